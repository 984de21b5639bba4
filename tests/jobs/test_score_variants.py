"""jobs.score_variants: DMS tables in, the same table plus scores out; bad rows by line."""

from __future__ import annotations

from pathlib import Path

import pytest

from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.jobs.score_variants import score_variants_file
from tests.inference.test_embedding import tiny_loaded
from tests.inference.test_scoring import SHARED, WT, read_csv


def test_mismatched_rows_are_reported_by_line(tmp_path: Path, caplog) -> None:
    (tmp_path / "wt.fasta").write_text(f">wt\n{WT}\n")
    table = tmp_path / "dms.csv"
    table.write_text(
        "\ufeffname,mutant,fitness\n"
        "a,K2R,1.0\n"
        "b,A2R,2.0\n"  # wrong wild-type letter -> line 3
        "c,T3S:Q9E,0.5\n"
        "d,M99A,0.1\n"  # outside -> line 5
        "e,Q9E,3.0\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.csv"
    with caplog.at_level("WARNING"):
        summary = score_variants_file(
            ProteinLM(tiny_loaded()),
            tmp_path / "wt.fasta",
            table,
            out,
            "masked-marginals",
            label_col="fitness",
            progress=False,
        )
    assert summary.rows == 5 and summary.scored == 3
    assert [line for line, _, _ in summary.skipped] == [3, 5]
    assert "line 3 ('A2R'" in caplog.text and "line 5 ('M99A'" in caplog.text
    rows = read_csv(out)
    assert rows[0] == ["name", "mutant", "fitness", "masked-marginals"]
    assert [r[:3] for r in rows[1:]] == [
        ["a", "K2R", "1.0"],
        ["b", "A2R", "2.0"],
        ["c", "T3S:Q9E", "0.5"],
        ["d", "M99A", "0.1"],
        ["e", "Q9E", "3.0"],
    ]
    assert rows[2][3] == "" and rows[4][3] == "" and rows[1][3] != ""
    assert summary.spearman is not None and summary.spearman_n == 3
    with pytest.raises(UserError, match="no column 'score'"):
        score_variants_file(
            ProteinLM(tiny_loaded()), tmp_path / "wt.fasta", table, out, mutation_col="score"
        )


def test_ragged_rows_are_reported_row_by_row(tmp_path: Path) -> None:
    (tmp_path / "wt.fasta").write_text(f">wt\n{WT}\n")
    table = tmp_path / "dms.csv"
    table.write_text("mutant,fitness\nK2R,1.0\nQ9E,3.0,extra\nT3S\nK2A,0.2\n")
    with pytest.raises(UserError) as info:
        score_variants_file(
            ProteinLM(tiny_loaded()), tmp_path / "wt.fasta", table, tmp_path / "o.csv"
        )
    assert "2 malformed row(s)" in str(info.value)
    assert "line 3 has 3, line 4 has 1" in str(info.value)
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/dms not checked out")
def test_tem1_dms_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "tem1.csv"
    summary = score_variants_file(
        ProteinLM(tiny_loaded()),
        SHARED / "BLAT_ECOLX_wt_offset24.fasta",
        SHARED / "BLAT_ECOLX_Ranganathan2015.csv",
        out,
        "masked-marginals",
        offset=24,
        label_col="2500",
        limit_rows=200,
        progress=False,
    )
    assert summary.rows == 200 and summary.scored == 200 and not summary.skipped
    assert summary.spearman is not None and -1 <= summary.spearman <= 1
    rows = read_csv(out)
    assert rows[0][:3] == ["", "mutant", "0"] and rows[0][-1] == "masked-marginals"
    assert rows[1][1] == "H24C" and rows[1][-1] != ""
    # Offset 1 instead of 24 misplaces every mutation: nothing scored is an error that names
    # the offset that fits (issue 35), not an empty table and exit 0.
    with pytest.raises(UserError, match="pass --offset 24"):
        score_variants_file(
            ProteinLM(tiny_loaded()),
            SHARED / "BLAT_ECOLX_wt_offset24.fasta",
            SHARED / "BLAT_ECOLX_Ranganathan2015.csv",
            tmp_path / "w.csv",
            offset=1,
            limit_rows=50,
            progress=False,
        )
    assert not (tmp_path / "w.csv").exists()


def test_the_context_sidecar_is_an_output(tmp_path: Path, capsys) -> None:
    """Issue 42 item 10: an existing OUT.context.json is replaced only with --overwrite (even
    when it is the --context input itself), and a run without --context removes a stale one."""
    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model

    model = export_model(tiny_loaded(), tmp_path / "model")
    (tmp_path / "wt.fasta").write_text(f">wt\n{WT}\n")
    (tmp_path / "dms.csv").write_text("mutant\nK2R\nT3S\n")
    out = tmp_path / "out.csv"
    record = tmp_path / "out.csv.context.json"
    record.write_text(">h\nMKTAYIAK\n")  # a homolog file that happens to have that name
    argv = ["score-variants", str(model), str(tmp_path / "wt.fasta"), str(tmp_path / "dms.csv")]
    argv += [str(out), "--no-progress"]
    assert main([*argv, "--context", str(record), "--overwrite"]) == 2
    assert "never replaces an input" in capsys.readouterr().err
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "out.csv.context.json already exists: pass --overwrite" in err, err
    assert record.read_text() == ">h\nMKTAYIAK\n" and not out.exists()
    assert main([*argv, "--overwrite"]) == 0  # no --context: the stale record goes
    assert out.exists() and not record.exists()
    assert not list(tmp_path.glob(".*lock"))
