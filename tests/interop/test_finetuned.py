"""A fine-tuned checkpoint is a trust boundary (issue 42 #17): its ``lora`` and ``task_head``
dicts are checked, and the model they describe is built on the meta device and matched against
the stored weights before any memory is allocated (``lora.r=1e9`` asked for 256 GB)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.finetuned import add_lora, finetuned_checkpoint
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.model.task_heads import HeadConfig, TaskHead


@pytest.fixture(scope="module")
def stored() -> dict:
    torch.manual_seed(0)
    config = PerformerConfig(dim=16, depth=1, heads=2, ff_dim=32, nb_features=8)
    model = PerformerLM(config).eval()
    settings = {"r": 2}
    adapters = add_lora(model, settings)
    head = TaskHead(HeadConfig(dim=16, hidden=4))
    loaded = LoadedModel(model, config, Alphabet(), Path("x"), torch.device("cpu"),
                         "finetuned", task=head, lora=settings, adapters=adapters)  # fmt: skip
    return finetuned_checkpoint(loaded)


def _edited(stored: dict, tmp_path: Path, part: str, **edits: object) -> Path:
    ckpt = {**stored, part: {**stored[part], **edits}}
    path = tmp_path / "ft.ckpt"
    torch.save(ckpt, path)
    return path


def test_the_checkpoint_loads_as_stored(stored: dict, tmp_path: Path) -> None:
    loaded = load_model(_edited(stored, tmp_path, "lora"), "cpu")
    assert loaded.task is not None and loaded.lora == {"r": 2}


@pytest.mark.parametrize(
    ("part", "edit", "says"),
    [
        ("lora", {"r": 10**9}, "LoRA r=1000000000 exceeds the model width 16"),
        ("lora", {"r": 0}, "r must be a positive integer, got 0"),
        ("lora", {"r": -4}, "got -4"),
        ("lora", {"r": "8"}, "got '8'"),
        ("lora", {"target_modules": ["nope"]}, "target_modules must be a list of"),
        ("lora", {"target_modules": "q_proj"}, "target_modules must be a list of"),
        ("lora", {"bias": "some"}, "bias must be one of none, all, lora_only"),
        ("lora", {"lora_dropout": 2.0}, "lora_dropout must be in [0, 1)"),
        ("task_head", {"hidden": 10**12}, "the head weights do not fit the stored configs"),
        ("task_head", {"dim": 10**12}, "dim 1000000000000 is not the backbone's width 16"),
        ("task_head", {"hidden": 1e12}, "head hidden must be an integer"),
    ],
)
def test_a_crafted_lora_or_head_is_one_line(stored, tmp_path, part, edit, says) -> None:
    with pytest.raises(UserError, match=r"ft\.ckpt: .*" + re.escape(says)):
        load_model(_edited(stored, tmp_path, part, **edit), "cpu")
