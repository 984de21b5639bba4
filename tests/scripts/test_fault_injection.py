"""scripts/fault_injection.py: kills inside writes leave the previous or the new output.

Slow (each trial starts a CLI process); the default suite covers the same guarantees in
test_atomic.py, test_checkpointing.py and test_preprocess_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _check(report_path: Path, commands: list[str], trials: int) -> None:
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert sorted(summary) == sorted(commands)
    for name, row in summary.items():
        assert row["trials"] == trials, name
        assert row["broken"] == 0 and row["stale_left"] == 0, (name, row)
        assert row["previous"] + row["new"] == trials, (name, row)


@pytest.mark.slow
def test_quick_every_command(run_script, tmp_path: Path) -> None:
    run_script("fault_injection.py", "--quick", "--out", str(tmp_path), timeout=1200)
    _check(tmp_path / "report.json", ["train", "preprocess", "embed", "export"], 2)
