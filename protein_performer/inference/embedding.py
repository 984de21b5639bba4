"""Per-sequence and per-residue embeddings of a FASTA file into one HDF5 file.

Shaped like ESM's ``esm-extract`` but without its two classic traps: sequences of any length go
through the model in one pass (no truncation at 1022 residues, no sliding windows: FAVOR+
attention is linear in L, so titin fits), and the output is one HDF5 file per run keyed by a
safe form of the record id, instead of one ``.pt`` file per sequence named after its header.

HDF5 layout (``FORMAT_NAME`` version ``FORMAT_VERSION``)::

    /                   attrs: format, format_version, checkpoint, objective, attention,
                               repr_layers (resolved, ESM numbering), include, dim,
                               num_records, model_config (JSON)
    /records/<key>/     one group per record; attrs: id, header (the FASTA header line
                        without '>'), description, length, record_number (1-based in FASTA)
        mean/<layer>    (D,)   float32  mean over residues (no <cls>/<eos>/pad)
        per_tok/<layer> (L, D) float32  residues only: row i is residue i+1
        bos/<layer>     (D,)   float32  the <cls> position
    /index              one row per record in FASTA order: key, id, header, length (a table
                        mapping record ids to group keys)

``<key>`` is the id with every character outside ``[A-Za-z0-9._-]`` replaced by ``_`` (HDF5
reserves ``/``), de-duplicated with a ``~N`` suffix when two ids collide after that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TextIO

import numpy as np
import torch

from protein_performer.atomic import atomic_file
from protein_performer.errors import UserError
from protein_performer.inference.loading import LoadedModel

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM

log = logging.getLogger(__name__)

FORMAT_NAME = "protein_performer.embeddings"
FORMAT_VERSION = 1
INCLUDE_CHOICES = ("mean", "per_tok", "bos")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


# --------------------------------------------------------------------------------------------
# Shared helpers (also used by scoring and evaluation)
# --------------------------------------------------------------------------------------------
def budget_batches(lengths: Sequence[int], toks_per_batch: int) -> list[list[int]]:
    """Indices grouped so each batch's padded size ``n * max_width`` stays under the budget.

    Longest first, so an out-of-memory failure happens at the start rather than after an hour.
    A single item wider than the budget gets a batch of its own and is never truncated: the
    budget bounds batching, not sequence length.
    """
    if toks_per_batch <= 0:
        raise UserError(f"--toks-per-batch must be positive, got {toks_per_batch}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        w = int(lengths[i])
        new_width = max(width, w)
        if current and new_width * (len(current) + 1) > toks_per_batch:
            batches.append(current)
            current, new_width = [], w
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    return batches


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` only on success.

    :func:`protein_performer.atomic.atomic_file` behind the checks a CLI output needs first: a
    directory or a missing parent directory is the user's mistake, said as such.
    """
    out = Path(path).expanduser()
    if out.is_dir():
        raise UserError(f"{out} is a directory; give a file name for the output")
    parent = out.parent
    if not parent.exists():
        raise UserError(f"output directory {parent} does not exist; create it first")
    with atomic_file(out, mode=0o644) as tmp:
        yield tmp


@contextlib.contextmanager
def text_output(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """A text file written atomically (:func:`atomic_output`), or standard output for ``-``.

    ``-`` lets a table or FASTA go into a pipe; a pipe closed early (``| head``) ends the
    command quietly instead of with a traceback.
    """
    if str(path) == "-":
        try:
            yield sys.stdout
            sys.stdout.flush()
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return
    with atomic_output(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        yield fh


class InputRecord(NamedTuple):
    """What the writers need of a record, whether it came from FASTA or from a store."""

    id: str
    description: str
    sequence: str
    number: int  # 1-based position in its file or store


def input_records(
    path: str | os.PathLike[str], on_invalid: str = "error"
) -> Iterator[InputRecord]:
    """Stream the records of a FASTA file or of a preprocessed store directory, in order.

    A store (``protein-performer preprocess``) is read record by record from its memory maps
    (lengths known, O(1) access), so very large inputs cost no parsing and constant memory.
    """
    from protein_performer.data.fasta import read_fasta
    from protein_performer.data.store import TokenStore, is_store

    src = Path(path).expanduser()
    if is_store(src):
        store = TokenStore(src)
        for i in range(len(store)):
            yield InputRecord(store.id(i), store.description(i), store.sequence(i), i + 1)
        return
    if not src.is_file():
        raise UserError(
            f"{src} does not exist or is not a file; give a FASTA file or a store directory "
            "from `protein-performer preprocess`"
        )
    for r in read_fasta(src, on_invalid=on_invalid):  # type: ignore[arg-type]
        yield InputRecord(r.id, r.description, r.sequence, r.number)


def read_records(fasta: str | os.PathLike[str], on_invalid: str = "error") -> list:
    """All FASTA records in file order (``FastaRecord``); errors name file, record and line."""
    from protein_performer.data.fasta import read_fasta

    path = Path(fasta).expanduser()
    if not path.is_file():
        raise UserError(f"{path} does not exist or is not a file; give a FASTA file")
    records = list(read_fasta(path, on_invalid=on_invalid))  # type: ignore[arg-type]
    if not records:
        raise UserError(f"{path}: no valid records to process")
    return records


class SafeKeys:
    """HDF5-safe, unique group names for record ids, one at a time (see the module docstring).

    Incremental, so a streaming writer names each record as it arrives.
    """

    def __init__(self) -> None:
        self._used: set[str] = set()

    def __call__(self, rid: str) -> str:
        base = _UNSAFE.sub("_", rid)[:200] or "_"
        if base in (".", ".."):
            base = base.replace(".", "_")
        key, n = base, 1
        while key in self._used:
            n += 1
            key = f"{base}~{n}"
        self._used.add(key)
        return key


def safe_keys(ids: Sequence[str]) -> list[str]:
    """:class:`SafeKeys` over a whole list of ids."""
    name = SafeKeys()
    return [name(rid) for rid in ids]


def encode_batch(loaded: LoadedModel, seqs: Sequence[str]) -> torch.Tensor:
    """``<cls> residues <eos>`` rows, right-padded, on the model's device."""
    from protein_performer.data.tokenizer import pad_token_arrays

    a = loaded.alphabet
    return pad_token_arrays([a.encode_with_specials(s) for s in seqs], a.pad_idx).to(loaded.device)


# --------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------
@dataclass
class EmbedSummary:
    """What a run wrote, for the CLI's closing lines and for callers."""

    path: Path
    num_records: int
    residues: int
    repr_layers: list[int]
    include: list[str]
    keys: dict[str, str] = field(default_factory=dict)  # record id -> group key


def resolve_layers(loaded: LoadedModel, layers: Sequence[int]) -> list[int]:
    """ESM numbering (negative from the end) -> sorted, unique block numbers 0..depth."""
    depth = loaded.config.depth
    out = set()
    for i in layers:
        j = i + depth + 1 if i < 0 else i
        if not 0 <= j <= depth:
            raise UserError(
                f"--repr-layers {i} is out of range for a {depth}-layer model "
                f"(valid: 0..{depth} or {-(depth + 1)}..-1)"
            )
        out.add(j)
    return sorted(out)


@torch.inference_mode()
def embed_sequences(
    loaded: LoadedModel,
    seqs: Sequence[str],
    repr_layers: Sequence[int] = (-1,),
    include: Sequence[str] = ("mean",),
    toks_per_batch: int = 4096,
) -> Iterator[tuple[int, dict[str, dict[int, np.ndarray]]]]:
    """Yield ``(index, {include: {layer: array}})`` per sequence, in length-batched order.

    Each sequence sees exactly what it would see alone (padding is masked in attention and
    excluded from means), so results do not depend on the batch it landed in.
    """
    bad = sorted(set(include) - set(INCLUDE_CHOICES))
    if bad or not include:
        raise UserError(f"--include takes {', '.join(INCLUDE_CHOICES)}; got {list(include)}")
    layers = resolve_layers(loaded, repr_layers)
    lengths = [len(s) + 2 for s in seqs]
    for batch in budget_batches(lengths, toks_per_batch):
        tokens = encode_batch(loaded, [seqs[i] for i in batch])  # (B, T)
        out = loaded.model(tokens, repr_layers=layers)
        for row, i in enumerate(batch):
            L = len(seqs[i])
            result: dict[str, dict[int, np.ndarray]] = {k: {} for k in include}
            for layer in layers:
                h = out.hidden_states[layer][row].float()  # (T, D)
                if "per_tok" in include:
                    result["per_tok"][layer] = h[1 : L + 1].cpu().numpy()
                if "mean" in include:
                    result["mean"][layer] = h[1 : L + 1].mean(0).cpu().numpy()
                if "bos" in include:
                    result["bos"][layer] = h[0].cpu().numpy()
            yield i, result


def embed_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    repr_layers: Sequence[int] = (-1,),
    include: Sequence[str] = ("mean",),
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
) -> EmbedSummary:
    """Embed every record of ``fasta`` (a FASTA file or a store directory) into the HDF5 file
    ``out`` (written atomically).

    Streams: records are read, embedded (``lm.iter_embed``) and written window by window, so
    memory does not grow with the number of records.
    """
    import h5py
    from tqdm import tqdm

    path = Path(fasta).expanduser()
    layers = resolve_layers(lm.loaded, repr_layers)
    include = list(dict.fromkeys(include))
    bad = sorted(set(include) - set(INCLUDE_CHOICES))
    if bad or not include:
        raise UserError(f"--include takes {', '.join(INCLUDE_CHOICES)}; got {list(include)}")
    pending: deque = deque()

    def records() -> Iterator[tuple[str, str]]:
        for r in input_records(path, on_invalid):
            pending.append(r)
            yield r.id, r.sequence

    name = SafeKeys()
    index: list[tuple[str, str, str, int]] = []
    keys: dict[str, str] = {}
    pooling = tuple(None if k == "per_tok" else k for k in include)
    with atomic_output(out) as tmp, h5py.File(tmp, "w") as h5:
        h5.attrs["format"] = FORMAT_NAME
        h5.attrs["format_version"] = FORMAT_VERSION
        h5.attrs["checkpoint"] = str(lm.loaded.source)
        h5.attrs["objective"] = lm.config.objective
        h5.attrs["attention"] = lm.config.attention
        h5.attrs["repr_layers"] = np.asarray(layers, dtype=np.int64)
        h5.attrs["include"] = json.dumps(include)
        h5.attrs["dim"] = lm.config.dim
        h5.attrs["model_config"] = json.dumps(lm.config.to_dict(), sort_keys=True)
        group = h5.create_group("records")
        bar = tqdm(unit="res", unit_scale=True, desc="embed", disable=not progress)
        with bar:
            for _, result in lm.iter_embed(records(), layers, pooling, toks_per_batch):
                r = pending.popleft()
                key = name(r.id)
                header = f"{r.id} {r.description}" if r.description else r.id
                g = group.create_group(key)
                g.attrs["id"] = r.id
                g.attrs["header"] = header
                g.attrs["description"] = r.description
                g.attrs["length"] = len(r.sequence)
                g.attrs["record_number"] = r.number
                for kind, per_layer in result.items():
                    sub = g.create_group(kind)
                    for layer, arr in per_layer.items():
                        sub.create_dataset(str(layer), data=arr.astype(np.float32, copy=False))
                index.append((key, r.id, header, len(r.sequence)))
                keys.setdefault(r.id, key)
                bar.update(len(r.sequence))
        if not index:
            raise UserError(f"{path}: no valid records to process")
        str_dt = h5py.string_dtype("utf-8")
        table = np.zeros(
            len(index),
            dtype=[("key", str_dt), ("id", str_dt), ("header", str_dt), ("length", np.int64)],
        )
        for n, row in enumerate(index):
            table[n] = row
        h5.create_dataset("index", data=table)
        h5.attrs["num_records"] = len(index)
    return EmbedSummary(
        path=Path(out),
        num_records=len(index),
        residues=sum(row[3] for row in index),
        repr_layers=layers,
        include=include,
        keys=keys,
    )
