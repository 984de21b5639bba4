"""The FAVOR+ entry points: :func:`favor_attention` (dispatch to the fused paths) and the
module :class:`FavorAttention`, which owns omega, the FAVOR++ statistic and the RNN step."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.errors import UserError
from protein_performer.model.config import default_nb_features
from protein_performer.model.favor.bidirectional import _BidiFavor
from protein_performer.model.favor.causal import _CausalFavor, causal_favor
from protein_performer.model.favor.kernels import (
    _NEG,
    FeatureMap,
    build_feature_map,
    draw_omega,
    flatten_heads,
    kernel_class,
    oprf_rho,
    running_max,
    step_max,
)
from protein_performer.model.favor.maps import MapFactors, MapStabilizers, favor_attention_map
from protein_performer.model.favor.reference import favor_attention_reference
from protein_performer.model.favor.scan import safe_denominator
from protein_performer.model.favor.tiles import DEFAULT_TILES, causal_tiles


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
            out = _BidiFavor.apply(x, y, vv, fmap, keep, block_size)
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


class FavorState(NamedTuple):
    """RNN-mode state of causal FAVOR attention.

    kv: (B, H, M, dv+1) sum over seen keys of phi(k_j)[v_j | 1]^T, scaled by exp(-mu);
    mu: (B, H) running key stabilizer (max log-feature so far; 0 for relu).
    """

    kv: Tensor
    mu: Tensor


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
    def extend_chunk(self) -> int:
        """Tokens per chunk of :meth:`extend` (and the longest prompt :meth:`prefill` runs as
        one chunk): ``chunk_size``, or the default tile when the scan's tiles are tuned."""
        return self.chunk_size or DEFAULT_TILES[0]

    def _rho(self) -> Tensor | None:
        return self.oprf_rho if (self._map_class.needs_statistic and self.causal) else None

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
            _, y, vv, keep = flatten_heads(k, k, v, key_padding_mask)  # (BH, L, ·)
            return self._absorb(None, y, vv, keep, k.shape[0])

    def _step_map(self, device: torch.device, dtype: torch.dtype) -> FeatureMap:
        """The feature map for :meth:`step`, built once per (omega, statistic, device, dtype).

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

    @torch.no_grad()
    def step(
        self,
        state: FavorState | None,
        q_t: Tensor,
        k_t: Tensor,
        v_t: Tensor,
        key_padding_mask: Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[FavorState, Tensor]:
        """One causal step: q_t, k_t, v_t (B, H, d) -> (new state, out_t (B, H, dv)).

        state=None starts fresh; key_padding_mask (B,) True = this token is a pad (the state is
        left unchanged). Matches the parallel causal forward (same stabilizer, same omega).

        One token's keys, stabilizer and state update in a handful of ops, the heads treated
        as rows of one map (the feature map is cached, :meth:`_step_map`). ``inplace``: the
        caller owns ``state`` (a generator's, never a family context's); the sum is then
        updated in place, but only in a tensor an earlier in-place step allocated itself: the
        first step copies (copy on first write), so states from ``prefill``, ``extend`` or a
        context are never written.
        """
        self._check_causal()
        B, H, _ = q_t.shape
        with torch.autocast(device_type=q_t.device.type, enabled=False):
            dtype = torch.float64 if q_t.dtype == torch.float64 else torch.float32
            fmap = self._step_map(q_t.device, dtype)
            x, y, vv = q_t.to(dtype), k_t.to(dtype), v_t.to(dtype)  # (B, H, d): heads as rows
            if fmap.exp and fmap.Wa.dim() == 2 and state is not None:
                return self._exp_step(fmap, state, x, y, vv, key_padding_mask, inplace, q_t.dtype)
            keep = None
            if key_padding_mask is not None:
                keep = (~key_padding_mask.bool())[:, None].expand(B, H)
            logits = fmap.key_logits(y, keep)
            top = step_max(logits)  # (B, H); None for relu (no stabilizer)
            old_mu = None if state is None else state.mu.to(dtype)
            if top is None:
                mu = y.new_zeros(B, H) if old_mu is None else old_mu
            else:
                mu = top.clamp_min_(_NEG) if old_mu is None else torch.maximum(top, old_mu)
            kf = fmap.keys(y, logits, mu[..., None], keep)  # (B, H, M)
            vx = F.pad(vv, (0, 1), value=1.0)  # (B, H, dv+1): [v | 1]
            M, C = kf.shape[-1], vx.shape[-1]
            kf3, vx3 = kf.reshape(B * H, M, 1), vx.reshape(B * H, 1, C)
            if state is None:
                kv = (kf3 @ vx3).view(B, H, M, C)
            else:
                kv = state.kv
                if kv.dtype != dtype or kv.device != kf.device:
                    kv = kv.to(dtype=dtype, device=kf.device)
                owned = inplace and getattr(kv, "_favor_owned", False)
                if top is not None:
                    decay = torch.exp(old_mu - mu)[..., None, None]  # (B, H, 1, 1), <= 1
                    kv = kv.mul_(decay) if owned else kv * decay
                elif not owned:
                    kv = kv.clone()
                kv = kv.expand(B, H, M, C) if kv.shape[0] != B else kv
                if not kv.is_contiguous():
                    kv = kv.contiguous()
                kv.view(B * H, M, C).baddbmm_(kf3, vx3)
            if inplace:
                kv._favor_owned = True  # allocated here: later in-place steps may write it
            qf, _ = fmap.queries(x)  # (B, H, M)
            yq = (qf.reshape(B * H, 1, M) @ kv.view(B * H, M, C)).view(B, H, C)
            out = yq[..., :-1] / safe_denominator(yq[..., -1:])
        return FavorState(kv, mu), out.to(q_t.dtype)

    @staticmethod
    def _exp_step(
        fmap: FeatureMap,
        state: FavorState,
        x: Tensor,
        y: Tensor,
        vv: Tensor,
        key_padding_mask: Tensor | None,
        inplace: bool,
        out_dtype: torch.dtype,
    ) -> tuple[FavorState, Tensor]:
        """:meth:`step` for the exp kernels (softmax, softmax_hyp, softmax_opt), written out:
        the same features and stabilizers as the map's methods in about half the ops (the
        row term folded into one add, one clamp as the normalizer's guard: exp features are
        never negative). x, y, vv (B, H, d) in the compute dtype."""
        B, H, _ = x.shape
        W = fmap.Wa.T  # (d, M)
        pk = torch.matmul(y, W)  # (B, H, M): key logits
        pq = torch.matmul(x, W)
        if fmap.bias is not None:
            pk += fmap.bias
            pq += fmap.bias
        row = torch.linalg.vecdot(y, y)[..., None]  # (B, H, 1): |k|^2
        pk.add_(row, alpha=-0.5 * fmap.t2)
        # On CPU a host check is cheap and saves whole passes; on a GPU it would be a sync.
        cpu = x.device.type == "cpu"
        if key_padding_mask is not None and (not cpu or bool(key_padding_mask.any())):
            pk.masked_fill_(key_padding_mask.bool()[:, None, None], float("-inf"))
        old_mu = state.mu.to(x.dtype)
        mu = torch.maximum(pk.amax(-1), old_mu)  # (B, H): never below old_mu >= _NEG
        kf = pk.sub_(mu[..., None]).exp_()  # (B, H, M), pads 0
        # A new running max is rare after the first tokens: rescale the sum only then (a
        # factor exp(0) = 1 changes nothing, so skipping it gives the same numbers).
        rescale = not cpu or bool((mu != old_mu).any())
        decay = (old_mu - mu).exp_()[..., None, None] if rescale else None  # (B, H, 1, 1)
        kv = state.kv
        if kv.dtype != x.dtype or kv.device != x.device:
            kv = kv.to(dtype=x.dtype, device=x.device)
        if inplace and getattr(kv, "_favor_owned", False):
            if decay is not None:
                kv.mul_(decay)
        else:
            kv = kv.clone() if decay is None else kv * decay
            kv = kv.expand(B, *kv.shape[1:]).contiguous()
        if inplace:
            kv._favor_owned = True  # allocated here: later in-place steps may write it
        M, C = kv.shape[-2:]
        vx = F.pad(vv, (0, 1), value=1.0)  # (B, H, dv+1): [v | 1]
        kv.addcmul_(kf[..., None], vx[..., None, :])  # + kf [v | 1]^T: one pass, no GEMM
        qf = pq.sub_(pq.amax(-1, keepdim=True)).exp_()  # (B, H, M), row max 1
        yq = torch.bmm(qf.view(B * H, 1, M), kv.view(B * H, M, C)).view(B, H, C)
        out = yq[..., :-1] / yq[..., -1:].clamp_min(torch.finfo(torch.float32).tiny)
        return FavorState(kv, mu), out.to(out_dtype)

    @torch.no_grad()
    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, FavorState]:
        """Causal outputs (B, H, L, dv) of a prompt q, k, v (B, H, L, d) and the state after
        it (generation's start). A prompt of at most ``extend_chunk`` tokens runs as one chunk of
        :meth:`extend` from an empty state (one pass, a few dozen ops: the scan's segment
        machinery costs more than such a prompt); a longer one, the parallel forward and
        :meth:`initial_state`."""
        self._check_causal()
        B, H, L, _ = q.shape
        long = L - self.extend_chunk > 0
        if long:
            out = self.forward(q, k, v, key_padding_mask)
            return out, self.initial_state(k, v, key_padding_mask)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        M, C = self.feature_dim, v.shape[-1] + 1
        # The state before any key: no sum, a stabilizer below every key's (0 without one).
        mu = q.new_full((1, H), _NEG if self._map_class.stabilized else 0.0, dtype=dtype)
        empty = FavorState(q.new_zeros(1, H, M, C, dtype=dtype), mu)
        out, state = self.extend(empty, q, k, v, key_padding_mask, return_state=True)
        return out, state  # type: ignore[return-value]

    @torch.no_grad()
    def extend(
        self,
        state: FavorState | None,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        return_state: bool = False,
    ) -> tuple[Tensor, FavorState | None]:
        """Causal outputs (B, H, L, dv) of new tokens q, k, v (B, H, L, d) after ``state``
        (batch 1, broadcast over B, or B; None: the parallel forward), and the state after
        them if ``return_state``. ``state`` is never written.

        Chunk by chunk (``extend_chunk`` tokens): token t's sums are the state's term
        qf_t . S exp(mu_S - mu_t) plus the chunk's causal terms (qf_t . kf_j) exp(mu_j - mu_t),
        mu the running key max continued from the state's (no future information, every
        factor <= 1), normalized by the same sums of [v | 1]; the chunk is then absorbed into
        S for the next one. Padded keys (key_padding_mask (B, L), True = pad) add nothing.
        """
        self._check_causal()
        if state is None:
            out = self.forward(q, k, v, key_padding_mask)
            new = self.initial_state(k, v, key_padding_mask) if return_state else None
            return out, new
        B, H, L, _ = q.shape
        with torch.autocast(device_type=q.device.type, enabled=False):
            dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            x, y, vv = (t.to(dtype) for t in (q, k, v))  # (B, H, L, d)
            keep = None
            if key_padding_mask is not None:
                keep = (~key_padding_mask.bool())[:, None, :].expand(B, H, L)  # (B, H, L)
            fmap = self._feature_map(x)
            kv, mu = state.kv.to(x), state.mu.to(x)  # (B | 1, H, M, dv+1), (B | 1, H)
            outs = []
            for a in range(0, L, self.extend_chunk):
                sl = slice(a, min(L, a + self.extend_chunk))
                ys, ks = y[..., sl, :], None if keep is None else keep[..., sl]
                logits = fmap.key_logits(ys, ks)
                mu_t = running_max(logits, mu)  # (B, H, C): the max over the state and keys <= t
                if mu_t is None:  # relu: no stabilizer
                    mu_t = mu[..., None].expand(B, H, ys.shape[-2])
                kf = fmap.keys(ys, logits, mu_t[..., None], ks)  # (B, H, C, M), relative to mu_t
                qf, _ = fmap.queries(x[..., sl, :])  # (B, H, C, M)
                vx = torch.cat([vv[..., sl, :], vv.new_ones(B, H, ys.shape[-2], 1)], dim=-1)
                decay = mu_t[..., None, :] - mu_t[..., :, None]  # (B, H, t, j): mu_j - mu_t
                tril = torch.ones_like(decay, dtype=torch.bool).tril_()
                w = (qf @ kf.mT) * decay.masked_fill_(~tril, float("-inf")).exp_()  # (B,H,C,C)
                num = (qf @ kv) * torch.exp(mu[..., None] - mu_t)[..., None]  # (B, H, C, dv+1)
                num = num + w @ vx
                outs.append(num[..., :-1] / safe_denominator(num[..., -1:]))
                if sl.stop < L or return_state:  # absorb the chunk, relative to its last mu
                    last = mu_t[..., -1]  # (B, H)
                    kf = kf * torch.exp(mu_t - last[..., None])[..., None]
                    kv = kv * torch.exp(mu - last)[..., None, None] + kf.mT @ vx
                    mu = last
            out = torch.cat(outs, dim=-2).to(q.dtype)  # (B, H, L, dv)
        if not return_state:
            return out, None
        return out, FavorState(kv.expand(B, *kv.shape[1:]), mu.expand(B, H))

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

    def _check_causal(self) -> None:
        if not self.causal:
            raise RuntimeError("RNN mode (step, initial_state) needs causal=True")

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, nb_features={self.nb_features}, causal={self.causal}, "
            f"kernel={self.kernel!r}, orthogonal={self.orthogonal}, norm={self.norm!r}, "
            f"chunk_size={self.chunk_size}"
        )
