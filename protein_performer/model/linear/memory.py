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
(P + 2W + 1) x (d + dv + 1) per head, P the longest member it holds: constant in the number of
members and in the context's length. A per-head gate from the query,
g_t = sigmoid(q_t . u_h + b_h), mixes it with the core's own output, out = core + g (mem - core);
where no memory entry is in reach (positions >= P, an empty memory) the output is the core's.

The causal parallel form splits the keys j <= t into the members before t's (a table per
member, prefix-summed over members) and t's own member up to t (a causal window within the
member), which is what the recurrent state accumulates one token at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from protein_performer.model.cores.base import AttentionCore, CoreWrapper
from protein_performer.model.cores.base import compute_dtype as _compute_dtype
from protein_performer.model.cores.registry import register
from protein_performer.model.rotary import as_positions, member_bounds

#: Tokens read at a time by a causal memory (its gathered sums are (2W + 2) x (d + dv + 1)
#: numbers per token and head: bounded memory for a long context's prefill).
READ_CHUNK = 2048


class MemoryState(NamedTuple):
    """The mixed core's state: the inner core's (``inner``) and the position memory
    ``mem`` (B, H, P + 2W + 1, d + dv + 1), slot p + W holding the sum of [k | v | 1] at p."""

    inner: Any
    mem: Tensor


def member_layout(positions: Tensor) -> Tensor:
    """Member index (B, L) of each token: a new member starts where the position does not
    continue the previous token's (a ``<cls>`` resets it to 0), the first token in member 0."""
    new = torch.ones_like(positions, dtype=torch.bool)
    new[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return member_bounds(new)[0]


@register("memory")
class PositionMemory(CoreWrapper):
    """Wraps an attention core (``inner``) with the member-position memory described above
    (``PerformerConfig.position_memory``); it finds members where positions restart, so it
    needs member positions."""

    order = 1  # around any core, the window included
    needs_positions = "member"
    label = "a position memory"

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

    def _slots(self, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Slot p + W of each token and whether it enters or reads the memory (real, p < P)."""
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        return (positions.clamp(0, self.max_positions - 1) + self.window), valid

    def _gather(self, kvx: Tensor, positions: Tensor, keep: Tensor, mem: Tensor | None):
        """Per offset D, the sums of [k | v | 1] at position p_t + D over the keys t may read,
        (B, H, L, n, C) with n = 2W + 1 (+1 causal: the successor slot), whether each token
        reads and enters the memory (B, L), and the memory after the tokens (B, H, S, C)."""
        B, H, L, C = kvx.shape
        W, S = self.window, self.max_positions + 2 * self.window + self.causal
        slot, valid = self._slots(positions, keep)
        kvx = kvx * valid[:, None, :, None].to(kvx.dtype)
        member = member_layout(positions)  # (B, L)
        K = int(member.max()) + 1
        # table[b, h, i] = sums of the members before i (and the state's), by slot
        table = kvx.new_zeros(B, H, K + 1, S, C)
        if mem is not None:  # row 0, "before the first member", holds the state
            table[:, :, 0] = mem.to(kvx)
        flat = (member + 1) * S + slot  # (B, L) into the (K+1)*S slots
        table.view(B, H, (K + 1) * S, C).scatter_add_(
            2, flat[:, None, :, None].expand(B, H, L, C), kvx
        )
        table = table.cumsum(2)
        new_mem = table[:, :, K]  # (B, H, S, C): everything, the state included
        if self.causal:  # the members before t's, then t's own keys j <= t
            view, base = table.view(B, H, (K + 1) * S, C), member * S + slot
        else:  # bidirectional: every token of every member, t's own member included
            view, base = new_mem, slot
        n = 2 * W + 1 + self.causal  # causal: one slot more, the successor of p_t + W
        offsets = torch.arange(-W, W + 1 + self.causal, device=kvx.device)
        # rows of C numbers picked by one flat index (a gather over C would index every number)
        rows = view.reshape(-1, C)  # (B * H * R, C), R rows per (b, h)
        start = torch.arange(B * H, device=kvx.device).view(B, H, 1) * view.shape[2]
        index = (start + (base[:, :, None] + offsets).reshape(B, 1, L * n)).reshape(-1)
        sums = rows.index_select(0, index).view(B, H, L, n, C)
        if self.causal:  # positions continue by 1 within a member: key j = t - d is at p_t - d
            for d in range(0, min(W, L - 1) + 1):  # offset -d (slot W - d); none ahead of t
                same = (member[:, d:] == member[:, : L - d])[:, None, :, None]
                sums[:, :, d:, W - d] += kvx[:, :, : L - d] * same.to(kvx.dtype)
        return sums, valid, new_mem

    def _read(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
              mem: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The memory's output (B, H, L, dv), whether any entry was in reach (B, H, L, 1), and
        the memory after the tokens: attention over the 2W+1 positions around p_t, each
        position's key and value the mean over the members seen there."""
        d = q.shape[-1]
        kvx = torch.cat([k, v, torch.ones_like(v[..., :1])], -1)  # (B, H, L, d + dv + 1)
        sums, valid, new_mem = self._gather(kvx, positions, keep, mem)  # (B, H, L, n, C)
        # keys at p_t + D; values at p_t + D + 1 when causal (the successor: what t predicts)
        keys, values = (sums[..., :-1, :], sums[..., 1:, :]) if self.causal else (sums, sums)
        k_count, v_count = keys[..., -1], values[..., -1]  # (B, H, L, 2W+1)
        # a token that is padding or past P reads nothing (its gathered slots are clamped)
        seen = (k_count > 0) & (v_count > 0) & valid[:, None, :, None]
        # q . mean key and the weighted mean values, contracting before dividing by the counts
        # (elementwise products: batched matmuls of 2W+1 rows are slower on CPU)
        scores = (keys[..., :d] * q[..., None, :]).sum(-1) / k_count.clamp_min(1e-6) * d**-0.5
        scores = scores + self.offset_logits.to(q.dtype)[None, :, None, :]
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
        weights = weights / v_count.clamp_min(1e-6)
        out = (weights[..., None] * values[..., d:-1]).sum(-2)  # (B, H, L, dv)
        return out, seen.any(-1, keepdim=True), new_mem

    def _read_chunks(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, keep: Tensor,
                     mem: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_read` over the tokens in chunks of :data:`READ_CHUNK`, the memory carried
        from one to the next (causal), so a 64k-token context needs the memory of one chunk."""
        L = q.shape[2]
        if not self.causal or L <= READ_CHUNK:
            return self._read(q, k, v, positions, keep, mem)
        outs, seens = [], []
        for start in range(0, L, READ_CHUNK):
            t = slice(start, start + READ_CHUNK)
            out, seen, mem = self._read(q[:, :, t], k[:, :, t], v[:, :, t], positions[:, t],
                                        keep[:, t], mem)
            outs.append(out)
            seens.append(seen)
        return torch.cat(outs, 2), torch.cat(seens, 2), mem  # type: ignore[return-value]

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
    ) -> tuple[Tensor, MemoryState | None]:
        """The inner core's output mixed with the memory's read (see the module docstring);
        the cores' call, whose rotary ``positions`` (any form of
        :func:`~protein_performer.model.rotary.as_positions`) place the tokens."""
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
            mem_out, seen, mem = self._read_chunks(x, y, vv, pos, keep,
                                                   None if state is None else state.mem)
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

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, window={self.window}"
