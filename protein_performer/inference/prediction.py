"""Predictions of a fine-tuned model's task head (``lm.predict``, ``protein-performer predict``).

What a head returns, per sequence: regression -> its targets (T,); classification -> class
probabilities (C,); residue classification -> per-residue class probabilities (L, C). Any
length runs in one pass (FAVOR+ is linear in length; no cropping, no windows). The file
writer streams windows of records into parts merged at the end, like ``score``, so ranks of a
``torchrun``/SLURM job split the records and memory is bounded by a window.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from protein_performer.data.inputs import InputRecord, input_records, total_in_background
from protein_performer.data.sampler import budget_batches
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.progress import progress as progress_bar
from protein_performer.io.tables import ShardedTable
from protein_performer.model.task_heads import TaskHead, residue_mask

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM


def task_head(loaded: LoadedModel) -> TaskHead:
    """The model's head, or one ``UserError`` saying how to get a model that has one."""
    head = getattr(loaded, "task", None)
    if head is None:
        raise UserError(
            f"{loaded.source} has no task head: predict needs a fine-tuned checkpoint "
            "(`protein-performer finetune base=CKPT data.train=labels.csv ...`)"
        )
    return head


@torch.inference_mode()
def predict_sequences(
    loaded: LoadedModel, seqs: Sequence[str], toks_per_batch: int = 4096
) -> list[np.ndarray]:
    """Head outputs for ``seqs`` in order: (T,) targets, (C,) or (L, C) probabilities."""
    head = task_head(loaded)
    model, c = loaded.model, loaded.config
    head.to(loaded.device).eval()
    alphabet = loaded.alphabet
    out: list[np.ndarray | None] = [None] * len(seqs)
    for batch in budget_batches([len(s) + 2 for s in seqs], toks_per_batch):
        tokens = alphabet.encode_batch([seqs[i] for i in batch]).to(loaded.device)
        res = model(tokens, repr_layers=[head.config.layer])
        hidden = next(iter(res.hidden_states.values())).float()
        mask = residue_mask(tokens, c.pad_idx, c.cls_idx, c.eos_idx)
        values = head(hidden, mask).float()
        if head.config.task != "regression":
            values = torch.softmax(values, dim=-1)
        values = values.cpu().numpy()
        for k, i in enumerate(batch):
            v = values[k, 1 : 1 + len(seqs[i])] if head.per_residue else values[k]
            out[i] = np.ascontiguousarray(v, dtype=np.float32)
    return out  # type: ignore[return-value]


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
    from protein_performer.io.sharding import rank_label, windows

    head = task_head(lm.loaded)
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
