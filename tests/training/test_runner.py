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


@pytest.mark.parametrize("how", ["paths.output_dir", "hydra.run.dir", "root"])
def test_a_file_where_the_run_goes_is_one_line(how, tmp_path, monkeypatch, capsys) -> None:
    """Hydra's NotADirectoryError traceback (exit 1) before (issue 42 #18)."""
    from protein_performer.cli.main import main

    afile = tmp_path / "afile"
    afile.write_text("mine")
    argv = ["train", "experiment=demo"]
    if how == "root":
        monkeypatch.setenv("PROTEIN_PERFORMER_ROOT", str(afile))
    else:
        argv.append(f"{how}={afile / 'run' if how == 'hydra.run.dir' else afile}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{afile} is a file, not a directory" in err[0], err
    assert afile.read_text() == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_trainer_gpu_without_a_gpu_is_one_line_before_anything_is_built(capsys) -> None:
    """Lightning's raw MisconfigurationException after 27 s before (issue 45 #7)."""
    from protein_performer.cli.main import main

    assert main(["train", "experiment=demo", "trainer=gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU torch can use: train with trainer=cpu" in err[0], err
