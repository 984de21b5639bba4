"""Child processes die with their parent (issue 42 #15, #18): a SIGTERM of ``homologs`` or a
``kill -9`` leaves no ``mmseqs`` running and no scratch copy of the database; a program that
cannot start is one line. A fake ``mmseqs`` (a shell script whose child hangs) stands in for a
long search, so the tests take seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import REPO

SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQ"


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _setup(tmp_path: Path, script: str) -> tuple[list[str], dict[str, str], Path]:
    """``homologs`` on two tiny FASTAs with a fake ``mmseqs`` first on PATH, $TMPDIR private."""
    bindir, tmp = tmp_path / "bin", tmp_path / "tmp"
    bindir.mkdir()
    tmp.mkdir()
    fake = bindir / "mmseqs"
    fake.write_text(script)
    fake.chmod(0o755)
    fasta = tmp_path / "q.fasta"
    fasta.write_text(f">q\n{SEQ}\n>r\n{SEQ[::-1]}\n")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "protein_performer.cli.main", "homologs", str(fasta),
            str(fasta), str(tmp_path / "h.fasta")]  # fmt: skip
    return argv, env, tmp


def _hanging(pidfile: Path) -> str:
    """A fake mmseqs that answers ``version`` and hangs otherwise, through a child of its own."""
    return (f'#!/bin/sh\n[ "$1" = version ] && {{ echo 14; exit 0; }}\n'
            f"sleep 120 &\necho $! > {pidfile}\nwait\n")  # fmt: skip


def _started(proc: subprocess.Popen[str], pidfile: Path) -> int:
    end = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the fake mmseqs never started"
        time.sleep(0.05)
    return int(pidfile.read_text())


def test_sigterm_stops_mmseqs_and_removes_its_scratch(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    argv, env, tmp = _setup(tmp_path, _hanging(pidfile))
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    grandchild = _started(proc, pidfile)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "stopped by SIGTERM" in err
    assert _wait_gone(grandchild), "mmseqs's child outlived the command"
    assert not list(tmp.glob("pp_homologs_*")), "the scratch copy of the database was left"


def test_sigterm_stops_the_clustering_of_preprocess_too(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    argv, env, tmp = _setup(tmp_path, _hanging(pidfile))
    fasta = argv[-3]
    argv = [*argv[:3], "preprocess", fasta, "--out", str(tmp_path / "store"),
            "--cluster-split", "0.5", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    grandchild = _started(proc, pidfile)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert _wait_gone(grandchild), "mmseqs's child outlived preprocess"
    assert not list(tmp.glob("pp_mmseqs_*"))


def test_kill_9_of_the_command_still_ends_mmseqs_and_its_scratch(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    argv, env, tmp = _setup(tmp_path, _hanging(pidfile))
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    grandchild = _started(proc, pidfile)
    proc.kill()
    proc.wait()
    assert _wait_gone(grandchild), "mmseqs's child outlived a kill -9 of the command"
    end = time.monotonic() + 5
    while list(tmp.glob("pp_homologs_*")) and time.monotonic() < end:
        time.sleep(0.05)
    assert not list(tmp.glob("pp_homologs_*"))


def test_a_program_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    # Executable, found on PATH, but its interpreter does not exist: exec fails.
    argv, env, tmp = _setup(tmp_path, "#!/nonexistent/interpreter\n")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("error: cannot start mmseqs")
    assert not list(tmp.glob("pp_homologs_*"))


def test_a_long_wait_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from protein_performer.io import processes

    monkeypatch.setattr(processes, "QUIET_SECONDS", 0.3)
    with caplog.at_level(logging.INFO, logger="protein_performer.io.processes"):
        processes.run_process(["sleep", "0.8"], "nothing", label="sleep")
    assert "sleep on nothing: running step, 0 s so far" in caplog.text
