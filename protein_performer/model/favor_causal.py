"""Chunked causal linear attention with an O(L)-memory custom backward.

Given non-negative (or, for trig, signed) feature maps qf = phi(Q), kf = phi(K) and values V, the
causal output is out_t = sum_{j<=t} w_tj v_j / sum_{j<=t} w_tj with w_tj = qf_t . kf_j. The
sequence is cut into chunks of C tokens: inside a chunk the masked C x C weights are formed
exactly; across chunks a running state S = sum_j kf_j [v_j | 1]^T (M x (dv+1)) carries the prefix.

Stabilizer without future information: the true key feature is kf_j * exp(mu_j), where mu is a
non-decreasing running max (computed by the caller from keys <= j only). Query t then uses
kf_j * exp(mu_j - mu_t) <= kf_j, i.e. every key it sees is rescaled by the same exp(-mu_t), which
cancels between numerator and normalizer. All rescale factors are exp(non-positive), so nothing
overflows, and a large future key can never push a past key's features to zero.

Backward recomputes per chunk: one forward-in-time scan rebuilds the states for the query
gradients, one reverse scan accumulates the state adjoint dS for the key/value gradients. Nothing
of size (chunks x M x dv) is ever stored.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_linear_attention", "safe_denominator"]


def safe_denominator(den: Tensor) -> Tensor:
    """Keep a normalizer away from 0 without biasing any representable value.

    Only |den| below float32's smallest normal number is touched (a row that sees no real key
    then outputs 0 instead of NaN).
    """
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(den.abs() < tiny, torch.full_like(den, tiny), den)


def _chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def _decay(mu_c: Tensor, tril: Tensor) -> Tensor:
    """exp(mu_j - mu_t) for j <= t inside a chunk, 0 above the diagonal. (BH, l, l)."""
    n = mu_c.shape[-1]
    diff = mu_c[:, None, :] - mu_c[:, :, None]  # (BH, t, j): mu_j - mu_t
    return diff.masked_fill(~tril[:n, :n], float("-inf")).exp_()


class _CausalLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qf: Tensor, kf: Tensor, v: Tensor, mu: Tensor, chunk: int) -> Tensor:
        BH, L, M = qf.shape
        dv = v.shape[-1]
        vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)  # (BH, L, dv+1)
        ys = torch.empty(BH, L, dv + 1, dtype=v.dtype, device=v.device)
        tril = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril_()
        state = v.new_zeros(BH, M, dv + 1)  # running sum kf_j [v_j|1]^T, scaled by exp(-mu_end)
        mu_prev = None
        for s, e in _chunk_bounds(L, chunk):
            q_c, k_c, vx_c, mu_c = qf[:, s:e], kf[:, s:e], vx[:, s:e], mu[:, s:e]
            mu_end = mu_c[:, -1:]  # (BH, 1)
            w = torch.bmm(q_c, k_c.transpose(1, 2)).mul_(_decay(mu_c, tril))  # (BH, l, l)
            y_c = torch.bmm(w, vx_c)  # (BH, l, dv+1)
            if mu_prev is not None:
                r = torch.exp(mu_prev - mu_c)  # (BH, l): past state seen from row t
                y_c.addcmul_(r[..., None], torch.bmm(q_c, state))
                state.mul_(torch.exp(mu_prev - mu_end)[..., None])
            sc = torch.exp(mu_c - mu_end)[..., None]  # (BH, l, 1)
            state.baddbmm_(k_c.transpose(1, 2), vx_c * sc)
            ys[:, s:e] = y_c
            mu_prev = mu_end
        den = safe_denominator(ys[..., dv:])  # (BH, L, 1)
        out = ys[..., :dv] / den
        ctx.chunk = chunk
        ctx.save_for_backward(qf, kf, v, mu, out, den)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        qf, kf, v, mu, out, den = ctx.saved_tensors
        chunk = ctx.chunk
        BH, L, M = qf.shape
        dv = v.shape[-1]
        grad_out = grad_out.contiguous()
        # out = num / den  ->  dnum = g / den, dden = -(g . out) / den
        dy = torch.cat([grad_out, -(grad_out * out).sum(-1, keepdim=True)], dim=-1) / den
        vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)  # (BH, L, dv+1)
        dq = torch.empty_like(qf)
        dk = torch.empty_like(kf)
        dvx = torch.empty_like(vx)
        tril = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril_()
        bounds = _chunk_bounds(L, chunk)

        # Pass 1, forward in time: intra-chunk terms and the query gradient through the state.
        state = v.new_zeros(BH, M, dv + 1)
        mu_prev = None
        for s, e in bounds:
            q_c, k_c, vx_c, mu_c, dy_c = qf[:, s:e], kf[:, s:e], vx[:, s:e], mu[:, s:e], dy[:, s:e]
            mu_end = mu_c[:, -1:]
            decay = _decay(mu_c, tril)  # (BH, l, l)
            w = torch.bmm(q_c, k_c.transpose(1, 2)).mul_(decay)
            dw = torch.bmm(dy_c, vx_c.transpose(1, 2)).mul_(decay)
            dq_c = torch.bmm(dw, k_c)  # (BH, l, M)
            dk[:, s:e] = torch.bmm(dw.transpose(1, 2), q_c)
            dvx[:, s:e] = torch.bmm(w.transpose(1, 2), dy_c)
            if mu_prev is not None:
                r = torch.exp(mu_prev - mu_c)[..., None]  # (BH, l, 1)
                dq_c.baddbmm_(dy_c * r, state.transpose(1, 2))
                state.mul_(torch.exp(mu_prev - mu_end)[..., None])
            sc = torch.exp(mu_c - mu_end)[..., None]
            state.baddbmm_(k_c.transpose(1, 2), vx_c * sc)
            dq[:, s:e] = dq_c
            mu_prev = mu_end
        del state

        # Pass 2, reverse: dS = dLoss/dState after each chunk, key/value gradients through it.
        dstate = v.new_zeros(BH, M, dv + 1)
        for idx in range(len(bounds) - 1, -1, -1):
            s, e = bounds[idx]
            q_c, k_c, vx_c, mu_c, dy_c = qf[:, s:e], kf[:, s:e], vx[:, s:e], mu[:, s:e], dy[:, s:e]
            mu_end = mu_c[:, -1:]
            if idx < len(bounds) - 1:
                sc = torch.exp(mu_c - mu_end)[..., None]  # (BH, l, 1)
                dk[:, s:e].baddbmm_(vx_c * sc, dstate.transpose(1, 2))
                dvx[:, s:e].addcmul_(sc, torch.bmm(k_c, dstate))
            if idx > 0:
                mu_prev = mu[:, s - 1 : s]  # (BH, 1)
                r = torch.exp(mu_prev - mu_c)[..., None]
                dstate.mul_(torch.exp(mu_prev - mu_end)[..., None])
                dstate.baddbmm_(q_c.transpose(1, 2), dy_c * r)
        return dq, dk, dvx[..., :dv], None, None


def causal_linear_attention(
    qf: Tensor, kf: Tensor, v: Tensor, mu: Tensor | None = None, chunk_size: int = 128
) -> Tensor:
    """Causal normalized linear attention, O(L) memory in forward and backward.

    qf, kf: (BH, L, M) features (padded keys already zeroed); v: (BH, L, dv);
    mu: (BH, L) non-decreasing key log-offsets (true key feature = kf_j * exp(mu_j)); None = 0.
    Returns (BH, L, dv). Gradients flow to qf, kf, v (mu is a stabilizer and cancels exactly).
    """
    if mu is None:
        mu = qf.new_zeros(qf.shape[:2])
    return _CausalLinearAttention.apply(
        qf.contiguous(), kf.contiguous(), v.contiguous(), mu.detach().contiguous(), int(chunk_size)
    )
