"""Causal FAVOR+ as Triton kernels (forward and backward), one autograd node: the GPU twin of
:class:`~protein_performer.model.favor.causal._CausalFavor`.

Why a kernel: the torch scan (:mod:`.scan`) is a few dozen small launches per segment, and each
writes its (rows, M) features and (C, C) weights to memory and reads them back. Here the feature
map, its stabilizer and the chunked scan are fused: a program reads q, k, v once per chunk,
computes phi(q), phi(k) in registers and never writes a feature. The design is
flash-linear-attention's chunked linear attention (``fused_chunk``), written anew for FAVOR+:

- one program per (block of BM features, segment of the sequence, head); inside, a loop over
  chunks of BT tokens: the intra-chunk part is the masked (BT, BT) product phi(Q) phi(K)^T
  times the decay exp(mu_j - mu_t) of the stabilizer, the inter-chunk part the running state
  S = sum_j phi(k_j) [v_j | 1]^T, (BM, dv) plus a (BM,) normalizer column, carried in registers;
- the outputs of the feature blocks are partial sums (every product is linear in the features),
  added up in torch before the normalization: O(L dv) per block (M / BM of them, and as many
  partial dq, dk, dv in backward), never O(L M);
- segments give the GPU enough programs at small batch: each segment's local end state is
  computed first (keys only), the incoming states follow from those in one small masked product
  over segments (:func:`_carry`), then every segment runs with its incoming state;
- the backward is one kernel with two loops per program: forward over the chunks for dq
  (the state recomputed as in the forward), backward over them for dk and dv (the adjoint
  state sum_t phi(q_t) [g_t | gamma_t]^T carried the other way); only the forward's segment
  boundary states are saved, a few (M, dv) matrices per head.

Numbers: the same stabilizers as the torch path, so the same outputs to float32 rounding. A
query's features are shifted by their row max over all M columns and a key's by mu_j, the
running max over keys <= j of its largest log-feature (no future key moves a past output). Both
need all M columns, which a program holding BM of them does not see: a small pre-pass kernel
(:func:`_stats_kernel`, the projections without the exp, nothing stored but two numbers per
row) gives them, and ``torch.cummax`` the running max. Every exponent is <= 0 (exact decay
matrices, no factorization; a pad's is clamped), so nothing overflows. trig's sin and cos halves
are two feature blocks of one projection block (cos = sin shifted by pi/2); relu has no
stabilizer. Everything is computed in float32; ``tl.dot`` follows torch's float32 matmul
precision (``torch.set_float32_matmul_precision``: "highest" = IEEE float32, else TF32). As in
the torch path, a backward that comes out non-finite (extreme logits) is redone in float64 by
the torch path.

This module imports triton at the top; nothing imports it unless a causal forward takes the
Triton path (:func:`~protein_performer.model.favor.module.causal_favor`): CUDA tensors, or an
explicit request. The tests run it on CPU tensors under ``TRITON_INTERPRET=1``, which triton
reads when a function is decorated: set it before triton is first imported. So far the kernels
have run only there (no GPU was lent when they were written): ``scripts/gpu_check.sh`` on a
GPU is their first compile, and the place to tune CHUNK, BLOCK and the warps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from protein_performer.model.favor.causal import _CausalFavor
from protein_performer.model.favor.kernels import _NEG, ExpFeatureMap, FeatureMap, Relu, Trig
from protein_performer.model.favor.scan import safe_denominator

__all__ = ["BLOCK", "CHUNK", "causal_favor_triton", "kernel_kind", "supports"]

_EXP, _RELU, _TRIG = 0, 1, 2
#: Kernel families by base class: each class's features as the kernels compute them (KIND).
_KINDS: tuple[tuple[type[FeatureMap], int], ...] = (
    (ExpFeatureMap, _EXP),
    (Relu, _RELU),
    (Trig, _TRIG),
)
_MAX_DIM = 128  # head dim and value dim: a (BM, BV) state and (BT, BD) tiles live in registers
CHUNK = 64  # tokens per chunk (BT): (BT, BT) weights and (BT, BM) features in registers
BLOCK = 64  # features per program (BM)


def kernel_kind(fmap: FeatureMap) -> int | None:
    """The kernels' family code of ``fmap`` (exp, relu, trig), None when they serve none."""
    for cls, kind in _KINDS:
        if isinstance(fmap, cls):
            return kind
    return None


def supports(fmap: FeatureMap, x: Tensor, v: Tensor) -> bool:
    """Whether :func:`causal_favor_triton` runs these inputs (float32, dims <= 128)."""
    return (
        kernel_kind(fmap) is not None
        and x.dtype == torch.float32
        and x.shape[-1] <= _MAX_DIM
        and v.shape[-1] <= _MAX_DIM
    )


# --------------------------------------------------------------------------- kernels


@triton.jit
def _key_features(kp, yy, mu, keep, bias, cmask, phase, t2, eps, KIND: tl.constexpr):
    """phi(k) of a (BT, BM) block from its projection kp, relative to each key's mu; pads and
    columns past M are 0. exp: exp(kp + bias - t2 |k|^2 / 2 - mu); relu: relu(kp) + eps;
    trig: sin(kp + phase) exp(t2 |k|^2 / 2 - mu). A real key's exponent is <= 0 (mu is the
    running max of it) up to rounding; the clamp keeps a pad's exponent from overflowing."""
    if KIND == 0:
        f = tl.exp(tl.minimum(kp + bias[None, :] - (0.5 * t2 * yy + mu)[:, None], 0.0))
    elif KIND == 1:
        f = tl.maximum(kp, 0.0) + eps
    else:
        f = tl.sin(kp + phase) * tl.exp(tl.minimum(0.5 * t2 * yy - mu, 0.0))[:, None]
    return tl.where(keep[:, None] & cmask[None, :], f, 0.0)


@triton.jit
def _query_features(qp, qs, bias, cmask, phase, eps, KIND: tl.constexpr):
    """phi(q) of a (BT, BM) block: exp shifted by the row max qs, relu, or sin."""
    if KIND == 0:
        f = tl.exp(qp + bias[None, :] - qs[:, None])
    elif KIND == 1:
        f = tl.maximum(qp, 0.0) + eps
    else:
        f = tl.sin(qp + phase)
    return tl.where(cmask[None, :], f, 0.0)


@triton.jit
def _decay(mu, offs_t, STAB: tl.constexpr):
    """(BT, BT) [t, j]: exp(mu_j - mu_t) for j <= t, else 0 (the causal mask)."""
    causal = offs_t[:, None] >= offs_t[None, :]
    if STAB:
        d = tl.where(causal, tl.exp(tl.minimum(mu[None, :] - mu[:, None], 0.0)), 0.0)
    else:
        d = tl.where(causal, 1.0, 0.0)
    return d


@triton.jit
def _query_grad(dqf, qf, qp, cmask, phase, KIND: tl.constexpr):
    """d loss / d projection of the queries from d loss / d phi(q)."""
    if KIND == 0:
        dp = dqf * qf
    elif KIND == 1:
        dp = tl.where(qp > 0, dqf, 0.0)
    else:
        dp = dqf * tl.cos(qp + phase)
    return tl.where(cmask[None, :], dp, 0.0)


@triton.jit
def _key_grad(
    dkf, kf, kp, y, yy, mu, keep, cmask, w, phase, t2, KIND: tl.constexpr, PREC: tl.constexpr
):
    """d loss / dk (BT, BD) of one feature block from d loss / d phi(k); the row terms
    (-t2 |k|^2 / 2 for exp, +t2 |k|^2 / 2 for trig) add their gradient along k."""
    if KIND == 0:
        dl = dkf * kf
        dy = tl.dot(dl, w, input_precision=PREC) - t2 * y * tl.sum(dl, 1)[:, None]
    elif KIND == 1:
        dp = tl.where((kp > 0) & keep[:, None] & cmask[None, :], dkf, 0.0)
        dy = tl.dot(dp, w, input_precision=PREC)
    else:
        rowf = tl.where(keep, tl.exp(tl.minimum(0.5 * t2 * yy - mu, 0.0)), 0.0)
        dp = tl.where(cmask[None, :], dkf * tl.cos(kp + phase) * rowf[:, None], 0.0)
        dy = tl.dot(dp, w, input_precision=PREC) + t2 * y * tl.sum(kf * dkf, 1)[:, None]
    return dy


@triton.jit
def _stats_kernel(
    X, Y, KEEP, W, BIAS, QS, TOP,
    L, D, MW, stride_w, stride_b, t2,
    HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per row, over all M columns: the query's max logit (its shift) and the key's largest
    log-feature (pads -> _NEG), the input of the running max. Grid (chunks, BH)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    offs_t = i_t * BT + tl.arange(0, BT)
    tmask = offs_t < L
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    rows = (i_bh * L + offs_t)[:, None] * D + offs_d[None, :]
    x = tl.load(X + rows, mask=tmask[:, None] & dmask[None, :], other=0.0)
    y = tl.load(Y + rows, mask=tmask[:, None] & dmask[None, :], other=0.0)
    qmax = tl.full([BT], float("-inf"), tl.float32)
    kmax = tl.full([BT], float("-inf"), tl.float32)
    for mb in range(0, tl.cdiv(MW, BM)):
        cols = mb * BM + tl.arange(0, BM)
        cmask = cols < MW
        wptr = W + i_bh * stride_w + cols[None, :] * D + offs_d[:, None]
        wt = tl.load(wptr, mask=dmask[:, None] & cmask[None, :], other=0.0)  # (BD, BM)
        qp = tl.dot(x, wt, input_precision=PREC)
        kp = tl.dot(y, wt, input_precision=PREC)
        if HAS_BIAS:
            b = tl.load(BIAS + i_bh * stride_b + cols, mask=cmask, other=0.0)
            qp += b[None, :]
            kp += b[None, :]
        qmax = tl.maximum(qmax, tl.max(tl.where(cmask[None, :], qp, float("-inf")), 1))
        kmax = tl.maximum(kmax, tl.max(tl.where(cmask[None, :], kp, float("-inf")), 1))
    keep = tmask
    if HAS_KEEP:
        keep = keep & (tl.load(KEEP + i_bh * L + offs_t, mask=tmask, other=0) != 0)
    top = tl.where(keep, kmax - 0.5 * t2 * tl.sum(y * y, 1), -1e30)
    tl.store(QS + i_bh * L + offs_t, qmax, mask=tmask)
    tl.store(TOP + i_bh * L + offs_t, tl.maximum(top, -1e30), mask=tmask)


@triton.jit
def _absorb(h, z, m_prev, kf, mu, v, STAB: tl.constexpr, PREC: tl.constexpr):
    """The state (h, z) after a chunk's keys kf (BT, BM) and values v: with a stabilizer,
    relative to the chunk's last mu (every factor <= 1; returned as the new m_prev)."""
    if STAB:
        m_c = tl.max(mu, 0)
        ks = kf * tl.exp(tl.minimum(mu - m_c, 0.0))[:, None]
        fac = tl.exp(tl.minimum(m_prev - m_c, 0.0))
        h = h * fac + tl.dot(tl.trans(ks), v, input_precision=PREC)
        z = z * fac + tl.sum(ks, 0)
        m_prev = m_c
    else:
        h += tl.dot(tl.trans(kf), v, input_precision=PREC)
        z += tl.sum(kf, 0)
    return h, z, m_prev


@triton.jit
def _feature_block(
    W, BIAS, i_m, i_s, i_bh, BH, D, DV, MW, MF, NMW, stride_w, stride_b,
    HAS_BIAS: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """What the forward and backward kernels first set up for feature block i_m of head i_bh
    in segment i_s: the trig phase (0 = sin, 1 = cos of projection block wb), the block's
    feature mask, the head and value offsets and masks, its projection rows w (BM, BD) and
    bias, and its rows of a per-segment state (offsets and mask)."""
    half = i_m // NMW
    wb = i_m - half * NMW
    phase = half.to(tl.float32) * 1.5707963267948966
    cols = wb * BM + tl.arange(0, BM)
    cmask = cols < MW
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    offs_v = tl.arange(0, BV)
    vmask = offs_v < DV
    wptr = W + i_bh * stride_w + cols[:, None] * D + offs_d[None, :]
    w = tl.load(wptr, mask=cmask[:, None] & dmask[None, :], other=0.0)
    bias = tl.zeros([BM], tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + i_bh * stride_b + cols, mask=cmask, other=0.0)
    soff = (i_s * BH + i_bh) * MF + half * MW + cols
    smask = cmask[:, None] & vmask[None, :]
    return phase, cmask, offs_d, dmask, offs_v, vmask, w, bias, soff, smask


@triton.jit
def _fwd_kernel(
    X, Y, V, KEEP, QS, MU, W, BIAS, H0, Z0, M0, O, DEN, HN, ZN,
    BH, L, D, DV, MW, MF, NMW, SEG, SEG0, stride_w, stride_b, t2, eps,
    KIND: tl.constexpr, STAB: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr, STATE_ONLY: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Grid (feature blocks, segments, BH). Full pass: one block's partial sums O (BT, dv) and
    DEN of every row of the segment, from the segment's incoming state (H0, Z0 relative to
    M0). STATE_ONLY: keys only, the segment's own end state into HN, ZN (relative to the
    segment's last mu)."""
    i_m = tl.program_id(0).to(tl.int64)  # int64 offsets: (blocks, BH, L, dv) may pass 2^31
    i_s = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    seg = i_s + SEG0
    phase, cmask, offs_d, dmask, offs_v, vmask, w, bias, soff, smask = _feature_block(
        W, BIAS, i_m, i_s, i_bh, BH, D, DV, MW, MF, NMW, stride_w, stride_b, HAS_BIAS, BD, BM, BV
    )
    wt = tl.trans(w)
    h = tl.zeros([BM, BV], tl.float32)
    z = tl.zeros([BM], tl.float32)
    m_prev = tl.full([], -1e30, tl.float32)  # the state's mu: none yet
    if HAS_INIT:
        h = tl.load(H0 + soff[:, None] * DV + offs_v[None, :], mask=smask, other=0.0)
        z = tl.load(Z0 + soff, mask=cmask, other=0.0)
        m_prev = tl.load(M0 + i_s * BH + i_bh)
    c0 = seg * SEG
    c1 = tl.minimum(c0 + SEG, tl.cdiv(L, BT))
    base = i_bh * L
    for c in range(c0, c1):
        offs_t = c * BT + tl.arange(0, BT)
        tmask = offs_t < L
        tdmask = tmask[:, None] & dmask[None, :]
        tvmask = tmask[:, None] & vmask[None, :]
        y = tl.load(Y + (base + offs_t)[:, None] * D + offs_d[None, :], mask=tdmask, other=0.0)
        v = tl.load(V + (base + offs_t)[:, None] * DV + offs_v[None, :], mask=tvmask, other=0.0)
        mu = tl.load(MU + base + offs_t, mask=tmask, other=-1e30)
        keep = tmask
        if HAS_KEEP:
            keep = keep & (tl.load(KEEP + base + offs_t, mask=tmask, other=0) != 0)
        kp = tl.dot(y, wt, input_precision=PREC)
        kf = _key_features(kp, tl.sum(y * y, 1), mu, keep, bias, cmask, phase, t2, eps, KIND)
        if not STATE_ONLY:
            xp = X + (base + offs_t)[:, None] * D + offs_d[None, :]
            x = tl.load(xp, mask=tdmask, other=0.0)
            qs = tl.load(QS + base + offs_t, mask=tmask, other=0.0)
            qp = tl.dot(x, wt, input_precision=PREC)
            qf = _query_features(qp, qs, bias, cmask, phase, eps, KIND)
            kft = tl.trans(kf)
            a = tl.dot(qf, kft, input_precision=PREC) * _decay(mu, offs_t, STAB)
            inter = tl.dot(qf, h, input_precision=PREC)
            inter_den = tl.sum(qf * z[None, :], 1)
            if STAB:
                r = tl.exp(tl.minimum(m_prev - mu, 0.0))
                inter = inter * r[:, None]
                inter_den = inter_den * r
            o = tl.dot(a, v, input_precision=PREC) + inter
            den = tl.sum(a, 1) + inter_den
            ooff = (i_m * BH + i_bh) * L + offs_t
            tl.store(O + ooff[:, None] * DV + offs_v[None, :], o, mask=tvmask)
            tl.store(DEN + ooff, den, mask=tmask)
        h, z, m_prev = _absorb(h, z, m_prev, kf, mu, v, STAB, PREC)
    if STATE_ONLY:
        tl.store(HN + soff[:, None] * DV + offs_v[None, :], h, mask=smask)
        tl.store(ZN + soff, z, mask=cmask)


@triton.jit
def _bwd_kernel(
    X, Y, V, KEEP, QS, MU, W, BIAS, GH, GAM, H0, Z0, M0, DH0, DZ0, DQ, DK, DVV, DHN, DZN,
    BH, L, D, DV, MW, MF, NMW, SEG, SEG0, stride_w, stride_b, t2, eps,
    KIND: tl.constexpr, STAB: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr, DUAL_ONLY: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Grid (feature blocks, segments, BH). GH = g / den and GAM = -(g . out) / den are the
    upstream gradients of the sums (0 on rows that saw no real key). Full pass: one block's
    partial dq (first loop, forward over the chunks from the incoming state H0, Z0, M0) and
    partial dk, dv (second loop, backward over the chunks from the incoming adjoint DH0, DZ0,
    relative to the segment's last mu). DUAL_ONLY: queries only, the segment's own adjoint
    into DHN, DZN (relative to the mu before the segment)."""
    i_m = tl.program_id(0).to(tl.int64)  # int64 offsets: (blocks, BH, L, dv) may pass 2^31
    i_s = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    seg = i_s + SEG0
    phase, cmask, offs_d, dmask, offs_v, vmask, w, bias, soff, smask = _feature_block(
        W, BIAS, i_m, i_s, i_bh, BH, D, DV, MW, MF, NMW, stride_w, stride_b, HAS_BIAS, BD, BM, BV
    )
    wt = tl.trans(w)
    c0 = seg * SEG
    c1 = tl.minimum(c0 + SEG, tl.cdiv(L, BT))
    base = i_bh * L
    goff = (i_m * BH + i_bh) * L  # this block's rows of the partial gradients
    if not DUAL_ONLY:
        h = tl.zeros([BM, BV], tl.float32)
        z = tl.zeros([BM], tl.float32)
        m_prev = tl.full([], -1e30, tl.float32)  # the state's mu: none yet
        if HAS_INIT:
            h = tl.load(H0 + soff[:, None] * DV + offs_v[None, :], mask=smask, other=0.0)
            z = tl.load(Z0 + soff, mask=cmask, other=0.0)
            m_prev = tl.load(M0 + i_s * BH + i_bh)
        for c in range(c0, c1):
            offs_t = c * BT + tl.arange(0, BT)
            tmask = offs_t < L
            tdmask = tmask[:, None] & dmask[None, :]
            tvmask = tmask[:, None] & vmask[None, :]
            rows_d = (base + offs_t)[:, None] * D + offs_d[None, :]
            rows_v = (base + offs_t)[:, None] * DV + offs_v[None, :]
            y = tl.load(Y + rows_d, mask=tdmask, other=0.0)
            x = tl.load(X + rows_d, mask=tdmask, other=0.0)
            v = tl.load(V + rows_v, mask=tvmask, other=0.0)
            gh = tl.load(GH + rows_v, mask=tvmask, other=0.0)
            gam = tl.load(GAM + base + offs_t, mask=tmask, other=0.0)
            mu = tl.load(MU + base + offs_t, mask=tmask, other=-1e30)
            qs = tl.load(QS + base + offs_t, mask=tmask, other=0.0)
            keep = tmask
            if HAS_KEEP:
                keep = keep & (tl.load(KEEP + base + offs_t, mask=tmask, other=0) != 0)
            kp = tl.dot(y, wt, input_precision=PREC)
            kf = _key_features(kp, tl.sum(y * y, 1), mu, keep, bias, cmask, phase, t2, eps, KIND)
            qp = tl.dot(x, wt, input_precision=PREC)
            qf = _query_features(qp, qs, bias, cmask, phase, eps, KIND)
            dec = _decay(mu, offs_t, STAB)
            dw = (tl.dot(gh, tl.trans(v), input_precision=PREC) + gam[:, None]) * dec
            inter = tl.dot(gh, tl.trans(h), input_precision=PREC) + gam[:, None] * z[None, :]
            if STAB:
                inter = inter * tl.exp(tl.minimum(m_prev - mu, 0.0))[:, None]
            dqf = tl.dot(dw, kf, input_precision=PREC) + inter
            dp = _query_grad(dqf, qf, qp, cmask, phase, KIND)
            dx = tl.dot(dp, w, input_precision=PREC)
            dptr = DQ + (goff + offs_t)[:, None] * D + offs_d[None, :]
            tl.store(dptr, dx, mask=tdmask)
            h, z, m_prev = _absorb(h, z, m_prev, kf, mu, v, STAB, PREC)
    # the adjoint of the state, sum over later queries of phi(q_t) [gh_t | gam_t]^T, relative
    # to the last mu of the chunk being processed (every factor <= 1)
    dh = tl.zeros([BM, BV], tl.float32)
    dz = tl.zeros([BM], tl.float32)
    if not DUAL_ONLY:
        dh = tl.load(DH0 + soff[:, None] * DV + offs_v[None, :], mask=smask, other=0.0)
        dz = tl.load(DZ0 + soff, mask=cmask, other=0.0)
    for i in range(0, c1 - c0):
        c = c1 - 1 - i
        offs_t = c * BT + tl.arange(0, BT)
        tmask = offs_t < L
        tdmask = tmask[:, None] & dmask[None, :]
        tvmask = tmask[:, None] & vmask[None, :]
        rows_d = (base + offs_t)[:, None] * D + offs_d[None, :]
        rows_v = (base + offs_t)[:, None] * DV + offs_v[None, :]
        x = tl.load(X + rows_d, mask=tdmask, other=0.0)
        gh = tl.load(GH + rows_v, mask=tvmask, other=0.0)
        gam = tl.load(GAM + base + offs_t, mask=tmask, other=0.0)
        mu = tl.load(MU + base + offs_t, mask=tmask, other=-1e30)
        qs = tl.load(QS + base + offs_t, mask=tmask, other=0.0)
        qp = tl.dot(x, wt, input_precision=PREC)
        qf = _query_features(qp, qs, bias, cmask, phase, eps, KIND)
        m_c = tl.max(mu, 0)
        if not DUAL_ONLY:
            y = tl.load(Y + rows_d, mask=tdmask, other=0.0)
            v = tl.load(V + rows_v, mask=tvmask, other=0.0)
            keep = tmask
            if HAS_KEEP:
                keep = keep & (tl.load(KEEP + base + offs_t, mask=tmask, other=0) != 0)
            yy = tl.sum(y * y, 1)
            kp = tl.dot(y, wt, input_precision=PREC)
            kf = _key_features(kp, yy, mu, keep, bias, cmask, phase, t2, eps, KIND)
            dec = _decay(mu, offs_t, STAB)
            a = tl.dot(qf, tl.trans(kf), input_precision=PREC) * dec
            dw = (tl.dot(gh, tl.trans(v), input_precision=PREC) + gam[:, None]) * dec
            inter_k = tl.dot(v, tl.trans(dh), input_precision=PREC) + dz[None, :]  # (BT, BM)
            inter_v = tl.dot(kf, dh, input_precision=PREC)  # (BT, BV)
            if STAB:
                sc = tl.exp(tl.minimum(mu - m_c, 0.0))
                inter_k = inter_k * sc[:, None]
                inter_v = inter_v * sc[:, None]
            dkf = tl.dot(tl.trans(dw), qf, input_precision=PREC) + inter_k
            dv = tl.dot(tl.trans(a), gh, input_precision=PREC) + inter_v
            dy = _key_grad(dkf, kf, kp, y, yy, mu, keep, cmask, w, phase, t2, KIND, PREC)
            tl.store(DK + (goff + offs_t)[:, None] * D + offs_d[None, :], dy, mask=tdmask)
            tl.store(DVV + (goff + offs_t)[:, None] * DV + offs_v[None, :], dv, mask=tvmask)
        if STAB:  # add this chunk's queries, relative to the mu before it
            prev = tl.load(MU + base + tl.maximum(c * BT - 1, 0))
            m_b = tl.where(c > 0, prev, -1e30)
            qr = qf * tl.exp(tl.minimum(m_b - mu, 0.0))[:, None]
            fac = tl.exp(tl.minimum(m_b - m_c, 0.0))
            dh = dh * fac + tl.dot(tl.trans(qr), gh, input_precision=PREC)
            dz = dz * fac + tl.sum(qr * gam[:, None], 0)
        else:
            dh += tl.dot(tl.trans(qf), gh, input_precision=PREC)
            dz += tl.sum(qf * gam[:, None], 0)
    if DUAL_ONLY:
        tl.store(DHN + soff[:, None] * DV + offs_v[None, :], dh, mask=smask)
        tl.store(DZN + soff, dz, mask=cmask)


# --------------------------------------------------------------------------- host side


def _pow2(n: int, floor: int = 16) -> int:
    """The tile size for n: a power of two, at least 16 (tl.dot's smallest)."""
    return max(floor, triton.next_power_of_2(n))


class _Plan(NamedTuple):
    """Everything a launch needs besides the per-pass tensors."""

    kind: int
    W: Tensor  # (BH | 1, MW, d) projection rows
    bias: Tensor | None  # (BH | 1, MW)
    stride_w: int
    stride_b: int
    MW: int  # projection rows
    MF: int  # features (2 MW for trig)
    NMW: int  # projection blocks
    NM: int  # feature blocks (programs along axis 0)
    BT: int
    BD: int
    BM: int
    BV: int
    seg: int  # chunks per segment
    NS: int  # segments
    t2: float
    eps: float
    prec: str
    warps: int  # num_warps of the scan kernels: 64 x 64 tiles need 8 to stay in registers

    def meta(self, BH: int, L: int, d: int, dv: int, seg0: int) -> tuple:
        """The scalar arguments shared by the forward and backward kernels."""
        return (
            BH, L, d, dv, self.MW, self.MF, self.NMW, self.seg, seg0, self.stride_w,
            self.stride_b, self.t2, self.eps,
        )  # fmt: skip

    def consts(self, keep: Tensor | None) -> dict:
        return dict(
            KIND=self.kind,
            STAB=self.kind != _RELU,
            HAS_KEEP=keep is not None,
            HAS_BIAS=self.bias is not None,
            BT=self.BT,
            BD=self.BD,
            BM=self.BM,
            BV=self.BV,
            PREC=self.prec,
            num_warps=self.warps,
        )


def _precision() -> str:
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _plan(
    x: Tensor, v: Tensor, fmap: FeatureMap, chunk: int, block: int, segments: int | None
) -> _Plan:
    BH, L, d = x.shape
    kind = kernel_kind(fmap)
    if kind is None:
        raise ValueError(f"no Triton causal kernel for {type(fmap).__name__}")
    W = fmap.Wa.to(device=x.device, dtype=torch.float32).contiguous()
    MW = W.shape[-2]
    stride_w = MW * d if W.dim() == 3 and W.shape[0] > 1 else 0
    bias = None
    stride_b = 0
    if fmap.bias is not None:
        bias = fmap.bias.to(device=x.device, dtype=torch.float32).reshape(-1, MW).contiguous()
        stride_b = MW if bias.shape[0] > 1 else 0
    BT, BM = _pow2(chunk), _pow2(min(block, MW))
    NMW = triton.cdiv(MW, BM)
    NM = 2 * NMW if kind == _TRIG else NMW
    n_chunks = triton.cdiv(L, BT)
    if segments is None:  # enough programs for the device, segments of >= 4 chunks
        target = 1
        if x.is_cuda:
            target = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count
        segments = min(max(1, -(-target // (NM * BH))), max(1, n_chunks // 4))
    seg = -(-n_chunks // max(1, min(segments, n_chunks)))
    NS = -(-n_chunks // seg)
    return _Plan(
        kind, W, bias, stride_w, stride_b, MW, NM // NMW * MW, NMW, NM, BT, _pow2(d),
        BM, _pow2(v.shape[-1]), seg, NS, float(fmap.t2), float(fmap.eps), _precision(),
        8 if BT * BM >= 64 * 64 else 4,
    )  # fmt: skip


def _stabilizers(
    p: _Plan, x: Tensor, y: Tensor, keep: Tensor | None, keep8: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(query shift, key running max mu), both (BH, L): the torch path's stabilizers."""
    BH, L, d = x.shape
    if p.kind == _RELU:
        zeros = x.new_zeros(BH, L)
        return zeros, zeros
    if p.kind == _TRIG:  # the key's log part is its row term alone; queries take no shift
        top = y.pow(2).sum(-1).mul_(0.5 * p.t2)
        if keep is not None:
            top.masked_fill_(~keep, float("-inf"))
        return x.new_zeros(BH, L), top.clamp_min_(_NEG).cummax(-1).values
    qs, top = x.new_empty(BH, L), x.new_empty(BH, L)
    bias = p.W if p.bias is None else p.bias
    _stats_kernel[(triton.cdiv(L, p.BT), BH)](
        x, y, _keep_arg(keep8, x), p.W, bias, qs, top, L, d, p.MW, p.stride_w, p.stride_b, p.t2,
        HAS_KEEP=keep is not None, HAS_BIAS=p.bias is not None, BT=p.BT, BD=p.BD, BM=p.BM,
        PREC=p.prec,
    )  # fmt: skip
    return qs, top.cummax(-1).values


def _keep_arg(keep: Tensor | None, like: Tensor) -> Tensor:
    return like if keep is None else keep


def _segment_ends(mu: Tensor, p: _Plan) -> Tensor:
    """(NS - 1, BH): mu at the last row of every segment but the last."""
    L = mu.shape[1]
    ends = [min(L, (s + 1) * p.seg * p.BT) - 1 for s in range(p.NS - 1)]
    return mu[:, ends].T.contiguous()


def _carry(local: Tensor, ends: Tensor, reverse: bool) -> Tensor:
    """Incoming states of the segments from their local ones, one masked product.

    Forward: local (NS-1, BH, F) end states of segments 0..NS-2, each relative to its own end
    mu e_s; segment s + 1 starts from sum_{r <= s} local_r exp(e_r - e_s). Reverse: local
    adjoints of segments 1..NS-1, relative to e_{r-1}; segment s ends with sum_{r >= s}
    local_r exp(e_s - e_r). Returns (NS, BH, F), zeros where a head starts (ends).
    """
    S, BH, F = local.shape
    e = ends.T  # (BH, S)
    expo = e[:, None, :] - e[:, :, None]  # [b, i, r] = e_r - e_i
    keep = torch.ones(S, S, dtype=torch.bool, device=e.device).tril_()
    if reverse:
        expo, keep = expo.mT, keep.T  # [b, i, r] = e_i - e_r for r >= i
    wgt = expo.masked_fill(~keep, float("-inf")).exp_()  # every factor <= 1
    inc = torch.bmm(wgt, local.transpose(0, 1))  # (BH, S, F)
    zero = local.new_zeros(BH, 1, F)
    inc = torch.cat([inc, zero] if reverse else [zero, inc], dim=1)
    return inc.transpose(0, 1).contiguous()


class _TritonCausalFavor(torch.autograd.Function):
    """Causal FAVOR+ forward and backward in Triton; see the module docstring."""

    @staticmethod
    def forward(ctx, x, y, v, fmap: FeatureMap, keep, chunk: int, block: int, segments):
        x, y, v = (t.contiguous() for t in (x, y, v))
        BH, L, d = x.shape
        dv = v.shape[-1]
        p = _plan(x, v, fmap, chunk, block, segments)
        keep8 = None if keep is None else keep.to(torch.uint8).contiguous()
        qs, mu = _stabilizers(p, x, y, keep, keep8)
        bias = p.W if p.bias is None else p.bias
        kp = _keep_arg(keep8, x)
        consts = p.consts(keep8)
        if p.NS > 1:  # every segment's own end state (keys only), then the incoming ones
            hn = x.new_empty(p.NS - 1, BH, p.MF, dv)
            zn = x.new_empty(p.NS - 1, BH, p.MF)
            _fwd_kernel[(p.NM, p.NS - 1, BH)](
                x, y, v, kp, qs, mu, p.W, bias, x, x, x, x, x, hn, zn, *p.meta(BH, L, d, dv, 0),
                HAS_INIT=False, STATE_ONLY=True, **consts,
            )  # fmt: skip
            ends = _segment_ends(mu, p)
            h0 = _carry(hn.view(p.NS - 1, BH, -1), ends, reverse=False).view(p.NS, BH, p.MF, dv)
            z0 = _carry(zn, ends, reverse=False)
            m0 = torch.cat([ends.new_full((1, BH), _NEG), ends]).contiguous()
        else:
            h0 = z0 = m0 = x.new_zeros(1)
        o = x.new_empty(p.NM, BH, L, dv)
        den = x.new_empty(p.NM, BH, L)
        _fwd_kernel[(p.NM, p.NS, BH)](
            x, y, v, kp, qs, mu, p.W, bias, h0, z0, m0, o, den, x, x, *p.meta(BH, L, d, dv, 0),
            HAS_INIT=p.NS > 1, STATE_ONLY=False, **consts,
        )  # fmt: skip
        den = safe_denominator(den.sum(0)[..., None])  # (BH, L, 1)
        out = o.sum(0).div_(den)
        empty = den == torch.finfo(torch.float32).tiny  # rows that saw no real key
        ctx.p, ctx.fmap = p, fmap
        rden = den.reciprocal_()
        ctx.save_for_backward(x, y, v, keep, keep8, qs, mu, out, rden, empty, h0, z0, m0)
        return out

    @staticmethod
    def backward(ctx, g):
        x, y, v, keep, keep8, qs, mu, out, rden, empty, h0, z0, m0 = ctx.saved_tensors
        p: _Plan = ctx.p
        BH, L, d = x.shape
        dv = v.shape[-1]
        g = g.to(torch.float32)
        gh = (g * rden).masked_fill_(empty, 0.0).contiguous()  # d loss / d numerator
        gam = (-(g * out).sum(-1, keepdim=True) * rden).masked_fill_(empty, 0.0)  # / d den
        gam = gam[..., 0].contiguous()
        bias = p.W if p.bias is None else p.bias
        kp = _keep_arg(keep8, x)
        consts = p.consts(keep8)
        if p.NS > 1:  # every segment's own adjoint (queries only), then the incoming ones
            dhn = x.new_empty(p.NS - 1, BH, p.MF, dv)
            dzn = x.new_empty(p.NS - 1, BH, p.MF)
            _bwd_kernel[(p.NM, p.NS - 1, BH)](
                x, y, v, kp, qs, mu, p.W, bias, gh, gam, x, x, x, x, x, x, x, x, dhn, dzn,
                *p.meta(BH, L, d, dv, 1), HAS_INIT=False, DUAL_ONLY=True, **consts,
            )  # fmt: skip
            ends = _segment_ends(mu, p)
            dh0 = _carry(dhn.view(p.NS - 1, BH, -1), ends, reverse=True)
            dh0 = dh0.view(p.NS, BH, p.MF, dv)
            dz0 = _carry(dzn, ends, reverse=True)
        else:
            dh0 = x.new_zeros(1, BH, p.MF, dv)
            dz0 = x.new_zeros(1, BH, p.MF)
        dq = x.new_empty(p.NM, BH, L, d)
        dk = x.new_empty(p.NM, BH, L, d)
        dvv = x.new_empty(p.NM, BH, L, dv)
        _bwd_kernel[(p.NM, p.NS, BH)](
            x, y, v, kp, qs, mu, p.W, bias, gh, gam, h0, z0, m0, dh0, dz0, dq, dk, dvv, x, x,
            *p.meta(BH, L, d, dv, 0), HAS_INIT=p.NS > 1, DUAL_ONLY=False, **consts,
        )  # fmt: skip
        grads = (dq.sum(0), dk.sum(0), dvv.sum(0))
        # As the torch path: one sync; a non-finite gradient (extreme logits) is redone there
        # in float64.
        if not bool(torch.stack([t.sum() for t in grads]).isfinite().all()):
            grads = _float64_grads(x, y, v, ctx.fmap, keep, g)
        return (*grads, None, None, None, None, None)


def _float64_grads(x, y, v, fmap: FeatureMap, keep, g) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) by the torch path in float64 (the rare fallback), as float32."""
    with torch.enable_grad():
        xd, yd, vd = (t.detach().double().requires_grad_() for t in (x, y, v))
        out = _CausalFavor.apply(xd, yd, vd, fmap.to(torch.float64), keep, 64, 8192)
        grads = torch.autograd.grad(out, (xd, yd, vd), g.double())
    return tuple(t.float() for t in grads)


def causal_favor_triton(
    x: Tensor,
    y: Tensor,
    v: Tensor,
    fmap: FeatureMap,
    keep: Tensor | None,
    *,
    chunk: int = CHUNK,
    block: int = BLOCK,
    segments: int | None = None,
) -> Tensor:
    """Causal FAVOR+ of flattened float32 heads x, y (BH, L, d), v (BH, L, dv), keep (BH, L)
    (True = real key) -> (BH, L, dv), as :class:`_CausalFavor` computes it.

    chunk: tokens per chunk (BT, a power of two >= 16); block: features per program (BM);
    segments: sequence segments per head run in parallel (None: enough programs for the
    device). None of them changes the result beyond float32 rounding.
    """
    if x.shape[1] == 0:
        return v.new_zeros(v.shape)
    return _TritonCausalFavor.apply(x, y, v, fmap, keep, chunk, block, segments)
