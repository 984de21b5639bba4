"""MLM masking and causal targets: rates, what may never be touched, reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protein_performer.data.dataset import ProteinDataset
from protein_performer.data.masking import IGNORE_INDEX, causal_targets, mlm_mask
from protein_performer.data.tokenizer import Alphabet
from tests.data.test_dataset import in_memory_source

A = Alphabet()


def _batch(rng: np.random.Generator, B: int = 200, T: int = 502) -> np.ndarray:
    """(B, T) rows ``<cls> residues <eos> <pad>...`` with random lengths, all standard aa."""
    standard = np.asarray(A.standard_idx)
    rows = np.full((B, T), A.pad_idx, dtype=np.int64)
    for b in range(B):
        n = int(rng.integers(1, T - 1))
        rows[b, 0] = A.cls_idx
        rows[b, 1 : n + 1] = standard[rng.integers(0, 20, n)]
        rows[b, n + 1] = A.eos_idx
    return rows


def _within(observed: int, n: int, p: float, k: float = 4.0) -> bool:
    """Binomial count within k standard errors of its expectation."""
    return abs(observed - n * p) <= k * math.sqrt(n * p * (1 - p))


def test_rates_80_10_10_within_standard_error() -> None:
    tokens = _batch(np.random.default_rng(1))
    inputs, targets = mlm_mask(tokens, A, np.random.default_rng(2))
    residues = ~np.isin(tokens, A.special_idx)
    selected = targets != IGNORE_INDEX
    n_res, n_sel = int(residues.sum()), int(selected.sum())
    # Per row the count is floor(0.15 n + u): within one of 0.15 n, and 15% overall.
    per_row = selected.sum(1)
    assert np.all(np.abs(per_row - 0.15 * residues.sum(1)) < 1.0)
    assert abs(n_sel / n_res - 0.15) < 0.005
    masked = int((inputs[selected] == A.mask_idx).sum())
    changed = int(((inputs != tokens) & (inputs != A.mask_idx))[selected].sum())
    kept = int((inputs[selected] == tokens[selected]).sum())
    assert masked + changed + kept == n_sel
    assert _within(masked, n_sel, 0.8)
    # A random replacement draws the original letter 1 time in 20 and then looks "kept".
    assert _within(changed, n_sel, 0.1 * 19 / 20)
    assert _within(kept, n_sel, 0.1 + 0.1 / 20)
    assert np.isin(inputs[selected & (inputs != A.mask_idx)], A.standard_idx).all()


def test_random_replacements_are_uniform_over_standard_aa() -> None:
    tokens = _batch(np.random.default_rng(5), B=40, T=502)
    inputs, targets = mlm_mask(
        tokens, A, np.random.default_rng(6), mask_prob=0.5, mask_frac=0.0, random_frac=1.0
    )
    sel = targets != IGNORE_INDEX
    counts = np.bincount(inputs[sel], minlength=len(A))
    assert counts[list(set(range(len(A))) - set(A.standard_idx))].sum() == 0
    n = int(sel.sum())
    assert all(_within(int(counts[i]), n, 1 / 20, k=5.0) for i in A.standard_idx)


def test_targets_hold_originals_and_specials_pads_untouched() -> None:
    tokens = _batch(np.random.default_rng(3), B=50, T=40)
    inputs, targets = mlm_mask(tokens, A, np.random.default_rng(4), mask_prob=0.5)
    special = np.isin(tokens, A.special_idx)
    assert np.all(targets[special] == IGNORE_INDEX)
    assert np.array_equal(inputs[special], tokens[special])
    sel = targets != IGNORE_INDEX
    assert np.array_equal(targets[sel], tokens[sel])
    assert np.array_equal(inputs[~sel], tokens[~sel])  # unselected residues are never altered
    assert inputs.dtype == targets.dtype == np.int64


@pytest.mark.parametrize("n", [1, 2, 3])
def test_short_sequences_always_get_one_target(n: int) -> None:
    tokens = np.array([A.cls_idx] + [A.tok_to_idx["K"]] * n + [A.eos_idx, A.pad_idx])
    for seed in range(20):
        _, targets = mlm_mask(tokens, A, np.random.default_rng(seed))
        assert (targets != IGNORE_INDEX).sum() == 1
        assert targets[0] == targets[-1] == targets[-2] == IGNORE_INDEX


def test_no_residue_no_target() -> None:
    tokens = np.array([A.cls_idx, A.eos_idx, A.pad_idx])
    inputs, targets = mlm_mask(tokens, A, np.random.default_rng(0))
    assert np.array_equal(inputs, tokens)
    assert np.all(targets == IGNORE_INDEX)


def test_dataset_masks_reproducible_per_seed_epoch_index() -> None:
    src = in_memory_source([("a", "MKTAYIAKQRQISFVKSHFSRQ" * 10), ("b", "ACDEFG" * 30)])
    ds = ProteinDataset(src, objective="mlm", max_len=1024, seed=7)
    first = [ds[i] for i in range(2)]
    again = ProteinDataset(src, objective="mlm", max_len=1024, seed=7)
    for i in range(2):
        assert np.array_equal(first[i]["tokens"], again[i]["tokens"])
        assert np.array_equal(first[i]["targets"], again[i]["targets"])
    # An explicit (index, epoch) key is the same as set_epoch.
    again.set_epoch(3)
    assert np.array_equal(again[1]["targets"], ds[(1, 3)]["targets"])
    # Other epoch, seed or index -> another mask.
    assert not np.array_equal(ds[(0, 1)]["targets"], first[0]["targets"])
    other_seed = ProteinDataset(src, objective="mlm", max_len=1024, seed=8)
    assert not np.array_equal(other_seed[0]["targets"], first[0]["targets"])


def test_causal_targets_shift_and_ignore_end_and_pads() -> None:
    p = A.pad_idx
    tokens = np.array([[0, 5, 6, 7, 2], [0, 8, 2, p, p]])
    expected = np.array([[5, 6, 7, 2, -100], [8, 2, -100, -100, -100]])
    assert np.array_equal(causal_targets(tokens, p), expected)
    assert np.array_equal(causal_targets(tokens[1], p), expected[1])
