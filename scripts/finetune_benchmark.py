#!/usr/bin/env python
"""Supervised fitness prediction on the BLAT_ECOLX scan: baselines vs fine-tuning (issue 24).

Label: the ampicillin 2500 column of ``../shared/data/dms/BLAT_ECOLX_Ranganathan2015.csv``
(4,996 single mutants of TEM-1). 5-fold cross-validation twice: folds by *position* (every
mutation at one position lands in one fold, so a test position was never seen in training) and
by *random* split. Methods, each timed in CPU seconds (process time, all folds):

* ``one-hot ridge``: ridge (RidgeCV) on the one-hot mutant sequence, the reviewer's baseline;
* ``frozen ridge (MODEL)``: ridge on the model's mean last-layer embeddings;
* ``lora (MODEL)`` / ``full (MODEL)``: ``protein-performer finetune`` (mode lora / full), one
  run per fold (10% of the training fold as validation, the best checkpoint predicts the test
  fold through ``pp.load(...).predict``).

``--model CKPT`` (repeatable) names the pretrained models; without one (and with ``--quick``) a
tiny random model stands in, which only checks that the pipeline runs. ``--quick`` also
subsamples the variants and trains one epoch. The table goes to standard output (markdown) and,
with ``--out``, to a JSON file.

    python scripts/finetune_benchmark.py --quick
    python scripts/finetune_benchmark.py --model outputs/demo/<run>/checkpoints/last.ckpt \
        --epochs 5 --out runs/finetune_benchmark.json
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DMS = ROOT.parent / "shared" / "data" / "dms"
AA = "ACDEFGHIKLMNPQRSTVWY"


def load_scan(
    dms: Path, column: str, limit: int | None, seed: int
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Mutant sequences, labels and mutated positions (NaN labels left out)."""
    wt = "".join(
        line.strip()
        for line in (dms / "BLAT_ECOLX_wt_offset24.fasta").read_text().splitlines()
        if not line.startswith(">")
    )
    seqs, ys, pos = [], [], []
    with open(dms / "BLAT_ECOLX_Ranganathan2015.csv", encoding="utf-8-sig", newline="") as fh:
        for row in csv.DictReader(fh):
            value = row[column].strip()
            if not value or value.lower() == "nan":
                continue
            m = row["mutant"]
            p = int(m[1:-1]) - 24
            assert wt[p] == m[0], m
            seqs.append(wt[:p] + m[-1] + wt[p + 1 :])
            ys.append(float(value))
            pos.append(p)
    idx = np.arange(len(seqs))
    if limit is not None and limit < len(seqs):
        idx = np.sort(np.random.default_rng(seed).choice(len(seqs), limit, replace=False))
    return [seqs[i] for i in idx], np.array(ys)[idx], np.array(pos)[idx]


def folds(kind: str, positions: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    """Test indices of each fold: by position (GroupKFold over positions) or random (KFold)."""
    from sklearn.model_selection import GroupKFold, KFold

    n = len(positions)
    if kind == "position":
        split = GroupKFold(n_splits=k).split(np.zeros(n), groups=positions)
    else:
        split = KFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(n))
    return [test for _, test in split]


def one_hot(seqs: list[str]) -> np.ndarray:
    index = {a: i for i, a in enumerate(AA)}
    out = np.zeros((len(seqs), len(seqs[0]) * len(AA)), np.float32)
    for r, s in enumerate(seqs):
        for p, a in enumerate(s):
            if a in index:
                out[r, p * len(AA) + index[a]] = 1.0
    return out


def ridge_cv(x: np.ndarray, y: np.ndarray, fold_list: list[np.ndarray]) -> np.ndarray:
    """Out-of-fold predictions of RidgeCV (alpha chosen inside each training fold)."""
    from sklearn.linear_model import RidgeCV

    pred = np.zeros_like(y)
    for test in fold_list:
        train = np.setdiff1d(np.arange(len(y)), test)
        model = RidgeCV(alphas=np.logspace(-2, 4, 13)).fit(x[train], y[train])
        pred[test] = model.predict(x[test])
    return pred


def finetune_cv(
    base: str,
    mode: str,
    seqs: list[str],
    y: np.ndarray,
    fold_list: list[np.ndarray],
    args: argparse.Namespace,
    work: Path,
) -> np.ndarray:
    """Out-of-fold predictions of ``finetune`` runs (one per fold)."""
    import protein_performer as pp
    from protein_performer.finetune.train import finetune
    from protein_performer.training.compose import compose_config

    pred = np.zeros_like(y)
    rng = np.random.default_rng(args.seed)
    for f, test in enumerate(fold_list):
        train = np.setdiff1d(np.arange(len(y)), test)
        valid = set(rng.choice(train, max(1, len(train) // 10), replace=False).tolist())
        table = work / f"{mode}_fold{f}.csv"
        with open(table, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["sequence", "label", "split"])
            test_set = set(test.tolist())
            for i, (s, v) in enumerate(zip(seqs, y, strict=True)):
                split = "test" if i in test_set else "valid" if i in valid else "train"
                w.writerow([s, f"{v:.6f}", split])
        out = work / f"{mode}_fold{f}"
        cfg = compose_config(
            [
                f"base={base}",
                f"data.train={table}",
                f"mode={mode}",
                f"paths.output_dir={out}",
                f"trainer.max_epochs={args.epochs}",
                "test=false",
                "trainer.enable_progress_bar=false",
                "~callbacks.progress_bar",
                "~callbacks.training_curve",
                "trainer.enable_model_summary=false",
                f"data.max_batch_size={args.batch_size}",
                f"seed={args.seed}",
            ],
            name="finetune",
            direct_keys=("base", "data.train"),
        )
        result = finetune(cfg)
        lm = pp.load(result["best_checkpoint"] or result["last_checkpoint"], "cpu")
        pred[test] = lm.predict([seqs[i] for i in test])
    return pred


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def timed(fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def tiny_model(work: Path) -> str:
    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.loading import LoadedModel, export_model
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(0)
    config = PerformerConfig(dim=32, depth=2, heads=4, ff_dim=64, nb_features=16)
    loaded = LoadedModel(
        PerformerLM(config).eval(),
        config,
        Alphabet(),
        Path("tiny-random"),
        torch.device("cpu"),
        "memory",
    )
    return str(export_model(loaded, work / "tiny_random"))


def _memory_child(length: int, checkpointing: bool, mode: str, queue) -> None:  # noqa: ANN001
    """One forward + backward on one sequence of ``length`` residues (an ESM-2 8M-shape FAVOR+
    model with a regression head) in a fresh process: the bytes autograd keeps for backward
    (unique storages, what gradient checkpointing reduces) and the process's peak RSS."""
    import resource

    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.finetuned import add_lora
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM
    from protein_performer.model.task_heads import (
        HeadConfig,
        TaskHead,
        TaskModel,
        set_gradient_checkpointing,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    backbone = PerformerLM(PerformerConfig())
    if mode == "lora":
        add_lora(backbone, {"r": 8, "lora_alpha": 16})
    set_gradient_checkpointing(backbone, checkpointing)
    model = TaskModel(backbone, TaskHead(HeadConfig(dim=backbone.config.dim))).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    tokens = Alphabet().encode_batch(["".join(AA[i % 20] for i in range(length))])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).sum()
    loss.backward()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    queue.put((sum(seen.values()) / 2**20, rss))


def memory_table(lengths: list[int]) -> list[dict]:
    """Memory of a fine-tuning step by length (lora / full, with and without checkpointing)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("lora", "full"):
        for checkpointing in (False, True):
            for length in lengths:
                queue = ctx.Queue()
                proc = ctx.Process(target=_memory_child, args=(length, checkpointing, mode, queue))
                proc.start()
                saved, rss = queue.get()
                proc.join()
                rows.append({"mode": mode, "checkpointing": checkpointing, "length": length,
                             "saved_mib": saved, "peak_rss_mib": rss,
                             "saved_kib_per_residue": saved * 1024 / length})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="CKPT",
        help="pretrained model(s) to probe and fine-tune (repeatable)",
    )
    p.add_argument("--dms", type=Path, default=DMS, help="folder with the BLAT_ECOLX files")
    p.add_argument("--column", default="2500", help="label column (default: 2500)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--limit", type=int, default=None, help="use this many variants (random)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per fine-tuning run")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--methods",
        default="onehot,frozen,lora,full",
        help="comma-separated subset of onehot,frozen,lora,full",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI size: 250 variants, 1 epoch, a tiny random model unless --model",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument(
        "--memory",
        type=int,
        nargs="*",
        default=None,
        metavar="L",
        help="also measure the peak memory of one fine-tuning step (8M shape) on one "
        "sequence of each length L (default 1000 4000), with and without "
        "gradient checkpointing",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    quiet = ("pytorch_lightning", "pytorch_lightning.utilities.rank_zero", "lightning_fabric",
             "lightning.pytorch.utilities.rank_zero", "protein_performer")  # fmt: skip
    import pytorch_lightning  # noqa: F401 - it sets its loggers' levels on import
    import torch

    for name in quiet:
        logging.getLogger(name).setLevel(logging.ERROR)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.limit = args.limit or 250
        args.epochs = 1
    if not (args.dms / "BLAT_ECOLX_Ranganathan2015.csv").is_file():
        print(f"error: {args.dms} has no BLAT_ECOLX_Ranganathan2015.csv", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seqs, y, pos = load_scan(args.dms, args.column, args.limit, args.seed)
    fold_sets = {k: folds(k, pos, args.folds, args.seed) for k in ("random", "position")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pp_ft_bench_") as tmp:
        work = Path(tmp)
        models = args.model or [tiny_model(work)]
        if "onehot" in methods:
            x = one_hot(seqs)
            row = {"method": "one-hot ridge", "cpu_s": 0.0}
            for kind, fl in fold_sets.items():
                pred, t = timed(lambda fl=fl: ridge_cv(x, y, fl))
                row[kind], row["cpu_s"] = spearman(pred, y), row["cpu_s"] + t
            rows.append(row)
        for m, base in enumerate(models):
            label = Path(base).name if args.model else "tiny random"
            if "frozen" in methods:
                import protein_performer as pp

                start = time.process_time()
                emb = pp.load(base, "cpu").embed(seqs)
                row = {"method": f"frozen ridge ({label})", "cpu_s": time.process_time() - start}
                for kind, fl in fold_sets.items():
                    pred, t = timed(lambda fl=fl, emb=emb: ridge_cv(emb, y, fl))
                    row[kind], row["cpu_s"] = spearman(pred, y), row["cpu_s"] + t
                rows.append(row)
            for mode in ("lora", "full"):
                if mode not in methods:
                    continue
                row = {"method": f"{mode} ({label})", "cpu_s": 0.0}
                for kind, fl in fold_sets.items():
                    sub = work / f"m{m}_{mode}_{kind}"
                    sub.mkdir()
                    pred, t = timed(
                        lambda fl=fl, sub=sub, mode=mode, base=base: finetune_cv(
                            base, mode, seqs, y, fl, args, sub
                        )
                    )
                    row[kind], row["cpu_s"] = spearman(pred, y), row["cpu_s"] + t
                rows.append(row)
    print(
        f"BLAT_ECOLX column {args.column}: {len(seqs)} variants, {args.folds}-fold CV, "
        f"{args.epochs} epoch(s) per fine-tune, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print("| method | Spearman (random folds) | Spearman (position folds) | CPU time |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['random']:.3f} | {r['position']:.3f} | {r['cpu_s']:.0f} s |")
    memory = None
    if args.memory is not None:
        memory = memory_table(args.memory or [1000, 4000])
        print("\n| mode | gradient checkpointing | length | kept for backward | per residue "
              "| peak RSS |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for r in memory:
            print(f"| {r['mode']} | {'on' if r['checkpointing'] else 'off'} | {r['length']} | "
                  f"{r['saved_mib']:.0f} MiB | {r['saved_kib_per_residue']:.0f} KiB | "
                  f"{r['peak_rss_mib']:.0f} MiB |")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "n": len(seqs),
                    "rows": rows,
                    "memory": memory,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
