"""The empirical amino-acid (unigram) baseline the Performer paper reports next to its models.

A model that has learnt nothing about context still knows residue frequencies; its perplexity
(about 17.8 on TrEMBL in the paper's Table 2) is the floor any language model must beat. It is
scored here on exactly the positions ``inference.evaluate`` scores a checkpoint on: the same
``ProteinDataset`` items (fixed crop, ``(index, 0)`` masks), so the numbers sit in one table.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from protein_performer.data.dataset import ProteinDataset, RecordSource
from protein_performer.data.masking import IGNORE_INDEX
from protein_performer.data.tokenizer import SEQUENCE_LETTERS, Alphabet


def unigram_log_probs(train: RecordSource, objective: str, alphabet: Alphabet) -> np.ndarray:
    """(V,) log-frequencies of the training residues, add-one smoothed over the residue letters
    (and ``<eos>`` for a causal LM, which must predict where a protein ends); -inf elsewhere."""
    counts = np.zeros(len(alphabet), dtype=np.float64)
    for i in range(len(train)):
        counts += np.bincount(train.tokens(i), minlength=len(alphabet))
    allowed = np.zeros(len(alphabet), dtype=bool)
    allowed[[alphabet.tokens.index(c) for c in SEQUENCE_LETTERS]] = True
    if objective == "clm":
        allowed[alphabet.eos_idx] = True
        counts[alphabet.eos_idx] = len(train)  # one <eos> per record
    counts = np.where(allowed, counts + 1.0, 0.0)
    logp = np.full(len(alphabet), -np.inf)
    logp[allowed] = np.log(counts[allowed] / counts.sum())
    return logp


def unigram_baseline(
    train: RecordSource,
    heldout: RecordSource,
    objective: str,
    max_len: int,
    mlm_prob: float = 0.15,
    seed: int = 0,
) -> dict[str, Any]:
    """Loss, perplexity and accuracy (always guessing the commonest residue) of the training
    split's residue frequencies on ``heldout``: masked positions for MLM, every next-token
    prediction (``<eos>`` included) for CLM, as ``evaluate`` with the same settings."""
    alphabet = Alphabet()
    logp = unigram_log_probs(train, objective, alphabet)
    best = int(np.argmax(logp))
    dataset = ProteinDataset(
        heldout,
        objective,  # type: ignore[arg-type]
        max_len=max_len,
        crop="fixed",
        mlm_prob=mlm_prob,
        seed=seed,
    )
    nll, n, correct = 0.0, 0, 0
    for i in range(len(dataset)):
        targets = np.asarray(dataset[(i, 0)]["targets"])
        t = targets[targets != IGNORE_INDEX]
        nll -= float(logp[t].sum())
        n += int(t.size)
        correct += int((t == best).sum())
    loss = nll / max(n, 1)
    return {
        "records": len(heldout),
        "tokens": n,
        "loss": loss,
        "ppl": math.exp(loss),
        "acc": correct / max(n, 1),
    }
