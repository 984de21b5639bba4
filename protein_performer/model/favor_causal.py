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


def _segments(n_chunks: int, per_segment: int) -> list[tuple[int, int]]:
    return [(g, min(g + per_segment, n_chunks)) for g in range(0, n_chunks, per_segment)]


def _decay(mu_s: Tensor, tril: Tensor) -> Tensor:
    """exp(mu_j - mu_t) for j <= t inside each chunk, 0 above the diagonal.

    mu_s: (BH, G, C) -> (BH, G, C, C) indexed [t, j]; every exponent is <= 0.
    """
    diff = mu_s[..., None, :] - mu_s[..., :, None]  # (BH, G, t, j): mu_j - mu_t
    return diff.masked_fill_(~tril, float("-inf")).exp_()


def _pad_chunks(t: Tensor, length: int, value: float | None = None) -> Tensor:
    """Right-pad dim 1 to `length` with zeros (or with the last entry when value is None)."""
    extra = length - t.shape[1]
    if extra == 0:
        return t
    if value is None:
        fill = t[:, -1:].expand(t.shape[0], extra, *t.shape[2:])
    else:
        fill = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
    return torch.cat([t, fill], dim=1)


class _CausalLinearAttention(torch.autograd.Function):
    """Layout: (BH, n, C, .) after padding L to n*C; work proceeds in segments of G chunks.

    Inside a segment all matmuls are batched over (BH * G); only the m x (dv+1) state recurrence
    (an elementwise rescale-and-add per chunk) runs sequentially.
    """

    @staticmethod
    def forward(ctx, qf, kf, v, mu, chunk: int, seg_chunks: int):
        BH, L, M = qf.shape
        dv = v.shape[-1]
        C = chunk
        n = -(-L // C)
        Lp = n * C
        vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)  # (BH, L, dv+1)
        q4 = _pad_chunks(qf, Lp, 0.0).view(BH, n, C, M)
        k4 = _pad_chunks(kf, Lp, 0.0).view(BH, n, C, M)
        vx4 = _pad_chunks(vx, Lp, 0.0).view(BH, n, C, dv + 1)
        mu3 = _pad_chunks(mu, Lp).view(BH, n, C)
        mu_end = mu3[..., -1]  # (BH, n): stabilizer of the state after each chunk
        mu_before = torch.cat([mu3[:, :1, 0], mu_end[:, :-1]], dim=1)  # (BH, n)
        tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril_()
        ys = torch.empty(BH, n, C, dv + 1, dtype=v.dtype, device=v.device)
        state = v.new_zeros(BH, M, dv + 1)  # sum k_j [v_j|1]^T of past chunks, / exp(mu_end)
        for g0, g1 in _segments(n, seg_chunks):
            G = g1 - g0
            q_s = q4[:, g0:g1].reshape(BH * G, C, M)
            k_s = k4[:, g0:g1].reshape(BH * G, C, M)
            vx_s = vx4[:, g0:g1].reshape(BH * G, C, dv + 1)
            mu_s = mu3[:, g0:g1]  # (BH, G, C)
            w = torch.bmm(q_s, k_s.transpose(1, 2))  # (BH*G, C, C)
            w.view(BH, G, C, C).mul_(_decay(mu_s, tril))
            y = torch.bmm(w, vx_s)  # (BH*G, C, dv+1)
            del w
            sc = torch.exp(mu_s - mu_end[:, g0:g1, None]).view(BH * G, C, 1)
            u = torch.bmm(k_s.transpose(1, 2), vx_s * sc).view(BH, G, M, dv + 1)
            rho = torch.exp(mu_before[:, g0:g1] - mu_end[:, g0:g1])[..., None, None]  # (BH,G,1,1)
            prefix = torch.empty_like(u)  # state before each chunk of the segment
            for c in range(G):
                prefix[:, c] = state
                state.mul_(rho[:, c]).add_(u[:, c])
            del u
            r = torch.exp(mu_before[:, g0:g1, None] - mu_s).view(BH * G, C, 1)
            y.addcmul_(r, torch.bmm(q_s, prefix.view(BH * G, M, dv + 1)))
            ys[:, g0:g1] = y.view(BH, G, C, dv + 1)
        ys = ys.view(BH, Lp, dv + 1)[:, :L]
        den = safe_denominator(ys[..., dv:])  # (BH, L, 1)
        out = ys[..., :dv] / den
        ctx.chunk, ctx.seg_chunks = chunk, seg_chunks
        ctx.save_for_backward(qf, kf, v, mu, out, den)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, v, mu, out, den = ctx.saved_tensors
        C, seg_chunks = ctx.chunk, ctx.seg_chunks
        BH, L, M = qf.shape
        dv = v.shape[-1]
        n = -(-L // C)
        Lp = n * C
        # out = num / den  ->  dnum = g / den, dden = -(g . out) / den
        dy = torch.cat([grad_out, -(grad_out * out).sum(-1, keepdim=True)], dim=-1) / den
        vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)
        q4 = _pad_chunks(qf, Lp, 0.0).view(BH, n, C, M)
        k4 = _pad_chunks(kf, Lp, 0.0).view(BH, n, C, M)
        vx4 = _pad_chunks(vx, Lp, 0.0).view(BH, n, C, dv + 1)
        dy4 = _pad_chunks(dy, Lp, 0.0).view(BH, n, C, dv + 1)
        mu3 = _pad_chunks(mu, Lp).view(BH, n, C)
        mu_end = mu3[..., -1]
        mu_before = torch.cat([mu3[:, :1, 0], mu_end[:, :-1]], dim=1)
        tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril_()
        dq = torch.empty(BH, n, C, M, dtype=qf.dtype, device=qf.device)
        dk = torch.empty_like(dq)
        dvx = torch.empty(BH, n, C, dv + 1, dtype=v.dtype, device=v.device)
        segments = _segments(n, seg_chunks)

        def load(g0: int, g1: int):
            G = g1 - g0
            return (
                G,
                q4[:, g0:g1].reshape(BH * G, C, M),
                k4[:, g0:g1].reshape(BH * G, C, M),
                vx4[:, g0:g1].reshape(BH * G, C, dv + 1),
                dy4[:, g0:g1].reshape(BH * G, C, dv + 1),
                mu3[:, g0:g1],
            )

        # Pass 1, forward in time: rebuild the states; query grads and intra-chunk terms.
        state = v.new_zeros(BH, M, dv + 1)
        for g0, g1 in segments:
            G, q_s, k_s, vx_s, dy_s, mu_s = load(g0, g1)
            sc = torch.exp(mu_s - mu_end[:, g0:g1, None]).view(BH * G, C, 1)
            u = torch.bmm(k_s.transpose(1, 2), vx_s * sc).view(BH, G, M, dv + 1)
            rho = torch.exp(mu_before[:, g0:g1] - mu_end[:, g0:g1])[..., None, None]
            prefix = torch.empty_like(u)
            for c in range(G):
                prefix[:, c] = state
                state.mul_(rho[:, c]).add_(u[:, c])
            del u
            r = torch.exp(mu_before[:, g0:g1, None] - mu_s).view(BH * G, C, 1)
            dq_s = torch.bmm(dy_s * r, prefix.view(BH * G, M, dv + 1).transpose(1, 2))
            del prefix
            decay = _decay(mu_s, tril).view(BH * G, C, C)
            w = torch.bmm(q_s, k_s.transpose(1, 2)).mul_(decay)
            dw = torch.bmm(dy_s, vx_s.transpose(1, 2)).mul_(decay)
            del decay
            dq_s.baddbmm_(dw, k_s)
            dq[:, g0:g1] = dq_s.view(BH, G, C, M)
            dk[:, g0:g1] = torch.bmm(dw.transpose(1, 2), q_s).view(BH, G, C, M)
            dvx[:, g0:g1] = torch.bmm(w.transpose(1, 2), dy_s).view(BH, G, C, dv + 1)
        del state

        # Pass 2, reverse: adjoint dS of the state after each chunk; key and value grads.
        dstate = v.new_zeros(BH, M, dv + 1)
        for g0, g1 in reversed(segments):
            G, q_s, k_s, vx_s, dy_s, mu_s = load(g0, g1)
            r = torch.exp(mu_before[:, g0:g1, None] - mu_s).view(BH * G, C, 1)
            z = torch.bmm(q_s.transpose(1, 2), dy_s * r).view(BH, G, M, dv + 1)
            rho = torch.exp(mu_before[:, g0:g1] - mu_end[:, g0:g1])[..., None, None]
            adj = torch.empty_like(z)  # dS after each chunk of the segment
            for c in range(G - 1, -1, -1):
                adj[:, c] = dstate
                dstate.mul_(rho[:, c]).add_(z[:, c])
            del z
            adj = adj.view(BH * G, M, dv + 1)
            sc = torch.exp(mu_s - mu_end[:, g0:g1, None]).view(BH * G, C, 1)
            dk[:, g0:g1] += torch.bmm(vx_s * sc, adj.transpose(1, 2)).view(BH, G, C, M)
            dvx[:, g0:g1] += (torch.bmm(k_s, adj) * sc).view(BH, G, C, dv + 1)
        dq = dq.view(BH, Lp, M)[:, :L]
        dk = dk.view(BH, Lp, M)[:, :L]
        dvv = dvx.view(BH, Lp, dv + 1)[:, :L, :dv]
        return dq, dk, dvv, None, None, None


def causal_linear_attention(
    qf: Tensor,
    kf: Tensor,
    v: Tensor,
    mu: Tensor | None = None,
    chunk_size: int = 128,
    segment_size: int = 4096,
) -> Tensor:
    """Causal normalized linear attention, O(L) memory in forward and backward.

    qf, kf: (BH, L, M) features (padded keys already zeroed); v: (BH, L, dv);
    mu: (BH, L) non-decreasing key log-offsets (true key feature = kf_j * exp(mu_j)); None = 0.
    Returns (BH, L, dv). Gradients flow to qf, kf, v (mu is a stabilizer and cancels exactly).
    segment_size: tokens whose chunks are batched into one matmul (bounds transient memory).
    """
    if mu is None:
        mu = qf.new_zeros(qf.shape[:2])
    return _CausalLinearAttention.apply(
        qf.contiguous(), kf.contiguous(), v.contiguous(), mu.detach().contiguous(),
        int(chunk_size),
        max(1, int(segment_size) // int(chunk_size)),
    )
