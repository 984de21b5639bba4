"""ProteinDataset crops and layout, ProteinCollator's exact batch dict, CLM shift."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protein_performer.data.dataset import (
    InMemorySource,
    ProteinCollator,
    ProteinDataset,
    RecordSource,
)
from protein_performer.data.masking import IGNORE_INDEX
from protein_performer.data.tokenizer import Alphabet

A = Alphabet()


def in_memory_source(pairs: list[tuple[str, str]]) -> InMemorySource:
    """An :class:`InMemorySource` of ``(id, sequence)`` pairs (any case)."""
    return InMemorySource([i for i, _ in pairs], [A.encode(seq.upper()) for _, seq in pairs])


LONG = "".join(np.random.default_rng(0).choice(list("LAGVSERTIDPKQNFYMHWC"), 300))


def _residues(item: dict) -> str:
    return A.decode(item["tokens"])


def test_in_memory_source_is_a_record_source() -> None:
    src = in_memory_source([("x", "mkt"), ("y", "")])
    assert isinstance(src, RecordSource)
    assert len(src) == 2 and src.id(0) == "x" and src.length(0) == 3 and src.length(1) == 0
    assert src.lengths.tolist() == [3, 0]
    assert src.tokens(0).dtype == np.uint8


def test_short_records_are_not_cropped_and_lengths_match() -> None:
    src = in_memory_source([("s", "MKTAY"), ("l", LONG)])
    ds = ProteinDataset(src, objective="clm", max_len=12)
    assert ds.model_lengths().tolist() == [7, 12]
    item = ds[0]
    assert item["tokens"].tolist() == [A.cls_idx, *A.encode("MKTAY").tolist(), A.eos_idx]
    assert len(ds[1]["tokens"]) == 12


def test_fixed_crop_is_first_window_every_epoch() -> None:
    src = in_memory_source([("l", LONG)])
    ds = ProteinDataset(src, objective="clm", max_len=52, crop="fixed")
    for epoch in range(5):
        assert _residues(ds[(0, epoch)]) == LONG[:50]


def test_random_crop_windows_vary_and_cover_the_record() -> None:
    src = in_memory_source([("l", LONG)])
    ds = ProteinDataset(src, objective="clm", max_len=52, crop="random", seed=3)
    starts = []
    for epoch in range(200):
        window = _residues(ds[(0, epoch)])
        assert len(window) == 50
        start = LONG.find(window)
        assert start >= 0  # a contiguous piece of the record
        starts.append(start)
    assert len(set(starts)) > 50
    assert min(starts) < 25 and max(starts) > 225  # both ends reachable (0..250 allowed)
    # Same (seed, epoch, index) -> same window.
    assert _residues(ds[(0, 9)]) == _residues(ProteinDataset(src, "clm", 52, seed=3)[(0, 9)])


def test_collator_exact_clm_batch() -> None:
    src = in_memory_source([("p1", "MKTA"), ("p2", "GW")])
    ds = ProteinDataset(src, objective="clm", max_len=16)
    batch = ProteinCollator(A)([ds[0], ds[1]])
    assert set(batch) == {"tokens", "targets", "padding_mask", "ids"}
    # ESM-2 ids: <cls>=0 <pad>=1 <eos>=2, M=20 K=15 T=11 A=5 G=6 W=22.
    assert batch["tokens"].tolist() == [[0, 20, 15, 11, 5, 2], [0, 6, 22, 2, 1, 1]]
    assert batch["targets"].tolist() == [
        [20, 15, 11, 5, 2, -100],
        [6, 22, 2, -100, -100, -100],
    ]
    assert batch["padding_mask"].tolist() == [[False] * 6, [False] * 4 + [True] * 2]
    assert batch["ids"] == ["p1", "p2"]
    assert batch["tokens"].dtype == batch["targets"].dtype == torch.long
    assert batch["padding_mask"].dtype == torch.bool


def test_collator_mlm_batch_layout() -> None:
    src = in_memory_source([("p1", LONG[:40]), ("p2", LONG[:7])])
    ds = ProteinDataset(src, objective="mlm", max_len=64, seed=1)
    batch = ProteinCollator(A)([ds[0], ds[1]])
    tokens, targets, pad = batch["tokens"], batch["targets"], batch["padding_mask"]
    assert tokens.shape == targets.shape == pad.shape == (2, 42)
    assert tokens[:, 0].tolist() == [A.cls_idx] * 2
    assert tokens[0, 41] == A.eos_idx and tokens[1, 8] == A.eos_idx
    assert torch.all(tokens[1, 9:] == A.pad_idx) and torch.all(pad[1, 9:]) and not pad[1, :9].any()
    assert torch.all(targets[pad] == IGNORE_INDEX)
    original = torch.as_tensor(A.encode(LONG[:40]).astype(np.int64))
    sel = targets[0, 1:41] != IGNORE_INDEX
    assert torch.equal(targets[0, 1:41][sel], original[sel])
    assert 1 <= int((targets[1] != IGNORE_INDEX).sum()) <= 2


def test_clm_targets_are_the_input_shifted_by_one() -> None:
    src = in_memory_source([(f"r{i}", LONG[: 5 + 17 * i]) for i in range(6)])
    ds = ProteinDataset(src, objective="clm", max_len=1024)
    batch = ProteinCollator(A)([ds[i] for i in range(6)])
    tokens, targets, pad = batch["tokens"], batch["targets"], batch["padding_mask"]
    real_next = ~pad[:, 1:]
    assert torch.equal(targets[:, :-1][real_next], tokens[:, 1:][real_next])
    assert torch.all(targets[:, :-1][~real_next] == IGNORE_INDEX)
    assert torch.all(targets[:, -1] == IGNORE_INDEX)


def test_clm_crop_does_not_teach_false_termini() -> None:
    src = in_memory_source([("l", LONG)])
    fixed = ProteinDataset(src, objective="clm", max_len=12, crop="fixed")[0]
    # First window: real start (target at <cls> kept), artificial end (residue -> <eos> ignored).
    assert fixed["targets"][0] == A.tok_to_idx[LONG[0]]
    assert fixed["targets"][-2] == IGNORE_INDEX and fixed["targets"][-1] == IGNORE_INDEX
    rand = ProteinDataset(src, objective="clm", max_len=12, crop="random")
    mid = next(
        item
        for item in (rand[(0, e)] for e in range(50))
        if 0 < LONG.find(_residues(item)) < len(LONG) - 10
    )
    assert mid["targets"][0] == IGNORE_INDEX


@pytest.mark.parametrize(
    "kwargs", [{"objective": "bert"}, {"crop": "middle"}, {"max_len": 2}, {"seed": -1}]
)
def test_bad_arguments_are_user_errors(kwargs: dict) -> None:
    from protein_performer.errors import UserError

    with pytest.raises(UserError):
        ProteinDataset(in_memory_source([("x", "MK")]), **kwargs)
