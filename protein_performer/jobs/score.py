"""``score``: the likelihood of every record of a FASTA file or store, one row per record in
input order (:data:`~protein_performer.inference.scoring.SCORE_COLUMNS`), through
``lm.iter_score``: CSV, or TSV when the output ends in ``.tsv``/``.tab``; ``-`` is standard
output. Sharded like every table (:class:`~protein_performer.io.tables.ShardedTable`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from protein_performer.data.inputs import InputRecord, input_records, total_in_background
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.context import FamilyContext
from protein_performer.inference.scoring import (
    SCORE_COLUMNS,
    SEQUENCE_STRATEGIES,
    check_pll_rate,
)
from protein_performer.io.progress import progress as progress_bar
from protein_performer.io.ranks import rank_label
from protein_performer.io.sharding import windows
from protein_performer.io.tables import ShardedTable


@dataclass
class ScoreSummary:
    """What ``score_fasta`` wrote (rank 0: the whole file; other ranks: their own parts)."""

    num_records: int
    log_likelihood: float
    n_scored: int

    @property
    def mean_log_likelihood(self) -> float:
        return self.log_likelihood / self.n_scored if self.n_scored else float("nan")


def score_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    strategy: str = "pseudo-ppl",
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
    context: FamilyContext | None = None,
    pll_rate: float | None = None,
) -> ScoreSummary:
    """Score every record of ``fasta`` (a FASTA file or a store directory; ``lm.iter_score``)
    into ``out`` (CSV/TSV, or standard output for ``-``), one row per record in input order.

    Window by window into parts, merged at the end, so ranks of a ``torchrun``/SLURM job split
    the records (:mod:`protein_performer.io.sharding`); standard output takes one process.
    """
    lm.check_strategy(strategy, SEQUENCE_STRATEGIES)
    check_pll_rate(pll_rate)
    path = Path(fasta).expanduser()
    table = ShardedTable(out, SCORE_COLUMNS)
    mine = ScoreSummary(0, 0.0, 0)
    merged = ScoreSummary(0, 0.0, 0)

    def rows(window: list[InputRecord]) -> Iterator[list[str]]:
        pairs = [(r.id, r.sequence) for r in window]
        for _, score in lm.iter_score(
            pairs, strategy, toks_per_batch, context=context, progress=bar, pll_rate=pll_rate
        ):
            mine.num_records += 1
            mine.log_likelihood += score.log_likelihood
            mine.n_scored += score.n_scored
            yield score.row()

    def add(row: list[str]) -> None:
        merged.num_records += 1
        merged.n_scored += int(row[2])
        merged.log_likelihood += float(row[3])

    records = input_records(path, on_invalid)
    batches = windows(records, toks_per_batch, lambda r: len(r.sequence))
    # Residues scored advance inside a window, batch by batch (the ETA from the total).
    bar = progress_bar(None, "res", rank_label(strategy), progress)
    total_in_background(bar, path, "residues")
    with bar:
        table.write(batches, rows, path, add)
    return merged if merged.num_records else mine
