"""User-facing errors, and the checks that raise them: the CLI prints one clear message, never a
traceback from deep inside the code that used a bad value.

:class:`Rule` and :func:`check_group` check settings read from configs and files (the Hydra
groups ``training.settings`` relies on, the JSON configs of foreign model directories).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class UserError(Exception):
    """An error caused by the user's input (file, flag, config); its message says what to do.

    The CLI catches it, prints ``error: <message>`` and exits with status 2.
    """


def shown(text: object) -> str:
    """An id from the user's data (a record, an assay, a column) as a terminal message shows it:
    as written when every character is printable, else quoted with its control and invisible
    characters escaped (``repr``), so an id holding ``ESC[2J`` or an OSC title never drives
    the terminal. Every message that prints such an id goes through here."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def check_format_header(data: object, where: object, name: str, version: int, what: str) -> None:
    """Refuse a JSON file that is not ours (``format`` != ``name``) or is newer than this code.

    Every versioned file this package writes starts with ``format`` and ``format_version``, so
    a wrong or future file fails here with what it is and what to do, not later with a KeyError.
    """
    if not isinstance(data, dict) or data.get("format") != name:
        raise UserError(f"{where}: not a {what} (format != {name})")
    found = data.get("format_version")
    if found is None or not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise UserError(
            f"{where}: format_version is {'missing' if found is None else repr(found)}: the "
            f"file says it is a {what} but its header is damaged or was edited; re-create it"
        )
    if found > version:
        raise UserError(
            f"{where}: {what} format version {found!r} is newer than this protein-performer "
            f"reads ({version}); upgrade protein-performer"
        )


@dataclass(frozen=True)
class Rule:
    """What one config value may be: ``kind`` ``int``/``float``/``bool``/``str``, within
    ``[low, high]`` (``low_open``: strictly above ``low``), or one of ``also`` (sentinels,
    choices), or null when ``nullable``."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    nullable: bool = False
    also: tuple[Any, ...] = ()
    choices: tuple[str, ...] = ()

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if any(value == s and type(value) is type(s) for s in self.also):
            return True
        if self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = ok and math.isfinite(value)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.kind)
        if not ok:
            return False
        if self.choices:
            return value in self.choices
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            text = {int: "an integer", float: "a number", bool: "true or false"}.get(
                self.kind, f"a {self.kind.__name__}"
            )
            if self.low is not None:
                text += f" {'>' if self.low_open else '>='} {_number(self.low)}"
            if self.high is not None:
                text += f"{' and' if self.low is not None else ''} <= {_number(self.high)}"
        extra = [repr(s) for s in self.also] + (["null"] if self.nullable else [])
        return text + (f" (or {' or '.join(extra)})" if extra else "")


def _number(value: float) -> str:
    """An integer bound in full (4294967295, not 4.29497e+09), a float compactly."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def invalid(key: str, value: Any, what: str) -> UserError:
    """The one-line error for a value that breaks its rule."""
    return UserError(f"{key}={value!r} is not valid: it must be {what}")


def check_group(node: Mapping[str, Any] | None, prefix: str, rules: Mapping[str, Rule]) -> None:
    """Every key of ``node`` that ``rules`` knows must satisfy its rule; keys are named
    ``prefix + key`` in the message (``data.`` or ``config.json: ``)."""
    for key, rule in rules.items():
        if node is not None and key in node and not rule.accepts(node[key]):
            raise invalid(f"{prefix}{key}", node[key], rule.describe())
