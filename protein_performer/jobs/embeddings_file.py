"""The embeddings file ``embed`` writes: its columnar HDF5 layout, the columns of a window of
records (a part, :func:`write_part`), the format check, and :func:`read_embeddings`, its reader
(``protein_performer.read_embeddings``). One array per field, not one group (or one ``.pt``
file) per record, so a file scales to UniRef.

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

Contact maps (``embed --include contacts``) are stored in the columns of a ``contacts predict``
file (:mod:`protein_performer.contacts.map_columns`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from protein_performer.contacts.map_columns import FORMAT_NAME as CONTACTS_FORMAT
from protein_performer.contacts.map_columns import (
    contact_columns,
    contact_ragged,
    read_contacts,
    read_maps,
)
from protein_performer.data.headers import IdLookup
from protein_performer.data.inputs import InputRecord
from protein_performer.errors import UserError, check_format_header
from protein_performer.io.columns import (
    HEADER_COLUMNS,
    RECORD_COLUMNS,
    Column,
    Layout,
    checked_offsets,
    checked_rows,
    header_column,
    open_columns,
    read_ids,
    record_columns,
    write_columns,
)
from protein_performer.io.json_safe import parse_json
from protein_performer.model.config import block_number

FORMAT_NAME = "protein_performer.embeddings"
FORMAT_VERSION = 2
#: Contact maps stored by ``embed --include contacts`` (``contacts predict``'s defaults).
CONTACTS_DTYPE = "float16"
#: The records' sequence digests (N, 16), in parts and merged files.
SEQ_DIGESTS = "sequence_sha256"
#: The per-record columns of every embeddings file and part, before the vectors.
_RECORD_COLUMNS = (*RECORD_COLUMNS, Column(SEQ_DIGESTS, np.uint8, (16,)))


def file_layout(attrs: dict[str, Any]) -> Layout:
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
        ragged.update(contact_ragged(CONTACTS_DTYPE))
    return Layout([*_RECORD_COLUMNS, *pooled], ragged)


def open_embeddings(path: Path) -> Any:  # noqa: ANN401 - h5py.File
    """An embeddings file opened for reading, its format checked (version 1 named as such)."""
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


def write_part(
    path: Path, attrs: dict, records: list[InputRecord], results: list, maps: list
) -> None:
    """One window of records as a part: their record columns, the vectors ``results`` (per
    record, ``{kind: {layer: array}}``) and the contact ``maps`` (empty: none asked)."""
    layout = file_layout(attrs)
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
        ragged.update(contact_columns(maps, CONTACTS_DTYPE))
    write_columns(path, layout, attrs, per_record, ragged)


def sequence_digests(seqs: Sequence[str]) -> np.ndarray:
    """(N, 16) uint8: the first 16 bytes of each sequence's SHA-256."""
    import hashlib

    out = np.zeros((len(seqs), 16), dtype=np.uint8)
    for n, seq in enumerate(seqs):
        out[n] = np.frombuffer(hashlib.sha256(seq.encode()).digest()[:16], dtype=np.uint8)
    return out


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

        with h5py.File(src, "r") as h5:
            is_contacts_file = h5.attrs.get("format") == CONTACTS_FORMAT
        if is_contacts_file:
            return Embeddings.of(read_contacts(src, ids))
    with open_embeddings(src) as h5:
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
