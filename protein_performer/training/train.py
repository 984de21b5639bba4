"""Training entry points: a pure ``train(cfg)`` and a thin Hydra wrapper around it.

``train(cfg)`` takes a composed config and returns numbers and paths, so tests and scripts call
it directly with a config from Hydra's compose API; ``main()`` / ``run_hydra()`` add Hydra's
command line, run directory and log file (``protein-performer train`` goes through them).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError
from protein_performer.training.compose import compose_config, config_path, register_resolvers

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

#: ``ckpt_path`` keywords: ``last`` (resolved here by ``checkpointing.last_checkpoint``: the
#: newest last.ckpt or SLURM hpc checkpoint of this run directory) and ``hpc`` (Lightning's: the
#: SLURM requeue checkpoint).
RESUME_KEYWORDS = ("last", "hpc")
#: Exit status of a run stopped by SIGTERM after saving last.ckpt (128 + SIGTERM, as the shell
#: reports a process killed by it): not 0, so a job chain does not take it for a finished run.
PREEMPTED_EXIT = 143


def _instantiate(node: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` whose failures name the config key; a ``UserError`` raised by
    our own constructors (e.g. a missing data file) passes through with its own message."""
    import hydra
    from hydra.errors import InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return hydra.utils.instantiate(node, **kwargs)
    except UserError:
        raise
    except InstantiationException as exc:
        cause = exc.__cause__
        while cause is not None:
            if isinstance(cause, UserError):
                raise cause from None
            cause = cause.__cause__
        raise UserError(f"cannot build `{key}` from the config: {exc}") from None
    except OmegaConfBaseException as exc:
        raise UserError(f"bad value under `{key}` in the config: {exc}") from None


def _instantiate_dict(cfg: DictConfig, group: str) -> list[Any]:
    """Instantiate every entry with a ``_target_`` of a group (callbacks, logger)."""
    from omegaconf import DictConfig

    node = cfg.get(group)
    if not node:
        return []
    if not isinstance(node, DictConfig):
        raise UserError(f"`{group}` must be a mapping of name -> config, got {node!r}")
    return [
        _instantiate(sub, f"{group}.{name}")
        for name, sub in node.items()
        if isinstance(sub, DictConfig) and "_target_" in sub
    ]


def _scalar(value: Any) -> float | Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _existing(path: str | None) -> str | None:
    return path if path and Path(path).is_file() else None


def holds_run_dir(fn: Callable[[DictConfig], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Lock the run directory (``paths.output_dir``) for the whole of ``fn``: a second
    ``train`` into the same ``run_name`` (a relaunch while the first still runs) gets one line
    naming the live process instead of writing checkpoints beside it. Only the job's first
    process takes it (DDP ranks and Lightning's spawned children share the run)."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(cfg: DictConfig) -> dict[str, Any]:
        from protein_performer.io.atomic import exclusive_lock

        first = all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))
        out = cfg.get("paths", {}).get("output_dir") if first else None
        if out is None:
            return fn(cfg)
        run_dir = Path(str(out)).expanduser().absolute()
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(run_dir, "a training run"):
            return fn(cfg)

    return wrapper


def _record_context_tokens(cfg: DictConfig) -> None:
    """A family-row run (``data.layout=family``) stores its row length as the model's
    ``context_tokens``, so the checkpoint tells ``lm.context()`` how much context training read
    (an explicit ``model.config.context_tokens`` is kept)."""
    from omegaconf import DictConfig, open_dict

    data, model = cfg.get("data"), cfg.get("model")
    config = model.get("config") if isinstance(model, DictConfig) else None
    if not isinstance(data, DictConfig) or not isinstance(config, DictConfig):
        return
    if data.get("layout") != "family" or config.get("context_tokens") is not None:
        return
    with open_dict(config):
        config.context_tokens = int(data.family_max_tokens)


@holds_run_dir
def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit (and optionally test) the model described by ``cfg``.

    Returns ``metrics`` (final logged values, plus ``test/*`` when ``cfg.test``),
    ``best_checkpoint``, ``last_checkpoint``, ``curve`` (PNG path or None), ``output_dir`` and
    ``global_rank`` (under DDP every rank returns; only rank 0 has written the files).
    """
    import pytorch_lightning as pl
    from pytorch_lightning.utilities import rank_zero_warn
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from protein_performer.training.callbacks import TrainingCurvePlot
    from protein_performer.training.checkpointing import (
        DivergenceGuard,
        SafeCheckpointIO,
        last_checkpoint,
    )
    from protein_performer.training.init_weights import check_init_from, maybe_init_from
    from protein_performer.training.quiet import quiet_lightning
    from protein_performer.training.run_dir import check_fresh_run_dir
    from protein_performer.training.settings import check_training_config

    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path not in (None, *RESUME_KEYWORDS) and not Path(ckpt_path).is_file():
        raise UserError(
            f"ckpt_path={ckpt_path} is not a file: give the last.ckpt (or another .ckpt) of the "
            "run to resume, e.g. outputs/<task>/<run>/checkpoints/last.ckpt, or ckpt_path=last "
            "to resume the newest last.ckpt of this run directory (see run_name)"
        )

    check_training_config(cfg)  # values of data, model.optim and trainer, before any building
    quiet_lightning()
    if ckpt_path is None:  # a new run: refuse to start over on a previous run's files
        check_fresh_run_dir(cfg.paths.output_dir, overwrite=cfg.get("overwrite") is True)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)  # an int in [0, 2**32) (checked above)
    check_init_from(cfg)  # before building anything: a fine-tune experiment without weights
    datamodule = _instantiate(cfg.data, "data")
    _record_context_tokens(cfg)
    module = _instantiate(cfg.model, "model")
    maybe_init_from(module, cfg)  # init_from=PATH: start from existing (e.g. ESM-2) weights
    callbacks = _instantiate_dict(cfg, "callbacks")
    if cfg.trainer.get("enable_progress_bar") is False:
        # trainer.enable_progress_bar=false alone should be enough to turn the bar off.
        from pytorch_lightning.callbacks import ProgressBar

        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    loggers = _instantiate_dict(cfg, "logger")
    trainer: pl.Trainer = _instantiate(
        cfg.trainer,
        "trainer",
        callbacks=[DivergenceGuard(), *callbacks],
        logger=loggers or False,
        plugins=[SafeCheckpointIO()],
    )
    if trainer.is_global_zero:
        log.info(
            "model: %s parameters, %s attention (%s)",
            f"{module.model.num_parameters():,}",
            module.performer_config.attention,
            module.performer_config.objective,
        )

    if ckpt_path == "last":
        ckpt_path = last_checkpoint(trainer)
        if ckpt_path is None:
            # Not an error: one command serves the first launch and every relaunch.
            rank_zero_warn(
                "ckpt_path=last: there is no last checkpoint in this run directory yet; "
                "training starts from scratch"
            )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        saved = getattr(trainer.checkpoint_callback, "last_model_path", None) or "nothing"
        log.warning(
            "stopped by SIGTERM at step %d (saved %s); relaunch the same command in the same "
            "run directory with ckpt_path=last to resume",
            trainer.global_step,
            saved,
        )
        raise SystemExit(PREEMPTED_EXIT) from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "wandb":
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"logger=wandb failed: {first} Set WANDB_MODE=offline (or logger.wandb.offline=true) "
            "to log locally and `wandb sync` later, run `wandb login`, or use logger=csv"
        ) from None
    metrics = {k: _scalar(v) for k, v in trainer.callback_metrics.items()}

    checkpoint = trainer.checkpoint_callback
    # fast_dev_run and runs without validation leave these empty (or naming unwritten files).
    best = _existing(getattr(checkpoint, "best_model_path", None))
    last = _existing(getattr(checkpoint, "last_model_path", None))
    if cfg.get("test"):
        # The best checkpoint when one was written; else the weights in memory (fast_dev_run).
        results = trainer.test(module, datamodule=datamodule, ckpt_path=best)
        for row in results:
            metrics.update({k: _scalar(v) for k, v in row.items()})

    curve = next((c.path for c in callbacks if isinstance(c, TrainingCurvePlot)), None)
    return {
        "metrics": metrics,
        "best_checkpoint": best,
        "last_checkpoint": last,
        "curve": str(curve) if curve else None,
        "output_dir": str(trainer.default_root_dir),
        "global_rank": trainer.global_rank,
    }


def run_hydra(overrides: Sequence[str], prog: str = "protein-performer train") -> dict[str, Any]:
    """Run ``train`` under ``@hydra.main`` (run directory, log file, saved ``.hydra/`` configs).

    Overrides are composed once with the compose API first, so a bad one becomes a ``UserError``
    instead of Hydra's exit status 1; Hydra's own flags (``--cfg job``, ``-m``, ...) skip that
    check and are left to Hydra. A ``UserError`` inside the run is carried out of Hydra's
    error handling and raised here, so the CLI reports it as ``error: ...`` with status 2.
    """
    import hydra

    overrides = list(overrides)
    register_resolvers()
    if not any(arg.startswith("-") for arg in overrides):
        compose_config(overrides)
    outcome: dict[str, Any] = {}

    saved_argv = sys.argv

    @hydra.main(version_base="1.3", config_path=config_path(), config_name="train")
    def _task(cfg: DictConfig) -> None:
        # Lightning's DDP launcher starts the other ranks by re-running sys.argv (plus a fixed
        # hydra.run.dir): give it the real command line, not the one made up for Hydra below.
        sys.argv = saved_argv
        try:
            outcome["result"] = train(cfg)
        except UserError as exc:
            outcome["error"] = exc

    sys.argv = [prog, *overrides]
    try:
        _task()
    finally:
        sys.argv = saved_argv
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result", {})


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
