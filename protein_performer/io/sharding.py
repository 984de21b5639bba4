"""Inference that scales from one process to a cluster: ranks, windows, parts, merge.

One design for ``embed``, ``score`` (and the resumable ``embed --resume``):

* the input is cut into **windows** of about ``WINDOW_BATCHES`` token budgets, in input order;
  window ``w`` belongs to rank ``w % world_size``, so ranks get similar numbers of tokens;
* each rank writes every finished window as one **part** file in ``OUT.parts/``, atomically
  (temp + fsync + rename): a kill loses at most the window in flight;
* when every rank is done (a gloo barrier), rank 0 **merges** the parts in (run, window) order
  into ``OUT``, which therefore holds the records in input order, exactly as a one-process run,
  and removes the parts.

Ranks come from the launcher (:mod:`protein_performer.io.ranks`): ``torchrun``
(``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or SLURM (``srun``: ``SLURM_PROCID``/``SLURM_NTASKS``,
through Lightning's ``SLURMEnvironment``, which also finds the main node). No MPI-built HDF5
is needed: every file has one writer.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from protein_performer.errors import UserError
from protein_performer.io.atomic import output_file
from protein_performer.io.outputs import PARTS, sidecar
from protein_performer.io.ranks import Ranks, detect_ranks

log = logging.getLogger(__name__)

#: Records held at once, in token budgets: enough to sort by length for tight batches, few
#: enough that memory is bounded by a window, not by the input.
WINDOW_BATCHES = 32
#: Environment variables (seconds) bounding the waits of a sharded run. INIT: how long ranks
#: wait for each other to start (a rank that never comes, e.g. one that failed before meeting
#: the others under srun); WAIT: how long a rank that finished waits for slower ones (long
#: proteins, big sets). A rank that fails says so to the others, who stop at once, and a rank
#: that dies is noticed by its lost connection: these bound only ranks that stay silent.
INIT_TIMEOUT_ENV = "PROTEIN_PERFORMER_INIT_TIMEOUT"
WAIT_TIMEOUT_ENV = "PROTEIN_PERFORMER_WAIT_TIMEOUT"
INIT_TIMEOUT = datetime.timedelta(minutes=5)
BARRIER_TIMEOUT = datetime.timedelta(hours=48)
#: Seconds between looks at whether another rank failed, while this one waits.
POLL_SECONDS = 0.2
_PART = re.compile(r"^run(\d{4})-w(\d{9})\.[a-z0-9]+$")

R = TypeVar("R")


def windows(records: Iterable[R], toks_per_batch: int, length=len) -> Iterator[list[R]]:
    """Consecutive groups of records of about ``WINDOW_BATCHES`` token budgets each.

    ``length(record)`` gives its residues (``len`` for plain strings).
    """
    budget = WINDOW_BATCHES * max(1, toks_per_batch)
    window: list[R] = []
    size = 0
    for rec in records:
        window.append(rec)
        size += length(rec) + 2
        if size >= budget:
            yield window
            window, size = [], 0
    if window:
        yield window


#: The store key where the first rank that fails leaves its line (one per process group).
_FAILED = "protein_performer/failed"


def _timeout(env: str, default: datetime.timedelta) -> datetime.timedelta:
    """``default``, or the seconds the environment variable ``env`` gives."""
    text = os.environ.get(env)
    if text is None or not text.strip():
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e9:
        raise UserError(f"{env}={text!r}: give a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


class Job:
    """The process group of a sharded run, for as long as the block (a no-op for one process).

    Every wait polls: a rank that fails posts its error line in the group's store, and the
    others, waiting at a barrier or between windows, stop with it instead of waiting for a rank
    that will never come; a rank that dies (kill -9) closes its connections, which the others
    notice too. ``options`` (names -> text) must be the same on every rank: the first
    difference is one line, before any work. A group that already exists (the CLI's, from
    ``join_ranks``) is reused, so a command meets the others once, before loading its model.
    """

    _count = 0  # Jobs entered in this process: every rank enters them in the same order

    def __init__(self, ranks: Ranks, options: dict[str, str] | None = None) -> None:
        self.ranks = ranks
        self.options = options or {}
        self._own_group = False
        self._store = None
        self._failed_here = False

    def __enter__(self) -> Job:
        import torch.distributed as dist

        if not self.ranks.distributed:
            return self
        Job._count += 1
        self._key = f"protein_performer/job{Job._count}"
        if not dist.is_initialized():
            self._init_group()
            self._own_group = True
        from torch.distributed.distributed_c10d import _get_default_store

        self._store = _get_default_store()
        try:
            self._agree()
        except BaseException:
            self.__exit__(*__import__("sys").exc_info())
            raise
        return self

    def _init_group(self) -> None:
        import torch.distributed as dist

        init = _timeout(INIT_TIMEOUT_ENV, INIT_TIMEOUT)
        r = self.ranks
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        try:
            store, _, _ = next(dist.rendezvous("env://", r.rank, r.world_size, timeout=init))
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("protein_performer", store),
                rank=r.rank,
                world_size=r.world_size,
                timeout=_timeout(WAIT_TIMEOUT_ENV, BARRIER_TIMEOUT),
            )
        except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
            raise UserError(
                f"rank {r.rank}: the {r.world_size} ranks did not all meet at {where} within "
                f"{init.total_seconds():g} s (a rank failed to start or is elsewhere; see the "
                f"other ranks' error lines; {INIT_TIMEOUT_ENV} sets the wait): "
                f"{str(exc).splitlines()[0][:200]}"
            ) from None

    def _agree(self) -> None:
        """Compare every rank's options with rank 0's; one line names the first difference."""
        import json

        store, r = self._store, self.ranks
        store.set(f"{self._key}/options/{r.rank}", json.dumps(self.options, sort_keys=True))
        self.barrier()
        mine = self.options
        for other in range(r.world_size):
            theirs = json.loads(store.get(f"{self._key}/options/{other}"))
            if theirs == mine:
                continue
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            name = diff[0]
            raise UserError(
                f"ranks disagree on their options before any work: {name} is "
                f"{mine.get(name, '(not set)')} on rank {r.rank} but "
                f"{theirs.get(name, '(not set)')} on rank {other}; launch every rank with the "
                "same command"
            )

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        import torch.distributed as dist

        if exc is not None and self.ranks.distributed:
            self.fail(exc)
        # After a failure a collective may still be pending, which destroying would wait for:
        # the group then ends with the process.
        if self._own_group and dist.is_initialized() and exc is None:
            dist.destroy_process_group()

    def fail(self, exc: object) -> None:
        """Tell the other ranks this one failed (best effort: the store may be gone)."""
        if self._store is None or self._failed_here or isinstance(exc, _OtherRankError):
            return
        self._failed_here = True
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        try:
            if not self._store.check([_FAILED]):
                self._store.set(_FAILED, f"rank {self.ranks.rank}: {text}"[:500])
        except Exception:  # noqa: BLE001 - the others then notice the closed connection
            pass

    def check(self) -> None:
        """Raise if another rank failed: a rank between windows stops within one window."""
        if self._store is None:
            return
        key = _FAILED
        try:
            failed = self._store.check([key])
            said = self._store.get(key).decode() if failed else ""
        except Exception:  # noqa: BLE001 - the store's host (rank 0 under srun) is gone
            raise self._lost() from None
        if failed:
            raise _OtherRankError(f"rank {self.ranks.rank}: stopping because {said}")

    def _lost(self) -> UserError:
        return _OtherRankError(
            f"rank {self.ranks.rank}: lost the connection to the other ranks (one of them "
            "stopped or was killed; see its error line)"
        )

    def _wait(self, work: Any) -> None:  # noqa: ANN401 - a torch.distributed Work
        """Wait for a collective, looking for another rank's failure meanwhile."""
        import time

        limit = _timeout(WAIT_TIMEOUT_ENV, BARRIER_TIMEOUT).total_seconds()
        deadline = time.monotonic() + limit
        while not work.is_completed():
            self.check()
            if time.monotonic() > deadline:
                raise UserError(
                    f"rank {self.ranks.rank}: waited {limit:g} s for the other ranks "
                    f"({WAIT_TIMEOUT_ENV} sets the wait)"
                )
            time.sleep(POLL_SECONDS)
        try:
            work.wait()
        except RuntimeError:  # a peer's connection closed: it died
            self.check()  # its own line, if it could leave one
            raise self._lost() from None

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.ranks.distributed:
            self._wait(dist.barrier(async_op=True))


class _OtherRankError(UserError):
    """This rank stops because another one failed (it must not post a failure of its own)."""


def parts_dir(out: Path) -> Path:
    """``OUT.parts/``: the finished windows of a run that has not been merged yet."""
    return sidecar(out, PARTS)


def part_name(run: int, window: int, suffix: str) -> str:
    return f"run{run:04d}-w{window:09d}{suffix}"


def finished_parts(directory: Path) -> list[Path]:
    """Complete parts in merge order (run, then window); temp files of killed writers are not
    parts (they never got their final name)."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _PART.match(p.name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), p))
    return [p for _, _, p in sorted(found)]


def next_run(directory: Path) -> int:
    """The run number for new parts: one past the last run that left parts."""
    runs = [int(_PART.match(p.name).group(1)) for p in finished_parts(directory)]  # type: ignore[union-attr]
    return max(runs, default=-1) + 1


def spread(batches: Iterable[list[R]], ranks: Ranks) -> Iterator[list[R]]:
    """``batches``, except that an input of a single window is cut by records into one window
    per rank (in order), so no rank idles on a small input."""
    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    second = next(it, None)
    if second is not None or not ranks.distributed or len(first) < 2:
        yield first
        if second is not None:
            yield second
            yield from it
        return
    n = min(ranks.world_size, len(first))
    for k in range(n):
        yield first[k * len(first) // n : (k + 1) * len(first) // n]


def run_sharded(
    out: Path,
    suffix: str,
    batches: Iterable[list[R]],
    write_part: Callable[[Path, list[R]], None],
    merge: Callable[[list[Path]], int],
    fresh: bool,
    parts: Path | None = None,
    options: dict[str, str] | None = None,
) -> tuple[int, int]:
    """Run ``write_part`` on this rank's windows, then (rank 0) ``merge`` every part into ``out``.

    Returns (records this rank wrote, records in ``out`` after the merge; 0 on other ranks).
    ``fresh`` drops parts left by an earlier run first (resume keeps them). ``options`` must be
    equal on every rank (checked before any work). A failure on any rank stops every rank
    within a window or a poll (:class:`Job`); the parts already finished stay for a resume,
    an empty parts directory goes.
    """
    ranks = detect_ranks()
    pdir = parts or parts_dir(output_file(out))
    new = 0
    with Job(ranks, options) as job:
        try:
            if ranks.rank == 0:
                if fresh and pdir.exists():
                    shutil.rmtree(pdir)
                pdir.mkdir(exist_ok=True)
            job.barrier()
            run = next_run(pdir)
            job.barrier()  # every rank has its run number before any rank writes a part
            for w, window in enumerate(spread(batches, ranks)):
                job.check()
                if w % ranks.world_size == ranks.rank:
                    write_part(pdir / part_name(run, w, suffix), window)
                    new += len(window)
            job.barrier()  # every part is written
            total = 0
            if ranks.rank == 0:
                total = merge(finished_parts(pdir))
                shutil.rmtree(pdir)
            job.barrier()  # the others learn whether the merge worked
        except BaseException:
            _drop_if_empty(pdir, ranks)
            raise
    return new, total


def _drop_if_empty(pdir: Path, ranks: Ranks) -> None:
    """A failed run that finished no window leaves no parts directory behind."""
    if ranks.rank == 0 and pdir.is_dir() and not any(pdir.iterdir()):
        pdir.rmdir()
