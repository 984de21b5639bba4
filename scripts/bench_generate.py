#!/usr/bin/env python
"""Generation speed: RNN-mode decoding cost per token, against performer-pytorch's generate.

Three measurements on the ESM-2 8M shape (6 layers, dim 320, 20 heads, ffn 1280), causal,
random weights, the default FAVOR+ config (what `protein-performer generate` runs), batch 1:

1. Per-token cost at context positions P: the prompt of P tokens goes through ``prefill``,
   then ``--steps`` calls of ``PerformerLM.step`` are timed (median; round-robin over the
   positions, so machine load hits all alike), the peak memory of a step above the RSS before
   it is sampled, and the state size is reported. Target: constant in P (the
   32,768 figure at most 1.3x the 256 one).
2. Total time of ``ProteinLM.generate`` for N new tokens (``--gen-lengths``; sampling included).
   Target: N = 4,096 at most 10x N = 512 (linear).
3. performer-pytorch's ``AutoregressiveWrapper.generate`` (installed by ``make bench-env``) on
   the same architecture (dim 320, depth 6, 20 heads of 16, our default m = 48, ffn 4x). It
   re-runs the whole prefix for every new token, so its total for N tokens is the sum of its
   forward times over lengths 1..N: generate is timed directly at ``--pp-generate`` lengths,
   and its forward at a grid of lengths up to the largest ``--pp-lengths``, whose
   piecewise-linear integral estimates the total at every ``--pp-lengths`` value (the direct
   runs check the estimate).
   Target: ours at least 50x faster at 4,096 tokens.

Examples::

    python scripts/bench_generate.py --quick
    python scripts/bench_generate.py --threads 1 --out docs/bench
"""

from __future__ import annotations

import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common as common

SHAPE = {"dim": 320, "depth": 6, "heads": 20, "ff_dim": 1280}


def _ours() -> Any:
    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.inference.api import ProteinLM
    from protein_performer.interop.loading import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(0)
    config = PerformerConfig(**SHAPE, objective="clm", attention="favor")
    model = PerformerLM(config).eval()
    return ProteinLM(
        LoadedModel(model, config, Alphabet(), Path("random"), torch.device("cpu"), "memory")
    )


def per_token(lm: Any, positions: list[int], steps: int) -> list[dict[str, Any]]:
    """Median step time and peak memory per context position.

    Every position's prompt is prefilled first; then the timed steps go round-robin over the
    positions, so a busy machine slows all of them alike instead of whichever ran last.
    """
    import torch

    model = lm.model
    tok = torch.tensor([5])
    states, times, peaks = {}, {P: [] for P in positions}, {P: 0 for P in positions}
    with torch.inference_mode(), common.PeakSampler(None) as sampler:
        for P in positions:
            tokens = torch.randint(4, 24, (1, P))
            tokens[0, 0] = lm.alphabet.cls_idx
            _, states[P] = model.prefill(tokens)
            _, states[P] = model.step(tok, torch.tensor([P]), states[P])  # warm-up
        for i in range(steps):
            for P in positions:
                peak = common.start_phase(sampler, torch.device("cpu")) if i == 0 else None
                t0 = time.perf_counter()
                _, states[P] = model.step(tok, torch.tensor([P + 1 + i]), states[P])
                times[P].append(time.perf_counter() - t0)
                if peak is not None:
                    peaks[P] = peak()
    rows = []
    for P in positions:
        s = states[P]
        state_b = sum(x.kv.numel() * x.kv.element_size() + x.mu.numel() * 4 for x in s)
        rows.append(
            {
                "position": P,
                "ms_per_token": 1e3 * statistics.median(times[P]),
                "peak_mib": peaks[P] / 2**20,
                "state_kib": state_b / 2**10,
            }
        )
        print(f"  position {P}: {rows[-1]['ms_per_token']:.2f} ms/token", file=sys.stderr)
    return rows


def ours_total(lm: Any, lengths: list[int], repeats: int) -> dict[int, float]:
    """Best of ``repeats`` timings per length, lengths taken round-robin (load hits all)."""
    out = {n: float("inf") for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            t0 = time.perf_counter()
            (seq,) = lm.generate(n=1, max_length=n + 1, min_length=n + 1, prompt="M", seed=0)
            out[n] = min(out[n], time.perf_counter() - t0)
            assert len(seq) == n + 1
            print(f"  ours: {n} tokens in {out[n]:.1f} s", file=sys.stderr)
    return out


def performer_pytorch(lengths: list[int], direct: list[int]) -> tuple[dict, dict, str]:
    """(estimated totals, directly timed totals, note) for performer-pytorch's generate."""
    try:
        import performer_pytorch
        import torch
        from performer_pytorch.autoregressive_wrapper import AutoregressiveWrapper

        from protein_performer.model.config import default_nb_features
    except ImportError:
        return {}, {}, "performer-pytorch not installed (make bench-env)"
    torch.manual_seed(0)
    top = max(lengths + direct)
    net = performer_pytorch.PerformerLM(
        num_tokens=33,
        max_seq_len=top + 1,
        dim=SHAPE["dim"],
        depth=SHAPE["depth"],
        heads=SHAPE["heads"],
        dim_head=SHAPE["dim"] // SHAPE["heads"],
        causal=True,
        nb_features=default_nb_features(SHAPE["dim"] // SHAPE["heads"]),
        ff_mult=SHAPE["ff_dim"] // SHAPE["dim"],
    ).eval()
    wrapper = AutoregressiveWrapper(net)
    grid = sorted(
        {1, *[g for g in (64, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192) if g <= top], top}
    )
    fwd = {}
    with torch.inference_mode():
        for t in grid:
            x = torch.randint(4, 24, (1, t))
            net(x)  # warm-up
            reps = []
            for _ in range(3 if t <= 1024 else 1):
                t0 = time.perf_counter()
                net(x)
                reps.append(time.perf_counter() - t0)
            fwd[t] = min(reps)
            print(f"  performer-pytorch forward at {t}: {1e3 * fwd[t]:.1f} ms", file=sys.stderr)

    import numpy as np

    xs = sorted(fwd)
    estimated = {  # one forward per new token, at every length 1..n, interpolated on the grid
        n: float(np.interp(np.arange(1, n + 1), xs, [fwd[t] for t in xs]).sum())
        for n in sorted(set(lengths + direct))
    }
    timed = {}
    with torch.inference_mode():
        for n in direct:
            start = torch.full((1, 1), 20, dtype=torch.long)
            t0 = time.perf_counter()
            wrapper.generate(start, n)
            timed[n] = time.perf_counter() - t0
            print(f"  performer-pytorch generate {n}: {timed[n]:.1f} s", file=sys.stderr)
    return estimated, timed, ""


def main() -> int:
    p = common.bench_parser(__doc__, "", ".bench/generate")
    p.add_argument("--positions", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    p.add_argument("--steps", type=int, default=64, help="timed steps per position")
    p.add_argument("--gen-lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--pp-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument(
        "--pp-generate", type=int, nargs="*", default=[128], help="timed directly (slow: O(N^2))"
    )
    p.add_argument("--repeats", type=int, default=2, help="timings per length (best kept)")
    p.add_argument("--threads", type=int, default=1)
    common.add_final_args(p, "tiny lengths, seconds: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.positions, args.steps = [16, 64], 4
        args.gen_lengths, args.pp_lengths, args.pp_generate = [16, 32], [32], [16]
        args.repeats = 1
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    lm = _ours()
    print("per-token cost (RNN mode):", file=sys.stderr)
    tokens = per_token(lm, args.positions, args.steps)
    print("total generation time:", file=sys.stderr)
    ours = ours_total(lm, args.gen_lengths, args.repeats)
    est, timed, note = performer_pytorch(args.pp_lengths, args.pp_generate)

    with (args.out / "generate_per_token.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(tokens[0]))
        w.writeheader()
        w.writerows(tokens)
    lines = [
        f"threads {args.threads}, {SHAPE}, FAVOR+ default config, batch 1",
        "",
        "| context position | ms / token | peak MiB of a step | state KiB |",
        "|---|---|---|---|",
    ]
    for r in tokens:
        lines.append(
            f"| {r['position']} | {r['ms_per_token']:.2f} | {r['peak_mib']:.1f} | "
            f"{r['state_kib']:.0f} |"
        )
    first, last = tokens[0], tokens[-1]
    lines.append(
        f"\nper-token time at {last['position']} / at {first['position']}: "
        f"{last['ms_per_token'] / first['ms_per_token']:.2f}x (target <= 1.3x)"
    )
    lines += [
        "",
        "| tokens | ours s | performer-pytorch s (timed) | (estimated) | ratio |",
        "|---|---|---|---|---|",
    ]
    for n in sorted(set(args.gen_lengths) | set(args.pp_lengths)):
        o = ours.get(n)
        e = est.get(n)
        t = timed.get(n)
        ratio = (t or e) / o if o and (t or e) else None
        lines.append(
            f"| {n} | {'' if o is None else f'{o:.1f}'} | {'' if t is None else f'{t:.1f}'} | "
            f"{'' if e is None else f'{e:.1f}'} | {'' if ratio is None else f'{ratio:.0f}x'} |"
        )
    lo, hi = min(ours), max(ours)
    lines.append(
        f"\nours: {hi} tokens / {lo} tokens = {ours[hi] / ours[lo]:.2f}x (linear: {hi / lo:.0f}x)"
    )
    for n, t in timed.items():
        if n in est:
            lines.append(f"performer-pytorch at {n}: estimate / timed = {est[n] / t:.2f}")
    if note:
        lines.append(note)
    report = "\n".join(lines) + "\n"
    (args.out / "generate.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
