"""``-``: standard input as a file. Every reader of FASTA takes ``-`` for standard input, which is
copied once per process to a temporary file (removed at exit), so a second read and the
location of a file-level error work as on a file; messages name it ``<stdin>``."""

from __future__ import annotations

import contextlib
import os

from protein_performer.errors import UserError

#: The path that means standard input, and the name errors give it.
STDIN = "-"
STDIN_NAME = "<stdin>"
_stdin_copies: list[tuple[object, str]] = []  # (the stdin object read, its copy)


def display_name(path: str | os.PathLike[str]) -> str:
    """The name a message gives ``path``: ``<stdin>`` for ``-``."""
    text = os.fspath(path)
    return STDIN_NAME if text == STDIN else text


def stdin_copy() -> str:
    """Standard input copied to a temporary file (removed at exit), once per process: what
    ``-`` reads, so a second read and the location of a file-level error work as on a file."""
    import sys

    src = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else sys.stdin
    for seen, copy in _stdin_copies:
        if seen is src:
            return copy
    import atexit
    import shutil
    import tempfile

    fd, copy = tempfile.mkstemp(prefix="protein-performer-stdin-", suffix=".fasta")
    try:
        with os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except OSError as exc:
        os.unlink(copy)
        raise UserError(f"cannot read standard input: {exc}") from exc
    atexit.register(_remove_quietly, copy)
    _stdin_copies.append((src, copy))
    return copy


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
