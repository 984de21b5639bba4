"""Multi-head self-attention: projections, heads and rotary around one attention core.

The math lives in the core, FAVOR+ (:class:`~protein_performer.model.favor.FavorAttention`) or
exact softmax (:class:`~protein_performer.model.exact.ExactAttention`); both offer one interface
(forward, RNN-mode state and step, attention rows, contact-map blocks), so this module never asks
which it holds. It owns the projections, named like ESM-2's ``q_proj k_proj v_proj out_proj`` so
its weights load by renaming.

ESM-2 scales q by ``head_dim ** -0.5`` before rotary; rotary is linear, so rotating the unscaled
q and letting the attention core apply ``1/sqrt(d)`` gives the same scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from protein_performer.model.config import PerformerConfig
from protein_performer.model.exact import ExactAttention, ExactMapBlocks, KVCache
from protein_performer.model.favor import FavorAttention, FavorState
from protein_performer.model.favor.module import FavorMapBlocks
from protein_performer.model.linear.core import LinearAttention
from protein_performer.model.linear.memory import PositionMemory
from protein_performer.model.linear.window import SlidingWindow
from protein_performer.model.rotary import RotaryEmbedding

#: The attention cores: one interface, two implementations.
AttentionCore = FavorAttention | ExactAttention
#: What one attention layer carries between generation steps.
AttentionState = FavorState | KVCache
#: One head's residue x residue map as blocks (``.sums``, ``.add_upper_block``), for contacts.
MapBlocks = FavorMapBlocks | ExactMapBlocks
#: Rotary positions: None (0, 1, ... along the row), an int offset (the first token's
#: position), or a tensor (B, L) of per-token positions.
Positions = int | torch.Tensor | None


def _build_core(config: PerformerConfig, attention: str) -> AttentionCore:
    """The core ``attention`` names (linear: with its exact window when ``config.local_window``
    is set), inside the position memory when ``config.position_memory`` is set."""
    if attention == "exact":
        core = ExactAttention(causal=config.causal)
    elif attention == "linear":
        core = LinearAttention(config.heads, config.head_dim, config.kernel, config.causal)
        if config.local_window:
            core = SlidingWindow(core, config.heads, config.local_window)
    else:
        core = FavorAttention(
            dim_head=config.head_dim,
            nb_features=config.nb_features,
            causal=config.causal,
            kernel=config.kernel,
            chunk_size=config.favor_chunk_size,
        )
    if not config.position_memory:
        return core
    return PositionMemory(
        core, config.heads, config.head_dim, config.position_memory, config.memory_window
    )


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with rotary q/k around the core ``config.attention`` names.

    ``layer`` (1-based) picks the core of hybrid stacks (``config.exact_every``). The core is
    registered under the attention's name, its state-dict prefix: FAVOR+'s buffers
    stay at ``...self_attn.favor.omega`` (checkpoints, ESM-2 conversions); the exact core has
    no state, so it adds no entry. :attr:`core` is the one to call.
    """

    def __init__(self, config: PerformerConfig, layer: int = 1) -> None:
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
        self._core_name = config.layer_attention(layer)
        self.add_module(self._core_name, _build_core(config, self._core_name))

    @property
    def core(self) -> AttentionCore:
        """The attention core: FAVOR+ or exact softmax, behind one interface."""
        return self._modules[self._core_name]

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        heads: Sequence[int] | None = None,
        positions: Positions = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (B, L, D), ``padding_mask`` (B, L) True = pad -> output (B, L, D) and, if
        ``need_weights``, the attention map (B, H', L, L) of ``heads`` (all heads if None).
        ``positions``: see :data:`Positions` (None: the row's own).

        The FAVOR+ map is the one the model implicitly uses (normalized feature products), never
        materialized in the forward pass itself.
        """
        B, L, D = x.shape
        q, k = self.rotated_qk(x, positions)
        v = self._split_heads(self.v_proj(x))
        extra = {"positions": positions} if getattr(self.core, "needs_positions", False) else {}
        out = self.core(q, k, v, key_padding_mask=padding_mask, **extra)
        if isinstance(out, tuple):
            out = out[0]
        out = out.transpose(1, 2).reshape(B, L, D)  # (B, H, L, d) -> (B, L, D)
        out = self.out_proj(out)
        weights = self.attention_map(q, k, padding_mask, heads) if need_weights else None
        return out, weights

    def prefill(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        positions: Positions = None,
    ) -> tuple[torch.Tensor, AttentionState]:
        """Causal forward over a prompt (B, L, D) that also returns the state to continue from.

        FAVOR+: the parallel forward plus the prefix-sum state of all prompt keys (one pass);
        exact: the parallel forward plus the KV cache. Padded keys never enter the state.
        """
        B, L, D = x.shape
        q, k = self.rotated_qk(x, positions)
        v = self._split_heads(self.v_proj(x))
        out, state = self.core.prefill(q, k, v, padding_mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D)), state

    def extend(
        self,
        x: torch.Tensor,
        state: AttentionState | None,
        positions: Positions,
        padding_mask: torch.Tensor | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, AttentionState | None]:
        """Causal attention of new tokens x (B, L, D) continuing from ``state`` (batch 1 or
        B; None: a fresh start) -> (B, L, D) and, if ``return_state``, the state after them.

        ``state`` is read, never written: a family context's state serves every candidate
        (broadcast over the batch). Padded keys never enter the output or the new state.
        """
        B, L, D = x.shape
        q, k = self.rotated_qk(x, positions)
        v = self._split_heads(self.v_proj(x))
        out, new_state = self.core.extend(state, q, k, v, padding_mask, return_state)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D)), new_state

    def _qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k and v projections stacked into one (3D, D) weight and (3D,) bias, for
        :meth:`step`: one GEMM per token instead of three. Cached and keyed on the
        parameters' storage and versions, so training, loading or moving the model rebuilds it
        (decoding only: the forward passes use the Linear layers)."""
        params = [m.weight for m in (self.q_proj, self.k_proj, self.v_proj)]
        params += [m.bias for m in (self.q_proj, self.k_proj, self.v_proj)]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        cached = self.__dict__.get("_qkv_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                weight = torch.cat([p.detach() for p in params[:3]])
                bias = torch.cat([p.detach() for p in params[3:]])
            cached = (key, weight, bias)
            self.__dict__["_qkv_cache"] = cached
        return cached[1], cached[2]

    def step(
        self,
        x_t: torch.Tensor,
        positions: torch.Tensor,
        state: AttentionState,
        pad: torch.Tensor | None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, AttentionState]:
        """One token per row, x_t (B, D) at ``positions`` (B,) -> (B, D) and the new state.

        Rows with ``pad`` (B,) True leave their state unchanged (finished sequences).
        ``inplace``: the caller owns ``state`` (see the cores' ``step``).
        """
        B, D = x_t.shape
        weight, bias = self._qkv_weights()
        qkv = torch.addmm(bias, x_t, weight.T).view(B, 3, self.heads, self.head_dim)
        qk = self.rot_emb.rotate_step(qkv[:, :2], positions).to(x_t.dtype)  # (B, 2, H, d)
        state, out = self.core.step(state, qk[:, 0], qk[:, 1], qkv[:, 2], pad, inplace=inplace)
        return F.linear(out.reshape(B, D), self.out_proj.weight, self.out_proj.bias), state

    def rotated_qk(
        self, x: torch.Tensor, positions: Positions = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D) -> q, k (B, H, L, d) after rotary, unscaled: what the attention core sees.

        Public so that ``inference.attention_maps`` can capture them from a forward hook
        without repeating the projection and rotary logic. ``positions``: see
        :data:`Positions` (None: 0, 1, ... along the row, for one lone sequence the same as
        member positions).
        """
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        if positions is None:
            return self.rot_emb(q, k)
        if isinstance(positions, int):
            return self.rot_emb(q, k, offset=positions)
        return self.rot_emb.at_positions(q, k, positions)

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
        return self.core.attention_map(
            q, k, key_padding_mask=padding_mask, query_slice=query_slice
        )
