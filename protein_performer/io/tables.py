"""Delimited tables: which delimiter a name means, and one CSV/TSV written by parts.

``score`` and ``predict`` write one row per record in input order; on a cluster every rank
writes its windows as parts that rank 0 merges (:mod:`protein_performer.io.sharding`), and
``-`` streams the merged table to standard output (one process only). This module is that
skeleton, written once; the callers say what a row holds.
"""

from __future__ import annotations

import csv
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from protein_performer.errors import UserError
from protein_performer.io.atomic import atomic_output, text_output
from protein_performer.io.ranks import detect_ranks
from protein_performer.io.sharding import run_sharded

R = TypeVar("R")
#: A cell starting with one of these is read as a formula by spreadsheets (OWASP, "CSV
#: injection"): ``=HYPERLINK(...)`` as an id would run when the table is opened.
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")
#: A plain decimal number (``-1.25``, ``+3e-4``): a spreadsheet reads it as the number it is.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def text_cell(value: object) -> object:
    """``value`` as a safe cell: text starting with a formula prefix gets a leading ``'`` (so
    spreadsheets show it as text); numbers, and text that is a plain number (``-0.5``), stay as
    they are. Idempotent: a cell already prefixed starts with ``'``."""
    if isinstance(value, str) and value.startswith(FORMULA_PREFIXES) and not _NUMBER.fullmatch(
        value
    ):
        return "'" + value
    return value


class _SafeWriter:
    """:func:`csv.writer` whose every row goes through :func:`text_cell`."""

    def __init__(self, fh: IO[str], delimiter: str, lineterminator: str) -> None:
        self._writer = csv.writer(fh, delimiter=delimiter, lineterminator=lineterminator)

    def writerow(self, row: Iterable[object]) -> None:
        self._writer.writerow([text_cell(v) for v in row])

    def writerows(self, rows: Iterable[Iterable[object]]) -> None:
        for row in rows:
            self.writerow(row)


def table_writer(fh: IO[str], delimiter: str = ",", lineterminator: str = "\r\n") -> _SafeWriter:
    """The one writer of every CSV/TSV table this package writes (score, predict,
    score-variants, benchmark, eval's bins, contacts' precision): text cells starting with
    ``= + - @`` TAB or CR are prefixed with ``'`` (:func:`text_cell`); numbers stay numbers."""
    return _SafeWriter(fh, delimiter, lineterminator)
#: Names whose tables are tab-separated; every other name is comma-separated.
TAB_SUFFIXES = (".tsv", ".tab")


def delimiter(path: str | os.PathLike[str], first_line: str | None = None) -> str:
    """Tab for ``.tsv``/``.tab``, comma for ``.csv``; another name (``-`` too) is a comma, or,
    given the table's ``first_line``, whichever of tab and comma it holds more of."""
    suffix = Path(path).suffix.lower()
    if suffix in TAB_SUFFIXES:
        return "\t"
    if first_line is None or suffix == ".csv":
        return ","
    return "\t" if first_line.count("\t") > first_line.count(",") else ","


class ShardedTable:
    """One table ``out`` (a file, or ``-`` for standard output) under ``header``, written
    window by window as parts and merged in input order.

    Made before any input is read, so a job of several ranks that names standard output stops
    at once."""

    def __init__(self, out: str | os.PathLike[str], header: Sequence[str]) -> None:
        self.out = out
        self.header = list(header)
        self.to_stdout = str(out) == "-"
        if self.to_stdout and detect_ranks().distributed:
            raise UserError("several ranks cannot share standard output; give OUT as a file")
        self.delimiter = delimiter(out)

    def write(
        self,
        windows: Iterable[list[R]],
        rows: Callable[[list[R]], Iterable[Sequence[str]]],
        source: object,
        merged_row: Callable[[list[str]], None] | None = None,
    ) -> tuple[int, int]:
        """Write ``rows(window)`` of this rank's windows as parts, then (rank 0) merge them
        under the header, each merged row shown to ``merged_row``. Returns (records this rank
        wrote, rows in the table; 0 on other ranks). An input with no record is one error
        naming ``source``."""
        count = 0

        def write_part(part: Path, window: list[R]) -> None:
            with atomic_output(part) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
                writer = table_writer(fh, self.delimiter)
                for row in rows(window):
                    writer.writerow(row)

        def merge(parts: list[Path]) -> int:
            nonlocal count
            if not parts:
                raise UserError(f"{source}: no valid records to process")
            with text_output(self.out) as fh:
                writer = table_writer(fh, self.delimiter)
                writer.writerow(self.header)
                for part in parts:
                    with open(part, newline="", encoding="utf-8") as src:
                        for row in csv.reader(src, delimiter=self.delimiter):
                            writer.writerow(row)
                            count += 1
                            if merged_row is not None:
                                merged_row(row)
            return count

        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "table" if self.to_stdout else Path(self.out).expanduser()
            parts = Path(tmp) / "parts" if self.to_stdout else None
            return run_sharded(dest, ".csv", windows, write_part, merge, fresh=True, parts=parts)
