"""Value rules for settings read from configs and files: one line naming the key, never a
traceback from deep inside the code that used the value.

Used for the Hydra groups training relies on (``training.settings``) and for the JSON configs
of foreign model directories (``model.convert_esm``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protein_performer.errors import UserError


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
                text += f" {'>' if self.low_open else '>='} {self.low:g}"
            if self.high is not None:
                text += f"{' and' if self.low is not None else ''} <= {self.high:g}"
        extra = [repr(s) for s in self.also] + (["null"] if self.nullable else [])
        return text + (f" (or {' or '.join(extra)})" if extra else "")


def invalid(key: str, value: Any, what: str) -> UserError:
    """The one-line error for a value that breaks its rule."""
    return UserError(f"{key}={value!r} is not valid: it must be {what}")


def check_group(node: Mapping[str, Any] | None, prefix: str, rules: Mapping[str, Rule]) -> None:
    """Every key of ``node`` that ``rules`` knows must satisfy its rule; keys are named
    ``prefix + key`` in the message (``data.`` or ``config.json: ``)."""
    for key, rule in rules.items():
        if node is not None and key in node and not rule.accepts(node[key]):
            raise invalid(f"{prefix}{key}", node[key], rule.describe())
