#!/usr/bin/env python
"""Linearizing a trained exact MLM: attention transfer (+ LoRA) against today's FAVOR+ recipe.

On one exact-attention checkpoint (``--exact-ckpt``; without it, a small exact MLM is first
trained for ``--exact-steps`` steps with the project's ``train(cfg)`` on ``--data``, as the
Performer paper's §4.3 backward-compatibility experiment does; ``--quick`` trains a tiny one),
held-out perplexity against the exact model's, with the compute each row spent (optimizer
steps, trainable parameters, CPU seconds of this process, held-out evaluation excluded):

- swap only: the same weights under FAVOR+ (``--nb-features``) and under the untrained
  linear map (``--kernel``, each ``--windows`` value);
- today's recipe: the FAVOR+ model fine-tuned for ``--ft-steps`` full-model steps on MLM
  + ``--distill-weight`` KL to the exact twin (``model.distill``), with the
  first evaluated step at which it reached 1.02x and the CPU seconds up to that step (its
  fitting time times that step's share of ``--ft-steps``);
- attention transfer alone (``protein_performer.training.linearize``, ``--transfer-steps``),
  then + LoRA (``--lora-steps``, ``--kl-weight``), once per ``--windows`` value.

Held-out perplexity is exp(mean NLL) over the masked positions of the test split of the same
data and split the exact model was trained on (hash split; never fitted on by any row; masks
fixed by the data seed), so every row is measured on the same tokens.

The verdict line (the issue's target): which linearized rows reach <= 1.01x in fewer CPU
seconds than the recipe needed for 1.02x. Writes ``--out-dir``/``linearize.csv`` and
``linearize.md``.

Examples::

    python scripts/studies/linearize_benchmark.py --quick
    python scripts/studies/linearize_benchmark.py --threads 1 --exact-steps 3000
    python scripts/studies/linearize_benchmark.py --threads 1 \\
        --exact-ckpt outputs/linearize/exact/checkpoints/last.ckpt --out-dir outputs/lin2
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness as h
import torch
import torch.nn.functional as F

from protein_performer.data.masking import IGNORE_INDEX
from protein_performer.training.linearize_options import LinearizeOptions

log = logging.getLogger("linearize_benchmark")
FIELDS = ("method", "window", "steps", "trainable", "cpu_s", "ppl", "ratio", "reached_1.02x",
          "cpu_s_to_1.02x")
TARGET, RECIPE_TARGET = 1.01, 1.02  # the issue: <= 1.01x for less than the recipe's 1.02x


class EvalClock:
    """Held-out perplexity: exp(token-weighted mean NLL) over the loader's MLM targets, eval
    mode, same as val/ppl; its CPU time kept apart (``seconds``), so rows count their fitting
    alone."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, loader: Any) -> float:
        start, was_training = time.process_time(), model.training
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
        self.seconds += time.process_time() - start
        if count == 0:
            raise RuntimeError("the held-out split has no masked tokens: use more records")
        return math.exp(nll / count)


def make_eval_callback(loader: Any, every: int, curve: list[dict],
                       measure: Callable[[torch.nn.Module, Any], float]) -> Any:
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


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The exact model's data and shape, shared by its training, the fine-tune and the test
    split every row is measured on."""
    paths = ",".join(str(p) for p in args.data)
    dim, depth, heads = args.shape
    overrides = ["experiment=small_mlm", "trainer=cpu", f"paths.root_dir={h.REPO}",
                 f"data.path=[{paths}]", f"data.max_len={args.max_len}",
                 f"data.max_tokens={args.max_tokens}", "data.num_workers=0",
                 f"data.valid_frac={args.heldout_frac}", f"data.test_frac={args.heldout_frac}",
                 f"model.config.dim={dim}", f"model.config.depth={depth}",
                 f"model.config.heads={heads}", f"model.config.ff_dim={4 * dim}",
                 f"seed={args.seed}", "task_name=linearize", "callbacks.progress_bar=null",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    if args.limit_records:
        overrides.append(f"data.limit_records={args.limit_records}")
    return overrides


def train_exact(args: argparse.Namespace) -> str:
    """The exact model through the project's pure ``train(cfg)`` (``--exact-steps`` steps,
    cosine over them); returns its last checkpoint."""
    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import train

    steps = args.exact_steps
    overrides = [*base_overrides(args), "model.config.attention=exact",
                 f"model.optim.lr={args.exact_lr}",
                 f"model.optim.warmup_steps={max(1, steps // 20)}",
                 f"trainer.max_steps={steps}",
                 f"trainer.val_check_interval={max(1, steps // 5)}",
                 "trainer.check_val_every_n_epoch=null",
                 f"trainer.log_every_n_steps={max(1, steps // 50)}"]
    result = train(compose_config(overrides, output_dir=args.out_dir / "exact"))
    ckpt = result.get("last_checkpoint") or result.get("best_checkpoint")
    if not ckpt:
        raise RuntimeError(f"training wrote no checkpoint (result: {result})")
    return ckpt


def fine_tune(args: argparse.Namespace, ckpt: str, loader: Any,
              measure: Callable[[torch.nn.Module, Any], float]) -> list[dict]:
    """Today's recipe: a FAVOR+ softmax module initialized from ``ckpt``, fitted for
    ``--ft-steps`` steps on MLM + ``--distill-weight`` KL against ``ckpt``'s exact model (0: MLM
    alone), features redrawn every 100 steps; the curve's perplexities from ``measure``."""
    import hydra
    import pytorch_lightning as pl

    from protein_performer.training.callbacks import FeatureRedraw
    from protein_performer.training.compose import compose_config
    from protein_performer.training.init_weights import init_from

    weight, redraw, every = args.distill_weight, 100, max(1, args.ft_steps // 12)
    overrides = [*base_overrides(args), "model.config.attention=favor",
                 "model.config.kernel=softmax", f"model.config.nb_features={args.nb_features}",
                 f"model.config.feature_redraw_interval={redraw}",
                 f"model.optim.lr={args.ft_lr}", "model.optim.warmup_steps=10",
                 f"model.distill.teacher='{ckpt}'" if weight > 0 else "model.distill.teacher=null",
                 f"model.distill.weight={weight}", "model.distill.temperature=1.0",
                 f"trainer.max_steps={args.ft_steps}", "trainer.limit_val_batches=0",
                 "trainer.num_sanity_val_steps=0", "+trainer.enable_checkpointing=false",
                 f"trainer.log_every_n_steps={every}"]
    cfg = compose_config(overrides, output_dir=args.out_dir / f"favor_finetune_w{weight:g}")
    pl.seed_everything(args.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.model)
    init_from(module, ckpt)
    curve: list[dict] = []
    callbacks = [
        FeatureRedraw(interval=redraw, seed=args.seed),  # first: draws step 0's ω
        make_eval_callback(loader, every, curve, measure),
    ]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    trainer.fit(module, datamodule=datamodule)
    return curve


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--exact-ckpt", type=Path, default=None,
                   help="the exact model (.ckpt); default: train one (--exact-steps)")
    p.add_argument("--exact-steps", type=int, default=3000,
                   help="without --exact-ckpt: the exact model's training steps")
    p.add_argument("--exact-lr", type=float, default=1e-3, help="its learning rate")
    p.add_argument("--data", type=Path, nargs="+", default=[Path(f) for f in h.DEFAULT_DATA],
                   help="the FASTA file(s) the exact model was (or is) trained on")
    p.add_argument("--limit-records", type=int, default=None)
    p.add_argument("--heldout-frac", type=float, default=0.02)
    p.add_argument("--shape", nargs=3, type=int, default=(128, 4, 8),
                   metavar=("DIM", "DEPTH", "HEADS"), help="the exact model's shape")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--nb-features", type=int, default=64, help="FAVOR+ m (swap, fine-tune)")
    p.add_argument("--ft-steps", type=int, default=300, help="FAVOR+ fine-tune steps")
    p.add_argument("--ft-lr", type=float, default=3e-4)
    p.add_argument("--distill-weight", type=float, default=0.5, help="FAVOR+ fine-tune KL")
    p.add_argument("--kernel", default="hedgehog", help="linear map (hedgehog, taylor)")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 64], help="exact windows")
    p.add_argument("--transfer-steps", type=int, default=LinearizeOptions().steps,
                   help="attention-transfer steps (default: linearize's)")
    p.add_argument("--transfer-lr", type=float, default=0.1)
    p.add_argument("--lora-steps", type=int, default=100)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--kl-weight", type=float, default=0.5, help="LoRA stage KL weight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=h.REPO / "outputs" / "linearize")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="wiring check: a tiny exact model trained for 40 steps, few steps each")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.limit_records, args.heldout_frac = (32, 2, 4), 600, 0.05
        args.max_len, args.max_tokens = 128, 2048
        args.nb_features, args.ft_steps, args.windows = 32, 6, [0, 8]
        args.transfer_steps, args.lora_steps = 6, 4
        args.data = [Path(p) for p in h.QUICK_DATA]
        args.exact_steps = 40
    missing = [str(f) for f in args.data if not f.is_file()]
    if missing:
        p.error(f"data file(s) not found: {', '.join(missing)} (give --data FASTA ...)")
    return args


def target_verdict(rows: list[dict[str, Any]], recipe_cpu: float | None) -> str:
    """The issue's target in one line: linearized rows at <= 1.01x for less CPU than the
    recipe's 1.02x (a recipe that never reached 1.02x leaves any such row ahead)."""
    linear = [r for r in rows if r["method"].startswith("attention transfer")]
    met = [r for r in linear if r["ratio"] <= TARGET
           and (recipe_cpu is None or r["cpu_s"] < recipe_cpu)]  # fmt: skip
    recipe = ("never reached 1.02x" if recipe_cpu is None
              else f"reached 1.02x after {recipe_cpu:.0f} CPU s")  # fmt: skip
    if not met:
        best = min(linear, key=lambda r: r["ratio"], default=None)
        closest = "" if best is None else (
            f"; closest: {best['method']}, window {best['window']}, {best['ratio']}x "
            f"in {best['cpu_s']} CPU s")  # fmt: skip
        return f"target (<= {TARGET}x for less than the recipe, which {recipe}): missed{closest}"
    names = "; ".join(f"{r['method']}, window {r['window']}: {r['ratio']}x in {r['cpu_s']} CPU s"
                      for r in met)  # fmt: skip
    return f"target (<= {TARGET}x for less than the recipe, which {recipe}): met by {names}"


def main(argv: Sequence[str] | None = None) -> int:
    h.setup_logging()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    h.fresh_outputs(args.out_dir, args.overwrite)

    import hydra

    from protein_performer.interop.loading import load_model
    from protein_performer.training import linearize as lz
    from protein_performer.training.compose import compose_config

    ckpt = str(args.exact_ckpt) if args.exact_ckpt else train_exact(args)
    cfg = compose_config(base_overrides(args), output_dir=args.out_dir)
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("test")
    test = dm.test_dataloader()
    clock = EvalClock()
    exact = load_model(ckpt, "cpu")
    exact_ppl = clock(exact.model, test)
    rows: list[dict[str, Any]] = []

    def row(method: str, window: Any, steps: int, trainable: int, cpu: float, ppl: float,
            reached: Any = "", cpu_to: Any = "") -> None:
        rows.append({"method": method, "window": window, "steps": steps, "trainable": trainable,
                     "cpu_s": round(cpu, 1), "ppl": round(ppl, 4),
                     "ratio": round(ppl / exact_ppl, 4), "reached_1.02x": reached,
                     "cpu_s_to_1.02x": cpu_to})
        log.info("%s", rows[-1])

    row("exact", "", 0, 0, 0.0, exact_ppl)
    favor = load_model(exact, "cpu", attention="favor", kernel="softmax",
                       nb_features=args.nb_features, seed=args.seed)
    row("FAVOR+ swap", "", 0, 0, 0.0, clock(favor.model, test))
    for w in args.windows:
        swap = lz.linear_student(exact.model, args.kernel, w)
        row(f"{args.kernel} swap (untrained map)", w, 0, 0, 0.0, clock(swap, test))

    before, start = clock.seconds, time.process_time()
    curve = fine_tune(args, ckpt, test, clock)
    cpu = time.process_time() - start - (clock.seconds - before)
    reached = next((p["step"] for p in curve if p["ppl"] <= RECIPE_TARGET * exact_ppl), None)
    recipe_cpu = None if reached is None else cpu * reached / args.ft_steps
    n_params = exact.model.num_parameters()
    row(f"FAVOR+ fine-tune (MLM + {args.distill_weight:g} KL)", "", args.ft_steps, n_params,
        cpu, curve[-1]["ppl"], "no" if reached is None else reached,
        "" if recipe_cpu is None else round(recipe_cpu, 1))

    for w in args.windows:
        out = args.out_dir / f"{args.kernel}_w{w}"
        seen: dict[str, float] = {}

        def transferred(model: torch.nn.Module, seen: dict[str, float] = seen) -> None:
            seen["cpu"] = time.process_time()
            seen["ppl"] = clock(model, test)

        before, start = clock.seconds, time.process_time()
        result = lz.fit_linear(
            ckpt, out, [str(p) for p in args.data],
            lz.LinearizeOptions(steps=args.transfer_steps, lora_steps=args.lora_steps,
                                lora_lr=args.lora_lr, kl_weight=args.kl_weight,
                                kernel=args.kernel, window=w, lr=args.transfer_lr,
                                max_len=args.max_len, max_tokens=args.max_tokens,
                                heldout_frac=args.heldout_frac, seed=args.seed,
                                save_every=10**9),
            device="cpu", show_progress=False, after_transfer=transferred,
        )  # fmt: skip
        cpu = time.process_time() - start - (clock.seconds - before)
        model = load_model(out, "cpu").model
        fitted = sum(p.numel() for p in lz._core_params(model).values())
        row("attention transfer", w, result.transfer_steps, fitted, seen["cpu"] - start,
            seen["ppl"])
        if args.lora_steps:
            d, r = exact.config.dim, lz.LinearizeOptions().lora_rank
            adapters = exact.config.depth * len(lz.LORA_TARGETS) * 2 * d * r
            row(f"attention transfer + LoRA (MLM + {args.kl_weight:g} KL)", w,
                result.transfer_steps + result.lora_steps, fitted + adapters, cpu,
                clock(model, test))

    h.write_csv(args.out_dir / "linearize.csv", rows, FIELDS)
    verdict = target_verdict(rows, recipe_cpu)
    print(verdict)
    text = (
        f"Exact model: {ckpt} (held-out ppl {exact_ppl:.4f}); data "
        f"{', '.join(str(p) for p in args.data)}; {torch.get_num_threads()} torch thread(s). "
        "cpu_s: this process's CPU seconds fitting the row (held-out evaluation excluded); "
        "trainable: parameters the row updates.\n\n"
        + h.markdown_table(FIELDS, [[r[f] for f in FIELDS] for r in rows])
        + f"\n\n{verdict}\n"
    )
    h.write_markdown(args.out_dir / "linearize.md", "Linearizing an exact MLM", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
