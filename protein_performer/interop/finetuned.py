"""Fine-tuned checkpoints (``protein-performer finetune``): one source of the one loader (read,
LoRA rebuilt), and merged and written here too.

A fine-tuned checkpoint is a Lightning ``.ckpt`` whose state dict holds the backbone under
``model.`` and the task head under ``head.``, plus ``performer_config``, ``task_head`` (a
``HeadConfig``) and, for ``mode=lora``, ``lora`` (PEFT's ``LoraConfig`` fields). The backbone's
LoRA layers are rebuilt with PEFT itself (``LoraModel``, the library that trained them), so the
loaded model computes exactly what was trained; :func:`merge_lora` folds the adapters into the
base weights with PEFT's ``merge_and_unload`` (plain ``nn.Linear`` again, same outputs).

Read through ``io.checkpoints.safe_load`` like every other checkpoint (weights only); the head
and LoRA configs are plain data, checked before anything is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel, LoadOptions, config_from
from protein_performer.io.checkpoints import CONTACT_REGRESSION_KEY, check_finite, save_atomic
from protein_performer.model.cores import upgrade_keys
from protein_performer.model.performer import PerformerLM
from protein_performer.model.task_heads import HeadConfig, TaskHead

#: Checkpoint keys of a fine-tuned model.
HEAD_KEY = "task_head"
LORA_KEY = "lora"
FINETUNE_KEY = "finetune"
BACKBONE_PREFIX = "model."
HEAD_PREFIX = "head."
#: The backbone's projections LoRA adapts: attention q/k/v/out and the FFN's fc1/fc2.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
ADAPTER = "default"
_LORA_FIELDS = {"r", "lora_alpha", "lora_dropout", "target_modules", "bias"}
_LORA_BIAS = ("none", "all", "lora_only")


def detect(path: Path, data: Any) -> bool:
    """Whether a checkpoint's contents are a fine-tuned model's (a head is stored)."""
    return isinstance(data, dict) and HEAD_KEY in data


def read(path: Path, data: Any, options: LoadOptions) -> LoadedModel:
    """The fine-tuned model as trained: its head was fitted to this attention core, so the
    options that would swap it are refused."""
    if options.changes_core():
        raise UserError(
            f"{path} is a fine-tuned model: its head was trained on this attention core; load "
            "it without attention/kernel/nb_features"
        )
    return read_finetuned(path, data)


def lora_config(settings: dict[str, Any]) -> Any:
    """PEFT's ``LoraConfig`` from plain settings (what a checkpoint stores)."""
    from peft import LoraConfig

    unknown = sorted(set(settings) - _LORA_FIELDS)
    if unknown:
        raise UserError(
            f"unknown LoRA setting(s) {', '.join(unknown)}; known: {sorted(_LORA_FIELDS)}"
        )
    values = {"target_modules": list(LORA_TARGETS), **settings}
    _check_lora(values)
    values["target_modules"] = list(values["target_modules"])
    return LoraConfig(**values)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_lora(values: dict[str, Any]) -> None:
    """The settings PEFT would reject with its own traceback (r 0, -4 or "8", a module name it
    cannot find, an unknown bias), as one line each."""
    r = values.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise UserError(f"LoRA r must be a positive integer, got {r!r}")
    alpha, dropout = values.get("lora_alpha", 8), values.get("lora_dropout", 0.0)
    if not _number(alpha) or not 0 < alpha < float("inf"):
        raise UserError(f"LoRA lora_alpha must be a positive number, got {alpha!r}")
    if not _number(dropout) or not 0.0 <= dropout < 1.0:
        raise UserError(f"LoRA lora_dropout must be in [0, 1), got {dropout!r}")
    targets = values["target_modules"]
    if (isinstance(targets, str) or not isinstance(targets, list | tuple) or not targets
            or not set(targets) <= set(LORA_TARGETS)):  # fmt: skip
        raise UserError(
            f"LoRA target_modules must be a list of {', '.join(LORA_TARGETS)}, got {targets!r}"
        )
    if values.get("bias", "none") not in _LORA_BIAS:
        raise UserError(f"LoRA bias must be one of {', '.join(_LORA_BIAS)}, got "
                        f"{values.get('bias')!r}")  # fmt: skip


def add_lora(model: PerformerLM, settings: dict[str, Any]) -> Any:
    """Wrap ``model``'s projections with LoRA adapters in place (PEFT's ``LoraModel``); only the
    adapters stay trainable. Returns the ``LoraModel`` (needed to merge), which is not a
    submodule of anything: the adapted layers live inside ``model`` itself."""
    from peft import LoraModel

    config = lora_config(settings)
    if config.r > model.config.dim:
        raise UserError(
            f"LoRA r={config.r} exceeds the model width {model.config.dim}: a rank above it "
            "adds parameters and no capacity"
        )
    return LoraModel(model, config, ADAPTER)


def read_finetuned(path: Path, ckpt: dict[str, Any]) -> LoadedModel:
    """A fine-tuned checkpoint's contents -> a ``LoadedModel`` (CPU, eval) with ``task`` set."""
    state = ckpt.get("state_dict")
    if not isinstance(state, dict):
        raise UserError(f"{path}: a fine-tuned checkpoint without a state_dict; re-run finetune")
    check_finite(state, path)
    config = config_from(ckpt.get("performer_config"), path, "performer_config")
    head_data = ckpt.get(HEAD_KEY)
    if not isinstance(head_data, dict):
        raise UserError(f"{path}: '{HEAD_KEY}' must be a mapping of head config fields")
    try:
        head_config = HeadConfig.from_dict(head_data)
    except (UserError, TypeError) as exc:
        raise UserError(f"{path}: {HEAD_KEY}: {exc}") from None
    lora = ckpt.get(LORA_KEY)
    if lora is not None and not isinstance(lora, dict):
        raise UserError(f"{path}: '{LORA_KEY}' must be a mapping of LoRA settings")
    if head_config.dim != config.dim:
        raise UserError(f"{path}: {HEAD_KEY} dim {head_config.dim} is not the backbone's "
                        f"width {config.dim}")  # fmt: skip

    def build() -> tuple[PerformerLM, Any, TaskHead]:
        try:
            model = PerformerLM(config)
            adapters = add_lora(model, lora) if lora is not None else None
        except UserError as exc:
            raise UserError(f"{path}: {LORA_KEY}: {exc}") from None
        return model, adapters, TaskHead(head_config)

    # Sizes come from the stored configs: built first on the meta device (no memory), the
    # model must match the stored weights before the real one is allocated (lora.r 1e9 and a
    # head hidden 1e12 asked for 256 GB and 256 TB).
    with torch.device("meta"):
        shell, _, head_shell = build()
    _check_part(shell, state, BACKBONE_PREFIX, path, "backbone")
    _check_part(head_shell, state, HEAD_PREFIX, path, "head")
    model, adapters, head = build()
    _load_part(model, state, BACKBONE_PREFIX, path, "backbone")
    _load_part(head, state, HEAD_PREFIX, path, "head")
    model.eval()
    head.eval()
    return LoadedModel(
        model, config, Alphabet(), path, torch.device("cpu"), "finetuned",
        ckpt.get(CONTACT_REGRESSION_KEY), task=head,
        lora=dict(lora) if lora is not None else None, adapters=adapters,
    )  # fmt: skip


def _load_part(module: torch.nn.Module, state: dict, prefix: str, path: Path, what: str) -> None:
    module.load_state_dict(_check_part(module, state, prefix, path, what), strict=False)


def _check_part(
    module: torch.nn.Module, state: dict, prefix: str, path: Path, what: str
) -> dict[str, torch.Tensor]:
    """The stored tensors of ``module`` (names under ``prefix``): exactly its own, with its
    shapes, or one line."""
    part = upgrade_keys({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    own = module.state_dict()
    aliases = {"lm_head.weight"} if what == "backbone" else set()
    missing = sorted(set(own) - set(part) - aliases)
    unexpected = sorted(set(part) - set(own))
    wrong = sorted(k for k in set(part) & set(own) if tuple(part[k].shape) != tuple(own[k].shape))
    if missing or unexpected or wrong:
        raise UserError(
            f"{path}: the {what} weights do not fit the stored configs (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}); the file was edited or "
            "written by an incompatible version"
        )
    return part


def merge_lora(loaded: LoadedModel) -> LoadedModel:
    """Fold LoRA adapters into the base weights (PEFT ``merge_and_unload``), in place; a model
    without adapters is returned unchanged. Predictions stay the same up to float rounding."""
    if loaded.adapters is None:
        return loaded
    loaded.model = loaded.adapters.merge_and_unload()
    loaded.lora = loaded.adapters = None
    return loaded


def finetuned_checkpoint(loaded: LoadedModel, extra: dict[str, Any] | None = None) -> dict:
    """The checkpoint dict of a fine-tuned model in memory (what :func:`read_finetuned` reads)."""
    state = {
        f"{BACKBONE_PREFIX}{k}": v.detach().cpu() for k, v in loaded.model.state_dict().items()
    }
    state.update(
        {f"{HEAD_PREFIX}{k}": v.detach().cpu() for k, v in loaded.task.state_dict().items()}
    )
    ckpt: dict[str, Any] = {
        "state_dict": state,
        "performer_config": loaded.config.to_dict(),
        HEAD_KEY: loaded.task.config.to_dict(),
        **(extra or {}),
    }
    if loaded.lora is not None:
        ckpt[LORA_KEY] = dict(loaded.lora)
    if loaded.contact_regression is not None:
        ckpt[CONTACT_REGRESSION_KEY] = loaded.contact_regression
    return ckpt


def save_finetuned(
    loaded: LoadedModel, out: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> Path:
    """Write a fine-tuned model as a ``.ckpt`` that ``protein_performer.load`` opens
    (atomically; non-finite weights refused)."""
    if loaded.task is None:
        raise UserError(f"{loaded.source} has no task head: only fine-tuned models are merged")
    return save_atomic(finetuned_checkpoint(loaded, extra), Path(out).expanduser())
