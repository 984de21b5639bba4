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

from protein_performer.errors import UserError
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


#: The most a gzip-compressed dataset can expand (zlib's limit is about 1032 to 1).
MAX_INFLATION = 1100


def _unreadable(h5: Any) -> str | None:  # noqa: ANN401 - an open h5py.File
    """Why the file must not be read, or None. HDF5 follows soft and external links, external
    storage and virtual datasets silently, so a crafted file could hand back any readable local
    file as numbers; and a dataset may declare more rows than the file stores (read as fill
    values: a tiny file asking for gigabytes)."""
    import h5py

    found: list[str] = []

    def visit(name: str, link: Any) -> bool | None:  # noqa: ANN401
        if not isinstance(link, h5py.HardLink):
            found.append(f"{name} is a {type(link).__name__}, reading data from outside the file")
            return True
        ds = h5[name]
        if not isinstance(ds, h5py.Dataset):
            return None
        if ds.is_virtual or ds.external:
            how = "virtually" if ds.is_virtual else "externally"
            found.append(f"{name} is stored {how}, reading data from outside the file")
            return True
        declared = int(np.prod(ds.shape, dtype=np.float64) * ds.dtype.itemsize)
        stored = ds.id.get_storage_size()
        if declared > stored * (MAX_INFLATION if ds.compression else 1):
            found.append(
                f"{name} declares shape {ds.shape} ({declared:,} bytes) but the file stores "
                f"{stored:,} bytes of it"
            )
            return True
        return None

    h5.visititems_links(visit)
    return found[0] if found else None


def open_columns(path: Path, what: str, fix: str) -> Any:  # noqa: ANN401 - h5py.File
    """``path`` opened read-only, refused (one ``UserError``) when it is not HDF5, reads from
    outside itself or declares more than it holds (:func:`_unreadable`); ``what`` names the
    kind of file."""
    import h5py

    try:
        h5 = h5py.File(path, "r")
    except OSError as exc:
        raise UserError(f"{path}: not a readable HDF5 file ({exc}); {fix}") from None
    why = _unreadable(h5)
    if why:
        h5.close()
        raise UserError(f"{path}: {why}; a {what} never does: refusing to read it ({fix})")
    return h5


def checked_rows(
    h5: Any,  # noqa: ANN401 - an open h5py.File
    name: str,
    rows: int | None,
    kind: str,
    ndim: int,
) -> Any:  # noqa: ANN401 - h5py.Dataset
    """Dataset ``name`` once its shape (``ndim`` dimensions, ``rows`` rows: one per id, any
    number when None) and
    dtype (numpy ``kind`` letters, e.g. ``"f"``) are what the reader expects: otherwise rows
    would be handed out under the wrong ids, silently."""
    import h5py

    ds = h5.get(name)
    if not isinstance(ds, h5py.Dataset):
        raise UserError(f"{h5.filename}: no dataset {name}: the file is damaged; re-create it")
    if ds.ndim != ndim or (rows is not None and ds.shape[0] != rows) or ds.dtype.kind not in kind:
        raise UserError(
            f"{h5.filename}: {name} has shape {ds.shape} ({ds.dtype}) for {rows} record(s): "
            "the file is damaged or edited; re-create it"
        )
    return ds


def read_ids(h5: Any) -> list[str]:  # noqa: ANN401 - an open h5py.File
    """The ``ids`` column of an open file, as str (refused unless text, one dimension)."""
    import h5py

    ds = h5.get("ids")
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or not h5py.check_string_dtype(ds.dtype):
        what = f"{ds.shape} {ds.dtype}" if isinstance(ds, h5py.Dataset) else "missing"
        raise UserError(
            f"{h5.filename}: ids is not a column of text ({what}): the file is damaged or "
            "edited; re-create it"
        )
    return list(ds.asstr()[:])


def write_columns(
    path: Path,
    layout: Layout,
    attrs: dict[str, Any],
    per_record: dict[str, Any],
    ragged: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]],
) -> int:
    """One file of records (a part of a sharded run), written atomically.

    The file is built in memory (a part is one window) and written with plain file I/O: HDF5
    never meets a full disk, which leaves its library half-closed and crashes the interpreter
    at exit (a segfault after the error line); here ENOSPC is an ordinary, clean error."""
    import io

    import h5py

    image = io.BytesIO()
    with h5py.File(image, "w") as h5:
        cols = ColumnFile(h5, layout, attrs)
        cols.append(per_record, ragged)
        n = cols.finish()
    with atomic_file(path, suffix=".h5") as tmp, open(tmp, "wb") as fh:
        fh.write(image.getbuffer())
    return n


def _check_room(out: Path, sources: Sequence[Path]) -> None:
    """Refuse a merge that cannot fit before HDF5 starts it (see :func:`write_columns`): the
    merged file is about as large as its sources."""
    import shutil

    from protein_performer.io.atomic import disk_full_error

    need = sum(src.stat().st_size for src in sources)
    if need > shutil.disk_usage(out.parent).free:
        raise disk_full_error(out)


def merge_columns(
    out: Path, layout: Layout, attrs: dict[str, Any], sources: Sequence[Path]
) -> int:
    """One file holding every record of ``sources`` (files of this layout), in order;
    written atomically. Returns the number of records."""
    import h5py

    _check_room(output_file(out), sources)
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


def checked_offsets(
    h5: Any,  # noqa: ANN401 - an open h5py.File
    name: str,
    n_records: int,
    total: int,
    where: object,
    sizes: np.ndarray | None = None,
) -> np.ndarray:
    """Column ``name`` of ragged offsets, checked before it slices anything: ``n_records + 1``
    values from 0 up to ``total`` (the data's rows), never decreasing, and record n's span
    equal to ``sizes[n]`` (0 allowed where ``sizes`` is None). A crafted or damaged column
    would otherwise hand out another record's rows, silently."""
    off = np.asarray(h5[name][:])
    if off.ndim != 1 or off.shape[0] != n_records + 1 or not np.issubdtype(off.dtype, np.integer):
        raise UserError(
            f"{where}: {name} has shape {off.shape} ({off.dtype}), expected ({n_records + 1},) "
            "integers: the file is damaged or edited; re-create it"
        )
    spans = np.diff(off.astype(np.int64))
    bad = None
    if n_records and off[0] != 0:
        bad = "does not start at 0"
    elif (spans < 0).any():
        bad = "decreases"
    elif int(off[-1]) > total:
        bad = f"ends at {int(off[-1])}, past the {total} stored rows"
    elif sizes is not None and not np.array_equal(spans, np.asarray(sizes, dtype=np.int64)):
        bad = "disagrees with the record lengths"
    if bad:
        raise UserError(f"{where}: {name} {bad}: the file is damaged or edited; re-create it")
    return off
