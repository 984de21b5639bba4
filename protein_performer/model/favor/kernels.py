"""The kernels' feature maps: random matrices, the FAVOR++ statistic, and phi with its
stabilizers and gradients, written once for every path (reference, fused, maps, RNN step): one
small class per kernel, registered by name, so no path asks which kernel it holds."""

from __future__ import annotations

import abc
import math
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from protein_performer.model.cores.base import compute_dtype

_NEG = -1e30  # finite stand-in for -inf in stabilizers, so that (-inf) - (-inf) never appears
LOG2E = 1.4426950408889634  # log2(e): exp(z) = exp2(z log2 e); torch's CPU exp2 is ~3x its exp


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


# --------------------------------------------------------------------------- the feature maps

#: kernel name -> its feature-map class; a subclass declared with ``name=`` registers itself.
FEATURE_MAPS: dict[str, type[FeatureMap]] = {}


class FeatureMap(abc.ABC):
    """phi(z) of one kernel for unscaled rows z (..., N, d), the temperature t folded in.

    Every kernel's feature is exp(a(z) - s) * b(z): a log part a, a base b and a stabilizer s
    that cancels; one subclass per kernel, registered by name (:data:`FEATURE_MAPS`), owns its
    projection Wa = t omega' (M' rows, (BH, M', d) when per head), log part, base and
    gradients. Constant factors (1/sqrt(m)) cancel in attention and are left out; only
    :meth:`unbiased` adds them. Queries also drop every per-row factor (it cancels between
    numerator and normalizer). Keys are stabilized by what the path allows: a running max over
    keys <= j (causal: no future key enters a past output), or a per-column max over all keys
    (bidirectional). The gradient methods give dz from dphi for features as computed here,
    treating the stabilizers as the constants they are (they cancel exactly). t2 = t^2.
    """

    name: ClassVar[str]
    #: Features are exp(logits - shift) alone (b = 1): queries take a row shift and per-column
    #: offsets, and the paths may compute the logits in place in a buffer of M columns.
    exp: ClassVar[bool] = False
    #: The map depends on the FAVOR++ data statistic rho (:func:`oprf_rho`).
    needs_statistic: ClassVar[bool] = False
    #: phi(x)^T phi(y) estimates the softmax kernel exp(x^T y) (not a generalized attention).
    estimates_softmax: ClassVar[bool] = True
    #: Keys carry a stabilizer (a log part): False where :func:`running_max` gives None.
    stabilized: ClassVar[bool] = True

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            FEATURE_MAPS[name] = cls

    def __init__(self, Wa: Tensor, bias: Tensor | None, t2: float, eps: float) -> None:
        self.Wa, self.bias, self.t2, self.eps = Wa, bias, t2, eps

    @staticmethod
    def build(
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
        cls = kernel_class(kernel)
        t = omega.shape[1] ** -0.25 if temperature is None else temperature
        Wa, bias = cls.projection(omega, t, rho)
        return cls(Wa, bias, t * t, relu_eps)

    @classmethod
    def projection(
        cls, omega: Tensor, t: float, rho: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """(Wa, bias of the log part) for omega (m, d) at temperature t."""
        return omega * t, None

    @classmethod
    def feature_dim(cls, nb_features: int) -> int:
        """M for m = nb_features omega rows, known before any map is built."""
        return nb_features

    @property
    def width(self) -> int:
        """M: the width of phi(z)."""
        return self.Wa.shape[-2]

    def heads(self, b0: int, b1: int) -> FeatureMap:
        """The map of flattened heads b0:b1 (the same map unless it is per head)."""
        if self.Wa.dim() == 2:
            return self
        bias = None if self.bias is None else self.bias[b0:b1]
        return type(self)(self.Wa[b0:b1], bias, self.t2, self.eps)

    def to(self, dtype: torch.dtype) -> FeatureMap:
        bias = None if self.bias is None else self.bias.to(dtype)
        return type(self)(self.Wa.to(dtype), bias, self.t2, self.eps)

    def unbiased(self, f: Tensor) -> Tensor:
        """Features f times the constant that makes phi(x)^T phi(y) an unbiased estimate of
        the kernel, 1/sqrt(rows of Wa) (attention cancels it: only :func:`random_features`)."""
        return f / math.sqrt(self.Wa.shape[-2])

    def project(self, z: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """z Wa^T (+ bias), (..., N, d) -> (..., N, Wa rows); one matmul when z is 3-d."""
        return self._project(z, self.Wa, bias, out)

    @staticmethod
    def _project(z: Tensor, Wa: Tensor, bias: Tensor | None, out: Tensor | None) -> Tensor:
        """z Wa^T (+ bias) for a given Wa (the map's own, or scaled)."""
        W = Wa.mT
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

    def _row_term(self, z: Tensor, keep: Tensor | None, sign: float) -> Tensor:
        """sign * t2 |z|^2, (..., N, 1); pads -inf."""
        row = z.pow(2).sum(-1, keepdim=True).mul_(sign * self.t2)
        if keep is not None:
            row.masked_fill_(~keep[..., None], float("-inf"))
        return row

    @abc.abstractmethod
    def queries(
        self,
        z: Tensor,
        offset: Tensor | None = None,
        shift: Tensor | None = None,
        rscale: Tensor | None = None,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Query features up to a per-row factor, (..., N, M), and the exp kernels' row shift
        (in the map's own units, base 2 for them: only this method makes and reads it).

        offset (..., 1, M): per-column log scales moved over from the keys (bidirectional);
        shift (..., N): the row max to subtract (computed unless given: a backward recomputing
        the forward's features); rscale (..., N, 1): a positive per-row factor (the causal
        backward), folded into the exp kernels' shift (one pass less).
        """

    @abc.abstractmethod
    def key_logits(self, z: Tensor, keep: Tensor | None, out: Tensor | None = None) -> KeyLogits:
        """The keys' log part a(z) as per-column logits plus a per-row term; pads get a row
        term of -inf. The columns go into ``out`` when given."""

    @abc.abstractmethod
    def keys(
        self, z: Tensor, logits: KeyLogits, stab: Tensor | None, keep: Tensor | None
    ) -> Tensor:
        """Key features exp(log part - stab) * base (pads 0), consuming ``logits`` (in place).

        stab broadcasts against the log part: (..., N, 1) a running max, (..., 1, 1) a state's
        max, or (..., 1, M|1) a column max (with the logits :func:`column_max` returned).
        """

    @abc.abstractmethod
    def query_grad(
        self,
        z: Tensor,
        f: Tensor,
        df: Tensor,
        rscale: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """dz from dphi for query features f as :meth:`queries` returned them (df consumed);
        rscale: the per-row factor they were computed with (only a kernel whose features do not
        carry it themselves needs to be told)."""

    @abc.abstractmethod
    def key_grad(
        self, z: Tensor, f: Tensor, df: Tensor, keep: Tensor | None, out: Tensor | None = None
    ) -> Tensor:
        """dz from dphi for key features f as :meth:`keys` returned them (df consumed)."""


class ExpFeatureMap(FeatureMap):
    """The exp family: a(z) = z Wa^T + bias - t2 |z|^2/2, b = 1 (positive random features).

    A query's features are stabilized by their row max (it cancels); for keys the per-row term
    rides with the columns, and its gradient -t2 z times the row sum of dphi * phi rides in the
    projection's GEMM as one more column of ones.
    """

    exp = True

    def queries(self, z, offset=None, shift=None, rscale=None, out=None):
        # Base 2 throughout (the shift is the map's own: only queries() makes and reads it), so
        # the features cost one exp2 pass: exp(a - s) = exp2(a log2 e - s').
        bias = self.bias
        if offset is not None:
            bias = offset if bias is None else bias + offset
        t = self._project(z, self.wa2, None if bias is None else bias * LOG2E, out)
        if shift is None:
            shift = t.detach().amax(-1)
        if rscale is not None:
            shift = shift - rscale[..., 0].log2()
        return t.sub_(shift[..., None]).exp2_(), shift

    @property
    def wa2(self) -> Tensor:
        """Wa log2 e: the query projection in base 2 (computed once per map)."""
        w = self.__dict__.get("_Wa2")
        if w is None:
            w = self.__dict__["_Wa2"] = self.Wa * LOG2E
        return w

    def key_logits(self, z, keep, out=None):
        return KeyLogits(self.project(z, self.bias, out), self._row_term(z, keep, -0.5))

    def fused_inputs(self, x: Tensor, y: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """The inputs of :meth:`keys_t` and :meth:`queries_t` for queries x and keys y
        (..., N, d), made once for all heads: [x | 1] and [y | |y|^2 | 1 (with a bias)],
        a pad's |y|^2 +inf (so its logits are -inf and its features 0)."""
        ones = x.new_ones(*x.shape[:-1], 1)
        sq = y.pow(2).sum(-1, keepdim=True)
        if keep is not None:
            sq.masked_fill_(~keep[..., None], float("inf"))
        ya = torch.cat([y, sq] if self.bias is None else [y, sq, ones], -1)
        return torch.cat([x, ones], -1), ya

    def keys_t(self, ya: Tensor) -> tuple[Tensor, Tensor]:
        """All keys of a sequence at once, transposed: features (..., M, N) and the column
        stabilizer col (..., 1, M) they are relative to, the values :func:`column_max` and
        :meth:`keys` give to rounding; ya from :meth:`fused_inputs`. Why: at the lengths of
        most proteins one block holds every key, and then the log part is one GEMM in base 2
        (the row term and the bias ride in it as extra input columns), the max one pass over
        contiguous rows, the features one subtract and one exp2. A head with no real key gets
        col 0 (its features are 0 whatever col is)."""
        W = self.__dict__.get("_Wk2")
        if W is None:  # (..., M, d + 1|2): [Wa | -t2/2 | bias] log2 e
            rows = [self.Wa, self.Wa.new_full((*self.Wa.shape[:-1], 1), -0.5 * self.t2)]
            rows += [] if self.bias is None else [self.bias.mT]
            W = self.__dict__["_Wk2"] = torch.cat(rows, -1).mul_(LOG2E)
        t = torch.matmul(W, ya.mT)  # (..., M, N)
        col = t.amax(-1, keepdim=True)  # (..., M, 1), base 2
        col.masked_fill_(col == float("-inf"), 0.0)
        return t.sub_(col).exp2_(), col.mT.mul(1 / LOG2E)

    def queries_t(self, xa: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
        """Query features transposed, (..., M, N), and their row shift (..., N), with the keys'
        column stabilizer col (..., 1, M) moved over: the values :meth:`queries` gives with
        ``offset=col`` (and takes back as ``shift``), from one GEMM ([x | 1] of
        :meth:`fused_inputs` against the base 2 weights and offsets), one max over contiguous
        columns, one subtract, one exp2."""
        offset = col if self.bias is None else self.bias + col
        W = torch.cat([self.wa2.expand(*col.shape[:-2], -1, -1), offset.mT * LOG2E], -1)
        t = torch.matmul(W, xa.mT)  # (..., M, N)
        shift = t.amax(-2, keepdim=True)  # (..., 1, N)
        return t.sub_(shift).exp2_(), shift[..., 0, :]

    def keys(self, z, logits, stab, keep):
        cols, row = logits
        shift = stab if row is None else stab - row  # the row term rides with the stabilizer
        return exp_shifted_(cols, shift)

    def query_grad(self, z, f, df, rscale=None, out=None):
        return torch.matmul(df.mul_(f), self.Wa, out=out)  # dproj = dphi * phi

    def key_grad(self, z, f, df, keep, out=None):
        W1 = torch.cat([self.Wa, self.Wa.new_ones(*self.Wa.shape[:-1], 1)], dim=-1)
        ext = torch.matmul(df.mul_(f), W1)  # (..., N, d+1): [dz | row sum]
        dz = ext[..., :-1]
        dz = dz.addcmul_(ext[..., -1:], z, value=-self.t2)
        return dz if out is None else out.copy_(dz)


class Softmax(ExpFeatureMap, name="softmax"):
    """Positive random features (FAVOR+, Lemma 1): Wa = t omega, M = m."""


class SoftmaxHyp(ExpFeatureMap, name="softmax_hyp"):
    """Hyperbolic positive features: Wa = t [omega; -omega], M = 2m (lower variance)."""

    @classmethod
    def projection(cls, omega, t, rho):
        return torch.cat([omega, -omega]) * t, None

    @classmethod
    def feature_dim(cls, nb_features):
        return 2 * nb_features


class SoftmaxOpt(ExpFeatureMap, name="softmax_opt"):
    """Optimal positive features (FAVOR++) for statistic rho: Wa = t B omega and a per-head
    bias c = A |omega|^2 + log D (:func:`oprf_coefficients`), M = m."""

    needs_statistic = True

    @classmethod
    def projection(cls, omega, t, rho):
        if rho is None:
            raise ValueError(f"{cls.name} needs the data statistic rho")
        coefficients = oprf_coefficients(rho.to(omega.dtype), omega.shape[1])
        a, b, log_d = (c[..., None, None] for c in coefficients)
        bias = a * omega.pow(2).sum(-1) + log_d  # (..., 1, m)
        return b * omega * t, bias


class ElementwiseFeatureMap(FeatureMap):
    """Features b(z Wa^T), b elementwise, times a per-row factor (trig, relu). A query's
    features are b(z Wa^T) alone: the row factor cancels and there is no exp part to shift."""

    @abc.abstractmethod
    def _base(self, proj: Tensor) -> Tensor:
        """b(z Wa^T), (..., N, Wa rows) -> (..., N, M)."""

    @abc.abstractmethod
    def _dproj(self, z: Tensor, f: Tensor, df: Tensor, keep: Tensor | None) -> Tensor:
        """d loss / d(z Wa^T) from dphi, for features f."""

    def queries(self, z, offset=None, shift=None, rscale=None, out=None):
        f = self._base(self.project(z, out=out))
        return f if rscale is None else f.mul_(rscale), shift

    def query_grad(self, z, f, df, rscale=None, out=None):
        return self._grad(z, f, df, None, out)

    def _grad(
        self, z: Tensor, f: Tensor, df: Tensor, keep: Tensor | None, out: Tensor | None
    ) -> Tensor:
        """dz through the projection: d loss / d(z Wa^T), then one matmul with Wa."""
        return torch.matmul(self._dproj(z, f, df, keep), self.Wa, out=out)


class Trig(ElementwiseFeatureMap, name="trig"):
    """Trigonometric features: b = [sin, cos](z Wa^T), a(z) = + t2 |z|^2/2 (one column),
    M = 2m; unbiased, but with unbounded relative error where the kernel is small."""

    @classmethod
    def feature_dim(cls, nb_features):
        return 2 * nb_features

    @property
    def width(self):
        return 2 * self.Wa.shape[-2]

    def _base(self, proj):
        return torch.cat([proj.sin(), proj.cos()], dim=-1)

    def _dproj(self, z, f, df, keep):
        # d sin = cos, d cos = -sin, read off the features (any row factor rides along)
        m = f.shape[-1] // 2
        return df[..., :m] * f[..., m:] - df[..., m:] * f[..., :m]

    def key_logits(self, z, keep, out=None):
        return KeyLogits(None, self._row_term(z, keep, 0.5))

    def keys(self, z, logits, stab, keep):
        return self._base(self.project(z)) * (logits.row - stab).exp_()

    def key_grad(self, z, f, df, keep, out=None):
        dz = self._grad(z, f, df, keep, out)
        return dz.addcmul_((f * df).sum(-1, keepdim=True), z, value=self.t2)


class Relu(ElementwiseFeatureMap, name="relu"):
    """Generalized attention (Performer-ReLU): b = ReLU(z Wa^T) + eps, no log part, M = m.
    Without an exp part it needs no stabilizer; it estimates no softmax, so it takes no
    unbiasing constant either."""

    estimates_softmax = False
    stabilized = False

    def _base(self, proj):
        return F.relu(proj) + self.eps

    def _dproj(self, z, f, df, keep):
        dp = df * (self.project(z) > 0)
        return dp if keep is None else dp * keep[..., None]

    def unbiased(self, f):
        return f

    def key_logits(self, z, keep, out=None):
        return KeyLogits(None, None)

    def keys(self, z, logits, stab, keep):
        f = self._base(self.project(z))
        return f if keep is None else f * keep[..., None]

    def query_grad(self, z, f, df, rscale=None, out=None):
        # no per-row factor rides in these features: the causal backward's rscale enters here
        return self._grad(z, f, df if rscale is None else df * rscale, None, out)

    def key_grad(self, z, f, df, keep, out=None):
        return self._grad(z, f, df, keep, out)


#: The registered kernels' names.
KERNELS = tuple(FEATURE_MAPS)


def kernel_class(kernel: str) -> type[FeatureMap]:
    """The feature-map class registered as ``kernel``; ValueError naming the registered ones."""
    if kernel not in FEATURE_MAPS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {tuple(FEATURE_MAPS)}")
    return FEATURE_MAPS[kernel]


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


def exp_shifted_(t: Tensor, shift: Tensor | float) -> Tensor:
    """exp(t - shift) in place, shift broadcast against t: one multiply-add pass and one exp2
    (torch's exp2 runs about 3x faster than its exp on CPU; the rounding is the same order)."""
    if isinstance(shift, Tensor) and not (torch.is_grad_enabled() and t.requires_grad):
        return torch.add(shift * -LOG2E, t, alpha=LOG2E, out=t).exp2_()
    return t.mul_(LOG2E).sub_(shift * LOG2E).exp2_()  # autograd (the reference): in place


def running_max(logits: KeyLogits, mu_in: Tensor | None = None) -> Tensor | None:
    """Causal key stabilizer mu (..., N): the running max over keys <= j of each key's largest
    log part, continued from mu_in (...,) (an earlier part of the sequence); None for relu."""
    cols, row = logits
    if row is None:
        return None
    top = row.detach()[..., 0] if cols is None else cols.detach().amax(-1).add_(row[..., 0])
    mu = top.clamp_min(_NEG).cummax(dim=-1).values  # not in place: top may be a view of row
    return mu if mu_in is None else torch.maximum(mu, mu_in[..., None])


def step_max(logits: KeyLogits) -> Tensor | None:
    """One key per row: its largest log part (...,) (pads -inf), the RNN step's stabilizer
    candidate; None for relu. :func:`running_max` over a single key, without the scan."""
    cols, row = logits
    if row is None:
        return None
    return row[..., 0].clone() if cols is None else cols.amax(-1).add_(row[..., 0])


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
    return fmap.unbiased(fmap.keys(x, fmap.key_logits(x, None), 0.0, None))


# --------------------------------------------------------------------------- inputs


def flatten_heads(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
    """Upcast and flatten heads: (B, H, L, d) -> (BH, L, d), views when q, k, v are contiguous
    float32; key_padding_mask (B, L) -> keep (BH, L)."""
    B, H, L, _ = q.shape
    dtype = compute_dtype(q)
    x, y, vv = (t.to(dtype).reshape(B * H, L, t.shape[-1]) for t in (q, k, v))
    keep = None
    if key_padding_mask is not None:
        keep = (~key_padding_mask.bool())[:, None, :].expand(B, H, L).reshape(B * H, L)
    return x, y, vv, keep


def build_feature_map(
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
    needs_statistic = kernel_class(kernel).needs_statistic
    om = omega.to(device=x.device, dtype=x.dtype)
    r = None
    if needs_statistic:
        if rho is None:
            if causal:
                raise ValueError(
                    f"causal {kernel} needs a fixed oprf_rho: a statistic of the whole sequence "
                    "would leak future tokens into past outputs"
                )
            t = x.shape[-1] ** -0.25
            r = oprf_rho(x.detach() * t, y.detach() * t, keep, keep)  # (BH,)
        else:
            r = torch.as_tensor(rho, dtype=x.dtype, device=x.device).expand(x.shape[0])
    return FeatureMap.build(kernel, om, rho=r, relu_eps=relu_eps)
