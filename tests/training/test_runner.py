"""The run skeleton's own choices: training's CPU threads under a (fake) load."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from protein_performer.errors import UserError
from protein_performer.io import threads
from protein_performer.training.runner import check_run, choose_threads


@pytest.fixture
def busy_machine(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """8 cores, all visible, 3 other processes running now, no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: set(range(8)))
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: len(cpus))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(threads, "running_elsewhere", lambda: 3)
    return monkeypatch


def _cfg(threads_key: int | None = None, workers: int = 0):
    return OmegaConf.create({"threads": threads_key, "data": {"num_workers": workers}})


def test_training_threads_are_the_free_cores_less_the_data_workers(busy_machine) -> None:
    line = choose_threads(_cfg(workers=2))
    assert torch.get_num_threads() == 3  # 8 cores - 3 running - 2 workers
    assert line == (
        "threads: 3 (8 core(s), less 3 other process(es) running now, less 2 data worker(s)); "
        "change with threads=N"
    )
    choose_threads(_cfg(workers=9))
    assert torch.get_num_threads() == 1  # never below one
    busy_machine.setattr(threads, "running_elsewhere", lambda: 0)
    choose_threads(OmegaConf.create({"threads": None}))  # finetune: no data.num_workers
    assert torch.get_num_threads() == 8


def test_threads_key_and_omp_num_threads_win(busy_machine) -> None:
    assert choose_threads(_cfg(threads_key=5, workers=2)) == "threads: 5 (threads=N)"
    assert torch.get_num_threads() == 5
    busy_machine.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(_cfg(workers=2)).startswith("threads: 2 (OMP_NUM_THREADS)")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5])
def test_a_bad_threads_key_is_one_error_naming_it(bad, tmp_path) -> None:
    cfg = OmegaConf.create({"threads": bad, "paths": {"output_dir": str(tmp_path)}})
    with pytest.raises(UserError, match="threads"):
        check_run(cfg)
