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

    python scripts/studies/paper_protein.py --quick  # smoke run: 3 CPU-s per model (startup
                                                    # dominates: ~6 min on a busy 2-core box)
    python scripts/studies/paper_protein.py --jobs 2         # 10 CPU-min per variant, 2 seeds
    python scripts/studies/paper_protein.py --trainer gpu --minutes 10 --out outputs/paper_gpu
    python scripts/studies/paper_protein.py --skip-existing  # train and evaluate what is missing
    python scripts/studies/paper_protein.py --report-only    # tables and figures of finished runs
    python scripts/studies/paper_protein.py --first-seed 2 --seeds 1   # one more seed later
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import harness as h

log = logging.getLogger("paper_protein")

OBJECTIVES = {"uni": "small_clm", "bid": "small_mlm"}
#: The small CPU model of docs/RESULTS.md's quality study (16-wide heads, m = 64 ~ d log d).
MODEL = ["dim=128", "depth=4", "heads=8", "ff_dim=512", "nb_features=64"]
#: The smaller exact model of the concatenated part (the paper shrank its Transformer to fit):
#: a quarter of the layers (the quick model has one layer already, so half the width there).
SMALL_EXACT = ["depth=1"]
QUICK_SMALL_EXACT = ["dim=16", "ff_dim=32"]
SPLITS = ("test", "ood")
FIELDS = ("part", "objective", "variant", "seed", "steps", "train_cpu_s", "wall_s", "peak_rss_mib",
          "val_acc", "val_ppl", "test_acc", "test_ppl", "test_tokens", "ood_acc", "ood_ppl",
          "ood_tokens", "command")


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


def eval_cmd(ckpt: Path, store: Path, split: str, out: Path,
             args: argparse.Namespace) -> list[str]:
    limit = ["--limit", str(args.eval_limit)] if args.eval_limit else []
    device = "cpu" if args.trainer == "cpu" else "auto"
    # fmt: off
    return h.cli("eval", str(ckpt), str(store), "--split", split, "--max-len", str(args.max_len),
                 *limit, "--seed", str(args.eval_seed), "--device", device, "--no-progress",
                 "--out-dir", str(out), "--overwrite")
    # fmt: on


def plan_runs(args: argparse.Namespace, store: Path, budget: h.Budget) -> list[h.Run]:
    """Every training run of the study, in the order they are launched."""
    runs_dir = args.out.resolve() / "runs"
    shared = h.store_overrides(args, store, budget)

    def run(part: str, variant: str, seed: int, attention: list[str], extra: list[str],
            small: bool = False) -> h.Run:  # fmt: skip
        name = f"{part}-{variant}-s{seed}"
        tags = {"part": part, "objective": "clm" if part == "uni" else "mlm"}
        model = [*(h.QUICK_MODEL if args.quick else MODEL),
                 *((QUICK_SMALL_EXACT if args.quick else SMALL_EXACT) if small else [])]
        overrides = [f"experiment={OBJECTIVES[part if part == 'uni' else 'bid']}", *shared,
                     *attention, *(f"model.config.{kv}" for kv in model), *extra, f"seed={seed}"]
        r = h.Run(name, overrides, runs_dir / name, {**tags, "variant": variant, "seed": seed})
        if part != "concat":
            for split in SPLITS:
                out = r.run_dir / f"eval_{split}"
                cmd = eval_cmd(r.checkpoint, store, split, out, args)
                r.after.append((split, cmd, out / "metrics.json"))
        return r

    runs: list[h.Run] = []
    parts = set(args.parts.split(","))
    for seed in args.seeds:
        for part in ("uni", "bid"):
            if part not in parts and "single" not in parts:
                continue
            for variant, attention in h.ATTENTION.items():
                runs.append(run(part, variant, seed, attention, [
                    "model.optim.warmup_steps=100", f"data.max_len={args.max_len}",
                    f"data.max_tokens={args.max_tokens}",
                    f"trainer.val_check_interval={args.val_every}",
                    f"trainer.limit_val_batches={args.val_batches}"]))
        if "concat" in parts and seed < args.first_seed + args.concat_seeds:
            favor = f"favor-{args.concat_kernel}"
            concat_variants = {favor: (h.ATTENTION[favor], False),
                               "exact": (h.ATTENTION["exact"], False),
                               "exact-small": (h.ATTENTION["exact"], True)}
            for variant, (attention, small) in concat_variants.items():
                runs.append(run("concat", variant, seed, attention, [
                    # Few steps fit the budget at this length: a short warmup, so the
                    # slower models are not compared while their LR is still near zero.
                    "model.optim.warmup_steps=5", "data.concat=true",
                    f"data.max_len={args.concat_len}", f"data.max_tokens={args.concat_len}",
                    f"trainer.val_check_interval={args.concat_val_every}",
                    f"trainer.limit_val_batches={args.concat_val_batches}"], small))
    return runs


def collect(run: h.Run) -> dict[str, Any]:
    """The eval metrics of each split (``metrics.json``), NaN where not evaluated."""
    row: dict[str, Any] = {}
    for split in SPLITS:
        path = run.run_dir / f"eval_{split}" / "metrics.json"
        overall = json.loads(path.read_text())["overall"] if path.is_file() else {}
        row[f"{split}_acc"] = overall.get("acc", math.nan)
        row[f"{split}_ppl"] = overall.get("ppl", math.nan)
        row[f"{split}_tokens"] = overall.get("tokens", "")
    return row


def baselines(store: Path, args: argparse.Namespace) -> dict[tuple[str, str], dict[str, Any]]:
    """Unigram baseline per (objective, split), on the positions ``eval`` scored."""
    from protein_performer.data.dataset import StoreSubset
    from protein_performer.data.store import TokenStore

    st = TokenStore(store)
    train = StoreSubset(st, st.indices("train"))
    out = {}
    for objective in ("clm", "mlm"):
        for split in SPLITS:
            idx = st.indices(split)
            held = StoreSubset(st, idx[: args.eval_limit] if args.eval_limit else idx)
            out[(objective, split)] = h.unigram_baseline(train, held, objective, args.max_len,
                                                         0.15, args.eval_seed)
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def table2(rows: list[dict[str, Any]], base: dict[tuple[str, str], dict[str, Any]]) -> str:
    """Markdown laid out like the paper's Table 2: accuracy (%) and perplexity, test and OOD."""
    header = ["model", "objective", "test acc (%)", "test ppl", "OOD acc (%)", "OOD ppl"]
    lines = []
    for part, objective in (("uni", "clm"), ("bid", "mlm")):
        for variant in h.ATTENTION:
            sel = h.select(rows, part=part, variant=variant)
            if sel:
                lines.append([variant, part.upper(), *(
                    h.cell([r[key] for r in sel], scale, digits) for key, scale, digits in
                    (("test_acc", 100, 2), ("test_ppl", 1, 2), ("ood_acc", 100, 2),
                     ("ood_ppl", 1, 2), ("steps", 1, 0))), len(sel)])  # fmt: skip
        if (objective, "test") in base and h.select(rows, part=part):
            t, o = base[(objective, "test")], base[(objective, "ood")]
            lines.append(
                ["unigram baseline", part.upper(), f"{100 * t['acc']:.2f}", f"{t['ppl']:.2f}",
                f"{100 * o['acc']:.2f}", f"{o['ppl']:.2f}", "-", "-"])
    return h.markdown_table([*header, "steps", "seeds"], lines, left=2)


#: The concatenated table's columns: (header, row key, scale, digits).
CONCAT_COLUMNS = (("steps", "steps", 1, 0), ("val acc (%)", "val_acc", 100, 2),
                  ("val ppl", "val_ppl", 1, 2), ("peak RSS (MiB)", "peak_rss_mib", 1, 0),
                  ("train CPU (s)", "train_cpu_s", 1, 0), ("wall (s)", "wall_s", 1, 0))


def concat_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in h.select(rows, part="concat")):
        sel = h.select(rows, part="concat", variant=variant)
        lines.append([variant, *(h.cell([r[key] for r in sel], scale, digits)
                                 for _, key, scale, digits in CONCAT_COLUMNS)])  # fmt: skip
    return h.markdown_table(["model", *(c[0] for c in CONCAT_COLUMNS)], lines)


def plot_curves(rows: list[dict[str, Any]], parts: tuple[str, ...], path: Path,
                title: str) -> None:
    """Validation accuracy against training CPU minutes, one line per run (like Fig. 6 / 7)."""
    sel = [r for r in rows if r["part"] in parts]
    if not sel:
        return
    colors = {"exact": "C0", "favor-softmax": "C1", "favor-relu": "C2", "exact-small": "C3"}
    first = min(x["seed"] for x in sel)
    with h.figure(path, len(parts), (5.5, 4), title) as axes:
        for ax, part in zip(axes, parts, strict=True):
            for r in (r for r in sel if r["part"] == part):
                pts = [(t / 60, a * 100) for t, a, _ in r["curve"] if math.isfinite(a)]
                if not pts:
                    continue
                label = r["variant"]
                if part == "concat":
                    label += f" ({r['peak_rss_mib']:.0f} MiB peak)"
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3,
                        color=colors.get(r["variant"], "C4"),
                        ls="-" if r["seed"] == first else "--",
                        label=label if r["seed"] == first else None)
            ax.set_title(part.upper() if part != "concat" else "BID, concatenated", fontsize=9)
            ax.set(xlabel="training CPU time [min]", ylabel="validation accuracy [%]")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)


def report(rows: list[dict[str, Any]], base: dict[tuple[str, str], dict[str, Any]],
           args: argparse.Namespace) -> str:
    out = args.out.resolve()
    h.write_csv(out / "runs.csv", rows, FIELDS)
    clock = "wall-clock" if args.trainer == "gpu" else "CPU"
    header = (f"{args.minutes:g} {clock} minutes of training per run, {args.threads} torch "
              f"thread(s), seeds {','.join(map(str, args.seeds))}"
              + (" (quick: tiny models)" if args.quick else ""))
    lines = []
    if any(r["part"] in ("uni", "bid") for r in rows):
        lines += ["## Single sequences (Table 2)", "",
                  header + f"; max_len {args.max_len}, {args.max_tokens} tokens per batch. "
                  "Mean ± sample sd over seeds.",
                  "", table2(rows, base), ""]
    if h.select(rows, part="concat"):
        lines += [f"## Concatenated, L = {args.concat_len} (Fig. 7 right)", "",
                  header + f"; validation on the first {args.concat_val_batches} rows of the "
                  "concatenated valid split.",
                  "", concat_table(rows), ""]
    lines += ["## Commands", "", f"    {args.store_command}"]
    lines += [f"    {r['command']}" for r in rows]
    text = "\n".join(lines) + "\n"
    h.write_markdown(out / "table2.md", "Performer paper, protein experiments", text)
    plot_curves(rows, ("uni", "bid"), out / "fig6.png", header)
    plot_curves(rows, ("concat",), out / "fig7.png", header)
    return text


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, h.Budget]:
    p = h.parser(__doc__, "Budgets are CPU time of each training process (time.process_time, "
                 "validation excluded) with --threads torch threads, so runs stay comparable on "
                 "a shared machine; --trainer gpu switches to wall clock. See the module "
                 "docstring.")
    p.add_argument("--out", type=Path, default=Path("outputs/paper_protein"))
    p.add_argument("--data", nargs="+", default=None, help="FASTA inputs (default: shared corpus)")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="training CPU-minutes per run (10)")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per variant (default 2)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds run from here (default 0: 0..N-1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once (1)")
    p.add_argument("--trainer", default="cpu", help="trainer config: cpu (default) or gpu")
    p.add_argument("--skip-existing", action="store_true", help="reuse finished runs")
    p.add_argument("--report-only", action="store_true",
                   help="train and evaluate nothing: report the runs in --out that finished")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models, the bundled "
                   "demo FASTA, 3 CPU-seconds per run, 1 seed")
    p.add_argument("--parts", default="uni,bid,concat",
                   help="comma list of uni, bid, concat (default all)")
    p.add_argument("--identity", type=float, default=0.5, help="MMseqs2 identity of OOD groups")
    p.add_argument("--ood-frac", type=float, default=0.03, help="fraction of clusters held out")
    p.add_argument("--valid-frac", type=float, default=0.02)
    p.add_argument("--test-frac", type=float, default=0.02)
    p.add_argument("--max-len", type=int, default=1024,
                   help="single-sequence crop (with specials)")
    p.add_argument("--max-tokens", type=int, default=4096, help="single-sequence batch budget")
    p.add_argument("--val-every", type=int, default=50, help="validate every N steps")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches (single)")
    p.add_argument("--concat-len", type=int, default=8192, help="concatenated row length")
    p.add_argument("--concat-val-batches", type=int, default=3, help="validation rows (concat)")
    p.add_argument("--concat-val-every", type=int, default=4, help="validate every N (concat)")
    p.add_argument("--concat-kernel", default="relu", choices=("softmax", "relu"),
                   help="FAVOR+ kernel")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the BID test/OOD masks")
    p.add_argument("--eval-limit", type=int, default=0,
                   help="score only the first N records of test and ood (default 0: all)")
    p.add_argument("--concat-seeds", type=int, default=None,
                   help="seeds of the concatenated part (--seeds)")
    args = p.parse_args(argv)
    if args.quick:  # each of these only where left at its default
        quick = {"minutes": (10.0, 0.05), "max_len": (1024, 256), "concat_len": (8192, 512),
                 "seeds": (2, 1)}  # fmt: skip
        for key, (default, value) in quick.items():
            if getattr(args, key) == default:
                setattr(args, key, value)
        args.max_tokens = min(args.max_tokens, 2048)
        args.val_every = min(args.val_every, 10)
        args.valid_frac, args.test_frac, args.ood_frac = 0.1, 0.1, 0.1
        args.identity = min(args.identity, 0.5)
    # --data: given paths from here, the defaults in the repository
    args.data = [str(Path(x).resolve()) for x in args.data or ()] or (
        h.QUICK_DATA if args.quick else h.DEFAULT_DATA)
    args.seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.concat_seeds is None:
        args.concat_seeds = len(args.seeds)
    clock = "wall" if args.trainer == "gpu" else "cpu"  # CPU time says little about GPU work
    return args, h.Budget(seconds=float(f"{args.minutes * 60:g}"), clock=clock)


def main(argv: list[str] | None = None) -> int:
    args, budget = parse_args(argv)
    h.setup_logging()
    args.out.mkdir(parents=True, exist_ok=True)
    store = h.preprocess(args, "id", args.threads)
    runs = h.run_all(plan_runs(args, store, budget), budget, args, collect)
    print(report([r.result for r in runs], baselines(store, args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
