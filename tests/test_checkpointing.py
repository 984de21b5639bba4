"""Training never lies or loses work: divergence stops the run, last.ckpt is the last state,
checkpoints are written atomically and read safely (protein_performer.training.checkpointing)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from test_ddp import torchrun
from test_train import TINY as TRAIN_TINY

from protein_performer.errors import UserError
from protein_performer.io.checkpoints import nonfinite_tensors, safe_load
from protein_performer.training.checkpointing import TrainingDivergedError
from protein_performer.training.compose import compose_config
from protein_performer.training.train import train

REPO = Path(__file__).resolve().parents[1]

# test_train's tiny model and data, validating on one batch, stopped by steps only.
TINY = [*TRAIN_TINY, "trainer.limit_val_batches=1", "trainer.max_epochs=-1"]
DIVERGE = ["model.optim.lr=1e12", "model.optim.warmup_steps=0", "trainer.gradient_clip_val=null"]


def _train(out: Path, *overrides: str) -> dict:
    return train(compose_config([*TINY, *overrides], output_dir=out))


def _step(path: Path) -> int:
    return int(safe_load(path)["global_step"])


def test_last_ckpt_is_the_last_state_even_when_the_metric_never_improves(tmp_path: Path) -> None:
    # lr=0: val/loss is the same at every validation, so no top-k checkpoint after the first;
    # last.ckpt must still follow every validation and the end of fit (step 10, not 8).
    result = _train(
        tmp_path, "model.optim.lr=0", "trainer.max_steps=10", "trainer.val_check_interval=4"
    )
    last = Path(result["last_checkpoint"])
    assert last == tmp_path / "checkpoints" / "last.ckpt"
    assert _step(last) == 10
    assert _step(Path(result["best_checkpoint"])) == 4
    assert not [p for p in last.parent.iterdir() if p.name.startswith(".")]  # no temporaries


def test_divergence_stops_the_run_and_saves_nothing_non_finite(tmp_path: Path) -> None:
    with pytest.raises(TrainingDivergedError) as info:
        _train(tmp_path, *DIVERGE, "trainer.max_steps=30", "trainer.val_check_interval=2")
    message = str(info.value)
    assert "\n" not in message
    assert "training stopped at step" in message and "is nan" in message
    assert "last finite train/loss" in message and "gradient_clip_val=1.0" in message
    for ckpt in (tmp_path / "checkpoints").glob("*.ckpt"):
        assert not nonfinite_tensors(safe_load(ckpt)["state_dict"]), ckpt


class PoisonAtEpochEnd(pl.Callback):
    """NaN weights with no loss computed after them: only the save-time check can see them."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        with torch.no_grad():
            pl_module.model.lm_head.bias.fill_(float("inf"))


def test_non_finite_weights_are_never_written(tmp_path: Path) -> None:
    target = f"{PoisonAtEpochEnd.__module__}.{PoisonAtEpochEnd.__qualname__}"
    with pytest.raises(TrainingDivergedError, match="weights are not finite.*not writing"):
        _train(
            tmp_path,
            "trainer.limit_val_batches=0",
            "trainer.limit_train_batches=2",
            "trainer.max_steps=-1",
            "trainer.max_epochs=1",
            f"+callbacks.poison._target_={target}",
        )
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob(".*.tmp"))


def test_validation_nan_is_not_dropped() -> None:
    from protein_performer.training.lit_module import ProteinLMModule

    module = ProteinLMModule({"dim": 16, "depth": 1, "heads": 2, "ff_dim": 32, "nb_features": 8})
    module.eval_nll.update(torch.tensor([1.0, float("nan")]))
    module.eval_tokens.update(torch.tensor(2.0))
    assert math.isnan(float(module.eval_nll.compute()))


class _Payload:
    """A pickle that runs code when loaded (what a malicious checkpoint carries)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_never_unpickles_code_even_with_the_torch_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": _Payload(marker)}, evil)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UserError, match="other than tensors.*refusing to load"):
        _train(tmp_path / "run", "trainer.max_steps=2", f"ckpt_path={evil}")
    assert not marker.exists()
    truncated = tmp_path / "cut.ckpt"
    truncated.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(UserError, match="truncated or damaged"):
        _train(tmp_path / "run2", "trainer.max_steps=2", f"ckpt_path={truncated}")


def test_cli_divergence_is_one_error_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "protein_performer.cli.main", "train", *TINY, *DIVERGE]
    cmd += ["trainer.max_steps=20", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training stopped at step" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout


class PoisonRank(pl.Callback):
    """From optimizer step ``step`` on, rank ``rank`` alone computes a NaN loss (a NaN row in its
    embedding): the other rank's loss stays finite, and must stop all the same."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.embed_tokens.weight[4:].fill_(float("nan"))


def ddp_worker(out_dir: Path) -> None:
    from protein_performer.training.train import main

    sys.argv = [
        "train", *TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
        "trainer.precision=32-true", "trainer.max_steps=20", "trainer.val_check_interval=2",
        f"hydra.run.dir={out_dir / 'run'}", f"+callbacks.poison._target_={__name__}.PoisonRank",
        "+callbacks.poison.rank=1", "+callbacks.poison.step=3",
    ]  # fmt: skip
    main()


@pytest.mark.slow
def test_ddp_ranks_stop_together_on_one_ranks_nan(tmp_path: Path) -> None:
    proc = torchrun(__file__, tmp_path, timeout=300)  # a hang would be a rank left waiting
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    # Rank 0 prints; its own loss was finite, rank 1's was not.
    assert "training stopped at step 3: train/loss is not finite on another rank" in errors[0]
    ckpts = list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert ckpts and all(not nonfinite_tensors(safe_load(c)["state_dict"]) for c in ckpts)
    assert max(_step(c) for c in ckpts) == 2


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))
