"""The Lightning wrapper around ``PerformerLM``: loss, metrics, optimizer and LR schedule.

Kept small on purpose: the model math lives in ``protein_performer.model`` and the masking/shift
logic in ``protein_performer.data``, so this module only glues a batch to a loss. The loss is the
same for both objectives because the collator already puts the right targets (masked originals
for MLM, next tokens for CLM) in ``batch["targets"]``, with -100 wherever there is no loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics.aggregation import SumMetric

from protein_performer.errors import UserError
from protein_performer.io.checkpoints import CONTACT_REGRESSION_KEY
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.training.distill import DistillSettings, distill_kl, exact_teacher

IGNORE_INDEX = -100

#: Optimizer settings used when the config leaves them out (ESM-2-like).
DEFAULT_OPTIM: dict[str, Any] = {
    "lr": 4e-4,
    "weight_decay": 0.01,
    "betas": (0.9, 0.98),
    "eps": 1e-8,
    "warmup_steps": 2000,
    "min_lr_ratio": 0.1,
}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_lr_ratio``.

    Warmup starts at 1/warmup (not 0) so the very first optimizer step already moves the weights;
    past ``total_steps`` the multiplier stays at the floor instead of rising again.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _plain(obj: Any) -> Any:
    """Hydra hands DictConfigs; checkpoints and dataclasses want builtins."""
    if isinstance(obj, DictConfig):
        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, PerformerConfig):
        return obj.to_dict()
    return dict(obj) if isinstance(obj, Mapping) else obj


class ProteinLMModule(pl.LightningModule):
    """Trains a ``PerformerLM`` on batches shaped as in ``docs/INTERFACES.md``.

    Args:
        config: ``PerformerConfig`` fields (a dict, DictConfig or the dataclass).
        optim: AdamW + schedule settings: ``lr``, ``weight_decay``, ``betas``, ``eps``,
            ``warmup_steps``, ``min_lr_ratio``; missing keys take ``DEFAULT_OPTIM``.
        distill: optional distillation from an exact-attention teacher (``teacher``,
            ``weight``, ``temperature``; see ``protein_performer.training.distill``). Training
            only: validation and test report the plain MLM/CLM loss either way.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | PerformerConfig,
        optim: Mapping[str, Any] | None = None,
        distill: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        config = _plain(config)
        optim = {**DEFAULT_OPTIM, **(_plain(optim) or {})}
        unknown = sorted(set(optim) - set(DEFAULT_OPTIM))
        if unknown:
            raise UserError(
                f"unknown model.optim key(s): {', '.join(unknown)}; "
                f"valid keys are: {', '.join(DEFAULT_OPTIM)}"
            )
        self.distill = DistillSettings.from_mapping(_plain(distill))
        # All go into hparams (so the Lightning checkpoint is self-describing) ...
        self.save_hyperparameters(
            {"config": config, "optim": optim, "distill": dataclasses.asdict(self.distill)}
        )
        self.performer_config = PerformerConfig.from_dict(config)
        self.optim = optim
        self.model = PerformerLM(self.performer_config)
        # Not a registered submodule (object.__setattr__ bypasses nn.Module's registration):
        # kept out of the checkpoint, the optimizer and the summary.
        teacher = exact_teacher(self.distill.teacher) if self.distill.enabled else None
        if teacher is not None and teacher.config.objective != self.performer_config.objective:
            raise UserError(
                f"model.distill.teacher={self.distill.teacher} is a {teacher.config.objective} "
                f"model but this run trains {self.performer_config.objective}: the teacher's "
                "logits would answer another question (use a teacher of the same objective)"
            )
        object.__setattr__(self, "_teacher", teacher)
        #: Set by ``init_from`` when the source model has one (``ContactRegression.to_dict()``).
        self.contact_regression: dict[str, Any] | None = None
        # Token-weighted sums, synced across ranks by torchmetrics at compute time, so val/ppl is
        # exp of the corpus-level mean NLL, not a mean of per-batch perplexities.
        # nan_strategy="disable": a NaN loss must show as NaN (the default drops it from the sum
        # while the token count keeps counting, which reports a diverged model as perfect).
        self.eval_nll = SumMetric(nan_strategy="disable")
        self.eval_tokens = SumMetric(nan_strategy="disable")
        self.eval_correct = SumMetric(nan_strategy="disable")

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
        return self.model(tokens, padding_mask=padding_mask)

    def _losses(
        self, batch: Mapping[str, Any], logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed NLL, number of target tokens and number of correct argmax predictions."""
        if logits is None:
            logits = self.model(batch["tokens"], padding_mask=batch["padding_mask"],
                                coordinates=batch.get("coordinates")).logits  # fmt: skip
        targets = batch["targets"]
        # float32 loss even under bf16 autocast: log-softmax over 33 tokens is cheap.
        nll = F.cross_entropy(
            logits.float().flatten(0, 1),  # (B*T, V)
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        valid = targets != IGNORE_INDEX
        n_tokens = valid.sum()
        correct = ((logits.argmax(-1) == targets) & valid).sum()
        return nll, n_tokens, correct

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        if self._teacher is None:
            nll, n_tokens, _ = self._losses(batch)
            loss = nll / n_tokens.clamp(min=1)
        else:
            loss = self._distill_step(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=True)
        return loss

    def _distill_step(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """(1 - w) * task loss + w * T^2 KL(teacher || student); logs both parts."""
        teacher, settings = self._teacher, self.distill
        logits = self.model(batch["tokens"], padding_mask=batch["padding_mask"],
                            coordinates=batch.get("coordinates")).logits  # fmt: skip
        if next(teacher.parameters()).device != logits.device:
            teacher.to(logits.device)  # Lightning moves registered modules only
        with torch.no_grad():
            teacher_logits = teacher(batch["tokens"], padding_mask=batch["padding_mask"]).logits
        nll, n_tokens, _ = self._losses(batch, logits)
        task = nll / n_tokens.clamp(min=1)
        kl = distill_kl(logits, teacher_logits, batch["padding_mask"], settings.temperature)
        opts = {"on_step": True, "on_epoch": False, "sync_dist": True}
        self.log("train/task_loss", task, **opts)
        self.log("train/distill_kl", kl, **opts)
        return (1.0 - settings.weight) * task + settings.weight * kl

    def _eval_step(self, batch: Mapping[str, Any]) -> None:
        nll, n_tokens, correct = self._losses(batch)
        self.eval_nll.update(nll.detach().float())
        self.eval_tokens.update(n_tokens.float())
        self.eval_correct.update(correct.float())

    def _eval_epoch_end(self, stage: str) -> None:
        tokens = self.eval_tokens.compute()
        if tokens > 0:
            loss = self.eval_nll.compute() / tokens
            acc = self.eval_correct.compute() / tokens
            # Values are already global (torchmetrics all-reduced the sums); sync_dist keeps the
            # logging call uniform on every rank and is a no-op average of identical numbers.
            self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True)
            self.log(f"{stage}/ppl", torch.exp(loss), prog_bar=stage == "val", sync_dist=True)
            self.log(f"{stage}/acc", acc, sync_dist=True)
        for metric in (self.eval_nll, self.eval_tokens, self.eval_correct):
            metric.reset()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def total_steps(self) -> int:
        """Optimizer steps the schedule spans; Lightning accounts for accumulation and devices."""
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise UserError(
                "the LR schedule needs a finite run: set trainer.max_steps or trainer.max_epochs"
            )
        return max(1, int(total))

    def configure_optimizers(self) -> dict[str, Any]:
        opt = self.optim
        groups = self.model.param_groups(opt["weight_decay"])
        for group in groups:  # names show up in LearningRateMonitor's keys: lr-AdamW/decay
            group.setdefault("name", "decay" if group["weight_decay"] else "no_decay")
        optimizer = torch.optim.AdamW(
            groups,
            lr=opt["lr"],
            betas=tuple(opt["betas"]),
            eps=opt["eps"],
        )
        schedule = partial(
            warmup_cosine,
            warmup_steps=int(opt["warmup_steps"]),
            total_steps=self.total_steps(),
            min_lr_ratio=float(opt["min_lr_ratio"]),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Inference rebuilds the model from this key alone (no Hydra, no Lightning hparams).
        checkpoint["performer_config"] = self.performer_config.to_dict()
        # The contact regression init_from brought along (plain JSON data, e.g. ESM-2's
        # contact head), so a fine-tune predicts contacts without a refit.
        if self.contact_regression is not None:
            checkpoint[CONTACT_REGRESSION_KEY] = self.contact_regression

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Resuming keeps the regression for the checkpoints still to come.
        self.contact_regression = checkpoint.get(CONTACT_REGRESSION_KEY, self.contact_regression)
