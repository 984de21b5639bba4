"""PNG pictures of attention and contacts (matplotlib, Agg backend: no display needed).

Every writer takes arrays and a path and returns the path; files are written to a temporary
sibling and renamed, so a crash never leaves a truncated PNG that looks like a result.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from protein_performer.io.atomic import atomic_file

#: The 20 standard amino acids in BLOSUM's customary order.
AMINO_ACIDS = "ARNDCQEGHILKMFPSTWYV"
#: Panels larger than this many pixels per side are block-averaged before drawing.
MAX_PANEL = 256


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Save as PNG atomically (:func:`protein_performer.io.atomic.atomic_file`); close it."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=dpi, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


#: Characters of one title line kept (a 100 kB record id made a 128,803-pixel figure).
MAX_TITLE_LINE = 300


def wrap_title(text: str, width: int) -> str:
    """``text`` with each line wrapped at ``width`` characters: a long record name or note
    makes the title taller, never wider than the figure (where it would be cut off). Lines
    are cut at :data:`MAX_TITLE_LINE` and ``$`` is escaped: matplotlib reads ``$...$`` as
    mathtext, and a record id like ``$\\foo{$`` was a traceback."""
    import textwrap

    lines = (ln if len(ln) <= MAX_TITLE_LINE else ln[: MAX_TITLE_LINE - 1] + "\u2026"
             for ln in text.splitlines())  # fmt: skip
    return "\n".join(textwrap.fill(line, width) for line in lines).replace("$", r"\$")


def downsample(x: np.ndarray, max_size: int = MAX_PANEL) -> np.ndarray:
    """Block-average the last two axes so neither exceeds ``max_size`` (keeps mass patterns
    visible where plain striding would drop isolated peaks' neighbours)."""
    h, w = x.shape[-2:]
    fh, fw = max(1, -(-h // max_size)), max(1, -(-w // max_size))
    if fh == 1 and fw == 1:
        return x
    ph, pw = (-h) % fh, (-w) % fw
    pad = [(0, 0)] * (x.ndim - 2) + [(0, ph), (0, pw)]
    xp = np.pad(x, pad, constant_values=np.nan)
    shape = xp.shape[:-2] + (xp.shape[-2] // fh, fh, xp.shape[-1] // fw, fw)
    return np.nanmean(xp.reshape(shape), axis=(-3, -1))


def _residue_ticks(ax, fontsize: int = 6) -> None:
    """A few integer ticks (residue numbers) per axis, small enough for a grid of panels."""
    from matplotlib.ticker import MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=3, integer=True))
    ax.tick_params(labelsize=fontsize, length=2)


def attention_grid(
    maps: np.ndarray,
    layers: Sequence[int],
    heads: Sequence[int],
    path: str | os.PathLike[str],
    *,
    row_start: int = 0,
    col_start: int = 0,
    title: str = "",
    dpi: int = 120,
) -> Path:
    """Layers (rows) x heads (columns) grid of maps (n_layers, n_heads, H, W). Axes are residue
    numbers (1-based, offset by the window start): query position down, key position across.
    Each panel has its own colour scale and colorbar: heads differ by orders of magnitude and a
    shared scale would blank most."""
    plt = _pyplot()
    maps = np.asarray(maps, dtype=np.float32)
    nl, nh, h, w = maps.shape
    small = downsample(maps)
    size = 2.2
    fig, axes = plt.subplots(
        nl, nh, figsize=(max(3.0, size * nh), max(3.0, size * nl)), squeeze=False
    )
    # Pixel centres at residue numbers row_start + 1 .. row_start + h (1-based).
    extent = (col_start + 0.5, col_start + w + 0.5, row_start + h + 0.5, row_start + 0.5)
    for a, layer in enumerate(layers):
        for b, head in enumerate(heads):
            ax = axes[a, b]
            panel = small[a, b]
            vmax = float(np.nanpercentile(panel, 99.5)) if np.isfinite(panel).any() else 1.0
            im = ax.imshow(panel, cmap="viridis", vmin=0.0, vmax=vmax or 1.0, extent=extent)
            ax.set_title(f"layer {layer}, head {head}", fontsize=7)
            _residue_ticks(ax)
            if a == nl - 1:
                ax.set_xlabel("key position (residue)", fontsize=7)
            if b == 0:
                ax.set_ylabel("query position (residue)", fontsize=7)
            bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
            bar.ax.tick_params(labelsize=5, length=2)
            if b == nh - 1:
                bar.set_label("attention weight", fontsize=6)
    fig.suptitle(
        wrap_title(
            (title or f"attention, residues {row_start + 1}-{row_start + h}")
            + "\ncolour: attention weight of query on key (each panel its own scale)",
            int(fig.get_figwidth() * 12),  # about 12 characters per inch at 9 pt
        ),
        fontsize=9,
    )
    fig.tight_layout()
    return save_figure(fig, path, dpi)


def contact_comparison(
    pred: np.ndarray,
    contacts: np.ndarray,
    valid: np.ndarray,
    path: str | os.PathLike[str],
    *,
    min_sep: int = 6,
    title: str = "",
    quantity: str = "predicted contact probability",
    dpi: int = 120,
) -> Path:
    """Predicted contact scores (upper triangle, colorbar) against the true contacts (lower
    triangle), for pairs with |i - j| >= ``min_sep``; pairs the structure does not resolve are
    grey; the top-L predictions are circled, green when correct and red when not."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = _pyplot()
    L = pred.shape[0]
    i, j = np.indices((L, L))
    upper, lower = j - i >= min_sep, i - j >= min_sep
    # Probabilities on a fixed 0..1 scale (a weak model must look weak); an unsupervised score
    # has no fixed range and is drawn min..99.5th percentile, said on the colorbar.
    shown = pred[upper & valid]
    probability = "probability" in quantity
    if probability:
        lo, hi, stretch = 0.0, 1.0, "fixed 0-1 scale"
    else:
        lo = float(shown.min()) if shown.size else 0.0
        hi = float(np.percentile(shown, 99.5)) if shown.size else 1.0
        stretch = f"stretched to {lo:.3g}..{hi:.3g} (min..99.5th percentile)"
    predicted = np.where(upper & valid, pred, np.nan)
    truth = np.where(lower & valid, contacts.astype(float), np.nan)
    unknown = np.where(~valid & (upper | lower), 1.0, np.nan)
    fig, ax = plt.subplots(figsize=(7, 6))
    extent = (0.5, L + 0.5, L + 0.5, 0.5)  # residue numbers, 1-based
    im = ax.imshow(
        predicted, cmap="Blues", vmin=lo, vmax=hi if hi > lo else lo + 1e-9,
        interpolation="nearest", extent=extent,
    )  # fmt: skip
    ax.imshow(truth, cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest", extent=extent)
    ax.imshow(unknown, cmap="Greys", vmin=0.0, vmax=4.0, interpolation="nearest", extent=extent)
    bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    bar.set_label(f"{quantity} (upper triangle)\n{stretch}", fontsize=8)
    ui, uj = np.nonzero(upper & valid)
    top = np.argsort(-pred[ui, uj], kind="stable")[:L]
    hit = contacts[ui[top], uj[top]]
    ax.scatter(uj[top][hit] + 1, ui[top][hit] + 1, s=8, facecolors="none", edgecolors="tab:green",
               lw=0.7)  # fmt: skip
    ax.scatter(uj[top][~hit] + 1, ui[top][~hit] + 1, s=8, facecolors="none", edgecolors="tab:red",
               lw=0.7)  # fmt: skip
    ax.plot([1, L], [1, L], color="k", lw=0.5)
    ax.set_xlabel("residue j")
    ax.set_ylabel("residue i")
    legend = [
        Patch(facecolor="black", label="true contact (lower triangle, C-beta < 8 A)"),
        Patch(facecolor="#dddddd", label="not resolved in the structure"),
        Line2D([], [], ls="", marker="o", mfc="none", mec="tab:green",
               label="predicted top-L, correct"),
        Line2D([], [], ls="", marker="o", mfc="none", mec="tab:red",
               label="predicted top-L, incorrect"),
    ]  # fmt: skip
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=7)
    precision = float(hit.mean()) if len(hit) else float("nan")
    ax.set_title(
        wrap_title(
            (title + "\n" if title else "")
            + f"pairs with |i - j| >= {min_sep}: predicted (upper) vs true (lower); "
            + f"top-L precision P@L = {precision:.2f}",
            int(fig.get_figwidth() * 10),
        ),
        fontsize=8,
    )
    return save_figure(fig, path, dpi)


def blosum62() -> np.ndarray:
    """BLOSUM62 restricted to ``AMINO_ACIDS`` as a (20, 20) array (Biopython's copy)."""
    from Bio.Align import substitution_matrices

    m = substitution_matrices.load("BLOSUM62")
    return np.array([[m[a][b] for b in AMINO_ACIDS] for a in AMINO_ACIDS], dtype=np.float64)


def matrix_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation over the upper triangle (diagonal included) where both are finite:
    both matrices are symmetric, so the lower triangle would only double-count."""
    iu = np.triu_indices(a.shape[0])
    x, y = a[iu], b[iu]
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(x[ok], y[ok])[0, 1])


def similarity_vs_blosum(
    similarity: np.ndarray,
    path: str | os.PathLike[str],
    *,
    title: str = "",
    dpi: int = 120,
) -> tuple[Path, float]:
    """The attention-derived 20 x 20 similarity beside BLOSUM62, their correlation in the
    title (as the Performer paper's Fig. 13). Returns (path, correlation)."""
    plt = _pyplot()
    ref = blosum62()
    r = matrix_correlation(similarity, ref)
    # Constrained layout keeps the left colorbar's label clear of the right panel's y label.
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), layout="constrained")
    panels = (
        (axes[0], similarity, "from attention", "attention log-odds"),
        (axes[1], ref, "BLOSUM62", "BLOSUM62 substitution score"),
    )
    for ax, mat, name, quantity in panels:
        lim = float(np.nanmax(np.abs(mat))) if np.isfinite(mat).any() else 1.0
        im = ax.imshow(mat, cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_xticks(range(20), list(AMINO_ACIDS), fontsize=7)
        ax.set_yticks(range(20), list(AMINO_ACIDS), fontsize=7)
        ax.tick_params(labelleft=True, labelbottom=True)  # letters on both axes of both panels
        ax.set_xlabel("amino acid")
        ax.set_ylabel("amino acid")
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046).set_label(quantity, fontsize=8)
    fig.suptitle(
        wrap_title(
            (title + ": " if title else "")
            + f"amino-acid similarity, Pearson r = {r:.3f} with BLOSUM62 over the 210 pairs "
            "(1: same pattern, 0: unrelated)",
            int(fig.get_figwidth() * 11),
        ),
        fontsize=10,
    )
    return save_figure(fig, path, dpi), r
