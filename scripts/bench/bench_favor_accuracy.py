#!/usr/bin/env python
"""How well FAVOR+ approximates softmax attention: the paper's Fig. 4 study and a logit-std sweep.

Why: speed is worthless if the output collapses to the mean of V (what performer-pytorch does at
logit std >= 1). Two studies, one run:

1. Fig. 4 of Choromanski et al. (2021): attention-output MSE against exact softmax as the number
   of random features m grows, orthogonal (ORF) vs IID draws, positive vs trigonometric features,
   at L=4096, d=16, over ``--seeds`` seeds (fresh inputs and fresh features per seed). Mean and
   standard deviation across seeds.
2. Relative error ||out - exact||_F / ||exact||_F at L=1024, d=64, m=256 for every kernel of
   ``FavorAttention``, for performer-pytorch's ``FastAttention`` (same m; if installed) and for
   the uniform baseline (every query outputs the mean of V), at logit std tau in {0.25, 0.5, 1, 2}.

m is FavorAttention's ``nb_features`` (the number of omega rows) for every kernel, as in the
paper and in Lemma 2's formulas; ``softmax_hyp`` and ``trig`` therefore use 2m-wide features
(+/- and sin/cos pairs), the others m.

Inputs ("normalized"): v ~ N(0, 1); q, k entries ~ N(0, s^2) with s = sqrt(tau). For independent
q, k the logit q.k/sqrt(d) is a sum of d products with variance s^4 each, divided by sqrt(d), so
its standard deviation is s^2 = tau: tau is exactly the std of the softmax logits. The Fig. 4
study runs each of ``--fig4-taus`` (default 0.25 and 1; tau = 1 is standard normal q, k). The
paper's "appropriately normalized" inputs are not specified further; the relevant size is
||x||^2 = ||q||^2 / sqrt(d) = tau sqrt(d) (4 tau at d = 16), since the positive estimator's
relative variance grows like exp(||x + y||^2) / m: at tau = 1, d = 16 that is ~e^8 / m, so the
error only starts to fall once m is in the thousands. Both regimes are shown, with the uniform
baseline as a flat reference line.

With zero-mean V the uniform baseline's relative error is about sqrt(1 - ESS/L), where
ESS = L / exp(tau^2) is the effective number of keys per query: ~0.80 at tau = 1, L = 1024; an
approximation scoring at or above that has learned nothing beyond averaging.

Outputs in ``--out``: ``fig4.csv``, ``tau.csv``, ``accuracy.md`` (also printed), ``accuracy.png``.

Examples::

    python scripts/bench/bench_favor_accuracy.py --quick
    python scripts/bench/bench_favor_accuracy.py --seeds 15 --out .bench/accuracy
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _common as common

if TYPE_CHECKING:  # torch is imported lazily so that --help answers at once
    from torch import Tensor

log = logging.getLogger("bench_favor_accuracy")

KERNELS = ("softmax", "softmax_hyp", "softmax_opt", "trig", "relu")
TAUS = (0.25, 0.5, 1.0, 2.0)
#: An approximation of softmax attention: fn(q, k, v, seed) -> output; ``seed`` draws features.
Method = Callable[["Tensor", "Tensor", "Tensor", int], "Tensor"]


def make_inputs(L: int, d: int, tau: float, seeds: int) -> list[tuple[Tensor, ...]]:
    """Per seed: q, k scaled so the logits q.k/sqrt(d) have std tau, v standard normal (shapes
    (1,1,L,d)), and exact softmax attention's output on them."""
    import torch

    from protein_performer.model.exact import exact_attention

    s, inputs = math.sqrt(tau), []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 1, L, d, generator=gen) * s
        k = torch.randn(1, 1, L, d, generator=gen) * s
        v = torch.randn(1, 1, L, d, generator=gen)
        inputs.append((q, k, v, exact_attention(q, k, v)))
    return inputs


def _ours(d: int, m: int, kernel: str, orthogonal: bool = True) -> Method:
    """A bidirectional FavorAttention, its features redrawn per seed; ``orthogonal=False``
    draws IID features."""
    import torch

    from protein_performer.model.favor import FavorAttention

    attn = FavorAttention(dim_head=d, nb_features=m, causal=False, kernel=kernel,
                          orthogonal=orthogonal)

    def ours(q: Tensor, k: Tensor, v: Tensor, seed: int) -> Tensor:
        attn.redraw(generator=torch.Generator().manual_seed(10_000 + seed))
        return attn(q, k, v)[0]

    return ours


def _uniform(q: Tensor, k: Tensor, v: Tensor, seed: int) -> Tensor:
    """The baseline that ignores q and k: every query outputs the mean of V."""
    return v.mean(dim=-2, keepdim=True).expand_as(v)


def _mse(out: Tensor, ref: Tensor) -> float:
    return float((out - ref).pow(2).mean())


def _rel_err(out: Tensor, ref: Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def _over_seeds(method: Method, inputs: list[tuple[Tensor, ...]],
                error: Callable[[Tensor, Tensor], float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one seed) of ``method``'s error per seed."""
    xs = [error(method(q, k, v, seed), ref) for seed, (q, k, v, ref) in enumerate(inputs)]
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def fig4_study(L: int, d: int, ms: Sequence[int], seeds: int,
               taus: Sequence[float]) -> list[dict[str, object]]:
    """MSE of the attention output vs m for {ORF, IID} x {positive, trig}, per logit std.

    The uniform baseline (mean of V) is added as a flat reference: an estimator above it is
    worse than ignoring q and k altogether.
    """
    cells: list[tuple[str, str, int, Method]] = [
        (feat, draw, m, _ours(d, m, kernel, orth))
        for kernel, feat in (("softmax", "positive"), ("trig", "trig"))
        for orth, draw in ((True, "ORF"), (False, "IID")) for m in ms]
    cells += [("uniform", "mean of V", m, _uniform) for m in ms]
    rows: list[dict[str, object]] = []
    for tau in taus:
        inputs = make_inputs(L, d, tau, seeds)
        for feat, draw, m, method in cells:
            mean, std = _over_seeds(method, inputs, _mse)
            rows.append({"tau": tau, "features": feat, "draw": draw, "m": m, "mse_mean": mean,
                         "mse_std": std, "seeds": seeds})
            log.info("fig4 tau=%g %-8s %-7s m=%-4d mse %.3e +- %.1e", tau, feat, draw, m, mean,
                     std)
    return rows


def tau_study(L: int, d: int, m: int, taus: Sequence[float], seeds: int,
              kernels: Sequence[str]) -> list[dict[str, object]]:
    """Relative error vs exact for each method and logit std; mean/std over seeds."""
    import torch

    methods = {f"ours/{kernel}": _ours(d, m, kernel) for kernel in kernels}
    try:
        from performer_pytorch import FastAttention
    except ImportError:
        log.warning("performer-pytorch not installed: no comparison against it "
                    "(pip install performer-pytorch==1.1.4)")
    else:

        def performer(q: Tensor, k: Tensor, v: Tensor, seed: int) -> Tensor:
            torch.manual_seed(10_000 + seed)  # it draws from the global RNG
            return FastAttention(dim_heads=d, nb_features=m)(q, k, v)

        methods["performer-pytorch"] = performer
    methods["uniform (mean of V)"] = _uniform
    rows = []
    for tau in taus:
        inputs = make_inputs(L, d, tau, seeds)
        for name, method in methods.items():
            mean, std = _over_seeds(method, inputs, _rel_err)
            rows.append({"method": name, "tau": tau, "rel_err_mean": mean, "rel_err_std": std,
                         "seeds": seeds, "L": L, "d": d, "m": m})
            log.info("tau %-4g %-22s rel err %.4f +- %.4f", tau, name, mean, std)
    return rows


def markdown(fig4: list[dict[str, object]], tau: list[dict[str, object]], fig4_cfg: str,
             tau_cfg: str) -> str:
    """MSE per (features, draw) vs m for each Fig. 4 logit std; rel. error per method vs tau."""
    lines = [f"## Fig. 4: attention-output MSE vs m ({fig4_cfg})"]
    for t in sorted({float(r["tau"]) for r in fig4}):
        sub = [r for r in fig4 if r["tau"] == t]
        cols = list(dict.fromkeys((str(r["features"]), str(r["draw"])) for r in sub))
        ms = sorted({int(r["m"]) for r in sub})
        cell = {(r["features"], r["draw"], r["m"]): r for r in sub}
        lines += ["", f"### logit std tau = {t:g}", "",
                  "| m | " + " | ".join(f"{f} {dr}" for f, dr in cols) + " | ORF < IID |",
                  "|---:|" + "---:|" * len(cols) + "---|"]
        for m in ms:
            orf_wins = []
            for feat in ("positive", "trig"):
                orf, iid = cell.get((feat, "ORF", m)), cell.get((feat, "IID", m))
                if orf and iid:
                    won = orf["mse_mean"] < iid["mse_mean"]
                    orf_wins.append(f"{feat}: {'yes' if won else 'NO'}")
            mses = [f"{cell[(f, dr, m)]['mse_mean']:.3e} ± {cell[(f, dr, m)]['mse_std']:.1e}"
                    for f, dr in cols]
            lines.append(f"| {m} | {' | '.join(mses)} | {', '.join(orf_wins) or 'n/a'} |")
    taus = sorted({float(r["tau"]) for r in tau})
    methods = list(dict.fromkeys(str(r["method"]) for r in tau))
    tcell = {(r["method"], r["tau"]): r for r in tau}
    lines += ["", f"## Relative error ||out - exact|| / ||exact|| vs logit std tau ({tau_cfg})",
              "",
              "softmax_hyp and trig use 2m-wide features; the uniform baseline outputs the "
              "mean of V for every query.",
              "", "| method | " + " | ".join(f"tau={t:g}" for t in taus) + " |",
              "|---|" + "---:|" * len(taus)]
    for name in methods:
        errs = [f"{tcell[(name, t)]['rel_err_mean']:.4f} ± {tcell[(name, t)]['rel_err_std']:.4f}"
                for t in taus]
        lines.append(f"| {name} | {' | '.join(errs)} |")
    return "\n".join(lines)


def _errorbars(ax: Any, rows: list[dict[str, object]], x: str, y: str, **style: Any) -> None:
    """One series: ``y`` mean with its ``y``-std error bars against ``x``, on log-log axes."""
    pts = sorted((float(r[x]), float(r[f"{y}_mean"]), float(r[f"{y}_std"])) for r in rows)
    xs, ys, errs = zip(*pts, strict=True)
    ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")


def plot(fig4: list[dict[str, object]], tau: list[dict[str, object]], path: Path,
         titles: tuple[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_taus = sorted({float(r["tau"]) for r in fig4})
    fig, axes = plt.subplots(1, len(fig_taus) + 1, figsize=(6 * (len(fig_taus) + 1), 4.8))
    styles = {("positive", "ORF"): ("tab:blue", "-"), ("positive", "IID"): ("tab:blue", "--"),
              ("trig", "ORF"): ("tab:red", "-"), ("trig", "IID"): ("tab:red", "--")}
    for ax, t in zip(axes[:-1], fig_taus, strict=True):
        sub = [r for r in fig4 if r["tau"] == t]
        for key in dict.fromkeys((str(r["features"]), str(r["draw"])) for r in sub):
            color, ls = styles.get(key, ("gray", ":"))
            _errorbars(ax, [r for r in sub if (r["features"], r["draw"]) == key], "m", "mse",
                       color=color, ls=ls, label=f"{key[0]} {key[1]}")
        ax.set(xlabel="random features m", ylabel="attention-output MSE")
        ax.set_title(f"{titles[0]}, logit std {t:g}", fontsize=9)
    for name in dict.fromkeys(str(r["method"]) for r in tau):
        ls = ":" if name.startswith("uniform") else ("--" if name.startswith("perf") else "-")
        _errorbars(axes[-1], [r for r in tau if r["method"] == name], "tau", "rel_err", ls=ls,
                   label=name)
    axes[-1].set(xlabel="logit std tau", ylabel="relative error vs exact")
    axes[-1].set_title(titles[1], fontsize=9)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _list(kind: type) -> Callable[[str], list[Any]]:
    """An argparse type: a comma list of ``kind`` values."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Input scaling and definitions: see the module docstring.")
    p.add_argument("--out", type=Path, default=Path(".bench/accuracy"), help="output directory")
    p.add_argument("--seeds", type=int, default=10, help="seeds per cell (paper: >= 10)")
    p.add_argument("--fig4-len", type=int, default=4096)
    p.add_argument("--fig4-dim", type=int, default=16)
    p.add_argument("--fig4-taus", type=_list(float), default="0.25,1",
                   help="comma list of logit stds for the Fig. 4 inputs (one panel each)")
    p.add_argument("--fig4-m", type=_list(int), default="16,32,64,128,256,512",
                   help="comma list of m")
    p.add_argument("--tau-len", type=int, default=1024)
    p.add_argument("--tau-dim", type=int, default=64)
    p.add_argument("--tau-m", type=int, default=256)
    p.add_argument("--taus", type=_list(float), default=",".join(f"{t:g}" for t in TAUS))
    p.add_argument("--kernels", type=_list(str), default=",".join(KERNELS))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke configuration (L=256, 2 seeds, m in {16, 64})")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = min(args.seeds, 2)
        args.fig4_len, args.tau_len, args.fig4_m = 256, 256, [16, 64]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.setup_logging(common.TIMED_LOG_FORMAT)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    fig4_cfg = f"L={args.fig4_len}, d={args.fig4_dim}, {args.seeds} seeds, mean ± std"
    tau_cfg = f"L={args.tau_len}, d={args.tau_dim}, m={args.tau_m}, {args.seeds} seeds"
    with torch.no_grad():
        fig4 = fig4_study(args.fig4_len, args.fig4_dim, args.fig4_m, args.seeds, args.fig4_taus)
        tau = tau_study(args.tau_len, args.tau_dim, args.tau_m, args.taus, args.seeds,
                        args.kernels)
    common.write_dicts_csv(fig4, args.out / "fig4.csv")
    common.write_dicts_csv(tau, args.out / "tau.csv")
    table = markdown(fig4, tau, fig4_cfg, tau_cfg)
    (args.out / "accuracy.md").write_text("# FAVOR accuracy\n\n" + table + "\n")
    fig4_title = f"Fig. 4: L={args.fig4_len}, d={args.fig4_dim}"
    plot(fig4, tau, args.out / "accuracy.png", (fig4_title, tau_cfg))
    print(table)
    log.info("wrote %s/{fig4.csv,tau.csv,accuracy.md,accuracy.png}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
