"""The output policy: the one rule every file or directory a command writes goes through.

Before any work, each output (a table, an HDF5 file, an export or store directory, a run
directory, a sidecar such as ``OUT.context.json``) is *claimed*:

* it is never one of the inputs, nor a directory holding one, nor inside an input directory (an
  export directory given as CKPT, a store, a folder of DMS files): the same file through any
  link counts, and ``--overwrite`` never licenses it;
* it is locked for the rest of the command (:func:`~protein_performer.io.atomic.exclusive_lock`:
  never through a link), so a second run writing it gets one line naming the live one;
* an existing output is replaced only with ``--overwrite`` (a resumable output directory, where a
  rerun continues, says so with ``exists_ok``).

The writers below it (:mod:`protein_performer.io.atomic`) then make every file appear complete
or not at all. ``-`` (standard output) is always fine. Each CLI command declares its outputs
(``OUTPUTS`` in its module), and ``tests/cli/test_cli_outputs.py`` walks the parsers to prove
that every one of them is refused here when it would replace or enter an input.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from protein_performer.errors import UserError
from protein_performer.io.atomic import exclusive_lock, lock_path
from protein_performer.io.ranks import detect_ranks

PathLike = str | os.PathLike[str]

#: The folder of finished windows beside a sharded output (``io.sharding.parts_dir``).
PARTS = ".parts"


def refuse_inputs(out: PathLike, inputs: Iterable[PathLike | None]) -> None:
    """A ``UserError`` when ``out`` is an input, holds one, or lies inside an input directory
    (resolved through links; hard links count as the same file). ``-`` and missing inputs
    (said by their reader) are skipped."""
    path = Path(out).expanduser()
    target = path.resolve()
    for given in inputs:
        if given is None or os.fspath(given) == "-" or not Path(given).expanduser().exists():
            continue
        src = Path(given).expanduser().resolve()
        same = target == src or (path.exists() and os.path.samefile(path, src))
        if same:
            how = "the input"
        elif target in src.parents:
            how = "a directory holding the input"
        elif src.is_dir() and src in target.parents:
            how = "inside the input directory"
        else:
            continue
        raise UserError(
            f"{out} is {how} {given}: an output never replaces an input nor goes inside "
            "one (--overwrite included); choose another output path"
        )


@contextlib.contextmanager
def claim_output(
    out: PathLike,
    inputs: Iterable[PathLike | None],
    overwrite: bool,
    what: str = "its output",
    *,
    exists_ok: bool = False,
    sidecars: Sequence[str] = (),
) -> Iterator[Path]:
    """Claim ``out`` for the block (module docstring): inputs refused, for ``out`` and for
    what is written beside it (its lock, ``OUT.parts/`` and the ``sidecars`` suffixes, e.g.
    ``.linearize.pt``), the lock held (rank 0 of a sharded job holds it for the job), an
    existing ``out`` refused without ``overwrite`` unless ``exists_ok``. Yields the path."""
    path = Path(out).expanduser()
    inputs = list(inputs)
    for written in (path, lock_path(path), *(sidecar(path, s) for s in (PARTS, *sidecars))):
        refuse_inputs(written, inputs)
    with contextlib.ExitStack() as stack:
        if detect_ranks().rank == 0 and path.parent.is_dir():  # a missing directory: said later
            stack.enter_context(exclusive_lock(path, what))
        if (path.exists() or path.is_symlink()) and not overwrite and not exists_ok:
            raise UserError(
                f"{out} already exists: pass --overwrite to replace it, or choose another output"
            )
        yield path


def sidecar(out: PathLike, suffix: str) -> Path:
    """The sidecar file of output ``out`` (``OUT.context.json``): an output of its own."""
    return Path(f"{os.fspath(Path(out).expanduser())}{suffix}")
