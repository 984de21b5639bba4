"""One self-contained interactive HTML report: attention, contacts, similarity (Plotly).

Arrays in (``ReportSpec``, built by ``inference.report_data``), one HTML file out: Plotly's
JavaScript is inlined once, every array is embedded as base64 typed data, nothing is fetched,
so the file opens from disk with no server and no internet. Plotly over Bokeh because its
heatmaps bring hover templates, zoom/pan, category axes whose residue labels thin out and
reappear with zoom (the sequence letters) and colour bars without any JavaScript of ours;
Bokeh's files are smaller per cell but need CustomJS for selectors and hover formatting
(measured: docs/RESULTS.md, issue 25). The only script of ours is the glue that
turns the two layer/head selectors into one ``Plotly.restyle`` of trace visibility: Plotly's
own dropdowns cannot combine two choices.

Axes are residue numbers, 1-based as in the PNGs; a binned view's cell covers ``size``
residues and says so in its title and in the resolution table.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protein_performer.io.atomic import atomic_file

AMINO_ACIDS = "ARNDCQEGHILKMFPSTWYV"
PLOT_CONFIG = {"scrollZoom": True, "displaylogo": False, "responsive": False}


@dataclass
class HeatView:
    """One map: rows ``rows`` x columns ``cols`` (residues, 0-based, end exclusive), each cell
    the mean over ``size`` x ``size`` residues (1: per residue)."""

    key: str
    z: np.ndarray  # (n_rows, n_cols) float32
    rows: tuple[int, int]
    cols: tuple[int, int]
    size: int
    quantity: str


@dataclass
class Track:
    """A per-residue value drawn under the maps' x axis."""

    name: str
    values: np.ndarray  # (L,)
    note: str


@dataclass
class SimilarityPanel:
    matrix: np.ndarray  # (20, 20) attention log-odds, AMINO_ACIDS order
    blosum: np.ndarray  # (20, 20)
    r: float


@dataclass
class ContactPanel:
    """Predicted vs true contacts of a structure (residue pairs 0-based)."""

    predicted: np.ndarray  # (n, n), cells of ``size`` residues (max over the bin)
    size: int
    true_pairs: np.ndarray  # (k, 2) i < j, |i - j| >= min_sep, both observed
    tp: np.ndarray  # (k, 2) top-L predictions that are contacts
    fp: np.ndarray  # (k, 2) top-L predictions that are not
    fn: np.ndarray  # (k, 2) contacts outside the top-L predictions
    how: str
    quantity: str
    scale: tuple[float, float] | None  # fixed colour range, None: stretched (stated)
    precision: dict[str, float]
    in_sample: bool
    target: str
    structure: bool = True  # False: predictions alone (no structure given to compare with)


@dataclass
class ReportSpec:
    name: str
    sequence: str
    model: str
    layers: list[int]
    heads: list[int]
    head_maps: dict[tuple[int, int], HeatView]
    mean: HeatView
    apc: HeatView
    windows: list[tuple[HeatView, HeatView]]
    track: Track
    similarity: SimilarityPanel
    contacts: ContactPanel | None
    rule: str
    notes: list[str] = field(default_factory=list)


def _go():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    return go, make_subplots


def axis_labels(sequence: str, start: int, stop: int, size: int) -> list[str]:
    """Unique category labels of the cells along an axis: "12 K" per residue (1-based), or
    "1-4 MKTA" / "1001-1064" for a bin."""
    out = []
    for a in range(start, stop, size):
        b = min(stop, a + size)
        if size == 1:
            out.append(f"{a + 1} {sequence[a]}")
        elif size <= 6:
            out.append(f"{a + 1}-{b} {sequence[a:b]}")
        else:
            out.append(f"{a + 1}-{b}")
    return out


def resolution(size: int) -> str:
    return "per residue (full resolution)" if size == 1 else f"{size} x {size} residues per cell"


def _hover(quantity: str, key: str) -> str:
    return f"i %{{y}}<br>j %{{x}}<br>{quantity} %{{z:.6g}}<extra>{html.escape(key)}</extra>"


def _scale(z: np.ndarray, diverging: bool) -> dict[str, float]:
    finite = z[np.isfinite(z)]
    if not finite.size:
        return {"zmin": 0.0, "zmax": 1.0}
    if diverging:
        lim = float(np.percentile(np.abs(finite), 99.5)) or 1.0
        return {"zmin": -lim, "zmax": lim, "zmid": 0.0}
    return {"zmin": 0.0, "zmax": float(np.percentile(finite, 99.5)) or 1.0}


def _binned_track(track: Track, start: int, stop: int, size: int) -> np.ndarray:
    v = np.asarray(track.values[start:stop], dtype=np.float64)
    edges = np.arange(0, len(v), size)
    return np.add.reduceat(v, edges) / np.diff(np.append(edges, len(v)))


def map_figure(
    views: list[HeatView],
    sequence: str,
    track: Track,
    title: str,
    *,
    colorscale: str = "Viridis",
    diverging: bool = False,
    height: int = 720,
    width: int = 720,
):
    """Heatmaps of ``views`` (same grid; the first visible) over a bar track of ``track``,
    sharing the x axis, so zooming the map zooms the track and its residue letters."""
    go, make_subplots = _go()
    v0 = views[0]
    ylab = axis_labels(sequence, *v0.rows, v0.size)
    xlab = axis_labels(sequence, *v0.cols, v0.size)
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.86, 0.14], vertical_spacing=0.03
    )
    for n, v in enumerate(views):
        fig.add_trace(
            go.Heatmap(
                z=np.asarray(v.z, dtype=np.float32),
                x=xlab,
                y=ylab,
                colorscale=colorscale,
                hovertemplate=_hover(v.quantity, v.key),
                colorbar={"title": {"text": v.quantity, "side": "right"}, "len": 0.8, "y": 0.57},
                visible=n == 0,
                name=v.key,
                **_scale(np.asarray(v.z), diverging),
            ),
            row=1,
            col=1,
        )
    t = _binned_track(track, *v0.cols, v0.size)
    fig.add_trace(
        go.Bar(
            x=xlab,
            y=t.astype(np.float32),
            marker={"color": "#555"},
            hovertemplate=f"%{{x}}<br>{track.name} %{{y:.3f}}<extra></extra>",
            showlegend=False,
        ),
        row=2,
        col=1,
    )
    fig.update_yaxes(autorange="reversed", title_text="residue i (query)", row=1, col=1)
    fig.update_yaxes(title_text=track.name, row=2, col=1)
    fig.update_xaxes(title_text="residue j (key)", row=2, col=1)
    fig.update_xaxes(type="category", tickangle=-90, tickfont={"size": 9})
    fig.update_yaxes(tickfont={"size": 9})
    fig.update_yaxes(type="category", row=1, col=1)
    fig.update_layout(
        title={"text": title, "font": {"size": 13}},
        height=height,
        width=width,
        margin={"l": 80, "r": 20, "t": 60, "b": 80},
        dragmode="zoom",
        plot_bgcolor="#eee",
    )
    return fig


def _pairs_labels(pairs: np.ndarray, labels: list[str], size: int, swap: bool = False):
    if not len(pairs):
        return [], []
    i, j = pairs[:, 0] // size, pairs[:, 1] // size
    if swap:
        i, j = j, i
    return [labels[k] for k in j], [labels[k] for k in i]  # x, y


def contact_figure(panel: ContactPanel, sequence: str, track: Track):
    """Predicted contacts (upper triangle, colour) vs true contacts (lower triangle, grey), the
    top-L predictions marked right (green) or wrong (red), and missed contacts (orange)."""
    go, _ = _go()
    L = len(sequence)
    z = np.array(panel.predicted, dtype=np.float32)
    n = z.shape[0]
    iu = np.triu(np.ones((n, n), dtype=bool), k=1)
    z[~iu] = np.nan
    if panel.scale is not None:
        zr = {"zmin": panel.scale[0], "zmax": panel.scale[1]}
        stated = f"colour: fixed {panel.scale[0]:g}-{panel.scale[1]:g} probability scale"
    else:
        zr = _scale(z, diverging=False)
        stated = (
            f"colour: stretched to 0-{zr['zmax']:.3g} (99.5th percentile; a score, "
            "not a probability)"
        )
    quantity = panel.quantity + (" (max over the bin)" if panel.size > 1 else "")
    view = HeatView("predicted", z, (0, L), (0, L), panel.size, quantity)
    fig = map_figure(
        [view], sequence, track, f"{panel.target}: {panel.how}<br><sub>{stated}</sub>",
        colorscale="Blues", height=780, width=780,
    )  # fmt: skip
    fig.data[0].update(**zr)
    labels = axis_labels(sequence, 0, L, panel.size)
    marks = (
        ("true contact (lower triangle)", panel.true_pairs, True, "square", "#444", 4),
        ("top-L predicted, correct", panel.tp, False, "circle", "#2ca02c", 6),
        ("top-L predicted, not a contact (false positive)", panel.fp, False, "x", "#d62728", 6),
        ("contact missed by the top-L (false negative)", panel.fn, False, "circle-open",
         "#ff7f0e", 6),
    )  # fmt: skip
    for name, pairs, swap, symbol, color, size in marks if panel.structure else ():
        x, y = _pairs_labels(np.asarray(pairs).reshape(-1, 2), labels, panel.size, swap)
        fig.add_trace(
            go.Scatter(
                x=x, y=y, mode="markers", name=f"{name}: {len(x)}",
                marker={"symbol": symbol, "color": color, "size": size},
                hovertemplate=f"i %{{y}}<br>j %{{x}}<extra>{html.escape(name)}</extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
    fig.update_layout(legend={"orientation": "h", "y": -0.18, "x": 0}, height=860)
    return fig


def similarity_figure(panel: SimilarityPanel):
    """The attention log-odds between amino-acid types beside BLOSUM62, letters on both axes."""
    go, make_subplots = _go()
    letters = list(AMINO_ACIDS)
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.16,
        subplot_titles=("from attention (log2 odds)", "BLOSUM62"),
    )  # fmt: skip
    for col, (mat, quantity, x) in enumerate(
        ((panel.matrix, "log2 odds", 0.42), (panel.blosum, "BLOSUM62 score", 1.0)), start=1
    ):
        fig.add_trace(
            go.Heatmap(
                z=np.asarray(mat, dtype=np.float32), x=letters, y=letters, colorscale="RdBu_r",
                hovertemplate=f"%{{y}} - %{{x}}<br>{quantity} %{{z:.3f}}<extra></extra>",
                colorbar={"title": {"text": quantity, "side": "right"}, "x": x, "len": 0.9},
                **_scale(np.asarray(mat, dtype=np.float32), diverging=True),
            ),
            row=1, col=col,
        )  # fmt: skip
    fig.update_xaxes(type="category", dtick=1, title_text="amino acid")
    fig.update_yaxes(type="category", dtick=1, autorange="reversed", title_text="amino acid")
    fig.update_layout(
        title=f"amino-acid similarity from attention vs BLOSUM62: Pearson r = {panel.r:.3f} "
        "over the 210 pairs (1: same pattern, 0: unrelated)",
        height=480, width=1000, margin={"l": 70, "r": 40, "t": 80, "b": 60},
    )  # fmt: skip
    return fig


_CSS = """
body{font-family:system-ui,sans-serif;margin:16px;color:#222;max-width:1600px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;padding:3px 8px}
.note{background:#fff3cd;border:1px solid #e0c060;padding:6px 10px;margin:8px 0}
.warn{background:#f8d7da;border:1px solid #d08080;padding:6px 10px;margin:8px 0;font-weight:600}
.row{display:flex;flex-wrap:wrap;gap:12px} .small{font-size:12px;color:#555}
"""

#: Glue only: two selectors pick one of the heatmap traces (Plotly's dropdowns are single).
_GLUE = """
(function(){var L=document.getElementById('layer'),H=document.getElementById('head'),
d=document.getElementById('fig-heads'),nh=H.options.length,n=%d;
function show(){var k=L.selectedIndex*nh+H.selectedIndex,v=[];
for(var t=0;t<n;t++)v.push(t===k);v.push(true);Plotly.restyle(d,{visible:v});}
L.onchange=show;H.onchange=show;})();
"""


def _div(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=PLOT_CONFIG)


def _precision_table(precision: dict[str, float]) -> str:
    from itertools import product

    ranges, tops = ("short", "medium", "long"), ("L", "L/2", "L/5")
    head = "".join(f"<th>P@{t}</th>" for t in tops)
    rows = []
    for r in ranges:
        cells = "".join(f"<td>{precision.get(f'P@{t}_{r}', float('nan')):.3f}</td>" for t in tops)
        rows.append(f"<tr><th>{r}</th>{cells}</tr>")
    assert all(f"P@{t}_{r}" in precision for r, t in product(ranges, tops)) or not precision
    return f"<table><tr><th>range</th>{head}</tr>{''.join(rows)}</table>"


def render_html(spec: ReportSpec) -> str:
    """The whole report as one HTML string (Plotly's JavaScript inlined)."""
    from plotly.offline import get_plotlyjs

    L = len(spec.sequence)
    esc = html.escape
    parts: list[str] = []
    hv = next(iter(spec.head_maps.values()))
    res_rows = [
        ("layer x head maps", resolution(hv.size)),
        ("mean over layers and heads", resolution(spec.mean.size)),
        ("APC-corrected symmetrised mean", resolution(spec.apc.size)),
    ]
    if spec.windows:
        res_rows.append((f"{len(spec.windows)} windows", "per residue (full resolution)"))
    if spec.contacts is not None:
        res_rows.append(("contacts", resolution(spec.contacts.size)))
    table = "".join(f"<tr><td>{esc(a)}</td><td>{esc(b)}</td></tr>" for a, b in res_rows)
    parts.append(
        f"<h1>{esc(spec.name)}: {L} residues</h1><p>{esc(spec.model)}</p>"
        f"<table id='resolution'><tr><th>view</th><th>resolution</th></tr>{table}</table>"
        f"<p class='small'>{esc(spec.rule)}. Residues are numbered from 1; hover a cell for "
        "(i, residue i, j, residue j, value); drag to zoom, scroll to zoom, double-click to "
        "reset; residue letters appear on the axes when zoomed in.</p>"
        + "".join(f"<p class='note'>{esc(n)}</p>" for n in spec.notes)
    )
    # Layer x head.
    views = [spec.head_maps[(la, h)] for la in spec.layers for h in spec.heads]
    lopts = "".join(f"<option value='{la}'>{la}</option>" for la in spec.layers)
    hopts = "".join(f"<option value='{h}'>{h}</option>" for h in spec.heads)
    fig = map_figure(
        views, spec.sequence, spec.track,
        f"implied attention of one layer x head ({resolution(hv.size)}; each map its own "
        "colour scale, 0 to its 99.5th percentile)",
    )  # fmt: skip
    parts.append(
        "<h2>Attention by layer and head</h2>"
        f"<label>layer <select id='layer'>{lopts}</select></label> "
        f"<label>head <select id='head'>{hopts}</select></label>"
        f"<p class='small'>{esc(spec.track.note)}</p>" + _div(fig, "fig-heads")
    )
    # Overview.
    mean = map_figure(
        [spec.mean],
        spec.sequence,
        spec.track,
        f"mean over layers and heads ({resolution(spec.mean.size)})",
    )
    apc = map_figure([spec.apc], spec.sequence, spec.track,
                     f"APC(symmetrised map), mean over heads ({resolution(spec.apc.size)})",
                     colorscale="RdBu_r", diverging=True)  # fmt: skip
    parts.append(
        "<h2>Mean attention and APC-corrected symmetrised map</h2><div class='row'>"
        + _div(mean, "fig-mean")
        + _div(apc, "fig-apc")
        + "</div>"
    )
    if spec.windows:
        parts.append(
            "<h2>Full-resolution windows</h2><p class='small'>The overview above is binned; "
            "these windows (the strongest off-diagonal APC bins, and the window asked for) "
            "are computed again per residue.</p>"
        )
        for n, (wm, wa) in enumerate(spec.windows):
            f1 = map_figure(
                [wm], spec.sequence, spec.track, f"mean attention, {wm.key}", height=560, width=620
            )
            f2 = map_figure(
                [wa],
                spec.sequence,
                spec.track,
                f"APC, {wa.key}",
                colorscale="RdBu_r",
                diverging=True,
                height=560,
                width=620,
            )
            parts.append("<div class='row'>" + _div(f1, f"fig-win{n}-mean")
                         + _div(f2, f"fig-win{n}-apc") + "</div>")  # fmt: skip
    parts.append("<h2>Contacts</h2>")
    c = spec.contacts
    if c is None:
        parts.append(
            "<p class='note' id='no-contacts'>No structure given and no contact regression: "
            "predicted vs true contacts are left out (pass a PDB/mmCIF file: "
            "<code>--structure</code> or <code>lm.report(seq, structure=...)</code>; fit a "
            "regression with <code>protein-performer contacts fit</code>).</p>"
        )
    elif not c.structure:
        parts.append(
            f"<p class='note' id='predicted-only'>{esc(c.how)}: predicted contacts only. No "
            "structure given, so nothing to compare them with (pass a PDB/mmCIF file: "
            "<code>--structure</code> or <code>lm.report(seq, structure=...)</code>).</p>"
            + _div(contact_figure(c, spec.sequence, spec.track), "fig-contacts")
        )
    else:
        if c.in_sample:
            parts.append(
                f"<p class='warn' id='in-sample'>In-sample: the contact regression was fitted "
                f"on this structure ({esc(c.target)}), so these precisions overstate what it "
                "does on a new protein.</p>"
            )
        prec = (
            _precision_table(c.precision)
            if c.precision
            else "<p class='small'>Precision needs the per-residue map (this one is binned).</p>"
        )
        parts.append(
            f"<p>{esc(c.how)}; precision of the top L, L/2, L/5 pairs by separation "
            "(short 6-11, medium 12-23, long >= 24), pairs with both residues observed:</p>"
            + prec
            + _div(contact_figure(c, spec.sequence, spec.track), "fig-contacts")
        )
    parts.append(
        "<h2>Amino-acid similarity vs BLOSUM62</h2><p class='small'>Attention between residue "
        "types summed over the chosen layers, heads and every query row, as log2 of observed "
        "over uniform attention.</p>" + _div(similarity_figure(spec.similarity), "fig-similarity")
    )
    glue = _GLUE % len(views)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{esc(spec.name)}: attention report</title><style>{_CSS}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        + "".join(parts) + f"<script>{glue}</script>"
        + f"<script type='application/json' id='report-meta'>{script_json(_meta(spec))}</script>"
        + "</body></html>"
    )  # fmt: skip


#: Characters that can end a script block, written as JSON escapes (``json.dumps`` already
#: escapes every non-ASCII character, U+2028/9 included).
_SCRIPT_UNSAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def script_json(obj: object) -> str:
    """JSON for a ``<script>`` block: a user's string holding ``</script>`` cannot close it
    (the escapes leave the parsed value unchanged)."""
    return json.dumps(obj).translate(_SCRIPT_UNSAFE)


def _meta(spec: ReportSpec) -> dict:
    """A few facts for tests and tools (no arrays)."""
    return {
        "name": spec.name,
        "length": len(spec.sequence),
        "layers": spec.layers,
        "heads": spec.heads,
        "head_bin": next(iter(spec.head_maps.values())).size,
        "overview_bin": spec.mean.size,
        "windows": [w[0].key for w in spec.windows],
        "contacts": spec.contacts is not None,
    }


def write_report(spec: ReportSpec, path: str | os.PathLike[str]) -> Path:
    """Write the report atomically (a crash leaves no half file that looks like a result)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = render_html(spec)
    with atomic_file(path, suffix=".html") as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path
