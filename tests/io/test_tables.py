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
