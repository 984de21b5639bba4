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
ones, up to ``max_positions``): constant in the number of members and in the context's length. A per-head gate from the query,
g_t = sigmoid(q_t . u_h + b_h), mixes it with the core's own output, out = core + g (mem - core);
where no memory entry is in reach (positions >= P, an empty memory) the output is the core's.

The causal parallel form splits the keys j <= t into the members before t's (a table per
member, prefix-summed over members) and t's own member up to t (a causal window within the
member), which is what the recurrent state accumulates one token at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.linear.core import _compute_dtype
from protein_performer.model.rotary import as_positions

#: Tokens read at a time by a causal memory (a long context's prefill in chunks, the memory
#: carried from one to the next: bounded working memory).
READ_CHUNK = 2048
#: Member positions per tile of the banded read (at least 2W + 1): a tile of T positions
#: multiplies its queries with the 2T memory columns from its own (two matrix products), of
#: which each query reads the n = 2W + 2 (causal; 2W + 1 masked) around its position.
TILE = 24


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
    return new.long().cumsum(-1) - 1


def _band(full: Tensor, n: int) -> Tensor:
    """Row i's columns i .. i + n - 1 of tile products full (N, T, 2T), as (N, T, n)."""
    T = full.shape[1]
    return F.pad(full.flatten(1), (0, T)).view(-1, T, 2 * T + 1)[..., :n]


def _unband(a: Tensor) -> Tensor:
    """A band (N, T, n) as the (N, T, 2T) matrix of :func:`_band`, zero off the band."""
    N, T, n = a.shape
    return F.pad(a, (0, 2 * T + 1 - n)).flatten(1)[:, : 2 * T * T].view(N, T, 2 * T)


def _scores(x: Tensor, y: Tensor, n: int) -> Tensor:
    """out[i, a, j] = x[i, a] . y_flat[i T + a + j]: queries x (N, T, c) against the n columns
    of y (N + 1, T, c) from their own on (y_flat: y's rows one after another)."""
    return _band(torch.cat([x @ y[:-1].mT, x @ y[1:].mT], -1), n)


def _apply(a: Tensor, y: Tensor) -> Tensor:
    """out[i, a] = sum_j a[i, a, j] y_flat[i T + a + j], the adjoint of :func:`_scores` in x."""
    full, T = _unband(a), a.shape[1]
    return full[..., :T] @ y[:-1] + full[..., T:] @ y[1:]


def _spread(a: Tensor, x: Tensor) -> Tensor:
    """out_flat[i T + a + j] += a[i, a, j] x[i, a] as (N + 1, T, c): the adjoint in y."""
    full, T = _unband(a), a.shape[1]
    lo, hi = full[..., :T].mT @ x, full[..., T:].mT @ x
    return F.pad(lo, (0, 0, 0, 0, 0, 1)) + F.pad(hi, (0, 0, 0, 0, 1, 0))


class _Scores(torch.autograd.Function):
    """:func:`_scores` with its backward as two more banded products (no (N, T, 2T) gradient
    of a strided view)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, n: int) -> Tensor:
        ctx.save_for_backward(x, y)
        return _scores(x, y, n)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, y = ctx.saved_tensors
        grad = grad.contiguous()
        dx = _apply(grad, y) if ctx.needs_input_grad[0] else None
        dy = _spread(grad, x) if ctx.needs_input_grad[1] else None
        return dx, dy, None


class _Apply(torch.autograd.Function):
    """:func:`_apply` with its backward as banded products."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, y: Tensor) -> Tensor:
        ctx.save_for_backward(a, y)
        return _apply(a, y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, y = ctx.saved_tensors
        grad = grad.contiguous()
        da = _scores(grad, y, a.shape[-1]) if ctx.needs_input_grad[0] else None
        dy = _spread(a, grad) if ctx.needs_input_grad[1] else None
        return da, dy


def _slots(mem: Tensor, first: int, width: int) -> Tensor:
    """Slots first .. first + width - 1 of a memory (B, H, P, C), zeros outside 0 .. P - 1."""
    lo, hi = max(first, 0), max(min(first + width, mem.shape[2]), max(first, 0))
    return F.pad(mem[:, :, lo:hi], (0, 0, lo - first, first + width - hi))


class PositionMemory(nn.Module):
    """Wraps an attention core (``inner``) with the member-position memory described above."""

    def __init__(
        self, inner: nn.Module, heads: int, dim_head: int, max_positions: int, window: int
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

    def redraw(self, generator: torch.Generator | None = None) -> None:
        self.inner.redraw(generator=generator)

    def _read(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
              mem: Tensor | None, want_state: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """The memory's output (B, H, L, dv), whether any entry was in reach (B, H, L, 1), and
        (``want_state``) the memory after the tokens.

        How: each member becomes a row of R columns (its positions from the lowest in the
        chunk, keys W columns to the right of their queries), the rows of every member, head
        and batch row one after another. The sums t reads are then its member's columns
        p_t + D of F, the prefix over the members up to its own, less its own member's G at
        the offsets D > 0 that lie ahead of t. Reading the 2W + 1 columns around each query is
        a band of tile products (:class:`_Scores`), and the values come back through the same
        band (:class:`_Apply`): a few batched matrix products whatever W, forward and back."""
        B, H, L, d = q.shape
        W, causal, dv = self.window, self.causal, v.shape[-1]
        n = 2 * W + 1 + causal  # causal: one column more, the successor of p_t + W
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        member = member_layout(positions)
        low = torch.where(valid, positions, self.max_positions).min()
        stats = torch.stack([low, torch.where(valid, positions, -1).max(), member.max()])
        base, top, last = stats.tolist()
        C = d + dv + 1
        if top < 0:  # nothing enters or reads: the memory stays as it was
            if want_state and mem is None:
                mem = q.new_zeros(B, H, 0, C)
            return q.new_zeros(B, H, L, dv), q.new_zeros(B, H, L, 1, dtype=torch.bool), mem
        M, P = last + 1, top - base + 1
        T = max(TILE, n - 1)
        R = (-(-P // T) + 1) * T  # a row: its query tiles, then one for the keys' overhang
        rows = (torch.arange(B * H, device=q.device).view(B, H, 1) * M + member[:, None]) * R
        col = (positions - base).clamp(0, R - 1 - W)[:, None]  # (B, 1, L)
        keyed = (rows + col + W).view(-1)  # (B * H * L,) into (B * H * M * R) columns
        # a padding token's query goes to its row's last column (never read), its key adds 0
        asked = torch.where(valid[:, None], rows + col, rows + R - 1).view(-1)
        kvx = torch.cat([k, v, torch.ones_like(v[..., :1])], -1)
        kvx = kvx * valid[:, None, :, None].to(kvx.dtype)
        G = kvx.new_zeros(B * H * M * R, C).index_add(0, keyed, kvx.reshape(-1, C))
        Q = q.new_zeros(B * H * M * R, d).index_add(0, asked, q.reshape(-1, d))
        G = G.view(B, H, M, R, C)
        Fsum = G.cumsum(2)  # F: the members up to each one
        if mem is not None:
            Fsum = Fsum + _slots(mem, base - W, R)[:, :, None]
        if not causal:  # every member of the row, t's own included, at every offset
            Fsum = Fsum[:, :, -1:].expand(B, H, M, R, C)
        y, x = Fsum.reshape(-1, T, C), Q.view(-1, T, d)[:-1]  # the last tile asks nothing
        N = x.shape[0]

        def counts(table: Tensor) -> Tensor:  # (N, T, n): the count at each column read
            return table.reshape(-1)[: N * T + n - 1].unfold(0, n, 1).view(N, T, n)

        sums, count = _Scores.apply(x, y[..., :d], n), counts(y[..., -1])
        if causal:  # less t's own member ahead of t (offsets D > 0; the successor of D = 0)
            ahead = torch.arange(n, device=q.device) > W
            g = G.view(-1, T, C)
            sums = sums - _Scores.apply(x, g[..., :d], n) * ahead
            count = count - counts(g[..., -1]) * ahead
            sums, k_count, v_count = sums[..., :-1], count[..., :-1], count[..., 1:]
        else:
            k_count = v_count = count
        seen = (k_count > 0.5) & (v_count > 0.5)  # (N, T, 2W + 1)
        scores = sums / k_count.clamp_min(1.0) * d**-0.5
        head = torch.arange(N, device=q.device) // (M * R // T) % H  # each tile's head
        scores = scores + self.offset_logits.to(q.dtype)[head][:, None]
        # a finite fill: a query with nothing in reach gets uniform weights, then zeros
        weights = scores.masked_fill(~seen, -1e30).softmax(-1) * seen
        weights = weights / v_count.clamp_min(1.0)
        if causal:  # values one column to the right: the successor of each key
            weights = F.pad(weights, (1, 0))
            read = _Apply.apply(weights, y[..., d:-1])
            read = read - _Apply.apply(weights * ahead, g[..., d:-1])
        else:
            read = _Apply.apply(weights, y[..., d:-1])
        index = torch.where(valid[:, None], rows + col, 0).view(-1)
        out = read.view(-1, dv).index_select(0, index).view(B, H, L, dv)
        reach = seen.any(-1).view(-1).index_select(0, index).view(B, H, L, 1)
        reach = reach & valid[:, None, :, None]
        new_mem = None
        if want_state:
            added = G[:, :, :, W : W + P].sum(2)  # positions base .. top
            size = max(top + 1, 0 if mem is None else mem.shape[2])
            new_mem = F.pad(added, (0, 0, base, size - top - 1))
            if mem is not None:
                new_mem = new_mem + F.pad(mem, (0, 0, 0, size - mem.shape[2]))
        return out, reach, new_mem

    def _read_chunks(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
                     mem: Tensor | None, want_state: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """:meth:`_read` over the tokens in chunks of :data:`READ_CHUNK`, the memory carried
        from one to the next (causal), so a 64k-token context needs the memory of one chunk."""
        L = q.shape[2]
        if not self.causal or L <= READ_CHUNK:
            return self._read(q, k, v, positions, keep, mem, want_state)
        outs, seens = [], []
        for start in range(0, L, READ_CHUNK):
            t = slice(start, start + READ_CHUNK)
            out, seen, mem = self._read(q[:, :, t], k[:, :, t], v[:, :, t], positions[:, t],
                                        keep[:, t], mem, want_state or start + READ_CHUNK < L)
            outs.append(out)
            seens.append(seen)
        return torch.cat(outs, 2), torch.cat(seens, 2), mem

    def forward(
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
    ) -> tuple[Tensor, MemoryState | None]:
        """The inner core's output mixed with the memory's read (see the module docstring);
        the cores' call, whose rotary ``positions`` (any form of
        :func:`~protein_performer.model.rotary.as_positions`) place the tokens."""
        if not self.causal and (state is not None or keep_state):
            raise RuntimeError("RNN mode (a state) needs causal=True")
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
        keep = (
            torch.ones(B, L, dtype=torch.bool, device=q.device)
            if key_padding_mask is None
            else ~key_padding_mask.bool()
        )
        dtype = _compute_dtype(q)
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y, vv = q.to(dtype), k.to(dtype), v.to(dtype)
            mem_out, seen, mem = self._read_chunks(
                x, y, vv, pos, keep, None if state is None else state.mem.to(dtype), keep_state
            )
            gate = torch.sigmoid(
                (x * self.gate_weight.to(dtype)[:, None]).sum(-1, keepdim=True)
                + self.gate_bias.to(dtype)[:, None, None]
            )  # (B, H, L, 1)
            gate = gate * seen.to(dtype)  # no entry in reach: the core's output alone
            mixed = out.to(dtype) + gate * (mem_out - out.to(dtype))
        new = MemoryState(inner_state, mem) if keep_state else None
        return mixed.to(q.dtype), new

    def attention_map(self, q, k, key_padding_mask=None, query_slice=None) -> Tensor:
        """The inner core's rows (the memory mixes values by position, not a map over keys)."""
        return self.inner.attention_map(q, k, key_padding_mask, query_slice)

    def map_blocks(self, q: Tensor, k: Tensor, L: int, window: int):
        return self.inner.map_blocks(q, k, L, window)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, window={self.window}"
