"""progress: lines, not carriage returns, when stderr is a file (training and inference)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protein_performer.io.progress import LineProgress, progress
from tests.training.test_train import TINY


def test_line_progress_prints_at_most_every_interval(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "3600")
    with progress(100, "res", "embed") as bar:  # stderr is captured: not a terminal
        assert isinstance(bar, LineProgress)
        for _ in range(100):
            bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("embed: 100%") and "100/100" in lines[0]
    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "0")
    with progress(None, "seq", "score") as bar:
        for _ in range(5):
            bar.update(2)
    lines = capsys.readouterr().err.splitlines()
    # One line per update (interval 0) and no repeat at close: the last line showed the end.
    assert len(lines) == 5 and lines[-1].startswith("score: 10seq") and "\r" not in "".join(lines)
    with progress(10, enabled=False) as bar:
        bar.update(10)
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # a training subprocess
def test_training_log_gets_lines_not_bar_redraws(tmp_path: Path) -> None:
    overrides = [o for o in TINY if "progress_bar" not in o]
    argv = [
        *overrides,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "logger=csv",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROTEIN_PERFORMER_PROGRESS_INTERVAL": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "protein_performer.cli.main", "train", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "\r" not in err
    train_lines = [line for line in err.splitlines() if line.startswith("train: step")]
    assert len(train_lines) == 6 and "train/loss" in train_lines[-1]
    assert any(
        line.startswith("val: step 3/6") and "val/loss=" in line for line in err.splitlines()
    )
    assert any(line.startswith("done: step 6/6") for line in err.splitlines())


@pytest.mark.slow  # an embedding subprocess
def test_inference_log_is_small(tmp_path: Path) -> None:
    """A whole embed run shorter than the interval leaves one progress line, its summary."""
    from protein_performer.interop.export import export_model
    from tests.inference.test_embedding import tiny_loaded

    model = export_model(tiny_loaded(), tmp_path / "m")
    fasta = tmp_path / "x.fasta"
    fasta.write_text("".join(f">r{i}\nMKTAYIAKQRQISFVKSHFSRQ\n" for i in range(50)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROTEIN_PERFORMER_PROGRESS_INTERVAL": "3600"}
    proc = subprocess.run(
        [sys.executable, "-m", "protein_performer.cli.main", "embed", str(model), str(fasta),
         str(tmp_path / "e.h5"), "--toks-per-batch", "8"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("embed")]
    assert line.startswith("embed: 100% 1.10k/1.10k")  # 50 records x 22 residues, all known
