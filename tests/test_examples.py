"""The examples users copy from run as written (so they cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from protein_performer.interop.export import export_model
from tests.inference.test_embedding import tiny_loaded
from tests.paths import REPO

ROOT = REPO


@pytest.mark.slow  # the example end to end in its own interpreter; test_api covers its calls
def test_quickstart(tmp_path: Path) -> None:
    mlm = export_model(tiny_loaded("mlm"), tmp_path / "mlm")
    clm = export_model(tiny_loaded("clm"), tmp_path / "clm")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(mlm), str(clm)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mean embeddings: (2, 16)" in out
    assert "per-residue embeddings: [(22, 16), (19, 16)]" in out
    assert re.search(r"fill-in: \[\[\('[A-Z]', 0\.\d+\)", out)
    samples = re.findall(r">sample\n([A-Z]+)\n", out)
    assert len(samples) == 3 and all(s.startswith("M") and len(s) <= 60 for s in samples)
