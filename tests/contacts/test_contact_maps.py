"""inference.contact_maps: streamed contact maps equal the full-map recipe, the sparse top-k path
equals the top of the dense map, the columnar HDF5 round trip, and the missing-regression line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.contacts import predict as contact_maps
from protein_performer.contacts.fit import model_maps
from protein_performer.contacts.map_columns import DTYPES, read_contacts
from protein_performer.contacts.predict import find_regression, predict_contacts
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.identity import model_identity
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.performer import PerformerLM

AMINO = list("ACDEFGHIKLMNPQRSTVWY")


def _loaded(attention: str, kernel: str = "softmax", objective: str = "mlm") -> LoadedModel:
    cfg = PerformerConfig(
        dim=32, depth=2, heads=4, ff_dim=64, nb_features=16, attention=attention, kernel=kernel,
        objective=objective,
    )  # fmt: skip
    torch.manual_seed(0)
    return LoadedModel(
        PerformerLM(cfg).eval(), cfg, Alphabet(), Path("m"), torch.device("cpu"), "x"
    )


def _sequence(n: int, seed: int = 0) -> str:
    return "".join(np.random.default_rng(seed).choice(AMINO, n))


def _regression(loaded: LoadedModel, seed: int = 0) -> ContactRegression:
    coef = np.random.default_rng(seed).normal(size=8)
    coef[3] = 0.0  # a head an L1 fit dropped: skipped, must not matter
    return ContactRegression(coef, -1.0, [1, 2], [0, 1, 2, 3], **model_identity(loaded))


@pytest.mark.parametrize(
    ("attention", "kernel", "objective"),
    [("exact", "softmax", "mlm"), ("exact", "softmax", "clm"), ("favor", "softmax", "mlm"),
     ("favor", "softmax_opt", "mlm"), ("favor", "trig", "mlm")],
)  # fmt: skip
def test_streamed_equals_full_maps_and_sparse_is_top_k(
    attention, kernel, objective, monkeypatch
) -> None:
    loaded = _loaded(attention, kernel, objective)
    reg = _regression(loaded)
    seq = _sequence(90)
    reference = reg.predict_maps(model_maps(loaded, seq, reg.layers, reg.heads))
    dense = predict_contacts(loaded, seq, reg).dense  # one window of 90 rows
    assert dense.shape == (90, 90)
    np.testing.assert_allclose(dense, reference, atol=1e-6)
    np.testing.assert_allclose(dense, dense.T, atol=1e-7)

    monkeypatch.setattr(contact_maps, "_BLOCK_ELEMENTS", 16 * 92)  # windows of 16 rows
    assert contact_maps.window_rows(90) == 16
    np.testing.assert_allclose(predict_contacts(loaded, seq, reg).dense, dense, atol=1e-6)
    sparse = predict_contacts(loaded, seq, reg, dense_max_length=50, top_k_per_length=1.5)
    assert sparse.dense is None and len(sparse.p) == 135
    i, j = np.triu_indices(90, 6)
    order = np.argsort(-dense[i, j], kind="stable")[:135]
    top = set(zip(i[order].tolist(), j[order].tolist(), strict=True))
    assert top == set(zip(sparse.i.tolist(), sparse.j.tolist(), strict=True))
    np.testing.assert_allclose(sparse.p, dense[i[order], j[order]], atol=1e-6)
    assert np.all(np.diff(sparse.p) <= 0) and np.all(sparse.j - sparse.i >= 6)


def test_no_regression_says_how_to_fit(tmp_path: Path) -> None:
    loaded = _loaded("exact")
    loaded.source = tmp_path / "last.ckpt"
    with pytest.raises(UserError, match="no contact regression: fit one"):
        find_regression(loaded)
    with pytest.raises(UserError, match="causal FAVOR"):
        causal = _loaded("favor", objective="clm")
        predict_contacts(causal, "MKTAYIAKQR", _regression(causal))


def test_api_method_returns_the_dense_map(tmp_path: Path) -> None:
    from protein_performer.inference.api import ProteinLM

    loaded = _loaded("favor")
    reg = _regression(loaded)
    path = reg.save(tmp_path / "reg.json")
    seq = _sequence(30, 5)
    got = ProteinLM(loaded).predict_contacts(seq, regression=path)
    np.testing.assert_array_equal(got, predict_contacts(loaded, seq, reg).dense)
    loaded.contact_regression = reg.to_dict()
    np.testing.assert_array_equal(ProteinLM(loaded).predict_contacts(seq), got)


def test_cli_predict_contacts(tmp_path: Path, capsys) -> None:
    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model

    loaded = _loaded("favor")
    model_dir = export_model(loaded, tmp_path / "model")
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{_sequence(25, 1)}\n>b\n{_sequence(60, 2)}\n")
    out = tmp_path / "c.h5"
    argv = ["contacts", "predict", str(model_dir), str(fasta), str(out), "--no-progress"]
    assert main(argv) == 2  # no regression yet: one line saying how to fit one
    err = capsys.readouterr().err
    assert err.startswith("error:") and "protein-performer contacts fit" in err
    assert err.count("\n") == 1
    reg_path = _regression(loaded).save(tmp_path / "reg.json")
    argv += ["--regression", str(reg_path), "--dense-max-length", "40", "--dtype", "float32"]
    assert main(argv) == 0
    assert "1 dense, 1 top pairs" in capsys.readouterr().out
    back = read_contacts(out)
    assert back["a"].dense.shape == (25, 25) and len(back["b"].p) == 120
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err


def test_regression_travels_with_checkpoints_and_exports(tmp_path: Path) -> None:
    from protein_performer.interop.export import export_model
    from protein_performer.interop.loading import load_model

    loaded = _loaded("favor")
    reg = _regression(loaded)
    state = {f"model.{k}": v for k, v in loaded.model.state_dict().items()}
    ckpt = tmp_path / "last.ckpt"
    torch.save(
        {
            "state_dict": state,
            "performer_config": loaded.config.to_dict(),
            "contact_regression": reg.to_dict(),  # what init_from's module saves
        },
        ckpt,
    )
    from_ckpt = load_model(ckpt, "cpu")
    assert from_ckpt.contact_regression == reg.to_dict()
    exported = export_model(from_ckpt, tmp_path / "export")
    again = load_model(exported, "cpu")
    assert again.contact_regression == reg.to_dict()
    np.testing.assert_array_equal(find_regression(again).coef, reg.coef)
    # A regression fitted and saved beside the checkpoint wins over the carried one.
    fitted = ContactRegression(reg.coef * 2, 0.5, reg.layers, reg.heads, reg.layout)
    fitted.save(tmp_path / "last.contact_regression.json")
    assert find_regression(from_ckpt).intercept == 0.5


def test_cli_defaults_are_the_library_defaults() -> None:
    """`contacts predict` spells its defaults out (so --help needs no torch): they must agree."""
    from protein_performer.cli import contacts as cli
    from protein_performer.contacts.fit import MIN_SEPARATION

    assert cli.DEFAULT_DENSE_MAX_LENGTH == contact_maps.DEFAULT_DENSE_MAX_LENGTH
    assert cli.DEFAULT_TOP_K_PER_LENGTH == contact_maps.DEFAULT_TOP_K_PER_LENGTH
    assert cli.DEFAULT_MIN_SEPARATION == MIN_SEPARATION
    assert tuple(DTYPES) == cli.DTYPE_CHOICES


def test_embed_include_contacts_stores_the_predicted_maps(tmp_path: Path, capsys) -> None:
    """`embed --include mean contacts`: the maps beside the embeddings are `contacts predict`'s."""
    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model
    from protein_performer.jobs.embeddings_file import read_embeddings

    loaded = _loaded("favor")
    loaded.contact_regression = _regression(loaded).to_dict()
    model = export_model(loaded, tmp_path / "model")
    seqs = {"a": _sequence(30, 4), "b": _sequence(55, 5)}
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">{k}\n{v}\n" for k, v in seqs.items()))
    both, alone = tmp_path / "both.h5", tmp_path / "contacts.h5"
    argv = [str(model), str(fasta)]
    assert main(["embed", *argv, str(both), "--include", "mean", "contacts", "--no-progress"]) == 0
    assert main(["contacts", "predict", *argv, str(alone), "--no-progress"]) == 0
    ids, maps = read_embeddings(both, kind="contacts")
    want = read_contacts(alone)
    assert ids == list(want) == ["a", "b"]
    for rid, got in zip(ids, maps, strict=True):
        np.testing.assert_array_equal(got.dense, want[rid].dense)
    ids, emb = read_embeddings(both)
    assert ids == ["a", "b"] and emb.shape == (2, 32)
    assert read_embeddings(alone, kind="contacts").ids == ["a", "b"]  # either file type
    plain = tmp_path / "plain"
    export_model(_loaded("favor"), plain)
    capsys.readouterr()
    assert (
        main(["embed", str(plain), str(fasta), str(tmp_path / "x.h5"), "--include", "contacts"])
        == 2
    )
    assert "has no contact regression" in capsys.readouterr().err
