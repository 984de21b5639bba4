"""scripts/bench/gpu_check.sh: the one GPU command, run here on the CPU with tiny sizes, so that it
works the day a GPU appears (every benchmark it calls, the CSVs they write, the ratio table)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

SCRIPT = REPO / "scripts" / "bench" / "gpu_check.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow  # every benchmark, each case a fresh interpreter
def test_quick_cpu_run_prints_the_ratio_table(tmp_path: Path) -> None:
    proc = _run("--device", "cpu", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("| benchmark | case |") :].splitlines()
    rows = [line.split("|")[1:-1] for line in table[2:] if line.startswith("| ")]
    assert {r[0].strip() for r in rows} == {
        "attention vs SDPA",
        "embed vs HF EsmModel",
        "embed vs our exact twin",
        "train step vs exact twin",
    }
    cases = {(r[0].strip(), r[1].strip()) for r in rows}
    assert ("attention vs SDPA", "causal fwd+bwd, L=128, bfloat16") in cases
    assert ("embed vs HF EsmModel", "proteins") in cases
    assert ("train step vs exact twin", "clm, L=64, bf16-mixed") in cases
    for r in rows:  # ratio = baseline / ours, both measured
        ours, base, ratio = (float(x) for x in r[2:5])
        assert (
            ours > 0 and base > 0 and math.isclose(ratio, base / ours, rel_tol=0.02, abs_tol=0.006)
        )
    for name in ("attention/attention.csv", "embed.csv", "train/train.csv"):
        assert (tmp_path / name).is_file()


def test_help_and_a_bad_argument() -> None:
    assert "--device cpu --quick" in _run("--help").stdout
    bad = _run("--gpu")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown argument '--gpu'")
