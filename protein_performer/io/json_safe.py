"""JSON read from files a user hands us (model directories, sidecars, file headers), parsed so
that a damaged or crafted file is one ``UserError``, never a traceback.

``json.loads`` alone raises ``RecursionError`` on deeply nested brackets and ``ValueError``
(Python's integer string-conversion limit) on a 5,000-digit number, and a number just under
that limit breaks later arithmetic or messages. Here the text's size, nesting depth and
integer lengths are bounded before anything uses the data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from protein_performer.errors import UserError

#: Larger than any config or sidecar this package writes (a safetensors header has its own).
MAX_BYTES = 16 << 20
#: Deeper than any file this package reads (configs nest two or three levels).
MAX_DEPTH = 64
#: Digits of the longest integer accepted (2**63 has 19): anything longer is not a setting.
MAX_INT_DIGITS = 24

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*+"')
_NOT_BRACKETS = {c: None for c in range(128) if chr(c) not in "[]{}"}


def _depth(text: str) -> int:
    """The deepest bracket nesting of ``text`` (brackets inside strings not counted)."""
    brackets = _STRINGS.sub("", text).translate(_NOT_BRACKETS)
    depth = deepest = 0
    for char in brackets:
        if char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
        elif char in "]}":
            depth -= 1
    return deepest


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer with {len(text.lstrip('-'))} digits")
    return int(text)


def parse_json(text: str | bytes, where: object, fix: str = "re-create it") -> Any:
    """``text`` parsed, or a ``UserError`` naming ``where`` and what to do (``fix``)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{where}: not valid JSON (not UTF-8: {exc}); {fix}") from None
    if _depth(text) > MAX_DEPTH:
        raise UserError(
            f"{where}: not a valid file: JSON nested deeper than {MAX_DEPTH} levels; {fix}"
        )
    try:
        return json.loads(text, parse_int=_parse_int)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UserError(f"{where}: not valid JSON ({message}); {fix}") from None


def read_json(
    path: str | os.PathLike[str], fix: str = "re-create it", max_bytes: int = MAX_BYTES
) -> Any:
    """The JSON file at ``path`` (at most ``max_bytes``), through :func:`parse_json`."""
    src = Path(path)
    try:
        size = src.stat().st_size
        if size > max_bytes:
            raise UserError(
                f"{src}: {size:,} bytes, more than the {max_bytes:,} a file of this kind can "
                f"have; it is not one ({fix})"
            )
        data = src.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{src}: not found; {fix}") from None
    except OSError as exc:
        raise UserError(f"{src}: cannot read it ({exc.strerror or exc}); {fix}") from None
    return parse_json(data, src, fix)
