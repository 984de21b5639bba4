"""The inference subcommands end to end through ``protein_performer.cli.main.main``."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from protein_performer.cli.main import main
from protein_performer.interop.export import export_model
from tests.inference.test_embedding import tiny_loaded
from tests.interop.test_loading import fit_checkpoint
from tests.paths import REPO

WT = "MKTAYIAKQRQISFVKSHFSRQ"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cli")
    ckpt, _ = fit_checkpoint(tmp)
    clm = export_model(tiny_loaded("clm"), tmp / "clm_export")
    fasta = tmp / "in.fasta"
    fasta.write_text(f">sp|P1|A_HUMAN first\n{WT}\n>b\nMLLAVLYCLAVF\n")
    wt = tmp / "wt.fasta"
    wt.write_text(f">wt\n{WT}\n")
    dms = tmp / "dms.csv"
    dms.write_text("mutant,fit\nK2R,1\nT3S:Q9E,2\nA2R,3\nQ9E,0.5\n")
    return {"ckpt": ckpt, "clm": clm, "fasta": fasta, "wt": wt, "dms": dms, "tmp": tmp}


def test_embed(files, tmp_path: Path, capsys) -> None:
    out = tmp_path / "e.h5"
    argv = [
        "embed",
        str(files["ckpt"]),
        str(files["fasta"]),
        str(out),
        "--repr-layers",
        "0",
        "-1",
        "--include",
        "mean",
        "per_tok",
        "bos",
        "--toks-per-batch",
        "64",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert "embedded 2 record(s)" in capsys.readouterr().out
    with h5py.File(out) as f:
        assert [x.decode() for x in f["ids"][:]] == ["sp|P1|A_HUMAN", "b"]
        assert f["per_tok/2"].shape == (len(WT) + 12, 16)


def test_score_both_objectives(files, tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "score",
                str(files["ckpt"]),
                str(files["fasta"]),
                str(tmp_path / "s.csv"),
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "with pseudo-ppl" in capsys.readouterr().out
    with open(tmp_path / "s.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["id"] for r in rows] == ["sp|P1|A_HUMAN", "b"] and rows[0]["n_scored"] == "22"
    assert (
        main(
            [
                "score",
                str(files["clm"]),
                str(files["fasta"]),
                str(tmp_path / "s.tsv"),
                "--strategy",
                "causal",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (tmp_path / "s.tsv").read_text().startswith("id\tlength\tn_scored")
    # Mismatch: one error line, status 2, no file.
    assert (
        main(
            [
                "score",
                str(files["ckpt"]),
                str(files["fasta"]),
                str(tmp_path / "x.csv"),
                "--strategy",
                "causal",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: strategy 'causal' needs a causal-LM") and "Traceback" not in err
    assert not (tmp_path / "x.csv").exists()


def test_score_variants(files, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "v.csv"
    argv = ["score-variants", str(files["ckpt"]), str(files["wt"]), str(files["dms"])]
    assert main([*argv, str(out), "--label-col", "fit", "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert "scored 3 of 4 row(s) with masked-marginals" in printed.out
    assert "Spearman rho vs 'fit'" in printed.out and "(n = 3)" in printed.out
    with open(out, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["mutant", "fit", "masked-marginals"] and rows[3][2] == ""
    assert main([*argv, "-", "--no-progress"]) == 0
    printed = capsys.readouterr()  # the table on stdout, the summary on stderr
    assert list(csv.reader(printed.out.splitlines())) == rows
    assert "scored 3 of 4 row(s)" in printed.err
    # `-` as the wild type reads FASTA from standard input: the same table.
    stdin(monkeypatch, files["wt"].read_bytes())
    wt_argv = ["score-variants", str(files["ckpt"]), "-", str(files["dms"])]
    assert main([*wt_argv, str(tmp_path / "s.csv"), "--no-progress"]) == 0
    with open(tmp_path / "s.csv", newline="") as fh:
        assert [r[:3] for r in csv.reader(fh)] == rows


def stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """Standard input holding ``data``, as a pipe would give it."""
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_fasta_from_stdin_errors_name_stdin(files, tmp_path: Path, capsys, monkeypatch) -> None:
    stdin(monkeypatch, b">a\nMKTAYIAK\n>b\nMK1LV\n")
    out = tmp_path / "s.csv"
    assert main(["score", str(files["ckpt"]), "-", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: <stdin>:4: record #2 'b'") and "Traceback" not in err
    assert not out.exists()


def test_export_and_eval(files, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "exp"
    assert main(["export", str(files["ckpt"]), str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert main(["export", str(files["ckpt"]), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    ev = tmp_path / "ev"
    argv = ["eval", str(out), str(files["fasta"]), "--out-dir", str(ev), "--no-progress"]
    assert main([*argv, "--bins", "15"]) == 0
    printed = capsys.readouterr().out
    assert "<=15" in printed and ">15" in printed
    metrics = json.loads((ev / "metrics.json").read_text())
    assert metrics["overall"]["records"] == 2
    assert [b["records"] for b in metrics["bins"]] == [1, 1]
    assert (ev / "bins.csv").read_text().startswith("bin,records,tokens")
    assert main([*argv, "--bins", "15"]) == 2  # the same files again: only with --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--bins", "15", "--overwrite", "--threads", "1"]) == 0
    assert json.loads((ev / "metrics.json").read_text()) == metrics
    # FASTA from standard input: the same numbers.
    stdin(monkeypatch, files["fasta"].read_bytes())
    ev2 = tmp_path / "ev2"
    argv = ["eval", str(out), "-", "--out-dir", str(ev2), "--no-progress", "--bins", "15"]
    assert main(argv) == 0
    got = json.loads((ev2 / "metrics.json").read_text())
    assert got["overall"] == metrics["overall"] and got["bins"] == metrics["bins"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(out)])  # FASTA missing: argparse's usage and error, exit 2
    assert exc.value.code == 2 and "FASTA|STORE" in capsys.readouterr().err


def test_console_script_corrupt_checkpoint(files, tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(files["ckpt"].read_bytes()[:2000])
    exe = shutil.which("protein-performer", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "protein_performer.cli.main"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "embed", str(bad), str(files["fasta"]), str(tmp_path / "o.h5")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.h5").exists()


def test_inference_demo_step(files, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from demo import run_inference_demo  # scripts/demo.py: the demo's inference step

    out = run_inference_demo(files["ckpt"], files["fasta"], tmp_path / "demo", progress=False)
    assert set(out) == {"embeddings", "scores", "export"}
    assert all(Path(p).exists() for p in out.values())
    with open(out["scores"], newline="") as fh:
        assert [r["id"] for r in csv.DictReader(fh)] == ["sp|P1|A_HUMAN", "b"]


@pytest.mark.slow  # a subprocess piped into a closed reader
def test_closed_pipe_ends_quietly(files, tmp_path: Path) -> None:
    """`protein-performer ... | head` closes the pipe early: exit 0, no traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "s.csv"
    for argv in (
        ["score", str(files["ckpt"]), str(files["fasta"]), "-", "--no-progress"],
        ["stats", str(files["fasta"]), "--json"],
    ):
        proc = subprocess.Popen(
            [sys.executable, "-m", "protein_performer.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        proc.stdout.close()  # the reader went away before the first byte
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0, err
        assert "Traceback" not in err and "BrokenPipe" not in err
    assert not out.exists()


def test_help_does_not_import_torch() -> None:
    """Building the parser (every `--help`, every command's start) stays light: heavy imports
    belong inside the commands that need them."""
    code = (
        "import sys; from protein_performer.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'h5py', 'pytorch_lightning') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
