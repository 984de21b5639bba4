"""FAVOR+ attention core: random features, linear and chunked causal attention, exact reference.

Math: ../shared/FAVOR.md (Choromanski et al., ICLR 2021) and, for ``softmax_opt``, FAVOR++
(Likhosherstov et al., "Chefs' Random Tables", NeurIPS 2022). Everything here is a pure function
of tensors except :class:`FavorAttention`, which only owns the random matrix omega (a persistent
buffer, so checkpoints reproduce) and, for causal ``softmax_opt``, a running data statistic.

Conventions: q, k, v are (B, H, L, d) and *unscaled*: the kernel approximates
softmax(q k^T / sqrt(d)). Internally x = q d^-1/4, y = k d^-1/4 so the kernel is exp(x^T y).
``key_padding_mask`` is (B, L) bool, True = pad; padded keys get zero features, so they add
nothing to the numerator or the normalizer. Features are always computed in float32 (float64 when
the inputs are float64), also under bf16/fp16 autocast; the output is cast back to q's dtype.

Feature dimension M: m (= nb_features) for softmax, softmax_opt and relu; 2m for softmax_hyp and
trig (each omega row gives a +/- or sin/cos pair).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.favor_causal import (
    Segment,
    SegmentOperands,
    causal_linear_attention,
    plan_segments,
    safe_denominator,
    scan_backward_segments,
    scan_forward_segments,
    workspace,
)

__all__ = [
    "KERNELS",
    "FavorAttention",
    "FavorState",
    "MapFactors",
    "MapStabilizers",
    "causal_linear_attention",
    "draw_omega",
    "exact_attention",
    "exact_attention_map",
    "favor_attention",
    "favor_attention_map",
    "oprf_coefficients",
    "oprf_rho",
    "random_features",
]

KERNELS = ("softmax", "softmax_hyp", "softmax_opt", "trig", "relu")
_EXP_KERNELS = ("softmax", "softmax_hyp", "softmax_opt")
_NEG = -1e30  # finite stand-in for -inf in stabilizers, so that (-inf) - (-inf) never appears


# --------------------------------------------------------------------------- random matrices


def draw_omega(
    nb_features: int,
    dim: int,
    *,
    orthogonal: bool = True,
    norm: str = "chi",
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Random projection omega (m, d) whose rows are marginally N(0, I_d).

    orthogonal: rows within each block of d are exactly orthogonal (Haar QR, sign-corrected),
    which lowers the estimator's variance at no cost (FAVOR.md, ORF). norm="chi" gives each row
    the norm of an independent Gaussian vector, keeping each row N(0, I) and the kernel unbiased;
    norm="fixed" sets every norm to sqrt(d) (the biased "regularized" variant, opt-in only).
    Drawn on the generator's device (CPU by default).
    """
    if norm not in ("chi", "fixed"):
        raise ValueError(f"norm must be 'chi' or 'fixed', got {norm!r}")
    device = generator.device if generator is not None else torch.device("cpu")
    if not orthogonal:
        return torch.randn(nb_features, dim, generator=generator, device=device).to(dtype)
    nb_blocks = math.ceil(nb_features / dim)
    gauss = torch.randn(nb_blocks, dim, dim, generator=generator, device=device)
    qmat, rmat = torch.linalg.qr(gauss.double())  # (n, d, d)
    qmat = qmat * torch.sign(torch.diagonal(rmat, dim1=-2, dim2=-1))[:, None, :]  # Haar
    rows = qmat.transpose(1, 2).reshape(nb_blocks * dim, dim)[:nb_features]  # (m, d)
    if norm == "chi":
        norms = torch.randn(nb_features, dim, generator=generator, device=device).double()
        norms = norms.norm(dim=1)
    else:
        norms = torch.full((nb_features,), math.sqrt(dim), dtype=torch.float64, device=device)
    return (rows * norms[:, None]).to(dtype)


# --------------------------------------------------------------------------- FAVOR++ (OPRF)


def oprf_rho(x: Tensor, y: Tensor, x_keep: Tensor | None = None, y_keep: Tensor | None = None):
    """Data statistic rho = mean_{i,j} ||x_i + y_j||^2 / d over real tokens. (..., L, d) -> (...).

    The mean over all pairs factorizes: E|x|^2 + E|y|^2 + 2 E[x]^T E[y], so this is O(L d).
    """

    def moments(z: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        if keep is None:
            return z.pow(2).sum(-1).mean(-1), z.mean(-2)
        w = keep.to(z.dtype)  # (..., L)
        cnt = w.sum(-1).clamp_min(1.0)
        sq = (z.pow(2).sum(-1) * w).sum(-1) / cnt
        mean = (z * w[..., None]).sum(-2) / cnt[..., None]
        return sq, mean

    sx, mx = moments(x, x_keep)
    sy, my = moments(y, y_keep)
    return (sx + sy + 2 * (mx * my).sum(-1)) / x.shape[-1]


def oprf_coefficients(rho: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(A, B, log D) of the optimal positive random features for statistic rho.

    f(w, x) = D exp(A|w|^2 + B w^T x - |x|^2 / 2), w ~ N(0, I_d). With B^2 = 1 - 4A and
    D = (1 - 4A)^(d/4), E[f(w,x) f(w,y)] = exp(x^T y) for any A < 1/8. The log second moment,
    averaged over pairs, is d log(1-4A) - d/2 log(1-8A) + 2 (1-4A)/(1-8A) rho d + const; its
    minimiser in u = 1 - 8A solves u^2 - (1 + 2 rho) u - 2 rho = 0, i.e.
    A = (1 - 2 rho - sqrt((2 rho + 1)^2 + 8 rho)) / 16 <= 0 (A = 0 is plain FAVOR+ at rho = 0).
    This is the FAVOR++ optimum of Likhosherstov et al. 2022 (arXiv 2205.15317), with rho the
    mean of |x_i + y_j|^2 / d over all query-key pairs of one attention instance (one batch
    element and head), as :func:`oprf_rho` computes it.

    When it helps at attention level: the optimum minimizes the pair-averaged *log* second
    moment of the unnormalized kernel estimate. At small norms (logit std ~0.25-0.5, d = 16,
    m = 64) that carries over to the attention output (tests: ~0.6x the positive-feature MSE).
    At larger norms (logit std >= 1) the closed forms still predict a far lower mean variance,
    but the positive estimator's mean error is then carried by rare omega draws (its variance
    grows like exp(2|x + y|^2)), which a few dozen draws never sample, while OPRF's prefactor
    (1 - 4A)^d (1 - 8A)^(-d/2) > 1 raises the typical error: sampled attention MSE then favours
    plain positive features, and the softmax normalization, which cancels much of the shared
    per-query noise, is not part of the objective either.
    """
    rho = torch.as_tensor(rho).clamp_min(0.0)
    u = ((1 + 2 * rho) + torch.sqrt((1 + 2 * rho) ** 2 + 8 * rho)) / 2
    a = (1 - u) / 8
    return a, torch.sqrt(1 - 4 * a), (dim / 4) * torch.log1p(-4 * a)


# --------------------------------------------------------------------------- feature maps


def _exp_logits(x: Tensor, omega: Tensor, kernel: str, rho: Tensor | None) -> Tensor:
    """log phi(x) for the exp kernels. x: (..., L, d) -> (..., L, M)."""
    m, d = omega.shape
    proj = x @ omega.T  # (..., L, m)
    half_sq = x.pow(2).sum(-1, keepdim=True) / 2  # (..., L, 1)
    if kernel == "softmax":
        return proj - (half_sq + 0.5 * math.log(m))
    if kernel == "softmax_hyp":
        return torch.cat([proj, -proj], dim=-1) - (half_sq + 0.5 * math.log(2 * m))
    if rho is None:
        raise ValueError("softmax_opt needs the data statistic rho")
    a, b, log_d = oprf_coefficients(rho.to(x.dtype), d)
    a, b, log_d = (t.reshape(t.shape + (1, 1)) for t in (a, b, log_d))  # (..., 1, 1)
    bias = a * omega.pow(2).sum(-1) + log_d - 0.5 * math.log(m)  # (..., 1, m)
    return b * proj + bias - half_sq


def random_features(
    x: Tensor,
    omega: Tensor,
    kernel: str = "softmax",
    *,
    rho: Tensor | float | None = None,
    relu_eps: float = 1e-3,
) -> Tensor:
    """Unstabilized phi(x), (..., L, d) -> (..., L, M), for x already scaled by d^-1/4.

    For the softmax kernels phi(x)^T phi(y) is an unbiased estimate of exp(x^T y). Meant for
    analysis and tests; the attention functions use stabilized versions of the same maps.
    """
    _check_kernel(kernel)
    if kernel in _EXP_KERNELS:
        r = None if rho is None else torch.as_tensor(rho, dtype=x.dtype, device=x.device)
        return torch.exp(_exp_logits(x, omega, kernel, r))
    proj = x @ omega.T
    if kernel == "relu":
        return F.relu(proj) + relu_eps
    h = torch.exp(x.pow(2).sum(-1, keepdim=True) / 2) / math.sqrt(omega.shape[0])
    return torch.cat([proj.sin(), proj.cos()], dim=-1) * h


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def _key_parts(
    y: Tensor, omega: Tensor, kernel: str, rho: Tensor | None, eps: float
) -> tuple[Tensor | None, Tensor | None]:
    """Key feature = exp(logit - stabilizer) * base, as (logit, base).

    exp kernels: logit (..., L, M), base None. trig: logit = |y|^2/2 (..., L, 1), base sin/cos.
    relu: no exponent (logit None), base = ReLU + eps.
    """
    if kernel in _EXP_KERNELS:
        return _exp_logits(y, omega, kernel, rho), None
    proj = y @ omega.T  # (..., L, m)
    if kernel == "relu":
        return None, F.relu(proj) + eps
    return y.pow(2).sum(-1, keepdim=True) / 2, torch.cat([proj.sin(), proj.cos()], dim=-1)


def _exp_feature_map(
    x: Tensor, W: Tensor, scale: Tensor | None, bias: Tensor | None, keep: Tensor | None, key: bool
) -> tuple[Tensor, Tensor]:
    """Stabilized exp features and their offsets mu, with one (BH, L, M) allocation.

    x: (BH, L, d) -> features (BH, L, M), mu (BH, L); see :class:`_ExpFeatures` for the
    stabilizers. The logits are scale * x W^T + bias; everything after the matmul is in place.
    """
    if bias is not None and scale is None and x.dim() == 3:  # bias folded into the matmul
        BH, L, d = x.shape
        t = torch.baddbmm(bias.expand(BH, L, W.shape[0]), x, W.T.expand(BH, d, W.shape[0]))
    else:
        t = x @ W.T  # (BH, L, M)
        if scale is not None:
            t.mul_(scale)
        if bias is not None:
            t.add_(bias)
    if key:
        return _stabilized_key_exp(t, x.pow(2).sum(-1).div_(2), keep)
    mu = t.amax(-1)
    t.sub_(mu[..., None])
    return t.exp_(), mu


def _stabilized_key_exp(
    t: Tensor,
    half_sq: Tensor,
    keep: Tensor | None,
    mu_in: Tensor | None = None,
    mu: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal key features exp(t - |k|^2/2 - mu) in place of the logits t (..., L, M); pads 0.

    mu (..., L) is the running max over keys <= j of each key's largest log-feature, so no
    future key enters a past position's stabilizer. It continues from mu_in (...,), the value
    carried in from an earlier part of the sequence, unless mu itself is given (a backward
    recomputing the forward's features). half_sq (..., L) = |k|^2/2 is consumed.
    """
    if mu is None:
        row = t.amax(-1).sub_(half_sq)
        if keep is not None:
            row.masked_fill_(~keep, float("-inf"))
        mu = row.clamp_min_(_NEG).cummax(dim=-1).values
        if mu_in is not None:
            mu = torch.maximum(mu, mu_in[..., None])
    t.sub_(half_sq.add_(mu)[..., None])
    if keep is not None:
        t.masked_fill_(~keep[..., None], float("-inf"))
    return t.exp_(), mu


class _ExpFeatures(torch.autograd.Function):
    """exp(scale * x W^T + bias - shift) with one (L, M) allocation, updated in place.

    Queries (key=False): shift = row max, which cancels between numerator and normalizer, so
    the -|x|^2/2 term (per row) is dropped too. Causal keys (key=True): shift = |x|^2/2 + mu_j,
    mu = running max over keys <= j of the row max (no future information); pads get 0.
    Returns (features, mu) with mu (BH, L) non-differentiable; both stabilizers cancel exactly,
    so the backward treats them as constants.
    """

    @staticmethod
    def forward(ctx, x, W, scale, bias, keep, key: bool):
        f, mu = _exp_feature_map(x, W, scale, bias, keep, key)
        ctx.key = key
        ctx.save_for_backward(x, W, scale, f)
        ctx.mark_non_differentiable(mu)
        return f, mu

    @staticmethod
    def backward(ctx, grad_f, _grad_mu):
        x, W, scale, f = ctx.saved_tensors
        dt = grad_f * f  # (BH, L, M)
        # A feature that underflowed to 0 gets no gradient (avoids inf * 0 at extreme logits).
        dt.masked_fill_(f == 0, 0.0)
        dx = dt @ W.to(dt.dtype)  # (BH, L, d)
        if scale is not None:
            dx.mul_(scale)
        if ctx.key:
            dx.sub_(dt.sum(-1, keepdim=True) * x)
        return dx, None, None, None, None, None


class _RowFeatures:
    """Stabilized exp features of one segment's rows, computed when the causal scan needs them.

    Why: the scan uses phi(Q), phi(K) one segment at a time, so neither is ever materialized
    for the whole sequence; the backward recomputes them from q, k and the O(L) stabilizers
    saved by the forward. q, k are unscaled (BH, Lp, d): the temperature t = d^-1/4 (and the
    FAVOR++ scale) is folded into Wa, so the logits are q Wa^T + bias for queries and
    k Wa^T + bias - t2 |k|^2/2 for keys (t2 = t^2), with no (L, d) copies of the inputs.
    Features are computed in q's dtype into reused buffers (valid until the next call) and
    returned as ``dtype`` (float64 for the backward's fallback, with the forward's values).
    """

    def __init__(self, q, k, v, Wa, bias, keep, t2: float, chunk: int, dtype: torch.dtype):
        self.q, self.k, self.v, self.Wa, self.bias, self.keep = q, k, v, Wa, bias, keep
        self.t2, self.chunk, self.dtype = t2, chunk, dtype
        self.bufs: dict[str, Tensor | None] = dict.fromkeys(("q", "k", "vx"))

    def rows(self, t: Tensor, seg: Segment) -> Tensor:
        """(BH, Lp, ...) -> the segment's (nb, G*C, ...) view."""
        b0, b1, g0, g1 = seg
        return t[b0:b1, g0 * self.chunk : g1 * self.chunk]

    def _logits(self, z: Tensor, seg: Segment, name: str) -> Tensor:
        zs = self.rows(z, seg)  # (nb, N, d)
        shape = (*zs.shape[:2], self.Wa.shape[-2])
        self.bufs[name] = buf = workspace(self.bufs[name], shape, zs)
        torch.matmul(zs, _segment_weights(self.Wa, seg).mT, out=buf)  # (nb, N, M)
        return buf if self.bias is None else buf.add_(self.bias[seg[0] : seg[1]])

    def chunk_mu(self, mu: Tensor, seg: Segment) -> Tensor:
        """(BH, Lp) -> the segment's (nb, G, C) view."""
        b0, b1, g0, g1 = seg
        return self.rows(mu, seg).view(b1 - b0, g1 - g0, self.chunk)

    def queries(
        self, seg: Segment, shift: Tensor | None = None, rscale: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """exp(logit - shift) * rscale; shift = the row max (nb, N) unless given (backward).

        rscale (nb, N, 1): the backward's row rescaling by 1 / normalizer.
        """
        t = self._logits(self.q, seg, "q")
        if shift is None:
            shift = t.amax(-1)
        t.sub_(shift[..., None]).exp_()
        if rscale is not None:
            t.mul_(rscale)
        return t.to(self.dtype), shift

    def keys(
        self, seg: Segment, mu_in: Tensor | None = None, mu: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """exp(logit - mu), pads 0; mu (nb, N) = running max of the row max over keys <= j.

        The max continues from mu_in (nb,), the stabilizer carried in from the previous
        segment of the same heads (None at a head's start); a given mu (backward) is used as is.
        """
        t = self._logits(self.k, seg, "k")
        half = self.rows(self.k, seg).pow(2).sum(-1).mul_(self.t2 / 2)  # (nb, N)
        keep = None if self.keep is None else self.rows(self.keep, seg)
        f, mu = _stabilized_key_exp(t, half, keep, mu_in, mu)
        return f.to(self.dtype), mu

    def values(self, seg: Segment) -> Tensor:
        """[v | 1] of the segment's rows, (nb, N, dv+1)."""
        vs = self.rows(self.v, seg)
        self.bufs["vx"] = vx = workspace(self.bufs["vx"], (*vs.shape[:2], vs.shape[-1] + 1), vs)
        vx[..., :-1] = vs
        vx[..., -1] = 1.0
        return vx.to(self.dtype)


class _CausalExpFavor(torch.autograd.Function):
    """Causal FAVOR for the exp kernels as one autograd node: features, chunked scan, backward.

    Why one node: the features of a segment's rows are computed when the scan reaches it (see
    :class:`_RowFeatures`), in forward and again in backward, and the feature gradients are
    finished segment by segment (dlogit = dphi * phi, then one (rows, M) @ (M, d) matmul), so
    no (BH, L, M) tensor is ever allocated: besides O(segment) buffers, memory is O(L d).
    Saved: q, k, v, the outputs and the stabilizers (query row max, normalizer, key mu).

    Row rescaling (finite gradients at extreme logits): a query's features are stabilized by its
    row max, so the normalizer den_t can still be tiny (query mass where the keys have none) and
    a backward through 1/den_t overflows. The backward multiplies each recomputed query row by
    1/den_t (<= 1/float32.tiny, finite), which changes no output (a per-row factor cancels)
    but makes every normalizer 1, so the backward divides by nothing small. Each product
    phi_t,c / den_t * (key mass in column c) is <= 1, but in float32 a sum over queries of a huge
    phi_t,c / den_t can still overflow before it meets the tiny key features of a dead column;
    only then (checked on the O(L d) results) is the backward redone in float64.
    """

    @staticmethod
    def forward(ctx, q, k, v, Wa, bias, keep, t2: float, chunk: int, rows: int):
        BH, L, _ = q.shape
        dv = v.shape[-1]
        Lp = -(-L // chunk) * chunk
        if Lp != L:  # pad to whole chunks at the input level: O(L d), not O(L M)
            q, k, v = (F.pad(t, (0, 0, 0, Lp - L)) for t in (q, k, v))
            real = torch.ones(BH, L, dtype=torch.bool, device=q.device) if keep is None else keep
            keep = F.pad(real, (0, Lp - L), value=False)
        feats = _RowFeatures(q, k, v, Wa, bias, keep, t2, chunk, q.dtype)
        qmax, mu = q.new_empty(BH, Lp), q.new_empty(BH, Lp)
        out, den = q.new_empty(BH, Lp, dv), q.new_empty(BH, Lp, 1)

        def operands(seg: Segment, mu_in: Tensor | None) -> SegmentOperands:
            qf, qmax_s = feats.queries(seg)
            kf, mu_s = feats.keys(seg, mu_in=mu_in)
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
        saved = scan_forward_segments(plan_segments(BH, n, chunk, rows), n, chunk, operands, emit)
        empty = den == torch.finfo(torch.float32).tiny  # rows that saw no real key
        ctx.chunk, ctx.rows, ctx.saved, ctx.L, ctx.t2 = chunk, rows, saved, L, t2
        ctx.save_for_backward(q, k, v, Wa, bias, keep, qmax, den.reciprocal_(), mu, out, empty)
        return out[:, :L]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, Wa, bias, keep, qmax, rden, mu, out, empty = ctx.saved_tensors
        L, Lp = ctx.L, q.shape[1]
        g = F.pad(grad_out, (0, 0, 0, Lp - L)) if Lp != L else grad_out
        stab = _CausalStabilizers(qmax, rden, mu, out, empty)
        args = (q, k, v, Wa, bias, keep, ctx.t2, stab, g, ctx.chunk, ctx.rows)
        grads = _causal_exp_backward(*args, ctx.saved, q.dtype)
        if q.dtype != torch.float64 and not all(bool(torch.isfinite(t).all()) for t in grads):
            saved = [None if s is None else tuple(t.double() for t in s) for s in ctx.saved]
            grads = tuple(t.to(q.dtype) for t in _causal_exp_backward(*args, saved, torch.float64))
        dq, dk, dvv = (t[:, :L] for t in grads)
        return dq, dk, dvv, None, None, None, None, None, None


class _CausalStabilizers(NamedTuple):
    """What the causal exp forward saves per row besides q, k, v, all (BH, Lp, .)."""

    qmax: Tensor  # (BH, Lp) query row max
    rden: Tensor  # (BH, Lp, 1) 1 / normalizer
    mu: Tensor  # (BH, Lp) key running max
    out: Tensor  # (BH, Lp, dv) normalized output
    empty: Tensor  # (BH, Lp, 1) rows that saw no real key


def _causal_exp_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    Wa: Tensor,
    bias: Tensor | None,
    keep: Tensor | None,
    t2: float,
    stab: _CausalStabilizers,
    g: Tensor,
    chunk: int,
    rows: int,
    saved: list,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each (BH, Lp, .) in ``dtype``, of :class:`_CausalExpFavor` for grad g.

    The features are recomputed per segment in q's dtype (the forward's values) and the scan
    runs in ``dtype``. out = num / den with den = 1 after the row rescaling: dnum = g and
    dden = -(g . out); rows that saw no real key output the constant 0 and get no gradient.
    """
    BH, Lp, _ = q.shape
    dv = v.shape[-1]
    feats = _RowFeatures(q, k, v, Wa, bias, keep, t2, chunk, dtype)
    Wg = Wa.to(dtype)
    dq, dk = q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype)
    dvv = v.new_empty(v.shape, dtype=dtype)

    def operands(seg: Segment) -> SegmentOperands:
        qf, _ = feats.queries(seg, feats.rows(stab.qmax, seg), feats.rows(stab.rden, seg))
        kf, _ = feats.keys(seg, mu=feats.rows(stab.mu, seg))
        gs = feats.rows(g, seg)
        dy = torch.cat([gs, -(gs * feats.rows(stab.out, seg)).sum(-1, keepdim=True)], dim=-1)
        dy = dy.masked_fill_(feats.rows(stab.empty, seg), 0.0).to(dtype)
        qf, kf, vx, dy = (_chunks(t, chunk) for t in (qf, kf, feats.values(seg), dy))
        return SegmentOperands(qf, kf, vx, feats.chunk_mu(stab.mu, seg).to(dtype), dy)

    def emit(seg: Segment, op: SegmentOperands, dq_s: Tensor, dk_s: Tensor, dvx_s: Tensor):
        dqs, dks, dvs = (feats.rows(t, seg) for t in (dq, dk, dvv))  # (nb, N, .) views
        W = _segment_weights(Wg, seg)
        dl = dq_s.view(op.q.shape).mul_(op.q).view(*dqs.shape[:2], -1)  # d loss / d logit
        torch.matmul(dl, W, out=dqs)
        dl = dk_s.view(op.k.shape).mul_(op.k).view(*dks.shape[:2], -1)
        torch.matmul(dl, W, out=dks)
        dks.sub_(dl.sum(-1, keepdim=True).mul_(t2) * feats.rows(k, seg))  # -t2 |k|^2/2 term
        dvs.copy_(dvx_s.view(*dvs.shape[:2], dv + 1)[..., :dv])

    n = Lp // chunk
    segments = plan_segments(BH, n, chunk, rows)
    scan_backward_segments(segments, n, chunk, saved, operands, emit)
    return dq, dk, dvv


def _segment_weights(W: Tensor, seg: Segment) -> Tensor:
    """W for a segment's heads: (M, d) as is, or rows b0:b1 of per-head (BH, M, d) weights."""
    return W if W.dim() == 2 else W[seg[0] : seg[1]]


def _chunks(t: Tensor, chunk: int) -> Tensor:
    """(nb, N, X) -> (nb * N / C, C, X) view."""
    return t.view(-1, chunk, t.shape[-1])


def _exp_params(
    omega: Tensor, kernel: str, rho: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(W, scale, bias) with log phi(x) = scale * x W^T + bias - |x|^2/2 for the exp kernels."""
    m, d = omega.shape
    if kernel == "softmax":
        return omega, None, None
    if kernel == "softmax_hyp":
        return torch.cat([omega, -omega], dim=0), None, None
    assert rho is not None
    a, b, log_d = oprf_coefficients(rho.to(omega.dtype), d)  # (BH,)
    bias = a[:, None, None] * omega.pow(2).sum(-1) + log_d[:, None, None]  # (BH, 1, m)
    return omega, b[:, None, None], bias


def _query_features(
    x: Tensor,
    omega: Tensor,
    kernel: str,
    rho: Tensor | None,
    eps: float,
    col_offset: Tensor | None = None,
) -> Tensor:
    """Query features up to a per-row factor (it cancels between numerator and normalizer).

    col_offset: per-feature log scale moved over from the keys (bidirectional stabilizer).
    """
    if kernel in _EXP_KERNELS:
        W, scale, bias = _exp_params(omega, kernel, rho)
        if col_offset is not None:
            bias = col_offset if bias is None else bias + col_offset
        return _ExpFeatures.apply(x, W, scale, bias, None, False)[0]
    proj = x @ omega.T
    if kernel == "relu":
        return F.relu(proj) + eps
    return torch.cat([proj.sin(), proj.cos()], dim=-1)


def _causal_key_features(
    y: Tensor, omega: Tensor, kernel: str, rho: Tensor | None, eps: float, keep: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Causally stabilized key features and the running max mu (BH, L) they are relative to."""
    if kernel in _EXP_KERNELS:
        W, scale, bias = _exp_params(omega, kernel, rho)
        return _ExpFeatures.apply(y, W, scale, bias, keep, True)
    logit, base = _key_parts(y, omega, kernel, rho, eps)
    assert base is not None
    if logit is None:  # relu: bounded, no stabilizer needed
        return (base if keep is None else base * keep[..., None]), None
    if keep is not None:  # trig: logit = |y|^2 / 2, one column
        logit = logit.masked_fill(~keep[..., None], float("-inf"))
    mu = logit.detach().amax(-1).clamp_min(_NEG).cummax(dim=-1).values  # (BH, L), keys <= j only
    return torch.exp(logit - mu[..., None]) * base, mu


# --------------------------------------------------------------------------- attention


def _flatten_inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
    """Scale, upcast and flatten heads: (B, H, L, d) -> (BH, L, d); mask -> keep (BH, L)."""
    B, H, L, d = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = d**-0.25
    x = (q.to(dtype) * scale).reshape(B * H, L, d)
    y = (k.to(dtype) * scale).reshape(B * H, L, d)
    vv = v.to(dtype).reshape(B * H, L, v.shape[-1])
    keep = None
    if key_padding_mask is not None:
        keep = (~key_padding_mask.bool())[:, None, :].expand(B, H, L).reshape(B * H, L)
    return x, y, vv, keep


def _resolve_rho(
    kernel: str, causal: bool, rho: Tensor | float | None, x: Tensor, y: Tensor, keep, B: int
):
    """OPRF statistic per (B*H): from the data (bidirectional) or given (causal: no leaks)."""
    if kernel != "softmax_opt":
        return None
    if rho is None:
        if causal:
            raise ValueError(
                "causal softmax_opt needs a fixed oprf_rho: a statistic of the whole sequence "
                "would leak future tokens into past outputs"
            )
        return oprf_rho(x, y, keep, keep).detach()  # (BH,)
    return torch.as_tensor(rho, dtype=x.dtype, device=x.device).expand(x.shape[0])


def _bidirectional(
    x: Tensor,
    y: Tensor,
    v: Tensor,
    keep: Tensor | None,
    omega: Tensor,
    kernel: str,
    rho: Tensor | None,
    eps: float,
    block: int,
) -> Tensor:
    """D^-1 Q'((K')^T [V|1]) with keys and queries in blocks; never forms L x L.

    Key stabilizer: per feature column, an online max over key blocks (the accumulated state is
    rescaled when it grows); the column offsets move to the query side, where a per-row max
    cancels. Then every normalizer is >= 1 for a query that sees any real key.
    """
    BH, L, _ = x.shape
    dv = v.shape[-1]
    vx = torch.cat([v, v.new_ones(BH, L, 1)], dim=-1)  # (BH, L, dv+1)
    kv: Tensor | None = None
    col: Tensor | None = None  # (BH, 1, M) or (BH, 1, 1): running key max per column
    for s in range(0, L, block):
        logit, base = _key_parts(y[:, s : s + block], omega, kernel, rho, eps)
        kb = None if keep is None else keep[:, s : s + block, None]  # (BH, l, 1)
        if logit is None:
            kf = base if kb is None else base * kb
        else:
            if kb is not None:
                logit = logit.masked_fill(~kb, float("-inf"))
            bmax = logit.detach().amax(-2, keepdim=True).clamp_min(_NEG)  # (BH, 1, M|1)
            if col is not None:
                new = torch.maximum(col, bmax)
                kv = kv * torch.exp(col - new).transpose(1, 2)  # rescale rows of the state
                col = new
            else:
                col = bmax
            kf = torch.exp(logit - col)  # (BH, l, M|1)
            if base is not None:
                kf = kf * base
        upd = kf.transpose(1, 2) @ vx[:, s : s + block]  # (BH, M, dv+1)
        kv = upd if kv is None else kv + upd
    offset = col if kernel in _EXP_KERNELS else None
    outs = []
    for s in range(0, L, block):
        qf = _query_features(x[:, s : s + block], omega, kernel, rho, eps, offset)  # (BH, l, M)
        yq = qf @ kv  # (BH, l, dv+1)
        outs.append(yq[..., :dv] / safe_denominator(yq[..., dv:]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _bidi_key_logits(
    y: Tensor, Wa: Tensor, bias: Tensor | None, t2: float, keep: Tensor | None
) -> Tensor:
    """Key logits a y W^T + bias - t2 |y|^2/2, unshifted, pads -inf: (BH, l, d) -> (BH, l, M)."""
    if bias is not None:
        BH, l, _ = y.shape
        t = torch.baddbmm(bias.expand(BH, l, Wa.shape[-2]), y, Wa.mT.expand(BH, -1, -1))
    else:
        t = y @ Wa.mT
    t.sub_(y.pow(2).sum(-1, keepdim=True).mul_(t2 / 2))
    if keep is not None:
        t.masked_fill_(~keep[..., None], float("-inf"))
    return t


def _bidi_query_features(x: Tensor, Wa: Tensor, qbias: Tensor, rmax: Tensor | None):
    """exp(a * x W^T + qbias - rowmax), in place; returns (features, rowmax (BH, l, 1))."""
    BH, l, _ = x.shape
    t = torch.baddbmm(qbias.expand(BH, l, Wa.shape[-2]), x, Wa.mT.expand(BH, -1, -1))
    if rmax is None:
        rmax = t.amax(-1, keepdim=True)
    return t.sub_(rmax).exp_(), rmax


class _BidiExpFavor(torch.autograd.Function):
    """Bidirectional FAVOR for the exp kernels as one autograd node, O(L d + block M) memory.

    Inputs are the *unscaled* flattened q, k, v (BH, L, d); the temperature d^-1/4 is folded into
    the projection: log phi(x) = a x W^T + bias - t^2 |x|^2/2 with a = t * scale. Forward: keys in
    blocks give S = phi(K)^T [V | 1] (M, dv+1), stabilized by the running per-column key max
    ``col`` (the state is rescaled when it grows); queries in blocks give
    out = phi(Q) S_v / (phi(Q) S_1), with the column offsets moved to the query logits and a
    per-row max subtracted (the -t^2|x|^2/2 term is dropped there: a per-row factor cancels).
    Both stabilizers cancel exactly in the output, so the backward treats them as constants.
    Saved: q, k, v, W, col, S, out and the normalizer; the backward recomputes the features
    block by block (queries first, accumulating dS, then keys).
    """

    @staticmethod
    def forward(ctx, q, k, v, W, scale, bias, keep, block: int):
        BH, L, d = q.shape
        dv = v.shape[-1]
        t = d**-0.25
        Wa = W * t if scale is None else W * (scale * t)  # (M, d) or (BH, M, d)
        Sv = q.new_zeros(BH, W.shape[0], dv)
        s1 = q.new_zeros(BH, W.shape[0], 1)
        col = None  # (BH, 1, M)
        for s in range(0, L, block):
            kb = None if keep is None else keep[:, s : s + block]
            lg = _bidi_key_logits(k[:, s : s + block], Wa, bias, t * t, kb)
            bmax = lg.amax(-2, keepdim=True).clamp_min_(_NEG)
            if col is None:
                col = bmax
            else:
                new = torch.maximum(col, bmax)
                r = torch.exp(col - new).mT  # (BH, M, 1)
                Sv.mul_(r)
                s1.mul_(r)
                col = new
            kf = lg.sub_(col).exp_()
            Sv.baddbmm_(kf.mT, v[:, s : s + block])
            s1.add_(kf.sum(-2)[..., None])
        S = torch.cat([Sv, s1], dim=-1)  # (BH, M, dv+1)
        del Sv, s1
        qbias = col if bias is None else bias + col
        out = q.new_empty(BH, L, dv)
        den = q.new_empty(BH, L, 1)
        rmaxs = q.new_empty(BH, L, 1)
        for s in range(0, L, block):
            qf, rmax = _bidi_query_features(q[:, s : s + block], Wa, qbias, None)
            yq = qf @ S
            d_ = safe_denominator(yq[..., dv:])
            den[:, s : s + block] = d_
            rmaxs[:, s : s + block] = rmax
            out[:, s : s + block] = yq[..., :dv] / d_
        ctx.block, ctx.t = block, t
        ctx.save_for_backward(q, k, v, Wa, bias, qbias, keep, col, S, out, den, rmaxs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, Wa, bias, qbias, keep, col, S, out, den, rmaxs = ctx.saved_tensors
        block, t = ctx.block, ctx.t
        BH, L, d = q.shape
        dv = v.shape[-1]
        g = grad_out
        tiny = torch.finfo(torch.float32).tiny
        dS = torch.zeros_like(S)  # (BH, M, dv+1)
        dq = torch.empty_like(q)
        Wq = Wa if Wa.dim() == 3 else Wa.expand(BH, -1, -1)
        for s in range(0, L, block):
            sl = slice(s, s + block)
            gb, db = g[:, sl], den[:, sl]
            # out = num / den: dnum = g / den, dden = -(g . out) / den; rows without real keys
            # (den clamped) have S = 0 and get no gradient.
            dy = torch.cat([gb, -(gb * out[:, sl]).sum(-1, keepdim=True)], dim=-1).div_(db)
            dy.masked_fill_(db == tiny, 0.0)
            qf, _ = _bidi_query_features(q[:, sl], Wa, qbias, rmaxs[:, sl])
            dS.baddbmm_(qf.mT, dy)
            dqf = torch.bmm(dy, S.mT).mul_(qf)  # d loss / d query logit
            dq[:, sl] = torch.bmm(dqf, Wq)
            del qf, dqf
        dk = torch.empty_like(k)
        dvv = torch.empty_like(v)
        dSv, dS1 = dS[..., :dv], dS[..., dv:].mT  # (BH, M, dv), (BH, 1, M)
        for s in range(0, L, block):
            sl = slice(s, s + block)
            kb = None if keep is None else keep[:, sl]
            y = k[:, sl]
            kf = _bidi_key_logits(y, Wa, bias, t * t, kb).sub_(col).exp_()
            dvv[:, sl] = torch.bmm(kf, dSv)
            l = kf.shape[1]
            dkf = torch.baddbmm(dS1.expand(BH, l, -1), v[:, sl], dSv.mT).mul_(kf)
            del kf
            dkb = torch.bmm(dkf, Wq)
            dkb.sub_(dkf.sum(-1, keepdim=True).mul_(t * t) * y)  # the -t^2 |y|^2/2 term
            dk[:, sl] = dkb
        return dq, dk, dvv, None, None, None, None, None


def _flatten_unscaled(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
    """Upcast and flatten heads without the temperature (the fused paths fold it into omega).

    (B, H, L, d) -> (BH, L, d), views when q, k, v are contiguous float32; mask -> keep (BH, L).
    """
    B, H, L, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    x, y, vv = (t.to(dtype).reshape(B * H, L, t.shape[-1]) for t in (q, k, v))
    keep = None
    if key_padding_mask is not None:
        keep = (~key_padding_mask.bool())[:, None, :].expand(B, H, L).reshape(B * H, L)
    return x, y, vv, keep


def _fused_bidirectional(q, k, v, omega, kernel, key_padding_mask, rho, block: int) -> Tensor:
    """Flatten (without the temperature, which :class:`_BidiExpFavor` folds in) and apply it."""
    B, H, L, d = q.shape
    x, y, vv, keep = _flatten_unscaled(q, k, v, key_padding_mask)
    dtype = x.dtype
    om = omega.to(device=x.device, dtype=dtype)
    r = None
    if kernel == "softmax_opt":
        t = d**-0.25
        xs, ys = (x.detach() * t, y.detach() * t) if rho is None else (x, y)
        r = _resolve_rho(kernel, False, rho, xs, ys, keep, B)
    W, scale, bias = _exp_params(om, kernel, r)
    return _BidiExpFavor.apply(x, y, vv, W, scale, bias, keep, block)


def _fused_causal(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    omega: Tensor,
    kernel: str,
    key_padding_mask: Tensor | None,
    rho: Tensor | float | None,
    chunk: int,
    rows: int,
) -> Tensor:
    """Flatten (without the temperature, which :class:`_CausalExpFavor` folds in) and apply it."""
    B, _, _, d = q.shape
    x, y, vv, keep = _flatten_unscaled(q, k, v, key_padding_mask)
    om = omega.to(device=x.device, dtype=x.dtype)
    W, scale, bias = _exp_params(om, kernel, _resolve_rho(kernel, True, rho, x, y, keep, B))
    t = d**-0.25
    Wa = W * t if scale is None else W * (scale * t)  # (M, d) or (BH, M, d)
    return _CausalExpFavor.apply(x, y, vv, Wa, bias, keep, t * t, chunk, rows)


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    omega: Tensor,
    *,
    kernel: str = "softmax",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    oprf_rho: Tensor | float | None = None,
    chunk_size: int = 128,
    block_size: int = 2048,
    relu_eps: float = 1e-3,
    segment_size: int = 8192,
    fused_bidirectional: bool = True,
) -> Tensor:
    """FAVOR attention, (B, H, L, d) -> (B, H, L, dv), linear in L in time and memory.

    Causal mode uses the chunked scan of :mod:`favor_causal` (O(L) memory also in backward);
    for the exp kernels through :class:`_CausalExpFavor`, which computes the features one scan
    segment at a time. segment_size: tokens (over all heads) per scan segment; it bounds the
    scan's transient memory (about segment_size * (4 M + 2 C) floats in backward).
    Bidirectional exp kernels use :class:`_BidiExpFavor` (features recomputed in backward, so
    O(L d + block M) memory) unless fused_bidirectional=False or omega / oprf_rho need
    gradients; the generic blockwise path then keeps every block's features for autograd.
    oprf_rho: the FAVOR++ statistic; computed from the (non-pad) data when None (bidirectional
    only). Features in float32 even under autocast; output in q's dtype.
    """
    _check_kernel(kernel)
    B, H, L, _ = q.shape
    out_dtype = q.dtype
    fused = (
        fused_bidirectional
        and not causal
        and kernel in _EXP_KERNELS
        and not omega.requires_grad
        and not (isinstance(oprf_rho, Tensor) and oprf_rho.requires_grad)
    )
    if fused or (causal and kernel in _EXP_KERNELS):
        with torch.autocast(device_type=q.device.type, enabled=False):
            if fused:
                out = _fused_bidirectional(
                    q, k, v, omega, kernel, key_padding_mask, oprf_rho, block_size
                )
            else:
                args = (kernel, key_padding_mask, oprf_rho, chunk_size, segment_size)
                out = _fused_causal(q, k, v, omega, *args)
        return out.reshape(B, H, L, -1).to(out_dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        x, y, vv, keep = _flatten_inputs(q, k, v, key_padding_mask)
        om = omega.to(device=x.device, dtype=x.dtype)
        rho = _resolve_rho(kernel, causal, oprf_rho, x, y, keep, B)
        if causal:
            qf = _query_features(x, om, kernel, rho, relu_eps)  # (BH, L, M)
            kf, mu = _causal_key_features(y, om, kernel, rho, relu_eps, keep)  # (BH,L,M), (BH,L)
            out = causal_linear_attention(qf, kf, vv, mu, chunk_size, segment_size)
        else:
            out = _bidirectional(x, y, vv, keep, om, kernel, rho, relu_eps, block_size)
    return out.reshape(B, H, L, -1).to(out_dtype)  # (B, H, L, dv)


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
    _check_kernel(kernel)
    B, H, L, _ = q.shape
    sl = query_slice if query_slice is not None else slice(0, L)
    pos = torch.arange(L, device=q.device)[sl]  # (W,)
    with torch.autocast(device_type=q.device.type, enabled=False):
        x, y, _, keep = _flatten_inputs(q, k, k[..., :1], key_padding_mask)
        om = omega.to(device=x.device, dtype=x.dtype)
        rho = _resolve_rho(kernel, causal, oprf_rho, x, y, keep, B)
        if causal:
            kf, mu = _causal_key_features(y, om, kernel, rho, relu_eps, keep)
            qf = _query_features(x[:, sl], om, kernel, rho, relu_eps)  # (BH, W, M)
            w = qf @ kf.transpose(1, 2)  # (BH, W, L)
            allowed = pos[:, None] >= torch.arange(L, device=q.device)[None, :]  # (W, L)
            if mu is not None:
                decay = (mu[:, None, :] - mu[:, sl, None]).masked_fill(~allowed, float("-inf"))
                w = w * decay.exp()
            else:
                w = w * allowed
        else:
            f = MapFactors(x, y, keep, om, kernel, rho, relu_eps)
            w = f.queries(sl, normalized=False) @ f.keys().transpose(1, 2)  # (BH, W, L)
        w = w / safe_denominator(w.sum(-1, keepdim=True))
    return w.reshape(B, H, w.shape[1], L)


class MapStabilizers(NamedTuple):
    """What fixes a bidirectional implied map beyond q and k: the OPRF statistic rho (BH,) or
    None, the key stabilizer col (BH, 1, M|1) or None (relu), the key feature sum (BH, M)."""

    rho: Tensor | None
    col: Tensor | None
    key_sum: Tensor


class MapFactors:
    """The bidirectional implied attention as a product A = queries() @ keys()^T.

    Why: contact maps need blocks A[rows, cols] and every row and column sum of A for L far
    beyond an L x L matrix (titin: 34k residues). The key stabilizer (a per-feature max over all
    keys, moved to the query side where a per-row factor cancels) and the normalizers are fixed
    once from the whole sequence (:attr:`stabilizers`, O(L M)); a later instance given them
    recomputes any block from the features of its rows alone, with the values
    :func:`favor_attention_map` gives. x, y: scaled, flattened (BH, L, d) as
    :func:`_flatten_inputs` returns them; use :meth:`from_heads` for (B, H, L, d) q and k.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        keep: Tensor | None,
        omega: Tensor,
        kernel: str,
        rho: Tensor | None,
        relu_eps: float,
        fixed: MapStabilizers | None = None,
    ) -> None:
        self.x, self.y, self.keep, self.omega = x, y, keep, omega
        self.kernel, self.relu_eps = kernel, relu_eps
        if fixed is None:
            col = None
            logit, _ = _key_parts(y, omega, kernel, rho, relu_eps)
            if logit is not None:
                if keep is not None:
                    logit = logit.masked_fill(~keep[..., None], float("-inf"))
                col = logit.detach().amax(-2, keepdim=True).clamp_min(_NEG)  # (BH, 1, M|1)
            self.rho, self.col = rho, col
            fixed = MapStabilizers(rho, col, self.keys().sum(1))
        self.stabilizers = fixed
        self.rho, self.col = fixed.rho, fixed.col

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
        _check_kernel(kernel)
        x, y, _, keep = _flatten_inputs(q, k, k[..., :1], key_padding_mask)
        om = omega.to(device=x.device, dtype=x.dtype)
        rho = None if fixed is not None else _resolve_rho(kernel, False, None, x, y, keep, 1)
        return cls(x, y, keep, om, kernel, rho, relu_eps, fixed)

    def keys(self, sl: slice = slice(None)) -> Tensor:
        """Key features of the keys in ``sl``, (BH, n, M); pads 0."""
        logit, base = _key_parts(self.y[:, sl], self.omega, self.kernel, self.rho, self.relu_eps)
        kf = base if logit is None else torch.exp(logit - self.col)
        if logit is not None and base is not None:
            kf = kf * base
        return kf if self.keep is None else kf * self.keep[:, sl, None]

    def queries(self, sl: slice = slice(None), normalized: bool = True) -> Tensor:
        """Query features of the queries in ``sl``, (BH, n, M), divided by each row's
        normalizer when ``normalized`` (then queries() @ keys()^T rows sum to 1)."""
        offset = self.col if self.kernel in _EXP_KERNELS else None
        x = self.x[:, sl]
        qf = _query_features(x, self.omega, self.kernel, self.rho, self.relu_eps, offset)
        if not normalized:
            return qf
        den = (qf * self.stabilizers.key_sum[:, None, :]).sum(-1, keepdim=True)
        return qf / safe_denominator(den)


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


# --------------------------------------------------------------------------- module


def _in_backward_pass() -> bool:
    """True while autograd's engine runs a backward pass on this thread.

    Why: activation checkpointing (reentrant or not) re-runs the forward *inside* the backward
    pass; a running statistic updated in forward must skip that replay or it counts a step
    twice. torch exposes no public flag for "this is a checkpoint recomputation", but the
    engine's thread-local graph task id is -1 exactly when no backward is running.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class FavorState(NamedTuple):
    """RNN-mode state of causal FAVOR attention.

    kv: (B, H, M, dv+1) sum over seen keys of phi(k_j)[v_j | 1]^T, scaled by exp(-mu);
    mu: (B, H) running key stabilizer (max log-feature so far; 0 for relu).
    """

    kv: Tensor
    mu: Tensor


class FavorAttention(nn.Module):
    """FAVOR attention with its random matrix omega as a persistent buffer.

    omega is redrawn only by an explicit :meth:`redraw` call (a training hook decides when;
    data-parallel ranks must pass identically seeded generators so all hold the same omega).
    For causal ``softmax_opt`` a running statistic ``oprf_rho`` (EMA of batch statistics,
    updated in training mode after each forward, once per step: the replay of the forward by
    activation checkpointing inside backward is skipped) fixes the feature map, because a
    statistic of the current sequence would leak future tokens; bidirectional mode uses each
    sequence's own.
    """

    def __init__(
        self,
        dim_head: int,
        nb_features: int = 256,
        causal: bool = False,
        kernel: str = "softmax",
        *,
        orthogonal: bool = True,
        norm: str = "chi",
        chunk_size: int = 128,
        block_size: int = 2048,
        relu_eps: float = 1e-3,
        oprf_momentum: float = 0.05,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        _check_kernel(kernel)
        self.dim_head = dim_head
        self.nb_features = nb_features
        self.causal = causal
        self.kernel = kernel
        self.orthogonal = orthogonal
        self.norm = norm
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.relu_eps = relu_eps
        self.oprf_momentum = oprf_momentum
        self.register_buffer("omega", self._draw(generator), persistent=True)
        if kernel == "softmax_opt":
            self.register_buffer("oprf_rho", torch.zeros(()), persistent=True)

    def _draw(self, generator: torch.Generator | None) -> Tensor:
        return draw_omega(
            self.nb_features,
            self.dim_head,
            orthogonal=self.orthogonal,
            norm=self.norm,
            generator=generator,
        )

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a new omega in place (same device and dtype as the buffer)."""
        self.omega.copy_(self._draw(generator).to(self.omega))

    @property
    def feature_dim(self) -> int:
        """M: the width of phi(x)."""
        return 2 * self.nb_features if self.kernel in ("softmax_hyp", "trig") else self.nb_features

    def _rho(self) -> Tensor | None:
        return self.oprf_rho if (self.kernel == "softmax_opt" and self.causal) else None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """(B, H, L, d) x3 -> (B, H, L, dv); key_padding_mask (B, L), True = pad."""
        out = favor_attention(
            q,
            k,
            v,
            self.omega,
            kernel=self.kernel,
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            oprf_rho=self._rho(),
            chunk_size=self.chunk_size,
            block_size=self.block_size,
            relu_eps=self.relu_eps,
        )
        if self.training and self._rho() is not None and not _in_backward_pass():
            self._update_rho(q, k, key_padding_mask)
        return out

    @torch.no_grad()
    def _update_rho(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> None:
        x, y, _, keep = _flatten_inputs(q, k, k[..., :1], key_padding_mask)
        batch_rho = oprf_rho(x, y, keep, keep).mean().to(self.oprf_rho)
        self.oprf_rho.lerp_(batch_rho, self.oprf_momentum)

    def attention_map(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None = None,
        query_slice: slice | None = None,
    ) -> Tensor:
        """Implied attention rows (B, H, W, L) (rows sum to 1, causal-masked when causal)."""
        return favor_attention_map(
            q,
            k,
            self.omega,
            kernel=self.kernel,
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            query_slice=query_slice,
            oprf_rho=self._rho(),
            relu_eps=self.relu_eps,
        )

    def _absorb(
        self, state: FavorState | None, y: Tensor, vv: Tensor, keep: Tensor | None, B: int
    ) -> FavorState:
        """Add keys y (BH, L, d) with values vv (BH, L, dv) to the running state.

        The stabilizer mu becomes the max of the old one and the new keys' largest log-feature,
        and the old sum is rescaled to it: for L = 1 this is the RNN step, for a whole prompt
        it is the state the step-by-step recursion would reach (a max is order-free).
        """
        om = self.omega.to(device=y.device, dtype=y.dtype)
        rho = self.oprf_rho.to(y).expand(y.shape[0]) if self.kernel == "softmax_opt" else None
        logit, base = _key_parts(y, om, self.kernel, rho, self.relu_eps)  # (BH, L, M|1)
        if logit is None:  # relu: bounded features, no stabilizer
            mu = y.new_zeros(y.shape[0])
            kf = base
        else:
            row = logit.amax(-1)  # (BH, L)
            if keep is not None:
                row = row.masked_fill(~keep, _NEG)
            mu = row.amax(-1).clamp_min(_NEG)  # (BH,)
            if state is not None:
                mu = torch.maximum(state.mu.reshape(-1).to(y), mu)
            kf = torch.exp(logit - mu[:, None, None])
            if base is not None:
                kf = kf * base
        if keep is not None:
            kf = kf.masked_fill(~keep[..., None], 0.0)
        vx = torch.cat([vv, vv.new_ones(*vv.shape[:-1], 1)], dim=-1)  # (BH, L, dv+1)
        kv = kf.transpose(1, 2) @ vx  # (BH, M, dv+1)
        if state is not None:
            old = state.kv.reshape(kv.shape).to(y)
            kv = kv + old * torch.exp(state.mu.reshape(-1).to(y) - mu)[:, None, None]
        return FavorState(kv.reshape(B, -1, *kv.shape[1:]), mu.reshape(B, -1))

    @torch.no_grad()
    def initial_state(
        self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None
    ) -> FavorState:
        """The RNN-mode state after a whole prompt, k, v (B, H, L, d), in one parallel pass.

        Generation runs the prompt through the parallel causal forward and continues from this
        state with :meth:`step`; padded keys (key_padding_mask (B, L), True = pad) add nothing.
        """
        self._check_causal()
        with torch.autocast(device_type=k.device.type, enabled=False):
            _, y, vv, keep = _flatten_inputs(k, k, v, key_padding_mask)  # (BH, L, ·)
            return self._absorb(None, y, vv, keep, k.shape[0])

    @torch.no_grad()
    def step(
        self,
        state: FavorState | None,
        q_t: Tensor,
        k_t: Tensor,
        v_t: Tensor,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[FavorState, Tensor]:
        """One causal step: q_t, k_t, v_t (B, H, d) -> (new state, out_t (B, H, dv)).

        state=None starts fresh; key_padding_mask (B,) True = this token is a pad (the state is
        left unchanged). Matches the parallel causal forward (same stabilizer, same omega).
        """
        self._check_causal()
        out_dtype = q_t.dtype
        B, H = q_t.shape[:2]
        with torch.autocast(device_type=q_t.device.type, enabled=False):
            pad = None if key_padding_mask is None else key_padding_mask.reshape(B, 1)
            x, y, vv, keep = _flatten_inputs(
                q_t[:, :, None], k_t[:, :, None], v_t[:, :, None], pad
            )  # (BH, 1, d)
            new_state = self._absorb(state, y, vv, keep, B)
            om = self.omega.to(device=x.device, dtype=x.dtype)
            rho = self.oprf_rho.to(x).expand(x.shape[0]) if self.kernel == "softmax_opt" else None
            qf = _query_features(x, om, self.kernel, rho, self.relu_eps)[:, 0]  # (BH, M)
            kv = new_state.kv.reshape(B * H, *new_state.kv.shape[2:])  # (BH, M, dv+1)
            yq = (qf[:, None, :] @ kv)[:, 0]  # (BH, dv+1)
            out = yq[:, :-1] / safe_denominator(yq[:, -1:])
        return new_state, out.reshape(B, H, -1).to(out_dtype)

    def _check_causal(self) -> None:
        if not self.causal:
            raise RuntimeError("RNN mode (step, initial_state) needs causal=True")

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, nb_features={self.nb_features}, causal={self.causal}, "
            f"kernel={self.kernel!r}, orthogonal={self.orthogonal}, norm={self.norm!r}, "
            f"chunk_size={self.chunk_size}"
        )
