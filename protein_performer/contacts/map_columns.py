"""Contact maps as records and in files: :class:`ContactMap` (one sequence's probabilities), the
ragged columns that hold them in the files of ``contacts predict`` and of ``embed --include
contacts`` alike, and their reader.

A ``contacts predict`` file (:mod:`protein_performer.io.columns`; one array per field)::

    /                 attrs: format, format_version, checkpoint, model_sha256, regression
                             (its JSON), regression_source, dtype, dense_max_length,
                             top_k_per_length, min_separation, num_records
    ids               (N,) utf-8, record ids in input order
    lengths           (N,) int64
    record_numbers    (N,) int64, 1-based position in the input
    header_bytes      (sum,) uint8, gzip: the FASTA header lines (no '>'), back to back;
    header_offsets    (N+1,) int64: record n's header is header_bytes[o[n]:o[n+1]]
    dense_offsets     (N+1,) int64 into dense_values; record n's map is
                      dense_values[o[n]:o[n+1]].reshape(L, L) (empty when sparse)
    dense_values      (sum L^2 of dense records,) probabilities, row-major
    pair_offsets      (N+1,) int64 into pair_i/pair_j/pair_p (empty when dense)
    pair_i, pair_j    int32 residue indices (0-based, i < j); pair_p probabilities,
                      most probable first within a record
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.data.headers import IdLookup
from protein_performer.errors import UserError, check_format_header
from protein_performer.io.columns import (
    HEADER_COLUMNS,
    RECORD_COLUMNS,
    Column,
    Layout,
    checked_offsets,
    checked_rows,
    open_columns,
    read_ids,
)


@dataclass
class ContactMap:
    """Contact probabilities of one sequence (residues 0-based, no BOS/EOS).

    ``dense``: the (L, L) map, symmetric, or None above the dense limit; then ``i``, ``j``
    (i < j) and ``p`` hold the top pairs, most probable first.
    """

    length: int
    dense: np.ndarray | None = None
    i: np.ndarray | None = None
    j: np.ndarray | None = None
    p: np.ndarray | None = None


#: The ``contacts predict`` file: its format name and version; the value types its maps take.
FORMAT_NAME = "protein_performer.contacts"
FORMAT_VERSION = 1
DTYPES = {"float16": np.float16, "float32": np.float32}


def contact_ragged(dtype: str) -> dict[str, tuple[Column, ...]]:
    """The ragged columns of contact maps (``dense_*``, ``pair_*``), in files of
    ``contacts predict`` and of ``embed --include contacts`` alike."""
    values = DTYPES[dtype]
    return {
        "dense_offsets": (Column("dense_values", values),),
        "pair_offsets": (
            Column("pair_i", np.int32),
            Column("pair_j", np.int32),
            Column("pair_p", values),
        ),
    }


def contacts_layout(dtype: str) -> Layout:
    """The columns of a ``contacts predict`` file: the record columns and the maps'."""
    return Layout(RECORD_COLUMNS, {**HEADER_COLUMNS, **contact_ragged(dtype)})


def contact_columns(
    maps: Sequence[ContactMap], dtype: str
) -> dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Records' maps as the ragged values of :func:`contact_ragged` (dense maps row-major)."""
    np_dtype = DTYPES[dtype]
    dense = [m.dense.reshape(-1) for m in maps if m.dense is not None]
    sparse = [m for m in maps if m.dense is None]

    def cat(arrays: list[np.ndarray], dt: Any) -> np.ndarray:  # noqa: ANN401
        return np.concatenate(arrays).astype(dt) if arrays else np.zeros(0, dt)

    return {
        "dense_offsets": (
            np.asarray([0 if m.dense is None else m.dense.size for m in maps]),
            {"dense_values": cat(dense, np_dtype)},
        ),
        "pair_offsets": (
            np.asarray([0 if m.p is None else len(m.p) for m in maps]),
            {
                "pair_i": cat([m.i for m in sparse], np.int32),
                "pair_j": cat([m.j for m in sparse], np.int32),
                "pair_p": cat([m.p for m in sparse], np_dtype),
            },
        ),
    }


def read_contacts(
    path: str | os.PathLike[str], ids: Sequence[str] | None = None
) -> dict[str, ContactMap]:
    """The maps of ``ids`` (all when None) from a ``contacts predict`` file."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise UserError(f"{src} does not exist or is not a file")
    try:
        with open_columns(src, "contacts predict files", "re-run contacts predict") as h5:
            header = {k: h5.attrs.get(k) for k in ("format", "format_version")}
            if header["format_version"] is not None:
                header["format_version"] = int(header["format_version"])
            check_format_header(header, src, FORMAT_NAME, FORMAT_VERSION, "contacts predict file")
            return read_maps(h5, src, ids)
    except (OSError, KeyError, ValueError) as exc:  # truncated or damaged: h5py's own errors
        raise UserError(
            f"{src}: not a readable contacts file ({str(exc).splitlines()[0][:200]}); "
            "it is truncated or damaged: re-run contacts predict"
        ) from None


def read_maps(
    h5: Any,
    path: str | os.PathLike[str],
    ids: Sequence[str] | None = None,  # noqa: ANN401
) -> dict[str, ContactMap]:
    """The maps of ``ids`` (all when None) from an open file with :func:`contact_ragged`."""
    if isinstance(ids, str):  # one id, not its letters
        ids = [ids]
    all_ids = read_ids(h5)
    lookup = IdLookup(all_ids)
    rows = [lookup.find(rid) for rid in ids] if ids is not None else range(len(all_ids))
    missing = [rid for rid, n in zip(ids, rows, strict=True) if n is None] if ids else []
    if missing:
        raise UserError(
            f"{path}: no record(s) {', '.join(missing[:5])} (by id, UniProt accession or entry "
            "name)"
        )
    lengths = np.asarray(h5["lengths"][:], dtype=np.int64)
    if lengths.shape != (len(all_ids),) or (lengths < 0).any():
        raise UserError(f"{path}: lengths do not match the ids: the file is damaged; re-create it")
    count = len(all_ids)
    # Values of the right kind, and the pairs' three columns of one length (a text column
    # would come back as bytes, a short one would misalign the pairs).
    dense = checked_rows(h5, "dense_values", None, "f", 1)
    pair_i = checked_rows(h5, "pair_i", None, "iu", 1)
    for name, kind in (("pair_j", "iu"), ("pair_p", "f")):
        checked_rows(h5, name, len(pair_i), kind, 1)
    doff = checked_offsets(h5, "dense_offsets", count, dense.shape[0], path)
    poff = checked_offsets(h5, "pair_offsets", count, len(pair_i), path)
    dense = np.diff(doff.astype(np.int64))
    if ((dense != 0) & (dense != lengths * lengths)).any():
        raise UserError(f"{path}: dense_offsets disagrees with the record lengths; re-create it")
    out: dict[str, ContactMap] = {}
    for n in rows:
        rid = all_ids[n]
        L = int(lengths[n])
        if doff[n + 1] > doff[n]:
            out[rid] = ContactMap(L, dense=h5["dense_values"][doff[n] : doff[n + 1]].reshape(L, L))
        else:
            sl = slice(int(poff[n]), int(poff[n + 1]))
            out[rid] = ContactMap(L, i=h5["pair_i"][sl], j=h5["pair_j"][sl], p=h5["pair_p"][sl])
    return out
