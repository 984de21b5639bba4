"""inference.sharding: embed resumes after kill -9, and torchrun ranks merge into one file.

Real processes throughout: the CLI in a subprocess killed with SIGKILL while it writes parts,
and ``torch.distributed.run`` with 2 gloo ranks, compared with one process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.contacts.map_columns import read_contacts
from protein_performer.data.tokenizer import STANDARD_AA
from protein_performer.interop.export import export_model
from protein_performer.interop.identity import model_identity
from protein_performer.interop.loading import load_model
from protein_performer.io.sharding import finished_parts, parts_dir, windows
from protein_performer.jobs.embeddings_file import read_embeddings
from protein_performer.model.contact_head import ContactRegression
from tests.inference.test_embedding import tiny_loaded

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "protein_performer.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def write_fasta(path: Path, n: int, seed: int = 0, start: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    ids = [f"p{start + i}" for i in range(n)]
    with path.open("w") as fh:
        for rid in ids:
            seq = "".join(rng.choice(list(STANDARD_AA), size=int(rng.integers(20, 60))))
            fh.write(f">{rid} made up\n{seq}\n")
    return ids


def ids_of(path: Path) -> list[str]:
    with h5py.File(path) as h5:
        return [x.decode() for x in h5["ids"][:]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model(tiny_loaded("mlm"), tmp_path_factory.mktemp("shard") / "model")


def test_windows_follow_the_token_budget() -> None:
    items = ["A" * 30] * 10  # 32 tokens each; budget 32 * 3 = 96 tokens -> 3 per window
    got = list(windows(items, 3))
    assert [len(w) for w in got] == [3, 3, 3, 1]
    assert [x for w in got for x in w] == items


@pytest.mark.slow  # kill -9 loop on a subprocess
def test_resume_after_kill_equals_an_uninterrupted_run(
    model: Path, tmp_path: Path, capsys
) -> None:
    fasta = tmp_path / "in.fasta"
    ids = write_fasta(fasta, 400)
    out = tmp_path / "emb.h5"
    args = [str(model), str(fasta), str(out), "--toks-per-batch", "4", "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "protein_performer.cli.main", "embed", *args],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    while len(finished_parts(parts_dir(out))) < 3 and proc.poll() is None:
        assert time.time() < deadline, "no parts appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not out.exists()
    finished = len(finished_parts(parts_dir(out)))

    capsys.readouterr()
    assert main(["embed", *args]) == 2  # without --resume: refused, parts kept
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume" in err
    assert len(finished_parts(parts_dir(out))) == finished
    kept = sum(len(ids_of(p)) for p in finished_parts(parts_dir(out)))
    assert 0 < kept < len(ids)

    assert main(["embed", *args, "--resume"]) == 0
    said = capsys.readouterr().out
    assert f"embedded {len(ids) - kept} record(s)" in said and f", {kept} already there" in said
    assert not parts_dir(out).exists()
    assert ids_of(out) == ids

    whole = tmp_path / "whole.h5"
    assert main(["embed", str(model), str(fasta), str(whole), "--no-progress"]) == 0
    (ids, got), (want_ids, want) = read_embeddings(out), read_embeddings(whole)
    assert ids == want_ids
    np.testing.assert_allclose(got, want, atol=1e-6)

    # A grown input: --resume adds only the new records, at the end.
    more = tmp_path / "more.fasta"
    extra = write_fasta(tmp_path / "extra.fasta", 5, seed=1, start=5000)
    more.write_text(fasta.read_text() + (tmp_path / "extra.fasta").read_text())
    capsys.readouterr()
    assert main(["embed", str(model), str(more), str(out), "--resume", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "embedded 5 record(s)" in said and f", {len(ids)} already there" in said
    assert ids_of(out) == ids + extra


def test_resume_refuses_another_model_or_options(model: Path, tmp_path: Path, capsys) -> None:
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 5)
    out = tmp_path / "emb.h5"
    assert main(["embed", str(model), str(fasta), str(out), "--no-progress"]) == 0
    other = export_model(tiny_loaded("mlm", seed=1), tmp_path / "other")
    for argv, what in (
        ([str(other), str(fasta), str(out), "--resume"], "other model weights"),
        ([str(model), str(fasta), str(out), "--resume", "--include", "bos"], "other include"),
        ([str(model), str(fasta), str(out), "--resume", "--precision", "bf16"], "other precision"),
    ):
        capsys.readouterr()
        assert main(["embed", *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --resume") and what in err


def test_resume_into_a_finished_file_checks_sequences(model: Path, tmp_path: Path, capsys) -> None:
    """Same ids, same lengths, other residues: the finished file's vectors are stale."""
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 5)
    out = tmp_path / "emb.h5"
    assert main(["embed", str(model), str(fasta), str(out), "--no-progress"]) == 0
    lines = fasta.read_text().splitlines()
    lines[3] = lines[3][::-1]  # the second record, reversed
    changed = tmp_path / "changed.fasta"
    changed.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["embed", str(model), str(changed), str(out), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "with another sequence than" in err, err
    assert main(["embed", str(model), str(fasta), str(out), "--resume", "--no-progress"]) == 0
    assert "embedded 0 record(s)" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 2 torchrun ranks per command
@pytest.mark.parametrize("command", ["embed", "score", "contacts predict"])
def test_two_torchrun_ranks_equal_one_process(model: Path, tmp_path: Path, command: str) -> None:
    fasta = tmp_path / "in.fasta"
    ids = write_fasta(fasta, 120 if command == "embed" else 24)  # pseudo-ppl: L passes each
    suffix = ".csv" if command == "score" else ".h5"
    one, two = tmp_path / f"one{suffix}", tmp_path / f"two{suffix}"
    common = [str(model), str(fasta)]
    opts = ["--toks-per-batch", "16" if command == "embed" else "4", "--no-progress"]
    if command == "contacts predict":  # a regression over the tiny model's 2 x 2 heads
        loaded = load_model(model, "cpu")
        reg = ContactRegression(
            np.array([0.5, -1.0, 2.0, 0.1]), -1.0, [1, 2], [0, 1], **model_identity(loaded)
        )
        opts = [
            "--regression",
            str(reg.save(tmp_path / "reg.json")),
            "--dense-max-length",
            "40",
            "--no-progress",
        ]
    assert cli(*command.split(), *common, str(one), *opts).returncode == 0
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "protein_performer.cli.main", *command.split(), *common, str(two), *opts,
    ]  # fmt: skip
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not parts_dir(two).exists()
    if command == "score":
        a, b = one.read_text().splitlines(), two.read_text().splitlines()
        assert [r.split(",")[0] for r in b[1:]] == ids
        for x, y in zip(a[1:], b[1:], strict=True):
            np.testing.assert_allclose(
                [float(v) for v in x.split(",")[1:]],
                [float(v) for v in y.split(",")[1:]],
                atol=2e-6,
            )
        return
    assert ids_of(two) == ids_of(one) == ids
    if command == "contacts predict":
        a, b = read_contacts(one), read_contacts(two)
        assert list(a) == list(b) == ids
        for rid in ids:
            for field in ("dense", "i", "j", "p"):
                x, y = getattr(a[rid], field), getattr(b[rid], field)
                assert (x is None) == (y is None)
                if x is not None:
                    np.testing.assert_allclose(x, y, atol=1e-3)  # float16 values
        return
    (ids, got), (want_ids, want) = read_embeddings(two), read_embeddings(one)
    assert ids == want_ids
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_sharded_outputs_in_a_missing_directory_are_one_error_line(
    model: Path, tmp_path: Path, capsys
) -> None:
    fasta = tmp_path / "in.fasta"
    write_fasta(fasta, 3)
    for command, name in (("embed", "e.h5"), ("score", "s.csv")):
        capsys.readouterr()
        out = tmp_path / "missing" / name
        assert main([command, str(model), str(fasta), str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not exist; create it first" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta"]
