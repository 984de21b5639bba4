"""Training never lies or loses work: divergence stops the run, last.ckpt is the last state,
checkpoints are written atomically and read safely (protein_performer.training.checkpointing)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException
from test_ddp import torchrun
from test_train import TINY as TRAIN_TINY

from protein_performer.errors import UserError
from protein_performer.io.checkpoints import nonfinite_tensors, safe_load
from protein_performer.training.checkpointing import (
    RunCheckpoint,
    SafeCheckpointIO,
    TrainingDivergedError,
    last_checkpoint,
)
from protein_performer.training.compose import compose_config
from protein_performer.training.train import train

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


@pytest.mark.slow  # a training subprocess; the in-process divergence tests are the fast check
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


# ---- The save schedule, on Lightning's public API only --------------------------------------
# A plain Lightning run (a linear model, 4 batches an epoch) with RunCheckpoint and a recording
# checkpoint I/O: the order and steps of every save pin what RunCheckpoint relies on from
# Lightning's hooks (on_validation_end before on_train_epoch_end at an epoch's end,
# trainer.is_last_batch, SIGTERMException at a batch boundary). A Lightning upgrade that moves
# any of these fails here, not silently in a user's run.


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        torch.nn.init.constant_(self.layer.weight, 1.0)  # a loss that falls: best-k improves

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 4, generator=_seeded()), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 4, generator=_seeded()), batch_size=4)


class _RecordingIO(SafeCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self.saves: list[tuple[str, int]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves.append((Path(path).name, int(checkpoint["global_step"])))
        super().save_checkpoint(checkpoint, path, storage_options)


class _SigtermAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _saves(tmp_path: Path, *callbacks: pl.Callback, ckpt: dict | None = None, **trainer):
    io = _RecordingIO()
    checkpoint = RunCheckpoint(
        dirpath=tmp_path / "checkpoints",
        filename="best-{step}",
        monitor="val/loss",
        save_last=True,
        auto_insert_metric_name=False,
        **(ckpt or {}),
    )
    options = dict(max_epochs=2, val_check_interval=1.0, num_sanity_val_steps=0)
    pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, *callbacks],
        plugins=[io],
        **{**options, **trainer},
    ).fit(_Linear())
    return io.saves, checkpoint


@pytest.mark.parametrize(
    ("trainer", "ckpt", "expected"),
    [
        # Validation at each epoch's end: the top-k save (epoch end), then last.ckpt after it.
        pytest.param({}, {}, [("best-4", 4), ("last", 4), ("best-8", 8), ("last", 8)], id="epoch"),
        # Mid-epoch validation: last.ckpt after it at once; at the end of fit once more.
        pytest.param(
            {"val_check_interval": 3, "max_epochs": 1},
            {},
            [("best-3", 3), ("last", 3), ("last", 4)],
            id="mid-epoch",
        ),
        # Every 2 steps (mid-epoch at once; at the epoch's last batch after its validation);
        # Lightning's top-k waits for the first val/loss, then saves at step 6 as it improved.
        pytest.param(
            {},
            {"every_n_train_steps": 2},
            [("last", 2), ("last", 4), ("best-6", 6), ("last", 6), ("last", 8)],
            id="steps",
        ),
        # No validation: last.ckpt at every epoch end, no best-k (no metric).
        pytest.param({"limit_val_batches": 0}, {}, [("last", 4), ("last", 8)], id="no-validation"),
    ],
)
def test_save_schedule(tmp_path: Path, trainer: dict, ckpt: dict, expected: list) -> None:
    saves, checkpoint = _saves(tmp_path, ckpt=ckpt, **trainer)
    assert [(Path(name).stem, step) for name, step in saves] == expected
    assert Path(checkpoint.last_model_path).name == "last.ckpt"
    assert _step(Path(checkpoint.last_model_path)) == expected[-1][1]


def test_sigterm_saves_last_at_the_batch_boundary(tmp_path: Path) -> None:
    # Step 6 is mid-epoch, with no validation or interval save due: only the signal saves.
    with pytest.raises(SIGTERMException):
        _saves(tmp_path, _SigtermAt(6))
    assert _step(tmp_path / "checkpoints" / "last.ckpt") == 6


def test_ckpt_path_last_is_the_newest_last_or_hpc_checkpoint(tmp_path: Path) -> None:
    _saves(tmp_path, max_epochs=1)
    run = pl.Trainer(
        default_root_dir=tmp_path, callbacks=[RunCheckpoint(dirpath=tmp_path / "checkpoints")]
    )
    ckpts = tmp_path / "checkpoints"
    assert last_checkpoint(run) == str(ckpts / "last.ckpt")
    for i, name in enumerate(["last-v1.ckpt", "../hpc_ckpt_2.ckpt", "best-9.ckpt"]):
        path = ckpts / name
        path.write_bytes(b"")
        os.utime(path, (2e9 + i, 2e9 + i))
        if name != "best-9.ckpt":
            assert last_checkpoint(run) == os.path.normpath(path)
    assert last_checkpoint(run) == os.path.normpath(ckpts / "../hpc_ckpt_2.ckpt")
    empty = pl.Trainer(default_root_dir=tmp_path / "new", callbacks=[RunCheckpoint()])
    assert last_checkpoint(empty) is None


def test_run_checkpoint_overrides_no_private_lightning_member() -> None:
    # Public API only: an override of a private ModelCheckpoint method would break silently.
    from pytorch_lightning.callbacks import ModelCheckpoint

    private = [
        name
        for name in vars(RunCheckpoint)
        if name.startswith("_") and not name.startswith("__") and hasattr(ModelCheckpoint, name)
    ]
    assert private == []


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))


def test_random_states_survive_a_safe_load(tmp_path: Path) -> None:
    """What a resumed step draws next (torch, numpy, Python) is what the saved run drew."""
    import random

    import numpy as np

    from protein_performer.training.checkpointing import rng_states, set_rng_states

    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    torch.save({"states": rng_states()}, tmp_path / "s.ckpt")
    want = (torch.rand(4), np.random.rand(4), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_states(safe_load(tmp_path / "s.ckpt")["states"])
    got = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[2] == want[2]
