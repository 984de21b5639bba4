"""A memory keyed by position within a family member, mixed into any attention core.

Why: in a family row ``<cls> m1 <eos> <cls> m2 <eos> ...`` with member positions (rotary
restarting at every ``<cls>``), homologs line up roughly by position, and copying from them is
what exact attention learns first (issue 30). A linear-attention cousin of MSA column
attention keeps, per head, one sum of [k | v | 1] per member position p over the keys seen at
p, so each position has a mean key K[p] and a mean value V[p]. A query at position p attends
over the 2W + 1 positions around it,

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
empty memory) the output is the core's.

The parallel form lays each member out as a row of columns (one per position), so a token's
reads are its member's columns around its position in two prefix tables over the members (up
to its own, and before it), and reading 2W + 1 neighbouring columns is a band of small matrix
products with a hand-written backward (:meth:`PositionMemory._read`); the recurrent state is
the last prefix, which is what it accumulates one token at a time.
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
    in the tables (B H L,), the tokens per column ``own`` (B, M, R) and the row each token's
    output is read from (``index``)."""

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
    index: Tensor


class MemoryState(NamedTuple):
    """The mixed core's state: the inner core's (``inner``) and the position memory
    ``mem`` (B, H, P, d + dv + 1), slot p holding the sum of [k | v | 1] at member position p;
    P is the longest member held so far (it grows with the context, up to ``max_positions``).
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


def _band(full: Tensor, w: int) -> Tensor:
    """Row a's columns a .. a + w - 1 of tile products full (N, T, 2T), as (N, T, w)."""
    N, T = full.shape[:2]
    full = full.contiguous()  # (a, a + j) sits at a (2T + 1) + j: a strided view, no copy
    return full.as_strided((N, T, w), (2 * T * T, 2 * T + 1, 1), full.storage_offset())


def _unband(a: Tensor, widths: tuple[int, ...]) -> Tensor:
    """Bands a (N, T, sum of widths), side by side, as the matrices of :func:`_band`, zero off
    their bands, side by side in one contiguous (N, T, 2T x segments) tensor (the batched
    products run fastest on it; a view per segment)."""
    N, T = a.shape[:2]
    S = 2 * T * len(widths)
    full = a.new_zeros(N, T, S)
    at = 0
    for s, w in enumerate(widths):
        full.as_strided((N, T, w), (T * S, S + 1, 1), 2 * T * s).copy_(a[..., at : at + w])
        at += w
    return full


def _widths(segments: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(width for _, width in segments)


class _Scores(torch.autograd.Function):
    """out[i, a, :] = the bands x[i, a] . y[i T + a + shift_s + j], j < width_s, of each
    segment s, side by side: queries in tiles x (N, T, c) against the rows of a table y
    (rows, c) around their own, each tile against the 2T rows it reaches (width <= T + 1),
    forward and back as batched products."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, segments: tuple[tuple[int, int], ...], y: Tensor
                ) -> Tensor:  # fmt: skip
        ctx.save_for_backward(x, y)
        ctx.segments = segments
        N, T = x.shape[:2]
        return torch.cat([_band(x @ _pairs(y, T, N, shift).mT, width)
                          for shift, width in segments], -1)  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, y = ctx.saved_tensors
        full = _unband(grad, _widths(ctx.segments))
        dx = _products(full, ctx.segments, y) if ctx.needs_input_grad[0] else None
        return dx, None, _spread(full, x, ctx.segments, y)


class _Apply(torch.autograd.Function):
    """out[i, a] = sum_s sum_j a[i, a, j_s] y[i T + a + shift_s + j]: the values back
    through bands laid out as :class:`_Scores` lays them (its adjoint in x), forward and
    back."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, segments: tuple[tuple[int, int], ...], y: Tensor
                ) -> Tensor:  # fmt: skip
        full = _unband(a, _widths(segments))
        ctx.save_for_backward(full, y)
        ctx.segments = segments
        return _products(full, segments, y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        full, y = ctx.saved_tensors
        N, T = full.shape[:2]
        grad = grad.contiguous()
        da = None
        if ctx.needs_input_grad[0]:
            da = torch.cat([_band(grad @ _pairs(y, T, N, shift).mT, width)
                            for shift, width in ctx.segments], -1)  # fmt: skip
        return da, None, _spread(full, grad, ctx.segments, y)


def _products(full: Tensor, segments: tuple[tuple[int, int], ...], y: Tensor) -> Tensor:
    """sum_s full_s @ (the 2T rows of y each tile reaches from shift_s), full as
    :func:`_unband` lays it out: (N, T, c)."""
    N, T = full.shape[:2]
    out = None
    for s, (shift, _) in enumerate(segments):
        part = full[..., 2 * T * s : 2 * T * (s + 1)]
        pairs = _pairs(y, T, N, shift)
        out = part @ pairs if out is None else out.baddbmm_(part, pairs)
    assert out is not None
    return out


def _spread(full: Tensor, x: Tensor, segments: tuple[tuple[int, int], ...], y: Tensor
            ) -> Tensor:  # fmt: skip
    """The gradient of the table y (rows, c) of the band products: row i T + shift_s + r
    gets full_s[i, :, r]^T x[i] (each tile's 2T rows overlap the next tile's first T),
    written by batched products straight into it (no temporaries)."""
    N, T = x.shape[:2]
    out = y.new_empty(y.shape)
    first = segments[0][0]
    out[:first].zero_()  # what the first segment's tiles do not write
    out[first + N * T :].zero_()
    for s, (shift, _) in enumerate(segments):
        part = full[..., 2 * T * s : 2 * T * (s + 1)].mT  # (N, 2T, T)
        tiles = out[shift : shift + (N + 1) * T].view(N + 1, T, -1)
        if s == 0:
            torch.bmm(part[:, :T], x, out=tiles[:N])
        else:
            tiles[:N].baddbmm_(part[:, :T], x)
        tiles[1:].baddbmm_(part[:, T:], x)
    return out


def _slots(mem: Tensor, first: int, width: int) -> Tensor:
    """Slots first .. first + width - 1 of a memory (B, H, P, C), zeros outside 0 .. P - 1."""
    lo, hi = max(first, 0), max(min(first + width, mem.shape[2]), max(first, 0))
    return F.pad(mem[:, :, lo:hi], (0, 0, lo - first, first + width - hi))


@register("memory")
class PositionMemory(CoreWrapper):
    """Wraps an attention core (``inner``) with the member-position memory described above
    (``PerformerConfig.position_memory``); it finds members where positions restart, so it
    needs member positions."""

    order = 1  # around any core, the window included
    needs_positions = "member"
    label = "a position memory"
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
        W, causal = self.window, self.causal
        device = positions.device
        member = member_layout(positions)
        if keys is not None:
            positions = keys
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        low = torch.where(valid, positions, self.max_positions).min()
        stats = torch.stack([low, torch.where(valid, positions, -1).max(), member.max()])
        base, top, last = stats.tolist()
        if top < 0:
            return None
        M, P = last + 1, top - base + 1
        # a tile of T query positions reads the 2T columns from its first on, a band of
        # w = W + 1 (causal, own member read: F, then E) or 2W + 1 (one table) of them per
        # query (w <= T + 1)
        T = max(W + 1 if causal and self.reads_own else 2 * W, 1)
        R = (-(-P // T) + 2) * T  # a row: its query tiles, then the keys' overhang
        # M + 1 rows a (batch row, head): row 0 for the state (or nothing) before the first
        # member, so a member's E (what the members before it hold) is the F of the row above
        rows = (torch.arange(B * heads, device=device).view(B, heads, 1) * (M + 1)
                + member[:, None] + 1) * R  # fmt: skip
        col = (positions - base).clamp(0, R - 1 - W)[:, None]  # (B, 1, L)
        # a padding token goes to its row's last column: never read, never in the state
        dump = rows + R - 1
        keyed = torch.where(valid[:, None], rows + col + W, dump).view(-1)
        asked = torch.where(valid[:, None], rows + col, dump).view(-1)
        # the counts are the same in every head: (B, M + 1, R), no gradient
        slot = (torch.arange(B, device=device)[:, None] * (M + 1) + member + 1) * R + col[:, 0]
        own = torch.zeros(B * (M + 1) * R, dtype=dtype, device=device)
        own = own.index_add(0, (slot + W).view(-1), valid.to(dtype).view(-1))
        # the queries' tiles start at the first member's row (R rows in)
        index = torch.where(valid[:, None], rows + col - R, 0).view(-1)
        return _Layout(valid, base, top, M, P, T, R, keyed, asked, own.view(B, M + 1, R), index)

    def _reach(self, lay: _Layout, count: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        """Which of each query tile's band columns hold both a key and a value (N, T, 2W + 1)
        (the same in every head), and whether a token has any (B, H, L, 1), from the
        tables' counts (B, M + 1, R) (members up to each row's, the state's included; masked:
        all of the row's, or all but its own)."""
        W, causal = self.window, self.causal
        B, rows, R = count.shape
        T = lay.T
        n = 2 * W + 1 + causal  # causal: one column more, the successor of p_t + W
        nt = rows * R // T  # tiles per (batch row, head)
        held = count.reshape(B, rows * R) > 0.5
        # a query reads F in its own row and (causal) E in the row above, R columns back
        own = not causal or self.reads_own
        have = ([F.pad(held, (0, n - 1))] if own else []) + (
            [F.pad(held, (R, n - 1))] if causal else [])  # fmt: skip
        have = [h[:, : rows * R + n - 1].unfold(1, n, 1).view(B, 1, nt, T, n) for h in have]
        if causal and own:  # keys at offsets 0..W from F, W+1..2W from E; values one right
            ahead = torch.arange(n, device=count.device) > W
            reach_cols = torch.where(ahead, have[1], have[0])
        else:  # one table: E (causal), or the row's (masked)
            reach_cols = have[0]
        # key and value both held, the same in every head; the tiles of the first row of
        # the first (batch row, head) ask nothing, nor the last row's last two
        seen = reach_cols[..., : 2 * W + 1] & reach_cols[..., n - 2 * W - 1 :]
        seen = seen.expand(B, heads, nt, T, 2 * W + 1).reshape(-1, T, 2 * W + 1)
        seen = seen[R // T : -2]
        L = lay.valid.shape[1]
        reach = seen.any(-1).view(-1).index_select(0, lay.index).view(B, heads, L, 1)
        return seen, reach & lay.valid[:, None, :, None]

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
        """The memory's output (B, H, L, dv), whether any entry was in reach (B, H, L, 1), and
        (``want_state``) the memory after the tokens (a :class:`MemoryState` whose ``inner``
        is None), ``held`` the one before them. ``keys``: the positions the columns are
        keyed by (aligned coordinates), when not the member ``positions``; members are found
        where the member positions restart either way. ``shared``: where the layout of a
        stateless read is kept for the next layer's (the same tokens).

        How: each member becomes a row of R columns (its positions from the lowest in the
        chunk, keys W columns to the right of their queries), the rows of every member, head
        and batch row one after another, after a row for the state. Per column, a member's
        row holds the mean [k | v] over the members up to it (F: its own included), so the
        row above holds the members before it (E). A memory that reads only the other
        members reads E at every offset (masked: the row's mean without its own member); one
        that reads its own member (models before 0.7) reads F at offsets D <= 0, where its
        own keys j <= t sit, and E ahead of its position. Reading the columns around each
        query is then a band of tile products on one table (:class:`_Scores`; F's and E's
        side by side), and the values come back through the same bands (:class:`_Apply`): a
        few batched matrix products whatever W, forward and back."""
        B, H, L, d = q.shape
        W, causal, dv, reads_own = self.window, self.causal, v.shape[-1], self.reads_own
        C = d + dv + 1
        cached = shared is not None and held is None and "layout" in shared
        lay = shared["layout"] if cached else self._layout(positions, keep, keys, H, q.dtype)
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
            return q.new_zeros(B, H, L, dv), q.new_zeros(B, H, L, 1, dtype=torch.bool), new
        base, top, M, P, T, R, own = lay.base, lay.top, lay.M, lay.P, lay.T, lay.R, lay.own
        count = own.cumsum(1)  # the members up to each row's (B, M + 1, R)
        if held is not None:
            slots = _slots(held.mem, base - W, R)  # (B or 1, H, R, C), row 0's
            if cont is not None:  # the member the memory ended in goes on: not row 0's
                going = _slots(held.part, base - W, R) * cont.to(q.dtype)[:, None, None, None]
                slots = slots - going
            count = count + slots[:, 0, None, :, -1]
            if cont is not None:
                count[:, 1:] += going[:, 0, None, :, -1]
        if not causal:  # every member of the row (or every other one), at every offset
            count = count[:, -1:].expand(B, M + 1, R) if reads_own else count[:, -1:] - own
        if cached:
            seen, reach = shared["reach"]
        else:
            seen, reach = self._reach(lay, count, H)
            if shared is not None and held is None:
                shared["layout"], shared["reach"] = lay, (seen, reach)
        size = B * H * (M + 1) * R
        Q = q.new_zeros(size, d).index_add(0, lay.asked, q.reshape(-1, d))
        x = Q.view(-1, T, d)[R // T : -2]  # from the first member's row; the last two ask nothing
        N = x.shape[0]
        # keys and values apart (no slice of a shared table in the backward): per column the
        # mean over the members up to each row's, row 0 the state's (or nothing): a member's
        # own row is its F, the row above its E
        tables, grids = [], []
        upto = torch.ones(M + 1, M + 1, dtype=q.dtype, device=q.device).tril()
        for i, (z, c) in enumerate(((k, d), (v, dv))):
            Gz = z.new_zeros(size, c).index_add(0, lay.keyed, z.reshape(-1, c))
            Gz = Gz.view(B, H, M + 1, R, c)
            grids.append(Gz)
            if causal:  # the sums over the members up to each row (a product: cumsum over a
                # middle dimension is several times slower, forward and back)
                Fz = torch.matmul(upto, Gz.view(B, H, M + 1, R * c)).view(B, H, M + 1, R, c)
                if held is not None:
                    Fz = Fz + slots[:, :, None, :, i * d : i * d + c]
                    if cont is not None:
                        Fz[:, :, 1:] += going[:, :, None, :, i * d : i * d + c]
            else:
                Fz = Gz.sum(2, keepdim=True)
                Fz = Fz.expand(B, H, M + 1, R, c) if reads_own else Fz - Gz
            # keys' means carry the scores' 1 / sqrt(d): one number per column
            unit = d**0.5 if i == 0 else 1.0
            tables.append((Fz / (count.clamp_min(1.0) * unit)[:, None, :, :, None]).view(-1, c))
        if causal and reads_own:  # keys at offsets 0..W from F, W+1..2W from E; values one
            keys_at, values_at = ((R, W + 1), (W + 1, W)), ((R + 1, W), (W + 1, W + 1))
        elif causal:  # keys and values (one column right) from E, the row above
            keys_at, values_at = ((0, 2 * W + 1),), ((1, 2 * W + 1),)
        else:
            keys_at = values_at = ((R, 2 * W + 1),)
        nt = (M + 1) * R // T  # tiles per (batch row, head)
        head = (torch.arange(N, device=q.device) + R // T) // nt % H  # each tile's head
        # a column out of reach gets weight 0; a query with none in reach reads junk that
        # its gate (reach) then drops
        bias = torch.where(seen, self.offset_logits.to(q.dtype)[head][:, None], -1e30)
        weights = _Scores.apply(x, keys_at, tables[0]).add_(bias).softmax(-1)
        read = _Apply.apply(weights, values_at, tables[1])
        out = read.view(-1, dv).index_select(0, lay.index).view(B, H, L, dv)
        if not want_state:
            return out, reach, None
        mem = None if held is None else held.mem
        added = torch.cat([  # positions base .. top
            grids[0][:, :, :, W : W + P].sum(2), grids[1][:, :, :, W : W + P].sum(2),
            own[:, :, W : W + P].sum(1)[:, None, :, None].expand(B, H, P, 1)], -1)
        size = max(top + 1, 0 if mem is None else mem.shape[2])
        new_mem = F.pad(added, (0, 0, base, size - top - 1))
        if mem is not None:
            new_mem = new_mem + F.pad(mem, (0, 0, 0, size - mem.shape[2]))
        if not causal or reads_own:
            return out, reach, MemoryState(None, new_mem)
        rows = torch.arange(B, device=q.device)
        last = member_layout(positions)[:, -1] + 1  # each batch row's last member's row
        grown = torch.cat([  # (B, H, P, C): that member's sums over these tokens
            grids[0][rows, :, last, W : W + P], grids[1][rows, :, last, W : W + P],
            own[rows, last, W : W + P][:, None, :, None].expand(B, H, P, 1)], -1)
        part = self._last_part(positions, held, cont, F.pad(grown, (0, 0, base, 0)))
        return out, reach, MemoryState(None, new_mem, part, positions[:, -1])

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

    def _shared(self, positions: Tensor | int | None, mask: Tensor | None,
                coordinates: Tensor | None, shape: tuple) -> dict | None:  # fmt: skip
        """Where a stateless read keeps its layout for the next layer's: a dict held by the
        ``positions`` tensor (every layer of one forward gets the same one), fresh when
        anything the layout depends on differs (None: positions not a tensor, or inference
        tensors)."""
        given = [t for t in (positions, mask, coordinates) if t is not None]
        if not isinstance(positions, Tensor) or any(t.is_inference() for t in given):
            return None  # no version counter to tell a changed tensor: no sharing
        token = (tuple(t._version for t in given), shape, self.max_positions, self.window,
                 self.causal, self.reads_own)  # fmt: skip
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
