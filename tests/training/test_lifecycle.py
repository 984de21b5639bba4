"""A training run and its helper processes (issue 42 #19, issue 45 #2): a scheduler's stop of the
whole process group saves ``last.ckpt``; DataLoader workers never keep the run directory locked
after the run is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from protein_performer.io.atomic import exclusive_lock
from tests.paths import REPO


def test_a_forked_child_does_not_keep_a_lock_of_a_killed_parent(tmp_path: Path) -> None:
    """``kill -9`` of a process holding a lock, while its fork (a DataLoader worker) lives on:
    the lock is free at once, not held by the orphan under the dead pid."""
    run_dir = tmp_path / "run"
    script = textwrap.dedent(f"""
        import multiprocessing, time
        from pathlib import Path
        from protein_performer.io.atomic import exclusive_lock
        with exclusive_lock(Path({str(run_dir)!r}), "a training run"):
            child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
            child.start()
            print(child.pid, flush=True)
            time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    child = int(proc.stdout.readline())
    try:
        proc.kill()
        proc.wait()
        time.sleep(0.1)
        with exclusive_lock(run_dir, "a training run"):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
