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


def _prefix_states(
    u: Tensor, mu_e: Tensor, mu_b: Tensor, state: Tensor, mu_state: Tensor
) -> tuple[Tensor, Tensor]:
    """States before each chunk of a segment, and the state after it, without a Python loop.

    The recurrence S_c = S_{c-1} exp(mu_b[c] - mu_e[c]) + u_c unrolls to weights
    exp(mu_e[c'] - mu_b[c]) (c' < c), all <= 1 since mu never decreases: one (G x G) matmul.
    u: (BH, G, F) per-chunk sums; mu_e / mu_b: (BH, G) stabilizer after / before each chunk;
    state: (BH, F) incoming state, relative to mu_state (BH,).
    """
    G = u.shape[1]
    strict = torch.ones(G, G, dtype=torch.bool, device=u.device).tril_(-1)
    expo = (mu_e[:, None, :] - mu_b[:, :, None]).masked_fill_(~strict, float("-inf"))
    prefix = torch.bmm(expo.exp_(), u)  # (BH, G, F)
    prefix.addcmul_(torch.exp(mu_state[:, None] - mu_b)[..., None], state[:, None, :])
    last = mu_e[:, -1:]  # (BH, 1)
    out = torch.bmm(torch.exp(mu_e - last)[:, None, :], u)[:, 0]  # (BH, F)
    out.addcmul_(torch.exp(mu_state[:, None] - last), state)
    return prefix, out


def _suffix_adjoints(
    z: Tensor, mu_e: Tensor, mu_b: Tensor, dstate: Tensor
) -> tuple[Tensor, Tensor]:
    """Adjoints dS of the state after each chunk of a segment (reverse scan, closed form).

    dS_{c-1} = dS_c exp(mu_b[c] - mu_e[c]) + z_c unrolls to weights exp(mu_e[c] - mu_b[c''])
    for c'' > c. z: (BH, G, F) query-side terms; dstate: (BH, F) adjoint after the segment.
    Returns (adjoints (BH, G, F), adjoint of the state before the segment (BH, F)).
    """
    G = z.shape[1]
    strict = torch.ones(G, G, dtype=torch.bool, device=z.device).triu_(1)
    expo = (mu_e[:, :, None] - mu_b[:, None, :]).masked_fill_(~strict, float("-inf"))
    adj = torch.bmm(expo.exp_(), z)  # (BH, G, F)
    last = mu_e[:, -1:]
    adj.addcmul_(torch.exp(mu_e - last)[..., None], dstate[:, None, :])
    first = mu_b[:, :1]
    out = torch.bmm(torch.exp(first - mu_b)[:, None, :], z)[:, 0]
    out.addcmul_(torch.exp(first - last), dstate)
    return adj, out


_MAX_JUMP = 60.0  # max rise of mu inside one chunk for the factorized intra-chunk path


class _CausalLinearAttention(torch.autograd.Function):
    """Layout: (BH, n, C, .) after padding L to n*C; work proceeds in segments of G chunks.

    Inside a segment all matmuls are batched over (BH * G); the state recurrence across chunks
    is a (G x G) matmul (see :func:`_prefix_states`), so no Python loop runs per chunk.

    Intra-chunk weights exp(mu_j - mu_t) factor as colf_j * r_t with colf_j = exp(mu_j - mu_b)
    (>= 1) and r_t = exp(mu_b - mu_t) (<= 1), mu_b the stabilizer before the chunk: the factors
    go on V and on the output rows, and only a triangular mask touches the C x C matrix. When mu
    rises by more than _MAX_JUMP inside a chunk (colf could overflow), the exact decay matrix is
    used instead.
    """

    @staticmethod
    def forward(ctx, qf, kf, v, mu, chunk: int, seg_chunks: int):
        BH, L, M = qf.shape
        dv = v.shape[-1]
        C = chunk
        n = -(-L // C)
        Lp = n * C
        F = M * (dv + 1)
        vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)  # (BH, L, dv+1)
        q4 = _pad_chunks(qf, Lp, 0.0).view(BH, n, C, M)
        k4 = _pad_chunks(kf, Lp, 0.0).view(BH, n, C, M)
        vx4 = _pad_chunks(vx, Lp, 0.0).view(BH, n, C, dv + 1)
        mu3 = _pad_chunks(mu, Lp).view(BH, n, C)
        mu_end = mu3[..., -1]  # (BH, n): stabilizer of the state after each chunk
        mu_before = torch.cat([mu3[:, :1, 0], mu_end[:, :-1]], dim=1)  # (BH, n)
        exact = bool((mu_end - mu_before).max() > _MAX_JUMP)
        tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril_()
        ys = torch.empty(BH, n, C, dv + 1, dtype=v.dtype, device=v.device)
        state = v.new_zeros(BH, F)  # sum k_j [v_j|1]^T of past segments, / exp(mu_state)
        mu_state = mu3[:, 0, 0]
        for g0, g1 in _segments(n, seg_chunks):
            G = g1 - g0
            q_s = q4[:, g0:g1].reshape(BH * G, C, M)
            k_s = k4[:, g0:g1].reshape(BH * G, C, M)
            vx_s = vx4[:, g0:g1].reshape(BH * G, C, dv + 1)
            mu_s, mu_e, mu_b = mu3[:, g0:g1], mu_end[:, g0:g1], mu_before[:, g0:g1]
            r = torch.exp(mu_b[..., None] - mu_s).view(BH * G, C, 1)  # <= 1
            sc = torch.exp(mu_s - mu_e[..., None]).view(BH * G, C, 1)  # <= 1
            u = torch.bmm(k_s.transpose(1, 2), vx_s * sc).view(BH, G, F)
            prefix, state = _prefix_states(u, mu_e, mu_b, state, mu_state)  # (BH, G, F)
            mu_state = mu_e[:, -1]
            del u
            prefix = prefix.view(BH * G, M, dv + 1)
            w = torch.bmm(q_s, k_s.transpose(1, 2))  # (BH*G, C, C)
            if exact:
                w.view(BH, G, C, C).mul_(_decay(mu_s, tril))
                y = torch.bmm(w, vx_s)
                y.addcmul_(r, torch.bmm(q_s, prefix))
            else:
                w.tril_()
                y = torch.bmm(w, vx_s * torch.exp(mu_s - mu_b[..., None]).view(BH * G, C, 1))
                y.baddbmm_(q_s, prefix).mul_(r)
            del w
            ys[:, g0:g1] = y.view(BH, G, C, dv + 1)
        ys = ys.view(BH, Lp, dv + 1)[:, :L]
        den = safe_denominator(ys[..., dv:])  # (BH, L, 1)
        out = ys[..., :dv] / den
        ctx.chunk, ctx.seg_chunks, ctx.exact = chunk, seg_chunks, exact
        ctx.save_for_backward(qf, kf, v, mu, out, den)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, v, mu, out, den = ctx.saved_tensors
        C, seg_chunks, exact = ctx.chunk, ctx.seg_chunks, ctx.exact
        BH, L, M = qf.shape
        dv = v.shape[-1]
        n = -(-L // C)
        Lp = n * C
        F = M * (dv + 1)
        # out = num / den  ->  dnum = g / den, dden = -(g . out) / den
        dy = torch.cat([grad_out, -(grad_out * out).sum(-1, keepdim=True)], dim=-1) / den
        # A row whose normalizer underflowed outputs the constant 0: no gradient through it.
        dy.masked_fill_(den == torch.finfo(torch.float32).tiny, 0.0)
        vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)
        q4 = _pad_chunks(qf, Lp, 0.0).view(BH, n, C, M)
        k4 = _pad_chunks(kf, Lp, 0.0).view(BH, n, C, M)
        vx4 = _pad_chunks(vx, Lp, 0.0).view(BH, n, C, dv + 1)
        dy4 = _pad_chunks(dy, Lp, 0.0).view(BH, n, C, dv + 1)
        mu3 = _pad_chunks(mu, Lp).view(BH, n, C)
        mu_end = mu3[..., -1]
        mu_before = torch.cat([mu3[:, :1, 0], mu_end[:, :-1]], dim=1)
        tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril_()
        segments = _segments(n, seg_chunks)
        single = len(segments) == 1
        dq = torch.empty(BH, n, C, M, dtype=qf.dtype, device=qf.device)
        dk = torch.empty_like(dq)
        dvx = torch.empty(BH, n, C, dv + 1, dtype=v.dtype, device=v.device)

        def load(g0: int, g1: int):
            G = g1 - g0
            mu_s, mu_e, mu_b = mu3[:, g0:g1], mu_end[:, g0:g1], mu_before[:, g0:g1]
            return (
                G,
                q4[:, g0:g1].reshape(BH * G, C, M),
                k4[:, g0:g1].reshape(BH * G, C, M),
                vx4[:, g0:g1].reshape(BH * G, C, dv + 1),
                dy4[:, g0:g1].reshape(BH * G, C, dv + 1),
                mu_s,
                mu_e,
                mu_b,
                torch.exp(mu_b[..., None] - mu_s).view(BH * G, C, 1),  # r <= 1
                torch.exp(mu_s - mu_e[..., None]).view(BH * G, C, 1),  # sc <= 1
            )

        # Pass 1, forward in time: rebuild the states; query grads and intra-chunk terms.
        state = v.new_zeros(BH, F)
        mu_state = mu3[:, 0, 0]
        for g0, g1 in segments:
            G, q_s, k_s, vx_s, dy_s, mu_s, mu_e, mu_b, r, sc = load(g0, g1)
            u = torch.bmm(k_s.transpose(1, 2), vx_s * sc).view(BH, G, F)
            prefix, state = _prefix_states(u, mu_e, mu_b, state, mu_state)
            mu_state = mu_e[:, -1]
            del u
            dyr = dy_s * r
            dq_s = torch.bmm(dyr, prefix.view(BH * G, M, dv + 1).transpose(1, 2))  # (BH*G, C, M)
            del prefix
            w = torch.bmm(q_s, k_s.transpose(1, 2))  # (BH*G, C, C)
            if exact:
                decay = _decay(mu_s, tril).view(BH * G, C, C)
                w.mul_(decay)
                dw = torch.bmm(dy_s, vx_s.transpose(1, 2)).mul_(decay)
                del decay
                dvx_s = torch.bmm(w.transpose(1, 2), dy_s)
            else:
                colf = torch.exp(mu_s - mu_b[..., None]).view(BH * G, C, 1)  # >= 1
                w.tril_()
                dw = torch.bmm(dyr, (vx_s * colf).transpose(1, 2)).tril_()
                dvx_s = torch.bmm(w.transpose(1, 2), dyr).mul_(colf)
            del w
            dq_s.baddbmm_(dw, k_s)
            dk_s = torch.bmm(dw.transpose(1, 2), q_s)
            del dw
            if single:
                dq, dk, dvx = (
                    t.view(BH, G, C, -1) for t in (dq_s, dk_s, dvx_s)
                )  # whole sequence in one segment: no copies
            else:
                dq[:, g0:g1] = dq_s.view(BH, G, C, M)
                dk[:, g0:g1] = dk_s.view(BH, G, C, M)
                dvx[:, g0:g1] = dvx_s.view(BH, G, C, dv + 1)
            del dq_s, dk_s, dvx_s
        del state

        # Pass 2, reverse: adjoint dS of the state after each chunk; key and value grads.
        dstate = v.new_zeros(BH, F)
        for g0, g1 in reversed(segments):
            G, q_s, k_s, vx_s, dy_s, mu_s, mu_e, mu_b, r, sc = load(g0, g1)
            z = torch.bmm(q_s.transpose(1, 2), dy_s * r).view(BH, G, F)
            adj, dstate = _suffix_adjoints(z, mu_e, mu_b, dstate)
            del z
            adj = adj.view(BH * G, M, dv + 1)
            dk4 = dk[:, g0:g1].view(BH * G, C, M) if single else dk[:, g0:g1]
            dvx4 = dvx[:, g0:g1].view(BH * G, C, dv + 1) if single else dvx[:, g0:g1]
            if single:
                dk4.baddbmm_(vx_s * sc, adj.transpose(1, 2))
                dvx4.addcmul_(sc, torch.bmm(k_s, adj))
            else:
                dk4 += torch.bmm(vx_s * sc, adj.transpose(1, 2)).view(BH, G, C, M)
                dvx4 += (torch.bmm(k_s, adj) * sc).view(BH, G, C, dv + 1)
        dq = dq.reshape(BH, Lp, M)[:, :L]
        dk = dk.reshape(BH, Lp, M)[:, :L]
        dvv = dvx.reshape(BH, Lp, dv + 1)[:, :L, :dv]
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
        qf.contiguous(),
        kf.contiguous(),
        v.contiguous(),
        mu.detach().contiguous(),
        int(chunk_size),
        max(1, int(segment_size) // int(chunk_size)),
    )
