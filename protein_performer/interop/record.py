"""What a load gives and what every reader checks first.

:class:`LoadedModel` is a model ready for inference and what it was built from; the readers of
each source (``ours``, ``fair_esm``, ``hf_esm``, ``finetuned``) make one and the dispatcher
(``loading.load_model``) hands it out. :class:`LoadOptions` is what a caller may change on the
way (the attention core and the seed of features drawn for it). :func:`config_from` checks a
config read from a file (types, ranges, a size that fits in memory) before anything is
allocated. This module imports no reader, so every reader can import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.identity import weights_sha256
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.model.task_heads import TaskHead

if TYPE_CHECKING:
    from peft import LoraModel


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, on ``device``) and what it was built from."""

    model: PerformerLM
    config: PerformerConfig
    alphabet: Alphabet
    source: Path  # the file or directory read (for a Hugging Face id, its cached snapshot)
    device: torch.device
    kind: str  # "lightning", "export", "fair-esm" or "hf"
    #: The contact regression stored with the model (``ContactRegression.to_dict()``), if any.
    contact_regression: dict[str, Any] | None = None
    #: A fine-tuned model's task head (``interop.finetuned``).
    task: TaskHead | None = None
    #: A fine-tuned model's LoRA settings and PEFT ``LoraModel`` (None once merged or for
    #: ``full``/``frozen`` fine-tunes; PEFT is imported only where adapters exist).
    lora: dict[str, Any] | None = None
    adapters: LoraModel | None = None

    def weights_sha256(self) -> str:
        """The SHA-256 that names these learned weights (:mod:`interop.identity`), hashed on
        each call: the weights may change after loading (a LoRA merge, a core swap)."""
        return weights_sha256(self.model)


@dataclass(frozen=True)
class LoadOptions:
    """The attention core a caller asks for (None: the stored one; for ESM-2 weights exact
    attention with the softmax kernel) and the seed of the FAVOR+ features drawn for it."""

    attention: str | None = None
    kernel: str | None = None
    nb_features: int | None = None
    seed: int = 0

    def changes_core(self) -> bool:
        """Whether any of the attention options is given."""
        return bool(self.attention or self.kernel or self.nb_features)


# --------------------------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------------------------
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available) -> a torch device.

    Asking for CUDA on a machine without it is an error rather than a silent CPU fallback: a
    user who asked for the GPU and gets a 50x slower run deserves to know why (ESM's ignored
    ``--nogpu`` is the cautionary tale).
    """
    if isinstance(device, torch.device):
        device = str(device)
    name = str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UserError(
                f"device {device!r} requested but CUDA is not available (torch "
                f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); use "
                "--device cpu or --device auto"
            )
        if name.startswith("cuda:"):
            index = name.split(":", 1)[1]
            if not index.isdigit() or int(index) >= torch.cuda.device_count():
                raise UserError(
                    f"device {device!r} does not exist: this machine has "
                    f"{torch.cuda.device_count()} CUDA device(s) (cuda:0..)"
                )
        return torch.device(name)
    raise UserError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto")


# --------------------------------------------------------------------------------------------
# A config read from a file
# --------------------------------------------------------------------------------------------
def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 62


def _available_memory() -> tuple[int, str]:
    """Bytes this process can allocate now and what they are: Linux's ``MemAvailable`` (free
    plus reclaimable cache), else the machine's total. Total RAM alone let a model that fits
    only on an idle machine start swapping, or be killed, minutes into building it."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available"
    except (OSError, ValueError, IndexError):
        pass
    return _physical_memory(), "total"


def check_fits_in_memory(config: PerformerConfig, where: object) -> None:
    """Refuse, before allocating anything, a model larger than the memory available now: a
    damaged or crafted config (``depth: 200000``) must not take the machine down."""
    numel = config.estimated_numel()
    (have, what), need = _available_memory(), 4 * numel
    if need > have:
        raise UserError(
            f"{where}: the model config describes {numel:,} parameters ({need / 2**30:.1f} GiB "
            f"in float32), more than this machine's {have / 2**30:.1f} GiB of {what} memory: "
            "the config is damaged, or the model needs a bigger (or less busy) machine"
        )


def config_from(data: Any, path: Path, where: str) -> PerformerConfig:
    """A validated config (types, ranges, a size that fits in memory) from a file's data."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UserError(
            f"{path}: {where} must be a mapping of config fields, got {type(data).__name__}"
        )
    try:
        config = PerformerConfig.from_dict(data)
    except UserError as exc:
        raise UserError(f"{path}: {where}: {exc}") from None
    check_fits_in_memory(config, f"{path}: {where}")
    return config
