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

Homologs may come with *coordinates* (an MSA, or the FASTA of ``homologs`` with its aligned
ranges: :func:`~protein_performer.data.inputs.read_homologs`): per residue, the member position
of the reference residue it aligns to. The prefill then hands them to the model
(``PerformerLM.forward(coordinates=...)``), where a core that keys a memory by position (the
position memory) keys the homolog residues by coordinate instead of by their own member
positions; rotary positions stay the member positions. A candidate is never given coordinates:
it is read at its member positions, which are the reference's coordinates when it is a variant
of the reference (the wild type: the MSA's first row, ``homologs``' query), so a scored
sequence is never placed by its own alignment.

A masked (MLM) model has no context: its bidirectional attention has no left-to-right state to
continue, and conditioning it would need the context re-encoded with every candidate. Asking
for one is a :class:`~protein_performer.errors.UserError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protein_performer.data.msa import Member, row_keys
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.model.attention import AttentionState, state_tensors
from protein_performer.model.cores import model_cores

log = logging.getLogger(__name__)

#: Tokens per prefill segment when reading a context: bounds the transient activations
#: (FAVOR+: O(segment) whatever the context's length); segments start at a member's <cls>.
PREFILL_SEGMENT = 4096

Homologs = (
    str | os.PathLike[str] | Iterable[str] | Iterable[tuple[str, str]] | Iterable[Member]
)


@dataclass(frozen=True)
class FamilyContext:
    """A family read once, to score or generate after: immutable, reusable.

    states: per layer, batch 1 (the core's state: FAVOR+ ``FavorState``, exact ``KVCache``, ...),
    never written;
    n_tokens: tokens in the context row; offset: the row position of a candidate's first token
    (``n_tokens`` with "sequence" positions, 0 with "member" positions, as training used);
    members / dropped: ids of the homologs read / left out by ``max_tokens``; grows: whether a
    layer's state grows with the context (an exact or hybrid stack's KV cache: asked of the
    cores); cores: per layer, the cores its state passes through (:func:`core_kinds`);
    coordinates: per member read, its residues' reference coordinates (None: placed by its
    member positions), empty when no homolog came aligned; reference: the MSA's first row at
    its coordinates (what a candidate must match to be read there), None when unknown.
    """

    states: tuple[AttentionState, ...]
    n_tokens: int
    offset: int
    members: tuple[str, ...]
    dropped: tuple[str, ...]
    attention: str
    grows: bool = False
    cores: tuple[str, ...] = ()
    coordinates: tuple[np.ndarray | None, ...] = ()
    reference: Member | None = None

    @property
    def aligned(self) -> bool:
        """Whether the states were keyed by coordinates (some member came aligned)."""
        return any(c is not None for c in self.coordinates)

    @property
    def nbytes(self) -> int:
        """Bytes held by the states (FAVOR+: the same for 1k and 64k context tokens)."""
        return sum(t.numel() * t.element_size() for t in state_tensors(self.states))

    @property
    def attended_tokens(self) -> int:
        """Context tokens each candidate token reads: 0 when every layer's state is fixed-size
        (FAVOR+), the whole cache when some layer's grows (exact attention, a hybrid stack's
        exact layers); what a batch's token budget must count."""
        return self.n_tokens if self.grows else 0

    def __repr__(self) -> str:
        return (
            f"FamilyContext(members={len(self.members)}, dropped={len(self.dropped)}, "
            f"n_tokens={self.n_tokens}, attention={self.attention!r}, aligned={self.aligned}, "
            f"nbytes={self.nbytes})"
        )


def homolog_members(homologs: Homologs) -> tuple[Member | None, list[Member]]:
    """The reference (an MSA's first row; else None) and the homologs as
    :class:`~protein_performer.data.msa.Member` (id, SEQUENCE, coordinates): from a file (FASTA
    or MSA: :func:`~protein_performer.data.inputs.read_homologs`; a ``str`` or PathLike is
    always a path, ``-`` standard input, a missing file an error), or an iterable of strings /
    (id, sequence) pairs / FASTA records / members; a bad one names its index. A sequence is
    never guessed from a string: a typo in a file name would otherwise become a 1-member
    family."""
    from protein_performer.data.inputs import as_records, read_homologs

    if isinstance(homologs, str | os.PathLike):
        return read_homologs(homologs)
    items = list(homologs)  # type: ignore[arg-type]
    if items and all(isinstance(m, Member) for m in items):
        for i, m in enumerate(items):  # coordinates come one per residue, or not at all
            if m.coordinates is not None and np.shape(m.coordinates) != (len(m.sequence),):
                raise UserError(
                    f"homolog {i} ({m.id}): {np.shape(m.coordinates)} coordinates for "
                    f"{len(m.sequence)} residues; give one per residue (or None)"
                )
        return None, items
    return None, [Member(rid, seq) for rid, seq in as_records(items)]


def trained_on_family_rows(loaded: LoadedModel) -> bool:
    """Whether the checkpoint says its model learnt from family rows: ``train
    data.layout=family`` stores the row length as ``config.context_tokens`` (since 0.2; an
    explicit ``model.config.context_tokens`` counts too). A model without it (the single-row
    demos, converted ESM-2, checkpoints older than the record) is not known to use a context."""
    return loaded.config.context_tokens is not None


def untrained_context_warning(loaded: LoadedModel) -> str | None:
    """The one warning for a context given to a model with no family-row training on record,
    None when the checkpoint records it."""
    if trained_on_family_rows(loaded):
        return None
    return (
        f"{loaded.source.name} records no training on family rows (its config has no "
        "context_tokens, which `train ... data.layout=family` stores): a family context given "
        "to it may change scores and samples little or not at all. Train on family rows "
        "(README: Family rows and homolog retrieval) for a model that uses its homologs"
    )


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
    reference: Member | None = None,
) -> FamilyContext:
    """Read ``homologs`` in order as one row ``<cls> m1 <eos> <cls> m2 <eos> ...`` into a
    :class:`FamilyContext`; members that would take the row past ``max_tokens`` are left out
    (logged; a linear model's cost does not grow with the context, so a larger limit is
    allowed). None: the config's ``context_tokens`` if known, else no limit. ``warn=False``
    for callers that cut on purpose (an ensemble's token budgets). ``reference``: the MSA's
    first row when ``homologs`` are members cut from one (a file names its own)."""
    config = loaded.config
    config.require_causal(
        "a family context", loaded.source,
        ", whose left-to-right attention state the candidates continue; score without a "
        "context, or train a causal model on family rows",
    )  # fmt: skip
    found, records = homolog_members(homologs)
    reference = reference or found
    if not records:
        raise UserError("the family context has no homologs; give at least one sequence")
    if max_tokens is None:
        max_tokens = default_max_tokens(loaded)
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    a = loaded.alphabet
    members: list[Member] = []
    total = 0
    for m in records:
        width = len(m.sequence) + 2  # <cls> ... <eos>
        if max_tokens is not None and total + width > max_tokens:
            break
        members.append(m)
        total += width
    if not members:
        raise UserError(
            f"max_tokens={max_tokens} is smaller than the first homolog ({records[0].id}: "
            f"{len(records[0].sequence) + 2} tokens with <cls> and <eos>); raise the limit"
        )
    dropped = tuple(m.id for m in records[len(members) :])
    if dropped and warn:
        log.warning("family context: %s", limit_note(loaded, len(members), len(records), total,
                                                    max_tokens, "max_tokens=N"))
    if max_tokens is None and warn:  # nothing bounds the read: say what it costs first
        log.info(
            "family context: reading %d homolog(s), %s tokens (the model records no trained "
            "row length; give max_tokens or --context-tokens to read fewer)",
            len(members),
            f"{total:,}",
        )
    from protein_performer.io.progress import progress

    aligned = any(m.coordinates is not None for m in members)
    memory = any(c.reads_coordinates for core in model_cores(loaded.model) for c in core.cores())
    if memory and warn and config.family_coordinates == "aligned" and not aligned:
        log.warning(
            "family context: no homolog carries coordinates, but this model's memory was "
            "trained on aligned family rows: it reads homologs at their member positions worse "
            "than no context (docs/RESULTS.md, issue 41); give an MSA whose first row is the "
            "scored sequence, or `protein-performer homologs` hits of it"
        )
    states = None
    row = 0
    parts = list(_segments([len(m.sequence) + 2 for m in members], segment))
    with progress(total, "tok", "context", enabled=len(parts) > 1) as bar:
        for part in parts:
            ids = [t for i in part for t in (a.cls_idx, *a.encode(members[i].sequence), a.eos_idx)]
            tokens = torch.tensor([ids], dtype=torch.long, device=loaded.device)  # (1, S)
            coords = None
            if aligned:  # (1, S): each member's <cls> ... <eos> on the reference's positions
                rows = [member_coordinates(members[i]) for i in part]
                coords = torch.from_numpy(np.concatenate(rows))[None].to(loaded.device)
            _, states = loaded.model.extend(
                tokens, states, offset=row, return_states=True, coordinates=coords
            )
            row += len(ids)
            bar.update(len(ids))
    offset = total if config.positions == "sequence" else 0
    return FamilyContext(
        states=tuple(states),  # type: ignore[arg-type]
        n_tokens=total,
        offset=offset,
        members=tuple(m.id for m in members),
        dropped=dropped,
        attention=config.attention,
        grows=any(core.state_grows for core in model_cores(loaded.model)),
        cores=core_kinds(loaded.model),
        coordinates=tuple(m.coordinates for m in members) if aligned else (),
        reference=reference if aligned else None,
    )


def core_kinds(model: torch.nn.Module) -> tuple[str, ...]:
    """Per layer, the registered names of its cores, outermost first (``memory+favor``): a
    context's states fit only a model whose layers hold the same."""
    return tuple("+".join(c.name for c in core.cores()) for core in model_cores(model))


def limit_note(
    loaded: LoadedModel, kept: int, given: int, tokens: int, limit: int | None, flag: str
) -> str:
    """``read K of N homologs (T tokens)``, and when some were left out, why (which limit) and
    how to read more (``flag``: the option that raises it where the reader is)."""
    said = f"read {kept} of {given} homolog(s) ({tokens:,} tokens)"
    if kept == given or limit is None:
        return said
    whose = (
        "the row length this model was trained on"
        if limit == loaded.config.context_tokens
        else "the token limit given"
    )
    return (
        f"{said}: the other {given - kept} would pass {limit:,} tokens, {whose}; {flag} reads "
        "more (a FAVOR+ model's cost per candidate does not grow with it)"
    )


def check_reference(context: FamilyContext, wild_type: str) -> None:
    """One warning when an aligned context's reference is not ``wild_type`` at its coordinates:
    the variants are then read at residues their homologs were not aligned to."""
    ref = context.reference
    if ref is None or ref.coordinates is None:
        return
    start = int(ref.coordinates[0]) - 1  # coordinates are member positions: residue i at i + 1
    if wild_type[start : start + len(ref.sequence)] != ref.sequence:
        log.warning(
            "the context's reference %r (its first row, residues %d-%d) is not the wild type "
            "there: its homologs are placed on the reference's residues, so the variants are "
            "read at the wrong ones; give an MSA whose first row is the wild type",
            ref.id, start + 1, start + len(ref.sequence),
        )  # fmt: skip


def member_coordinates(member: Member) -> np.ndarray:
    """(L + 2,) int64 keys of a member's ``<cls> residues <eos>``
    (:func:`~protein_performer.data.msa.row_keys`: its member positions when it came
    unaligned, the fallback)."""
    return row_keys(member.coordinates, len(member.sequence))


def _segments(widths: Sequence[int], segment: int) -> Iterable[list[int]]:
    """Indices of whole members (``widths`` tokens each) packed into prefill segments of about
    ``segment`` tokens: a segment starts at a ``<cls>``, so member positions need nothing from
    the segment before."""
    part: list[int] = []
    used = 0
    for i, width in enumerate(widths):
        if part and used + width > segment:
            yield part
            part, used = [], 0
        part.append(i)
        used += width
    if part:
        yield part
