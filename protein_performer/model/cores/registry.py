"""The registry of attention cores and wrappers: names to classes, and the questions a config
asks of them (which core a layer builds, what the config must say for it, how many numbers it
holds). Nothing here compares a name with a literal: a core is found by the name it registered.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from protein_performer.model.cores.base import AttentionCore, CoreWrapper

#: attention name -> core class (``PerformerConfig.attention``).
CORES: dict[str, type[AttentionCore]] = {}
#: wrapper name -> wrapper class, applied inner first (:attr:`CoreWrapper.order`).
WRAPPERS: dict[str, type[CoreWrapper]] = {}

C = TypeVar("C", bound=type[AttentionCore])


def register(name: str) -> Callable[[C], C]:
    """Class decorator: ``@register("favor")`` makes the core buildable by that name (a
    :class:`CoreWrapper` subclass registers as a wrapper)."""

    def add(cls: C) -> C:
        table: dict[str, Any] = WRAPPERS if issubclass(cls, CoreWrapper) else CORES
        if name in table and table[name] is not cls:
            raise ValueError(f"attention core {name!r} is registered twice")
        cls.name = name
        table[name] = cls
        return cls

    return add


#: Modules outside this folder that register cores (kept where checkpoints and docs know them).
_BESIDE = ("exact", "favor.module", "linear.core", "linear.window", "linear.memory")
_loaded: list[bool] = []


def _load() -> None:
    """Import every module that registers a core, once: those beside the model, then every
    module of this folder (a new core is a file here and nothing else)."""
    if _loaded:
        return
    _loaded.append(True)
    for name in _BESIDE:
        importlib.import_module(f"protein_performer.model.{name}")
    # this folder read by its path, not through its package (which imports this module)
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{info.name}")


def names() -> tuple[str, ...]:
    """The registered attention names (``PerformerConfig.attention``'s choices)."""
    _load()
    return tuple(CORES)


def core_class(name: str) -> type[AttentionCore]:
    """The core registered as ``name``; ValueError naming the registered ones."""
    _load()
    if name not in CORES:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(CORES)}")
    return CORES[name]


def _wrappers(config: Any, inner: type[AttentionCore]) -> Iterator[type[CoreWrapper]]:
    """The wrappers ``config`` turns on that can hold a core of class ``inner``, inner first."""
    for wrapper in sorted(WRAPPERS.values(), key=lambda w: w.order):
        if wrapper.enabled(config) and wrapper.wraps(inner):
            yield wrapper
            inner = wrapper


def build_core(config: Any, layer: int = 1) -> AttentionCore:
    """Block ``layer``'s (1-based) core: its attention's (``config.layer_attention``) inside
    every wrapper the config turns on and that can hold it."""
    _load()
    cls = core_class(config.layer_attention(layer))
    core = cls.from_config(config)
    for wrapper in _wrappers(config, cls):
        core = wrapper.from_config(config, core)
    return core


def _stacks(config: Any) -> dict[str, list[type[AttentionCore]]]:
    """Per distinct layer attention, the classes of its core and wrappers (core first)."""
    names = dict.fromkeys(config.layer_attention(i) for i in range(1, config.depth + 1))
    return {n: [CORES[n], *_wrappers(config, CORES[n])] for n in names}


def config_problem(config: Any) -> str | None:
    """The first thing the registered cores find wrong in ``config`` (one line), or None."""
    _load()
    if config.attention not in CORES:
        return f"unknown attention {config.attention!r}; choose one of {', '.join(CORES)}"
    for wrapper in WRAPPERS.values():
        if wrapper.enabled(config) and (problem := wrapper.config_problem(config)):
            return problem
    for stack in _stacks(config).values():
        for cls in stack:
            if problem := cls.config_problem(config):
                return problem
            if cls.needs_positions and config.positions != cls.needs_positions:
                return (
                    f"{cls.label or cls.name} needs positions={cls.needs_positions} (it finds "
                    "family members where the rotary positions restart), got "
                    f"positions={config.positions}"
                )
    return None


def extra_numel(config: Any) -> int:
    """Numbers all cores of a ``config`` hold (parameters and buffers), without building them."""
    _load()
    stacks = _stacks(config)
    layers = [config.layer_attention(i) for i in range(1, config.depth + 1)]
    return sum(
        layers.count(name) * sum(c.extra_numel(config) for c in stack)
        for name, stack in stacks.items()
    )


def upgrade_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict of 0.5 or earlier with the current key paths: the core then lived under its
    attention's name (``layers.0.self_attn.favor.omega``), now under ``core``
    (``layers.0.self_attn.core.omega``). The one place that reads an old path."""
    _load()
    old = tuple(f".self_attn.{name}." for name in CORES)
    out = {}
    for key, value in state.items():
        for prefix in old:
            at = key.find(prefix)
            if at >= 0:
                key = f"{key[:at]}.self_attn.core.{key[at + len(prefix) :]}"
                break
        out[key] = value
    return out
