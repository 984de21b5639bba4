"""Compose an entry config (``conf/<name>.yaml``) for the Hydra-configured inference commands.

Factored out of ``inference.evaluate.compose`` so that ``eval``, ``visualize`` and later
commands share one behaviour: Hydra's compose API (no ``@hydra.main``, so tests and notebooks
call the pure function with the result), composition errors as one-line ``UserError``, required
keys named in the message with an example, and *direct* keys set after composing. Direct keys
exist because a value like ``data=PATH`` collides with training's ``data/`` config group, and
paths or sequences with characters Hydra's override grammar rejects (``=``, ``,``, brackets)
should still work: such ``key=value`` items bypass the grammar and are stored as plain strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from protein_performer.errors import UserError


def compose_entry(
    name: str,
    overrides: Sequence[str] = (),
    *,
    direct_keys: Iterable[str] = (),
    required: Iterable[str] = (),
    example: str = "",
    override_example: str = "",
) -> Any:
    """``conf/<name>.yaml`` composed with ``overrides`` and resolved, as a DictConfig.

    ``example`` is a whole command line quoted when a ``required`` key is missing;
    ``override_example`` (e.g. ``split=test``) is shown after "use key=value" when composing fails.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from protein_performer.training.train import conf_dir

    directory = conf_dir()
    if not (directory / f"{name}.yaml").is_file():
        raise UserError(f"no {name}.yaml in {directory}")
    direct_set = set(direct_keys)
    direct: dict[str, str] = {}
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in direct_set:
            direct[key] = value
        else:
            rest.append(item)
    try:
        with initialize_config_dir(str(directory), version_base="1.3"):
            cfg = hydra_compose(name, overrides=rest)
        for key, value in direct.items():
            OmegaConf.update(cfg, key, value)
        missing = sorted(k for k in required if OmegaConf.is_missing(cfg, k))
        if missing:
            raise UserError(
                f"{name} needs {' and '.join(f'{k}=...' for k in missing)}"
                + (f", e.g. `{example}`" if example else "")
            )
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UserError(
            f"bad {name} config: {exc}\n  overrides: {' '.join(overrides) or '(none)'}\n"
            "  use key=value"
            + (f", e.g. {override_example}" if override_example else "")
            + f" (see `protein-performer {name} --help`)"
        ) from None
    return cfg
