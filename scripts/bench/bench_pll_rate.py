#!/usr/bin/env python
"""Pseudo-perplexity: the spaced estimate (``score --pll-rate R``) against the exact value.

Exact pseudo-log-likelihood masks each residue once: L forward passes per protein. The
estimate masks every ``round(1/R)``-th residue together, about 1/R passes, and reads each
residue's term from the pass that masked it (its spaced neighbours masked too). On real
proteins (a seeded sample of ``--fasta``, default the shared Swiss-Prot set), per rate: the
Spearman correlation of the per-protein mean log-likelihoods with the exact ones (does the
estimate rank proteins as the exact PLL does?), the mean absolute and mean signed difference
of the per-protein mean (nats per residue), and the time of the exact scoring over the
estimate's, in one process with the same threads, each protein timed exact then estimated.

Examples::

    python scripts/bench/bench_pll_rate.py CKPT --n 40 --rates 0.05 0.1 0.2 --threads 1
    python scripts/bench/bench_pll_rate.py --quick
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import _common as common

DEFAULT_FASTA = common.SEQUENCES / "swissprot_opal_train.fasta"


def sample(fasta: Path, n: int, max_len: int, seed: int) -> list[tuple[str, str]]:
    from protein_performer.data.inputs import read_records

    records = [(r.id, r.sequence) for r in read_records(fasta) if len(r.sequence) <= max_len]
    return random.Random(seed).sample(records, min(n, len(records)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("ckpt", nargs="?", help="a masked-LM checkpoint (not with --quick)")
    p.add_argument("--fasta", type=Path, default=DEFAULT_FASTA, help="proteins to sample")
    p.add_argument("--n", type=int, default=40, help="proteins (default 40)")
    p.add_argument("--max-len", type=int, default=1000, help="longest protein sampled")
    p.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(".bench/pll_rate"), help="per-protein CSV")
    p.add_argument("--quick", action="store_true", help="a tiny random model, 4 proteins")
    args = p.parse_args(argv)
    import numpy as np
    import torch
    from scipy.stats import spearmanr

    from protein_performer.inference.api import ProteinLM, load
    from protein_performer.inference.scoring import pseudo_log_likelihoods

    torch.set_num_threads(args.threads)
    if args.quick:
        # a random tiny masked LM: checks the script, not the estimate
        tiny = common.random_lm(dim=16, depth=2, heads=2, ff_dim=32, nb_features=8)
        lm, args.n, args.max_len = ProteinLM(tiny), 4, 120
    elif args.ckpt is None:
        p.error("CKPT is required without --quick")
    else:
        lm = load(args.ckpt, "cpu")
    proteins = sample(args.fasta, args.n, args.max_len, args.seed)
    rows, seconds = [], {r: 0.0 for r in [None, *args.rates]}
    for rid, seq in proteins:
        row = {"id": rid, "length": len(seq)}
        for rate in [None, *args.rates]:
            start = time.perf_counter()
            terms = pseudo_log_likelihoods(lm.loaded, seq, rate=rate)
            seconds[rate] += time.perf_counter() - start
            row["exact" if rate is None else f"rate_{rate:g}"] = float(terms.mean())
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_dicts_csv(rows, args.out / "per_protein.csv")
    exact = np.array([r["exact"] for r in rows])
    lengths = [r["length"] for r in rows]
    median = int(np.median(lengths))
    print(f"{len(rows)} proteins from {args.fasta.name} (median {median} aa, max "
          f"{max(lengths)}), {args.threads} thread(s); exact: {seconds[None]:.1f} s")  # fmt: skip
    print("rate  passes/protein  spearman  mean|diff|  mean diff  exact s / estimate s")
    for rate in args.rates:
        est = np.array([r[f"rate_{rate:g}"] for r in rows])
        rho = spearmanr(exact, est).statistic
        diff = est - exact
        print(f"{rate:<5g} {round(1 / rate):>14d}  {rho:8.4f}  {np.abs(diff).mean():10.4f}  "
              f"{diff.mean():9.4f}  {seconds[None] / seconds[rate]:6.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
