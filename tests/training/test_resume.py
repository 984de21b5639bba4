"""A crashed run resumed from last.ckpt ends where an unbroken run of the same seed ends."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from protein_performer.io.checkpoints import safe_load
from protein_performer.training.compose import compose_config
from protein_performer.training.train import train
from tests.paths import REPO

pytestmark = pytest.mark.slow


# 4 epochs x 4 batches = 16 optimizer steps; validation (and last.ckpt) at every epoch end;
# features redrawn every 3 steps so the resumed run must also continue the redraw stream.
BASE = [
    "experiment=demo",
    "model.config.dim=32",
    "model.config.depth=2",
    "model.config.heads=2",
    "model.config.ff_dim=64",
    "model.config.nb_features=16",
    "model.config.feature_redraw_interval=3",
    "model.optim.warmup_steps=4",
    "data.limit_records=200",
    "data.max_len=128",
    "data.max_tokens=1024",
    "data.num_workers=0",
    "trainer.max_steps=-1",
    "trainer.max_epochs=4",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2",
    "trainer.val_check_interval=1.0",
    "trainer.check_val_every_n_epoch=1",
    "trainer.log_every_n_steps=1",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
]


class SimulatedCrashError(RuntimeError):
    pass


class CrashAt(pl.Callback):
    """Dies at the start of optimizer step ``step``, like a killed job (no graceful save)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise SimulatedCrashError(f"simulated crash at step {self.step}")


def run(out: Path, *overrides: str) -> dict:
    return train(compose_config([*BASE, *overrides], output_dir=out))


def weights(ckpt_path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt_path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.parametrize(
    ("crash_step", "extra"),
    [
        pytest.param(9, [], id="epoch-boundary"),
        # last.ckpt at step 6 (epoch 1, 2 of its 4 batches done): the train loader's state
        # makes the resumed run continue with batch 3 of epoch 1.
        pytest.param(7, ["callbacks.model_checkpoint.every_n_train_steps=2"], id="mid-epoch"),
    ],
)
def test_resume_matches_unbroken_run(tmp_path: Path, crash_step: int, extra: list[str]) -> None:
    unbroken = run(tmp_path / "unbroken", *extra)

    crash_target = f"{CrashAt.__module__}.{CrashAt.__qualname__}"
    with pytest.raises(SimulatedCrashError):
        run(
            tmp_path / "crashed",
            *extra,
            f"+callbacks.crash._target_={crash_target}",
            f"+callbacks.crash.step={crash_step}",
        )
    last = tmp_path / "crashed" / "checkpoints" / "last.ckpt"
    saved_step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < saved_step < crash_step  # resumed from a point before the crash

    resumed = run(tmp_path / "resumed", *extra, f"ckpt_path={last}")

    final_a = weights(unbroken["last_checkpoint"])
    final_b = weights(resumed["last_checkpoint"])
    assert final_a.keys() == final_b.keys()
    for key in final_a:
        torch.testing.assert_close(final_b[key], final_a[key], rtol=1e-5, atol=1e-6, msg=key)
    for key in ("val/loss", "train/loss"):
        assert resumed["metrics"][key] == pytest.approx(unbroken["metrics"][key], rel=1e-5)

    # Same losses step by step after the resume point (the curve callback's record).
    def curve(run_dir: str) -> dict[int, float]:
        data = json.loads((Path(run_dir) / "training_curve.json").read_text())
        return {int(s): v for s, v in data["train/loss"]}

    a, b = curve(unbroken["output_dir"]), curve(resumed["output_dir"])
    assert max(b) == max(a) == 16
    for step in range(saved_step + 1, 17):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


class SignalAt(pl.Callback):
    """Sends ``signum`` to its own process after optimizer step ``step``."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigterm_saves_last_and_ckpt_path_last_resumes_the_same_curve(tmp_path: Path) -> None:
    unbroken = run(tmp_path / "unbroken")
    # The same command twice in one run directory (run_name), the first one preempted at step 6
    # (mid-epoch); the relaunch adds nothing but ckpt_path=last.
    cmd = [sys.executable, "-m", "protein_performer.cli.main", "train", *BASE, "run_name=job42"]
    cmd.append("ckpt_path=last")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    kill = [f"+callbacks.kill._target_={__name__}.SignalAt", "+callbacks.kill.step=6"]
    kill.append(f"+callbacks.kill.signum={int(signal.SIGTERM)}")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(REPO)])
    first = subprocess.run(
        [*cmd, *kill], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 143, first.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "demo" / "job42"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert weights_step(last) == 6
    second = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert weights_step(last) == 16

    def curve(run_dir: str | Path) -> dict[int, float]:
        data = json.loads((Path(run_dir) / "training_curve.json").read_text())
        return {int(s): v for s, v in data["train/loss"]}

    a, b = curve(unbroken["output_dir"]), curve(run_dir)
    assert sorted(b) == sorted(a) == list(range(1, 17))
    for step in range(1, 17):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step

    # metrics.csv holds the whole history, each step once (Lightning's CSVLogger deleted the
    # first launch's rows on resume), and the same rows as the unbroken run's.
    def logged(run_dir: str | Path) -> dict[int, float]:
        with open(Path(run_dir) / "csv" / "metrics.csv", newline="") as fh:
            rows = [r for r in csv.DictReader(fh) if r["train/loss"]]
        steps = [int(r["step"]) for r in rows]
        assert len(steps) == len(set(steps)), steps
        return {int(r["step"]): float(r["train/loss"]) for r in rows}

    full, resumed = logged(unbroken["output_dir"]), logged(run_dir)
    assert len(full) == 16 and sorted(resumed) == sorted(full)
    for step, value in full.items():
        assert resumed[step] == pytest.approx(value, rel=1e-5), step


def weights_step(path: Path) -> int:
    return int(safe_load(path)["global_step"])


def test_slurm_requeue_signal_checkpoint_is_found_by_ckpt_path_last(tmp_path: Path) -> None:
    # Lightning's SLURM handling: USR1 saves hpc_ckpt_1.ckpt in the run directory (then tries
    # `scontrol requeue`, absent here); the job is then killed hard. The relaunch, same
    # run_name, resumes from that checkpoint, the newest one, through ckpt_path=last.
    slurm = {
        "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "pp", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
    }  # fmt: skip
    env = {**os.environ, **slurm, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(REPO)])
    cmd = [sys.executable, "-m", "protein_performer.cli.main", "train", *BASE, "ckpt_path=last"]
    cmd += ["run_name=job4242", "trainer.max_epochs=-1", "trainer.max_steps=8"]
    signals = [
        f"+callbacks.usr1._target_={__name__}.SignalAt", "+callbacks.usr1.step=5",
        f"+callbacks.usr1.signum={int(signal.SIGUSR1)}",
        f"+callbacks.kill._target_={__name__}.SignalAt", "+callbacks.kill.step=6",
        f"+callbacks.kill.signum={int(signal.SIGKILL)}",
    ]  # fmt: skip
    first = subprocess.run(
        [*cmd, *signals], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "demo" / "job4242"
    assert weights_step(run_dir / "hpc_ckpt_1.ckpt") == 5
    assert weights_step(run_dir / "checkpoints" / "last.ckpt") == 4  # the epoch-end validation
    second = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "hpc_ckpt_1.ckpt" in second.stdout + second.stderr
    assert weights_step(run_dir / "checkpoints" / "last.ckpt") == 8
