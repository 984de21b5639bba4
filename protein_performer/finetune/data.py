"""Labelled proteins for fine-tuning: a CSV/TSV (or FASTA + labels table), splits, batches.

Input: a table with a ``sequence`` column (or ``id`` and a FASTA file with those ids), one or
more label columns and an optional ``split`` column (``train``/``valid``/``test``; ``val`` and
``validation`` mean ``valid``). Labels by task:

* regression: numbers, one column per target. An empty, ``nan`` or ``NA`` label is *skipped and
  counted* (the row leaves the set, logged once with the first row numbers) unless
  ``on_nan="error"``; with several targets a row is kept while one target is observed (the
  loss ignores the missing ones).
* classification: one column of class names (or 0/1); classes are the sorted distinct values
  unless listed. An empty label is skipped and counted like a NaN.
* residue_classification: one column holding a string of the sequence's length
  (``HHHEEECCC``: one class per letter) or a list (``[0, 1, 1]``, or separated by commas or
  spaces); a length that differs from the sequence's is an error naming the row.

Every problem is one ``UserError`` naming the file, the row (1-based, the header is row 1) and
what to do. Splits without a column: seeded random, or ``cluster`` (MMseqs2 clusters at
``identity``; whole clusters go to one split, so near-identical variants never straddle
train and test).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError, shown
from protein_performer.io.tables import delimiter
from protein_performer.model.task_heads import IGNORE_INDEX, TASKS

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
_SPLIT_ALIASES = {"train": "train", "valid": "valid", "val": "valid", "validation": "valid",
                  "test": "test"}  # fmt: skip
SPLIT_BY = ("column", "random", "cluster")
_NAN = {"", "nan", "na", "n/a", "none", "null"}
_SHOW = 5


@dataclass
class LabelledSet:
    """Sequences with their labels and split, in file order (rows kept after NaN skipping)."""

    ids: list[str]
    sequences: list[str]
    #: regression: (N, T) float32 with NaN for a missing target; classification: (N,) int64;
    #: residue_classification: a list of (L_i,) int64 arrays.
    labels: Any
    task: str
    label_names: list[str]  # target columns (regression) or class names (classification)
    rows: list[int]  # 1-based file row of each record
    splits: list[str] | None = None  # from the split column, when there is one
    skipped: int = 0
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sequences)

    def subset(self, idx: Sequence[int]) -> LabelledSet:
        idx = list(idx)
        labels = (
            [self.labels[i] for i in idx] if isinstance(self.labels, list) else self.labels[idx]
        )
        return LabelledSet(
            [self.ids[i] for i in idx], [self.sequences[i] for i in idx], labels, self.task,
            self.label_names, [self.rows[i] for i in idx],
            None if self.splits is None else [self.splits[i] for i in idx], 0, self.source,
        )  # fmt: skip


def _is_nan(text: str) -> bool:
    return text.strip().lower() in _NAN


def _residue_labels(text: str, length: int, where: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{where}: residue labels {text[:30]!r}... are not a valid list "
                f"({exc.msg}); write [0, 1, ...] or a string like HHHEEC"
            ) from None
        values = [str(x) for x in items]
    elif "," in text or " " in text:
        values = [x for x in text.replace(",", " ").split() if x]
    else:
        values = list(text)
    if len(values) != length:
        raise UserError(
            f"{where}: {len(values)} residue labels for a sequence of {length} residues; give "
            "one label per residue (a string of the sequence's length or a list)"
        )
    return values


def _rows(src: Path, reader: Any) -> Iterator[list[str]]:  # noqa: ANN401 - a csv.reader
    """``reader``'s rows, its ``csv.Error`` (a field over the csv module's 131,072-character
    limit, a stray NUL) one ``UserError`` naming the line."""
    try:
        yield from reader
    except csv.Error as exc:
        raise UserError(f"{src}: line {reader.line_num}: {exc}; fix the row") from None


def read_labels(
    path: str | os.PathLike[str],
    task: str = "regression",
    label_cols: Sequence[str] = ("label",),
    *,
    sequence_col: str = "sequence",
    id_col: str = "id",
    split_col: str = "split",
    fasta: str | os.PathLike[str] | None = None,
    classes: Sequence[str] | None = None,
    on_nan: str = "skip",
) -> LabelledSet:
    """Read a labels table (see the module docstring) into a :class:`LabelledSet`."""
    if task not in TASKS:
        raise UserError(f"task={task!r} is not one of {', '.join(TASKS)}")
    if on_nan not in ("skip", "error"):
        raise UserError(f"data.on_nan={on_nan!r}: use skip or error")
    src = Path(path).expanduser()
    if not src.is_file():
        raise UserError(
            f"{src} does not exist or is not a file: give a CSV/TSV of labels "
            "(data.train=labels.csv)"
        )
    data = src.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(
            f"{src}: line {line} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
            f"{exc.start}); save the table as UTF-8"
        ) from None
    if not text.strip():
        raise UserError(f"{src} is empty: give a CSV/TSV with a header row")
    reader = _rows(
        src, csv.reader(text.splitlines(), delimiter=delimiter(src, text.splitlines()[0]))
    )
    header = [h.strip() for h in next(reader)]
    label_cols = [str(c) for c in label_cols]
    missing = [c for c in label_cols if c not in header]
    if missing:
        raise UserError(
            f"{src}: no label column {', '.join(map(repr, missing))} in the header "
            f"{header[:12]}; set data.labels=[COLUMN,...]"
        )
    if task != "regression" and len(label_cols) != 1:
        raise UserError(f"{src}: {task} takes one label column, got {label_cols}")
    by_id: dict[str, str] | None = None
    if fasta is not None:
        from protein_performer.data.inputs import read_records

        by_id = {r.id: r.sequence for r in read_records(fasta)}
        if id_col not in header:
            raise UserError(f"{src}: with data.fasta the table needs an {id_col!r} column")
    elif sequence_col not in header:
        raise UserError(
            f"{src}: no {sequence_col!r} column (header {header[:12]}); add one, or "
            f"give ids in an {id_col!r} column with data.fasta=SEQS.fasta"
        )
    col = {h: i for i, h in enumerate(header)}
    alphabet = Alphabet()
    ids, seqs, raw, rows, splits = [], [], [], [], []
    nan_rows: list[int] = []
    has_split = split_col in col
    for n, fields in enumerate(reader, start=2):
        if not fields or all(not f.strip() for f in fields):
            continue
        where = f"{src}: row {n}"
        if len(fields) != len(header):
            raise UserError(
                f"{where} has {len(fields)} fields, the header {len(header)}; fix "
                "the row (a quoted field with a stray separator?)"
            )
        rid = fields[col[id_col]].strip() if id_col in col else str(n - 1)
        if by_id is not None:
            if rid not in by_id:
                raise UserError(
                    f"{where}: id {rid!r} is not in {fasta}; add the record or drop the row"
                )
            seq = by_id[rid]
        else:
            seq = fields[col[sequence_col]].strip().upper()
        if not seq:
            raise UserError(f"{where}: empty sequence")
        alphabet.check_residues(seq, f"{where} ({shown(rid)})")
        values = [fields[col[c]] for c in label_cols]
        if all(_is_nan(v) for v in values):
            if on_nan == "error":
                raise UserError(
                    f"{where} ({shown(rid)}): no label in {label_cols}; fill it in, drop "
                    "the row, or set data.on_nan=skip"
                )
            nan_rows.append(n)
            continue
        if has_split:
            name = fields[col[split_col]].strip().lower()
            if name not in _SPLIT_ALIASES:
                raise UserError(
                    f"{where} ({shown(rid)}): unknown split {fields[col[split_col]]!r}; use "
                    "train, valid or test"
                )
            splits.append(_SPLIT_ALIASES[name])
        ids.append(rid)
        seqs.append(seq)
        raw.append((values, where))
        rows.append(n)
    if nan_rows:
        log.warning(
            "%s: %d row(s) without a label skipped (rows %s%s)",
            src,
            len(nan_rows),
            ", ".join(map(str, nan_rows[:_SHOW])),
            " ..." if len(nan_rows) > _SHOW else "",
        )
    if not seqs:
        raise UserError(f"{src}: no labelled rows")
    labels, names = _parse_labels(task, raw, seqs, label_cols, classes, on_nan)
    return LabelledSet(
        ids,
        seqs,
        labels,
        task,
        names,
        rows,
        splits if has_split else None,
        len(nan_rows),
        str(src),
    )


def _parse_labels(
    task: str,
    raw: list,
    seqs: list[str],
    label_cols: list[str],
    classes: Sequence[str] | None,
    on_nan: str,
) -> tuple[Any, list[str]]:
    if task == "regression":
        out = np.full((len(raw), len(label_cols)), np.nan, dtype=np.float32)
        for i, (values, where) in enumerate(raw):
            for j, v in enumerate(values):
                if _is_nan(v):
                    if on_nan == "error":
                        raise UserError(
                            f"{where}: no value for {label_cols[j]!r}; fill it in or "
                            "set data.on_nan=skip"
                        )
                    continue
                try:
                    out[i, j] = float(v)
                except ValueError:
                    raise UserError(
                        f"{where}: label {label_cols[j]}={v!r} is not a number"
                    ) from None
                if not math.isfinite(out[i, j]):
                    raise UserError(f"{where}: label {label_cols[j]}={v!r} is not finite")
        return out, list(label_cols)
    if task == "classification":
        values = [v[0].strip() for v, _ in raw]
    else:
        values = [_residue_labels(v[0], len(s), w) for (v, w), s in zip(raw, seqs, strict=True)]
    seen = sorted({x for v in values for x in ([v] if task == "classification" else v)})
    names = [str(c) for c in classes] if classes else seen
    index = {c: k for k, c in enumerate(names)}
    unknown = [x for x in seen if x not in index]
    if unknown:
        raise UserError(
            f"{raw[0][1].split(': row')[0]}: labels {unknown[:5]} are not in data.classes={names}"
        )
    if len(names) < 2:
        raise UserError(
            f"{raw[0][1].split(': row')[0]}: {task} needs at least 2 classes, "
            f"the labels hold only {names}"
        )
    if task == "classification":
        return np.array([index[v] for v in values], dtype=np.int64), names
    return [np.array([index[x] for x in v], dtype=np.int64) for v in values], names


# --------------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------------
def assign_splits(
    data: LabelledSet,
    split_by: str | None = None,
    valid_frac: float = 0.1,
    test_frac: float = 0.1,
    seed: int = 0,
    identity: float = 0.9,
) -> dict[str, list[int]]:
    """Record indices per split. ``split_by``: ``column`` (the table's), ``random`` (seeded),
    ``cluster`` (MMseqs2 clusters at ``identity``, whole clusters per split); None: the column
    when there is one, else random. Valid and test rows that repeat a training sequence are
    counted in one warning (:func:`warn_repeats`)."""
    splits = _assign_splits(data, split_by, valid_frac, test_frac, seed, identity)
    warn_repeats(data, splits)
    return splits


def warn_repeats(data: LabelledSet, splits: dict[str, list[int]]) -> dict[str, int]:
    """Valid and test rows whose sequence is also a training row's, by split; one warning
    when there are any: their metrics measure recall of the training labels, not prediction."""
    train = {data.sequences[i] for i in splits["train"]}
    repeats = {s: sum(data.sequences[i] in train for i in splits[s]) for s in ("valid", "test")}
    if any(repeats.values()):
        log.warning(
            "%s: %s repeat a training sequence, so their metrics overstate what the model "
            "predicts; deduplicate the table or split with --split-by cluster",
            data.source,
            " and ".join(f"{n} of {len(splits[s])} {s} row(s)" for s, n in repeats.items() if n),
        )
    return repeats


def _assign_splits(
    data: LabelledSet,
    split_by: str | None,
    valid_frac: float,
    test_frac: float,
    seed: int,
    identity: float,
) -> dict[str, list[int]]:
    split_by = split_by or ("column" if data.splits is not None else "random")
    if split_by not in SPLIT_BY:
        raise UserError(f"--split-by {split_by!r}: use one of {', '.join(SPLIT_BY)}")
    if not (0 <= valid_frac < 1 and 0 <= test_frac < 1 and valid_frac + test_frac < 1):
        raise UserError(
            f"data.valid_frac={valid_frac}, data.test_frac={test_frac}: fractions "
            "in [0, 1) summing below 1"
        )
    if split_by == "column":
        if data.splits is None:
            raise UserError(f"{data.source}: --split-by column but the table has no split column")
        out: dict[str, list[int]] = {s: [] for s in SPLITS}
        for i, s in enumerate(data.splits):
            out[s].append(i)
        return out
    groups = (
        cluster_groups(data.sequences, identity)
        if split_by == "cluster"
        else list(range(len(data)))
    )
    return _split_groups(groups, valid_frac, test_frac, seed)


def cluster_groups(sequences: Sequence[str], identity: float) -> list[int]:
    """The MMseqs2 cluster of each sequence (an integer per record), via ``data.homology``."""
    from protein_performer.data.homology import cluster_sequences

    with tempfile.TemporaryDirectory(prefix="pp_ft_") as tmp:
        fasta = Path(tmp) / "seqs.fasta"
        fasta.write_text("".join(f">r{i}\n{s}\n" for i, s in enumerate(sequences)))
        clusters, _ = cluster_sequences([fasta], identity)
    reps: dict[str, int] = {}
    return [
        reps.setdefault(clusters.get(f"r{i}", f"r{i}"), len(reps)) for i in range(len(sequences))
    ]


def _split_groups(
    groups: Sequence[int], valid_frac: float, test_frac: float, seed: int
) -> dict[str, list[int]]:
    """Whole groups to splits in a seeded random order until each split has its share."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    keys = list(members)
    order = np.random.default_rng(seed).permutation(len(keys))
    n = len(groups)
    want = {"test": round(test_frac * n), "valid": round(valid_frac * n)}
    out: dict[str, list[int]] = {s: [] for s in SPLITS}
    for k in order:
        idx = members[keys[k]]
        target = next((s for s in ("test", "valid") if len(out[s]) < want[s]), "train")
        out[target].extend(idx)
    return {s: sorted(v) for s, v in out.items()}


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------
class TokenDataset(torch.utils.data.Dataset):
    """Items ``(tokens, label)`` of a :class:`LabelledSet` (``<cls>`` + residues + ``<eos>``)."""

    def __init__(self, data: LabelledSet) -> None:
        self.data = data
        self.alphabet = Alphabet()

    def __len__(self) -> int:
        return len(self.data)

    def lengths(self) -> np.ndarray:
        return np.array([len(s) + 2 for s in self.data.sequences])

    def __getitem__(self, i: int) -> tuple[np.ndarray, Any]:
        return self.alphabet.encode_with_specials(self.data.sequences[i]), self.data.labels[i]


class FeatureDataset(torch.utils.data.Dataset):
    """Items ``(features, label)`` for the frozen mode: the backbone's features, cached once."""

    def __init__(self, features: list[torch.Tensor], labels: Any) -> None:
        self.features = features
        self.labels = labels

    def __len__(self) -> int:
        return len(self.features)

    def lengths(self) -> np.ndarray:
        return np.array([f.shape[0] if f.ndim == 2 else 1 for f in self.features])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        return self.features[i], self.labels[i]


def collate(items: list[tuple[Any, Any]], task: str, pad_idx: int = 1) -> dict[str, torch.Tensor]:
    """Pad a batch: ``tokens`` (B, T) or ``features`` (B, D) / (B, T, D) + ``mask``, and
    ``labels``: (B, K) float, (B,) long, or (B, T) long aligned with the tokens (``<cls>`` at 0,
    so residue i is token i + 1; padding and specials hold ``IGNORE_INDEX``)."""
    xs, ys = zip(*items, strict=True)
    batch: dict[str, torch.Tensor] = {}
    if isinstance(xs[0], np.ndarray):
        from protein_performer.data.tokenizer import pad_token_arrays

        batch["tokens"] = pad_token_arrays(xs, pad_idx)
        width = batch["tokens"].shape[1]
        offset = 1
    elif xs[0].ndim == 1:
        batch["features"] = torch.stack(list(xs))
        width, offset = 0, 0
    else:
        width = max(x.shape[0] for x in xs)
        feats = torch.zeros(len(xs), width, xs[0].shape[1], dtype=xs[0].dtype)
        mask = torch.zeros(len(xs), width, dtype=torch.bool)
        for k, x in enumerate(xs):
            feats[k, : x.shape[0]] = x
            mask[k, : x.shape[0]] = True
        batch["features"], batch["mask"] = feats, mask
        offset = 0
    if task == "regression":
        batch["labels"] = torch.as_tensor(np.stack(ys), dtype=torch.float32)
    elif task == "classification":
        batch["labels"] = torch.as_tensor(np.array(ys), dtype=torch.long)
    else:
        labels = torch.full((len(ys), width), IGNORE_INDEX, dtype=torch.long)
        for k, y in enumerate(ys):
            labels[k, offset : offset + len(y)] = torch.as_tensor(y)
        batch["labels"] = labels
    return batch
