"""Hydra values are checked per config group before anything is built
(protein_performer.training.settings): one line naming the key, documented sentinels kept."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from protein_performer.errors import UserError
from protein_performer.training.compose import compose_config
from protein_performer.training.settings import check_training_config
from tests.paths import REPO

BASE = ["experiment=demo", f"paths.root_dir={REPO}"]

BAD = [
    ("data.max_tokens=-1", "data.max_tokens=-1"),
    ("data.max_tokens=0", "data.max_tokens=0"),
    ("data.max_batch_size=0", "data.max_batch_size=0"),
    ("data.max_len=2", "data.max_len=2"),
    ("data.mlm_prob=2", "data.mlm_prob=2"),
    ("data.mlm_prob=0", "data.mlm_prob=0"),
    ("data.valid_frac=-0.1", "data.valid_frac=-0.1"),
    ("data.num_workers=-2", "data.num_workers=-2"),
    ("data.max_tokens=lots", "data.max_tokens='lots'"),
    ("data.pin_memory=maybe", "data.pin_memory='maybe'"),
    ("data.limit_records=0", "data.limit_records=0"),
    ("data.family_memory_dropout=1.5", "data.family_memory_dropout=1.5"),
    ("model.optim.lr=-1", "model.optim.lr=-1"),
    ("model.optim.lr=nan", "model.optim.lr=nan"),
    ("model.optim.lr='1e-3'", "model.optim.lr='1e-3'"),
    ("model.optim.eps=0", "model.optim.eps=0"),
    ("model.optim.warmup_steps=-5", "model.optim.warmup_steps=-5"),
    ("model.optim.min_lr_ratio=1.5", "model.optim.min_lr_ratio=1.5"),
    ("model.optim.betas=[0.9,1.2]", "model.optim.betas=[0.9, 1.2]"),
    ("trainer.max_steps=0", "trainer.max_steps=0"),
    ("trainer.max_steps=-2", "trainer.max_steps=-2"),
    ("trainer.max_epochs=-3", "trainer.max_epochs=-3"),
    ("trainer.devices=0", "trainer.devices=0"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1"),
    ("trainer.limit_val_batches=1.5", "trainer.limit_val_batches=1.5"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0"),
    ("trainer.val_check_interval='00:00:00:00'", "trainer.val_check_interval='00:00:00:00'"),
    ("trainer.val_check_interval='2 minutes'", "trainer.val_check_interval='2 minutes'"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0"),
]


@pytest.fixture(scope="module")
def demo_cfg(tmp_path_factory: pytest.TempPathFactory):
    return compose_config(BASE, output_dir=tmp_path_factory.mktemp("run"))


@pytest.mark.parametrize(("override", "named"), BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_one_line_naming_the_key(demo_cfg, override: str, named: str) -> None:
    key, text = override.split("=", 1)
    value = float("nan") if text == "nan" else yaml.safe_load(text)
    cfg = copy.deepcopy(demo_cfg)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(UserError) as info:
        check_training_config(cfg)
    assert str(info.value).startswith(f"{named} is not valid: it must be")
    assert "\n" not in str(info.value)


def test_documented_sentinels_and_defaults_pass(tmp_path: Path) -> None:
    for experiment in ("demo", "small_mlm", "small_clm", "uniref50_mlm"):
        check_training_config(compose_config([f"experiment={experiment}"], output_dir=tmp_path))
    sentinels = ["trainer.max_steps=-1", "trainer.max_epochs=-1", "trainer.devices=-1"]
    more = ["model.optim.lr=0", "trainer.devices=[0,1]", "trainer.gradient_clip_val=null"]
    more.append("trainer.val_check_interval=00:00:02:00")  # Lightning's wall-clock interval
    check_training_config(compose_config([*BASE, *sentinels, *more], output_dir=tmp_path))


@pytest.mark.slow  # a training subprocess; the in-process cases above are the fast check
def test_cli_bad_value_exit_2_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "protein_performer.cli.main", "train", *BASE]
    cmd += ["data.max_tokens=-1", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: data.max_tokens=-1 is not valid: it must be an integer >= 1"
    ]
