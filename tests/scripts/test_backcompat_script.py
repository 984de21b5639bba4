"""The backward-compatibility experiment (scripts/studies/backcompat_experiment.py) end to end,
tiny.

Runs on the bundled demo FASTA so CI exercises it without ../shared: exact training through
``train(cfg)``, the swap, and one fine-tune per distillation weight, then the same fine-tune
again from the saved exact checkpoint (``--exact-ckpt``), which must reproduce the curve.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tests.paths import REPO

# Trains, swaps and fine-tunes in a subprocess; test_scripts.py checks its CLI by default.
pytestmark = pytest.mark.slow

ROOT = REPO
DEMO = ROOT / "protein_performer" / "data" / "demo" / "train.fasta"
QUICK = ["--quick", "--threads", "1", "--data", str(DEMO)]


def _curves(path: Path) -> dict[float, list[tuple[int, float]]]:
    curves: dict[float, list[tuple[int, float]]] = {}
    with path.open() as fh:
        for row in csv.DictReader(fh):
            curves.setdefault(float(row["distill_weight"]), []).append(
                (int(row["step"]), float(row["ppl"]))
            )
    return curves


def test_backcompat_quick_and_resume_from_exact_ckpt(tmp_path: Path, run_script) -> None:
    first = tmp_path / "first"
    proc = run_script("studies/backcompat_experiment.py", *QUICK, "--out-dir", str(first))
    assert "## Backward compatibility" in proc.stdout
    for name in ("recovery.md", "recovery.png", "recovery.csv", "summary.json"):
        assert (first / name).is_file(), name
    summary = json.loads((first / "summary.json").read_text())
    exact = summary["exact_ppl"]
    assert 1.0 < exact < 33.0  # a real perplexity over the 33-token vocabulary
    assert len(summary["swap_ppls"]) == 2 and all(math.isfinite(p) for p in summary["swap_ppls"])

    curves = _curves(first / "recovery.csv")
    assert set(curves) == {0.0, 0.5}
    for curve in curves.values():
        assert [s for s, _ in curve] == [0, 5, 10, 15, 20]
    # Same weights, same step-0 feature draw, no update yet: both runs start at the same point.
    assert curves[0.0][0][1] == curves[0.5][0][1]
    # Training moves the model: the distilled run's later points differ from MLM-only's.
    assert curves[0.0][-1][1] != curves[0.5][-1][1]
    for run in summary["runs"]:
        reached = run["reached_step"]
        ppls = [p["ppl"] for p in run["curve"]]
        want = next((p["step"] for p in run["curve"] if p["ppl"] <= 1.05 * exact), None)
        assert reached == want and len(ppls) == 5

    second = tmp_path / "second"
    ckpt = first / "exact" / "checkpoints" / "last.ckpt"
    run_script(
        "studies/backcompat_experiment.py",
        *QUICK,
        "--out-dir",
        str(second),
        "--exact-ckpt",
        str(ckpt),
        "--distill-weights",
        "0",
    )
    again = _curves(second / "recovery.csv")
    assert set(again) == {0.0}
    for (s1, p1), (s2, p2) in zip(curves[0.0], again[0.0], strict=True):
        assert s1 == s2 and math.isclose(p1, p2, rel_tol=1e-5)
    assert "loaded from" in (second / "recovery.md").read_text()
