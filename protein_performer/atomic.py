"""Atomic file output: every file this package writes appears complete or not at all.

A temporary sibling is written and then renamed over the target with ``os.replace`` (atomic on
one filesystem), so a crash, Ctrl-C or full disk never leaves a half-written output that looks
valid, and a failure removes the temporary file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def default_file_mode() -> int:
    """What ``open(path, "w")`` would give: 0o666 minus the umask (``mkstemp`` gives 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_file(path: Path, suffix: str = ".tmp", mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (its directory must exist) to write; on success it
    is renamed over ``path`` with ``mode`` (default: :func:`default_file_mode`), on failure
    deleted. ``suffix`` is for writers that pick a format from the file name."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, default_file_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> Path:
    """Write UTF-8 ``text`` (newlines as given) to ``path`` atomically, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    return path
