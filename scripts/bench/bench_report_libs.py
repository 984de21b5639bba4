"""Plotly vs Bokeh for the HTML report: file size and build time of one standalone heatmap.

One random ``N x N`` float32 map (default 4,000, the size of a 4k-residue protein's map at full
resolution) with hover, written as ONE self-contained HTML file (the library's JavaScript
inlined, the array embedded as base64 typed data), each library in a fresh subprocess so the
peak memory (``ru_maxrss``) is its own. This is the measurement behind the report's choice of
Plotly (see ``protein_performer/viz/report.py``).

    python scripts/bench/bench_report_libs.py            # N = 4000
    python scripts/bench/bench_report_libs.py --quick    # N = 500

A library that is not installed (bokeh is no dependency of the project) is skipped in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="map side (default 4000)")
    p.add_argument("--quick", action="store_true", help="N = 500 (a smoke run)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one library
    return p.parse_args(argv)


def _plotly(z, path: Path) -> None:
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(z=z, colorscale="Viridis", hovertemplate="%{y} %{x}: %{z}"))
    fig.write_html(path, include_plotlyjs=True, full_html=True)


def _bokeh(z, path: Path) -> None:
    from bokeh.embed import file_html
    from bokeh.models import HoverTool
    from bokeh.plotting import figure
    from bokeh.resources import INLINE

    n = z.shape[0]
    fig = figure(x_range=(0, n), y_range=(n, 0), tools="pan,wheel_zoom,box_zoom,reset")
    fig.image(image=[z], x=0, y=n, dw=n, dh=n, palette="Viridis256")
    fig.add_tools(HoverTool(tooltips=[("i", "$y{0}"), ("j", "$x{0}"), ("value", "@image")]))
    path.write_text(file_html(fig, INLINE, "bench"), encoding="utf-8")


def run_case(lib: str, n: int) -> dict[str, float]:
    import numpy as np

    z = np.random.default_rng(0).random((n, n), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{lib}.html"
        t0 = time.perf_counter()
        (_plotly if lib == "plotly" else _bokeh)(z, path)
        seconds = time.perf_counter() - t0
        size = path.stat().st_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"n": n, "seconds": round(seconds, 2), "mb": round(size / 1e6, 1), "peak_rss_mb": rss}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = 500 if args.quick else args.n
    if args.case:
        print("RESULT " + json.dumps({"lib": args.case, **run_case(args.case, n)}))
        return 0
    print(f"{'library':8} {'N':>6} {'build s':>8} {'file MB':>8} {'peak RSS MB':>12}")
    for lib in ("plotly", "bokeh"):
        if importlib.util.find_spec(lib) is None:  # bokeh is no dependency of the project
            print(f"{lib:8} not installed in this environment (pip install {lib}): skipped")
            continue
        out = subprocess.run(
            [sys.executable, __file__, "--case", lib, "--n", str(n)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        r = json.loads(line[7:])
        print(f"{lib:8} {n:>6} {r['seconds']:>8} {r['mb']:>8} {r['peak_rss_mb']:>12.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
