"""scripts/studies/linearize_benchmark.py --quick end to end: a tiny exact model trained, then
every row of the table (swap, FAVOR+ fine-tune, transfer, transfer + LoRA) measured."""

from __future__ import annotations

import csv
import math

import pytest


@pytest.mark.slow
def test_quick_linearize_benchmark_writes_every_row(run_script, tmp_path) -> None:
    run_script("studies/linearize_benchmark.py", "--quick", "--threads", "1", "--out-dir",
               str(tmp_path), timeout=900)
    rows = list(csv.DictReader((tmp_path / "linearize.csv").open()))
    methods = [r["method"] for r in rows]
    assert methods[:2] == ["exact", "FAVOR+ swap"]
    assert sum(m.startswith("attention transfer") for m in methods) == 4  # 2 windows x LoRA
    assert float(rows[0]["ratio"]) == 1.0
    assert all(math.isfinite(float(r["ppl"])) and float(r["ppl"]) > 1 for r in rows)
    lora = [r for r in rows if "LoRA" in r["method"]]
    assert all(int(r["steps"]) == 10 for r in lora)  # 6 transfer + 4 LoRA steps
    text = (tmp_path / "linearize.md").read_text()
    assert "| exact |" in text
    assert "target (<= 1.01x for less than the recipe" in text  # the verdict line
    favor = next(r for r in rows if r["method"].startswith("FAVOR+ fine-tune"))
    if favor["reached_1.02x"] != "no":  # CPU to the target = that step's share of the fit
        share = int(favor["reached_1.02x"]) / int(favor["steps"])
        assert math.isclose(float(favor["cpu_s_to_1.02x"]), share * float(favor["cpu_s"]),
                            rel_tol=0.02, abs_tol=0.1)
