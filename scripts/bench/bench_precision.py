#!/usr/bin/env python
"""Half precision against fp32: how far bf16/fp16 weights move embeddings and scores.

Loads CKPT (any checkpoint the CLI accepts; by default a random model of the ESM-2 8M shape)
three times, with ``protein_performer.load(..., dtype=...)`` in fp32, bf16 and fp16, embeds
real proteins (mean and per-residue, last layer) and scores them (the model's strategy), and
reports for each half precision the max |delta| against fp32 and its size relative to the
largest fp32 value. This is the measurement behind the precision table in ``docs/API.md``.

Examples::

    python scripts/bench/bench_precision.py --quick
    python scripts/bench/bench_precision.py --ckpt outputs/demo/<run>/checkpoints/last.ckpt
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import _common as common

#: The bundled demo proteins (15 records, median 156 aa).
DEMO = "data/demo/some_proteins.fasta"


def main() -> int:
    p = common.bench_parser(__doc__, "", ".bench/precision")
    p.add_argument("--ckpt", default=None, help="model to measure (default: random 8M shape)")
    p.add_argument("--objective", choices=("mlm", "clm"), default="clm",
                   help="for the random model")
    p.add_argument("--fasta", type=Path, default=None,
                   help=f"proteins (default: the package's {DEMO})")
    p.add_argument("--records", type=int, default=20, help="how many records to use")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="3 short records: a smoke run")
    args = p.parse_args()
    import numpy as np

    import protein_performer as pp
    from protein_performer.data.bundled import bundled_path
    from protein_performer.data.inputs import read_records

    fasta = args.fasta or bundled_path(DEMO)
    n = 3 if args.quick else args.records
    records = [(r.id, r.sequence) for r in read_records(fasta)][:n]
    if args.quick:
        records = [(rid, s[:60]) for rid, s in records]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or common.random_export(Path(tmp) / f"random_8m_{args.objective}",
                                                  objective=args.objective)
        results = {}
        for precision in ("fp32", "bf16", "fp16"):
            lm = pp.load(ckpt, device=args.device, dtype=precision, threads=args.threads)
            results[precision] = (lm.embed(records), lm.embed(records, pooling=None),
                                  lm.score(records))
    mean32, tok32, score32 = results["fp32"]
    lines = [
        f"model: {args.ckpt or f'random ESM-2 8M shape ({args.objective})'}; {len(records)} "
        f"records from {fasta.name} (median {int(np.median([len(s) for _, s in records]))} aa)",
        "",
        "| precision | mean emb. max abs delta | (relative) | per-residue max abs delta | "
        "(relative) | score max abs delta |",
        "|---|---|---|---|---|---|"]
    for precision in ("bf16", "fp16"):
        mean, tok, score = results[precision]
        d_mean = float(np.abs(mean - mean32).max())
        d_tok = max(float(np.abs(a - b).max()) for a, b in zip(tok, tok32, strict=True))
        scale_tok = max(float(np.abs(b).max()) for b in tok32)
        lines.append(
            f"| {precision} | {d_mean:.2e} | {d_mean / float(np.abs(mean32).max()):.2e} | "
            f"{d_tok:.2e} | {d_tok / scale_tok:.2e} | {float(np.abs(score - score32).max()):.2e} |"
        )
    common.write_report(args.out / "precision.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
