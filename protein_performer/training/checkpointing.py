"""What keeps a run's files honest: the divergence stop, ``last.ckpt`` and checkpoint I/O.

* :class:`DivergenceGuard` stops training at the first non-finite training or validation loss,
  before the backward pass that would spread it into the weights, with one message saying where,
  why and what to try. Every data-parallel rank takes the same decision (one all-reduce of a
  flag), so no rank is left waiting in a collective.
* :class:`RunCheckpoint` is Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is really the
  last state: written at every validation and at the end of ``fit`` whatever the monitored
  metric did, and on SIGTERM (Lightning's signal connector turns it into ``SIGTERMException``
  at a batch boundary). ``ckpt_path=last`` also finds the ``hpc_ckpt_N.ckpt`` Lightning's SLURM
  handler writes on the requeue signal, whichever is newer.
* :class:`SafeCheckpointIO` routes every save through ``checkpoints.save_atomic`` (temp file in
  the target's directory, fsync, rename; non-finite weights refused) and every load, resume
  included, through ``checkpoints.load_lightning`` (``weights_only=True``, allowlist).
"""

from __future__ import annotations

import logging
import math
import os
from itertools import chain
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
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


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is the last state of the run (see the module doc).

    Before any save the weights are checked: non-finite weights stop the run instead of being
    written (every rank holds the same weights, so every rank stops).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_step: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath and Path(self.dirpath).is_dir():
            stale = remove_stale_temps(Path(self.dirpath))
            if stale:
                log.info("removed %d temporary file(s) of a killed run", len(stale))

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        # Each rank checks the tensors it holds (a shard under FSDP: no gathering) and the
        # ranks agree on the decision, as every rank saves at the same point.
        module = trainer.lightning_module
        bad = nonfinite_tensors(dict(chain(module.named_parameters(), module.named_buffers())))
        if trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
            error = TrainingDivergedError(
                _divergence_message(
                    trainer,
                    f"the weights are not finite ({', '.join(bad[:3]) or 'on another rank'}); "
                    f"not writing {filepath}",
                    None,
                    trainer.lightning_module,
                )
            )
            error.quiet = trainer.global_rank != 0
            raise error
        super()._save_checkpoint(trainer, filepath)

    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_step = trainer.global_step

    def _save_last_now(self, trainer: pl.Trainer) -> None:
        """last.ckpt for the current step, unless written already or not a real fit."""
        if (
            not self.save_last
            or trainer.fast_dev_run
            or trainer.sanity_checking
            or self._last_step == trainer.global_step
        ):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.state.fn == "fit":
            self._save_last_now(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_now(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_last_now(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)
        # SIGTERM surfaces at a batch boundary on every rank (Lightning broadcasts it), so the
        # state is consistent and the save's barrier is reached by all ranks.
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            self._save_last_now(trainer)
            log.info("SIGTERM: saved %s at step %d", self.last_model_path, trainer.global_step)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        root = Path(trainer.default_root_dir)
        return found | {os.path.normpath(p) for p in root.glob("hpc_ckpt_*.ckpt")}


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
