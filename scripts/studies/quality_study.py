#!/usr/bin/env python
"""Quality at equal compute: FAVOR+ (softmax, relu kernels) against exact attention.

The same small MLM (``experiment=small_mlm`` unless ``--experiment``) is trained three times, as
``favor-softmax``, ``favor-relu`` and ``exact``, for the same wall-clock training time each
(``--minutes``, the project's ``TimeBudget`` callback with ``clock=wall``: validation is not
counted), on the same data with the same seed, each with ``protein-performer train`` in a fresh
process (so one run's allocator and thread state cannot slow the next). Each final checkpoint
(``last.ckpt``, written by the validation that runs when the time is up) is then scored with
``protein-performer eval`` on the same held-out split: perplexity and accuracy on the masked
positions of a fixed-seed masking, identical for every variant. The unigram baseline (the
residue frequencies of the training split) is scored on those same positions.

Why wall-clock and not steps: FAVOR+ buys speed, so the fair question is which model is better
after the same compute; a faster variant simply runs more optimizer steps. The LR schedule is the
experiment's (warmup + cosine over ``trainer.max_steps``), identical per step for all variants.

Why the held-out split is written to a FASTA: ``eval`` scores every record of a FASTA, and its
masks are a function of (seed, record index), so one file in one order gives every variant (and
the unigram baseline) the very same masked positions. The split is the datamodule's own (hash
of the record id; ``data.valid_frac``/``data.test_frac`` of the composed config), so it is
disjoint from what the models trained on.

Every command is printed and written to the report. Outputs under ``--out``: ``runs/<variant>/``
(the Hydra run directories, with ``time_budget.json``: val/ppl against training time for the
plot), ``logs/``, ``quality.csv``, ``quality.md``, ``quality.png`` and the held-out FASTA.

Examples::

    python scripts/studies/quality_study.py --quick          # 1 minute per variant, tiny model
    python scripts/studies/quality_study.py                  # 30 minutes per variant
    python scripts/studies/quality_study.py --trainer gpu --minutes 30 --out outputs/quality_gpu
    python scripts/studies/quality_study.py --skip-existing  # re-evaluate finished runs only
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import harness as h

log = logging.getLogger("quality_study")

VARIANTS = ("favor-softmax", "favor-relu", "exact")
DEFAULT_DATA = "../shared/data/sequences/*.fasta"
#: Within this relative margin of exact's held-out perplexity counts as a pass (issue 4).
TARGET_MARGIN = 0.05
#: A tiny model and short crops for ``--quick`` (smoke runs of the whole pipeline).
QUICK_OVERRIDES = ["model.config.dim=64", "model.config.depth=2", "model.config.heads=4",
                   "model.config.ff_dim=128", "model.config.nb_features=32",
                   "model.config.feature_redraw_interval=50", "model.optim.warmup_steps=20",
                   "data.max_len=256", "data.max_tokens=4096", "data.limit_records=3000",
                   "data.num_workers=0"]
CSV_FIELDS = ("variant", "attention", "kernel", "steps", "train_minutes", "split", "records",
              "tokens", "loss", "ppl", "acc", "ppl_vs_exact", "checkpoint", "command")


def hms(minutes: float) -> str:
    """Minutes -> Lightning's ``DD:HH:MM:SS`` (a time-based ``val_check_interval``)."""
    total = max(1, round(minutes * 60))
    d, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d:02d}:{hours:02d}:{m:02d}:{s:02d}"


def data_paths(pattern: str) -> list[str]:
    """Expand ``--data`` (comma list of paths or globs), sorted so every variant sees one order."""
    paths: list[str] = []
    for item in (x.strip() for x in pattern.split(",")):
        if not item:
            continue
        matches = sorted(glob.glob(item))
        if not matches:
            raise SystemExit(f"error: --data {item!r} matches no file")
        paths.extend(matches)
    return paths


def shared_overrides(args: argparse.Namespace, budget: h.Budget) -> list[str]:
    """What every variant's run shares (the data the held-out split is taken from)."""
    overrides = [f"experiment={args.experiment}"]
    if args.trainer:
        overrides.append(f"trainer={args.trainer}")
    overrides += [*budget.overrides(), f"trainer.val_check_interval={hms(args.val_every_min)}",
                  f"seed={args.seed}", "trainer.enable_progress_bar=false"]
    if args.data:
        overrides.append(f"data.path=[{','.join(data_paths(args.data))}]")
    if args.quick:
        overrides += QUICK_OVERRIDES
    return [*overrides, *args.override]


def heldout_split(cfg: Any, split: str, out_dir: Path) -> tuple[Path, Any, Any]:
    """Write the datamodule's held-out split as FASTA; returns it and the train/held-out sources.

    The datamodule is built from the composed run config, so its split is exactly the one the
    runs used (same paths, fractions, ``split_by``).
    """
    import hydra

    from protein_performer.data.tokenizer import Alphabet

    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    held = dm.sources[split]
    if len(held) == 0:
        raise SystemExit(f"error: the {split} split is empty; raise data.{split}_frac")
    alphabet = Alphabet()
    path = out_dir / f"heldout_{split}.fasta"
    with path.open("w") as fh:
        for i in range(len(held)):
            fh.write(f">{held.id(i)}\n{alphabet.decode(held.tokens(i))}\n")
    log.info("held-out %s split: %d records -> %s", split, len(held), path)
    return path, dm.sources["train"], held


def plot(rows: list[dict[str, Any]], unigram_ppl: float, path: Path, title: str) -> None:
    """val/ppl against wall-clock training minutes, one line per variant, and the unigram."""
    with h.figure(path, size=(7, 4.5)) as (ax,):
        for r in rows:
            pts = [(t / 60, ppl) for t, _, ppl in r.get("curve", ()) if math.isfinite(ppl)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=r["variant"])
        if math.isfinite(unigram_ppl):
            ax.axhline(unigram_ppl, ls="--", color="gray", label="unigram (held-out)")
        ax.set(xlabel="wall-clock training time [min]", ylabel="val/ppl (validation split)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_title(textwrap.fill(title, 100), fontsize=8)


def verdict_line(rows: list[dict[str, Any]], exact: float) -> str:
    favor = [r for r in rows if r["attention"] == "favor"]
    if not (favor and math.isfinite(exact)):
        return "Target: n/a (needs the exact run and at least one FAVOR+ run)"
    best = min(favor, key=lambda r: r["ppl"])
    ok = best["ppl"] <= (1 + TARGET_MARGIN) * exact
    return (
        f"Target (best FAVOR+ within {TARGET_MARGIN:.0%} of exact's perplexity): "
        f"{'PASS' if ok else 'FAIL'}: {best['variant']} {best['ppl']:.3f} vs exact "
        f"{exact:.3f} ({best['ppl'] / exact - 1:+.1%})"
    )


def run_study(args: argparse.Namespace) -> int:
    from protein_performer.training.compose import compose_config

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [x for x in args.variants.split(",") if x]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    budget = h.Budget(seconds=args.minutes * 60, clock="wall")
    shared = shared_overrides(args, budget)
    # One composed config defines the data (identical across variants: only model keys differ).
    cfg = compose_config(shared, output_dir=out / "runs" / names[0])
    max_len, mlm_prob = int(cfg.data.max_len), float(cfg.data.mlm_prob)
    fasta, train_source, held = heldout_split(cfg, args.split, out)
    runs = []
    for name in names:
        run = h.Run(name, [*shared, *h.ATTENTION[name]], out / "runs" / name, {"variant": name})
        eval_dir = run.run_dir / f"eval_{args.split}"
        # fmt: off
        cmd = h.cli("eval", str(run.checkpoint), str(fasta), "--max-len", str(max_len),
                    "--mlm-prob", f"{mlm_prob:g}", "--seed", str(args.eval_seed), "--device",
                    args.eval_device, "--no-progress", "--out-dir", str(eval_dir), "--overwrite")
        # fmt: on
        run.after.append(("eval", cmd, eval_dir / "metrics.json"))
        runs.append(run)

    def collect(run: h.Run) -> dict[str, Any]:
        metrics = json.loads((run.run_dir / f"eval_{args.split}" / "metrics.json").read_text())
        attention = "exact" if run.name == "exact" else "favor"
        return {**metrics["overall"], "attention": attention,
                "kernel": "-" if attention == "exact" else run.name.split("-", 1)[1],
                "split": args.split, "checkpoint": str(run.checkpoint)}

    rows = [r.result for r in h.run_all(runs, budget, args, collect)]
    uni = h.unigram_baseline(train_source, held, "mlm", max_len, mlm_prob, args.eval_seed)
    log.info("unigram baseline: ppl %.3f acc %.4f", uni["ppl"], uni["acc"])
    for r in rows:
        r["train_minutes"] = r["train_cpu_s"] / 60
        if r["tokens"] != uni["tokens"]:
            log.warning("%s scored %d positions, the unigram baseline %d: masks differ",
                        r["variant"], r["tokens"], uni["tokens"])  # fmt: skip
    rows.append({**uni, "variant": "unigram", "attention": "-", "kernel": "-", "steps": "",
                 "train_minutes": math.nan, "split": args.split, "checkpoint": "",
                 "command": ""})  # fmt: skip
    exact = next((r["ppl"] for r in rows if r["variant"] == "exact"), math.nan)
    for r in rows:
        r["ppl_vs_exact"] = r["ppl"] / exact if math.isfinite(exact) else math.nan

    header = (
        f"{args.experiment}{' (quick: tiny model)' if args.quick else ''}, "
        f"{args.minutes:g} min each, seed {args.seed}; held-out = {args.split} split "
        f"({uni['records']} records, {uni['tokens']} masked positions, "
        f"mask seed {args.eval_seed}, max_len {max_len})"
    )
    table = h.markdown_table(
        ["variant", "steps", "train min", "held-out ppl", "masked acc", "ppl / exact"],
        ([r["variant"], r["steps"], h.cell([r["train_minutes"]], 1, 1), f"{r['ppl']:.3f}",
          f"{r['acc']:.4f}", f"{r['ppl_vs_exact']:.3f}"] for r in rows),
    )  # fmt: skip
    text = "\n".join([header, "", table, "", verdict_line(rows, exact), "",
                      "Reproduce (one command per variant):", "",
                      *(f"    {r['command']}" for r in rows if r["command"])])  # fmt: skip
    h.write_csv(out / "quality.csv", rows, CSV_FIELDS)
    h.write_markdown(out / "quality.md", "Quality at equal compute", text + "\n")
    plot(rows[:-1], uni["ppl"], out / "quality.png", header)
    print(text)
    log.info("wrote %s, %s, %s", out / "quality.csv", out / "quality.md", out / "quality.png")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "Method and outputs: see the module docstring.")
    p.add_argument("--out", type=Path, default=Path("outputs/quality_study"))
    p.add_argument("--experiment", default="small_mlm", help="base experiment config")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget per variant")
    p.add_argument("--val-every-min", type=float, default=0.0,
                   help="validation interval in minutes (time-based; default: minutes / 10)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="FASTA path(s)/glob(s), comma separated ('' = the experiment's data.path)")
    p.add_argument("--seed", type=int, default=0, help="run seed (weights, data order, masks)")
    p.add_argument("--trainer", default="", help="trainer config (cpu, gpu, ...); '' = default")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    p.add_argument("--split", default="test", choices=("valid", "test"), help="held-out split")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out masks")
    p.add_argument("--eval-device", default="auto", help="device for the evaluation")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every variant (repeatable)")
    p.add_argument("--skip-existing", action="store_true",
                   help="reuse finished runs in --out (only evaluate and report)")
    p.add_argument("--quick", action="store_true", help="1 minute per variant on a tiny model")
    args = p.parse_args(argv)
    if args.quick and args.minutes == p.get_default("minutes"):
        args.minutes = 1.0
    if args.val_every_min <= 0:
        # ~10 validations per run; 4 in --quick, where validation would otherwise eat the minute.
        args.val_every_min = args.minutes / (4 if args.quick else 10)
    args.jobs, args.report_only = 1, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    h.setup_logging()
    return run_study(args)


if __name__ == "__main__":
    sys.exit(main())
