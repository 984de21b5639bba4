"""FASTA(.gz) -> tokenized memory-mapped store, in one streaming pass and constant memory.

Reading, validation and header parsing are ``data.fasta``'s job; this module only assigns each
record a split (``data.split``), tokenizes it and appends it to a ``data.store`` writer, plus the
bookkeeping that makes a store reproducible: which inputs it came from (size and a content
fingerprint, never a timestamp) and what was skipped.

With ``workers > 1`` plain files are cut into byte ranges at header lines; worker processes
read, tokenize and write each range to a shard store, and this process checks duplicate ids
across shards (from their id hashes), raises the error that comes first in the input, and
concatenates the shards in order, so the store is byte-identical to a single-process run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.data.duplicate_ids import DuplicateIdChecker
from protein_performer.data.fasta import (
    DuplicateIds,
    FastaFormatError,
    InvalidReport,
    RecordBlock,
    count_lines_and_records,
    read_fasta_blocks,
)
from protein_performer.data.split import (
    DEFAULT_TEST_FRAC,
    DEFAULT_VALID_FRAC,
    SPLIT_NAMES,
    Groups,
    Splitter,
    taxid_of,
)
from protein_performer.data.store import StoreWriter, TokenStore, check_output_dir
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.io.progress import progress as progress_bar

log = logging.getLogger(__name__)

_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of an input file
# Records are handed to the store writer in chunks bounded both ways (memory stays constant
# even for titin-sized records).
_CHUNK_RECORDS = 8192
_CHUNK_RESIDUES = 1 << 23
# The parallel path (byte ranges read by worker processes):
_RANGE_BYTES = 32 << 20  # bytes per range (a worker's unit of work)
_MIN_PARALLEL_BYTES = 128 << 20  # below this, starting processes costs more than it saves
_NOT_FASTA_SCAN = 2 << 20  # > the 1 MiB without a header after which the reader gives up
MAX_DEFAULT_WORKERS = 8
_START_METHOD = "spawn"  # safe whatever the caller's threads (tests use fork for speed)
_HASH_DOC = (
    "blake2b-64 (big-endian) of 'cluster:' + UniRef cluster id, else of the id; "
    "test = lowest test_frac of the hash range, valid = the next valid_frac"
)
_CLUSTER_HASH_DOC = (
    "blake2b-64 (big-endian) of 'mmseqs:' + the record's MMseqs2 cluster representative id; "
    "test = lowest test_frac of the hash range, valid = the next valid_frac"
)
_OOD_DOC = (
    "ood = records whose OX=/TaxID= is in taxa, and the groups (MMseqs2 clusters when "
    "clustered, else the split key) whose blake2b-64 of 'ood:' + group is below frac"
)


@dataclass
class PreprocessSummary:
    """What a preprocessing run produced, for the CLI summary and for tests."""

    out: str
    records: int
    residues: int
    splits: dict[str, int]
    skipped: int
    input_bytes: int
    seconds: float
    skipped_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mb_per_s"] = self.mb_per_s
        return d


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Size plus a blake2b of the first and last MiB: identifies the input without an extra full
    read of a 50 GB file, and without mtimes (which would break byte-identical re-runs)."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as fh:
        h.update(fh.read(_FINGERPRINT_SPAN))
        if size > _FINGERPRINT_SPAN:
            fh.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
            h.update(fh.read(_FINGERPRINT_SPAN))
    return {
        "path": os.fspath(path),
        "size": size,
        "fingerprint": h.hexdigest(),
        "fingerprint_method": "blake2b-128(size, first 1 MiB, last 1 MiB)",
    }


def _report_dict(report: Any) -> dict[str, Any]:
    """JSON-able, deterministic view of the skipped-records report for ``meta.json``."""
    return {
        "skipped": int(report.skipped),
        "by_reason": dict(sorted(report.by_reason.items())),
        "examples": list(report.examples),
    }


def default_workers() -> int:
    """Usable CPUs (affinity-aware), capped at :data:`MAX_DEFAULT_WORKERS`."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_DEFAULT_WORKERS))


def preprocess(
    inputs: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    on_invalid: str = "error",
    valid_frac: float = DEFAULT_VALID_FRAC,
    test_frac: float = DEFAULT_TEST_FRAC,
    split_mode: str = "auto",
    cluster_identity: float | None = None,
    ood_frac: float = 0.0,
    ood_taxa: Sequence[int] = (),
    overwrite: bool = False,
    progress: bool = True,
    alphabet: Alphabet | None = None,
    workers: int = 1,
    _range_bytes: int | None = None,
) -> PreprocessSummary:
    """Stream FASTA(.gz) ``inputs`` into a token store at ``out`` and return a summary.

    ``workers > 1`` reads plain files in byte ranges cut at record starts, in that many worker
    processes (a gzip file is one range: its own worker), and concatenates their shards in
    order: the store, ``meta.json`` included, and every error message are the same as with
    ``workers=1``. Small inputs (one range) are read in this process.

    ``cluster_identity`` clusters the inputs with MMseqs2 first (``data.homology``) and splits
    whole clusters; ``ood_frac`` (of the clusters, or of the split keys without clustering) and
    ``ood_taxa`` (``OX=``/``TaxID=`` values) go to a fourth split, ``ood``, that training never
    reads. All of it is recorded under ``split`` in ``meta.json``.

    Raises ``UserError`` (nothing is written under ``out``) for bad arguments, bad input in
    ``on_invalid="error"`` mode, or an input without a single valid record.
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise UserError("no input FASTA given")
    for p in paths:
        if not p.is_file():
            raise UserError(f"{p}: no such file (expected a FASTA or FASTA.gz file)")
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    if int(workers) < 1:
        raise UserError(f"workers must be >= 1, got {workers}")
    Splitter(valid_frac, test_frac, split_mode, Groups(ood_frac=ood_frac))  # validates all
    if ood_frac + valid_frac + test_frac >= 1.0:
        raise UserError(
            f"ood_frac + valid_frac + test_frac must be < 1 (got {ood_frac} + {valid_frac} + "
            f"{test_frac}): nothing would be left for training"
        )
    out = Path(out)
    check_output_dir(out, overwrite)
    alphabet = alphabet or Alphabet()

    t0 = time.perf_counter()
    split_meta: dict[str, Any] = {
        "mode": split_mode,
        "valid_frac": valid_frac,
        "test_frac": test_frac,
        "hash": _HASH_DOC,
    }
    clusters = None
    if cluster_identity is not None:
        from protein_performer.data.homology import cluster_sequences

        clusters, split_meta["clusters"] = cluster_sequences(
            paths, cluster_identity, workers, on_invalid
        )
        if split_mode != "id":
            split_meta["hash"] = _CLUSTER_HASH_DOC
    if ood_frac > 0 or ood_taxa:
        split_meta["ood"] = {"frac": ood_frac, "taxa": sorted(set(ood_taxa)), "rule": _OOD_DOC}
    groups = Groups(clusters, ood_frac, frozenset(int(t) for t in ood_taxa))
    splitter = Splitter(valid_frac, test_frac, split_mode, groups)
    inputs_meta = [file_fingerprint(p) for p in paths]
    report = _KeyedReport()
    total_bytes = sum(p.stat().st_size for p in paths)
    bar = progress_bar(total_bytes, "B", "preprocess", enabled=progress)
    try:
        with StoreWriter(out, overwrite=overwrite, alphabet=alphabet) as writer:
            ranges = None
            if int(workers) > 1:
                ranges = _plan_ranges(paths, _range_bytes or _RANGE_BYTES, _range_bytes is None)
            if ranges is None:
                _run_serial(paths, writer, splitter, on_invalid, report, alphabet, bar)
            else:
                job = _Job(on_invalid, valid_frac, test_frac, split_mode, alphabet, groups)
                _run_parallel(paths, ranges, int(workers), job, writer, report, bar)
            report.finish()
            skipped = int(report.skipped)
            if writer.num_records == 0:
                what = f" ({skipped} invalid records skipped)" if skipped else ""
                raise UserError(
                    f"no valid records in {', '.join(map(os.fspath, paths))}{what}: "
                    "nothing to preprocess"
                )
            writer.commit(
                {
                    "split": split_meta,
                    "inputs": inputs_meta,
                    "on_invalid": on_invalid,
                    "invalid": _report_dict(report),
                }
            )
            summary = PreprocessSummary(
                out=os.fspath(out),
                records=writer.num_records,
                residues=int(writer.split_residues.sum()),
                splits={name: int(writer.split_records[i]) for i, name in enumerate(SPLIT_NAMES)},
                skipped=skipped,
                input_bytes=total_bytes,
                seconds=0.0,
                skipped_reasons=dict(sorted(report.by_reason.items())),
            )
    finally:
        bar.update(total_bytes - bar.n)
        bar.close()
    summary.seconds = time.perf_counter() - t0
    if summary.skipped:
        log.warning("skipped %d invalid records (see meta.json 'invalid')", summary.skipped)
    if ood_taxa and summary.splits.get("ood", 0) == 0:
        log.warning("%s", _no_taxa_held_out(out, ood_taxa))
    return summary


def _no_taxa_held_out(out: str | os.PathLike[str], ood_taxa: Sequence[int]) -> str:
    """Why ``--ood-taxa`` held out nothing: no header carries a taxon, or none of those asked."""
    store = TokenStore(out)
    tagged = any(taxid_of(store.description(i)) is not None for i in range(len(store)))
    asked = ",".join(str(t) for t in sorted(set(ood_taxa)))
    if not tagged:
        return (
            f"--ood-taxa {asked} held out nothing: no record's header carries a taxon (OX= or "
            "TaxID=, as UniProt and UniRef headers do); the ood split is empty"
        )
    return f"--ood-taxa {asked} held out nothing: no record is of these taxa"


def _chunks(blocks: Iterable[RecordBlock]) -> Iterator[RecordBlock]:
    """The reader's blocks of valid records merged into chunks of about
    :data:`_CHUNK_RECORDS` records / :data:`_CHUNK_RESIDUES` residues (list extends per block:
    no per-record Python work here). When the reader raises, the records before the error
    come out first (a duplicate among them is the earlier error)."""
    chunk = RecordBlock("")
    residues = 0
    try:
        for block in blocks:
            chunk.path = block.path
            chunk.ids += block.ids
            chunk.descs += block.descs
            chunk.seqs += block.seqs
            chunk.numbers += block.numbers
            chunk.lines += block.lines
            residues += sum(map(len, block.seqs))
            if residues >= _CHUNK_RESIDUES or len(chunk.ids) >= _CHUNK_RECORDS:
                yield chunk
                chunk, residues = RecordBlock(block.path), 0
    except UserError:
        if chunk.ids:
            yield chunk
        raise
    if chunk.ids:
        yield chunk


@dataclass
class _KeyedReport(InvalidReport):
    """The skipped-records report, with examples kept by position in the input (input file,
    record number; 0 for text before the first header) and put in that order by
    :meth:`finish`: duplicate ids are found a chunk (or a shard) after the reader reported the
    errors around them."""

    file: int = 0  # the input being read: set by the caller before reading it
    keyed: list[tuple[tuple[int, int], str]] = field(default_factory=list)

    def add(self, err: FastaFormatError) -> None:
        self.skipped += 1
        self.by_reason[err.kind] += 1
        self.note((self.file, err.record_number or 0), err.located)

    def note(self, key: tuple[int, int], text: str) -> None:
        self.keyed.append((key, text))
        if len(self.keyed) > 4 * self.max_examples:
            self._trim()

    def _trim(self) -> None:
        self.keyed.sort(key=itemgetter(0))
        del self.keyed[self.max_examples :]

    def finish(self) -> None:
        self._trim()
        self.examples = [text for _, text in self.keyed]


class _DuplicateCheck:
    """Duplicate ids across all inputs (:class:`DuplicateIds`), checked a chunk at a time in
    input order from id hashes: what the serial path and the merge of shards both do."""

    def __init__(self, paths: list[Path], skip: bool, report: _KeyedReport) -> None:
        self.ids = DuplicateIds([os.fspath(p) for p in paths])
        self.skip = skip
        self.report = report

    def keep(
        self,
        file: int,
        numbers: np.ndarray,
        hashes: np.ndarray,
        lines: Sequence[int],
        id_of: Any,
    ) -> np.ndarray | None:
        """Keep-mask for the next valid records of input ``file`` ((n,) record ``numbers``,
        id ``hashes``, header ``lines``; ``id_of(i)`` the id of record i), None to keep all.
        A duplicate raises in error mode (callers check every record before raising a later
        error) and is counted and left out in skip mode."""
        firsts = self.ids.check(file, numbers, hashes)
        dups = np.flatnonzero(firsts >= 0).tolist()
        if not dups:
            return None

        def error(i: int) -> FastaFormatError:
            return self.ids.error(file, int(firsts[i]), int(numbers[i]), int(lines[i]), id_of(i))

        if not self.skip:
            raise error(dups[0])
        rep = self.report
        rep.skipped += len(dups)
        rep.by_reason["duplicate id"] += len(dups)
        for i in dups[: rep.max_examples]:
            rep.note((file, int(numbers[i])), error(i).located)
        keep = np.ones(len(numbers), dtype=bool)
        keep[dups] = False
        return keep


def _run_serial(
    paths: list[Path],
    writer: StoreWriter,
    splitter: Splitter,
    on_invalid: str,
    report: _KeyedReport,
    alphabet: Alphabet,
    bar: Any,
) -> None:
    """The single-process path: the reader per file, duplicate ids checked per chunk (a
    vectorised check of thousands of ids, not one per 256 KiB block)."""
    dups = _DuplicateCheck(paths, on_invalid == "skip", report)
    for file, path in enumerate(paths):
        report.file = file
        blocks = read_fasta_blocks(
            path,
            on_invalid=on_invalid,  # type: ignore[arg-type]
            report=report,
            alphabet=alphabet,
            check_duplicates=False,
            on_bytes=bar.update,
        )
        for chunk in _chunks(blocks):
            nums = np.asarray(chunk.numbers, dtype=np.int64)
            hashes = DuplicateIdChecker.hash_ids(chunk.ids)
            keep = dups.keep(file, nums, hashes, chunk.lines, chunk.ids.__getitem__)
            if keep is not None:
                chunk = chunk.take(np.flatnonzero(keep).tolist())
            writer.write_chunk(
                chunk.ids, chunk.seqs, splitter.codes(chunk.ids, chunk.descs), chunk.descs
            )


# --------------------------------------------------------------------------------------------
# Parallel path: byte ranges -> shards in worker processes -> concatenated in order
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Range:
    """Bytes ``start:end`` of input ``file`` (``end`` None: the whole file, e.g. gzip), with
    the line number of its first byte and the number of records before it."""

    file: int
    path: str
    start: int = 0
    end: int | None = None
    line: int = 1
    number: int = 0


@dataclass(frozen=True)
class _Job:
    """What every worker needs besides its range (pickled to spawned processes)."""

    on_invalid: str
    valid_frac: float
    test_frac: float
    split_mode: str
    alphabet: Alphabet
    groups: Groups


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _cuts(path: Path, size: int, range_bytes: int) -> list[int]:
    """Range starts after 0: the first record start at or after each multiple of
    ``range_bytes`` (and after the file's first header, so range 0 holds every byte before
    it); ``[]`` for a file that fits one range."""
    cuts: list[int] = []
    with open(path, "rb") as fh:
        data = fh.read(_NOT_FASTA_SCAN)
        first = 0 if data[:1] == b">" else data.find(b"\n>") + 1
        if first == 0 and data[:1] != b">":
            return []  # no header near the start: one range, the reader explains
        target = max(range_bytes, first + 1)
        while target < size:
            fh.seek(target - 1)  # a header starting exactly at target counts
            pos, tail = target - 1, b""
            found = -1
            while found < 0:
                piece = fh.read(1 << 16)
                if not piece:
                    break
                buf = tail + piece
                found = buf.find(b"\n>")
                if found < 0:
                    pos += len(buf) - 1
                    tail = buf[-1:]
                else:
                    found += pos + 1  # file offset of the '>'
            if found < 0:
                break
            cuts.append(found)
            target = max(found + 1, target + range_bytes)
    return cuts


def _plan_ranges(paths: list[Path], range_bytes: int, auto: bool) -> list[_Range] | None:
    """Cut plain inputs into ranges; None when there is only one (or, unless a range size
    was forced, the inputs are too small to be worth worker processes)."""
    sizes = [p.stat().st_size for p in paths]
    if auto and sum(sizes) < _MIN_PARALLEL_BYTES:
        return None
    plan: list[tuple[int, Path, list[int]]] = []
    for i, (p, size) in enumerate(zip(paths, sizes, strict=True)):
        plain = size > 0 and not _is_gzip(p)
        plan.append((i, p, _cuts(p, size, range_bytes) if plain else []))
    if len(paths) + sum(len(c) for _, _, c in plan) < 2:
        return None
    ranges: list[_Range] = []
    for i, p, cuts in plan:
        if not cuts:
            ranges.append(_Range(i, os.fspath(p)))
            continue
        bounds = [0, *cuts, sizes[i]]
        ranges += [
            _Range(i, os.fspath(p), a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    return ranges


def _count_range(r: _Range) -> tuple[int, int]:
    return count_lines_and_records(r.path, r.start, r.end)


def _number_ranges(ranges: list[_Range], pool: Any) -> list[_Range]:
    """Give each range of a cut file its first line and record number (counted in parallel)."""
    cut = [
        k
        for k, r in enumerate(ranges)
        if r.end is not None and k + 1 < len(ranges) and ranges[k + 1].file == r.file
    ]
    counts = dict(zip(cut, pool.map(_count_range, [ranges[k] for k in cut]), strict=True))
    out: list[_Range] = []
    line = number = 0
    for k, r in enumerate(ranges):
        if r.start == 0:
            line, number = 1, 0
        out.append(_Range(r.file, r.path, r.start, r.end, line, number))
        if k in counts:
            line += counts[k][0]
            number += counts[k][1]
    return out


def _shard_worker(r: _Range, job: _Job, shard: str) -> dict[str, Any]:
    """Read one range into a shard store; return what the parent needs to check and merge.

    Duplicate ids are not checked here but by the parent, across all shards in order, from the
    returned id hashes (with record numbers and lines, to name a duplicate exactly). The shard
    holds the valid records read before an error too, so the parent can name a duplicate
    among them; the error itself travels back pickled.
    """
    report = _KeyedReport(file=r.file)
    mode: Any = job.split_mode  # validated by the parent
    splitter = Splitter(job.valid_frac, job.test_frac, mode, job.groups)
    hashes: list[np.ndarray] = [np.empty(0, np.uint64)]
    numbers: list[np.ndarray] = [np.empty(0, np.int64)]
    lines: list[np.ndarray] = [np.empty(0, np.int64)]
    error: UserError | None = None
    span: dict[str, Any] = {}
    if r.end is not None:
        span = {"byte_range": (r.start, r.end), "start_line": r.line, "start_number": r.number}
    with StoreWriter(shard, alphabet=job.alphabet) as writer:
        blocks = read_fasta_blocks(
            r.path,
            on_invalid=job.on_invalid,  # type: ignore[arg-type]
            report=report,
            alphabet=job.alphabet,
            check_duplicates=False,
            **span,
        )
        try:
            for chunk in _chunks(blocks):
                # A --split-by cluster record without a cluster id raises here: its error
                # comes before a later one of the reader's.
                codes = splitter.codes(chunk.ids, chunk.descs)
                writer.write_chunk(chunk.ids, chunk.seqs, codes, chunk.descs)
                hashes.append(DuplicateIdChecker.hash_ids(chunk.ids))
                numbers.append(np.asarray(chunk.numbers, dtype=np.int64))
                lines.append(np.asarray(chunk.lines, dtype=np.int64))
        except UserError as exc:  # bad input
            error = exc
        writer.commit()
    report._trim()
    return {
        "shard": shard,
        "hashes": np.concatenate(hashes),
        "numbers": np.concatenate(numbers),
        "lines": np.concatenate(lines),
        "skipped": report.skipped,
        "by_reason": dict(report.by_reason),
        "keyed": report.keyed,
        "error": error,
    }


class _ShardMerger:
    """The parent's side, a shard at a time in input order: the duplicate-id check, the
    shard's error if any, its part of the report, and the concatenation."""

    def __init__(
        self, paths: list[Path], job: _Job, writer: StoreWriter, report: _KeyedReport
    ) -> None:
        self.writer = writer
        self.report = report
        self.dups = _DuplicateCheck(paths, job.on_invalid == "skip", report)

    def merge(self, r: _Range, res: dict[str, Any]) -> None:
        shard = res["shard"]
        store: list[TokenStore] = []

        def id_of(i: int) -> str:
            if not store:
                store.append(TokenStore(shard))
            return store[0].id(i)

        keep = self.dups.keep(r.file, res["numbers"], res["hashes"], res["lines"], id_of)
        if res["error"] is not None:
            raise res["error"]
        report = self.report
        report.skipped += res["skipped"]
        report.by_reason.update(res["by_reason"])
        for key, text in res["keyed"]:
            report.note(tuple(key), text)
        self.writer.append_store(shard, keep)
        shutil.rmtree(shard, ignore_errors=True)


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: when the parent dies (any signal, kill -9 included) the worker exits
    within a second instead of waiting forever on the pool's pipe."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _run_parallel(
    paths: list[Path],
    ranges: list[_Range],
    workers: int,
    job: _Job,
    writer: StoreWriter,
    report: _KeyedReport,
    bar: Any,
) -> None:
    """Ranges -> shards in ``workers`` spawned processes (at most two ranges per worker in
    flight, so shards on disk and results in memory stay bounded) -> merged in order."""
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor

    sizes = [p.stat().st_size for p in paths]
    shard_dir = writer.tmp / "shards"
    shard_dir.mkdir()
    merger = _ShardMerger(paths, job, writer, report)
    pool = ProcessPoolExecutor(
        max_workers=min(workers, len(ranges)),
        mp_context=multiprocessing.get_context(_START_METHOD),
        initializer=_exit_with_parent,
        initargs=(os.getpid(),),
    )
    try:
        ranges = _number_ranges(ranges, pool)
        pending: deque[tuple[_Range, Future[dict[str, Any]]]] = deque()
        todo = iter(enumerate(ranges))
        for k, r in todo:
            pending.append(
                (r, pool.submit(_shard_worker, r, job, os.fspath(shard_dir / f"{k:06d}")))
            )
            if len(pending) >= 2 * workers:
                break
        while pending:
            r, fut = pending.popleft()
            res = fut.result()
            nxt = next(todo, None)
            if nxt is not None:
                k, rn = nxt
                pending.append(
                    (rn, pool.submit(_shard_worker, rn, job, os.fspath(shard_dir / f"{k:06d}")))
                )
            merger.merge(r, res)
            bar.update((sizes[r.file] if r.end is None else r.end) - r.start)
    except BaseException:  # an error, Ctrl-C or SIGTERM: stop the ranges in flight, not finish
        for proc in list((pool._processes or {}).values()):  # noqa: SLF001 - no public handle
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(shard_dir, ignore_errors=True)
