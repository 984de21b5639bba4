"""Exact softmax attention: the reference FAVOR+ approximates and the exact twin's core."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def exact_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(d)) v via torch SDPA: the reference and the speed baseline.

    A query that sees no real key (possible with left padding in causal mode) outputs 0.
    """
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mask = _exact_mask(q.shape[-2], key_padding_mask, causal, q.device)  # (B, 1, L, L)
    empty = ~mask.any(-1, keepdim=True)  # (B, 1, L, 1): rows with nothing to attend to
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty)
    return out.masked_fill(empty, 0.0)


def _exact_mask(L: int, key_padding_mask: Tensor, causal: bool, device) -> Tensor:
    allowed = (~key_padding_mask.bool())[:, None, None, :]  # (B, 1, 1, L)
    if causal:
        allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=device).tril()
    return allowed.expand(-1, 1, L, L)


def exact_attention_map(
    q: Tensor,
    k: Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    query_slice: slice | None = None,
) -> Tensor:
    """Exact softmax attention rows (B, H, W, L) for the queries in query_slice, O(W L)."""
    L, d = q.shape[-2], q.shape[-1]
    sl = query_slice if query_slice is not None else slice(0, L)
    pos = torch.arange(L, device=q.device)
    dtype = torch.promote_types(q.dtype, torch.float32)
    logits = (q[..., sl, :].to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(d)  # (B,H,W,L)
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if causal:
        allowed = allowed & (pos[sl][:, None] >= pos[None, :])
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.bool()[:, None, None, :]
    w = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(w, nan=0.0)
