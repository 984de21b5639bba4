"""inference.contacts: APC, precision@L, the L1 regression, JSON round trip, the null baseline."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.contacts.fit import (
    default_regression_path,
    fit_regression,
    null_prediction,
    permutation_for,
    permute_maps,
    precision_at,
    training_pairs,
)
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.identity import model_identity
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import (
    ContactRegression,
    apc,
    contact_features,
    symmetrize,
)
from protein_performer.model.performer import PerformerLM


def test_apc_hand_computed() -> None:
    # row sums 3, 7; column sums 4, 6; total 10 -> correction a_i a_j / 10
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    expected = x - np.array([[3 * 4, 3 * 6], [7 * 4, 7 * 6]]) / 10
    np.testing.assert_allclose(apc(x), expected)
    np.testing.assert_allclose(apc(x), [[-0.2, 0.2], [0.2, -0.2]], atol=1e-12)
    np.testing.assert_allclose(symmetrize(x), [[2, 5], [5, 8]])
    maps = np.stack([np.stack([x, 2 * x])])  # (1 layer, 2 heads, 2, 2)
    feats = contact_features(maps)
    assert feats.shape == (2, 2, 2)
    np.testing.assert_allclose(feats[..., 1], apc(symmetrize(2 * x)), rtol=1e-6)


def test_precision_hand_example() -> None:
    L = 30  # top L = 30, L/2 = 15, L/5 = 6 pairs
    pred = np.zeros((L, L))
    contacts = np.zeros((L, L), dtype=bool)
    valid = np.ones((L, L), dtype=bool)
    long_pairs = [(0, 24), (1, 25), (2, 26), (3, 27), (4, 28), (5, 29)]  # the 6 best long pairs
    for rank, (i, j) in enumerate(long_pairs):
        pred[i, j] = 1.0 - rank / 100
    for i, j in long_pairs[::2]:  # 3 of the 6 are contacts
        contacts[i, j] = contacts[j, i] = True
    contacts[0, 6] = True  # one short contact at the top of the short range
    pred[0, 6] = 0.99
    out = precision_at(pred, contacts, valid)
    assert out["P@L/5_long"] == pytest.approx(3 / 6)
    assert out["P@L/2_long"] == pytest.approx(3 / 15)
    assert out["P@L/5_short"] == pytest.approx(1 / 6)
    assert out["P@L/5_medium"] == 0.0
    # an unobserved residue removes its pairs: now 2 of the 5 scoreable top pairs remain hits
    valid[0, :] = valid[:, 0] = False
    assert precision_at(pred, contacts, valid)["P@L/5_long"] == pytest.approx(2 / 6)
    short = precision_at(pred[:5, :5], contacts[:5, :5], valid[:5, :5])
    assert math.isnan(short["P@L_long"])  # no pair that far apart


def synthetic(seed: int, L: int = 60, signal: tuple[int, int] = (1, 2)):
    """Maps (2 layers, 3 heads, L, L) of noise; one head also carries the contacts."""
    rng = np.random.default_rng(seed)
    contacts = np.zeros((L, L), dtype=bool)
    for _ in range(40):
        i, j = sorted(rng.choice(L, 2, replace=False))
        if j - i >= 6:
            contacts[i, j] = contacts[j, i] = True
    maps = rng.random((2, 3, L, L)) * 0.1
    maps[signal] += 0.3 * contacts
    maps /= maps.sum(-1, keepdims=True)
    return maps, contacts


def test_regression_recovers_the_contact_head() -> None:
    X, y = [], []
    for seed in range(4):
        maps, contacts = synthetic(seed)
        xi, yi = training_pairs(contact_features(maps), contacts, np.ones_like(contacts))
        X.append(xi)
        y.append(yi)
    reg = fit_regression(np.concatenate(X), np.concatenate(y), [1, 2], [0, 1, 2], C=0.15)
    grid = reg.coef_grid()
    assert grid[1, 2] > 0 and abs(grid[1, 2]) == np.abs(grid).max()
    maps, contacts = synthetic(99)
    out = precision_at(reg.predict_maps(maps), contacts, np.ones_like(contacts))
    assert out["P@L/5_long"] > 0.9
    with pytest.raises(UserError, match="all non-contacts"):
        fit_regression(np.concatenate(X), np.zeros(len(np.concatenate(y))), [1, 2], [0, 1, 2])


def test_json_round_trip_and_checks(tmp_path: Path, caplog) -> None:
    cfg = PerformerConfig(dim=18, depth=2, heads=3, ff_dim=32, nb_features=8)
    cpu = torch.device("cpu")
    loaded = LoadedModel(PerformerLM(cfg), cfg, Alphabet(), Path("m"), cpu, "lightning")
    reg = ContactRegression(
        np.array([0.5, -1.0, 0.0, 2.0, 0.25, -0.125]), -3.5, [1, 2], [0, 1, 2],
        meta={"C": 0.15, "fit_on": ["a", "b"]}, **model_identity(loaded),
    )  # fmt: skip
    path = reg.save(tmp_path / "sub" / "reg.json")
    data = json.loads(path.read_text())
    assert data["format"] == "protein_performer.contact_regression" and data["fit_on"] == [
        "a",
        "b",
    ]
    assert data["layout"] == {"depth": 2, "heads": 3, "objective": "mlm"}
    back = ContactRegression.load(path)
    np.testing.assert_array_equal(back.coef, reg.coef)
    assert (back.intercept, back.layers, back.heads) == (-3.5, [1, 2], [0, 1, 2])
    assert back.model_sha256 == reg.model_sha256 and back.meta["C"] == 0.15
    maps, _ = synthetic(0)
    np.testing.assert_array_equal(back.predict_maps(maps), reg.predict_maps(maps))
    back.check_model(loaded)
    # A config field that changes neither the layout nor the weights leaves it valid ...
    other = dataclasses.replace(cfg, feature_redraw_interval=7, favor_chunk_size=64)
    caplog.clear()
    back.check_model(dataclasses.replace(loaded, config=other))
    assert not caplog.records
    # ... other weights of the same layout get a warning; another layout is refused.
    torch.manual_seed(1)
    back.check_model(dataclasses.replace(loaded, model=PerformerLM(cfg), source=Path("m2")))
    assert "fitted on other weights" in caplog.text
    two_heads = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, nb_features=8)
    with pytest.raises(UserError, match="another attention layout"):
        back.check_model(dataclasses.replace(loaded, config=two_heads, source=Path("m3")))
    path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        ContactRegression.load(path)
    path.write_text(json.dumps({**data, "coef": [1.0]}))
    with pytest.raises(UserError, match="coefficients"):
        ContactRegression.load(path)
    assert default_regression_path(tmp_path / "last.ckpt").name == "last.contact_regression.json"
    assert default_regression_path(tmp_path) == tmp_path / "contact_regression.json"


def test_null_uses_one_permutation_on_both_axes() -> None:
    maps, contacts = synthetic(3)
    perm = permutation_for("prot", maps.shape[-1], seed=0)
    assert sorted(perm.tolist()) == list(range(maps.shape[-1]))
    np.testing.assert_array_equal(perm, permutation_for("prot", maps.shape[-1], seed=0))
    assert not np.array_equal(perm, permutation_for("prot", maps.shape[-1], seed=1))
    shuffled = permute_maps(maps, perm)
    np.testing.assert_array_equal(shuffled, maps[:, :, perm][:, :, :, perm])
    sym = symmetrize(maps[0, 0])
    np.testing.assert_array_equal(permute_maps(sym, perm), permute_maps(sym, perm).T)
    reg = ContactRegression(np.array([0, 0, 0, 0, 0, 5.0]), -1.0, [1, 2], [0, 1, 2])
    real = reg.predict_maps(maps)
    null = null_prediction(reg, maps, "prot", seed=0)
    # the prediction is equivariant: the null is the real prediction with rows+columns shuffled
    np.testing.assert_allclose(null, real[perm][:, perm], rtol=1e-5)
    valid = np.ones_like(contacts)
    assert (
        precision_at(null, contacts, valid)["P@L/5_long"]
        < precision_at(real, contacts, valid)["P@L/5_long"]
    )
