"""Every script in scripts/ answers ``--help`` (the README's promise) and imports its shared
helpers (``scripts/_common.py``) by name, with no ``sys.path`` edits: run as
``python scripts/X.py``, the script's own directory is already first on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
NAMES = sorted(p.name for p in SCRIPTS.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", NAMES)
def test_help(script: str, run_script) -> None:
    assert "usage" in run_script(script, "--help").stdout


def test_no_sys_path_edits() -> None:
    offenders = [
        p.name
        for p in SCRIPTS.glob("*.py")
        if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()
    ]
    assert not offenders, offenders
