"""Inference that scales from one process to a cluster: ranks, windows, parts, merge.

One design for ``embed``, ``score`` (and the resumable ``embed --resume``):

* the input is cut into **windows** of about ``WINDOW_BATCHES`` token budgets, in input order;
  window ``w`` belongs to rank ``w % world_size``, so ranks get similar numbers of tokens;
* each rank writes every finished window as one **part** file in ``OUT.parts/``, atomically
  (temp + fsync + rename): a kill loses at most the window in flight;
* when every rank is done (a gloo barrier), rank 0 **merges** the parts in (run, window) order
  into ``OUT``, which therefore holds the records in input order, exactly as a one-process run,
  and removes the parts.

Ranks come from the launcher: ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or SLURM
(``srun``: ``SLURM_PROCID``/``SLURM_NTASKS``, through Lightning's ``SLURMEnvironment``, which
also finds the main node). No MPI-built HDF5 is needed: every file has one writer.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from protein_performer.errors import UserError

log = logging.getLogger(__name__)

#: Records held at once, in token budgets: enough to sort by length for tight batches, few
#: enough that memory is bounded by a window, not by the input.
WINDOW_BATCHES = 32
#: A rank may wait this long at the final barrier for slower ranks (long proteins, big sets).
BARRIER_TIMEOUT = datetime.timedelta(hours=48)
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


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def device(self, device: str) -> str:
        """``auto``/``cuda`` -> this rank's own GPU when several ranks share a node."""
        if self.distributed and device in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return device


def detect_ranks() -> Ranks:
    """Ranks from ``torchrun`` or SLURM; one process otherwise.

    Under SLURM the main address and port come from Lightning's ``SLURMEnvironment`` (the first
    node of the allocation), so ``srun protein-performer embed ...`` needs no launcher script.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return Ranks(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        from lightning_fabric.plugins.environments import SLURMEnvironment

        env = SLURMEnvironment()
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        return Ranks(env.global_rank(), env.world_size(), env.local_rank())
    return Ranks()


def rank_label(what: str) -> str:
    """``what``, or ``what[rank R/N]`` in a sharded job (progress lines of several ranks)."""
    r = detect_ranks()
    return f"{what}[rank {r.rank}/{r.world_size}]" if r.distributed else what


class Job:
    """Process group set-up and barriers for a sharded run (a no-op for one process)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self._own_group = False

    def __enter__(self) -> Job:
        import torch.distributed as dist

        if self.ranks.distributed and not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                rank=self.ranks.rank,
                world_size=self.ranks.world_size,
                timeout=BARRIER_TIMEOUT,
            )
            self._own_group = True
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if self._own_group:
            dist.destroy_process_group()

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.ranks.distributed:
            dist.barrier()

    def all_ok(self, ok: bool) -> bool:
        """True when every rank's ``ok`` is: a rank that failed makes all of them stop."""
        import torch.distributed as dist

        if not self.ranks.distributed:
            return ok
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag) == 0


def parts_dir(out: Path) -> Path:
    """``OUT.parts/``: the finished windows of a run that has not been merged yet."""
    return out.with_name(out.name + ".parts")


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


def run_sharded(
    out: Path,
    suffix: str,
    batches: Iterable[list[R]],
    write_part: Callable[[Path, list[R]], None],
    merge: Callable[[list[Path]], int],
    fresh: bool,
    parts: Path | None = None,
) -> tuple[int, int]:
    """Run ``write_part`` on this rank's windows, then (rank 0) ``merge`` every part into ``out``.

    Returns (records this rank wrote, records in ``out`` after the merge; 0 on other ranks).
    ``fresh`` drops parts left by an earlier run first (resume keeps them). A failure on any
    rank stops every rank with that error (no rank is left waiting at a barrier); the parts
    already finished stay for a resume, an empty parts directory goes.
    """
    from protein_performer.io.atomic import output_file

    ranks = detect_ranks()
    pdir = parts or parts_dir(output_file(out))
    new = 0
    failure: BaseException | None = None
    with Job(ranks) as job:
        if ranks.rank == 0:
            if fresh and pdir.exists():
                shutil.rmtree(pdir)
            pdir.mkdir(exist_ok=True)
        job.barrier()
        run = next_run(pdir)
        job.barrier()  # every rank has its run number before any rank writes a part
        try:
            for w, window in enumerate(batches):
                if w % ranks.world_size == ranks.rank:
                    write_part(pdir / part_name(run, w, suffix), window)
                    new += len(window)
        except Exception as exc:  # every rank must learn of a failure, or the others wait
            failure = exc
        if not job.all_ok(failure is None):
            _drop_if_empty(pdir, ranks)
            raise failure or UserError("the run failed on another rank; see its error line")
        total = 0
        if ranks.rank == 0:
            try:
                total = merge(finished_parts(pdir))
                shutil.rmtree(pdir)
            except Exception as exc:  # the parts stay for a retry; the other ranks must not hang
                failure = exc
        if not job.all_ok(failure is None):
            _drop_if_empty(pdir, ranks)
            raise failure or UserError("merging the parts failed on rank 0; see its error line")
    return new, total


def _drop_if_empty(pdir: Path, ranks: Ranks) -> None:
    """A failed run that finished no window leaves no parts directory behind."""
    if ranks.rank == 0 and pdir.is_dir() and not any(pdir.iterdir()):
        pdir.rmdir()
