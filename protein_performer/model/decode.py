"""A decoding step as one traced graph: PerformerLM's one-token call for torch.compile or
TorchScript.

Why: in eager mode a token of the 8M model is about 1,400 small ops (views, casts, the
stabilizer's bookkeeping) around 26 matrix-vector products, and at batch 1 they cost as much
as the products (issue 33). :class:`CompiledStep` takes what a step needs out of the model
once (every weight, in the layout its product reads fastest, and each layer's FAVOR+ map),
looks the rotary rows up outside the graph, and runs every layer as one function of tensors
without host checks, so ``torch.compile`` makes one graph per model and batch size, whatever
the prompt and position, and ``torch.jit.trace`` records the same function's ops once per
batch size (a twentieth of a second; its interpreter then runs them without Python, about a
quarter off a step: issue 43). The attention math is the model's own
(:func:`.favor.recurrent.step`, :func:`.rotary.rotate_rows`); the products read a copy of the
weights, so eager, traced or compiled it gives ``PerformerLM.step``'s numbers to float
rounding. A model it cannot run (:func:`unsupported`) keeps ``PerformerLM.step``.

A wrapper that declares it (``CoreWrapper.traced``: the position memory) runs around a layer's
FAVOR+ step through the functions the model's own step calls (``step_buffers`` on the host,
``step_mix`` in the graph, ``step_state``); its state enters as buffers of a fixed size (the
memory's slots, doubled on the host when a position needs more), so a graph serves a batch
size and a buffer size, and a step traces or compiles again only when the memory grows.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.model.favor import FavorState, recurrent
from protein_performer.model.favor.kernels import FeatureMap
from protein_performer.model.performer import MASK_RATIO_TRAIN, PerformerLM
from protein_performer.model.rotary import rotate_rows

log = logging.getLogger(__name__)


def unsupported(model: PerformerLM) -> str | None:
    """Why :class:`CompiledStep` cannot run ``model`` (None: it can): it needs a causal
    float32 model whose every core offers a step map (``AttentionCore.step_map``: FAVOR+) with
    an exp kernel's shared map (wrappers around it: those that declare ``traced``), and plain
    projections."""
    if not model.config.causal:
        return "a masked LM has no decoding step"
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"{model.embed_tokens.weight.dtype} weights (float32 only)"
    device = model.embed_tokens.weight.device
    for i, layer in enumerate(model.layers, start=1):
        attn = layer.self_attn
        fmap = attn.core.step_map(device, torch.float32)
        if fmap is None:  # the innermost core without a step map (a wrapper's is its inner's)
            core = next(c for c in reversed(attn.core.cores())
                        if c.step_map(device, torch.float32) is None)  # fmt: skip
            return f"layer {i} has {core.label or core.name}, which has no traced step"
        if not (fmap.exp and fmap.Wa.dim() == 2):
            return f"layer {i}'s kernel {attn.core.kernel!r} has no exp step"
        plain = attn._fusable() and all(
            type(m) is nn.Linear for m in (attn.out_proj, layer.fc1, layer.fc2)
        )
        if not plain:  # the step reads the Linear weights, not the modules' forward
            return f"layer {i}'s projections are replaced (LoRA): merge the adapters first"
    if type(model.lm_head.dense) is not nn.Linear:
        return "the head's projection is replaced (LoRA): merge the adapters first"
    return None


#: How :class:`CompiledStep` runs its function: "compile" (``torch.compile``), "trace"
#: (``torch.jit.trace``, once per batch size) or "eager" (plain Python calls).
MODES = ("compile", "trace", "eager")


class CompiledStep:
    """``PerformerLM.step`` of a supported model (:func:`unsupported`) through one traced
    function, run as ``mode`` says (:data:`MODES`). Tokens are what generation feeds (never
    ``<mask>``: the token-dropout rule is the no-mask one).

    One graph serves every position and prompt (and, with a position memory, every memory of
    one size: see the module docstring): the states enter contiguous (a prefill's
    stabilizer is a strided slice, and strides are part of a graph's guards) and positions as
    tensors. Every weight a step reads lives in one flat buffer, built once and rebuilt when a
    parameter changes, so a compiled graph's guards check one tensor, not a hundred (they cost
    as much as a layer's small ops); the traced and eager modes take its views, made once per
    build. Each product reads the layout a one-row product reads fastest (about 20%): (in, out)
    for the projections to a wider or equal width, (out, in) through a matrix-vector product
    for the ones that narrow (``fc2``, measured in issue 43) and for the square ones at batch
    1. So the step matches ``PerformerLM.step`` to float rounding, not bit for bit, and holds a
    second copy of the model's weights. A trace that fails runs the function eagerly from then
    on, after one log line.
    """

    def __init__(self, model: PerformerLM, mode: str = "compile") -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"no compiled step for this model: {reason}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode = model, mode
        self._params = tuple(model.parameters())  # walking the modules costs a layer's ops
        self._flat: Tensor | None = None
        self._weight_views: tuple[Tensor, ...] = ()
        self._key: list | None = None
        self._layout: tuple[tuple[tuple[int, ...], ...], ...] = ((), (), ())
        self._maps: tuple[FeatureMap, ...] = ()
        # each layer's wrappers around its FAVOR+ core, outermost first, and their weight counts
        self._wraps = tuple(tuple(layer.self_attn.core.cores()[:-1]) for layer in model.layers)
        self._wrap_sizes = tuple(tuple(len(w.step_weights()) for w in ws) for ws in self._wraps)
        self._fn = torch.compile(self._run, dynamic=False) if mode == "compile" else None
        self._compiled_for: set[tuple] | None = set() if mode == "compile" else None
        self._traced: dict[tuple, Callable] = {}

    def _weights(self, device: torch.device) -> Tensor:
        """The flat buffer (see :meth:`_views` for its order), rebuilt when any parameter's
        storage or version changes (training, loading, a moved model)."""
        model = self.model
        key = [device, *[p._version for p in self._params], *[p.data_ptr() for p in self._params]]
        if self._flat is not None and self._key == key:
            return self._flat
        layers, maps = [], []
        for layer, wraps in zip(model.layers, self._wraps, strict=True):
            attn = layer.self_attn
            qkv_w, qkv_b = attn._qkv_weights()
            fmap = attn.core.step_map(device, torch.float32)
            layers.append(
                [*_norm(layer.self_attn_layer_norm), qkv_w.T, qkv_b]
                + [attn.out_proj.weight, attn.out_proj.bias]
                + [*_norm(layer.final_layer_norm), layer.fc1.weight.T, layer.fc1.bias]
                + [layer.fc2.weight, layer.fc2.bias, fmap.Wa]
                + ([] if fmap.bias is None else [fmap.bias])
                + [t for w in wraps for t in w.step_weights()]
            )
            maps.append(fmap)
        head = model.lm_head
        last = [*_norm(model.emb_layer_norm_after), head.dense.weight, head.dense.bias]
        last += [*_norm(head.layer_norm), head.weight.T, head.bias]
        first = [model.embed_tokens.weight]
        self._maps = tuple(maps)
        self._layout = tuple(tuple(tuple(t.shape) for t in ts) for ts in (first, layers[0], last))
        flat = torch.empty(sum(_sizes(self._shape_list())), device=device)
        with torch.no_grad():
            for view, t in zip(self._views(flat), first + sum(layers, []) + last, strict=True):
                view.copy_(t)
        self._flat, self._key = flat, key
        self._weight_views = tuple(self._views(flat))
        return flat

    def __call__(
        self,
        tokens: Tensor,
        positions: Tensor,
        states: Sequence[Any],
        pad: Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[Tensor, list[Any]]:
        """tokens (B,) at positions (B,) after per-layer ``states`` -> logits (B, V) and the
        new states, as ``PerformerLM.step`` (``inplace``: the sums are updated in place where
        they are plain (B, ...) float32 tensors, a memory's where it has room; otherwise
        ``states`` are left as they were)."""
        model = self.model
        device = tokens.device
        B = tokens.shape[0]
        if model.config.positions == "member":  # a <cls> starts a member at 0, as forward does
            positions = torch.where(tokens == model.config.cls_idx, 0, positions)
        rows = model.layers[0].self_attn.rot_emb.step_rows(positions, device, torch.float32)
        pad = torch.zeros_like(tokens, dtype=torch.bool) if pad is None else pad.bool()
        flat = self._weights(device)
        keep = ~pad
        inner, held = [], []
        for state, wraps in zip(states, self._wraps, strict=True):
            bufs = []
            for w in wraps:  # outermost first: each wrapper's buffers, then its inner state
                bufs.append(w.step_buffers(state, positions, keep, inplace, torch.float32))
                state = state.inner
            inner.append(state)
            held.append(tuple(bufs))
        kv = tuple(_owned(s.kv, B, inplace) for s in inner)
        mu = tuple(
            s.mu if _plain(s.mu, B) else s.mu.float().expand(B, -1).contiguous() for s in inner
        )
        bufs = tuple(held)
        # a graph per batch size and wrapper buffer shapes (a memory's grow by doubling)
        key = (B, *sorted({tuple(b.shape) for layer in bufs for w in layer for b in w}))
        if self._fn is not None and self._compiled_for is not None:
            if key not in self._compiled_for:  # a batch and memory size's first token waits
                self._compiled_for.add(key)
                note = "compiling the decoding step for batch size %d%s (once; tens of seconds)"
                log.info(note, B, "".join(f", buffers {tuple(n)}" for n in key[1:]))
            logits, mu = self._fn(tokens, rows, pad, positions, kv, mu, bufs, flat)
        else:
            args = (tokens, rows, pad, positions, kv, mu, bufs, self._weight_views)
            logits, mu = self._function((*key, device), args)(*args)
        new: list[Any] = []
        for a, b, layer, wraps in zip(kv, mu, bufs, self._wraps, strict=True):
            state: Any = FavorState(a, b)
            for w, own in zip(reversed(wraps), reversed(layer), strict=True):
                state = w.step_state(state, own, positions)
            new.append(state)
        return logits, new

    def _function(self, key: tuple, args: tuple) -> Callable:
        """The step's function for ``key`` (batch size, memory sizes, device) in the traced or
        eager mode: traced once per key on ``args`` (the states are written as the first step
        would: the trace runs on copies), eager where the trace fails (one log line) or in
        eager mode."""
        fn = self._traced.get(key)
        if fn is not None:
            return fn
        fn = self._run
        if self.mode == "trace":
            tokens, rows, pad, positions, kv, mu, bufs, weights = args
            bufs = tuple(tuple(tuple(t.clone() for t in w) for w in layer) for layer in bufs)
            kv = tuple(t.clone() for t in kv)
            copies = (tokens, rows, pad, positions, kv, tuple(mu), bufs, weights)
            try:
                with warnings.catch_warnings():  # shapes read as constants: one trace per key
                    warnings.simplefilter("ignore", torch.jit.TracerWarning)
                    fn = torch.jit.trace(self._run, copies, check_trace=False)
            except Exception as err:  # the tracer's failures have no common type
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                log.info("tracing the decoding step failed (%s); it runs eagerly", first)
                fn = self._run
        self._traced[key] = fn
        return fn

    def _shape_list(self) -> list[tuple[int, ...]]:
        """Every weight's shape in buffer order: the embedding, each layer's (the same
        layout: a few guards, not one per weight), the final norm and head."""
        first, layer, last = self._layout
        return [*first, *layer * len(self._maps), *last]

    def _views(self, flat: Tensor) -> Iterator[Tensor]:
        """The weights in ``flat``, in the order :meth:`_weights` put them."""
        shapes = self._shape_list()
        offset = 0
        for shape, size in zip(shapes, _sizes(shapes), strict=True):
            yield flat[offset : offset + math.prod(shape)].view(shape)
            offset += size

    def _run(
        self,
        tokens: Tensor,
        rows: Tensor,
        pad: Tensor,
        positions: Tensor,
        kvs: tuple[Tensor, ...],
        mus: tuple[Tensor, ...],
        bufs: tuple,
        weights: Tensor | tuple[Tensor, ...],
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The traced step: embedding, every layer (the model's one-token forward, host checks
        off; its wrappers' ``step_mix`` on their buffers ``bufs``), final norm and head; the
        sums ``kvs`` and the buffers are updated in place. ``weights``: the views of the flat
        buffer (traced, eager), or the buffer itself (the compiled graph's one input, viewed
        inside the graph)."""
        config = self.model.config
        w = iter(self._views(weights) if isinstance(weights, Tensor) else weights)
        x = F.embedding(tokens, next(w))  # (B, D)
        if config.token_dropout:
            x = x * (1 - MASK_RATIO_TRAIN)
        x = x.masked_fill(pad[:, None], 0.0)  # pad rows zeroed, as the forward's padding does
        B, D = x.shape
        eps = config.layer_norm_eps
        new_mu = []
        keep = ~pad
        layers = zip(self._maps, kvs, mus, self._wraps, self._wrap_sizes, bufs, strict=True)
        for fmap, kv, mu, wraps, sizes, held in layers:
            h = F.layer_norm(x, (D,), next(w), next(w), eps)
            qkv_w, qkv_b = next(w), next(w)
            qkv = torch.addmm(qkv_b, h, qkv_w).view(B, 3, config.heads, config.head_dim)
            qk = rotate_rows(qkv[:, :2], rows)  # (B, 2, H, d)
            out_w, out_b = next(w), next(w)
            ln2 = next(w), next(w)
            w1, b1, w2, b2, wa = next(w), next(w), next(w), next(w), next(w)
            step_map = type(fmap)(wa, None if fmap.bias is None else next(w), fmap.t2, fmap.eps)
            out, state = recurrent.step(
                step_map, FavorState(kv, mu), qk[:, 0], qk[:, 1], qkv[:, 2], pad, True, False
            )
            own = [tuple(next(w) for _ in range(n)) for n in sizes]
            for wrap, params, buffers in zip(wraps[::-1], own[::-1], held[::-1], strict=True):
                out = wrap.step_mix(out, qk[:, 0], qk[:, 1], qkv[:, 2], positions, keep,
                                    buffers, params)  # fmt: skip
            x = x + _narrow(out_b, out.reshape(B, D), out_w)
            h = F.layer_norm(x, (D,), *ln2, eps)
            x = x + _narrow(b2, F.gelu(torch.addmm(b1, h, w1)), w2)
            new_mu.append(state.mu)
        x = F.layer_norm(x, (D,), next(w), next(w), eps)
        dense_w, dense_b = next(w), next(w)
        x = F.layer_norm(F.gelu(_narrow(dense_b, x, dense_w)), (D,), next(w), next(w), eps)
        head_w, head_b = next(w), next(w)
        return torch.addmm(head_b, x, head_w), tuple(new_mu)


def _narrow(bias: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """bias + x weight^T for x (B, in) and weight (out, in) stored as the Linear holds it: at
    batch 1 a matrix-vector product, which reads that layout fastest when out <= in."""
    if x.shape[0] == 1:
        return torch.addmv(bias, weight, x[0])[None]
    return torch.addmm(bias, x, weight.T)


def _sizes(shapes: Sequence[tuple[int, ...]]) -> list[int]:
    """Each weight's room in the flat buffer: its size rounded up to 64 bytes (aligned views)."""
    return [-(-math.prod(shape) // 16) * 16 for shape in shapes]


def _norm(norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    return norm.weight, norm.bias


def _plain(t: Tensor, B: int) -> bool:
    """Whether a state tensor enters the graph as it is: (B, ...) float32, contiguous (checked
    in Python: cheaper than the no-op casts per layer and token)."""
    return t.shape[0] == B and t.dtype == torch.float32 and t.is_contiguous()


def _owned(kv: Tensor, B: int, inplace: bool) -> Tensor:
    """A sum the traced step may write: ``kv`` itself when the caller gave it up and it is a
    plain (B, ...) float32 tensor, else a contiguous copy (a batch-1 state broadcast to B)."""
    if inplace and _plain(kv, B):
        return kv
    kv = kv.to(torch.float32).expand(B, *kv.shape[1:])
    return kv.clone(memory_format=torch.contiguous_format)
