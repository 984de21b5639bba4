"""The tokenized, memory-mapped record store that training reads.

Layout of a store directory (all binaries raw little-endian, N = number of records)::

    tokens.bin           uint8   (total residues,)  token ids, records back to back, no BOS/EOS
    offsets.bin          <i8     (N + 1,)           record i is tokens[offsets[i]:offsets[i+1]]
    lengths.bin          <i4     (N,)               residues per record (= offsets diff)
    split.bin            uint8   (N,)               0 train, 1 valid, 2 test, 3 ood
    ids.bin              bytes                      record ids, UTF-8, back to back
    ids.offsets.bin      <i8     (N + 1,)
    descriptions.txt     bytes                      the header line after the id, UTF-8,
                                                    one per record, each ending in '\n'
    descriptions.offsets.bin <i8 (N + 1,)
    meta.json                                       format version, counts, vocabulary, inputs

Headers are kept raw (id + description = the header line) and parsed on access
(``TokenStore.header``): lossless, and it keeps the per-record cost of writing at a few list
appends (JSON-encoding every header would cost more than parsing the FASTA does).

Why this shape: nanoGPT-style flat binaries are readable with ``np.memmap`` from any process
(DataLoader workers included) with no per-record Python objects, so a UniRef50-sized corpus
costs constant RAM; offsets give O(1) random access; everything is written in one streaming pass.

The writer builds the store in a temporary sibling directory and renames it into place only when
complete, so a crash never leaves a half-written store under the requested name. Output is a pure
function of the input: no timestamps, no temporary paths, sorted JSON keys.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from protein_performer.data.split import SPLIT_CODES, SPLIT_NAMES
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.io.atomic import (
    disk_full_error,
    exclusive_lock,
    fsync_path,
    is_disk_full,
    make_temp_dir,
    replace_dir,
)
from protein_performer.io.json_safe import read_json

log = logging.getLogger(__name__)

FORMAT_NAME = "protein_performer.token_store"
FORMAT_VERSION = 1

TOKENS = "tokens.bin"
OFFSETS = "offsets.bin"
LENGTHS = "lengths.bin"
SPLIT = "split.bin"
IDS = "ids.bin"
ID_OFFSETS = "ids.offsets.bin"
HEADERS = "descriptions.txt"
HEADER_OFFSETS = "descriptions.offsets.bin"
META = "meta.json"

#: The binary files of a store, in the order of the layout above.
FILES = (TOKENS, OFFSETS, LENGTHS, SPLIT, IDS, ID_OFFSETS, HEADERS, HEADER_OFFSETS)
#: File -> numpy dtype string; stored in meta so other tools can read the store without us.
DTYPES: dict[str, str] = {
    TOKENS: "|u1",
    OFFSETS: "<i8",
    LENGTHS: "<i4",
    SPLIT: "|u1",
    ID_OFFSETS: "<i8",
    HEADER_OFFSETS: "<i8",
}

_BUFFER = 1 << 20  # bytes of OS-level write buffering per output file


def _bad_letter(alphabet: Alphabet, seq: str) -> None:
    """Raise the tokenizer's ValueError naming the first non-vocabulary character."""
    alphabet.encode(seq)
    raise ValueError("sequence holds a character outside the vocabulary")


def _translate_table(alphabet: Alphabet) -> bytes:
    """``bytes.translate`` table: letter byte -> token id, 255 for anything else."""
    table = bytearray(b"\xff" * 256)
    for token, idx in alphabet.tok_to_idx.items():
        if len(token) == 1:
            table[ord(token)] = idx
    return bytes(table)


def _pack(strings: Sequence[str], terminator: str) -> tuple[bytes, np.ndarray]:
    """Concatenate strings (each followed by ``terminator``) as UTF-8, with per-string byte
    lengths (n,) int64; ASCII chunks (the usual case) skip the per-string encode."""
    blob = terminator.join(strings) + (terminator if strings else "")
    extra = len(terminator)
    if blob.isascii():
        lens = np.fromiter(map(len, strings), dtype=np.int64, count=len(strings)) + extra
        return blob.encode("ascii"), lens
    parts = [s.encode("utf-8") for s in strings]
    lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)) + extra
    return blob.encode("utf-8"), lens


def _multiline(headers: Sequence[str]) -> bool:
    """A description with a line break would shift every later line; FASTA cannot produce one, but
    a programmatic caller could."""
    joined = "\n".join(headers)
    return joined.count("\n") != max(len(headers) - 1, 0) or "\r" in joined


def _one_line(header: str) -> str:
    return header.replace("\r", " ").replace("\n", " ")


def _copy_file(src: BinaryIO, dst: BinaryIO, nbytes: int) -> None:
    """Append the first ``nbytes`` of ``src`` to ``dst`` (both buffered file objects)."""
    src.seek(0)
    dst.flush()
    done = 0
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is not None:
        try:
            while done < nbytes:
                step = copy_range(src.fileno(), dst.fileno(), min(nbytes - done, 1 << 30))
                if step == 0:
                    break
                done += step
        except OSError:  # not supported here (old kernel, other file systems): copy below
            pass
        dst.seek(0, os.SEEK_END)  # sync the buffered object with the file position
        src.seek(done)
    while done < nbytes:
        piece = src.read(min(nbytes - done, _BUFFER))
        if not piece:
            raise UserError(f"{src.name} is truncated")
        dst.write(piece)
        done += len(piece)


def _select(blob: bytes, lens: np.ndarray, keep: np.ndarray) -> bytes:
    """The pieces of ``blob`` (back to back, (n,) byte lengths ``lens``) where ``keep``."""
    return np.frombuffer(blob, np.uint8)[np.repeat(keep, lens)].tobytes()


def _dump_json(obj: Any) -> str:
    """Canonical JSON so identical inputs give identical bytes."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


class StoreWriter:
    """Stream records into a new store directory, in bounded memory.

    Each :meth:`write_chunk` (the caller sizes the chunks) is tokenized in one vectorised call
    and appended to the open files; only running totals are kept. Use as a context manager:
    leaving the block by an exception removes the temporary directory; call :meth:`commit` to
    publish the store.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        alphabet: Alphabet | None = None,
    ) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        self.alphabet = alphabet or Alphabet()
        self._table = _translate_table(self.alphabet)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # Held until commit or abort: a second run into the same out gets one line, not a race.
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(exclusive_lock(self.out, "a token store"))
        try:
            check_output_dir(self.out, overwrite)
            self.tmp = make_temp_dir(self.out)  # the umask's mode, named for stale-temp cleanup
        except BaseException:
            self._lock.close()
            raise
        self._files: dict[str, BinaryIO] = {
            name: open(self.tmp / name, "wb", buffering=_BUFFER)  # noqa: SIM115
            for name in FILES
        }
        zero = np.zeros(1, dtype="<i8").tobytes()
        for name in (OFFSETS, ID_OFFSETS, HEADER_OFFSETS):
            self._files[name].write(zero)
        # Running totals (the only state that grows with the corpus is a few integers).
        self.num_records = 0
        self.split_records = np.zeros(len(SPLIT_NAMES), dtype=np.int64)
        self.split_residues = np.zeros(len(SPLIT_NAMES), dtype=np.int64)
        self.max_length = 0
        self._tok_end = 0
        self._id_end = 0
        self._hdr_end = 0
        self._closed = False

    def write_chunk(
        self,
        ids: Sequence[str],
        seqs: Sequence[str],
        splits: Sequence[int],
        descriptions: Sequence[str],
    ) -> None:
        """Tokenize a chunk of records and append it to every file.

        ``seqs`` must hold vocabulary letters only (validated upstream, where the file and line
        are known); a description is the header line after the id. All per-record work happens
        in C (one join, one LUT pass, one cumsum per file), so the caller's loop only appends
        to four lists.
        """
        n = len(ids)
        if n == 0:
            return
        headers = descriptions
        if not (len(seqs) == len(splits) == len(headers) == n):
            raise ValueError("ids, seqs, splits and descriptions must have the same length")
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=n)  # (n,)
        # One bytes.translate over the whole chunk (same mapping as Alphabet.encode, ~10x faster
        # than n small numpy calls); 255 marks a letter outside the vocabulary.
        joined = "".join(seqs)
        if not joined.isascii():
            _bad_letter(self.alphabet, joined)
        tokens = joined.encode("ascii").translate(self._table)  # (sum(lengths),) uint8 ids
        if b"\xff" in tokens:
            _bad_letter(self.alphabet, joined)
        split_arr = np.asarray(splits, dtype=np.uint8)  # (n,)
        if split_arr.size and int(split_arr.max()) >= len(SPLIT_NAMES):
            raise ValueError(f"split codes must be 0..{len(SPLIT_NAMES) - 1}")
        id_blob, id_len = _pack(ids, "")
        hdr_blob, hdr_len = _pack(
            [_one_line(h) for h in headers] if _multiline(headers) else headers, "\n"
        )
        self._append(tokens, lengths, split_arr, id_blob, id_len, hdr_blob, hdr_len)

    def _append(
        self,
        tokens: bytes,
        lengths: np.ndarray,
        split_arr: np.ndarray,
        id_blob: bytes,
        id_len: np.ndarray,
        hdr_blob: bytes,
        hdr_len: np.ndarray,
    ) -> None:
        """Append n encoded records: token bytes with (n,) lengths, (n,) uint8 split codes, id
        and description blobs with (n,) byte lengths (a description's includes its '\\n')."""
        if len(lengths) == 0:
            return
        f = self._files
        f[TOKENS].write(tokens)
        f[IDS].write(id_blob)
        f[HEADERS].write(hdr_blob)
        self._append_index(lengths, split_arr, id_len, hdr_len)

    def _append_index(
        self, lengths: np.ndarray, split_arr: np.ndarray, id_len: np.ndarray, hdr_len: np.ndarray
    ) -> None:
        """The offsets, lengths and split codes of n records whose blobs are (or will be, in
        the same order) appended to the tokens, ids and descriptions files."""
        n = len(lengths)
        if n == 0:
            return
        f = self._files
        f[OFFSETS].write((np.cumsum(lengths) + self._tok_end).astype("<i8").tobytes())
        f[LENGTHS].write(lengths.astype("<i4").tobytes())
        f[SPLIT].write(split_arr.tobytes())
        f[ID_OFFSETS].write((np.cumsum(id_len) + self._id_end).astype("<i8").tobytes())
        f[HEADER_OFFSETS].write((np.cumsum(hdr_len) + self._hdr_end).astype("<i8").tobytes())
        self._tok_end += int(lengths.sum())
        self._id_end += int(id_len.sum())
        self._hdr_end += int(hdr_len.sum())
        self.num_records += n
        k = len(SPLIT_NAMES)
        self.split_records += np.bincount(split_arr, minlength=k)
        self.split_residues += np.bincount(split_arr, weights=lengths, minlength=k).astype(
            np.int64
        )
        self.max_length = max(self.max_length, int(lengths.max()))

    def append_store(
        self,
        src: str | os.PathLike[str],
        keep: np.ndarray | None = None,
        *,
        chunk_records: int = 1 << 16,
    ) -> None:
        """Append the records of the complete store at ``src`` (only those where the (N,) bool
        ``keep`` is True), streamed in chunks: the result is byte-identical to writing the
        same records with :meth:`write_chunk`. Used to concatenate the shards of a parallel
        preprocess; when every record is kept, the three blobs are copied file to file (in
        the kernel where it can) and only the offsets are rebased here."""
        src = Path(src)
        n = int(_read_meta(src)["num_records"])
        if keep is not None and len(keep) != n:
            raise ValueError(f"keep has {len(keep)} entries for a store of {n} records")
        if n == 0:
            return
        whole = keep is None or bool(np.all(keep))
        fh = {name: open(src / name, "rb") for name in FILES}  # noqa: SIM115
        blob_ends = {TOKENS: self._tok_end, IDS: self._id_end, HEADERS: self._hdr_end}
        try:

            def read(name: str, a: int, b: int, itemsize: int = 1) -> bytes:
                fh[name].seek(a * itemsize)
                data = fh[name].read((b - a) * itemsize)
                if len(data) != (b - a) * itemsize:
                    raise UserError(f"{src / name} is truncated")
                return data

            for a in range(0, n, chunk_records):
                b = min(n, a + chunk_records)
                off = np.frombuffer(read(OFFSETS, a, b + 1, 8), "<i8")
                ido = np.frombuffer(read(ID_OFFSETS, a, b + 1, 8), "<i8")
                hdo = np.frombuffer(read(HEADER_OFFSETS, a, b + 1, 8), "<i8")
                lengths, id_len, hdr_len = np.diff(off), np.diff(ido), np.diff(hdo)
                split_arr = np.frombuffer(read(SPLIT, a, b), np.uint8)
                if whole:
                    self._append_index(lengths, split_arr, id_len, hdr_len)
                    continue
                sel = np.asarray(keep[a:b], dtype=bool)  # type: ignore[index]
                self._append(
                    _select(read(TOKENS, int(off[0]), int(off[-1])), lengths, sel),
                    lengths[sel],
                    split_arr[sel],
                    _select(read(IDS, int(ido[0]), int(ido[-1])), id_len, sel),
                    id_len[sel],
                    _select(read(HEADERS, int(hdo[0]), int(hdo[-1])), hdr_len, sel),
                    hdr_len[sel],
                )
            if whole:
                ends = {TOKENS: self._tok_end, IDS: self._id_end, HEADERS: self._hdr_end}
                for name, start in blob_ends.items():
                    _copy_file(fh[name], self._files[name], ends[name] - start)
        finally:
            for f in fh.values():
                f.close()

    def _close_files(self) -> None:
        """Close every file, even when one fails (a full disk fails the final flush): the
        first error is raised after all are closed, so an abort can still remove them."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for fh in self._files.values():
            try:
                fh.close()
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    def commit(self, extra_meta: dict[str, Any] | None = None) -> Path:
        """Finish the files, write ``meta.json`` and atomically move the store into place."""
        self._close_files()
        meta: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "num_records": self.num_records,
            "num_residues": self._tok_end,
            "max_length": self.max_length,
            "splits": {
                name: {
                    "records": int(self.split_records[code]),
                    "residues": int(self.split_residues[code]),
                }
                for code, name in enumerate(SPLIT_NAMES)
            },
            "split_codes": dict(SPLIT_CODES),
            "vocab": list(self.alphabet.tokens),
            "dtypes": dict(DTYPES),
            "files": {
                TOKENS: self._tok_end,
                IDS: self._id_end,
                HEADERS: self._hdr_end,
            },
        }
        if extra_meta:
            clash = set(meta) & set(extra_meta)
            if clash:
                raise ValueError(f"extra_meta may not override {sorted(clash)}")
            meta.update(extra_meta)
        (self.tmp / META).write_text(_dump_json(meta), encoding="utf-8")
        for path in self.tmp.iterdir():
            if path.is_file():
                fsync_path(path)  # on disk before the rename publishes them
        _replace_dir(self.tmp, self.out, self.overwrite)
        self._lock.close()
        log.debug("committed store %s (%d records)", self.out, self.num_records)
        return self.out

    def abort(self) -> None:
        """Drop everything written so far."""
        with contextlib.suppress(OSError):  # the unwritten rest goes with the directory
            self._close_files()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._lock.close()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or self.tmp.exists():
            # Either an error, or the block ended without commit(): nothing is published.
            self.abort()
        if exc is not None and is_disk_full(exc):  # type: ignore[arg-type]
            raise disk_full_error(self.out) from None


def is_store(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` looks like a token store (a directory holding our ``meta.json``)."""
    meta = Path(path) / META
    if not meta.is_file():
        return False
    try:
        return read_json(meta).get("format") == FORMAT_NAME
    except (UserError, AttributeError):
        return False


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse early (before any work) to clobber something the user did not ask to replace."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise UserError(f"{out} exists and is not a directory: choose another --out")
    if not overwrite:
        raise UserError(
            f"{out} already exists: pass --overwrite to replace it, or choose another --out"
        )
    if not is_store(out) and any(out.iterdir()):
        raise UserError(
            f"{out} exists and is not a preprocessed store: refusing to replace it even with "
            "--overwrite; choose another --out or remove it yourself"
        )


def _replace_dir(src: Path, dst: Path, overwrite: bool) -> None:
    """Move ``src`` to ``dst`` (:func:`protein_performer.io.atomic.replace_dir`: an old store is
    exchanged atomically), so ``dst`` is always the complete old or the complete new store."""
    if dst.exists():
        check_output_dir(dst, overwrite)
    try:
        replace_dir(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise UserError(
            f"{dst} already exists: something else created it while this run was working; "
            "pass --overwrite to replace it, or choose another --out"
        ) from None


class TokenStore:
    """Read-only view of a store: O(1) random access through memory-mapped offsets.

    Memory maps are opened lazily and dropped on pickling, so a store handed to DataLoader
    workers reopens its files in each process instead of sharing (or copying) mappings.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = _read_meta(self.path)
        self._num = int(self.meta["num_records"])
        self._check_sizes()
        self._mm: dict[str, np.ndarray] | None = None
        self._indices: dict[str, np.ndarray] = {}
        self._check_index()

    # -- opening -----------------------------------------------------------------------------

    def _check_sizes(self) -> None:
        """Catch truncated or mixed-up files now, with a clear message, not as garbage later."""
        n = self._num
        blob_sizes = {**self.meta.get("files", {}), TOKENS: self.meta["num_residues"]}
        for name in FILES:
            if name in (TOKENS, IDS, HEADERS):  # bytes back to back: meta.json has the size
                size = int(blob_sizes.get(name, -1))
            else:  # one entry per record; the offsets one more
                entries = n if name in (LENGTHS, SPLIT) else n + 1
                size = entries * np.dtype(DTYPES[name]).itemsize
            p = self.path / name
            if not p.is_file():
                raise UserError(
                    f"{self.path} is not a complete store: {name} is missing; re-run "
                    "`protein-performer preprocess`"
                )
            actual = p.stat().st_size
            if actual != size:
                raise UserError(
                    f"{self.path} is corrupt: {name} has {actual} bytes, meta.json expects "
                    f"{size}; re-run `protein-performer preprocess --overwrite`"
                )

    def _corrupt(self, name: str, what: str) -> UserError:
        return UserError(
            f"{self.path} is corrupt: {name} {what}; re-run `protein-performer preprocess "
            "--overwrite` (a store is read as its meta.json describes it)"
        )

    def _check_index(self) -> None:
        """Everything that addresses the blobs, checked once against meta.json (O(records),
        vectorised; the tokens themselves are checked per record as they are read): a crafted
        or damaged store is one line here instead of wrong ids, a fake record injected into
        ``homologs`` output (a description holding a newline) or a traceback later."""
        vocab = self.meta["vocab"]
        if (not isinstance(vocab, list) or not all(isinstance(t, str) for t in vocab)
                or len(set(vocab)) != len(vocab) or not 0 < len(vocab) <= 256):  # fmt: skip
            raise self._corrupt(META, "has no vocabulary of distinct tokens (one byte each)")
        mm = self._open()
        offsets, lengths = mm[OFFSETS], mm[LENGTHS]
        if self._num and (offsets[0] != 0 or offsets[-1] != self.meta["num_residues"]):
            raise self._corrupt(OFFSETS, "does not span tokens.bin")
        if np.any(np.diff(offsets) != lengths):
            raise self._corrupt(LENGTHS, "disagrees with offsets.bin (or holds negative lengths)")
        if self._num and int(np.max(mm[SPLIT])) >= len(SPLIT_NAMES):
            raise self._corrupt(SPLIT, "holds an unknown split code")
        for name, blob, offs in ((ID_OFFSETS, IDS, mm[ID_OFFSETS]),
                                 (HEADER_OFFSETS, HEADERS, mm[HEADER_OFFSETS])):  # fmt: skip
            size = len(mm[blob])
            if offs[0] != 0 or offs[-1] != size or np.any(np.diff(offs) < 0):
                raise self._corrupt(name, f"is not a rising index into {blob}")
        headers, ends = mm[HEADERS], mm[HEADER_OFFSETS][1:]
        if self._num and (np.any(np.diff(mm[HEADER_OFFSETS]) < 1)
                          or np.any(headers[ends - 1] != ord("\n"))):  # fmt: skip
            raise self._corrupt(HEADER_OFFSETS, "does not end each description at a newline")
        for name, allowed_newlines in ((IDS, 0), (HEADERS, self._num)):
            _check_text(mm[name], name, allowed_newlines, self._corrupt)

    def _open(self) -> dict[str, np.ndarray]:
        if self._mm is None:
            mm: dict[str, np.ndarray] = {}
            for name in FILES:
                dtype = np.dtype(DTYPES.get(name, "|u1"))
                p = self.path / name
                if p.stat().st_size == 0:  # mmap cannot map an empty file
                    mm[name] = np.zeros(0, dtype=dtype)
                else:
                    mm[name] = np.memmap(p, dtype=dtype, mode="r")
            self._mm = mm
        return self._mm

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mm"] = None
        state["_indices"] = {}
        return state

    # -- access ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._num

    def _index(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._num
        if not 0 <= i < self._num:
            raise IndexError(f"record index {i} out of range for a store of {self._num}")
        return i

    def tokens(self, i: int) -> np.ndarray:
        """Token ids of record ``i``: (length,) uint8, a private copy (safe to modify/torch);
        a byte outside the vocabulary is one line naming the record."""
        i = self._index(i)
        mm = self._open()
        a, b = mm[OFFSETS][i], mm[OFFSETS][i + 1]
        out = np.array(mm[TOKENS][a:b])
        if len(out) and int(out.max()) >= len(self.meta["vocab"]):
            raise self._corrupt(TOKENS, f"holds token {int(out.max())} in record {i}, outside "
                                f"its vocabulary of {len(self.meta['vocab'])}")  # fmt: skip
        return out

    def length(self, i: int) -> int:
        return int(self._open()[LENGTHS][self._index(i)])

    @property
    def lengths(self) -> np.ndarray:
        """(N,) int32 memmap: lengths for length-bucketed batching without touching tokens."""
        return self._open()[LENGTHS]

    @property
    def offsets(self) -> np.ndarray:
        """(N + 1,) int64 memmap."""
        return self._open()[OFFSETS]

    @property
    def split(self) -> np.ndarray:
        """(N,) uint8 memmap of split codes (0 train, 1 valid, 2 test)."""
        return self._open()[SPLIT]

    def id(self, i: int) -> str:
        i = self._index(i)
        mm = self._open()
        a, b = mm[ID_OFFSETS][i], mm[ID_OFFSETS][i + 1]
        return mm[IDS][a:b].tobytes().decode("utf-8")

    def description(self, i: int) -> str:
        """The header line of record ``i`` after its id ("" when there is none)."""
        i = self._index(i)
        mm = self._open()
        a, b = mm[HEADER_OFFSETS][i], mm[HEADER_OFFSETS][i + 1]
        return mm[HEADERS][a : b - 1].tobytes().decode("utf-8")

    def header_line(self, i: int) -> str:
        """The FASTA header line of record ``i``, without '>'."""
        rid, desc = self.id(i), self.description(i)
        return f"{rid} {desc}" if desc else rid

    def header(self, i: int) -> dict[str, Any]:
        """Structured header fields of record ``i`` (UniProt/UniRef), parsed on access."""
        from protein_performer.data.headers import parse_header

        return parse_header(self.header_line(i)).to_dict()

    def sequence(self, i: int) -> str:
        """Record ``i`` decoded back to letters with the store's own vocabulary."""
        vocab: Sequence[str] = self.meta["vocab"]
        return "".join(vocab[t] for t in self.tokens(i).tolist())

    def indices(self, split: str = "all") -> np.ndarray:
        """(n,) int64 record indices of one split (train, valid, test, ood) or ``all``."""
        name = {"val": "valid", "validation": "valid"}.get(split, split)
        if name not in self._indices:
            if name == "all":
                idx = np.arange(self._num, dtype=np.int64)
            elif name in SPLIT_CODES:
                idx = np.flatnonzero(np.asarray(self.split) == SPLIT_CODES[name]).astype(np.int64)
            else:
                raise ValueError(f"unknown split {split!r}: use train, valid, test, ood or all")
            self._indices[name] = idx
        return self._indices[name]

    def __repr__(self) -> str:
        counts = {k: v["records"] for k, v in self.meta.get("splits", {}).items()}
        return f"TokenStore({str(self.path)!r}, records={self._num}, splits={counts})"


def _check_text(
    blob: np.ndarray, name: str, newlines: int, corrupt: Callable[[str, str], UserError]
) -> None:
    """``blob`` is UTF-8 with exactly ``newlines`` line feeds and no carriage return (ids have
    none, descriptions one each): read in chunks, so a large store costs no large copy."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    counted = 0
    step = 1 << 26
    for start in range(0, len(blob), step):
        chunk = blob[start : start + step].tobytes()
        counted += chunk.count(b"\n")
        if b"\r" in chunk:
            raise corrupt(name, "holds a carriage return")
        if not chunk.isascii():
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError:
                raise corrupt(name, "is not UTF-8") from None
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise corrupt(name, "is not UTF-8") from None
    if counted != newlines:
        raise corrupt(name, f"holds {counted} line break(s), {newlines} expected")


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise UserError(
            f"{path} does not exist: run `protein-performer preprocess ... --out {path}`"
        )
    if not path.is_dir():
        raise UserError(f"{path} is not a directory, so not a preprocessed store")
    meta_path = path / META
    if not meta_path.is_file():
        raise UserError(
            f"{path} is not a preprocessed store (no {META}): run "
            f"`protein-performer preprocess ... --out {path}`"
        )
    meta = read_json(meta_path, fix="re-run preprocess")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise UserError(f"{meta_path} does not describe a protein_performer token store")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise UserError(
            f"{path} has store format version {version!r}, this protein_performer reads version "
            f"{FORMAT_VERSION}: re-run `protein-performer preprocess` with this version"
        )
    for key in ("num_records", "num_residues", "vocab"):
        if key not in meta:
            raise UserError(f"{meta_path} lacks {key!r}: the store is corrupt; re-run preprocess")
    return meta
