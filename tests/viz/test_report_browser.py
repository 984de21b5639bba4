"""The HTML report in a real browser: Debian's Chromium driven by Playwright.

Opens the file from disk with the network blocked, checks there are no console errors and no
request leaves the file, switches layer and head, zooms by dragging, and reads the hover text
of a known cell against ``attention_maps`` (the API's numbers). The screenshot is kept under
``outputs/test-artifacts/`` (``PP_TEST_ARTIFACTS`` overrides) for CI to collect. Slow (Chromium
and Plotly's start take seconds on a loaded machine): ``make test-slow``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from protein_performer.contacts.attention import attention_maps
from protein_performer.data.tokenizer import Alphabet
from protein_performer.inference.api import ProteinLM
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from tests.paths import REPO

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(
    os.environ.get("PP_TEST_ARTIFACTS", REPO / "outputs")
) / "test-artifacts"  # fmt: skip
SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQ"
#: JavaScript: the page position of cell (row i, column j) of a heatmap div (0-based indices).
CELL_XY = """([id, i, j]) => {
  const d = document.getElementById(id), r = d.getBoundingClientRect();
  const xa = d._fullLayout.xaxis, ya = d._fullLayout.yaxis;
  return [r.left + xa._offset + xa.l2p(j), r.top + ya._offset + ya.l2p(i)]; }"""


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory: pytest.TempPathFactory):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as pw:
        user_data = tmp_path_factory.mktemp("chromium-profile")
        ctx = pw.chromium.launch_persistent_context(
            str(user_data), executable_path=CHROMIUM, args=ARGS, headless=True,
            viewport={"width": 1400, "height": 1000},
        )  # fmt: skip
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    torch.manual_seed(0)
    config = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, nb_features=8)
    net = PerformerLM(config).eval()
    return LoadedModel(net, config, Alphabet(), Path("tiny"), torch.device("cpu"), "export")


def hover_text(page, div: str, i: int, j: int) -> str:
    x, y = page.evaluate(CELL_XY, [div, i, j])
    page.mouse.move(x, y)
    page.wait_for_selector(f"#{div} .hoverlayer .hovertext", timeout=5000)
    return page.evaluate(  # SVG: one line per <tspan>
        "(sel) => [...document.querySelectorAll(sel)].map(t => t.textContent).join('\\n')",
        f"#{div} .hoverlayer .hovertext tspan",
    )


def test_report_in_chromium(browser_page, model: LoadedModel, tmp_path: Path) -> None:
    path = ProteinLM(model).report(SEQ, path=tmp_path / "report.html", name="demo")
    page = browser_page.new_page()
    errors: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def block(route) -> None:
        outside.append(route.request.url)
        route.abort()

    page.route(re.compile(r"^(?!file:).*"), block)
    start = time.perf_counter()
    page.goto(path.as_uri(), wait_until="load")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4")
    opened = time.perf_counter() - start
    assert opened < 30, f"the report took {opened:.1f} s to open"

    # Layer 2, head 1: the selectors show that trace, and its hover is the API's number.
    page.select_option("#layer", "2")
    page.select_option("#head", "1")
    visible = page.evaluate(
        "() => document.getElementById('fig-heads').data.map(t => t.visible === true)"
    )
    assert visible[:4] == [False, False, False, True]
    want = attention_maps(model.model, SEQ, layers=[2], heads=[1]).maps[2][0].numpy()
    i, j = 11, 39
    text = hover_text(page, "fig-heads", i, j)
    assert f"i {i + 1} {SEQ[i]}" in text and f"j {j + 1} {SEQ[j]}" in text, text
    value = float(re.search(r"attention ([-0-9.e]+)", text).group(1))
    assert value == pytest.approx(float(want[i, j]), rel=1e-5)

    # Zoom: drag a box over rows/columns 6..25; the axes narrow and residue letters appear.
    (x0, y0), (x1, y1) = (page.evaluate(CELL_XY, ["fig-heads", k, k]) for k in (5, 24))
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, (y0 + y1) / 2, steps=5)
    page.mouse.move(x1, y1, steps=5)
    page.mouse.up()
    page.wait_for_timeout(500)
    lo, hi = page.evaluate("() => document.getElementById('fig-heads')._fullLayout.xaxis.range")
    assert lo >= 3 and hi <= 27 and hi - lo < 25, (lo, hi)
    ticks = page.locator("#fig-heads .ytick text, #fig-heads .x2tick text").all_text_contents()
    assert f"10 {SEQ[9]}" in ticks, ticks  # every residue labelled at this zoom
    text = hover_text(page, "fig-heads", 14, 20)
    assert float(re.search(r"attention ([-0-9.e]+)", text).group(1)) == pytest.approx(
        float(want[14, 20]), rel=1e-5
    )

    assert not errors, errors
    assert not outside, outside
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report_chromium.png"), full_page=True)
    page.close()


def test_hostile_strings_run_nothing(browser_page, model: LoadedModel, tmp_path: Path) -> None:
    """A record id and a file name made to close the script block and add elements: the page
    holds only the report's own scripts and elements, no dialog opens, the metadata parses."""
    hostile = "</script><script>alert(1)</script><img src=x onerror=alert(2)>\u2028"
    lm = ProteinLM(model)
    plain = lm.report(SEQ, path=tmp_path / "plain.html", name="demo")
    path = lm.report(SEQ, path=tmp_path / "<b onclick=alert(3)>'.html", name=hostile)
    page = browser_page.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    census = "() => [...document.querySelectorAll('*')].map(e => e.tagName).sort().join(',')"
    seen = []
    for p in (plain, path):
        page.goto(p.as_uri(), wait_until="load")
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4")
        seen.append(page.evaluate(census))
    assert seen[0] == seen[1] and "IMG" not in seen[1]
    assert not dialogs, dialogs
    meta = page.evaluate("() => JSON.parse(document.getElementById('report-meta').textContent)")
    assert meta["name"] == hostile
    page.close()
