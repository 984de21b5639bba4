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

Work is done in *segments*: a contiguous block of the (BH, n_chunks, C, .) layout, either whole
heads (all their chunks) or a run of chunks of one head, so every operand is a view (no copies).
Inside a segment all matmuls are batched over its chunks and the state recurrence across chunks is
one small (G x G) matmul. The forward keeps only the state at segment boundaries (a few M x (dv+1)
matrices per head, only when a head spans several segments); the backward walks the segments in
reverse, recomputes each segment's prefix states from that boundary state, carries the state
adjoint dS backwards, and finishes the segment's gradients at once. Nothing of size
(chunks x M x dv) is stored across segments. The scan takes a segment's operands from a provider
(:func:`scan_forward_segments`, :func:`scan_backward_segments`), so a caller computes the
features of a segment's rows only when the scan reaches it (:mod:`.causal`).

No host-device synchronisation inside the scan: whether a chunk's stabilizer jumps too far for
the factorized intra-chunk weights is accumulated on the device and read once after the forward
scan (which is then redone with the exact decay matrices, a rare case).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Segment",
    "SegmentOperands",
    "plan_segments",
    "safe_denominator",
    "scan_backward_segments",
    "scan_forward_segments",
    "workspace",
]


def safe_denominator(den: Tensor) -> Tensor:
    """Keep a normalizer away from 0 without biasing any representable value.

    Only |den| below float32's smallest normal number is touched (a row that sees no real key
    then outputs 0 instead of NaN).
    """
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(den.abs() < tiny, torch.full_like(den, tiny), den)


_MAX_SEGMENT_CHUNKS = 64  # chunks of one head per segment: the (G x G) state matmul is O(G^2 M dv)


def plan_segments(BH: int, n: int, C: int, rows: int) -> list[tuple[int, int, int, int]]:
    """Segments (b0, b1, g0, g1) over the (BH, n, C) chunk layout, each about `rows` tokens.

    Whole heads are grouped when a head fits (then a segment is a contiguous slab of heads);
    otherwise each head is cut into runs of chunks. Either way the slice [b0:b1, g0:g1] of a
    contiguous (BH, n, C, .) tensor is itself contiguous, so reshaping it is free. A run holds
    at most _MAX_SEGMENT_CHUNKS chunks, because the closed-form state recurrence costs
    O(G^2 M dv) per head and segment, i.e. O(G M dv / C) per token.
    """
    if n * C <= rows and n <= _MAX_SEGMENT_CHUNKS:
        hg = max(1, rows // (n * C))
        return [(b, min(b + hg, BH), 0, n) for b in range(0, BH, hg)]
    G = max(1, min(rows // C, _MAX_SEGMENT_CHUNKS))
    return [(b, b + 1, g, min(g + G, n)) for b in range(BH) for g in range(0, n, G)]


def _decay(mu_s: Tensor, tril: Tensor) -> Tensor:
    """exp(mu_j - mu_t) for j <= t inside each chunk, 0 above the diagonal.

    mu_s: (nb, G, C) -> (nb, G, C, C) indexed [t, j]; every exponent is <= 0.
    """
    diff = mu_s[..., None, :] - mu_s[..., :, None]  # (nb, G, t, j): mu_j - mu_t
    return diff.masked_fill_(~tril, float("-inf")).exp_()


def _prefix_states(
    u: Tensor,
    mu_e: Tensor,
    mu_b: Tensor,
    state: Tensor | None,
    mu_state: Tensor | None,
    need_out: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """States before each chunk of a segment, and the state after it, without a Python loop.

    The recurrence S_c = S_{c-1} exp(mu_b[c] - mu_e[c]) + u_c unrolls to weights
    exp(mu_e[c'] - mu_b[c]) (c' < c), all <= 1 since mu never decreases: one (G x G) matmul.
    u: (nb, G, F) per-chunk sums; mu_e / mu_b: (nb, G) stabilizer after / before each chunk;
    state: (nb, F) incoming state relative to mu_state (nb,), or None at a head's start.
    """
    G = u.shape[1]
    strict = torch.ones(G, G, dtype=torch.bool, device=u.device).tril_(-1)
    expo = (mu_e[:, None, :] - mu_b[:, :, None]).masked_fill_(~strict, float("-inf"))
    prefix = torch.bmm(expo.exp_(), u)  # (nb, G, F)
    if state is not None:
        prefix.addcmul_(torch.exp(mu_state[:, None] - mu_b)[..., None], state[:, None, :])
    if not need_out:
        return prefix, None
    last = mu_e[:, -1:]  # (nb, 1)
    out = torch.bmm(torch.exp(mu_e - last)[:, None, :], u)[:, 0]  # (nb, F)
    if state is not None:
        out.addcmul_(torch.exp(mu_state[:, None] - last), state)
    return prefix, out


def _suffix_adjoints(
    z: Tensor, mu_e: Tensor, mu_b: Tensor, dstate: Tensor | None, need_out: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Adjoints dS of the state after each chunk of a segment (reverse scan, closed form).

    dS_{c-1} = dS_c exp(mu_b[c] - mu_e[c]) + z_c unrolls to weights exp(mu_e[c] - mu_b[c''])
    for c'' > c. z: (nb, G, F) query-side terms; dstate: (nb, F) adjoint after the segment (None
    at a head's end). Returns (adjoints (nb, G, F), adjoint of the state before it (nb, F)).
    """
    G = z.shape[1]
    strict = torch.ones(G, G, dtype=torch.bool, device=z.device).triu_(1)
    expo = (mu_e[:, :, None] - mu_b[:, None, :]).masked_fill_(~strict, float("-inf"))
    adj = torch.bmm(expo.exp_(), z)  # (nb, G, F)
    last = mu_e[:, -1:]
    if dstate is not None:
        adj.addcmul_(torch.exp(mu_e - last)[..., None], dstate[:, None, :])
    if not need_out:
        return adj, None
    first = mu_b[:, :1]
    out = torch.bmm(torch.exp(first - mu_b)[:, None, :], z)[:, 0]
    if dstate is not None:
        out.addcmul_(torch.exp(first - last), dstate)
    return adj, out


_MAX_JUMP = 60.0  # max rise of mu inside one chunk for the factorized intra-chunk path

Segment = tuple[int, int, int, int]


class SegmentOperands(NamedTuple):
    """One segment's operands in the chunk layout (R = nb * G chunks of C rows).

    Why a provider hands these over per segment instead of the scan slicing full tensors: the
    exp kernels compute the features of a segment's rows only when the scan reaches it (and
    again in backward), so no (BH, L, M) feature map is ever alive.
    """

    q: Tensor  # (R, C, M) query features
    k: Tensor  # (R, C, M) key features relative to mu
    vx: Tensor  # (R, C, E) values with the ones column
    mu: Tensor  # (nb, G, C) key stabilizer, non-decreasing along each head
    dy: Tensor | None = None  # (R, C, E) upstream gradient of the sums (backward only)


ForwardOperands = Callable[[Segment, Tensor | None], SegmentOperands]
BackwardOperands = Callable[[Segment], SegmentOperands]
SegmentSums = Callable[[Segment, Tensor], None]
SegmentGrads = Callable[[Segment, SegmentOperands, Tensor, Tensor, Tensor], None]


class _Factors(NamedTuple):
    """Per-chunk stabilizers of one segment (see :func:`_factors`)."""

    mu_e: Tensor  # (nb, G) stabilizer of the state after each chunk
    mu_b: Tensor  # (nb, G) stabilizer of the state before each chunk
    r: Tensor  # (R, C, 1) exp(mu_b - mu_t) <= 1
    sc: Tensor  # (R, C, 1) exp(mu_t - mu_e) <= 1
    colf: Tensor | None  # (R, C, 1) exp(mu_t - mu_b) >= 1; None: use the exact decay matrix
    jump: Tensor  # () the largest rise of mu inside one chunk of the segment


def _factors(mu_s: Tensor, mu_in: Tensor | None, exact: bool) -> _Factors:
    """Stabilizer factors of a segment; mu_in (nb,) is the state's mu before it (None: start).

    Intra-chunk weights exp(mu_j - mu_t) factor as colf_j * r_t with colf_j = exp(mu_j - mu_b)
    (>= 1) and r_t = exp(mu_b - mu_t) (<= 1): the factors go on V and on the output rows, and
    only a triangular mask touches the C x C matrix. That is exact while mu rises by at most
    _MAX_JUMP inside a chunk (colf stays finite; the exponent is clamped there, and ``jump``
    tells the caller); with ``exact`` the exact decay matrix is used instead.
    """
    C = mu_s.shape[-1]
    mu_e = mu_s[..., -1]
    first = mu_s[:, :1, 0] if mu_in is None else mu_in[:, None]
    mu_b = torch.cat([first, mu_e[:, :-1]], dim=1)
    r = torch.exp(mu_b[..., None] - mu_s).view(-1, C, 1)
    sc = torch.exp(mu_s - mu_e[..., None]).view(-1, C, 1)
    jump = (mu_e - mu_b).max()
    colf = None
    if not exact:
        colf = (mu_s - mu_b[..., None]).clamp_max_(_MAX_JUMP).exp_().view(-1, C, 1)
    return _Factors(mu_e, mu_b, r, sc, colf, jump)


def _tril(C: int, device: torch.device) -> Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril_()


def scan_forward_segments(
    segments: list[Segment], n: int, chunk: int, operands: ForwardOperands, emit: SegmentSums
) -> tuple[list, bool]:
    """Unnormalized causal sums, segment by segment, with operands from a provider.

    operands(segment, mu_in) gives the segment's operands; mu_in (nb,) is the stabilizer of the
    state carried in from the previous segment of the same heads (None at a head's start), so
    a provider can continue a running max. emit(segment, y) receives the sums
    y_t = sum_{j<=t} (q_t . k_j) exp(mu_j - mu_t) vx_j as (R, C, E); the buffer is reused for
    the next segment. n: chunks per head. Returns the incoming state of every segment (None at
    a head's start), which is all the backward needs besides the operands, and whether the
    exact intra-chunk decay was needed (pass it to :func:`scan_backward_segments`).
    """
    saved, jump = _scan_forward(segments, n, chunk, operands, emit, exact=False)
    if bool(jump > _MAX_JUMP):  # the one synchronisation, after the whole scan
        saved, _ = _scan_forward(segments, n, chunk, operands, emit, exact=True)
        return saved, True
    return saved, False


def _scan_forward(
    segments: list[Segment],
    n: int,
    chunk: int,
    operands: ForwardOperands,
    emit: SegmentSums,
    exact: bool,
) -> tuple[list, Tensor | None]:
    C = chunk
    jump: Tensor | None = None
    saved: list = []
    state: Tensor | None = None
    mu_state: Tensor | None = None
    w_buf: Tensor | None = None
    y_buf: Tensor | None = None
    tril: Tensor | None = None
    for seg in segments:
        b0, b1, g0, g1 = seg
        nb, G = b1 - b0, g1 - g0
        if g0 == 0:
            state, mu_state = None, None
        saved.append(None if state is None else (state, mu_state))
        op = operands(seg, mu_state)
        R, _, M = op.q.shape
        E = op.vx.shape[-1]
        f = _factors(op.mu, mu_state, exact)
        jump = f.jump if jump is None else torch.maximum(jump, f.jump)
        u = torch.bmm(op.k.transpose(1, 2), op.vx * f.sc).view(nb, G, M * E)
        prefix, state = _prefix_states(u, f.mu_e, f.mu_b, state, mu_state, need_out=g1 < n)
        mu_state = f.mu_e[:, -1]
        del u
        prefix = prefix.view(R, M, E)
        w_buf = workspace(w_buf, (R, C, C), op.q)
        y_buf = workspace(y_buf, (R, C, E), op.vx)
        w, y = torch.bmm(op.q, op.k.transpose(1, 2), out=w_buf), y_buf
        if f.colf is None:
            tril = _tril(C, op.q.device) if tril is None else tril
            w.view(nb, G, C, C).mul_(_decay(op.mu, tril))
            torch.bmm(op.q, prefix, out=y).mul_(f.r)
            y.baddbmm_(w, op.vx)
        else:
            w.tril_()
            torch.bmm(w, op.vx * f.colf, out=y)
            y.baddbmm_(op.q, prefix).mul_(f.r)
        del prefix
        emit(seg, y)
    return saved, jump


def workspace(buf: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A reusable scratch tensor: the segment loop allocates its large temporaries once.

    Why: fresh multi-MiB allocations are served by mmap and page-faulted in on every use.
    """
    numel = 1
    for s in shape:
        numel *= s
    if buf is None or buf.numel() < numel:
        buf = like.new_empty(numel)
    return buf.view(-1)[:numel].view(shape)


def scan_backward_segments(
    segments: list[Segment],
    n: int,
    chunk: int,
    saved: list,
    operands: BackwardOperands,
    emit: SegmentGrads,
    exact: bool,
) -> None:
    """Gradients of :func:`scan_forward_segments`, walking the segments in reverse.

    operands(segment) must give the same operands as in the forward, plus dy (the upstream
    gradient of the sums). emit(segment, operands, dq_s, dk_s, dvx_s) receives the complete
    gradients of that segment's rows w.r.t. q, k and vx, shaped (R, C, M | M | E). The buffers
    are reused for the next segment: emit must consume them before returning (it may modify
    them in place). exact: what :func:`scan_forward_segments` returned.
    """
    C = chunk
    dstate: Tensor | None = None
    tril: Tensor | None = None
    bufs: dict[str, Tensor | None] = dict.fromkeys(("dq", "dk", "w", "dw"))

    def ws(name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        bufs[name] = workspace(bufs[name], shape, like)
        return bufs[name].view(shape)

    for seg, incoming in zip(reversed(segments), reversed(saved), strict=True):
        b0, b1, g0, g1 = seg
        nb, G = b1 - b0, g1 - g0
        if g1 == n:
            dstate = None
        state, mu_state = incoming if incoming is not None else (None, None)
        op = operands(seg)
        q_s, k_s, vx_s, dy_s = op.q, op.k, op.vx, op.dy
        R, _, M = q_s.shape
        E = vx_s.shape[-1]
        f = _factors(op.mu, mu_state, exact)
        vsc = vx_s * f.sc
        u = torch.bmm(k_s.transpose(1, 2), vsc).view(nb, G, M * E)
        prefix, _ = _prefix_states(u, f.mu_e, f.mu_b, state, mu_state, need_out=False)
        del u
        prefix = prefix.view(R, M, E)
        dyr = dy_s * f.r
        z = torch.bmm(q_s.transpose(1, 2), dyr).view(nb, G, M * E)
        adj, dstate = _suffix_adjoints(z, f.mu_e, f.mu_b, dstate, need_out=g0 > 0)
        del z
        adj = adj.view(R, M, E)
        dq_s = torch.bmm(dyr, prefix.transpose(1, 2), out=ws("dq", (R, C, M), q_s))
        del prefix
        w = torch.bmm(q_s, k_s.transpose(1, 2), out=ws("w", (R, C, C), q_s))
        if f.colf is None:
            tril = _tril(C, q_s.device) if tril is None else tril
            decay = _decay(op.mu, tril).view(R, C, C)
            w.mul_(decay)
            dw = torch.bmm(dy_s, vx_s.transpose(1, 2), out=ws("dw", (R, C, C), q_s))
            dw.mul_(decay)
            del decay
            dvx_s = torch.bmm(w.transpose(1, 2), dy_s)
        else:
            w.tril_()
            dw = torch.bmm(dyr, (vx_s * f.colf).transpose(1, 2), out=ws("dw", (R, C, C), q_s))
            dw.tril_()
            dvx_s = torch.bmm(w.transpose(1, 2), dyr).mul_(f.colf)
        dq_s.baddbmm_(dw, k_s)
        dk_s = torch.bmm(dw.transpose(1, 2), q_s, out=ws("dk", (R, C, M), q_s))
        dk_s.baddbmm_(vsc, adj.transpose(1, 2))
        dvx_s.addcmul_(f.sc, torch.bmm(k_s, adj))
        del adj
        emit(seg, op, dq_s, dk_s, dvx_s)
