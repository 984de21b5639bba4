#!/usr/bin/env python
"""Reading an MSA as family context: seconds for ``data.inputs.read_homologs`` on an A2M the
size of ProteinGym's (issue 41).

A seeded synthetic A2M: a random wild type of ``--columns`` residues, then ``--rows`` homologs,
each the wild type with 40% substitutions, cut to a random fragment (the rest ``-``), with a
three-residue lower-case insertion after 2% of its residues. Prints the best of ``--repeats``
reads (the file is read from the page cache after the first) and what was read.

Example::

    python scripts/bench/bench_msa_read.py --rows 50000 --columns 500
    python scripts/bench/bench_msa_read.py --quick    # 200 rows of 100 columns, one read
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from protein_performer.data.inputs import read_homologs

AMINO = np.array(list("ACDEFGHIKLMNPQRSTVWY"))


def write_a2m(path: Path, rows: int, columns: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    wt = rng.choice(AMINO, columns)
    lines = [f">wt/1-{columns}\n{''.join(wt)}\n"]
    for i in range(rows):
        row = wt.copy()
        sub = rng.random(columns) < 0.4
        row[sub] = rng.choice(AMINO, int(sub.sum()))
        lo, hi = sorted(rng.integers(0, columns, 2).tolist())
        hi = max(hi, lo + 1)
        row[:lo], row[hi:] = "-", "-"
        inserted = [
            c + ("".join(rng.choice(AMINO, 3)).lower() if c != "-" and rng.random() < 0.02 else "")
            for c in row
        ]
        lines.append(f">h{i}/{lo + 1}-{hi}\n{''.join(inserted)}\n")
    path.write_text("".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50000, help="homolog rows (default 50000)")
    p.add_argument("--columns", type=int, default=500, help="match columns (default 500)")
    p.add_argument("--repeats", type=int, default=3, help="reads, the best kept (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="200 rows of 100 columns, one read")
    args = p.parse_args()
    if args.quick:
        args.rows, args.columns, args.repeats = 200, 100, 1
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench_msa_") as work:
        path = Path(work) / "family.a2m"
        write_a2m(path, args.rows, args.columns, args.seed)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            reference, members = read_homologs(path)
            times.append(time.perf_counter() - start)
        print(json.dumps({
            "rows": args.rows, "columns": args.columns, "megabytes": path.stat().st_size / 1e6,
            "homologs": len(members), "residues": sum(len(m.sequence) for m in members),
            "best_s": round(min(times), 3), "reference": reference.id,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
