"""The one delimiter rule and the sharded table writer that ``score`` and ``predict`` share."""

from __future__ import annotations

from pathlib import Path

import pytest

from protein_performer.errors import UserError
from protein_performer.io.tables import ShardedTable, delimiter


@pytest.mark.parametrize(
    "name, first_line, want",
    [
        ("out.tsv", None, "\t"),
        ("OUT.TAB", None, "\t"),
        ("out.csv", None, ","),
        ("-", None, ","),
        ("labels.txt", "id\tlabel", "\t"),
        ("labels.txt", "id,label\tx", ","),
        ("labels.csv", "id\tlabel", ","),  # the name wins over the content
        ("labels.tsv", "id,label", "\t"),
    ],
)
def test_delimiter_by_name_then_by_first_line(name: str, first_line: str | None, want: str):
    assert delimiter(name, first_line) == want


def test_rows_of_every_window_come_in_order_under_the_header(tmp_path: Path) -> None:
    out = tmp_path / "t.tsv"
    seen: list[list[str]] = []
    windows = [["a", "bb"], ["ccc"]]
    new, total = ShardedTable(out, ["id", "len"]).write(
        windows, lambda w: ([x, str(len(x))] for x in w), "in.fasta", seen.append
    )
    assert (new, total) == (3, 3)
    assert out.read_text() == "id\tlen\na\t1\nbb\t2\nccc\t3\n"
    assert seen == [["a", "1"], ["bb", "2"], ["ccc", "3"]]
    assert not (tmp_path / "t.tsv.parts").exists()


def test_standard_output_gets_the_table_and_no_file(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    ShardedTable("-", ["id"]).write([["x"], ["y"]], lambda w: ([v] for v in w), "in")
    assert capsys.readouterr().out.splitlines() == ["id", "x", "y"]
    assert list(tmp_path.iterdir()) == []


def test_an_input_without_records_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^in\.fasta: no valid records to process$"):
        ShardedTable(tmp_path / "t.csv", ["id"]).write([], lambda w: [], "in.fasta")
    assert not (tmp_path / "t.csv").exists()


def test_several_ranks_naming_standard_output_stop_before_any_work(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="several ranks cannot share standard output"):
        ShardedTable("-", ["id"])


EVIL = ["=HYPERLINK(\"http://x\",\"y\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\tx", "\rx"]


def test_formula_cells_are_text_and_numbers_stay_numbers(tmp_path: Path) -> None:
    """Issue 42 item 4 (OWASP CSV injection): text cells starting with = + - @ TAB CR are
    prefixed with ' in every table; negative and signed numbers are left as numbers."""
    import csv

    from protein_performer.io.tables import text_cell

    assert [text_cell(v) for v in EVIL] == ["'" + v for v in EVIL]
    assert [text_cell(v) for v in ("-1.5", "+3e-4", "-.5", 2.0, -1, "'=x", "A42G")] == [
        "-1.5", "+3e-4", "-.5", 2.0, -1, "'=x", "A42G"
    ]  # fmt: skip
    for name in ("t.csv", "t.tsv"):
        out = tmp_path / name
        ShardedTable(out, ["id", "=score"]).write(
            [EVIL], lambda w: [[v, f"{-i - 0.5:.3f}"] for i, v in enumerate(w)], "src"
        )
        with open(out, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh, delimiter=delimiter(out)))
        assert rows[0] == ["id", "'=score"]
        assert [r[0] for r in rows[1:]] == ["'" + v for v in EVIL]
        assert [r[1] for r in rows[1:]] == [f"{-i - 0.5:.3f}" for i in range(len(EVIL))]
