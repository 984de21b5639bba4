"""Family (homolog) context: read a protein's homologs once, score and generate after them.

PoET (Truong & Bepler 2023) and ProtMamba (Sgarbossa et al. 2024) condition a protein LM on a
family by concatenating its members, ``<cls> m1 <eos> <cls> m2 <eos> ...``, before the sequence
of interest. A causal model reads that row once (one prefill) into per-layer attention states;
every candidate is then the next member of the row, run from those states by
:meth:`~protein_performer.model.performer.PerformerLM.extend`. With FAVOR+ the state is a
fixed-size summary (layers x heads x M x (d + 1) numbers, whatever the context's length), so a
candidate costs its own tokens alone; the exact twin keeps its KV cache, which grows with the
context and is read by every candidate.

The states are never written: one :class:`FamilyContext` serves any number of candidates, its
batch-1 states broadcast over each batch (no copy per candidate).

A masked (MLM) model has no context: its bidirectional attention has no left-to-right state to
continue, and conditioning it would need the context re-encoded with every candidate. Asking
for one is a :class:`~protein_performer.errors.UserError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.model.attention import AttentionState, state_tensors

log = logging.getLogger(__name__)

#: Tokens per prefill segment when reading a context: bounds the transient activations
#: (FAVOR+: O(segment) whatever the context's length); segments start at a member's <cls>.
PREFILL_SEGMENT = 4096

Homologs = str | os.PathLike[str] | Iterable[str] | Iterable[tuple[str, str]]


@dataclass(frozen=True)
class FamilyContext:
    """A family read once, to score or generate after: immutable, reusable.

    states: per layer, batch 1 (the core's state: FAVOR+ ``FavorState``, exact ``KVCache``, ...),
    never written;
    n_tokens: tokens in the context row; offset: the row position of a candidate's first token
    (``n_tokens`` with "sequence" positions, 0 with "member" positions, as training used);
    members / dropped: ids of the homologs read / left out by ``max_tokens``.
    """

    states: tuple[AttentionState, ...]
    n_tokens: int
    offset: int
    members: tuple[str, ...]
    dropped: tuple[str, ...]
    attention: str

    @property
    def nbytes(self) -> int:
        """Bytes held by the states (FAVOR+: the same for 1k and 64k context tokens)."""
        return sum(t.numel() * t.element_size() for t in state_tensors(self.states))

    @property
    def attended_tokens(self) -> int:
        """Context tokens each candidate token reads: 0 for FAVOR+ (a fixed-size state), the
        whole cache for exact attention; what a batch's token budget must count."""
        return self.n_tokens if self.attention == "exact" else 0

    def __repr__(self) -> str:
        return (
            f"FamilyContext(members={len(self.members)}, dropped={len(self.dropped)}, "
            f"n_tokens={self.n_tokens}, attention={self.attention!r}, nbytes={self.nbytes})"
        )


def homolog_records(homologs: Homologs) -> list[tuple[str, str]]:
    """Homologs as (id, SEQUENCE): a FASTA path (a ``str`` or PathLike is always a path; ``-``
    reads standard input; a missing file is an error), or an iterable of strings / (id,
    sequence) pairs / FASTA records; a bad one names its index. A sequence is never guessed
    from a string: a typo in a file name would otherwise become a 1-member family."""
    from protein_performer.data.inputs import as_records, read_records

    if isinstance(homologs, str | os.PathLike):
        return [(r.id, r.sequence.upper()) for r in read_records(homologs)]
    return list(as_records(homologs))  # type: ignore[arg-type]


def default_max_tokens(loaded: LoadedModel) -> int | None:
    """The trained row length when the config records it (``context_tokens``), else None."""
    return loaded.config.context_tokens


@torch.inference_mode()
def build_context(
    loaded: LoadedModel,
    homologs: Homologs,
    max_tokens: int | None = None,
    segment: int = PREFILL_SEGMENT,
    warn: bool = True,
) -> FamilyContext:
    """Read ``homologs`` in order as one row ``<cls> m1 <eos> <cls> m2 <eos> ...`` into a
    :class:`FamilyContext`; members that would take the row past ``max_tokens`` are left out
    (logged; a linear model's cost does not grow with the context, so a larger limit is
    allowed). None: the config's ``context_tokens`` if known, else no limit. ``warn=False``
    for callers that cut on purpose (an ensemble's token budgets)."""
    config = loaded.config
    if not config.causal:
        raise UserError(
            f"{loaded.source} is a masked LM (objective mlm): a family context needs a causal "
            "model (objective clm), whose left-to-right attention state the candidates continue; "
            "score without a context, or train a causal model on family rows"
        )
    records = homolog_records(homologs)
    if not records:
        raise UserError("the family context has no homologs; give at least one sequence")
    if max_tokens is None:
        max_tokens = default_max_tokens(loaded)
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    a = loaded.alphabet
    members: list[tuple[str, list[int]]] = []
    total = 0
    for rid, seq in records:
        ids = [a.cls_idx, *a.encode(seq).tolist(), a.eos_idx]
        if max_tokens is not None and total + len(ids) > max_tokens:
            break
        members.append((rid, ids))
        total += len(ids)
    if not members:
        raise UserError(
            f"max_tokens={max_tokens} is smaller than the first homolog ({records[0][0]}: "
            f"{len(records[0][1]) + 2} tokens with <cls> and <eos>); raise the limit"
        )
    dropped = tuple(rid for rid, _ in records[len(members) :])
    if dropped and warn:
        log.warning(
            "family context: %d of %d homolog(s) left out to stay within max_tokens=%d "
            "(kept %d tokens); raise max_tokens to read more",
            len(dropped),
            len(records),
            max_tokens,
            total,
        )
    if max_tokens is None:  # nothing bounds the read: say what it costs before paying it
        log.info(
            "family context: reading %d homolog(s), %s tokens (the model records no trained "
            "row length; give max_tokens or --context-tokens to read fewer)",
            len(members),
            f"{total:,}",
        )
    from protein_performer.io.progress import progress

    states = None
    row = 0
    parts = list(_segments([ids for _, ids in members], segment))
    with progress(total, "tok", "context", enabled=len(parts) > 1) as bar:
        for part in parts:
            tokens = torch.tensor([part], dtype=torch.long, device=loaded.device)  # (1, S)
            _, states = loaded.model.extend(tokens, states, offset=row, return_states=True)
            row += len(part)
            bar.update(len(part))
    offset = total if config.positions == "sequence" else 0
    return FamilyContext(
        states=tuple(states),  # type: ignore[arg-type]
        n_tokens=total,
        offset=offset,
        members=tuple(rid for rid, _ in members),
        dropped=dropped,
        attention=config.attention,
    )


def _segments(members: Sequence[list[int]], segment: int) -> Iterable[list[int]]:
    """Whole members packed into prefill segments of about ``segment`` tokens: a segment
    starts at a ``<cls>``, so member positions need nothing from the segment before."""
    part: list[int] = []
    for ids in members:
        if part and len(part) + len(ids) > segment:
            yield part
            part = []
        part.extend(ids)
    if part:
        yield part
