"""One output rule for every writing command: an output never replaces an input, and an existing
output is replaced only with --overwrite (protein_performer.cli._common.check_output)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protein_performer.cli.main import main


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    fasta = tmp_path / "x.fasta"
    fasta.write_text(">a\nMKV\n")
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not read: the output check runs first")
    csv = tmp_path / "dms.csv"
    csv.write_text("mutant\nK2A\n")
    existing = tmp_path / "old.out"
    existing.write_text("keep me\n")
    os.symlink(fasta, tmp_path / "link.fasta")
    os.symlink(ckpt, tmp_path / "link.ckpt")
    return {"fasta": fasta, "ckpt": ckpt, "csv": csv, "existing": existing}


def _commands(f: dict[str, Path], out: Path) -> list[list[str]]:
    ckpt, fasta, csv = str(f["ckpt"]), str(f["fasta"]), str(f["csv"])
    return [
        ["embed", ckpt, fasta, str(out)],
        ["score", ckpt, fasta, str(out)],
        ["score-variants", ckpt, fasta, csv, str(out)],
        ["export", ckpt, str(out)],
        ["contacts", "fit", ckpt, fasta, "--out-dir", str(out)],
        ["preprocess", fasta, "--out", str(out)],
        ["convert-esm", ckpt, str(out)],
        ["contacts", "predict", ckpt, fasta, str(out)],
        ["generate", ckpt, str(out), "--num", "1", "--max-length", "5"],
    ]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


NAMES = ["embed", "score", "score-variants", "export", "contacts-fit", "preprocess", "convert-esm"]
NAMES += ["contacts-predict", "generate"]


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_every_writing_command_applies_the_rule(files, tmp_path, capsys, index) -> None:
    name = "fasta" if index == 5 else "ckpt"  # an input of every one of these commands
    before = files[name].read_bytes()
    # The input itself, through a symlink, and a directory holding it.
    for out in (files[name], tmp_path / f"link.{name}", tmp_path):
        argv = _commands(files, out)[index]
        assert "never replaces an input" in _run(argv, capsys)
    assert files[name].read_bytes() == before
    # An existing output: refused without --overwrite, untouched.
    argv = _commands(files, files["existing"])[index]
    assert "already exists: pass --overwrite" in _run(argv, capsys)
    assert files["existing"].read_text() == "keep me\n"
    if index == 2:  # score-variants: OUT naming the mutation table
        assert "never replaces an input" in _run(_commands(files, files["csv"])[2], capsys)


def test_overwrite_passes_the_check_but_never_for_an_input(files, capsys) -> None:
    argv = ["score", str(files["ckpt"]), str(files["fasta"]), str(files["fasta"]), "--overwrite"]
    assert "never replaces an input" in _run(argv, capsys)
    argv = [
        "score",
        str(files["ckpt"]),
        str(files["fasta"]),
        str(files["existing"]),
        "--overwrite",
    ]
    assert "already exists" not in _run(argv, capsys)  # got past the check to the checkpoint


@pytest.mark.parametrize("command", ["generate", "score"])
def test_standard_output_closed_is_one_line(files, capsys, monkeypatch, command) -> None:
    """``cmd ... - >&-``: Python starts with no sys.stdout; refused before any work."""
    import sys

    argv = {
        "generate": ["generate", str(files["ckpt"]), "-", "--num", "1", "--max-length", "5"],
        "score": ["score", str(files["ckpt"]), str(files["fasta"]), "-"],
    }[command]
    monkeypatch.setattr(sys, "stdout", None)
    assert "standard output is closed" in _run(argv, capsys)


def test_an_output_inside_an_input_directory_is_refused(files, tmp_path, capsys) -> None:
    """Issue 42 item 6: OUT inside an export directory given as CKPT, or inside a store given as
    the input, is refused like OUT == input, --overwrite included; nothing there changes."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    store = tmp_path / "store"
    store.mkdir()
    (store / "tokens.bin").write_bytes(b"tokens")
    fasta = str(files["fasta"])
    cases = [
        ["embed", str(export), fasta, str(export / "model.safetensors"), "--overwrite"],
        ["score", str(files["ckpt"]), str(store), str(store / "tokens.bin"), "--overwrite"],
        ["score", str(export), fasta, str(export / "new.csv")],
    ]
    for argv in cases:
        assert "inside the input directory" in _run(argv, capsys)
    assert (export / "model.safetensors").read_bytes() == b"weights"
    assert (store / "tokens.bin").read_bytes() == b"tokens"
    assert sorted(p.name for p in export.iterdir()) == ["model.safetensors"]


def test_what_is_written_beside_an_output_is_an_output_too(files, tmp_path, capsys) -> None:
    """Issue 42 item 10: OUT.parts/, the lock .OUT.lock and OUT.linearize.pt are written beside
    OUT, so none of them may be an input either."""
    named = {n: tmp_path / n for n in ("o.csv.parts", ".o.csv.lock", "lin.linearize.pt")}
    for path in named.values():
        path.write_text(">a\nMKV\n")
    ckpt = str(files["ckpt"])
    cases = [
        ["score", ckpt, str(named["o.csv.parts"]), str(tmp_path / "o.csv")],
        ["score", ckpt, str(named[".o.csv.lock"]), str(tmp_path / "o.csv")],
        ["linearize", ckpt, str(tmp_path / "lin"), "--data", str(named["lin.linearize.pt"])],
    ]
    for argv in cases:
        assert "never replaces an input" in _run(argv, capsys)
    assert all(p.read_text() == ">a\nMKV\n" for p in named.values())
