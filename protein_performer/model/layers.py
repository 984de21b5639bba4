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


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` without the module call (the same kernel): a decoding step's cost is mostly
    per-op overhead. The projections stay module calls, which LoRA adapters replace."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


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
        positions: Positions,
        state: AttentionState | None,
        keep_state: bool,
        inplace: bool,
        coordinates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, AttentionState | None]:
        attn_out, weights, state = self.self_attn(
            _layer_norm(self.self_attn_layer_norm, x),
            padding_mask,
            need_weights,
            heads,
            positions,
            state,
            keep_state=keep_state,
            inplace=inplace,
            coordinates=coordinates,
        )
        x = x + self._drop(attn_out)
        h = F.gelu(self.fc1(_layer_norm(self.final_layer_norm, x)))  # erf GELU, as ESM-2
        return x + self._drop(self.fc2(h)), weights, state

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout in training; in eval the identity without the call, since a decoding step's
        cost is mostly per-op overhead."""
        return self.dropout(x) if self.training else x

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        heads: Sequence[int] | None = None,
        positions: Positions = None,
        state: AttentionState | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        coordinates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, AttentionState | None]:
        """``x`` (B, L, D) -> (B, L, D), the attention map (B, H', L, L) if ``need_weights``,
        and the attention state after the tokens if ``keep_state``.

        With ``gradient_checkpointing`` (and only when a backward pass can follow) the block's
        activations are recomputed in backward; non-reentrant checkpointing replays dropout with
        the saved RNG state, so gradients equal the unchecked ones. ``positions``: rotary
        positions (None: the row's own; see ``attention.Positions``); ``state``,
        ``keep_state``, ``inplace``, ``coordinates``: see ``MultiHeadSelfAttention.forward``.
        """
        args = (x, padding_mask, need_weights, heads, positions, state, keep_state, inplace,
                coordinates)  # fmt: skip
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._block, *args, use_reentrant=False)
        return self._block(*args)
