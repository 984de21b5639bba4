"""Multi-head self-attention: projections, heads and rotary around one attention core.

The math lives in the core, FAVOR+ (:class:`~protein_performer.model.favor.FavorAttention`),
exact softmax (:class:`~protein_performer.model.exact.ExactAttention`), linear attention
(:class:`~protein_performer.model.linear.core.LinearAttention`, alone or with its exact
:class:`~protein_performer.model.linear.window.SlidingWindow`), any of them inside the position
memory (:class:`~protein_performer.model.linear.memory.PositionMemory`); all offer one
interface (one forward with an optional state, attention rows, contact-map blocks), so this
module never asks which it holds. It owns the projections, named like ESM-2's
``q_proj k_proj v_proj out_proj`` so its weights load by renaming.

ESM-2 scales q by ``head_dim ** -0.5`` before rotary; rotary is linear, so rotating the unscaled
q and letting the attention core apply ``1/sqrt(d)`` gives the same scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from protein_performer.model.config import PerformerConfig
from protein_performer.model.exact import ExactAttention, ExactMapBlocks, KVCache
from protein_performer.model.favor import FavorAttention, FavorState
from protein_performer.model.favor.module import FavorMapBlocks
from protein_performer.model.linear.core import LinearAttention, LinearState
from protein_performer.model.linear.memory import MemoryState, PositionMemory
from protein_performer.model.linear.window import SlidingWindow, WindowState
from protein_performer.model.rotary import RotaryEmbedding, as_positions

#: The attention cores: one interface, five implementations.
AttentionCore = FavorAttention | ExactAttention | LinearAttention | SlidingWindow | PositionMemory
#: What one attention layer carries between calls (generation steps, a family context).
AttentionState = FavorState | KVCache | LinearState | WindowState | MemoryState


def state_tensors(state: tuple) -> list[torch.Tensor]:
    """The tensors of a state or of per-layer states, nested ones (the position memory's
    ``inner``) included: what a state holds, for its size or a copy."""
    return [t for s in state for t in (state_tensors(s) if isinstance(s, tuple) else [s])]


#: One head's residue x residue map as blocks (``.sums``, ``.add_upper_block``), for contacts.
MapBlocks = FavorMapBlocks | ExactMapBlocks
#: Rotary positions: None (0, 1, ... along the row), an int offset (the first token's
#: position), a tensor (B,) of each row's first position (a decoding step's), or a tensor
#: (B, L) of per-token positions (see :func:`~protein_performer.model.rotary.as_positions`).
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
        state: AttentionState | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        coordinates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, AttentionState | None]:
        """``x`` (B, L, D), ``padding_mask`` (B, L) True = pad -> output (B, L, D), the
        attention map (B, H', L, L) of ``heads`` (all heads if None) if ``need_weights``, and
        the core's state after the tokens if ``keep_state``.

        ``positions``: see :data:`Positions` (None: the row's own). ``state`` continues an
        earlier part of the row (read, never written unless ``inplace``: the caller gives it
        up); see the cores' ``forward``. One token after a state (a decoding step) takes q, k
        and v from one GEMM and rotates them in one call (:meth:`_step_qkv`), since a token's
        cost is mostly per-op overhead. The FAVOR+ map is the one the model implicitly uses
        (normalized feature products), never materialized in the forward pass itself.

        ``coordinates`` (B, L) long: the position each token is keyed by in a core that keeps
        a memory by position (a homolog residue's reference coordinate, -1: no position;
        ``PerformerLM.forward``); handed only to a core that declares
        ``reads_coordinates``, the others have no such memory. Rotary uses ``positions``.
        """
        B, L, D = x.shape
        if state is not None and L == 1 and self._fusable():
            at = positions if isinstance(positions, torch.Tensor) else None
            if at is None or at.numel() != B:
                at = as_positions(positions, B, 1, x.device)
            q, k, v = self._step_qkv(x.reshape(B, D), at.reshape(B))
        else:
            q, k = self.rotated_qk(x, positions)
            v = self._split_heads(self.v_proj(x))
        placed = {}
        if coordinates is not None and getattr(self.core, "reads_coordinates", False):
            placed["coordinates"] = coordinates
        out, new_state = self.core(
            q,
            k,
            v,
            padding_mask,
            state,
            keep_state=keep_state,
            inplace=inplace,
            positions=positions,
            **placed,
        )
        out = out.transpose(1, 2).reshape(B, L, D)  # (B, H, L, d) -> (B, L, D)
        out = self.out_proj(out)
        weights = self.attention_map(q, k, padding_mask, heads) if need_weights else None
        return out, weights, new_state

    def _qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k and v projections stacked into one (3D, D) weight and (3D,) bias, for
        :meth:`_step_qkv`: one GEMM per token instead of three. Cached and keyed on the
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

    def _fusable(self) -> bool:
        """Whether q, k and v may come from one stacked GEMM: plain Linear layers (a LoRA
        adapter, which replaces them, must run its own forward)."""
        return all(type(m) is nn.Linear for m in (self.q_proj, self.k_proj, self.v_proj))

    def _step_qkv(
        self, x_t: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row, x_t (B, D) at ``positions`` (B,) -> rotated q, k and v
        (B, H, 1, d), the values :meth:`rotated_qk` gives."""
        B, D = x_t.shape
        weight, bias = self._qkv_weights()
        qkv = torch.addmm(bias, x_t, weight.T).view(B, 3, self.heads, self.head_dim)
        qk = self.rot_emb.rotate_step(qkv[:, :2], positions).to(x_t.dtype)  # (B, 2, H, d)
        # Views by method calls, not indexing: a slice index costs several times a select.
        q, k = qk.unsqueeze(3).unbind(1)  # (B, H, 1, d) each
        return q, k, qkv.select(1, 2).unsqueeze(2)

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
        if isinstance(positions, torch.Tensor) and positions.ndim < 2:
            positions = as_positions(positions, x.shape[0], x.shape[1], x.device)
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
