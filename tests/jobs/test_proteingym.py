"""ProteinGym's formats: its metrics as it defines them, its DMS files read as they are, and the
benchmark runner (resumable per assay, the leaderboard's column names)."""

from __future__ import annotations

import contextlib
import csv
import math
import re
from pathlib import Path

import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.inference.dms_metrics import (
    leaderboard_average,
    mcc,
    ndcg,
    spearman,
    top_recall,
)
from protein_performer.jobs.proteingym import summary_columns
from scripts._checks import reference_file
from tests.interop.test_loading import fit_checkpoint
from tests.paths import REPO

PG = REPO / "data" / "proteingym"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_checkpoint(tmp_path_factory.mktemp("fit"))[0]


def test_ndcg_by_hand() -> None:
    # 10 rows: k = floor(10 * 10%) = 1, so only the top-ranked row counts.
    labels = np.array([0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    gains = labels / 9  # min-max scaled
    perfect = labels.copy()
    assert ndcg(perfect, labels) == pytest.approx(1.0)
    second = labels.copy()
    second[8], second[9] = 9, 8  # the model's top row has gain 8/9
    assert ndcg(second, labels) == pytest.approx(gains[8] / gains[9])
    # 20 rows: k = 2, discounts 1 and 1/log2(3)
    labels20 = np.arange(20.0)
    scores = np.arange(20.0)
    scores[[17, 19]] = scores[[19, 17]]  # top two by score: rows 17 (gain 17/19), 18
    g = labels20 / 19
    want = (g[17] + g[18] / math.log2(3)) / (g[19] + g[18] / math.log2(3))
    assert ndcg(scores, labels20) == pytest.approx(want)


def test_mcc_cuts_the_score_at_its_median_and_undefined_is_none() -> None:
    fit = [0, 0, 1, 1]
    assert mcc([0.1, 0.2, 0.3, 0.4], fit) == pytest.approx(1.0)
    assert mcc([0.4, 0.3, 0.2, 0.1], fit) == pytest.approx(-1.0)
    assert mcc([1, 2, 3, 4], [1, 1, 1, 1]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    assert top_recall(np.arange(20.0), np.arange(20.0)) == 1.0


def test_leaderboard_average_weights_proteins_and_selection_types_equally() -> None:
    values = [0.2, 0.4, 0.9, 0.5]
    proteins = ["A", "A", "B", "C"]
    selection = ["Stability", "Stability", "Stability", "Binding"]
    # Stability: mean(A = 0.3, B = 0.9) = 0.6; Binding: C = 0.5; average (0.6 + 0.5) / 2
    assert leaderboard_average(values, proteins, selection) == pytest.approx(0.55)
    assert leaderboard_average([None, 0.5], ["A", "B"], ["x", "y"]) == pytest.approx(0.5)


def test_score_variants_reads_a_proteingym_file_as_it_is(
    ckpt: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out.csv"
    argv = ["score-variants", str(ckpt), str(PG / "BLAT_ECOLX.fasta"),
            str(PG / "BLAT_ECOLX_Stiffler_2015.csv"), str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "ProteinGym DMS columns found" in said
    assert "scored 200 of 200" in said and "Spearman rho vs 'DMS_score'" in said


def test_multi_mutants_in_proteingym_notation(ckpt: Path, tmp_path: Path, capsys) -> None:
    wt = "MKTAYIAKQRQISFVKSHFSRQ"
    (tmp_path / "wt.fasta").write_text(f">wt\n{wt}\n")
    dms = tmp_path / "dms.csv"
    dms.write_text("mutant,DMS_score,DMS_score_bin\nK2R,1.0,1\nK2R:T3S,0.5,1\nY5G:K8R:Q9E,-1,0\n")
    out = tmp_path / "out.csv"
    argv = ["score-variants", str(ckpt), str(tmp_path / "wt.fasta"), str(dms), str(out)]
    assert main([*argv, "--no-progress"]) == 0
    assert "scored 3 of 3" in capsys.readouterr().out


def _tables(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.csv"))}


def test_benchmark_runs_every_assay_and_a_second_run_reproduces_it(
    ckpt: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "pg"
    argv = ["benchmark", "proteingym", str(PG / "reference_two_assays.csv"), str(PG), str(out),
            str(ckpt), "--no-progress", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "[1/2] BLAT_ECOLX_Stiffler_2015: 200 mutants" in first.err
    assert "[2/2] BLAT_ECOLX_Stiffler_2015_cefotaxime: 119 mutants" in first.err
    before = _tables(out)
    (out / "scores" / "BLAT_ECOLX_Stiffler_2015_cefotaxime.csv").unlink()  # killed before it
    assert main(argv) == 0
    second = capsys.readouterr()
    assert (
        "(reused)" in second.err.splitlines()[0] and "(reused)" not in second.err.splitlines()[1]
    )
    assert _tables(out) == before  # the same bytes: numbers reproduced from the files
    with open(out / "Spearman" / "Summary_performance_DMS_substitutions_Spearman.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == summary_columns("Spearman")
    assert rows[0]["Model_name"] == "protein_performer" and rows[0]["Average_Spearman"]
    with open(out / "AUC" / "DMS_substitutions_AUC_DMS_level.csv") as fh:
        level = list(csv.DictReader(fh))
    assert [r["DMS ID"] for r in level] == ["BLAT_ECOLX_Stiffler_2015",
                                            "BLAT_ECOLX_Stiffler_2015_cefotaxime"]  # fmt: skip
    assert all(0 <= float(r["protein_performer"]) <= 1 for r in level)
    with open(out / "scores" / "BLAT_ECOLX_Stiffler_2015.csv") as fh:
        scored = list(csv.DictReader(fh))
    rho = spearman([float(r["protein_performer"]) for r in scored],
                   [float(r["DMS_score"]) for r in scored])  # fmt: skip
    with open(out / "Spearman" / "DMS_substitutions_Spearman_DMS_level.csv") as fh:
        assert float(next(csv.DictReader(fh))["protein_performer"]) == round(rho, 3)


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ("mutant,DMS_score,DMS_score_bin\nA1C,0.5,0.7\n", "DMS_score_bin must be 0 or 1, got"),
        ("mutant,DMS_score,DMS_score_bin\nA1C,0.5,2\n", "got '2'"),
        ("mutant,DMS_score,DMS_score_bin\nA1C,0.5,-1\n", "got '-1'"),
        ("mutant,DMS_score,DMS_score_bin\nA1C,0.5,inf\n", "got 'inf'"),
        ("DMS_score,mutant\n0.5\n", "line 2: fewer fields than the header's 2 (no mutant)"),
    ],
)
def test_a_bad_assay_row_is_one_line(tmp_path: Path, rows: str, says: str) -> None:
    from protein_performer.errors import UserError
    from protein_performer.jobs.proteingym import read_assay

    path = tmp_path / "assay.csv"
    path.write_text(rows)
    with pytest.raises(UserError, match=re.escape(says)):
        read_assay(path)
    path.write_text("mutant,DMS_score,DMS_score_bin\nA1C,0.5,1.0\nA1D,0.1,0\n")
    assert read_assay(path)[2] == [1, 0]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize("dms_id", ["/ABS/PWNED", "../../dms/assay", "a/b", "..", ".hidden",
                                    "x\x1b[2J"])  # fmt: skip
def test_a_dms_id_is_never_a_path(tmp_path: Path, capsys, dms_id: str) -> None:
    """Issue 42 item 3: an id that would write outside OUT_DIR is one line, nothing written."""
    dms_id = dms_id.replace("/ABS", str(tmp_path))
    ref = reference_file(tmp_path / "ref.csv", dms_id)
    argv = ["benchmark", "proteingym", str(ref), str(PG), str(tmp_path / "out" / "pg"),
            str(tmp_path / "model.ckpt")]  # fmt: skip
    (tmp_path / "out").mkdir()
    assert main(argv) == 2
    assert "cannot name a file" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "ref.csv"]


def test_benchmark_out_dir_never_holds_or_enters_its_inputs(ckpt: Path, tmp_path: Path,
                                                            capsys) -> None:  # fmt: skip
    """Issue 42 item 7: OUT_DIR == DMS_DIR, OUT_DIR holding it (the assay in o2/scores) or
    inside it are refused before any work; the DMS file keeps its bytes."""
    o2 = tmp_path / "o2"
    (o2 / "scores").mkdir(parents=True)
    name = "BLAT_ECOLX_Stiffler_2015.csv"
    (o2 / "scores" / name).write_bytes((PG / name).read_bytes())
    ref = reference_file(tmp_path / "ref.csv", "BLAT_ECOLX_Stiffler_2015")
    before = (o2 / "scores" / name).read_bytes()
    for dms, out in ((o2 / "scores", o2), (o2 / "scores", o2 / "scores"),
                     (o2, o2 / "scores" / "deeper")):  # fmt: skip
        argv = ["benchmark", "proteingym", str(ref), str(dms), str(out), str(ckpt), "--overwrite"]
        assert main(argv) == 2
        assert "an output never replaces an input" in _one_line(capsys)
    assert (o2 / "scores" / name).read_bytes() == before
    assert not (o2 / "scores" / "deeper").exists()


def test_benchmark_reuse_is_keyed_by_digests(ckpt: Path, tmp_path: Path, capsys) -> None:
    """Issue 42 item 8: a table its run file does not vouch for (a kill between the two
    files) is scored again, and a changed wild type is another key (refused without
    --overwrite), never the old scores read back as this run's."""
    ref = reference_file(tmp_path / "ref.csv", "BLAT_ECOLX_Stiffler_2015")
    out = tmp_path / "pg"
    argv = ["benchmark", "proteingym", str(ref), str(PG), str(out), str(ckpt), "--no-progress",
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    table = out / "scores" / "BLAT_ECOLX_Stiffler_2015.csv"
    good = table.read_bytes()
    # Another run's table under the same name, its run file never written (killed between).
    lines = good.decode().splitlines(keepends=True)
    table.write_text(lines[0] + "".join(lines[:0:-1]))  # the scores of other mutants
    assert main(argv) == 0
    assert "(reused)" not in capsys.readouterr().err
    assert table.read_bytes() == good
    # The reference's wild type changed: the old scores are not this run's.
    with open(PG / "reference_two_assays.csv", newline="") as fh:
        wt = next(csv.DictReader(fh))["target_seq"]
    changed = wt[:-1] + ("A" if wt[-1] != "A" else "G")
    reference_file(ref, "BLAT_ECOLX_Stiffler_2015", target_seq=changed)
    assert main(argv) == 2
    assert "differs: target_seq_sha256" in _one_line(capsys)
    assert table.read_bytes() == good


@pytest.mark.parametrize("flags", [["--model-name", "mutant"], ["--model-name", "DMS ID"],
                                   ["--toks-per-batch", "0"]])  # fmt: skip
def test_benchmark_refuses_a_clashing_model_name_and_no_token_budget(tmp_path, capsys, flags):
    """Issue 42 item 20: --model-name mutant made every rerun score again (the column clashed);
    --toks-per-batch 0 was accepted."""
    argv = ["benchmark", "proteingym", str(PG / "reference_two_assays.csv"), str(PG),
            str(tmp_path / "pg"), str(tmp_path / "m.ckpt"), *flags]  # fmt: skip
    with pytest.raises(SystemExit) if flags[0] == "--toks-per-batch" else contextlib.nullcontext():
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("column the tables already have" in err) or ("must be at least 1" in err), err
    assert not (tmp_path / "pg").exists()
