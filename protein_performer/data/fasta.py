"""Streaming, validating FASTA(.gz) reader.

The file is read in ~256 KiB blocks cut at record starts (:class:`_Blocks`); each block is
parsed by :func:`_parse_block`, which splits it into records with a few whole-block string
calls and checks every letter of the block at once. Only a record that fails that check is
looked at on its own (:meth:`_Validator.check`), to repair what may be repaired (lower case, a
final stop) or to name its problem with line and column. :func:`read_fasta_blocks` hands out
the valid records a block at a time (what ``preprocess`` consumes); :func:`read_fasta` turns
them into :class:`FastaRecord` objects. :func:`count_lines_and_records` is the one byte scanner
(progress totals, parallel ranges, the line of a file-level error).

Parallel readers (``preprocess --workers``) read a plain file in byte ranges cut at header lines
(``byte_range=..., start_line=..., start_number=...``, with the counts from
:func:`count_lines_and_records`), so records and errors carry whole-file lines and numbers.

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

``-`` as a path is standard input, for every reader here (so for every command that reads
FASTA): it is copied once per process to a temporary file (:mod:`protein_performer.data.stdin`),
because a file-level error is located by re-reading and some callers read twice; errors name it
``<stdin>``. Duplicate ids are found in bounded memory by
:mod:`protein_performer.data.duplicate_ids`.
"""

from __future__ import annotations

import bisect
import gzip
import logging
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from protein_performer.data.duplicate_ids import DuplicateIdChecker
from protein_performer.data.headers import HeaderInfo, parse_header
from protein_performer.data.stdin import STDIN, display_name, stdin_copy
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

log = logging.getLogger(__name__)

OnInvalid = Literal["error", "skip"]
PathLike = str | os.PathLike[str]

# Bytes read per call; a block is this plus the rest of the record it cuts. A block is passed
# over about ten times, so it should stay in a core's L2 cache (1 MiB measured ~25% slower).
_BLOCK = 1 << 18
_NOT_FASTA_AFTER = 1 << 20  # this much text without any header: not a FASTA file
_GZIP_MAGIC = b"\x1f\x8b"
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)
_SKIP_HINT = "use --on-invalid skip to skip such records"
_FILE_HINT = (
    "this is a file-level problem that --on-invalid skip cannot skip; fix or re-create the file"
)
_EMPTY = "header with no sequence (an empty record)"


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
        self.path = display_name(path)
        self.line = line
        self.reason = reason
        self.record_number = record_number
        self.record_id = record_id
        self.kind = kind  # short category, the key of InvalidReport.by_reason
        self.file_level = file_level  # True: on_invalid="skip" cannot skip it
        self.hint = hint if hint is not None else (_FILE_HINT if file_level else _SKIP_HINT)
        super().__init__(f"{self.located}; {self.hint}")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by fields (the keyword-only ones would be lost): workers send it back."""
        keywords = {
            "record_number": self.record_number,
            "record_id": self.record_id,
            "kind": self.kind,
            "file_level": self.file_level,
            "hint": self.hint,
        }
        return _rebuild_error, (self.path, self.line, self.reason, keywords)

    @property
    def located(self) -> str:
        """The message without the hint, as listed in an :class:`InvalidReport`."""
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        if self.record_number is not None:
            where += f": record #{self.record_number} {self.record_id!r}"
        return f"{where}: {self.reason}"


def _rebuild_error(
    path: str, line: int | None, reason: str, keywords: dict[str, Any]
) -> FastaFormatError:
    return FastaFormatError(path, line, reason, **keywords)


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
# Duplicate ids across the files of one read
# --------------------------------------------------------------------------------------------
class DuplicateIds:
    """Duplicate ids across the input files of one read, named by their first occurrence.

    Records are fed in file order (a file's records by increasing record number); the checker
    tags each with an ordinal (the file's start + record number - 1), so an earlier record with
    the same id can be named by file and number.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        self.checker = DuplicateIdChecker()
        self.paths = list(paths)
        self.starts: list[int] = []  # ordinal of record #1 of each file
        self.next_ordinal = 0

    def check(self, file: int, numbers: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """Per record of input ``file`` ((n,) record ``numbers``, id ``hashes`` from
        ``DuplicateIdChecker.hash_ids``), the ordinal of an earlier record with that id or -1."""
        while len(self.starts) <= file:
            self.starts.append(self.next_ordinal)
        if len(numbers) == 0:
            return np.empty(0, dtype=np.int64)
        start = self.starts[file]
        self.next_ordinal = max(self.next_ordinal, start + int(numbers[-1]))
        return self.checker.check_hashes(hashes, numbers + (start - 1))

    def error(
        self, file: int, first: int, number: int, line: int, record_id: str
    ) -> FastaFormatError:
        """The error for record ``number`` of ``file``, whose id record ordinal ``first`` had."""
        f = bisect.bisect_right(self.starts, first) - 1
        path = self.paths[file]
        where = "" if self.paths[f] == path else f" of {display_name(self.paths[f])}"
        return FastaFormatError(
            path,
            line,
            f"duplicate id: record #{first - self.starts[f] + 1}{where} has the same id",
            record_number=number,
            record_id=record_id,
            kind="duplicate id",
        )


# --------------------------------------------------------------------------------------------
# Opening, scanning and block reading
# --------------------------------------------------------------------------------------------
def _open_binary(path: str) -> BinaryIO:
    """Open plain or gzip (by magic bytes) for binary reading, with user-facing errors; ``-``
    opens the copy of standard input."""
    p = Path(stdin_copy() if os.fspath(path) == STDIN else path)
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


def count_lines_and_records(
    path: PathLike, start: int = 0, end: int | None = None
) -> tuple[int, int]:
    """(newlines, header lines) in the (uncompressed) bytes ``start:end`` of a file.

    For a range that starts at 0 or at a header line, these are what the reader adds to its
    line number and record number over the range: the ``start_line``/``start_number`` of the
    next range follow by summing. A gzip break ends the count (the reader reports it).
    """
    newlines = headers = 0
    with _open_binary(os.fspath(path)) as fh:
        prev = b"\n"
        if start > 0:
            fh.seek(start - 1)
            prev = fh.read(1)
        left = None if end is None else end - start
        while left is None or left > 0:
            try:
                chunk = fh.read(4 * _BLOCK if left is None else min(4 * _BLOCK, left))
            except _GZIP_ERRORS:
                break
            if not chunk:
                break
            if left is not None:
                left -= len(chunk)
            arr = np.frombuffer(chunk, np.uint8)  # numpy compares count ~3x faster than bytes
            newlines += int(np.count_nonzero(arr == 10))
            gt = np.flatnonzero(arr == 62)  # '>' is rare outside headers: a sparse check
            if gt.size:
                headers += int(gt[0] == 0 and prev == b"\n")
                gt = gt[gt > 0]
                headers += int(np.count_nonzero(arr[gt - 1] == 10))
            prev = chunk[-1:]
    return newlines, headers


def count_records_and_residues(path: PathLike) -> tuple[int, int]:
    """(records, residue letters) of a FASTA file (gzip too), by a byte scan without parsing:
    a progress bar's total. Letters are the bytes outside header lines other than whitespace
    and ``*``, so a file with invalid records counts those too."""
    records = residues = 0
    in_header, line_start = False, True
    with _open_binary(os.fspath(path)) as fh:
        while True:
            try:
                chunk = fh.read(4 * _BLOCK)
            except _GZIP_ERRORS:
                break
            if not chunk:
                break
            arr = np.frombuffer(chunk, np.uint8)
            newline = np.flatnonzero(arr == 10)
            starts = newline[newline + 1 < arr.size] + 1
            if line_start:
                starts = np.concatenate([[0], starts])
            heads = starts[arr[starts] == 62]  # '>' at a line start
            records += heads.size
            edges = np.zeros(arr.size + 1, np.int32)  # +1 where a header line starts, -1 after
            np.add.at(edges, heads, 1)
            ends = np.searchsorted(newline, heads)
            closed = ends < newline.size  # the others run on into the next chunk
            after = np.full(heads.size, arr.size)
            after[closed] = newline[ends[closed]] + 1
            np.add.at(edges, after, -1)
            if in_header:
                edges[0] += 1
                if newline.size:
                    edges[newline[0] + 1] -= 1
            inside = np.cumsum(edges[:-1]) > 0
            letters = ~np.isin(arr, _NOT_LETTERS)
            residues += int(np.count_nonzero(letters & ~inside))
            in_header = bool(inside[-1]) and arr[-1] != 10
            line_start = arr[-1] == 10
    return records, residues


#: Bytes that are not residues outside a header: whitespace and the stop ``*``.
_NOT_LETTERS = np.frombuffer(b" \t\r\n\v\f*", np.uint8)


class _Blocks:
    """Reads a file in blocks of whole records, checked and decoded.

    Iterating yields each block's text: it starts at a header, holds whole records and has LF
    line ends. Text before the first header is cut off the first block and noted in
    ``leading`` / ``lead_lines``. File-level problems are raised from here, after the complete
    records read before them were yielded; their line is found by re-reading the file up to the
    problem (an error path, so the hot path never counts lines twice). ``on_bytes`` is told the
    number of file bytes (compressed for gzip) consumed after each read.
    """

    def __init__(
        self,
        fh: BinaryIO,
        path: str,
        *,
        base: int = 0,
        limit: int | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.fh = fh
        self.path = path
        self.base = base  # file offset of the first byte read (a byte range's start)
        self.limit = limit  # bytes to read at most (a byte range's length), None: to the end
        self.leading: tuple[int, str] | None = None  # (line, text) before the first header
        self.lead_lines = 0  # newlines cut off the first block (before the first header)
        self.nbytes = 0  # (uncompressed) bytes read so far
        self.on_bytes = on_bytes
        self._raw = getattr(fh, "fileobj", None) or fh  # what the disk gives: compressed bytes
        self._raw_pos = base

    def __iter__(self) -> Iterator[str]:
        size = _BLOCK
        pieces: list[bytes] = []
        buffered = 0
        first = True
        remaining = self.limit
        while True:
            try:
                chunk = self.fh.read(size if remaining is None else min(size, remaining))
            except _GZIP_ERRORS as exc:
                yield from self._broken_gzip(b"".join(pieces), exc, first)
                return
            if not chunk:
                break
            self.nbytes += len(chunk)
            if self.on_bytes is not None:
                pos = self._raw.tell()
                self.on_bytes(pos - self._raw_pos)
                self._raw_pos = pos
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

    def _emit(self, blk: bytes, first: bool, after: int) -> str:
        """Check and decode one block (``after`` bytes were read past it)."""
        nul = blk.find(b"\x00")
        if nul >= 0:
            raise self._binary_error(blk, nul, after, "a NUL byte")
        try:
            text = blk.decode("utf-8")  # ASCII, the usual case, decodes as fast as a copy
        except UnicodeDecodeError as exc:
            raise self._binary_error(
                blk, exc.start, after, f"byte 0x{blk[exc.start]:02x} (not UTF-8 text)"
            ) from None
        if "\r" in text:
            text = text.replace("\r\n", "\n")
        if first and text[:1] != ">":
            start = text.find("\n>") + 1 or len(text)
            lead = text[:start]
            self.lead_lines = lead.count("\n")
            if lead.strip():
                blank = len(lead) - len(lead.lstrip())
                self.leading = (1 + lead.count("\n", 0, blank), lead.strip())
            text = text[start:]
        return text

    def _broken_gzip(self, rest: bytes, exc: Exception, first: bool) -> Iterator[str]:
        """Yield the complete records before a gzip break, then raise a located error."""
        last = rest.rfind(b"\n>") + 1  # start of the record the break cut (0: none complete)
        complete, partial = rest[:last], rest[last:]
        if complete:
            yield self._emit(complete, first, len(partial))
        header_end = partial.find(b"\n")
        newlines, records = count_lines_and_records(self.path, 0, self.nbytes - len(partial))
        line = newlines + 1
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
        newlines, _ = count_lines_and_records(self.path, 0, offset)
        return self._file_error(
            newlines + 1,
            f"binary data: {what} at byte {offset + 1} of the (uncompressed) file; this is "
            "not a FASTA text file or it is damaged",
            kind="binary data",
        )


# --------------------------------------------------------------------------------------------
# Sequence checks and the block parser
# --------------------------------------------------------------------------------------------
class _Validator:
    """Allowed letters (the alphabet's single-character tokens), the whole-block test and the
    per-record check that repairs or locates."""

    def __init__(self, alphabet: Alphabet | None, aligned: bool = False) -> None:
        alphabet = alphabet or Alphabet()
        self.aligned = aligned  # keep case: an A2M/A3M's lower case marks its insertions
        letters = "".join(t for t in alphabet.tokens if len(t) == 1)
        self.letters = letters
        self.allowed = frozenset(letters)
        self.allowed_bytes = letters.encode("ascii")
        self.strip_stop = "*" not in self.allowed
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

    def clean(self, seq: str) -> bool:
        """Whether every letter of ``seq`` is allowed as it stands."""
        return seq.isascii() and not seq.encode("ascii").translate(None, self.allowed_bytes)

    def check(self, seq: str, body: str) -> tuple[str, None] | tuple[None, tuple[int, str, str]]:
        """The sequence of a record whose letters are not all allowed as they stand, or the
        (line offset from its header, kind, reason) of its first problem.

        ``body`` is the text after the header line, ``seq`` its lines joined. Lower case and
        one final '*' are repaired, trailing whitespace on a line and blank lines are ignored;
        anything else is located.
        """
        fixed = seq[:-1] if self.strip_stop and seq[-1:] == "*" else seq
        if fixed and fixed.isascii() and self.clean(fixed.upper()):
            return self._case(fixed), None  # the usual repairs, found without the line scan
        lines = [ln.rstrip() for ln in body.split("\n")]
        found = self._first_problem(lines)
        if found is not None:
            return None, found
        seq = "".join(lines)
        if not seq:
            return None, (0, "empty record", _EMPTY)
        if self.strip_stop and seq[-1] == "*":
            seq = seq[:-1]
            if not seq:
                return None, (0, "empty record", "the sequence is only a stop '*'")
        return self._case(seq), None

    def _case(self, seq: str) -> str:
        """Upper case, or (aligned) the letters as written."""
        return seq if self.aligned else seq.upper()

    def _first_problem(self, lines: list[str]) -> tuple[int, str, str] | None:
        """(line offset from the header, kind, reason) of the first character that is not an
        allowed letter in either case; a '*' that is the very last residue is allowed."""
        last = max((i for i, ln in enumerate(lines) if ln), default=-1)
        for i, ln in enumerate(lines):
            if not ln or (ln.isascii() and self.clean(ln.upper())):
                continue
            for col, ch in enumerate(ln, 1):
                if ch.isascii() and ch.upper() in self.allowed:
                    continue
                if ch == "*" and i == last and col == len(ln):
                    continue
                kind, reason = self._describe(ch)
                return i + 1, kind, f"{reason} at column {col}"
        return None

    def _describe(self, ch: str) -> tuple[str, str]:
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


@dataclass
class RecordBlock:
    """The valid records of one block as parallel lists (as the :class:`FastaRecord` fields),
    and the located errors of its invalid records by record number."""

    path: str
    ids: list[str] = field(default_factory=list)
    descs: list[str] = field(default_factory=list)
    seqs: list[str] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    errors: dict[int, FastaFormatError] = field(default_factory=dict)

    def take(self, idx: list[int]) -> RecordBlock:
        """A block of the records at positions ``idx``."""
        return RecordBlock(
            self.path,
            [self.ids[i] for i in idx],
            [self.descs[i] for i in idx],
            [self.seqs[i] for i in idx],
            [self.numbers[i] for i in idx],
            [self.lines[i] for i in idx],
        )


_first = itemgetter(0)


def _parse_block(
    text: str, number: int, line: int, v: _Validator, path: str
) -> tuple[RecordBlock, int, int]:
    """The records of a block (its first line a header), numbered after ``number`` and with
    header lines counted from ``line``; and how many records and newlines the block had.

    Splitting, joining sequence lines and the letter check each run over the whole block in C;
    only a record whose letters fail that check is looked at on its own.
    """
    chunks = text[1:].split("\n>")  # per record: the header line, then its sequence lines
    m = len(chunks)
    heads, _, bodies = zip(*map(str.partition, chunks, repeat("\n")), strict=True)
    seqs = list(map(str.replace, bodies, repeat("\n"), repeat("")))
    # A record's newlines (after its header, between its sequence lines) are the characters
    # that neither its header nor its joined sequence kept; a header's line follows from them.
    nl = _lengths(chunks, m) - _lengths(heads, m) - _lengths(seqs, m)  # (m,)
    lines = (np.cumsum(nl + 1) - nl - 1 + line).tolist()  # (m,) header lines
    newlines = int(nl.sum()) + m - 1
    parts = list(map(str.split, map(str.rstrip, heads), repeat(None), repeat(1)))
    descs = [p[1] if len(p) > 1 else "" for p in parts]
    numbers = list(range(number + 1, number + m + 1))
    residues = "".join(seqs)
    if (
        residues.isascii()
        and v.all_allowed(residues.encode("ascii"))
        and "" not in seqs
        and [] not in parts
    ):
        ids = list(map(_first, parts))
        return RecordBlock(path, ids, descs, seqs, numbers, lines), m, newlines
    out = RecordBlock(path)
    for k, (p, seq) in enumerate(zip(parts, seqs, strict=True)):
        num, ln = numbers[k], lines[k]
        if not p:
            problem: tuple[int, str, str] | None = (0, "missing id", "the header line has no id")
        elif seq and v.clean(seq):
            problem = None
        else:
            seq, problem = v.check(seq, bodies[k])  # type: ignore[assignment]
        if problem is not None:
            offset, kind, reason = problem
            out.errors[num] = FastaFormatError(
                path,
                ln + offset,
                reason,
                record_number=num,
                record_id=p[0] if p else "",
                kind=kind,
            )
            continue
        out.ids.append(p[0])
        out.descs.append(descs[k])
        out.seqs.append(seq)
        out.numbers.append(num)
        out.lines.append(ln)
    return out, m, newlines


def _lengths(strings: Sequence[str], n: int) -> np.ndarray:
    return np.fromiter(map(len, strings), np.int64, n)


# --------------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------------
def read_fasta_blocks(
    paths: PathLike | Sequence[PathLike],
    *,
    on_invalid: OnInvalid = "error",
    report: InvalidReport | None = None,
    alphabet: Alphabet | None = None,
    check_duplicates: bool = True,
    byte_range: tuple[int, int] | None = None,
    start_line: int = 1,
    start_number: int = 0,
    on_bytes: Callable[[int], None] | None = None,
    aligned: bool = False,
) -> Iterator[RecordBlock]:
    """Stream the valid records of one FASTA(.gz) file, or of several in order, a block at a
    time (see the module docstring); one duplicate-id check spans all the files.

    Errors are raised (or, with ``on_invalid="skip"``, added to ``report``) in file order,
    after the block's valid records before the error were yielded. ``on_bytes(n)`` is called
    as the reader consumes ``n`` more bytes of a file (compressed bytes for gzip): progress.

    ``byte_range=(start, end)`` reads only bytes ``start:end`` of one plain (not gzip) file, for
    parallel readers; ``start`` must be 0 or the start of a header line, and a range should end
    just before one (else its last record is cut). ``start_line`` and ``start_number`` are the
    line number of the range's first byte and the number of records before it (count them with
    :func:`count_lines_and_records`), so lines and record numbers, in records and in errors,
    are those of the whole file. Duplicate ids are then only checked within the range.

    ``aligned=True`` reads the rows of an A2M/A3M alignment (``data.msa``): letters keep their
    case (lower case marks an insertion), ``-`` and ``.`` stay in place (gaps), and ``#`` lines
    before the first record (ColabFold's A3M header) are not text out of place.
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', not {on_invalid!r}")
    single = isinstance(paths, (str, os.PathLike))
    files = [os.fspath(paths)] if single else [os.fspath(p) for p in paths]  # type: ignore[arg-type]
    if byte_range is not None:
        start, end = (int(x) for x in byte_range)
        if not 0 <= start <= end:
            raise ValueError(
                f"byte_range must be (start, end) with 0 <= start <= end, got {byte_range}"
            )
        if len(files) != 1:
            raise ValueError("byte_range applies to one file")
    elif (start_line, start_number) != (1, 0):
        raise ValueError("start_line and start_number only apply with byte_range")
    if start_line < 1 or start_number < 0:
        raise ValueError("start_line must be >= 1 and start_number >= 0")
    reader = _Reader(
        files,
        on_invalid == "skip",
        report,
        _Validator(alphabet, aligned),
        DuplicateIds(files) if check_duplicates else None,
        on_bytes,
    )
    return reader.blocks(byte_range, int(start_line), int(start_number))


def read_fasta(paths: PathLike | Sequence[PathLike], **options: Any) -> Iterator[FastaRecord]:
    """:func:`read_fasta_blocks` (same arguments), one :class:`FastaRecord` at a time."""
    return _records(read_fasta_blocks(paths, **options))


def _records(blocks: Iterator[RecordBlock]) -> Iterator[FastaRecord]:
    for b in blocks:
        yield from map(FastaRecord, b.ids, b.descs, b.seqs, b.numbers, b.lines, repeat(b.path))


class _Reader:
    """One read of one or more files: the report, the duplicate check, the error order."""

    def __init__(
        self,
        paths: list[str],
        skip: bool,
        report: InvalidReport | None,
        validator: _Validator,
        dups: DuplicateIds | None,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        self.paths = paths
        self.skip = skip
        self.own_report = report is None
        self.report = InvalidReport() if report is None else report
        self.validator = validator
        self.dups = dups
        self.on_bytes = on_bytes

    def blocks(
        self, byte_range: tuple[int, int] | None, first_line: int, number: int
    ) -> Iterator[RecordBlock]:
        for file, path in enumerate(self.paths):
            yield from self._file(file, path, byte_range, first_line, number)
        if self.own_report and self.report.skipped:
            log.warning("%s", self.report.summary())

    def _file(
        self, file: int, path: str, byte_range: tuple[int, int] | None, line: int, number: int
    ) -> Iterator[RecordBlock]:
        start, end = byte_range or (0, None)
        with _open_binary(path) as fh:
            if byte_range is not None:
                _seek_range(fh, path, start)
            source = _Blocks(
                fh,
                path,
                base=start,
                limit=None if end is None else end - start,
                on_bytes=self.on_bytes,
            )
            first = True
            for text in source:
                if first:  # text before the first header is reported before any record
                    first = False
                    line += source.lead_lines
                    self._leading(source)
                if not text:
                    continue
                block, count, newlines = _parse_block(text, number, line, self.validator, path)
                number += count
                line += newlines
                yield from self._settle(file, block)
        if number == 0:
            raise FastaFormatError(
                path,
                None,
                "no FASTA records: no line starts with '>'",
                kind="no records",
                file_level=True,
            )

    def _settle(self, file: int, block: RecordBlock) -> Iterator[RecordBlock]:
        """Check the block's ids for duplicates, then yield its valid records and raise (or
        report) its errors in file order."""
        ids, numbers, errors = block.ids, block.numbers, block.errors
        if self.dups is not None and ids:
            nums = np.asarray(numbers, dtype=np.int64)
            firsts = self.dups.check(file, nums, DuplicateIdChecker.hash_ids(ids))
            for i in np.flatnonzero(firsts >= 0).tolist():
                errors[numbers[i]] = self.dups.error(
                    file, int(firsts[i]), numbers[i], block.lines[i], ids[i]
                )
        if not errors:  # the usual case
            if ids:
                yield block
            return
        pending = sorted(errors.items())  # (record number, error), in file order
        if not self.skip:
            before = bisect.bisect_left(numbers, pending[0][0])  # the valid records before it
            if before:
                yield block.take(list(range(before)))
            raise pending[0][1]
        for _num, exc in pending:
            self.report.add(exc)
        keep = [i for i, num in enumerate(numbers) if num not in errors]  # drops duplicates
        if keep:
            yield block if len(keep) == len(ids) else block.take(keep)

    def _leading(self, source: _Blocks) -> None:
        """Text before the first header is skippable (it is not a record) but never silent."""
        if source.leading is None:
            return
        line, lead = source.leading
        if self.validator.aligned and all(ln[:1] in ("#", "") for ln in lead.splitlines()):
            return  # an A3M's comment lines
        snippet = lead.splitlines()[0][:40]
        exc = FastaFormatError(
            source.path,
            line,
            f"text before the first header ({snippet!r}...); FASTA records start with '>'",
            kind="text before first header",
            hint="remove it, or use --on-invalid skip to skip it",
        )
        if not self.skip:
            raise exc
        self.report.add(exc)


def _seek_range(fh: BinaryIO, path: str, start: int) -> None:
    """Position ``fh`` at a byte range's start, which must be 0 or a header line's start."""
    if isinstance(fh, gzip.GzipFile):
        raise ValueError(f"{path}: byte ranges need a plain file, not gzip")
    if start > 0:
        fh.seek(start - 1)
        if fh.read(2) != b"\n>":
            raise ValueError(f"{path}: byte range start {start} is not a header line's start")
    fh.seek(start)
