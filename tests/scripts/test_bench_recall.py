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


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data").is_dir(), reason="needs ../shared/data")
def test_shifted_study_scores_each_placement(tmp_path) -> None:
    """Issue 41's shifted fragments, tiny: the memory trained on aligned rows, perplexity per
    placement and k, Spearman rho of the planted variants, and the table."""
    script = REPO / "scripts" / "studies" / "bench_recall.py"
    args = ["--study", "shifted", "--out", str(tmp_path), "--designs", "favor+memory@aligned",
            "--steps", "20", "--families", "30", "--eval-families", "3", "--variants", "6",
            "--min-len", "150", "--max-len", "190", "--row-tokens", "1232",
            "--corpus", str(SHARED / "data" / "sequences" / "uniprot_mmseqs_train.fasta")]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads((tmp_path / "results.json").read_text())["designs"]["favor+memory@aligned"]
    assert len(got["ppl"]) == 12 and len(got["rho"]) == 8
    assert all(1.0 < p < 33.0 for p in got["ppl"].values())
    assert all(-1.0 <= r <= 1.0 for r in got["rho"].values())
    assert "| favor+memory@aligned | on-target |" in (tmp_path / "table.md").read_text()
