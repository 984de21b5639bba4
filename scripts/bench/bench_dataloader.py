"""Data-loader throughput: batches/s and tokens/s of the training loader, as training builds it.

Runs ``ProteinDataModule.train_dataloader()`` (token-budget sampler, crops, MLM masks, collation,
persistent workers) over a FASTA file (read into memory) or a preprocessed store, and reports
real tokens/s (non-pad) and padded tokens/s (what the model computes on). Worker start-up and
the first batch are timed separately so the steady-state rate is not diluted by them.

    python scripts/bench/bench_dataloader.py                      # swissprot sample, 2 workers
    python scripts/bench/bench_dataloader.py --store DIR --batches 500
    python scripts/bench/bench_dataloader.py --quick              # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import _common as common

from protein_performer.data.datamodule import ProteinDataModule

DEFAULT_FASTA = (common.SEQUENCES / "swissprot_opal_train.fasta").resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--fasta", type=Path, default=None,
                     help=f"FASTA input (default {DEFAULT_FASTA})")
    src.add_argument("--store", type=Path, default=None, help="preprocessed store directory")
    p.add_argument("--objective", choices=("mlm", "clm"), default="mlm")
    p.add_argument("--max-len", type=int, default=1024, help="tokens incl. <cls>/<eos> (1024)")
    p.add_argument("--max-tokens", type=int, default=16384, help="padded tokens per batch (16384)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (2)")
    p.add_argument("--batches", type=int, default=300, help="batches to time after warm-up (300)")
    p.add_argument("--limit-records", type=int, default=None, help="use the first N records")
    p.add_argument("--quick", action="store_true", help="2,000 records, 30 batches")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    common.setup_logging("%(message)s")
    log = logging.getLogger("bench_dataloader")
    if args.quick:
        args.batches = min(args.batches, 30)
        args.limit_records = args.limit_records or 2000
    path = args.store or args.fasta or DEFAULT_FASTA
    if not Path(path).exists():
        raise SystemExit(f"error: {path} not found: pass --fasta FILE or --store DIR")

    t0 = time.perf_counter()
    dm = ProteinDataModule(str(path), objective=args.objective, max_len=args.max_len,
                           max_tokens=args.max_tokens, num_workers=args.workers,
                           limit_records=args.limit_records, on_invalid="skip")
    dm.setup("fit")
    load_s = time.perf_counter() - t0
    loader = dm.train_dataloader()
    log.info("%s: %d train records, %d batches/epoch, loaded in %.2fs", path,
             len(dm.datasets["train"]), len(loader), load_s)

    batches = real = padded = 0
    epoch = 0
    t_start = time.perf_counter()
    first_s = None
    t_steady = t_start
    while batches < args.batches:
        loader.batch_sampler.set_epoch(epoch)  # what Lightning does at each epoch start
        for batch in loader:
            if first_s is None:  # worker start-up + first batch: reported, not averaged in
                first_s = time.perf_counter() - t_start
                t_steady = time.perf_counter()
                continue
            batches += 1
            real += int((~batch["padding_mask"]).sum())
            padded += batch["tokens"].numel()
            if batches >= args.batches:
                break
        epoch += 1
    elapsed = time.perf_counter() - t_steady
    results = {"source": str(path), "max_len": args.max_len, "max_tokens": args.max_tokens,
               "workers": args.workers, "objective": args.objective, "batches": batches,
               "first_batch_s": round(first_s or 0.0, 3),
               "batches_per_s": round(batches / elapsed, 2),
               "real_tokens_per_s": round(real / elapsed),
               "padded_tokens_per_s": round(padded / elapsed),
               "padding_frac": round(1 - real / max(padded, 1), 4)}
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
