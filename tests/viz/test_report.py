"""The interactive HTML report: its numbers (exact and binned), its content, and the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.cli.main import main
from protein_performer.contacts.attention import attention_maps
from protein_performer.data.tokenizer import Alphabet
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.attention_views import unsupervised_contacts
from protein_performer.inference.report_data import build_report, plan_resolution
from protein_performer.interop.export import export_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.viz.report import axis_labels, render_html
from tests.paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR / "data" / "structures"
SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQ"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    torch.manual_seed(0)
    config = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, nb_features=8)
    model = PerformerLM(config).eval()
    return LoadedModel(model, config, Alphabet(), Path("tiny"), torch.device("cpu"), "export")


def full_maps(loaded: LoadedModel, seq: str) -> np.ndarray:
    return attention_maps(loaded.model, seq).stacked().numpy().astype(np.float64)  # (2, 2, L, L)


def test_full_resolution_numbers_are_the_apis(loaded) -> None:
    spec = build_report(loaded, SEQ, name="s")
    maps = full_maps(loaded, SEQ)
    assert spec.mean.size == 1 and not spec.windows
    for (layer, head), view in spec.head_maps.items():
        np.testing.assert_allclose(view.z, maps[layer - 1, head], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(spec.mean.z, maps.mean((0, 1)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(spec.apc.z, unsupervised_contacts(maps), rtol=1e-4, atol=1e-6)
    assert spec.track.values.shape == (len(SEQ),)
    assert np.all((spec.track.values >= 0) & (spec.track.values <= np.log2(20) + 1e-4))


def test_binned_views_and_windows_are_exact(loaded) -> None:
    """Under a tiny budget the overview is a block mean, APC of it is exact, and windows are
    the per-residue maps."""
    seq = (SEQ * 3)[:200]
    spec = build_report(loaded, seq, budget_mb=0.4, window=32, first_window=(10, 60))
    maps = full_maps(loaded, seq)
    k = spec.mean.size
    assert k > 1 and spec.windows
    n = -(-200 // k)
    pad = n * k - 200

    def block_mean(x: np.ndarray) -> np.ndarray:
        xp = np.pad(x, ((0, pad), (0, pad)), constant_values=np.nan)
        return np.nanmean(xp.reshape(n, k, n, k), axis=(1, 3))

    np.testing.assert_allclose(spec.mean.z, block_mean(maps.mean((0, 1))), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        spec.apc.z, block_mean(unsupervised_contacts(maps)), rtol=1e-3, atol=1e-6
    )
    wm, wa = spec.windows[0]
    (a, b), (c, d) = wm.rows, wm.cols
    assert (a, c) == (10, 10) and b - a == 32  # the window asked for comes first
    np.testing.assert_allclose(wm.z, maps.mean((0, 1))[a:b, c:d], rtol=1e-5, atol=1e-7)
    for _, wa in spec.windows:
        (a, b), (c, d) = wa.rows, wa.cols
        np.testing.assert_allclose(wa.z, unsupervised_contacts(maps)[a:b, c:d], atol=1e-5)


def test_budget_bounds_the_file_whatever_the_length() -> None:
    titin = plan_resolution(34350, 120, budget_mb=20)
    cells = 3 * titin.overview_cells**2 + 120 * titin.head_cells**2
    cells += titin.n_windows * 2 * titin.window**2
    assert cells * 6.7 <= 20e6 and titin.n_windows >= 1 and titin.window == 256
    small = plan_resolution(300, 4)
    assert small.overview_bin == small.head_bin == 1 and small.n_windows == 0
    assert axis_labels("MKTAY", 0, 5, 1)[:2] == ["1 M", "2 K"]
    assert axis_labels("MKTAY", 0, 5, 2) == ["1-2 MK", "3-4 TA", "5-5 Y"]


def test_html_is_self_contained_with_hover_and_notes(loaded, tmp_path: Path) -> None:
    path = ProteinLM(loaded).report(SEQ, path=tmp_path / "r.html", name="demo")
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\ssrc=", text) and "<link" not in text
    from plotly.offline import get_plotlyjs

    ours = text.replace(get_plotlyjs(), "")  # Plotly's bundle links to plotly.com; ours: nothing
    assert len(ours) < len(text) and not re.search(r"https?://", ours)
    assert "Plotly.newPlot" in text and text.count('"bdata"') >= 6  # arrays embedded
    hover = "i %{y}\\u003cbr\\u003ej %{x}\\u003cbr\\u003eattention %{z:.6g}"  # JSON-escaped <br>
    assert hover in text  # hover: i and residue i, j and residue j, the value
    assert "<select id='layer'>" in text and "<select id='head'>" in text
    assert "id='no-contacts'" in text and "per residue (full resolution)" in text
    assert "file-size rule" in text and "BLOSUM62" in text


@pytest.fixture(scope="module")
def structure() -> Path:
    path = SHARED / "1A8O_A.pdb"
    if not path.is_file():
        pytest.skip("../shared/data/structures not available")
    return path


def test_contacts_panel_in_sample_note(loaded, structure: Path, tmp_path: Path) -> None:
    from protein_performer.contacts.structures import contact_target
    from protein_performer.interop.identity import model_identity
    from protein_performer.model.contact_head import ContactRegression

    target = contact_target(structure)
    F = 4
    reg = ContactRegression(
        np.full(F, 50.0), -3.0, [1, 2], [0, 1], meta={"fit_on": [target.id]},
        **model_identity(loaded),
    )  # fmt: skip
    reg_path = reg.save(tmp_path / "reg.json")
    spec = build_report(loaded, target.sequence, target=target, regression=str(reg_path))
    c = spec.contacts
    assert c is not None and c.in_sample and c.scale == (0.0, 1.0)
    assert len(c.tp) + len(c.fp) == target.length  # top-L split into right and wrong
    assert len(c.tp) + len(c.fn) == len(c.true_pairs)
    assert set(c.precision) >= {"P@L_long", "P@L/5_short"}
    text = render_html(spec)
    assert "id='in-sample'" in text and "fixed 0-1 probability scale" in text
    spec = build_report(loaded, target.sequence, target=target)  # no regression: stretched
    assert spec.contacts.scale is None and not spec.contacts.in_sample
    assert "stretched to 0-" in render_html(spec)


def test_cli_html_and_png_notes(loaded, tmp_path: Path, capsys) -> None:
    model_dir = export_model(loaded, tmp_path / "model")
    out = tmp_path / "report.html"
    argv = ["visualize", str(model_dir), "--sequence", SEQ, "--device", "cpu"]
    assert main([*argv, "--html", str(out), "--layers", "-1"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: the HTML report" in printed and "no --structure given" in printed
    assert "<option value='2'>2</option>" in out.read_text(encoding="utf-8")
    png = ["--out-dir", str(tmp_path / "png"), "--no-grid", "--no-similarity"]
    assert main([*argv, *png]) == 0
    assert "contacts: contacts.png not drawn: no --structure given" in capsys.readouterr().out


HOSTILE = "</script><script>alert(1)</script><img src=x onerror=alert(2)>&amp;\u2028'\""


def test_hostile_name_stays_text(loaded) -> None:
    """A record id that closes a script block is text in the page and in the metadata."""
    import json

    text = render_html(build_report(loaded, SEQ, name=HOSTILE))
    plain = render_html(build_report(loaded, SEQ, name="demo"))
    assert text.count("<script") == plain.count("<script")  # ours only
    assert "<img" not in text
    meta = re.search(r"<script type='application/json' id='report-meta'>(.*?)</script>", text)
    assert json.loads(meta.group(1))["name"] == HOSTILE


@pytest.mark.parametrize("rid", ["$\\foo{$", "x" * 100_000], ids=["mathtext", "100kB"])
def test_png_titles_take_any_record_id(tmp_path: Path, rid: str) -> None:
    """A record id in a figure title: matplotlib's mathtext and a 100 kB id (a figure
    128,803 pixels across before) draw as text of bounded size."""
    from PIL import Image

    from protein_performer.viz.plots import similarity_vs_blosum

    matrix = np.random.default_rng(0).normal(size=(20, 20))
    path, _ = similarity_vs_blosum(matrix, tmp_path / "s.png", title=f"{rid} (2 layers)", dpi=40)
    assert max(Image.open(path).size) < 2000


def test_predicted_contacts_without_a_structure(loaded, tmp_path: Path, capsys) -> None:
    """Issue 45 #10: `visualize --html --regression` with no structure shows the regression's
    predicted contacts (nothing marked true or false), and says so."""
    from protein_performer.interop.identity import model_identity
    from protein_performer.model.contact_head import ContactRegression

    model_dir = export_model(loaded, tmp_path / "model")
    reg = ContactRegression(np.full(4, 5.0), -3.0, [1, 2], [0, 1], **model_identity(loaded))
    reg_path = reg.save(tmp_path / "reg.json")
    out = tmp_path / "report.html"
    argv = ["visualize", str(model_dir), "--sequence", SEQ, "--device", "cpu", "--html", str(out)]
    assert main([*argv, "--regression", str(reg_path)]) == 0
    printed = capsys.readouterr().out
    assert "contacts: the regression's predictions only" in printed
    text = out.read_text(encoding="utf-8")
    assert "id='predicted-only'" in text and "fig-contacts" in text
    assert "id='no-contacts'" not in text and "true contact (lower triangle)" not in text
    spec = build_report(loaded, SEQ, regression=str(reg_path))
    c = spec.contacts
    assert c is not None and not c.structure and c.scale == (0.0, 1.0)
    assert c.predicted.shape == (len(SEQ), len(SEQ)) and len(c.true_pairs) == 0
    direct = ProteinLM(loaded).predict_contacts(SEQ, regression=str(reg_path))
    np.testing.assert_allclose(c.predicted, direct, atol=1e-6)


def test_building_a_report_shows_progress(loaded, capsys, monkeypatch) -> None:
    """Issue 45 #7: a long protein's report takes tens of seconds: a bar (in a log, a line
    every interval) over the layers' row tiles says where it is."""
    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "0")
    build_report(loaded, SEQ)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("report:")]
    assert lines and "tile" in lines[-1] and "100%" in lines[-1], lines
