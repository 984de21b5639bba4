"""Record sources, the cropping/masking dataset, and the collator that builds the batch dict.

A *record source* is anything with ``__len__``, ``tokens(i)`` (uint8 residue ids, no specials),
``length(i)``, ``id(i)`` and a ``lengths`` array: a subset of the memory-mapped
:class:`~protein_performer.data.store.TokenStore` for real corpora (constant RAM, worker-safe),
or :class:`InMemorySource` read straight from FASTA for small sets. The dataset never cares which.

Every random choice an item makes (crop window, mask) comes from
``np.random.default_rng([seed, epoch, index])``, so an item is a pure function of those three
numbers: identical across runs, worker counts and resumes, and different every epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from protein_performer.data.masking import IGNORE_INDEX, causal_targets, mlm_mask
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

Objective = Literal["mlm", "clm"]
Crop = Literal["random", "fixed"]
SPLITS: tuple[str, ...] = ("train", "valid", "test")


@runtime_checkable
class RecordSource(Protocol):
    """Random access to tokenized records (residues only, no specials)."""

    def __len__(self) -> int: ...

    def tokens(self, i: int) -> np.ndarray: ...

    def length(self, i: int) -> int: ...

    def id(self, i: int) -> str: ...

    @property
    def lengths(self) -> np.ndarray: ...


def unigram_perplexity(
    train: RecordSource, valid: RecordSource, max_records: int = 5000, vocab: int = 33
) -> float | None:
    """Perplexity on ``valid``'s residues of the residue frequencies of ``train`` (add-one
    smoothed): the honest floor of a protein LM's curve (a model that ignores context scores
    this, not the 20 of a uniform guess; natural proteins are far from uniform). Up to
    ``max_records`` evenly spaced records of each split are read (None when either is empty)."""

    def counts(source: RecordSource) -> np.ndarray:
        n = len(source)
        picked = np.unique(np.linspace(0, n - 1, min(n, max_records)).astype(np.int64))
        tokens = [np.asarray(source.tokens(int(i)), dtype=np.int64) for i in picked]
        return np.bincount(np.concatenate(tokens), minlength=vocab) if tokens else np.zeros(vocab)

    if not len(train) or not len(valid):
        return None
    seen, held = counts(train), counts(valid)
    if not held.sum():
        return None
    letters = seen > 0
    p = (seen + letters) / (seen + letters).sum()  # smoothed over the letters training saw
    held = held.astype(np.float64)
    unseen = held[~letters].sum()
    logp = float((held[letters] * np.log(p[letters])).sum())
    if unseen:  # a letter training never saw: as rare as the rarest seen, not impossible
        logp += unseen * float(np.log(p[letters].min()))
    return float(np.exp(-logp / held.sum()))


class StoreSubset:
    """The records of a ``TokenStore`` listed in ``indices`` (e.g. ``store.indices("train")``).

    Holds only the store and an index array, so pickling it into DataLoader workers is cheap;
    the store's memory maps are what every worker reads.
    """

    def __init__(self, store: Any, indices: np.ndarray) -> None:
        self.store = store
        self.indices = np.asarray(indices, dtype=np.int64)
        # int32 like the store: 60M UniRef50 lengths stay at 240 MB.
        self._lengths = np.asarray(store.lengths[self.indices], dtype=np.int32)

    def __len__(self) -> int:
        return len(self.indices)

    def tokens(self, i: int) -> np.ndarray:
        return self.store.tokens(int(self.indices[i]))

    def length(self, i: int) -> int:
        return int(self._lengths[i])

    def id(self, i: int) -> str:
        return self.store.id(int(self.indices[i]))

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths


class InMemorySource:
    """Tokenized records held in RAM: for FASTA files small enough to read whole (demo, tests)."""

    def __init__(self, ids: Sequence[str], tokens: Sequence[np.ndarray]) -> None:
        if len(ids) != len(tokens):
            raise ValueError(f"{len(ids)} ids but {len(tokens)} token arrays")
        self._ids = list(ids)
        self._tokens = [np.asarray(t, dtype=np.uint8) for t in tokens]
        self._lengths = np.array([len(t) for t in self._tokens], dtype=np.int32)

    def __len__(self) -> int:
        return len(self._ids)

    def tokens(self, i: int) -> np.ndarray:
        return self._tokens[i]

    def length(self, i: int) -> int:
        return int(self._lengths[i])

    def id(self, i: int) -> str:
        return self._ids[i]

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths


class ConcatSource:
    """The records of ``source`` joined end to end, ``<eos>`` after each, cut into
    non-overlapping chunks of ``chunk`` tokens (the tail shorter than a chunk is dropped).

    This is the Performer paper's concatenated-TrEMBL setting: every row is full length, so
    the model sees many proteins per row and attention must span their boundaries. The chunks
    are read from one flat uint8 array (a byte per token: fine for corpora of this project's
    bench size, not for UniRef50, which would need the store's memmap instead).
    """

    def __init__(self, source: RecordSource, chunk: int, eos_idx: int) -> None:
        if chunk < 1:
            raise UserError(f"concatenated chunks need at least one token, got {chunk}")
        eos = np.array([eos_idx], dtype=np.uint8)
        parts = [p for i in range(len(source)) for p in (source.tokens(i), eos)]
        flat = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        n = len(flat) // chunk
        self._flat = flat[: n * chunk]
        self.chunk = int(chunk)
        self._lengths = np.full(n, chunk, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._lengths)

    def tokens(self, i: int) -> np.ndarray:
        return self._flat[i * self.chunk : (i + 1) * self.chunk]

    def length(self, i: int) -> int:
        return self.chunk

    def id(self, i: int) -> str:
        return f"chunk{i}"

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths


def fasta_splits(
    paths: str | Path | Sequence[str | Path],
    valid_frac: float,
    test_frac: float,
    *,
    on_invalid: str = "error",
    limit_records: int | None = None,
    split_by: str = "auto",
    alphabet: Alphabet | None = None,
) -> dict[str, InMemorySource]:
    """Read FASTA file(s) once and return ``{"train", "valid", "test"}`` in-memory sources.

    The split is the same hash-of-id (or UniRef cluster) rule ``preprocess`` uses, so a record
    lands in the same split whether it is read from FASTA or from a store.
    ``limit_records`` keeps the first N valid records of the input, before splitting.
    """
    from protein_performer.data.fasta import read_fasta
    from protein_performer.data.split import Splitter

    splitter = Splitter(valid_frac, test_frac, split_by)  # type: ignore[arg-type]
    alphabet = alphabet or Alphabet()
    if isinstance(paths, (str, Path)):
        paths = [paths]
    ids: dict[str, list[str]] = {s: [] for s in SPLITS}
    toks: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    records = read_fasta(list(paths), on_invalid=on_invalid, alphabet=alphabet)
    for n, rec in enumerate(records):
        if limit_records is not None and n >= limit_records:
            break
        try:
            encoded = alphabet.encode(rec.sequence)
        except ValueError as e:  # read_fasta validates; this only fires if the rules diverge
            raise UserError(
                f"{rec.path}: record {rec.number} ({rec.id!r}, line {rec.line}): {e}"
            ) from None
        split = SPLITS[splitter(rec)]
        ids[split].append(rec.id)
        toks[split].append(encoded)
    return {s: InMemorySource(ids[s], toks[s]) for s in SPLITS}


#: The widest row a dataset makes (row widths are int32 for batching).
MAX_ROW = 2**31 - 1


def check_max_len(max_len: int) -> None:
    """``max_len`` in 3..:data:`MAX_ROW` (1e12 was an OverflowError deep in batching)."""
    if not 3 <= max_len <= MAX_ROW:
        raise UserError(
            f"max_len must be in 3..{MAX_ROW} (<cls>, one residue, <eos>; row widths are "
            f"int32), got {max_len}"
        )


class ProteinDataset(torch.utils.data.Dataset):
    """Crops long records to ``max_len`` and applies the objective's inputs/targets.

    ``max_len`` counts ``<cls>`` and ``<eos>``, so a record longer than ``max_len - 2`` residues is
    cut to a window of ``max_len - 2`` residues:

    - ``crop="random"`` (training): a uniformly random window, a new one every epoch, so all of a
      long protein is seen over training;
    - ``crop="fixed"`` (evaluation): the first window (the N-terminus), what ESM's
      ``truncation_seq_length`` keeps, so validation loss is comparable between epochs and runs.

    The window keeps ``<cls>``/``<eos>`` at its ends even when cut mid-protein: the model always
    sees the same layout, as in ESM-2 training. For CLM the targets across an artificial end
    (``<cls>`` -> first residue of a window that starts mid-protein, last residue -> ``<eos>`` of
    a window that stops early) are -100, so the model does not learn false termini.

    Items are dicts ``{"id": str, "tokens": int64 (L,), "targets": int64 (L,)}``, L <= max_len.
    An index may be an ``int`` (uses the epoch from :meth:`set_epoch`) or an ``(index, epoch)``
    tuple: the batch sampler tags indices with the epoch because ``set_epoch`` on this object
    does not reach copies living in persistent DataLoader workers.
    """

    def __init__(
        self,
        source: RecordSource,
        objective: Objective = "mlm",
        max_len: int = 1024,
        crop: Crop = "random",
        mlm_prob: float = 0.15,
        seed: int = 0,
        alphabet: Alphabet | None = None,
    ) -> None:
        if objective not in ("mlm", "clm"):
            raise UserError(f"unknown objective {objective!r} (choose mlm or clm)")
        if crop not in ("random", "fixed"):
            raise UserError(f"unknown crop {crop!r} (choose random or fixed)")
        check_max_len(max_len)
        if seed < 0:
            raise UserError(f"seed must be >= 0, got {seed}")
        self.source = source
        self.objective = objective
        self.max_len = int(max_len)
        self.crop = crop
        self.mlm_prob = float(mlm_prob)
        self.seed = int(seed)
        self.alphabet = alphabet or Alphabet()
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.source)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def model_lengths(self) -> np.ndarray:
        """Row width of every item (residues + 2, capped at ``max_len``): what batching needs."""
        lengths = np.asarray(self.source.lengths, dtype=np.int32)
        return np.minimum(lengths + 2, self.max_len).astype(np.int32)

    def crop_start(self, length: int, rng: np.random.Generator) -> int:
        """First residue of the window kept from a record of ``length`` residues."""
        excess = length - (self.max_len - 2)
        if excess <= 0 or self.crop == "fixed":
            return 0
        return int(rng.integers(0, excess + 1))

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        if isinstance(key, tuple):
            index, epoch = int(key[0]), int(key[1])
        else:
            index, epoch = int(key), self.epoch
        rng = np.random.default_rng([self.seed, epoch, index])
        residues = self.source.tokens(index)
        start = self.crop_start(len(residues), rng)
        window = np.asarray(residues[start : start + self.max_len - 2], dtype=np.int64)
        a = self.alphabet
        tokens = np.concatenate(([a.cls_idx], window, [a.eos_idx]))  # (L,)
        if self.objective == "mlm":
            tokens, targets = mlm_mask(tokens, a, rng, mask_prob=self.mlm_prob)
        else:
            targets = causal_targets(tokens, a.pad_idx)
            # A window cut out of a longer protein has artificial ends: do not teach the model
            # that the protein starts after <cls> or stops before <eos> there.
            if start > 0:
                targets[0] = IGNORE_INDEX
            if start + len(window) < len(residues):
                targets[-2] = IGNORE_INDEX
        return {"id": self.source.id(index), "tokens": tokens, "targets": targets}


class ProteinCollator:
    """Pads dataset items into the batch dict of ``docs/INTERFACES.md``.

    ``tokens`` (B, T) int64 right-padded with ``<pad>``; ``targets`` (B, T) int64 padded with -100;
    ``padding_mask`` (B, T) bool, True = pad; ``ids`` list[str]; and ``coordinates`` (B, T)
    int64 padded with -1 when the items carry them (family rows with
    ``data.family_coordinates=aligned``). T is the longest item, so a length-sorted batch
    carries almost no padding.
    """

    def __init__(self, alphabet: Alphabet | None = None) -> None:
        self.alphabet = alphabet or Alphabet()

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        B = len(items)
        T = max((len(it["tokens"]) for it in items), default=0)
        tokens = np.full((B, T), self.alphabet.pad_idx, dtype=np.int64)
        targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        padding_mask = np.ones((B, T), dtype=bool)
        placed = any("coordinates" in it for it in items)
        coordinates = np.full((B, T), -1, dtype=np.int64)
        for row, it in enumerate(items):
            n = len(it["tokens"])
            tokens[row, :n] = it["tokens"]
            targets[row, :n] = it["targets"]
            padding_mask[row, :n] = False
            if placed:
                coordinates[row, :n] = it["coordinates"]
        batch = {
            "tokens": torch.from_numpy(tokens),
            "targets": torch.from_numpy(targets),
            "padding_mask": torch.from_numpy(padding_mask),
            "ids": [it["id"] for it in items],
        }
        if placed:
            batch["coordinates"] = torch.from_numpy(coordinates)
        return batch
