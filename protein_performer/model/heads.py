"""The LM head, ESM-2's ``RobertaLMHead``: dense -> GELU -> LayerNorm -> tied decoder + bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LMHead(nn.Module):
    """Maps hidden states to vocabulary logits through the (shared) embedding matrix.

    ``weight`` is the embedding's Parameter itself, not a copy: tying halves the vocabulary
    parameters and is what ESM-2 checkpoints expect (``lm_head.weight`` = ``embed_tokens.weight``).
    """

    def __init__(self, dim: int, vocab_size: int, weight: nn.Parameter, eps: float = 1e-5) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.layer_norm = nn.LayerNorm(dim, eps=eps)
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> logits (B, T, V)."""
        x = self.layer_norm(F.gelu(self.dense(features)))
        return F.linear(x, self.weight) + self.bias
