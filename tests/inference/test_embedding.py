"""inference.embedding: hidden states as arrays, whatever the batching; the tiny test model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from protein_performer.data.sampler import budget_batches
from protein_performer.data.tokenizer import Alphabet
from protein_performer.inference.embedding import embed_sequences, resolve_layers
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM

TINY = {"dim": 16, "depth": 2, "heads": 2, "ff_dim": 32, "nb_features": 8}


def tiny_loaded(objective: str = "mlm", seed: int = 0, **kw) -> LoadedModel:
    torch.manual_seed(seed)
    config = PerformerConfig.from_dict({**TINY, "objective": objective, **kw})
    model = PerformerLM(config).eval()
    return LoadedModel(model, config, Alphabet(), Path("tiny"), torch.device("cpu"), "memory")


def test_batched_equals_one_by_one() -> None:
    loaded = tiny_loaded()
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "MLL", "GSHMKKLLAVLYCLAVFAL", "W" * 40]
    layers = resolve_layers(loaded, [1, -1])
    assert layers == [1, 2]
    together = dict(embed_sequences(loaded, seqs, layers, ["mean", "per_tok"], 10_000))
    alone = dict(embed_sequences(loaded, seqs, layers, ["mean", "per_tok"], 1))
    for i in range(len(seqs)):
        for kind in ("mean", "per_tok"):
            for layer in (1, 2):
                np.testing.assert_allclose(
                    together[i][kind][layer], alone[i][kind][layer], rtol=1e-4, atol=1e-5
                )


def test_budget_batches() -> None:
    lengths = [5, 100, 7, 7, 3, 50]
    batches = budget_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) == 1 or width * len(b) <= 20
    assert batches[0] == [1]  # longest first, alone although wider than the budget
