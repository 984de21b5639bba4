"""One columnar HDF5 writer for every per-record output (embeddings, contact maps).

Why columnar: one group per record (the old embeddings file) costs kilobytes of HDF5 metadata
per record and seconds to walk for 20,000 records; UniRef50 has 65 million. Here a file holds one
array per field, like nanoGPT's ``.bin`` + offsets or fairseq's indexed datasets:

* **per-record** datasets: one row per record, shape (N, ...) (ids, lengths, pooled embeddings);
* **ragged** datasets: the records' values back to back, shape (sum, ...), with one offsets
  array (N+1,) per group of them: record n owns rows ``offsets[n]:offsets[n+1]`` (headers as
  bytes, per-residue embeddings, contact-map values).

Writers append windows of records (one resize per dataset per window), so memory is bounded by
the window; :meth:`ColumnFile.copy_from` appends a whole file of the same layout in slices,
which is how parts of a sharded or resumed run are merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.io.atomic import atomic_file, output_file

#: Bytes per HDF5 chunk: appends and reads stay cheap without a chunk per record.
CHUNK_BYTES = 1 << 18


@dataclass(frozen=True)
class Column:
    """One dataset: its name, numpy dtype (``str`` for UTF-8 text) and row shape."""

    name: str
    dtype: Any
    row: tuple[int, ...] = ()
    gzip: bool = False


@dataclass(frozen=True)
class Layout:
    """The datasets of a file: per-record columns, and ragged columns grouped by offsets."""

    per_record: Sequence[Column]
    ragged: dict[str, Sequence[Column]] = field(default_factory=dict)  # offsets -> columns


class ColumnFile:
    """Appends records to an open, empty ``h5py.File`` laid out as ``layout``."""

    def __init__(self, h5: Any, layout: Layout, attrs: dict[str, Any]) -> None:  # noqa: ANN401
        import h5py

        self.h5, self.layout = h5, layout
        h5.attrs.update(attrs)
        self.ds: dict[str, Any] = {}
        for col in [*layout.per_record, *(c for cols in layout.ragged.values() for c in cols)]:
            dtype = h5py.string_dtype("utf-8") if col.dtype is str else col.dtype
            itemsize = 16 if col.dtype is str else np.dtype(col.dtype).itemsize
            rows = max(64, CHUNK_BYTES // (itemsize * int(np.prod(col.row, dtype=np.int64))))
            self.ds[col.name] = h5.create_dataset(
                col.name,
                shape=(0, *col.row),
                maxshape=(None, *col.row),
                chunks=(rows, *col.row),
                dtype=dtype,
                compression="gzip" if col.gzip else None,
            )
        self.ends: dict[str, int] = {}  # rows written so far per ragged group
        for name in layout.ragged:  # offsets grow on disk, not in memory: 65M records fit
            self.ds[name] = h5.create_dataset(
                name, data=np.zeros(1, np.int64), maxshape=(None,), chunks=(CHUNK_BYTES // 8,)
            )
            self.ends[name] = 0
        self.n = 0

    @staticmethod
    def _extend(ds: Any, values: np.ndarray) -> None:  # noqa: ANN401
        start = ds.shape[0]
        ds.resize(start + len(values), axis=0)
        ds[start:] = values

    def append(
        self,
        per_record: dict[str, Any],
        ragged: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]],
    ) -> None:
        """Add n records: ``per_record`` maps each per-record column to n rows; ``ragged``
        maps each offsets name to (rows per record (n,), {column: the records' rows})."""
        counts = {len(v) for v in per_record.values()}
        if counts == {0}:
            return
        if len(counts) != 1:
            raise ValueError(f"per-record columns of unequal lengths {sorted(counts)}")
        for col in self.layout.per_record:
            values = per_record[col.name]
            self._extend(
                self.ds[col.name],
                np.asarray(values, dtype=object if col.dtype is str else col.dtype),
            )
        for name, cols in self.layout.ragged.items():
            lengths, values = ragged[name]
            ends = self.ends[name] + np.cumsum(np.asarray(lengths, dtype=np.int64))
            self._extend(self.ds[name], ends)
            self.ends[name] = int(ends[-1])
            for col in cols:
                self._extend(self.ds[col.name], values[col.name])
        self.n += counts.pop()

    def copy_from(self, src: Any, step: int = 1 << 16) -> None:  # noqa: ANN401
        """Append every record of an open file of the same layout, ``step`` records at a time."""
        n = len(src[self.layout.per_record[0].name])
        for a in range(0, n, step):
            b = min(n, a + step)
            per_record = {}
            for col in self.layout.per_record:
                ds = src[col.name]
                per_record[col.name] = (ds.asstr() if col.dtype is str else ds)[a:b]
            ragged = {}
            for name, cols in self.layout.ragged.items():
                off = src[name][a : b + 1]
                sl = slice(int(off[0]), int(off[-1]))
                ragged[name] = (np.diff(off), {c.name: src[c.name][sl] for c in cols})
            self.append(per_record, ragged)

    def finish(self) -> int:
        """Record the count of records; returns it."""
        self.h5.attrs["num_records"] = self.n
        return self.n


def read_ids(h5: Any) -> list[str]:  # noqa: ANN401 - an open h5py.File
    """The ``ids`` column of an open file, as str."""
    return list(h5["ids"].asstr()[:])


def write_columns(
    path: Path,
    layout: Layout,
    attrs: dict[str, Any],
    per_record: dict[str, Any],
    ragged: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]],
) -> int:
    """One file of records (a part of a sharded run), written atomically."""
    import h5py

    with atomic_file(path, suffix=".h5") as tmp, h5py.File(tmp, "w") as h5:
        cols = ColumnFile(h5, layout, attrs)
        cols.append(per_record, ragged)
        return cols.finish()


def merge_columns(
    out: Path, layout: Layout, attrs: dict[str, Any], sources: Sequence[Path]
) -> int:
    """One file holding every record of ``sources`` (files of this layout), in order;
    written atomically. Returns the number of records."""
    import h5py

    with atomic_file(output_file(out), suffix=".h5") as tmp, h5py.File(tmp, "w") as h5:
        cols = ColumnFile(h5, layout, attrs)
        for src in sources:
            with h5py.File(src, "r") as part:
                cols.copy_from(part)
        return cols.finish()


def header_column(records: Sequence[Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The ragged ``header_bytes`` of records with ``id`` and ``description``: the FASTA header
    lines (no '>'), UTF-8, back to back (gzip-compressed in the file)."""
    headers = [(f"{r.id} {r.description}" if r.description else r.id).encode() for r in records]
    lengths = np.asarray([len(h) for h in headers], dtype=np.int64)
    return lengths, {"header_bytes": np.frombuffer(b"".join(headers), dtype=np.uint8)}


#: The columns every per-record file starts with (ids, lengths, input positions, headers).
RECORD_COLUMNS = (
    Column("ids", str),
    Column("lengths", np.int64),
    Column("record_numbers", np.int64),
)
HEADER_COLUMNS = {"header_offsets": (Column("header_bytes", np.uint8, gzip=True),)}


def record_columns(records: Sequence[Any]) -> dict[str, Any]:
    """The per-record values of :data:`RECORD_COLUMNS` for records (``id``, ``sequence``,
    ``number``)."""
    return {
        "ids": [r.id for r in records],
        "lengths": np.asarray([len(r.sequence) for r in records], dtype=np.int64),
        "record_numbers": np.asarray([r.number for r in records], dtype=np.int64),
    }
