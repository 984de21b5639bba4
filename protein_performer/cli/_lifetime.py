"""The lifetime of one ``protein-performer`` command: what it holds until it returns (output
locks, a rank's process group), SIGTERM and Ctrl-C turned into one line and an exit status, the
output rule of every writing command (:func:`check_output`) and a sharded job's ranks."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from protein_performer.errors import UserError
from protein_performer.io.processes import Stopped

#: What the running command holds until it returns (output locks, a rank's process group).
_SCOPE: list[contextlib.ExitStack] = []


@contextlib.contextmanager
def command_scope(sigterm: bool = True) -> Iterator[None]:
    """The lifetime of one command (``main`` runs each in one): what :func:`hold` takes is
    released when the command ends, by an error or a stop too. With ``sigterm`` (every command
    but those whose trainer saves on SIGTERM itself), SIGTERM raises :class:`Stopped` in this
    process, so its locks and temporaries go as they do on Ctrl-C (a forked child dies as
    before)."""
    import signal
    import threading

    from protein_performer.io.progress import drop_pending

    owner = os.getpid()

    def stop(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked worker: the default death
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Stopped

    install = sigterm and threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, stop) if install else None
    with contextlib.ExitStack() as stack:
        _SCOPE.append(stack)
        try:
            yield
        finally:
            _SCOPE.remove(stack)
            drop_pending()  # a `threads:` line never printed (--no-progress) stays this one's
            if install:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def hold(cm: contextlib.AbstractContextManager[Any]) -> None:
    """Enter ``cm`` for the rest of the running command (outside :func:`command_scope`, a
    direct call of a command's ``run``: until the process exits)."""
    if not _SCOPE:
        _SCOPE.append(contextlib.ExitStack())  # never closed: the process's exit releases it
    _SCOPE[-1].enter_context(cm)


def join_ranks(args: argparse.Namespace) -> None:
    """Under torchrun/srun, meet the other ranks before any work and check that every rank was
    given the same options (one line naming the first difference); a no-op in one process.

    The process group lives as long as the command, so a rank that fails later (a bad
    checkpoint on one node) makes the others stop instead of waiting for it."""
    from protein_performer.io.ranks import detect_ranks
    from protein_performer.io.sharding import Job

    ranks = detect_ranks()
    if not ranks.distributed:
        return
    local = {"func", "overrides", "verbose", "no_progress", "threads", "device"}
    options = {k: v for k, v in sorted(vars(args).items()) if k not in local}
    hold(Job(ranks, {k: repr(v) for k, v in options.items()}))


def rank_line(records: int, did: str) -> bool:
    """On a rank other than 0 of a sharded job, say what this rank did (``rank 1: no records``
    on an idle one) and return True: rank 0 alone reports the merged output."""
    from protein_performer.io.ranks import detect_ranks

    rank = detect_ranks().rank
    if rank == 0:
        return False
    print(
        f"rank {rank}: {did} {records} record(s) into parts that rank 0 merges"
        if records
        else f"rank {rank}: no records"
    )
    return True


def _check_stdout() -> None:
    """Refuse ``-`` when standard output is closed (``cmd >&-``: Python then has no
    ``sys.stdout``), before any work, instead of a traceback at the first write."""
    import io

    try:
        if sys.stdout is not None:
            os.fstat(sys.stdout.fileno())
            return
    except io.UnsupportedOperation:  # a stream in memory (a notebook, a test): it writes
        return
    except (OSError, ValueError):  # closed
        pass
    raise UserError(
        "the output is '-' but standard output is closed; give an output file or redirect "
        "standard output"
    )


def check_output(
    out: str | os.PathLike[str] | None,
    inputs: Iterable[str | os.PathLike[str] | None],
    overwrite: bool,
    what: str = "its output",
    *,
    exists_ok: bool = False,
    sidecars: Sequence[str] = (),
) -> None:
    """Claim ``out`` under the output policy (:mod:`protein_performer.io.outputs`) for the rest
    of the command (:func:`hold`), before any work: never an input, a directory holding one or
    a path inside an input directory, locked against a second run, replaced only with
    ``--overwrite``. ``-`` (standard output) is always fine, when standard output is open."""
    if out is not None and os.fspath(out) == "-":
        _check_stdout()
    if out is None or os.fspath(out) == "-":
        return
    from protein_performer.io.outputs import claim_output

    hold(claim_output(out, inputs, overwrite, what, exists_ok=exists_ok, sidecars=sidecars))


#: Exit status of a command stopped by SIGTERM (128 + 15, as the shell reports it; as train).
SIGTERM_EXIT = 143


@contextlib.contextmanager
def stop_hint(describe: Callable[[], str]) -> Iterator[None]:
    """A command stopped by Ctrl-C or SIGTERM says ``"<how>: " + describe()`` (what it kept and
    how to continue, read at the stop) in one line and exits 130 or 143, as ``train`` does."""
    from protein_performer.io.processes import sigterm_raises

    try:
        with sigterm_raises():
            yield
    except KeyboardInterrupt as exc:
        how = "SIGTERM" if isinstance(exc, Stopped) else "interrupted"
        print(f"{how}: {describe()}", file=sys.stderr)
        raise SystemExit(SIGTERM_EXIT if isinstance(exc, Stopped) else 130) from None


def resume_hint(out: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """:func:`stop_hint` for a command with ``--resume`` that writes parts: how many finished
    parts it kept."""
    from protein_performer.io.atomic import output_file
    from protein_performer.io.sharding import finished_parts, parts_dir

    def kept() -> str:
        pdir = parts_dir(output_file(out))
        return (
            f"{len(finished_parts(pdir))} finished part(s) kept in {pdir}; rerun the same "
            "command with --resume to continue (only the window in flight is redone)"
        )

    return stop_hint(kept)
