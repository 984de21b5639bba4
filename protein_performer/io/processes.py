"""Child processes die with their parent: the one way this package runs another program.

MMseqs2 (``homologs``, ``preprocess --cluster-split``, the family search of ``train``) runs for
minutes and spawns its own children; run naively it outlived a SIGTERM of the command (orphaned
with ppid 1) and left ``$TMPDIR/pp_*`` scratch copies of the database behind. Here every program
runs under a small supervisor in a process group of its own (Ray and Dask stop their workers the
same way; Slurm's ``scancel`` signals whole groups):

* SIGTERM and Ctrl-C of the command stop the whole group, and the scratch directories the caller
  opened with :func:`scratch_dir` are removed (``tempfile.TemporaryDirectory``);
* when the command dies without a chance to clean up (``kill -9``), the supervisor notices
  (``PR_SET_PDEATHSIG`` on Linux, its parent pid elsewhere), removes the scratch directories and
  kills the group;
* a wait longer than :data:`QUIET_SECONDS` says so (a line per progress interval), a timeout
  stops it, and a program that cannot start is one line.

DataLoader workers, the other children, leave the group (:func:`leave_group_stop`): a group's
SIGTERM reaches the main process, which saves ``last.ckpt`` and ends them itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from protein_performer.errors import UserError

log = logging.getLogger(__name__)

#: A wait longer than this (seconds) gets a progress line; then one per progress interval.
QUIET_SECONDS = 5.0
#: How long a stopped group gets to end before SIGKILL (seconds).
GRACE_SECONDS = 2.0
#: The supervisor's exit status when the program cannot start (the shell's "not executable").
CANNOT_START = 127
_CANNOT_START = "pp-supervisor: cannot start"

#: The supervisor (run with ``python -I -S``): leader of the group, parent of the program. When
#: its parent dies it removes the scratch directories and kills the group. Stays tiny and
#: standard-library only: it starts in ~20 ms.
_SUPERVISOR = f"""
import os, shutil, signal, subprocess, sys
parent, n = int(sys.argv[1]), int(sys.argv[2])
scratch, cmd = sys.argv[3:3 + n], sys.argv[3 + n:]
def end(*_):
    if os.getppid() != parent:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass  # not Linux: the loop below watches the parent pid instead
if os.getppid() != parent:
    end()
try:
    child = subprocess.Popen(cmd)
except OSError as exc:
    sys.stderr.write("{_CANNOT_START} " + str(exc.strerror or exc) + "\\n")
    sys.exit({CANNOT_START})
while True:
    try:
        rc = child.wait(timeout=0.5)
        sys.exit(rc if rc >= 0 else 128 - rc)
    except subprocess.TimeoutExpired:
        if os.getppid() != parent:
            end()
"""

#: Scratch directories of this process, removed by the supervisor if the process dies first.
_SCRATCH: list[str] = []


class Stopped(KeyboardInterrupt):
    """SIGTERM turned into an exception, so ``finally`` blocks (killing a child's group,
    removing scratch) run; a ``KeyboardInterrupt`` so that it passes ``except Exception``."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """For the block, SIGTERM raises :class:`Stopped` in the main thread (a no-op elsewhere:
    only the main thread can install handlers)."""

    def stop(signum: int, frame: object) -> None:
        raise Stopped

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A ``tempfile.TemporaryDirectory`` that a SIGTERM of the command removes too, and the
    supervisor of any program run meanwhile removes if the command is killed outright."""
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix=prefix) as work:
        _SCRATCH.append(work)
        try:
            yield Path(work)
        finally:
            _SCRATCH.remove(work)


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the group (the supervisor then SIGKILLs it), SIGKILL after the grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=GRACE_SECONDS)
            return
        except subprocess.TimeoutExpired:
            continue


def _progress_interval() -> float:
    from protein_performer.io.progress import interval

    return max(0.1, interval())


def run_process(
    cmd: Sequence[str],
    what: str,
    *,
    label: str | None = None,
    timeout: float | None = None,
    timeout_flag: str = "",
    stage: Callable[[str], str] | None = None,
) -> str:
    """Run ``cmd`` to the end under the supervisor; returns its output (stdout and stderr).

    ``what`` says what it works on and ``label`` what it is (default: the program's name) in
    the progress lines and errors; ``stage(output so far)`` names its current step in them.
    A non-zero exit, a timeout (``timeout`` seconds; ``timeout_hint`` says how to change it) or
    a program that cannot start is a ``UserError``; SIGTERM or Ctrl-C stop its whole group.
    """
    label = label or Path(cmd[0]).name
    argv = [sys.executable, "-I", "-S", "-c", _SUPERVISOR, str(os.getpid()), str(len(_SCRATCH)),
            *_SCRATCH, *map(os.fspath, cmd)]  # fmt: skip
    with tempfile.TemporaryFile("w+", errors="replace") as out, sigterm_raises():
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        start = time.monotonic()
        next_line = start + min(QUIET_SECONDS, _progress_interval())
        try:
            while True:
                now = time.monotonic()
                deadline = next_line if timeout is None else min(next_line, start + timeout)
                try:
                    proc.wait(timeout=max(0.0, deadline - now))
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - start
                    step = stage(_read(out)) if stage else "running"
                    if timeout is not None and elapsed >= timeout:
                        within = f"{timeout_flag} {timeout:g}".strip()
                        raise UserError(
                            f"{label} on {what} did not finish within {within} s (in its {step} "
                            f"step); stopped it. Raise the timeout or check {label.split()[0]}"
                        ) from None
                    if time.monotonic() >= next_line:
                        log.info("%s on %s: %s step, %.0f s so far", label, what, step, elapsed)
                        next_line = time.monotonic() + _progress_interval()
        finally:
            if proc.poll() is None:
                _stop_group(proc)
        output = _read(out)
    if proc.returncode == CANNOT_START and _CANNOT_START in output:
        reason = output.split(_CANNOT_START, 1)[1].strip().splitlines()[0]
        raise UserError(f"cannot start {label} ({cmd[0]}) for {what}: {reason}")
    if proc.returncode != 0:
        tail = output.strip().splitlines()[-3:]
        raise UserError(
            f"{label} failed (exit {proc.returncode}) on {what}: "
            f"{' | '.join(tail) or 'no message'}"
        )
    return output


def _read(fh: tempfile._TemporaryFileWrapper[str]) -> str:
    """Everything written to ``fh`` so far (the position is put back at the end)."""
    fh.seek(0)
    text = fh.read()
    fh.seek(0, os.SEEK_END)
    return text


def leave_group_stop(worker_id: int) -> None:
    """``worker_init_fn`` of the DataLoaders: each worker leaves the command's process group.
    A SIGTERM to the whole group (``kill -- -PGID``, a batch system's stop) killed the workers
    with it, and the main process failed with a DataLoader traceback before it could save
    ``last.ckpt``; outside the group they keep serving until the main process stops them (its
    ``terminate()`` still works: they keep the default SIGTERM), and they exit when it dies."""
    os.setpgid(0, 0)
