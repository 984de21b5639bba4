"""Attention cores behind one interface, found by name in one registry.

- :mod:`.base`: :class:`AttentionCore` (the one call, what a core declares) and
  :class:`CoreWrapper` (a core around another);
- :mod:`.registry`: ``@register(name)``, :func:`build_core` and the config's questions.

Registered: ``exact`` (softmax, ``model/exact.py``), ``favor`` (FAVOR+, ``model/favor/``),
``linear`` (deterministic or learned maps, ``model/linear/core.py``); the wrappers ``window``
(an exact sliding window around the linear core, ``model/linear/window.py``) and ``memory``
(the member-position memory around any core, ``model/linear/memory.py``). A new core is one
module in this folder with one ``@register``: every module here is imported by the registry, so the
registry knows it without a list to edit (imported at the registry's first question, so a
core's module may import this package while it is being imported itself).
"""

from __future__ import annotations

from protein_performer.model.cores.base import (
    AttentionCore,
    CoreWrapper,
    compute_dtype,
    drawn_keys,
    model_cores,
    real_tokens,
)
from protein_performer.model.cores.registry import (
    CORES,
    WRAPPERS,
    build_core,
    config_problem,
    core_class,
    extra_numel,
    names,
    register,
    upgrade_keys,
)

__all__ = [
    "CORES",
    "WRAPPERS",
    "AttentionCore",
    "CoreWrapper",
    "build_core",
    "compute_dtype",
    "config_problem",
    "core_class",
    "drawn_keys",
    "extra_numel",
    "model_cores",
    "names",
    "real_tokens",
    "register",
    "upgrade_keys",
]
