#!/usr/bin/env python
"""Training throughput and peak memory of the Performer LM: FAVOR+ against its exact twin.

What is measured: one optimizer step (forward, loss, backward, AdamW step) of the *same*
``PerformerLM`` (default 6 layers, dim 320, 20 heads, the model's m: the ESM-2 8M shape) with
``attention=favor`` and ``attention=exact`` (SDPA), at L = 1024, 4096, 16384 with a fixed number
of tokens per batch (B = tokens // L), for both objectives (mlm, clm). Tokens/s = B·L / median
step time. The targets come from issue 4: favor >= 2x exact at L=4096 and >= 5x at L=16384.

Why this shape:

- The model runs directly (``PerformerLM`` + ``torch.optim.AdamW``, no Lightning): the benchmark
  is about the model, so Lightning's loop, logging, data loading and callbacks must not add
  their (attention-independent) overhead to both sides of the ratio.
- Batches are synthetic random residues of exactly L tokens (``<cls>`` ... ``<eos>``, no padding),
  so padding never blurs the comparison and no case waits on a data loader. MLM masks 15% of
  the positions with ``<mask>`` (no 80/10/10 split: it does not change the cost); CLM predicts
  the next token. Timing does not depend on the values.
- Every case runs in a fresh process (this script re-invoked with ``--case JSON``): peak memory is
  only meaningful there, and an exact-attention case that would run for an hour is cut off by
  ``--timeout`` instead of hanging the run. A child prints a ``RESULT {...}`` line after every
  timed step, so a case killed by the timeout still reports the steps it finished. A case that
  finishes no timed step is recorded as ``timeout``/``oom``/``error`` and the larger L of the same
  (objective, attention) series as ``skipped``. Cases are interleaved favor/exact per
  (objective, L), so drifting load on a shared machine hits both sides of a ratio alike.
- ``--warmup`` untimed steps first (allocations, AdamW state, kernel selection), then up to
  ``--steps`` timed steps or until ``--budget-s`` is spent (at least one).

Peak memory: on CPU the peak RSS during the steps minus the RSS just before the first step (the
model, the batch and the imported libraries are excluded; AdamW state, gradients and activations
count), via the sampler of ``_common.py``; on CUDA ``torch.cuda.max_memory_allocated``
minus the allocation before the first step.

Examples::

    python scripts/bench/bench_train.py --quick                      # tiny model, seconds per case
    python scripts/bench/bench_train.py --threads 16 --timeout 1800  # the real CPU measurement
    python scripts/bench/bench_train.py --device cuda --precision bf16-mixed --out .bench/train_gpu
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import _common as common

log = logging.getLogger("bench_train")

EPILOG = "Method, memory definition and targets: see the module docstring."

ATTENTIONS = ("favor", "exact")
#: FAVOR+ with the position memory (issue 40), measured against plain FAVOR+ on family rows.
MEMORY = "favor+memory"
#: The memory's position_memory (member positions it holds), as family_clm trains it.
MEMORY_POSITIONS = 1024
#: Issue 40: family-row training with the memory at >= 0.8x the steps/s of plain FAVOR+.
MEMORY_TARGET = 0.8
OBJECTIVES = ("mlm", "clm")
#: Targets of issue 4: favor tokens/s over exact tokens/s at a given L (fwd+bwd+step).
TARGETS: dict[int, float] = {4096: 2.0, 16384: 5.0}
MLM_PROB = 0.15


# --------------------------------------------------------------------------------------------
# Child side: one (objective, attention, L) case in a fresh process
# --------------------------------------------------------------------------------------------


def synthetic_batch(objective: str, B: int, L: int, seed: int, config: Any,
                    member_len: int = 0) -> tuple[Any, Any]:
    """Random residues of exactly L tokens (``<cls>`` residues ``<eos>``) and their targets;
    with ``member_len``, family rows: a ``<cls>`` every member_len tokens, an ``<eos>`` before.

    Why not real data: the comparison is about attention cost at a given L, so every row must be
    exactly L long (no padding, no crop variation) and no data loader may sit in the loop.
    """
    import torch

    from protein_performer.data.masking import IGNORE_INDEX
    from protein_performer.data.tokenizer import STANDARD_AA, Alphabet

    alphabet = Alphabet()
    first = alphabet.encode(STANDARD_AA[0])[0]  # standard residues are contiguous in ESM-2 order
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(int(first), int(first) + len(STANDARD_AA), (B, L), generator=gen)
    tokens[:, 0] = config.cls_idx
    tokens[:, -1] = config.eos_idx
    if member_len:
        tokens[:, member_len::member_len] = config.cls_idx
        tokens[:, member_len - 1 :: member_len] = config.eos_idx
    targets = torch.full_like(tokens, IGNORE_INDEX)
    if objective == "mlm":
        selected = torch.rand(B, L, generator=gen) < MLM_PROB
        selected[:, 0] = selected[:, -1] = False
        targets[selected] = tokens[selected]
        tokens = tokens.masked_fill(selected, config.mask_idx)
    else:
        targets[:, :-1] = tokens[:, 1:]
    return tokens, targets


def hidden_coordinates(tokens: Any, cls_idx: int, p: float, seed: int) -> Any:
    """The ``coordinates`` a training family row carries under ``data.family_memory_dropout``
    p (:class:`~protein_performer.data.family.FamilyDataset`): member positions, and -1 on the
    members after a row's first that are hidden from the memory, each with probability p; so
    the memory's step is timed on the keys the default training run gives it."""
    import torch

    from protein_performer.data.msa import UNPLACED
    from protein_performer.model.rotary import member_index, member_positions

    member = member_index(tokens == cls_idx)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.rand(int(member.max()) + 1, generator=gen) < p
    hidden[0] = False
    positions = member_positions(tokens, cls_idx)
    return torch.where(hidden[member], torch.full_like(positions, UNPLACED), positions)


def run_case(case: dict[str, Any]) -> None:
    """Warm up, then time optimizer steps; one ``RESULT`` line after every timed step."""
    import torch
    import torch.nn.functional as F

    from protein_performer.data.masking import IGNORE_INDEX
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    limit = common.start_case(case)
    device = torch.device(case["device"])
    B, L = case["B"], case["L"]
    bf16 = case["precision"] == "bf16-mixed"
    losses: list[float] = []

    def side(attention: str) -> Any:
        """One model, its optimizer and batch: the function that runs one optimizer step."""
        torch.manual_seed(case["seed"])
        config = PerformerConfig(
            dim=case["dim"], depth=case["depth"], heads=case["heads"], ff_dim=case["ff_dim"],
            nb_features=case["m"], objective=case["objective"],
            attention="favor" if attention == MEMORY else attention, kernel=case["kernel"],
            feature_redraw_interval=0,
            position_memory=MEMORY_POSITIONS if attention == MEMORY else 0).validate()
        model = PerformerLM(config).to(device).train()
        optimizer = torch.optim.AdamW(model.param_groups(0.01), lr=1e-4, betas=(0.9, 0.98))
        tokens, targets = synthetic_batch(case["objective"], B, L, case["seed"], config,
                                          case.get("member_len", 0))
        coordinates = None
        if attention == MEMORY and case.get("memory_dropout"):
            coordinates = hidden_coordinates(tokens, config.cls_idx, case["memory_dropout"],
                                             case["seed"]).to(device)
        tokens, targets = tokens.to(device), targets.to(device)

        def step() -> float:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(tokens, coordinates=coordinates).logits
            # float32 loss under autocast, as the LightningModule does.
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                   ignore_index=IGNORE_INDEX)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))  # .item() also syncs CUDA: the step is complete
            return time.perf_counter() - t0

        return step

    step = side(case["attention"])
    # --paired: plain FAVOR+ in the same process, its steps alternating with the memory's
    twin = side("favor") if case.get("paired") and case["attention"] == MEMORY else None

    with common.PeakSampler(limit, interval_s=0.005) as sampler:
        peak_bytes = common.start_phase(sampler, device)
        try:
            for _ in range(case["warmup"]):
                step()
                if twin is not None:
                    twin()
            times: list[float] = []
            shares: list[float] = []  # per pair: the twin's step time over this one's
            while len(times) < case["steps"] and (not times or sum(times) < case["budget_s"]):
                if twin is None:
                    times.append(step())
                else:  # alternate which goes first, so a drifting load hits both alike
                    first, second = (step, twin) if len(times) % 2 == 0 else (twin, step)
                    a, b = first(), second()
                    mine, theirs = (a, b) if first is step else (b, a)
                    times.append(mine)
                    shares.append(theirs / mine)
                median = statistics.median(times)
                common.emit({"status": "ok" if math.isfinite(losses[-1]) else "error",
                            "steps_timed": len(times), "step_time_s": median,
                            "step_time_min_s": min(times), "tokens_per_s": B * L / median,
                            "peak_mem_mib": peak_bytes() / 2**20, "final_loss": losses[-1],
                            "note": "" if math.isfinite(losses[-1]) else "non-finite loss",
                            "paired_speed": statistics.median(shares) if shares else math.nan})
        except torch.OutOfMemoryError as exc:
            common.emit({"status": "oom", "note": str(exc).splitlines()[0][:200]})


# --------------------------------------------------------------------------------------------
# Parent side: orchestration, CSV, markdown
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One CSV row: a measured (objective, attention, L) case or why it has no numbers."""

    objective: str
    attention: str
    kernel: str
    L: int
    B: int
    tokens_per_batch: int
    depth: int
    dim: int
    heads: int
    m: int
    precision: str
    device: str
    threads: int
    status: str
    steps_timed: int = 0
    step_time_s: float = math.nan
    step_time_min_s: float = math.nan
    tokens_per_s: float = math.nan
    peak_mem_mib: float = math.nan
    mem_kind: str = ""
    final_loss: float = math.nan
    paired_speed: float = math.nan
    note: str = ""


#: What a child's RESULT line carries into its row as measured.
MEASURED = ("status", "steps_timed", "step_time_s", "step_time_min_s", "tokens_per_s",
            "peak_mem_mib", "final_loss")


def run_all(args: argparse.Namespace) -> list[Row]:
    """Every (objective, L, attention) case in its own process, favor/exact interleaved."""
    lengths = sorted(int(x) for x in args.lengths.split(",") if x)
    objectives = [x for x in args.objectives.split(",") if x]
    attentions = [x for x in args.attentions.split(",") if x]
    mem_limit = args.mem_limit_gib or common.default_mem_limit_gib()
    failed: dict[tuple[str, str], str] = {}
    rows: list[Row] = []
    for objective in objectives:
        for L in lengths:
            for attention in attentions:
                B = max(1, args.tokens // L)  # at least one row (then it holds L tokens)
                base = {"objective": objective, "attention": attention,
                        "kernel": args.kernel if attention != "exact" else "-", "L": L, "B": B,
                        "tokens_per_batch": B * L, "depth": args.depth, "dim": args.dim,
                        "heads": args.heads, "m": args.nb_features, "precision": args.precision,
                        "device": args.device, "threads": args.threads}
                series = (objective, attention)
                if series in failed:
                    rows.append(Row(**base, status="skipped", note=failed[series]))
                    continue
                case = {**base, "ff_dim": args.ff_dim or 4 * args.dim, "kernel": args.kernel,
                        "seed": args.seed, "warmup": args.warmup, "steps": args.steps,
                        "budget_s": args.budget_s, "mem_limit_gib": mem_limit,
                        "member_len": args.member_len, "paired": args.paired,
                        "memory_dropout": args.memory_dropout}
                t0 = time.perf_counter()
                results, note = common.spawn_case(__file__, case, args.timeout)
                result = results[-1] if results else None  # a child reports after every step
                if result is not None and result.get("steps_timed", 0) > 0:
                    kind = "cuda_alloc_delta" if args.device == "cuda" else "rss_delta"
                    row = Row(**base, **{k: result[k] for k in MEASURED}, mem_kind=kind,
                              paired_speed=result.get("paired_speed", math.nan),
                              note="; ".join(x for x in (result.get("note", ""), note) if x))
                else:
                    status, why = common.failure(results, note)
                    row = Row(**base, status=status, note=why)
                    failed[series] = f"after {status} at L={L}"
                rows.append(row)
                log.info("%s %-5s L=%-6d B=%-3d %6.1fs  %s  %.0f tok/s  %.0f MiB  %s", objective,
                         attention, L, B, time.perf_counter() - t0, row.status, row.tokens_per_s,
                         row.peak_mem_mib, row.note)
    return rows


def _find(rows: list[Row], objective: str, attention: str, L: int) -> Row | None:
    for r in rows:
        if (r.objective, r.attention, r.L) == (objective, attention, L) and r.steps_timed > 0:
            return r
    return None


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """favor/exact speed and exact/favor memory per (objective, L), with the target verdict."""
    out = []
    for objective, L in sorted({(r.objective, r.L) for r in rows}):
        fav, ex = _find(rows, objective, "favor", L), _find(rows, objective, "exact", L)
        mem_row = _find(rows, objective, MEMORY, L)
        memory = math.nan
        if mem_row is not None and not math.isnan(mem_row.paired_speed):
            memory = mem_row.paired_speed
        elif mem_row is not None and fav is not None:
            memory = mem_row.tokens_per_s / fav.tokens_per_s
        speed = fav.tokens_per_s / ex.tokens_per_s if fav and ex else math.nan
        mem = (ex.peak_mem_mib / fav.peak_mem_mib if fav and ex and fav.peak_mem_mib > 0
               else math.nan)
        target = TARGETS.get(L)
        if target is None:
            verdict = "-"
        elif math.isnan(speed):
            verdict = "n/a (not measured)"
        else:
            verdict = common.verdict(speed >= target)
        memory_verdict = "-" if math.isnan(memory) else common.verdict(memory >= MEMORY_TARGET)
        out.append({"objective": objective, "L": L,
                    "favor_tok_s": fav.tokens_per_s if fav else math.nan,
                    "exact_tok_s": ex.tokens_per_s if ex else math.nan, "speed_ratio": speed,
                    "mem_ratio": mem, "target": f">= {target:g}x" if target else "-",
                    "verdict": verdict, "memory_ratio": memory,
                    "memory_verdict": memory_verdict})
    return out


def format_tables(rows: list[Row], header: str) -> str:
    """Markdown: the raw measurements, then the favor/exact ratios against the targets (where
    both ran) and the memory's ratio to plain FAVOR+ (where it ran)."""
    lines = [
        header, "",
        "| objective | attention | L | B | status | steps | step s | tokens/s | peak MiB | note |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r.objective} | {r.attention} | {r.L} | {r.B} | {r.status} | {r.steps_timed} "
            f"| {r.step_time_s:.4g} | {r.tokens_per_s:.0f} | {r.peak_mem_mib:.0f} | {r.note} |")
    measured = [x for x in ratios(rows) if not math.isnan(x["speed_ratio"])]
    if measured:  # favor and exact both run at some length
        lines += [
            "",
            "| objective | L | favor tok/s | exact tok/s | favor/exact speed | exact/favor memory "
            "| target | verdict |",
            "|---|---:|---:|---:|---:|---:|---|---|"]
    for x in measured:
        lines.append(
            f"| {x['objective']} | {x['L']} | {x['favor_tok_s']:.0f} | {x['exact_tok_s']:.0f} "
            f"| {x['speed_ratio']:.2f} | {x['mem_ratio']:.2f} | {x['target']} | {x['verdict']} |")
    if any(not math.isnan(x["memory_ratio"]) for x in ratios(rows)):
        lines += ["", f"| objective | L | {MEMORY} / favor speed | target | verdict |",
                  "|---|---:|---:|---|---|"]
        for x in ratios(rows):
            lines.append(f"| {x['objective']} | {x['L']} | {x['memory_ratio']:.2f} "
                         f"| >= {MEMORY_TARGET:g}x | {x['memory_verdict']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.bench_parser(__doc__, EPILOG, out=".bench/train")
    p.add_argument("--precision", default="32", choices=("32", "bf16-mixed"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--lengths", default="1024,4096,16384", help="comma list of L")
    p.add_argument("--tokens", type=int, default=16384,
                   help="tokens per batch (B = tokens // L, >= 1)")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma list: mlm,clm")
    p.add_argument("--attentions", default=",".join(ATTENTIONS),
                   help=f"comma list: favor,exact,{MEMORY} (FAVOR+ with the position memory)")
    p.add_argument("--paired", action="store_true",
                   help=f"{MEMORY}: time plain FAVOR+ in the same process, steps alternating")
    p.add_argument("--member-len", type=int, default=0,
                   help="family rows: a member every N tokens (0: one protein a row)")
    p.add_argument("--memory-dropout", type=float, default=0.0,
                   help=f"{MEMORY} on family rows: hide each member after a row's first from "
                        "the memory with this probability (data.family_memory_dropout; "
                        "family_clm's default is 0.1)")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--dim", type=int, default=320)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--ff-dim", type=int, default=0, help="feed-forward size (0: 4 * dim)")
    p.add_argument(
        "--nb-features", type=int, default=None,
        help="FAVOR+ random features m (default: the model's, d ln d of the head size d)")
    p.add_argument("--kernel", default="softmax", help="FAVOR+ kernel")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per case")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per case (max)")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="stop timing a case once this much step time was spent (>= 1 timed step)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="hard limit per case (process), seconds")
    common.add_mem_limit_arg(p)
    common.add_final_args(
        p, quick_help="tiny smoke configuration: 2 layers, dim 64, L=64,128, 256 tokens, 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.depth, args.dim, args.heads, args.nb_features = 2, 64, 4, 32
        if args.lengths == p.get_default("lengths"):
            args.lengths = "64,128"
        args.tokens = min(args.tokens, 256)
        args.warmup, args.steps = 1, min(args.steps, 3)
        args.budget_s, args.timeout = min(args.budget_s, 5.0), min(args.timeout, 120.0)
    if args.nb_features is None:
        from protein_performer.model.config import default_nb_features

        args.nb_features = default_nb_features(args.dim // args.heads)
    return args


def main(argv: list[str] | None = None) -> int:
    return common.dispatch(parse_args(argv), run_case, run_parent)


def run_parent(args: argparse.Namespace) -> int:
    """Every case in its own process, then the CSV files and the markdown tables under --out."""
    rows = run_all(args)
    csv_path, md_path = args.out / "train.csv", args.out / "train.md"
    common.write_rows_csv(rows, csv_path, Row)
    common.write_dicts_csv(ratios(rows), args.out / "train_ratios.csv")
    header = (
        f"depth={args.depth} dim={args.dim} heads={args.heads} m={args.nb_features} "
        f"kernel={args.kernel}, {args.tokens} tokens/batch, precision {args.precision}, "
        f"{args.device}, threads={args.threads or 'default'}; optimizer step = "
        "fwd + loss + bwd + AdamW, PerformerLM directly (no Lightning)"
    )
    table = format_tables(rows, header)
    md_path.write_text(f"# Training throughput: FAVOR+ vs exact\n\n{table}\n")
    print(table)
    log.info("wrote %s, %s and %s", csv_path, args.out / "train_ratios.csv", md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
