"""The Hydra values training relies on, checked in one place per config group before anything
is built: ``data``, ``model.optim`` and the composed ``trainer`` (the model's own fields are
``PerformerConfig.validate``'s job, ``model.distill`` is ``DistillSettings``').

Each group is a table of :class:`protein_performer.errors.Rule` (accepted types, range,
documented sentinels such as ``-1`` for ``trainer.max_steps``), so a negative size, a
probability outside [0, 1] or a string where a number belongs is one ``error:`` line naming
the key, not a traceback from deep inside a sampler or an optimizer a minute later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protein_performer.errors import Rule, check_group, invalid

_FRACTION = Rule(float, 0.0, 1.0)
_POSITIVE = Rule(int, 1)

DATA: dict[str, Rule] = {
    "objective": Rule(str, choices=("mlm", "clm")),
    "max_len": Rule(int, 3),  # <cls> + one residue + <eos>
    "max_tokens": _POSITIVE,
    "max_batch_size": Rule(int, 1, nullable=True),
    "mlm_prob": Rule(float, 0.0, 1.0, low_open=True),
    "valid_frac": _FRACTION,
    "test_frac": _FRACTION,
    "num_workers": Rule(int, 0),
    "seed": Rule(int, 0, 2**32 - 1, nullable=True),
    "on_invalid": Rule(str, choices=("error", "skip")),
    "pin_memory": Rule(bool),
    "limit_records": Rule(int, 1, nullable=True),
    "concat": Rule(bool),
    "layout": Rule(str, choices=("single", "family")),
    "family_max_tokens": Rule(int, 3),  # <cls> + one residue + <eos>
    "family_method": Rule(str, choices=("search", "cluster")),
    "family_identity": Rule(float, 0.0, 1.0, low_open=True),
    "family_memory_dropout": _FRACTION,
}

OPTIM: dict[str, Rule] = {
    "lr": Rule(float, 0.0),  # 0 is a legitimate smoke setting
    "weight_decay": Rule(float, 0.0),
    "eps": Rule(float, 0.0, low_open=True),
    "warmup_steps": Rule(int, 0),
    "min_lr_ratio": _FRACTION,
}

TRAINER: dict[str, Rule] = {
    "max_steps": Rule(int, 1, also=(-1,)),
    "max_epochs": Rule(int, 1, also=(-1,), nullable=True),
    "num_nodes": _POSITIVE,
    "accumulate_grad_batches": _POSITIVE,
    "gradient_clip_val": Rule(float, 0.0, nullable=True),
    "check_val_every_n_epoch": Rule(int, 1, nullable=True),
    "log_every_n_steps": _POSITIVE,
    "num_sanity_val_steps": Rule(int, 0, also=(-1,)),
}


def _check_batches(key: str, value: Any) -> None:
    """``limit_*_batches`` and ``val_check_interval``: an int count or a float fraction."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return
    raise invalid(key, value, "null, a whole number of batches >= 0 or a fraction in [0, 1]")


def _valid_interval(value: Any) -> bool:
    """Lightning's val_check_interval: batches, a fraction, or a duration 'DD:HH:MM:SS'."""
    if isinstance(value, str):
        parts = value.split(":")
        return len(parts) == 4 and all(p.isdigit() for p in parts) and any(map(int, parts))
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check_devices(value: Any) -> None:
    if value in ("auto", -1) or (
        isinstance(value, int) and not isinstance(value, bool) and value > 0
    ):
        return
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and items:
        try:
            if all(int(str(i).strip()) >= 0 for i in items):
                return
        except ValueError:
            pass
    raise invalid("trainer.devices", value, "a count > 0, -1 (all), auto, or a list of device ids")


def _plain(node: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


#: Top-level keys of every run config (``train.yaml``, ``finetune.yaml``). ``seed`` seeds
#: numpy too, which takes [0, 2**32).
TOP: dict[str, Rule] = {
    "seed": Rule(int, 0, 2**32 - 1, nullable=True),
    "overwrite": Rule(bool),
    "threads": Rule(int, 1, nullable=True),
}


def check_training_config(cfg: Mapping[str, Any]) -> None:
    """The checks of every group a training run composes, first failure as a ``UserError``."""
    check_group({k: cfg.get(k) for k in TOP if k in cfg}, "", TOP)
    check_group(_plain(cfg.get("data")), "data.", DATA)
    model = cfg.get("model") or {}
    optim = _plain(model.get("optim")) if isinstance(model, Mapping) else None
    check_group(optim, "model.optim.", OPTIM)
    if isinstance(optim, Mapping) and "betas" in optim:
        betas = optim["betas"]
        if not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(Rule(float, 0.0, 1.0).accepts(b) and b < 1.0 for b in betas)
        ):
            raise invalid("model.optim.betas", betas, "two numbers in [0, 1), e.g. [0.9, 0.98]")
    trainer = _plain(cfg.get("trainer"))
    check_group(trainer, "trainer.", TRAINER)
    if isinstance(trainer, Mapping):
        for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
            if key in trainer:
                _check_batches(f"trainer.{key}", trainer[key])
        interval = trainer.get("val_check_interval")
        if interval is not None and not _valid_interval(interval):
            raise invalid(
                "trainer.val_check_interval",
                interval,
                "> 0 (batches or a fraction) or a wall-clock duration 'DD:HH:MM:SS'",
            )
        if "devices" in trainer:
            _check_devices(trainer["devices"])
