"""jobs.embed: the HDF5 layout, exact values, any length, atomicity, bad arguments."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.interop.record import LoadedModel
from protein_performer.jobs.embed import embed_fasta
from protein_performer.jobs.embeddings_file import read_embeddings
from tests.inference.test_embedding import tiny_loaded

FASTA = """\
>sp|P12345|ABC_HUMAN Some protein OS=Homo sapiens
MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV
>sp_P12345_ABC_HUMAN collides after sanitising
MLLAVLYCLAVF
>short
GS
"""


@pytest.fixture()
def fasta(tmp_path: Path) -> Path:
    path = tmp_path / "in.fasta"
    path.write_text(FASTA)
    return path


def _direct(loaded: LoadedModel, seq: str, layer: int) -> torch.Tensor:
    tokens = torch.as_tensor(loaded.alphabet.encode_with_specials(seq))[None]
    with torch.no_grad():
        return loaded.model(tokens, repr_layers=[layer]).hidden_states[layer][0]


def test_hdf5_layout_and_values(fasta: Path, tmp_path: Path) -> None:
    loaded = tiny_loaded()
    out = tmp_path / "emb.h5"
    summary = embed_fasta(
        ProteinLM(loaded),
        fasta,
        out,
        repr_layers=[0, -1],
        include=["mean", "per_tok", "bos"],
        progress=False,
    )
    assert summary.repr_layers == [0, 2] and summary.num_records == summary.new_records == 3
    seqs = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV", "MLLAVLYCLAVF", "GS"]
    with h5py.File(out) as f:
        assert f.attrs["format"] == "protein_performer.embeddings"
        assert f.attrs["format_version"] == 2 and f.attrs["num_records"] == 3
        assert list(f.attrs["repr_layers"]) == [0, 2] and f.attrs["precision"] == "fp32"
        assert len(f.attrs["model_sha256"]) == 64
        assert [x.decode() for x in f["ids"][:]] == [
            "sp|P12345|ABC_HUMAN",
            "sp_P12345_ABC_HUMAN",
            "short",
        ]
        assert list(f["lengths"][:]) == [32, 12, 2]
        assert list(f["record_numbers"][:]) == [1, 2, 3]
        hb, ho = f["header_bytes"][:].tobytes(), f["header_offsets"][:]
        assert hb[ho[0] : ho[1]].decode() == "sp|P12345|ABC_HUMAN Some protein OS=Homo sapiens"
        assert hb[ho[2] : ho[3]].decode() == "short"
        off = f["per_tok_offsets"][:]
        assert list(off) == [0, 32, 44, 46]
        assert f["per_tok/2"].shape == (46, 16) and f["per_tok/2"].dtype == np.float32
        assert f["mean/0"].shape == (3, 16)
        for n, seq in enumerate(seqs):
            per_tok = f["per_tok/2"][off[n] : off[n + 1]]
            np.testing.assert_allclose(f["mean/2"][n], per_tok.mean(0), rtol=1e-5, atol=1e-6)
            # Residues only (row i = residue i+1), BOS separately, exactly what the model gives.
            full = _direct(loaded, seq, 2)
            np.testing.assert_allclose(per_tok, full[1 : len(seq) + 1].numpy(), atol=1e-6)
            np.testing.assert_allclose(f["bos/2"][n], full[0].numpy(), atol=1e-6)
    assert not (tmp_path / "emb.h5.parts").exists()
    ids, got = read_embeddings(out, ids=["short", "sp|P12345|ABC_HUMAN"], kind="bos", layer=-1)
    assert ids == ["short", "sp|P12345|ABC_HUMAN"]
    with h5py.File(out) as f:
        np.testing.assert_array_equal(got, f["bos/2"][:][[2, 0]])
    assert read_embeddings(out, kind="per_tok", layer=0).values[2].shape == (2, 16)


def test_sequence_longer_than_any_training_length(tmp_path: Path) -> None:
    loaded = tiny_loaded()
    rng = np.random.default_rng(0)
    seq = "".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), size=3000))
    (tmp_path / "long.fasta").write_text(f">long\n{seq}\n")
    embed_fasta(
        ProteinLM(loaded),
        tmp_path / "long.fasta",
        tmp_path / "o.h5",
        include=["per_tok"],
        toks_per_batch=512,
        progress=False,
    )
    _, (arr,) = read_embeddings(tmp_path / "o.h5", kind="per_tok")
    assert arr.shape == (3000, 16) and np.isfinite(arr).all()


def test_failure_leaves_no_partial_file(fasta: Path, tmp_path: Path, monkeypatch) -> None:
    loaded = tiny_loaded()
    out = tmp_path / "emb.h5"
    out.write_bytes(b"previous result")
    calls = {"n": 0}
    forward = loaded.model.forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", failing)
    with pytest.raises(UserError, match="exists; pass --resume .* or --overwrite"):
        embed_fasta(ProteinLM(loaded), fasta, out, progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        embed_fasta(
            ProteinLM(loaded), fasta, out, toks_per_batch=40, progress=False, overwrite=True
        )
    assert calls["n"] == 2
    assert out.read_bytes() == b"previous result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emb.h5", "in.fasta"]


def test_bad_arguments_are_user_errors(fasta: Path, tmp_path: Path) -> None:
    loaded = tiny_loaded()
    with pytest.raises(UserError, match="out of range"):
        embed_fasta(ProteinLM(loaded), fasta, tmp_path / "o.h5", repr_layers=[5], progress=False)
    with pytest.raises(UserError, match="does not exist"):
        embed_fasta(ProteinLM(loaded), tmp_path / "nope.fasta", tmp_path / "o.h5", progress=False)
    with pytest.raises(UserError, match="does not exist"):
        embed_fasta(ProteinLM(loaded), fasta, tmp_path / "no" / "o.h5", progress=False)
    assert not (tmp_path / "o.h5").exists()


def test_read_embeddings_finds_records_by_accession_and_entry_name(fasta, tmp_path) -> None:
    """Issue 45 #9: ``ids=["Q197F8"]`` finds ``sp|Q197F8|002R_IIV3``, as ``visualize --record``
    does (one matcher, ``data.headers.IdLookup``); an exact id still wins."""
    out = tmp_path / "emb.h5"
    embed_fasta(ProteinLM(tiny_loaded()), fasta, out, repr_layers=[-1],
                include=["mean", "per_tok"], progress=False)  # fmt: skip
    ids, every = read_embeddings(out)
    ids, mean = read_embeddings(out, ids=["short", "P12345", "ABC_HUMAN"])
    assert ids == ["short", "sp|P12345|ABC_HUMAN", "sp|P12345|ABC_HUMAN"]
    np.testing.assert_array_equal(mean, every[[2, 0, 0]])
    ids, rows = read_embeddings(out, ids="P12345", kind="per_tok")
    assert ids == ["sp|P12345|ABC_HUMAN"] and rows[0].shape[0] == 32
    with pytest.raises(UserError, match="no record.*Q99999.*accession"):
        read_embeddings(out, ids=["Q99999"])
