"""Multi-head self-attention: projections, heads and rotary around one attention core.

The math lives in the core (:class:`~protein_performer.model.cores.AttentionCore`), built by
the registry from the config (:func:`~protein_performer.model.cores.build_core`): exact softmax,
FAVOR+, linear attention, inside the wrappers the config turns on (the linear core's exact
window, the position memory). All take one call (one forward with an optional state) and give
attention rows and contact-map blocks, so this module never asks which it holds. It owns the
projections, named like ESM-2's ``q_proj k_proj v_proj out_proj`` so its weights load by
renaming.

ESM-2 scales q by ``head_dim ** -0.5`` before rotary; rotary is linear, so rotating the unscaled
q and letting the attention core apply ``1/sqrt(d)`` gives the same scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from protein_performer.model.config import PerformerConfig
from protein_performer.model.cores import AttentionCore, build_core, upgrade_keys
from protein_performer.model.rotary import RotaryEmbedding, as_positions

#: What one attention layer carries between calls (generation steps, a family context): the
#: core's state (FAVOR+ ``FavorState``, exact ``KVCache``, linear ``LinearState``, a wrapper's
#: tuple holding its inner core's).
AttentionState = Any


def state_tensors(state: tuple) -> list[torch.Tensor]:
    """The tensors of a state or of per-layer states, nested ones (the position memory's
    ``inner``) included: what a state holds, for its size or a copy."""
    return [t for s in state for t in (state_tensors(s) if isinstance(s, tuple) else [s])]


#: Rotary positions: None (0, 1, ... along the row), an int offset (the first token's
#: position), a tensor (B,) of each row's first position (a decoding step's), or a tensor
#: (B, L) of per-token positions (see :func:`~protein_performer.model.rotary.as_positions`).
Positions = int | torch.Tensor | None


def _upgrade_core_keys(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: keys of 0.5 (the core under its attention's name) read as
    today's (``core``), so every loader, a training resume included, takes old files."""
    own = {k: v for k, v in state.items() if k.startswith(prefix)}
    for old, new in zip(own, upgrade_keys(own), strict=True):
        if old != new:
            state[new] = state.pop(old)


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with rotary q/k around the core ``config.attention`` names.

    ``layer`` (1-based) picks the core of hybrid stacks (``config.exact_every``). The core's
    tensors live under ``...self_attn.core.`` whatever it is (FAVOR+'s ``core.omega``, the
    memory's ``core.gate_bias`` and its inner core's ``core.inner.omega``), so an attention
    swap keeps every learned tensor at its key; the exact core has no tensors, so it adds no
    entry. Files of 0.5 (``...self_attn.favor.omega``) load through a pre-hook.
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
        self.core: AttentionCore = build_core(config, layer)
        self.register_load_state_dict_pre_hook(_upgrade_core_keys)

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
        cost is mostly per-op overhead; without gradients (embedding, scoring, a prefill) any
        length takes them from one GEMM too (a tenth less time in the projections at 2,048
        tokens, issue 43). The FAVOR+ map is the one the model implicitly uses
        (normalized feature products), never materialized in the forward pass itself.

        ``coordinates`` (B, L) long: the position each token is keyed by in a core that keeps
        a memory by position (a homolog residue's reference coordinate, -1: no position;
        ``PerformerLM.forward``); the core hands them on only if it declares
        ``reads_coordinates`` (the others have no such memory). Rotary uses ``positions``.
        """
        B, L, D = x.shape
        if state is not None and L == 1 and self._fusable():
            at = positions if isinstance(positions, torch.Tensor) else None
            if at is None or at.numel() != B:
                at = as_positions(positions, B, 1, x.device)
            q, k, v = self._step_qkv(x.reshape(B, D), at.reshape(B))
        elif not torch.is_grad_enabled() and self._fusable():  # inference: one GEMM for q, k, v
            weight, bias = self._qkv_weights()
            q, k, v = torch.nn.functional.linear(x, weight, bias).split(D, -1)  # (B, L, D) each
            q, k = self._rotate(self._split_heads(q), self._split_heads(k), positions)
            v = self._split_heads(v)
        else:
            q, k = self.rotated_qk(x, positions)
            v = self._split_heads(self.v_proj(x))
        out, new_state = self.core(
            q,
            k,
            v,
            padding_mask,
            state,
            keep_state=keep_state,
            inplace=inplace,
            positions=positions,
            coordinates=coordinates,
        )
        out = out.transpose(1, 2).reshape(B, L, D)  # (B, H, L, d) -> (B, L, D)
        out = self.out_proj(out)
        weights = self.attention_map(q, k, padding_mask, heads) if need_weights else None
        return out, weights, new_state

    def _qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k and v projections stacked into one (3D, D) weight and (3D,) bias, for
        :meth:`_step_qkv` and forward passes without gradients: one GEMM instead of three.
        Cached and keyed on the parameters' storage and versions, so training, loading or
        moving the model rebuilds it (inference only: training uses the Linear layers)."""
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
        return self._rotate(q, k, positions)

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, L, d) rotated at ``positions`` (see :data:`Positions`)."""
        if isinstance(positions, torch.Tensor) and positions.ndim < 2:
            positions = as_positions(positions, q.shape[0], q.shape[2], q.device)
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
