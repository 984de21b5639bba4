"""Config composition for the Hydra-configured commands (``train`` and ``finetune``).

One behaviour for both: Hydra's compose API (tests and notebooks call the pure functions with
the result), composition errors as one-line ``UserError``, required keys named in the message
with an example, and *direct* keys set after composing. Direct keys exist because a value like
``data=PATH`` collides with training's ``data/`` config group, and paths or sequences with
characters Hydra's override grammar rejects (``=``, ``,``, brackets) should still work: such
``key=value`` items bypass the grammar and are stored as plain strings.

This module owns where the configs live: the package's ``protein_performer/conf/``, found on
Hydra's package search path (``pkg://protein_performer.conf``) so that an installed wheel works
outside the repository, or ``$PROTEIN_PERFORMER_CONF_DIR`` (a copy to customise). It registers
the ``pp.package`` resolver through which configs name data shipped with the package (the demo
set), and ``pp.family_memory`` (the position memory where a model trains on family rows). It
imports nothing from training or inference, so both can compose without depending on each
other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from protein_performer.data.bundled import package_root
from protein_performer.errors import UserError
from protein_performer.training.targets import check_config_targets

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: Environment variable naming another config directory (a copy of ``protein_performer/conf/``).
CONF_DIR_ENV = "PROTEIN_PERFORMER_CONF_DIR"
#: The package holding the shipped configs.
CONF_PACKAGE = "protein_performer.conf"
#: The training entry. Every entry (``train``, ``finetune``) is composed for a run: with its
#: ``hydra`` node, left unresolved so that ``${hydra:...}`` resolves once the run directory is
#: known.
TRAIN = "train"
_USAGE = " to change a key, +key=value to add one, group=option to pick a config"


def package_path(relative: str) -> str:
    """A file or folder shipped inside the package (``data/demo``), as an absolute path: the
    ``${pp.package:data/demo}`` of the configs, so the demo trains from any directory."""
    return str(package_root() / relative)


def family_memory(layout: str, max_len: int) -> int:
    """``${pp.family_memory:${data.layout},${data.max_len}}``, the default position memory:
    one slot per member position (``max_len``) where a model trains on family rows, else 0
    (a single-sequence row has no homolog to read, and the memory would only cost time)."""
    return int(max_len) if layout == "family" else 0


def register_resolvers() -> None:
    """The configs' own interpolations (idempotent: composing twice must not fail)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("pp.package"):
        OmegaConf.register_new_resolver("pp.package", package_path)
    if not OmegaConf.has_resolver("pp.family_memory"):
        OmegaConf.register_new_resolver("pp.family_memory", family_memory)


def conf_dir() -> Path:
    """The config directory on disk: ``$PROTEIN_PERFORMER_CONF_DIR``, else the package's
    ``conf/`` (for listing groups in ``--help`` and for messages)."""
    env = os.environ.get(CONF_DIR_ENV)
    path = Path(env).expanduser() if env else package_root() / "conf"
    if not (path / "train.yaml").is_file():
        where = f"${CONF_DIR_ENV}={env}" if env else "the installed package"
        raise UserError(
            f"no Hydra config train.yaml in {path} (from {where}): set {CONF_DIR_ENV} to a "
            "directory holding a copy of protein_performer/conf/, or reinstall the package"
        )
    return path.resolve()


def config_path() -> str:
    """What Hydra searches: the package (``pkg://...``) unless ``$PROTEIN_PERFORMER_CONF_DIR``
    names a directory (checked, so a wrong one is one line, not Hydra's traceback)."""
    directory = conf_dir()
    return str(directory) if os.environ.get(CONF_DIR_ENV) else f"pkg://{CONF_PACKAGE}"


def list_choices(group: str) -> list[str]:
    """Config names of a group (``experiment``, ``trainer``, ...), for help texts."""
    directory = conf_dir() / group
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def split_direct(
    overrides: Iterable[str], direct_keys: Iterable[str]
) -> tuple[dict[str, str], list[str]]:
    """``key=value`` items whose key is direct (set after composing, as plain strings), and the
    rest (for Hydra's grammar)."""
    keys = set(direct_keys)
    direct: dict[str, str] = {}
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in keys:
            direct[key] = value
        else:
            rest.append(item)
    return direct, rest


def missing_keys(cfg: DictConfig, keys: Iterable[str]) -> list[str]:
    """The ``???`` ones among ``keys``, nested keys (``data.train``) included."""
    from omegaconf import OmegaConf

    missing = []
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if node is None or OmegaConf.is_missing(node, leaf):
            missing.append(key)
    return missing


def compose_config(
    overrides: Sequence[str] = (),
    output_dir: str | Path | None = None,
    *,
    name: str = TRAIN,
    direct_keys: Iterable[str] = (),
    required: Iterable[str] = (),
    example: str = "",
    override_example: str = "",
) -> DictConfig:
    """``<conf>/<name>.yaml`` composed with ``overrides``, composition errors as ``UserError``.

    The config keeps Hydra's own node; with ``output_dir`` it is made runnable outside
    ``@hydra.main`` (tests, notebooks): the run directory is set and the config registered as
    the current Hydra config, so ``${hydra:...}`` interpolations resolve. ``example`` is a whole
    command line quoted when a ``required`` key is missing; ``override_example`` (e.g.
    ``task=regression mode=lora``) is shown after "use key=value" when composing fails.
    """
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    source = config_path()
    directory = conf_dir()
    if not (directory / f"{name}.yaml").is_file():
        raise UserError(f"no {name}.yaml in {directory}")
    register_resolvers()
    direct, rest = split_direct(overrides, direct_keys)
    try:
        init = (
            initialize_config_module(CONF_PACKAGE, version_base="1.3")
            if source.startswith("pkg://")
            else initialize_config_dir(source, version_base="1.3")
        )
        with init:
            cfg = compose(name, overrides=rest, return_hydra_config=True)
        for key, value in direct.items():
            OmegaConf.update(cfg, key, value)
        check_config_targets(cfg)
        missing = missing_keys(cfg, required)
        if missing:
            raise UserError(
                f"{name} needs {' and '.join(f'{k}=...' for k in missing)}"
                + (f", e.g. `{example}`" if example else "")
            )
    except (HydraException, OmegaConfBaseException) as exc:
        usage = f", e.g. {override_example}" if override_example else _USAGE
        raise UserError(
            f"bad {'training' if name == TRAIN else name} config: {_first_cause(exc)}\n"
            f"  overrides: {' '.join(overrides) or '(none)'}\n"
            f"  use key=value{usage} (see `protein-performer {name} --help`)"
        ) from None
    if output_dir is not None:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.paths.output_dir = str(output_dir)
        HydraConfig.instance().set_config(cfg)
    return cfg


def _first_cause(exc: BaseException) -> str:
    """The error's text, with its cause when that says more (Hydra wraps the real reason)."""
    text = str(exc).strip()
    cause = exc.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text}: {str(cause).strip()}"
    return text
