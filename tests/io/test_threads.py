"""Threads clamped to what the machine has (issue 42 #14): ``--threads 100000``,
``OMP_NUM_THREADS=100000`` and ``train threads=100000`` crashed OpenMP (exit 139, no message)."""

from __future__ import annotations

import os
import subprocess
import sys

from protein_performer.io.threads import usable_cpus
from tests.paths import REPO

_RUN = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from protein_performer.io.threads import set_threads
print(set_threads({requested}), flush=True)
print(float((torch.ones(300, 300) @ torch.ones(300, 300)).sum()))
"""


def _run(requested: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN.format(requested=requested)],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_huge_thread_count_is_clamped_with_one_warning() -> None:
    cpus = len(usable_cpus())
    proc = _run("100000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"threads: {cpus} (--threads N)" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and f"--threads=100000 is more than the {cpus} CPU(s)" in warnings[0]


def test_omp_num_threads_is_clamped_too() -> None:
    proc = _run("None", OMP_NUM_THREADS="100000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"threads: {len(usable_cpus())} (OMP_NUM_THREADS)" in proc.stdout
    assert "OMP_NUM_THREADS=100000 is more than" in proc.stderr
