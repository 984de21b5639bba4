"""``scripts/studies/harness.py``: when a run counts as finished, what a table looks like, the
Spearman rho, and (slow) a step-budget run through the real train CLI that is not redone."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from scripts.studies import harness as h
from tests.training.test_train import TINY


def _budget_log(run_dir: Path, *events: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / h.BUDGET_LOG).write_text(json.dumps(list(events)))


def test_budget_met_needs_this_budgets_end_event(tmp_path: Path) -> None:
    timed = h.Budget(seconds=3.0)
    stepped = h.Budget(steps=40)
    assert not timed.met(tmp_path / "none")  # no log: never trained
    _budget_log(tmp_path / "a", {"event": "val", "step": 5, "train_s": 1.0})
    assert not timed.met(tmp_path / "a")  # interrupted: no end event
    _budget_log(tmp_path / "b", {"event": "end", "step": 9, "train_s": 3.1, "budget_s": 3.0})
    assert timed.met(tmp_path / "b") and not h.Budget(seconds=6.0).met(tmp_path / "b")
    assert not stepped.met(tmp_path / "b")  # a time-budget run is not a step-budget run
    unreached = float(h._UNREACHED_S)
    _budget_log(
        tmp_path / "c", {"event": "end", "step": 40, "train_s": 9.0, "budget_s": unreached}
    )
    assert stepped.met(tmp_path / "c") and not h.Budget(steps=80).met(tmp_path / "c")
    # The step budget's overrides: the TimeBudget only records (its seconds out of reach).
    assert "trainer.max_steps=40" in stepped.overrides()
    assert f"++callbacks.time_budget.seconds={h._UNREACHED_S}" in stepped.overrides()


def test_markdown_table_and_cells() -> None:
    table = h.markdown_table(["model", "ppl"], [["exact", h.cell([2.0, 4.0])], ["x", h.cell([])]])
    sd = float(np.std([2.0, 4.0], ddof=1))
    assert table.splitlines() == [
        "| model | ppl |",
        "|---|---:|",
        f"| exact | 3.00 ± {sd:.2f} |",
        "| x | - |",
    ]
    assert h.cell([0.5], 100) == "50.00"  # one seed: no spread
    assert h.cell([1.0, math.nan]) == "1.00"  # NaN never becomes a number
    # Any tag selects, not only the harness's own (``rows`` here).
    assert h.select([{"rows": "a", "seed": 0}, {"rows": "b"}], rows="a") == [
        {"rows": "a", "seed": 0}
    ]


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")
def test_spearman_is_scipys_and_nan_when_undefined() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert h.spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)
    assert math.isnan(h.spearman([1.0, 2.0], [2.0, 1.0]))  # too few points
    assert math.isnan(h.spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # constant


@pytest.mark.slow  # two train CLI processes
def test_step_budget_run_is_resumed_not_redone(tmp_path: Path) -> None:
    budget = h.Budget(steps=3)
    overrides = [*TINY, "trainer.num_sanity_val_steps=0", "callbacks.training_curve=null"]
    run = h.Run("tiny", [*overrides, *budget.overrides()], tmp_path / "runs" / "tiny", {"v": 1})
    after = tmp_path / "after.txt"
    run.after.append(("touch", ["touch", str(after)], after))
    args = argparse.Namespace(
        out=tmp_path, threads=1, jobs=1, skip_existing=True, report_only=False
    )
    (done,) = h.run_all([run], budget, args)
    assert done.result["steps"] == 3 and done.result["v"] == 1 and after.is_file()
    assert done.result["command"].startswith("OMP_NUM_THREADS=1 protein-performer train")
    stamp = run.checkpoint.stat().st_mtime_ns
    after.unlink()
    h.run_all([run], budget, args)  # finished: not retrained; the step whose output went
    assert run.checkpoint.stat().st_mtime_ns == stamp and after.is_file()  # missing runs again
