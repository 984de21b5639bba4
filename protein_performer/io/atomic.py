"""Atomic file output: every file this package writes appears complete or not at all.

A temporary sibling is written, flushed to disk (fsync) and renamed over the target with
``os.replace`` (atomic on one filesystem; the temporary lives in the target's own directory, so
it is always the same filesystem), then the directory entry is fsynced. A crash, kill -9, Ctrl-C
or full disk never leaves a half-written output that looks valid, and a failure removes the
temporary file. Temporaries are named after their host and process
(``.NAME.HOST.PID.XXXX.tmp``), so the next write of the same target removes those left by a
killed process of this host; others are left alone (they may belong to a live writer).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from protein_performer.errors import UserError


def output_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as an output file, or a ``UserError`` for the user's two usual mistakes: a
    directory given as the file, and a parent directory that does not exist. A trailing
    separator names a directory too, existing or not (``Path`` drops it: ``export CKPT dir/
    --merge`` wrote a file named ``dir``)."""
    out = Path(path).expanduser()
    if out.is_dir() or os.fspath(path).endswith(("/", os.sep)):
        raise UserError(f"{out} is a directory; give a file name for the output")
    if not out.parent.exists():
        raise UserError(f"output directory {out.parent} does not exist; create it first")
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """What ``open(path, "w")`` would give: 0o666 minus the umask (``mkstemp`` gives 0o600)."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """What ``mkdir`` would give: 0o777 minus the umask (``mkdtemp`` gives 0o700)."""
    return 0o777 & ~_umask()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def temp_prefix(path: Path, pid: int | None = None) -> str:
    """The name prefix of the temporaries for ``path`` of process ``pid`` (default: this one)."""
    return f".{path.name}.{_host()}.{os.getpid() if pid is None else pid}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(directory: Path, name: str | None = None) -> list[Path]:
    """Delete the temporaries in ``directory`` (of target ``name``, or of any target) left by
    dead processes of this host; returns them.

    Directories (an export or a store being assembled) are removed too. Another host's
    temporaries cannot be judged from here and are kept.
    """
    import shutil

    target = re.escape(name) if name is not None else r"[^/]+"
    pattern = re.compile(rf"^\.{target}\.{re.escape(_host())}\.(\d+)\.[^/]*\.tmp(\.\w+)?$")
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        found = pattern.match(entry.name)
        if not found or _alive(int(found.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


#: errno values of a full disk (or a full quota, which the user meets the same way).
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or h5py's, which carries the errno only in its text) is a
    full disk."""
    if isinstance(exc, UserError):
        return False
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return True
    text = str(exc)  # h5py, safetensors (its own type), torch.save (RuntimeError)
    return any(s in text for s in ("No space left on device", "errno = 28", "os error 28"))


def _device(path: Path) -> str:
    """The mount point holding ``path`` and its device (``/scratch (/dev/sdb1)``): where the
    user must free space."""
    mount = Path(os.path.abspath(path))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            devices = {f[1]: f[0] for f in (line.split() for line in fh) if len(f) > 1}
    except OSError:
        devices = {}
    dev = devices.get(str(mount))
    return f"{mount} ({dev})" if dev and dev != str(mount) else str(mount)


def disk_full_error(path: str | os.PathLike[str]) -> UserError:
    """The one line for a write that ran out of space (what was partly written is removed)."""
    return UserError(
        f"no space left on {_device(Path(path))} writing {path}; nothing was left behind: free "
        "space there or choose another output"
    )


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk (best effort for directories:
    some filesystems refuse to fsync a directory)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not path.is_dir() or exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def make_temp_dir(path: Path) -> Path:
    """A temporary directory beside ``path`` (named like :func:`atomic_file`'s files) with the
    mode ``mkdir`` would give, so a published directory follows the umask."""
    remove_stale_temps(path.parent, path.name)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))
    os.chmod(tmp, default_dir_mode())
    return tmp


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def replace_dir(src: Path, dst: Path) -> None:
    """Put the complete directory ``src`` at ``dst`` (same filesystem), deleting an old ``dst``.

    An existing ``dst`` is exchanged with ``src`` in one atomic step where the kernel allows it,
    so at every moment ``dst`` is the complete old or the complete new directory; elsewhere the
    old one is moved aside first (a kill in between leaves it at ``.NAME.HOST.PID.old.tmp``).
    """
    import shutil

    fsync_path(src)
    if not dst.exists():
        os.replace(src, dst)
    elif _exchange(src, dst):
        shutil.rmtree(src, ignore_errors=True)
    else:
        old = dst.with_name(f"{temp_prefix(dst)}old.tmp")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(dst.parent)


@contextlib.contextmanager
def atomic_file(path: Path, suffix: str = ".tmp", mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (its directory must exist) to write; on success it
    is fsynced and renamed over ``path`` with ``mode`` (default: :func:`default_file_mode`), on
    failure deleted. ``suffix`` is for writers that pick a format from the file name."""
    path = Path(path)
    remove_stale_temps(path.parent, path.name)
    fd, name = tempfile.mkstemp(
        prefix=temp_prefix(path),
        suffix=suffix if suffix == ".tmp" else f".tmp{suffix}",
        dir=path.parent,
    )
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, default_file_mode() if mode is None else mode)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(path) from None
        raise


def write_text_atomic(path: Path, text: str) -> Path:
    """Write UTF-8 ``text`` (newlines as given) to ``path`` atomically, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    return path


#: Lock files this process holds (path -> depth): a command that locks its output and then
#: calls a writer that locks the same output (``preprocess`` and its store) holds it once.
_HELD: dict[str, int] = {}
#: The descriptors of those locks, closed in every forked child (below).
_LOCK_FDS: set[int] = set()


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, a pool process): close the copies of the
    parent's lock descriptors. A ``flock`` lives as long as any descriptor of it, so a child
    that kept them would hold the parent's outputs locked after the parent died (kill -9)."""
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _holder(lock: Path) -> str:
    """Who holds ``lock``, as its holder wrote it (``pid N on HOST``), or ``another run``."""
    try:
        text = lock.read_text(encoding="utf-8").split()
    except OSError:
        return "another run"
    if len(text) >= 2 and text[0].isdigit():
        return f"another run (pid {text[0]} on {text[1]})"
    return "another run"


def lock_path(path: Path) -> Path:
    """The hidden lock file of output ``path`` (``.NAME.lock`` beside it)."""
    return path.parent / f".{path.name}.lock"


def _open_lock(lock: Path, path: Path) -> int:
    """The descriptor of the lock file ``lock`` (of output ``path``), never through a link.

    ``O_NOFOLLOW`` refuses a symbolic link planted under the lock's name (``ln -s ~/victim
    .out.csv.lock`` would otherwise truncate the victim to our pid); an existing file is used
    only when it is a plain file of this user with one name (a hard link to someone's file is
    refused the same way). ``O_CLOEXEC``: a program this process runs never inherits it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(lock, flags, default_file_mode())
    except FileNotFoundError:
        where = path.parent
        raise UserError(f"output directory {where} does not exist; create it first") from None
    except PermissionError:
        raise UserError(
            f"cannot open the lock file {lock} of {path} (permission denied: another user's "
            "lock, or a directory you cannot write): remove it or choose another output"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UserError(
            f"the lock file {lock} of {path} is a symbolic link; refusing to follow it (someone "
            "may be trying to overwrite the file it points to): remove it or choose another output"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        os.close(fd)
        raise UserError(
            f"the lock file {lock} of {path} is not a plain file of yours (a hard link, another "
            "user's file or a special file); refusing to use it: remove it or choose another "
            "output"
        )
    return fd


@contextlib.contextmanager
def exclusive_lock(path: Path, what: str, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on a hidden lock file beside ``path`` for the block.

    Two runs writing the same output would otherwise race (the second one's ``--overwrite``
    pulling the file from under the first); the second one gets one line naming the holder's
    pid and host, which the holder writes into the lock file; with ``wait`` it waits for the
    lock instead (a shared cache, where the second one then reads what the first wrote). The
    lock dies with its process (kill -9 included), so a crash never leaves it held; the file is
    removed on release (a run that locked a file unlinked meanwhile sees it and retries).
    Re-entrant within a process.
    """
    lock = lock_path(path)
    key = os.path.abspath(lock)
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            if key in _HELD:  # the outer holder may have let go first (an error on the way)
                _HELD[key] -= 1
        return
    while True:
        fd = _open_lock(lock, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"{path} is in use by {_holder(lock)} writing {what} there; wait for it to "
                "finish (or stop it) or choose another output; --overwrite and --resume never "
                "take an output from a live run"
            ) from None
        try:
            if os.lstat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # locked a file its holder had just removed: take the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {_host()}\n".encode())
    except OSError:  # a full disk: the lock holds all the same, only the holder stays unnamed
        pass
    _HELD[key] = 1
    _LOCK_FDS.add(fd)
    try:
        yield
    finally:
        _HELD.pop(key, None)
        if fd in _LOCK_FDS:  # else a forked child leaving the block: its copy went at the fork
            _LOCK_FDS.discard(fd)
            with contextlib.suppress(OSError):
                if os.lstat(lock).st_ino == os.fstat(fd).st_ino:  # ours, not a swapped-in name
                    lock.unlink()
            os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` only on success.

    :func:`atomic_file` behind the checks a CLI output needs first: a
    directory or a missing parent directory is the user's mistake, said as such.
    """
    out = output_file(path)
    with atomic_file(out) as tmp:
        yield tmp


@contextlib.contextmanager
def text_output(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """A text file written atomically (:func:`atomic_output`), or standard output for ``-``.

    ``-`` lets a table or FASTA go into a pipe; a pipe closed early (``| head``) ends the
    command quietly instead of with a traceback.
    """
    if str(path) == "-":
        try:
            yield sys.stdout
            sys.stdout.flush()
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return
    with atomic_output(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        yield fh


def publish_directory(
    out_dir: str | os.PathLike[str],
    files: Mapping[str, Callable[[Path], Any]],
    overwrite: bool,
    what: str,
    is_ours: Callable[[Path], bool],
) -> Path:
    """Write ``files`` (name -> writer of that path) into a temporary sibling of ``out_dir`` and
    put it in place atomically. A non-empty ``out_dir`` is replaced only when ``is_ours`` says
    it holds ``what`` and ``overwrite`` is set: an unrelated directory is never deleted."""
    out = Path(out_dir).expanduser()
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{out} exists and is not a directory; choose another output")
        if any(out.iterdir()):
            if not is_ours(out):
                raise UserError(f"{out} is a non-empty directory that is not {what}; refusing")
            if not overwrite:
                raise UserError(f"{out} already holds {what}; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out)
    try:
        for name, write in files.items():
            write(tmp / name)
            os.chmod(tmp / name, default_file_mode())
            fsync_path(tmp / name)
        replace_dir(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # safetensors says so in its own exception type
            raise disk_full_error(out) from None
        raise
    return out
