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
#: Member positions per tile of the banded read: a tile of T positions multiplies its queries
#: with the T + n - 1 memory columns they reach (n = 2W + 2 causal, 2W + 1 masked), so the
#: read is a few batched matrix products instead of a gather of n columns per token.
TILE = 16


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


def _windows(x: Tensor, tile: int, n: int) -> Tensor:
    """Columns (..., Pk, c) as overlapping tiles (..., Pk // tile, tile + n - 1, c): tile i holds
    columns i*tile .. i*tile + tile + n - 2 (a view)."""
    return x.unfold(-2, tile + n - 1, tile).transpose(-1, -2)


def _band(s: Tensor, n: int) -> Tensor:
    """The band s[..., i, i + j], j < n, of tile products (..., T, T + n - 1), as (..., T, n)."""
    T = s.shape[-2]
    flat = F.pad(s.flatten(-2), (0, T))
    return flat.unflatten(-1, (T, s.shape[-1] + 1))[..., :n]


def _unband(a: Tensor) -> Tensor:
    """A band (..., T, n) as the tile matrix (..., T, T + n - 1) of :func:`_band`, zero off it."""
    T, n = a.shape[-2:]
    flat = F.pad(a, (0, T)).flatten(-2)[..., : T * (T + n - 1)]
    return flat.unflatten(-1, (T, T + n - 1))


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

        How: each member becomes a row of columns (its positions, laid side by side with the
        row's other members, padded to the longest), so the sums a token reads are its
        member's column p_t + D in the prefix over the members before it (E) or up to it (F,
        offsets D <= 0 of t's own member, whose keys j <= t sit at p_t + D). Reading 2W + 1
        neighbouring columns of a table is a band of a product with it: tiles of T query
        positions times the T + n - 1 columns they reach (:func:`_band`), and the values back
        through the same band (:func:`_unband`)."""
        B, H, L, d = q.shape
        W, causal, dv = self.window, self.causal, v.shape[-1]
        n = 2 * W + 1 + causal  # causal: one column more, the successor of p_t + W
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        member = member_layout(positions)
        low = torch.where(valid, positions, self.max_positions).min()
        stats = torch.stack([low, torch.where(valid, positions, -1).max(), member.max()])
        base, top, last = stats.tolist()
        if top < 0:  # nothing enters or reads: the memory stays as it was
            if want_state and mem is None:
                mem = q.new_zeros(B, H, 0, d + dv + 1)
            return q.new_zeros(B, H, L, dv), q.new_zeros(B, H, L, 1, dtype=torch.bool), mem
        M, P = last + 1, top - base + 1
        T = min(TILE, P)
        Pq = -(-P // T) * T
        Pk = Pq + n - 1  # key columns: W before the first query position, W + causal after
        rel = (positions - base).clamp(0, Pq - 1)
        qcell = torch.where(valid, member * Pq + rel, M * Pq)[:, None, :, None]  # dump: M * Pq
        kcell = torch.where(valid, member * Pk + rel + W, M * Pk)[:, None, :, None]
        kvx = torch.cat([k, v, torch.ones_like(v[..., :1])], -1)  # (B, H, L, C)
        C = kvx.shape[-1]
        G = kvx.new_zeros(B, H, M * Pk + 1, C).scatter_add(2, kcell.expand(B, H, L, C), kvx)
        G = G[:, :, :-1].view(B, H, M, Pk, C)  # each member's [k | v | 1] by column
        Q = q.new_zeros(B, H, M * Pq + 1, d).scatter_add(2, qcell.expand(B, H, L, d), q)
        Q = Q[:, :, :-1].view(B, H, M, Pq // T, T, d)
        held = None if mem is None else _slots(mem, base - W, Pk)[:, :, None]
        Fsum = G.cumsum(2) if held is None else G.cumsum(2) + held  # members up to each one
        if causal:  # E: the members before each one; F: also its own, read at D <= 0
            E = F.pad(Fsum[:, :, :-1], (0, 0, 0, 0, 1, 0)) if held is None else torch.cat(
                [held, Fsum[:, :, :-1]], 2)
            own = torch.arange(n, device=q.device) <= W
            tables = (Fsum, E)
        else:  # every member of the row, t's own included, at every offset
            tables = (Fsum[:, :, -1:],)
        wins = [_windows(t, T, n) for t in tables]
        sums = [_band(Q @ w[..., :d].transpose(-1, -2), n) for w in wins]
        counts = [t[..., -1].unfold(-1, n, 1).unflatten(-2, (Pq // T, T)) for t in tables]
        if causal:
            sums_k, count = torch.where(own, *sums), torch.where(own, *counts)
            sums_k, k_count, v_count = sums_k[..., :-1], count[..., :-1], count[..., 1:]
        else:
            sums_k, k_count = sums[0], counts[0]
            v_count = k_count
        seen = (k_count > 0) & (v_count > 0)  # (B, H, M, nT, T, 2W + 1)
        scores = sums_k / k_count.clamp_min(1e-6) * d**-0.5
        scores = scores + self.offset_logits.to(q.dtype)[None, :, None, None, None]
        # a finite fill: a query with nothing in reach gets uniform weights, then zeros
        weights = scores.masked_fill(~seen, -1e30).softmax(-1) * seen
        weights = weights / v_count.clamp_min(1e-6)
        if causal:  # values one column to the right: the successor of each key
            weights = F.pad(weights, (1, 0))
            read = _unband(weights * own) @ wins[0][..., d:-1]
            read = read + _unband(weights * ~own) @ wins[1][..., d:-1]
        else:
            read = _unband(weights) @ wins[0][..., d:-1]
        out = F.pad(read.reshape(B, H, M * Pq, dv), (0, 0, 0, 1))
        out = out.gather(2, qcell.expand(B, H, L, dv))
        reach = seen.any(-1).expand(B, H, M, Pq // T, T).reshape(B, H, M * Pq)
        reach = F.pad(reach, (0, 1)).gather(2, qcell[..., 0])
        new_mem = None
        if want_state:
            added = G[:, :, :, W : W + P].sum(2)  # positions base .. top
            size = max(top + 1, 0 if mem is None else mem.shape[2])
            new_mem = F.pad(added, (0, 0, base, size - top - 1))
            if mem is not None:
                new_mem = new_mem + F.pad(mem, (0, 0, 0, size - mem.shape[2]))
        return out, reach[..., None], new_mem

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
