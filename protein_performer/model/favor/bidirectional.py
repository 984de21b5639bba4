"""Bidirectional FAVOR+ as one autograd node: keys summed into a state block by block, queries
read it; features recomputed in backward, O(L d + block M) memory."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from protein_performer.model.favor.kernels import FeatureMap, column_max
from protein_performer.model.favor.scan import safe_denominator


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
    from cache instead of memory (the measured gain is in docs/RESULTS.md). On GPU all heads go
    at once. ``block`` stays an upper bound on the rows.
    """
    if like.device.type != "cpu":
        return BH, block
    cache = _l2_bytes() * torch.get_num_threads()
    rows = max(64, cache // (2 * M * like.element_size()))
    block = min(block, rows)
    return max(1, rows // min(L, block)), block


#: Heads per tile of the one-block path over those of the block loop: it makes fewer passes
#: over a tile's features, and 4-5x larger tiles ran fastest (8M shape, 1 thread, batches of
#: 12 x 340 and 4 x 1,000 tokens: 25 vs 29 ms and 21 vs 30 ms a layer; all heads at once 43
#: and 38 ms).
_FUSED_TILES = 4


class _BidiFavor(torch.autograd.Function):
    """Bidirectional FAVOR as one autograd node, O(L d + block M) memory.

    Forward, per tile of heads (:func:`_tile`): keys in blocks give S = phi(K)^T [V | 1]
    (M, dv+1), stabilized by the running per-column key max ``col`` (the state is rescaled when
    it grows); queries in blocks give out = phi(Q) S_v / (phi(Q) S_1), with the column offsets
    moved to the query logits (exp kernels) and a per-row max subtracted. Both stabilizers
    cancel exactly in the output, so the backward treats them as constants. Saved: q, k, v, col,
    S, out and the normalizer; the backward recomputes the features block by block (queries
    first, accumulating dS, then keys). When one block holds every row (exp kernels), the
    forward is :func:`_fused_exp` instead, and ``out`` is (B, H, L, dv) over (B, L, H, dv)
    memory (``heads`` = H), the layout the layer's output projection reads.
    """

    @staticmethod
    def forward(ctx, q, k, v, fmap: FeatureMap, keep, block: int, heads: int):
        BH, L, _ = q.shape
        dv = v.shape[-1]
        hb, block = _tile(BH, L, fmap.width, block, q)
        ctx.tile, ctx.fmap = (hb, block), fmap  # the backward's tiles: the block loop's
        S = q.new_empty(BH, fmap.width, dv + 1)  # [phi(K)^T V | phi(K)^T 1] per head
        den, shifts = q.new_empty(BH, L, 1), q.new_zeros(BH, L)
        fused = fmap.exp and block >= L  # one block holds every row: _fused_exp
        if fused:
            # (B, H, L, dv) over (B, L, H, dv) memory: the layer's out_proj reads it as it is
            hb = _aligned(hb * _FUSED_TILES, heads)
            out = q.new_empty(BH // heads, L, heads, dv).permute(0, 2, 1, 3)
            xa, ya = fmap.fused_inputs(q, k, keep)  # [Q | 1], [K | |K|^2 ...]: all heads
        else:
            out = q.new_empty(BH, L, dv)
        cols = []
        for b0 in range(0, BH, hb):
            h, fm = slice(b0, b0 + hb), fmap.heads(b0, b0 + hb)
            kp = None if keep is None else keep[h]
            if fused:  # the tile's rows of out: (batch rows, heads, dv, L) views
                rows, first = slice(b0 // heads, -(-(b0 + hb) // heads)), b0 % heads
                target = out[rows, first : first + min(hb, heads)].transpose(-1, -2)
                cols.append(_fused_exp(xa[h], ya[h], v[h], fm, S[h], target, den[h], shifts[h]))
                continue
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
        ctx.save_for_backward(q, k, v, keep, col, S, out, den, shifts)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep, col, S, out, den, shifts = ctx.saved_tensors
        (hb, block), fmap = ctx.tile, ctx.fmap
        BH, L, _ = q.shape
        dv = v.shape[-1]
        grad_out, out = grad_out.reshape(BH, L, dv), out.reshape(BH, L, dv)
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
        return dq, dk, dvv, None, None, None, None


def _aligned(hb: int, heads: int) -> int:
    """Heads per tile made to fit the (batch, head) grid: a multiple of ``heads`` or a divisor
    of it, so a tile's rows of the (B, L, H, dv) output are one strided view."""
    if hb >= heads:
        return hb // heads * heads
    return max(n for n in range(1, hb + 1) if heads % n == 0)


def _fused_exp(
    xa: Tensor,
    ya: Tensor,
    v: Tensor,
    fmap: FeatureMap,
    S: Tensor,
    out: Tensor,
    den: Tensor,
    shift: Tensor,
) -> Tensor:
    """The forward of one tile of heads when one block holds every row (exp kernels), from
    the inputs of :meth:`ExpFeatureMap.fused_inputs`.

    Why: at a typical protein's length the block loop's passes over the (heads, rows, M)
    features, not the products, were FAVOR+'s cost (issue 43). Here the features are made
    transposed, (h, M, L), by :meth:`ExpFeatureMap.keys_t` and :meth:`ExpFeatureMap.queries_t`
    (one GEMM each, the stabilizer's max over contiguous rows, one exp2), S = phi(K)^T [V | 1]
    and [num | den]^T = S^T phi(Q)^T are two GEMMs, and the output is written once, into
    ``out`` (batch rows, heads, dv, L) (a view of the (B, L, H, dv) output). The normalizer
    column of S is a row sum: a GEMM over dv + 1 = 17 columns costs as much as one over 32.
    Writes S, den (h, L, 1), the row shift (h, L); returns the key stabilizer (h, 1, M) for
    the backward, which recomputes these features with :meth:`FeatureMap.queries` /
    :meth:`FeatureMap.keys` (the same values to rounding).
    """
    dv = v.shape[-1]
    kf, col = fmap.keys_t(ya)  # (h, M, L), (h, 1, M)
    S[..., :dv] = torch.bmm(kf, v)  # (h, M, dv)
    torch.sum(kf, -1, out=S[..., dv])
    qf, sh = fmap.queries_t(xa, col)  # (h, M, L), (h, L)
    shift.copy_(sh)
    yt = torch.bmm(S.mT, qf)  # (h, dv + 1, L)
    # positive features: den >= 0, so the clamp is safe_denominator's guard (NaN stays NaN)
    dt = yt[:, dv:].clamp_min(torch.finfo(torch.float32).tiny)  # (h, 1, L)
    den.copy_(dt.mT)
    torch.div(yt[:, :dv].view(out.shape), dt.view(*out.shape[:-2], 1, -1), out=out)
    return col


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
