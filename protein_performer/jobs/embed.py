"""``embed``: the embeddings of many proteins (``lm.embed_window``) into one columnar HDF5 file
that scales to UniRef, and :func:`read_embeddings`, its reader.

Shaped like ESM's ``esm-extract`` without its classic traps: any length goes through the model
in one pass (no truncation at 1022 residues, no windows: FAVOR+ attention is linear in L), and a
run writes ONE file with one array per field, not one group (or one ``.pt`` file) per record.

HDF5 layout (``FORMAT_NAME`` version ``FORMAT_VERSION``; N records, D = model width)::

    /                       attrs: format, format_version, protein_performer_version,
                                   checkpoint, model_sha256 (learned weights), features_sha256
                                   (FAVOR+ random features), objective, attention, dim, precision,
                                   repr_layers (resolved, 0..depth), include (JSON), model_config
                                   (JSON), num_records
    ids                     (N,) utf-8            record ids, in input order
    lengths                 (N,) int64            residues per record
    record_numbers          (N,) int64            1-based position in the input file or store
    sequence_sha256         (N, 16) uint8         first 16 bytes of each sequence's SHA-256
                                                  (what --resume compares with the input)
    header_bytes            (sum,) uint8, gzip    the FASTA header lines (no '>'), back to back
    header_offsets          (N+1,) int64          record n's header is header_bytes[o[n]:o[n+1]]
    mean/<layer>            (N, D) float32        mean over residues (no <cls>/<eos>/padding)
    bos/<layer>             (N, D) float32        the <cls> position
    per_tok/<layer>         (sum L, D) float32    residues of all records back to back
    per_tok_offsets         (N+1,) int64          record n is per_tok[o[n]:o[n+1]] (row i =
                                                  residue i+1)

:func:`read_embeddings` reads it back. Files of format version 1 (protein-performer 0.1, one
group per record) are refused with a message saying to re-run ``embed``.

Runs are written as parts (``OUT.parts/``, one per window of records) and merged at the end
(:mod:`protein_performer.io.sharding`): a killed run resumes with ``--resume`` and loses
at most one window, and ranks of a ``torchrun``/SLURM job each write their own parts.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from protein_performer.data.headers import IdLookup
from protein_performer.data.inputs import InputRecord, input_records, total_in_background
from protein_performer.errors import UserError, shown
from protein_performer.inference.api import ProteinLM, precision_name
from protein_performer.inference.embedding import HIDDEN_KINDS
from protein_performer.interop.identity import model_hashes
from protein_performer.io.atomic import output_file
from protein_performer.io.columns import (
    HEADER_COLUMNS,
    RECORD_COLUMNS,
    Column,
    Layout,
    checked_offsets,
    checked_rows,
    header_column,
    merge_columns,
    open_columns,
    read_ids,
    record_columns,
    write_columns,
)
from protein_performer.io.json_safe import parse_json
from protein_performer.model.config import block_number

FORMAT_NAME = "protein_performer.embeddings"
FORMAT_VERSION = 2
#: What ``embed --include`` takes: the hidden kinds, and contact maps from the model's contact
#: regression (as ``contacts predict`` writes them).
INCLUDE_CHOICES = (*HIDDEN_KINDS, "contacts")
#: Contact maps stored by ``embed --include contacts`` (``contacts predict``'s defaults).
CONTACTS_DTYPE = "float16"


# --------------------------------------------------------------------------------------------
# The columnar file
# --------------------------------------------------------------------------------------------
def _layout(attrs: dict[str, Any]) -> Layout:
    """The file's datasets for the kinds and layers its attributes name."""
    include = json.loads(attrs["include"])
    layers = [int(x) for x in attrs["repr_layers"]]
    row = (int(attrs["dim"]),)
    pooled = [
        Column(f"{k}/{n}", np.float32, row)
        for k in include
        if k in ("mean", "bos")
        for n in layers
    ]
    ragged = dict(HEADER_COLUMNS)
    if "per_tok" in include:
        ragged["per_tok_offsets"] = tuple(Column(f"per_tok/{n}", np.float32, row) for n in layers)
    if "contacts" in include:
        from protein_performer.contacts.predict import contact_ragged

        ragged.update(contact_ragged(CONTACTS_DTYPE))
    return Layout([*_RECORD_COLUMNS, *pooled], ragged)


def file_attrs(lm: ProteinLM, layers: Sequence[int], include: Sequence[str]) -> dict[str, Any]:
    """The root attributes: what the embeddings came from and how they were made."""
    from protein_performer import __version__

    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "protein_performer_version": __version__,
        "checkpoint": str(lm.source),
        **model_hashes(lm.model),
        "objective": lm.config.objective,
        "attention": lm.config.attention,
        "dim": lm.config.dim,
        "precision": precision_name(lm.dtype),
        "repr_layers": np.asarray(sorted(layers), dtype=np.int64),
        "include": json.dumps(list(include)),
        "model_config": json.dumps(lm.config.to_dict(), sort_keys=True),
    }


#: Attributes a resumed run must share with what it continues.
_SAME_RUN = ("precision", "repr_layers", "include", "model_sha256", "features_sha256")


def _open_embeddings(path: Path) -> Any:  # noqa: ANN401 - h5py.File
    """An embeddings file opened for reading, its format checked (version 1 named as such)."""
    from protein_performer.errors import check_format_header

    h5 = open_columns(path, "embeddings files", "re-run embed")
    header = {k: h5.attrs.get(k) for k in ("format", "format_version")}
    if header["format_version"] is not None:
        header["format_version"] = int(header["format_version"])
    if header["format"] == FORMAT_NAME and header["format_version"] == 1:
        h5.close()
        raise UserError(
            f"{path} was written by protein-performer 0.1 (embeddings format 1, one group per "
            "record), which this version does not read; re-run `protein-performer embed`"
        )
    try:
        check_format_header(header, path, FORMAT_NAME, FORMAT_VERSION, "embeddings file")
    except UserError:
        h5.close()
        raise
    return h5


def _check_same_run(path: Path, h5: Any, attrs: dict[str, Any]) -> None:  # noqa: ANN401
    for key in _SAME_RUN:
        have, want = h5.attrs.get(key), attrs[key]
        if not np.array_equal(np.asarray(have), np.asarray(want)):
            what = {"model_sha256": "model weights", "features_sha256": "FAVOR+ features"}
            raise UserError(
                f"--resume: {path} was made with other {what.get(key, key)} ({have!r} there, "
                f"{want!r} now); resume with the same checkpoint and options, or start over "
                "with --overwrite"
            )


def _write_part(
    path: Path, attrs: dict, records: list[InputRecord], results: list, maps: list
) -> None:
    layout = _layout(attrs)
    per_record = record_columns(records)
    per_record[SEQ_DIGESTS] = sequence_digests([r.sequence for r in records])
    ragged = {"header_offsets": header_column(records)}
    for col in layout.per_record[len(_RECORD_COLUMNS) :]:
        kind, layer = col.name.split("/")
        per_record[col.name] = np.stack([res[kind][int(layer)] for res in results])
    if "per_tok_offsets" in layout.ragged:
        tok = {
            c.name: np.concatenate([res["per_tok"][int(c.name.split("/")[1])] for res in results])
            for c in layout.ragged["per_tok_offsets"]
        }
        ragged["per_tok_offsets"] = (per_record["lengths"], tok)
    if maps:
        from protein_performer.contacts.predict import contact_columns

        ragged.update(contact_columns(maps, CONTACTS_DTYPE))
    write_columns(path, layout, attrs, per_record, ragged)


# --------------------------------------------------------------------------------------------
# What a part was made from (--resume keeps only parts that match the input)
# --------------------------------------------------------------------------------------------
#: The records' sequence digests (N, 16), in parts and merged files; a part's run (model and
#: options).
SEQ_DIGESTS = "sequence_sha256"
PART_RUN = "part_run_id"
#: The per-record columns of every embeddings file and part, before the vectors.
_RECORD_COLUMNS = (*RECORD_COLUMNS, Column(SEQ_DIGESTS, np.uint8, (16,)))


def sequence_digests(seqs: Sequence[str]) -> np.ndarray:
    """(N, 16) uint8: the first 16 bytes of each sequence's SHA-256."""
    import hashlib

    out = np.zeros((len(seqs), 16), dtype=np.uint8)
    for n, seq in enumerate(seqs):
        out[n] = np.frombuffer(hashlib.sha256(seq.encode()).digest()[:16], dtype=np.uint8)
    return out


def run_id(attrs: dict[str, Any]) -> str:
    """The identity of a run's parts: what the vectors depend on (model, features, options)."""
    import hashlib

    keys = (*_SAME_RUN, "contact_regression")
    same = {k: np.asarray(attrs[k]).tolist() for k in keys if k in attrs}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class PartCheck:
    """What ``--resume`` made of the parts it found."""

    kept: list[Path]  # parts whose every record is in the input, with the same sequence
    reused: int = 0  # records in them
    redone: int = 0  # records of dropped parts that the input still holds (computed again)
    dropped: int = 0  # parts of another run or input, or of protein-performer < 0.3
    damaged: int = 0  # parts that do not read (set aside as NAME.damaged)


def check_parts(
    parts: Sequence[Path],
    attrs: dict[str, Any],
    records: Any,  # noqa: ANN401 - an iterable of InputRecord
    set_aside: bool = True,
) -> PartCheck:
    """Keep the parts made by this run (same model and options: :func:`run_id`) whose records
    are all in the input ``records`` with the same sequence; set aside the others.

    Every rank of a sharded run checks the same parts and reaches the same verdict; only one
    (``set_aside``: rank 0) renames, and a part another rank renamed first counts as set aside.

    A part that does not read is renamed ``NAME.damaged`` (not fatal: its records are redone);
    a part of another run, holding a record the input lacks or whose sequence changed, or
    written before parts recorded their sources (protein-performer < 0.3) is renamed
    ``NAME.dropped`` and its records that the input holds are computed again.
    """

    def aside(part: Path, suffix: str) -> None:
        if set_aside:
            with contextlib.suppress(FileNotFoundError):
                part.rename(part.with_name(part.name + suffix))

    want = run_id(attrs)
    check = PartCheck([])
    owner: dict[str, int] = {}  # id -> index into candidates
    digests: dict[str, bytes] = {}
    candidates: list[tuple[Path, list[str]]] = []
    for part in parts:
        try:
            with open_columns(part, "embed parts", "it is set aside") as h5:
                ids = read_ids(h5)
                same_run = h5.attrs.get(PART_RUN) == want and SEQ_DIGESTS in h5
                sha = h5[SEQ_DIGESTS][:] if same_run else None
                n = int(h5.attrs["num_records"])
                whole = len(ids) == n and all(len(h5[c.name]) == n for c in RECORD_COLUMNS)
        except (OSError, KeyError, ValueError, TypeError, UserError):
            whole = False
        if not whole or (sha is not None and sha.shape != (len(ids), 16)):
            aside(part, ".damaged")
            check.damaged += 1
            continue
        if sha is None:
            aside(part, ".dropped")
            check.dropped += 1
            continue
        candidates.append((part, ids))
        for rid, digest in zip(ids, sha, strict=True):
            owner[rid] = len(candidates) - 1
            digests[rid] = digest.tobytes()
    bad: set[int] = set()
    seen: set[str] = set()
    in_bad: list[str] = []
    for rec in records:
        k = owner.get(rec.id)
        if k is None:
            continue
        seen.add(rec.id)
        if sequence_digests([rec.sequence])[0].tobytes() != digests[rec.id]:
            bad.add(k)
    for k, (part, ids) in enumerate(candidates):
        if k in bad or any(rid not in seen for rid in ids):
            aside(part, ".dropped")
            check.dropped += 1
            in_bad += [rid for rid in ids if rid in seen]
        else:
            check.kept.append(part)
            check.reused += len(ids)
    check.redone = len(in_bad)
    return check


# --------------------------------------------------------------------------------------------
# Running embed
# --------------------------------------------------------------------------------------------
@dataclass
class EmbedSummary:
    """What a run did, for the CLI's closing lines and for callers."""

    path: Path
    num_records: int  # records in the file now
    new_records: int  # embedded by this process in this run
    residues: int  # of the new records
    repr_layers: list[int]
    include: list[str]
    skipped: int = 0  # already in the file or its parts (--resume)
    parts: PartCheck | None = None  # what --resume made of the parts it found


def embed_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    repr_layers: Sequence[int] = (-1,),
    include: Sequence[str] = ("mean",),
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> EmbedSummary:
    """Embed every record of ``fasta`` (a FASTA file or a store directory) into ``out``.

    Window by window into parts, then merged (see the module docstring). ``resume`` skips ids
    already in ``out`` or in its finished parts and adds the rest (the input may have grown);
    it refuses when the model or the options differ. Without it, an existing ``out`` or
    leftover parts are refused unless ``overwrite``. Under ``torchrun``/SLURM every rank runs
    this with the same arguments.
    """
    from protein_performer.io.progress import progress as progress_bar
    from protein_performer.io.sharding import (
        detect_ranks,
        finished_parts,
        parts_dir,
        rank_label,
        run_sharded,
        windows,
    )

    path = Path(fasta).expanduser()
    dest = output_file(out)
    layers = lm.resolve_layers(repr_layers)
    include = list(dict.fromkeys(include))
    bad = sorted(set(include) - set(INCLUDE_CHOICES))
    if bad or not include:
        raise UserError(f"--include takes {', '.join(INCLUDE_CHOICES)}; got {list(include)}")
    attrs = file_attrs(lm, layers, include)
    regression = None
    if "contacts" in include:  # the model's own regression, or one line saying how to fit one
        regression = lm.contact_regression(caller="embed", sha256=attrs["model_sha256"])
        attrs["contact_regression"] = json.dumps(regression.to_dict(), sort_keys=True)
        attrs["contacts_dtype"] = CONTACTS_DTYPE
    pdir = parts_dir(dest)
    old_parts = finished_parts(pdir)
    done: set[str] = set()
    checked = None
    part_attrs = {**attrs, PART_RUN: run_id(attrs)}
    if resume:
        if old_parts and os.fspath(fasta) == "-":
            raise UserError(
                "--resume with parts reads the input twice (to check the parts, then to add "
                "what is missing): give the FASTA file, not standard input"
            )
        if dest.exists():
            with _open_embeddings(dest) as h5:
                _check_same_run(dest, h5, attrs)
                ids = read_ids(h5)
                if SEQ_DIGESTS not in h5:
                    raise UserError(
                        f"--resume: {dest} records no sequence digests (written by an older "
                        "version), so its vectors cannot be checked against the input; start "
                        "over with --overwrite"
                    )
                sha = checked_rows(h5, SEQ_DIGESTS, len(ids), "u", 2)[:]
            there = {rid: digest.tobytes() for rid, digest in zip(ids, sha, strict=True)}
            for rec in input_records(path, on_invalid) if there else ():
                digest = there.get(rec.id)
                if digest is not None and digest != sequence_digests([rec.sequence])[0].tobytes():
                    raise UserError(
                        f"--resume: {dest} holds {shown(rec.id)} with another sequence than "
                        f"{path} has: the input changed; start over with --overwrite"
                    )
            done.update(there)
        if old_parts:
            first = detect_ranks().rank == 0
            checked = check_parts(old_parts, attrs, input_records(path, on_invalid), first)
            for part in checked.kept:
                with _open_embeddings(part) as h5:
                    done.update(read_ids(h5))
    elif not overwrite and (dest.exists() or old_parts):
        what = f"{dest} exists" if dest.exists() else f"{pdir} holds parts of an unfinished run"
        raise UserError(
            f"{what}; pass --resume to add what is missing, or --overwrite to start over"
        )
    pooling = tuple(None if k == "per_tok" else k for k in include if k in HIDDEN_KINDS)
    residues = 0
    bar = progress_bar(None, "res", rank_label("embed"), progress)
    if not done:
        total_in_background(bar, path, "residues")

    def write_part(part: Path, window: list[InputRecord]) -> None:
        nonlocal residues
        pairs = [(r.id, r.sequence) for r in window]
        results = (
            [res for _, res in lm.embed_window(pairs, layers, pooling, toks_per_batch)]
            if pooling
            else []
        )
        maps = []
        if regression is not None:
            maps = [lm.contact_map(s, regression) for _, s in pairs]
        _write_part(part, part_attrs, window, results, maps)
        n = sum(len(r.sequence) for r in window)
        residues += n
        bar.update(n)

    def merge(parts: list[Path]) -> int:
        sources = ([dest] if resume and dest.exists() else []) + parts
        if not sources:
            raise UserError(f"{path}: no valid records to process")
        return merge_columns(dest, _layout(attrs), attrs, sources)

    todo = (r for r in input_records(path, on_invalid) if r.id not in done)
    with bar:
        new, total = run_sharded(
            dest,
            ".h5",
            windows(todo, toks_per_batch, lambda r: len(r.sequence)),
            write_part,
            merge,
            fresh=not resume,
            options={"run": part_attrs[PART_RUN], "resume": str(resume)},
        )
    return EmbedSummary(dest, total, new, residues, layers, include, len(done), checked)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
class Embeddings(NamedTuple):
    """What :func:`read_embeddings` returns: ``ids, values = read_embeddings(path)``;
    ``dict(zip(*read_embeddings(path)))`` maps id -> value."""

    ids: list[str]  # record ids, in the order of the values
    values: Any  # (n, D) array (mean, bos), or a list of (L_i, D) arrays / contact maps

    @classmethod
    def of(cls, by_id: dict[str, Any]) -> Embeddings:
        return cls(list(by_id), list(by_id.values()))


def read_embeddings(
    path: str | os.PathLike[str],
    ids: Sequence[str] | None = None,
    kind: str = "mean",
    layer: int = -1,
) -> Embeddings:
    """``(ids, values)`` from an ``embed`` file, so each row is known by its record: values are
    (n, D) for ``mean``/``bos``, a list of (L_i, D) for ``per_tok``, in the order of ``ids``
    (all records, in file order, when None).

    ``layer`` uses ESM's numbering (-1 = last). ``kind="contacts"`` gives a list of contact
    maps, from ``embed --include contacts`` or from a ``contacts predict`` file.
    """
    src = Path(path).expanduser()
    if not src.is_file():
        raise UserError(f"{src} does not exist or is not a file")
    if isinstance(ids, str):  # one id, not its letters
        ids = [ids]
    try:
        return _read_embeddings(src, ids, kind, layer)
    except (OSError, KeyError, ValueError) as exc:  # truncated or damaged: h5py's own errors
        raise UserError(
            f"{src}: not a readable embeddings file ({str(exc).splitlines()[0][:200]}); it is "
            "truncated or damaged: re-run embed"
        ) from None


def _read_embeddings(src: Path, ids: Sequence[str] | None, kind: str, layer: int) -> Embeddings:
    """:func:`read_embeddings` once the path and ``ids`` are checked."""
    if kind == "contacts":
        import h5py

        from protein_performer.contacts.predict import FORMAT_NAME as CONTACTS
        from protein_performer.contacts.predict import read_contacts, read_maps

        with h5py.File(src, "r") as h5:
            is_contacts_file = h5.attrs.get("format") == CONTACTS
        if is_contacts_file:
            return Embeddings.of(read_contacts(src, ids))
    with _open_embeddings(src) as h5:
        include = parse_json(h5.attrs["include"], f"{src}: attribute include", "re-run embed")
        if not isinstance(include, list):
            raise UserError(f"{src}: attribute include is not a list; re-run embed")
        if kind not in include:
            raise UserError(f"{src} holds {', '.join(include)}, not {kind!r}")
        if kind == "contacts":
            return Embeddings.of(read_maps(h5, src, ids))
        stored = [int(x) for x in h5.attrs["repr_layers"]]
        config = parse_json(h5.attrs["model_config"], f"{src}: model_config", "re-run embed")
        depth = config.get("depth") if isinstance(config, dict) else None
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise UserError(f"{src}: model_config has no valid depth ({depth!r}); re-run embed")
        want = block_number(layer, depth)
        if want not in stored:
            raise UserError(f"{src}: layer {layer} was not saved (layers: {stored})")
        all_ids = read_ids(h5)
        everything = ids is None
        if ids is None:
            ids = all_ids
            rows = np.arange(len(all_ids))
        else:
            lookup = IdLookup(all_ids)
            found = [lookup.find(rid) for rid in ids]
            missing = [rid for rid, n in zip(ids, found, strict=True) if n is None]
            if missing:
                raise UserError(
                    f"{src}: no record(s) {', '.join(missing[:5])} (by id, UniProt accession "
                    "or entry name)"
                )
            rows = np.asarray(found, dtype=np.int64)
            ids = [all_ids[n] for n in rows]
        pooled = kind != "per_tok"
        data = checked_rows(h5, f"{kind}/{want}", len(all_ids) if pooled else None, "f", 2)
        if not pooled:
            lengths = checked_rows(h5, "lengths", len(all_ids), "iu", 1)[:]
            off = checked_offsets(h5, "per_tok_offsets", len(all_ids), data.shape[0], src, lengths)
            return Embeddings(list(ids), [data[int(off[n]) : int(off[n + 1])] for n in rows])
        if everything:
            return Embeddings(all_ids, data[:])
        order = np.argsort(rows, kind="stable")
        unique, inverse = np.unique(rows[order], return_inverse=True)
        picked = data[unique] if len(unique) else np.zeros((0, data.shape[1]), np.float32)
        result = np.empty((len(rows), data.shape[1]), dtype=np.float32)
        result[order] = picked[inverse]
        return Embeddings(list(ids), result)
