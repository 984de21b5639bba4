"""Distillation from an exact-attention teacher (model.distill): loss, settings, module wiring."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.export import export_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.training.distill import DistillSettings, distill_kl
from protein_performer.training.init_weights import init_from
from protein_performer.training.lit_module import ProteinLMModule
from tests.paths import REPO

SHAPE = {"dim": 32, "depth": 2, "heads": 4, "ff_dim": 64, "nb_features": 16}
PAD = 1


def _batch(seed: int = 0, B: int = 3, T: int = 24) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 24, (B, T), generator=g)
    padding_mask = torch.zeros(B, T, dtype=torch.bool)
    padding_mask[0, -5:] = True
    tokens[padding_mask] = PAD
    targets = torch.full((B, T), -100)
    pick = (torch.rand(B, T, generator=g) < 0.3) & ~padding_mask
    targets[pick] = tokens[pick]
    tokens[pick] = 32  # <mask>
    return {"tokens": tokens, "targets": targets, "padding_mask": padding_mask}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """An exact-attention model with non-trivial weights, exported like convert-esm does."""
    torch.manual_seed(3)
    config = PerformerConfig.from_dict({**SHAPE, "attention": "exact"})
    model = PerformerLM(config)
    with torch.no_grad():  # larger weights than the init: peaked attention and logits, so the
        for name, param in model.named_parameters():  # FAVOR+ swap changes the output measurably
            if param.dim() == 2 or "norm" in name:
                param.mul_(3.0)
    loaded = LoadedModel(model, config, Alphabet(), Path("t"), torch.device("cpu"), "export")
    return export_model(loaded, tmp_path_factory.mktemp("distill") / "teacher")


def _student(teacher_dir: Path, attention: str, weight: float, T: float = 1.0):
    torch.manual_seed(0)
    module = ProteinLMModule(
        {**SHAPE, "attention": attention},
        {"lr": 3e-3, "warmup_steps": 1},
        {"teacher": str(teacher_dir), "weight": weight, "temperature": T},
    )
    init_from(module, teacher_dir)
    return module


def test_kl_matches_definition_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 33, generator=g), torch.randn(2, 5, 33, generator=g)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    for temp in (1.0, 2.0):
        p = F.softmax(t / temp, -1)
        per = (p * (p.log() - F.log_softmax(s / temp, -1))).sum(-1)
        want = per[~pad].mean() * temp**2
        assert distill_kl(s, t, pad, temp).item() == pytest.approx(want.item(), rel=1e-5)
    assert distill_kl(t, t, pad, 1.0).item() == pytest.approx(0.0, abs=1e-6)
    # Changing a padded position's logits changes nothing.
    s2 = s.clone()
    s2[1, 4] += 10
    assert distill_kl(s2, t, pad, 1.0).item() == pytest.approx(distill_kl(s, t, pad, 1.0).item())


def test_settings_validation() -> None:
    assert not DistillSettings.from_mapping(None).enabled
    with pytest.raises(UserError, match="needs a teacher"):
        DistillSettings.from_mapping({"weight": 0.5})
    with pytest.raises(UserError, match=r"in \[0, 1\]"):
        DistillSettings.from_mapping({"teacher": "x", "weight": 1.5})
    with pytest.raises(UserError, match="temperature"):
        DistillSettings.from_mapping({"teacher": "x", "weight": 0.5, "temperature": 0})
    with pytest.raises(UserError, match="unknown model.distill key"):
        DistillSettings.from_mapping({"teachr": "x"})


def test_exact_student_of_its_own_weights_has_zero_kl(teacher_dir) -> None:
    """Same weights, same (exact) attention: the loss is exactly (1 - w) * MLM."""
    module = _student(teacher_dir, "exact", weight=0.25).eval()
    batch = _batch()
    logits = module.model(batch["tokens"], padding_mask=batch["padding_mask"]).logits
    sel = batch["targets"] != -100
    mlm = F.cross_entropy(logits[sel], batch["targets"][sel]).item()
    assert module.training_step(batch, 0).item() == pytest.approx(0.75 * mlm, rel=1e-5)


def test_teacher_is_exact_frozen_and_outside_checkpoint(teacher_dir) -> None:
    module = _student(teacher_dir, "favor", weight=0.5)
    assert module._teacher.config.attention == "exact"
    assert not any(p.requires_grad for p in module._teacher.parameters())
    assert all(not k.startswith("_teacher") for k in module.state_dict())
    n_student = sum(p.numel() for p in module.model.parameters())
    assert sum(p.numel() for p in module.parameters()) == n_student
    assert module.hparams["distill"]["weight"] == 0.5
    with pytest.raises(UserError, match="is a mlm model but this run trains clm"):
        ProteinLMModule(
            {**SHAPE, "objective": "clm"}, None, {"teacher": str(teacher_dir), "weight": 0.5}
        )


def test_distillation_pulls_favor_student_toward_teacher(teacher_dir) -> None:
    """With weight 1 the objective is the KL alone; a real Trainer fitting one batch must drive
    it down from the swap's starting value (a deterministic, seeded descent)."""
    pl.seed_everything(0)
    module = _student(teacher_dir, "favor", weight=1.0)
    batch = _batch(1)
    with torch.no_grad():
        student = module.model(batch["tokens"], padding_mask=batch["padding_mask"]).logits
        teacher = module._teacher(batch["tokens"], padding_mask=batch["padding_mask"]).logits
    before = distill_kl(student, teacher, batch["padding_mask"], 1.0).item()
    assert before > 1e-3  # the swap really changed the function
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader([batch] * 30, batch_size=None))
    assert math.isfinite(trainer.callback_metrics["train/distill_kl"].item())
    with torch.no_grad():
        student = module.model(batch["tokens"], padding_mask=batch["padding_mask"]).logits
    after = distill_kl(student, teacher, batch["padding_mask"], 1.0).item()
    assert after < 0.5 * before


def test_finetune_experiment_with_distillation_through_hydra(teacher_dir, tmp_path) -> None:
    """``experiment=esm_favor_finetune`` + ``model.distill.weight``: the documented recovery path,
    composed by Hydra and run by ``train(cfg)``; the teacher defaults to ``init_from``."""
    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import train

    repo = REPO
    cfg = compose_config(
        [
            "experiment=esm_favor_finetune",
            f"init_from={teacher_dir}",
            "model.distill.weight=0.5",
            *(f"model.config.{k}={v}" for k, v in SHAPE.items()),
            "model.config.token_dropout=false",
            f"data.path=[{repo / 'protein_performer' / 'data' / 'demo' / 'train.fasta'}]",
            "data.limit_records=400",
            "data.max_len=64",
            "data.max_tokens=512",
            "data.num_workers=0",
            "trainer=cpu",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=1",
            "callbacks.progress_bar=null",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
        ],
        output_dir=tmp_path,
    )
    assert cfg.model.distill.teacher == str(teacher_dir)
    result = train(cfg)
    metrics = result["metrics"]
    for key in ("train/loss", "train/task_loss", "train/distill_kl", "val/ppl"):
        assert math.isfinite(metrics[key]), key
    # The logged loss is the documented mix of its two logged parts (same step).
    mix = 0.5 * metrics["train/task_loss"] + 0.5 * metrics["train/distill_kl"]
    assert metrics["train/loss"] == pytest.approx(mix, rel=1e-5)
    ckpt = torch.load(result["last_checkpoint"], map_location="cpu", weights_only=False)
    assert not any("teacher" in k for k in ckpt["state_dict"])
    assert ckpt["hyper_parameters"]["distill"]["weight"] == 0.5
