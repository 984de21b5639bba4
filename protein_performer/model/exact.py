"""Exact softmax attention: the reference FAVOR+ approximates and the exact twin's core.

:class:`ExactAttention` is the core registered as ``exact``
(:class:`~protein_performer.model.cores.AttentionCore`: one forward with an optional state,
attention rows, contact-map blocks), so the attention layer, contact maps and generation never
ask which core they hold.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from protein_performer.model.cores.base import (
    AttentionCore,
    allowed_keys,
    compute_dtype,
    real_tokens,
)
from protein_performer.model.cores.registry import register


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
    L = q.shape[-2]
    mask = allowed_keys(key_padding_mask, causal, None, L, q.device).expand(-1, 1, L, L)
    empty = ~mask.any(-1, keepdim=True)  # (B, 1, L, 1): rows with nothing to attend to
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty)
    return out.masked_fill(empty, 0.0)


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
    dtype = compute_dtype(q)
    logits = (q[..., sl, :].to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(d)  # (B,H,W,L)
    allowed = allowed_keys(key_padding_mask, causal, query_slice, L, q.device)
    w = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(w, nan=0.0)


#: Most mask entries one SDPA call of :meth:`ExactAttention._extend` builds (64 Mi booleans).
_MASK_ELEMENTS = 1 << 26


class KVCache(NamedTuple):
    """RNN-mode state of exact causal attention: every key and value so far (a KV cache).

    k, v: (B, H, T, d) rotated keys and values; keep: (B, T) False where the row had a pad.
    """

    k: Tensor
    v: Tensor
    keep: Tensor


class ExactMapBlocks:
    """One exact-softmax head's residue x residue map as blocks, for contact maps.

    Why two sweeps: a row's normalizer needs every key, so a first sweep over windows of rows
    stores each row's log-normalizer (and the map's row and column sums, :attr:`sums`); any
    block is then exp(scores - lse) of its rows alone, O(window x L) memory.
    """

    def __init__(self, q: Tensor, k: Tensor, L: int, causal: bool, window: int) -> None:
        d = q.shape[-1]
        self.q = q[0, 0].float() * d**-0.5  # (T, d)
        self.k = k[0, 0].float()
        self.L, self.causal = L, causal
        self.lse = torch.empty(L, device=self.q.device)
        rows = torch.zeros(L, device=self.q.device)
        cols = torch.zeros(L, device=self.q.device)
        for a in range(0, L, window):
            b = min(L, a + window)
            logits = self._logits(a, b, 0, L + 2)  # (W, T): every token is normalized over
            self.lse[a:b] = torch.logsumexp(logits, -1)
            att = torch.exp(logits - self.lse[a:b, None])[:, 1 : L + 1]  # (W, L)
            rows[a:b] = att.sum(-1)
            cols += att.sum(0)
        self.sums = rows + cols  # rows of A + columns of A, (L,)

    def _logits(self, a: int, b: int, c0: int, c1: int) -> Tensor:
        """Scores of residues [a, b) against tokens [c0, c1), causal positions masked."""
        s = self.q[a + 1 : b + 1] @ self.k[c0:c1].T
        if self.causal:
            later = (
                torch.arange(c0, c1, device=s.device)[None, :]
                > torch.arange(a + 1, b + 1, device=s.device)[:, None]
            )
            s = s.masked_fill(later, float("-inf"))
        return s

    def add_upper_block(self, acc: Tensor, a: int, weight: float) -> None:
        """acc += weight * S[a:b, a:], S = A + A^T, acc (b - a, L - a): the rows' part, then the
        columns' (A's rows below a restricted to columns [a, b))."""
        L, b = self.L, a + acc.shape[0]
        rows = torch.exp(self._logits(a, b, a + 1, L + 1) - self.lse[a:b, None])  # (W, L - a)
        acc.add_(rows, alpha=weight)
        cols = torch.exp(self._logits(a, L, a + 1, b + 1) - self.lse[a:, None])  # (L - a, W)
        acc.add_(cols.T, alpha=weight)


def _room(t: Tensor, dim: int) -> int:
    """How many entries along ``dim`` the memory behind ``t`` holds: more than ``t.shape[dim]``
    only when ``t`` is a leading slice along ``dim`` of a contiguous buffer (what
    :func:`_append` leaves: its strides and its storage say so), else ``t.shape[dim]``."""
    n = t.shape[dim]
    if dim == 0 or t.stride(dim) == 0:
        return n
    room = t.stride(dim - 1) // t.stride(dim)
    shape = [*t.shape[:dim], room, *t.shape[dim + 1 :]]
    strides, size = [], 1
    for extent in reversed(shape):
        strides.append(size)
        size *= extent
    fits = t.storage_offset() + size <= t.untyped_storage().nbytes() // t.element_size()
    return room if room > n and tuple(reversed(strides)) == t.stride() and fits else n


def _append(old: Tensor, new: Tensor, dim: int) -> Tensor:
    """``old`` with ``new`` appended along ``dim``, written into the spare room behind ``old``
    when there is some (:func:`_room`); otherwise a new buffer with a quarter more room (at
    least 64 tokens) is allocated and filled (amortized O(1) per token, and a long prompt's
    cache is not doubled). Only for a cache its caller gave up (``inplace``)."""
    n, extra = old.shape[dim], new.shape[dim]
    shape = list(new.shape)
    if (
        _room(old, dim) >= n + extra
        and old.dtype == new.dtype
        and old.shape[:dim] == new.shape[:dim]
    ):
        shape[dim] = n + extra
        grown = old.as_strided(shape, old.stride())
    else:
        shape[dim] = n + extra + max(64, n // 4)
        buf = new.new_empty(shape)
        buf.narrow(dim, 0, n).copy_(old.expand(*new.shape[:dim], *old.shape[dim:]))
        grown = buf.narrow(dim, 0, n + extra)
    grown.narrow(dim, n, extra).copy_(new)
    return grown


@register("exact")
class ExactAttention(AttentionCore):
    """Exact softmax attention; no parameters or buffers, so an exact model's state dict
    (ESM-2 conversions included) has no attention-core entries. Its state, the KV cache,
    grows with the context."""

    state_grows = True
    softmax = "exact"
    label = "exact attention"

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    @classmethod
    def from_config(cls, config) -> ExactAttention:  # noqa: ANN001 - a PerformerConfig
        return cls(causal=config.causal)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        state: KVCache | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        positions: Tensor | int | None = None,
    ) -> tuple[Tensor, KVCache | None]:
        """The KV cache as the state: ``inplace`` appends a one-token step into spare room of
        the cache's buffer (grown geometrically) instead of concatenating the whole cache again
        (O(T) copied per token). ``positions`` is not needed here. The paths with a state are
        inference (causal only, no gradients)."""
        if state is None and not keep_state:
            return exact_attention(q, k, v, self.causal, key_padding_mask), None
        with torch.no_grad():
            if state is None:
                out = exact_attention(q, k, v, self.causal, key_padding_mask)
                return out, self._cache(k, v, key_padding_mask)
            if q.shape[2] == 1:
                return self._step(state, q, k, v, key_padding_mask, keep_state, inplace)
            return self._extend(state, q, k, v, key_padding_mask, keep_state)

    @staticmethod
    def _cache(k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> KVCache:
        """The KV cache of k, v (B, H, L, d): every key, the pads marked."""
        B, _, L, _ = k.shape
        return KVCache(k, v, real_tokens(key_padding_mask, B, L, k.device))

    @staticmethod
    def _step(
        state: KVCache,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        keep_state: bool,
        inplace: bool,
    ) -> tuple[Tensor, KVCache | None]:
        """One token per row, q, k, v (B, H, 1, d), after the cache: a pad's key is cached but
        never attended."""
        keep = real_tokens(key_padding_mask, q.shape[0], 1, q.device)
        if inplace:
            k, v, keep = (
                _append(old, new, dim)
                for old, new, dim in ((state.k, k, 2), (state.v, v, 2), (state.keep, keep, 1))
            )
        else:
            k, v = torch.cat([state.k, k], 2), torch.cat([state.v, v], 2)
            keep = torch.cat([state.keep, keep], dim=1)  # (B, T+1)
        # No mask when every key is real (CPU: a cheap host check; a GPU would sync on it).
        dense = q.device.type == "cpu" and bool(keep.all())
        mask = None if dense else keep[:, None, None, :]  # (B, 1, 1, T+1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out, (KVCache(k, v, keep) if keep_state else None)

    @staticmethod
    def _extend(
        state: KVCache,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        keep_state: bool,
    ) -> tuple[Tensor, KVCache | None]:
        """New tokens q, k, v (B, H, L, d) after the cache.

        They attend over concat(cache, new): the cache fully visible (its pads excluded),
        causal among the new tokens. Right padding of the new tokens needs no mask of its own
        (a real query never reaches a later key), so the common case is one (L, T + L) mask
        shared by the batch.
        """
        B, H, L, _ = q.shape
        T = state.k.shape[-2]
        kk = torch.cat([state.k.expand(B, -1, -1, -1), k], dim=2)  # (B, H, T + L, d)
        vv = torch.cat([state.v.expand(B, -1, -1, -1), v], dim=2)
        new_keep = real_tokens(key_padding_mask, B, L, q.device)
        keep = torch.cat([state.keep.expand(B, -1), new_keep], dim=1)  # (B, T + L)
        shared = bool(state.keep.all()) and bool((new_keep[:, 1:] <= new_keep[:, :-1]).all())
        # Queries in blocks so that a mask stays under _MASK_ELEMENTS (a long prefill segment
        # after a long cache would otherwise need an L x (T + L) mask); block [a, b) reads the
        # keys before T + b only.
        block = max(1, _MASK_ELEMENTS // (T + L))
        outs = []
        for a in range(0, L, block):
            b = min(L, a + block)
            causal = torch.ones(b - a, T + b, dtype=torch.bool, device=q.device).tril_(T + a)
            mask = causal if shared else causal & keep[:, None, None, : T + b]  # (B|1,1,W,T+b)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, a:b], kk[:, :, : T + b], vv[:, :, : T + b], attn_mask=mask
                )
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, L, dv)
        return out, (KVCache(kk, vv, keep) if keep_state else None)

    def attention_map(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None = None,
        query_slice: slice | None = None,
    ) -> Tensor:
        """Softmax rows (B, H, W, L) (rows sum to 1, causal-masked when causal)."""
        return exact_attention_map(
            q, k, causal=self.causal, key_padding_mask=key_padding_mask, query_slice=query_slice
        )

    def map_blocks(self, q: Tensor, k: Tensor, L: int, window: int) -> ExactMapBlocks:
        """One head's map between the L residues of ``<cls> residues <eos>``, q, k (1, 1, L + 2,
        d), rows normalized over all tokens, as blocks; window: rows per normalizer sweep."""
        return ExactMapBlocks(q, k, L, self.causal, window)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"
