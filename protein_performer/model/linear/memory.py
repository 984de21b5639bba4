"""A memory keyed by position within a family member, mixed into any attention core.

Why: in a family row ``<cls> m1 <eos> <cls> m2 <eos> ...`` with member positions (rotary
restarting at every ``<cls>``), homologs line up roughly by position, and copying from them is
what exact attention learns first (issue 30). A linear-attention cousin of MSA column
attention keeps, per head, one sum of [v | 1] per member position p: M[p] = sum over the keys
seen at position p. A query at position p reads a learned soft kernel over nearby positions,

    mem_t = sum_D w_h(D) M[p_t + D] / sum_D w_h(D) count[p_t + D],   D in [-W, W],

so an indel that shifts a homolog by a few positions still matches, and a head can learn to
read D = +1 (the residue after the aligned one: what a causal model must predict). The state is
(P + 2W) x (dv + 1) per head, P the longest member it holds: constant in the number of members
and in the context's length. A per-head gate from the query, g_t = sigmoid(q_t . u_h + b_h),
mixes it with the core's own output: out = core + g (mem - core); where no memory entry is in
reach (positions >= P, an empty memory) the output is the core's.

The causal parallel form splits the keys j <= t into the members before t's (a table per
member, prefix-summed over members) and t's own member up to t (a causal window within the
member), which is what the recurrent state accumulates one token at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.linear.core import _TINY, _compute_dtype


class MemoryState(NamedTuple):
    """The mixed core's state: the inner core's (``inner``) and the position memory
    ``mem`` (B, H, P + 2W, dv + 1), slot p + W holding the sum of [v | 1] at position p."""

    inner: Any
    mem: Tensor


def member_layout(positions: Tensor) -> Tensor:
    """Member index (B, L) of each token: a new member starts where the position does not
    continue the previous token's (a ``<cls>`` resets it to 0), the first token in member 0."""
    new = torch.ones_like(positions, dtype=torch.bool)
    new[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return new.long().cumsum(-1) - 1


def as_positions(positions: Tensor | int | None, B: int, L: int, device) -> Tensor:
    """Rotary positions in any of the attention layer's forms -> (B, L) long."""
    if isinstance(positions, Tensor):
        return positions.to(device=device, dtype=torch.long).expand(B, L)
    start = 0 if positions is None else int(positions)
    return (torch.arange(L, device=device) + start).expand(B, L)


class PositionMemory(nn.Module):
    """Wraps an attention core (``inner``) with the member-position memory described above."""

    needs_positions = True

    def __init__(
        self, inner: nn.Module, heads: int, dim_head: int, max_positions: int, window: int
    ) -> None:
        super().__init__()
        self.inner = inner
        self.causal = inner.causal
        self.max_positions = max_positions
        self.window = window
        # w_h(D) = exp(offset_logits[h, D + W]); 0 = a flat window at first.
        self.offset_logits = nn.Parameter(torch.zeros(heads, 2 * window + 1))
        self.gate_weight = nn.Parameter(torch.zeros(heads, dim_head))
        self.gate_bias = nn.Parameter(torch.full((heads,), -1.0))

    def redraw(self, generator: torch.Generator | None = None) -> None:
        self.inner.redraw(generator=generator)

    def _slots(self, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Slot p + W of each token and whether it enters or reads the memory (real, p < P)."""
        valid = keep & (positions >= 0) & (positions < self.max_positions)
        return (positions.clamp(0, self.max_positions - 1) + self.window), valid

    def _read(
        self,
        vx: Tensor,
        positions: Tensor,
        keep: Tensor,
        mem: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """Memory sums (B, H, L, dv+1) for every token, and the memory after the tokens."""
        B, H, L, C = vx.shape
        W, S = self.window, self.max_positions + 2 * self.window
        slot, valid = self._slots(positions, keep)
        w = self.offset_logits.to(vx.dtype).exp()  # (H, 2W+1)
        vx = vx * valid[:, None, :, None].to(vx.dtype)
        member = member_layout(positions)  # (B, L)
        K = int(member.max()) + 1
        # tables[b, h, i] = sums of the members before i (and the state), by slot
        table = vx.new_zeros(B, H, K + 1, S, C)
        flat = (member + 1) * S + slot  # (B, L) into the (K+1)*S slots
        table.view(B, H, (K + 1) * S, C).scatter_add_(
            2, flat[:, None, :, None].expand(B, H, L, C), vx
        )
        table = table.cumsum(2)
        if mem is not None:
            table = table + mem.to(vx)[:, :, None]
        new_mem = table[:, :, K]  # (B, H, S, C): everything, state included
        read = torch.zeros_like(vx)
        base = member * S + slot  # the table before t's own member
        view = table.view(B, H, (K + 1) * S, C)
        for d in range(-W, W + 1):
            index = (base + d)[:, None, :, None].expand(B, H, L, C)
            read = read + w[:, d + W, None, None] * view.gather(2, index)
        if self.causal:  # t's own member, keys j <= t (positions continue by 1 within it)
            for d in range(0, W + 1):
                if d >= L:
                    break
                same = (member[:, d:] == member[:, :-d or None])[:, None, :, None]
                shifted = vx[:, :, : L - d] * same.to(vx.dtype)
                read[:, :, d:] = read[:, :, d:] + w[:, W - d, None, None] * shifted
        else:  # bidirectional: every token of every member, the own member included
            read = torch.zeros_like(vx)
            total = table[:, :, K]
            for d in range(-W, W + 1):
                index = (slot + d)[:, None, :, None].expand(B, H, L, C)
                read = read + w[:, d + W, None, None] * total.gather(2, index)
        read = read * valid[:, None, :, None].to(vx.dtype)  # nothing read past P
        return read, new_mem

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
        the same call shape as the cores, plus the rotary ``positions`` of the tokens."""
        if not self.causal and (state is not None or keep_state):
            raise RuntimeError("RNN mode (a state) needs causal=True")
        B, H, L, _ = q.shape
        inner_kwargs: dict[str, Any] = {}
        if state is not None or keep_state:
            inner_kwargs = {"state": None if state is None else state.inner,
                            "keep_state": keep_state, "inplace": inplace}
        result = self.inner(q, k, v, key_padding_mask, **inner_kwargs)
        out, inner_state = result if isinstance(result, tuple) else (result, None)
        pos = as_positions(positions, B, L, q.device)
        keep = (
            torch.ones(B, L, dtype=torch.bool, device=q.device)
            if key_padding_mask is None
            else ~key_padding_mask.bool()
        )
        dtype = _compute_dtype(q)
        with torch.autocast(device_type=q.device.type, enabled=False):
            vx = F.pad(v.to(dtype), (0, 1), value=1.0)  # (B, H, L, dv+1)
            read, mem = self._read(vx, pos, keep, None if state is None else state.mem)
            den = read[..., -1:]
            mem_out = read[..., :-1] / den.clamp_min(_TINY)
            gate = torch.sigmoid(
                (q.to(dtype) * self.gate_weight.to(dtype)[:, None]).sum(-1, keepdim=True)
                + self.gate_bias.to(dtype)[:, None, None]
            )  # (B, H, L, 1)
            gate = gate * (den > 0).to(dtype)  # no entry in reach: the core's output alone
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
