"""scripts/studies/bench_recall.py --quick end to end: real preprocess, train and scoring."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.paths import REPO, SHARED


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data").is_dir(), reason="needs ../shared/data")
def test_quick_recall_study_writes_its_tables(tmp_path) -> None:
    script = REPO / "scripts" / "studies" / "bench_recall.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    family = results["family"]["id70"]
    assert set(family) == {"exact", "favor"}
    for ppl in family.values():  # a perplexity per k, each between 1 and the vocabulary
        assert sorted(ppl, key=int) == ["0", "1", "4", "7", "16"]
        assert all(1.0 < p < 33.0 and math.isfinite(p) for p in ppl.values())
    assert set(results["mqar"]) == {"exact", "favor"}
    assert all(0.0 <= a <= 1.0 for acc in results["mqar"].values() for a in acc.values())
    table = (tmp_path / "table.md").read_text()
    assert "| exact |" in table and "MQAR" in table
