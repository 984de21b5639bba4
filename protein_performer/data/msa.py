"""Multiple sequence alignments as family context: A2M/A3M and Stockholm rows -> homologs whose
residues carry a *coordinate*, the reference column they align to.

Why: the family memory keys homolog residues by position, and real homologs (fragments,
extensions, insertions) do not line up by their own positions; the alignment tools already say
where each residue belongs. The field writes MSAs as:

* **A2M / A3M** (HH-suite, ProteinGym's MSA files, ColabFold): FASTA records whose upper-case
  letters and ``-`` are match columns (every row has the same number of them), lower-case
  letters and ``.`` insertions (A2M pads insert columns with ``.``, A3M leaves them out: both
  read the same). Read by :func:`~protein_performer.data.fasta.read_fasta` with
  ``aligned=True`` (case kept, ``#`` comment lines allowed before the first record).
* **Stockholm** (HMMER, Pfam, Rfam): ``# STOCKHOLM 1.0``, then ``name row`` lines (blocks may
  interleave), ``#=`` markup, ``//``. Rows are aligned column for column.

The first sequence is the *reference* (the query: the wild type of a variant task). It defines
the coordinates and is not itself a homolog of the context (as ``homologs`` leaves out the
query). Coordinates are the reference's member positions: residue ``i`` (0-based) of the
reference is coordinate ``i + 1`` (``<cls>`` sits at 0), so a candidate that is a variant of
the reference, read at its own member positions, is read at the reference's coordinates without
being aligned itself (no leak: a scored sequence is never placed by its own alignment). A first
id ending in ``/START-END`` (ProteinGym, EVcouplings: a region of the full protein) shifts the
coordinates by ``START - 1``, so they are the full protein's.

Placement rule (documented in the README): a residue in a column where the reference has a
residue takes that residue's coordinate; a residue in an insertion, or in a column where the
reference has a gap, takes the coordinate of the nearest reference residue along the alignment
(an insertion of k residues between two columns sits at fractions 1/(k+1) ... k/(k+1) between
them; ties go to the left). Residues before a row's first or after its last match-column
residue (terminal insertions: outside what was aligned) get :data:`UNPLACED` (-1): they are
tokens of the context, but enter no column. Gap characters (``-``, ``.``) never become tokens;
residues become upper-case tokens.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.data.tokenizer import SEQUENCE_LETTERS
from protein_performer.errors import UserError

log = logging.getLogger(__name__)

#: The coordinate of a residue that aligns to no reference column.
UNPLACED = -1
#: File name endings (after any ``.gz``) that name an MSA format.
MSA_SUFFIXES = {
    ".a2m": "a2m",
    ".a3m": "a3m",
    ".sto": "stockholm",
    ".stk": "stockholm",
    ".sth": "stockholm",
    ".stockholm": "stockholm",
}
_GAPS = "-."
_REGION = re.compile(r"/(\d+)-(\d+)$")


@dataclass(frozen=True)
class Member:
    """One homolog of a family context: its id, its residues (upper case, no gaps: the tokens)
    and, when it came with an alignment, ``coordinates`` (L,) int64: per residue, the reference
    member position it aligns to (:data:`UNPLACED` where none); None: not aligned (the model
    places it by its member positions)."""

    id: str
    sequence: str
    coordinates: np.ndarray | None = None


def msa_format(path: str | os.PathLike[str]) -> str | None:
    """The MSA format a file name says (``a2m``, ``a3m``, ``stockholm``), else by its first
    line (``# STOCKHOLM``), else None (FASTA, or an A2M told apart by its gaps when read)."""
    name = Path(os.fspath(path)).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    fmt = MSA_SUFFIXES.get(Path(name).suffix)
    if fmt is not None:
        return fmt
    from protein_performer.data.fasta import _open_binary

    with _open_binary(os.fspath(path)) as fh:
        head = fh.read(4096)
    first = head.lstrip().split(b"\n", 1)[0]
    return "stockholm" if first.startswith(b"# STOCKHOLM") else None


def is_aligned(sequences: Sequence[str]) -> bool:
    """Whether FASTA rows are alignment rows (an A2M/A3M or an aligned FASTA): a gap anywhere.
    Lower case alone is not enough: many plain FASTA files are written in lower case."""
    return any("-" in s or "." in s for s in sequences)


class MsaError(UserError):
    """A located problem in an MSA: ``<path>:<line>: record #<n> '<id>': <reason>``."""

    def __init__(self, path: str, line: int | None, reason: str, number: int | None = None,
                 rid: str | None = None) -> None:  # fmt: skip
        where = path if line is None else f"{path}:{line}"
        if number is not None:
            where += f": record #{number} {rid!r}"
        super().__init__(f"{where}: {reason}")


# --------------------------------------------------------------------------------------------
# Placement: positions along the alignment -> reference coordinates
# --------------------------------------------------------------------------------------------
def _a2m_positions(row: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions along the match columns of the row's residues (float), whether each residue
    is in a match column, the row's number of match columns). A residue in match column m is
    at m; the j-th of k insertions between columns m - 1 and m at m - 1 + (j + 1) / (k + 1)."""
    a = np.frombuffer(row.encode("ascii"), np.uint8)
    upper = (a >= 65) & (a <= 90)
    lower = (a >= 97) & (a <= 122)
    match = upper | (a == 45)
    columns = np.cumsum(match)  # match columns up to and including each character
    residue = upper | lower
    pos = (columns - 1).astype(np.float64)
    gap_of = columns[lower]  # an insertion sits before match column `gap_of`
    if gap_of.size:
        first = np.searchsorted(gap_of, gap_of, "left")
        count = np.searchsorted(gap_of, gap_of, "right") - first
        j = np.arange(gap_of.size) - first
        pos[lower] = gap_of - 1 + (j + 1) / (count + 1)
    return pos[residue], match[residue], int(columns[-1]) if a.size else 0


def place(reference: np.ndarray, positions: np.ndarray, aligned: np.ndarray) -> np.ndarray:
    """Coordinates (n,) int64 of a row's residues at ``positions`` (n,) along the alignment:
    the index of the nearest of the ``reference`` residues' positions (increasing; ties to the
    left), :data:`UNPLACED` for residues before the row's first or after its last ``aligned``
    residue (terminal insertions)."""
    out = np.full(len(positions), UNPLACED, dtype=np.int64)
    if not aligned.any() or not len(reference):
        return out
    idx = np.searchsorted(reference, positions)
    left = np.clip(idx - 1, 0, len(reference) - 1)
    right = np.clip(idx, 0, len(reference) - 1)
    nearer_right = np.abs(reference[right] - positions) < np.abs(positions - reference[left])
    nearest = np.where(nearer_right, right, left)
    inside = np.flatnonzero(aligned)
    span = slice(int(inside[0]), int(inside[-1]) + 1)
    out[span] = nearest[span]
    return out


def _shift(rid: str, length: int) -> int:
    """Residues before the reference's region in its full protein: START - 1 of a first id
    ending in ``/START-END`` that spans ``length`` residues, else 0."""
    m = _REGION.search(rid)
    if m is None:
        return 0
    start, end = int(m.group(1)), int(m.group(2))
    return start - 1 if start >= 1 and end - start + 1 == length else 0


def _members(
    rows: Sequence[tuple[str, Any]], positions: list[tuple[np.ndarray, np.ndarray]],
    residues: list[str],
) -> tuple[Member, list[Member]]:  # fmt: skip
    """The reference (the first row, at its own coordinates) and the homologs (the other rows)
    with their coordinates."""
    ref_pos = positions[0][0]
    shift = _shift(rows[0][0], len(ref_pos)) + 1  # member position of reference residue 0
    reference = Member(rows[0][0], residues[0], np.arange(len(ref_pos), dtype=np.int64) + shift)
    out = []
    for (rid, _), (pos, aligned), seq in zip(rows[1:], positions[1:], residues[1:], strict=True):
        coords = place(ref_pos, pos, aligned)
        coords[coords != UNPLACED] += shift
        out.append(Member(rid, seq, coords))
    return reference, out


def _residues(row: str) -> str:
    """A row's residues as tokens: gaps dropped, letters upper-cased."""
    return row.translate(_DROP_GAPS).upper()


_DROP_GAPS = str.maketrans("", "", _GAPS)


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------
def a2m_members(records: Sequence[Any], path: str) -> tuple[Member, list[Member]]:
    """The reference and the homologs of an A2M/A3M read with ``read_fasta(..., aligned=True)``
    (records with ``id``, ``sequence`` as written, ``number``, ``line``): every row needs the
    reference's number of match columns; a homolog row without a residue says nothing and is
    left out (one warning)."""
    if not records:
        raise MsaError(path, None, "no records: an alignment needs its reference (the first)")
    rows, positions, residues = [], [], []
    empty: list[str] = []
    width = None
    for r in records:
        pos, aligned, columns = _a2m_positions(r.sequence)
        if width is None:
            width = columns
        elif columns != width:
            raise MsaError(
                path, r.line,
                f"{columns} match columns (upper-case letters and '-'), the reference (the "
                f"first record) has {width}: not an A2M/A3M row of this alignment",
                r.number, r.id,
            )  # fmt: skip
        seq = _residues(r.sequence)
        if not seq and _empty_row(empty, path, r.line, r.number, r.id, first=not rows):
            continue
        rows.append((r.id, r))
        positions.append((pos, aligned))
        residues.append(seq)
    _left_out(empty, path)
    if len(rows) < 2:
        raise MsaError(path, None, "only the reference (the first record): no homolog to read")
    return _members(rows, positions, residues)


def _empty_row(empty: list[str], path: str, line: int, number: int, rid: str,
               first: bool) -> bool:  # fmt: skip
    """A row of gaps only: the reference's is an error (nothing to place on), a homolog's is
    noted in ``empty`` and left out (True)."""
    if first:
        raise MsaError(path, line, "the reference (the first row) has gaps only", number, rid)
    empty.append(f"{path}:{line}: record #{number} {rid!r}")
    return True


def _left_out(empty: list[str], path: str) -> None:
    if empty:
        log.warning("%s: left out %d homolog row(s) with gaps only (the first: %s)",
                    path, len(empty), empty[0])  # fmt: skip


def read_stockholm(path: str | os.PathLike[str]) -> tuple[Member, list[Member]]:
    """The reference and the homologs of a Stockholm file's first alignment (rows in order of
    first appearance; interleaved blocks joined), placed column for column on the first row."""
    from protein_performer.data.fasta import _open_binary, display_name

    name = display_name(path)
    text_rows: dict[str, list[str]] = {}
    first_line: dict[str, int] = {}
    with _open_binary(os.fspath(path)) as fh:
        try:
            lines = fh.read().decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise MsaError(name, None, f"not UTF-8 text (byte {exc.start + 1})") from None
    start = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if start is None or not lines[start].startswith("# STOCKHOLM"):
        first = 1 if start is None else start + 1
        raise MsaError(name, first, "not Stockholm: the first line must be '# STOCKHOLM 1.0'")
    for no, line in enumerate(lines[start + 1 :], start + 2):
        text = line.strip()
        if text == "//":
            break
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if len(parts) != 2:
            raise MsaError(name, no, f"expected 'NAME ALIGNED_SEQUENCE', got {text[:40]!r}")
        rid, row = parts
        bad = next((c for c in row if c.upper() not in SEQUENCE_LETTERS), None)
        if bad is not None:
            raise MsaError(name, no, f"invalid character {bad!r} in the row of {rid!r}")
        first_line.setdefault(rid, no)
        text_rows.setdefault(rid, []).append(row)
    if not text_rows:
        raise MsaError(name, None, "no sequence rows before '//'")
    ids, rows, empty = [], [], []
    for n, rid in enumerate(text_rows, 1):
        row = "".join(text_rows[rid])
        if rows and len(row) != len(rows[0]):
            raise MsaError(
                name, first_line[rid],
                f"{len(row)} columns, the reference (the first row) has {len(rows[0])}",
                n, rid,
            )  # fmt: skip
        if not row.strip(_GAPS) and _empty_row(empty, name, first_line[rid], n, rid, not rows):
            continue
        ids.append(rid)
        rows.append(row)
    _left_out(empty, name)
    if len(rows) < 2:
        raise MsaError(name, None, "only the reference (the first row): no homolog to read")
    positions = []
    for row in rows:
        a = np.frombuffer(row.encode("ascii"), np.uint8)
        is_res = np.isin(a, np.frombuffer(_GAPS.encode(), np.uint8), invert=True)
        columns = np.flatnonzero(is_res).astype(np.float64)
        upper = (a[is_res] >= 65) & (a[is_res] <= 90)
        positions.append((columns, upper))
    return _members(list(zip(ids, rows, strict=True)), positions, [_residues(r) for r in rows])
