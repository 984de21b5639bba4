"""A decoding step as one traced graph: PerformerLM's one-token call for torch.compile.

Why: in eager mode a token of the 8M model is about 1,400 small ops (views, casts, the
stabilizer's bookkeeping) around 25 matrix-vector products, and at batch 1 they cost as much
as the products (issue 33). :class:`CompiledStep` takes what a step needs out of the model
once (the stacked q/k/v weights, each layer's FAVOR+ map), looks the rotary rows up outside
the graph, and runs every layer as one function of tensors without host checks, so
``torch.compile`` makes one graph per model and batch size. The function is made of the
model's own parts (:func:`.favor.recurrent.step`, :func:`.rotary.rotate_rows`, the layers'
modules): in eager mode (``compile=False``) it gives ``PerformerLM.step``'s numbers exactly,
compiled the same to float rounding. A model it cannot run (:func:`unsupported`) keeps
``PerformerLM.step``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from protein_performer.model.favor import FavorAttention, FavorState, recurrent
from protein_performer.model.performer import MASK_RATIO_TRAIN, PerformerLM
from protein_performer.model.rotary import rotate_rows

log = logging.getLogger(__name__)


def unsupported(model: PerformerLM) -> str | None:
    """Why :class:`CompiledStep` cannot run ``model`` (None: it can): it needs a causal
    float32 FAVOR+ model with an exp kernel's shared map and plain projections."""
    if not model.config.causal:
        return "a masked LM has no decoding step"
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"{model.embed_tokens.weight.dtype} weights (float32 only)"
    for i, layer in enumerate(model.layers, start=1):
        attn = layer.self_attn
        if type(attn.core) is not FavorAttention:
            return f"layer {i} has {type(attn.core).__name__} attention (FAVOR+ only)"
        fmap = attn.core._step_map(model.embed_tokens.weight.device, torch.float32)
        if not (fmap.exp and fmap.Wa.dim() == 2):
            return f"layer {i}'s kernel {attn.core.kernel!r} has no exp step"
        if not attn._fusable():
            return f"layer {i}'s projections are replaced (LoRA): merge the adapters first"
    return None


class CompiledStep:
    """``PerformerLM.step`` of a supported model (:func:`unsupported`) through one compiled
    function; states are never written (``inplace`` allows that, it does not require it).
    Tokens are what generation feeds (never ``<mask>``: the token-dropout rule is the no-mask
    one)."""

    def __init__(self, model: PerformerLM, compile: bool = True) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"no compiled step for this model: {reason}")
        self.model = model
        self._fn = torch.compile(self._layers, dynamic=False) if compile else self._layers

    def __call__(
        self,
        tokens: Tensor,
        positions: Tensor,
        states: Sequence[FavorState],
        pad: Tensor | None = None,
    ) -> tuple[Tensor, list[FavorState]]:
        """tokens (B,) at positions (B,) after per-layer ``states`` -> logits (B, V) and the
        new states, as ``PerformerLM.step``."""
        model = self.model
        device = tokens.device
        if model.config.positions == "member":  # a <cls> starts a member at 0, as forward does
            positions = torch.where(tokens == model.config.cls_idx, 0, positions)
        rows = model.layers[0].self_attn.rot_emb.step_rows(positions, device, torch.float32)
        keep = torch.ones(tokens.shape, dtype=torch.float32, device=device)
        if pad is not None:
            keep = keep - pad.to(torch.float32)
        pad = torch.zeros_like(tokens, dtype=torch.bool) if pad is None else pad.bool()
        parts = tuple(
            (layer.self_attn._qkv_weights(), layer.self_attn.core._step_map(device, torch.float32))
            for layer in model.layers
        )
        kv = tuple(s.kv for s in states)
        mu = tuple(s.mu for s in states)
        logits, kv, mu = self._fn(tokens, rows, keep, pad, kv, mu, parts)
        return logits, [FavorState(a, b) for a, b in zip(kv, mu, strict=True)]

    def _layers(
        self,
        tokens: Tensor,
        rows: Tensor,
        keep: Tensor,
        pad: Tensor,
        kvs: tuple[Tensor, ...],
        mus: tuple[Tensor, ...],
        parts: tuple,
    ) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The traced step: embedding, every layer (the same ops as the model's one-token
        forward, host checks off), final norm and head."""
        model = self.model
        x = model.embed_tokens(tokens)  # (B, D)
        if model.config.token_dropout:
            x = x * (1 - MASK_RATIO_TRAIN)
        x = x * keep[:, None]  # pad rows zeroed, as the forward's padding does
        B, D = x.shape
        new_kv, new_mu = [], []
        layers = zip(model.layers, parts, kvs, mus, strict=True)
        for layer, ((weight, bias), fmap), kv, mu in layers:
            attn = layer.self_attn
            ln1, ln2 = layer.self_attn_layer_norm, layer.final_layer_norm
            h = F.layer_norm(x, ln1.normalized_shape, ln1.weight, ln1.bias, ln1.eps)
            qkv = torch.addmm(bias, h, weight.T).view(B, 3, attn.heads, attn.head_dim)
            qk = rotate_rows(qkv[:, :2], rows).to(h.dtype)  # (B, 2, H, d)
            out, state = recurrent.step(
                fmap, FavorState(kv, mu), qk[:, 0], qk[:, 1], qkv[:, 2], pad, False, False
            )
            x = x + attn.out_proj(out.reshape(B, D))
            h = F.layer_norm(x, ln2.normalized_shape, ln2.weight, ln2.bias, ln2.eps)
            x = x + layer.fc2(F.gelu(layer.fc1(h)))
            new_kv.append(state.kv)
            new_mu.append(state.mu)
        return model.lm_head(model.emb_layer_norm_after(x)), tuple(new_kv), tuple(new_mu)
