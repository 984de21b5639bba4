"""Multi-head self-attention: projections, heads and rotary around the attention core.

The math (FAVOR+ or exact softmax) lives in ``favor.py``; this module only owns the projections
(named like ESM-2's ``q_proj k_proj v_proj out_proj`` so its weights load by renaming) and, for
FAVOR+, the random-feature buffer inside ``self.favor``.

ESM-2 scales q by ``head_dim ** -0.5`` before rotary; rotary is linear, so rotating the unscaled
q and letting the attention core apply ``1/sqrt(d)`` gives the same scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from protein_performer.model.config import PerformerConfig
from protein_performer.model.exact import exact_attention, exact_attention_map
from protein_performer.model.favor import FavorAttention, FavorState
from protein_performer.model.rotary import RotaryEmbedding


class KVCache(NamedTuple):
    """RNN-mode state of exact causal attention: every key and value so far (a KV cache).

    k, v: (B, H, T, d) rotated keys and values; keep: (B, T) False where the row had a pad.
    """

    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor


#: What one attention layer carries between generation steps.
AttentionState = FavorState | KVCache


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with rotary q/k; FAVOR+ or exact softmax by ``config.attention``."""

    def __init__(self, config: PerformerConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.causal = config.causal
        dim = config.dim
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.rot_emb = RotaryEmbedding(self.head_dim, base=config.rotary_base)
        self.favor: FavorAttention | None = None
        if config.attention == "favor":
            kwargs = {}
            if config.favor_chunk_size is not None:
                kwargs["chunk_size"] = config.favor_chunk_size
            self.favor = FavorAttention(
                dim_head=self.head_dim,
                nb_features=config.nb_features,
                causal=self.causal,
                kernel=config.kernel,
                **kwargs,
            )

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        heads: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (B, L, D), ``padding_mask`` (B, L) True = pad -> output (B, L, D) and, if
        ``need_weights``, the attention map (B, H', L, L) of ``heads`` (all heads if None).

        The FAVOR+ map is the one the model implicitly uses (normalized feature products), never
        materialized in the forward pass itself.
        """
        B, L, D = x.shape
        q, k = self.rotated_qk(x)
        v = self._split_heads(self.v_proj(x))
        if self.favor is not None:
            out = self.favor(q, k, v, key_padding_mask=padding_mask)
        else:
            out = exact_attention(q, k, v, causal=self.causal, key_padding_mask=padding_mask)
        out = out.transpose(1, 2).reshape(B, L, D)  # (B, H, L, d) -> (B, L, D)
        out = self.out_proj(out)
        weights = self.attention_map(q, k, padding_mask, heads) if need_weights else None
        return out, weights

    def prefill(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, AttentionState]:
        """Causal forward over a prompt (B, L, D) that also returns the state to continue from.

        FAVOR+: the parallel forward plus the prefix-sum state of all prompt keys (one pass);
        exact: the parallel forward plus the KV cache. Padded keys never enter the state.
        """
        B, L, D = x.shape
        q, k = self.rotated_qk(x)
        v = self._split_heads(self.v_proj(x))
        if self.favor is not None:
            out = self.favor(q, k, v, key_padding_mask=padding_mask)
            state: AttentionState = self.favor.initial_state(k, v, padding_mask)
        else:
            out = exact_attention(q, k, v, causal=True, key_padding_mask=padding_mask)
            keep = (
                torch.ones(B, L, dtype=torch.bool, device=x.device)
                if padding_mask is None
                else ~padding_mask.bool()
            )
            state = KVCache(k, v, keep)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D)), state

    def step(
        self,
        x_t: torch.Tensor,
        positions: torch.Tensor,
        state: AttentionState,
        pad: torch.Tensor,
    ) -> tuple[torch.Tensor, AttentionState]:
        """One token per row, x_t (B, D) at ``positions`` (B,) -> (B, D) and the new state.

        Rows with ``pad`` (B,) True leave their state unchanged (finished sequences).
        """
        B, D = x_t.shape
        q, k = self.rot_emb.at_positions(
            self._split_heads(self.q_proj(x_t)[:, None]),
            self._split_heads(self.k_proj(x_t)[:, None]),
            positions,
        )  # (B, H, 1, d)
        v = self._split_heads(self.v_proj(x_t)[:, None])  # (B, H, 1, d)
        if isinstance(state, FavorState):
            assert self.favor is not None
            state, out = self.favor.step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], pad)
        else:
            keep = torch.cat([state.keep, ~pad[:, None]], dim=1)  # (B, T+1)
            state = KVCache(torch.cat([state.k, k], 2), torch.cat([state.v, v], 2), keep)
            mask = keep[:, None, None, :]  # (B, 1, 1, T+1)
            out = F.scaled_dot_product_attention(q, state.k, state.v, attn_mask=mask)[:, :, 0]
        return self.out_proj(out.reshape(B, D)), state

    def rotated_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D) -> q, k (B, H, L, d) after rotary, unscaled: what the attention core sees.

        Public so that ``inference.attention_maps`` can capture them from a forward hook
        without repeating the projection and rotary logic.
        """
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        return self.rot_emb(q, k)

    def attention_map(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        heads: Sequence[int] | None = None,
        query_slice: slice | None = None,
    ) -> torch.Tensor:
        """Attention rows (B, H', W, L) of ``heads`` for the queries in ``query_slice`` (all
        when None), from :meth:`rotated_qk`'s q, k; O(W L) memory, rows sum to 1."""
        if heads is not None:
            index = torch.as_tensor(list(heads), device=q.device, dtype=torch.long)
            q, k = q.index_select(1, index), k.index_select(1, index)  # (B, H', L, d)
        if self.favor is not None:
            return self.favor.attention_map(
                q, k, key_padding_mask=padding_mask, query_slice=query_slice
            )
        return exact_attention_map(
            q, k, causal=self.causal, key_padding_mask=padding_mask, query_slice=query_slice
        )
