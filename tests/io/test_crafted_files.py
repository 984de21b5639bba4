"""Crafted and damaged files are refused with one ``UserError`` before anything is allocated or
sliced (issue 26, items 5 and 7): a config at odds with its weights, JSON built to crash the
parser, truncated or edited HDF5 offsets, and the flags that took a bad count or seed."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from protein_performer.cli.main import main
from protein_performer.contacts.predict import predict_contacts_fasta, read_contacts
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.embedding import embed_fasta, read_embeddings
from protein_performer.interop import record
from protein_performer.interop.export import export_model
from protein_performer.interop.loading import load_model
from protein_performer.io.json_safe import parse_json
from protein_performer.model.contact_head import ContactRegression
from tests.contacts.test_contact_maps import _loaded, _regression
from tests.inference.test_embedding import tiny_loaded

FASTA = ">P1 one\nMKTAYIAKQRQISFVKSHF\n>P2 two\nMLLAVLYCLAVF\n>P3\nGS\n"


def _checkpoint(tmp_path: Path, **config_edits: object) -> Path:
    """A Lightning-shaped checkpoint of a tiny model, its config edited."""
    loaded = tiny_loaded()
    state = {f"model.{k}": v for k, v in loaded.model.state_dict().items()}
    path = tmp_path / "m.ckpt"
    config = {**loaded.config.to_dict(), **config_edits}
    torch.save({"state_dict": state, "performer_config": config}, path)
    return path


def test_a_deep_config_with_normal_weights_fails_before_building(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, depth=20000)
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"missing key\(s\) for depth=20000: layers\.2\."):
        load_model(path, "cpu")
    assert time.perf_counter() - start < 5  # no 20000-layer model was built


def test_memory_is_checked_against_available_memory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(record, "_available_memory", lambda: (1024, "available"))
    with pytest.raises(UserError, match="GiB of available memory"):
        load_model(_checkpoint(tmp_path), "cpu")


def test_available_memory_reads_meminfo() -> None:
    have, what = record._available_memory()
    assert have > 0 and what in ("available", "total")


@pytest.mark.parametrize(
    "text",
    [
        '{"format": "protein_performer.model", "format_version": ' + "9" * 5000 + "}",
        "[" * 200_000 + "]" * 200_000,
        '{"format": "protein_performer.model", "config": {"depth": ' + "9" * 4000 + "}}",
        "\xff{",
    ],
    ids=["5000-digits", "200k-brackets", "4000-digits", "not-json"],
)
def test_crafted_export_config_is_one_error(tmp_path: Path, text: str, capsys) -> None:
    out = export_model(tiny_loaded(), tmp_path / "m")
    (out / "config.json").write_text(text, encoding="utf-8", errors="surrogateescape")
    with pytest.raises(UserError, match="config.json: "):
        load_model(out, "cpu")
    assert main(["embed", str(out), str(tmp_path / "x.fasta"), str(tmp_path / "o.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and len(err[0]) < 600


def test_crafted_regression_sidecar_is_one_error(tmp_path: Path) -> None:
    bad = tmp_path / "reg.json"
    bad.write_text("[" * 100_000)
    with pytest.raises(UserError, match="nested deeper"):
        ContactRegression.load(bad)


def test_parse_json_accepts_ordinary_files() -> None:
    data = parse_json('{"a": [1, -2, 3.5e300, "[[[{"], "b": {"c": null}}', "x")
    assert data == {"a": [1, -2, 3.5e300, "[[[{"], "b": {"c": None}}


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    emb = tmp_path / "emb.h5"
    lm = ProteinLM(tiny_loaded())
    embed_fasta(lm, fasta, emb, include=["mean", "per_tok"], progress=False)
    loaded = _loaded("exact")
    contacts = tmp_path / "contacts.h5"
    predict_contacts_fasta(loaded, fasta, contacts, _regression(loaded), progress=False)
    return emb, contacts


def test_one_id_string_is_one_id(files: tuple[Path, Path]) -> None:
    emb, contacts = files
    ids, values = read_embeddings(emb, ids="P1")
    assert ids == ["P1"] and values.shape[0] == 1
    ids, values = read_embeddings(emb, ids="P2", kind="per_tok")
    assert ids == ["P2"] and values[0].shape[0] == 12
    assert list(read_contacts(contacts, "P3")) == ["P3"]


def _edit(path: Path, name: str, values: np.ndarray) -> None:
    with h5py.File(path, "r+") as h5:
        del h5[name]
        h5.create_dataset(name, data=values)


@pytest.mark.parametrize(
    "offsets",
    [[0, 12, 19, 33], [0, 19, 12, 33], [0, 19, 31, 99], [1, 20, 32, 34], [0, 19]],
    ids=["wrong-spans", "non-monotonic", "out-of-range", "not-from-0", "short"],
)
def test_crafted_per_tok_offsets_are_refused(
    files: tuple[Path, Path], tmp_path: Path, offsets: list[int]
) -> None:
    emb = tmp_path / "edited.h5"
    shutil.copy(files[0], emb)
    with h5py.File(emb) as h5:
        assert h5["per_tok_offsets"][:].tolist() == [0, 19, 31, 33]
    _edit(emb, "per_tok_offsets", np.asarray(offsets, dtype=np.int64))
    with pytest.raises(UserError, match="per_tok_offsets .*damaged or edited"):
        read_embeddings(emb, kind="per_tok")


def test_crafted_contact_offsets_are_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    with h5py.File(files[1]) as h5:
        dense = h5["dense_offsets"][:]
    for name, values, match in (
        ("dense_offsets", dense[::-1].copy(), "dense_offsets does not start at 0"),
        ("dense_offsets", dense + np.asarray([0, 1, 1, 0]), "disagrees with the record lengths"),
        ("pair_offsets", np.asarray([0, 0, 0, 7]), "pair_offsets ends at 7, past the 0"),
    ):
        edited = tmp_path / f"edited-{match[:4]}.h5"
        shutil.copy(files[1], edited)
        _edit(edited, name, values)
        with pytest.raises(UserError, match=match):
            read_contacts(edited)


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_truncated_files_are_one_error(files: tuple[Path, Path], tmp_path: Path, keep) -> None:
    for src, read in ((files[0], read_embeddings), (files[1], read_contacts)):
        cut = tmp_path / f"cut-{src.name}"
        data = src.read_bytes()
        cut.write_bytes(data[: int(len(data) * keep)])
        with pytest.raises(UserError, match=str(cut)):
            read(cut)


def test_limit_rows_and_seeds_are_checked(tmp_path: Path, capsys) -> None:
    for argv in (
        ["score-variants", "m", "wt.fasta", "dms.csv", "o.csv", "--limit-rows", "0"],
        ["score-variants", "m", "wt.fasta", "dms.csv", "o.csv", "--limit-rows", "-1"],
        ["generate", "m", "o.fasta", "--seed", "-1"],
        ["generate", "m", "o.fasta", "--seed", "4294967296"],
        ["eval", "m", "in.fasta", "--seed", "abc"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("protein-performer") and ("--limit-rows" in err or "--seed" in err)
    from protein_performer.inference.scoring import score_variants_file

    with pytest.raises(UserError, match="limit_rows=0"):
        score_variants_file(ProteinLM(tiny_loaded()), "wt", "dms", "out", limit_rows=0)
