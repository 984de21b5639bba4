"""PoET-style context ensembles: several prompts built from one homolog file, scores averaged.

PoET (Truong & Bepler 2023) scores a variant as the mean over prompts that differ in how many
context tokens they read, the most identity to the query a homolog may have, and the order of
the homologs. Here every combination of

* ``max_identity`` (e.g. 1.0, 0.9, 0.7): homologs more identical to the query than the value
  are left out (1.0 keeps all);
* ``tokens`` (e.g. 6144, 12288): whole homologs, in the prompt's order, up to that many tokens
  (:func:`~protein_performer.inference.context.build_context`'s ``max_tokens``);
* orders: the file's order, or with ``orders=N`` N random orders drawn from ``seed``, each
  also reversed (2N orders)

is one prompt, read once (one :class:`FamilyContext` each). The prompts depend only on (the
file's bytes, the query, the options, the seed): the same inputs give the same prompts on any
machine, and :meth:`ContextEnsemble.record` says which ones (written beside the output).

Identity to the query is computed in-package, by Biopython's local aligner (BLOSUM62, gap open
11, extend 1): identical aligned pairs over the length of the shorter of the two sequences (as
CD-HIT counts it: a short chance match of an unrelated protein scores low, a fragment of the
query scores 1); no external tool, so the filter gives the same homologs wherever it runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from protein_performer.data.msa import Member
from protein_performer.errors import UserError
from protein_performer.inference.context import (
    FamilyContext,
    Homologs,
    build_context,
    homolog_members,
)
from protein_performer.interop.record import LoadedModel

ALIGNER = (
    "biopython local alignment, BLOSUM62, gap open 11 extend 1; identity = identical pairs / "
    "shorter length"
)


def identity_to(query: str, homologs: Sequence[str]) -> np.ndarray:
    """(n,) identical pairs of the best local alignment over the shorter sequence's length
    (module docstring); 0 where nothing aligns."""
    from Bio.Align import PairwiseAligner, substitution_matrices

    aligner = PairwiseAligner(
        mode="local",
        substitution_matrix=substitution_matrices.load("BLOSUM62"),
        open_gap_score=-11,
        extend_gap_score=-1,
    )
    out = np.zeros(len(homologs), dtype=np.float64)
    for i, seq in enumerate(homologs):
        if aligner.score(query, seq) <= 0:
            continue
        alignment = aligner.align(query, seq)[0]
        out[i] = alignment.counts().identities / min(len(query), len(seq))
    return out


@dataclass(frozen=True)
class Prompt:
    """One prompt of an ensemble: its options and the context it reads."""

    max_identity: float
    tokens: int | None
    order: str  # "file", "random 0", "random 0 reversed", ...
    context: FamilyContext

    @property
    def label(self) -> str:
        tokens = "default" if self.tokens is None else str(self.tokens)
        return f"id{self.max_identity:g}_tok{tokens}_{self.order.replace(' ', '_')}"

    def record(self) -> dict[str, Any]:
        members = "\n".join(self.context.members).encode()
        return {
            "label": self.label,
            "max_identity": self.max_identity,
            "tokens": self.tokens,
            "order": self.order,
            "members": len(self.context.members),
            "n_tokens": self.context.n_tokens,
            "members_sha256": hashlib.sha256(members).hexdigest(),
            "aligned": self.context.aligned,
        }


@dataclass(frozen=True)
class ContextEnsemble:
    """Prompts scored one by one and averaged: pass it as ``context=`` like one context."""

    prompts: tuple[Prompt, ...]
    source: str
    source_sha256: str
    query_sha256: str | None
    seed: int
    identities: tuple[float, ...]  # of the homologs in file order (empty without a query)

    @property
    def cores(self) -> tuple[str, ...]:
        return self.prompts[0].context.cores

    def record(self) -> dict[str, Any]:
        """What built the ensemble, for the output's attributes (same inputs, same record)."""
        return {
            "source": self.source,
            "source_sha256": self.source_sha256,
            "query_sha256": self.query_sha256,
            "seed": self.seed,
            "aligner": ALIGNER if self.query_sha256 else None,
            "prompts": [p.record() for p in self.prompts],
        }

    def __repr__(self) -> str:
        return f"ContextEnsemble(prompts={len(self.prompts)}, source={self.source!r})"


def context_record(context: FamilyContext | ContextEnsemble) -> dict[str, Any]:
    """What a context was built from, for an output's attributes: an ensemble's
    :meth:`~ContextEnsemble.record`, or one context's members and tokens."""
    if isinstance(context, ContextEnsemble):
        return context.record()
    members = "\n".join(context.members).encode()
    return {
        "members": len(context.members),
        "n_tokens": context.n_tokens,
        "members_sha256": hashlib.sha256(members).hexdigest(),
        "aligned": context.aligned,
    }


def _digest(records: Sequence[Member]) -> str:
    h = hashlib.sha256()
    for m in records:
        h.update(f">{m.id}\n{m.sequence}\n".encode())
    return h.hexdigest()


#: The most prompts an ensemble holds (``--context-orders 1e8`` drew 4.4 GB of orders before
#: anything said so; PoET's ensembles have tens).
MAX_PROMPTS = 1024


def _orders(n: int, orders: int, seed: int) -> list[tuple[str, list[int]]]:
    if orders == 0:
        return [("file", list(range(n)))]
    rng = np.random.default_rng(np.random.SeedSequence([seed, n]))
    out = []
    for k in range(orders):
        perm = rng.permutation(n).tolist()
        out += [(f"random {k}", perm), (f"random {k} reversed", perm[::-1])]
    return out


def _check(values: Sequence[Any], what: str, ok: Any) -> tuple[Any, ...]:  # noqa: ANN401
    values = tuple(values)
    if not values or not all(ok(v) for v in values):
        raise UserError(f"{what}: got {list(values)!r}")
    return values


def build_ensemble(
    loaded: LoadedModel,
    homologs: Homologs,
    *,
    query: str | None = None,
    max_identity: Sequence[float] = (1.0,),
    tokens: Sequence[int | None] = (None,),
    orders: int = 0,
    seed: int = 0,
) -> ContextEnsemble:
    """Every (max_identity x tokens x order) prompt of ``homologs`` (module docstring), each
    read into its own :class:`FamilyContext` by :func:`build_context`."""
    max_identity = _check(
        max_identity, "max_identity takes fractions in (0, 1]",
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1,
    )  # fmt: skip
    tokens = _check(
        tokens, "tokens takes positive whole numbers (or None: the default limit)",
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
    )  # fmt: skip
    if isinstance(orders, bool) or not isinstance(orders, int) or orders < 0:
        raise UserError(
            f"orders must be a whole number >= 0 (0: the file's order), got {orders!r}"
        )
    count = len(max_identity) * len(tokens) * (2 * orders if orders else 1)
    if count > MAX_PROMPTS:
        raise UserError(
            f"an ensemble of {count} prompts ({len(max_identity)} max_identity x {len(tokens)} "
            f"tokens x {2 * orders if orders else 1} orders) is more than {MAX_PROMPTS}: each "
            "prompt holds its own context and costs one pass per sequence scored"
        )
    reference, records = homolog_members(homologs)
    if not records:
        raise UserError("the family context has no homologs; give at least one sequence")
    filtering = any(t < 1 for t in max_identity)
    if filtering and query is None:
        raise UserError("max_identity below 1 needs the query (the wild type) to compare with")
    ident = identity_to(query.upper(), [m.sequence for m in records]) if filtering else np.zeros(0)
    prompts = []
    for limit, budget in product(max_identity, tokens):
        kept = [r for i, r in enumerate(records) if limit >= 1 or ident[i] <= limit]
        if not kept:
            raise UserError(
                f"max_identity {limit:g}: every one of the {len(records)} homolog(s) is more "
                f"identical to the query (least: {ident.min():.3f}); raise the value"
            )
        for name, order in _orders(len(kept), orders, seed):
            ctx = build_context(
                loaded, [kept[i] for i in order], budget, warn=False, reference=reference
            )
            prompts.append(Prompt(limit, budget, name, ctx))
    is_path = isinstance(homologs, str) or hasattr(homologs, "__fspath__")
    source = str(homologs) if is_path else "<sequences>"
    return ContextEnsemble(
        tuple(prompts),
        source,
        _digest(records),
        None if query is None else hashlib.sha256(query.upper().encode()).hexdigest(),
        seed,
        tuple(ident.tolist()),
    )
