"""The README's command lines run as written on the bundled data.

Every ``protein-performer`` line of the README's bash blocks is run, with only its placeholders
filled in (``CKPT``: a tiny trained masked LM, ``CLM_CKPT``: a tiny causal one), in a scratch
directory that sees the repository's ``data/``. Lines that need a download, a GPU, a cluster
or hours are listed in ``SKIP`` with the reason; a README line that is neither run nor skipped
fails the test, so new lines get checked too. Training lines other than ``debug=fdr`` itself
run with ``debug=fdr`` appended (one batch through everything) in the slow suite.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from protein_performer.cli.main import main
from protein_performer.interop.export import export_model
from tests.inference.test_embedding import tiny_loaded
from tests.interop.test_loading import fit_checkpoint
from tests.paths import DEMO_DATA, REPO

ROOT = REPO

#: Substrings of README lines that are not run here, and why.
SKIP = {
    "uniref50": "needs UniRef50 (a download)",
    "esm2_t6_8M_UR50D.pt": "needs ESM-2 weights (a download)",
    "init_from=esm2_8m": "needs converted ESM-2 weights (a download)",
    "trainer=gpu": "needs a GPU",
    "experiment=small_": "trains on ../shared/data for hours",
    "<run>": "names a run directory of the reader's own",
    "<time>": "names a run directory of the reader's own",
    "[--": "shows optional flags in brackets",
    "--help": "help texts are tested by test_cli_* and test_train",
    "--ood-taxa": "the bundled FASTA headers carry no TaxID",
}
PLACEHOLDERS = {"CKPT", "CLM_CKPT"}


def _records(path: Path) -> int:
    return path.read_text().count(">") if path.is_file() else 0


def _rows(path: Path) -> int:
    return max(0, len(path.read_text().splitlines()) - 1) if path.is_file() else 0


#: README lines whose outputs a new user found empty or meaningless (issue 35), keyed by a
#: substring of the line: what each must now produce, in the scratch checkout ``d``.
NONEMPTY = {
    "homologs protein_performer/data/demo/family_query.fasta store hits.fasta": (
        "homolog hits", lambda d: _records(d / "hits.fasta") > 0),
    "homologs protein_performer/data/demo/family_query.fasta protein_performer/data/demo/train"
    ".fasta homologs.fasta": (
        "homolog hits", lambda d: _records(d / "homologs.fasta") > 0),
    "predict outputs/finetune/blat": (
        "a prediction per BLAT variant", lambda d: _rows(d / "blat_pred.csv") == 12),
    "--offset 24 --label-col 2500 --limit-rows 20": (
        "scored rows", lambda d: all(r.split(",")[-1] for r in (d / "variants.csv")
                                     .read_text().splitlines()[1:])),
    "BLAT_ECOLX_Stiffler_2015.csv pg_variants.csv": (
        "200 scored rows", lambda d: _rows(d / "pg_variants.csv") == 200),
    "benchmark proteingym": (
        "an Average_Spearman", lambda d: (d / "pg_out" / "Spearman"
            / "Summary_performance_DMS_substitutions_Spearman.csv").read_text()
            .splitlines()[1].split(",")[3] != ""),
    "variants_ens.csv": (
        "ensemble scores and their record", lambda d: _rows(d / "variants_ens.csv") == 6
        and (d / "variants_ens.csv.context.json").is_file()),
}  # fmt: skip


def readme_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            if line.startswith("protein-performer "):
                lines.append(line)
    return lines


def doc_commands() -> list[tuple[str, str]]:
    """Every ``protein-performer ...`` command the README and docs/*.md name inline (in
    backticks, outside the README's bash blocks): (file, command)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for match in re.findall(r"`[^`]*?(protein-performer [^`]*)`", text):
            found.append((path.name, " ".join(match.split())))
    return found


def test_every_command_the_docs_name_exists_with_its_flags() -> None:
    """Issue 45 #8: RESULTS and the other docs named commands that no longer exist
    (`contacts CKPT ... --out`, `predict-contacts`); every named subcommand (and `contacts`'
    own) and every named flag must exist."""
    from protein_performer.cli.main import build_parser

    def choices(parser):  # noqa: ANN001, ANN202 - argparse's subcommand table
        sub = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        return sub[0].choices if sub else {}

    commands = doc_commands()
    assert len(commands) >= 10
    for where, command in commands:
        words = command.split()[1:]
        parser, named = build_parser(), []
        while words and choices(parser) and not words[0].startswith("-"):
            assert words[0] in choices(parser), f"{where}: `{command}`: no command {words[0]!r}"
            parser = choices(parser)[words[0]]
            named.append(words.pop(0))
        flags = {o for a in parser._actions for o in a.option_strings}
        for word in words:
            flag = word.split("=")[0]
            if flag.startswith("--") and flag.strip("-").replace("-", "").isalpha():
                assert flag in flags, f"{where}: `{command}`: {' '.join(named)} has no {flag}"


def skipped(line: str) -> str | None:
    if "../shared" in line and not (ROOT.parent / "shared").is_dir():
        return "../shared is not checked out beside the repository"
    mmseqs_keys = ("--cluster-split", " store ", "layout=family", "homologs ")
    if any(k in line for k in mmseqs_keys) and shutil.which("mmseqs") is None:
        return "MMseqs2 is not installed"
    return next((why for key, why in SKIP.items() if key in line), None)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("readme")
    work = base / "work"  # the reader's checkout: data/ and the demo's data here, ../shared beside
    (work / "protein_performer" / "data").mkdir(parents=True)
    (work / "data").symlink_to(ROOT / "data")
    (work / "protein_performer" / "data" / "demo").symlink_to(DEMO_DATA)
    if (ROOT.parent / "shared").is_dir():
        (base / "shared").symlink_to(ROOT.parent / "shared")
    ckpt, _ = fit_checkpoint(base / "fit")
    clm = export_model(tiny_loaded("clm"), base / "fit" / "clm_export")
    return {"dir": work, "CKPT": str(ckpt), "CLM_CKPT": str(clm)}


def fill(line: str, scratch: dict) -> list[str]:
    """The line's arguments with placeholders filled in and globs expanded (as a shell would)."""
    out = []
    for arg in shlex.split(line)[1:]:
        for name in sorted(PLACEHOLDERS, key=len, reverse=True):
            arg = re.sub(rf"(?<![A-Z_]){name}(?![A-Z_])", scratch[name], arg)
        matches = sorted(glob.glob(arg, root_dir=scratch["dir"])) if "*" in arg else []
        out.extend(matches or [arg])
    return out


def run_subprocess(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Training lines run as their own process, as Hydra apps do."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "PYTHONWARNINGS": "ignore",
        # As the console script does: the scratch checkout's protein_performer/data/ folder
        # must not shadow the installed package (`python -m` would put the cwd first).
        "PYTHONSAFEPATH": "1",
    }
    env.pop("PROTEIN_PERFORMER_ROOT", None)
    return subprocess.run(
        [sys.executable, "-m", "protein_performer.cli.main", *argv],
        cwd=cwd, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def _is_training(line: str) -> bool:
    return line.startswith("protein-performer train ")


def test_every_once_empty_output_is_checked_on_a_readme_line() -> None:
    """The checks of ``NONEMPTY`` name lines the README still has (a renamed example would
    otherwise silently lose its check)."""
    lines = readme_lines()
    for key in NONEMPTY:
        assert any(key in line for line in lines), key


def test_readme_lines_parse(tmp_path: Path, capsys) -> None:
    """The fast check of every line run below: its subcommand and flags parse as ``main`` parses
    them, and a training line's overrides compose, without running anything."""
    from protein_performer.cli.main import build_parser
    from protein_performer.training.compose import compose_config

    parser, values = build_parser(), {"dir": str(ROOT), "CKPT": "m.ckpt", "CLM_CKPT": "c.ckpt"}
    checked = 0
    for line in readme_lines():
        if skipped(line):
            continue
        argv = fill(line, values)
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit:
            pytest.fail(f"{line}\n{capsys.readouterr().err}")
        assert not extra or getattr(args, "accepts_overrides", False), (line, extra)
        if _is_training(line):
            compose_config(argv[1:], output_dir=tmp_path)
        checked += 1
    assert checked >= 10


@pytest.mark.slow  # every line in turn (minutes); test_readme_lines_parse is the fast check
def test_readme_inference_and_data_lines_run(scratch: dict, monkeypatch, capsys) -> None:
    """Inference and data lines in this process (the CLI's own entry point; no interpreter
    start-up per line), in order, in the scratch checkout; `train ... debug=fdr` as a process."""
    monkeypatch.chdir(scratch["dir"])
    monkeypatch.delenv("PROTEIN_PERFORMER_ROOT", raising=False)
    ran = 0
    for line in readme_lines():
        if skipped(line) or (_is_training(line) and "debug=fdr" not in line):
            continue
        argv = fill(line, scratch)
        if _is_training(line):
            proc = run_subprocess(argv, scratch["dir"])
            assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        else:
            capsys.readouterr()
            assert main(argv) == 0, f"{line}\n{capsys.readouterr().err[-3000:]}"
        for key, (what, check) in NONEMPTY.items():
            if key in line:
                assert check(scratch["dir"]), f"{line}\nproduced no {what}"
        ran += 1
    assert ran >= 10


@pytest.mark.slow
def test_readme_training_lines_run(scratch: dict) -> None:
    for line in readme_lines():
        if skipped(line) or not _is_training(line) or "debug=fdr" in line:
            continue
        proc = run_subprocess([*fill(line, scratch), "debug=fdr"], scratch["dir"])
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
