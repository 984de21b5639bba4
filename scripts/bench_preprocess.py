#!/usr/bin/env python
"""Benchmark ``protein-performer preprocess`` against Biopython's bare FASTA parsing.

Generates a large FASTA (streamed to disk, never held in RAM) by sampling real sequences with
unique ids, then on the same file measures
  1. parse-only: ``Bio.SeqIO.FastaIO.SimpleFastaParser`` iterating every record (the floor any
     Python FASTA pipeline pays), and
  2. ours: ``preprocess`` end to end (parse, validate, headers, split, tokenize, write the store),
     in a child process so its peak RSS is measured on its own.
Targets (issue 2): ours >= 0.5x the parse-only MB/s, and peak RSS < 1 GB.

    python scripts/bench_preprocess.py --quick          # seconds, a smoke test
    python scripts/bench_preprocess.py --size-gb 2      # the real measurement
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("bench_preprocess")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCES = sorted((REPO.parent / "shared" / "data" / "sequences").glob("*train*.fasta"))
TARGET_RATIO = 0.5
TARGET_RSS_BYTES = 1 << 30

_CHILD = r"""
import json, resource, sys, time
from protein_performer.data.preprocess import preprocess
fasta, out = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
s = preprocess([fasta], out, progress=False, overwrite=True)
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
print(json.dumps({"seconds": dt, "records": s.records, "residues": s.residues,
                  "splits": s.splits, "peak_rss": rss}))
"""


def _read_source(paths: list[Path]) -> list[tuple[str, str, str]]:
    """(id, description rest, 60-column wrapped sequence) for every source record (~17 MB)."""
    from Bio.SeqIO.FastaIO import SimpleFastaParser

    out = []
    for p in paths:
        with open(p) as fh:
            for title, seq in SimpleFastaParser(fh):
                rid, _, rest = title.partition(" ")
                wrapped = "\n".join(seq[i : i + 60] for i in range(0, len(seq), 60))
                out.append((rid, rest, wrapped))
    if not out:
        raise SystemExit(f"no records in {', '.join(map(str, paths))}")
    return out


def _records(source: list[tuple[str, str, str]], seed: int) -> Iterator[str]:
    """Endless FASTA text, one record at a time: real sequences, unique ids (suffix ``.bN``)."""
    rng = random.Random(seed)
    n = 0
    while True:
        rid, rest, wrapped = source[rng.randrange(len(source))]
        n += 1
        yield f">{rid}.b{n} {rest}\n{wrapped}\n" if rest else f">{rid}.b{n}\n{wrapped}\n"


def generate(path: Path, size_bytes: int, source: list[tuple[str, str, str]], seed: int) -> int:
    """Write at least ``size_bytes`` of FASTA in 8 MB pieces; returns the bytes written."""
    written = 0
    buf: list[str] = []
    buf_len = 0
    with open(path, "w", buffering=1 << 20) as fh:
        for text in _records(source, seed):
            buf.append(text)
            buf_len += len(text)
            if buf_len >= 8 << 20 or written + buf_len >= size_bytes:
                fh.write("".join(buf))
                written += buf_len
                buf, buf_len = [], 0
                if written >= size_bytes:
                    break
    return written


def parse_only(path: Path) -> tuple[float, int]:
    """Seconds and record count for SimpleFastaParser merely iterating the file."""
    from Bio.SeqIO.FastaIO import SimpleFastaParser

    t0 = time.perf_counter()
    n = 0
    with open(path) as fh:
        for _title, _seq in SimpleFastaParser(fh):
            n += 1
    return time.perf_counter() - t0, n


def ours(path: Path, out: Path) -> dict:
    """Run preprocess in a child process; its own ru_maxrss is its peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, os.fspath(path), os.fspath(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"preprocess failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_seconds"] = wall
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--size-gb", type=float, default=2.0, help="FASTA size to generate (GB, 1e9)")
    ap.add_argument("--quick", action="store_true", help="tiny run (20 MB) to check the script")
    ap.add_argument(
        "--source",
        type=Path,
        nargs="*",
        default=DEFAULT_SOURCES,
        help="FASTA file(s) to sample sequences from (default: ../shared/data/"
        "sequences/*train*.fasta)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where to put the FASTA and the store (default: a new temp dir)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the generated FASTA and store")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    size = int((0.02 if args.quick else args.size_gb) * 1e9)
    if not args.source:
        raise SystemExit("no source FASTA: pass --source FILE")
    workdir = Path(tempfile.mkdtemp(prefix="bench_preprocess_", dir=args.workdir))
    fasta, store = workdir / "bench.fasta", workdir / "store"
    try:
        source = _read_source(list(args.source))
        log.info(
            "generating %.2f GB FASTA from %d source records in %s",
            size / 1e9,
            len(source),
            workdir,
        )
        t0 = time.perf_counter()
        nbytes = generate(fasta, size, source, args.seed)
        log.info("generated %d bytes in %.1f s", nbytes, time.perf_counter() - t0)

        log.info("parse-only pass (SimpleFastaParser)")
        t_parse, n_parse = parse_only(fasta)
        log.info("preprocess pass (child process)")
        res = ours(fasta, store)
        if res["records"] != n_parse:
            raise SystemExit(f"record count mismatch: ours {res['records']}, Biopython {n_parse}")

        mb = nbytes / 1e6
        parse_rate, our_rate = mb / t_parse, mb / res["seconds"]
        ratio = our_rate / parse_rate
        store_bytes = sum(p.stat().st_size for p in store.iterdir())
        result = {
            "input_bytes": nbytes,
            "records": n_parse,
            "parse_only_seconds": t_parse,
            "parse_only_mb_s": parse_rate,
            "preprocess_seconds": res["seconds"],
            "preprocess_wall_seconds": res["wall_seconds"],
            "preprocess_mb_s": our_rate,
            "ratio": ratio,
            "peak_rss_bytes": res["peak_rss"],
            "store_bytes": store_bytes,
            "target_ratio": TARGET_RATIO,
            "target_rss_bytes": TARGET_RSS_BYTES,
            "ratio_ok": ratio >= TARGET_RATIO,
            "rss_ok": res["peak_rss"] < TARGET_RSS_BYTES,
        }
        print(f"input        {mb:,.0f} MB, {n_parse:,} records")
        print(f"parse-only   {parse_rate:8.1f} MB/s  ({t_parse:.1f} s, SimpleFastaParser)")
        print(
            f"preprocess   {our_rate:8.1f} MB/s  ({res['seconds']:.1f} s; "
            f"{res['wall_seconds']:.1f} s with interpreter start)"
        )
        print(
            f"ratio        {ratio:8.2f}x  (target >= {TARGET_RATIO}x: "
            f"{'OK' if result['ratio_ok'] else 'MISSED'})"
        )
        print(
            f"peak RSS     {res['peak_rss'] / 2**20:8.0f} MiB (target < 1024 MiB: "
            f"{'OK' if result['rss_ok'] else 'MISSED'})"
        )
        print(f"store        {store_bytes / 1e6:,.0f} MB")
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        return 0 if result["ratio_ok"] and result["rss_ok"] else 1
    finally:
        if args.keep:
            log.info("kept %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
