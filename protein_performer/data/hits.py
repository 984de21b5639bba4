"""A hit of ``protein-performer homologs``: what MMseqs2 reports of it, the header fields it is
written with, and how those fields place its residues on its query (the CIGAR string and the
aligned ranges). Made by the search (:mod:`protein_performer.data.homology`, whose training
families place their members the same way) and read back from a context file
(:mod:`protein_performer.data.inputs`): both import it from here, so inputs need not import
homology.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from protein_performer.data.msa import one_per_column

#: The header fields ``homologs`` appends to a hit's own header line, in order: the scores,
#: the aligned ranges (1-based, inclusive) and the alignment as a CIGAR string (``M`` both,
#: ``I`` a query residue facing a gap, ``D`` a target residue facing one), which place each
#: hit's residues on its query (``hit_coordinates``).
HIT_FIELDS = ("fident", "evalue", "bits", "qcov", "tcov", "qstart", "qend", "tstart", "tend",
              "qlen", "tlen", "cigar")  # fmt: skip
#: What MMseqs2 reports per hit for ``homologs`` (``--format-output``): ``query``, ``target``
#: and the :data:`HIT_FIELDS`.
HOMOLOG_FORMAT = ",".join(("query", "target", *HIT_FIELDS))
_CIGAR = re.compile(r"(\d+)([MID])")


@dataclass(frozen=True)
class Homolog:
    """One hit of one query: the database record's FASTA header line (without ``>``) and
    sequence, the query's id, and what MMseqs2 reports of the alignment (identity ``fident``,
    E-value, bit score, coverage of query and target, the aligned ranges ``qstart..qend`` of
    the query and ``tstart..tend`` of the target, 1-based inclusive, both lengths, and the
    alignment as MMseqs2's CIGAR string)."""

    header: str
    sequence: str
    query: str
    fident: float
    evalue: float
    bits: float
    qcov: float
    tcov: float
    qstart: int
    qend: int
    tstart: int
    tend: int
    qlen: int
    tlen: int
    cigar: str = ""

    def fields(self) -> list[str]:
        """The :data:`HIT_FIELDS` as text (what the header and the TSV hold)."""
        return [
            f"{self.fident:.3f}", f"{self.evalue:.3g}", f"{self.bits:g}", f"{self.qcov:.3f}",
            f"{self.tcov:.3f}", *(str(getattr(self, k)) for k in HIT_FIELDS[5:]),
        ]  # fmt: skip

    @property
    def target(self) -> str:
        return self.header.split(maxsplit=1)[0]

    def header_line(self) -> str:
        """The record's own header, then ``query=ID`` and the fields as ``key=value``."""
        pairs = " ".join(f"{k}={v}" for k, v in zip(HIT_FIELDS, self.fields(), strict=True))
        return f"{self.header} query={self.query} {pairs}"


def hit_coordinates(description: str, length: int) -> tuple[str, np.ndarray] | None:
    """(query id, coordinates (length,) int64) of a hit ``homologs`` wrote, from the
    ``query=``, range and ``cigar=`` fields of its header (the last of each, after the
    record's own description), else None (a header without them).

    Coordinates are the query's residue numbers (1-based: member positions, ``<cls>`` at 0).
    With the CIGAR string, a target residue facing a query residue takes its number, one
    facing a query gap (an insertion) the nearer of the query residues around the gap, as an
    MSA's insertions (``data.msa``). Without it (a header cut short), the aligned range
    ``tstart..tend`` is stretched linearly onto ``qstart..qend``: exact at both ends, off
    inside by the indels between (docs/RESULTS.md, "Where do `homologs`' hits land", says how far).
    One residue per query residue (``data.msa.one_per_column``: the facing one, else the
    first); the others, and residues outside the aligned range, are unplaced (-1)."""
    found: dict[str, str] = {}
    for word in description.split():
        key, eq, value = word.partition("=")
        if eq and key in ("query", "qstart", "qend", "tstart", "tend", "cigar"):
            found[key] = value
    if not {"query", "qstart", "qend", "tstart", "tend"} <= set(found):
        return None
    try:
        qs, qe, ts, te = (int(found[k]) for k in ("qstart", "qend", "tstart", "tend"))
    except ValueError:
        return None
    coords = alignment_coordinates(found.get("cigar", ""), qs, qe, ts, te, length)
    return None if coords is None else (found["query"], coords)


def alignment_coordinates(
    cigar: str, qs: int, qe: int, ts: int, te: int, length: int
) -> np.ndarray | None:
    """(length,) int64: a target of ``length`` residues placed on its query by one MMseqs2
    alignment (the ranges and the CIGAR string, as :func:`hit_coordinates` describes), or None
    when the ranges do not fit the target."""
    if not (1 <= ts <= te <= length and 1 <= qs <= qe):
        return None
    coords = np.full(length, -1, dtype=np.int64)
    exact = np.zeros(length, dtype=bool)
    from_cigar = _cigar_coordinates(cigar, qs, qe, te - ts + 1)
    if from_cigar is None:
        t = np.arange(ts, te + 1)
        scale = (qe - qs) / (te - ts) if te > ts else 0.0
        coords[ts - 1 : te] = np.rint(qs + (t - ts) * scale).astype(np.int64)
    else:
        coords[ts - 1 : te], exact[ts - 1 : te] = from_cigar
    return one_per_column(coords, exact)


def _cigar_coordinates(
    cigar: str, qs: int, qe: int, n: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(n,) the query residue number of each target residue of the aligned range, from a
    CIGAR string (insertions to the nearer query residue around them, ties to the left), and
    whether each faces that residue (``M``); None when there is none or it does not span the
    ranges (then the ranges are stretched)."""
    ops = _CIGAR.findall(cigar)
    if not ops or "".join(f"{k}{op}" for k, op in ops) != cigar:
        return None
    out: list[float] = []
    q = qs - 1  # the query residue last passed
    for count, op in ops:
        k = int(count)
        if op == "M":
            out += range(q + 1, q + k + 1)
            q += k
        elif op == "I":  # query residues facing gaps
            q += k
        else:  # target residues facing a query gap: between q and q + 1
            out += [q + (j + 1) / (k + 1) for j in range(k)]
    if len(out) != n or q != qe:
        return None
    at = np.asarray(out)
    nearest = np.floor(at + 0.5 - 1e-9)  # x.5 (a tie) goes to the left
    return np.clip(nearest, qs, qe).astype(np.int64), at == np.round(at)
