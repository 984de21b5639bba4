"""Weights against a model: names and shapes checked before anything is built or copied, then
a strict load. Every reader and the attention swap use these, so a file that does not fit is
refused one way, with the first offending keys named."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from protein_performer.errors import UserError
from protein_performer.model.config import PerformerConfig
from protein_performer.model.cores import drawn_keys, upgrade_keys
from protein_performer.model.performer import PerformerLM

SHOW_KEYS = 5  # how many offending keys an error message names


class NoRandomInit(TorchFunctionMode):
    """Skips random initialisation of meta tensors (there is nothing to fill): torch's first
    ``normal_`` on the meta device imports its reference kernels, about 5 s of CPU, which every
    load would otherwise pay just to learn the model's shapes."""

    _SKIP = frozenset({"normal_", "uniform_", "trunc_normal_"})

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,  # noqa: ANN401 - torch's protocol
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:  # noqa: ANN401
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self._SKIP:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def check_shapes(
    config: PerformerConfig, found: Mapping[str, tuple[int, ...]], where: object, fix: str
) -> None:
    """Tensor names and shapes (a safetensors header, a checkpoint's state dict) against those
    ``config`` implies, before the model is built: a config edited to ``depth: 20000`` beside
    a normal state dict is refused at once, not after allocating 20000 layers. Names of 0.5
    (the core under its attention's name) are read as today's."""
    found = upgrade_keys(found)
    # Shapes without memory: one block of each kind stands for every block of its kind (a
    # hybrid stack's exact blocks differ: two blocks with exact_every = 2 hold both kinds).
    few = min(config.exact_every, 2) if config.exact_every else 1
    small = dataclasses.replace(config, depth=few, exact_every=few if config.exact_every else 0)
    with torch.device("meta"), NoRandomInit():
        shapes = {k: tuple(v.shape) for k, v in PerformerLM(small).state_dict().items()}
    kinds: dict[str, dict[str, tuple[int, ...]]] = {}
    for j in range(few):
        prefix = f"layers.{j}."
        kinds.setdefault(small.layer_attention(j + 1), {
            k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)
        })

    def block(i: int) -> dict[str, tuple[int, ...]]:
        return kinds[config.layer_attention(i + 1)]

    top = {k: v for k, v in shapes.items() if not k.startswith("layers.")}
    unexpected: list[str] = []
    wrong: list[str] = []
    for name, shape in found.items():
        parts = name.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit():
            i = int(parts[1])
            want = block(i).get(parts[2]) if i < config.depth else None
        else:
            want = top.get(name)
        if want is None:
            unexpected.append(name)
        elif want != tuple(shape):
            wrong.append(f"{name} {tuple(shape)} vs model {want}")
    expected = len(top) + sum(  # a depth of 20000 is counted per kind, not per block
        len(b) * sum(config.layer_attention(i + 1) == kind for i in range(config.depth))
        for kind, b in kinds.items()
    )
    matched = len(found) - len(unexpected)
    tied = "lm_head.weight" in top and "lm_head.weight" not in found
    missing: list[str] = []
    if matched + tied < expected:
        tops = (n for n in top if n not in found and n != "lm_head.weight")
        # Generated lazily, stopping at the first few: a depth of 20000 is counted, not listed.
        layers = (f"layers.{i}.{k}" for i in range(config.depth) for k in block(i))
        for name in chain(tops, (n for n in layers if n not in found)):
            missing.append(name)
            if len(missing) == SHOW_KEYS:
                break
    count = expected - matched - tied
    named = f"{count} missing key(s) for depth={config.depth}: {', '.join(missing)}"
    problems = misfit(named if missing else "", unexpected, wrong)
    if problems:
        raise UserError(f"{where}: {' | '.join(problems)}; {fix}")


def misfit(missing: str, unexpected: list[str], wrong: list[str]) -> list[str]:
    """The parts of a "weights do not fit" message: the missing keys' line as the caller words
    it, then the first unexpected keys and shape mismatches."""
    problems = [missing] if missing else []
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s): {', '.join(unexpected[:SHOW_KEYS])}"
        )
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:SHOW_KEYS])}")
    return problems


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier entry's storage (the tied LM-head matrix)."""
    seen: set[int] = set()
    aliases: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen and tensor.numel():
            aliases.add(name)
        seen.add(ptr)
    return aliases


@dataclass
class StateDiff:
    """How a state dict fails to fit a model: names the model has and the state lacks, names
    the model has no place for, and (name, state's, model's) where shapes differ or the kinds
    of number do (the dtypes then named too)."""

    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, str, str]]

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)


def diff_state(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    optional: Callable[[str], bool] = lambda name: False,
) -> StateDiff:
    """``state`` against ``model``'s own state dict, before ``model.load_state_dict(state,
    strict=False)`` copies it in: every weight is compared, and only the names ``optional``
    accepts (a tied alias, FAVOR+ features drawn rather than loaded) may be absent."""
    expected = model.state_dict()
    mismatched = []
    for k, ours in expected.items():
        theirs = state.get(k)
        if theirs is None:
            continue
        # A float tensor stored as integers (a safetensors header whose dtype lies) would
        # otherwise be read as integers and cast, silently.
        kinds = _number_kind(theirs) != _number_kind(ours)
        if kinds or tuple(theirs.shape) != tuple(ours.shape):
            spec = (f"{tuple(t.shape)}" + (f" {t.dtype}" if kinds else "") for t in (theirs, ours))
            mismatched.append((k, *spec))
    return StateDiff(
        missing=[k for k in expected if k not in state and not optional(k)],
        unexpected=[k for k in state if k not in expected],
        mismatched=mismatched,
    )


def _number_kind(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.bool:
        return "bool"
    return "float" if tensor.is_floating_point() or tensor.is_complex() else "integer"


def load_weights(model: PerformerLM, state: dict[str, torch.Tensor], path: Path) -> None:
    """Strict load with a message naming the first mismatching keys and shapes (names of 0.5
    read as today's)."""
    state = upgrade_keys(state)
    expected = model.state_dict()
    aliases = tied_aliases(model)
    diff = diff_state(model, state, aliases.__contains__)
    missing, unexpected = diff.missing, diff.unexpected
    wrong = [f"{k} {theirs} vs model {ours}" for k, theirs, ours in diff.mismatched]
    problems = misfit(
        f"{len(missing)} missing key(s): {', '.join(missing[:SHOW_KEYS])}" if missing else "",
        unexpected,
        wrong,
    )
    if problems:
        raise UserError(
            f"{path}: the weights do not fit the stored model config: {' | '.join(problems)}. "
            "The file was edited or written by an incompatible version"
        )
    full = dict(state)
    for k in aliases:
        full.setdefault(k, state.get(k, expected[k]))
    model.load_state_dict(full, strict=False)
    # Re-tie: load_state_dict copies into the shared Parameter, but an alias given explicitly
    # (Lightning stores both names) must not silently untie anything.
    if model.lm_head.weight is not model.embed_tokens.weight:  # pragma: no cover - defensive
        model.lm_head.weight = model.embed_tokens.weight


def not_imported(model: torch.nn.Module) -> Callable[[str], bool]:
    """Which of ``model``'s entries no other model or ESM-2 source supplies: what its cores
    draw (FAVOR+ features, asked of the cores) and the tied LM-head alias."""
    return (drawn_keys(model) | tied_aliases(model)).__contains__
