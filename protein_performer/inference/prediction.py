"""Predictions of a fine-tuned model's task head (``lm.predict``, ``protein-performer predict``).

What a head returns, per sequence: regression -> its targets (T,); classification -> class
probabilities (C,); residue classification -> per-residue class probabilities (L, C). Any
length runs in one pass (FAVOR+ is linear in length; no cropping, no windows). Tensor work on a
:class:`~protein_performer.interop.record.LoadedModel` only; the ``predict`` command's table is
:mod:`protein_performer.jobs.predict`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from protein_performer.data.sampler import budget_batches
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.model.task_heads import TaskHead, residue_mask


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
