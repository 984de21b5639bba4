"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.paths import REPO

ROOT = REPO

# Without a GPU, Triton code (the causal kernels' tests) runs under its interpreter. Set before
# anything imports triton (peft may, while collecting), since triton reads it when a function is
# decorated; on a CUDA machine the kernels compile as they would for users.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

RunScript = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(autouse=True, scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Per-machine measurements (the causal scan's tuned tiles) go to a fresh directory: the
    suite neither reads a user's cache nor leaves one (subprocesses inherit the variable)."""
    before = os.environ.get("PROTEIN_PERFORMER_CACHE_DIR")
    os.environ["PROTEIN_PERFORMER_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("PROTEIN_PERFORMER_CACHE_DIR")
    else:
        os.environ["PROTEIN_PERFORMER_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def own_callbacks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test's own callbacks (crash and signal probes, named ``{__name__}.Class`` in its
    overrides) are trusted as a user's own modules are; subprocesses inherit the variable."""
    monkeypatch.setenv("PROTEIN_PERFORMER_EXTRA_TARGETS", f"tests,{request.module.__name__}")


@pytest.fixture(autouse=True)
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """One intra-op thread per test unless it asks for more with ``@pytest.mark.threads(n)``;
    the previous setting is restored afterwards, also when the code under test changed it.

    Tiny models gain nothing from intra-op threads, and on a loaded machine OpenMP spinning
    makes each op ~100x slower.
    """
    marker = request.node.get_closest_marker("threads")
    threads = int(marker.args[0]) if marker else 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    # Code that chooses its own threads (train, pp.load) takes OMP_NUM_THREADS first.
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    yield threads
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture
def run_script() -> RunScript:
    """Run ``scripts/DIR/NAME *args`` with this interpreter from the repo root; a non-zero exit
    fails the test with the script's output. Scripts run as subprocesses because that is how
    users run them (their own argument parsing, thread settings and imports)."""

    def run(script: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / script), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    return run
