"""A small exact sliding window summed with the linear core under one shared normalizer.

Why: a linear map cannot reproduce softmax's sharpest, nearest-neighbour weights, and those are
most of what a trained model's attention does; LoLCATs (arXiv 2410.10254) keeps them exact in a
window of w tokens and lets the linear map carry only the rest, which closes most of the gap
that attention transfer leaves. With scores s = q.k / sqrt(d),

    out_t = (g_h sum_{j in W(t)} e^{s_tj - m_t} [v_j | 1] + sum_{j not in W(t)} phi(q_t).phi(k_j)
             [v_j | 1]),  numerator over normalizer,

W(t) the w keys t-w+1 .. t (causal) or the keys within w-1 of t (bidirectional), m_t the largest
score in the window (a stabilizer, shared by the parallel and the recurrent form) and g_h a
learned positive scale per head (``exp(window_log_scale)``): the two terms are on different
scales (the maps' kernels are not e^s), so their balance is fitted, not assumed.

The causal recurrent state is constant-size: a ring of the last w keys and values (oldest
first) with their validity, plus the inner core's sum over every key that left the window. A
call with a state runs the same code as one without: the ring is prepended to the new keys (a
fresh row's ring is w invalid slots), the first L keys of ``[ring | new]`` feed the linear sum
(exactly the keys more than w-1 before each query), and the last w become the new ring.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.cores.base import (
    AttentionCore,
    CoreWrapper,
    allowed_keys,
    compute_dtype,
    real_tokens,
)
from protein_performer.model.cores.registry import register
from protein_performer.model.linear.core import (
    LinearAttention,
    LinearState,
    _normalized,
    causal_linear,
)


class WindowState(NamedTuple):
    """The windowed core's state: the inner linear core's (sum over keys before the ring) and
    the ring of the last w keys ``k`` (B, H, w, d), values ``v`` (B, H, w, dv) and ``valid``
    (B, w) (False: padding, or not yet filled)."""

    inner: LinearState
    k: Tensor
    v: Tensor
    valid: Tensor


def window_sums(q: Tensor, k: Tensor, vx: Tensor, keep: Tensor, lo: int, hi: int,
                block: int) -> Tensor:
    """sum_j e^{s_ij - m_i} vx_j over the kept keys j in [i + lo, i + hi] of ``k``'s indexing,
    m_i the largest such score: q (B, H, L, d), k (B, H, Lk, d), vx (B, H, Lk, C), keep (B, Lk)
    -> (B, H, L, C). Blocked: query block b reads key blocks b .. b + ceil(hi / block), so
    memory is O(L (block + hi)), never (L, Lk)."""
    B, H, L, d = q.shape
    C = vx.shape[-1]
    n = -(-L // block)
    nb = 1 + -(-hi // block)
    total = (n + nb - 1) * block
    q = F.pad(q, (0, 0, 0, n * block - L))
    k, vx = (F.pad(t[:, :, :total], (0, 0, 0, total - min(t.shape[2], total))) for t in (k, vx))
    keep = F.pad(keep[:, :total], (0, total - min(keep.shape[1], total)), value=False)
    kb = k.view(B, H, n + nb - 1, block, d)
    vb = vx.view(B, H, n + nb - 1, block, C)
    mb = keep.view(B, n + nb - 1, block)
    kw = torch.cat([kb[:, :, t : t + n] for t in range(nb)], dim=3)  # (B, H, n, nb*block, d)
    vw = torch.cat([vb[:, :, t : t + n] for t in range(nb)], dim=3)
    mw = torch.cat([mb[:, t : t + n] for t in range(nb)], dim=2)  # (B, n, nb*block)
    r = torch.arange(block, device=q.device)[:, None]
    c = torch.arange(nb * block, device=q.device)[None, :]
    band = (c >= r + lo) & (c <= r + hi)  # (block, nb*block)
    allowed = band & mw[:, None, :, None, :]  # (B, 1, n, block, nb*block)
    scores = (q.view(B, H, n, block, d) @ kw.mT) * d**-0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    out = torch.exp(scores - top) @ vw  # (B, H, n, block, C)
    return out.reshape(B, H, n * block, C)[:, :, :L]


def _shifted(t: Tensor, w: int) -> Tensor:
    """t (B, H, L, X) moved w places later along L (zeros first): key j - w at index j."""
    return F.pad(t, (0, 0, w, 0))[:, :, : t.shape[2]]


@register("window")
class SlidingWindow(CoreWrapper):
    """Wraps a :class:`~.core.LinearAttention` (``inner``) with the exact window described
    above (``PerformerConfig.local_window``); the same call shape and state contract as the
    cores."""

    order = 0  # next to the linear core, inside the position memory

    def __init__(self, inner: LinearAttention, heads: int, window: int) -> None:
        super().__init__()
        self.inner = inner
        self.causal = inner.causal
        self.window = window
        # log g_h: 0 = the window's e^{s - m} and the map's kernel side by side, as drawn.
        self.window_log_scale = nn.Parameter(torch.zeros(heads))

    @classmethod
    def enabled(cls, config) -> bool:  # noqa: ANN001 - a PerformerConfig
        return bool(config.local_window)

    @classmethod
    def wraps(cls, inner: type[AttentionCore]) -> bool:
        return issubclass(inner, LinearAttention)

    @classmethod
    def from_config(  # noqa: ANN001 - a PerformerConfig
        cls, config, inner: AttentionCore | None = None
    ) -> SlidingWindow:
        assert isinstance(inner, LinearAttention)
        return cls(inner, config.heads, config.local_window)

    @classmethod
    def config_problem(cls, config) -> str | None:  # noqa: ANN001
        from protein_performer.model.cores.registry import core_class

        if not cls.wraps(core_class(config.attention)):
            return (
                f"local_window={config.local_window} needs attention=linear (the window shares "
                f"the linear map's normalizer), got attention={config.attention}"
            )
        return None

    @classmethod
    def extra_numel(cls, config) -> int:  # noqa: ANN001
        return config.heads

    @property
    def label(self) -> str:  # type: ignore[override]
        return f"{self.inner.label} with an exact window"

    @property
    def feature_map(self) -> nn.Module:
        return self.inner.feature_map

    def _scale(self, dtype: torch.dtype) -> Tensor:
        return self.window_log_scale.to(dtype).exp()[None, :, None, None]  # (1, H, 1, 1)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        state: WindowState | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        positions: Tensor | int | None = None,
    ) -> tuple[Tensor, WindowState | None]:
        """q, k, v (B, H, L, d) -> (B, H, L, dv) and, with ``keep_state``, the state after the
        tokens; ``state`` (batch 1 or B) is read, never written (``inplace`` and ``positions``
        are part of the cores' call, not needed here)."""
        B, H, L, _ = q.shape
        w = self.window
        dtype = compute_dtype(q)
        keep = real_tokens(key_padding_mask, B, L, q.device)
        fmap = self.inner.feature_map
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y = q.to(dtype), k.to(dtype)
            vx = F.pad(v.to(dtype), (0, 1), value=1.0)  # (B, H, L, dv+1): [v | 1]
            qf = fmap(x)
            if not self.causal:
                kf = fmap(y) * keep[:, None, :, None].to(dtype)
                before = causal_linear(qf, _shifted(kf, w), _shifted(vx, w), None,
                                       self.inner.chunk_size)[0]
                after = causal_linear(qf.flip(2), _shifted(kf.flip(2), w),
                                      _shifted(vx.flip(2), w), None,
                                      self.inner.chunk_size)[0].flip(2)
                y_pad = F.pad(y, (0, 0, w, 0))
                near = window_sums(x, y_pad, F.pad(vx, (0, 0, w, 0)),
                                   F.pad(keep, (w, 0), value=False), 1, 2 * w - 1, w)
                num = before + after + self._scale(dtype) * near
                return _normalized(num).to(q.dtype), None
            if state is None:
                ring_k = y.new_zeros(B, H, w, y.shape[-1])
                ring_v = vx.new_zeros(B, H, w, vx.shape[-1])
                ring_keep = torch.zeros(B, w, dtype=torch.bool, device=q.device)
                kv0 = None
            else:
                ring_k = state.k.to(dtype).expand(B, -1, -1, -1)
                ring_v = F.pad(state.v.to(dtype), (0, 1), value=1.0).expand(B, -1, -1, -1)
                ring_keep = state.valid.expand(B, -1)
                kv0 = state.inner.kv.to(dtype)
            ks = torch.cat([ring_k, y], 2)  # (B, H, w + L, d): the ring, then the new keys
            vs = torch.cat([ring_v, vx], 2)
            keeps = torch.cat([ring_keep, keep], 1)  # (B, w + L)
            kf = fmap(ks[:, :, :L]) * keeps[:, None, :L, None].to(dtype)
            chunk = 1 if L == 1 else self.inner.chunk_size
            far, last = causal_linear(qf, kf, vs[:, :, :L], kv0, chunk)
            near = window_sums(x, ks, vs, keeps, 1, w, w)
            num = far + self._scale(dtype) * near
        new = None
        if keep_state:
            new = WindowState(LinearState(last), ks[:, :, L:], vs[:, :, L:, :-1], keeps[:, L:])
        return _normalized(num).to(q.dtype), new

    def attention_map(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None = None,
        query_slice: slice | None = None,
    ) -> Tensor:
        """The implied rows (B, H, W, L) of the queries in ``query_slice``: window weights
        g e^{s - m} inside the window, phi(q).phi(k) outside, normalized over the real keys."""
        qs = q if query_slice is None else q[:, :, query_slice]
        start = 0 if query_slice is None else (query_slice.start or 0)
        dtype = compute_dtype(q)
        d = q.shape[-1]
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y = qs.to(dtype), k.to(dtype)
            lin = self.inner.feature_map(x) @ self.inner.feature_map(y).mT  # (B, H, W, L)
            rows = torch.arange(start, start + qs.shape[2], device=q.device)[:, None]
            cols = torch.arange(k.shape[2], device=q.device)[None, :]
            gap = rows - cols
            near = (gap >= 0) & (gap < self.window) if self.causal else gap.abs() < self.window
            real = allowed_keys(key_padding_mask, self.causal, query_slice, k.shape[2], q.device)
            scores = (x @ y.mT) * d**-0.5
            scores = scores.masked_fill(~(near & real), float("-inf"))
            top = scores.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            exact = torch.exp(scores - top) * self._scale(dtype)
            weights = torch.where(near, exact, lin).masked_fill(~real, 0.0)
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
        return weights.to(q.dtype)

    def extra_repr(self) -> str:
        return f"window={self.window}"
