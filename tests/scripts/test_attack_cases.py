"""scripts/attack_cases.py: the round-three crafted inputs through the real CLI, every case
its promised outcome. Slow (a process per case); the default suite has a test per finding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_every_case_holds(run_script, tmp_path: Path) -> None:
    run_script("attack_cases.py", "--out", str(tmp_path), timeout=1200)
    rows = json.loads((tmp_path / "report.json").read_text())["cases"]
    assert len(rows) >= 20 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
