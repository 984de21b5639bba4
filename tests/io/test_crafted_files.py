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
from protein_performer.contacts.map_columns import read_contacts
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.interop import record
from protein_performer.interop.export import export_model
from protein_performer.interop.loading import load_model
from protein_performer.io.json_safe import parse_json
from protein_performer.jobs.contacts import predict_contacts_fasta
from protein_performer.jobs.embed import embed_fasta
from protein_performer.jobs.embeddings_file import read_embeddings
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
    predict_contacts_fasta(
        ProteinLM(loaded), fasta, contacts, _regression(loaded), progress=False
    )
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
    from protein_performer.jobs.score_variants import score_variants_file

    with pytest.raises(UserError, match="limit_rows=0"):
        score_variants_file(ProteinLM(tiny_loaded()), "wt", "dms", "out", limit_rows=0)


def _mean_name(path: Path) -> str:
    with h5py.File(path) as h5:
        return f"mean/{int(h5.attrs['repr_layers'][-1])}"


@pytest.mark.parametrize("how", ["external", "virtual", "soft", "external-link"])
def test_h5_reading_outside_itself_is_refused(
    files: tuple[Path, Path], tmp_path: Path, how: str
) -> None:
    """A dataset stored in (or linked to) another local file would read that file as floats."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(3 * 16, dtype=np.float32).tobytes())
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as h5:
        h5.create_dataset("x", data=np.ones((3, 16), np.float32))
    emb = tmp_path / f"{how}.h5"
    shutil.copy(files[0], emb)
    name = _mean_name(emb)
    with h5py.File(emb, "r+") as h5:
        del h5[name]
        if how == "external":
            h5.create_dataset(name, (3, 16), np.float32, external=[(str(secret), 0, 192)])
        elif how == "virtual":
            layout = h5py.VirtualLayout((3, 16), np.float32)
            layout[:] = h5py.VirtualSource(str(other), "x", shape=(3, 16))
            h5.create_virtual_dataset(name, layout)
        elif how == "soft":
            h5["copy"] = np.ones((3, 16), np.float32)
            h5[name] = h5py.SoftLink("/copy")
        else:
            h5[name] = h5py.ExternalLink(str(other), "x")
    with pytest.raises(UserError, match=f"{emb}: .*reading data from outside the file"):
        read_embeddings(emb)


def _replace(path: Path, name: str, **create: object) -> None:
    with h5py.File(path, "r+") as h5:
        del h5[name]
        h5.create_dataset(name, **create)


@pytest.mark.parametrize(
    ("name", "create", "match"),
    [
        ("mean", {"data": np.ones((1, 16), np.float32)}, r"shape \(1, 16\) .* for 3 record"),
        ("mean", {"data": np.asarray([b"a", b"b", b"c"])}, r"shape \(3,\) .* for 3 record"),
        ("ids", {"data": np.arange(3)}, r"ids is not a column of text \(\(3,\) int64\)"),
        (
            "mean",
            {"shape": (10**9, 16), "dtype": np.float32, "chunks": (64, 16)},
            r"declares shape \(1000000000, 16\) \(64,000,000,000 bytes\) but the file stores 0",
        ),
    ],
    ids=["rows-unlike-ids", "text-values", "integer-ids", "declared-1e9-rows"],
)
def test_h5_arrays_unlike_their_ids_are_refused(
    files: tuple[Path, Path], tmp_path: Path, name: str, create: dict, match: str
) -> None:
    emb = tmp_path / "edited.h5"
    shutil.copy(files[0], emb)
    _replace(emb, _mean_name(emb) if name == "mean" else name, **create)
    with pytest.raises(UserError, match=match):
        read_embeddings(emb)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"coef": [float("nan")] + [0.0] * 7}, "must be finite"),
        ({"intercept": float("inf")}, "must be finite"),
        ({"coef": [1e308] * 8}, "must be finite and at most"),
        ({"heads": [-1, 0, 1, 2]}, "out of range"),
        ({"layers": [], "heads": [], "coef": []}, "out of range"),
    ],
    ids=["nan-coef", "inf-intercept", "1e308", "negative-head", "no-features"],
)
def test_crafted_regression_numbers_are_one_line(
    tmp_path: Path, edit: dict, match: str, capsys
) -> None:
    """Through --regression and through an export's own contact_regression.json."""
    import json

    loaded = _loaded("exact")
    bad = {**_regression(loaded).to_dict(), **edit}
    reg = tmp_path / "reg.json"
    reg.write_text(json.dumps(bad))
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    model_dir = export_model(loaded, tmp_path / "m")
    argv = ["contacts", "predict", str(model_dir), str(fasta), str(tmp_path / "c.h5")]
    assert main([*argv, "--regression", str(reg), "--no-progress"]) == 2
    (model_dir / "contact_regression.json").write_text(json.dumps(bad))
    embed = ["embed", str(model_dir), str(fasta), str(tmp_path / "e.h5"), "--no-progress"]
    assert main([*embed, "--include", "contacts"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: ") and match in e for e in err), err


def test_safetensors_dtype_that_lies_is_refused(tmp_path: Path, capsys) -> None:
    """``"dtype": "I32"`` on float data has the same size, so only the kind of number tells."""
    import json
    import struct

    out = export_model(tiny_loaded(), tmp_path / "m")
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    weights.write_bytes(data[:8] + text + data[8 + n :])
    fasta = tmp_path / "x.fasta"
    fasta.write_text(FASTA)
    assert main(["embed", str(out), str(fasta), str(tmp_path / "o.h5"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name} " in err[0] and "torch.int32 vs model" in err[0], err


def test_zero_stride_view_is_checked_through_its_storage(tmp_path: Path, capsys) -> None:
    """A 1.6 kB file holding shape (1e6, 1e6) over one number: no 4 TB finite check."""
    from protein_performer.io.checkpoints import load_lightning

    path = tmp_path / "view.ckpt"
    for value, match in ((float("nan"), "the weights are not finite"), (0.0, None)):
        view = torch.full((1,), value).expand(10**6, 10**6)
        torch.save({"state_dict": {"model.embed_tokens.weight": view}}, path)
        assert path.stat().st_size < 4096
        start = time.perf_counter()
        if match:
            with pytest.raises(UserError, match=match):
                load_lightning(path)
        else:
            assert load_lightning(path)["state_dict"]["model.embed_tokens.weight"].shape[0] > 1
        assert time.perf_counter() - start < 5


def test_zip_that_inflates_is_refused_before_unpickling(tmp_path: Path) -> None:
    import zipfile

    from protein_performer.io.checkpoints import safe_load

    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}, "pad": "a" * (40 << 20)}, plain)
    bomb = tmp_path / "bomb.ckpt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(UserError, match=r"inflate to [0-9,]+ bytes from a [0-9,]+-byte file"):
        safe_load(bomb)
    assert safe_load(plain)["state_dict"] == {}


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("dense_values", r"dense_values has shape \(\d+,\) \(\|S1\)"),
        ("pair_j", r"pair_j has shape \(1,\) \(int32\) for 0 record"),
    ],
    ids=["text-values", "pairs-unlike-each-other"],
)
def test_contact_arrays_of_the_wrong_kind_or_length_are_refused(
    files: tuple[Path, Path], tmp_path: Path, name: str, match: str
) -> None:
    """Text where numbers belong came back as bytes; a pair column longer than the others
    misaligned the pairs."""
    edited = tmp_path / "edited.h5"
    shutil.copy(files[1], edited)
    with h5py.File(edited) as h5:
        n = len(h5["dense_values"])
    values = np.asarray([b"a"] * n) if name == "dense_values" else np.zeros(1, np.int32)
    _edit(edited, name, values)
    with pytest.raises(UserError, match=match):
        read_contacts(edited)
