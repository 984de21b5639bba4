"""FAVOR+ attention: random features, the feature map of each kernel, and the attention paths.

Math: ../shared/FAVOR.md (Choromanski et al., ICLR 2021) and, for ``softmax_opt``, FAVOR++
(Likhosherstov et al., "Chefs' Random Tables", NeurIPS 2022). Read top-down:

1. random matrices (:func:`draw_omega`) and the FAVOR++ statistic (:func:`oprf_rho`);
2. :class:`FeatureMap`: phi of every kernel, with its stabilizers and its gradient, written once;
3. :func:`favor_attention_reference`: phi(Q) phi(K)^T masked and normalized with plain autograd
   (quadratic memory): the spec every fused path is tested against;
4. the fused paths, linear in L in time and memory, each one autograd node that recomputes the
   features in backward: :class:`_BidiFavor` and :class:`_CausalFavor` (the chunked scan of
   :mod:`favor_causal`), dispatched by :func:`favor_attention`;
5. implied attention maps (:func:`favor_attention_map`, :class:`MapFactors`) and the module
   :class:`FavorAttention`, which owns omega and the RNN step.

Conventions: q, k, v are (B, H, L, d) and *unscaled*: the kernel approximates
softmax(q k^T / sqrt(d)); the temperature t = d^-1/4 is folded into the projection (no scaled
copy of q or k is made). ``key_padding_mask`` is (B, L) bool, True = pad; padded keys get zero
features, so they add nothing to the numerator or the normalizer. Features are computed in
float32 (float64 when the inputs are float64), also under bf16/fp16 autocast; the output is cast
back to q's dtype. Feature dimension M: m (= nb_features) for softmax, softmax_opt and relu; 2m
for softmax_hyp and trig (each omega row gives a +/- or sin/cos pair).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.config import KERNELS, default_nb_features
from protein_performer.model.favor_causal import (
    Segment,
    SegmentOperands,
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
    "FeatureMap",
    "MapFactors",
    "MapStabilizers",
    "draw_omega",
    "exact_attention",
    "exact_attention_map",
    "favor_attention",
    "favor_attention_map",
    "favor_attention_reference",
    "oprf_coefficients",
    "oprf_rho",
    "random_features",
]

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

    x, y are scaled by d^-1/4. The mean over all pairs factorizes: E|x|^2 + E|y|^2 + 2 E[x]^T E[y],
    so this is O(L d).
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


# --------------------------------------------------------------------------- the feature map


class FeatureMap:
    """phi(z) of one kernel for unscaled rows z (..., N, d), the temperature t folded in.

    Every kernel's feature is exp(a(z) - s) * b(z), with a stabilizer s that cancels:

    ===========  ==========================================  ==========================  ====
    kernel       log part a(z)                               base b(z)                   M
    ===========  ==========================================  ==========================  ====
    softmax      z Wa^T - t2 |z|^2/2, Wa = t omega           1                           m
    softmax_hyp  same, Wa = t [omega; -omega]                1                           2m
    softmax_opt  z Wa^T + c - t2 |z|^2/2, Wa = t B omega,    1                           m
                 c = A |omega|^2 + log D (per head)
    trig         + t2 |z|^2/2 (one column)                   [sin, cos](z Wa^T)          2m
    relu         none                                        ReLU(z Wa^T) + eps          m
    ===========  ==========================================  ==========================  ====

    with t2 = t^2. Constant factors (1/sqrt(m)) cancel in attention and are left out; only
    :func:`random_features` adds them. Queries also drop every per-row factor (it cancels
    between numerator and normalizer), so a query's exp part is stabilized by its row max. Keys
    are stabilized by what the path allows: a running max over keys <= j (causal: no future
    key enters a past output), or a per-column max over all keys (bidirectional). The gradient
    methods give dz from dphi for features as computed here, treating the stabilizers as the
    constants they are (they cancel exactly). Wa is (M, d), or (BH, M, d) for per-head FAVOR++.
    """

    def __init__(self, kernel: str, Wa: Tensor, bias: Tensor | None, t2: float, eps: float):
        self.kernel, self.Wa, self.bias, self.t2, self.eps = kernel, Wa, bias, t2, eps
        self.exp = kernel in _EXP_KERNELS

    @classmethod
    def build(
        cls,
        kernel: str,
        omega: Tensor,
        *,
        rho: Tensor | None = None,
        relu_eps: float = 1e-3,
        temperature: float | None = None,
    ) -> FeatureMap:
        """The map of ``kernel`` for omega (m, d); t = d^-1/4 unless ``temperature`` is given.

        rho: the FAVOR++ statistic, () or (BH,) (then Wa and the bias are per head).
        """
        _check_kernel(kernel)
        m, d = omega.shape
        t = d**-0.25 if temperature is None else temperature
        if kernel == "softmax_hyp":
            return cls(kernel, torch.cat([omega, -omega]) * t, None, t * t, relu_eps)
        if kernel != "softmax_opt":
            return cls(kernel, omega * t, None, t * t, relu_eps)
        if rho is None:
            raise ValueError("softmax_opt needs the data statistic rho")
        a, b, log_d = (c[..., None, None] for c in oprf_coefficients(rho.to(omega.dtype), d))
        bias = a * omega.pow(2).sum(-1) + log_d  # (..., 1, m)
        return cls(kernel, b * omega * t, bias, t * t, relu_eps)

    @property
    def width(self) -> int:
        """M: the width of phi(z)."""
        return 2 * self.Wa.shape[-2] if self.kernel == "trig" else self.Wa.shape[-2]

    def heads(self, b0: int, b1: int) -> FeatureMap:
        """The map of flattened heads b0:b1 (the same map unless it is per head)."""
        if self.Wa.dim() == 2:
            return self
        bias = None if self.bias is None else self.bias[b0:b1]
        return FeatureMap(self.kernel, self.Wa[b0:b1], bias, self.t2, self.eps)

    def to(self, dtype: torch.dtype) -> FeatureMap:
        bias = None if self.bias is None else self.bias.to(dtype)
        return FeatureMap(self.kernel, self.Wa.to(dtype), bias, self.t2, self.eps)

    def project(self, z: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """z Wa^T (+ bias), (..., N, d) -> (..., N, Wa rows); one matmul when z is 3-d."""
        W = self.Wa.mT
        if W.dim() == 2 and bias is None:  # one GEMM over all rows of all heads
            return torch.matmul(z, W, out=out)
        if z.dim() == 3 and (bias is not None or out is not None):
            BH, N, _ = z.shape
            W = W.expand(BH, *W.shape[-2:])
            if bias is None:
                return torch.bmm(z, W, out=out)
            return torch.baddbmm(bias.expand(BH, N, W.shape[-1]), z, W, out=out)
        t = z @ W
        return t if bias is None else t + bias

    def queries(
        self,
        z: Tensor,
        offset: Tensor | None = None,
        shift: Tensor | None = None,
        rscale: Tensor | None = None,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Query features up to a per-row factor, (..., N, M), and the exp kernels' row shift.

        offset (..., 1, M): per-column log scales moved over from the keys (bidirectional);
        shift (..., N): the row max to subtract (computed unless given: a backward recomputing
        the forward's features); rscale (..., N, 1): a positive per-row factor (the causal
        backward), folded into the exp kernels' shift (one pass less).
        """
        if self.exp:
            bias = self.bias
            if offset is not None:
                bias = offset if bias is None else bias + offset
            t = self.project(z, bias, out)
            if shift is None:
                shift = t.detach().amax(-1)
            if rscale is not None:
                shift = shift - rscale[..., 0].log()
            return t.sub_(shift[..., None]).exp_(), shift
        f = self._base(self.project(z, out=out))
        return f if rscale is None else f.mul_(rscale), shift

    def key_logits(self, z: Tensor, keep: Tensor | None, out: Tensor | None = None) -> KeyLogits:
        """The keys' log part a(z) as per-column logits plus a per-row term; pads get a row
        term of -inf. The columns go into ``out`` when given."""
        cols = self.project(z, self.bias, out) if self.exp else None
        row = None
        if self.kernel != "relu":
            sign = -0.5 if self.exp else 0.5
            row = z.pow(2).sum(-1, keepdim=True).mul_(sign * self.t2)  # (..., N, 1)
            if keep is not None:
                row.masked_fill_(~keep[..., None], float("-inf"))
        return KeyLogits(cols, row)

    def keys(
        self, z: Tensor, logits: KeyLogits, stab: Tensor | None, keep: Tensor | None
    ) -> Tensor:
        """Key features exp(log part - stab) * base (pads 0), consuming ``logits`` (in place).

        stab broadcasts against the log part: (..., N, 1) a running max, (..., 1, 1) a state's
        max, or (..., 1, M|1) a column max (with the logits :func:`column_max` returned).
        """
        cols, row = logits
        if row is None and cols is None:  # relu: bounded, no stabilizer
            f = self._base(self.project(z))
            return f if keep is None else f * keep[..., None]
        if cols is None:  # trig
            return self._base(self.project(z)) * (row - stab).exp_()
        if row is None:  # the row term is already in the columns
            return cols.sub_(stab).exp_()
        return cols.add_(row - stab).exp_()

    def _base(self, proj: Tensor) -> Tensor:
        if self.kernel == "relu":
            return F.relu(proj) + self.eps
        return torch.cat([proj.sin(), proj.cos()], dim=-1)

    def query_grad(
        self,
        z: Tensor,
        f: Tensor,
        df: Tensor,
        rscale: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """dz from dphi for query features f as :meth:`queries` returned them (df consumed);
        rscale: the per-row factor they were computed with (only relu needs to be told)."""
        if rscale is not None and self.kernel == "relu":
            df = df * rscale
        return self._grad(z, f, df, None, out)

    def key_grad(
        self, z: Tensor, f: Tensor, df: Tensor, keep: Tensor | None, out: Tensor | None = None
    ) -> Tensor:
        """dz from dphi for key features f as :meth:`keys` returned them (df consumed).

        The log part's -/+ t2 |z|^2/2 adds -/+ t2 z times the row sum of dphi * phi; for the exp
        kernels that sum rides in the projection's GEMM as one more column of ones.
        """
        if self.exp:
            W1 = torch.cat([self.Wa, self.Wa.new_ones(*self.Wa.shape[:-1], 1)], dim=-1)
            ext = torch.matmul(df.mul_(f), W1)  # (..., N, d+1): [dz | row sum]
            dz = ext[..., :-1]
            dz = dz.addcmul_(ext[..., -1:], z, value=-self.t2)
            return dz if out is None else out.copy_(dz)
        dz = self._grad(z, f, df, keep, out)
        if self.kernel == "trig":
            dz.addcmul_((f * df).sum(-1, keepdim=True), z, value=self.t2)
        return dz

    def _grad(
        self, z: Tensor, f: Tensor, df: Tensor, keep: Tensor | None, out: Tensor | None
    ) -> Tensor:
        """dz through the projection: d loss / d(z Wa^T), then one matmul with Wa.

        exp: dproj = dphi * phi (written into df); trig: d sin = cos, d cos = -sin, read off the
        features themselves (any row factor rides along); relu: dphi where the projection > 0.
        """
        if self.exp:
            dp = df.mul_(f)
        elif self.kernel == "trig":
            m = f.shape[-1] // 2
            dp = df[..., :m] * f[..., m:] - df[..., m:] * f[..., :m]
        else:
            dp = df * (self.project(z) > 0)
            if keep is not None:
                dp = dp * keep[..., None]
        return torch.matmul(dp, self.Wa, out=out)


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


class KeyLogits(NamedTuple):
    """The log part of key features, split so that no (N, M) pass is spent on a per-row term:
    cols (..., N, M) (exp kernels; else None) + row (..., N, 1) (None for relu), pads -inf."""

    cols: Tensor | None
    row: Tensor | None

    def merged(self) -> KeyLogits:
        """The row term added into the columns (in place), for a per-column stabilizer."""
        if self.cols is None or self.row is None:
            return self
        return KeyLogits(self.cols.add_(self.row), None)


def running_max(logits: KeyLogits, mu_in: Tensor | None = None) -> Tensor | None:
    """Causal key stabilizer mu (..., N): the running max over keys <= j of each key's largest
    log part, continued from mu_in (...,) (an earlier part of the sequence); None for relu."""
    cols, row = logits
    if row is None:
        return None
    top = row.detach()[..., 0] if cols is None else cols.detach().amax(-1).add_(row[..., 0])
    mu = top.clamp_min_(_NEG).cummax(dim=-1).values
    return mu if mu_in is None else torch.maximum(mu, mu_in[..., None])


def column_max(logits: KeyLogits) -> tuple[KeyLogits, Tensor | None]:
    """Bidirectional key stabilizer (..., 1, M|1): the max over keys of each column's log part,
    and the logits to use with it (exp kernels: the row term added into the columns in place);
    None for relu."""
    logits = logits.merged()
    full = logits.row if logits.cols is None else logits.cols
    if full is None:
        return logits, None
    return logits, full.detach().amax(-2, keepdim=True).clamp_min(_NEG)


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
    analysis and tests; the attention paths use the stabilized :class:`FeatureMap`.
    """
    r = None if rho is None else torch.as_tensor(rho, dtype=x.dtype, device=x.device)
    fmap = FeatureMap.build(kernel, omega, rho=r, relu_eps=relu_eps, temperature=1.0)
    f = fmap.keys(x, fmap.key_logits(x, None), 0.0, None)
    m = omega.shape[0]
    return f if kernel == "relu" else f / math.sqrt(2 * m if kernel == "softmax_hyp" else m)


# --------------------------------------------------------------------------- inputs


def _flatten(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
    """Upcast and flatten heads: (B, H, L, d) -> (BH, L, d), views when q, k, v are contiguous
    float32; key_padding_mask (B, L) -> keep (BH, L)."""
    B, H, L, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    x, y, vv = (t.to(dtype).reshape(B * H, L, t.shape[-1]) for t in (q, k, v))
    keep = None
    if key_padding_mask is not None:
        keep = (~key_padding_mask.bool())[:, None, :].expand(B, H, L).reshape(B * H, L)
    return x, y, vv, keep


def _feature_map(
    kernel: str,
    omega: Tensor,
    causal: bool,
    rho: Tensor | float | None,
    x: Tensor,
    y: Tensor,
    keep: Tensor | None,
    relu_eps: float,
) -> FeatureMap:
    """The map for flattened unscaled x, y (BH, L, d); the FAVOR++ statistic per head comes from
    the data (bidirectional) or is given (causal: a statistic of the sequence would leak)."""
    _check_kernel(kernel)
    om = omega.to(device=x.device, dtype=x.dtype)
    r = None
    if kernel == "softmax_opt":
        if rho is None:
            if causal:
                raise ValueError(
                    "causal softmax_opt needs a fixed oprf_rho: a statistic of the whole sequence "
                    "would leak future tokens into past outputs"
                )
            t = x.shape[-1] ** -0.25
            r = oprf_rho(x.detach() * t, y.detach() * t, keep, keep)  # (BH,)
        else:
            r = torch.as_tensor(rho, dtype=x.dtype, device=x.device).expand(x.shape[0])
    return FeatureMap.build(kernel, om, rho=r, relu_eps=relu_eps)


# --------------------------------------------------------------------------- the reference


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
        x, y, vv, keep = _flatten(q, k, v, key_padding_mask)
        fmap = _feature_map(kernel, omega, causal, oprf_rho, x, y, keep, relu_eps)
        logits, col = column_max(fmap.key_logits(y, keep))
        kf = fmap.keys(y, logits, col, keep)  # (BH, L, M)
        qf, _ = fmap.queries(x, offset=col if fmap.exp else None)  # (BH, L, M)
        a = qf @ kf.mT  # (BH, L, L)
        if causal:
            a = a.tril()
        out = (a @ vv) / safe_denominator(a.sum(-1, keepdim=True))
    return out.reshape(B, H, L, -1).to(q.dtype)


# --------------------------------------------------------------------------- bidirectional


@functools.lru_cache(maxsize=1)
def _l2_bytes() -> int:
    """This CPU's per-core L2 cache size (Linux sysfs), 1 MiB where it cannot be read."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()
                return int(size.rstrip("KM")) << (20 if size.endswith("M") else 10)
        except (OSError, ValueError):
            continue
    return 1 << 20


def _tile(BH: int, L: int, M: int, block: int, like: Tensor) -> tuple[int, int]:
    """(heads per tile, rows per block) for the bidirectional path.

    Why: each block makes several elementwise passes over its (heads, rows, M) features (row
    term, max, shift, exp); sized to the L2 caches of the threads that share the work, they run
    from cache instead of memory (the attention of an ESM-2 8M-shaped protein batch: 157 -> 79 ms,
    docs/RESULTS.md). On GPU all heads go at once. ``block`` stays an upper bound on the rows.
    """
    if like.device.type != "cpu":
        return BH, block
    cache = _l2_bytes() * torch.get_num_threads()
    rows = max(64, cache // (2 * M * like.element_size()))
    block = min(block, rows)
    return max(1, rows // min(L, block)), block


class _BidiFavor(torch.autograd.Function):
    """Bidirectional FAVOR as one autograd node, O(L d + block M) memory.

    Forward, per tile of heads (:func:`_tile`): keys in blocks give S = phi(K)^T [V | 1]
    (M, dv+1), stabilized by the running per-column key max ``col`` (the state is rescaled when
    it grows); queries in blocks give out = phi(Q) S_v / (phi(Q) S_1), with the column offsets
    moved to the query logits (exp kernels) and a per-row max subtracted. Both stabilizers
    cancel exactly in the output, so the backward treats them as constants. Saved: q, k, v, col,
    S, out and the normalizer; the backward recomputes the features block by block (queries
    first, accumulating dS, then keys).
    """

    @staticmethod
    def forward(ctx, q, k, v, fmap: FeatureMap, keep, block: int):
        BH, L, _ = q.shape
        dv = v.shape[-1]
        hb, block = _tile(BH, L, fmap.width, block, q)
        S = q.new_empty(BH, fmap.width, dv + 1)  # [phi(K)^T V | phi(K)^T 1] per head
        out, den, shifts = q.new_empty(BH, L, dv), q.new_empty(BH, L, 1), q.new_zeros(BH, L)
        cols = []
        for b0 in range(0, BH, hb):
            h, fm = slice(b0, b0 + hb), fmap.heads(b0, b0 + hb)
            kp = None if keep is None else keep[h]
            col = _bidi_state(k[h], v[h], fm, kp, block, S[h])
            cols.append(col)
            offset = col if fm.exp else None
            for s in range(0, L, block):
                r = slice(s, s + block)
                qf, shift = fm.queries(q[h, r], offset)
                yq = qf @ S[h]  # (hb, l, dv+1)
                den[h, r] = safe_denominator(yq[..., dv:])
                if shift is not None:
                    shifts[h, r] = shift
                torch.div(yq[..., :dv], den[h, r], out=out[h, r])
        col = None if cols[0] is None else torch.cat(cols)  # (BH, 1, M|1)
        ctx.tile, ctx.fmap = (hb, block), fmap
        ctx.save_for_backward(q, k, v, keep, col, S, out, den, shifts)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, col, S, out, den, shifts = ctx.saved_tensors
        (hb, block), fmap = ctx.tile, ctx.fmap
        BH, L, _ = q.shape
        dv = v.shape[-1]
        tiny = torch.finfo(torch.float32).tiny
        dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for b0 in range(0, BH, hb):
            h, fm = slice(b0, b0 + hb), fmap.heads(b0, b0 + hb)
            col_h = None if col is None else col[h]
            offset = col_h if fm.exp else None
            dS = torch.zeros_like(S[h])  # (hb, M, dv+1)
            for s in range(0, L, block):
                r = slice(s, s + block)
                g, db = grad_out[h, r], den[h, r]
                # out = num / den: dnum = g / den, dden = -(g . out) / den; rows without real
                # keys (den clamped) have S = 0 and get no gradient.
                dy = torch.cat([g, -(g * out[h, r]).sum(-1, keepdim=True)], dim=-1).div_(db)
                dy.masked_fill_(db == tiny, 0.0)
                qf, _ = fm.queries(q[h, r], offset, shifts[h, r] if fm.exp else None)
                dS.baddbmm_(qf.mT, dy)
                dq[h, r] = fm.query_grad(q[h, r], qf, torch.bmm(dy, S[h].mT))
            dSv, dS1 = dS[..., :dv], dS[..., dv:].mT  # (hb, M, dv), (hb, 1, M)
            for s in range(0, L, block):
                r = slice(s, s + block)
                kb = None if keep is None else keep[h, r]
                y = k[h, r]
                kf = fm.keys(y, fm.key_logits(y, kb).merged(), col_h, kb)
                dvv[h, r] = torch.bmm(kf, dSv)
                dkf = torch.baddbmm(dS1.expand(*y.shape[:2], -1), v[h, r], dSv.mT)
                dk[h, r] = fm.key_grad(y, kf, dkf, kb)
        return dq, dk, dvv, None, None, None


def _bidi_state(
    k: Tensor, v: Tensor, fmap: FeatureMap, keep: Tensor | None, block: int, S: Tensor
) -> Tensor | None:
    """S = phi(K)^T [V | 1] into ``S`` (h, M, dv+1), keys in blocks; returns the key
    stabilizer col (h, 1, M|1) the features are relative to (None for relu)."""
    L, dv = k.shape[1], v.shape[-1]
    Sv, s1 = S.new_zeros(S.shape[0], S.shape[1], dv), S.new_zeros(S.shape[0], S.shape[1], 1)
    col = None
    for s in range(0, L, block):
        kb = None if keep is None else keep[:, s : s + block]
        y = k[:, s : s + block]
        logits, bmax = column_max(fmap.key_logits(y, kb))
        if col is not None and bmax is not None:
            new = torch.maximum(col, bmax)
            r = torch.exp(col - new).mT  # rescales the state's rows, (h, M|1, 1)
            Sv.mul_(r)
            s1.mul_(r)
            col = new
        elif bmax is not None:
            col = bmax
        kf = fmap.keys(y, logits, col, kb)  # (h, l, M)
        Sv.baddbmm_(kf.mT, v[:, s : s + block])
        s1.add_(kf.sum(-2)[..., None])
    torch.cat([Sv, s1], dim=-1, out=S)
    return col


# --------------------------------------------------------------------------- causal


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


# --------------------------------------------------------------------------- dispatch


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
) -> Tensor:
    """FAVOR attention, (B, H, L, d) -> (B, H, L, dv), linear in L in time and memory.

    Causal mode runs the chunked scan of :mod:`favor_causal` through :class:`_CausalFavor`,
    which computes the features one scan segment at a time; segment_size: tokens (over all
    heads) per scan segment; it bounds the scan's transient memory (about
    segment_size * (4 M + 2 C) floats in backward). Bidirectional mode runs
    :class:`_BidiFavor` (features recomputed in backward, O(L d + block M) memory). When omega
    or oprf_rho needs gradients, :func:`favor_attention_reference` (quadratic memory) runs
    instead. oprf_rho: the FAVOR++ statistic; computed from the (non-pad) data when None
    (bidirectional only). Features in float32 even under autocast; output in q's dtype.
    """
    _check_kernel(kernel)
    kw = dict(kernel=kernel, causal=causal, key_padding_mask=key_padding_mask, relu_eps=relu_eps)
    if omega.requires_grad or (isinstance(oprf_rho, Tensor) and oprf_rho.requires_grad):
        return favor_attention_reference(q, k, v, omega, oprf_rho=oprf_rho, **kw)
    B, H, L, _ = q.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        x, y, vv, keep = _flatten(q, k, v, key_padding_mask)
        fmap = _feature_map(kernel, omega, causal, oprf_rho, x, y, keep, relu_eps)
        if causal:
            rows = max(int(chunk_size), int(segment_size))
            out = _CausalFavor.apply(x, y, vv, fmap, keep, int(chunk_size), rows)
        else:
            out = _BidiFavor.apply(x, y, vv, fmap, keep, block_size)
    return out.reshape(B, H, L, -1).to(q.dtype)


# --------------------------------------------------------------------------- implied maps


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
    with torch.autocast(device_type=q.device.type, enabled=False):
        if causal:
            x, y, _, keep = _flatten(q, k, k[..., :1], key_padding_mask)
            fmap = _feature_map(kernel, omega, True, oprf_rho, x, y, keep, relu_eps)
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
        x, y, _, keep = _flatten(q, k, k[..., :1], key_padding_mask)
        if fixed is None:
            fmap = _feature_map(kernel, omega, False, None, x, y, keep, relu_eps)
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


# --------------------------------------------------------------------------- exact attention


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
    sequence's own. nb_features=None: d ln d rounded up to a multiple of 16
    (:func:`~protein_performer.model.config.default_nb_features`).
    """

    def __init__(
        self,
        dim_head: int,
        nb_features: int | None = None,
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
        self.nb_features = default_nb_features(dim_head) if nb_features is None else nb_features
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
        x, y, _, keep = _flatten(q, k, k[..., :1], key_padding_mask)
        t = q.shape[-1] ** -0.25
        batch_rho = oprf_rho(x * t, y * t, keep, keep).mean().to(self.oprf_rho)
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

    def _feature_map(self, like: Tensor) -> FeatureMap:
        om = self.omega.to(device=like.device, dtype=like.dtype)
        rho = self.oprf_rho.to(like) if self.kernel == "softmax_opt" else None
        return FeatureMap.build(self.kernel, om, rho=rho, relu_eps=self.relu_eps)

    def _absorb(
        self, state: FavorState | None, y: Tensor, vv: Tensor, keep: Tensor | None, B: int
    ) -> FavorState:
        """Add unscaled keys y (BH, L, d) with values vv (BH, L, dv) to the running state.

        The stabilizer mu becomes the max of the old one and the new keys' largest log-feature,
        and the old sum is rescaled to it: for L = 1 this is the RNN step, for a whole prompt
        it is the state the step-by-step recursion would reach (a max is order-free).
        """
        fmap = self._feature_map(y)
        logits = fmap.key_logits(y, keep)
        mu = running_max(logits)
        mu = y.new_zeros(y.shape[0]) if mu is None else mu[:, -1]  # (BH,)
        if state is not None:
            mu = torch.maximum(state.mu.reshape(-1).to(y), mu)
        kf = fmap.keys(y, logits, mu[:, None, None], keep)  # (BH, L, M)
        vx = torch.cat([vv, vv.new_ones(*vv.shape[:-1], 1)], dim=-1)  # (BH, L, dv+1)
        kv = kf.mT @ vx  # (BH, M, dv+1)
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
            _, y, vv, keep = _flatten(k, k, v, key_padding_mask)  # (BH, L, ·)
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
        B, H = q_t.shape[:2]
        with torch.autocast(device_type=q_t.device.type, enabled=False):
            pad = None if key_padding_mask is None else key_padding_mask.reshape(B, 1)
            x, y, vv, keep = _flatten(q_t[:, :, None], k_t[:, :, None], v_t[:, :, None], pad)
            new_state = self._absorb(state, y, vv, keep, B)  # x, y, vv: (BH, 1, d)
            qf, _ = self._feature_map(x).queries(x)  # (BH, 1, M)
            kv = new_state.kv.reshape(B * H, *new_state.kv.shape[2:])  # (BH, M, dv+1)
            yq = (qf @ kv)[:, 0]  # (BH, dv+1)
            out = yq[:, :-1] / safe_denominator(yq[:, -1:])
        return new_state, out.reshape(B, H, -1).to(q_t.dtype)

    def _check_causal(self) -> None:
        if not self.causal:
            raise RuntimeError("RNN mode (step, initial_state) needs causal=True")

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, nb_features={self.nb_features}, causal={self.causal}, "
            f"kernel={self.kernel!r}, orthogonal={self.orthogonal}, norm={self.norm!r}, "
            f"chunk_size={self.chunk_size}"
        )
