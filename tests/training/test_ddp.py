"""DDP with 2 CPU processes (gloo), launched by torchrun like a real multi-GPU job.

Checks the two promises data parallelism rests on here: every rank holds the same ω after a
redraw without any broadcast (``trainer=ddp`` turns buffer broadcasting off), and the ranks'
batches are disjoint. Each rank records what it saw to files that the test then compares.

Run as a script, this file is the per-rank worker: ``python tests/training/test_ddp.py OUT_DIR``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from tests.paths import REPO

REDRAW_SEED = 7
INTERVAL = 2
STEPS = 5


class DDPProbe(pl.Callback):
    """Records, per optimizer step, this rank's record ids and ω (after that step's redraw:
    it is added after FeatureRedraw, and callbacks run in order)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        omega = [layer.self_attn.core.omega.detach().clone() for layer in pl_module.model.layers]
        self.steps.append({"step": trainer.global_step, "ids": list(batch["ids"]), "omega": omega})

    def on_fit_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        ddp_kwargs = getattr(strategy, "_ddp_kwargs", {})
        info = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(strategy).__name__,
            "broadcast_buffers": ddp_kwargs.get("broadcast_buffers", True),
            "steps": self.steps,
        }
        torch.save(info, self.out_dir / f"rank{trainer.global_rank}.pt")


def worker(out_dir: Path) -> None:
    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import train

    rank = int(os.environ["RANK"])
    overrides = [
        "experiment=demo",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        f"trainer.max_steps={STEPS}",
        "trainer.limit_val_batches=1",
        f"trainer.val_check_interval={STEPS}",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "logger=csv",
        # Different global seeds per rank: initial weights and ω differ, so equal ω after a
        # redraw can only come from the (seed, step)-seeded redraw, not from equal init.
        f"seed={100 + rank}",
        "data.seed=0",
        f"callbacks.feature_redraw.seed={REDRAW_SEED}",
        f"model.config.feature_redraw_interval={INTERVAL}",
        "model.config.dim=32",
        "model.config.depth=2",
        "model.config.heads=2",
        "model.config.ff_dim=64",
        "model.config.nb_features=16",
        "data.limit_records=200",
        "data.max_len=128",
        "data.max_tokens=1024",
        "data.num_workers=0",
        f"+callbacks.probe._target_={__name__}.DDPProbe",
        f"+callbacks.probe.out_dir={out_dir}",
    ]
    train(compose_config(overrides, output_dir=out_dir / "run"))


def torchrun(script: str, out_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``script OUT_DIR`` on 2 CPU ranks under torchrun, as a real multi-GPU job is launched."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        script, str(out_dir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # The script's own callbacks are __main__'s there: trusted as the test module is here.
    env["PROTEIN_PERFORMER_EXTRA_TARGETS"] = "__main__"
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_ddp_two_cpu_ranks(tmp_path: Path) -> None:
    proc = torchrun(__file__, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["strategy"] == "DDPStrategy" for r in ranks)
    assert not any(r["broadcast_buffers"] for r in ranks)  # ω equality is not DDP's doing
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert [s["step"] for s in steps0] == [s["step"] for s in steps1] == list(range(STEPS))

    # Identical ω on both ranks at every step, equal to the (seed, step) redraw.
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM
    from protein_performer.training.callbacks import redraw_generator

    reference = PerformerLM(PerformerConfig(dim=32, depth=2, heads=2, ff_dim=64, nb_features=16))
    for a, b in zip(steps0, steps1, strict=True):
        for wa, wb in zip(a["omega"], b["omega"], strict=True):
            assert torch.equal(wa, wb), f"ω differs between ranks at step {a['step']}"
        drawn_at = a["step"] - a["step"] % INTERVAL
        reference.redraw_features(generator=redraw_generator(REDRAW_SEED, drawn_at))
        expected = [layer.self_attn.core.omega for layer in reference.layers]
        for got, want in zip(a["omega"], expected, strict=True):
            assert torch.equal(got, want), f"step {a['step']}: not the redraw of step {drawn_at}"
    assert not torch.equal(steps0[0]["omega"][0], steps0[INTERVAL]["omega"][0])  # it redrew

    # Disjoint data: no record id on both ranks, and every rank got real batches.
    ids0 = {i for s in steps0 for i in s["ids"]}
    ids1 = {i for s in steps1 for i in s["ids"]}
    assert ids0 and ids1
    assert not ids0 & ids1, f"records seen by both ranks: {sorted(ids0 & ids1)[:5]}"


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
