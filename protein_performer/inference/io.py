"""What the inference commands read and write around the model: input records (a FASTA file or
a preprocessed store), token-budget batches, and output files that appear whole or not at all.

Shared by ``embed``, ``score``, ``score-variants``, ``predict-contacts``, ``generate`` and
``eval``; the model itself is not touched here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, TextIO

from protein_performer.atomic import atomic_file, output_file
from protein_performer.errors import UserError


def budget_batches(lengths: Sequence[int], toks_per_batch: int) -> list[list[int]]:
    """Indices grouped so each batch's padded size ``n * max_width`` stays under the budget.

    Longest first, so an out-of-memory failure happens at the start rather than after an hour.
    A single item wider than the budget gets a batch of its own and is never truncated: the
    budget bounds batching, not sequence length.
    """
    if toks_per_batch <= 0:
        raise UserError(f"--toks-per-batch must be positive, got {toks_per_batch}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        w = int(lengths[i])
        new_width = max(width, w)
        if current and new_width * (len(current) + 1) > toks_per_batch:
            batches.append(current)
            current, new_width = [], w
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    return batches


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` only on success.

    :func:`protein_performer.atomic.atomic_file` behind the checks a CLI output needs first: a
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


class InputRecord(NamedTuple):
    """What the writers need of a record, whether it came from FASTA or from a store."""

    id: str
    description: str
    sequence: str
    number: int  # 1-based position in its file or store


def input_records(
    path: str | os.PathLike[str], on_invalid: str = "error"
) -> Iterator[InputRecord]:
    """Stream the records of a FASTA file or of a preprocessed store directory, in order.

    A store (``protein-performer preprocess``) is read record by record from its memory maps
    (lengths known, O(1) access), so very large inputs cost no parsing and constant memory.
    """
    from protein_performer.data.fasta import read_fasta
    from protein_performer.data.store import TokenStore, is_store

    src = Path(path).expanduser()
    if is_store(src):
        store = TokenStore(src)
        for i in range(len(store)):
            yield InputRecord(store.id(i), store.description(i), store.sequence(i), i + 1)
        return
    if not src.is_file():
        raise UserError(
            f"{src} does not exist or is not a file; give a FASTA file or a store directory "
            "from `protein-performer preprocess`"
        )
    for r in read_fasta(src, on_invalid=on_invalid):  # type: ignore[arg-type]
        yield InputRecord(r.id, r.description, r.sequence, r.number)


def read_records(fasta: str | os.PathLike[str], on_invalid: str = "error") -> list:
    """All FASTA records in file order (``FastaRecord``); errors name file, record and line."""
    from protein_performer.data.fasta import read_fasta

    path = Path(fasta).expanduser()
    if not path.is_file():
        raise UserError(f"{path} does not exist or is not a file; give a FASTA file")
    records = list(read_fasta(path, on_invalid=on_invalid))  # type: ignore[arg-type]
    if not records:
        raise UserError(f"{path}: no valid records to process")
    return records
