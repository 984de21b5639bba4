"""What a config may build: an allowlist of ``_target_`` prefixes per config group.

Hydra's ``instantiate`` calls whatever a ``_target_`` names, and its own blocklist only stops
``os.system``, ``subprocess`` and friends: ``builtins.open`` or ``pathlib.Path.write_text`` pass,
so one override (``+callbacks.evil._target_=builtins.open``) or a shared experiment YAML could
write any file of the user. Each group builds only what it is for (callbacks build Lightning's
callbacks and ours, loggers Lightning's loggers and ours, ...), checked on the composed config
before anything is instantiated; a ``_target_`` anywhere else is refused too, since nothing
there is built on purpose.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: group -> what its ``_target_``s may name: a prefix ending in ``.`` covers a module's
#: contents, any other entry is one exact name.
ALLOWED_TARGETS: dict[str, tuple[str, ...]] = {
    "callbacks": (
        "pytorch_lightning.callbacks.",
        "lightning.pytorch.callbacks.",
        "protein_performer.training.callbacks.",
        "protein_performer.training.checkpointing.",
    ),
    "logger": (
        "pytorch_lightning.loggers.",
        "lightning.pytorch.loggers.",
        "protein_performer.training.run_dir.RunCSVLogger",
    ),
    "trainer": (
        "pytorch_lightning.Trainer",
        "lightning.pytorch.Trainer",
        "pytorch_lightning.strategies.",
        "pytorch_lightning.plugins.",
        "pytorch_lightning.accelerators.",
        "pytorch_lightning.profilers.",
        "torch.distributed.fsdp.wrap.",
        "hydra.utils.get_class",  # with its ``path`` checked against CLASS_PATHS
    ),
    "data": ("protein_performer.data.",),
    "model": ("protein_performer.training.lit_module.",),
    # Hydra's own launcher and sweeper, installed launcher plugins, its logging callback.
    "hydra": (
        "hydra._internal.core_plugins.",
        "hydra_plugins.",
        "hydra.experimental.callbacks.LogJobReturnCallback",
    ),
}
#: Environment variable naming more modules or classes (comma-separated, ``mylab.callbacks``)
#: that the ``callbacks`` and ``logger`` groups may build: the user's own, vouched for by the
#: environment they run in (who can set it can run code anyway), never by a config file.
EXTRA_ENV = "PROTEIN_PERFORMER_EXTRA_TARGETS"
_EXTENSIBLE = ("callbacks", "logger")
#: What ``hydra.utils.get_class`` may import (``path:``): importing a module runs its code.
CLASS_PATHS = ("protein_performer.", "torch.nn.")
_GET_CLASS = "hydra.utils.get_class"
#: Hydra's logging configs go to ``logging.config.dictConfig``, which calls a handler's
#: ``class`` and any ``()`` factory: classes of ``logging`` only, no factories.
LOGGING_NODES = ("job_logging", "hydra_logging")
LOGGING_CLASSES = (
    "logging.StreamHandler",
    "logging.FileHandler",
    "logging.NullHandler",
    "logging.Formatter",
    "logging.Filter",
    "logging.handlers.",
)


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target.startswith(p) if p.endswith(".") else target == p for p in prefixes)


def _shown(prefixes: tuple[str, ...]) -> str:
    return ", ".join(f"{p}*" if p.endswith(".") else p for p in prefixes)


def check_target(key: str, target: Any) -> None:
    """One ``_target_`` at config key ``key`` (``callbacks.evil._target_``): allowed for the
    group that holds it, or a ``UserError`` naming the key."""
    group = key.lstrip("+~").split(".", 1)[0]
    prefixes = ALLOWED_TARGETS.get(group)
    if prefixes is not None and group in _EXTENSIBLE:
        extra = os.environ.get(EXTRA_ENV, "")
        for name in filter(None, (p.strip().rstrip(".") for p in extra.split(","))):
            prefixes = (*prefixes, name, f"{name}.")
    where = f"config key {key}={target}"
    if prefixes is None:
        groups = ", ".join(g for g in ALLOWED_TARGETS if g != "hydra")
        raise UserError(
            f"{where} is refused: only the groups {groups} build objects "
            "(configs instantiate only what their group is for)"
        )
    if not isinstance(target, str) or not _allowed(target, prefixes):
        own = f"; add your own modules with {EXTRA_ENV}=mymodule" if group in _EXTENSIBLE else ""
        raise UserError(
            f"{where} is refused: `{group}` may only build {_shown(prefixes)} "
            f"(configs instantiate only what their group is for{own})"
        )


def check_class_path(key: str, path: Any) -> None:
    """The ``path`` of a ``hydra.utils.get_class`` node at ``key``: importing runs code."""
    if not (isinstance(path, str) and _allowed(path, CLASS_PATHS)):
        raise UserError(
            f"config key {key}.path={path} is refused: {_GET_CLASS} may only load "
            f"{_shown(CLASS_PATHS)}"
        )


def _targets(node: Any, key: str) -> Iterator[str]:
    """The key of each node with a ``_target_`` under a plain container ("" for the root)."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield key
        for name, value in node.items():
            yield from _targets(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{key}[{i}]")


def check_config_targets(cfg: DictConfig) -> None:
    """Every ``_target_`` of a composed config (Hydra's own node included), before anything
    is instantiated. Interpolated targets are resolved first; one that cannot be is refused."""
    from omegaconf import OmegaConf

    def value(node_key: str, leaf: str) -> Any:
        full = f"{node_key}.{leaf}" if node_key else leaf
        return OmegaConf.select(cfg, full, throw_on_resolution_failure=False)

    for node_key in _targets(OmegaConf.to_container(cfg, resolve=False), ""):
        target = value(node_key, "_target_")
        check_target(f"{node_key}._target_" if node_key else "_target_", target)
        if target == _GET_CLASS:
            check_class_path(node_key, value(node_key, "path"))
    check_logging_classes(cfg)


def check_logging_classes(cfg: DictConfig) -> None:
    """The ``class`` and ``()`` entries of Hydra's logging configs (the other way a config
    names something to call)."""
    from omegaconf import OmegaConf

    hydra = cfg.get("hydra") if "hydra" in cfg else None
    for name in LOGGING_NODES:
        node = hydra.get(name) if hydra is not None else None
        if node is None:
            continue
        plain = OmegaConf.to_container(node, resolve=False)
        sections = plain.items() if isinstance(plain, dict) else ()
        for section_name, section in sections:
            for entry_name, entry in section.items() if isinstance(section, dict) else ():
                if not isinstance(entry, dict):
                    continue
                key = f"hydra.{name}.{section_name}.{entry_name}"
                if "()" in entry:
                    raise UserError(
                        f"config key {key}.()={entry['()']} is refused: Hydra's "
                        "logging configs may name handler classes, not factories"
                    )
                cls = entry.get("class")
                if cls is not None and not _allowed(str(cls), LOGGING_CLASSES):
                    raise UserError(
                        f"config key {key}.class={cls} is refused: Hydra's "
                        f"logging configs may only use {_shown(LOGGING_CLASSES)}"
                    )


def check_override_targets(overrides: list[str]) -> None:
    """``key._target_=value`` among raw command-line overrides: for launches Hydra composes
    itself (``-m`` sweeps), where Hydra would build ``hydra.callbacks`` before any task."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.rsplit(".", 1)[-1] == "_target_":
            check_target(key, value.strip("'\""))
