"""Streaming, validating FASTA(.gz) reader built on Biopython's ``SimpleFastaParser``.

Biopython parses, but it silently skips text before the first header, deletes spaces inside
sequences and cannot say on which line a record starts. So the file is read in ~256 KiB blocks cut
at record boundaries (:class:`_BlockSource`), and each block takes one of two paths:

* fast (:func:`_fast_block`, a clean ASCII block, the usual case): the sequence lines of every
  record are joined in bulk in C (``bytes.replace``/``str.split`` over the whole block), so
  ``SimpleFastaParser`` sees two lines per record; letters are checked for the whole block at
  once, line numbers follow from the line lengths, ids are checked for duplicates per block.
* exact (:func:`_exact_block`, a block with any problem, or with non-ASCII text):
  ``SimpleFastaParser`` iterates the raw lines and each record is located and checked on its
  own, so every problem is named with its exact line and column.

Both paths give the same records and errors (tests compare them on blocks of a few bytes).

Parallel readers (``preprocess --workers``) read a plain file in byte ranges cut at header lines
(``read_fasta(..., byte_range=..., start_line=..., start_number=...)``, with the counts from
:func:`count_lines_and_records`), so records and errors carry whole-file lines and numbers; bulk
consumers take a block of records at a time (:func:`read_fasta_blocks`).

Documented normalisations (nothing else is altered, nothing else is dropped):

* gzip is detected by its magic bytes, not by the file name;
* CRLF line ends become LF; trailing whitespace at the end of a line and blank lines are ignored;
* sequence lines of a record are joined and upper-cased;
* one trailing ``*`` (a stop) is removed; a ``*`` anywhere else is invalid.

Bad records (unknown letter such as ``J``, a digit or space inside a sequence, a header without
sequence, a header without id, a duplicate id) and text before the first header raise
:class:`FastaFormatError`, or with ``on_invalid="skip"`` are skipped and counted in an
:class:`InvalidReport`. File-level problems (missing or empty file, no records, binary data,
invalid UTF-8, truncated or corrupt gzip) always raise.
"""

from __future__ import annotations

import bisect
import gzip
import io
import logging
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from hashlib import blake2b
from itertools import repeat as _repeat
from operator import itemgetter
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
from Bio.SeqIO.FastaIO import SimpleFastaParser

from protein_performer.data.headers import HeaderInfo, parse_header
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

log = logging.getLogger(__name__)

OnInvalid = Literal["error", "skip"]

# Bytes read per call; a block is this plus the rest of the record it cuts. The fast path makes
# about ten passes over a block, so it should stay in a core's L2 cache: 256 KiB measured
# best (1 MiB: ~25% slower; 64 KiB: per-block overhead dominates).
_BLOCK = 1 << 18
_NOT_FASTA_AFTER = 1 << 20  # this much text without any header: not a FASTA file
_GZIP_MAGIC = b"\x1f\x8b"
_SKIP_HINT = "use --on-invalid skip to skip such records"
_FILE_HINT = (
    "this is a file-level problem that --on-invalid skip cannot skip; fix or re-create the file"
)


# --------------------------------------------------------------------------------------------
# Records, errors, report
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FastaRecord:
    """One validated record. ``header`` is parsed on first access (most callers need only id)."""

    id: str
    description: str
    sequence: str  # upper-cased, one trailing '*' stripped
    number: int  # 1-based record number within its file (invalid records count too)
    line: int  # 1-based line number of the header line
    path: str

    @cached_property
    def header(self) -> HeaderInfo:
        """Structured header fields (UniProt / UniRef), see :func:`parse_header`."""
        title = f"{self.id} {self.description}" if self.description else self.id
        return parse_header(title)


_new = object.__new__
_first = itemgetter(0)


class FastaFormatError(UserError):
    """A located problem in a FASTA file: ``<path>:<line>: record #<n> '<id>': <reason>``."""

    def __init__(
        self,
        path: str,
        line: int | None,
        reason: str,
        *,
        record_number: int | None = None,
        record_id: str | None = None,
        kind: str = "invalid record",
        file_level: bool = False,
        hint: str | None = None,
    ) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        self.record_number = record_number
        self.record_id = record_id
        self.kind = kind  # short category, the key of InvalidReport.by_reason
        self.file_level = file_level  # True: on_invalid="skip" cannot skip it
        self.hint = hint if hint is not None else (_FILE_HINT if file_level else _SKIP_HINT)
        super().__init__(f"{self.located}; {self.hint}")

    @property
    def located(self) -> str:
        """The message without the hint, as listed in an :class:`InvalidReport`."""
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        if self.record_number is not None:
            where += f": record #{self.record_number} {self.record_id!r}"
        return f"{where}: {self.reason}"


@dataclass
class InvalidReport:
    """What ``on_invalid="skip"`` skipped: counts per reason and the first located messages."""

    skipped: int = 0  # skipped records (and blocks of text before the first header)
    by_reason: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 10

    def add(self, err: FastaFormatError) -> None:
        self.skipped += 1
        self.by_reason[err.kind] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(err.located)

    def summary(self) -> str:
        """One paragraph for the CLI: total, per reason, then the first examples."""
        if not self.skipped:
            return "no invalid records"
        reasons = ", ".join(f"{n} {kind}" for kind, n in self.by_reason.most_common())
        lines = [f"skipped {self.skipped} invalid record(s): {reasons}"]
        lines += [f"  {ex}" for ex in self.examples]
        if self.skipped > len(self.examples):
            lines.append(f"  ... and {self.skipped - len(self.examples)} more")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Duplicate ids in bounded memory
# --------------------------------------------------------------------------------------------
class DuplicateIdChecker:
    """Finds repeated ids among ~1e8 records in about 12 bytes per id.

    Keeps a 64-bit hash of each id with a uint32 tag (the caller's record ordinal) in a few sorted
    numpy runs, merged like an LSM tree so each id is moved O(log n) times and the newest run stays
    small. The hash is vectorised and deterministic (unlike ``hash()``), so a rerun behaves the
    same. Two different ids with the same 64-bit hash would be reported as duplicates: expected
    about once in 10^4 runs over 60 million ids.
    """

    _MERGE_FACTOR = 4
    _LONG_ID = 64  # characters; longer ids are hashed one by one
    _SEED = np.uint64(0x243F6A8885A308D3)
    _M1 = np.uint64(0xBF58476D1CE4E5B9)
    _M2 = np.uint64(0x94D049BB133111EB)

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted uint64 keys, uint32 tags)

    def __len__(self) -> int:
        return sum(len(k) for k, _ in self._runs)

    @classmethod
    def hash_ids(cls, ids: Sequence[str]) -> np.ndarray:
        """uint64 hash per id, a function of the id alone (not of the batch it came in).

        8-byte words of the UCS-4 text are mixed column by column; a row skips the all-zero
        words, which are the padding up to the batch's longest id (ids hold no NUL). Ids
        longer than ``_LONG_ID`` characters, which would make the matrix huge, are hashed one
        by one with blake2b.
        """
        arr = np.array(ids, dtype=str)
        width = arr.dtype.itemsize // 4
        if width > cls._LONG_ID:
            lens = np.fromiter(map(len, ids), np.int64, len(ids))
            h = np.empty(len(ids), dtype=np.uint64)
            for i in np.flatnonzero(lens > cls._LONG_ID).tolist():
                raw = ids[i].encode("utf-8", "surrogatepass")
                h[i] = np.frombuffer(blake2b(raw, digest_size=8).digest(), np.uint64)[0]
            short = np.flatnonzero(lens <= cls._LONG_ID)
            if short.size:
                h[short] = cls.hash_ids([ids[i] for i in short.tolist()])
            return h
        if width % 2:
            width += 1
            arr = arr.astype(f"U{width}")
        cols = arr.view(np.uint64).reshape(len(ids), width // 2)
        h = np.full(len(ids), cls._SEED, dtype=np.uint64)
        s29, s31, s27 = np.uint64(29), np.uint64(31), np.uint64(27)
        for j in range(width // 2):
            col = cols[:, j]
            x = h ^ col
            x *= cls._M1
            x ^= x >> s29
            h = np.where(col != 0, x, h)
        h ^= h >> s31  # splitmix64 finaliser
        h *= cls._M2
        h ^= h >> s27
        return h

    def check(self, ids: Sequence[str], tags: np.ndarray | Sequence[int]) -> np.ndarray:
        """Add ids (in order) and return, per id, the tag of an earlier equal id or -1."""
        if len(ids) == 0:
            return np.empty(0, dtype=np.int64)
        return self.check_hashes(self.hash_ids(ids), tags)

    def check_hashes(self, keys: np.ndarray, tags: np.ndarray | Sequence[int]) -> np.ndarray:
        """:meth:`check` for ids already hashed with :meth:`hash_ids` ((n,) uint64), e.g. by
        the worker processes of a parallel preprocess."""
        keys = np.asarray(keys, dtype=np.uint64)
        if len(keys) == 0:
            return np.empty(0, dtype=np.int64)
        tags = np.asarray(tags, dtype=np.int64)
        if tags.min() < 0 or tags.max() >= 2**32:
            raise ValueError("DuplicateIdChecker tags must fit in uint32")
        order = np.argsort(keys, kind="stable")  # equal ids keep their input order
        skeys, stags = keys[order], tags[order]
        is_first = np.ones(len(skeys), dtype=bool)
        is_first[1:] = skeys[1:] != skeys[:-1]
        run_start = np.maximum.accumulate(np.where(is_first, np.arange(len(skeys)), 0))
        first_tag = np.where(is_first, -1, stags[run_start])
        for rkeys, rtags in self._runs:  # the first of each run may repeat an earlier call's id
            pos = np.minimum(np.searchsorted(rkeys, skeys), len(rkeys) - 1)
            hit = rkeys[pos] == skeys
            if hit.any():
                first_tag = np.where(hit, rtags[pos].astype(np.int64), first_tag)
        new = is_first & (first_tag < 0)
        if new.any():
            self._runs.append((skeys[new], stags[new].astype(np.uint32)))
            self._compact()
        out = np.empty(len(keys), dtype=np.int64)
        out[order] = first_tag
        return out

    def _compact(self) -> None:
        runs = self._runs
        while len(runs) >= 2 and len(runs[-1][0]) * self._MERGE_FACTOR >= len(runs[-2][0]):
            (k2, t2), (k1, t1) = runs.pop(), runs.pop()
            keys = np.concatenate([k1, k2])
            tags = np.concatenate([t1, t2])
            order = np.argsort(keys, kind="stable")  # timsort: one linear merge of two runs
            runs.append((keys[order], tags[order]))


# --------------------------------------------------------------------------------------------
# Opening and block reading
# --------------------------------------------------------------------------------------------
def _open_binary(path: str) -> BinaryIO:
    """Open plain or gzip (by magic bytes) for binary reading, with user-facing errors."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"no such file: {path}")
    if p.is_dir():
        raise UserError(f"{path} is a directory, expected a FASTA file")
    try:
        fh = open(p, "rb")  # noqa: SIM115 - returned to the caller
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from exc
    if fh.read(2) == _GZIP_MAGIC:
        fh.seek(0)
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    fh.seek(0)
    return fh


class _BlockSource:
    """Reads the file in blocks of whole records, checked and ready for parsing.

    :meth:`blocks` yields ``(data, text)`` per block: ``data`` holds whole records (it starts at
    a header, CRLF already turned into LF) and ``text`` is its decoded text, or ``None`` when the
    block is pure ASCII (then ``data`` is the text). Text before the first header is cut off the
    first block and noted in ``leading`` / ``lead_lines``. File-level problems are raised from
    here, after the complete records read before them were yielded; their line is found by
    re-reading the file up to the problem (an error path, so the hot path never counts lines
    twice).
    """

    def __init__(
        self,
        fh: BinaryIO,
        path: str,
        block_size: int = _BLOCK,
        *,
        base: int = 0,
        limit: int | None = None,
    ) -> None:
        self.fh = fh
        self.path = path
        self.block_size = block_size
        self.base = base  # file offset of the first byte read (a byte range's start)
        self.limit = limit  # bytes to read at most (a byte range's length), None: to the end
        self.leading: tuple[int, str] | None = None  # (line, text) before the first header
        self.lead_lines = 0  # newlines cut off the first block (before the first header)
        self.nbytes = 0  # (uncompressed) bytes read so far

    def blocks(self) -> Iterator[tuple[bytes, str | None]]:
        size = self.block_size
        pieces: list[bytes] = []
        buffered = 0
        first = True
        remaining = self.limit
        while True:
            try:
                chunk = self.fh.read(size if remaining is None else min(size, remaining))
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                yield from self._broken_gzip(b"".join(pieces), exc, first)
                return
            if not chunk:
                break
            self.nbytes += len(chunk)
            if remaining is not None:
                remaining -= len(chunk)
            if pieces and chunk[:1] == b">" and pieces[-1][-1:] == b"\n":
                yield self._emit(b"".join(pieces), first, len(chunk))
                first, pieces, buffered = False, [], 0
            cut = chunk.rfind(b"\n>")
            if cut >= 0:
                pieces.append(chunk[: cut + 1])
                yield self._emit(b"".join(pieces), first, len(chunk) - cut - 1)
                first, pieces, buffered = False, [chunk[cut + 1 :]], len(chunk) - cut - 1
            else:
                pieces.append(chunk)
                buffered += len(chunk)
                if first and buffered > _NOT_FASTA_AFTER and pieces[0].lstrip()[:1] != b">":
                    raise self._file_error(
                        1,
                        "no FASTA header (a line starting with '>') in the first "
                        f"{buffered // 1024} KiB: is this a FASTA file?",
                        kind="not FASTA",
                    )
        if pieces:
            yield self._emit(b"".join(pieces), first, 0)
        if self.nbytes == 0 and self.base == 0:
            raise self._file_error(None, "the file is empty", kind="empty file")

    def _file_error(self, line: int | None, reason: str, kind: str) -> FastaFormatError:
        return FastaFormatError(self.path, line, reason, kind=kind, file_level=True)

    def _emit(self, blk: bytes, first: bool, after: int) -> tuple[bytes, str | None]:
        """Check one block (``after`` bytes were read past it); decode it unless it is ASCII."""
        nul = blk.find(b"\x00")
        if nul >= 0:
            raise self._binary_error(blk, nul, after, "a NUL byte")
        text: str | None = None
        if not blk.isascii():
            try:
                text = blk.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self._binary_error(
                    blk, exc.start, after, f"byte 0x{blk[exc.start]:02x} (not UTF-8 text)"
                ) from None
        if b"\r" in blk:
            blk = blk.replace(b"\r\n", b"\n")
            if text is not None:
                text = text.replace("\r\n", "\n")
        if first and blk[:1] != b">":
            start = blk.find(b"\n>") + 1 or len(blk)
            lead = blk[:start].decode("utf-8")
            self.lead_lines = lead.count("\n")
            if lead.strip():
                blank = len(lead) - len(lead.lstrip())
                self.leading = (1 + lead.count("\n", 0, blank), lead.strip())
            blk = blk[start:]
            if text is not None:
                text = text[len(lead) :]
        return blk, text

    def _broken_gzip(
        self, rest: bytes, exc: Exception, first: bool
    ) -> Iterator[tuple[bytes, str | None]]:
        """Yield the complete records before a gzip break, then raise a located error."""
        last = rest.rfind(b"\n>") + 1  # start of the record the break cut (0: none complete)
        complete, partial = rest[:last], rest[last:]
        if complete:
            yield self._emit(complete, first, len(partial))
        header_end = partial.find(b"\n")
        line, records = _count_until(self.path, self.nbytes - len(partial))
        detail = str(exc) or type(exc).__name__
        where = ""
        if partial.startswith(b">"):
            words = partial[1 : header_end if header_end >= 0 else None].split(None, 1)
            ident = words[0].decode("utf-8", "replace") if words else ""
            where = f" inside record #{records + 1} {ident!r} (header at line {line})"
        raise self._file_error(
            line + partial.count(b"\n"),
            f"gzip data ends early or is corrupt ({detail}){where}; {records} complete "
            "record(s) were read before the break",
            kind="truncated gzip",
        )

    def _binary_error(self, blk: bytes, pos: int, after: int, what: str) -> FastaFormatError:
        offset = self.base + self.nbytes - after - len(blk) + pos  # 0-based, uncompressed
        line, _ = _count_until(self.path, offset)
        return self._file_error(
            line,
            f"binary data: {what} at byte {offset + 1} of the (uncompressed) file; this is "
            "not a FASTA text file or it is damaged",
            kind="binary data",
        )


def _count_until(path: str, offset: int) -> tuple[int, int]:
    """(1-based line number at byte ``offset``, headers before it), by re-reading the file."""
    newlines = headers = 0
    prev = b"\n"
    done = 0
    with _open_binary(path) as fh:
        while done < offset:
            try:
                chunk = fh.read(min(_BLOCK, offset - done))
            except (EOFError, gzip.BadGzipFile, zlib.error):
                break
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            headers += chunk.count(b"\n>") + (prev == b"\n" and chunk[:1] == b">")
            prev = chunk[-1:]
            done += len(chunk)
    return newlines + 1, headers


# --------------------------------------------------------------------------------------------
# Sequence checks
# --------------------------------------------------------------------------------------------
class _Validator:
    """Allowed letters (the alphabet's single-character tokens) and the slow locating scan."""

    def __init__(self, alphabet: Alphabet | None) -> None:
        alphabet = alphabet or Alphabet()
        letters = "".join(t for t in alphabet.tokens if len(t) == 1)
        self.letters = letters
        self.allowed = frozenset(letters)
        self.allowed_bytes = letters.encode("ascii")
        # What normalisation can repair: lower case of an allowed letter and a '*' (a stop).
        fixable = {c.lower() for c in letters} | set(letters) | {"*"}
        self.fixable_bytes = "".join(sorted(fixable)).encode("ascii")
        # A quick sufficient test: every byte is an upper-case letter and none is one of the
        # few upper-case letters not allowed (J for ESM-2); '.', '-' etc. need translate.
        upper = {chr(c) for c in range(65, 91)}
        self.missing_upper = [c.encode("ascii") for c in sorted(upper - self.allowed)]
        self.quick = len(self.missing_upper) <= 4

    def all_allowed(self, residues: bytes) -> bool:
        """Whether every byte is an allowed letter (numpy range test, else ``translate``)."""
        if self.quick:
            arr = np.frombuffer(residues, np.uint8) - np.uint8(65)
            if (arr < 26).all() and not any(c in residues for c in self.missing_upper):
                return True
        return not residues.translate(None, self.allowed_bytes)

    def normalise(
        self, seq: str, text: str, start: int, end: int, line: int
    ) -> tuple[str, tuple[str, str, int] | None]:
        """Upper-case and strip a final '*'; or say what is wrong and where (exact path)."""
        allowed = self.allowed_bytes
        raw = seq.encode("ascii")
        if not raw.translate(None, allowed):
            return seq, None
        if raw[-1:] == b"*":
            raw = raw[:-1]
            if not raw:
                return seq, ("empty record", "the sequence is only a stop '*'", line)
        raw = raw.upper()
        if not raw.translate(None, allowed):
            return raw.decode("ascii"), None
        return seq, _locate(self, text, start, end, line) or (
            "invalid character",
            "invalid character in the sequence",
            line,
        )

    def normalise_all(self, seqs: Sequence[str], bad: bytes) -> list[str] | None:
        """The fast path's :meth:`normalise` of a block whose letters not allowed are ``bad``;
        ``None`` if any record has a problem (the exact path then locates it)."""
        if bad.translate(None, self.fixable_bytes):
            return None
        allowed = self.allowed_bytes
        out = []
        for seq in seqs:
            raw = seq.encode("ascii")
            if raw.translate(None, allowed):
                if raw[-1:] == b"*":
                    raw = raw[:-1]
                raw = raw.upper()
                if not raw or raw.translate(None, allowed):
                    return None
                seq = raw.decode("ascii")
            out.append(seq)
        return out

    def first_problem(self, text: str, start: int, end: int) -> tuple[int, int, str, str] | None:
        """(line offset from header, column, kind, reason) of the first bad character, if any.

        Trailing whitespace on a line is allowed, and so is a '*' that is the very last
        residue of the record.
        """
        raw_lines = text[start:end].split("\n")[1:]
        stripped = [ln.rstrip() for ln in raw_lines]
        last = max((i for i, ln in enumerate(stripped) if ln), default=-1)
        for i, ln in enumerate(stripped):
            if not ln:
                continue
            if ln.isascii() and not ln.upper().encode("ascii").translate(None, self.allowed_bytes):
                continue
            for col, ch in enumerate(ln, 1):
                if ch.upper() in self.allowed:
                    continue
                if ch == "*" and i == last and col == len(ln):
                    continue
                kind, reason = self.describe(ch)
                return i + 1, col, kind, f"{reason} at column {col}"
        return None

    def describe(self, ch: str) -> tuple[str, str]:
        if ch in " \t":
            name = "space" if ch == " " else "tab"
            return "whitespace in sequence", f"{name} inside the sequence"
        if ch.isdigit():
            return "digit in sequence", f"digit {ch!r} inside the sequence"
        if ch == "*":
            return "'*' inside sequence", (
                "'*' before the end of the sequence (only a final stop '*' is allowed)"
            )
        if ch.isascii() and ch.isalpha():
            return "unknown letter", (
                f"unknown letter {ch!r} (allowed: {self.letters} and a final '*')"
            )
        return "invalid character", f"invalid character {ch!r} inside the sequence"


# --------------------------------------------------------------------------------------------
# Public readers
# --------------------------------------------------------------------------------------------
def read_fasta(
    path: str | Path,
    *,
    on_invalid: OnInvalid = "error",
    report: InvalidReport | None = None,
    alphabet: Alphabet | None = None,
    check_duplicates: bool = True,
    byte_range: tuple[int, int] | None = None,
    start_line: int = 1,
    start_number: int = 0,
) -> Iterator[FastaRecord]:
    """Stream validated records from one FASTA or FASTA.gz file (see the module docstring).

    ``byte_range=(start, end)`` reads only bytes ``start:end`` of a plain (not gzip) file, for
    parallel readers; ``start`` must be 0 or the start of a header line, and a range should end
    just before one (else its last record is cut). ``start_line`` and ``start_number`` are the
    line number of the range's first byte and the number of records before it (count them with
    :func:`count_lines_and_records`), so lines and record numbers, in records and in errors,
    are those of the whole file. Duplicate ids are then only checked within the range.
    """
    return _records(
        read_fasta_blocks(
            path,
            on_invalid=on_invalid,
            report=report,
            alphabet=alphabet,
            check_duplicates=check_duplicates,
            byte_range=byte_range,
            start_line=start_line,
            start_number=start_number,
        )
    )


def read_fasta_blocks(
    path: str | Path,
    *,
    on_invalid: OnInvalid = "error",
    report: InvalidReport | None = None,
    alphabet: Alphabet | None = None,
    check_duplicates: bool = True,
    byte_range: tuple[int, int] | None = None,
    start_line: int = 1,
    start_number: int = 0,
) -> Iterator[RecordBlock]:
    """:func:`read_fasta`, a block of valid records at a time (no per-record objects).

    Each :class:`RecordBlock` holds parallel sequences ``ids``, ``descs``, ``seqs``,
    ``numbers`` and ``lines`` (as the :class:`FastaRecord` fields) and ``path``; bulk consumers
    such as ``preprocess`` use it to skip building a ``FastaRecord`` per record. Errors are
    raised (or reported) in the same order as by :func:`read_fasta`, after the block's valid
    records before the error were yielded.
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', not {on_invalid!r}")
    span: _Span | None = None
    if byte_range is not None:
        start, end = (int(x) for x in byte_range)
        if not 0 <= start <= end:
            raise ValueError(
                f"byte_range must be (start, end) with 0 <= start <= end, got {byte_range}"
            )
        span = (start, end, int(start_line), int(start_number))
    elif (start_line, start_number) != (1, 0):
        raise ValueError("start_line and start_number only apply with byte_range")
    if start_line < 1 or start_number < 0:
        raise ValueError("start_line must be >= 1 and start_number >= 0")
    return _read_many(
        [str(path)], on_invalid, report, _Validator(alphabet), check_duplicates, span
    )


def read_fastas(
    paths: Sequence[str | Path],
    *,
    on_invalid: OnInvalid = "error",
    report: InvalidReport | None = None,
    alphabet: Alphabet | None = None,
    check_duplicates: bool = True,
) -> Iterator[FastaRecord]:
    """Stream several files in order; one duplicate-id check spans all of them."""
    return _records(
        read_fastas_blocks(
            paths,
            on_invalid=on_invalid,
            report=report,
            alphabet=alphabet,
            check_duplicates=check_duplicates,
        )
    )


def read_fastas_blocks(
    paths: Sequence[str | Path],
    *,
    on_invalid: OnInvalid = "error",
    report: InvalidReport | None = None,
    alphabet: Alphabet | None = None,
    check_duplicates: bool = True,
) -> Iterator[RecordBlock]:
    """:func:`read_fastas` a block of valid records at a time (see :func:`read_fasta_blocks`)."""
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', not {on_invalid!r}")
    return _read_many(
        [str(p) for p in paths], on_invalid, report, _Validator(alphabet), check_duplicates
    )


# (start, end, line of the first byte, records before it): a byte range of a plain file
_Span = tuple[int, int, int, int]


def _read_many(
    paths: list[str],
    on_invalid: OnInvalid,
    report: InvalidReport | None,
    validator: _Validator,
    check_duplicates: bool,
    span: _Span | None = None,
) -> Iterator[RecordBlock]:
    own_report = report is None
    if report is None:
        report = InvalidReport()
    dups = _Duplicates(paths) if check_duplicates else None
    for path in paths:
        yield from _read_one(path, on_invalid == "skip", report, validator, dups, span)
    if own_report and report.skipped:
        log.warning("%s", report.summary())


def _records(blocks: Iterator[RecordBlock]) -> Iterator[FastaRecord]:
    new, rec_type = _new, FastaRecord
    for block in blocks:
        path = block.path
        for ident, desc, seq, num, ln in zip(
            block.ids, block.descs, block.seqs, block.numbers, block.lines, strict=True
        ):
            rec = new(rec_type)  # skips the frozen __init__: 3x cheaper, same object
            d = rec.__dict__
            d["id"] = ident
            d["description"] = desc
            d["sequence"] = seq
            d["number"] = num
            d["line"] = ln
            d["path"] = path
            yield rec


def count_lines_and_records(
    path: str | Path, start: int = 0, end: int | None = None
) -> tuple[int, int]:
    """(newlines, header lines) in bytes ``start:end`` of a plain file, by a vectorised scan.

    For a range that starts at 0 or at a header line, these are what the reader adds to its
    line number and record number over the range: the ``start_line``/``start_number`` of the
    next range follow by summing.
    """
    newlines = headers = 0
    prev = b"\n" if start == 0 else b""
    with open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            prev = fh.read(1)
        left = None if end is None else end - start
        while left is None or left > 0:
            chunk = fh.read(1 << 20 if left is None else min(1 << 20, left))
            if not chunk:
                break
            if left is not None:
                left -= len(chunk)
            arr = np.frombuffer(chunk, np.uint8)
            newlines += int(np.count_nonzero(arr == 10))
            gt = np.flatnonzero(arr == 62)  # '>' is rare outside headers: a sparse check
            if gt.size:
                head = int(gt[0] == 0 and prev == b"\n")
                gt = gt[gt > 0]
                headers += head + int(np.count_nonzero(arr[gt - 1] == 10))
            prev = chunk[-1:]
    return newlines, headers


class _Duplicates:
    """A DuplicateIdChecker across files, fed one block at a time; names the first occurrence."""

    def __init__(self, paths: list[str]) -> None:
        self.checker = DuplicateIdChecker()
        self.paths = paths
        self.starts: list[int] = []  # checker ordinal of record #1 of each file
        self.next_ordinal = 0

    def start_file(self) -> None:
        self.starts.append(self.next_ordinal)

    def check(self, ids: list[str], numbers: np.ndarray) -> np.ndarray:
        """Per id, the ordinal of an earlier record with the same id, or -1."""
        return self.checker.check(ids, numbers + (self.starts[-1] - 1))

    def describe(self, ordinal: int, path: str) -> str:
        i = bisect.bisect_right(self.starts, ordinal) - 1
        where = "" if self.paths[i] == path else f" of {self.paths[i]}"
        return f"duplicate id: record #{ordinal - self.starts[i] + 1}{where} has the same id"


_EMPTY = "header with no sequence (an empty record)"
_FAST = True  # tests switch the fast path off to compare it with the exact one


class RecordBlock:
    """The records of one block, parsed by Biopython.

    ``ids``/``descs``/``seqs``/``lines`` hold the valid records (``numbers`` their record
    numbers); ``errors`` maps the record number of each invalid record to its located error
    (the duplicate-id check adds its errors; blocks handed out by :func:`read_fasta_blocks`
    hold valid records only).
    """

    __slots__ = (
        "ids",
        "descs",
        "seqs",
        "lines",
        "numbers",
        "errors",
        "count",
        "newlines",
        "path",
    )

    def __init__(self) -> None:
        self.path = ""
        self.ids: list[str] = []
        self.descs: list[str] = []
        self.seqs: Sequence[str] = []
        self.lines: list[int] = []
        self.numbers: list[int] | range = []
        self.errors: dict[int, FastaFormatError] = {}
        self.count = 0  # records in the block, valid or not
        self.newlines = 0  # newlines in the block

    def take(self, idx: slice | list[int]) -> RecordBlock:
        """A block of the records at ``idx`` (a slice or positions)."""
        out = RecordBlock()
        out.path = self.path
        if isinstance(idx, slice):
            out.ids, out.descs = self.ids[idx], self.descs[idx]
            out.seqs, out.lines = list(self.seqs[idx]), self.lines[idx]
            out.numbers = list(self.numbers[idx])
        else:
            out.ids = [self.ids[i] for i in idx]
            out.descs = [self.descs[i] for i in idx]
            out.seqs = [self.seqs[i] for i in idx]
            out.lines = [self.lines[i] for i in idx]
            out.numbers = [self.numbers[i] for i in idx]
        return out


_Block = RecordBlock


_MARKERS = (b"\x01", b"\x02", b"\x03", b"\x04")  # the first one absent from a block is used


def _fast_block(blk: bytes, number: int, line: int, v: _Validator) -> _Block | None:
    """Parse an ASCII block whose records are all valid; ``None`` if any record has a problem.

    Everything per byte happens in C, in bulk. The newline ending each header line and the one
    before each header become a marker byte, every other newline is deleted, and one ``split``
    on the marker gives two lines per record (header, joined sequence), so Biopython's per-line
    loop runs twice per record. Line numbers follow from the line lengths (each deleted newline
    shortens the text by one), letters are checked by one ``translate`` over the block. Any
    problem (empty record, missing id, a character Biopython would drop, a bad letter) sends
    the block to :func:`_exact_block`, which locates it.
    """
    out = _Block()
    n = len(blk)
    if n == 0:
        return out
    mark = next((mk for mk in _MARKERS if mk not in blk), None)
    if mark is None:
        return None
    arr = np.frombuffer(blk, np.uint8)
    gt = np.flatnonzero(arr == 62)  # '>' is rare outside header starts: a sparse scan
    gt = gt[gt > 0]
    pre = gt[arr[gt - 1] == 10] - 1  # the newline before each header but the first
    starts = [0, *(pre + 1).tolist()]  # header starts (the block starts with one)
    m = len(starts)
    ends = np.fromiter(map(blk.find, _repeat(b"\n"), starts), np.int64, m)  # header line ends
    if ends[-1] < 0 or (m > 1 and (ends[:-1] == pre).any()):
        return None  # an empty record
    buf = bytearray(blk)
    marks = np.frombuffer(buf, np.uint8)
    marks[ends] = mark[0]
    marks[pre] = mark[0]
    flat = buf.replace(b"\n", b"")
    lines = flat.decode("ascii").split(mark.decode("ascii"))
    if len(lines) != 2 * m:
        return None
    lens = np.fromiter(map(len, lines), np.int64, 2 * m)
    if lens[1::2].min() == 0:
        return None  # only blank lines after a header
    residues = "".join(lines[1::2]).encode("ascii")
    if not v.all_allowed(residues):
        bad = residues.translate(None, v.allowed_bytes)
        fixed = v.normalise_all(lines[1::2], bad)
        if fixed is None:
            return None
        lines[1::2] = fixed
    try:
        pairs = list(SimpleFastaParser(iter(lines)))
    except IndexError:
        return None
    if len(pairs) != m:
        return None
    titles, seqs = zip(*pairs, strict=True)
    parts = list(map(str.split, titles, _repeat(None), _repeat(1)))
    try:
        out.ids = list(map(_first, parts))
    except IndexError:
        return None  # a header without id
    out.descs = [p[1] if len(p) > 1 else "" for p in parts]
    out.seqs = seqs
    # Newlines before header i: its offset in the block minus its offset in the marked text,
    # plus the 2 * i markers before it.
    flat_starts = np.cumsum(lens + 1)[1:-1:2]
    before = np.empty(m, np.int64)
    before[0] = 0
    before[1:] = pre + 1 - flat_starts + 2 * np.arange(1, m)
    out.lines = (before + line).tolist()
    out.numbers = range(number + 1, number + m + 1)
    out.count = m
    out.newlines = n - len(flat) + 2 * m - 1
    return out


def _exact_block(text: str, number: int, line: int, v: _Validator, path: str) -> _Block:
    """Parse a block record by record, locating every problem to its line and column.

    Biopython iterates the raw lines; each record's span in the text gives its header line and
    raw length, and a record whose sequence is shorter than its raw characters (Biopython
    dropped spaces or CRs) or has bad letters is re-scanned line by line.
    """
    out = _Block()
    ids, descs, seqs, lines = out.ids, out.descs, out.seqs, out.lines
    numbers: list[int] = []
    errors = out.errors
    find, count, tlen = text.find, text.count, len(text)
    pos = 0
    first = number + 1
    for title, seq in SimpleFastaParser(io.StringIO(text, newline="\n")):
        start = pos
        pos = find("\n>", start) + 1 or tlen
        nl = count("\n", start, pos)
        number += 1
        rec_line = line
        line += nl
        parts = title.split(None, 1)
        if not parts:
            err = ("missing id", "the header line has no id", rec_line)
        elif len(seq) != pos - start - nl - len(title) - 1 or not seq.isascii():
            # Raw sequence characters = span - header line - newlines. A mismatch means
            # Biopython dropped spaces or CRs (or the header has trailing blanks).
            err = _locate(v, text, start, pos, rec_line)
            if err is None and not seq:
                err = ("empty record", _EMPTY, rec_line)
        elif not seq:
            err = ("empty record", _EMPTY, rec_line)
        else:
            err = None
        if err is None:
            seq, err = v.normalise(seq, text, start, pos, rec_line)
        if err is not None:
            kind, reason, err_line = err
            errors[number] = FastaFormatError(
                path,
                err_line,
                reason,
                record_number=number,
                record_id=parts[0] if parts else "",
                kind=kind,
            )
            continue
        ids.append(parts[0])
        descs.append(parts[1] if len(parts) > 1 else "")
        seqs.append(seq)
        lines.append(rec_line)
        numbers.append(number)
    out.numbers = numbers
    out.count = number + 1 - first
    out.newlines = count("\n")
    return out


def _read_one(
    path: str,
    skip: bool,
    report: InvalidReport,
    validator: _Validator,
    dups: _Duplicates | None,
    span: _Span | None = None,
) -> Iterator[RecordBlock]:
    if dups is not None:
        dups.start_file()
    start, end, first_line, number = (0, -1, 1, 0) if span is None else span
    fh = _open_binary(path)
    with fh:
        if span is not None:
            _seek_range(fh, path, start)
        source = _BlockSource(
            fh, path, _BLOCK, base=start, limit=None if span is None else end - start
        )
        line = 0  # line number of the current block's first line, once known
        for data, text in source.blocks():
            if line == 0:  # the first block: text before the first header is reported first
                line = first_line + source.lead_lines
                _leading(source, report, skip)
            block = None
            if text is None and _FAST:
                block = _fast_block(data, number, line, validator)
            if block is None:
                text = data.decode("ascii") if text is None else text
                block = _exact_block(text, number, line, validator, path)
            number += block.count
            line += block.newlines
            yield from _settle_block(block, path, skip, report, dups)
        if number == 0:
            raise FastaFormatError(
                path,
                None,
                "no FASTA records: no line starts with '>'",
                kind="no records",
                file_level=True,
            )
    if dups is not None:
        dups.next_ordinal += number


def _seek_range(fh: BinaryIO, path: str, start: int) -> None:
    """Position ``fh`` at a byte range's start, which must be 0 or a header line's start."""
    if isinstance(fh, gzip.GzipFile):
        fh.close()
        raise ValueError(f"{path}: byte ranges need a plain file, not gzip")
    if start > 0:
        fh.seek(start - 1)
        if fh.read(2) != b"\n>":
            fh.close()
            raise ValueError(f"{path}: byte range start {start} is not a header line's start")
    fh.seek(start)


def _settle_block(
    block: RecordBlock,
    path: str,
    skip: bool,
    report: InvalidReport,
    dups: _Duplicates | None,
) -> Iterator[RecordBlock]:
    """Check the block's ids for duplicates, then yield its valid records and raise (or
    report) its errors in file order."""
    block.path = path
    ids, numbers = block.ids, block.numbers
    errors = block.errors
    if dups is not None and ids:
        firsts = dups.check(ids, np.asarray(numbers, dtype=np.int64))
        if firsts.max() >= 0:
            for i in np.flatnonzero(firsts >= 0).tolist():
                num = numbers[i]
                errors[num] = FastaFormatError(
                    path,
                    block.lines[i],
                    dups.describe(int(firsts[i]), path),
                    record_number=num,
                    record_id=ids[i],
                    kind="duplicate id",
                )
    if not errors:  # the usual case
        if ids:
            yield block
        return
    pending = sorted(errors.items())  # (record number, error), in file order
    if not skip:
        before = bisect.bisect_left(numbers, pending[0][0])  # the valid records before it
        if before:
            yield block.take(slice(0, before))
        raise pending[0][1]
    for _num, exc in pending:
        report.add(exc)
    keep = [i for i, num in enumerate(numbers) if num not in errors]  # drops duplicates
    if keep:
        yield block if len(keep) == len(ids) else block.take(keep)


def _locate(
    validator: _Validator, text: str, start: int, end: int, line: int
) -> tuple[str, str, int] | None:
    found = validator.first_problem(text, start, end)
    if found is None:
        return None  # only trailing whitespace: allowed
    offset, _col, kind, reason = found
    return kind, reason, line + offset


def _leading(source: _BlockSource, report: InvalidReport, skip: bool) -> None:
    """Text before the first header is skippable (it is not a record) but never silent."""
    if source.leading is None:
        return
    line, lead = source.leading
    snippet = lead.splitlines()[0][:40]
    exc = FastaFormatError(
        source.path,
        line,
        f"text before the first header ({snippet!r}...); FASTA records start with '>'",
        kind="text before first header",
        hint="remove it, or use --on-invalid skip to skip it",
    )
    if not skip:
        raise exc
    report.add(exc)


def count_records(path: str | Path) -> int:
    """Number of header lines, by scanning bytes (for progress bars; no validation)."""
    n = 0
    prev = b"\n"
    with _open_binary(str(path)) as fh:
        while chunk := fh.read(_BLOCK):
            n += chunk.count(b"\n>") + (prev == b"\n" and chunk[:1] == b">")
            prev = chunk[-1:]
    return n
