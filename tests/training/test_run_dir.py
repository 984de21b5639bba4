"""A run directory keeps its history: metrics appended on resume, no silent restart of a named
run, and the top-level seed checked before anything is built (the whole SIGTERM-and-resume
history is in tests/training/test_resume.py, slow)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from protein_performer.errors import UserError
from protein_performer.training.compose import compose_config
from protein_performer.training.run_dir import RunCSVLogger, check_fresh_run_dir
from protein_performer.training.train import train
from tests.training.test_train import TINY


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_csv_logger_appends_and_replaces_rows_after_the_checkpoint(tmp_path: Path) -> None:
    first = RunCSVLogger(tmp_path, name="csv", version="")
    for step in range(5):  # steps 3 and 4 were logged after the checkpoint at step 3
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.log_metrics({"val/loss": 9.0}, step=4)
    first.save()
    resumed = RunCSVLogger(tmp_path, name="csv", version="")
    for step in range(3, 6):
        resumed.log_metrics({"train/loss": 10.0 * step, "lr": 0.1}, step=step)
    resumed.save()
    rows = _rows(tmp_path / "csv" / "metrics.csv")
    assert [(r["step"], r["train/loss"]) for r in rows] == [
        ("0", "0.0"), ("1", "1.0"), ("2", "2.0"), ("3", "30.0"), ("4", "40.0"), ("5", "50.0")
    ]  # fmt: skip
    assert all(not r["val/loss"] for r in rows)  # the stale step-4 validation row is gone
    assert not list((tmp_path / "csv").glob("*.tmp"))


def _previous_run(run_dir: Path) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"old")
    (run_dir / "csv").mkdir()
    (run_dir / "csv" / "metrics.csv").write_text("step,train/loss\n0,1.0\n")


def test_relaunch_without_ckpt_path_is_refused(tmp_path: Path) -> None:
    _previous_run(tmp_path)
    cfg = compose_config([*TINY, "trainer.max_steps=1"], output_dir=tmp_path)
    with pytest.raises(UserError, match=r"already holds a run .*ckpt_path=last.*overwrite=true"):
        train(cfg)
    assert (tmp_path / "checkpoints" / "last.ckpt").read_bytes() == b"old"
    assert (tmp_path / "csv" / "metrics.csv").read_text().startswith("step,train/loss")


def test_overwrite_moves_the_previous_run_aside(tmp_path: Path) -> None:
    _previous_run(tmp_path)
    check_fresh_run_dir(tmp_path, overwrite=True)
    (aside,) = tmp_path.glob("replaced-*")
    assert (aside / "checkpoints" / "last.ckpt").read_bytes() == b"old"
    assert (aside / "csv" / "metrics.csv").is_file()
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "csv" / "metrics.csv").exists()
    check_fresh_run_dir(tmp_path, overwrite=False)  # now clean: accepted


def test_an_empty_run_dir_is_a_fresh_run(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()  # what Hydra writes before the run starts
    (tmp_path / "checkpoints").mkdir()  # no checkpoint in it
    check_fresh_run_dir(tmp_path, overwrite=False)


@pytest.mark.parametrize("seed", ["-1", "4294967296", "abc", "1.5"])
def test_bad_seed_is_one_line(tmp_path: Path, seed: str) -> None:
    cfg = compose_config([*TINY, f"seed={seed}"], output_dir=tmp_path)
    with pytest.raises(UserError, match=r"^seed=.* is not valid: it must be an integer >= 0 "):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_an_unused_run_directory_is_removed_and_a_used_one_kept(tmp_path) -> None:
    """Issue 45 #11: Hydra's files, the log and empty folders make an unused run directory
    (removed with the empty folders above it); any other file keeps it."""
    from protein_performer.training.run_dir import remove_unused_run_dir

    def made(name: str) -> Path:
        run = tmp_path / "outputs" / "demo" / name
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("a: 1\n")
        (run / "demo.log").write_text("started\n")
        (run / "csv").mkdir()
        return run

    kept = made("mine")
    (kept / "notes.txt").write_text("mine\n")
    assert not remove_unused_run_dir(kept, "demo.log") and (kept / "notes.txt").is_file()
    ckpt = made("trained")
    (ckpt / "checkpoints").mkdir()
    (ckpt / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert not remove_unused_run_dir(ckpt, "demo.log")
    unused = made("failed")
    assert remove_unused_run_dir(unused, "demo.log") and not unused.exists()
    assert (tmp_path / "outputs" / "demo").is_dir()  # still holds the other runs
    for run in (kept, ckpt):
        shutil.rmtree(run)
    assert remove_unused_run_dir(made("again"), "demo.log")
    assert not (tmp_path / "outputs").exists()  # outputs/demo/ and outputs/ were left empty
