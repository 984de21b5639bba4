"""The Lightning module of fine-tuning: a head (and, for lora/full, the backbone) and its loss.

Small on purpose, like ``training.lit_module``: heads and losses live in
``model.task_heads``, LoRA in ``interop.finetuned`` (PEFT); this file glues a batch to a loss
and computes the metrics the field reports, logged as ``val/...`` and ``test/...``:
Spearman, Pearson and MSE for regression; accuracy, AUROC and MCC for classification;
per-residue accuracy and macro F1 for residue classification. ``val/loss`` is the task's loss
(what ``DivergenceGuard`` watches and the checkpoint keeps the best of).

Regression targets are standardized: the head learns z-scores (the train split's mean and std
per target), because raw labels of any scale (a fitness of -3..0, a melting point near 60, an
offset of +1000) otherwise leave a head at Adam's default step sizes far from the targets for
the whole run. The checkpoint stores the statistics (``finetune.target_mean`` /
``target_std``) and its head's output layer with them folded in (``W * std``, ``b * std +
mean``), so ``pp.load(...).predict`` returns label units without knowing about them; loading
a checkpoint to resume or test unfolds them again. A checkpoint without the statistics (written
before they existed) reads as mean 0, std 1: it was trained on raw labels. ``val/loss`` is the
MSE in z-units (what training minimizes), ``val/mse`` is in label units.

Modes: ``frozen`` batches carry cached features (``features``; the backbone never runs),
``lora`` and ``full`` carry ``tokens`` and run backbone + head end to end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.optim.lr_scheduler import LambdaLR

from protein_performer.errors import UserError
from protein_performer.interop.finetuned import (
    FINETUNE_KEY,
    HEAD_KEY,
    LORA_KEY,
    add_lora,
)
from protein_performer.io.checkpoints import CONTACT_REGRESSION_KEY
from protein_performer.model.performer import PerformerLM
from protein_performer.model.task_heads import (
    IGNORE_INDEX,
    HeadConfig,
    TaskHead,
    TaskModel,
    head_loss,
    set_gradient_checkpointing,
)
from protein_performer.training.lit_module import warmup_cosine

MODES = ("frozen", "lora", "full")
#: The head's output layer in the module's state dict (where the target statistics fold in).
OUT_WEIGHT, OUT_BIAS = "head.out.weight", "head.out.bias"


class FinetuneModule(pl.LightningModule):
    """Trains a task head on a backbone in one of :data:`MODES`.

    Args:
        backbone: the base model (its weights already loaded; adapted in place for lora).
        head: the head's config.
        mode: ``frozen`` (head only, on cached features), ``lora`` (PEFT adapters on the
            attention and FFN projections + head) or ``full`` (everything).
        lora: PEFT ``LoraConfig`` fields (``r``, ``lora_alpha``, ``lora_dropout``).
        optim: ``lr`` (backbone or adapters), ``head_lr``, ``weight_decay``, ``warmup_ratio``
            (of the total steps), ``min_lr_ratio``.
        gradient_checkpointing: recompute block activations in backward (long sequences).
        target_stats: regression only: per-target ``(mean, std)`` of the train split; the head
            learns ``(y - mean) / std``. None: mean 0, std 1 (raw labels).
    """

    def __init__(
        self,
        backbone: PerformerLM,
        head: HeadConfig,
        mode: str = "lora",
        lora: Mapping[str, Any] | None = None,
        optim: Mapping[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        contact_regression: dict[str, Any] | None = None,
        target_stats: tuple[Sequence[float], Sequence[float]] | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise UserError(f"mode={mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.head_config = head
        self.optim = {"lr": 1e-3, "head_lr": 1e-3, "weight_decay": 0.01, "warmup_ratio": 0.06,
                      "min_lr_ratio": 0.1, **(optim or {})}  # fmt: skip
        self.model = backbone
        self.head = TaskHead(head)
        self.lora_settings = dict(lora or {}) if mode == "lora" else None
        self.contact_regression = contact_regression
        if mode == "lora":
            # Not a submodule: the adapters live inside self.model; this only merges them.
            object.__setattr__(self, "_adapters", add_lora(self.model, self.lora_settings))
        elif mode == "frozen":
            self.model.requires_grad_(False)
        set_gradient_checkpointing(self.model, gradient_checkpointing and mode != "frozen")
        # Not persistent: the checkpoint keeps them in FINETUNE_KEY, next to the folded head.
        k = head.num_outputs
        mean, std = target_stats if target_stats is not None else ([0.0] * k, [1.0] * k)
        self.register_buffer("target_mean", _stat(mean, k, "mean"), persistent=False)
        self.register_buffer("target_std", _stat(std, k, "std"), persistent=False)
        self._eval: list[tuple[np.ndarray, np.ndarray]] = []

    # ------------------------------------------------------------------------- forward
    def task_model(self) -> TaskModel:
        return TaskModel(self.model, self.head)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Head outputs: (B, K) for sequence tasks, (B, T, K) for residue tasks (aligned with
        the batch's tokens or features)."""
        if "tokens" in batch:
            return TaskModel(self.model, self.head)(batch["tokens"])
        feats = batch["features"]
        if feats.ndim == 2:
            return self.head.project(feats)
        return self.head(feats, batch["mask"])

    def train(self, mode: bool = True) -> FinetuneModule:
        super().train(mode)
        if self.mode == "frozen":
            self.model.eval()  # the backbone is a fixed feature extractor: no dropout
        return self

    @property
    def standardizes(self) -> bool:
        return self.head_config.task == "regression"

    def standardize(self, labels: torch.Tensor) -> torch.Tensor:
        """Regression labels in z-units (NaN stays NaN); other tasks' labels unchanged."""
        if not self.standardizes:
            return labels
        return (labels - self.target_mean) / self.target_std

    def _loss(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self(batch)
        return head_loss(self.head_config.task, out, self.standardize(batch["labels"])), out

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        n = batch["labels"].shape[0]
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=n)
        return loss

    # ------------------------------------------------------------------------- evaluation
    def _eval_step(self, batch: Mapping[str, torch.Tensor]) -> None:
        _, out = self._loss(batch)
        out, labels = out.detach().float().cpu(), batch["labels"].cpu()
        if self.head_config.per_residue:
            keep = labels != IGNORE_INDEX
            self._eval.append((out[keep].numpy(), labels[keep].numpy()))
        else:
            self._eval.append((out.numpy(), labels.numpy()))

    def _eval_end(self, stage: str) -> None:
        if not self._eval:
            return
        out = np.concatenate([o for o, _ in self._eval])
        labels = np.concatenate([y for _, y in self._eval])
        self._eval.clear()
        task = self.head_config.task
        if self.standardizes:  # metrics in label units; the loss in the z-units trained on
            mean = self.target_mean.cpu().numpy()
            std = self.target_std.cpu().numpy()
            metrics = task_metrics(task, out * std + mean, labels)
            metrics["loss"] = task_metrics(task, out, (labels - mean) / std)["loss"]
        else:
            metrics = task_metrics(task, out, labels)
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value, prog_bar=name in ("loss", "spearman", "acc"))

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def test_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")

    # ------------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> dict[str, Any]:
        opt = self.optim
        groups = [{"params": [p for p in self.head.parameters()], "lr": float(opt["head_lr"]),
                   "name": "head"}]  # fmt: skip
        backbone = [p for p in self.model.parameters() if p.requires_grad]
        if backbone and self.mode != "frozen":
            groups.append({"params": backbone, "lr": float(opt["lr"]), "name": self.mode})
        optimizer = torch.optim.AdamW(groups, weight_decay=float(opt["weight_decay"]))
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise UserError("the LR schedule needs trainer.max_epochs or trainer.max_steps")
        schedule = partial(
            warmup_cosine,
            warmup_steps=int(float(opt["warmup_ratio"]) * total),
            total_steps=max(1, int(total)),
            min_lr_ratio=float(opt["min_lr_ratio"]),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    # ------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What interop.finetuned.read_finetuned (and so protein_performer.load) rebuilds from.
        checkpoint["performer_config"] = self.model.config.to_dict()
        checkpoint[HEAD_KEY] = self.head_config.to_dict()
        checkpoint[FINETUNE_KEY] = {"mode": self.mode, "optim": dict(self.optim)}
        if self.standardizes:
            checkpoint[FINETUNE_KEY]["target_mean"] = self.target_mean.tolist()
            checkpoint[FINETUNE_KEY]["target_std"] = self.target_std.tolist()
            fold_targets(checkpoint["state_dict"], self.target_mean, self.target_std)
        if self.lora_settings is not None:
            checkpoint[LORA_KEY] = dict(self.lora_settings)
        if self.contact_regression is not None:
            checkpoint[CONTACT_REGRESSION_KEY] = self.contact_regression

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Called before Lightning loads the state dict (resume, test of the best checkpoint):
        # the checkpoint's statistics win over this run's, and the head goes back to z-units.
        if not self.standardizes:
            return
        mean, std = target_stats_of(checkpoint, self.head_config.num_outputs)
        self.target_mean.copy_(mean)
        self.target_std.copy_(std)
        fold_targets(checkpoint["state_dict"], mean, std, inverse=True)


def _stat(values: Sequence[float], k: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(list(values), dtype=torch.float32).flatten()
    if t.numel() != k or not torch.isfinite(t).all() or (what == "std" and (t <= 0).any()):
        raise UserError(f"target {what} {t.tolist()} does not fit {k} regression target(s)")
    return t


def label_stats(labels: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-target mean and std of regression labels (N, T), NaNs ignored. A target with fewer
    than 2 values or no spread gets std 1 (nothing to scale), one with none mean 0."""
    means, stds = [], []
    for j in range(labels.shape[1]):
        y = labels[:, j][~np.isnan(labels[:, j])].astype(np.float64)
        means.append(float(y.mean()) if len(y) else 0.0)
        sd = float(y.std()) if len(y) > 1 else 0.0
        stds.append(sd if sd > 0 and math.isfinite(sd) else 1.0)
    return means, stds


def target_stats_of(checkpoint: Mapping[str, Any], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics a checkpoint's head was trained with; mean 0, std 1 when it stores none."""
    stored = checkpoint.get(FINETUNE_KEY) or {}
    mean = stored.get("target_mean", [0.0] * k)
    std = stored.get("target_std", [1.0] * k)
    return _stat(mean, k, "mean"), _stat(std, k, "std")


def fold_targets(state: dict[str, torch.Tensor], mean: torch.Tensor, std: torch.Tensor,
                 inverse: bool = False) -> None:  # fmt: skip
    """Fold ``y = z * std + mean`` into the head's output layer (``inverse``: take it out), in
    the state dict only: new tensors, the live parameters are not touched."""
    w, b = state[OUT_WEIGHT], state[OUT_BIAS]
    std = std.to(w.device, w.dtype)
    mean = mean.to(b.device, b.dtype)
    if inverse:
        state[OUT_WEIGHT], state[OUT_BIAS] = w / std[:, None], (b - mean) / std
    else:
        state[OUT_WEIGHT], state[OUT_BIAS] = w * std[:, None], b * std + mean


def task_metrics(task: str, out: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The metrics that fit ``task`` from head outputs and labels (NumPy, whole split)."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef, roc_auc_score

    t_out = torch.from_numpy(out)
    if task == "regression":
        metrics = {"loss": float(head_loss(task, t_out, torch.from_numpy(labels)))}
        metrics["mse"] = metrics["loss"]
        rhos, rs = [], []
        for j in range(labels.shape[1]):
            seen = ~np.isnan(labels[:, j])
            y, p = labels[seen, j], out[seen, j]
            if seen.sum() > 2 and np.ptp(y) > 0 and np.ptp(p) > 0:
                rhos.append(spearmanr(p, y).statistic)
                rs.append(pearsonr(p, y).statistic)
        if rhos:
            metrics["spearman"] = float(np.mean(rhos))
            metrics["pearson"] = float(np.mean(rs))
        return metrics
    # Residue outputs arrive already flattened to the labelled residues: (N, K) either way.
    metrics = {"loss": float(head_loss("classification", t_out, torch.from_numpy(labels)))}
    pred = out.argmax(-1)
    metrics["acc"] = float((pred == labels).mean())
    if task == "residue_classification":
        metrics["f1"] = float(f1_score(labels, pred, average="macro", zero_division=0))
        return metrics
    metrics["mcc"] = float(matthews_corrcoef(labels, pred))
    probs = torch.softmax(t_out.float(), -1).numpy()
    present = np.unique(labels)
    if len(present) >= 2:
        try:
            if out.shape[1] == 2:
                metrics["auroc"] = float(roc_auc_score(labels, probs[:, 1]))
            elif len(present) == out.shape[1]:
                metrics["auroc"] = float(roc_auc_score(labels, probs, multi_class="ovr"))
        except ValueError:
            pass
    return metrics
