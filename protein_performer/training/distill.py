"""Distillation from an exact-attention teacher, for recovering converted weights with FAVOR+.

After an exact -> FAVOR+ swap the weights are right but the attention is approximate; the MLM
loss alone teaches the student through the ~15% masked positions. The exact twin of the same
weights knows the target function at *every* position, so matching its logits is a denser signal
(Hinton et al., 2015; DistilBERT). The loss is

    (1 - weight) * MLM cross-entropy + weight * temperature^2 * KL(teacher_T || student_T)

with the KL averaged over the real (non-padding) tokens of the batch and ``_T`` the softmax at
``temperature``; the T^2 factor keeps gradient sizes comparable across temperatures.

The teacher is frozen, in eval mode, and deliberately *not* a registered submodule: it is not in
the checkpoint, the optimizer or the parameter count, and resuming a run reloads it from its path.
Its attention is exact, so its memory is O(L^2): keep ``data.max_len`` moderate when distilling.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from protein_performer.errors import UserError

if TYPE_CHECKING:
    from protein_performer.model.performer import PerformerLM

#: Settings used when ``model.distill`` leaves them out.
DEFAULT_DISTILL: dict[str, Any] = {"teacher": None, "weight": 0.0, "temperature": 1.0}


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Validated ``model.distill`` settings; weight 0 means off (and no teacher is loaded)."""

    teacher: str | None
    weight: float
    temperature: float

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> DistillSettings:
        merged = {**DEFAULT_DISTILL, **(raw or {})}
        unknown = sorted(set(merged) - set(DEFAULT_DISTILL))
        if unknown:
            raise UserError(
                f"unknown model.distill key(s): {', '.join(unknown)}; "
                f"valid keys are: {', '.join(DEFAULT_DISTILL)}"
            )
        weight, temperature = float(merged["weight"]), float(merged["temperature"])
        if not 0.0 <= weight <= 1.0:
            raise UserError(f"model.distill.weight must be in [0, 1], got {weight}")
        if temperature <= 0:
            raise UserError(f"model.distill.temperature must be > 0, got {temperature}")
        teacher = merged["teacher"]
        if weight > 0 and not teacher:
            raise UserError(
                "model.distill.weight > 0 needs a teacher: set model.distill.teacher=PATH (the "
                "exact-attention weights, e.g. the same path as init_from)"
            )
        return cls(str(teacher) if teacher else None, weight, temperature)


def exact_teacher(path: str | os.PathLike[str]) -> PerformerLM:
    """The exact-attention twin of ``path``'s weights, frozen and in eval mode.

    ``path`` is anything ``init_from`` accepts (``.ckpt``, export directory, ESM-2 ``.pt``,
    Hugging Face directory or cached id); a FAVOR+ source is swapped to exact attention, since
    the point of the teacher is the function the weights compute without the kernel
    approximation.
    """
    from protein_performer.interop.loading import load_model

    model = load_model(path, "cpu", attention="exact").model
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def distill_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    padding_mask: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """T^2 * KL(teacher_T || student_T), averaged over non-padding positions (float32)."""
    t = temperature
    student = F.log_softmax(student_logits.float() / t, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
    per_token = (teacher.exp() * (teacher - student)).sum(-1)  # (B, T)
    if padding_mask is not None:
        keep = ~padding_mask
        per_token = per_token[keep]
    if per_token.numel() == 0:
        return student_logits.new_zeros((), dtype=torch.float32)
    return per_token.mean() * (t * t)
