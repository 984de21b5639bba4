"""The arrays of the interactive HTML report, in bounded memory and a bounded file size.

The report (``viz.report``) shows every chosen layer x head, their mean and the APC-corrected
symmetrised mean, at a resolution that a byte budget sets (:func:`plan_resolution`): up to the
budget every view is per residue; above it a view is block-averaged into bins of ``bin``
residues (the overview), and a bounded set of ``window`` x ``window`` windows is computed again
at full resolution. The file size is therefore bounded by the budget whatever the length
(titin's 34k residues included), and each view carries its resolution for the report to state.

Everything is computed in tiles from the implied attention (``MultiHeadSelfAttention
.attention_map``, O(rows x L) per head): one forward pass whose hooks sweep each chosen layer's
heads over blocks of query rows, adding each block into the binned sums, never an L x L array:

* pass 1: binned sums of each head's map (head resolution) and of their mean (overview
  resolution), each head's exact row and column sums (what APC needs), and the amino-acid
  similarity sums (``viz.similarity``);
* pass 2 (only when the overview is binned): the rows of the chosen windows, exact.

APC of a symmetrised map S_f = A_f + A_f^T is S_f - r_f r_f^T / s_f with r_f = S_f 1. Block
averages commute with both terms (the mean of r_i r_j over a block is mean(r_I) mean(r_J)), so
the binned APC map is exact, not an approximation of the per-residue one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from protein_performer.errors import UserError
from protein_performer.viz.report import (
    ContactPanel,
    HeatView,
    ReportSpec,
    SimilarityPanel,
    Track,
)

if TYPE_CHECKING:
    from protein_performer.contacts.structures import ContactTarget
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.contact_head import ContactRegression

log = logging.getLogger(__name__)

#: Bytes of HTML per embedded float32 cell (base64 + JSON escapes), measured on Plotly 6-7.
BYTES_PER_CELL = 6.7
#: Default budget of embedded map data; Plotly's own JavaScript adds about 4.7 MB.
DEFAULT_BUDGET_MB = 20.0
#: Shares of the budget: overview maps (mean, APC, contacts), per-head maps, windows.
SHARES = {"overview": 0.35, "heads": 0.40, "windows": 0.25}
DEFAULT_WINDOW = 256
MAX_WINDOWS = 8
#: Elements of one head's (rows, L) tile: sets the rows per tile (16 MB of float32).
TILE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class ResolutionPlan:
    """Residues per cell of each view, from the budget (the rule the report states)."""

    length: int
    overview_bin: int
    head_bin: int
    window: int
    n_windows: int
    budget_mb: float

    @property
    def overview_cells(self) -> int:
        return math.ceil(self.length / self.overview_bin)

    @property
    def head_cells(self) -> int:
        return math.ceil(self.length / self.head_bin)

    def rule(self) -> str:
        return (
            f"file-size rule: at most {self.budget_mb:g} MB of map data (+ about 4.7 MB of "
            f"Plotly) whatever the length: overview maps {SHARES['overview']:.0%}, per-head "
            f"maps {SHARES['heads']:.0%}, full-resolution windows {SHARES['windows']:.0%}, at "
            f"{BYTES_PER_CELL} bytes per cell; a view finer than its share allows is "
            "block-averaged (mean over the bin)"
        )


def _bin_for(length: int, cells: float) -> int:
    """The smallest bin (residues per cell) with at most ``cells`` cells in an L x L map."""
    side = max(1, math.isqrt(max(1, int(cells))))
    return max(1, math.ceil(length / side))


def plan_resolution(
    length: int,
    n_head_maps: int,
    budget_mb: float = DEFAULT_BUDGET_MB,
    window: int = DEFAULT_WINDOW,
) -> ResolutionPlan:
    """Bins for the overview (3 maps) and per-head maps, and how many full-resolution windows
    fit, so the embedded data stays under ``budget_mb``."""
    if budget_mb <= 0 or window < 8:
        raise UserError(f"budget must be > 0 MB and window >= 8, got {budget_mb}, {window}")
    cells = budget_mb * 1e6 / BYTES_PER_CELL
    overview_bin = _bin_for(length, cells * SHARES["overview"] / 3)
    head_bin = _bin_for(length, cells * SHARES["heads"] / max(1, n_head_maps))
    window = min(window, length)
    n_windows = 0
    if overview_bin > 1:  # a mean and an APC map per window; smaller windows under tight budgets
        window = max(8, min(window, math.isqrt(int(cells * SHARES["windows"] / 2))))
        n_windows = min(MAX_WINDOWS, int(cells * SHARES["windows"] / (2 * window * window)))
    return ResolutionPlan(length, overview_bin, head_bin, window, n_windows, budget_mb)


@dataclass
class _Binner:
    """Sums of an L x L map over square bins of ``size`` residues, fed by row tiles."""

    length: int
    size: int
    sums: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = math.ceil(self.length / self.size)
        self.edges = np.arange(0, self.length, self.size)  # (n,) first residue of each bin
        self.sums = np.zeros((n, n), dtype=np.float64)
        counts = np.diff(np.append(self.edges, self.length)).astype(np.float64)
        self.counts = np.outer(counts, counts)

    def add(self, a: int, rows: np.ndarray) -> None:
        """Rows a .. a + W - 1 of the map, all L columns."""
        cols = np.add.reduceat(rows, self.edges, axis=1)  # (W, n)
        np.add.at(self.sums, (a + np.arange(rows.shape[0])) // self.size, cols)

    def mean(self) -> np.ndarray:
        return (self.sums / self.counts).astype(np.float32)

    def bin_means(self, v: np.ndarray) -> np.ndarray:
        """Per-bin mean of a per-residue vector."""
        n = np.diff(np.append(self.edges, self.length))
        return np.add.reduceat(v, self.edges) / n


def _tiles(length: int, rows: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + rows)) for a in range(0, length, rows)]


def _head_rows(module, q, k, padding_mask, h: int, a: int, b: int) -> np.ndarray:
    """Residue rows [a, b) of head ``h``'s implied attention over the L residues (float64)."""
    w = module.attention_map(q, k, padding_mask, heads=[h], query_slice=slice(a + 1, b + 1))
    L = q.shape[2] - 2
    return w[0, 0, :, 1 : L + 1].to("cpu", torch.float64).numpy()  # (W, L)


def choose_windows(
    apc_overview: np.ndarray, plan: ResolutionPlan, first: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """(row start, column start) of up to ``plan.n_windows`` windows: the one asked for first,
    then centred on the strongest off-diagonal APC bins, none centred inside another."""
    L, w, size = plan.length, plan.window, plan.overview_bin
    out: list[tuple[int, int]] = []

    def clamp(c: int) -> int:
        return int(min(max(0, c - w // 2), L - w))

    if first is not None:
        out.append((clamp(int(first[0]) + w // 2), clamp(int(first[0]) + w // 2)))
    n = apc_overview.shape[0]
    iu, ju = np.triu_indices(n, k=1)
    order = np.argsort(-np.nan_to_num(apc_overview[iu, ju], nan=-np.inf), kind="stable")
    for t in order:
        if len(out) >= plan.n_windows:
            break
        ci, cj = int(iu[t]) * size + size // 2, int(ju[t]) * size + size // 2
        if any(r <= ci < r + w and c <= cj < c + w for r, c in out):
            continue
        out.append((clamp(ci), clamp(cj)))
    return out[: max(plan.n_windows, 1 if first is not None else 0)]


def residue_entropy(loaded: LoadedModel, sequence: str) -> np.ndarray:
    """Per-residue entropy (bits) of the model's distribution over the 20 standard amino acids
    at each position, from ONE unmasked forward (pseudo-log-likelihood would need L forwards):
    low = the model is sure what belongs there. Causal models: the prediction of residue r
    from the residues before it."""
    from protein_performer.contacts.attention import encode_sequence

    tokens = encode_sequence(loaded.model, sequence, loaded.alphabet)
    with torch.inference_mode():
        logits = loaded.model(tokens).logits[0].float()  # (T, V)
    L = tokens.shape[1] - 2
    rows = logits[0:L] if loaded.config.objective == "clm" else logits[1 : L + 1]  # (L, V)
    aa = rows[:, list(loaded.alphabet.standard_idx)].log_softmax(-1)  # (L, 20)
    return (-(aa.exp() * aa).sum(-1) / math.log(2)).cpu().numpy()


def build_report(
    loaded: LoadedModel,
    sequence: str,
    *,
    name: str = "sequence",
    target: ContactTarget | None = None,
    regression: str | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    budget_mb: float = DEFAULT_BUDGET_MB,
    window: int = DEFAULT_WINDOW,
    first_window: Sequence[int] | None = None,
    progress: bool = True,
) -> ReportSpec:
    """Everything ``viz.report.write_report`` draws for one sequence (see the module doc);
    ``progress``: a bar over the layers' row tiles (a long protein takes tens of seconds)."""
    from protein_performer.contacts.attention import (
        encode_sequence,
        resolve_selection,
        run_with_qk,
    )
    from protein_performer.io.progress import progress as progress_bar
    from protein_performer.viz.similarity import SimilarityAccumulator

    model = loaded.model
    chosen_layers, chosen_heads = resolve_selection(model, layers, heads)
    tokens = encode_sequence(model, sequence, loaded.alphabet)
    L = tokens.shape[1] - 2
    F = len(chosen_layers) * len(chosen_heads)
    plan = plan_resolution(L, F, budget_mb, window)
    tiles = _tiles(L, max(16, TILE_ELEMENTS // (L + 2)))
    per_head = {(la, h): _Binner(L, plan.head_bin) for la in chosen_layers for h in chosen_heads}
    overview = _Binner(L, plan.overview_bin)
    r = np.zeros((F, L))  # row sums of S_f = row + column sums of A_f
    sim = SimilarityAccumulator(sequence, 0)
    order = [(la, h) for la in chosen_layers for h in chosen_heads]

    def pass1(layer: int, module, q, k, padding_mask) -> None:
        for a, b in tiles:
            layer_sum = np.zeros((b - a, L))
            for h in chosen_heads:
                rows = _head_rows(module, q, k, padding_mask, h, a, b)  # (W, L)
                f = order.index((layer, h))
                per_head[(layer, h)].add(a, rows)
                r[f, a:b] += rows.sum(1)
                r[f] += rows.sum(0)
                layer_sum += rows
            overview.add(a, layer_sum / F)
            sim.row_start = a
            sim.add(layer_sum[None])
            bar.update(1)

    log.info("report: %d residues, %d maps, tiles of %d rows", L, F, tiles[0][1])
    bar = progress_bar(len(chosen_layers) * len(tiles), "tile", "report", progress)
    with bar, torch.inference_mode():
        run_with_qk(model, tokens, chosen_layers, pass1)
    s = r.sum(1)  # (F,)
    g = np.where(s != 0, 1.0 / np.where(s != 0, s, 1.0), 0.0) / F  # (F,)
    mean_o = overview.mean()
    rb = np.stack([overview.bin_means(rf) for rf in r])  # (F, n)
    apc_o = (mean_o + mean_o.T - (rb.T * g) @ rb).astype(np.float32)

    windows: list[tuple[HeatView, HeatView]] = []
    if plan.n_windows:
        corners = choose_windows(apc_o, plan, first_window)
        log.info("report: the exact maps of %d window(s) of %d residues", len(corners),
                 plan.window)  # fmt: skip
        windows = _window_views(loaded, tokens, corners, plan.window, order, r, g)

    def view(key: str, z: np.ndarray, size: int, quantity: str) -> HeatView:
        return HeatView(key, z, (0, L), (0, L), size, quantity)

    head_views = {
        (la, h): view(f"layer {la}, head {h}", b.mean(), plan.head_bin, "attention")
        for (la, h), b in per_head.items()
    }
    if target is not None:
        apc_view = view("APC", apc_o, plan.overview_bin, "APC score")
        contacts = contact_panel(loaded, target, regression, apc_view)
    else:  # no structure: the regression's predictions alone, when there is a regression
        contacts = predicted_panel(loaded, sequence, name, regression, plan.overview_bin)
    sim_matrix = sim.matrix()
    from protein_performer.viz.plots import blosum62, matrix_correlation

    return ReportSpec(
        name=name,
        sequence=sequence,
        model=f"{loaded.source.name} ({loaded.config.depth} layers x {loaded.config.heads} "
        f"heads, {loaded.config.attention} attention, {loaded.config.objective})",
        layers=chosen_layers,
        heads=chosen_heads,
        head_maps=head_views,
        mean=view("mean over layers and heads", mean_o, plan.overview_bin, "mean attention"),
        apc=view("APC(symmetrised), mean over layers and heads", apc_o, plan.overview_bin,
                 "APC score"),
        windows=windows,
        track=Track("entropy (bits)", residue_entropy(loaded, sequence),
                    "per-residue entropy of the model's prediction over the 20 amino acids, "
                    "one unmasked forward pass (low: the model is sure)"),
        similarity=SimilarityPanel(sim_matrix, blosum62(),
                                   matrix_correlation(sim_matrix, blosum62())),
        contacts=contacts,
        rule=plan.rule(),
    )  # fmt: skip


def _window_views(
    loaded: LoadedModel,
    tokens: torch.Tensor,
    corners: list[tuple[int, int]],
    w: int,
    order: list[tuple[int, int]],
    r: np.ndarray,
    g: np.ndarray,
) -> list[tuple[HeatView, HeatView]]:
    """Pass 2: the exact mean map and APC map of each window (rows I, columns J), from the rows
    of I (columns J) and of J (columns I), so the symmetrised map needs no other rows."""
    from protein_performer.contacts.attention import run_with_qk

    F = len(order)
    blocks = {c: (np.zeros((w, w)), np.zeros((w, w))) for c in corners}  # A[I, J], A[J, I]

    def pass2(layer: int, module, q, k, padding_mask) -> None:
        for h in sorted({h for la, h in order if la == layer}):
            for (ri, cj), (aij, aji) in blocks.items():
                rows = _head_rows(module, q, k, padding_mask, h, ri, ri + w)
                aij += rows[:, cj : cj + w] / F
                if ri != cj:
                    rows = _head_rows(module, q, k, padding_mask, h, cj, cj + w)
                aji += rows[:, ri : ri + w] / F

    with torch.inference_mode():
        run_with_qk(loaded.model, tokens, sorted({la for la, _ in order}), pass2)
    out = []
    for (ri, cj), (aij, aji) in blocks.items():
        I, J = slice(ri, ri + w), slice(cj, cj + w)
        apc = aij + aji.T - (r[:, I].T * g) @ r[:, J]
        span = (ri, ri + w), (cj, cj + w)
        key = f"rows {ri + 1}-{ri + w} x columns {cj + 1}-{cj + w}"
        out.append(
            (
                HeatView(key, aij.astype(np.float32), *span, 1, "mean attention"),
                HeatView(key, apc.astype(np.float32), *span, 1, "APC score"),
            )
        )
    return out


def _block_max(z: np.ndarray, size: int) -> np.ndarray:
    """Max over square bins of ``size`` (a contact is a sparse event: a mean would hide it)."""
    if size == 1:
        return z
    n = z.shape[0]
    pad = (-n) % size
    zp = np.pad(z, ((0, pad), (0, pad)), constant_values=np.nan)
    m = n + pad
    return np.nanmax(zp.reshape(m // size, size, m // size, size), axis=(1, 3))


def _regression_map(
    loaded: LoadedModel, sequence: str, reg: ContactRegression
) -> np.ndarray:
    """The regression's (L, L) contact probabilities of ``sequence`` (dense at any length)."""
    from protein_performer.contacts.predict import predict_contacts

    reg.check_model(loaded)
    L = len(sequence)
    pred = predict_contacts(loaded, sequence, reg, dense_max_length=L, checked=True)
    return pred.dense.astype(np.float32)


def predicted_panel(
    loaded: LoadedModel, sequence: str, name: str, regression: str | None, size: int
) -> ContactPanel | None:
    """Without a structure, the regression's predicted contacts alone (no truth to mark, no
    precision), binned like the overview maps; None when the model has no regression (its
    APC map is in the report already)."""
    from protein_performer.contacts.predict import find_regression

    reg = find_regression(loaded, regression or None, required=False)
    if reg is None:
        return None
    full = _regression_map(loaded, sequence, reg)
    empty = np.zeros((0, 2), dtype=np.int64)
    return ContactPanel(
        predicted=_block_max(full, size), size=size, true_pairs=empty, tp=empty, fp=empty,
        fn=empty, how="logistic regression on the attention maps",
        quantity="contact probability", scale=(0.0, 1.0), precision={}, in_sample=False,
        target=name, structure=False,
    )  # fmt: skip


def contact_panel(
    loaded: LoadedModel,
    target: ContactTarget,
    regression: str | None,
    apc: HeatView,
    min_sep: int = 6,
) -> ContactPanel:
    """Predicted vs true contacts of ``target`` and precision at L, L/2, L/5 by range: the
    regression's probabilities (fixed 0-1 scale), else the unsupervised APC map (stretched).
    The top-L pairs (j - i >= ``min_sep``, both residues observed) are split into right and
    wrong, and the contacts they miss are listed: the two kinds of error."""
    from protein_performer.contacts.fit import precision_at
    from protein_performer.contacts.predict import find_regression

    L = target.length
    reg = find_regression(loaded, regression or None, required=False)
    in_sample = False
    if reg is not None:
        full: np.ndarray | None = _regression_map(loaded, target.sequence, reg)
        fit_on = [str(x) for x in reg.meta.get("fit_on", [])]
        in_sample = target.id in fit_on
        how = "logistic regression on the attention maps"
        quantity, scale = "contact probability", (0.0, 1.0)
        size = apc.size
    else:
        full = apc.z if apc.size == 1 else None
        how = "unsupervised: mean APC attention (no contact regression)"
        quantity, scale = "APC score", None
        size = apc.size
    valid, true = target.valid(), target.contacts()
    i, j = np.triu_indices(L, k=min_sep)
    ok = valid[i, j]
    i, j = i[ok], j[ok]
    is_true = true[i, j]
    true_pairs = np.stack([i[is_true], j[is_true]], 1)
    empty = np.zeros((0, 2), dtype=np.int64)
    tp = fp = fn = empty
    metrics: dict[str, float] = {}
    if full is not None:
        metrics = precision_at(full, true, valid)
        top = np.argsort(-full[i, j], kind="stable")[:L]
        hit = is_true[top]
        tp = np.stack([i[top][hit], j[top][hit]], 1)
        fp = np.stack([i[top][~hit], j[top][~hit]], 1)
        missed = is_true.copy()
        missed[top] = False
        fn = np.stack([i[missed], j[missed]], 1)
    z = _block_max(full, size) if full is not None else apc.z
    return ContactPanel(
        predicted=z.astype(np.float32),
        size=size,
        true_pairs=true_pairs,
        tp=tp,
        fp=fp,
        fn=fn,
        how=how,
        quantity=quantity,
        scale=scale,
        precision=metrics,
        in_sample=in_sample,
        target=target.id,
    )
