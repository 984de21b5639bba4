"""A memory keyed by position within a family member, mixed into any attention core.

Why: in a family row ``<cls> m1 <eos> <cls> m2 <eos> ...`` with member positions (rotary
restarting at every ``<cls>``), homologs line up roughly by position, and copying from them is
what exact attention learns first (issue 30). A linear-attention cousin of MSA column
attention keeps, per head, one sum of [k | v | 1] per member position p over the keys of the
other members (causal: the earlier ones), so each position has a mean key K[p] and a mean value
V[p]. A query at position p attends over the 2W + 1 positions around it,

    mem_t = sum_D softmax_D(q_t . K[p_t + D] / sqrt(d) + b_h(D)) V[p_t + D + s],   D in [-W, W],

with s = 1 when causal: the key found is paired with its successor's value, the residue that
follows the matched one in the homolog, which is what t predicts (an induction head, built in);
s = 0 for a masked model, which predicts the residue at t itself. Keys are rotary, so q . K
carries the offset D as exact attention's scores do: with aligned homologs a head can read
D = 0 by position alone (the learned bias b_h), and when an indel shifts a homolog, content
(the residue at t against the residues around p_t) finds the homologous position. The state is
P x (d + dv + 1) per head, P the longest member it holds (grown as a context brings longer
ones, up to ``max_positions``): constant in the number of members and in the context's length.
A per-head gate from the query, g_t = sigmoid(q_t . u_h + b_h), mixes it with the core's own
output, out = core + g (mem - core); where no memory entry is in reach (positions >= P, an
empty memory, a lone sequence) the output is the core's.

Why not the token's own member: models before 0.7 (``reads_own``, configs without
``memory_reads_own``) also read their own keys j <= t at D <= 0; alone (k = 0) the gate, which
cannot tell whose entries are in reach, then mixed in the sequence's own shifted past, and
these models were 8-12% worse than FAVOR+ alone there (docs/RESULTS.md). Reading only the
other members, a lone sequence gets its core's output, and the read is one table.

The parallel form lays each member out as a row of columns (one per position), so a token's
reads are its member's columns around its position in a prefix table over the members (before
its own; and up to it for ``reads_own``), and reading 2W + 1 neighbouring columns is one
product per tile of queries against the rows the tile reaches, a softmax under a mask, and the
values back through the same tiles, with a hand-written backward (:class:`_Read`); the
recurrent state is the last prefix, which is what it accumulates one token at a time, with the
member it ended in kept apart. A decoding step (one token per row after a state) reads the
2W + 2 slots around its position straight from that state (:func:`step_mix`, no tables), the
state then held in buffers of :func:`step_slots` slots, grown by doubling on the host, so the
model's step and the traced one (``model.decode``) are the same function of tensors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.cores.base import AttentionCore, CoreWrapper, real_tokens
from protein_performer.model.cores.base import compute_dtype as _compute_dtype
from protein_performer.model.cores.registry import register
from protein_performer.model.rotary import as_positions, member_index

#: Tokens read at a time by a causal memory (a long context's prefill in chunks, the memory
#: carried from one to the next: bounded working memory).
READ_CHUNK = 2048


class _Layout(NamedTuple):
    """Where a read's tokens go (:meth:`PositionMemory._layout`): ``valid`` (B, L) the tokens
    that enter a position, positions ``base`` .. ``top`` held, M members a row, P positions,
    tiles of T, rows of R columns, each token's key row (``keyed``) and query row (``asked``)
    in the tables (B H L,), the tokens per column ``own`` (M + 1, B, R), each token's query
    column in it (``slot`` (B, L)), its member (B, L), and whether no two tokens of a member
    share a column (``unique``: keyed by member positions, or by coordinates that are those
    or -1, as a training row's members hidden from the memory have)."""

    valid: Tensor
    base: int
    top: int
    M: int
    P: int
    T: int
    R: int
    keyed: Tensor
    asked: Tensor
    own: Tensor
    slot: Tensor
    member: Tensor
    unique: bool


class MemoryState(NamedTuple):
    """The mixed core's state: the inner core's (``inner``) and the position memory
    ``mem`` (B, H, P, d + dv + 1), slot p holding the sum of [k | v | 1] at member position p;
    P is the longest member held so far (it grows with the context, up to ``max_positions``;
    after a decoding step rounded up by :func:`step_slots`, ``mem`` and ``part`` views of
    slot-major buffers).
    A memory that reads only the other members also keeps the last member's own sums
    (``part``, its slots only, which ``mem`` includes) and the last token's position
    (``last`` (B,)): a call that continues that member must not read them."""

    inner: Any
    mem: Tensor
    part: Tensor | None = None
    last: Tensor | None = None


def member_layout(positions: Tensor) -> Tensor:
    """Member index (B, L) of each token: a new member starts where the position does not
    continue the previous token's (a ``<cls>`` resets it to 0), the first token in member 0."""
    new = torch.ones_like(positions, dtype=torch.bool)
    new[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return member_index(new)


def _pairs(y: Tensor, T: int, N: int, shift: int) -> Tensor:
    """Rows y (rows, c) as N overlapping windows (N, 2T, c), window i holding rows
    i T + shift .. i T + shift + 2T - 1 (a view; y must hold (N + 1) T + shift rows)."""
    return y.as_strided((N, 2 * T, y.shape[1]), (T * y.stride(0), y.stride(0), y.stride(1)),
                        y.storage_offset() + shift * y.stride(0))


def _spread(full: Tensor, x: Tensor, shift: int, rows: int) -> Tensor:
    """The gradient (rows, c) of a table read through :func:`_pairs` windows from ``shift``:
    row i T + shift + r gets full[i, :, r]^T x[i] (each tile's 2T rows overlap the next
    tile's first T), written by batched products straight into it (no temporaries)."""
    N, T = x.shape[:2]
    out = x.new_empty(rows, x.shape[2])
    out[:shift].zero_()  # what the tiles do not write
    out[shift + (N + 1) * T :].zero_()
    tiles = out[shift : shift + (N + 1) * T].view(N + 1, T, -1)
    part = full.mT  # (N, 2T, T)
    torch.bmm(part[:, :T], x, out=tiles[:N])
    tiles[N].zero_()
    tiles[1:].baddbmm_(part[:, T:], x)
    return out


class _Read(torch.autograd.Function):
    """The memory's read as tile products: query tiles x (N, T, d) against the 2T rows of
    each key table from their own (:func:`_pairs`), an additive ``bias`` (B, H, nt, T, 2T)
    broadcast (N = B H nt; -1e30 off a query's band and where a column holds nothing), a
    softmax over the 2T, and the values back from the value tables' windows (one row on when
    causal: the successor of the matched key). Sources s (F and E for a memory that reads its
    own member) mix under 0/1 masks (T, 2T) per band entry, ``masks`` = (key masks, value
    masks) or None for one source. Forward and backward as a few batched products over the
    tiles, whatever W; the weights P are what the backward keeps."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor, offsets: Tensor, shape: tuple[int, ...],
                shift: int, masks: tuple | None, *tables: Tensor) -> Tensor:  # fmt: skip
        N, T = x.shape[:2]
        n = len(tables) // 2
        keys, values = tables[:n], tables[n:]
        kmask, vmask = masks if masks is not None else ((None,) * n, (None,) * n)
        scores = None
        for y, m in zip(keys, kmask, strict=True):
            s = torch.bmm(x, _pairs(y, T, N, 0).mT)  # (N, T, 2T)
            s = s if m is None else s.mul_(m)
            scores = s if scores is None else scores.add_(s)
        assert scores is not None
        # (B, H, nt, T, 2T): where and how much each band column counts, the same in every
        # head, plus the learned bias per head and offset
        scores.view(shape).add_(bias).add_(offsets[:, None])
        weights = scores.softmax(-1)
        out = None
        for y, m in zip(values, vmask, strict=True):
            w = weights if m is None else weights * m
            out = torch.bmm(w, _pairs(y, T, N, shift)) if out is None else out.baddbmm_(
                w, _pairs(y, T, N, shift))  # fmt: skip
        ctx.save_for_backward(x, weights, *tables)
        ctx.shape, ctx.shift, ctx.masks, ctx.n = shape, shift, masks, n
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weights, *tables = ctx.saved_tensors
        n, shift, N, T = ctx.n, ctx.shift, x.shape[0], x.shape[1]
        keys, values = tables[:n], tables[n:]
        kmask, vmask = ctx.masks if ctx.masks is not None else ((None,) * n, (None,) * n)
        grad = grad.contiguous()
        dw = None
        dvalues = []
        for y, m in zip(values, vmask, strict=True):
            g = torch.bmm(grad, _pairs(y, T, N, shift).mT)  # (N, T, 2T)
            g = g if m is None else g.mul_(m)
            dw = g if dw is None else dw.add_(g)
            dvalues.append(_spread(weights if m is None else weights * m, grad, shift,
                                   y.shape[0]))  # fmt: skip
        ds = torch._softmax_backward_data(dw, weights, -1, weights.dtype)
        B, H, nt = ctx.shape[:3]
        doffsets = ds.view(B, H, nt, -1).sum(2).sum(0).view(H, T, 2 * T)
        dx = None
        dkeys = []
        for y, m in zip(keys, kmask, strict=True):
            dm = ds if m is None else ds * m
            if ctx.needs_input_grad[0]:
                dx = torch.bmm(dm, _pairs(y, T, N, 0)) if dx is None else dx.baddbmm_(
                    dm, _pairs(y, T, N, 0))  # fmt: skip
            dkeys.append(_spread(dm, x, 0, y.shape[0]))
        return dx, None, doffsets, None, None, None, *dkeys, *dvalues


def _place(src: Tensor, index: Tensor, rows: int, unique: bool) -> Tensor:
    """Rows src (n, c) at rows ``index`` of a zero table (rows, c), summed where they meet;
    ``unique``: no two real tokens share a row (padding may: its rows are never read), so a
    copy does it, and its gradient is a gather (a sum sorts its indices, forward and back)."""
    out = src.new_zeros(rows, src.shape[1])
    return out.index_copy_(0, index, src) if unique else out.index_add_(0, index, src)


def _held_tables(held: MemoryState, cont: Tensor | None, B: int, first: int, R: int, d: int,
                 spare: int) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    """The counts [(2, B, R)] and the key and value tables (B H R + ``spare``, c) of a read
    whose B rows each hold one member that reads only the others: the memory ``held`` alone,
    its slots ``first`` .. ``first`` + R - 1 (less the member it ended in where a row
    continues it, ``cont``), as means (keys' over sqrt(d)), then the ``spare`` zero rows the
    last tile reaches. Why apart: the general tables sum a grid of (members + 1) rows of
    columns per batch row; a candidate after a context (one member, a batch-1 memory) needs
    the memory's columns once per batch row, written in place."""
    slots = _slots(held.mem, first, R)  # (1 or B, H, R, C)
    H, C = slots.shape[1], slots.shape[-1]
    count = slots[:, 0, :, -1]  # (1 or B, R)
    if cont is not None:  # the member the memory ended in goes on: not for these rows
        on = cont.to(slots.dtype)[:, None, None, None]  # (B, 1, 1, 1)
        part = _slots(held.part, first, R)
        count = count - part[:, 0, :, -1] * on[:, 0, 0]
    count = count.expand(B, R)
    tables = []
    for lo, c, unit in ((0, d, d**0.5), (d, C - d - 1, 1.0)):
        table = slots.new_empty(B * H * R + spare, c)
        table[B * H * R :].zero_()
        tab = table[: B * H * R].view(B, H, R, c).copy_(slots[..., lo : lo + c])
        if cont is not None:
            tab.addcmul_(part[..., lo : lo + c], on, value=-1.0)
        tab.div_((count.clamp_min(1.0) * unit)[:, None, :, None])
        tables.append(table)
    return [count.expand(2, B, R)], tables  # (members + 1, B, R), as :meth:`_mask` reads them


class _Take(torch.autograd.Function):
    """table[index]: each token's row of the read (the real tokens' rows are their own, so
    the gradient is a copy back, not a sum; padding's rows get no gradient, as its gate is
    0)."""

    @staticmethod
    def forward(ctx: Any, table: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = table.shape[0]
        return table.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, grad.shape[1]).index_copy_(0, index, grad), None


def _slots(mem: Tensor, first: int, width: int) -> Tensor:
    """Slots first .. first + width - 1 of a memory (B, H, P, C), zeros outside 0 .. P - 1."""
    lo, hi = max(first, 0), max(min(first + width, mem.shape[2]), max(first, 0))
    return F.pad(mem[:, :, lo:hi], (0, 0, lo - first, first + width - hi))


def _band(T: int, W: int, device: torch.device) -> Tensor:
    """(T, 2T) the offset D + W of query a's band entry (a, a + W + D), -1 off the band."""
    j = torch.arange(2 * T, device=device)[None] - torch.arange(T, device=device)[:, None]
    return torch.where((j >= 0) & (j <= 2 * W), j, -1)


#: The fewest slots a decoding step's memory holds (:func:`step_slots`).
STEP_SLOTS = 64


def step_slots(need: int, max_positions: int) -> int:
    """The slots (positions) a decoding step's memory buffer holds to reach position
    ``need - 1``: a power of two, at least :data:`STEP_SLOTS`, at most ``max_positions``.

    Why: a member decoded past the longest one held would grow the memory by a slot a token
    (a copy of it each time); doubling makes that a copy per doubling, and a traced step one
    graph per size. At most twice the longest member held: still not the context's length."""
    return min(max_positions, max(STEP_SLOTS, 1 << max(need - 1, 0).bit_length()))


def _step_buffer(t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, inplace: bool) -> Tensor:  # fmt: skip
    """A memory tensor (B, S, H, C) a step may write, slot-major (a row's window of slots is
    one block): ``t`` (B, H, P, C) itself where the caller gave it up (``inplace``) and it is
    such a buffer's view (:meth:`PositionMemory.step_state`), else a copy into zeros (a
    batch-1 state broadcast over B, a buffer grown, a state the caller keeps)."""
    if t is not None:
        t = t.transpose(1, 2)  # (B, P, H, C)
        plain = t.shape == shape and t.dtype == dtype and t.is_contiguous()
        if inplace and plain and t.device == device:
            return t
    out = torch.zeros(shape, dtype=dtype, device=device)
    if t is not None:
        out[:, : t.shape[1]] = t
    return out


def step_mix(out: Tensor, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
             buffers: tuple[Tensor, ...], weights: tuple[Tensor, ...], max_positions: int
             ) -> Tensor:  # fmt: skip
    """One token per row through the memory: the inner core's output ``out`` (B, H, dv) mixed
    with the memory's read for q, k, v (B, H, ·) at member ``positions`` (B,) (``keep`` (B,):
    False at a pad, which neither reads nor enters), the read as :meth:`PositionMemory._read`
    defines it; a function of tensors with no host check (a traced step's graph).

    ``buffers``: the memory ``mem`` (B, S, H, C), slot-major, slot p the sum of [k | v | 1]
    at position p (S > every position that enters: :meth:`PositionMemory.step_buffers`),
    and, for a memory that reads only the other members, the sums of the member being decoded
    (``part``, zero where the token does not continue it); both updated in place.
    ``weights``: the offset logits (H, 2W + 1), the gate's weights (H, d) and bias (H,).

    The token enters slot p first; it then reads the 2W + 1 slots around its position: keys at
    p + D, values at p + D + 1 (causal: the successor), from ``mem`` less ``part`` (the other
    members), or, reading its own member too, from ``mem`` itself, the token included (what
    the parallel form's F and E tables hold at the band entries that read them)."""
    mem, part = buffers[0], (buffers[1] if len(buffers) > 1 else None)
    offsets, gate_weight, gate_bias = weights
    B, S, H, C = mem.shape
    d, dv = q.shape[-1], v.shape[-1]
    W = (offsets.shape[-1] - 1) // 2
    valid = keep & (positions >= 0) & (positions < max_positions)  # (B,)
    row = torch.arange(B, device=positions.device)
    add = torch.cat([k, v, torch.ones_like(v[..., :1])], -1) * valid[:, None, None]  # (B, H, C)
    # the token enters slot p first, in place (an index_put before the reads is what a
    # compiler keeps in place: written after them, inductor copied the whole buffer)
    slot = (row, positions.clamp(0, S - 1))
    mem.index_put_(slot, add, accumulate=True)
    if part is not None:
        part.index_put_(slot, add, accumulate=True)
    near = positions[:, None] + torch.arange(-W, W + 2, device=positions.device)  # (B, 2W + 2)
    at = (row[:, None] * S + near.clamp(0, S - 1)).view(-1)  # rows of the (B S, H C) views

    def window(t: Tensor) -> Tensor:  # (B, 2W + 2, H, C): slots p - W .. p + W + 1
        return t.view(B * S, H * C).index_select(0, at).view(B, 2 * W + 2, H, C)

    table = window(mem)  # its own member up to t (itself included) and the others
    if part is not None:  # the other members alone
        table = table - window(part)
    count = table[..., -1]  # (B, 2W + 2, H)
    # a slot outside 0 .. S - 1 holds nothing (its clamped row is weighed 0 below)
    has = (count > 0.5) & ((near >= 0) & (near < S))[:, :, None]
    held = has[:, :-1] & has[:, 1:]  # (B, 2W + 1, H): a key at p + D and a value at p + D + 1
    n = count.clamp_min(1.0)  # sums to means
    scores = (table[:, :-1, :, :d] * q[:, None]).sum(-1) / (n[:, :-1] * d**0.5) + offsets.T
    weights_d = scores.masked_fill(~held, -1e30).softmax(1)  # (B, 2W + 1, H)
    read = ((weights_d / n[:, 1:])[..., None] * table[:, 1:, :, d : d + dv]).sum(1)  # (B, H, dv)
    gate = torch.sigmoid((q * gate_weight).sum(-1) + gate_bias)  # (B, H)
    gate = gate * (held.any(1) & valid[:, None])  # nothing in reach: the core's output
    return torch.lerp(out, read, gate[..., None])


@register("memory")
class PositionMemory(CoreWrapper):
    """Wraps an attention core (``inner``) with the member-position memory described above
    (``PerformerConfig.position_memory``); it finds members where positions restart, so it
    needs member positions."""

    order = 1  # around any core, the window included
    needs_positions = "member"
    label = "a position memory"
    # a decoding step is :func:`step_mix` (here and in ``model.decode``'s traced step)
    traced = True
    # a bias per offset and the gate's weights and bias: logits, never decayed towards 0
    no_decay = ("offset_logits", "gate_weight", "gate_bias")
    # Aligned coordinates, when a call gives them (``coordinates`` (B, L): a family context's
    # homologs placed on a reference, -1 for a token that enters no position), key the tokens'
    # slots instead of their member positions; members are still told apart by their rotary
    # positions (a ``<cls>`` restarts them).
    reads_coordinates = True

    @classmethod
    def enabled(cls, config) -> bool:  # noqa: ANN001 - a PerformerConfig
        return bool(config.position_memory)

    @classmethod
    def from_config(  # noqa: ANN001 - a PerformerConfig
        cls, config, inner: AttentionCore | None = None
    ) -> PositionMemory:
        assert inner is not None
        return cls(inner, config.heads, config.head_dim, config.position_memory,
                   config.memory_window, reads_own=config.memory_reads_own)  # fmt: skip

    @classmethod
    def extra_numel(cls, config) -> int:  # noqa: ANN001
        return config.heads * (2 * config.memory_window + 2 + config.head_dim)

    def __init__(
        self, inner: AttentionCore, heads: int, dim_head: int, max_positions: int, window: int,
        *, reads_own: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.inner = inner
        self.causal = inner.causal
        self.max_positions = max_positions
        self.window = window
        # whether a token also reads its own member (the models before 0.7; see the module
        # docstring): with it off a lone sequence reads nothing and gets its core's output
        self.reads_own = reads_own
        # b_h(D) = offset_logits[h, D + W], a learned bias per offset; 0 at first.
        self.offset_logits = nn.Parameter(torch.zeros(heads, 2 * window + 1))
        self.gate_weight = nn.Parameter(torch.zeros(heads, dim_head))
        self.gate_bias = nn.Parameter(torch.full((heads,), -1.0))

    def _layout(self, positions: Tensor, keep: Tensor, keys: Tensor | None, heads: int,
                dtype: torch.dtype) -> _Layout | None:  # fmt: skip
        """Where every token goes in the tables of :meth:`_read` (None: no token enters a
        position): a function of the positions and the padding alone, the same in every layer
        (:meth:`attend` shares it across the layers of one batch)."""
        B, L = positions.shape
        W = self.window
        device = positions.device
        member = member_layout(positions)
        # coordinates that are the member positions wherever they place a token repeat no
        # column within a member, as member positions do
        moved = torch.zeros((), dtype=torch.long, device=device)
        if keys is not None:
            moved = ((keys != positions) & (keys >= 0)).any().long()
            positions = keys
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        low = torch.where(valid, positions, self.max_positions).min()
        stats = torch.stack([low, torch.where(valid, positions, -1).max(), member.max(), moved])
        base, top, last, repeats = stats.tolist()
        if top < 0:
            return None
        M, P = last + 1, top - base + 1
        # a tile of T query columns reads the 2T table rows from its first: the band of
        # 2W + 1 keys (and their successors' values) around each of its queries (T >= 2W)
        T = max(2 * W, 1)
        # a row: its queries, their keys W columns right, the last one's successor, and a
        # column for padding tokens (never read, never in the state)
        R = -(-(P + 2 * W + 2) // T) * T
        # rows by member, then batch row, then head: the sums over members are one product,
        # and the (M + 1)-th member's rows (nothing in them) are what the last tiles reach
        row = member * B + torch.arange(B, device=device)[:, None]  # (B, L)
        rows = (row[:, None] * heads + torch.arange(heads, device=device)[:, None]) * R
        col = (positions - base).clamp(0, R - 1 - W)[:, None]  # (B, 1, L)
        dump = rows + R - 1
        keyed = torch.where(valid[:, None], rows + col + W, dump).view(-1)
        asked = torch.where(valid[:, None], rows + col, dump).view(-1)
        # the counts are the same in every head: (M + 1, B, R), no gradient
        slot = torch.where(valid, row * R + col[:, 0], row * R + R - 1)
        own = torch.zeros((M + 1) * B * R, dtype=dtype, device=device)
        own = own.index_add_(0, torch.where(valid, slot + W, slot).view(-1),
                             valid.to(dtype).view(-1))  # fmt: skip
        return _Layout(valid, base, top, M, P, T, R, keyed, asked, own.view(M + 1, B, R), slot,
                       member, not repeats)  # fmt: skip

    def _sources(self) -> tuple[int, tuple | None]:
        """The tables a read mixes (1, or 2: F and E for a causal memory that reads its own
        member) and, for 2, which band entries read each: (key masks, value masks) as the
        offsets D + W that read F (keys at D <= 0, values at D < 0: the token's own member,
        up to t) and E (the rest)."""
        if self.causal and self.reads_own:
            W = self.window
            return 2, ((range(0, W + 1), range(W + 1, 2 * W + 1)),
                       (range(0, W), range(W, 2 * W + 1)))  # fmt: skip
        return 1, None

    def _mask(self, lay: _Layout, counts: list[Tensor], heads: int
              ) -> tuple[Tensor, Tensor, tuple | None]:  # fmt: skip
        """The additive bias (M B, 1, R / T, T, 2T) of the tile products (0 where a query's band
        column holds a key and its value, -1e30 elsewhere), whether a token has any such
        column (B, 1, L, 1), and the sources' masks (T, 2T) for :class:`_Read`, from the
        tables' counts (M + 1, B, R) (the same in every head)."""
        M, B, R = counts[0].shape[0] - 1, counts[0].shape[1], counts[0].shape[2]
        T, W, shift = lay.T, self.window, int(self.causal)
        band = _band(T, W, counts[0].device)  # (T, 2T)
        _, which = self._sources()
        held = []
        for count in counts:  # the 2T columns each tile reads, from its first (and one on)
            h = F.pad(count[:M] > 0.5, (0, 2 * T + 1))
            held.append([h[..., s : s + R + T].unfold(-1, 2 * T, T)[..., None, :]
                         for s in (0, shift)])  # (M, B, R / T, 1, 2T)  # fmt: skip
        inband = band >= 0
        if which is None:
            ok = held[0][0] & held[0][1] & inband
            masks = None
        else:
            select = [[torch.isin(band, torch.tensor(list(r), device=band.device))
                       for r in rs] for rs in which]  # fmt: skip
            key = held[0][0] & select[0][0] | held[1][0] & select[0][1]
            value = held[0][1] & select[1][0] | held[1][1] & select[1][1]
            ok = key & value & inband
            dtype = counts[0].dtype
            masks = tuple(tuple(s.to(dtype) for s in sel) for sel in select)
        bias = torch.zeros(ok.shape, dtype=counts[0].dtype, device=ok.device)
        bias = bias.masked_fill_(~ok, -1e30).view(M * B, 1, R // T, T, 2 * T)
        L = lay.valid.shape[1]
        reach = ok.any(-1).view(-1)[lay.slot] & lay.valid
        return bias, reach.view(B, 1, L, 1), masks

    def _continues(self, positions: Tensor, held: MemoryState | None) -> Tensor | None:
        """(B,) whether each row's first token continues the member the memory ``held`` ended
        in (None: a memory that reads the own member, or none held): a member goes on where
        the position continues the last token's."""
        if held is None or held.last is None:
            return None
        return positions[:, 0] == held.last + 1

    def _last_part(self, positions: Tensor, held: MemoryState | None, cont: Tensor | None,
                   grown: Tensor | None) -> Tensor:  # fmt: skip
        """The sums of the member the tokens end in (B, H, slots, C): ``grown`` (its sums
        over the tokens, None: none entered), plus what ``held`` had of it when the tokens
        continue it."""
        B = positions.shape[0]
        parts = [] if grown is None else [grown]
        if cont is not None and held is not None and held.part is not None:
            alone = cont & (member_layout(positions)[:, -1] == 0)  # one member, continued
            parts.append(held.part * alone.to(held.part.dtype)[:, None, None, None])
        if not parts:
            return held.part.new_zeros(B, *held.part.shape[1:2], 0, held.part.shape[-1])
        size = max(p.shape[2] for p in parts)
        total = F.pad(parts[0], (0, 0, 0, size - parts[0].shape[2]))
        for p in parts[1:]:
            total = total + F.pad(p, (0, 0, 0, size - p.shape[2]))
        return total

    def _read(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
              held: MemoryState | None, want_state: bool, keys: Tensor | None = None,
              shared: dict | None = None
              ) -> tuple[Tensor, Tensor, MemoryState | None]:  # fmt: skip
        """The memory's output (B, H, L, dv), whether any entry was in reach (B, 1, L, 1), and
        (``want_state``) the memory after the tokens (a :class:`MemoryState` whose ``inner``
        is None), ``held`` the one before them. ``keys``: the positions the columns are
        keyed by (aligned coordinates), when not the member ``positions``; members are found
        where the member positions restart either way. ``shared``: where the layout of a
        stateless read is kept for the next layer's (the same tokens).

        How: each member becomes a row of R columns (its positions from the lowest in the
        chunk, keys W columns to the right of their queries), the rows of every member, head
        and batch row one after another. Per column, E holds the sums of [k | v] over the
        members before a row's (the state's included), F over those up to it (its own
        included); a memory that reads only the other members reads E at every offset
        (masked: the row's sums without its own member), one that reads its own member
        (models before 0.7) F at offsets D <= 0, where its own keys j <= t sit, and E ahead.
        Reading the columns around each query is then a tile product per table, a softmax
        over the 2T columns each tile reaches (off the band: weight 0), and the values back
        through the same tiles (:class:`_Read`): a few batched products whatever W. Rows of
        one member that read only the other members (candidates after a context) read the
        memory held alone, its columns copied once per row (:func:`_held_tables`), and read
        nothing when it is empty (a lone sequence)."""
        B, H, L, d = q.shape
        W, causal, dv, reads_own = self.window, self.causal, v.shape[-1], self.reads_own
        C = d + dv + 1
        cached = shared is not None and held is None and "layout" in shared
        lay = shared["layout"] if cached else self._layout(positions, keep, keys, H, q.dtype)
        if shared is not None and held is None:
            shared["layout"] = lay
        cont = self._continues(positions, held)
        if lay is None:  # nothing enters or reads: the memory stays as it was
            new = None
            if want_state:
                mem = q.new_zeros(B, H, 0, C) if held is None else held.mem
                new = MemoryState(None, mem)
                if causal and not reads_own:
                    held = held if held is not None else new
                    new = MemoryState(None, mem, self._last_part(positions, held, cont, None),
                                      positions[:, -1])  # fmt: skip
            return q.new_zeros(B, H, L, dv), q.new_zeros(B, 1, L, 1, dtype=torch.bool), new
        base, top, M, P, T, R, own = lay.base, lay.top, lay.M, lay.P, lay.T, lay.R, lay.own
        size = M * B * H * R
        # member positions never repeat within a member; aligned coordinates may
        unique = lay.unique
        # one member a row reads none of these tokens' sums: a candidate after a context reads
        # the memory held alone, a lone sequence nothing (unless the offsets are trained: they
        # get the zero gradient a read gives, never none)
        trained = torch.is_grad_enabled() and self.offset_logits.requires_grad
        if M == 1 and not reads_own and (held is not None or not trained):
            grids = [_place(z.reshape(-1, z.shape[-1]), lay.keyed, size, unique).view(
                M, B, H, R, -1) for z in (k, v)] if want_state else []  # fmt: skip
            if not trained and (held is None or held.mem.shape[2] == 0):
                out = q.new_zeros(B, H, L, dv)
                reach = q.new_zeros(B, 1, L, 1, dtype=torch.bool)
            else:  # a candidate after a context: the memory held, alone
                counts, tables = _held_tables(held, cont, B, base - W, R, d, T + 1)
                mask = self._mask(lay, counts, H)
                out, reach = self._tiles(q, lay, mask, tables, unique), mask[1]
        else:
            # the members before each row's (E) and, reading its own member, up to it (F)
            before = torch.ones(M + 1, M + 1, dtype=q.dtype, device=q.device).tril(-1)
            count = (before @ own.view(M + 1, B * R)).view(M + 1, B, R)
            if held is not None:
                slots = _slots(held.mem, base - W, R)  # (B or 1, H, R, C)
                if cont is not None:  # the member the memory ended in goes on: not for row 0
                    going = _slots(held.part, base - W, R) * cont.to(q.dtype)[:, None, None, None]
                    slots = slots - going
                count = count + slots[:, 0, :, -1]
                if cont is not None:
                    count[1:] += going[:, 0, :, -1]
            if not causal:  # every member of the row (or every other one), at every offset
                total = own.sum(0, keepdim=True)
                count = total.expand(M + 1, B, R) if reads_own else total - own
            counts = [count + own, count] if causal and reads_own else [count]
            if cached and "mask" in shared:
                mask = shared["mask"]
            else:
                mask = self._mask(lay, counts, H)
                if shared is not None and held is None:
                    shared["mask"] = mask
            keys_t, values_t, grids = [], [], []
            for i, (z, c, out_tables) in enumerate(((k, d, keys_t), (v, dv, values_t))):
                Gz = _place(z.reshape(-1, c), lay.keyed, size + B * H * R, unique)
                Gz = Gz.view(M + 1, B, H, R, c)
                grids.append(Gz)
                if causal:  # E: one product over the members (a cumsum is no faster)
                    Ez = (before @ Gz.view(M + 1, -1)).view(M + 1, B, H, R, c)
                    if held is not None:
                        Ez = Ez + slots[None, :, :, :, i * d : i * d + c]
                        if cont is not None:
                            Ez[1:] += going[None, :, :, :, i * d : i * d + c]
                    tabs = [Ez + Gz, Ez] if reads_own else [Ez]
                else:
                    total = Gz.sum(0, keepdim=True)
                    tabs = [total.expand(M + 1, B, H, R, c) if reads_own else total - Gz]
                # means; keys' carry the scores' 1 / sqrt(d)
                unit = d**0.5 if i == 0 else 1.0
                for tab, cnt in zip(tabs, counts, strict=True):
                    out_tables.append((tab / (cnt.clamp_min(1.0) * unit)[:, :, None, :, None]
                                       ).view(-1, c))  # fmt: skip
            out, reach = self._tiles(q, lay, mask, keys_t + values_t, unique), mask[1]
        if not want_state:
            return out, reach, None
        mem = None if held is None else held.mem
        added = torch.cat([  # positions base .. top
            grids[0][..., W : W + P, :].sum(0), grids[1][..., W : W + P, :].sum(0),
            own[..., W : W + P].sum(0)[:, None, :, None].expand(B, H, P, 1)], -1)
        size = max(top + 1, 0 if mem is None else mem.shape[2])
        new_mem = F.pad(added, (0, 0, base, size - top - 1))
        if mem is not None:
            new_mem = new_mem + F.pad(mem, (0, 0, 0, size - mem.shape[2]))
        if not causal or reads_own:
            return out, reach, MemoryState(None, new_mem)
        rows = torch.arange(B, device=q.device)
        last = lay.member[:, -1]  # each batch row's last member
        grown = torch.cat([  # (B, H, P, C): that member's sums over these tokens
            grids[0][last, rows, :, W : W + P], grids[1][last, rows, :, W : W + P],
            own[last, rows, W : W + P][:, None, :, None].expand(B, H, P, 1)], -1)
        part = self._last_part(positions, held, cont, F.pad(grown, (0, 0, base, 0)))
        return out, reach, MemoryState(None, new_mem, part, positions[:, -1])

    def _tiles(self, q: Tensor, lay: _Layout, mask: tuple, tables: list[Tensor], unique: bool
               ) -> Tensor:  # fmt: skip
        """The read (B, H, L, dv) of the queries q (B, H, L, d) from the key tables, then the
        value tables (rows of M B H R columns, then the zero rows the last tile reaches), under
        ``mask`` (:meth:`_mask`): each token's query placed in its column, the tile products
        (:class:`_Read`), each token's row back."""
        B, H, L, d = q.shape
        M, T, R, dv = lay.M, lay.T, lay.R, tables[-1].shape[-1]
        x = _place(q.reshape(-1, d), lay.asked, M * B * H * R, unique).view(-1, T, d)
        band = _band(T, self.window, q.device)
        offsets = F.pad(self.offset_logits.to(q.dtype), (0, 1))[:, band]  # (H, T, 2T)
        bias, _, masks = mask
        read = _Read.apply(x, bias, offsets, (M * B, H, R // T, T, 2 * T), int(self.causal),
                           masks, *tables)  # fmt: skip
        return (_Take.apply(read.view(-1, dv), lay.asked) if unique else
                read.view(-1, dv).index_select(0, lay.asked)).view(B, H, L, dv)  # fmt: skip

    def _read_chunks(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
                     held: MemoryState | None, want_state: bool, keys: Tensor | None = None,
                     shared: dict | None = None
                     ) -> tuple[Tensor, Tensor, MemoryState | None]:  # fmt: skip
        """:meth:`_read` over the tokens in chunks of :data:`READ_CHUNK`, the memory carried
        from one to the next (causal), so a 64k-token context needs the memory of one chunk."""
        L = q.shape[2]
        # a training row's backward keeps every chunk's tables anyway: chunks would bound
        # nothing there, only add work (the gradients' zero-filled slices, the carried state)
        trains = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                               or v.requires_grad)
        if not self.causal or L <= READ_CHUNK or trains:
            return self._read(q, k, v, positions, keep, held, want_state, keys, shared)
        outs, seens = [], []
        for start in range(0, L, READ_CHUNK):
            t = slice(start, start + READ_CHUNK)
            out, seen, held = self._read(q[:, :, t], k[:, :, t], v[:, :, t], positions[:, t],
                                         keep[:, t], held, want_state or start + READ_CHUNK < L,
                                         None if keys is None else keys[:, t])  # fmt: skip
            outs.append(out)
            seens.append(seen)
        return torch.cat(outs, 2), torch.cat(seens, 2), held

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        state: MemoryState | None = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        positions: Tensor | int | None = None,
        coordinates: Tensor | None = None,
    ) -> tuple[Tensor, MemoryState | None]:
        """The inner core's output mixed with the memory's read (see the module docstring);
        the cores' call, whose rotary ``positions`` (any form of
        :func:`~protein_performer.model.rotary.as_positions`) place the tokens, and
        ``coordinates`` (B, L), when given, key them in the memory (:attr:`reads_coordinates`)."""
        B, H, L, _ = q.shape
        out, inner_state = self.inner(
            q,
            k,
            v,
            key_padding_mask,
            None if state is None else state.inner,
            keep_state=keep_state,
            inplace=inplace,
            positions=positions,
        )
        pos = as_positions(positions, B, L, q.device)
        keep = real_tokens(key_padding_mask, B, L, q.device)
        if state is not None and L == 1 and coordinates is None:  # a decoding step
            mixed, mem = self._step(out, q, k, v, pos[:, 0], keep[:, 0], state, inplace)
            return mixed, (mem._replace(inner=inner_state) if keep_state else None)
        dtype = _compute_dtype(q)
        shared = None if state is not None else self._shared(
            positions, key_padding_mask, coordinates, (B, H, L, dtype, q.device))
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y, vv = q.to(dtype), k.to(dtype), v.to(dtype)
            keys = None if coordinates is None else coordinates.to(pos).expand(B, L)
            held = None if state is None else MemoryState(
                None, state.mem.to(dtype), None if state.part is None else state.part.to(dtype),
                state.last)  # fmt: skip
            mem_out, seen, mem = self._read_chunks(
                x, y, vv, pos, keep, held, keep_state, keys, shared)
            gate = torch.sigmoid(  # (B, H, L, 1)
                x @ self.gate_weight.to(dtype)[:, :, None]
                + self.gate_bias.to(dtype)[:, None, None]
            )
            gate = gate * seen.to(dtype)  # no entry in reach: the core's output alone
            mixed = torch.lerp(out.to(dtype), mem_out, gate)
        new = mem._replace(inner=inner_state) if keep_state and mem is not None else None
        return mixed.to(q.dtype), new

    def step_weights(self) -> tuple[Tensor, ...]:
        """The learned tensors :func:`step_mix` reads, in its order."""
        return self.offset_logits, self.gate_weight, self.gate_bias

    def step_buffers(self, state: MemoryState, positions: Tensor, keep: Tensor, inplace: bool,
                     dtype: torch.dtype) -> tuple[Tensor, ...]:  # fmt: skip
        """The host side of a step at ``positions`` (B,) (``keep`` (B,): False at a pad): the
        tensors :func:`step_mix` writes, (mem,) or (mem, part), each (B, S, H, C) in ``dtype``,
        S from :func:`step_slots` (grown, by doubling, to hold every position that enters), the
        state's own where the caller gave it up (``inplace``) and they fit, else copies; the
        decoded member's sums zeroed in the rows whose token does not continue it (a ``<cls>``,
        a jump)."""
        mem = state.mem
        B, (H, C) = positions.shape[0], (mem.shape[1], mem.shape[3])
        entering = torch.where(keep & (positions < self.max_positions), positions, -1)
        need = max(mem.shape[2], int(entering.max()) + 1)
        shape = (B, step_slots(need, self.max_positions), H, C)
        device = positions.device
        mem = _step_buffer(mem, shape, dtype, device, inplace)
        if self.reads_own:
            return (mem,)
        part = _step_buffer(state.part, shape, dtype, device, inplace)
        cont = self._continues(positions[:, None], state)
        if cont is None:  # no member held yet: nothing to continue
            cont = torch.zeros_like(keep)
        # on CPU a look is cheap and skips a pass over the buffer; on a GPU it would be a sync
        if device.type != "cpu" or not bool(cont.all()):
            part.mul_(cont.to(dtype)[:, None, None, None])
        return mem, part

    def step_mix(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                 keep: Tensor, buffers: tuple[Tensor, ...], weights: tuple[Tensor, ...]
                 ) -> Tensor:  # fmt: skip
        """:func:`step_mix` with this memory's ``max_positions``."""
        return step_mix(out, q, k, v, positions, keep, buffers, weights, self.max_positions)

    def step_state(self, inner: Any, buffers: tuple[Tensor, ...], positions: Tensor
                   ) -> MemoryState:  # fmt: skip
        """The state after a step: the inner core's and the buffers :func:`step_mix` wrote, as
        the (B, H, S, C) views a state holds (the next step takes them back as they are)."""
        mem, *part = (t.transpose(1, 2) for t in buffers)
        if self.reads_own:
            return MemoryState(inner, mem)
        return MemoryState(inner, mem, part[0], positions)

    def _step(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
              keep: Tensor, state: MemoryState, inplace: bool) -> tuple[Tensor, MemoryState]:
        """:meth:`attend` of one token per row after ``state`` (a decoding step): the three
        ``step_*`` calls the traced step makes too, on (B, H, 1, ·) tensors."""
        dtype = _compute_dtype(q)
        with torch.autocast(device_type=q.device.type, enabled=False):
            buffers = self.step_buffers(state, positions, keep, inplace, dtype)
            weights = tuple(t.to(dtype) for t in self.step_weights())
            x, y, vv, o = (t.to(dtype).select(2, 0) for t in (q, k, v, out))
            mixed = self.step_mix(o, x, y, vv, positions, keep, buffers, weights)
        return mixed[:, :, None].to(q.dtype), self.step_state(None, buffers, positions)

    def _shared(self, positions: Tensor | int | None, mask: Tensor | None,
                coordinates: Tensor | None, shape: tuple) -> dict | None:  # fmt: skip
        """Where a stateless read keeps its layout for the next layer's: a dict held by the
        ``positions`` tensor (every layer of one forward gets the same one), fresh when
        anything the layout depends on differs (None: positions not a tensor, or inference
        tensors)."""
        given = [t for t in (positions, mask, coordinates) if t is not None]
        if not isinstance(positions, Tensor) or any(t.is_inference() for t in given):
            return None  # no version counter to tell a changed tensor: no sharing
        # (a layout worked out under inference mode holds inference tensors: not for autograd)
        token = (tuple(t._version for t in given), shape, self.max_positions, self.window,
                 self.causal, self.reads_own, torch.is_inference_mode_enabled())  # fmt: skip
        held = getattr(positions, "_memory_layout", None)
        if held is not None and held[0] is mask and held[1] is coordinates and held[2] == token:
            return held[3]
        shared: dict = {}
        positions._memory_layout = (mask, coordinates, token, shared)
        return shared

    def attention_map(self, q, k, key_padding_mask=None, query_slice=None) -> Tensor:
        """The inner core's rows (the memory mixes values by position, not a map over keys)."""
        return self.inner.attention_map(q, k, key_padding_mask, query_slice)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, window={self.window}"
