#!/usr/bin/env python
"""Quality at equal compute: FAVOR+ (softmax, relu kernels) against exact attention.

The same small MLM (``experiment=small_mlm`` unless ``--experiment``) is trained three times, as
``favor-softmax``, ``favor-relu`` and ``exact``, for the same wall-clock budget each
(``--minutes``, Lightning's ``trainer.max_time``), on the same data with the same seed, through the
project's real ``train(cfg)`` composed by Hydra (``compose_config``). Each final checkpoint
(``last.ckpt``, written by the validation that runs when the time is up) is then scored on the
same held-out split with ``protein_performer.inference.evaluate``: perplexity and accuracy on the
masked positions of a fixed-seed masking, identical for every variant. The unigram baseline is
computed here: the residue frequencies of the training split, scored on those same positions.

Why wall-clock and not steps: FAVOR+ buys speed, so the fair question is which model is better
after the same compute; a faster variant simply runs more optimizer steps. The LR schedule is the
experiment's (warmup + cosine over ``trainer.max_steps``), identical per step for all variants.

Why the held-out split is written to a FASTA: ``evaluate`` scores every record of a FASTA, and
its masks are a function of (seed, record index), so one file in one order gives every variant
(and the unigram baseline) the very same masked positions. The split is the datamodule's own
(hash of the record id; ``data.valid_frac``/``data.test_frac`` of the composed config), so it is
disjoint from what the models trained on.

Each variant trains in a fresh process (so one run's allocator and thread state cannot slow the
next) and reproduces from one command, printed and written to the report, e.g.::

    protein-performer train experiment=small_mlm model.config.attention=exact \\
        ++trainer.max_time=00:00:30:00 seed=0 ...

The study adds one observer callback to each run (``++callbacks.wall_clock``, it records wall
time at each validation for the plot and changes nothing in training); it is left out of the
printed command. Outputs under ``--out``: ``runs/<variant>/`` (the Hydra run directories),
``quality.csv``, ``quality.md``, ``quality.png`` (val/ppl vs wall time) and the held-out FASTA.

Examples::

    python scripts/quality_study.py --quick              # 1 minute per variant, tiny model
    python scripts/quality_study.py                      # 30 minutes per variant (CPU default)
    python scripts/quality_study.py --trainer gpu --minutes 30 --out outputs/quality_gpu
    python scripts/quality_study.py --skip-existing      # re-evaluate finished runs only
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import json
import logging
import math
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import _common as common

log = logging.getLogger("quality_study")

#: Variant name -> the overrides that make it (everything else is shared).
VARIANTS: dict[str, list[str]] = {
    "favor-softmax": ["model.config.attention=favor", "model.config.kernel=softmax"],
    "favor-relu": ["model.config.attention=favor", "model.config.kernel=relu"],
    "exact": ["model.config.attention=exact"],
}
DEFAULT_DATA = "../shared/data/sequences/*.fasta"
#: Within this relative margin of exact's held-out perplexity counts as a pass (issue 4).
TARGET_MARGIN = 0.05
#: A tiny model and short crops for ``--quick`` (smoke runs of the whole pipeline).
QUICK_OVERRIDES = [
    "model.config.dim=64",
    "model.config.depth=2",
    "model.config.heads=4",
    "model.config.ff_dim=128",
    "model.config.nb_features=32",
    "model.config.feature_redraw_interval=50",
    "model.optim.warmup_steps=20",
    "data.max_len=256",
    "data.max_tokens=4096",
    "data.limit_records=3000",
    "data.num_workers=0",
]
WALLCLOCK_FILE = "val_wallclock.jsonl"
RESULT_FILE = "study_train.json"
CSV_FIELDS = (
    "variant",
    "attention",
    "kernel",
    "steps",
    "train_minutes",
    "split",
    "records",
    "tokens",
    "loss",
    "ppl",
    "acc",
    "ppl_vs_exact",
    "checkpoint",
    "command",
)


def make_wall_clock(filename: str = WALLCLOCK_FILE) -> Any:
    """A callback appending (wall time since train start, step, val metrics) per validation.

    Why a callback: the CSV logger records steps, not time, and the study plots quality against
    the wall clock that ``max_time`` budgets. It only reads, so training is unchanged. Built by a
    factory (the config's ``_target_``) so this script's ``--help`` needs no Lightning import.
    """
    import pytorch_lightning as pl

    class ValWallClock(pl.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._t0: float | None = None

        def _write(self, trainer: pl.Trainer, event: str, **extra: float) -> None:
            if not trainer.is_global_zero:
                return
            wall = time.monotonic() - self._t0 if self._t0 is not None else math.nan
            payload = {"event": event, "wall_s": wall, "step": trainer.global_step, **extra}
            with (Path(trainer.default_root_dir) / filename).open("a") as fh:
                fh.write(json.dumps(payload) + "\n")

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._t0 = time.monotonic()

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.sanity_checking:
                return
            metrics = trainer.callback_metrics.items()
            self._write(
                trainer, "val", **{k: float(v) for k, v in metrics if k.startswith("val/")}
            )

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._write(trainer, "end")

    return ValWallClock()


# --------------------------------------------------------------------------------------------
# One training run (child process)
# --------------------------------------------------------------------------------------------


def run_variant(spec: dict[str, Any]) -> None:
    """Compose the run's config and call the project's ``train(cfg)``; save its return value."""
    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import train

    out = Path(spec["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / WALLCLOCK_FILE).unlink(missing_ok=True)
    overrides = [
        *spec["overrides"],
        # The script's directory is sys.path[0] in this child, so the module imports by name.
        "++callbacks.wall_clock._target_=quality_study.make_wall_clock",
    ]
    cfg = compose_config(overrides, output_dir=out)
    t0 = time.perf_counter()
    result = train(cfg)
    result["process_wall_s"] = time.perf_counter() - t0
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# Orchestration, held-out evaluation, unigram baseline, report
# --------------------------------------------------------------------------------------------


def max_time(minutes: float) -> str:
    """Minutes -> Lightning's ``DD:HH:MM:SS``."""
    total = max(1, round(minutes * 60))
    d, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d:02d}:{h:02d}:{m:02d}:{s:02d}"


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


def variant_overrides(args: argparse.Namespace, name: str) -> list[str]:
    """The full override list of one variant, in the order the printed command shows it."""
    overrides = [f"experiment={args.experiment}"]
    if args.trainer:
        overrides.append(f"trainer={args.trainer}")
    overrides += VARIANTS[name]
    overrides += [
        f"++trainer.max_time={max_time(args.minutes)}",
        f"trainer.val_check_interval={max_time(args.val_every_min)}",
        f"seed={args.seed}",
        "trainer.enable_progress_bar=false",
    ]
    if args.data:
        overrides.append(f"data.path=[{','.join(data_paths(args.data))}]")
    if args.quick:
        overrides += QUICK_OVERRIDES
    overrides += args.override
    return overrides


def command_for(overrides: list[str], run_dir: Path) -> str:
    """The one command that reproduces a variant's run (same run directory)."""
    # Relative to the launch directory when inside it, so the command stays portable.
    with contextlib.suppress(ValueError):
        run_dir = run_dir.relative_to(Path.cwd())
    parts = ["protein-performer", "train", *overrides, f"hydra.run.dir={run_dir}"]
    return " ".join(shlex.quote(p) for p in parts)


def train_variant(name: str, overrides: list[str], run_dir: Path, timeout: float) -> None:
    """Train one variant in a fresh interpreter; its output streams to this terminal."""
    spec = {"overrides": overrides, "output_dir": str(run_dir)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-variant", json.dumps(spec)]
    log.info("training %s (%s)", name, run_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"error: training {name} failed with exit status {proc.returncode}")
    log.info("trained %s in %.1f min", name, (time.perf_counter() - t0) / 60)


def heldout_split(cfg: Any, split: str, out_dir: Path) -> tuple[Path, Any, Any]:
    """Write the datamodule's held-out split as FASTA; returns it and the train/held-out sources.

    The datamodule is built from the composed run config, so its split is exactly the one the
    runs used (same paths, fractions, ``split_by``).
    """
    import hydra

    from protein_performer.data.tokenizer import Alphabet

    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    sources = dm.sources
    held = sources[split]
    if len(held) == 0:
        raise SystemExit(f"error: the {split} split is empty; raise data.{split}_frac")
    alphabet = Alphabet()
    path = out_dir / f"heldout_{split}.fasta"
    with path.open("w") as fh:
        for i in range(len(held)):
            fh.write(f">{held.id(i)}\n{alphabet.decode(held.tokens(i))}\n")
    log.info("held-out %s split: %d records -> %s", split, len(held), path)
    return path, sources["train"], held


def unigram_baseline(
    train_source: Any, fasta: Path, max_len: int, mlm_prob: float, seed: int
) -> dict[str, float]:
    """Residue frequencies of the training split scored on the held-out masked positions.

    The held-out records are re-read from the FASTA ``evaluate`` reads and masked with the same
    dataset rule and seed, so the positions are the ones the models were scored on.
    """
    import _baseline as baseline

    from protein_performer.data.dataset import InMemorySource
    from protein_performer.data.inputs import read_records
    from protein_performer.data.tokenizer import Alphabet

    alphabet = Alphabet()
    records = read_records(fasta)
    source = InMemorySource(
        [r.id for r in records], [alphabet.encode(r.sequence) for r in records]
    )
    return baseline.unigram_baseline(train_source, source, "mlm", max_len, mlm_prob, seed)


def evaluate_checkpoint(
    ckpt: Path, fasta: Path, out_dir: Path, max_len: int, mlm_prob: float, seed: int, device: str
) -> dict[str, Any]:
    """``protein_performer.inference.evaluate`` on the held-out FASTA (fixed-seed masks)."""
    from protein_performer.inference.evaluate import evaluate
    from protein_performer.interop.loading import load_model

    return evaluate(
        load_model(ckpt, device),
        fasta,
        out_dir,
        max_len=max_len,
        mlm_prob=mlm_prob,
        seed=seed,
        progress=False,
    )


def read_wallclock(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / WALLCLOCK_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(
    curves: dict[str, list[dict[str, Any]]], unigram_ppl: float, path: Path, title: str
) -> None:
    """val/ppl against wall-clock minutes, one line per variant, unigram as a reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        pts = [(p["wall_s"] / 60, p["val/ppl"]) for p in points if "val/ppl" in p]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    if math.isfinite(unigram_ppl):
        ax.axhline(unigram_ppl, ls="--", color="gray", label="unigram (held-out)")
    ax.set_xlabel("wall-clock time since train start [min]")
    ax.set_ylabel("val/ppl (validation split)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else "-"


def format_report(rows: list[dict[str, Any]], header: str, verdict: str) -> str:
    lines = [
        header,
        "",
        "| variant | steps | train min | held-out ppl | masked acc | ppl / exact |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['steps']} | {_fmt(r['train_minutes'], '.1f')} "
            f"| {r['ppl']:.3f} | {r['acc']:.4f} | {r['ppl_vs_exact']:.3f} |"
        )
    lines += ["", verdict, "", "Reproduce (one command per variant):", ""]
    lines += [f"    {r['command']}" for r in rows if r["command"]]
    return "\n".join(lines)


def run_study(args: argparse.Namespace) -> int:
    from protein_performer.training.compose import compose_config

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [x for x in args.variants.split(",") if x]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    plan = {n: (variant_overrides(args, n), out / "runs" / n) for n in names}
    for name, (overrides, run_dir) in plan.items():
        print(f"# {name}\n{command_for(overrides, run_dir)}", flush=True)
    for name, (overrides, run_dir) in plan.items():
        done = (run_dir / RESULT_FILE).is_file() and (run_dir / "checkpoints/last.ckpt").is_file()
        if args.skip_existing and done:
            log.info("%s: finished run found in %s, not retraining", name, run_dir)
            continue
        train_variant(name, overrides, run_dir, timeout=args.minutes * 60 * 3 + 1800)

    # One composed config defines the data (identical across variants: only model keys differ).
    first_overrides, first_dir = plan[names[0]]
    cfg = compose_config(first_overrides, output_dir=first_dir)
    max_len, mlm_prob = int(cfg.data.max_len), float(cfg.data.mlm_prob)
    fasta, train_source, _ = heldout_split(cfg, args.split, out)
    uni = unigram_baseline(train_source, fasta, max_len, mlm_prob, args.eval_seed)
    log.info("unigram baseline: ppl %.3f acc %.4f", uni["ppl"], uni["acc"])

    rows: list[dict[str, Any]] = []
    curves: dict[str, list[dict[str, Any]]] = {}
    for name, (overrides, run_dir) in plan.items():
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        if not ckpt.is_file():
            raise SystemExit(f"error: {name}: no {ckpt}; the run wrote no checkpoint")
        result = evaluate_checkpoint(
            ckpt,
            fasta,
            run_dir / f"eval_{args.split}",
            max_len,
            mlm_prob,
            args.eval_seed,
            args.eval_device,
        )
        overall = result["overall"]
        if overall["tokens"] != uni["tokens"]:
            log.warning(
                "%s scored %d positions, the unigram baseline %d: masks differ",
                name,
                overall["tokens"],
                uni["tokens"],
            )
        points = read_wallclock(run_dir)
        curves[name] = [p for p in points if p.get("event") == "val"]
        end = next((p for p in reversed(points) if p.get("event") == "end"), None)
        attention = "exact" if name == "exact" else "favor"
        rows.append(
            {
                "variant": name,
                "attention": attention,
                "kernel": "-" if attention == "exact" else name.split("-", 1)[1],
                "steps": end["step"] if end else "",
                "train_minutes": end["wall_s"] / 60 if end else math.nan,
                "split": args.split,
                "records": overall["records"],
                "tokens": overall["tokens"],
                "loss": overall["loss"],
                "ppl": overall["ppl"],
                "acc": overall["acc"],
                "checkpoint": str(ckpt),
                "command": command_for(overrides, run_dir),
            }
        )
    exact = next((r["ppl"] for r in rows if r["variant"] == "exact"), math.nan)
    for r in rows:
        r["ppl_vs_exact"] = r["ppl"] / exact if math.isfinite(exact) else math.nan
    rows.append(
        {
            "variant": "unigram",
            "attention": "-",
            "kernel": "-",
            "steps": "",
            "train_minutes": math.nan,
            "split": args.split,
            "records": len(_fasta_ids(fasta)),
            "tokens": uni["tokens"],
            "loss": uni["loss"],
            "ppl": uni["ppl"],
            "acc": uni["acc"],
            "ppl_vs_exact": uni["ppl"] / exact if math.isfinite(exact) else math.nan,
            "checkpoint": "",
            "command": "",
        }
    )

    favor = [r for r in rows if r["attention"] == "favor"]
    if favor and math.isfinite(exact):
        best = min(favor, key=lambda r: r["ppl"])
        ok = best["ppl"] <= (1 + TARGET_MARGIN) * exact
        verdict = (
            f"Target (best FAVOR+ within {TARGET_MARGIN:.0%} of exact's perplexity): "
            f"{common.verdict(ok)}: {best['variant']} {best['ppl']:.3f} vs exact "
            f"{exact:.3f} ({best['ppl'] / exact - 1:+.1%})"
        )
    else:
        verdict = "Target: n/a (needs the exact run and at least one FAVOR+ run)"

    header = (
        f"{args.experiment}{' (quick: tiny model)' if args.quick else ''}, "
        f"{args.minutes:g} min each, seed {args.seed}; held-out = {args.split} split "
        f"({rows[0]['records'] if rows else 0} records, {uni['tokens']} masked positions, "
        f"mask seed {args.eval_seed}, max_len {max_len})"
    )
    with (out / "quality.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    report = format_report(rows, header, verdict)
    (out / "quality.md").write_text(f"# Quality at equal compute\n\n{report}\n")
    plot(curves, uni["ppl"], out / "quality.png", header)
    print(report)
    log.info("wrote %s, %s, %s", out / "quality.csv", out / "quality.md", out / "quality.png")
    return 0


def _fasta_ids(path: Path) -> list[str]:
    return [line[1:].strip() for line in path.read_text().splitlines() if line.startswith(">")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Method and outputs: see the module docstring.",
    )
    p.add_argument("--out", type=Path, default=Path("outputs/quality_study"))
    p.add_argument("--experiment", default="small_mlm", help="base experiment config")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget per variant")
    p.add_argument(
        "--val-every-min",
        type=float,
        default=0.0,
        help="validation interval in minutes (time-based; default: minutes / 10)",
    )
    p.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help="FASTA path(s)/glob(s), comma separated ('' = the experiment's data.path)",
    )
    p.add_argument("--seed", type=int, default=0, help="run seed (weights, data order, masks)")
    p.add_argument("--trainer", default="", help="trainer config (cpu, gpu, ...); '' = default")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    p.add_argument("--split", default="test", choices=("valid", "test"), help="held-out split")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out masks")
    p.add_argument("--eval-device", default="auto", help="device for the evaluation")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every variant (repeatable)",
    )
    p.add_argument(
        "--skip-existing",
        action="store_true",
        help="reuse finished runs in --out (only evaluate and report)",
    )
    p.add_argument("--quick", action="store_true", help="1 minute per variant on a tiny model")
    p.add_argument("--run-variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and args.minutes == p.get_default("minutes"):
        args.minutes = 1.0
    if args.val_every_min <= 0:
        # ~10 validations per run; 4 in --quick, where validation would otherwise eat the minute.
        args.val_every_min = args.minutes / (4 if args.quick else 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.setup_logging(common.TIMED_LOG_FORMAT)
    if args.run_variant is not None:
        run_variant(json.loads(args.run_variant))
        return 0
    return run_study(args)


if __name__ == "__main__":
    sys.exit(main())
