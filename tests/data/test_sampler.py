"""TokenBudgetBatchSampler: budget, coverage, DDP disjointness/equal counts, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from protein_performer.data.sampler import TokenBudgetBatchSampler

# Model lengths (residues + 2, capped at 1024) with a long tail, like real proteins.
LENGTHS = np.minimum(np.random.default_rng(0).lognormal(5.5, 0.8, 997).astype(int) + 2, 1024)


def _epoch(sampler: TokenBudgetBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_budget_and_max_batch_size_respected() -> None:
    s = TokenBudgetBatchSampler(LENGTHS, 4096, max_batch_size=16, seed=1)
    batches = _epoch(s, 0)
    for b in batches:
        assert len(b) <= 16
        assert len(b) * LENGTHS[b].max() <= 4096
    # Packing is tight: merging neighbours in length order would break the budget or the cap.
    assert len(batches) < 2 * (LENGTHS.sum() / 4096 + len(LENGTHS) / 16)


def _greedy(lengths: np.ndarray, max_tokens: int, cap: int) -> list[int]:
    """Record-by-record greedy packing (ESM's loop), the reference for the vectorised one."""
    sizes, n = [], 0
    for length in np.sort(lengths):
        if n and ((n + 1) * length > max_tokens or n + 1 > cap):
            sizes.append(n)
            n = 0
        n += 1
    return sizes + [n] if n else sizes


@pytest.mark.parametrize(("budget", "cap"), [(4096, 10**9), (2000, 7), (500, 3), (1024, 10**9)])
def test_packing_equals_record_by_record_greedy(budget: int, cap: int) -> None:
    s = TokenBudgetBatchSampler(LENGTHS, budget, max_batch_size=cap, bucket_width=1)
    assert [
        len(b)
        for b in TokenBudgetBatchSampler(
            LENGTHS, budget, max_batch_size=cap, bucket_width=1, shuffle=False
        )
    ] == _greedy(LENGTHS, budget, cap)
    assert len(s) == len(_greedy(LENGTHS, budget, cap))
    bucketed = TokenBudgetBatchSampler(LENGTHS, budget, max_batch_size=cap, bucket_width=8)
    assert len(bucketed) == len(_greedy((LENGTHS + 7) // 8 * 8, budget, cap))


def test_batches_change_composition_between_epochs() -> None:
    """Length buckets let records of similar length meet different neighbours each epoch."""
    s = TokenBudgetBatchSampler(LENGTHS, 4096, seed=0)
    pairs = [{frozenset(b) for b in _epoch(s, e)} for e in (0, 1)]
    assert len(pairs[0] & pairs[1]) < len(pairs[0]) / 2


def test_over_long_record_gets_its_own_batch() -> None:
    s = TokenBudgetBatchSampler([10, 10, 500, 10], 100, shuffle=False)
    assert list(s) == [[0, 1, 3], [2]]


def test_every_index_exactly_once_per_epoch_single_rank() -> None:
    s = TokenBudgetBatchSampler(LENGTHS, 8192, seed=2)
    for epoch in range(3):
        flat = np.concatenate(_epoch(s, epoch))
        assert np.array_equal(np.sort(flat), np.arange(len(LENGTHS)))
        assert len(list(s)) == len(s)


@pytest.mark.parametrize("replicas", [2, 3, 4, 8])
def test_ranks_disjoint_equal_counts_cover_everything(replicas: int) -> None:
    per_rank = []
    for rank in range(replicas):
        s = TokenBudgetBatchSampler(LENGTHS, 8192, seed=5, num_replicas=replicas, rank=rank)
        batches = _epoch(s, 1)
        assert len(batches) == len(s)
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1
    flat = np.concatenate([np.concatenate(b) for b in per_rank])
    # Splitting (not repetition) makes the count divisible: no record is seen twice.
    assert np.array_equal(np.sort(flat), np.arange(len(LENGTHS)))
    for b in (x for r in per_rank for x in r):
        assert len(b) * LENGTHS[b].max() <= 8192


def test_drop_last_gives_equal_disjoint_ranks() -> None:
    lengths = np.full(10, 50)  # 10 batches of one record each over 4 ranks -> 8 kept
    ranks = [
        list(TokenBudgetBatchSampler(lengths, 60, num_replicas=4, rank=r, drop_last=True))
        for r in range(4)
    ]
    assert [len(r) for r in ranks] == [2, 2, 2, 2]
    flat = [i for r in ranks for b in r for i in b]
    assert len(flat) == len(set(flat)) == 8


def test_fewer_records_than_ranks_pads_by_repetition() -> None:
    ranks = [
        list(TokenBudgetBatchSampler([30, 40, 50], 1000, num_replicas=4, rank=r)) for r in range(4)
    ]
    assert [len(r) for r in ranks] == [1, 1, 1, 1]
    flat = sorted(i for r in ranks for b in r for i in b)
    assert set(flat) == {0, 1, 2} and len(flat) == 4


def test_deterministic_per_seed_and_epoch() -> None:
    a = TokenBudgetBatchSampler(LENGTHS, 4096, seed=3)
    b = TokenBudgetBatchSampler(LENGTHS, 4096, seed=3)
    assert _epoch(a, 4) == _epoch(b, 4)
    assert _epoch(a, 4) != _epoch(a, 5)
    assert _epoch(a, 4) != _epoch(TokenBudgetBatchSampler(LENGTHS, 4096, seed=4), 4)
    # Batch count does not depend on the epoch (Lightning reads len() once).
    assert len({len(_epoch(a, e)) for e in range(4)}) == 1


def test_no_shuffle_is_ascending_length_and_epoch_independent() -> None:
    s = TokenBudgetBatchSampler(LENGTHS, 4096, shuffle=False)
    batches = _epoch(s, 0)
    assert batches == _epoch(s, 7)
    flat = np.concatenate(batches)
    assert np.all(np.diff(LENGTHS[flat]) >= 0)


def test_tag_epoch_yields_index_epoch_pairs() -> None:
    s = TokenBudgetBatchSampler([5, 6, 7], 100, tag_epoch=True)
    s.set_epoch(2)
    (batch,) = list(s)
    assert sorted(batch) == [(0, 2), (1, 2), (2, 2)]


def test_lightning_hook_forwards_set_epoch() -> None:
    """Lightning calls ``batch_sampler.sampler.set_epoch``, not ``batch_sampler.set_epoch``."""
    s = TokenBudgetBatchSampler(LENGTHS, 4096, seed=1)
    s.sampler.set_epoch(6)
    assert s.epoch == 6 and list(s) == _epoch(TokenBudgetBatchSampler(LENGTHS, 4096, seed=1), 6)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        TokenBudgetBatchSampler([5], 0)
    with pytest.raises(ValueError):
        TokenBudgetBatchSampler([5], 10, num_replicas=2, rank=2)


@pytest.mark.parametrize("replicas", [1, 3])
def test_start_batch_skips_exactly_the_first_batches(replicas: int) -> None:
    """Mid-epoch resume: starting at batch k gives the rest of the uninterrupted epoch."""

    def make(rank: int) -> TokenBudgetBatchSampler:
        return TokenBudgetBatchSampler(
            LENGTHS, 4096, seed=2, num_replicas=replicas, rank=rank, tag_epoch=True
        )

    for rank in range(replicas):
        full = _epoch(make(rank), 3)
        for k in (0, 1, 5, len(full) - 1, len(full), len(full) + 4):
            s = make(rank)
            s.set_epoch(3)
            s.start_batch = k
            it = iter(s)  # start_batch is bound here, the epoch at the first next()
            s.start_batch = 0
            assert list(it) == full[k:]
            assert list(s) == full  # later iterations start at the beginning again
    with pytest.raises(ValueError):
        s = TokenBudgetBatchSampler(LENGTHS, 4096)
        s.start_batch = -1
        list(s)
