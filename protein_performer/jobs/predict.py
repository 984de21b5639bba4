"""``predict``: a fine-tuned model's head on every record of a FASTA file or store
(``lm.iter_predict``), one row per record in input order (CSV, or TSV when the output ends in
``.tsv``/``.tab``; ``-`` is standard output). The table streams windows of records into parts
merged at the end, like ``score`` (:class:`~protein_performer.io.tables.ShardedTable`), so
ranks of a ``torchrun``/SLURM job split the records and memory is bounded by a window.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protein_performer.data.inputs import InputRecord, input_records, total_in_background
from protein_performer.inference.api import ProteinLM
from protein_performer.io.progress import progress as progress_bar
from protein_performer.io.ranks import rank_label
from protein_performer.io.sharding import windows
from protein_performer.io.tables import ShardedTable
from protein_performer.model.task_heads import TaskHead


def prediction_columns(head: TaskHead) -> list[str]:
    """The header ``predict`` writes for this head."""
    names = head.config.labels
    if head.config.task == "regression":
        return ["id", "length", *names]
    if head.config.task == "classification":
        return ["id", "length", "predicted", *(f"p_{n}" for n in names)]
    return ["id", "length", "predicted", "mean_confidence"]


def prediction_row(head: TaskHead, rid: str, length: int, value: np.ndarray) -> list[str]:
    names = head.config.labels
    if head.config.task == "regression":
        return [rid, str(length), *(f"{x:.6g}" for x in value)]
    if head.config.task == "classification":
        return [rid, str(length), names[int(value.argmax())], *(f"{x:.6f}" for x in value)]
    labels = [names[int(k)] for k in value.argmax(-1)]
    sep = "" if all(len(n) == 1 for n in names) else " "
    return [rid, str(length), sep.join(labels), f"{float(value.max(-1).mean()):.6f}"]


@dataclass
class PredictSummary:
    num_records: int


def predict_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
) -> PredictSummary:
    """Predict every record of ``fasta`` (FASTA or a store) into ``out`` (CSV/TSV; ``-``:
    standard output), one row per record in input order; sharded like ``score_fasta``."""
    head = lm.task_head()
    path = Path(fasta).expanduser()
    table = ShardedTable(out, prediction_columns(head))

    def rows(window: list[InputRecord]) -> Iterator[list[str]]:
        pairs = [(r.id, r.sequence) for r in window]
        for (rid, seq), (_, value) in zip(
            pairs, lm.iter_predict(pairs, toks_per_batch), strict=True
        ):
            yield prediction_row(head, rid, len(seq), value)
        bar.update(len(window))

    records = input_records(path, on_invalid)
    batches = windows(records, toks_per_batch, lambda r: len(r.sequence))
    bar = progress_bar(None, "seq", rank_label("predict"), progress)
    total_in_background(bar, path, "records")
    with bar:
        _, total = table.write(batches, rows, path)
    return PredictSummary(total)
