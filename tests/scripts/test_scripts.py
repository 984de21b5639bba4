"""Every script under scripts/ answers ``--help`` (the README's promise) and imports its shared
helpers (``scripts/bench/_common.py``, ``scripts/studies/harness.py``) by name, with no
``sys.path`` edits: run as ``python scripts/DIR/X.py``, the script's own directory is already
first on ``sys.path``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

SCRIPTS = REPO / "scripts"
#: Every runnable script (what has a ``__main__``; the helper modules have none), as
#: ``DIR/NAME`` relative to scripts/.
NAMES = sorted(
    str(p.relative_to(SCRIPTS))
    for p in SCRIPTS.rglob("*.py")
    if 'if __name__ == "__main__"' in p.read_text()
)

# Runs every script's ``__main__`` with ``--help`` in one interpreter (one ``import torch``, not
# one per script): a child process, so that no script's imports or settings leak into pytest.
_HELP_ALL = """
import contextlib, io, json, os, runpy, sys
scripts, names = sys.argv[1], sys.argv[2:]
result = {}
for name in names:
    out, code = io.StringIO(), "returned without exiting"
    sys.path.insert(0, os.path.dirname(f"{scripts}/{name}"))  # as `python scripts/DIR/X.py`
    sys.argv = [os.path.basename(name), "--help"]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(f"{scripts}/{name}", run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    result[name] = [code, out.getvalue()]
print(json.dumps(result))
"""


def test_every_script_answers_help_in_one_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_ALL, str(SCRIPTS), *NAMES],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(answers) == NAMES
    wrong = {
        name: (code, text[:200])
        for name, (code, text) in answers.items()
        if code not in (0, None) or not text.startswith(f"usage: {name.rsplit('/', 1)[-1]}")
    }
    assert not wrong, wrong


@pytest.mark.slow
@pytest.mark.parametrize("script", NAMES)
def test_help(script: str, run_script) -> None:
    """The same, each as users run it: its own interpreter, the script's directory on the path."""
    assert "usage" in run_script(script, "--help").stdout


def test_no_sys_path_edits() -> None:
    offenders = [
        p.name
        for p in SCRIPTS.rglob("*.py")
        if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()
    ]
    assert not offenders, offenders
