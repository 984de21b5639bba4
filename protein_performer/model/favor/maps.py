"""Implied attention maps: the rows FAVOR+ uses without forming them (its output for V = I),
for any window of queries, with the same features and stabilizers as the forward."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from protein_performer.model.favor.kernels import (
    FeatureMap,
    build_feature_map,
    column_max,
    flatten_heads,
    kernel_class,
    running_max,
)
from protein_performer.model.favor.scan import safe_denominator


def favor_attention_map(
    q: Tensor,
    k: Tensor,
    omega: Tensor,
    *,
    kernel: str = "softmax",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    query_slice: slice | None = None,
    oprf_rho: Tensor | float | None = None,
    relu_eps: float = 1e-3,
) -> Tensor:
    """Implied attention rows (B, H, W, L) for the queries in query_slice.

    Same features and stabilizers as :func:`favor_attention`, so map @ V equals its output;
    memory O(W L + L M).
    """
    kernel_class(kernel)
    B, H, L, _ = q.shape
    sl = query_slice if query_slice is not None else slice(0, L)
    with torch.autocast(device_type=q.device.type, enabled=False):
        if causal:
            x, y, _, keep = flatten_heads(q, k, k[..., :1], key_padding_mask)
            fmap = build_feature_map(kernel, omega, True, oprf_rho, x, y, keep, relu_eps)
            logits = fmap.key_logits(y, keep)
            mu = running_max(logits)
            kf = fmap.keys(y, logits, None if mu is None else mu[..., None], keep)  # (BH, L, M)
            qf, _ = fmap.queries(x[:, sl])  # (BH, W, M)
            w = qf @ kf.mT  # (BH, W, L)
            pos = torch.arange(L, device=q.device)
            allowed = pos[sl][:, None] >= pos[None, :]  # (W, L)
            if mu is None:
                w = w * allowed
            else:  # key j's feature is relative to mu_j; query t's normalization to mu_t
                decay = (mu[:, None, :] - mu[:, sl, None]).masked_fill(~allowed, float("-inf"))
                w = w * decay.exp()
        else:
            f = MapFactors.from_heads(
                q, k, omega, kernel=kernel, key_padding_mask=key_padding_mask, relu_eps=relu_eps
            )
            w = f.queries(sl, normalized=False) @ f.keys().mT  # (BH, W, L)
        w = w / safe_denominator(w.sum(-1, keepdim=True))
    return w.reshape(B, H, w.shape[1], L)


class MapStabilizers(NamedTuple):
    """What fixes a bidirectional implied map beyond q and k: the feature map (with its FAVOR++
    statistic), the key stabilizer col (BH, 1, M|1) or None (relu), the key feature sum (BH, M)."""

    fmap: FeatureMap
    col: Tensor | None
    key_sum: Tensor


class MapFactors:
    """The bidirectional implied attention as a product A = queries() @ keys()^T.

    Why: contact maps need blocks A[rows, cols] and every row and column sum of A for L far
    beyond an L x L matrix (titin: 34k residues). The key stabilizer (a per-feature max over all
    keys, moved to the query side where a per-row factor cancels) and the normalizers are fixed
    once from the whole sequence (:attr:`stabilizers`, O(L M)); a later instance given them
    recomputes any block from the features of its rows alone, with the values
    :func:`favor_attention_map` gives. Build it with :meth:`from_heads`.
    """

    def __init__(self, x: Tensor, y: Tensor, keep: Tensor | None, fixed: MapStabilizers) -> None:
        self.x, self.y, self.keep, self.stabilizers = x, y, keep, fixed

    @classmethod
    def from_heads(
        cls,
        q: Tensor,
        k: Tensor,
        omega: Tensor,
        *,
        kernel: str = "softmax",
        key_padding_mask: Tensor | None = None,
        relu_eps: float = 1e-3,
        fixed: MapStabilizers | None = None,
    ) -> MapFactors:
        """Factors of unscaled q, k (B, H, L, d) (heads flattened into BH, float32)."""
        x, y, _, keep = flatten_heads(q, k, k[..., :1], key_padding_mask)
        if fixed is None:
            fmap = build_feature_map(kernel, omega, False, None, x, y, keep, relu_eps)
            logits, col = column_max(fmap.key_logits(y, keep))
            key_sum = fmap.keys(y, logits, col, keep).sum(1)
            fixed = MapStabilizers(fmap, col, key_sum)
        return cls(x, y, keep, fixed)

    def keys(self, sl: slice = slice(None)) -> Tensor:
        """Key features of the keys in ``sl``, (BH, n, M); pads 0."""
        fmap, col = self.stabilizers.fmap, self.stabilizers.col
        y, keep = self.y[:, sl], None if self.keep is None else self.keep[:, sl]
        return fmap.keys(y, fmap.key_logits(y, keep).merged(), col, keep)

    def queries(self, sl: slice = slice(None), normalized: bool = True) -> Tensor:
        """Query features of the queries in ``sl``, (BH, n, M), divided by each row's
        normalizer when ``normalized`` (then queries() @ keys()^T rows sum to 1)."""
        fmap, col = self.stabilizers.fmap, self.stabilizers.col
        qf, _ = fmap.queries(self.x[:, sl], offset=col if fmap.exp else None)
        if not normalized:
            return qf
        den = (qf * self.stabilizers.key_sum[:, None, :]).sum(-1, keepdim=True)
        return qf / safe_denominator(den)
