"""FASTA(.gz) -> tokenized memory-mapped store, in one streaming pass and constant memory.

Reading, validation and header parsing are ``data.fasta``'s job; this module only assigns each
record a split (``data.split``), tokenizes it and appends it to a ``data.store`` writer, plus the
bookkeeping that makes a store reproducible: which inputs it came from (size and a content
fingerprint, never a timestamp) and what was skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from protein_performer.data.split import (
    DEFAULT_TEST_FRAC,
    DEFAULT_VALID_FRAC,
    SPLIT_NAMES,
    Splitter,
)
from protein_performer.data.store import StoreWriter, check_output_dir
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

log = logging.getLogger(__name__)

_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of an input file
# Records are handed to the store writer in chunks bounded both ways (memory stays constant
# even for titin-sized records).
_CHUNK_RECORDS = 8192
_HASH_DOC = (
    "blake2b-64 (big-endian) of 'cluster:' + UniRef cluster id, else of the id; "
    "test = lowest test_frac of the hash range, valid = the next valid_frac"
)
_CHUNK_RESIDUES = 1 << 23


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


class _ByteProgress:
    """Progress over input bytes (compressed bytes for gzip), read from the OS file position.

    ``read_fastas`` owns its file handles, so the position of the file being read is taken from
    ``/proc/self/fdinfo`` (Linux); elsewhere the bar advances a file at a time.
    """

    def __init__(self, paths: Sequence[Path], enabled: bool) -> None:
        self.sizes = {os.fspath(p): p.stat().st_size for p in paths}
        self.resolved = {os.path.realpath(p): os.fspath(p) for p in paths}
        self.done_before: dict[str, int] = {}
        acc = 0
        for p in paths:
            self.done_before.setdefault(os.fspath(p), acc)
            acc += self.sizes[os.fspath(p)]
        self.total = acc
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="preprocess",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )
        self._fd: int | None = None
        self._fd_path: str | None = None
        self._last = 0.0

    def _find_fd(self, path: str) -> int | None:
        target = os.path.realpath(path)
        try:
            for name in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{name}") == target:
                        return int(name)
                except OSError:
                    continue
        except OSError:
            return None
        return None

    def _position(self, path: str) -> int | None:
        if self._fd_path != path:
            self._fd, self._fd_path = self._find_fd(path), path
        if self._fd is None:
            return None
        try:
            with open(f"/proc/self/fdinfo/{self._fd}") as fh:
                for line in fh:
                    if line.startswith("pos:"):
                        return int(line.split()[1])
        except OSError:
            self._fd_path = None
        return None

    def update(self, path: str) -> None:
        """Called every few thousand records; cheap enough, and throttled to ~4 Hz."""
        if self.bar is None:
            return
        now = time.monotonic()
        if now - self._last < 0.25:
            return
        self._last = now
        key = path if path in self.sizes else self.resolved.get(os.path.realpath(path), path)
        base = self.done_before.get(key, 0)
        pos = self._position(path)
        if pos is None:
            pos = 0
        done = min(base + min(pos, self.sizes.get(key, 0)), self.total)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.total - self.bar.n)
            self.bar.close()


def _report_dict(report: Any) -> dict[str, Any]:
    """JSON-able, deterministic view of the skipped-records report for ``meta.json``."""
    return {
        "skipped": int(report.skipped),
        "by_reason": dict(sorted(report.by_reason.items())),
        "examples": list(report.examples),
    }


def preprocess(
    inputs: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    on_invalid: str = "error",
    valid_frac: float = DEFAULT_VALID_FRAC,
    test_frac: float = DEFAULT_TEST_FRAC,
    split_mode: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    alphabet: Alphabet | None = None,
) -> PreprocessSummary:
    """Stream FASTA(.gz) ``inputs`` into a token store at ``out`` and return a summary.

    Raises ``UserError`` (nothing is written under ``out``) for bad arguments, bad input in
    ``on_invalid="error"`` mode, or an input without a single valid record.
    """
    from protein_performer.data.fasta import InvalidReport, read_fastas

    paths = [Path(p) for p in inputs]
    if not paths:
        raise UserError("no input FASTA given")
    for p in paths:
        if not p.is_file():
            raise UserError(f"{p}: no such file (expected a FASTA or FASTA.gz file)")
    if on_invalid not in ("error", "skip"):
        raise UserError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    splitter = Splitter(valid_frac, test_frac, split_mode)  # validates both
    out = Path(out)
    check_output_dir(out, overwrite)
    alphabet = alphabet or Alphabet()

    t0 = time.perf_counter()
    inputs_meta = [file_fingerprint(p) for p in paths]
    report = InvalidReport()
    bar = _ByteProgress(paths, enabled=progress)
    try:
        with StoreWriter(out, overwrite=overwrite, alphabet=alphabet) as writer:
            records: Iterator[Any] = read_fastas(
                paths, on_invalid=on_invalid, report=report, alphabet=alphabet
            )
            # The hot loop: per record only list appends; hashing, tokenizing and writing
            # happen per chunk, mostly in C (Splitter.codes, StoreWriter.write_chunk).
            ids: list[str] = []
            seqs: list[str] = []
            descs: list[str] = []
            residues = 0
            for rec in records:
                seq = rec.sequence
                ids.append(rec.id)
                seqs.append(seq)
                descs.append(rec.description)
                residues += len(seq)
                if residues >= _CHUNK_RESIDUES or len(ids) >= _CHUNK_RECORDS:
                    writer.write_chunk(ids, seqs, splitter.codes(ids), descs)
                    bar.update(rec.path)
                    ids, seqs, descs, residues = [], [], [], 0
            writer.write_chunk(ids, seqs, splitter.codes(ids), descs)
            skipped = int(report.skipped)
            if writer.num_records == 0:
                what = f" ({skipped} invalid records skipped)" if skipped else ""
                raise UserError(
                    f"no valid records in {', '.join(map(os.fspath, paths))}{what}: "
                    "nothing to preprocess"
                )
            writer.commit(
                {
                    "split": {
                        "mode": split_mode,
                        "valid_frac": valid_frac,
                        "test_frac": test_frac,
                        "hash": _HASH_DOC,
                    },
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
                input_bytes=bar.total,
                seconds=0.0,
                skipped_reasons=dict(sorted(report.by_reason.items())),
            )
    finally:
        bar.close()
    summary.seconds = time.perf_counter() - t0
    if summary.skipped:
        log.warning("skipped %d invalid records (see meta.json 'invalid')", summary.skipped)
    return summary
