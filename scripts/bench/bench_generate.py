#!/usr/bin/env python
"""Generation speed: RNN-mode decoding cost per token, against performer-pytorch's generate.

Three measurements on the ESM-2 8M shape (6 layers, dim 320, 20 heads, ffn 1280), causal,
random weights, the default FAVOR+ config (what `protein-performer generate` runs), batch 1:

1. Per-token cost at context positions P: the prompt of P tokens goes through ``prefill``,
   then ``--steps`` calls of the decoding step generation runs are timed (the TorchScript
   trace by default, ``PerformerLM.step`` with ``PROTEIN_PERFORMER_COMPILE_STEP=0``; median;
   round-robin over the positions, so machine load hits all alike), the peak memory of a step
   above the RSS before it is sampled, and the state size is reported. Target: constant in P (the
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
4. Peers, one run, interleaved (every cell times ours FAVOR+, our exact twin's KV cache and
   transformers' ``GPT2LMHeadModel.generate`` with its KV cache, the ProtGPT2 path, on the same
   dim/depth/heads/ffn and vocab 33, back to back; best of ``--repeats``): ms per generated
   token, prefill and sampling included, at prompts ``--peer-prompts`` (16, 2,048), ``--new``
   (256) new tokens, batches ``--batches`` (1, 16, 32), threads ``--peer-threads`` (1, 2), with
   the ratios. Targets: prompt 16: FAVOR+ <= GPT-2 at batch 1 and 16/32; prompt 2,048: FAVOR+
   >= 2x faster than GPT-2 at batch 1 and 16.
5. The floor: one token reads every weight once, so ms/token >= weight bytes / memory
   bandwidth (a STREAM-like copy of ``--stream-mib`` MiB, measured in the same run, per thread
   count), for the 8M and the 35M shapes, against ours at batch 1, prompt 16. Aim: within 3x.

6. A family (``--parts family``): a model with the position memory (``position_memory`` on,
   member positions, what ``family_clm`` trains) reads a family context of ``--family``
   homologs of ``--family-length`` residues once (``lm.context``), then generates ``--new``
   tokens after it at batch 1, decoded by ``PerformerLM.step`` ("eager",
   ``PROTEIN_PERFORMER_COMPILE_STEP=0``) and by the traced step (the default), with plain
   FAVOR+ traced on the same context as the anchor; the runs alternate, ``--repeats`` of each
   (median and best). Then the memory model's step per token after contexts of
   ``--family-sizes`` homologs (round-robin, eager and traced), with its state's size: constant
   in the context's length, the memory's slots sized by the longest member.

``--compile`` decodes ours through the compiled step (``PROTEIN_PERFORMER_COMPILE_STEP=1``,
``protein_performer.model.decode``): the first step of each batch size pays the compile, printed
apart ("first step"); the per-token timings start after it, and the totals keep the best of
``--repeats`` (2 or more leave the compile out).

Examples::

    python scripts/bench/bench_generate.py --quick
    python scripts/bench/bench_generate.py --threads 1 --out docs/bench
    python scripts/bench/bench_generate.py --threads 1 --compile --out docs/bench
    python scripts/bench/bench_generate.py --threads 1 --parts family --out /tmp/family
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from typing import Any

import _common as common

SHAPE = common.ESM2_8M
#: ESM-2 shapes for the floor: 8M and 35M.
SHAPES = {"8M": SHAPE, "35M": {"dim": 480, "depth": 12, "heads": 20, "ff_dim": 1920}}
RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
#: The measurements of the docstring, 1-5, by name (``--parts``).
PARTS = ("per-token", "totals", "performer-pytorch", "peers", "floor", "family")


def per_token(lm: Any, positions: list[int], steps: int) -> list[dict[str, Any]]:
    """Median step time and peak memory per context position.

    Every position's prompt is prefilled first; then the timed steps go round-robin over the
    positions, so a busy machine slows all of them alike instead of whichever ran last.
    """
    import torch

    from protein_performer.inference.generation import decoding_step

    model = lm.model
    step = decoding_step(model)  # the traced step, or the compiled one with --compile
    tok = torch.tensor([5])
    states, times, peaks = {}, {P: [] for P in positions}, {P: 0 for P in positions}
    with torch.inference_mode(), common.PeakSampler(None) as sampler:
        for j, P in enumerate(positions):
            tokens = torch.randint(4, 24, (1, P))
            tokens[0, 0] = lm.alphabet.cls_idx
            _, states[P] = model.prefill(tokens)
            t0 = time.perf_counter()
            _, states[P] = step(tok, torch.tensor([P]), states[P], inplace=True)  # warm
            if j == 0:
                first = time.perf_counter() - t0
                print(f"  first step (compile, if any): {first:.1f} s", file=sys.stderr)
        for i in range(steps):
            for P in positions:
                peak = common.start_phase(sampler, torch.device("cpu")) if i == 0 else None
                t0 = time.perf_counter()
                _, states[P] = step(tok, torch.tensor([P + 1 + i]), states[P], inplace=True)
                times[P].append(time.perf_counter() - t0)
                if peak is not None:
                    peaks[P] = peak()
    rows = []
    for P in positions:
        rows.append({"position": P, "ms_per_token": 1e3 * statistics.median(times[P]),
                    "peak_mib": peaks[P] / 2**20, "state_kib": _state_bytes(states[P]) / 2**10})
        print(f"  position {P}: {rows[-1]['ms_per_token']:.2f} ms/token", file=sys.stderr)
    return rows


#: The variable that pins the step generation decodes with, and its value per kind: "eager"
#: (model.step), "traced" (the default below the compile threshold), "compiled".
COMPILE_ENV = "PROTEIN_PERFORMER_COMPILE_STEP"
DECODING = {"eager": "0", "traced": "auto", "compiled": "1"}
#: The position memory as family_clm trains it (member positions, 1,024 positions).
MEMORY = {"position_memory": 1024, "positions": "member"}


def _family(n: int, length: int, seed: int = 0) -> list[str]:
    """``n`` homologs of ``length`` residues: one random sequence, 20% of sites resampled per
    member (speed does not depend on the residues; the memory's slots on the lengths)."""
    import random

    rng = random.Random(seed)
    base = [rng.choice(RESIDUES) for _ in range(length)]
    return ["".join(rng.choice(RESIDUES) if rng.random() < 0.2 else c for c in base)
            for _ in range(n)]  # fmt: skip


def family_totals(args: Any) -> list[dict[str, Any]]:
    """ms per generated token after a family context (read once, not timed): the memory model
    eager and traced (and compiled with ``--compile``), plain FAVOR+ traced, alternating."""
    homologs = _family(args.family, args.family_length)
    memory, favor = common.random_clm(**MEMORY), common.random_clm()
    runs = [("memory", memory, "eager"), ("memory", memory, "traced"),
            ("favor", favor, "traced")]  # fmt: skip
    if args.compile:
        runs.append(("memory", memory, "compiled"))
    contexts = {id(lm): lm.context(homologs, warn=False) for lm in (memory, favor)}
    n = args.new

    def once(lm: Any, kind: str) -> float:
        os.environ[COMPILE_ENV] = DECODING[kind]
        return _generate_s(lm, n, "", context=contexts[id(lm)])

    for name, lm, kind in runs:  # warm-up: traces (compiles) and first allocations
        print(f"  first run {name} {kind}: {once(lm, kind):.1f} s", file=sys.stderr)
    times: dict[tuple[str, str], list[float]] = {(r[0], r[2]): [] for r in runs}
    for _ in range(args.repeats):
        for name, lm, kind in runs:
            times[(name, kind)].append(1e3 * once(lm, kind) / n)
            print(f"  {name} {kind}: {times[(name, kind)][-1]:.3f} ms/token", file=sys.stderr)
    os.environ.pop(COMPILE_ENV, None)
    return [{"model": name, "step": kind, "median_ms_per_token": statistics.median(ts),
             "best_ms_per_token": min(ts), "repeats": len(ts)}
            for (name, kind), ts in times.items()]  # fmt: skip


def _state_bytes(states: Any) -> int:
    """Bytes of every tensor in per-layer states (a memory's and its inner core's)."""
    import torch

    def walk(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(walk(y) for y in x) if isinstance(x, tuple | list) else 0

    return walk(states)


def family_per_token(args: Any) -> list[dict[str, Any]]:
    """The memory model's step per token (median of ``--steps``) after contexts of
    ``--family-sizes`` homologs, eager and traced, round-robin over the sizes and steps."""
    import torch

    from protein_performer.inference.generation import decoding_step

    lm = common.random_clm(**MEMORY)
    model = lm.model
    tok = torch.tensor([5])
    steps = {}
    for kind in ("eager", "traced"):
        os.environ[COMPILE_ENV] = DECODING[kind]
        steps[kind] = decoding_step(model)
    os.environ.pop(COMPILE_ENV, None)
    states: dict[tuple[int, str], Any] = {}
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for k in args.family_sizes:
            ctx = lm.context(_family(k, args.family_length, seed=k), warn=False)
            for kind, step in steps.items():  # the new member's <cls>, then a warm step
                _, s = step(torch.tensor([lm.alphabet.cls_idx]), torch.tensor([0]), ctx.states)
                _, s = step(tok, torch.tensor([1]), s, inplace=True)
                states[(k, kind)], times[(k, kind)] = s, []
        for i in range(args.steps):
            for k in args.family_sizes:
                for kind, step in steps.items():
                    t0 = time.perf_counter()
                    _, states[(k, kind)] = step(tok, torch.tensor([2 + i]), states[(k, kind)],
                                                inplace=True)  # fmt: skip
                    times[(k, kind)].append(time.perf_counter() - t0)
    rows = []
    for k in args.family_sizes:
        row: dict[str, Any] = {"homologs": k, "context_tokens": k * (args.family_length + 2)}
        for kind in steps:
            row[f"{kind}_ms_per_token"] = 1e3 * statistics.median(times[(k, kind)])
        row["state_kib"] = _state_bytes(states[(k, "traced")]) / 2**10
        row["memory_slots"] = states[(k, "traced")][0].mem.shape[2]
        rows.append(row)
        print(f"  {k} homologs: eager {row['eager_ms_per_token']:.2f}, traced "
              f"{row['traced_ms_per_token']:.2f} ms/token", file=sys.stderr)
    return rows


def family_lines(args: Any, totals: list[dict[str, Any]], tokens: list[dict[str, Any]]
                 ) -> list[str]:  # fmt: skip
    """The family tables (and their CSVs, written here)."""
    common.write_dicts_csv(totals, args.out / "generate_family.csv")
    common.write_dicts_csv(tokens, args.out / "generate_family_per_token.csv")
    lines = ["", f"after a family context of {args.family} x {args.family_length}-aa homologs, "
             f"{args.new} new tokens, batch 1 (sampling included; {args.repeats} alternating "
             "runs each):", "",
             "| model | step | median ms / token | best ms / token |",
             "|---|---|---|---|"]  # fmt: skip
    for r in totals:
        lines.append(f"| {r['model']} | {r['step']} | {r['median_ms_per_token']:.3f} | "
                     f"{r['best_ms_per_token']:.3f} |")
    by = {(r["model"], r["step"]): r["median_ms_per_token"] for r in totals}
    anchor = by.get(("favor", "traced"))
    for kind in ("eager", "traced", "compiled"):
        if ("memory", kind) in by and anchor:
            lines.append(f"\nmemory {kind} / FAVOR+ traced: {by[('memory', kind)] / anchor:.2f}x")
    lines += ["", f"the memory model's step after growing contexts ({args.family_length}-aa "
              f"homologs; median of {args.steps} steps):", "",
              "| homologs | context tokens | eager ms / token | traced ms / token | state KiB "
              "| memory slots |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in tokens:
        lines.append(f"| {r['homologs']} | {r['context_tokens']} | "
                     f"{r['eager_ms_per_token']:.2f} | {r['traced_ms_per_token']:.2f} | "
                     f"{r['state_kib']:.0f} | {r['memory_slots']} |")
    return lines


def ours_total(lm: Any, lengths: list[int], repeats: int) -> dict[int, float]:
    """Best of ``repeats`` timings per length, lengths taken round-robin (load hits all)."""
    print("total generation time:", file=sys.stderr)
    out = {n: float("inf") for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            out[n] = min(out[n], _generate_s(lm, n + 1, "M"))
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
        num_tokens=33, max_seq_len=top + 1, dim=SHAPE["dim"], depth=SHAPE["depth"],
        heads=SHAPE["heads"], dim_head=SHAPE["dim"] // SHAPE["heads"], causal=True,
        nb_features=default_nb_features(SHAPE["dim"] // SHAPE["heads"]),
        ff_mult=SHAPE["ff_dim"] // SHAPE["dim"]).eval()
    wrapper = AutoregressiveWrapper(net)
    grid = sorted(
        {1, *[g for g in (64, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192) if g <= top], top})
    fwd = {}
    with torch.inference_mode():
        for t in grid:
            x = torch.randint(4, 24, (1, t))
            fwd[t] = common.time_phase(lambda x=x: net(x), x.device, 3 if t <= 1024 else 1)[1]
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


def _gpt2(shape: dict[str, int], positions: int) -> Any:
    """transformers' GPT-2 (ProtGPT2's architecture) on our shape, vocab 33; None if absent."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=33, n_positions=positions, n_embd=shape["dim"],
                     n_layer=shape["depth"], n_head=shape["heads"], n_inner=shape["ff_dim"],
                     bos_token_id=0, eos_token_id=2, pad_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """STREAM-like copy bandwidth in bytes/s (read + written) at the current torch threads."""
    import torch

    n = mib * 2**20 // 4
    a, b = torch.ones(n), torch.empty(n)
    return 2 * n * 4 / common.time_phase(lambda: b.copy_(a), a.device, repeats)[1]


def _generate_s(lm: Any, length: int, prompt: str, batch: int = 1, **kw: Any) -> float:
    """Seconds for ``lm.generate`` of ``batch`` sequences of exactly ``length`` residues after
    ``prompt``, sampling included (``kw``: the family ``context``)."""
    t0 = time.perf_counter()
    seqs = lm.generate(n=batch, max_length=length, min_length=length, prompt=prompt, seed=0,
                       batch_size=batch, **kw)  # fmt: skip
    dt = time.perf_counter() - t0
    assert all(len(q) == length for q in seqs)
    return dt


def _time_ours(lm: Any, prompt: int, batch: int, new: int) -> float:
    """Seconds for ``lm.generate`` of ``batch`` sequences, ``new`` tokens after a ``prompt``-token
    row (``<cls>`` + prompt - 1 residues), sampling included."""
    import random

    rng = random.Random(prompt)
    text = "".join(rng.choice(RESIDUES) for _ in range(prompt - 1))
    return _generate_s(lm, len(text) + new, text, batch)


def _time_gpt2(model: Any, prompt: int, batch: int, new: int) -> float:
    """Seconds for GPT-2's ``generate`` (sampling, KV cache) of ``new`` tokens per row."""
    import torch

    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(4, 24, (batch, prompt), generator=g)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             max_new_tokens=new, min_new_tokens=new, use_cache=True,
                             pad_token_id=1)
    dt = time.perf_counter() - t0
    assert out.shape == (batch, prompt + new)
    return dt


def peers(args: Any) -> tuple[list[dict[str, Any]], str]:
    """ms per generated token for ours FAVOR+, our exact twin and GPT-2, every cell's three
    runs back to back (machine load hits all alike), best of ``args.repeats``."""
    import torch

    print("peers (interleaved):", file=sys.stderr)
    timers = {"favor": functools.partial(_time_ours, common.random_clm()),
              "exact": functools.partial(_time_ours, common.random_clm(attention="exact"))}
    gpt2 = _gpt2(SHAPE, max(args.peer_prompts) + args.new + 1)
    note = "" if gpt2 is not None else "transformers not installed: no GPT-2 column"
    if gpt2 is not None:
        timers["gpt2"] = functools.partial(_time_gpt2, gpt2)
    cells = [(t, p, b) for t in args.peer_threads for p in args.peer_prompts for b in args.batches]
    best: dict[tuple, float] = {}
    for t in args.peer_threads:  # warm-up: first calls allocate and pick kernels, and the
        torch.set_num_threads(t)  # longest prompt tunes the scan's tiles once (not timed)
        for p in sorted({16, max(args.peer_prompts)}):
            for timer in timers.values():
                timer(p, 1, 4)
    for _ in range(args.repeats):
        for t, p, b in cells:
            torch.set_num_threads(t)
            for name, timer in timers.items():
                ms = 1e3 * timer(p, b, args.new) / (b * args.new)
                key = (t, p, b, name)
                best[key] = min(best.get(key, float("inf")), ms)
                print(f"  threads {t} prompt {p} batch {b} {name}: {ms:.3f} ms/token",
                      file=sys.stderr)
    rows = []
    for t, p, b in cells:
        row = {"threads": t, "prompt": p, "batch": b}
        for name in ("favor", "exact", "gpt2"):
            row[f"{name}_ms_per_token"] = best.get((t, p, b, name))
        rows.append(row)
    return rows, note


def floors(args: Any) -> list[dict[str, Any]]:
    """The weight-read floor per shape and thread count, against ours (FAVOR+, batch 1,
    prompt 16), bandwidth measured here, interleaved with the generation runs."""
    import torch

    rows = []
    lms = {name: common.random_clm(shape) for name, shape in SHAPES.items()}
    for t in args.peer_threads:
        torch.set_num_threads(t)
        for name, lm in lms.items():
            _time_ours(lm, 16, 1, 4)  # warm-up
            bw = copy_bandwidth(args.stream_mib)
            ms = min(1e3 * _time_ours(lm, 16, 1, args.new) / args.new for _ in range(args.repeats))
            # what one token must read: every distinct parameter (a tied matrix once)
            params = {p.data_ptr(): p for p in lm.model.parameters()}.values()
            wb = sum(p.numel() * p.element_size() for p in params)
            floor_ms = 1e3 * wb / bw
            rows.append({"shape": name, "threads": t, "weights_mib": wb / 2**20,
                         "copy_gb_s": bw / 1e9, "floor_ms_per_token": floor_ms,
                         "favor_ms_per_token": ms, "over_floor": ms / floor_ms})
            print(f"  floor {name} threads {t}: {floor_ms:.2f} ms, ours {ms:.2f}", file=sys.stderr)
    return rows


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f"{b / a:.2f}x"


def peer_lines(rows: list[dict[str, Any]], floor_rows: list[dict[str, Any]],
               note: str) -> list[str]:
    lines = [
        "", "ms per generated token (prefill and sampling included; best of the repeats):", "",
        "| threads | prompt | batch | ours FAVOR+ | ours exact (KV cache) | GPT-2 (HF, KV cache) "
        "| GPT-2 / FAVOR+ | exact / FAVOR+ |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, e, g = r["favor_ms_per_token"], r["exact_ms_per_token"], r["gpt2_ms_per_token"]
        lines.append(f"| {r['threads']} | {r['prompt']} | {r['batch']} | {_fmt(f)} | {_fmt(e)} | "
                     f"{_fmt(g)} | {_ratio(f, g)} | {_ratio(f, e)} |")
    if note:
        lines.append(note)
    if not floor_rows:  # the floor is measured with the per-token part
        return lines
    lines += [
        "",
        "floor: weight bytes / copy bandwidth (STREAM-like, this run), ours FAVOR+ at batch 1, "
        "prompt 16:",
        "",
        "| shape | threads | weights MiB | copy GB/s | floor ms/token | ours ms/token "
        "| ours / floor |",
        "|---|---|---|---|---|---|---|"]
    for r in floor_rows:
        lines.append(
            f"| {r['shape']} | {r['threads']} | {r['weights_mib']:.1f} | {r['copy_gb_s']:.1f} | "
            f"{r['floor_ms_per_token']:.2f} | {r['favor_ms_per_token']:.2f} | "
            f"{r['over_floor']:.1f}x |")
    return lines


def per_token_lines(args: Any, tokens: list[dict[str, Any]]) -> list[str]:
    """The per-token table (and its CSV, written here)."""
    common.write_dicts_csv(tokens, args.out / "generate_per_token.csv")
    lines = ["", "| context position | ms / token | peak MiB of a step | state KiB |",
             "|---|---|---|---|"]
    for r in tokens:
        lines.append(f"| {r['position']} | {r['ms_per_token']:.2f} | {r['peak_mib']:.1f} | "
                     f"{r['state_kib']:.0f} |")
    first, last = tokens[0], tokens[-1]
    lines.append(f"\nper-token time at {last['position']} / at {first['position']}: "
                 f"{last['ms_per_token'] / first['ms_per_token']:.2f}x (target <= 1.3x)")
    return lines


def total_lines(ours: dict, est: dict, timed: dict, note: str) -> list[str]:
    """The totals table: ours against performer-pytorch's generate."""
    lines = ["", "| tokens | ours s | performer-pytorch s (timed) | (estimated) | ratio |",
             "|---|---|---|---|---|"]
    for n in sorted(set(ours) | set(est) | set(timed)):
        o, e, t = ours.get(n), est.get(n), timed.get(n)
        ratio = (t or e) / o if o and (t or e) else None
        lines.append(f"| {n} | {_fmt(o, '.1f')} | {_fmt(t, '.1f')} | {_fmt(e, '.1f')} | "
                     f"{_fmt(ratio, '.0f')}{'' if ratio is None else 'x'} |")
    if ours:
        lo, hi = min(ours), max(ours)
        lines.append(f"\nours: {hi} tokens / {lo} tokens = {ours[hi] / ours[lo]:.2f}x "
                     f"(linear: {hi / lo:.0f}x)")
    for n, t in timed.items():
        if n in est:
            lines.append(f"performer-pytorch at {n}: estimate / timed = {est[n] / t:.2f}")
    if note:
        lines.append(note)
    return lines


def main() -> int:
    p = common.bench_parser(__doc__, "", ".bench/generate")
    p.add_argument("--positions", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    p.add_argument("--steps", type=int, default=64, help="timed steps per position")
    p.add_argument("--gen-lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--pp-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--pp-generate", type=int, nargs="*", default=[128],
                   help="timed directly (slow: O(N^2))")
    p.add_argument("--repeats", type=int, default=2, help="timings per length (best kept)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peer-prompts", type=int, nargs="+", default=[16, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--peer-threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--new", type=int, default=256, help="new tokens per peer run")
    p.add_argument("--stream-mib", type=int, default=512, help="copy size for the bandwidth")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="which measurements to run (default: all; the numbers above)")
    p.add_argument("--family", type=int, default=4, help="homologs in the family context")
    p.add_argument("--family-length", type=int, default=300, help="residues per homolog")
    p.add_argument("--family-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="homologs per context for the memory's per-token step")
    p.add_argument("--compile", action="store_true",
                   help="decode ours through the compiled step (PROTEIN_PERFORMER_COMPILE_STEP=1)")
    common.add_final_args(p, "tiny lengths, seconds: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.positions, args.steps = [16, 64], 4
        args.gen_lengths, args.pp_lengths, args.pp_generate = [16, 32], [32], [16]
        args.repeats = 1
        args.peer_prompts, args.batches, args.peer_threads = [16, 64], [1, 2], [1]
        args.new, args.stream_mib = 8, 64
        args.family, args.family_length, args.family_sizes = 2, 30, [1, 4]
    import torch

    if args.compile:
        os.environ[COMPILE_ENV] = DECODING["compiled"]
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    lm = common.random_clm()
    parts = set(args.parts)
    lines = [f"threads {args.threads}, {SHAPE}, FAVOR+ default config, batch 1"]
    if "per-token" in parts:
        print("per-token cost (RNN mode):", file=sys.stderr)
        lines += per_token_lines(args, per_token(lm, args.positions, args.steps))
    ours = ours_total(lm, args.gen_lengths, args.repeats) if "totals" in parts else {}
    est, timed, note = ({}, {}, "")
    if "performer-pytorch" in parts:
        est, timed, note = performer_pytorch(args.pp_lengths, args.pp_generate)
    if ours or est:
        lines += total_lines(ours, est, timed, note)
    peer_rows, peer_note = peers(args) if "peers" in parts else ([], "")
    floor_rows = floors(args) if "floor" in parts else []
    torch.set_num_threads(args.threads)
    if "family" in parts:
        print("after a family context (position memory):", file=sys.stderr)
        totals = family_totals(args)
        lines += family_lines(args, totals, family_per_token(args))
    if peer_rows or floor_rows:
        lines += peer_lines(peer_rows, floor_rows, peer_note)
    for name, rows in (("generate_peers.csv", peer_rows), ("generate_floor.csv", floor_rows)):
        if rows:
            common.write_dicts_csv(rows, args.out / name)
    common.write_report(args.out / "generate.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
