"""The one run skeleton of every training command (``train``, ``finetune``).

A command supplies what differs, a ``build(cfg) -> Job`` (the module, its data, one line saying
what trains); :func:`run` does the rest the same way for both: the resume and run-directory
checks, seeding, the CPU threads, the trainer with the trust callbacks (NaN stop, atomic saves,
``weights_only`` loads), fit with SIGTERM as a resumable stop, the test pass and the result.
:func:`launch` is the one command-line path: Hydra's ``@hydra.main`` (run directory, log file,
``.hydra/`` configs) around the command's pure function, so ``run_name``, ``hydra.run.dir`` and
``PROTEIN_PERFORMER_ROOT`` place a fine-tuning run exactly as they place a training run.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError, check_group
from protein_performer.training.compose import (
    compose_config,
    config_path,
    register_resolvers,
    split_direct,
)
from protein_performer.training.targets import check_override_targets

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

#: ``ckpt_path`` keywords: ``last`` (resolved here by ``checkpointing.last_checkpoint``: the
#: newest last.ckpt or SLURM hpc checkpoint of this run directory) and ``hpc`` (Lightning's: the
#: SLURM requeue checkpoint).
RESUME_KEYWORDS = ("last", "hpc")
#: Exit status of a run stopped by SIGTERM after saving last.ckpt (128 + SIGTERM, as the shell
#: reports a process killed by it): not 0, so a job chain does not take it for a finished run.
PREEMPTED_EXIT = 143


@dataclass
class Job:
    """What one command trains: built from the config after the run checks and seeding."""

    module: pl.LightningModule
    datamodule: pl.LightningDataModule
    #: One log line naming what trains (written by rank 0 once the trainer exists).
    describe: str
    #: Evaluate the best checkpoint on the test split after fitting.
    test: bool = False
    #: Entries the command adds to the result.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    """A command on the launch path: its config name, its pure function and how its command
    line is read (``direct_keys`` bypass Hydra's override grammar: paths)."""

    name: str
    fn: Callable[[DictConfig], dict[str, Any]]
    direct_keys: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    example: str = ""
    override_example: str = ""


def instantiate(node: Any, key: str, **kwargs: Any) -> Any:
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


def instantiate_dict(cfg: DictConfig, group: str) -> list[Any]:
    """Instantiate every entry with a ``_target_`` of a group (callbacks, logger)."""
    from omegaconf import DictConfig

    node = cfg.get(group)
    if not node:
        return []
    if not isinstance(node, DictConfig):
        raise UserError(f"`{group}` must be a mapping of name -> config, got {node!r}")
    return [
        instantiate(sub, f"{group}.{name}")
        for name, sub in node.items()
        if isinstance(sub, DictConfig) and "_target_" in sub
    ]


def holds_run_dir(fn: Callable[[DictConfig], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Lock the run directory (``paths.output_dir``) for the whole of ``fn``: a second launch
    into the same ``run_name`` (a relaunch while the first still runs) gets one line naming the
    live process instead of writing checkpoints beside it. Only the job's first process takes
    it (DDP ranks and Lightning's spawned children share the run)."""

    @functools.wraps(fn)
    def wrapper(cfg: DictConfig) -> dict[str, Any]:
        from protein_performer.io.atomic import exclusive_lock
        from protein_performer.io.outputs import refuse_inputs

        first = all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))
        out = cfg.get("paths", {}).get("output_dir") if first else None
        if out is None:
            return fn(cfg)
        run_dir = Path(str(out)).expanduser().absolute()
        refuse_inputs(run_dir, run_inputs(cfg))
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(run_dir, "a training run"):
            return fn(cfg)

    return wrapper


#: The config keys that name a run's inputs (train and finetune): the run directory is an
#: output under the one policy, never one of them, holding one or inside one.
INPUT_KEYS = ("data.path", "data.train", "data.fasta", "init_from", "base",
              "model.distill.teacher")  # fmt: skip


def run_inputs(cfg: DictConfig) -> list[str]:
    """The paths :data:`INPUT_KEYS` give in ``cfg`` (lists flattened; unset keys skipped)."""
    from omegaconf import OmegaConf

    found: list[str] = []
    for key in INPUT_KEYS:
        try:
            value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        except Exception:  # noqa: BLE001 - an interpolation that fails is said by its reader
            continue
        values = value if OmegaConf.is_list(value) or isinstance(value, list) else [value]
        found += [str(v) for v in values if isinstance(v, str) and v not in ("", "???")]
    return found


def check_run_dirs(cfg: DictConfig) -> None:
    """The output policy for a launch, before ``@hydra.main`` creates anything: Hydra's run
    directory (``hydra.run.dir``: ``.hydra/`` and the log file) and the run's own
    (``paths.output_dir`` when it is set apart) are never an input, hold one or lie inside one.
    ``cfg`` is a composed config with Hydra's node; it is not changed. A file where a
    directory must go is one line too."""
    import copy

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from protein_performer.io.outputs import refuse_inputs

    try:
        probe = copy.deepcopy(cfg)
        with open_dict(probe):
            probe.hydra.runtime.cwd = os.getcwd()
        HydraConfig.instance().set_config(probe)  # ${hydra:runtime.cwd} in paths.root_dir
        run_dir = OmegaConf.select(probe, "hydra.run.dir")
        probe = copy.deepcopy(cfg)
        with open_dict(probe):
            probe.hydra.runtime.cwd = os.getcwd()
            probe.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(probe)
        outs = {"hydra.run.dir": str(run_dir),
                "paths.output_dir": str(OmegaConf.select(probe, "paths.output_dir"))}
    except OmegaConfBaseException:  # said by Hydra when it resolves the same keys
        return
    inputs = run_inputs(probe)
    for key, out in outs.items():
        path = Path(out).expanduser().absolute()
        # A file on the way was Hydra's NotADirectoryError traceback (PROTEIN_PERFORMER_ROOT,
        # paths.root_dir or hydra.run.dir naming a file).
        existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
        if not existing.is_dir():
            raise UserError(
                f"{key}={out}: {existing} is a file, not a directory; point "
                "PROTEIN_PERFORMER_ROOT, paths.root_dir or hydra.run.dir at a directory"
            )
        refuse_inputs(path, inputs)


def _scalar(value: Any) -> float | Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _existing(path: str | None) -> str | None:
    return path if path and Path(path).is_file() else None


def check_accelerator(cfg: DictConfig) -> None:
    """``trainer=gpu`` on a machine without a GPU: one line now, not Lightning's
    MisconfigurationException once the data and the model are built (27 s later)."""
    trainer = cfg.get("trainer")
    accelerator = str(trainer.get("accelerator", "")) if trainer is not None else ""
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    if torch.cuda.is_available() or (accelerator == "gpu" and torch.backends.mps.is_available()):
        return
    raise UserError(
        f"trainer.accelerator={accelerator} (trainer=gpu, ddp or fsdp) but this machine has no "
        "GPU torch can use: train with trainer=cpu, or on a GPU machine"
    )


def check_run(cfg: DictConfig) -> None:
    """Before anything is built: what the config may instantiate, the run keys' values,
    ``ckpt_path`` names a checkpoint (or a keyword), and a new run does not start over on a
    previous run's files."""
    from protein_performer.training.run_dir import check_fresh_run_dir
    from protein_performer.training.settings import TOP
    from protein_performer.training.targets import check_config_targets

    check_config_targets(cfg)
    check_accelerator(cfg)
    check_group({k: cfg.get(k) for k in TOP if k in cfg}, "", TOP)
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path not in (None, *RESUME_KEYWORDS) and not Path(ckpt_path).is_file():
        raise UserError(
            f"ckpt_path={ckpt_path} is not a file: give the last.ckpt (or another .ckpt) of the "
            "run to resume, e.g. outputs/<task>/<run>/checkpoints/last.ckpt, or ckpt_path=last "
            "to resume the newest last.ckpt of this run directory (see run_name)"
        )
    if ckpt_path is None:
        check_fresh_run_dir(cfg.paths.output_dir, overwrite=cfg.get("overwrite") is True)


def choose_threads(cfg: DictConfig) -> str:
    """Set torch's intra-op threads as the inference commands do (the free cores, at least 1;
    ``OMP_NUM_THREADS`` or the ``threads`` key win), counting the DataLoader's worker
    processes against the same cores; returns the line that says so."""
    from protein_performer.io.threads import set_threads

    data = cfg.get("data")
    workers = int(data.get("num_workers") or 0) if data is not None else 0
    return set_threads(cfg.get("threads"), flag="threads=N", reserve=workers)


def build_trainer(cfg: DictConfig) -> tuple[pl.Trainer, list[Any]]:
    """The configured trainer with the trust pieces every run has: ``DivergenceGuard`` (NaN
    stop), ``RandomStates`` (exact resume with dropout) and ``SafeCheckpointIO`` (atomic saves,
    ``weights_only`` loads); and its callbacks."""
    from protein_performer.training.checkpointing import (
        DivergenceGuard,
        RandomStates,
        SafeCheckpointIO,
    )

    callbacks = instantiate_dict(cfg, "callbacks")
    if cfg.trainer.get("enable_progress_bar") is False:
        # trainer.enable_progress_bar=false alone should be enough to turn the bar off.
        from pytorch_lightning.callbacks import ProgressBar

        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    loggers = instantiate_dict(cfg, "logger")
    trainer = instantiate(
        cfg.trainer,
        "trainer",
        callbacks=[DivergenceGuard(), RandomStates(), *callbacks],
        logger=loggers or False,
        plugins=[SafeCheckpointIO()],
    )
    return trainer, callbacks


def fit(trainer: pl.Trainer, job: Job, ckpt_path: str | None) -> None:
    """``trainer.fit`` from ``ckpt_path`` (``last``: this run directory's newest), a SIGTERM
    stop as exit status 143 after last.ckpt is saved, a wandb failure as one line."""
    from pytorch_lightning.utilities import rank_zero_warn
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from protein_performer.training.checkpointing import last_checkpoint

    if ckpt_path == "last":
        ckpt_path = last_checkpoint(trainer)
        if ckpt_path is None:
            # Not an error: one command serves the first launch and every relaunch.
            rank_zero_warn(
                "ckpt_path=last: there is no last checkpoint in this run directory yet; "
                "training starts from scratch"
            )
    try:
        trainer.fit(job.module, datamodule=job.datamodule, ckpt_path=ckpt_path, weights_only=True)
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


def run(cfg: DictConfig, build: Callable[[DictConfig], Job]) -> dict[str, Any]:
    """The skeleton: checks, seed, threads, ``build(cfg)``, trainer, fit, test.

    Returns ``metrics`` (final logged values, plus ``test/*`` when the job tests),
    ``best_checkpoint``, ``last_checkpoint``, ``curve`` (PNG path or None), ``output_dir``,
    ``global_rank`` (under DDP every rank returns; only rank 0 has written the files) and the
    job's ``extra`` entries.
    """
    import pytorch_lightning as pl

    from protein_performer.training.callbacks import TrainingCurvePlot
    from protein_performer.training.quiet import quiet_lightning

    check_run(cfg)
    quiet_lightning()
    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True)
    threads = choose_threads(cfg)
    job = build(cfg)
    trainer, callbacks = build_trainer(cfg)
    if trainer.is_global_zero:
        log.info(threads)
        log.info(job.describe)
    fit(trainer, job, cfg.get("ckpt_path"))
    metrics = {k: _scalar(v) for k, v in trainer.callback_metrics.items()}
    checkpoint = trainer.checkpoint_callback
    # fast_dev_run and runs without validation leave these empty (or naming unwritten files).
    best = _existing(getattr(checkpoint, "best_model_path", None))
    last = _existing(getattr(checkpoint, "last_model_path", None))
    if job.test:
        # The best checkpoint when one was written; else the weights in memory (fast_dev_run).
        for row in trainer.test(job.module, datamodule=job.datamodule, ckpt_path=best):
            metrics.update({k: _scalar(v) for k, v in row.items()})
    curve = next((c.path for c in callbacks if isinstance(c, TrainingCurvePlot)), None)
    return {
        "metrics": metrics,
        "best_checkpoint": best,
        "last_checkpoint": last,
        "curve": str(curve) if curve else None,
        "output_dir": str(trainer.default_root_dir),
        "global_rank": trainer.global_rank,
        **job.extra,
    }


def launch(entry: Entry, overrides: Sequence[str], prog: str | None = None) -> dict[str, Any]:
    """Run ``entry.fn`` under ``@hydra.main`` (run directory, log file, saved ``.hydra/``).

    Overrides are composed once with the compose API first, so a bad one (or a missing required
    key) becomes a ``UserError`` instead of Hydra's exit status 1; Hydra's own flags (``--cfg
    job``, ``-m``, ...) skip that check and are left to Hydra, direct keys quoted for its
    grammar; otherwise direct keys are set after Hydra composes. A ``UserError`` inside the
    run is carried out of Hydra's error handling and raised here, so the CLI reports it as
    ``error: ...`` with status 2.
    """
    import hydra
    from omegaconf import OmegaConf

    overrides = list(overrides)
    register_resolvers()
    hydra_flags = any(arg.startswith("-") for arg in overrides)
    if hydra_flags:  # Hydra composes (sweeps): its own callbacks are built before any task
        check_override_targets(overrides)
    else:
        composed = compose_config(
            overrides, name=entry.name, direct_keys=entry.direct_keys, required=entry.required,
            example=entry.example, override_example=entry.override_example,
        )  # fmt: skip
        check_run_dirs(composed)  # before Hydra writes .hydra/ and the log file there
        check_accelerator(composed)
    direct, rest = split_direct(overrides, entry.direct_keys)
    if hydra_flags:  # --cfg job and the like print before any task runs: Hydra sets them too
        rest += [f"{key}={_quoted(value)}" for key, value in direct.items()]
        direct = {}
    outcome: dict[str, Any] = {}
    saved_argv = sys.argv

    @hydra.main(version_base="1.3", config_path=config_path(), config_name=entry.name)
    def _task(cfg: DictConfig) -> None:
        # Lightning's DDP launcher starts the other ranks by re-running sys.argv (plus a fixed
        # hydra.run.dir): give it the real command line, not the one made up for Hydra below.
        sys.argv = saved_argv
        for key, value in direct.items():
            OmegaConf.update(cfg, key, value)
        try:
            outcome["result"] = entry.fn(cfg)
        except UserError as exc:
            outcome["error"] = exc
            _forget_run_dir(cfg)
        except BaseException:
            _forget_run_dir(cfg)
            raise

    sys.argv = [prog or f"protein-performer {entry.name}", *rest]
    try:
        _task()
    finally:
        sys.argv = saved_argv
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result", {})


def _forget_run_dir(cfg: DictConfig) -> None:
    """A launch that failed before training leaves no empty ``outputs/<task>/<time>/``."""
    from hydra.core.hydra_config import HydraConfig

    from protein_performer.training.run_dir import remove_unused_run_dir

    if HydraConfig.initialized():
        runtime = HydraConfig.get().runtime
        remove_unused_run_dir(runtime.output_dir, f"{cfg.get('task_name', '')}.log")


def _quoted(value: str) -> str:
    """A value as a quoted string of Hydra's override grammar (``=``, ``,`` and brackets
    allowed inside)."""
    quote = "'" if "'" not in value else '"'
    return f"{quote}{value}{quote}"
