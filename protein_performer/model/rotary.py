"""Rotary position embeddings, ESM-2's variant (RoFormer with GPT-NeoX's half-split rotation).

Rotary is why the model has no maximum length: positions enter only as rotations of q and k,
computed on the fly for whatever length arrives, and q·k then depends on the offset between
positions only. Applied before the FAVOR+ feature map, so the kernel sees rotated q and k exactly
as ESM-2's softmax does.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim's two halves (ESM-2's pairing, not interleaved)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., L, d) by position tables ``cos``/``sin`` (L, d)."""
    return x * cos + rotate_half(x) * sin


def rotary_tables(
    length: int,
    dim: int,
    base: float = 10000.0,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos``/``sin`` (length, dim) for positions ``offset .. offset + length - 1``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    t = torch.arange(offset, offset + length, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (L, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (L, d): both halves share a frequency
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k; holds no state that a checkpoint needs.

    Tables are computed in float32 (positions up to 2**24 are exact). One table per (device,
    dtype) is cached at the longest length seen and sliced for shorter inputs, so variable-length
    batches neither recompute nor accumulate tables.
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dimension must be even, got {dim}")
        self.dim = dim
        self.base = base
        self._cache: dict[tuple[torch.device, torch.dtype, bool], tuple[torch.Tensor, ...]] = {}

    def tables(
        self, length: int, device: torch.device, dtype: torch.dtype, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` (length, dim) in ``dtype`` for positions starting at ``offset``."""
        end = offset + length
        # Tables made under inference_mode cannot be saved for backward later: key on the mode.
        key = (torch.device(device), dtype, torch.is_inference_mode_enabled())
        cached = self._cache.get(key)
        if cached is None or cached[0].shape[0] < end:
            # Grow geometrically: token-by-token decoding asks for one more position each step.
            size = end if cached is None else max(end, 2 * cached[0].shape[0])
            cos, sin = rotary_tables(size, self.dim, self.base, device=device)
            half = torch.ones(self.dim, device=device)
            half[: self.dim // 2] = -1.0
            # The step's table: cos | sin with rotate_half's sign folded in (see rotate_step).
            step = torch.cat([cos, sin * half], dim=-1)
            cached = (cos.to(dtype), sin.to(dtype), step.to(dtype))
            self._cache[key] = cached
        return cached[0][offset:end], cached[1][offset:end]

    def rotate_step(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate one token per row, x (B, ..., d) at ``positions`` (B,): the step's q and k
        in one call, with the values :meth:`at_positions` gives.

        Why: decoding rotates once per token and layer; rotate_half(x) * sin is x rolled by
        d/2 times a sine table with the sign folded in (the same products), so q and k (one
        tensor) take one table lookup and four ops."""
        return rotate_rows(x, self.step_rows(positions, x.device, x.dtype))

    def step_rows(self, positions: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
        """The step's table rows (B, 2d) of ``positions`` (B,), cos | sin with rotate_half's
        sign folded in, in the compute dtype of inputs of ``dtype``."""
        compute = torch.promote_types(dtype, torch.float32)
        self.tables(int(positions.max()) + 1, device, compute)
        key = (torch.device(device), compute, torch.is_inference_mode_enabled())
        return self._cache[key][2].index_select(0, positions)  # (B, 2d)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (..., L, d); ``offset`` is the position of the first token (RNN mode).

        Half-precision inputs are rotated in float32 and cast back: bf16 tables would put ~0.4%
        error on every angle, growing with position.
        """
        compute = torch.promote_types(k.dtype, torch.float32)
        cos, sin = self.tables(k.shape[-2], k.device, compute, offset)
        q_rot = apply_rotary(q.to(compute), cos, sin).to(q.dtype)
        k_rot = apply_rotary(k.to(compute), cos, sin).to(k.dtype)
        return q_rot, k_rot

    def at_positions(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k at explicit positions: one token per row, q and k (B, H, 1, d) at
        positions (B,), or every token, (B, H, L, d) at positions (B, L).

        RNN-mode decoding of prompts of different lengths puts every row at another position;
        positions that restart at each family member (``PerformerConfig.positions="member"``)
        put every token at its own. The rotation is the one :meth:`forward` gives that
        position in a whole sequence (the same table entries).
        """
        compute = torch.promote_types(k.dtype, torch.float32)
        cos, sin = self.tables(int(positions.max()) + 1, k.device, compute)
        if positions.ndim == 2:
            cos, sin = cos[positions][:, None], sin[positions][:, None]  # (B, 1, L, d)
        else:
            cos, sin = cos[positions][:, None, None], sin[positions][:, None, None]  # (B,1,1,d)
        q_rot = apply_rotary(q.to(compute), cos, sin).to(q.dtype)
        k_rot = apply_rotary(k.to(compute), cos, sin).to(k.dtype)
        return q_rot, k_rot


def rotate_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (B, ..., d) rotated by its row's ``rows`` (B, 2d) of :meth:`RotaryEmbedding.step_rows`:
    rotate_half(x) * sin is x rolled by d/2 times the signed sine, four ops."""
    d = x.shape[-1]
    rows = rows.view(x.shape[0], *([1] * (x.ndim - 2)), 2 * d)
    cos, sin = rows[..., :d], rows[..., d:]
    x = x.to(rows.dtype)
    out = x * cos
    out += x.roll(d // 2, -1) * sin
    return out


def member_bounds(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Family members from where they start, ``starts`` (B, L) bool: each token's member index
    (B, L), from 0 (a partial member before the row's first start counts as one), and the
    index of its member's first token (B, L) (-1 before the first start).

    The one place members are worked out: the model's member positions (a ``<cls>`` starts
    a member), the position memory's layout (a position that does not continue the previous
    one starts a member) and a family context's prefill segments all call it.
    """
    L = starts.shape[-1]
    idx = torch.arange(L, device=starts.device)
    first = torch.where(starts, idx, -1).cummax(-1).values  # last start <= t
    index = starts.long().cumsum(-1) - starts[..., :1].long()
    return index, first


def member_positions(tokens: torch.Tensor, cls_idx: int, offset: int = 0) -> torch.Tensor:
    """Rotary positions (B, L) that restart at 0 at every ``<cls>`` of tokens (B, L).

    Why: in a row of family members ``<cls> m1 <eos> <cls> m2 <eos> ...`` each member then
    sees the positions a lone sequence sees (PoET's within-sequence positions), derived from
    the tokens so the data needs no position field. Tokens before the row's first ``<cls>``
    continue from ``offset`` (the position of the first token within its member).
    """
    idx = torch.arange(tokens.shape[-1], device=tokens.device)
    _, start = member_bounds(tokens == cls_idx)  # (B, L)
    return torch.where(start >= 0, idx - start, idx + offset)


def as_positions(positions: torch.Tensor | int | None, B: int, L: int, device) -> torch.Tensor:
    """Rotary positions (B, L) long of L tokens per row from any of the forms the attention
    layer takes: None (0, 1, ...), an int or a 0-d tensor (the first token's position), a (B,)
    tensor (each row's first position, e.g. a decoding step's), or (B, L) per token."""
    if isinstance(positions, torch.Tensor) and positions.ndim == 2:
        return positions.to(device=device, dtype=torch.long).expand(B, L)
    steps = torch.arange(L, device=device)
    if positions is None:
        return steps.expand(B, L)
    if isinstance(positions, int):
        return (steps + positions).expand(B, L)
    start = positions.to(device=device, dtype=torch.long).reshape(-1, 1)  # (B | 1, 1)
    return (start + steps).expand(B, L)
