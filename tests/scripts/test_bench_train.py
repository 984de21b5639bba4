"""Smoke tests for the training benchmark: its CLI and the CSV contract.

Why: the script is run rarely and by hand (on a quiet machine or a GPU), so a broken CLI or a
renamed column would only surface then. Speed is not checked, only that the numbers exist and
are finite.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

# Each benchmark case is a fresh interpreter; test_scripts.py checks every CLI by default.
pytestmark = pytest.mark.slow


def test_help(run_script) -> None:
    assert "usage" in run_script("bench/bench_train.py", "--help").stdout


def test_bench_train_quick(tmp_path: Path, run_script) -> None:
    # One objective and one length: each case is a fresh interpreter (an `import torch` each).
    proc = run_script(
        "bench/bench_train.py",
        "--quick",
        "--objectives",
        "mlm",
        "--lengths",
        "64",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    )
    with (tmp_path / "train.csv").open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        columns = set(reader.fieldnames or ())
    assert {
        "objective",
        "attention",
        "L",
        "B",
        "status",
        "steps_timed",
        "step_time_s",
        "tokens_per_s",
        "peak_mem_mib",
        "final_loss",
    } <= columns
    assert {r["attention"] for r in rows} == {"favor", "exact"}
    for row in rows:
        assert row["status"] == "ok", row
        assert int(row["L"]) * int(row["B"]) == int(row["tokens_per_batch"])
        for key in ("step_time_s", "tokens_per_s", "peak_mem_mib", "final_loss"):
            assert math.isfinite(float(row[key])), (key, row)
        assert float(row["tokens_per_s"]) > 0
    assert "favor/exact speed" in proc.stdout
    assert (tmp_path / "train.md").is_file()
    with (tmp_path / "train_ratios.csv").open() as fh:
        ratios = list(csv.DictReader(fh))
    assert [(r["objective"], r["L"]) for r in ratios] == [("mlm", "64")]
    assert math.isfinite(float(ratios[0]["speed_ratio"]))


def test_tables_show_only_the_ratios_that_were_measured(monkeypatch) -> None:
    """A memory-only paired run (issue 40's command) has no exact rows: its tables give the
    memory / FAVOR+ ratio and no favor/exact table of nan."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "bench"))
    import bench_train as bt

    shape = dict(objective="clm", kernel="softmax", B=1, tokens_per_batch=64, depth=1, dim=8,
                 heads=2, m=4, precision="32", device="cpu", threads=1, status="ok",
                 steps_timed=3, step_time_s=0.64, tokens_per_s=100.0, peak_mem_mib=10.0)
    rows = [bt.Row(attention="favor+memory", L=64, paired_speed=0.8, **shape)]
    text = bt.format_tables(rows, "header")
    assert "favor/exact speed" not in text and "nan" not in text
    assert "| clm | 64 | 0.80 | >= 0.8x |" in text
    rows.append(bt.Row(attention="exact", L=64, **{**shape, "tokens_per_s": 50.0}))
    rows.append(bt.Row(attention="favor", L=64, **shape))
    assert "| clm | 64 | 100 | 50 | 2.00 |" in bt.format_tables(rows, "header")


def test_hidden_coordinates_are_the_training_rows_keys(monkeypatch) -> None:
    """--memory-dropout times the memory on the keys a default family_clm row carries: member
    positions, -1 on hidden members, never the first; p = 0 hides none, p = 1 all the others."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "bench"))
    import bench_train as bt
    import torch

    cls = 0
    tokens = torch.tensor([[cls, 5, 6, 7, cls, 5, 6, cls, 5, 6, 7, 8]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    assert torch.equal(bt.hidden_coordinates(tokens, cls, 0.0, seed=0), positions)
    hidden = bt.hidden_coordinates(tokens, cls, 1.0, seed=0)
    assert torch.equal(hidden[0, :4], positions[0, :4])
    assert (hidden[0, 4:] == -1).all()
