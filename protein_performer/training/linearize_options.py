"""What a linearization does (``training.linearize``), torch-free so the CLI's ``--help``
shows the defaults without importing torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from protein_performer.errors import UserError
from protein_performer.model.config import LINEAR_KERNELS


@dataclass
class LinearizeOptions:
    """What a linearization does; stored in the resume state, which must match to resume."""

    kernel: str = "hedgehog"  # the linear map: hedgehog (learned) or taylor (fixed)
    window: int = 64  # exact sliding window of the nearest keys (0 = none)
    steps: int = 100  # attention-transfer steps (one batch each; 60-200 gave the same fit on
    # the 3,000-step exact MLM, docs/RESULTS.md)
    lr: float = 0.1  # transfer learning rate (LoLCATs: 1e-2 over far more steps; 0.1 fits
    # 30 steps 2-4x closer than 1e-2 on a 300-step exact MLM, docs/RESULTS.md)
    lora_steps: int = 0  # LoRA fine-tune steps after the transfer (0 = none)
    lora_lr: float = 1e-3
    lora_rank: int = 8
    kl_weight: float = 0.0  # (1 - w) MLM + w KL(exact || linear) in the LoRA stage
    max_len: int = 512
    max_tokens: int = 8192
    heldout_frac: float = 0.02  # valid and test fractions of a FASTA input (never fitted on)
    seed: int = 0
    save_every: int = 25

    @classmethod
    def of(cls, **options: Any) -> LinearizeOptions:
        """From keywords (``pp.linearize``'s); an unknown one is a UserError, not a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UserError(f"linearize: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**options).check()

    def check(self) -> LinearizeOptions:
        def bad(msg: str) -> None:
            raise UserError(f"linearize: {msg}")

        if self.kernel not in LINEAR_KERNELS:
            bad(f"unknown kernel {self.kernel!r}; choose one of {', '.join(LINEAR_KERNELS)}")
        if self.kernel == "taylor" and not self.window:
            bad(
                "the taylor map has nothing to fit (no parameters) and --window 0 adds none; "
                "use --kernel hedgehog or a window"
            )
        for name in ("window", "steps", "lora_steps"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "lora_lr", "lora_rank", "max_tokens", "save_every"):
            if not getattr(self, name) > 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_len < 3:
            bad(f"max_len must be >= 3, got {self.max_len}")
        if not 0.0 <= self.kl_weight <= 1.0:
            bad(f"kl_weight must be in [0, 1], got {self.kl_weight}")
        return self
