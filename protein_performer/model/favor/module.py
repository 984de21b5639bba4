"""The FAVOR+ entry points: :func:`favor_attention` (dispatch to the fused paths, the causal
one by :func:`causal_favor`: the torch scan or the Triton kernels) and the core
:class:`FavorAttention` (registered as ``favor``), which owns omega and the FAVOR++ statistic
and runs the parallel or the recurrent form (:mod:`.recurrent`) from one ``forward``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
from torch import Tensor

from protein_performer.errors import UserError
from protein_performer.model.config import KERNELS, default_nb_features
from protein_performer.model.cores.base import AttentionCore, compute_dtype
from protein_performer.model.cores.registry import register
from protein_performer.model.favor import recurrent
from protein_performer.model.favor.bidirectional import _BidiFavor
from protein_performer.model.favor.causal import _CausalFavor
from protein_performer.model.favor.kernels import (
    FeatureMap,
    build_feature_map,
    draw_omega,
    flatten_heads,
    kernel_class,
    oprf_rho,
)
from protein_performer.model.favor.maps import MapFactors, MapStabilizers, favor_attention_map
from protein_performer.model.favor.recurrent import FavorState
from protein_performer.model.favor.reference import favor_attention_reference
from protein_performer.model.favor.tiles import DEFAULT_TILES, causal_tiles

#: Environment variable that picks the causal implementation (:func:`causal_favor`): "auto"
#: (the default), "triton" or "torch".
CAUSAL_IMPL_ENV = "PROTEIN_PERFORMER_CAUSAL_IMPL"


def causal_favor(
    x: Tensor,
    y: Tensor,
    v: Tensor,
    fmap: FeatureMap,
    keep: Tensor | None,
    tiles: Callable[[], tuple[int, int]],
) -> Tensor:
    """Causal FAVOR+ of flattened heads (BH, L, .) -> (BH, L, dv) by the implementation that
    fits (:func:`triton_kernels_for`): the Triton kernels, which choose their own tiles, else
    :class:`_CausalFavor` with ``tiles()`` = (chunk, segment), asked for only then (tuning
    them costs seconds, once; :mod:`.tiles`).
    """
    kernels = triton_kernels_for(x, fmap, v)
    if kernels is not None:
        return kernels.causal_favor_triton(x, y, v, fmap, keep)
    chunk, segment = tiles()
    return _CausalFavor.apply(x, y, v, fmap, keep, chunk, max(chunk, segment))


def triton_kernels_for(x: Tensor, fmap: FeatureMap, v: Tensor) -> ModuleType | None:
    """:mod:`.triton_causal` when it runs these inputs: CUDA tensors it supports, where triton
    imports (CPU: never, and triton is never imported); None for the torch scan.

    ``PROTEIN_PERFORMER_CAUSAL_IMPL`` overrides "auto": "torch" keeps the torch scan on CUDA
    (benchmarks), "triton" takes the kernels for every input they support, CPU tensors
    included (the tests run them under ``TRITON_INTERPRET=1``) and fails if triton is missing.
    """
    impl = os.environ.get(CAUSAL_IMPL_ENV, "").strip().lower() or "auto"
    if impl not in ("auto", "triton", "torch"):
        raise UserError(f"{CAUSAL_IMPL_ENV}={impl!r}: expected 'auto', 'triton' or 'torch'")
    if impl == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            f"{CAUSAL_IMPL_ENV}=triton runs the triton kernels, which need CUDA tensors (this "
            f"run is on {x.device.type}; TRITON_INTERPRET=1 interprets them on a CPU, slowly): "
            f"unset {CAUSAL_IMPL_ENV} or set it to torch"
        )
    if impl == "triton" or (impl == "auto" and x.is_cuda):
        kernels = _triton_kernels(required=impl == "triton")
        if kernels is not None and kernels.supports(fmap, x, v):
            return kernels
    return None


def _triton_kernels(required: bool) -> ModuleType | None:
    """:mod:`.triton_causal`, imported on first use; None when triton is not installed or
    fails to import (warned once; raised when ``required``)."""
    try:
        from protein_performer.model.favor import triton_causal
    except Exception as exc:  # missing or broken: the torch scan still runs, unless required
        if required:
            raise UserError(
                f"{CAUSAL_IMPL_ENV}=triton but triton failed to import ({exc}); install "
                f"triton or set {CAUSAL_IMPL_ENV}=torch"
            ) from None
        if isinstance(exc, ImportError):
            return None
        message = f"triton failed to import ({exc}); causal FAVOR+ runs the torch scan"
        warnings.warn(message, stacklevel=3)
        return None
    return triton_causal


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
    chunk_size: int | None = None,
    block_size: int = 2048,
    relu_eps: float = 1e-3,
    segment_size: int | None = None,
) -> Tensor:
    """FAVOR attention, (B, H, L, d) -> (B, H, L, dv), linear in L in time and memory.

    Causal mode runs the chunked scan of :mod:`.scan` through :class:`_CausalFavor`,
    which computes the features one scan segment at a time; segment_size: tokens (over all
    heads) per scan segment; it bounds the scan's transient memory (about
    segment_size * (4 M + 2 C) floats in backward); both None: tuned for this machine at first
    use (:mod:`.tiles`), one given: the other at its default (128 rows, 8,192 tokens). On
    CUDA the Triton kernels of :mod:`.triton_causal` run instead when triton is installed
    (:func:`causal_favor`; they choose their own chunks and segments). Bidirectional mode runs
    :class:`_BidiFavor` (features recomputed in backward, O(L d + block M) memory). When omega
    or oprf_rho needs gradients, :func:`favor_attention_reference` (quadratic memory) runs
    instead. oprf_rho: the FAVOR++ statistic; computed from the (non-pad) data when None
    (bidirectional only). Features in float32 even under autocast; output in q's dtype.
    """
    kernel_class(kernel)
    kw = dict(kernel=kernel, causal=causal, key_padding_mask=key_padding_mask, relu_eps=relu_eps)
    if omega.requires_grad or (isinstance(oprf_rho, Tensor) and oprf_rho.requires_grad):
        return favor_attention_reference(q, k, v, omega, oprf_rho=oprf_rho, **kw)
    B, H, L, _ = q.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        x, y, vv, keep = flatten_heads(q, k, v, key_padding_mask)
        fmap = build_feature_map(kernel, omega, causal, oprf_rho, x, y, keep, relu_eps)
        if causal:

            def tiles() -> tuple[int, int]:
                chosen = (chunk_size or DEFAULT_TILES[0], segment_size or DEFAULT_TILES[1])
                if chunk_size is not None or segment_size is not None:  # no tuning
                    return int(chosen[0]), int(chosen[1])
                dv = vv.shape[-1]
                probe = partial(_TileProbe, kernel, omega, oprf_rho, relu_eps, x, dv)
                return causal_tiles(x, fmap.width, dv, probe)

            out = causal_favor(x, y, vv, fmap, keep, tiles)
        else:
            out = _BidiFavor.apply(x, y, vv, fmap, keep, block_size, H)
    return out.reshape(B, H, L, -1).to(q.dtype)


class _TileProbe:
    """One representative causal scan (8 heads x 4,096 tokens of the caller's head width,
    features and dtype; with backward when ``grad``), timed by :func:`causal_tiles`
    for each candidate (chunk, segment). Seeded: tuning never touches the global RNG."""

    def __init__(
        self, kernel: str, omega: Tensor, rho, relu_eps: float, like: Tensor, dv: int, grad: bool
    ):
        g = torch.Generator(device=like.device).manual_seed(0)
        self.grad = grad
        kw = dict(generator=g, device=like.device, dtype=like.dtype)
        x, y = (torch.randn(8, 4096, like.shape[-1], **kw) for _ in range(2))
        self.v = torch.randn(8, 4096, dv, **kw).requires_grad_(self.grad)
        self.x, self.y = x.requires_grad_(self.grad), y.requires_grad_(self.grad)
        rho = None if rho is None else torch.as_tensor(rho).detach()
        self.fmap = build_feature_map(kernel, omega.detach(), True, rho, x, y, None, relu_eps)

    def __call__(self, chunk: int, segment: int) -> None:
        rows = max(chunk, segment)
        out = _CausalFavor.apply(self.x, self.y, self.v, self.fmap, None, chunk, rows)
        if self.grad:
            out.sum().backward()


def _in_backward_pass() -> bool:
    """True while autograd's engine runs a backward pass on this thread.

    Why: activation checkpointing (reentrant or not) re-runs the forward *inside* the backward
    pass; a running statistic updated in forward must skip that replay or it counts a step
    twice. torch exposes no public flag for "this is a checkpoint recomputation", but the
    engine's thread-local graph task id is -1 exactly when no backward is running.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class FavorMapBlocks:
    """One bidirectional FAVOR+ head's residue x residue implied map as blocks, for contact maps.

    The map is a product of query and key features (:class:`MapFactors`), so its row and column
    sums (:attr:`sums`) cost O(L M) and any block is recomputed from the features of its rows
    and the head's stabilizers, fixed once from the whole sequence.
    """

    def __init__(
        self, q: Tensor, k: Tensor, L: int, omega: Tensor, kernel: str, relu_eps: float
    ) -> None:
        self.q, self.k, self.L = q, k, L
        self.omega, self.kernel, self.relu_eps = omega, kernel, relu_eps
        f = self._factors()
        self.stabilizers = f.stabilizers
        res = slice(1, L + 1)
        qn, kf = f.queries(res)[0], f.keys(res)[0]  # (L, M)
        self.sums = qn @ kf.sum(0) + kf @ qn.sum(0)  # rows of A + columns of A, (L,)

    def _factors(self, fixed: MapStabilizers | None = None) -> MapFactors:
        return MapFactors.from_heads(
            self.q, self.k, self.omega, kernel=self.kernel, relu_eps=self.relu_eps, fixed=fixed
        )

    def add_upper_block(self, acc: Tensor, a: int, weight: float) -> None:
        """acc += weight * S[a:b, a:], S[a:b, a:] = A[a:b, a:] + A[a:, a:b]^T, acc (b - a, L - a)
        (two fused matmuls into the accumulator: no block-sized temporaries)."""
        f = self._factors(self.stabilizers)
        cols = slice(a + 1, self.L + 1)
        qn, kf = f.queries(cols)[0], f.keys(cols)[0]  # (L - a, M)
        w = acc.shape[0]
        acc.addmm_(qn[:w], kf.T, alpha=weight).addmm_(kf[:w], qn.T, alpha=weight)


@register("favor")
class FavorAttention(AttentionCore):
    """FAVOR attention with its random matrix omega as a persistent buffer (drawn, not learned,
    as is the FAVOR++ statistic: :attr:`drawn`).

    omega is redrawn only by an explicit :meth:`redraw` call (a training hook decides when;
    data-parallel ranks must pass identically seeded generators so all hold the same omega).
    For causal ``softmax_opt`` a running statistic ``oprf_rho`` (EMA of batch statistics,
    updated in training mode after each forward, once per step: the replay of the forward by
    activation checkpointing inside backward is skipped) fixes the feature map, because a
    statistic of the current sequence would leak future tokens; bidirectional mode uses each
    sequence's own. nb_features=None: d ln d rounded up to a multiple of 16
    (:func:`~protein_performer.model.config.default_nb_features`).
    """

    kernels = KERNELS

    drawn = ("omega", "oprf_rho")
    label = "FAVOR+ attention"

    def __init__(
        self,
        dim_head: int,
        nb_features: int | None = None,
        causal: bool = False,
        kernel: str = "softmax",
        *,
        orthogonal: bool = True,
        norm: str = "chi",
        chunk_size: int | None = None,
        block_size: int = 2048,
        relu_eps: float = 1e-3,
        oprf_momentum: float = 0.05,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self._map_class = kernel_class(kernel)
        self.dim_head = dim_head
        self.nb_features = default_nb_features(dim_head) if nb_features is None else nb_features
        self.causal = causal
        self.kernel = kernel
        self.orthogonal = orthogonal
        self.norm = norm
        self.chunk_size = chunk_size  # None: the causal scan's tiles are tuned (.tiles)
        self.block_size = block_size
        self.relu_eps = relu_eps
        self.oprf_momentum = oprf_momentum
        self.register_buffer("omega", self._draw(generator), persistent=True)
        if self._map_class.needs_statistic:
            self.register_buffer("oprf_rho", torch.zeros(()), persistent=True)

    @property
    def softmax(self) -> str:  # type: ignore[override]
        """An estimate of softmax attention, except for kernels that approximate none (ReLU)."""
        return "estimate" if self._map_class.estimates_softmax else "none"

    @classmethod
    def from_config(cls, config) -> FavorAttention:  # noqa: ANN001 - a PerformerConfig
        return cls(
            dim_head=config.head_dim,
            nb_features=config.nb_features,
            causal=config.causal,
            kernel=config.kernel,
            chunk_size=config.favor_chunk_size,
        )

    @classmethod
    def extra_numel(cls, config) -> int:  # noqa: ANN001
        return config.heads * config.nb_features * (config.head_dim + 1)

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
        return self._map_class.feature_dim(self.nb_features)

    @property
    def recurrent_chunk(self) -> int:
        """Tokens per chunk of the recurrent form (and the longest prompt it runs from no state
        rather than the scan): ``chunk_size``, or the default tile when the scan's tiles are
        tuned."""
        return self.chunk_size or DEFAULT_TILES[0]

    def _rho(self) -> Tensor | None:
        return self.oprf_rho if (self._map_class.needs_statistic and self.causal) else None

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        state: FavorState | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        positions: Tensor | int | None = None,
    ) -> tuple[Tensor, FavorState | None]:
        """Padded keys add nothing; ``inplace``: a step may update the state's sum in place
        (:func:`.recurrent.step`). ``positions`` (rotary) are not needed here. The paths with a
        state are inference (RNN mode, causal only, no gradients)."""
        if state is None and not keep_state:
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
            return out, None
        return self._recurrent(q, k, v, key_padding_mask, state, keep_state, inplace)

    @torch.no_grad()
    def _recurrent(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        state: FavorState | None,
        keep_state: bool,
        inplace: bool,
    ) -> tuple[Tensor, FavorState | None]:
        """:meth:`forward` with a state in or out. One token after a state is a step; a prompt
        of more than ``recurrent_chunk`` tokens from no state runs the parallel forward and then
        its keys' state (:func:`.recurrent.prompt_state`: one pass, the scan's speed); anything
        else runs :func:`.recurrent.chunked` (a short prompt from the empty state: a few dozen
        ops, less than the scan's segment machinery costs)."""
        B, H, L, _ = q.shape
        if state is None and self.recurrent_chunk < L:
            out, _ = self.forward(q, k, v, key_padding_mask)
            with torch.autocast(device_type=k.device.type, enabled=False):
                # keys in the queries' place, an empty view in theirs: one copy of k, not two
                y, _, vv, keep = flatten_heads(k, k[..., :0], v, key_padding_mask)  # (BH, L, ·)
                kv, mu = recurrent.prompt_state(self._feature_map(y), y, vv, keep)
            return out, FavorState(kv.reshape(B, H, *kv.shape[1:]), mu.reshape(B, H))
        with torch.autocast(device_type=q.device.type, enabled=False):
            dtype = compute_dtype(q)
            x, y, vv = (t.to(dtype) for t in (q, k, v))  # (B, H, L, d)
            if state is not None and L == 1:
                pad = None if key_padding_mask is None else key_padding_mask.select(1, 0)
                fmap = self.step_map(q.device, dtype)
                x, y, vv = (t.select(2, 0) for t in (x, y, vv))  # (B, H, ·)
                out, new = recurrent.step(fmap, state, x, y, vv, pad, inplace)
                return out.unsqueeze(2).to(q.dtype), (new if keep_state else None)
            if state is None:
                stabilized = self._map_class.stabilized
                state = recurrent.empty_state(H, self.feature_dim, v.shape[-1] + 1, stabilized, x)
            keep = None
            if key_padding_mask is not None:
                keep = (~key_padding_mask.bool())[:, None, :].expand(B, H, L)  # (B, H, L)
            fmap = self._feature_map(x)
            out, new = recurrent.chunked(
                fmap, state, x, y, vv, keep, self.recurrent_chunk, keep_state
            )
        return out.to(q.dtype), new

    @torch.no_grad()
    def _update_rho(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> None:
        x, y, _, keep = flatten_heads(q, k, k[..., :1], key_padding_mask)
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
        rho = self.oprf_rho.to(like) if self._map_class.needs_statistic else None
        return FeatureMap.build(self.kernel, om, rho=rho, relu_eps=self.relu_eps)

    def step_map(self, device: torch.device, dtype: torch.dtype) -> FeatureMap:
        """The feature map of a decoding step (here and in ``model.decode``'s traced step),
        built once per (omega, statistic, device, dtype).

        Why: decoding calls step once per token and layer; rebuilding the map (omega cast,
        projection, FAVOR++ coefficients) each time was a good part of a step's small ops. The
        key holds the buffers' versions, so :meth:`redraw`, ``load_state_dict`` or a moved
        model rebuild it."""
        rho = self.oprf_rho if self._map_class.needs_statistic else None
        versions = tuple((t.data_ptr(), t._version) for t in (self.omega, rho) if t is not None)
        key = (*versions, device, dtype)
        cached = self.__dict__.get("_step_cache")
        if cached is None or cached[0] != key:
            om = self.omega.to(device=device, dtype=dtype)
            r = None if rho is None else rho.to(device=device, dtype=dtype)
            fmap = FeatureMap.build(self.kernel, om, rho=r, relu_eps=self.relu_eps)
            cached = (key, fmap)
            self.__dict__["_step_cache"] = cached
        return cached[1]

    def map_blocks(self, q: Tensor, k: Tensor, L: int, window: int) -> FavorMapBlocks:
        """One head's implied map between the L residues of ``<cls> residues <eos>``, q, k
        (1, 1, L + 2, d), rows normalized over all tokens, as blocks; window (rows per sweep of
        the exact core) is not needed: the row and column sums are products of feature sums."""
        if self.causal:
            raise UserError(
                "contact maps of a causal FAVOR+ model are not supported (its implied attention "
                "is not a product of two feature blocks); use a bidirectional (MLM) model or "
                "exact attention"
            )
        return FavorMapBlocks(q, k, L, self.omega, self.kernel, self.relu_eps)

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, nb_features={self.nb_features}, causal={self.causal}, "
            f"kernel={self.kernel!r}, orthogonal={self.orthogonal}, norm={self.norm!r}, "
            f"chunk_size={self.chunk_size}"
        )
