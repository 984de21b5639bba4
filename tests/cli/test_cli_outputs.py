"""One output policy for every writing command (protein_performer.io.outputs, through
cli._lifetime.check_output): an output never replaces an input nor goes inside one, and an existing
output is replaced only with --overwrite. The registry test walks every command's parser and its
``OUTPUTS`` so a new command or output cannot skip it."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path

import pytest

from protein_performer.cli.main import SUBCOMMAND_MODULES, build_parser, main


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


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every runnable command of the CLI: (its words, its parser)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


def _declared(path: tuple[str, ...]) -> tuple[str, ...]:
    """The command's registry entry: the arguments it declares as outputs (``OUTPUTS``)."""
    outputs = importlib.import_module(f"protein_performer.cli.{path[0].replace('-', '_')}").OUTPUTS
    return outputs[path[1]] if isinstance(outputs, dict) else outputs


LEAVES = dict(_leaves(build_parser()))
CASES = [(path, dest) for path in LEAVES for dest in _declared(path)]


def test_every_argument_naming_an_output_is_registered() -> None:
    """The registry cannot fall behind the parsers: an argument whose name says output (out,
    out_*, *_out, html) is declared by its command, and every declared one exists."""
    assert {p[0] for p in LEAVES} == {m.replace("_", "-") for m in SUBCOMMAND_MODULES}
    for path, parser in LEAVES.items():
        dests = {a.dest for a in parser._actions}
        looks = {d for d in dests if re.search(r"(^|_)out($|_)|^html$", d)}
        declared = set(_declared(path))
        assert looks <= declared, f"{' '.join(path)}: undeclared outputs {looks - declared}"
        assert {d for d in declared if "." not in d} <= dests, " ".join(path)


def _argv(path: tuple[str, ...], dest: str, inputs: Path, out: Path) -> list[str]:
    """``path`` with every input naming the directory ``inputs`` and output ``dest`` = ``out``
    (other outputs only where required, elsewhere); other required options get 1."""
    if "." in dest:  # a Hydra key: train and finetune
        ins = {"train": ["data.path"], "finetune": ["base", "data.train"]}[path[0]]
        return [*path, f"{dest}={out}", *(f"{k}={inputs}" for k in ins)]
    argv = list(path)
    for action in LEAVES[path]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        value = str(out) if action.dest == dest else None
        if value is None and action.dest in _declared(path):
            if not (action.required or (not action.option_strings and action.nargs != "?")):
                continue
            value = str(out.parent.parent / f"elsewhere_{action.dest}")
        if value is None:
            if action.option_strings and not action.required:
                continue
            value = str(inputs) if not action.option_strings else "1"
        argv += [action.option_strings[0], value] if action.option_strings else [value]
    return argv


@pytest.mark.parametrize("path, dest", CASES, ids=[f"{' '.join(p)}:{d}" for p, d in CASES])
def test_every_command_output_goes_through_the_policy(tmp_path, capsys, path, dest) -> None:
    """Issue 42: each output of each command (from the parsers and the registry) is refused
    inside an input directory and as the input directory itself, --overwrite included, before
    anything is written there."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "x.fasta").write_text(">a\nMKV\n")
    for out in (inputs / "out", inputs):
        argv = [*_argv(path, dest, inputs, out), "--overwrite"]
        if "." in dest:
            argv = [*argv[:-1], "overwrite=true"]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err, (argv, err)
        assert "never replaces an input" in err, (argv, err)
        assert sorted(p.name for p in inputs.iterdir()) == ["x.fasta"], argv
