"""Issue 45 #6: every command that writes files ends with one ``wrote PATH: ...`` line (one
helper, ``cli._wrote.say_wrote``), naming its output, on a real run of the command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.interop.export import export_model
from protein_performer.interop.identity import model_identity
from protein_performer.model.contact_head import ContactRegression
from tests.finetune.test_finetune import base, fitness, lora_run  # noqa: F401 - fixtures
from tests.inference.test_embedding import tiny_loaded
from tests.paths import REPO, SHARED

SEQ = "MKTAYIAKQRQISFVKSHFSRQ"
STRUCTURES = SHARED / "data" / "structures"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wrote")
    mlm = tiny_loaded("mlm")
    layers, heads = mlm.config.depth, mlm.config.heads
    coef = np.random.default_rng(0).normal(size=layers * heads)
    mlm.contact_regression = ContactRegression(
        coef, -1.0, list(range(1, layers + 1)), list(range(heads)), **model_identity(mlm)
    ).to_dict()
    fasta = tmp / "in.fasta"
    fasta.write_text(f">sp|P1|A_HUMAN first\n{SEQ}\n>b\nMLLAVLYCLAVF\n")
    wt = tmp / "wt.fasta"
    wt.write_text(f">wt\n{SEQ}\n")
    dms = tmp / "dms.csv"
    dms.write_text("mutant,fit\nK2R,1\nT3S,2\n")
    many = tmp / "many.fasta"  # enough records for linearize's held-out split
    rng = np.random.default_rng(0)
    many.write_text("".join(f">s{i}\n{''.join(rng.choice(list('ACDEFGHIKLMNPQRSTVWY'), 30))}\n"
                            for i in range(60)))  # fmt: skip
    return {"mlm": export_model(mlm, tmp / "mlm"),
            "clm": export_model(tiny_loaded("clm"), tmp / "clm"),
            "fasta": fasta, "wt": wt, "dms": dms, "many": many}  # fmt: skip


COMMANDS = {
    "embed": ["embed", "{mlm}", "{fasta}", "{out}"],
    "score": ["score", "{mlm}", "{fasta}", "{out}"],
    "score-variants": ["score-variants", "{mlm}", "{wt}", "{dms}", "{out}"],
    "generate": ["generate", "{clm}", "{out}", "--num", "2", "--max-length", "10"],
    "eval": ["eval", "{mlm}", "{fasta}", "--out-dir", "{out}"],
    "export": ["export", "{mlm}", "{out}"],
    "export --format hf": ["export", "{mlm}", "{out}", "--format", "hf", "--as-exact"],
    "convert-esm": ["convert-esm", "{mlm}", "{out}"],
    "contacts predict": ["contacts", "predict", "{mlm}", "{fasta}", "{out}"],
    "visualize --html": ["visualize", "{mlm}", "--sequence", SEQ, "--html", "{out}"],
    "visualize": ["visualize", "{mlm}", "--sequence", SEQ, "--out-dir", "{out}"],
    "preprocess": ["preprocess", "{fasta}", "--out", "{out}", "--no-progress"],
    "linearize": ["linearize", "{mlm}", "{out}", "--data", "{many}", "--steps", "1",
                  "--max-len", "64", "--no-progress"],
    "benchmark proteingym": ["benchmark", "proteingym", str(REPO / "data" / "proteingym" /
                             "reference_two_assays.csv"), str(REPO / "data" / "proteingym"),
                             "{out}", "{mlm}", "--no-progress"],
    "contacts fit": ["contacts", "fit", "{mlm}", str(STRUCTURES / "1A8O_A.pdb"),
                     str(STRUCTURES / "1LCD_A.pdb"), "--out-dir", "{out}"],
}
#: Commands checked by other tests, and where; commands that write no file.
ELSEWHERE = {
    "predict": "test_predict_and_export_merge_say_what_they_wrote",
    "finetune": "tests/finetune/test_finetune.py::test_cli_finetune_residue_frozen_and_errors",
    "train": "the same helper as finetune (cli._wrote.say_wrote_run; test_wheel runs it)",
    "homologs": "its own `wrote N homolog(s)` line (tests/data/test_homology.py)",
    "stats": "writes no file (its report is the output)",
}


def _one_wrote_line(said: str, out: Path) -> str:
    lines = [line for line in said.splitlines() if line.startswith("wrote ")]
    assert len(lines) == 1, said
    assert str(out) in lines[0], lines[0]
    return lines[0]


def test_every_command_is_checked_here_or_elsewhere() -> None:
    """A new command gets a row above (or a reason in ELSEWHERE), so none ends silently."""
    from protein_performer.cli.main import build_parser

    def subcommands(parser) -> dict:  # noqa: ANN001 - argparse's subcommand table
        sub = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        return sub[0].choices if sub else {}

    names = set()
    for name, parser in subcommands(build_parser()).items():
        inner = subcommands(parser)
        names |= {f"{name} {n}" for n in inner} if inner else {name}
    checked = {n for n in COMMANDS if " --" not in n} | set(ELSEWHERE)
    assert names == checked, (names - checked, checked - names)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_says_what_it_wrote(name, models, tmp_path, capsys) -> None:
    if name == "contacts fit" and not STRUCTURES.is_dir():
        pytest.skip("../shared/data/structures is not checked out beside the repository")
    out = tmp_path / "out"
    argv = [a.format(out=out, **models) for a in COMMANDS[name]]
    assert main(argv) == 0
    printed = capsys.readouterr()
    _one_wrote_line(printed.out + printed.err, out)


def test_predict_and_export_merge_say_what_they_wrote(lora_run, models, tmp_path, capsys):  # noqa: F811
    ckpt = lora_run["last_checkpoint"]
    pred = tmp_path / "pred.csv"
    assert main(["predict", ckpt, str(models["fasta"]), str(pred), "--no-progress"]) == 0
    assert "predicted 2 record(s)" in _one_wrote_line(capsys.readouterr().out, pred)
    merged = tmp_path / "merged.ckpt"
    assert main(["export", ckpt, str(merged), "--merge"]) == 0
    _one_wrote_line(capsys.readouterr().out, merged)


def test_standard_output_data_keeps_the_line_on_stderr(models, capsys) -> None:
    assert main(["score", str(models["mlm"]), str(models["fasta"]), "-", "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("id,") and "wrote" not in printed.out
    assert "wrote standard output: scored 2 record(s)" in printed.err
