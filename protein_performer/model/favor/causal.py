"""Causal FAVOR+ as one autograd node: the features of each scan segment computed when the
chunked scan (:mod:`.scan`) reaches it, in forward and again in backward. The dispatcher that
picks between it and the Triton kernels of :mod:`.triton_causal` lives in :mod:`.module`
(:func:`~.module.causal_favor`), so the kernels' float64 fallback can import this module
without an import circle."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from protein_performer.model.favor.kernels import FeatureMap, running_max
from protein_performer.model.favor.scan import (
    Segment,
    SegmentOperands,
    plan_segments,
    safe_denominator,
    scan_backward_segments,
    scan_forward_segments,
    workspace,
)


class _Rows:
    """The features of one scan segment's rows, computed when the causal scan reaches it.

    Why: the scan uses phi(Q), phi(K) one segment at a time, so neither is ever materialized
    for the whole sequence; the backward recomputes them from q, k and the O(L) stabilizers
    saved by the forward. Features are computed in q's dtype into reused buffers (valid until
    the next call) and returned as ``dtype`` (float64 for the backward's fallback).
    """

    def __init__(self, q, k, v, fmap: FeatureMap, keep, chunk: int, dtype: torch.dtype):
        self.q, self.k, self.v, self.fmap, self.keep = q, k, v, fmap, keep
        self.chunk, self.dtype = chunk, dtype
        self.bufs: dict[str, Tensor | None] = dict.fromkeys(("q", "k", "vx"))

    def rows(self, t: Tensor, seg: Segment) -> Tensor:
        """(BH, Lp, ...) -> the segment's (nb, G*C, ...) view."""
        b0, b1, g0, g1 = seg
        return t[b0:b1, g0 * self.chunk : g1 * self.chunk]

    def chunk_mu(self, mu: Tensor, seg: Segment) -> Tensor:
        """(BH, Lp) -> the segment's (nb, G, C) view."""
        b0, b1, g0, g1 = seg
        return self.rows(mu, seg).view(b1 - b0, g1 - g0, self.chunk)

    def _buf(self, name: str, z: Tensor, width: int) -> Tensor:
        self.bufs[name] = buf = workspace(self.bufs[name], (*z.shape[:2], width), z)
        return buf

    def queries(self, seg: Segment, shift: Tensor | None = None, rscale: Tensor | None = None):
        """(features, row shift) of the segment's queries; see :meth:`FeatureMap.queries`."""
        z = self.rows(self.q, seg)
        fm = self.fmap.heads(seg[0], seg[1])
        out = self._buf("q", z, fm.Wa.shape[-2]) if fm.exp else None
        f, shift = fm.queries(z, shift=shift, rscale=rscale, out=out)
        return f.to(self.dtype), shift

    def keys(self, seg: Segment, mu_in: Tensor | None = None, mu: Tensor | None = None):
        """(features, mu) of the segment's keys; mu (nb, N) continues the running max from
        mu_in (nb,) (None at a head's start) unless given (backward); zeros for relu."""
        z = self.rows(self.k, seg)
        keep = None if self.keep is None else self.rows(self.keep, seg)
        fm = self.fmap.heads(seg[0], seg[1])
        out = self._buf("k", z, fm.Wa.shape[-2]) if fm.exp else None
        logits = fm.key_logits(z, keep, out)
        if mu is None:
            mu = running_max(logits, mu_in)
            mu = z.new_zeros(z.shape[:2]) if mu is None else mu
        f = fm.keys(z, logits, mu[..., None], keep)
        return f.to(self.dtype), mu

    def values(self, seg: Segment) -> Tensor:
        """[v | 1] of the segment's rows, (nb, N, dv+1)."""
        vs = self.rows(self.v, seg)
        vx = self._buf("vx", vs, vs.shape[-1] + 1)
        vx[..., :-1] = vs
        vx[..., -1] = 1.0
        return vx.to(self.dtype)


class _CausalStabilizers(NamedTuple):
    """What the causal forward saves per row besides q, k, v, all (BH, Lp, .)."""

    qmax: Tensor  # (BH, Lp) query row shift (exp kernels)
    rden: Tensor  # (BH, Lp, 1) 1 / normalizer
    mu: Tensor  # (BH, Lp) key running max
    out: Tensor  # (BH, Lp, dv) normalized output
    empty: Tensor  # (BH, Lp, 1) rows that saw no real key


class _CausalFavor(torch.autograd.Function):
    """Causal FAVOR as one autograd node: features per scan segment, chunked scan, backward.

    Why one node: the features of a segment's rows are computed when the scan reaches it (see
    :class:`_Rows`), in forward and again in backward, and the feature gradients are finished
    segment by segment (:meth:`FeatureMap.query_grad` / :meth:`FeatureMap.key_grad`), so no
    (BH, L, M) tensor is ever allocated: besides O(segment) buffers, memory is O(L d).

    Row rescaling (finite gradients at extreme logits): a query's features are stabilized by its
    row max, so the normalizer den_t can still be tiny (query mass where the keys have none) and
    a backward through 1/den_t overflows. The backward multiplies each recomputed query row by
    1/den_t (<= 1/float32.tiny, finite), which changes no output (a per-row factor cancels)
    but makes every normalizer 1, so the backward divides by nothing small. Each product
    phi_t,c / den_t * (key mass in column c) is <= 1, but in float32 a sum over queries of a huge
    phi_t,c / den_t can still overflow before it meets the tiny key features of a dead column;
    only then (checked once, on the O(L d) results) is the backward redone in float64.
    """

    @staticmethod
    def forward(ctx, q, k, v, fmap: FeatureMap, keep, chunk: int, rows: int):
        BH, L, _ = q.shape
        dv = v.shape[-1]
        Lp = -(-L // chunk) * chunk
        if Lp != L:  # pad to whole chunks at the input level: O(L d), not O(L M)
            q, k, v = (F.pad(t, (0, 0, 0, Lp - L)) for t in (q, k, v))
            real = torch.ones(BH, L, dtype=torch.bool, device=q.device) if keep is None else keep
            keep = F.pad(real, (0, Lp - L), value=False)
        feats = _Rows(q, k, v, fmap, keep, chunk, q.dtype)
        qmax, mu = q.new_zeros(BH, Lp), q.new_empty(BH, Lp)
        out, den = q.new_empty(BH, Lp, dv), q.new_empty(BH, Lp, 1)

        def operands(seg: Segment, mu_in: Tensor | None) -> SegmentOperands:
            qf, qmax_s = feats.queries(seg)
            kf, mu_s = feats.keys(seg, mu_in=mu_in)
            if qmax_s is not None:
                feats.rows(qmax, seg).copy_(qmax_s)
            feats.rows(mu, seg).copy_(mu_s)
            qf, kf, vx = (_chunks(t, chunk) for t in (qf, kf, feats.values(seg)))
            return SegmentOperands(qf, kf, vx, feats.chunk_mu(mu, seg))

        def emit(seg: Segment, y: Tensor) -> None:
            out_s, den_s = feats.rows(out, seg), feats.rows(den, seg)  # (nb, N, dv | 1)
            y = y.view(*out_s.shape[:2], dv + 1)
            den_s.copy_(safe_denominator(y[..., dv:]))
            torch.div(y[..., :dv], den_s, out=out_s)

        n = Lp // chunk
        segments = plan_segments(BH, n, chunk, rows)
        saved, exact = scan_forward_segments(segments, n, chunk, operands, emit)
        empty = den == torch.finfo(torch.float32).tiny  # rows that saw no real key
        ctx.chunk, ctx.rows, ctx.saved, ctx.L, ctx.fmap, ctx.exact = (
            chunk,
            rows,
            saved,
            L,
            fmap,
            exact,
        )
        ctx.save_for_backward(q, k, v, keep, qmax, den.reciprocal_(), mu, out, empty)
        return out[:, :L]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, qmax, rden, mu, out, empty = ctx.saved_tensors
        L, Lp = ctx.L, q.shape[1]
        g = F.pad(grad_out, (0, 0, 0, Lp - L)) if Lp != L else grad_out
        stab = _CausalStabilizers(qmax, rden, mu, out, empty)
        args = (q, k, v, ctx.fmap, keep, stab, g, ctx.chunk, ctx.rows, ctx.exact)
        grads = _causal_backward(*args, ctx.saved, q.dtype)
        # One reduction per gradient: a NaN or inf anywhere makes its sum non-finite (a sum
        # overflowing from finite terms only costs a needless float64 pass). One sync.
        if q.dtype != torch.float64 and not bool(
            torch.stack([t.sum() for t in grads]).isfinite().all()
        ):
            saved = [None if s is None else tuple(t.double() for t in s) for s in ctx.saved]
            grads = tuple(t.to(q.dtype) for t in _causal_backward(*args, saved, torch.float64))
        dq, dk, dvv = (t[:, :L] for t in grads)
        return dq, dk, dvv, None, None, None, None


def _causal_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fmap: FeatureMap,
    keep: Tensor | None,
    stab: _CausalStabilizers,
    g: Tensor,
    chunk: int,
    rows: int,
    exact: bool,
    saved: list,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each (BH, Lp, .) in ``dtype``, of :class:`_CausalFavor` for grad g.

    The features are recomputed per segment in q's dtype (the forward's values) and the scan
    runs in ``dtype``. out = num / den with den = 1 after the row rescaling: dnum = g and
    dden = -(g . out); rows that saw no real key output the constant 0 and get no gradient.
    """
    BH, Lp, _ = q.shape
    dv = v.shape[-1]
    feats = _Rows(q, k, v, fmap, keep, chunk, dtype)
    fg = fmap.to(dtype)
    dq, dk = q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype)
    dvv = v.new_empty(v.shape, dtype=dtype)

    def operands(seg: Segment) -> SegmentOperands:
        shift = feats.rows(stab.qmax, seg) if fmap.exp else None
        qf, _ = feats.queries(seg, shift, feats.rows(stab.rden, seg))
        kf, _ = feats.keys(seg, mu=feats.rows(stab.mu, seg))
        gs = feats.rows(g, seg)
        dy = torch.cat([gs, -(gs * feats.rows(stab.out, seg)).sum(-1, keepdim=True)], dim=-1)
        dy = dy.masked_fill_(feats.rows(stab.empty, seg), 0.0).to(dtype)
        qf, kf, vx, dy = (_chunks(t, chunk) for t in (qf, kf, feats.values(seg), dy))
        return SegmentOperands(qf, kf, vx, feats.chunk_mu(stab.mu, seg).to(dtype), dy)

    def emit(seg: Segment, op: SegmentOperands, dq_s: Tensor, dk_s: Tensor, dvx_s: Tensor):
        dqs, dks, dvs = (feats.rows(t, seg) for t in (dq, dk, dvv))  # (nb, N, .) views
        fm = fg.heads(seg[0], seg[1])
        zq, zk = (feats.rows(t, seg).to(dtype) for t in (q, k))
        shape = (*dqs.shape[:2], -1)
        rscale = feats.rows(stab.rden, seg).to(dtype)
        fm.query_grad(zq, op.q.view(shape), dq_s.view(shape), rscale, out=dqs)
        kb = None if keep is None else feats.rows(keep, seg)
        fm.key_grad(zk, op.k.view(shape), dk_s.view(shape), kb, out=dks)
        dvs.copy_(dvx_s.view(*dvs.shape[:2], dv + 1)[..., :dv])

    n = Lp // chunk
    segments = plan_segments(BH, n, chunk, rows)
    scan_backward_segments(segments, n, chunk, saved, operands, emit, exact)
    return dq, dk, dvv


def _chunks(t: Tensor, chunk: int) -> Tensor:
    """(nb, N, X) -> (nb * N / C, C, X) view."""
    return t.view(-1, chunk, t.shape[-1])
