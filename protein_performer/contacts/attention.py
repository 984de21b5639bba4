"""Implied attention maps of a trained model for chosen layers, heads and a residue window.

A FAVOR+ model never forms its attention matrix, yet every head still has one: the output for
V = I, i.e. the normalized feature products phi(q_i)^T phi(k_j) / sum_l phi(q_i)^T phi(k_l).
``favor.favor_attention_map`` computes those rows for a window of queries with the same
features and stabilizers as the forward pass (so ``map @ V`` is the layer's output), in
O(W x L + L x M) memory; the exact twin gets softmax rows the same way.

The model runs once: a forward hook on each requested layer's attention module takes its input,
asks the module for its rotated q/k (``MultiHeadSelfAttention.rotated_qk``, the same code path
as ``forward``) and turns them into rows head by head, so at most one head's (W, T) block is
alive besides the output. The forward stops after the deepest requested layer.

Coordinates are residues (0-based, ``<cls>``/``<eos>`` stripped): a map entry [i, j] is the
attention of residue ``start + i`` on residue ``key_start + j``. Rows are normalized over every
token the model attends to, specials included (as the model itself does, and as ESM's contact
head sees them), so after stripping a row sums to 1 minus its ``<cls>``/``<eos>`` mass; pass
``strip_special=False`` to keep those two columns (then rows sum to 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from protein_performer.errors import UserError
from protein_performer.model.config import block_number
from protein_performer.model.performer import PerformerLM

#: Called once per requested layer with (layer, maps (H', W, K)) instead of storing the maps.
MapSink = Callable[[int, torch.Tensor], None]


@dataclass
class AttentionMaps:
    """Maps of one sequence: ``maps[layer]`` is (H', W, K), rows = residues [start, end),
    columns = residues [key_start, key_end) (or all tokens with specials kept)."""

    maps: dict[int, torch.Tensor]
    layers: list[int]  # resolved block numbers, 1..depth, ascending
    heads: list[int]
    start: int
    end: int
    key_start: int
    key_end: int
    length: int  # residues in the sequence
    strip_special: bool = True

    def stacked(self) -> torch.Tensor:
        """(n_layers, n_heads, W, K) in ``layers`` order."""
        return torch.stack([self.maps[i] for i in self.layers])


class _StopForwardError(Exception):
    """Raised by the last hook: the layers after the deepest requested one are not needed."""


def resolve_layers(model: PerformerLM, layers: Sequence[int] | None) -> list[int]:
    """ESM-style layer indices (1..depth, negative from the end; None = all) -> sorted blocks."""
    depth = model.config.depth
    if layers is None:
        return list(range(1, depth + 1))
    out = {block_number(int(i), depth, lowest=1, what="attention layer") for i in layers}
    if not out:
        raise UserError("no attention layers requested")
    return sorted(out)


def resolve_heads(model: PerformerLM, heads: Sequence[int] | None) -> list[int]:
    """Head indices (0-based, None = all) checked against the model."""
    n = model.config.heads
    if heads is None:
        return list(range(n))
    out = [int(h) for h in heads]
    bad = [h for h in out if not 0 <= h < n]
    if bad or not out:
        raise UserError(
            f"attention head(s) {bad or out} invalid for {n} heads (valid: 0..{n - 1})"
        )
    return out


def resolve_selection(
    model: PerformerLM, layers: Sequence[int] | None, heads: Sequence[int] | None
) -> tuple[list[int], list[int]]:
    """The (layers, heads) a set of attention maps covers: :func:`resolve_layers` and
    :func:`resolve_heads` together, as every caller that draws maps needs both."""
    return resolve_layers(model, layers), resolve_heads(model, heads)


def _check_window(window: tuple[int, int] | None, length: int, what: str) -> tuple[int, int]:
    if window is None:
        return 0, length
    start, end = int(window[0]), int(window[1])
    if not 0 <= start < end <= length:
        raise UserError(
            f"{what} [{start}, {end}) is not inside the sequence's {length} residues "
            f"(0-based, end exclusive: 0 <= start < end <= {length})"
        )
    return start, end


def encode_sequence(model: PerformerLM, sequence: str, alphabet=None) -> torch.Tensor:
    """``<cls> residues <eos>`` as a (1, T) LongTensor on the model's device."""
    from protein_performer.data.tokenizer import Alphabet

    alphabet = alphabet or Alphabet()
    try:
        ids = alphabet.encode_with_specials(sequence)
    except (KeyError, ValueError) as exc:
        raise UserError(f"cannot encode the sequence: {exc}") from None
    device = next(model.parameters()).device
    return torch.as_tensor(ids, dtype=torch.long, device=device)[None]


@torch.no_grad()
def attention_maps(
    model: PerformerLM,
    sequence: str | torch.Tensor,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    window: tuple[int, int] | None = None,
    key_window: tuple[int, int] | None = None,
    strip_special: bool = True,
    sink: MapSink | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionMaps:
    """Implied attention rows of one sequence for ``layers`` x ``heads``, queries in ``window``.

    ``sequence``: a residue string or a (T,)/(1, T) token tensor ``<cls> ... <eos>`` (no pads).
    ``window``/``key_window``: residue ranges [start, end) for rows/columns (None = all);
    memory is O(W x T) per head. ``sink``: receive each layer's maps instead of keeping them
    (``maps`` is then empty), for callers that reduce maps on the fly.
    """
    tokens = encode_sequence(model, sequence) if isinstance(sequence, str) else sequence
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[0] != 1:
        raise ValueError(
            f"one sequence at a time: tokens must be (T,) or (1, T), got {tokens.shape}"
        )
    cfg = model.config
    if bool(tokens.eq(cfg.pad_idx).any()):
        raise ValueError("tokens contain <pad>: give one unpadded sequence")
    length = tokens.shape[1] - 2  # residues
    if length < 1:
        raise UserError("the sequence is empty")
    want, head_list = resolve_selection(model, layers, heads)
    start, end = _check_window(window, length, "window")
    key_start, key_end = _check_window(key_window, length, "key window")
    # Residue r is token r + 1; with specials kept the columns are all T tokens.
    rows = slice(start + 1, end + 1)
    cols = slice(key_start + 1, key_end + 1) if strip_special else slice(0, length + 2)
    captured: dict[int, torch.Tensor] = {}

    def on_layer(layer_no: int, module, q, k, padding_mask) -> None:
        out = torch.empty(
            len(head_list), rows.stop - rows.start, cols.stop - cols.start, dtype=dtype
        )  # (H', W, K) on CPU
        for n, h in enumerate(head_list):
            w = module.attention_map(q, k, padding_mask, heads=[h], query_slice=rows)
            out[n] = w[0, 0, :, cols].to("cpu", dtype)  # (W, K)
            del w
        if sink is not None:
            sink(layer_no, out)
        else:
            captured[layer_no] = out

    run_with_qk(model, tokens, want, on_layer)
    return AttentionMaps(
        maps=captured,
        layers=want,
        heads=head_list,
        start=start,
        end=end,
        key_start=key_start if strip_special else 0,
        key_end=key_end if strip_special else length + 2,
        length=length,
        strip_special=strip_special,
    )


#: Called with (layer, its attention module, rotated q, k (1, H, T, d), padding mask or None).
QKSink = Callable[[int, torch.nn.Module, torch.Tensor, torch.Tensor, "torch.Tensor | None"], None]


def run_with_qk(model: PerformerLM, tokens: torch.Tensor, layers: list[int], sink: QKSink) -> None:
    """Run ``model`` on ``tokens`` and hand each layer in ``layers`` (sorted block numbers) its
    rotated q, k as the attention core sees them; the forward stops after the last one."""
    last = layers[-1]
    handles = []

    def make_hook(layer_no: int):
        def hook(module, args, kwargs, output) -> None:
            x = args[0] if args else kwargs["x"]
            padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            q, k = module.rotated_qk(x)  # (1, H, T, d)
            sink(layer_no, module, q, k, padding_mask)
            if layer_no == last:
                raise _StopForwardError

        return hook

    try:
        for i in layers:
            attn = model.layers[i - 1].self_attn
            handles.append(attn.register_forward_hook(make_hook(i), with_kwargs=True))
        with contextlib.suppress(_StopForwardError):
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()


def full_maps(
    model: PerformerLM,
    sequence: str,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> torch.Tensor:
    """All residue x residue maps (n_layers, n_heads, L, L): the input of contact prediction."""
    return attention_maps(model, sequence, layers=layers, heads=heads).stacked()
