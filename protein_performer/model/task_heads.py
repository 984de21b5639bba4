"""Task heads on a ``PerformerLM`` backbone: sequence regression, sequence classification,
residue classification (HF's ``EsmForSequenceClassification`` / ``EsmForTokenClassification``).

They live on the model floor, not in ``protein_performer.finetune``, because inference
(``ProteinLM.predict``) and the one loader (``interop.loading``) must rebuild them from a
checkpoint without importing training. A head reads one hidden layer of the backbone; its
architecture is one dataclass (:class:`HeadConfig`) stored in the checkpoint, like
``PerformerConfig``. The backbone's objective (mlm or clm) does not matter to a head.

A head is split into :meth:`TaskHead.pool` (hidden states -> what the output layer reads) and
:meth:`TaskHead.project`, so the ``frozen`` fine-tuning mode can cache the pooled features once
and train only the projection on them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protein_performer.errors import UserError
from protein_performer.model.performer import PerformerLM

TASKS = ("regression", "classification", "residue_classification")
POOLINGS = ("mean", "cls", "attention")
#: Label value meaning "no label here" (padding, <cls>/<eos>, unlabelled residues).
IGNORE_INDEX = -100


@dataclass
class HeadConfig:
    """Everything needed to rebuild a :class:`TaskHead`; stored verbatim in checkpoints."""

    # regression (one or more real targets), classification (one label per sequence),
    # residue_classification (one label per residue).
    task: str = "regression"
    # Outputs: the number of targets (regression) or of classes (classification tasks).
    num_outputs: int = 1
    # Names of the outputs: target column names, or class labels in index order.
    labels: list[str] = field(default_factory=lambda: ["label"])
    # Backbone width (the hidden size the head reads).
    dim: int = 320
    # Sequence pooling: mean over residues, the <cls> position, or learned attention pooling.
    # Ignored by residue_classification.
    pooling: str = "mean"
    # Backbone layer read, ESM numbering (0 = embeddings, -1 = last block after the final norm).
    layer: int = -1
    # Hidden width of a one-hidden-layer MLP head (0 = a linear head, the probe baseline).
    hidden: int = 0
    # Dropout before the output layer (training only).
    dropout: float = 0.1

    def validate(self) -> HeadConfig:
        if self.task not in TASKS:
            raise UserError(f"task={self.task!r} is not one of {', '.join(TASKS)}")
        if self.pooling not in POOLINGS:
            raise UserError(f"head pooling={self.pooling!r} is not one of {', '.join(POOLINGS)}")
        for name in ("dim", "hidden", "layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise UserError(f"head {name} must be an integer, got {value!r}")
        if self.dim < 1:
            raise UserError(f"head dim must be positive, got {self.dim}")
        if not isinstance(self.num_outputs, int) or self.num_outputs < 1:
            raise UserError(f"head num_outputs must be a positive integer, got {self.num_outputs}")
        if self.task != "regression" and self.num_outputs < 2:
            raise UserError(f"{self.task} needs at least 2 classes, got {self.num_outputs}")
        if len(self.labels) != self.num_outputs:
            raise UserError(
                f"head labels {self.labels} do not match num_outputs={self.num_outputs}"
            )
        if self.hidden < 0 or not 0.0 <= self.dropout < 1.0:
            raise UserError(f"head hidden={self.hidden}, dropout={self.dropout} out of range")
        return self

    @property
    def per_residue(self) -> bool:
        return self.task == "residue_classification"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"unknown head config key(s): {', '.join(unknown)}")
        return cls(
            **{**data, "labels": [str(x) for x in data.get("labels", ["label"])]}
        ).validate()


def residue_mask(tokens: torch.Tensor, pad_idx: int, cls_idx: int, eos_idx: int) -> torch.Tensor:
    """(B, T) True at residues: not padding, not ``<cls>``/``<eos>``."""
    return (tokens != pad_idx) & (tokens != cls_idx) & (tokens != eos_idx)


class TaskHead(nn.Module):
    """Pooling (sequence tasks) + optional MLP + output layer."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        d = config.dim
        self.attn_score = nn.Linear(d, 1) if config.pooling == "attention" else None
        self.dropout = nn.Dropout(config.dropout)
        if config.hidden:
            self.mlp: nn.Module = nn.Sequential(nn.Linear(d, config.hidden), nn.GELU())
            d = config.hidden
        else:
            self.mlp = nn.Identity()
        self.out = nn.Linear(d, config.num_outputs)

    @property
    def per_residue(self) -> bool:
        return self.config.per_residue

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, D) and residue mask (B, T) -> what :meth:`project` reads:
        (B, D) for sequence tasks, (B, T, D) unchanged for residue tasks."""
        if self.per_residue:
            return hidden
        if self.config.pooling == "cls":
            return hidden[:, 0]  # <cls> is always token 0
        m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        if self.config.pooling == "mean":
            return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
        assert self.attn_score is not None
        scores = self.attn_score(hidden).squeeze(-1).float()  # (B, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(hidden.dtype)  # (B, T)
        return torch.einsum("bt,btd->bd", weights, hidden)

    def needs_tokens(self) -> bool:
        """Whether the frozen mode must cache per-residue features (attention pooling and
        residue tasks read every position; mean and cls pool to one vector)."""
        return self.per_residue or self.config.pooling == "attention"

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        """(B, D) -> (B, K), or (B, T, D) -> (B, T, K)."""
        return self.out(self.dropout(self.mlp(pooled)))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.project(self.pool(hidden, mask))


def head_loss(
    task: str, outputs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The loss that fits the task: MSE over the observed targets (a NaN target is ignored),
    cross-entropy for classification, cross-entropy over labelled residues. float32 always."""
    outputs = outputs.float()
    if task == "regression":
        observed = ~torch.isnan(labels)
        diff = torch.where(observed, outputs - labels.nan_to_num(0.0), torch.zeros_like(outputs))
        return (diff**2).sum() / observed.sum().clamp(min=1)
    if task == "classification":
        return F.cross_entropy(outputs, labels.long())
    if task == "residue_classification":
        targets = labels.long()
        if mask is not None:
            targets = targets.masked_fill(~mask, IGNORE_INDEX)
        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    raise UserError(f"unknown task {task!r}")


class TaskModel(nn.Module):
    """Backbone + head, end to end from tokens: what fine-tuning (lora, full) trains and what
    ``ProteinLM.predict`` runs. The backbone is held, not copied: ``lm.model`` is the same
    module, so embeddings of a fine-tuned model come from its fine-tuned weights."""

    def __init__(self, backbone: PerformerLM, head: TaskHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def features(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B, T) -> the head's layer (B, T, D) and the residue mask (B, T)."""
        c = self.backbone.config
        padding = tokens.eq(c.pad_idx)
        out = self.backbone(tokens, padding_mask=padding, repr_layers=[self.head.config.layer])
        hidden = next(iter(out.hidden_states.values()))
        return hidden, residue_mask(tokens, c.pad_idx, c.cls_idx, c.eos_idx)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, mask = self.features(tokens)
        return self.head(hidden, mask)


def set_gradient_checkpointing(backbone: PerformerLM, enabled: bool) -> None:
    """Recompute each block's activations in backward: memory per residue drops to about one
    block's worth, so fine-tuning long proteins needs no cropping."""
    for layer in backbone.layers:
        layer.gradient_checkpointing = enabled
