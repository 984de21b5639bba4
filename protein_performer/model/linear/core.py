"""Linear attention with a deterministic or learned feature map: the core behind
``attention="linear"`` (kernels ``taylor`` and ``hedgehog``, :mod:`.maps`).

out_t = sum_j phi(q_t).phi(k_j) v_j / sum_j phi(q_t).phi(k_j), over j <= t when causal. The
causal form runs in chunks of ``chunk`` tokens: within a chunk the masked (C, C) products, across
chunks the prefix sums S = sum phi(k)[v | 1]^T (fla's ``chunk.py`` layout, written here with
plain autograd since a learned map needs gradients for its own weights). The recurrent state is
that one sum, (B, H, M, dv + 1), whatever the context length.

Unlike FAVOR+'s exp features these need no stabilizer: the maps' kernels are bounded below
(Taylor >= 1/2, Hedgehog > 0), so the normalizer never vanishes; features are computed in
float32 (float64 for float64 inputs), also under autocast.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from protein_performer.model.config import LINEAR_KERNELS
from protein_performer.model.cores.base import AttentionCore, allowed_keys, compute_dtype
from protein_performer.model.cores.registry import register
from protein_performer.model.linear.maps import build_linear_map

_TINY = torch.finfo(torch.float32).tiny


class LinearState(NamedTuple):
    """RNN-mode state of the linear core: kv (B, H, M, dv+1) = sum over seen keys of
    phi(k_j)[v_j | 1]^T."""

    kv: Tensor


def _normalized(num: Tensor) -> Tensor:
    """[numerator | normalizer] (..., dv+1) -> numerator / normalizer."""
    return num[..., :-1] / num[..., -1:].clamp_min(_TINY)


def causal_linear(qf: Tensor, kf: Tensor, vx: Tensor, kv0: Tensor | None, chunk: int):
    """Causal sums sum_{j<=t} (qf_t . kf_j) vx_j plus qf_t . kv0, and the sum after the last key.

    qf, kf (B, H, L, M), vx (B, H, L, C), kv0 (B|1, H, M, C) or None -> ((B, H, L, C),
    (B, H, M, C)). Chunked: a (c, c) masked product inside each chunk, exclusive prefix sums of
    the chunks' kf^T vx across them.
    """
    B, H, L, M = qf.shape
    C = vx.shape[-1]
    n = -(-L // chunk)
    pad = n * chunk - L
    if pad:
        qf, kf, vx = (F.pad(t, (0, 0, 0, pad)) for t in (qf, kf, vx))
    qc = qf.view(B, H, n, chunk, M)
    kc = kf.view(B, H, n, chunk, M)
    vc = vx.view(B, H, n, chunk, C)
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=qf.device).tril_()
    scores = (qc @ kc.mT).masked_fill(~tril, 0.0)  # (B, H, n, c, c)
    out = scores @ vc  # (B, H, n, c, C)
    sums = kc.mT @ vc  # (B, H, n, M, C): each chunk's keys
    prefix = sums.cumsum(2) - sums  # keys of the chunks before
    if kv0 is not None:
        prefix = prefix + kv0[:, :, None]
    out = out + qc @ prefix
    last = prefix[:, :, -1] + sums[:, :, -1]  # (B, H, M, C)
    return out.reshape(B, H, n * chunk, C)[:, :, :L], last


@register("linear")
class LinearAttention(AttentionCore):
    """Linear attention behind the attention cores' interface (forward with an optional state,
    attention rows); ``kernel`` names a map of :data:`~.maps.LINEAR_MAPS`."""

    kernels = LINEAR_KERNELS

    def __init__(
        self, heads: int, dim_head: int, kernel: str, causal: bool, chunk_size: int = 64
    ) -> None:
        super().__init__()
        self.causal = causal
        self.kernel = kernel
        self.chunk_size = chunk_size
        self.feature_map = build_linear_map(kernel, heads, dim_head)

    @classmethod
    def from_config(cls, config) -> LinearAttention:  # noqa: ANN001 - a PerformerConfig
        return cls(config.heads, config.head_dim, config.kernel, config.causal)

    @classmethod
    def extra_numel(cls, config) -> int:  # noqa: ANN001
        return config.heads * config.head_dim * (config.head_dim + 1)

    @property
    def label(self) -> str:  # type: ignore[override]
        return f"the {self.kernel} linear attention"

    @property
    def feature_dim(self) -> int:
        return self.feature_map.feature_dim(self.feature_map.head_dim)

    def _features(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        dtype = compute_dtype(q)
        qf = self.feature_map(q.to(dtype))  # (B, H, L, M)
        kf = self.feature_map(k.to(dtype))
        vx = F.pad(v.to(dtype), (0, 1), value=1.0)  # (B, H, L, dv+1): [v | 1]
        if key_padding_mask is not None:
            kf = kf * (~key_padding_mask.bool())[:, None, :, None].to(dtype)
        return qf, kf, vx

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        state: LinearState | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        positions: Tensor | int | None = None,
    ) -> tuple[Tensor, LinearState | None]:
        """q, k, v (B, H, L, d) -> (B, H, L, dv) and, with ``keep_state``, the state after the
        tokens; ``state`` (batch 1 or B) continues an earlier part of the row and is never
        written (``inplace`` and ``positions`` are part of the cores' call: the sum is small,
        so a step allocates a new one, and the map needs no positions)."""
        with torch.autocast(device_type=q.device.type, enabled=False):
            qf, kf, vx = self._features(q, k, v, key_padding_mask)
            if not self.causal:
                out = qf @ (kf.mT @ vx)  # (B, H, L, dv+1)
                return _normalized(out).to(q.dtype), None
            kv0 = None if state is None else state.kv.to(qf)
            chunk = 1 if q.shape[2] == 1 else self.chunk_size
            num, last = causal_linear(qf, kf, vx, kv0, chunk)
        new = LinearState(last) if keep_state else None
        return _normalized(num).to(q.dtype), new

    def attention_map(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None = None,
        query_slice: slice | None = None,
    ) -> Tensor:
        """The implied rows (B, H, W, L) of the queries in ``query_slice``: phi(q).phi(k)
        normalized over the (causal, real) keys; O(W L) memory."""
        qs = q if query_slice is None else q[:, :, query_slice]
        dtype = compute_dtype(q)
        with torch.autocast(device_type=q.device.type, enabled=False):
            scores = self.feature_map(qs.to(dtype)) @ self.feature_map(k.to(dtype)).mT
            L = k.shape[2]
            allowed = allowed_keys(key_padding_mask, self.causal, query_slice, L, q.device)
            scores = scores.masked_fill(~allowed, 0.0)
            scores = scores / scores.sum(-1, keepdim=True).clamp_min(_TINY)
        return scores.to(q.dtype)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel!r}, causal={self.causal}, chunk_size={self.chunk_size}"
