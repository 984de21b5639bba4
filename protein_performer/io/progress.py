"""Progress that knows where it is written: a bar on a terminal, a line now and then in a log.

A tqdm bar redraws itself with carriage returns; in a SLURM log or a ``| tee`` file each redraw
is kept, and a day-long run leaves megabytes of them. When stderr is not a terminal, progress is
instead one plain line every ``PROGRESS_INTERVAL`` seconds (and one at the end).

A command counts whole windows of records, which can take minutes each (a pseudo-perplexity
score runs L forwards per record); the loops inside a window call :func:`beat` once per batch,
so the log still gets a line every interval, saying where in the window the run is.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds between progress lines when stderr is not a terminal
#: (``PROTEIN_PERFORMER_PROGRESS_INTERVAL`` overrides).
PROGRESS_INTERVAL = 30.0
#: Units shown as 1.2k / 3.4M (residues, bytes); counts of sequences or passes stay whole.
SCALED_UNITS = ("res", "B")


def interval() -> float:
    """The line interval in seconds, from the environment when set there."""
    value = os.environ.get("PROTEIN_PERFORMER_PROGRESS_INTERVAL")
    try:
        return max(0.0, float(value)) if value else PROGRESS_INTERVAL
    except ValueError:
        return PROGRESS_INTERVAL


def on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced stream
        return False


class LineProgress:
    """The tqdm calls the package uses (``update``, ``close``, a context manager), printing a
    line to stderr at most every ``interval()`` seconds and once when closed."""

    def __init__(self, total: float | None = None, unit: str = "it", desc: str = "") -> None:
        self.total, self.unit, self.desc = total, unit, desc
        self.n: float = 0  # stays an int while the updates are
        self.start = self._last = time.monotonic()
        self.every = interval()
        self.closed = False
        self._written: float | None = None  # the count the last line showed
        _OPEN.append(self)

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._write(now)

    def beat(self, note: str = "") -> None:
        """A line with ``note`` (the work inside the current step) if none for an interval."""
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._write(now, note)

    def _write(self, now: float, note: str = "") -> None:
        from tqdm import tqdm

        _flush_pending()

        meter = tqdm.format_meter(
            self.n, self.total, now - self.start, ncols=0, prefix=self.desc, unit=self.unit,
            unit_scale=self.unit in SCALED_UNITS,
        )  # fmt: skip
        print(f"{meter} ({note})" if note else meter, file=sys.stderr, flush=True)
        self._written = self.n

    def close(self) -> None:
        """The final line, unless the last one already showed the final count."""
        if not self.closed:
            self.closed = True
            if self in _OPEN:
                _OPEN.remove(self)
            if self._written != self.n:
                self._write(time.monotonic())

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The open line progresses, innermost last: where :func:`beat` goes.
_OPEN: list[LineProgress] = []
#: Lines for the start of the work, by topic, printed before the first progress output.
_PENDING: dict[str, str] = {}


def announce(line: str, topic: str = "threads") -> None:
    """A line for the start of the work (the threads in use), printed with the first progress
    output (a bar, a line or a :func:`beat` inside one): a command that stops at its input
    checks prints its error alone. A later line on the same topic replaces one not printed
    yet."""
    _PENDING[topic] = line


def drop_pending() -> None:
    """Forget start-of-work lines not printed yet: they belong to the command that ends."""
    _PENDING.clear()


def _flush_pending() -> None:
    while _PENDING:
        print(_PENDING.pop(next(iter(_PENDING))), file=sys.stderr, flush=True)


def beat(note: str = "") -> None:
    """Signs of life from inside a long step (one batch of a window): in log mode the innermost
    open progress prints its line, with ``note``, if it printed none for an interval; nothing
    otherwise (a terminal's bar, no progress, or a line printed recently). Costs a clock read.
    """
    if _OPEN:
        _flush_pending()
        _OPEN[-1].beat(note)


def total_later(bar: Any, count: Callable[[], float | None]) -> None:  # noqa: ANN401
    """Give ``bar`` its total once ``count()`` knows it (a scan of the input, in a background
    thread), so the work starts at once and the bar shows an ETA from then on."""

    def fill() -> None:
        try:
            total = count()
        except Exception:  # noqa: BLE001 - a total is a nicety: the work reports input errors
            return
        if total is not None and not getattr(bar, "disable", False):
            bar.total = total
            if hasattr(bar, "refresh"):
                bar.refresh()

    threading.Thread(target=fill, name="progress-total", daemon=True).start()


def progress(
    total: float | None = None, unit: str = "it", desc: str = "", enabled: bool = True
) -> Any:  # noqa: ANN401 - a tqdm bar or a LineProgress
    """A tqdm bar on a terminal, a :class:`LineProgress` otherwise, a silent one when disabled."""
    from tqdm import tqdm

    if not enabled:
        return tqdm(total=total, disable=True)
    if on_terminal():
        _flush_pending()
        return tqdm(total=total, unit=unit, unit_scale=unit in SCALED_UNITS, desc=desc)
    return LineProgress(total, unit, desc)
