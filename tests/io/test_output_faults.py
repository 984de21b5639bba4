"""Two writers of one output, and full disks (issue 26, items 1 and 4).

Locks: a real second process holds the output's lock (``io.atomic.exclusive_lock``, as a live
run does) and every writing command must stop with one line naming it, ``--overwrite`` and
``--resume`` included, before touching anything. Full disks: a real 1 MiB tmpfs where the tests
run as root (skipped, with the reason, where ``mount`` is not permitted), and an injected
``OSError(ENOSPC)`` at the lowest write layer (``fsync_path`` inside ``atomic_file``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from protein_performer.cli.main import main
from protein_performer.errors import UserError
from protein_performer.interop.export import export_model
from protein_performer.io import atomic
from tests.inference.test_embedding import tiny_loaded
from tests.io.test_sharding import ENV, write_fasta

HOLD = """
import sys, time
from pathlib import Path
from protein_performer.io.atomic import exclusive_lock
with exclusive_lock(Path(sys.argv[1]), "a test"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model(tiny_loaded("mlm"), tmp_path_factory.mktemp("faults") / "model")


@contextlib.contextmanager
def held(out: Path, seconds: float = 60) -> Iterator[subprocess.Popen[str]]:
    """Another live process holding ``out``'s lock, as a running writer does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_every_writer_refuses_an_output_a_live_run_holds(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 3)
    wt, muts = tmp_path / "wt.fasta", tmp_path / "m.csv"
    wt.write_text(">wt\nACDEFGHIK\n")
    muts.write_text("mutant\nA1C\n")
    m, f = str(model), str(fasta)
    cases = {
        "e.h5": [["embed", m, f, "{}", "--overwrite"], ["embed", m, f, "{}", "--resume"]],
        "s.csv": [["score", m, f, "{}", "--overwrite"]],
        "v.csv": [["score-variants", m, str(wt), str(muts), "{}", "--overwrite"]],
        "c.h5": [["contacts", "predict", m, f, "{}", "--overwrite"]],
        "g.fasta": [["generate", m, "{}", "--num", "1", "--max-length", "5"]],
        "exported": [["export", m, "{}", "--overwrite"]],
        "store": [["preprocess", f, "--out", "{}", "--overwrite"]],
    }
    for name, argvs in cases.items():
        out = tmp_path / name
        out.write_text("previous")
        with held(out) as proc:
            for argv in argvs:
                capsys.readouterr()
                assert main([a.replace("{}", str(out)) for a in argv]) == 2, argv
                err = capsys.readouterr().err
                assert err.count("\n") == 1 and err.startswith("error: "), err
                assert f"in use by another run (pid {proc.pid} on " in err, err
        assert out.read_text() == "previous", name  # nothing was pulled from under it
        assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name], name


def test_a_second_training_into_a_live_run_directory_is_refused(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from protein_performer.training.train import train

    run = tmp_path / "outputs" / "run1"
    run.mkdir(parents=True)
    with held(run) as proc, pytest.raises(UserError, match=f"pid {proc.pid} on .*training run"):
        train(OmegaConf.create({"paths": {"output_dir": str(run)}}))


def test_the_lock_is_released_and_reentrant(tmp_path: Path) -> None:
    out = tmp_path / "o.h5"
    with atomic.exclusive_lock(out, "x"), atomic.exclusive_lock(out, "x"):  # the store in
        assert (tmp_path / ".o.h5.lock").read_text().split()[0] == str(os.getpid())
    assert not (tmp_path / ".o.h5.lock").exists()
    with atomic.exclusive_lock(out, "x"):  # free again
        pass


def test_a_lock_never_follows_a_link(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42 item 1: a symlink (or hard link) planted under the lock's name is refused in one
    line; the file it points to keeps its bytes and the planted name stays as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 2)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(victim, shared / ".out.csv.lock")
    assert main(["score", str(model), str(fasta), str(shared / "out.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "symbolic link" in err, err
    assert victim.read_text() == "precious\n" and (shared / ".out.csv.lock").is_symlink()
    assert not (shared / "out.csv").exists()
    (shared / ".out.csv.lock").unlink()
    os.link(victim, shared / ".out.csv.lock")  # a hard link: the same file by another name
    with (
        pytest.raises(UserError, match="not a plain file of yours"),
        atomic.exclusive_lock(shared / "out.csv", "x"),
    ):
        pass
    assert victim.read_text() == "precious\n"


def test_the_lock_descriptor_is_close_on_exec(tmp_path: Path) -> None:
    """A program the command starts (mmseqs, a spawned worker) never inherits the lock."""
    out = tmp_path / "o.h5"
    with atomic.exclusive_lock(out, "x"):
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
        mine = [f for f in fds if _target(f) == str(tmp_path / ".o.h5.lock")]
        assert len(mine) == 1 and not os.get_inheritable(mine[0])


def _target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_an_injected_enospc_is_one_line_and_leaves_nothing(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """ENOSPC injected at the lowest write layer (the fsync before the rename), for a table
    (score), an HDF5 file (embed) and a directory (export)."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 3)
    real = atomic.fsync_path

    def full(path: Path) -> None:
        if path.is_file():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path)

    monkeypatch.setattr(atomic, "fsync_path", full)
    for argv, out in (
        (["score", str(model), str(fasta)], tmp_path / "s.csv"),
        (["embed", str(model), str(fasta)], tmp_path / "e.h5"),
    ):
        capsys.readouterr()
        assert main([*argv, str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: no space left on "), err
        assert f" writing {tmp_path}" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta"], argv


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "1m") -> Iterator[Path]:
    """A small real filesystem that fills up; skips where mounting is not permitted."""
    path.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {got.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "protein_performer.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )


@pytest.mark.slow  # subprocesses (a crash must show as its exit status, not kill pytest)
def test_a_full_tmpfs_is_one_line_for_every_writer(model: Path, tmp_path: Path) -> None:
    """A real 1 MiB tmpfs: embed (per_tok, which crashed h5py before), score, export and
    preprocess each end with one line, status 2, and leave the filesystem empty."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 400)  # per_tok of 400 x 40 residues x 16 floats: > 1 MiB
    small = tmp_path / "small.fasta"
    write_fasta(small, 2)
    big = tmp_path / "big.fasta"
    big.write_text("".join(f">b{i}\n{'ACDEFGHIKLMNPQRSTVWY' * 200}\n" for i in range(400)))
    with tmpfs(tmp_path / "full") as disk:
        cases = [
            ["embed", str(model), str(fasta), str(disk / "e.h5"), "--include", "per_tok",
             "mean", "--no-progress"],
            ["score", str(model), str(small), str(disk / "s.csv"), "--no-progress"],
            ["export", str(model), str(disk / "exported")],
            ["preprocess", str(big), "--out", str(disk / "store"), "--no-progress"],
        ]  # fmt: skip
        ballast = disk / "ballast"
        for argv in cases:
            if argv[0] in ("score", "export"):  # small outputs: fill the disk first
                with contextlib.suppress(OSError), open(ballast, "wb", buffering=0) as fh:
                    while True:
                        fh.write(b"\0" * 4096)
            started = time.monotonic()
            proc = run_cli(*argv)
            assert proc.returncode == 2, (argv[0], proc.returncode, proc.stderr[-3000:])
            assert proc.stderr.count("error:") == 1, proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr
            line = proc.stderr.strip().splitlines()[-1]
            assert line.startswith(f"error: no space left on {disk} (tmpfs) writing {disk}"), line
            left = sorted(p.name for p in disk.iterdir() if p.name != "ballast")
            assert left == [], (argv[0], left)
            ballast.unlink(missing_ok=True)
            assert time.monotonic() - started < 120


def test_sigterm_leaves_no_lock_behind(model: Path, tmp_path: Path) -> None:
    """Issue 42 item 20: a command stopped by SIGTERM (here `score` waiting on its standard
    input) releases its lock and removes it, exits 143 in one line, and writes no output."""
    import signal

    out = tmp_path / "out.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "protein_performer.cli.main", "score", str(model), "-", str(out),
         "--no-progress"],  # fmt: skip
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lock = tmp_path / ".out.csv.lock"
    deadline = time.monotonic() + 60
    while not lock.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert lock.exists(), "the command never took its lock"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM", err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_run_directory_is_never_inside_or_holding_its_data(tmp_path: Path) -> None:
    """Issue 42 item 6 for train/finetune: the run directory (paths.output_dir) goes through
    the one policy: inside the data store, or holding the init weights, is refused."""
    from omegaconf import OmegaConf

    from protein_performer.training.train import train

    store = tmp_path / "store"
    store.mkdir()
    (store / "tokens.bin").write_bytes(b"t")
    cfg = {"paths": {"output_dir": str(store / "run")}, "data": {"path": str(store)}}
    with pytest.raises(UserError, match="inside the input directory"):
        train(OmegaConf.create(cfg))
    weights = tmp_path / "runs" / "x" / "init.ckpt"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"w")
    cfg = {"paths": {"output_dir": str(tmp_path / "runs")}, "init_from": str(weights)}
    with pytest.raises(UserError, match="a directory holding the input"):
        train(OmegaConf.create(cfg))
    assert sorted(p.name for p in store.iterdir()) == ["tokens.bin"]


FORK_AND_DIE = """
import os, signal, sys, time
from pathlib import Path
from protein_performer.io.atomic import exclusive_lock
with exclusive_lock(Path(sys.argv[1]), "a test"):
    ready, said = os.pipe()
    child = os.fork()
    if child == 0:  # a worker forked while the lock is held (a DataLoader worker)
        os.write(said, b"1")  # after the fork hooks ran: the parent may die now
        time.sleep(30)
        os._exit(0)
    os.read(ready, 1)
    print(child, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the parent dies at once, its worker lives on
"""


def test_a_forked_worker_never_holds_its_parents_lock(tmp_path: Path) -> None:
    """Issue 42 item 1: forked children close their copies of the lock descriptors, so a run
    killed with -9 frees its output at once even while its workers still run."""
    out = tmp_path / "o.h5"
    proc = subprocess.Popen([sys.executable, "-c", FORK_AND_DIE, str(out)],
                            stdout=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.wait(timeout=30)
    try:
        assert Path(f"/proc/{child}").exists()  # the worker still runs
        with atomic.exclusive_lock(out, "x"):  # and the output is free: it holds no copy
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """Another user's lock file (EACCES; injected, the suite may run as root) is a UserError
    naming it, not a traceback."""
    real_open = os.open

    def denied(path, flags, *args):  # noqa: ANN001, ANN202
        if str(path).endswith(".o.h5.lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(atomic.os, "open", denied)
    with (
        pytest.raises(UserError, match=r"cannot open the lock file .*\.o\.h5\.lock"),
        atomic.exclusive_lock(tmp_path / "o.h5", "x"),
    ):
        pass
