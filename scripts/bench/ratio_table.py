#!/usr/bin/env python
"""One ratio table from the attention, embedding and training benchmarks' CSV files.

Reads ``DIR/attention/attention.csv`` (``bench_attention.py``), ``DIR/embed.csv``
(``bench_embed.py``) and ``DIR/train/train.csv`` (``bench_train.py``), as
``scripts/bench/gpu_check.sh`` writes them, and prints one markdown table: each row is a case
measured for ours and for a baseline in the same run, with the baseline's time over ours (> 1:
ours is faster). Attention rows compare SDPA with ``ours`` (on CUDA the causal Triton kernel,
its note says so), ``ours-torch`` (the torch scan) and ``triton``, whichever the run measured.
Missing files or cases are skipped with a note, so a partial run still reports.

Example::

    python scripts/bench/ratio_table.py .bench/gpu_check
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import _common as common


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        print(f"(no {path}: skipped)")
        return []
    with path.open(newline="", encoding="utf-8") as fh:
        return [r for r in csv.DictReader(fh) if r.get("status") == "ok"]


#: Our attention implementations (bench_attention.py --impls) and what the case label adds.
OURS = {"ours": "", "ours-torch": ", torch scan", "triton": ", Triton kernel"}
BACKENDS = {"triton": "Triton kernel", "torch": "torch scan"}
#: The embedding baselines (bench_embed.py --impls) and their rows' names.
EMBED_BASES = {"hf": "embed vs HF EsmModel", "exact": "embed vs our exact twin"}


def attention(rows: list[dict[str, str]]) -> list[tuple[str, str, float, float, str]]:
    """(benchmark, case, ours s, baseline s, note): SDPA (flash on CUDA) against each of our
    implementations, same L, mode and phase; the note names the causal path that ran (on CUDA
    ``ours`` is the Triton kernel when triton is installed: the Triton-vs-flash ratio)."""
    times = {(r["impl"], r["causal"], r["L"], r["mode"]): r for r in rows}
    out = []
    for (impl, causal, L, mode), r in sorted(times.items(), key=lambda kv: int(kv[0][2])):
        base = times.get(("sdpa", causal, L, mode))
        if impl in OURS and base:
            kind = "causal" if causal == "True" else "bidirectional"
            frac = f"useful FLOP fraction {float(r['useful_frac']):.2f}"
            backend = BACKENDS.get(r.get("backend", ""))
            out.append(("attention vs SDPA", f"{kind} {mode}, L={L}, {r['dtype']}{OURS[impl]}",
                        float(r["time_s"]), float(base["time_s"]),
                        f"{backend}; {frac}" if backend else frac))
    return out


def embed(rows: list[dict[str, str]]) -> list[tuple[str, str, float, float, str]]:
    """transformers' EsmModel (SDPA) and our exact twin against ours, per case."""
    times = {(r["impl"], r["case"]): float(r["time_s"]) for r in rows}
    return [(name, f"L={case}" if case.isdigit() else case, ours, times[base, case], "")
            for (impl, case), ours in times.items() if impl == "performer"
            for base, name in EMBED_BASES.items()
            if (base, case) in times]


def train(rows: list[dict[str, str]]) -> list[tuple[str, str, float, float, str]]:
    """Our exact twin against FAVOR+: optimizer step time per (objective, L)."""
    times = {(r["attention"], r["objective"], r["L"]): r for r in rows}
    return [("train step vs exact twin", f"{objective}, L={L}, {r['precision']}",
             float(r["step_time_s"]), float(times["exact", objective, L]["step_time_s"]), "")
            for (attn, objective, L), r in times.items()
            if attn == "favor" and ("exact", objective, L) in times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Files read: see the module docstring.")
    p.add_argument("dir", type=Path, help="the benchmark output directory")
    args = p.parse_args(argv)
    common.setup_logging()
    table = [*attention(_rows(args.dir / "attention" / "attention.csv")),
             *embed(_rows(args.dir / "embed.csv")),
             *train(_rows(args.dir / "train" / "train.csv"))]
    print("| benchmark | case | ours (s) | baseline (s) | baseline / ours | |")
    print("|---|---|---:|---:|---:|---|")
    for name, case, ours, base, note in table:
        print(f"| {name} | {case} | {ours:.4g} | {base:.4g} | {base / ours:.2f} | {note} |")
    if not table:
        print("error: no case was measured for both ours and a baseline", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
