"""protein_performer.atomic: outputs appear complete or not at all."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from protein_performer.atomic import atomic_file, default_file_mode, write_text_atomic


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "result.csv"
    out.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_file(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.csv"]


def test_success_replaces_with_a_normal_file_mode(tmp_path: Path) -> None:
    out = write_text_atomic(tmp_path / "new" / "metrics.json", "a\r\nb\n")
    assert out.read_bytes() == b"a\r\nb\n"  # newlines as given
    assert stat.S_IMODE(out.stat().st_mode) == default_file_mode()
    with atomic_file(out, mode=0o644) as tmp:
        tmp.write_text("c")
    assert out.read_text() == "c" and stat.S_IMODE(out.stat().st_mode) == 0o644
    assert sorted(p.name for p in out.parent.iterdir()) == ["metrics.json"]
