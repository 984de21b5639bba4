"""preprocess under faults: a killed run leaves no workers behind and its temporary store is
removed by the next run; two runs into one --out give the loser one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protein_performer.cli.main import main
from tests.paths import REPO

DEMO = REPO / "protein_performer" / "data" / "demo" / "train.fasta"

# Kill loops and racing runs, each a preprocess subprocess with worker processes.
pytestmark = pytest.mark.slow

# Many small byte ranges on two spawned workers: the run lasts long enough to be killed inside.
SLOW_RUN = """
import sys
from protein_performer.data.preprocess import preprocess
preprocess([sys.argv[1]] * 6, sys.argv[2], progress=False, workers=2, _range_bytes=4096,
           on_invalid="skip")
"""


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _started_workers(proc: subprocess.Popen) -> list[int]:
    """The pids of ``proc``'s spawned workers, once at least two run (within a minute)."""
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while time.monotonic() < deadline and len(workers) < 2:
        time.sleep(0.1)
        workers = [p for p in _children(proc.pid) if "spawn" in _cmdline(p)]
    assert len(workers) >= 2, "the workers never started"
    return workers


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_preprocess_leaves_no_workers_and_next_run_cleans_up(tmp_path, sig) -> None:
    out = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RUN, str(DEMO), str(out)], env=env)
    workers = _started_workers(proc)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    time.sleep(0.2)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), "orphaned workers outlived the run"
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".store")]
    assert leftovers  # the killed run's temporary store (removed by the next run, below)
    assert main(["preprocess", str(DEMO), "--out", str(out), "--no-progress"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["store"]


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_second_run_into_the_same_out_gets_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-c", SLOW_RUN, str(DEMO), str(out)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / ".store.lock").exists():
            time.sleep(0.05)
        assert main(["preprocess", str(DEMO), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err
        assert "in use by another run" in err or "already exists" in err, err
    finally:
        first.kill()
        first.wait(timeout=30)
    assert main(["preprocess", str(DEMO), "--out", str(out), "--no-progress"]) == 0
    assert main(["preprocess", str(DEMO), "--out", str(out), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err


SLOW_CLI = """
import sys
import protein_performer.data.preprocess as pre
run = pre.preprocess  # many small ranges: the run lasts long enough to be stopped inside
pre.preprocess = lambda *args, **kwargs: run(*args, _range_bytes=4096, **kwargs)
from protein_performer.cli.main import main
sys.exit(main(["preprocess", *[sys.argv[1]] * 6, "--out", sys.argv[2], "--workers", "2",
               "--no-progress", "--on-invalid", "skip"]))
"""


def test_sigterm_stops_preprocess_like_ctrl_c(tmp_path) -> None:
    """Issue 42 item 20: SIGTERM to the command (not only kill) ends its workers, removes its
    temporary store and lock, and exits 143 with one line."""
    out = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, str(DEMO), str(out)], env=env,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    workers = _started_workers(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "stopped by SIGTERM", err
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), "orphaned workers outlived the run"
    assert list(tmp_path.iterdir()) == []  # no store, no temporary store, no lock
