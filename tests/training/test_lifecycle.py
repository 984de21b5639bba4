"""A training run and its helper processes (issue 45 #2): a scheduler's stop of the whole
process group saves ``last.ckpt`` (inherited lock descriptors: the fork rule of io/atomic)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import pytorch_lightning as pl

from tests.paths import REPO


class GroupSignalAt(pl.Callback):
    """SIGTERM to the whole process group after optimizer step ``step``, as ``kill -- -PGID``,
    ``scancel`` and ``docker stop`` send it, in the order that broke: the DataLoader workers get
    it first, the main process ``delay`` seconds later (by then it has fetched the batches the
    workers had ready, so a dead worker would fail its next fetch)."""

    def __init__(self, step: int, delay: float = 3.0) -> None:
        self.step, self.delay = step, delay

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(os.getpgid(0), signal.SIGTERM)  # the workers (the main one ignores it now)
        signal.signal(signal.SIGTERM, handler)
        main = os.getpid()
        threading.Timer(self.delay, os.kill, (main, signal.SIGTERM)).start()


@pytest.mark.slow
def test_sigterm_to_the_whole_group_saves_last_and_exits_143(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "protein_performer.cli.main", "train", "experiment=demo",
           "model.config.dim=16", "model.config.depth=1", "model.config.heads=2",
           "model.config.ff_dim=32", "model.config.nb_features=8", "data.num_workers=2",
           "data.limit_records=200", "data.max_len=64", "data.max_tokens=512",
           "trainer.max_steps=100000", "trainer.val_check_interval=50000",
           "trainer.enable_progress_bar=false", "callbacks.progress_bar=null",
           f"+callbacks.stop._target_={__name__}.GroupSignalAt", "+callbacks.stop.step=3",
           "run_name=job", f"paths.root_dir={tmp_path}"]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO)]),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          start_new_session=True)  # fmt: skip
    err = proc.stdout + proc.stderr  # Hydra's console log goes to stdout
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    last = tmp_path / "outputs" / "demo" / "job" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    stops = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 1, err[-3000:]
