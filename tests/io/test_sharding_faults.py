"""Resume that checks what it resumes, and ranks that fail together (issue 26, items 2, 3, 8).

Parts come from a real run stopped by an invalid record (its finished windows stay as parts,
as after a kill); the rank cases launch real processes: ``torch.distributed.run`` with 2 gloo
ranks on CPU, and srun-like ranks started by hand with ``RANK``/``WORLD_SIZE`` set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.io.ranks import Ranks
from protein_performer.io.sharding import finished_parts, parts_dir, spread
from protein_performer.jobs.embed import PART_RUN
from protein_performer.jobs.embeddings_file import SEQ_DIGESTS, read_embeddings
from tests.io.test_sharding import ENV, _free_port, write_fasta

OPTS = ["--toks-per-batch", "4", "--no-progress"]  # windows of 128 tokens: ~3 records each


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from protein_performer.interop.export import export_model
    from tests.inference.test_embedding import tiny_loaded

    return export_model(tiny_loaded("mlm"), tmp_path_factory.mktemp("resume") / "model")


def stopped_run(model: Path, fasta: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that stops at an invalid last record, leaving its finished windows as parts."""
    text = fasta.read_text()
    fasta.write_text(text + ">bad\nAC1DE\n")
    assert main(["embed", str(model), str(fasta), str(out), *OPTS]) == 2
    fasta.write_text(text)
    capsys.readouterr()
    assert len(finished_parts(parts_dir(out))) >= 3


def by_id(path: Path) -> dict[str, np.ndarray]:
    ids, values = read_embeddings(path)
    return dict(zip(ids, values, strict=True))


@pytest.mark.parametrize("case", ["changed", "truncated", "foreign", "old-version"])
def test_resume_keeps_only_parts_that_match_the_input(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    fasta, out = tmp_path / "in.fasta", tmp_path / "e.h5"
    ids = write_fasta(fasta, 12)
    stopped_run(model, fasta, out, capsys)
    parts = finished_parts(parts_dir(out))
    if case == "changed":  # same ids, two sequences changed: their parts are stale
        lines = fasta.read_text().splitlines()
        lines[1], lines[9] = lines[1][::-1] + "W", lines[9] + "W"
        fasta.write_text("\n".join(lines) + "\n")
    elif case == "truncated":
        with open(parts[1], "r+b") as fh:
            fh.truncate(parts[1].stat().st_size // 2)
    elif case == "foreign":  # a part of another run, its records not in this input
        other = tmp_path / "other"
        other.mkdir()
        write_fasta(other / "o.fasta", 12, seed=5, start=100)
        stopped_run(model, other / "o.fasta", other / "o.h5", capsys)
        shutil.copy(finished_parts(parts_dir(other / "o.h5"))[0], parts[0].with_name(
            "run0009-w000000000.h5"))  # fmt: skip
    else:  # written by the previous version: no digests, no run id
        with h5py.File(parts[0], "r+") as h5:
            del h5[SEQ_DIGESTS]
            del h5.attrs[PART_RUN]
    assert main(["embed", str(model), str(fasta), str(out), *OPTS, "--resume"]) == 0
    said = capsys.readouterr()
    assert said.err.count("resume: reused ") == 1, said.err
    expect = {
        "changed": "damaged part(s)",
        "truncated": "1 damaged part(s) set aside",
        "foreign": "of 1 part(s) dropped",
        "old-version": "of 1 part(s) dropped",
    }[case]
    assert expect in said.err, said.err
    if case == "changed":
        assert "of 0 part(s) dropped" not in said.err and "redoing 0 " not in said.err
    fresh = tmp_path / "fresh.h5"
    assert main(["embed", str(model), str(fasta), str(fresh), *OPTS]) == 0
    got, want = by_id(out), by_id(fresh)
    assert sorted(got) == sorted(want) == sorted(ids)
    for rid in ids:
        np.testing.assert_allclose(got[rid], want[rid], atol=1e-6, err_msg=rid)
    assert not parts_dir(out).exists()


def test_a_small_input_is_split_by_records_across_ranks() -> None:
    two = Ranks(0, 2)
    assert list(spread([[1, 2, 3]], two)) == [[1], [2, 3]]
    assert list(spread([[1]], two)) == [[1]]  # one record: one rank idles
    assert list(spread([[1, 2], [3]], two)) == [[1, 2], [3]]  # several windows: as they are
    assert list(spread([[1, 2, 3]], Ranks())) == [[1, 2, 3]]


def test_wait_bounds_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    from protein_performer.errors import UserError
    from protein_performer.io.sharding import INIT_TIMEOUT, INIT_TIMEOUT_ENV, _timeout

    assert _timeout(INIT_TIMEOUT_ENV, INIT_TIMEOUT) == INIT_TIMEOUT
    monkeypatch.setenv(INIT_TIMEOUT_ENV, "7.5")
    assert _timeout(INIT_TIMEOUT_ENV, INIT_TIMEOUT) == datetime.timedelta(seconds=7.5)
    monkeypatch.setenv(INIT_TIMEOUT_ENV, "soon")
    with pytest.raises(UserError, match="positive number of seconds"):
        _timeout(INIT_TIMEOUT_ENV, INIT_TIMEOUT)


def by_hand(
    argv: list[list[str]], cwd: list[Path], env: dict[str, str]
) -> list[subprocess.Popen[str]]:
    """srun-like ranks: one process per argv, RANK/WORLD_SIZE/MASTER_* set by hand."""
    port = str(_free_port())
    procs = []
    for rank, (args, where) in enumerate(zip(argv, cwd, strict=True)):
        rank_env = {**ENV, **env, "RANK": str(rank), "WORLD_SIZE": str(len(argv))}
        rank_env.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "protein_performer.cli.main", *args],
                cwd=where,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - start


@pytest.mark.slow  # srun-like ranks in subprocesses
def test_a_rank_failing_on_a_bad_checkpoint_stops_the_others(model: Path, tmp_path: Path) -> None:
    """Both ranks are given ``model`` (the same argv); on rank 1's node it is a broken file."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 40)
    good, bad = tmp_path / "node0", tmp_path / "node1"
    good.mkdir(), bad.mkdir()
    shutil.copytree(model, good / "model")
    (bad / "model").mkdir()
    (bad / "model" / "config.json").write_text("{ not json")
    args = ["embed", "model", str(fasta), str(tmp_path / "e.h5"), *OPTS]
    started = time.monotonic()
    procs = by_hand([args, args], [good, bad], {"PROTEIN_PERFORMER_INIT_TIMEOUT": "60"})
    results = [finish(p, 120) for p in procs]
    assert time.monotonic() - started < 60
    for rc, err, _ in results:
        assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, err[-2000:]
    assert "rank 1" in results[0][1], results[0][1]
    assert not (tmp_path / "e.h5").exists()


@pytest.mark.slow
def test_a_rank_that_never_starts_bounds_the_wait(model: Path, tmp_path: Path) -> None:
    """srun-like: rank 1 of 2 never comes; rank 0 stops after the init timeout, one line."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 4)
    args = ["embed", str(model), str(fasta), str(tmp_path / "e.h5"), *OPTS]
    port = str(_free_port())
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port, "PROTEIN_PERFORMER_INIT_TIMEOUT": "5"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "protein_performer.cli.main", *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    rc, err, took = finish(proc, 90)
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, err[-2000:]
    assert "did not all meet" in err and "PROTEIN_PERFORMER_INIT_TIMEOUT" in err
    assert took < 60


@pytest.mark.slow
def test_ranks_given_other_options_stop_before_any_work(model: Path, tmp_path: Path) -> None:
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 6)
    out = str(tmp_path / "e.h5")
    a = ["embed", str(model), str(fasta), out, *OPTS]
    procs = by_hand([a, [*a, "--include", "bos"]], [tmp_path, tmp_path], {})
    for proc in procs:
        rc, err, _ = finish(proc, 120)
        assert rc == 2 and err.count("error:") == 1, err[-2000:]
        assert "ranks disagree on their options" in err and "include" in err, err
    assert not parts_dir(tmp_path / "e.h5").exists() and not (tmp_path / "e.h5").exists()


@pytest.mark.slow  # torchrun, 2 gloo ranks
@pytest.mark.parametrize("records", [3, 1])
def test_torchrun_splits_a_small_input_and_an_idle_rank_says_so(
    model: Path, tmp_path: Path, records: int
) -> None:
    fasta = tmp_path / "in.fasta"
    ids = write_fasta(fasta, records)
    out = tmp_path / "e.h5"
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "protein_performer.cli.main", "embed", str(model), str(fasta), str(out),
        "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = "rank 1: embedded 2 record(s)" if records == 3 else "rank 1: no records"
    assert said in proc.stdout, proc.stdout
    assert "(0 records)" not in proc.stdout
    assert read_embeddings(out).ids == ids


@pytest.mark.slow  # torchrun, 2 gloo ranks
def test_torchrun_rank_failing_mid_run_stops_the_other(model: Path, tmp_path: Path) -> None:
    """An invalid record stops both ranks (each reads the input), each with one line; what
    torchrun's agent prints after that (its ChildFailedError report) is torchrun's."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 60)
    text = fasta.read_text().splitlines()
    text[7] = "AC1DE"  # record 4 (rank 1's first window with 3 records per window) is invalid
    fasta.write_text("\n".join(text) + "\n")
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "protein_performer.cli.main", "embed", str(model), str(fasta),
        str(tmp_path / "e.h5"), *OPTS,
    ]  # fmt: skip
    env = {**ENV, "PROTEIN_PERFORMER_INIT_TIMEOUT": "60"}
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert proc.stderr.count("error:") == 2, proc.stderr
    assert "protein_performer/" not in proc.stderr.split("ChildFailedError")[0], proc.stderr
    assert not (tmp_path / "e.h5").exists()


def test_env_is_clean_of_rank_variables() -> None:
    """The in-process tests above run as one process: no launcher variables leak in."""
    assert "RANK" not in os.environ or os.environ.get("WORLD_SIZE", "1") == "1"
