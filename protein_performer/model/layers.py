"""The pre-LayerNorm transformer block, laid out and named like ESM-2's ``TransformerLayer``.

Same names (``self_attn_layer_norm self_attn final_layer_norm fc1 fc2``) so ESM-2 weights load
by renaming; same order of operations so the exact-attention twin reproduces ESM-2's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from protein_performer.model.attention import AttentionState, MultiHeadSelfAttention, Positions
from protein_performer.model.config import PerformerConfig


class TransformerLayer(nn.Module):
    """x + Attn(LN(x)), then x + FFN(LN(x)) with an erf GELU (ESM-2's ``gelu``)."""

    def __init__(self, config: PerformerConfig, layer: int = 1) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.self_attn = MultiHeadSelfAttention(config, layer)
        self.final_layer_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.dim, config.ff_dim)
        self.fc2 = nn.Linear(config.ff_dim, config.dim)
        # Residual-branch dropout (fairseq's placement); ESM-2 trains with 0.
        self.dropout = nn.Dropout(config.dropout)
        self.gradient_checkpointing = config.gradient_checkpointing

    def _block(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        need_weights: bool,
        heads: Sequence[int] | None,
        positions: Positions = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, weights = self.self_attn(
            self.self_attn_layer_norm(x),
            padding_mask,
            need_weights=need_weights,
            heads=heads,
            positions=positions,
        )
        return self._feed_forward(x + self.dropout(attn_out)), weights

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.final_layer_norm(x)))  # exact (erf) GELU, as ESM-2
        return x + self.dropout(self.fc2(h))

    def prefill(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None, positions: Positions = None
    ) -> tuple[torch.Tensor, AttentionState]:
        """The block over a prompt (B, L, D), plus its attention state (RNN mode, inference)."""
        attn_out, state = self.self_attn.prefill(
            self.self_attn_layer_norm(x), padding_mask, positions
        )
        return self._feed_forward(x + attn_out), state

    def extend(
        self,
        x: torch.Tensor,
        state: AttentionState | None,
        positions: Positions,
        padding_mask: torch.Tensor | None,
        return_state: bool,
    ) -> tuple[torch.Tensor, AttentionState | None]:
        """The block for new tokens (B, L, D) after ``state`` (read only; inference)."""
        attn_out, state = self.self_attn.extend(
            self.self_attn_layer_norm(x), state, positions, padding_mask, return_state
        )
        return self._feed_forward(x + attn_out), state

    def step(
        self,
        x_t: torch.Tensor,
        positions: torch.Tensor,
        state: AttentionState,
        pad: torch.Tensor | None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, AttentionState]:
        """The block for one token per row, x_t (B, D) (RNN mode, inference): the same ops as
        :meth:`prefill` through the functional calls (no module dispatch, no dropout, which
        inference never applies), since a token's cost is mostly per-op overhead."""
        ln1, ln2 = self.self_attn_layer_norm, self.final_layer_norm
        h = F.layer_norm(x_t, ln1.normalized_shape, ln1.weight, ln1.bias, ln1.eps)
        attn_out, state = self.self_attn.step(h, positions, state, pad, inplace)
        x_t = x_t + attn_out
        h = F.layer_norm(x_t, ln2.normalized_shape, ln2.weight, ln2.bias, ln2.eps)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias))
        return x_t + F.linear(h, self.fc2.weight, self.fc2.bias), state

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        heads: Sequence[int] | None = None,
        positions: Positions = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (B, L, D) -> (B, L, D) and the attention map (B, H', L, L) if ``need_weights``.

        With ``gradient_checkpointing`` (and only when a backward pass can follow) the block's
        activations are recomputed in backward; non-reentrant checkpointing replays dropout with
        the saved RNG state, so gradients equal the unchecked ones. ``positions``: rotary
        positions (None: the row's own; see ``attention.Positions``).
        """
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(
                self._block, x, padding_mask, need_weights, heads, positions, use_reentrant=False
            )
        return self._block(x, padding_mask, need_weights, heads, positions)
