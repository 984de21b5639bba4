"""The attention core: what every core declares and the one call they all take.

Why a base class: the attention layer, the loader, export, linearize, decoding and the weight
hash used to decide what a core can do from its name or from its state-dict path; now they ask
the core (HF's ``ATTENTION_FUNCTIONS``, timm's ``register_model``: a module declares what it
is). A core is built from the architecture config (:meth:`AttentionCore.from_config`), checks
the config it needs (:meth:`AttentionCore.config_problem`), and declares

- :attr:`~AttentionCore.drawn`: the tensors it draws rather than learns (FAVOR+'s ``omega`` and
  its statistic), which a weight hash, an attention swap and ``init_from`` leave out;
- :attr:`~AttentionCore.state_grows`: whether its state grows with the context (a KV cache) or
  stays the same size (FAVOR+, linear attention);
- :attr:`~AttentionCore.needs_positions`: the rotary positions it reads (``"member"``: it
  finds family members where the positions restart);
- :attr:`~AttentionCore.softmax`: how it relates to softmax attention (``"exact"``,
  ``"estimate"``: an unbiased estimate, ``"none"``), which says where its weights may go;
- :meth:`~AttentionCore.step_map`: the feature map a traced decoding step can run, if any (a
  wrapper that declares :attr:`~CoreWrapper.traced` runs in that step around its inner core's,
  through its ``step_*`` methods).

The one call is :meth:`AttentionCore.forward` ``(q, k, v, key_padding_mask, state, *,
keep_state, inplace, positions) -> (out, state)``: the checks every core needs (a state needs a
causal core, the mask's shape) run here once, then the core's :meth:`~AttentionCore.attend`.
Wrappers (:class:`CoreWrapper`) hold an ``inner`` core and are cores themselves.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from protein_performer.errors import UserError

#: Rotary positions as the cores take them (see ``model.rotary.as_positions``).
Positions = Tensor | int | None


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a core computes in: float64 for float64 inputs (gradient checks), else float32,
    also under bf16/fp16 autocast (the exponentials and sums need its range)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def real_tokens(key_padding_mask: Tensor | None, B: int, L: int, device: torch.device) -> Tensor:
    """(B, L) True where a token is real: the complement of ``key_padding_mask`` (True = pad)."""
    if key_padding_mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    return ~key_padding_mask.bool()


def allowed_keys(
    key_padding_mask: Tensor | None, causal: bool, query_slice: slice | None, L: int,
    device: torch.device,
) -> Tensor:  # fmt: skip
    """(B|1, 1, W|1, L) True where a query (those in ``query_slice``, all L when None) may weigh
    a key: a real one and, when ``causal``, none after the query. The one mask of the cores'
    attention maps (:meth:`AttentionCore.attention_map`) and exact attention's forward."""
    pos = torch.arange(L, device=device)
    if causal:
        rows = pos[query_slice if query_slice is not None else slice(None)]
        allowed = rows[:, None] >= pos[None, :]  # (W, L)
    else:
        allowed = torch.ones(1, L, dtype=torch.bool, device=device)  # every row alike
    allowed = allowed[None, None]  # (1, 1, W|1, L)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.bool()[:, None, None, :]
    return allowed


class MapBlocks(Protocol):
    """One head's residue x residue map as blocks, for contact maps (``map_blocks``)."""

    #: Row sums plus column sums of the map, (L,).
    sums: Tensor

    def add_upper_block(self, acc: Tensor, a: int, weight: float) -> None:
        """acc += weight * S[a:b, a:] with S = A + A^T, acc (b - a, L - a)."""


class AttentionCore(nn.Module):
    """A core: q, k, v (B, H, L, d) in, (B, H, L, dv) out, with an optional recurrent state.

    Subclasses implement :meth:`attend`, :meth:`attention_map` and :meth:`from_config`, declare
    what differs from the defaults below, and register with
    :func:`~protein_performer.model.cores.registry.register`.
    """

    #: The registered name (``PerformerConfig.attention`` for cores; a wrapper's own name).
    name: ClassVar[str] = ""
    #: Names (of this module's own parameters or buffers) drawn rather than learned.
    drawn: ClassVar[tuple[str, ...]] = ()
    #: Names of this module's own parameters that are gates, logits or scales rather than
    #: weights: an optimizer leaves them out of weight decay, as it does biases and norms.
    no_decay: ClassVar[tuple[str, ...]] = ()
    #: Whether the state grows with the context's length (a KV cache does).
    state_grows: ClassVar[bool] = False
    #: The rotary positions the core needs (None: any).
    needs_positions: ClassVar[str | None] = None
    #: "exact" (computes softmax attention), "estimate" (an estimate of it), "none".
    softmax: ClassVar[str] = "none"
    #: Words for messages ("FAVOR+ attention", "a position memory").
    label: ClassVar[str] = ""
    #: Whether the core keys a memory by position and takes aligned ``coordinates`` as those
    #: keys (the position memory); the others are never handed them.
    reads_coordinates: ClassVar[bool] = False

    causal: bool

    @classmethod
    def from_config(cls, config: Any) -> AttentionCore:
        """The core a ``PerformerConfig`` asks for."""
        raise NotImplementedError

    #: The ``config.kernel`` names this core computes (empty: it reads no kernel).
    kernels: tuple[str, ...] = ()

    @classmethod
    def config_problem(cls, config: Any) -> str | None:
        """What in ``config`` this core cannot run with (one line), or None."""
        if cls.kernels and config.kernel not in cls.kernels:
            return (
                f"unknown kernel {config.kernel!r} for {config.attention} attention; choose one "
                f"of {', '.join(cls.kernels)}"
            )
        return None

    @classmethod
    def extra_numel(cls, config: Any) -> int:
        """Numbers the core holds per layer (parameters and buffers), from the config alone."""
        return 0

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        state: Any = None,
        *,
        keep_state: bool = False,
        inplace: bool = False,
        positions: Positions = None,
        coordinates: Tensor | None = None,
    ) -> tuple[Tensor, Any]:
        """(B, H, L, d) x3 -> (B, H, L, dv) and, with ``keep_state``, the state after the
        tokens; ``key_padding_mask`` (B, L), True = pad (padded keys are never attended).

        ``state`` (batch 1, broadcast over B, or B) continues an earlier part of the row:
        prefill is a call from no state with ``keep_state``, extend one from a state, a decoding
        step one of a single token (:meth:`step`). ``inplace``: the caller gives ``state`` up,
        so a core may update it in place; otherwise ``state`` is never written. ``positions``:
        the tokens' rotary positions (any form of ``rotary.as_positions``), for the cores that
        read them. ``coordinates`` (B, L): aligned coordinates (``PerformerLM.forward``), handed
        to :meth:`attend` only by a core that declares :attr:`reads_coordinates`. A state needs
        a causal core (RNN mode is left to right).
        """
        if (state is not None or keep_state) and not self.causal:
            raise RuntimeError("RNN mode (a state) needs causal=True")
        if key_padding_mask is not None and key_padding_mask.shape != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"key_padding_mask {tuple(key_padding_mask.shape)} does not match "
                f"(batch, tokens) = {(q.shape[0], q.shape[2])}"
            )
        placed = {"coordinates": coordinates} if self.reads_coordinates else {}
        return self.attend(
            q, k, v, key_padding_mask, state,
            keep_state=keep_state, inplace=inplace, positions=positions, **placed,
        )  # fmt: skip

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        state: Any,
        *,
        keep_state: bool,
        inplace: bool,
        positions: Positions,
    ) -> tuple[Tensor, Any]:
        """The core's own math behind :meth:`forward` (inputs already checked)."""
        raise NotImplementedError

    def step(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Any,
        key_padding_mask: Tensor | None = None,
        *,
        inplace: bool = False,
        positions: Positions = None,
    ) -> tuple[Tensor, Any]:
        """One token per row, q, k, v (B, H, 1, d), after ``state`` -> output and new state:
        :meth:`forward` with a state kept (the recurrent form, causal only)."""
        return self(
            q, k, v, key_padding_mask, state,
            keep_state=True, inplace=inplace, positions=positions,
        )  # fmt: skip

    def attention_map(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None = None,
        query_slice: slice | None = None,
    ) -> Tensor:
        """Attention rows (B, H, W, L) for the queries in ``query_slice`` (all when None), rows
        summing to 1: the weights the core uses (or implies)."""
        raise NotImplementedError

    def map_blocks(self, q: Tensor, k: Tensor, L: int, window: int) -> MapBlocks:
        """One head's residue x residue map as blocks, for contact maps; q, k (1, 1, L + 2,
        d) of ``<cls> residues <eos>``; window: rows per sweep where a core needs sweeps."""
        raise UserError(
            f"contact maps from {self.label or self.name} are not supported; use a FAVOR+ or "
            "exact model"
        )

    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw the :attr:`drawn` tensors anew (nothing to draw: a no-op)."""

    def step_map(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The feature map a traced decoding step (``model.decode``) runs for this core, or
        None when it has none."""
        return None

    def cores(self) -> list[AttentionCore]:
        """This core and the cores it wraps, outermost first."""
        return [self]


class CoreWrapper(AttentionCore):
    """A core around another (``inner``): the window, the position memory. It is asked before
    the core it wraps is built (:meth:`wraps`), and answers for the pair."""

    inner: AttentionCore
    #: Wrappers apply in increasing order, the lowest closest to the core.
    order: ClassVar[int] = 0

    @classmethod
    def enabled(cls, config: Any) -> bool:
        """Whether ``config`` asks for this wrapper at all."""
        raise NotImplementedError

    @classmethod
    def wraps(cls, inner: type[AttentionCore]) -> bool:
        """Whether this wrapper can hold a core of class ``inner``."""
        return True

    @classmethod
    def from_config(cls, config: Any, inner: AttentionCore | None = None) -> AttentionCore:
        raise NotImplementedError

    #: Whether the traced decoding step (``model.decode``) can run this wrapper around its inner
    #: core's step: it then offers ``step_weights()`` (the learned tensors the step reads, in
    #: order), ``step_buffers(state, positions, keep, inplace, dtype)`` (host side: its own
    #: state as tensors the step may write, inner state apart), ``step_mix(out, q, k, v,
    #: positions, keep, buffers, weights)`` (a function of tensors, one token per row: the
    #: inner core's output (B, H, dv) mixed with its own) and ``step_state(inner, buffers,
    #: positions)`` (the state again).
    traced: ClassVar[bool] = False

    @property
    def state_grows(self) -> bool:  # type: ignore[override]
        return self.inner.state_grows

    def step_map(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The inner core's map where the traced step runs this wrapper (:attr:`traced`)."""
        return self.inner.step_map(device, dtype) if self.traced else None

    def redraw(self, generator: torch.Generator | None = None) -> None:
        self.inner.redraw(generator=generator)

    def map_blocks(self, q: Tensor, k: Tensor, L: int, window: int) -> MapBlocks:
        return self.inner.map_blocks(q, k, L, window)

    def cores(self) -> list[AttentionCore]:
        return [self, *self.inner.cores()]


def drawn_keys(model: nn.Module) -> set[str]:
    """State-dict keys of ``model`` that its cores declare drawn (see
    :attr:`AttentionCore.drawn`): asked of the modules, never read from a key's path."""
    keys = set()
    for prefix, module in model.named_modules():
        if isinstance(module, AttentionCore):
            own = {**module._parameters, **module._buffers}
            dot = f"{prefix}." if prefix else ""
            keys.update(f"{dot}{name}" for name in module.drawn if own.get(name) is not None)
    return keys


def model_cores(model: nn.Module) -> list[AttentionCore]:
    """The outermost core of every attention layer of ``model``, in layer order."""
    found: list[AttentionCore] = []
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, AttentionCore) and id(module) not in inner:
            found.append(module)
            inner.update(id(c) for c in module.cores()[1:])
    return found
