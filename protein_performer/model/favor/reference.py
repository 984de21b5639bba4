"""The spec: FAVOR+ with plain autograd and quadratic memory, as docs/FAVOR.md states it.

Every fused path is tested against it."""

from __future__ import annotations

import torch
from torch import Tensor

from protein_performer.model.favor.kernels import build_feature_map, column_max, flatten_heads
from protein_performer.model.favor.scan import safe_denominator


def favor_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    omega: Tensor,
    *,
    kernel: str = "softmax",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    oprf_rho: Tensor | float | None = None,
    relu_eps: float = 1e-3,
) -> Tensor:
    """phi(Q) phi(K)^T, masked and row-normalized, times V: FAVOR+ as FAVOR.md states it.

    Plain autograd (gradients reach omega and oprf_rho too) and O(L^2) memory: the spec the
    fused paths are tested against, and the path :func:`favor_attention` takes when omega or the
    statistic needs gradients. (B, H, L, d) -> (B, H, L, dv).
    """
    B, H, L, _ = q.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        x, y, vv, keep = flatten_heads(q, k, v, key_padding_mask)
        fmap = build_feature_map(kernel, omega, causal, oprf_rho, x, y, keep, relu_eps)
        logits, col = column_max(fmap.key_logits(y, keep))
        kf = fmap.keys(y, logits, col, keep)  # (BH, L, M)
        qf, _ = fmap.queries(x, offset=col if fmap.exp else None)  # (BH, L, M)
        a = qf @ kf.mT  # (BH, L, L)
        if causal:
            a = a.tril()
        out = (a @ vv) / safe_denominator(a.sum(-1, keepdim=True))
    return out.reshape(B, H, L, -1).to(q.dtype)
