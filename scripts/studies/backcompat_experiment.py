#!/usr/bin/env python
"""Backward compatibility (Performer paper §4.3) on CPU: train exact, swap to FAVOR+, recover.

1. Train a small exact-attention MLM on the shared corpus with the project's ``train(cfg)``
   (Hydra compose; same data pipeline, optimizer and checkpointing as ``protein-performer
   train``) for ``--steps`` optimizer steps.
2. Swap: the same weights with FAVOR+ attention (``--kernel``, ``--nb-features``); record the
   held-out perplexity jump (mean over ``--swap-seeds`` feature draws, and the draw the
   fine-tune starts from).
3. Fine-tune the FAVOR+ model (weights initialized from step 1 through
   ``protein_performer.training.init_weights``) for ``--ft-steps`` steps, measuring held-out
   perplexity every ``--eval-every`` steps; once per ``--distill-weights`` value: 0 is MLM
   alone, w > 0 is (1 - w) MLM + w KL(exact twin || FAVOR+) (``model.distill``).

Held-out perplexity is exp(mean NLL) over the masked positions of the test split (hash split
of the records, never seen in training or validation; masks fixed by the data seed), so every
point of the curve is measured on the same tokens. Target (issue 7): back within 5% of the exact
model's perplexity in at most 10% of its training steps.

Writes to ``--out-dir``: ``exact/`` (the training run), ``recovery.csv``, ``recovery.png`` and
``recovery.md`` (summary and table, ready for docs/RESULTS.md). ``--exact-ckpt`` skips step 1
and starts from an earlier run's checkpoint (its step count is read from the checkpoint).

Examples::

    python scripts/studies/backcompat_experiment.py --help
    python scripts/studies/backcompat_experiment.py --quick            # wiring check, seconds
    python scripts/studies/backcompat_experiment.py --steps 3000 --ft-steps 300 --eval-every 25
    python scripts/studies/backcompat_experiment.py --distill-weights 0.5 --out-dir outputs/bc2 \\
        --exact-ckpt outputs/backcompat/exact/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness as h
import torch
import torch.nn.functional as F

from protein_performer.data.masking import IGNORE_INDEX

log = logging.getLogger("backcompat")
DEFAULT_DATA = [h.SEQUENCES / "uniprot_mmseqs_train.fasta",
                h.SEQUENCES / "swissprot_opal_train.fasta"]


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_ppl(model: torch.nn.Module, loader: Any) -> float:
    """exp(token-weighted mean NLL) over the loader's MLM targets, eval mode, same as val/ppl."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for batch in loader:
        tokens = batch["tokens"].to(device)
        targets = batch["targets"].to(device)
        logits = model(tokens, padding_mask=batch["padding_mask"].to(device)).logits
        nll += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum").item()
        count += int((targets != IGNORE_INDEX).sum())
    model.train(was_training)
    if count == 0:
        raise RuntimeError("the held-out split has no masked tokens: use more records")
    return math.exp(nll / count)


def make_eval_callback(loader: Any, every: int, curve: list[dict],
                       measure: Callable[[torch.nn.Module, Any], float] = heldout_ppl) -> Any:
    """Held-out perplexity (``measure``) at step 0 (after the step-0 feature draw, before any
    update), every ``every`` optimizer steps, and at the end."""
    import pytorch_lightning as pl

    class HeldoutCurve(pl.Callback):
        def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            step = trainer.global_step
            if curve and curve[-1]["step"] == step:
                return
            ppl = measure(pl_module.model, loader)
            curve.append({"step": step, "ppl": ppl})
            log.info("fine-tune step %d: held-out ppl %.4f", step, ppl)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step % every == 0:
                self._record(trainer, pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            self._record(trainer, pl_module)

    return HeldoutCurve()


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------
def base_overrides(args: argparse.Namespace) -> list[str]:
    paths = ",".join(str(p) for p in args.data)
    dim, depth, heads = args.shape
    overrides = ["experiment=small_mlm", f"trainer={args.trainer}", f"paths.root_dir={h.REPO}",
                 f"data.path=[{paths}]", f"data.max_len={args.max_len}",
                 f"data.max_tokens={args.max_tokens}", "data.num_workers=0",
                 f"data.valid_frac={args.heldout_frac}", f"data.test_frac={args.heldout_frac}",
                 f"model.config.dim={dim}", f"model.config.depth={depth}",
                 f"model.config.heads={heads}", f"model.config.ff_dim={4 * dim}",
                 f"seed={args.seed}", "task_name=backcompat", "callbacks.progress_bar=null",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    if args.limit_records:
        overrides.append(f"data.limit_records={args.limit_records}")
    return overrides


def train_exact(args: argparse.Namespace) -> tuple[str, Any]:
    """Phase 1 through the training engineer's pure ``train(cfg)``; returns the last checkpoint
    and the composed config."""
    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import train

    out = args.out_dir / "exact"
    overrides = [*base_overrides(args), "model.config.attention=exact",
                 f"model.optim.lr={args.lr}",
                 f"model.optim.warmup_steps={max(1, args.steps // 20)}",
                 f"trainer.max_steps={args.steps}",
                 f"trainer.val_check_interval={max(1, args.steps // 5)}",
                 "trainer.check_val_every_n_epoch=null",
                 f"trainer.log_every_n_steps={max(1, args.steps // 50)}"]
    cfg = compose_config(overrides, output_dir=out)
    result = train(cfg)
    ckpt = result.get("last_checkpoint") or result.get("best_checkpoint")
    if not ckpt:
        raise RuntimeError(f"training wrote no checkpoint (result: {result})")
    return ckpt, cfg


def fine_tune(args: argparse.Namespace, ckpt: str, loader: Any, weight: float,
              measure: Callable[[torch.nn.Module, Any], float] = heldout_ppl) -> list[dict]:
    """Phase 3: a FAVOR+ module initialized from ``ckpt``, fitted for ``--ft-steps`` steps with
    distillation weight ``weight`` against ``ckpt``'s exact-attention model (0: MLM alone); the
    curve's perplexities from ``measure``."""
    import hydra
    import pytorch_lightning as pl

    from protein_performer.training.callbacks import FeatureRedraw
    from protein_performer.training.compose import compose_config
    from protein_performer.training.init_weights import init_from

    out = args.out_dir / f"favor_finetune_w{weight:g}"
    overrides = [*base_overrides(args), "model.config.attention=favor",
                 f"model.config.kernel={args.kernel}",
                 f"model.config.nb_features={args.nb_features}",
                 f"model.config.feature_redraw_interval={args.redraw_interval}",
                 f"model.optim.lr={args.ft_lr}", f"model.optim.warmup_steps={args.ft_warmup}",
                 f"model.distill.teacher='{ckpt}'" if weight > 0 else "model.distill.teacher=null",
                 f"model.distill.weight={weight}",
                 f"model.distill.temperature={args.distill_temperature}",
                 f"trainer.max_steps={args.ft_steps}", "trainer.limit_val_batches=0",
                 "trainer.num_sanity_val_steps=0", "+trainer.enable_checkpointing=false",
                 f"trainer.log_every_n_steps={max(1, args.eval_every)}"]
    cfg = compose_config(overrides, output_dir=out)
    pl.seed_everything(args.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.model)
    init_from(module, ckpt)
    curve: list[dict] = []
    callbacks = [
        FeatureRedraw(interval=args.redraw_interval, seed=args.seed),  # first: draws step 0's ω
        make_eval_callback(loader, args.eval_every, curve, measure),
    ]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    trainer.fit(module, datamodule=datamodule)
    return curve


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _label(weight: float) -> str:
    return "MLM" if weight == 0 else f"MLM + distill (w={weight:g})"


def reached_step(curve: list[dict], target: float) -> int | None:
    """First measured fine-tune step at which held-out perplexity is at or below ``target``."""
    return next((p["step"] for p in curve if p["ppl"] <= target), None)


def write_report(args: argparse.Namespace, exact_ppl: float, swap_ppls: list[float],
                 curves: dict[float, list[dict]], seconds: dict[str, float]) -> str:
    target = 1.05 * exact_ppl
    budget = math.floor(0.10 * args.steps)
    weights = list(curves)
    points = [{"distill_weight": weight, **p, "ratio_to_exact": p["ppl"] / exact_ppl}
              for weight, curve in curves.items() for p in curve]
    h.write_csv(args.out_dir / "recovery.csv", points, list(points[0]))
    plot(args, exact_ppl, curves)

    dim, depth, heads = args.shape
    swap_mean = statistics.fmean(swap_ppls)
    swap_sd = statistics.stdev(swap_ppls) if len(swap_ppls) > 1 else 0.0
    source = (f"loaded from {args.exact_ckpt}" if args.exact_ckpt
              else f"trained with exact attention (lr {args.lr})")
    lines = [
        "## Backward compatibility: exact -> FAVOR+ swap and recovery", "",
        f"Model: MLM, dim {dim}, depth {depth}, heads {heads}, ff {4 * dim}; {args.steps} steps "
        f"{source} (<= {args.max_tokens} tokens per batch, max_len {args.max_len}) on "
        f"{', '.join(p.name for p in args.data)}"
        f"{f' (first {args.limit_records} records)' if args.limit_records else ''}. "
        f"Swap: FAVOR+ `{args.kernel}`, m = {args.nb_features}. Fine-tune: {args.ft_steps} steps, "
        f"lr {args.ft_lr}, feature redraw every {args.redraw_interval} steps, distillation "
        f"temperature {args.distill_temperature:g}. Held-out: test split, perplexity over masked "
        "positions.",
        "",
        f"Exact model: held-out perplexity {exact_ppl:.4f}. FAVOR+ swap without fine-tuning: "
        f"{swap_mean:.4f} ± {swap_sd:.4f} (mean ± sd over {len(swap_ppls)} feature seeds), "
        f"{swap_mean / exact_ppl:.3f}× exact.",
        "",
        "| fine-tune step | " + " | ".join(f"{_label(w)}: ppl (× exact)" for w in weights) + " |",
        "|---:|" + "---:|" * len(weights)]
    steps = sorted({p["step"] for curve in curves.values() for p in curve})
    by_step = {w: {p["step"]: p["ppl"] for p in curve} for w, curve in curves.items()}
    for step in steps:
        cells = [f"{by_step[w][step]:.4f} ({by_step[w][step] / exact_ppl:.3f})"
                 if step in by_step[w] else "" for w in weights]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines.append("")
    summary: dict[str, Any] = {"exact_ppl": exact_ppl, "swap_ppls": swap_ppls, "runs": []}
    for weight, curve in curves.items():
        reached = reached_step(curve, target)
        met = reached is not None and reached <= budget
        verdict = (
            f"within 5% of exact after {reached} steps ({100 * reached / args.steps:.1f}% of "
            f"the exact model's steps): target {'met' if met else 'NOT met'} (budget {budget})"
            if reached is not None
            else f"not within 5% of exact after {args.ft_steps} steps: target NOT met"
        )
        lines.append(f"- {_label(weight)}: {verdict}.")
        summary["runs"].append(
            {"distill_weight": weight, "curve": curve, "reached_step": reached, "target_met": met})
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    lines += ["", f"Wall time: {timing}.", "Figure: recovery.png. Reproduce: `python "
              f"scripts/studies/backcompat_experiment.py {' '.join(args.argv)}`."]
    text = "\n".join(lines) + "\n"
    (args.out_dir / "recovery.md").write_text(text, encoding="utf-8")
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return text


def plot(args: argparse.Namespace, exact_ppl: float, curves: dict[float, list[dict]]) -> None:
    with h.figure(args.out_dir / "recovery.png") as (ax,):
        for weight, curve in curves.items():
            ax.plot([p["step"] for p in curve], [p["ppl"] for p in curve], "o-", ms=3,
                    label=_label(weight))
        ax.axhline(exact_ppl, color="k", ls="--", lw=1, label=f"exact ({exact_ppl:.3f})")
        ax.axhline(1.05 * exact_ppl, color="gray", ls=":", lw=1, label="exact + 5%")
        ax.axvline(0.10 * args.steps, color="tab:red", ls=":", lw=1,
                   label="10% of training steps")
        ax.set(xlabel="fine-tuning steps after the swap", ylabel="held-out perplexity",
               title=f"exact -> FAVOR+ ({args.kernel}, m={args.nb_features}) recovery")
        ax.legend(fontsize=8)


# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--data", type=Path, nargs="+", default=DEFAULT_DATA, help="FASTA file(s)")
    p.add_argument("--limit-records", type=int, default=None, help="first N records only")
    p.add_argument("--heldout-frac", type=float, default=0.02, help="valid and test fractions")
    p.add_argument("--shape", nargs=3, type=int, default=(128, 4, 8),
                   metavar=("DIM", "DEPTH", "HEADS"),
                   help="model shape (ff = 4 * dim); default: 128 4 8")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3000, help="exact training steps (N)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kernel", default="softmax", help="FAVOR+ kernel after the swap")
    p.add_argument("--nb-features", type=int, default=64, help="FAVOR+ m after the swap")
    p.add_argument("--swap-seeds", type=int, default=3, help="feature draws for the jump")
    p.add_argument("--ft-steps", type=int, default=None, help="fine-tune steps (M; default N/10)")
    p.add_argument("--ft-lr", type=float, default=3e-4)
    p.add_argument("--ft-warmup", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=None, help="K (default M/12)")
    p.add_argument("--redraw-interval", type=int, default=100)
    p.add_argument(
        "--distill-weights", type=float, nargs="+", default=[0.0, 0.5], metavar="W",
        help="one fine-tune per weight: 0 = MLM alone, w = (1-w) MLM + w KL to the exact twin")
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument(
        "--exact-ckpt", type=Path, default=None,
        help="skip training: start from this exact-attention .ckpt (same --shape and data)")
    p.add_argument("--trainer", default="cpu", help="trainer config group option (cpu, gpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out-dir", type=Path, default=h.REPO / "outputs" / "backcompat")
    p.add_argument("--overwrite", action="store_true",
                   help="replace earlier runs' outputs in --out-dir")
    p.add_argument("--quick", action="store_true",
                   help="wiring check in seconds: tiny model, 600 records, 40 + 20 steps")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.shape = (32, 2, 4)
        args.limit_records = args.limit_records or 600
        args.heldout_frac = max(args.heldout_frac, 0.05)
        args.max_len = min(args.max_len, 128)
        args.max_tokens = min(args.max_tokens, 2048)
        args.steps = min(args.steps, 40)
        args.ft_steps = 20
        args.eval_every = 5
        args.nb_features = min(args.nb_features, 32)
        args.swap_seeds = 2
        args.redraw_interval = 10
    if args.exact_ckpt:
        from protein_performer.io.checkpoints import safe_load

        if not args.exact_ckpt.is_file():
            p.error(f"--exact-ckpt {args.exact_ckpt}: no such file")
        meta = safe_load(args.exact_ckpt)
        args.steps = int(meta.get("global_step", args.steps))  # the 10% budget is of these
    if any(not 0 <= w <= 1 for w in args.distill_weights):
        p.error("--distill-weights must be in [0, 1]")
    args.ft_steps = args.ft_steps or max(1, args.steps // 10)
    args.eval_every = args.eval_every or max(1, args.ft_steps // 12)
    missing = [str(p) for p in args.data if not p.is_file()]
    if missing:
        p.error(f"data file(s) not found: {', '.join(missing)} (give --data FASTA ...)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    h.setup_logging()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [args.out_dir / f"favor_finetune_w{w:g}" for w in args.distill_weights]
    if not args.exact_ckpt:
        runs.append(args.out_dir / "exact")
    h.fresh_outputs(args.out_dir, runs, args.overwrite)

    import hydra

    from protein_performer.interop.loading import load_model
    from protein_performer.training.compose import compose_config

    start = time.perf_counter()
    if args.exact_ckpt:
        ckpt = str(args.exact_ckpt)
        cfg = compose_config(base_overrides(args), output_dir=args.out_dir)
        seconds = {}
    else:
        ckpt, cfg = train_exact(args)
        seconds = {"exact training": time.perf_counter() - start}
        log.info("exact model trained: %s", ckpt)

    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("test")
    test_loader = datamodule.test_dataloader()
    device = "cpu" if args.trainer == "cpu" else "auto"
    exact = load_model(ckpt, device)
    exact_ppl = heldout_ppl(exact.model, test_loader)
    swap_ppls = [
        heldout_ppl(
            load_model(exact, device, attention="favor", kernel=args.kernel,
                       nb_features=args.nb_features, seed=s).model,
            test_loader,
        )
        for s in range(args.swap_seeds)
    ]
    log.info("held-out ppl: exact %.4f, FAVOR+ swap %s", exact_ppl, swap_ppls)

    curves = {}
    for weight in args.distill_weights:
        start = time.perf_counter()
        curves[weight] = fine_tune(args, ckpt, test_loader, weight)
        seconds[f"fine-tune ({_label(weight)})"] = time.perf_counter() - start
    print(write_report(args, exact_ppl, swap_ppls, curves, seconds))
    log.info("wrote %s", args.out_dir / "recovery.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
