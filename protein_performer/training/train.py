"""Training entry points: a pure ``train(cfg)`` and the command line's path to it.

``train(cfg)`` takes a composed config and returns numbers and paths, so tests and scripts call
it directly with a config from Hydra's compose API; it is the shared run skeleton
(:mod:`protein_performer.training.runner`) with the pretraining build. ``run_hydra()`` /
``main()`` add Hydra's command line, run directory and log file (``protein-performer train``
goes through them).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError
from protein_performer.training.compose import TRAIN
from protein_performer.training.runner import Entry, Job, holds_run_dir, instantiate, launch, run

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


def _record_context_tokens(cfg: DictConfig) -> None:
    """A family-row run (``data.layout=family``) stores its row length as the model's
    ``context_tokens``, so the checkpoint tells ``lm.context()`` how much context training read
    (an explicit ``model.config.context_tokens`` is kept), and what its homologs were keyed by
    as ``family_coordinates`` (``data.family_coordinates``), so a context is read the same way."""
    from omegaconf import DictConfig, open_dict

    data, model = cfg.get("data"), cfg.get("model")
    config = model.get("config") if isinstance(model, DictConfig) else None
    if not isinstance(data, DictConfig) or not isinstance(config, DictConfig):
        return
    if data.get("layout") != "family":
        return
    with open_dict(config):
        config.family_coordinates = str(data.get("family_coordinates", "positions"))
        if config.get("context_tokens") is None:
            config.context_tokens = int(data.family_max_tokens)


@holds_run_dir
def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit (and optionally test) the model described by ``cfg``: :func:`runner.run` with the
    training build (its result keys; ``test/*`` metrics when ``cfg.test``)."""
    from protein_performer.training.init_weights import check_init_from
    from protein_performer.training.settings import check_training_config

    check_training_config(cfg)  # values of data, model.optim and trainer, before any building
    check_init_from(cfg)  # before building anything: a fine-tune experiment without weights
    return run(cfg, _build)


def _build(cfg: DictConfig) -> Job:
    from protein_performer.training.init_weights import maybe_init_from

    datamodule = instantiate(cfg.data, "data")
    _record_context_tokens(cfg)
    module = instantiate(cfg.model, "model")
    maybe_init_from(module, cfg)  # init_from=PATH: start from existing (e.g. ESM-2) weights
    c = module.performer_config
    describe = f"model: {module.model.num_parameters():,} parameters, {c.attention} attention"
    return Job(module, datamodule, f"{describe} ({c.objective})", test=bool(cfg.get("test")))


#: ``protein-performer train``: the training entry on the one launch path.
TRAIN_ENTRY = Entry(TRAIN, train)


def run_hydra(overrides: Sequence[str], prog: str = "protein-performer train") -> dict[str, Any]:
    """``train`` under ``@hydra.main`` (:func:`runner.launch`): the command line's path."""
    return launch(TRAIN_ENTRY, overrides, prog)


def main() -> None:
    """``python -m protein_performer.training.train [overrides]`` (the torchrun entry point)."""
    try:
        result = run_hydra(sys.argv[1:], prog=sys.argv[0])
    except UserError as exc:
        if not getattr(exc, "quiet", False):
            print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if result:
        from omegaconf import OmegaConf

        log.info("result: %s", OmegaConf.to_yaml(OmegaConf.create(result)).strip())


if __name__ == "__main__":
    main()
