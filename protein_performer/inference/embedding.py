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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from protein_performer.atomic import atomic_file
from protein_performer.errors import UserError
from protein_performer.inference.loading import LoadedModel

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


def safe_keys(ids: Sequence[str]) -> list[str]:
    """HDF5-safe, unique group names for record ids (see the module docstring)."""
    keys: list[str] = []
    used: set[str] = set()
    for rid in ids:
        base = _UNSAFE.sub("_", rid)[:200] or "_"
        if base in (".", ".."):
            base = base.replace(".", "_")
        key, n = base, 1
        while key in used:
            n += 1
            key = f"{base}~{n}"
        used.add(key)
        keys.append(key)
    return keys


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
    loaded: LoadedModel,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    repr_layers: Sequence[int] = (-1,),
    include: Sequence[str] = ("mean",),
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
) -> EmbedSummary:
    """Embed every record of ``fasta`` into the HDF5 file ``out`` (written atomically)."""
    import h5py
    from tqdm import tqdm

    records = read_records(fasta, on_invalid)
    layers = resolve_layers(loaded, repr_layers)
    include = list(dict.fromkeys(include))
    seqs = [r.sequence for r in records]
    keys = safe_keys([r.id for r in records])
    str_dt = h5py.string_dtype("utf-8")
    with atomic_output(out) as tmp, h5py.File(tmp, "w") as h5:
        h5.attrs["format"] = FORMAT_NAME
        h5.attrs["format_version"] = FORMAT_VERSION
        h5.attrs["checkpoint"] = str(loaded.source)
        h5.attrs["objective"] = loaded.config.objective
        h5.attrs["attention"] = loaded.config.attention
        h5.attrs["repr_layers"] = np.asarray(layers, dtype=np.int64)
        h5.attrs["include"] = json.dumps(include)
        h5.attrs["dim"] = loaded.config.dim
        h5.attrs["num_records"] = len(records)
        h5.attrs["model_config"] = json.dumps(loaded.config.to_dict(), sort_keys=True)
        group = h5.create_group("records")
        index = np.zeros(
            len(records),
            dtype=[("key", str_dt), ("id", str_dt), ("header", str_dt), ("length", np.int64)],
        )
        for n, (r, key) in enumerate(zip(records, keys, strict=True)):
            header = f"{r.id} {r.description}" if r.description else r.id
            index[n] = (key, r.id, header, len(r.sequence))
        h5.create_dataset("index", data=index)
        bar = tqdm(
            total=sum(len(s) for s in seqs),
            unit="res",
            unit_scale=True,
            desc="embed",
            disable=not progress,
        )
        with bar:
            for i, result in embed_sequences(loaded, seqs, layers, include, toks_per_batch):
                r = records[i]
                g = group.create_group(keys[i])
                g.attrs["id"] = r.id
                g.attrs["header"] = f"{r.id} {r.description}" if r.description else r.id
                g.attrs["description"] = r.description
                g.attrs["length"] = len(r.sequence)
                g.attrs["record_number"] = r.number
                for kind, per_layer in result.items():
                    sub = g.create_group(kind)
                    for layer, arr in per_layer.items():
                        sub.create_dataset(str(layer), data=arr.astype(np.float32, copy=False))
                bar.update(len(r.sequence))
    return EmbedSummary(
        path=Path(out),
        num_records=len(records),
        residues=sum(len(s) for s in seqs),
        repr_layers=layers,
        include=include,
        keys={r.id: k for r, k in zip(records, keys, strict=True)},
    )
