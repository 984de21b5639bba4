"""inference.embedding: HDF5 layout, exact values, any length, batching invariance, atomicity."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.embedding import (
    budget_batches,
    embed_fasta,
    embed_sequences,
    safe_keys,
)
from protein_performer.inference.loading import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM

TINY = {"dim": 16, "depth": 2, "heads": 2, "ff_dim": 32, "nb_features": 8}
FASTA = """\
>sp|P12345|ABC_HUMAN Some protein OS=Homo sapiens
MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV
>sp_P12345_ABC_HUMAN collides after sanitising
MLLAVLYCLAVF
>short
GS
"""


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_loaded(objective: str = "mlm", seed: int = 0, **kw) -> LoadedModel:
    torch.manual_seed(seed)
    config = PerformerConfig.from_dict({**TINY, "objective": objective, **kw})
    model = PerformerLM(config).eval()
    return LoadedModel(model, config, Alphabet(), Path("tiny"), torch.device("cpu"), "memory")


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
    assert summary.repr_layers == [0, 2] and summary.num_records == 3
    with h5py.File(out) as f:
        assert f.attrs["format"] == "protein_performer.embeddings"
        assert list(f.attrs["repr_layers"]) == [0, 2]
        keys = sorted(f["records"])
        assert keys == ["short", "sp_P12345_ABC_HUMAN", "sp_P12345_ABC_HUMAN~2"]
        g = f["records"]["sp_P12345_ABC_HUMAN"]
        assert g.attrs["id"] == "sp|P12345|ABC_HUMAN"
        assert g.attrs["header"] == "sp|P12345|ABC_HUMAN Some protein OS=Homo sapiens"
        assert g.attrs["length"] == 32
        per_tok = g["per_tok"]["2"][:]
        assert per_tok.shape == (32, 16) and per_tok.dtype == np.float32
        np.testing.assert_allclose(g["mean"]["2"][:], per_tok.mean(0), rtol=1e-5, atol=1e-6)
        # Residues only (row i = residue i+1), BOS separately, exactly what the model returns.
        full = _direct(loaded, "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV", 2)
        np.testing.assert_allclose(per_tok, full[1:33].numpy(), atol=1e-6)
        np.testing.assert_allclose(g["bos"]["2"][:], full[0].numpy(), atol=1e-6)
        assert g["mean"]["0"].shape == (16,)
        index = f["index"][:]
        assert [r.decode() for r in index["id"]] == [
            "sp|P12345|ABC_HUMAN",
            "sp_P12345_ABC_HUMAN",
            "short",
        ]
        assert [r.decode() for r in index["key"]] == [
            "sp_P12345_ABC_HUMAN",
            "sp_P12345_ABC_HUMAN~2",
            "short",
        ]
        assert list(index["length"]) == [32, 12, 2]
    assert summary.keys["sp_P12345_ABC_HUMAN"] == "sp_P12345_ABC_HUMAN~2"


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
    with h5py.File(tmp_path / "o.h5") as f:
        arr = f["records"]["long"]["per_tok"]["2"][:]
    assert arr.shape == (3000, 16) and np.isfinite(arr).all()


def test_batched_equals_one_by_one() -> None:
    loaded = tiny_loaded()
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "MLL", "GSHMKKLLAVLYCLAVFAL", "W" * 40]
    together = dict(embed_sequences(loaded, seqs, [1, -1], ["mean", "per_tok"], 10_000))
    alone = dict(embed_sequences(loaded, seqs, [1, -1], ["mean", "per_tok"], 1))
    for i in range(len(seqs)):
        for kind in ("mean", "per_tok"):
            for layer in (1, 2):
                np.testing.assert_allclose(
                    together[i][kind][layer], alone[i][kind][layer], rtol=1e-4, atol=1e-5
                )


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
    with pytest.raises(RuntimeError, match="boom"):
        embed_fasta(ProteinLM(loaded), fasta, out, toks_per_batch=40, progress=False)
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


def test_budget_batches_and_safe_keys() -> None:
    lengths = [5, 100, 7, 7, 3, 50]
    batches = budget_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) == 1 or width * len(b) <= 20
    assert batches[0] == [1]  # longest first, alone although wider than the budget
    assert safe_keys(["a/b", "a_b", "..", "x y"]) == ["a_b", "a_b~2", "__", "x_y"]
