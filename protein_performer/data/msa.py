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
them; ties go to the left) unless a residue of its row already holds that coordinate: each
coordinate holds at most one residue per row (:func:`one_per_column`: the aligned one, else the
first), the others get :data:`UNPLACED` (-1), as do residues before a row's first or after its
last match-column residue (terminal insertions: outside what was aligned). Unplaced residues
are tokens of the context that enter no column. Gap characters (``-``, ``.``) never become
tokens; residues become upper-case tokens.
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
#: What a position memory keys a family row's homologs by: their member positions, or their
#: alignment to a reference (``data.family_coordinates``, ``PerformerConfig.family_coordinates``).
FAMILY_COORDINATES = ("positions", "aligned")
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


def row_keys(coordinates: np.ndarray | None, n: int) -> np.ndarray:
    """(n + 2,) int64 keys of a member's ``<cls> residues <eos>`` in a row: its member
    positions 0 .. n + 1 when it has no coordinates (the fallback), else ``<cls>`` at 0 (every
    member's start), the residues' coordinates, and ``<eos>`` one past the last residue's when
    that one is placed (:data:`UNPLACED` otherwise). What a family context (inference) and a
    family row for training (``data.family``) hand the model as ``coordinates``."""
    if coordinates is None:
        return np.arange(n + 2, dtype=np.int64)
    last = int(coordinates[-1]) if n else UNPLACED
    eos = UNPLACED if last == UNPLACED else last + 1
    return np.concatenate(([0], coordinates, [eos])).astype(np.int64)


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
class _Layout:
    """Every row of an alignment at once (one pass over all their characters, no Python loop
    per row): per residue, its position along the alignment and whether it sits in a match
    column; the rows' residue offsets; per row, its match columns and its residues as tokens.

    ``columns_of``: "match" (A2M/A3M: a residue in match column m is at m, the j-th of k
    insertions between columns m - 1 and m at m - 1 + (j + 1) / (k + 1)) or "all" (Stockholm:
    every column is a column, a residue sits at its own)."""

    def __init__(self, rows: Sequence[str], columns_of: str) -> None:
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        starts = np.concatenate(([0], np.cumsum(lengths)))
        a = np.frombuffer("".join(rows).encode("ascii"), np.uint8)
        upper = (a >= 65) & (a <= 90)
        lower = (a >= 97) & (a <= 122)
        residue = upper | lower
        row_of = np.repeat(np.arange(len(rows)), lengths)  # (chars,)
        if columns_of == "match":
            match = upper | (a == 45)
            total = np.concatenate(([0], np.cumsum(match)))
            columns = total[1:] - total[starts[:-1]][row_of]  # match columns so far, in-row
            self.widths = total[starts[1:]] - total[starts[:-1]]  # (N,)
            pos = (columns - 1).astype(np.float64)
            gap_of = columns[lower]  # an insertion sits before match column `gap_of`
            key = row_of[lower] * (int(self.widths.max(initial=0)) + 2) + gap_of  # sorted
            first = np.searchsorted(key, key, "left")
            count = np.searchsorted(key, key, "right") - first
            pos[lower] = gap_of - 1 + (np.arange(key.size) - first + 1) / (count + 1)
        else:
            self.widths = lengths
            pos = (np.arange(a.size) - starts[:-1][row_of]).astype(np.float64)
        self.positions = pos[residue]  # (R,) residues of all rows, in order
        self.aligned = upper[residue]
        counts = np.bincount(row_of[residue], minlength=len(rows))
        self.offsets = np.concatenate(([0], np.cumsum(counts)))  # (N + 1,)
        self.residues = [r.translate(_DROP_GAPS).upper() for r in rows]

    def row(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def place(
    reference: np.ndarray, positions: np.ndarray, aligned: np.ndarray,
    offsets: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """Coordinates (n,) int64 of residues at ``positions`` (n,) along the alignment: the index
    of the nearest of the ``reference`` residues' positions (increasing; ties to the left),
    :data:`UNPLACED` for residues before their row's first or after its last ``aligned``
    residue (terminal insertions). ``offsets`` (rows + 1,): where each row's residues start
    (None: one row)."""
    n = len(positions)
    offsets = np.array([0, n]) if offsets is None else np.asarray(offsets)
    if not len(reference) or not n:
        return np.full(n, UNPLACED, dtype=np.int64)
    idx = np.searchsorted(reference, positions)
    left = np.clip(idx - 1, 0, len(reference) - 1)
    right = np.clip(idx, 0, len(reference) - 1)
    nearer_right = np.abs(reference[right] - positions) < np.abs(positions - reference[left])
    nearest = np.where(nearer_right, right, left)
    rows = len(offsets) - 1
    row_of = np.repeat(np.arange(rows), np.diff(offsets))  # (n,)
    inside = np.flatnonzero(aligned)  # sorted, and so are their rows
    lo = np.searchsorted(row_of[inside], np.arange(rows), "left")
    hi = np.searchsorted(row_of[inside], np.arange(rows), "right")
    has = hi > lo
    first = np.where(has, inside[np.minimum(lo, len(inside) - 1)], n)  # (rows,)
    last = np.where(has, inside[np.maximum(hi - 1, 0)], -1)
    k = np.arange(n)
    within = (k >= first[row_of]) & (k <= last[row_of])
    coords = np.where(within, nearest, UNPLACED).astype(np.int64)
    return one_per_column(coords, reference[nearest] == positions, offsets)


def one_per_column(
    coords: np.ndarray, exact: np.ndarray, offsets: np.ndarray | None = None
) -> np.ndarray:
    """``coords`` (n,) (non-decreasing along each row among the placed) with one residue per
    row and coordinate kept: the one ``exact``-ly aligned to that reference residue, else the
    first; the others :data:`UNPLACED`. Why: a column's slot is then a mean over rows, as a
    member position is a mean over members, and coordinates rise strictly along a row, so a
    causal read at a residue's column never meets a later residue of its own row."""
    n = len(coords)
    offsets = np.array([0, n]) if offsets is None else np.asarray(offsets)
    idx = np.flatnonzero(coords != UNPLACED)
    if not idx.size:
        return coords
    row = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))[idx]
    order = np.lexsort((idx, ~exact[idx], coords[idx], row))  # exact first within a group
    r, c = row[order], coords[idx][order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (r[1:] != r[:-1]) | (c[1:] != c[:-1])
    out = np.full(n, UNPLACED, dtype=np.int64)
    keep = idx[order[first]]
    out[keep] = coords[keep]
    return out


def _shift(rid: str, length: int) -> int:
    """Residues before the reference's region in its full protein: START - 1 of a first id
    ending in ``/START-END`` that spans ``length`` residues, else 0."""
    m = _REGION.search(rid)
    if m is None:
        return 0
    start, end = int(m.group(1)), int(m.group(2))
    return start - 1 if start >= 1 and end - start + 1 == length else 0


def _members(ids: Sequence[str], layout: _Layout, keep: np.ndarray) -> tuple[Member, list[Member]]:
    """The reference (the first row, at its own coordinates) and the homologs (the other rows
    in ``keep``) with their coordinates."""
    ref = layout.positions[layout.row(0)]
    shift = _shift(ids[0], len(ref)) + 1  # the member position of reference residue 0
    coords = place(ref, layout.positions, layout.aligned, layout.offsets)
    coords[coords != UNPLACED] += shift
    reference = Member(ids[0], layout.residues[0], np.arange(len(ref), dtype=np.int64) + shift)
    return reference, [
        Member(ids[i], layout.residues[i], coords[layout.row(i)]) for i in keep.tolist() if i
    ]


_DROP_GAPS = str.maketrans("", "", _GAPS)


def _homolog_rows(
    ids: Sequence[str], layout: _Layout, path: str, lines: Sequence[int]
) -> np.ndarray:
    """The rows to read (indices): all but the homolog rows of gaps only, which say nothing
    and are left out with one warning; the reference's is an error (nothing to place on), as
    is an alignment of the reference alone."""
    empty = np.flatnonzero(np.diff(layout.offsets) == 0)
    if len(empty) and empty[0] == 0:
        raise MsaError(path, lines[0], "the reference (the first row) has gaps only", 1, ids[0])
    if len(empty):
        i = int(empty[0])
        log.warning("%s: left out %d homolog row(s) with gaps only (the first: %s:%d: record "
                    "#%d %r)", path, len(empty), path, lines[i], i + 1, ids[i])  # fmt: skip
    keep = np.setdiff1d(np.arange(len(ids)), empty)
    if len(keep) < 2:
        raise MsaError(path, None, "only the reference (the first row): no homolog to read")
    return keep


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
    layout = _Layout([r.sequence for r in records], "match")
    wrong = np.flatnonzero(layout.widths != layout.widths[0])
    if len(wrong):
        r = records[int(wrong[0])]
        raise MsaError(
            path, r.line,
            f"{layout.widths[wrong[0]]} match columns (upper-case letters and '-'), the "
            f"reference (the first record) has {layout.widths[0]}: not an A2M/A3M row of this "
            "alignment",
            r.number, r.id,
        )  # fmt: skip
    ids = [r.id for r in records]
    return _members(ids, layout, _homolog_rows(ids, layout, path, [r.line for r in records]))


def read_stockholm(path: str | os.PathLike[str]) -> tuple[Member, list[Member]]:
    """The reference and the homologs of a Stockholm file's first alignment (rows in order of
    first appearance; interleaved blocks joined), placed column for column on the first row."""
    from protein_performer.data.fasta import _open_binary
    from protein_performer.data.stdin import display_name

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
    ids = list(text_rows)
    rows = ["".join(text_rows[rid]) for rid in ids]
    for n, (rid, row) in enumerate(zip(ids, rows, strict=True), 1):
        if len(row) != len(rows[0]):
            raise MsaError(
                name, first_line[rid],
                f"{len(row)} columns, the reference (the first row) has {len(rows[0])}",
                n, rid,
            )  # fmt: skip
    layout = _Layout(rows, "all")
    return _members(ids, layout, _homolog_rows(ids, layout, name, [first_line[i] for i in ids]))
