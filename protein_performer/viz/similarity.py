"""The amino-acid similarity picture's numbers: attention summed between residue types.

A log-odds (the Performer paper's Fig. 13 idea; also Vig et al. 2021): total attention from
residues of type a to residues of type b, summed over layers, heads and query positions
(self-attention i == j excluded), divided by what attention spread uniformly over the other
residues would give, log2, symmetrized. A model whose attention ignores residue types scores 0
everywhere; types that never occur stay NaN. Arrays in, a (20, 20) array out, in the order
``plots.similarity_vs_blosum`` draws (``plots.AMINO_ACIDS``); rows are streamed, so memory stays
O(window x L).
"""

from __future__ import annotations

import numpy as np

from protein_performer.viz.plots import AMINO_ACIDS

_AA_INDEX = {a: i for i, a in enumerate(AMINO_ACIDS)}


class SimilarityAccumulator:
    """Sums attention between amino-acid types over streamed (H', W, L) row blocks, and what
    uniform attention (each row's mass spread evenly over the other L - 1 residues) would give,
    so that type frequencies and the excluded diagonal cancel out of the ratio."""

    def __init__(self, sequence: str, row_start: int = 0) -> None:
        idx = np.array([_AA_INDEX.get(c, -1) for c in sequence.upper()])
        self.cols = np.zeros((len(sequence), 20))
        known = idx >= 0
        self.cols[np.nonzero(known)[0], idx[known]] = 1.0  # (L, 20) one-hot, 0 rows for X etc.
        self.counts = self.cols.sum(0)  # (20,)
        self.row_start = row_start
        self.observed = np.zeros((20, 20))
        self.expected = np.zeros((20, 20))

    def add(self, maps: np.ndarray) -> None:
        """maps (H', W, L) rows for residues row_start .. row_start + W - 1."""
        a = np.asarray(maps, dtype=np.float64).sum(0)  # (W, L)
        W, L = a.shape
        rows = np.arange(W)
        a[rows, rows + self.row_start] = 0.0  # self-attention says nothing about similarity
        one_hot = self.cols[self.row_start : self.row_start + W]  # (W, 20)
        self.observed += one_hot.T @ a @ self.cols  # (20, 20)
        mass = one_hot.T @ a.sum(1)  # (20,) row mass per query type
        others = self.counts[None, :] - np.eye(20)  # (20, 20): b-residues other than i itself
        self.expected += mass[:, None] * others / max(L - 1, 1)

    def matrix(self) -> np.ndarray:
        """Symmetric log2(observed / expected), NaN where a type is absent."""
        return log_odds(self.observed, self.expected)


def log_odds(observed: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """log2 of the symmetrized ratio; NaN where either side is 0."""
    o, e = observed + observed.T, expected + expected.T
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log2(o / e)
    out[~np.isfinite(out)] = np.nan
    return out
