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
from protein_performer.model.rotary import as_positions, member_bounds

#: Tokens read at a time by a causal memory (a long context's prefill in chunks, the memory
#: carried from one to the next: bounded working memory).
READ_CHUNK = 2048


class MemoryState(NamedTuple):
    """The mixed core's state: the inner core's (``inner``) and the position memory
    ``mem`` (B, H, P, d + dv + 1), slot p holding the sum of [k | v | 1] at member position p;
    P is the longest member held so far (it grows with the context, up to ``max_positions``)."""

    inner: Any
    mem: Tensor


def member_layout(positions: Tensor) -> Tensor:
    """Member index (B, L) of each token: a new member starts where the position does not
    continue the previous token's (a ``<cls>`` resets it to 0), the first token in member 0."""
    new = torch.ones_like(positions, dtype=torch.bool)
    new[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return member_bounds(new)[0]


def _pairs(y: Tensor, T: int, N: int, shift: int) -> Tensor:
    """Rows y (rows, c) as N overlapping windows (N, 2T, c), window i holding rows
    i T + shift .. i T + shift + 2T - 1 (a view; y must hold (N + 1) T + shift rows)."""
    return y.as_strided((N, 2 * T, y.shape[1]), (T * y.stride(0), y.stride(0), y.stride(1)),
                        y.storage_offset() + shift * y.stride(0))


def _band(full: Tensor, w: int) -> Tensor:
    """Row a's columns a .. a + w - 1 of tile products full (N, T, 2T), as (N, T, w)."""
    T = full.shape[1]
    return F.pad(full.flatten(1), (0, T)).view(-1, T, 2 * T + 1)[..., :w]


def _unband(a: Tensor) -> Tensor:
    """A band (N, T, w) as the (N, T, 2T) matrix of :func:`_band`, zero off the band."""
    N, T, w = a.shape
    return F.pad(a, (0, 2 * T + 1 - w)).flatten(1)[:, : 2 * T * T].view(N, T, 2 * T)


class _Scores(torch.autograd.Function):
    """out[i, a, :] = the bands x[i, a] . y_s[i T + a + shift_s + j], j < width_s, of each
    segment s, side by side: queries in tiles x (N, T, c) against the rows of tables y_s
    (rows, c) around their own, each tile against the 2T rows it reaches (width <= T + 1),
    forward and back as batched products."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, segments: tuple[tuple[int, int], ...], *ys: Tensor
                ) -> Tensor:
        ctx.save_for_backward(x, *ys)
        ctx.segments = segments
        N, T = x.shape[:2]
        return torch.cat([_band(x @ _pairs(y, T, N, shift).mT, width)
                          for y, (shift, width) in zip(ys, segments, strict=True)], -1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, *ys = ctx.saved_tensors
        N, T = x.shape[:2]
        dx, dys, at = None, [], 0
        for y, (shift, width) in zip(ys, ctx.segments, strict=True):
            full = _unband(grad[..., at : at + width])
            at += width
            if ctx.needs_input_grad[0]:
                part = full @ _pairs(y, T, N, shift)
                dx = part if dx is None else dx + part
            dys.append(_spread(full, x, y, shift))
        return (dx, None, *dys)


class _Apply(torch.autograd.Function):
    """out[i, a] = sum_s sum_j a[i, a, j_s] y_s[i T + a + shift_s + j]: the values back
    through bands laid out as :class:`_Scores` lays them (its adjoint in x), forward and
    back."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, segments: tuple[tuple[int, int], ...], *ys: Tensor
                ) -> Tensor:
        ctx.save_for_backward(a, *ys)
        ctx.segments = segments
        N, T = a.shape[:2]
        out, at = None, 0
        for y, (shift, width) in zip(ys, segments, strict=True):
            part = _unband(a[..., at : at + width]) @ _pairs(y, T, N, shift)
            at += width
            out = part if out is None else out + part
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, *ys = ctx.saved_tensors
        N, T = a.shape[:2]
        grad = grad.contiguous()
        bands, dys, at = [], [], 0
        for y, (shift, width) in zip(ys, ctx.segments, strict=True):
            if ctx.needs_input_grad[0]:
                bands.append(_band(grad @ _pairs(y, T, N, shift).mT, width))
            dys.append(_spread(_unband(a[..., at : at + width]), grad, y, shift))
            at += width
        return (torch.cat(bands, -1) if bands else None, None, *dys)


def _spread(full: Tensor, x: Tensor, y: Tensor, shift: int) -> Tensor:
    """The gradient of y (rows, c) of the band products: row i T + shift + r gets
    full[i, :, r]^T x[i] (each tile's 2T rows overlap the next tile's first T)."""
    N, T = x.shape[:2]
    both = full.mT @ x  # (N, 2T, c)
    out = y.new_zeros(y.shape)
    out[shift : shift + N * T].view(N, T, -1).add_(both[:, :T])
    out[shift + T : shift + (N + 1) * T].view(N, T, -1).add_(both[:, T:])
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
                   config.memory_window)  # fmt: skip

    @classmethod
    def extra_numel(cls, config) -> int:  # noqa: ANN001
        return config.heads * (2 * config.memory_window + 2 + config.head_dim)

    def __init__(
        self, inner: AttentionCore, heads: int, dim_head: int, max_positions: int, window: int
    ) -> None:
        super().__init__()
        self.inner = inner
        self.causal = inner.causal
        self.max_positions = max_positions
        self.window = window
        # b_h(D) = offset_logits[h, D + W], a learned bias per offset; 0 at first.
        self.offset_logits = nn.Parameter(torch.zeros(heads, 2 * window + 1))
        self.gate_weight = nn.Parameter(torch.zeros(heads, dim_head))
        self.gate_bias = nn.Parameter(torch.full((heads,), -1.0))

    def _read(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
              mem: Tensor | None, want_state: bool, keys: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """The memory's output (B, H, L, dv), whether any entry was in reach (B, H, L, 1), and
        (``want_state``) the memory after the tokens. ``keys``: the positions the columns are
        keyed by (aligned coordinates), when not the member ``positions``; members are found
        where the member positions restart either way.

        How: each member becomes a row of R columns (its positions from the lowest in the
        chunk, keys W columns to the right of their queries), the rows of every member, head
        and batch row one after another. Per column, F holds the mean [k | v] over the members
        up to each one (its own included, what t reads at offsets D <= 0, where its own keys
        j <= t sit) and E over the members before it (what t reads ahead of its position).
        Reading the columns around each query is then a band of tile products
        (:class:`_Scores`, F's and E's side by side), and the values come back through the
        same bands (:class:`_Apply`): four batched matrix products whatever W, forward and
        back."""
        B, H, L, d = q.shape
        W, causal, dv = self.window, self.causal, v.shape[-1]
        n = 2 * W + 1 + causal  # causal: one column more, the successor of p_t + W
        member = member_layout(positions)
        if keys is not None:
            positions = keys
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        low = torch.where(valid, positions, self.max_positions).min()
        stats = torch.stack([low, torch.where(valid, positions, -1).max(), member.max()])
        base, top, last = stats.tolist()
        C = d + dv + 1
        if top < 0:  # nothing enters or reads: the memory stays as it was
            if want_state and mem is None:
                mem = q.new_zeros(B, H, 0, C)
            return q.new_zeros(B, H, L, dv), q.new_zeros(B, H, L, 1, dtype=torch.bool), mem
        M, P = last + 1, top - base + 1
        # a tile of T query positions reads the 2T columns from its first on, a band of
        # w = W + 1 (causal: F, then E) or 2W + 1 (masked) of them per query (w <= T + 1)
        T = max(W + 1 if causal else 2 * W, 1)
        R = (-(-P // T) + 2) * T  # a row: its query tiles, then the keys' overhang
        rows = (torch.arange(B * H, device=q.device).view(B, H, 1) * M + member[:, None]) * R
        col = (positions - base).clamp(0, R - 1 - W)[:, None]  # (B, 1, L)
        # a padding token goes to its row's last column: never read, never in the state
        dump = rows + R - 1
        keyed = torch.where(valid[:, None], rows + col + W, dump).view(-1)
        asked = torch.where(valid[:, None], rows + col, dump).view(-1)
        Q = q.new_zeros(B * H * M * R, d).index_add(0, asked, q.reshape(-1, d))
        # the counts are the same in every head: (B, M, R), no gradient
        slot = ((torch.arange(B, device=q.device)[:, None] * M + member) * R + col[:, 0] + W)
        own = q.new_zeros(B * M * R).index_add(0, slot.view(-1), valid.to(q.dtype).view(-1))
        own = own.view(B, M, R)
        count = own.cumsum(1)  # the members up to each one
        if mem is not None:
            held = _slots(mem, base - W, R)
            count = count + held[:, 0, None, :, -1]
        if not causal:  # every member of the row, t's own included, at every offset
            count = count[:, -1:].expand(B, M, R)
        nt = M * R // T  # tiles per (batch row, head)
        x = Q.view(-1, T, d)[:-2]  # the last row's last two tiles ask nothing
        N = x.shape[0]
        # keys and values apart (no slice of a shared table in the backward): per column the
        # mean over the members up to each one (F) and, causal, before it (E)
        tables: list[list[Tensor]] = [[], []]
        grids = []
        counts = [count, count - own] if causal else [count]
        for i, (z, c) in enumerate(((k, d), (v, dv))):
            Gz = z.new_zeros(B * H * M * R, c).index_add(0, keyed, z.reshape(-1, c))
            Gz = Gz.view(B, H, M, R, c)
            grids.append(Gz)
            Fz = Gz.cumsum(2)
            if mem is not None:
                Fz = Fz + held[:, :, None, :, i * d : i * d + c]
            if not causal:
                Fz = Fz[:, :, -1:].expand(B, H, M, R, c)
            # keys' means carry the scores' 1 / sqrt(d): one number per column
            unit = d**0.5 if i == 0 else 1.0
            mean = Fz / (count.clamp_min(1.0) * unit)[:, None, :, :, None]
            tables[0].append(mean.view(-1, c))
            if causal:  # E: F one member up, the state's means (or nothing) before the first
                first = mean.new_zeros(1, 1, 1, 1, 1).expand(B, H, 1, R, c)
                if mem is not None:
                    first = (held[..., i * d : i * d + c] / (held[..., -1:].clamp_min(1.0)
                                                             * unit))[:, :, None]
                    first = first.expand(B, H, 1, R, c)
                tables[1].append(torch.cat([first, mean[:, :, :-1]], 2).view(-1, c))
        have = []
        for n_of in counts:  # whether anything is there, column by column
            flat = F.pad(n_of.reshape(B, M * R) > 0.5, (0, n - 1))
            have.append(flat.unfold(1, n, 1).view(B, 1, nt, T, n))
        if causal:  # keys at offsets 0..W from F, W+1..2W from E; values one column right
            ahead = torch.arange(n, device=q.device) > W
            reach_cols = torch.where(ahead, have[1], have[0])
            keys, values = ((0, W + 1), (W + 1, W)), ((1, W), (W + 1, W + 1))
        else:
            reach_cols = have[0]
            keys = values = ((0, n),)
        # key and value both held, the same in every head
        seen = reach_cols[..., : 2 * W + 1] & reach_cols[..., n - 2 * W - 1 :]
        seen = seen.expand(B, H, nt, T, 2 * W + 1).reshape(-1, T, 2 * W + 1)[:N]
        head = torch.arange(N, device=q.device) // nt % H  # each tile's head
        # a column out of reach gets weight 0; a query with none in reach reads junk that
        # its gate (reach) then drops
        bias = torch.where(seen, self.offset_logits.to(q.dtype)[head][:, None], -1e30)
        weights = (_Scores.apply(x, keys, *tables[0][:1], *tables[1][:1]) + bias).softmax(-1)
        read = _Apply.apply(weights, values, *tables[0][1:], *tables[1][1:])
        index = torch.where(valid[:, None], rows + col, 0).view(-1)
        out = read.view(-1, dv).index_select(0, index).view(B, H, L, dv)
        reach = seen.any(-1).view(-1).index_select(0, index).view(B, H, L, 1)
        reach = reach & valid[:, None, :, None]
        new_mem = None
        if want_state:
            added = torch.cat([  # positions base .. top
                grids[0][:, :, :, W : W + P].sum(2), grids[1][:, :, :, W : W + P].sum(2),
                own[:, :, W : W + P].sum(1)[:, None, :, None].expand(B, H, P, 1)], -1)
            size = max(top + 1, 0 if mem is None else mem.shape[2])
            new_mem = F.pad(added, (0, 0, base, size - top - 1))
            if mem is not None:
                new_mem = new_mem + F.pad(mem, (0, 0, 0, size - mem.shape[2]))
        return out, reach, new_mem

    def _read_chunks(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
                     mem: Tensor | None, want_state: bool, keys: Tensor | None = None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """:meth:`_read` over the tokens in chunks of :data:`READ_CHUNK`, the memory carried
        from one to the next (causal), so a 64k-token context needs the memory of one chunk."""
        L = q.shape[2]
        if not self.causal or L <= READ_CHUNK:
            return self._read(q, k, v, positions, keep, mem, want_state, keys)
        outs, seens = [], []
        for start in range(0, L, READ_CHUNK):
            t = slice(start, start + READ_CHUNK)
            out, seen, mem = self._read(q[:, :, t], k[:, :, t], v[:, :, t], positions[:, t],
                                        keep[:, t], mem, want_state or start + READ_CHUNK < L,
                                        None if keys is None else keys[:, t])  # fmt: skip
            outs.append(out)
            seens.append(seen)
        return torch.cat(outs, 2), torch.cat(seens, 2), mem

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
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y, vv = q.to(dtype), k.to(dtype), v.to(dtype)
            keys = None if coordinates is None else coordinates.to(pos).expand(B, L)
            mem_out, seen, mem = self._read_chunks(
                x, y, vv, pos, keep, None if state is None else state.mem.to(dtype), keep_state,
                keys,
            )
            gate = torch.sigmoid(
                (x * self.gate_weight.to(dtype)[:, None]).sum(-1, keepdim=True)
                + self.gate_bias.to(dtype)[:, None, None]
            )  # (B, H, L, 1)
            gate = gate * seen.to(dtype)  # no entry in reach: the core's output alone
            mixed = torch.lerp(out.to(dtype), mem_out, gate)
        new = MemoryState(inner_state, mem) if keep_state else None
        return mixed.to(q.dtype), new

    def attention_map(self, q, k, key_padding_mask=None, query_slice=None) -> Tensor:
        """The inner core's rows (the memory mixes values by position, not a map over keys)."""
        return self.inner.attention_map(q, k, key_padding_mask, query_slice)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, window={self.window}"
