"""The real Hydra config composed with tiny overrides, run through ``train(cfg)`` and the CLI."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.training.compose import compose_config
from protein_performer.training.train import train
from tests.paths import REPO

#: A ~10k-parameter model on the first 120 demo records: wiring, not learning.
TINY = [
    "experiment=demo",
    f"paths.root_dir={REPO}",
    "model.config.dim=32",
    "model.config.depth=1",
    "model.config.heads=2",
    "model.config.ff_dim=64",
    "model.config.nb_features=16",
    "data.limit_records=120",
    "data.max_len=128",
    "data.max_tokens=1024",
    "data.num_workers=0",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


def tiny_cfg(tmp_path: Path, *overrides: str):
    return compose_config([*TINY, *overrides], output_dir=tmp_path)


@pytest.mark.parametrize("attention", ["favor", "exact"])
@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_fast_dev_run(tmp_path: Path, objective: str, attention: str) -> None:
    cfg = tiny_cfg(
        tmp_path, "debug=fdr", f"data.objective={objective}", f"model.config.attention={attention}"
    )
    assert cfg.model.config.objective == objective  # the model follows the data's objective
    result = train(cfg)
    m = result["metrics"]
    for key in ("train/loss", "val/loss", "val/ppl", "val/acc"):
        assert math.isfinite(m[key]), key
    assert m["val/ppl"] == pytest.approx(math.exp(m["val/loss"]), rel=1e-4)
    assert 0.0 <= m["val/acc"] <= 1.0
    # Untrained: cross-entropy near log(vocab), far from 0.
    assert 2.0 < m["val/loss"] < 5.0
    assert result["curve"] is not None and Path(result["curve"]).is_file()


def test_bf16_checkpointing_and_accumulation(tmp_path: Path) -> None:
    # The GPU recipe's switches, on CPU: bf16 autocast, activation checkpointing, accumulation.
    cfg = tiny_cfg(
        tmp_path,
        "trainer.precision=bf16-mixed",
        "model.config.gradient_checkpointing=true",
        "trainer.accumulate_grad_batches=2",
        "trainer.max_steps=2",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
    )
    result = train(cfg)
    assert math.isfinite(result["metrics"]["train/loss"])
    assert math.isfinite(result["metrics"]["val/loss"])
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [s for s, _ in curve["train/loss"]] == [1, 2]  # 4 batches made 2 optimizer steps


def test_short_run_writes_checkpoints_metrics_and_tests(tmp_path: Path) -> None:
    cfg = tiny_cfg(
        tmp_path,
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.log_every_n_steps=1",
        "test=true",
    )
    result = train(cfg)
    assert math.isfinite(result["metrics"]["test/loss"])
    best, last = Path(result["best_checkpoint"]), Path(result["last_checkpoint"])
    assert best.is_file() and last.name == "last.ckpt" and last.is_file()
    assert best.parent == tmp_path / "checkpoints"

    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4
    assert ckpt["performer_config"]["dim"] == 32
    assert ckpt["performer_config"]["objective"] == "mlm"
    assert ckpt["hyper_parameters"]["config"]["dim"] == 32
    # Inference's route: the model back from the checkpoint alone, strictly, omega included.
    model = PerformerLM(PerformerConfig.from_dict(ckpt["performer_config"]))
    state = {k[6:]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state, strict=True)
    assert any(k.endswith("omega") for k in state)

    with open(tmp_path / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {"train/loss", "val/loss", "val/ppl", "val/acc", "lr-AdamW/decay"} <= set(rows[0])
    assert sum(1 for r in rows if r["train/loss"]) == 4
    assert sum(1 for r in rows if r["val/loss"]) == 2  # validated at steps 2 and 4
    assert Path(result["curve"]).is_file()
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [s for s, _ in curve["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in curve["val/loss"]] == [2, 4]
    logged = [float(r["val/loss"]) for r in rows if r["val/loss"]]
    assert [v for _, v in curve["val/loss"]] == pytest.approx(logged, rel=1e-6)


@pytest.mark.slow  # the default suite's time budget (make test <= 2 min)
def test_wandb_logger_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_cfg(
        tmp_path,
        "logger=wandb",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.val_check_interval=2",
    )
    try:
        result = train(cfg)
    finally:
        wandb.finish()
    assert math.isfinite(result["metrics"]["val/loss"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, f"no offline wandb run under {tmp_path / 'wandb'}"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "protein-performer"
    fallback = [sys.executable, "-m", "protein_performer.cli.main"]
    cmd = [str(script)] if script.exists() else fallback
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def test_cli_bad_override_is_a_clear_error(tmp_path: Path) -> None:
    proc = _cli("train", "experiment=demo", "trainer.no_such_key=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error:"), proc.stderr
    assert "trainer.no_such_key" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "outputs").exists()  # rejected before Hydra made a run directory


def test_launch_failing_before_training_leaves_no_run_directory(tmp_path: Path) -> None:
    """Issue 45 #11: a launch that fails after Hydra made ``outputs/<task>/<time>/`` (here: a
    data path that does not exist) removes it (test_run_dir: what is kept)."""
    proc = _cli("train", "experiment=demo", "data.path=missing.fasta", cwd=tmp_path)
    assert proc.returncode == 2 and "missing.fasta" in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))


@pytest.mark.slow  # a training subprocess; test_cli_bad_override_is_a_clear_error is fast
def test_cli_error_inside_the_run_is_a_clear_error(tmp_path: Path) -> None:
    # Raised inside the Hydra task (after Hydra made the run directory), not at composition.
    missing = tmp_path / "nope.ckpt"
    proc = _cli(
        "train",
        "experiment=demo",
        f"ckpt_path={missing}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    # Hydra made the run directory; a launch that fails before training removes it (0.6.0).
    assert not (tmp_path / "run").exists()


def test_cli_help_lists_experiments() -> None:
    proc = _cli("train", "--help", cwd=REPO)
    assert proc.returncode == 0
    for name in ("demo", "small_mlm", "small_clm", "uniref50_mlm"):
        assert name in proc.stdout


def test_every_experiment_composes(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    for path in sorted((REPO / "protein_performer" / "conf" / "experiment").glob("*.yaml")):
        cfg = compose_config([f"experiment={path.stem}"], output_dir=tmp_path)
        body = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        resolved = OmegaConf.to_container(body, resolve=True, throw_on_missing=False)
        PerformerConfig.from_dict(resolved["model"]["config"])  # valid architecture
        assert resolved["model"]["config"]["objective"] == resolved["data"]["objective"]
        assert resolved["trainer"]["use_distributed_sampler"] is False


def test_instantiation_errors_name_the_config_key(tmp_path: Path) -> None:
    from protein_performer.errors import UserError

    with pytest.raises(UserError, match="cannot build `trainer`"):
        train(tiny_cfg(tmp_path, "trainer.precision=bogus"))
    # Our own constructors' UserErrors pass through with their message.
    with pytest.raises(UserError, match="divisible"):
        train(tiny_cfg(tmp_path, "model.config.heads=3"))
    with pytest.raises(UserError, match="ckpt_path"):
        train(tiny_cfg(tmp_path, f"ckpt_path={tmp_path / 'missing.ckpt'}"))
    # A fine-tune experiment without weights stops before building anything (it would otherwise
    # train from random weights).
    finetune = compose_config(["experiment=esm_favor_finetune"], output_dir=tmp_path)
    with pytest.raises(UserError, match="add init_from=PATH"):
        train(finetune)


def test_conf_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from protein_performer.errors import UserError
    from protein_performer.training.compose import conf_dir

    copy = tmp_path / "conf"
    shutil.copytree(REPO / "protein_performer" / "conf", copy)
    (copy / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ntask_name: mine\n", encoding="utf-8"
    )
    monkeypatch.setenv("PROTEIN_PERFORMER_CONF_DIR", str(copy))
    assert conf_dir() == copy.resolve()
    assert compose_config(["experiment=mine"]).task_name == "mine"
    monkeypatch.setenv("PROTEIN_PERFORMER_CONF_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="PROTEIN_PERFORMER_CONF_DIR"):
        conf_dir()


@pytest.mark.slow  # a training subprocess; test_wandb_logger_offline runs the logger in-process
def test_wandb_without_an_account_is_one_error_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    argv = [*TINY, "logger=wandb", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "protein_performer.cli.main", "train", *argv],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1
        and "logger=wandb failed" in errors[0]
        and "WANDB_MODE=offline" in errors[0]
    )
    assert "Traceback" not in proc.stderr


def test_train_records_the_family_row_length_as_context_tokens(tmp_path: Path) -> None:
    """``lm.context()`` defaults to what training read: train() copies data.family_max_tokens
    into model.config.context_tokens for family rows; an explicit value and single rows keep
    theirs."""
    from protein_performer.training.train import _record_context_tokens

    def recorded(*overrides: str) -> object:
        cfg = compose_config([*overrides, f"data.path={tmp_path}"], output_dir=tmp_path)
        _record_context_tokens(cfg)
        return cfg.model.config.get("context_tokens")

    assert recorded("experiment=family_clm", "data.family_max_tokens=2048") == 2048
    assert recorded("experiment=family_clm", "model.config.context_tokens=512") == 512
    assert recorded("experiment=small_clm") is None

    def keyed(*overrides: str) -> object:
        cfg = compose_config([*overrides, f"data.path={tmp_path}"], output_dir=tmp_path)
        _record_context_tokens(cfg)
        return cfg.model.config.get("family_coordinates")

    # ... and what its homologs were keyed by, which a context then reads them by (issue 41)
    assert keyed("experiment=family_clm", "data.family_coordinates=aligned") == "aligned"
    assert keyed("experiment=family_clm") == "positions"
