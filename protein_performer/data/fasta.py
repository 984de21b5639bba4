"""Streaming, validating FASTA(.gz) reader built on Biopython's ``SimpleFastaParser``.

Biopython parses, but it silently skips text before the first header, deletes spaces inside
sequences and cannot say on which line a record starts. So Biopython iterates a thin line source
(:class:`_BlockSource`) that reads the file in ~1 MiB blocks cut at record boundaries and, once
per block, notes each record's header line, raw length and id. Per record the reader then costs a
few C-level string calls; only a record that fails a check is re-scanned line by line, to name
the exact line and column of the problem.

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
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from hashlib import blake2b
from itertools import chain
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
from Bio.SeqIO.FastaIO import SimpleFastaParser

from protein_performer.data.headers import HeaderInfo, parse_header
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

log = logging.getLogger(__name__)

OnInvalid = Literal["error", "skip"]

_BLOCK = 1 << 20  # bytes read per call; a block is this plus the rest of the record it cuts
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
    _SEED = np.uint64(0x243F6A8885A308D3)
    _M1 = np.uint64(0xBF58476D1CE4E5B9)
    _M2 = np.uint64(0x94D049BB133111EB)

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted uint64 keys, uint32 tags)

    def __len__(self) -> int:
        return sum(len(k) for k, _ in self._runs)

    @classmethod
    def hash_ids(cls, ids: Sequence[str]) -> np.ndarray:
        """uint64 hash per id: 8-byte chunks of the UCS-4 text mixed column by column."""
        arr = np.array(ids, dtype=str)
        width = arr.dtype.itemsize // 4
        if width > 64:  # a few very long ids would make the matrix huge: hash one by one
            digests = [blake2b(i.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                       for i in ids]
            return np.frombuffer(b"".join(digests), dtype=np.uint64)
        if width % 2:
            width += 1
            arr = arr.astype(f"U{width}")
        cols = arr.view(np.uint64).reshape(len(ids), width // 2)
        h = np.full(len(ids), cls._SEED, dtype=np.uint64)
        s29, s31, s27 = np.uint64(29), np.uint64(31), np.uint64(27)
        for j in range(width // 2):
            h ^= cols[:, j]
            h *= cls._M1
            h ^= h >> s29
        h ^= h >> s31  # splitmix64 finaliser
        h *= cls._M2
        h ^= h >> s27
        return h

    def check(self, ids: Sequence[str], tags: np.ndarray | Sequence[int]) -> np.ndarray:
        """Add ids (in order) and return, per id, the tag of an earlier equal id or -1."""
        if len(ids) == 0:
            return np.empty(0, dtype=np.int64)
        keys = self.hash_ids(ids)
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
    """Reads the file in blocks of whole records and feeds their lines to Biopython.

    Each decoded block is appended to ``blocks`` before Biopython sees its first line, so the
    reader can locate every record Biopython yields in the raw text (line numbers, raw length).
    File-level problems are raised from here; their line is found by re-reading the file up to
    the problem (an error path, so the hot path never counts lines twice).
    """

    def __init__(self, fh: BinaryIO, path: str) -> None:
        self.fh = fh
        self.path = path
        self.blocks: deque[str] = deque()
        self.first_start = 0  # offset of the first header in the first block
        self.leading: tuple[int, str] | None = None  # (line, text) before the first header
        self.nbytes = 0  # (uncompressed) bytes read so far

    def lines(self) -> Iterator[str]:
        """Lines for Biopython: TextIOWrapper's C readline, block after block."""
        return chain.from_iterable(self._texts())

    def _texts(self) -> Iterator[io.TextIOWrapper]:
        pieces: list[bytes] = []
        buffered = 0
        first = True
        while True:
            try:
                chunk = self.fh.read(_BLOCK)
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                yield from self._broken_gzip(b"".join(pieces), exc, first)
                return
            if not chunk:
                break
            self.nbytes += len(chunk)
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
                if first and buffered > _BLOCK and pieces[0].lstrip()[:1] != b">":
                    raise self._file_error(
                        1,
                        "no FASTA header (a line starting with '>') in the first "
                        f"{buffered // 1024} KiB: is this a FASTA file?",
                        kind="not FASTA",
                    )
        if pieces:
            yield self._emit(b"".join(pieces), first, 0)
        if self.nbytes == 0:
            raise self._file_error(None, "the file is empty", kind="empty file")

    def _file_error(self, line: int | None, reason: str, kind: str) -> FastaFormatError:
        return FastaFormatError(self.path, line, reason, kind=kind, file_level=True)

    def _emit(self, blk: bytes, first: bool, after: int) -> io.TextIOWrapper:
        """Check and decode one block (``after`` bytes were read past it); queue its text."""
        nul = blk.find(b"\x00")
        if nul >= 0:
            raise self._binary_error(blk, nul, after, "a NUL byte")
        try:
            text = blk.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._binary_error(
                blk, exc.start, after, f"byte 0x{blk[exc.start]:02x} (not UTF-8 text)"
            ) from None
        if "\r" in text:
            text = text.replace("\r\n", "\n")
            blk = blk.replace(b"\r\n", b"\n")
        if first and not text.startswith(">"):
            start = text.find("\n>") + 1 or len(text)
            self.first_start = start
            lead = text[:start]
            if lead.strip():
                blank = len(lead) - len(lead.lstrip())
                self.leading = (1 + lead.count("\n", 0, blank), lead.strip())
        self.blocks.append(text)
        return io.TextIOWrapper(io.BytesIO(blk), encoding="utf-8", newline="\n")

    def _broken_gzip(self, rest: bytes, exc: Exception, first: bool) -> Iterator[io.TextIOWrapper]:
        """Yield the complete records before a gzip break, then raise a located error."""
        last = rest.rfind(b"\n>") + 1  # start of the record the break cut (0: none complete)
        complete, partial = rest[:last], rest[last:]
        if complete:
            yield self._emit(complete, first, len(partial))
        header_end = partial.find(b"\n")
        if partial.startswith(b">"):
            # Biopython yields the last complete record only once it sees the next header.
            yield io.TextIOWrapper(
                io.BytesIO(partial[: header_end + 1 if header_end >= 0 else None]),
                encoding="utf-8",
                errors="replace",
                newline="\n",
            )
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
        offset = self.nbytes - after - len(blk) + pos  # 0-based, in the uncompressed stream
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
) -> Iterator[FastaRecord]:
    """Stream validated records from one FASTA or FASTA.gz file (see the module docstring)."""
    return read_fastas(
        [path],
        on_invalid=on_invalid,
        report=report,
        alphabet=alphabet,
        check_duplicates=check_duplicates,
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
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', not {on_invalid!r}")
    return _read_many(
        [str(p) for p in paths], on_invalid, report, _Validator(alphabet), check_duplicates
    )


def _read_many(
    paths: list[str],
    on_invalid: OnInvalid,
    report: InvalidReport | None,
    validator: _Validator,
    check_duplicates: bool,
) -> Iterator[FastaRecord]:
    own_report = report is None
    if report is None:
        report = InvalidReport()
    dups = _Duplicates(paths) if check_duplicates else None
    for path in paths:
        yield from _read_one(path, on_invalid == "skip", report, validator, dups)
    if own_report and report.skipped:
        log.warning("%s", report.summary())


class _Duplicates:
    """A DuplicateIdChecker across files, fed in batches; names the first occurrence."""

    def __init__(self, paths: list[str]) -> None:
        self.checker = DuplicateIdChecker()
        self.paths = paths
        self.starts: list[int] = []  # checker ordinal of record #1 of each file
        self.next_ordinal = 0

    def start_file(self) -> None:
        self.starts.append(self.next_ordinal)

    def check(self, batch: list[FastaRecord]) -> list[int]:
        """Per record, the ordinal of an earlier record with the same id, or -1."""
        base = self.starts[-1] - 1
        tags = np.fromiter((base + r.number for r in batch), np.int64, len(batch))
        return self.checker.check([r.id for r in batch], tags).tolist()

    def describe(self, ordinal: int, path: str) -> str:
        i = bisect.bisect_right(self.starts, ordinal) - 1
        where = "" if self.paths[i] == path else f" of {self.paths[i]}"
        return f"duplicate id: record #{ordinal - self.starts[i] + 1}{where} has the same id"


_EMPTY = "header with no sequence (an empty record)"
_BATCH = 1024  # records held back at most, so letters and ids are checked in bulk


class _Batch:
    """Records that passed the per-record checks, waiting for the bulk letter and id checks."""

    def __init__(
        self,
        skip: bool,
        report: InvalidReport,
        validator: _Validator,
        dups: _Duplicates | None,
    ) -> None:
        self.skip = skip
        self.report = report
        self.validator = validator
        self.allowed = validator.allowed_bytes
        self.dups = dups
        self.records: list[FastaRecord] = []
        self.where: list[tuple[str, int, int]] = []  # raw (text, start, end) of each record

    def flush(self) -> Iterator[FastaRecord]:
        """Yield the held records minus (or raising at, in file order) the bad ones."""
        records, where = self.records, self.where
        if not records:
            return
        self.records, self.where = [], []
        # One translate over the whole batch: almost always nothing is left and we are done.
        letters_ok = not "".join([r.sequence for r in records]).encode("ascii").translate(
            None, self.allowed
        )
        firsts = self.dups.check(records) if self.dups is not None else None
        if letters_ok and (firsts is None or max(firsts) < 0):
            yield from records
            return
        for i, rec in enumerate(records):
            err = None
            if not letters_ok:
                err = self._normalise(rec, where[i])
            if err is None and firsts is not None and firsts[i] >= 0:
                err = (
                    "duplicate id",
                    self.dups.describe(firsts[i], rec.path),  # type: ignore[union-attr]
                    rec.line,
                )
            if err is None:
                yield rec
                continue
            kind, reason, line = err
            exc = FastaFormatError(
                rec.path, line, reason, record_number=rec.number, record_id=rec.id, kind=kind
            )
            if not self.skip:
                raise exc
            self.report.add(exc)

    def _normalise(self, rec: FastaRecord, where: tuple[str, int, int]) -> tuple | None:
        """Upper-case and strip a final '*' in place; or say what is wrong and where."""
        seq = rec.sequence
        allowed = self.allowed
        raw = seq.encode("ascii")
        if not raw.translate(None, allowed):
            return None
        if raw[-1:] == b"*":
            raw = raw[:-1]
            if not raw:
                return ("empty record", "the sequence is only a stop '*'", rec.line)
        raw = raw.upper()
        if not raw.translate(None, allowed):
            rec.__dict__["sequence"] = raw.decode("ascii")  # still ours: not yet yielded
            return None
        text, start, end = where
        return _locate(self.validator, text, start, end, rec.line) or (
            "invalid character", "invalid character in the sequence", rec.line
        )


def _read_one(
    path: str,
    skip: bool,
    report: InvalidReport,
    validator: _Validator,
    dups: _Duplicates | None,
) -> Iterator[FastaRecord]:
    batch = _Batch(skip, report, validator, dups)
    records, where = batch.records, batch.where
    if dups is not None:
        dups.start_file()
    fh = _open_binary(path)
    with fh:
        source = _BlockSource(fh, path)
        blocks = source.blocks
        text, pos, tlen = "", 0, 0
        number, line = 0, 1
        find = count = text.find
        try:
            for title, seq in SimpleFastaParser(source.lines()):
                if pos >= tlen:  # this record starts the next block
                    text = blocks.popleft()
                    find, count, tlen, pos = text.find, text.count, len(text), 0
                    if number == 0:
                        pos = source.first_start
                        line += count("\n", 0, pos)
                        _leading(source, report, skip)
                # Where the record is in the raw text: its span, header line and line count.
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
                    err = _locate(validator, text, start, pos, rec_line)
                    if err is None and not seq:
                        err = ("empty record", _EMPTY, rec_line)
                elif not seq:
                    err = ("empty record", _EMPTY, rec_line)
                else:
                    err = None
                if err is not None:
                    kind, reason, err_line = err
                    exc = FastaFormatError(
                        path,
                        err_line,
                        reason,
                        record_number=number,
                        record_id=parts[0] if parts else "",
                        kind=kind,
                    )
                    if not skip:
                        yield from batch.flush()  # problems in earlier records come first
                        raise exc
                    report.add(exc)
                    continue
                rec = _new(FastaRecord)  # skips the frozen __init__: 3x cheaper, same object
                d = rec.__dict__
                d["id"] = parts[0]
                d["description"] = parts[1] if len(parts) > 1 else ""
                d["sequence"] = seq  # upper-cased and '*'-stripped by batch.flush() if needed
                d["number"] = number
                d["line"] = rec_line
                d["path"] = path
                records.append(rec)
                where.append((text, start, pos))
                if len(records) >= _BATCH:
                    yield from batch.flush()
                    records, where = batch.records, batch.where
        except FastaFormatError as exc:
            if exc.file_level:  # release the complete records read before, then stop
                yield from batch.flush()
            raise
        yield from batch.flush()
        if number == 0:
            _leading(source, report, skip)
            raise FastaFormatError(
                path,
                None,
                "no FASTA records: no line starts with '>'",
                kind="no records",
                file_level=True,
            )
    if dups is not None:
        dups.next_ordinal += number


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
