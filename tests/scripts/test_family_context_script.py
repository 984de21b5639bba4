"""``scripts/studies/family_context.py`` (issue 21's study): ``--help`` (fast: no torch import),
and the whole ``--quick`` pipeline end to end (slow: MMseqs2 preprocess and families, seven tiny
trainings through Hydra, scoring with family contexts through the API)."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

SCRIPT = REPO / "scripts" / "studies" / "family_context.py"


def test_help_names_the_protocol() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--quick", "--minutes", "--family-tokens", "--single-len", "--targets"):
        assert flag in proc.stdout


def test_train_records_the_family_row_length_as_context_tokens(tmp_path: Path) -> None:
    """``lm.context()`` defaults to what training read: train() copies data.family_max_tokens
    into model.config.context_tokens for family rows; an explicit value and single rows keep
    theirs."""
    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import _record_context_tokens

    def recorded(*overrides: str) -> object:
        cfg = compose_config([*overrides, f"data.path={tmp_path}"], output_dir=tmp_path)
        _record_context_tokens(cfg)
        return cfg.model.config.get("context_tokens")

    assert recorded("experiment=family_clm", "data.family_max_tokens=2048") == 2048
    assert recorded("experiment=family_clm", "model.config.context_tokens=512") == 512
    assert recorded("experiment=small_clm") is None

    def keyed(*overrides: str) -> object:
        cfg = compose_config([*overrides, f"data.path={tmp_path}"], output_dir=tmp_path)
        _record_context_tokens(cfg)
        return cfg.model.config.get("family_coordinates")

    # ... and what its homologs were keyed by, which a context then reads them by (issue 41)
    assert keyed("experiment=family_clm", "data.family_coordinates=aligned") == "aligned"
    assert keyed("experiment=family_clm") == "positions"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mmseqs") is None, reason="needs MMseqs2 (`mmseqs` on PATH)")
def test_quick_end_to_end(tmp_path: Path, run_script) -> None:
    run_script("studies/family_context.py", "--quick", "--out", str(tmp_path), timeout=1500)
    with (tmp_path / "family_context.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["rows"], r["variant"], r["positions"]) for r in rows} == {
        *(
            (rows_, v, "sequence")
            for rows_ in ("single", "family")
            for v in ("exact", "favor-softmax", "favor-relu")
        ),
        ("family", "favor-softmax", "member"),
    }
    for r in rows:
        assert float(r["train_cpu_s"]) >= 3.0 and int(r["steps"]) > 0, r
        for k in (0, 1, 4, 16):
            assert math.isfinite(float(r[f"test_ppl_k{k}"])), (k, r)
        assert -1.0 <= float(r["blat_rho"]) <= 1.0
    # The family models record their row length; scoring read every member regardless.
    runs = json.loads((tmp_path / "family_context.json").read_text())["runs"]
    for run in runs:
        want = 1024 if run["rows"] == "family" else None
        assert run["eval"]["context_tokens"] == want, run["name"]
    meta = json.loads((tmp_path / "store" / "meta.json").read_text())
    assert meta["split"]["mode"] == "auto" and "clusters" in meta["split"]
    report = (tmp_path / "family_context.md").read_text()
    for heading in ("Family context", "Positions", "BLAT_ECOLX", "Length extrapolation"):
        assert heading in report
    assert "Better: **positions=" in report and "unigram baseline" in report
