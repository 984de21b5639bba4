"""What keeps a run's files honest: the divergence stop, ``last.ckpt`` and checkpoint I/O.

* :class:`DivergenceGuard` stops training at the first non-finite training or validation loss,
  before the backward pass that would spread it into the weights, with one message saying where,
  why and what to try. Every data-parallel rank takes the same decision (one all-reduce of a
  flag), so no rank is left waiting in a collective.
* :class:`RunCheckpoint` is Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is really the
  last state: written at every validation and at the end of ``fit`` whatever the monitored
  metric did, and on SIGTERM (Lightning's signal connector turns it into ``SIGTERMException``
  at a batch boundary). :func:`last_checkpoint` is what ``ckpt_path=last`` resumes: the newest
  ``last.ckpt`` of the run directory or ``hpc_ckpt_N.ckpt`` Lightning's SLURM handler writes on
  the requeue signal.

Only Lightning's public API is used (``ModelCheckpoint``'s constructor arguments, public
attributes and hooks, ``Callback`` hooks, ``Trainer.save_checkpoint``, public trainer
properties, the ``CheckpointIO`` plugin), so a Lightning upgrade cannot silently bypass them;
tests/training/test_checkpointing.py pins the save schedule this relies on.
* :class:`SafeCheckpointIO` routes every save through ``checkpoints.save_atomic`` (temp file in
  the target's directory, fsync, rename; non-finite weights refused) and every load, resume
  included, through ``checkpoints.load_lightning`` (``weights_only=True``, allowlist).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from datetime import timedelta
from itertools import chain
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import SIGTERMException

from protein_performer.errors import UserError
from protein_performer.io.atomic import remove_stale_temps
from protein_performer.io.checkpoints import load_lightning, nonfinite_tensors, save_atomic

log = logging.getLogger(__name__)


class TrainingDivergedError(UserError):
    """A non-finite loss or weights stopped the run. ``quiet`` on ranks other than 0, so a
    data-parallel job prints the message once."""

    quiet = False


def _divergence_message(
    trainer: pl.Trainer, what: str, last: tuple[int, float] | None, module: Any
) -> str:
    lr = getattr(module, "optim", {}).get("lr")
    clip = trainer.gradient_clip_val
    precision = str(trainer.precision)
    causes = [f"a learning rate too high for this model (model.optim.lr={lr})"]
    tries = ["a lower model.optim.lr or longer model.optim.warmup_steps"]
    if not clip:
        causes.append("exploding gradients with no clipping (trainer.gradient_clip_val is off)")
        tries.append("trainer.gradient_clip_val=1.0")
    if not precision.startswith(("32", "64")):
        causes.append(f"overflow in {precision} precision")
        tries.append("trainer.precision=32-true")
    since = (
        f"last finite train/loss {last[1]:.4g} at step {last[0]}" if last else "no finite loss yet"
    )
    return (
        f"training stopped at step {trainer.global_step}: {what} ({since}); likely cause: "
        f"{' or '.join(causes)}; try {', '.join(tries)}, and resume from a checkpoint written "
        "before the divergence (nothing non-finite was saved)"
    )


class DivergenceGuard(Callback):
    """Stop at the first NaN/inf loss (training, before backward; or validation)."""

    def __init__(self) -> None:
        super().__init__()
        self.last_finite: tuple[int, float] | None = None

    def _stop_if(self, trainer: pl.Trainer, module: Any, key: str, value: float | None) -> None:
        bad = value is not None and not math.isfinite(value)
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            what = f"{key} is {value}" if bad else f"{key} is not finite on another rank"
            error = TrainingDivergedError(
                _divergence_message(trainer, what, self.last_finite, module)
            )
            error.quiet = trainer.global_rank != 0
            raise error

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        value = float(loss.detach())
        self._stop_if(trainer, pl_module, "train/loss", value)
        self.last_finite = (trainer.global_step, value)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/loss")
        self._stop_if(trainer, pl_module, "val/loss", None if value is None else float(value))


#: Checkpoint key of the random states (torch CPU and CUDA, numpy, Python) at the save.
RNG_KEY = "rng_states"


def rng_states() -> dict[str, Any]:
    """Every global random state a training step draws from (dropout: torch's), in types
    ``torch.load(weights_only=True)`` reads back (numpy's key as a tensor)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states` (CUDA states only where as many devices are visible)."""
    import random

    import numpy as np

    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda") or []
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))


class RandomStates(Callback):
    """Checkpoints carry the random states, so a resumed run draws the dropout masks the
    uninterrupted one drew (rank 0's states, as every rank is seeded alike).

    They are restored just before the first training batch after the restore, not when the
    checkpoint is read: what Lightning does in between (a sanity validation, building loaders)
    draws from them too, and the uninterrupted run did none of it at that point."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[str, Any] | None = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RNG_KEY] = rng_states()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.pending = checkpoint.get(RNG_KEY)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: ANN401
        if self.pending is not None:
            set_rng_states(self.pending)
            self.pending = None


def _refuse_nonfinite_weights(trainer: pl.Trainer, path: str | None) -> None:
    """Stop the run instead of saving non-finite weights; every rank takes the same decision.

    Each rank checks the tensors it holds (a shard under FSDP: no gathering) and the ranks
    agree, as every rank takes part in a save."""
    module = trainer.lightning_module
    bad = nonfinite_tensors(dict(chain(module.named_parameters(), module.named_buffers())))
    if trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
        error = TrainingDivergedError(
            _divergence_message(
                trainer,
                f"the weights are not finite ({', '.join(bad[:3]) or 'on another rank'}); "
                f"not writing {path or 'the checkpoint'}",
                None,
                module,
            )
        )
        error.quiet = trainer.global_rank != 0
        raise error


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is the last state of the run (see the module doc).

    Built on Lightning's public API only: the best-k checkpoints are Lightning's own (its
    constructor arguments, its hooks called through ``super()``); ``last.ckpt`` is written here,
    with ``Trainer.save_checkpoint``, from public callback hooks, so Lightning runs with
    ``save_last=False`` and its last-checkpoint logic never runs. ``last.ckpt`` follows:

    * every validation of ``fit``; at an epoch's end it is written in ``on_train_epoch_end``,
      after the epoch-end top-k save, so that its callback state lists that checkpoint;
    * every ``every_n_train_steps`` optimizer steps / ``train_time_interval`` (as the top-k
      saves do), and every epoch end when nothing validates or ``save_on_train_epoch_end``;
    * the end of ``fit`` and SIGTERM (``SIGTERMException`` at a batch boundary, every rank);

    once per step: a trigger at a step already saved writes nothing. As Lightning did, a fresh
    run in a directory holding another run's ``last.ckpt`` writes ``last-v1.ckpt`` (``ckpt_path=
    last`` resumes the newest, see :func:`last_checkpoint`). Before any save (top-k, last, or any
    other ``Trainer.save_checkpoint``) the weights are checked: non-finite weights stop the run
    instead of being written, on every rank.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        *,
        save_last: bool | None = None,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        **kwargs: Any,
    ) -> None:
        if save_last == "link":
            raise UserError(
                "callbacks.model_checkpoint.save_last=link is not supported: last.ckpt is the "
                "last state of the run, written as a file (use save_last=true)"
            )
        super().__init__(
            dirpath,
            filename,
            monitor,
            verbose,
            save_last=False,  # last.ckpt is written by this class, not by Lightning
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
            **kwargs,
        )
        #: Whether ``last.ckpt`` is written (the ``save_last`` argument).
        self.write_last = bool(save_last)
        self._step_interval = int(every_n_train_steps or 0)
        self._time_interval = train_time_interval
        self._at_epoch_end = save_on_train_epoch_end
        self._versioned = enable_version_counter
        self._last_step: int | None = None  # global step of the last last.ckpt written
        self._last_time: float | None = None  # monotonic time of the last time-triggered save
        self._pending = False  # a save due at the epoch's end (after its validation and top-k)
        self._writing: str | None = None  # the last.ckpt being written (for messages)

    # ---- Lightning hooks (each calls Lightning's own first: the top-k checkpoints) ------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath and Path(self.dirpath).is_dir():
            stale = remove_stale_temps(Path(self.dirpath))
            if stale:
                log.info("removed %d temporary file(s) of a killed run", len(stale))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_time = time.monotonic()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._fitting(trainer) and self._interval_due(trainer):
            self._save_now_or_at_epoch_end(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._fitting(trainer):
            self._save_now_or_at_epoch_end(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._fitting(trainer) and (self._pending or self._saves_at_epoch_end(trainer)):
            self._save_last(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self._fitting(trainer):
            self._save_last(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)
        # SIGTERM surfaces at a batch boundary on every rank (Lightning broadcasts it), so the
        # state is consistent and the save's barrier is reached by all ranks.
        if isinstance(exception, SIGTERMException) and self._fitting(trainer):
            self._save_last(trainer)
            log.info("SIGTERM: saved %s at step %d", self.last_model_path, trainer.global_step)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every Trainer.save_checkpoint passes here on every rank before anything is written
        # (not with weights_only=True: _save_last checks those itself).
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        _refuse_nonfinite_weights(trainer, self._writing)

    # ---- last.ckpt -------------------------------------------------------------------------
    @staticmethod
    def _fitting(trainer: pl.Trainer) -> bool:
        """A real fit: not validate/test, not the sanity check, not ``fast_dev_run``."""
        return (
            trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
            and not trainer.fast_dev_run
        )

    def _interval_due(self, trainer: pl.Trainer) -> bool:
        """``every_n_train_steps`` or ``train_time_interval`` says save at this batch's end."""
        step = trainer.global_step
        due = self._step_interval > 0 and step > 0 and step % self._step_interval == 0
        if self._time_interval is not None:
            now = time.monotonic()
            elapsed = self._last_time is not None and (
                now - self._last_time >= self._time_interval.total_seconds()
            )
            # Clocks differ between ranks: rank 0 decides, so that every rank saves or none.
            if trainer.strategy.broadcast(elapsed):
                self._last_time = now
                due = True
        return due

    def _save_now_or_at_epoch_end(self, trainer: pl.Trainer) -> None:
        # At the epoch's last batch, on_train_epoch_end follows (after the epoch-end validation
        # and Lightning's top-k save there): save then, once, with that state included.
        if trainer.is_last_batch:
            self._pending = True
        else:
            self._save_last(trainer)

    def _saves_at_epoch_end(self, trainer: pl.Trainer) -> bool:
        """Epoch ends that get a last.ckpt of their own: asked for, or nothing validates."""
        if self._at_epoch_end is not None:
            return self._at_epoch_end
        return not trainer.enable_validation or not sum(trainer.num_val_batches)

    def _last_path(self, trainer: pl.Trainer) -> str:
        """``last.ckpt``, or ``last-vN.ckpt`` when another run's last.ckpt is there."""
        metrics = {
            **trainer.callback_metrics,
            "epoch": torch.tensor(trainer.current_epoch),
            "step": torch.tensor(trainer.global_step),
        }
        name = self.CHECKPOINT_NAME_LAST
        path = self.format_checkpoint_name(dict(metrics), name)
        version = self.STARTING_VERSION
        while self._versioned and path != self.last_model_path and self.file_exists(path, trainer):
            path = self.format_checkpoint_name(dict(metrics), name, ver=version)
            version += 1
        return path

    def _save_last(self, trainer: pl.Trainer) -> None:
        """Write last.ckpt for the current step, unless off or written at this step already."""
        self._pending = False
        if not self.write_last or self._last_step == trainer.global_step:
            return
        path = self._last_path(trainer)
        # Set before saving: the path is part of this callback's state in the checkpoint.
        previous, self.last_model_path = self.last_model_path, path
        self._writing = path
        try:
            if self.save_weights_only:  # on_save_checkpoint is not called for these
                _refuse_nonfinite_weights(trainer, path)
            trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        finally:
            self._writing = None
        self._last_step = trainer.global_step
        if previous and previous != path and self._is_own_old_last(trainer, previous):
            trainer.strategy.remove_checkpoint(previous)

    def _is_own_old_last(self, trainer: pl.Trainer, previous: str) -> bool:
        """A previous last checkpoint of this directory that was not resumed from (a last
        name with ``{step}`` etc. in it changes at every save)."""
        if self.dirpath is None or "://" in str(previous):
            return False
        old = Path(previous).absolute()
        resumed = trainer.ckpt_path
        return old.parent == Path(self.dirpath).absolute() and (
            resumed is None or old != Path(resumed).absolute()
        )


def last_checkpoint(trainer: pl.Trainer) -> str | None:
    """What ``ckpt_path=last`` resumes: the newest (by modification time) of the run
    directory's last checkpoints (``last.ckpt``, ``last-vN.ckpt``, in each ``ModelCheckpoint``'s
    directory), the ``hpc_ckpt_N.ckpt`` Lightning's SLURM handler writes on the requeue signal,
    and an ``OnExceptionCheckpoint``'s file; None when there is none (a first launch)."""
    candidates: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            directory = callback.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
            pattern = re.compile(rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-v?\d+)?$")
            candidates |= {
                path
                for path in _ls(directory)
                if path.endswith(callback.FILE_EXTENSION)
                and pattern.match(Path(path).name[: -len(callback.FILE_EXTENSION)])
            }
    hpc = re.compile(r"^hpc_ckpt_\d+\.ckpt$")
    candidates |= {p for p in _ls(trainer.default_root_dir) if hpc.match(Path(p).name)}
    for callback in trainer.callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            candidates.add(str(callback.ckpt_path))
    times = {}
    for path in candidates:
        fs = get_filesystem(path)
        if fs.exists(path):
            times[path] = fs.modified(path)
    return max(times, key=times.__getitem__) if times else None


def _ls(directory: str | os.PathLike[str]) -> list[str]:
    fs = get_filesystem(str(directory))
    if not fs.isdir(str(directory)):
        return []
    found = fs.ls(str(directory), detail=False)
    return [os.path.normpath(p) if "://" not in str(directory) else p for p in found]


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O through ``protein_performer.io.checkpoints`` (atomic, safe)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote: fsspec's way
            return
        save_atomic(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_lightning(path)
