#!/usr/bin/env python
"""The Performer paper's protein experiments (Table 2, Fig. 6, Fig. 7 right) at CPU scale.

Everything goes through the project's own commands, each in a fresh process and printed so any
run can be repeated by hand:

1. ``protein-performer preprocess`` of the corpus into a store whose ``test`` split is a random
   sample of records (the paper's in-distribution test set: its proteins may have relatives in
   train) and whose ``ood`` split holds out whole MMseqs2 clusters at ``--identity`` (held-out
   families: no OOD protein has a relative at that identity in train). Needs ``mmseqs``.
2. Single sequences (L <= ``--max-len``): UNI (causal, ``experiment=small_clm``) and BID
   (masked, ``experiment=small_mlm``) x {exact, FAVOR+ softmax, FAVOR+ ReLU} x seeds, trained
   with ``protein-performer train`` and scored with ``protein-performer eval`` on ``test`` and
   ``ood``: UNI over every next-token prediction, BID over the masked positions (fixed-seed
   masks, identical for every model), accuracy and perplexity, plus the unigram baseline
   (training residue frequencies on the same positions).
3. Concatenated sequences, BID: each split's proteins joined with ``<eos>`` and cut into rows of
   ``--concat-len`` tokens (``data.concat=true``): exact vs FAVOR+ with the same model, and a
   smaller exact model; validation accuracy against training time and each run's peak memory.

**Equal compute means equal CPU time, not wall clock.** Each training run gets ``--minutes`` of
*its own process's CPU time* (``protein_performer.training.callbacks.TimeBudget``, which reads
``time.process_time``; validation is not counted), with ``--threads`` torch threads (default 1,
via ``OMP_NUM_THREADS``) and data loading in that process (``data.num_workers=0``). On a shared
machine a run slowed by other jobs then still gets the same compute, where a wall-clock budget
would hand whichever variant ran during a busy spell less. With ``--trainer gpu`` the budget is
wall clock since training started (CPU time says little about GPU work).

Outputs under ``--out``: ``store/``, ``runs/<part>-<variant>-s<seed>/`` (Hydra run directories
with ``time_budget.json`` and ``eval_{test,ood}/metrics.json``), ``runs.csv`` (one row per run),
``table2.md`` (mean and spread over seeds, laid out like the paper's Table 2), ``fig6.png``
(validation accuracy against training CPU time) and ``fig7.png`` (the concatenated runs:
accuracy against time, peak memory).

Examples::

    python scripts/paper_protein.py --quick          # smoke run: 3 CPU-s per model (startup
                                                    # dominates: ~6 min on a busy 2-core box)
    python scripts/paper_protein.py --jobs 2         # 10 CPU-min per variant, 2 seeds
    python scripts/paper_protein.py --trainer gpu --minutes 10 --out outputs/paper_gpu
    python scripts/paper_protein.py --skip-existing  # train and evaluate only what is missing
    python scripts/paper_protein.py --report-only    # tables and figures of finished runs
    python scripts/paper_protein.py --first-seed 2 --seeds 1   # one more seed later
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common

log = logging.getLogger("paper_protein")

DEFAULT_DATA = [
    "../shared/data/sequences/uniprot_mmseqs_train.fasta",
    "../shared/data/sequences/swissprot_opal_train.fasta",
]
QUICK_DATA = ["data/demo/train.fasta"]
#: Attention variant -> overrides (everything else is shared by the variants of a part).
ATTENTION: dict[str, list[str]] = {
    "exact": ["model.config.attention=exact"],
    "favor-softmax": ["model.config.attention=favor", "model.config.kernel=softmax"],
    "favor-relu": ["model.config.attention=favor", "model.config.kernel=relu"],
}
OBJECTIVES = {"uni": "small_clm", "bid": "small_mlm"}
#: The small CPU model of docs/RESULTS.md's quality study (16-wide heads, m = 64 ~ d log d).
MODEL = ["dim=128", "depth=4", "heads=8", "ff_dim=512", "nb_features=64"]
QUICK_MODEL = ["dim=32", "depth=1", "heads=2", "ff_dim=64", "nb_features=16"]
#: The smaller exact model of the concatenated part (the paper shrank its Transformer to fit):
#: a quarter of the layers (the quick model has one layer already, so half the width there).
SMALL_EXACT = ["depth=1"]
QUICK_SMALL_EXACT = ["dim=16", "ff_dim=32"]
SPLITS = ("test", "ood")
FIELDS = (
    "part",
    "objective",
    "variant",
    "seed",
    "steps",
    "train_cpu_s",
    "wall_s",
    "peak_rss_mib",
    "val_acc",
    "val_ppl",
    "test_acc",
    "test_ppl",
    "test_tokens",
    "ood_acc",
    "ood_ppl",
    "ood_tokens",
    "command",
)


@dataclass
class Run:
    """One training run and the evaluations that follow it."""

    part: str  # uni, bid or concat
    variant: str  # exact, favor-softmax, favor-relu, exact-small
    seed: int
    overrides: list[str]
    run_dir: Path
    evaluate: bool = True
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.part}-{self.variant}-s{self.seed}"


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def child_env(threads: int) -> dict[str, str]:
    """The environment of every child: ``threads`` intra-op threads, the repo importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("PROTEIN_PERFORMER_ROOT", str(common.REPO))
    return env


def cli(*args: str) -> list[str]:
    """``protein-performer ARGS`` run with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "protein_performer.cli.main", *args]


def shown(cmd: list[str], threads: int) -> str:
    """The command as a user would type it."""
    return f"OMP_NUM_THREADS={threads} " + shlex.join(["protein-performer", *cmd[3:]])


def call(cmd: list[str], threads: int, log_path: Path) -> None:
    """Run a child with its output in ``log_path``; a failure stops the study with its tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as fh:
        fh.write(shown(cmd, threads) + "\n")
        fh.flush()
        proc = subprocess.run(
            cmd, cwd=common.REPO, env=child_env(threads), stdout=fh, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-5:]
        raise SystemExit(
            f"error: {shown(cmd, threads)} failed (exit {proc.returncode}); see {log_path}:\n"
            + "\n".join(tail)
        )


def budget_overrides(args: argparse.Namespace) -> list[str]:
    clock = "wall" if args.trainer == "gpu" else "cpu"
    return [
        "++callbacks.time_budget._target_=protein_performer.training.callbacks.TimeBudget",
        f"++callbacks.time_budget.seconds={args.minutes * 60:g}",
        f"++callbacks.time_budget.clock={clock}",
    ]


def model_overrides(args: argparse.Namespace, small: bool = False) -> list[str]:
    model = QUICK_MODEL if args.quick else MODEL
    if small:
        model = [*model, *(QUICK_SMALL_EXACT if args.quick else SMALL_EXACT)]
    return [f"model.config.{kv}" for kv in model]


def plan_runs(args: argparse.Namespace, store: Path) -> list[Run]:
    """Every training run of the study, in the order they are launched."""
    out = args.out.resolve()
    common = [
        f"trainer={args.trainer}",
        f"data.path={store}",
        "data.num_workers=0",
        "trainer.enable_progress_bar=false",
        "trainer.num_sanity_val_steps=0",
        "trainer.max_steps=20000",  # the LR schedule's length: far beyond any budget here
        *budget_overrides(args),
    ]
    runs: list[Run] = []
    parts = set(args.parts.split(","))
    for seed in args.seeds:
        for part in ("uni", "bid"):
            if part not in parts and "single" not in parts:
                continue
            for variant, attention in ATTENTION.items():
                overrides = [
                    f"experiment={OBJECTIVES[part]}",
                    *common,
                    *attention,
                    *model_overrides(args),
                    "model.optim.warmup_steps=100",
                    f"data.max_len={args.max_len}",
                    f"data.max_tokens={args.max_tokens}",
                    f"trainer.val_check_interval={args.val_every}",
                    f"trainer.limit_val_batches={args.val_batches}",
                    f"seed={seed}",
                ]
                run_dir = out / "runs" / f"{part}-{variant}-s{seed}"
                runs.append(Run(part, variant, seed, overrides, run_dir))
        if "concat" in parts and seed < args.first_seed + args.concat_seeds:
            concat_variants = {
                f"favor-{args.concat_kernel}": (ATTENTION[f"favor-{args.concat_kernel}"], False),
                "exact": (ATTENTION["exact"], False),
                "exact-small": (ATTENTION["exact"], True),
            }
            for variant, (attention, small) in concat_variants.items():
                overrides = [
                    "experiment=small_mlm",
                    *common,
                    *attention,
                    *model_overrides(args, small),
                    # Few steps fit the budget at this length: a short warmup, so the
                    # slower models are not compared while their LR is still near zero.
                    "model.optim.warmup_steps=5",
                    "data.concat=true",
                    f"data.max_len={args.concat_len}",
                    f"data.max_tokens={args.concat_len}",
                    f"trainer.val_check_interval={args.concat_val_every}",
                    f"trainer.limit_val_batches={args.concat_val_batches}",
                    f"seed={seed}",
                ]
                run_dir = out / "runs" / f"concat-{variant}-s{seed}"
                runs.append(Run("concat", variant, seed, overrides, run_dir, evaluate=False))
    return runs


def train_cmd(run: Run) -> list[str]:
    return cli("train", *run.overrides, f"hydra.run.dir={run.run_dir}")


def eval_cmd(run: Run, store: Path, split: str, args: argparse.Namespace) -> list[str]:
    return cli(
        "eval",
        str(run.run_dir / "checkpoints" / "last.ckpt"),
        str(store),
        "--split",
        split,
        "--max-len",
        str(args.max_len),
        *(["--limit", str(args.eval_limit)] if args.eval_limit else []),
        "--seed",
        str(args.eval_seed),
        "--device",
        "cpu" if args.trainer == "cpu" else "auto",
        "--no-progress",
        "--out-dir",
        str(run.run_dir / f"eval_{split}"),
        "--overwrite",
    )


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def make_store(args: argparse.Namespace, split_by: str = "id", workers: int | None = None) -> Path:
    """Preprocess once (``--split-by split_by`` with ``--cluster-split``; ``workers``: default
    ``--threads``); an existing store made with other split settings is refused. Shared with
    family_context.py, which holds out whole families (``auto``)."""
    store = args.out.resolve() / "store"
    cmd = cli(
        "preprocess",
        *args.data,
        "--out",
        str(store),
        "--on-invalid",
        "skip",
        "--split-by",
        split_by,
        "--cluster-split",
        f"{args.identity:g}",
        "--ood-frac",
        f"{args.ood_frac:g}",
        "--valid-frac",
        f"{args.valid_frac:g}",
        "--test-frac",
        f"{args.test_frac:g}",
        "--workers",
        str(workers or args.threads),
        "--no-progress",
    )
    args.store_command = shown(cmd, args.threads)
    print(f"# store\n{args.store_command}", flush=True)
    meta_path = store / "meta.json"
    if meta_path.is_file():
        split = json.loads(meta_path.read_text())["split"]
        want = {
            "valid_frac": args.valid_frac,
            "test_frac": args.test_frac,
            "ood": args.ood_frac,
            "identity": args.identity,
            "mode": split_by,
        }
        have = {
            "valid_frac": split.get("valid_frac"),
            "test_frac": split.get("test_frac"),
            "ood": split.get("ood", {}).get("frac"),
            "identity": split.get("clusters", {}).get("min_seq_id"),
            "mode": split.get("mode"),
        }
        if want != have:
            raise SystemExit(
                f"error: {store} was made with {have}, not {want}: remove it or pick another --out"
            )
        log.info("reusing %s", store)
        return store
    t0 = time.perf_counter()
    call(cmd, args.threads, args.out.resolve() / "logs" / "preprocess.log")
    log.info("preprocessed in %.0f s", time.perf_counter() - t0)
    return store


def execute(run: Run, store: Path, args: argparse.Namespace) -> Run:
    """Train (unless finished and ``--skip-existing``), then evaluate on test and ood."""
    logs = run.run_dir.parent.parent / "logs"
    if not (args.skip_existing and finished(run, float(f"{args.minutes * 60:g}"))):
        # An interrupted run's checkpoints and budget log would mix with the new run's.
        shutil.rmtree(run.run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        log.info("training %s", run.name)
        call(train_cmd(run), args.threads, logs / f"{run.name}.train.log")
        log.info("trained %s in %.1f min (wall)", run.name, (time.perf_counter() - t0) / 60)
    if run.evaluate:
        for split in SPLITS:
            metrics = run.run_dir / f"eval_{split}" / "metrics.json"
            if not (args.skip_existing and metrics.is_file()):
                call(
                    eval_cmd(run, store, split, args),
                    args.threads,
                    logs / f"{run.name}.{split}.log",
                )
    run.result = collect(run, args.threads)
    return run


def finished(run: Run, budget_s: float) -> bool:
    """The run's budget log has its ``end`` event (the last checkpoint is written before it),
    for this budget."""
    path = run.run_dir / "time_budget.json"
    if not path.is_file():
        return False
    events = json.loads(path.read_text())
    return bool(events) and events[-1]["event"] == "end" and events[-1]["budget_s"] == budget_s


def collect(run: Run, threads: int) -> dict[str, Any]:
    """One ``runs.csv`` row from the run's ``time_budget.json`` and eval ``metrics.json``."""
    events = json.loads((run.run_dir / "time_budget.json").read_text())
    vals = [e for e in events if e["event"] == "val"]
    end = next((e for e in reversed(events) if e["event"] == "end"), {})
    row: dict[str, Any] = {
        "part": run.part,
        "objective": "clm" if run.part == "uni" else "mlm",
        "variant": run.variant,
        "seed": run.seed,
        "steps": end.get("step", math.nan),
        "train_cpu_s": end.get("train_s", math.nan),
        "wall_s": end.get("wall_s", math.nan),
        "peak_rss_mib": end.get("peak_rss_mib", math.nan),
        "val_acc": vals[-1].get("val/acc", math.nan) if vals else math.nan,
        "val_ppl": vals[-1].get("val/ppl", math.nan) if vals else math.nan,
        "command": shown(train_cmd(run), threads),
        "curve": [(e["train_s"], e.get("val/acc", math.nan)) for e in vals],
    }
    for split in SPLITS:
        path = run.run_dir / f"eval_{split}" / "metrics.json"
        overall = json.loads(path.read_text())["overall"] if path.is_file() else {}
        row[f"{split}_acc"] = overall.get("acc", math.nan)
        row[f"{split}_ppl"] = overall.get("ppl", math.nan)
        row[f"{split}_tokens"] = overall.get("tokens", "")
    return row


def baselines(store: Path, args: argparse.Namespace) -> dict[tuple[str, str], dict[str, Any]]:
    """Unigram baseline per (objective, split), on the positions ``eval`` scored."""
    from _baseline import unigram_baseline

    from protein_performer.data.dataset import StoreSubset
    from protein_performer.data.store import TokenStore

    st = TokenStore(store)
    train = StoreSubset(st, st.indices("train"))
    out = {}
    for objective in ("clm", "mlm"):
        for split in SPLITS:
            idx = st.indices(split)
            held = StoreSubset(st, idx[: args.eval_limit] if args.eval_limit else idx)
            out[(objective, split)] = unigram_baseline(
                train, held, objective, args.max_len, 0.15, args.eval_seed
            )
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def mean_sd(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else math.nan


def cell(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± sd`` over seeds (sd: sample standard deviation; absent for one seed)."""
    m, s = mean_sd([v * scale for v in values])
    if not math.isfinite(m):
        return "-"
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if math.isfinite(s) else "")


def table2(rows: list[dict[str, Any]], base: dict[tuple[str, str], dict[str, Any]]) -> str:
    """Markdown laid out like the paper's Table 2: accuracy (%) and perplexity, test and OOD."""
    lines = [
        "| model | objective | test acc (%) | test ppl | OOD acc (%) | OOD ppl | steps | seeds |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for part, objective in (("uni", "clm"), ("bid", "mlm")):
        for variant in ATTENTION:
            sel = [r for r in rows if r["part"] == part and r["variant"] == variant]
            if not sel:
                continue
            cells = [
                cell([r["test_acc"] for r in sel], 100),
                cell([r["test_ppl"] for r in sel]),
                cell([r["ood_acc"] for r in sel], 100),
                cell([r["ood_ppl"] for r in sel]),
                cell([r["steps"] for r in sel], 1, 0),
            ]
            lines.append(f"| {variant} | {part.upper()} | {' | '.join(cells)} | {len(sel)} |")
        if (objective, "test") in base and any(r["part"] == part for r in rows):
            t, o = base[(objective, "test")], base[(objective, "ood")]
            lines.append(
                f"| unigram baseline | {part.upper()} | {100 * t['acc']:.2f} | {t['ppl']:.2f} "
                f"| {100 * o['acc']:.2f} | {o['ppl']:.2f} | - | - |"
            )
    return "\n".join(lines)


def concat_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | steps | val acc (%) | val ppl | peak RSS (MiB) | train CPU (s) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in dict.fromkeys(r["variant"] for r in rows if r["part"] == "concat"):
        sel = [r for r in rows if r["part"] == "concat" and r["variant"] == variant]
        lines.append(
            f"| {variant} | {cell([r['steps'] for r in sel], 1, 0)} "
            f"| {cell([r['val_acc'] for r in sel], 100)} | {cell([r['val_ppl'] for r in sel])} "
            f"| {cell([r['peak_rss_mib'] for r in sel], 1, 0)} "
            f"| {cell([r['train_cpu_s'] for r in sel], 1, 0)} "
            f"| {cell([r['wall_s'] for r in sel], 1, 0)} |"
        )
    return "\n".join(lines)


def plot_curves(
    rows: list[dict[str, Any]], parts: tuple[str, ...], path: Path, title: str
) -> None:
    """Validation accuracy against training CPU minutes, one line per run (like Fig. 6 / 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["part"] in parts]
    if not sel:
        return
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4), squeeze=False)
    colors = {"exact": "C0", "favor-softmax": "C1", "favor-relu": "C2", "exact-small": "C3"}
    for ax, part in zip(axes[0], parts, strict=True):
        for r in (r for r in sel if r["part"] == part):
            pts = [(t / 60, a * 100) for t, a in r["curve"] if math.isfinite(a)]
            if not pts:
                continue
            label = r["variant"]
            if part == "concat":
                label += f" ({r['peak_rss_mib']:.0f} MiB peak)"
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                ms=3,
                color=colors.get(r["variant"], "C4"),
                ls="-" if r["seed"] == min(x["seed"] for x in sel) else "--",
                label=label if r["seed"] == min(x["seed"] for x in sel) else None,
            )
        ax.set_title(part.upper() if part != "concat" else "BID, concatenated", fontsize=9)
        ax.set_xlabel("training CPU time [min]")
        ax.set_ylabel("validation accuracy [%]")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(
    runs: list[Run], base: dict[tuple[str, str], dict[str, Any]], args: argparse.Namespace
) -> str:
    from protein_performer.io.atomic import write_text_atomic

    out = args.out.resolve()
    rows = [r.result for r in runs]
    lines = []
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(out / "runs.csv", table.getvalue())
    clock = "wall-clock" if args.trainer == "gpu" else "CPU"
    header = (
        f"{args.minutes:g} {clock} minutes of training per run, {args.threads} torch thread(s), "
        f"seeds {','.join(map(str, args.seeds))}{' (quick: tiny models)' if args.quick else ''}"
    )
    if any(r["part"] in ("uni", "bid") for r in rows):
        lines += [
            "## Single sequences (Table 2)",
            "",
            header + f"; max_len {args.max_len}, {args.max_tokens} tokens per batch. "
            "Mean ± sample sd over seeds.",
            "",
            table2(rows, base),
            "",
        ]
    if any(r["part"] == "concat" for r in rows):
        lines += [
            f"## Concatenated, L = {args.concat_len} (Fig. 7 right)",
            "",
            header + f"; validation on the first {args.concat_val_batches} rows of the "
            "concatenated valid split.",
            "",
            concat_table(rows),
            "",
        ]
    lines += ["## Commands", "", f"    {args.store_command}"]
    lines += [f"    {r['command']}" for r in rows]
    text = "\n".join(lines) + "\n"
    write_text_atomic(out / "table2.md", f"# Performer paper, protein experiments\n\n{text}")
    plot_curves(rows, ("uni", "bid"), out / "fig6.png", header)
    plot_curves(rows, ("concat",), out / "fig7.png", header)
    return text


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Budgets are CPU time of each training process (time.process_time, validation "
            "excluded) with --threads torch threads, so runs stay comparable on a shared "
            "machine; --trainer gpu switches to wall clock. See the module docstring."
        ),
    )
    p.add_argument("--out", type=Path, default=Path("outputs/paper_protein"))
    p.add_argument("--data", nargs="+", default=None, help="FASTA inputs (default: shared corpus)")
    p.add_argument(
        "--minutes", type=float, default=10.0, help="training CPU-minutes per run (default 10)"
    )
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per variant (default 2)")
    p.add_argument(
        "--first-seed", type=int, default=0, help="seeds run from here (default 0: 0..N-1)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once (default 1)")
    p.add_argument("--trainer", default="cpu", help="trainer config: cpu (default) or gpu")
    p.add_argument(
        "--parts", default="uni,bid,concat", help="comma list of uni, bid, concat (default all)"
    )
    p.add_argument("--identity", type=float, default=0.5, help="MMseqs2 identity of OOD groups")
    p.add_argument("--ood-frac", type=float, default=0.03, help="fraction of clusters held out")
    p.add_argument("--valid-frac", type=float, default=0.02)
    p.add_argument("--test-frac", type=float, default=0.02)
    p.add_argument(
        "--max-len", type=int, default=1024, help="single-sequence crop (with specials)"
    )
    p.add_argument("--max-tokens", type=int, default=4096, help="single-sequence batch budget")
    p.add_argument("--val-every", type=int, default=50, help="validate every N steps")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches (single)")
    p.add_argument("--concat-len", type=int, default=8192, help="concatenated row length")
    p.add_argument("--concat-val-batches", type=int, default=3, help="validation rows (concat)")
    p.add_argument("--concat-val-every", type=int, default=4, help="validate every N (concat)")
    p.add_argument(
        "--concat-kernel", default="relu", choices=("softmax", "relu"), help="FAVOR+ kernel"
    )
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the BID test/OOD masks")
    p.add_argument(
        "--eval-limit",
        type=int,
        default=0,
        help="score only the first N records of test and ood (default 0: all)",
    )
    p.add_argument(
        "--concat-seeds", type=int, default=None, help="seeds of the concatenated part (--seeds)"
    )
    p.add_argument(
        "--skip-existing", action="store_true", help="reuse finished runs and evaluations"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train and evaluate nothing: report the runs in --out that finished",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny models, the bundled demo FASTA, 3 CPU-seconds per run, 1 seed",
    )
    args = p.parse_args(argv)
    if args.quick:
        defaults = {"minutes": 10.0, "seeds": 2, "max_len": 1024, "concat_len": 8192}
        quick = {"minutes": 0.05, "seeds": 1, "max_len": 256, "concat_len": 512}
        for key, value in quick.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
        args.max_tokens = min(args.max_tokens, 2048)
        args.val_every = min(args.val_every, 10)
        args.valid_frac, args.test_frac, args.ood_frac = 0.1, 0.1, 0.1
        args.identity = min(args.identity, 0.5)
    # Given paths are relative to where you are; the defaults to the repository.
    if args.data:
        args.data = [str(Path(x).resolve()) for x in args.data]
    else:
        args.data = [
            str((common.REPO / x).resolve()) for x in (QUICK_DATA if args.quick else DEFAULT_DATA)
        ]
    if args.concat_seeds is None:
        args.concat_seeds = args.seeds
    args.seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.setup_logging(common.TIMED_LOG_FORMAT)
    args.out.mkdir(parents=True, exist_ok=True)
    store = make_store(args)
    runs = plan_runs(args, store)
    for run in runs:
        print(f"# {run.name}\n{shown(train_cmd(run), args.threads)}", flush=True)
    if args.report_only:
        budget = float(f"{args.minutes * 60:g}")
        runs = [r for r in runs if finished(r, budget)]
        for run in runs:
            run.result = collect(run, args.threads)
        log.info("reporting the %d finished runs", len(runs))
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            runs = list(pool.map(lambda r: execute(r, store, args), runs))
    base = baselines(store, args)
    print(report(runs, base, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
