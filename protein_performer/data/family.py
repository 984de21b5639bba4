"""Family rows (``data.layout=family``): each training row is one family's members, PoET-style.

A row is ``<cls> A... <eos> <cls> B... <eos> ...``: the members of one family
(:class:`~protein_performer.data.homology.Families`) in a random order, each cropped to
``max_len`` like a single-sequence item, added while they fit a row budget of ``row_tokens``.
A family larger than a row is thus sampled (a new random subset every epoch); a small family
makes a short row: small families are not packed together, since a row then mixes unrelated
proteins and the context stops being a family (what the layout exists to teach).

Items keep :class:`~protein_performer.data.dataset.ProteinDataset`'s contract (``tokens``,
``targets``, ``id``), so the collator, the token-budget sampler and the Lightning module are
unchanged; every random choice comes from ``np.random.default_rng([seed, epoch, index])``.
``<cls>`` marks each member's start, which is all the model needs to place positions.

``coordinates="aligned"``: each item also carries ``coordinates`` (L,) int64, the keys a
position memory files each token under (``PerformerLM.forward(coordinates=...)``, the path a
family context's aligned homologs take): a member that has an alignment to its family's first
member (a family search's, :meth:`~protein_performer.data.homology.Families.coordinates`) sits
at that member's residue numbers (``data.msa.row_keys``), one without (cluster families) at its
own member positions. ``"positions"`` (the default): no coordinates, member positions for all.

``memory_dropout`` p (``data.family_memory_dropout``, training rows only): each member after
the first is, with probability p, hidden from a position memory (its coordinates are -1, so it
neither reads the memory nor is filed in it; the attention core still reads the whole row).
Why: a member with homologs before it is predicted mostly by the memory's read, so without
this the shared weights learn to predict alone (k = 0, where the memory has nothing to read)
only on each row's first member, and a memory model is worse alone than FAVOR+ trained on the
same rows (docs/RESULTS.md). Rows then carry coordinates (member positions, or the aligned
keys) whether or not a member was hidden, so a batch is keyed alike; a model without a memory
ignores them. The members, crops and masks do not depend on p (the draw has its own stream).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protein_performer.data.dataset import Crop, Objective, ProteinDataset, RecordSource
from protein_performer.data.homology import Families
from protein_performer.data.masking import IGNORE_INDEX, causal_targets, mlm_mask
from protein_performer.data.msa import FAMILY_COORDINATES, UNPLACED, row_keys
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

#: Default row budget: the Performer paper's concatenated rows, and PoET's context scale.
DEFAULT_ROW_TOKENS = 8192
#: Default ``memory_dropout`` of training rows (``data.family_memory_dropout``), measured on
#: planted families: alone nearer FAVOR+, recall kept (docs/RESULTS.md).
DEFAULT_MEMORY_DROPOUT = 0.1


class FamilyDataset(ProteinDataset):
    """One item per family of ``families`` (indices into ``source``), built as described in
    the module docstring.

    Members are taken in a random order and skipped when they would overflow the row, so a
    row fills up to ``row_tokens`` (only the tail of a full row favours short members).
    Each member is cropped to ``min(max_len, row_tokens)`` tokens with ``crop`` (random
    window in training, the N-terminus in evaluation). CLM targets run across the whole row
    (the first residue of a member is predicted from the members before it), except where a
    target says nothing: ``<eos>`` -> next ``<cls>`` (always the same) and the artificial ends
    of a cropped member. MLM masks residues anywhere in the row, never the specials.
    """

    def __init__(
        self,
        source: RecordSource,
        families: Families,
        objective: Objective = "clm",
        max_len: int = 1024,
        row_tokens: int = DEFAULT_ROW_TOKENS,
        crop: Crop = "random",
        mlm_prob: float = 0.15,
        seed: int = 0,
        alphabet: Alphabet | None = None,
        coordinates: str = "positions",
        memory_dropout: float = 0.0,
    ) -> None:
        if not 0.0 <= memory_dropout <= 1.0:
            raise UserError(
                f"data.family_memory_dropout must be a probability in [0, 1], got "
                f"{memory_dropout}"
            )
        if coordinates not in FAMILY_COORDINATES:
            raise UserError(
                f"data.family_coordinates must be {' or '.join(FAMILY_COORDINATES)}, got "
                f"{coordinates!r}"
            )
        if row_tokens < 3:
            raise UserError(
                f"data.family_max_tokens must be >= 3 (<cls>, one residue, <eos>), got "
                f"{row_tokens}"
            )
        super().__init__(
            source, objective, min(max_len, row_tokens), crop, mlm_prob, seed, alphabet
        )
        n = len(source)
        if len(families.members) and (families.members.min() < 0 or families.members.max() >= n):
            raise UserError(
                f"the families index records outside the {n} of this split: rebuild them "
                "(delete the store's families/ directory)"
            )
        self.families = families
        self.row_tokens = int(row_tokens)
        self.aligned = coordinates == "aligned"
        self.memory_dropout = float(memory_dropout)

    def __len__(self) -> int:
        return len(self.families)

    def model_lengths(self) -> np.ndarray:
        """Upper bound of each row's width (all members, each cropped, capped at the budget):
        the sampler packs batches with it; a sampled row is never longer."""
        member = np.minimum(np.asarray(self.source.lengths, dtype=np.int64) + 2, self.max_len)
        total = np.add.reduceat(member[self.families.members], self.families.offsets[:-1])
        return np.minimum(total, self.row_tokens).astype(np.int32)

    def row(self, index: int, epoch: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The row's tokens (L,) int64 before masking, its CLM targets (L,), and the source
        indices of its members in row order; the rng then goes on to mask (MLM)."""
        tokens, targets, taken, _ = self._row(index, epoch)
        return tokens, targets, taken

    def _row(
        self, index: int, epoch: int
    ) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray | None]:
        """:meth:`row`, and the row's coordinates (L,) when ``coordinates="aligned"`` or a
        member may be hidden from the memory (``memory_dropout``), else None."""
        rng = np.random.default_rng([self.seed, epoch, index])
        members = self.families[index]
        permuted = rng.permutation(len(members))
        order = members[permuted]
        at = self.families.offsets[index] + permuted  # where each one's alignment is
        a = self.alphabet
        parts: list[np.ndarray] = []
        keys: list[np.ndarray] = []
        ignore: list[int] = []  # row positions whose CLM target is meaningless
        taken: list[int] = []
        used = 0
        for m, where in zip(order.tolist(), at.tolist(), strict=True):
            width = min(self.source.length(m), self.max_len - 2) + 2
            if used + width > self.row_tokens:
                continue
            residues = self.source.tokens(m)
            start = self.crop_start(len(residues), rng)
            window = np.asarray(residues[start : start + width - 2], dtype=np.int64)
            if start > 0:
                ignore.append(used)  # <cls> -> a residue mid-protein
            if start + len(window) < len(residues):
                ignore.append(used + width - 2)  # last residue -> an early <eos>
            ignore.append(used + width - 1)  # <eos> -> the next <cls>
            parts.append(np.concatenate(([a.cls_idx], window, [a.eos_idx])))
            placed = None
            if self.aligned:
                placed = self.families.coordinates(where, len(residues))
                if placed is not None:
                    placed = placed[start : start + len(window)]
            keys.append(row_keys(placed, len(window)))
            taken.append(m)
            used += width
            if self.row_tokens - used < 3:
                break
        tokens = np.concatenate(parts)  # (L,)
        targets = causal_targets(tokens, a.pad_idx)
        targets[ignore] = IGNORE_INDEX
        if not (self.aligned or self.memory_dropout):
            return tokens, targets, taken, None
        if self.memory_dropout:
            hidden = self.hidden_members(index, epoch, len(keys))
            keys = [np.full_like(k, UNPLACED) if h else k
                    for k, h in zip(keys, hidden, strict=True)]  # fmt: skip
        return tokens, targets, taken, np.concatenate(keys)

    def hidden_members(self, index: int, epoch: int, members: int) -> np.ndarray:
        """(members,) bool: which members of row ``index`` in ``epoch`` are hidden from a
        position memory, each after the first with probability ``memory_dropout``; its own
        stream of (seed, epoch, index), so the row's members do not depend on it."""
        rng = np.random.default_rng([self.seed, epoch, index, 2])
        hidden = rng.random(members) < self.memory_dropout
        hidden[:1] = False  # the first reads nothing anyway: hiding it only drops context
        return hidden

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        if isinstance(key, tuple):
            index, epoch = int(key[0]), int(key[1])
        else:
            index, epoch = int(key), self.epoch
        tokens, targets, _, coordinates = self._row(index, epoch)
        if self.objective == "mlm":
            # Its own stream, so the row's members do not depend on the objective.
            rng = np.random.default_rng([self.seed, epoch, index, 1])
            tokens, targets = mlm_mask(tokens, self.alphabet, rng, mask_prob=self.mlm_prob)
        key_id = self.source.id(int(self.families.keys[index]))
        item = {"id": f"family:{key_id}", "tokens": tokens, "targets": targets}
        if coordinates is not None:
            item["coordinates"] = coordinates
        return item
