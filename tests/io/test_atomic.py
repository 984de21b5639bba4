"""protein_performer.io.atomic: outputs appear complete or not at all."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from protein_performer.io.atomic import atomic_file, default_file_mode, write_text_atomic


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


@pytest.mark.parametrize(
    ("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)]
)
def test_stores_and_exports_follow_the_umask(tmp_path: Path, umask, file_mode, dir_mode) -> None:
    import os

    import torch

    from protein_performer.data.store import StoreWriter
    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.export import export_model
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    old = os.umask(umask)
    try:
        with StoreWriter(tmp_path / "store") as w:
            w.write_chunk(["a"], ["MKV"], [0], [""])
            w.commit()
        config = PerformerConfig(dim=16, depth=1, heads=2, ff_dim=32, nb_features=8)
        loaded = LoadedModel(
            PerformerLM(config), config, Alphabet(), tmp_path / "x", torch.device("cpu"), "export"
        )
        export_model(loaded, tmp_path / "export")
    finally:
        os.umask(old)
    for directory in (tmp_path / "store", tmp_path / "export"):
        assert stat.S_IMODE(directory.stat().st_mode) == dir_mode, directory
        for f in directory.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == file_mode, f
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "store"]  # no temporaries


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "result.csv"
    # A writer killed mid-write: its temporary stays behind, named by host and pid.
    code = (
        "import os, sys; from pathlib import Path; from protein_performer.io.atomic import "
        "atomic_file\nwith atomic_file(Path(sys.argv[1])) as tmp:\n"
        "    tmp.write_text('half'); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", code, str(out)]).returncode == 9
    assert len(list(tmp_path.iterdir())) == 1 and not out.exists()
    write_text_atomic(out, "new\n")
    assert [p.name for p in tmp_path.iterdir()] == ["result.csv"]


def test_an_output_file_ending_in_a_separator_is_a_directory(tmp_path) -> None:
    from protein_performer.errors import UserError
    from protein_performer.io.atomic import output_file

    with pytest.raises(UserError, match="is a directory; give a file name"):
        output_file(f"{tmp_path}/not_yet/")
    assert output_file(tmp_path / "f.ckpt") == tmp_path / "f.ckpt"
