"""Checkpoint I/O on the package's low floor: one safe loader and one atomic writer.

Training (resume, ``init_from``, the distillation teacher) and inference (every command taking
CKPT, ``convert-esm``) read pickled checkpoints through :func:`safe_load` only, and every
checkpoint is written through :func:`save_atomic`. Nothing here imports training or inference.

Why so strict: unpickling runs code. :func:`safe_load` always calls
``torch.load(weights_only=True)`` explicitly (an explicit argument is not overridden by
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``; the variables are also cleared for the load, so setting
both cannot turn the refusal into a crash) with an allowlist per *source*: a Lightning
checkpoint may hold paths and numpy scalars, a fair-esm file also an ``argparse.Namespace``.
Any other object is refused with one line, never unpickled.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import pickle
import re
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from protein_performer.errors import UserError
from protein_performer.io.atomic import atomic_file

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # pickle protocol >= 2: torch's legacy (non-zip) format
_SHOW = 5  # offending names an error message lists
_CHUNK = 1 << 20  # bytes per write() of a checkpoint
#: A model's contact regression (``ContactRegression.to_dict()``, plain data) in a checkpoint.
CONTACT_REGRESSION_KEY = "contact_regression"
#: A zip checkpoint's entries may inflate to this many times the file, plus the slack.
_MAX_INFLATION, _INFLATION_SLACK = 4, 16 << 20
_ENV_VARS = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")


def _numpy_globals() -> list[Any]:
    """numpy scalars and dtypes (a metric logged as ``np.float64``): rebuilt without user code."""
    import numpy as np

    allowed: list[Any] = [np.dtype]
    for mod_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            allowed.append(__import__(mod_name, fromlist=["scalar"]).scalar)
            break
        except (ImportError, AttributeError):
            continue
    for name in ("Float64DType", "Float32DType", "Int64DType", "Int32DType", "BoolDType"):
        dtype_cls = getattr(getattr(np, "dtypes", None), name, None)
        if dtype_cls is not None:
            allowed.append(dtype_cls)
    return allowed


def allowed_globals(source: str) -> list[Any]:
    """The non-tensor types a checkpoint from ``source`` may hold.

    ``lightning``: paths (a callback's ``dirpath``) and numpy scalars; ``fair-esm``: those plus
    ``argparse.Namespace`` (ESM-2's ``cfg["model"]``; rebuilding one only sets attributes).
    """
    allowed: list[Any] = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath]
    allowed += [pathlib.PureWindowsPath, *_numpy_globals()]
    if source == "fair-esm":
        allowed.append(argparse.Namespace)
    elif source != "lightning":
        raise ValueError(f"unknown checkpoint source {source!r}")
    return allowed


@contextlib.contextmanager
def _no_weights_only_override() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in _ENV_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_inflation(src: Path) -> None:
    """Refuse a zip whose entries inflate far beyond the file before anything is unpickled:
    torch stores them uncompressed, and a 1 MB crafted file inflating to 1 GB peaked at 2.3 GB
    before the allowlist refused it."""
    size = src.stat().st_size
    try:
        with zipfile.ZipFile(src) as zf:
            inflated = sum(info.file_size for info in zf.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch.load reports a damaged file in its own words
    if inflated > _MAX_INFLATION * size + _INFLATION_SLACK:
        raise UserError(
            f"{src}: its zip entries inflate to {inflated:,} bytes from a {size:,}-byte file "
            "(torch stores them uncompressed): it is crafted; refusing to load it"
        )


def safe_load(path: str | os.PathLike[str], source: str = "lightning", what: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` with ``source``'s allowlist, on CPU.

    Raises ``UserError`` naming the file for a missing, empty, truncated or foreign file and
    for a pickle holding anything but tensors, plain containers and the allowlisted types.
    ``what`` says what the file should be, for the messages.
    """
    src = Path(path)
    what = what or "a .ckpt from `protein-performer train`"
    if not src.is_file():
        raise UserError(f"{src} is not a file: give {what}")
    with open(src, "rb") as fh:
        head = fh.read(4)
    if not head:
        raise UserError(f"{src} is empty (0 bytes): an interrupted copy or save? re-copy it")
    if not (head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC)):
        raise UserError(
            f"{src} is not a PyTorch checkpoint (it starts with {head!r}, not a zip or pickle "
            f"header); give {what}"
        )
    if head.startswith(_ZIP_MAGIC):
        _check_inflation(src)
    try:
        with (
            _no_weights_only_override(),
            torch.serialization.safe_globals(allowed_globals(source)),
        ):
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"(?:Unsupported global|unsupported GLOBAL): GLOBAL (\S+)", str(exc))
        found = found or re.search(r"GLOBAL (\S+)", str(exc))
        kind = f"a {found.group(1)}" if found else "a non-allowlisted object"
        raise UserError(
            f"{src} contains Python objects other than tensors; refusing to load ({kind}: "
            "unpickling it could run code). If you trust the file, re-save its weights in a "
            "trusted session (or `protein-performer export` it there)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError) as exc:
        raise UserError(
            f"{src}: cannot read the checkpoint: the file is truncated or damaged "
            f"({_first_line(exc)}); re-copy it or pick another checkpoint"
        ) from None


def _finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or infinity. A view with more elements than its storage (a
    zero stride: shape (1e6, 1e6) over one number) is checked through the storage, which bounds
    the work by the bytes in the file, not by the shape."""
    storage = t.untyped_storage()
    count = storage.nbytes() // t.element_size()
    if t.numel() > count and t.device.type != "meta":
        t = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (count,))
    return bool(t.isfinite().all())


def nonfinite_tensors(state: Mapping[str, Any]) -> list[str]:
    """Names of floating-point tensors in ``state`` holding a NaN or an infinity."""
    return [
        name
        for name, t in state.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not _finite(t)
    ]


def check_finite(state: Mapping[str, Any], where: object) -> None:
    """Refuse weights with NaN/inf: every output computed from them would be NaN too."""
    bad = nonfinite_tensors(state)
    if bad:
        more = f" (+{len(bad) - _SHOW} more)" if len(bad) > _SHOW else ""
        raise UserError(
            f"{where}: the weights are not finite (NaN or inf in {len(bad)} tensor(s): "
            f"{', '.join(bad[:_SHOW])}{more}); the run that wrote them diverged. Use an "
            "earlier checkpoint of that run"
        )


def checked_lightning(ckpt: Any, path: object, refusal: str) -> dict[str, Any]:
    """``ckpt`` (as loaded from ``path``) when it is a Lightning checkpoint (a ``state_dict``)
    with finite weights; otherwise the UserError ``refusal`` (or :func:`check_finite`'s)."""
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict)):
        raise UserError(refusal)
    check_finite(ckpt["state_dict"], path)
    return ckpt


def contents(ckpt: Any) -> str:
    """What a loaded file holds, for a message: a dict's first keys or the object's type."""
    if isinstance(ckpt, dict):
        return f"a dict with keys {sorted(map(str, ckpt))[:8]}"
    return type(ckpt).__name__


def load_lightning(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A Lightning checkpoint dict with finite weights (resume and inference read it so)."""
    ckpt = safe_load(path, "lightning")
    return checked_lightning(
        ckpt,
        path,
        f"{path} is not a protein-performer Lightning checkpoint (no 'state_dict'; it holds "
        f"{contents(ckpt)}); give a .ckpt from `protein-performer train` or an exported "
        "directory",
    )


def save_atomic(checkpoint: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file in ``path``'s own directory, fsynced, then renamed:
    a kill at any byte leaves the previous complete file (a temp in ``$TMPDIR`` would be
    copied across filesystems, which is not atomic). Non-finite weights are refused."""
    target = Path(path)
    state = checkpoint.get("state_dict")
    if isinstance(state, Mapping):
        check_finite(state, f"not writing {target}")
    buffer = io.BytesIO()
    torch.save(dict(checkpoint), buffer)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = buffer.getbuffer()
    with atomic_file(target) as tmp, open(tmp, "wb") as fh:
        for start in range(0, len(data), _CHUNK):  # bounded syscalls; no extra copy
            fh.write(data[start : start + _CHUNK])
    return target


_MAX_HEADER = 100 << 20  # bytes: a safetensors header larger than this is not a model's


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a ``.safetensors`` file's JSON header, reading only the header
    (never the tensors), so a config can be checked against the weights before allocating."""
    import struct

    from protein_performer.io.json_safe import parse_json

    src = Path(path)
    size = src.stat().st_size
    with open(src, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(_MAX_HEADER, size - 8):
            raise UserError(
                f"{src}: not a safetensors file (header length {n} in a {size}-byte file); the "
                "file is truncated or damaged: re-export"
            )
        header = parse_json(fh.read(n), f"{src}: safetensors header", "re-export")
    if not isinstance(header, dict):
        raise UserError(f"{src}: damaged safetensors header (not a mapping); re-export")
    shapes: dict[str, tuple[int, ...]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        ):
            raise UserError(f"{src}: damaged safetensors header entry {name!r}; re-export")
        shapes[name] = tuple(shape)
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise UserError(
            f"{src}: truncated: the header describes {8 + n + end} bytes, the file has {size}; "
            "re-export or re-copy it"
        )
    return shapes
