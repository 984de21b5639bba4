#!/usr/bin/env python
"""Speed and memory of FAVOR+ attention against exact SDPA and performer-pytorch.

Why this shape: peak memory is only meaningful in a fresh process (allocator caches, earlier
cases and the import of torch all pollute it), and a quadratic baseline at L=65,536 must not hang
the run. So the orchestrator re-invokes this script with ``--case JSON`` once per
(implementation, causal, L); the child measures the forward (no grad, inference) and then
forward+backward, prints one ``RESULT {...}`` line per mode and exits. A case that exceeds
``--timeout`` or ``--mem-limit-gib`` is recorded as ``timeout``/``oom`` and the larger L of the
same series are recorded as ``skipped``. A large square matmul (``--matmul-n``) is timed in its own
fresh process at the start and at the end of the run; the larger rate is the reference.

Peak memory: on CPU the peak RSS during a phase minus the RSS just before it (inputs, module and
the imported libraries are excluded; gradients of q, k, v count in fwd+bwd; freed heap is
returned to the OS with ``malloc_trim`` before each phase). The peak comes from
``ru_maxrss`` when the phase raised it (exact), otherwise from a 1 ms psutil sampler. On CUDA it is
``torch.cuda.max_memory_allocated`` minus the allocation before the phase.

Useful matmul FLOPs (per batch element and head; L tokens, head dim d, m features, e = d + 1 for
the value columns plus the normalizer column, c = the causal chunk size):

- linear attention (ours, performer-pytorch), forward:
  projections Q·Ωᵀ and K·Ωᵀ: 4·L·d·m; K'ᵀ[V|1] and Q'·S: 4·L·m·e;
  causal only, in-chunk products Q'_c·K'_cᵀ and A_c·[V|1] over the lower triangle
  (c(c+1)/2 entries per chunk, masked half not counted): L·(c+1)·(m+e).
- backward: every matmul costs twice its forward (gradient for both operands), except the
  projections (Ω is a buffer: only dQ, dK): +4·L·d·m + 8·L·m·e (+ 2·L·(c+1)·(m+e) causal).
- exact attention (SDPA): forward 4·L²·d (QKᵀ and AV), backward 8·L²·d (dV, dP, dQ, dK; the
  flash-style recomputation is not counted); causal counts L(L+1)/2 instead of L².

Our implementations: ``ours`` is what ``FavorAttention`` runs by default, i.e. on CUDA the causal
Triton kernels (``protein_performer/model/favor/triton_causal.py``) when triton is installed and
the torch chunked scan otherwise; ``ours-torch`` forces the torch scan and ``triton`` the Triton
kernels (on CPU under ``TRITON_INTERPRET=1``: a correctness smoke, not a timing). Both exist for
the causal mode only (bidirectional has one path); the CSV's ``backend`` column says which
causal path a row ran (the Triton kernels count their own chunk size, 64, in the FLOPs). On CUDA
in bfloat16 or float16 every case runs with ``torch.set_float32_matmul_precision("high")``, as a
mixed-precision training run would: FAVOR+ computes its features in float32, and both our paths
(torch matmuls, the kernels' ``tl.dot``) then use TF32 tensor cores instead of IEEE float32.

The useful fraction is useful FLOPs / measured time / the same run's matmul rate. It says how
close the implementation gets to pure-matmul speed; exp, masking and memory traffic are overhead.
For performer-pytorch causal the same formula with our chunk size is used (the work the algorithm
needs, not what that port does).

Examples::

    python scripts/bench/bench_attention.py --help
    python scripts/bench/bench_attention.py --quick                 # tiny, seconds
    python scripts/bench/bench_attention.py --lengths 512,2048,16384 --timeout 300
    python scripts/bench/bench_attention.py --device cuda --dtype bfloat16 --out .bench/gpu
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common

log = logging.getLogger("bench_attention")

EPILOG = "Targets and the FLOP formula: see the module docstring."

IMPLS = ("ours", "ours-torch", "triton", "sdpa", "performer")
DEFAULT_IMPLS = ("ours", "sdpa", "performer")
#: Our implementations, and the causal path each forces (None: FavorAttention's own choice).
OURS = {"ours": None, "ours-torch": "torch", "triton": "triton"}
CAUSAL_ONLY = ("ours-torch", "triton")  # bidirectional FAVOR+ has a single path
MODES = ("bidirectional", "causal")
PHASES = ("fwd", "fwd+bwd")
DEFAULT_CHUNK = 128  # used for the FLOP count when FavorAttention does not expose its chunk size
TRITON_MODULE = "protein_performer.model.favor.triton_causal"
COLORS = {"ours": "tab:blue", "ours-torch": "tab:purple", "triton": "tab:red",
          "sdpa": "tab:orange", "performer": "tab:green"}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Child side: one case in a fresh process
# --------------------------------------------------------------------------------------------


def _build_fn(case: dict[str, Any], device: Any) -> tuple[Callable[..., Any], int | None]:
    """Returns fn(q, k, v) -> out and the causal chunk size used for the FLOP count."""
    import torch
    import torch.nn.functional as F

    impl, causal, d, m = case["impl"], case["causal"], case["d"], case["m"]
    if impl == "sdpa":
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), None
    if impl in OURS:
        from protein_performer.model.favor import FavorAttention
        from protein_performer.model.favor.module import CAUSAL_IMPL_ENV

        if OURS[impl] is not None:  # read at every causal forward; this process is the case's
            os.environ[CAUSAL_IMPL_ENV] = OURS[impl]
        if impl == "triton" and device.type == "cpu":  # before the kernels are decorated
            os.environ["TRITON_INTERPRET"] = "1"
        attn = FavorAttention(dim_head=d, nb_features=m, causal=causal,
                              kernel=case["kernel"]).to(device)  # fmt: skip

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attn(q, k, v)[0]  # the cores return (out, state)

        run.feature_dim = attn.feature_dim  # type: ignore[attr-defined]  (the tiles' key)
        return run, attn.chunk_size  # chunk None: tuned (.tiles)
    if impl == "performer":
        from performer_pytorch import FastAttention

        torch.manual_seed(case["seed"])
        attn = FastAttention(dim_heads=d, nb_features=m, causal=causal).to(device)
        return (lambda q, k, v: attn(q, k, v)[0]), case.get("flop_chunk", DEFAULT_CHUNK)
    raise ValueError(f"unknown impl {impl!r}")


def useful_flops(impl: str, causal: bool, L: int, B: int, H: int, d: int, m: int,
                 chunk: int | None, backward: bool) -> float:  # fmt: skip
    """Matmul FLOPs the algorithm inherently needs (formula in the module docstring)."""
    if impl == "sdpa":
        pairs = L * (L + 1) / 2 if causal else float(L * L)
        return B * H * 4 * pairs * d * (3 if backward else 1)
    e = d + 1
    proj, state = 4 * L * d * m, 4 * L * m * e
    chunk_f = L * ((chunk or DEFAULT_CHUNK) + 1) * (m + e) if causal else 0.0
    per = proj + state + chunk_f
    if backward:
        per += proj + 2 * state + 2 * chunk_f
    return B * H * per


def run_matmul_case(case: dict[str, Any]) -> None:
    """Times an n×n @ n×n matmul in the benchmark dtype: the reference rate for useful FLOPs."""
    import torch

    device, dtype, n = torch.device(case["device"]), getattr(torch, case["dtype"]), case["n"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    median, best, reps = common.time_phase(lambda: torch.mm(a, b), device, case["repeats"],
                                     case["budget_s"])  # fmt: skip
    common.emit({"status": "ok", "mode": "matmul", "time_s": median, "time_min_s": best,
                 "repeats": reps, "achieved_gflops": 2 * n**3 / median / 1e9})  # fmt: skip


def _tuned_chunks(fn: Any, B: int, H: int, L: int, d: int, device: Any, dtype: Any) -> dict:
    """The scan's tiles are tuned at a layer's first large call (model/favor/tiles.py): do that
    here for both phases, at a size that triggers it, so no timed call pays for it; returns the
    chunk in use per phase (the tuning is keyed on whether gradients flow)."""
    import torch

    from protein_performer.model.favor.tiles import TUNE_MIN_LENGTH, TUNE_MIN_TOKENS, tiles_in_use

    n = max(TUNE_MIN_LENGTH, -(-TUNE_MIN_TOKENS // (B * H)))
    if L >= TUNE_MIN_LENGTH and B * H * L >= TUNE_MIN_TOKENS:
        probe = [torch.randn(B, H, n, d).to(device, dtype) for _ in range(3)]
        with torch.no_grad():
            fn(*probe)
        out = fn(*(t.requires_grad_(True) for t in probe))
        out.backward(torch.randn_like(out))
        del probe, out
    shape = torch.empty_strided((B * H, L, d), (0, 0, 0), device=device)  # no memory
    return {False: tiles_in_use(shape, fn.feature_dim, d)[0],
            True: tiles_in_use(shape.requires_grad_(True), fn.feature_dim, d)[0]}  # fmt: skip


def run_case(case: dict[str, Any]) -> None:
    """Runs one (impl, causal, L) case: forward then forward+backward, one RESULT line each."""
    import torch

    limit = common.start_case(case)
    if case["impl"] == "matmul":
        run_matmul_case(case)
        return
    device, dtype = torch.device(case["device"]), getattr(torch, case["dtype"])
    if device.type == "cuda" and dtype != torch.float32:
        torch.set_float32_matmul_precision("high")  # TF32 for the float32 features
    B, H, L, d = case["B"], case["H"], case["L"], case["d"]
    gen = torch.Generator(device="cpu").manual_seed(case["seed"])
    q, k, v, g = (torch.randn(B, H, L, d, generator=gen).to(device, dtype) for _ in range(4))
    fn, chunk = _build_fn(case, device)
    # Library warm-up at a tiny size, so one-time costs (lazy kernels, autograd worker threads)
    # do not count as this case's memory or time.
    tiny = [torch.randn(B, H, 16, d).to(device, dtype).requires_grad_(True) for _ in range(3)]
    out = fn(*tiny)
    out.backward(torch.randn_like(out))  # not .sum(): its expanded gradient takes another path
    del tiny, out
    if case["impl"] in OURS and case["causal"] and chunk is None:
        chunk = _tuned_chunks(fn, B, H, L, d, device, dtype)  # (nothing where Triton runs)
    backend = ""  # which causal path ours ran: the Triton kernels' module is imported if taken
    if case["impl"] in OURS and case["causal"]:
        backend = "triton" if TRITON_MODULE in sys.modules else "torch"
    if backend == "triton":
        chunk = sys.modules[TRITON_MODULE].CHUNK

    def fwd() -> None:
        with torch.no_grad():
            fn(q, k, v)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd() -> None:
        for t in (qg, kg, vg):
            t.grad = None
        fn(qg, kg, vg).backward(g)

    with common.PeakSampler(limit) as sampler:
        for mode, step, backward in (("fwd", fwd, False), ("fwd+bwd", fwd_bwd, True)):
            peak_bytes = common.start_phase(sampler, device)
            try:
                median, best, reps = common.time_phase(step, device, case["repeats"],
                                                       case["budget_s"])  # fmt: skip
            except torch.OutOfMemoryError as exc:
                common.emit({"mode": mode, "status": "oom",
                             "note": str(exc).splitlines()[0][:200]})  # fmt: skip
                return
            peak = peak_bytes()
            used = chunk[backward] if isinstance(chunk, dict) else chunk
            flops = useful_flops(case["impl"], case["causal"], L, B, H, d, case["m"], used,
                                 backward)  # fmt: skip
            common.emit({"mode": mode, "status": "ok", "time_s": median, "time_min_s": best,
                         "repeats": reps, "peak_mem_mib": peak / 2**20,
                         "useful_gflop": flops / 1e9, "achieved_gflops": flops / median / 1e9,
                         "chunk_size": used, "backend": backend})  # fmt: skip


# --------------------------------------------------------------------------------------------
# Parent side: orchestration, CSV, plot, target table
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One CSV row: a (impl, causal, L, mode) measurement or its failure."""

    impl: str
    causal: bool
    L: int
    B: int
    H: int
    d: int
    m: int
    dtype: str
    device: str
    mode: str
    status: str
    time_s: float = math.nan
    time_min_s: float = math.nan
    repeats: int = 0
    peak_mem_mib: float = math.nan
    useful_gflop: float = math.nan
    achieved_gflops: float = math.nan
    useful_frac: float = math.nan
    matmul_gflops: float = math.nan
    chunk_size: int | None = None
    backend: str = ""
    note: str = ""


#: What a child's RESULT line carries into its row as measured.
MEASURED = ("time_s", "time_min_s", "repeats", "peak_mem_mib", "useful_gflop", "achieved_gflops")


def run_all(args: argparse.Namespace) -> list[Row]:
    """Runs the matmul reference and every requested case, each in a fresh process."""
    impls = [x for x in args.impls.split(",") if x]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        raise SystemExit(f"error: unknown --impls {','.join(unknown)}; choose from {IMPLS}")
    if "performer" in impls and importlib.util.find_spec("performer_pytorch") is None:
        log.warning("performer-pytorch is not installed: skipping it "
                    "(pip install performer-pytorch==1.1.4 to compare)")  # fmt: skip
        impls.remove("performer")
    shape = {"B": args.batch, "H": args.heads, "d": args.dim_head, "m": args.nb_features,
             "dtype": args.dtype, "device": args.device}  # fmt: skip
    mem_limit = args.mem_limit_gib or common.default_mem_limit_gib()
    shared_case = {**shape, "seed": args.seed, "repeats": args.repeats, "budget_s": args.budget_s,
                   "threads": args.threads, "kernel": args.kernel,
                   "mem_limit_gib": mem_limit}  # fmt: skip
    mm_case = {**shared_case, "impl": "matmul", "n": args.matmul_n}
    matmul_gflops = _matmul_rate(mm_case, args.timeout)
    rows: list[Row] = []
    ours_chunk: int | None = None
    for mode in (x for x in args.modes.split(",") if x):
        causal = mode == "causal"
        for impl in impls:
            if impl in CAUSAL_ONLY and not causal:
                continue  # the same path as ours
            failed_at: str | None = None
            for L in sorted(int(x) for x in args.lengths.split(",")):
                base = {**shape, "impl": impl, "causal": causal, "L": L,
                        "matmul_gflops": matmul_gflops}  # fmt: skip
                if failed_at is not None:
                    rows += [Row(**base, mode=ph, status="skipped", note=failed_at)
                             for ph in PHASES]  # fmt: skip
                    continue
                case = {**shared_case, "impl": impl, "causal": causal, "L": L}
                if impl == "performer" and ours_chunk:
                    case["flop_chunk"] = ours_chunk
                t0 = time.perf_counter()
                results, note = common.spawn_case(__file__, case, args.timeout)
                done = {r["mode"]: r for r in results if "mode" in r}
                for ph in PHASES:
                    r = done.get(ph, {})
                    if r.get("status") == "ok":
                        if impl == "ours" and r.get("chunk_size"):
                            ours_chunk = int(r["chunk_size"])
                        rows.append(Row(**base, mode=ph, status="ok",
                                        **{k: r[k] for k in MEASURED},
                                        useful_frac=r["achieved_gflops"] / matmul_gflops,
                                        chunk_size=r.get("chunk_size"),
                                        backend=r.get("backend", "")))  # fmt: skip
                    else:
                        status, why = common.failure(results, note)
                        rows.append(Row(**base, mode=ph, status=status, note=why))
                        failed_at = f"after {status} at L={L}"
                log.info("%-9s %-13s L=%-6d %5.1fs  %s", impl, mode, L, time.perf_counter() - t0,
                         "  ".join(f"{r.mode}: {r.status} {r.time_s:.4g}s {r.peak_mem_mib:.0f}MiB"
                                   for r in rows[-2:]))  # fmt: skip
    # Measured again at the end: on a shared machine the larger of the two is the closer estimate
    # of the achievable rate, and a large gap between them says the timings are unreliable.
    again = _matmul_rate(mm_case, args.timeout)
    if not math.isnan(again) and not again <= matmul_gflops:
        for r in rows:
            r.matmul_gflops = again
            r.useful_frac = r.achieved_gflops / again
    return rows


def _matmul_rate(case: dict[str, Any], timeout: float) -> float:
    mm, note = common.spawn_case(__file__, case, timeout)
    rate = mm[0]["achieved_gflops"] if mm and mm[0].get("status") == "ok" else math.nan
    log.info("matmul %d^3 %s: %.1f GFLOP/s %s", case["n"], case["dtype"], rate, note)
    return rate


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Log-log time and memory vs L; solid = fwd+bwd, dashed = fwd."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    for impl, causal in sorted({(r.impl, r.causal) for r in rows}):
        for mode, ls in (("fwd+bwd", "-"), ("fwd", "--")):
            pts = sorted((r.L, r.time_s, r.peak_mem_mib) for r in rows if r.status == "ok"
                         and (r.impl, r.causal, r.mode) == (impl, causal, mode))  # fmt: skip
            if not pts:
                continue
            style = {"marker": "s" if causal else "o", "color": COLORS.get(impl),
                     "alpha": 1.0 if causal else 0.6,
                     "label": f"{impl} {'causal' if causal else 'bidir'} {mode}"}  # fmt: skip
            xs = [p[0] for p in pts]
            ax_t.plot(xs, [p[1] for p in pts], ls, **style)
            ax_m.plot(xs, [max(p[2], 1e-3) for p in pts], ls, **style)
    for ax, ylabel in ((ax_t, "time [s]"), (ax_m, "peak memory delta [MiB]")):
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="sequence length L", ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _get(rows: list[Row], impl: str, causal: bool, L: int, mode: str = "fwd+bwd") -> Row | None:
    for r in rows:
        if (r.impl, r.causal, r.L, r.mode) == (impl, causal, L, mode) and r.status == "ok":
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b is not None and b > 0 else math.nan


def targets(rows: list[Row]) -> list[tuple[str, str, float, bool | None]]:
    """The issue's targets: (description, target, measured, passed or None when unmeasured)."""

    def t(impl: str, causal: bool, L: int, key: str = "time_s") -> float | None:
        r = _get(rows, impl, causal, L)
        return getattr(r, key) if r else None

    def mem(impl: str, causal: bool, L: int) -> float | None:
        return t(impl, causal, L, "peak_mem_mib")

    worst = max((_ratio(mem("ours", True, L), mem("ours", False, L))
                 for L in sorted({r.L for r in rows if r.L >= 4096})),
                key=lambda x: -1 if math.isnan(x) else x, default=math.nan)  # fmt: skip
    checks = [  # (description, measured, goal)
        ("causal fwd+bwd L=8192: SDPA time / ours",
         _ratio(t("sdpa", True, 8192), t("ours", True, 8192)), ">= 2.5"),
        ("causal fwd+bwd L=8192: performer time / ours",
         _ratio(t("performer", True, 8192), t("ours", True, 8192)), ">= 30"),
        ("causal fwd+bwd L=8192: ours causal mem / ours bidir mem",
         _ratio(mem("ours", True, 8192), mem("ours", False, 8192)), "<= 1.5"),
        ("causal fwd+bwd L>=4096 worst: ours causal mem / bidir mem", worst, "<= 1.5"),
        ("bidir fwd+bwd L=32768: performer time / ours",
         _ratio(t("performer", False, 32768), t("ours", False, 32768)), ">= 1.5"),
        ("bidir fwd+bwd L=32768: ours mem / performer mem",
         _ratio(mem("ours", False, 32768), mem("performer", False, 32768)), "<= 0.5"),
    ]  # fmt: skip
    for causal in (False, True):
        for mode in PHASES:
            fracs = [r.useful_frac for r in rows if r.impl == "ours" and r.causal == causal
                     and r.mode == mode and r.L >= 8192 and r.status == "ok"]  # fmt: skip
            name = "causal" if causal else "bidir"
            checks.append((f"ours {name} {mode} L>=8192: min useful FLOP fraction",
                           min(fracs) if fracs else math.nan, ">= 0.40"))  # fmt: skip
    out: list[tuple[str, str, float, bool | None]] = []
    for desc, val, goal in checks:
        op, bound = goal.split()
        passed = val >= float(bound) if op == ">=" else val <= float(bound)
        out.append((desc, goal, val, None if math.isnan(val) else passed))
    return out


def format_tables(rows: list[Row], matmul_gflops: float) -> str:
    """Markdown: raw measurements, ratios to ours, and the target checklist."""
    lines = [f"matmul reference: {matmul_gflops:.1f} GFLOP/s", "",
             "| impl | mode | L | phase | status | time s | peak MiB | useful GFLOP/s | frac |"
             " x ours time | x ours mem |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = _get(rows, "ours", r.causal, r.L, r.mode)  # a failed row's nan gives nan
        rt, rm = (_ratio(getattr(r, k), getattr(ref, k)) if ref else math.nan
                  for k in ("time_s", "peak_mem_mib"))
        lines.append(
            f"| {r.impl} | {'causal' if r.causal else 'bidir'} | {r.L} | {r.mode} | {r.status} "
            f"| {r.time_s:.4g} | {r.peak_mem_mib:.1f} | {r.achieved_gflops:.1f} "
            f"| {r.useful_frac:.2f} | {rt:.2f} | {rm:.2f} |")
    lines += ["", "| target | goal | measured | pass |", "|---|---|---:|---|"]
    for desc, tgt, val, ok in targets(rows):
        verdict = "n/a (not measured)" if ok is None else common.verdict(ok)
        lines.append(f"| {desc} | {tgt} | {val:.3g} | {verdict} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.bench_parser(__doc__, EPILOG, out=".bench/attention")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma list from: {','.join(IMPLS)} (ours-torch, triton: causal only)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list from: " + ",".join(MODES))
    p.add_argument("--lengths", default=",".join(str(512 * 2**i) for i in range(8)),
                   help="comma list of L (default 512, 1024, ..., 65536)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim-head", type=int, default=64)
    p.add_argument("--nb-features", type=int, default=None,
                   help="FAVOR+ features m (default: the model's, d ln d rounded up to 16: "
                   "272 at d=64)")
    p.add_argument("--kernel", default="softmax", help="FavorAttention kernel for 'ours'")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per phase (median)")
    p.add_argument("--budget-s", type=float, default=20.0,
                   help="stop repeating a phase once this much time was spent; a warm-up "
                   "longer than this is the measurement (repeats=0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case (process)")
    common.add_mem_limit_arg(p)
    p.add_argument("--matmul-n", type=int, default=4096, help="size of the reference matmul")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    common.add_final_args(p, "tiny smoke configuration: L=256,512, 1 repeat, small matmul")
    args = p.parse_args(argv)
    if args.nb_features is None:
        from protein_performer.model.config import default_nb_features

        args.nb_features = default_nb_features(args.dim_head)
    if args.quick:
        if args.lengths == p.get_default("lengths"):
            args.lengths = "256,512"
        args.repeats, args.budget_s, args.matmul_n = 1, 1.0, min(args.matmul_n, 512)
        args.timeout = min(args.timeout, 120.0)
    return args


def main(argv: list[str] | None = None) -> int:
    return common.dispatch(parse_args(argv), run_case, run_parent)


def run_parent(args: argparse.Namespace) -> int:
    """Every case in its own process, then the CSV, the plot and the markdown under --out."""
    rows = run_all(args)
    matmul = next((r.matmul_gflops for r in rows), math.nan)
    csv_path, png_path, md_path = (args.out / f"attention.{x}" for x in ("csv", "png", "md"))
    common.write_rows_csv(rows, csv_path, Row)
    title = (f"B={args.batch} H={args.heads} d={args.dim_head} m={args.nb_features} "
             f"{args.dtype} {args.device}, matmul {matmul:.0f} GFLOP/s")  # fmt: skip
    plot(rows, png_path, title)
    table = format_tables(rows, matmul)
    md_path.write_text(f"# Attention benchmark\n\n{title}\n\n{table}\n")
    print(table)
    log.info("wrote %s, %s, %s", csv_path, png_path, md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
