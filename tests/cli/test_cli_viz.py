"""``protein-performer contacts fit`` and ``visualize`` end to end on a tiny fresh model."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.cli.main import main
from protein_performer.contacts.fit import METRICS
from protein_performer.data.tokenizer import Alphabet
from protein_performer.interop.export import export_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.performer import PerformerLM
from tests.paths import FIXTURES
from tests.paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR / "data" / "structures"
TINY_PDB = FIXTURES / "tiny_blank_chain.pdb"
SMALL = ["2N2U_A.pdb", "1LCD_A.pdb", "1A8O_A.pdb"]  # the three smallest shared chains
SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQ"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, nb_features=8)
    model = PerformerLM(config).eval()
    loaded = LoadedModel(model, config, Alphabet(), Path("fresh"), torch.device("cpu"), "export")
    return export_model(loaded, tmp_path_factory.mktemp("viz") / "model")


@pytest.fixture(scope="module")
def structures() -> list[Path]:
    paths = [SHARED / n for n in SMALL]
    if not all(p.is_file() for p in paths):
        pytest.skip("../shared/data/structures not available")
    return paths


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow  # the default suite's time budget (make test <= 2 min)
def test_contacts_cross_fit_then_apply(model_dir, structures, tmp_path: Path, capsys) -> None:
    out = tmp_path / "c"
    argv = [
        "contacts",
        "fit",
        str(model_dir),
        *map(str, structures),
        "--out-dir",
        str(out),
        "--device",
        "cpu",
    ]
    assert main([*argv, "--save-beside"]) == 0
    printed = capsys.readouterr().out
    assert "leave-one-out" in printed and "long" in printed
    rows = read_csv(out / "precision.csv")
    assert [r["protein"] for r in rows] == ["2N2U_A", "1LCD_A", "1A8O_A", "mean"]
    assert rows[0]["contacts"] == "114" and rows[0]["fold"] == "0"
    for metric in METRICS:
        values = [float(r[metric]) for r in rows[:3]]
        nulls = [float(r[f"null_{metric}"]) for r in rows[:3]]
        assert all(0.0 <= v <= 1.0 for v in values + nulls)
        assert float(rows[3][metric]) == pytest.approx(np.mean(values), abs=1e-4)
    reg = ContactRegression.load(out / "contact_regression.json")
    assert reg.layers == [1, 2] and reg.heads == [0, 1]
    assert reg.meta["fit_on"] == ["2N2U_A", "1LCD_A", "1A8O_A"]
    assert (model_dir / "contact_regression.json").is_file()  # --save-beside

    applied = tmp_path / "a"
    regression = str(out / "contact_regression.json")
    tiny = f"{TINY_PDB}:_"
    argv = ["contacts", "fit", str(model_dir), str(structures[0]), tiny, "--out-dir", str(applied)]
    assert main([*argv, "--regression", regression]) == 0
    rows = read_csv(applied / "precision.csv")
    assert [r["protein"] for r in rows] == ["2N2U_A", "tiny_blank_chain:_", "mean"]
    assert rows[1]["chain"] == "_" and rows[1]["length"] == "12" and rows[1]["contacts"] == "9"
    assert not (applied / "contact_regression.json").exists()  # nothing fitted

    fitted = tmp_path / "f"
    argv = ["contacts", "fit", str(model_dir), str(structures[2]), "--out-dir", str(fitted)]
    assert main([*argv, "--fit-on", *map(str, structures[:2])]) == 0
    assert (
        ContactRegression.load(fitted / "contact_regression.json").meta["evaluation"] == "fit-on"
    )


def test_contacts_errors(model_dir, tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "e")
    fit = ["contacts", "fit", str(model_dir)]
    assert main([*fit, str(TINY_PDB), "--out-dir", out]) == 2
    assert "at least 2 structures" in capsys.readouterr().err
    assert main([*fit, str(tmp_path / "nope.pdb"), "--out-dir", out]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    argv = [*fit, str(TINY_PDB), "--out-dir", out, "--regression", str(bad)]
    assert main(argv) == 2
    assert "not a contact regression" in capsys.readouterr().err


def assert_png(path: Path) -> None:
    """Exists, is a PNG, and has real content (not one flat colour)."""
    import matplotlib.image as mpimg

    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(path)
    assert min(pixels.shape[:2]) > 100 and float(pixels[..., :3].std()) > 0.02


def test_visualize_sequence_and_structure(model_dir, tmp_path: Path, capsys) -> None:
    out = tmp_path / "v"
    argv = ["visualize", str(model_dir), "--sequence", SEQ, "--out-dir", str(out)]
    assert main([*argv, "--device", "cpu", "--window", "10", "60", "--layers", "-1"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: 2 figure(s): attention_grid.png, aa_similarity.png" in printed
    assert_png(out / "attention_grid.png")
    assert_png(out / "aa_similarity.png")
    assert not (out / "contacts.png").exists()
    assert main(argv) == 2  # the PNGs exist: replaced only with --overwrite
    assert "--overwrite" in capsys.readouterr().err

    fasta = tmp_path / "x.fasta"
    fasta.write_text(f">first\n{SEQ}\n>tiny desc\nMKGAYLPDEVKTWER\n")
    w = tmp_path / "w"
    base = ["visualize", str(model_dir), "--structure", str(TINY_PDB), "--chain", "_"]
    base += ["--no-similarity", "--heads", "1", "--out-dir", str(w), "--overwrite"]
    assert main([*base[:2], str(fasta), *base[2:], "--record", "tiny"]) == 0
    printed = capsys.readouterr().out  # the record, with the structure aligned onto it (gap 7-9)
    assert f"wrote {w}: 2 figure(s): attention_grid.png, contacts.png" in printed
    assert_png(w / "contacts.png")
    # a record the structure does not belong to: a clear error
    assert main([*base[:2], str(fasta), *base[2:], "--record", "first"]) == 2
    assert "do not match" in capsys.readouterr().err
    (w / "contacts.png").unlink()
    assert main(base) == 0  # the structure's own sequence
    assert_png(w / "contacts.png")
    assert_png(w / "attention_grid.png")


@pytest.mark.slow  # the default suite's time budget (make test <= 2 min)
def test_visualize_positional_and_record_by_accession(
    model_dir, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`visualize CKPT FASTA --record ...` with the id, the accession or the entry name."""
    import io
    import sys

    fasta = tmp_path / "x.fasta"
    fasta.write_text(f">sp|P69905|HBA_HUMAN Hemoglobin\n{SEQ}\n>other\nMKGAYLPDEVKTWER\n")
    for record in ("sp|P69905|HBA_HUMAN", "P69905", "HBA_HUMAN"):
        out = tmp_path / record.replace("|", "_")
        argv = [str(model_dir), str(fasta), "--record", record, "--out-dir", str(out)]
        assert main(["visualize", *argv, "--no-similarity", "--threads", "1"]) == 0
        assert_png(out / "attention_grid.png")
    capsys.readouterr()
    assert main(["visualize", str(model_dir), str(fasta), "--record", "P99999"]) == 2
    assert "no record 'P99999' (by id, accession or entry name" in capsys.readouterr().err
    # FASTA from standard input (`-`): the same picture's record, and errors name <stdin>.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(fasta.read_bytes())))
    out = tmp_path / "stdin"
    argv = ["visualize", str(model_dir), "-", "--record", "P69905", "--out-dir", str(out)]
    assert main([*argv, "--no-similarity"]) == 0
    assert_png(out / "attention_grid.png")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(fasta.read_bytes())))
    assert main(["visualize", str(model_dir), "-", "--record", "P99999"]) == 2
    assert capsys.readouterr().err.startswith("error: <stdin>: no record 'P99999'")


def test_visualize_errors(model_dir, tmp_path: Path, capsys) -> None:
    assert main(["visualize", str(model_dir), "--out-dir", str(tmp_path)]) == 2
    assert "--sequence" in capsys.readouterr().err
    argv = ["visualize", str(model_dir), "--sequence", "MKV", "--window", "0", "9"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 2
    assert "window" in capsys.readouterr().err


def test_ids_in_messages_cannot_drive_the_terminal(tmp_path: Path, capsys) -> None:
    """Issue 42 item 5: record ids holding ESC[2J or an OSC title are escaped (one helper,
    errors.shown) in the error line of `visualize --record`; plain ids read as written."""
    from protein_performer.errors import shown

    fasta = tmp_path / "f.fasta"
    fasta.write_text(">\x1b[2J\x1b]0;pwned\x07x\nMKV\n>ok\nMKT\n")
    (tmp_path / "m.ckpt").write_bytes(b"x")
    argv = ["visualize", str(tmp_path / "m.ckpt"), str(fasta), "--record", "nope"]
    argv += ["--out-dir", str(tmp_path / "figs")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and err.count("\n") == 1, repr(err)
    assert "'\\x1b[2J\\x1b]0;pwned\\x07x', ok" in err
    assert shown("P69905") == "P69905" and shown("a\u202eb") == "'a\\u202eb'"
