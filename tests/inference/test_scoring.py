"""inference.scoring: exact PLL/LL against naive loops, variant strategies, mutation names."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.scoring import (
    parse_mutant,
    pseudo_log_likelihoods,
    score_sequences,
    score_variants,
)
from protein_performer.jobs.score import score_fasta
from tests.inference.test_embedding import tiny_loaded
from tests.paths import SHARED as SHARED_DIR

WT = "MKTAYIAKQRQISFVKSHFSRQ"
SHARED = SHARED_DIR / "data" / "dms"


def read_csv(path: Path, delimiter: str = ",") -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh, delimiter=delimiter))


def _tokens(loaded, seq: str) -> torch.Tensor:
    return torch.as_tensor(loaded.alphabet.encode_with_specials(seq))[None]


def naive_pll_terms(loaded, seq: str) -> np.ndarray:
    """One forward per residue, residue i at token i + 1: the reference."""
    terms = []
    for i in range(len(seq)):
        tokens = _tokens(loaded, seq)
        true = int(tokens[0, i + 1])
        tokens[0, i + 1] = loaded.alphabet.mask_idx
        with torch.no_grad():
            logits = loaded.model(tokens).logits[0, i + 1]
        terms.append(float(torch.log_softmax(logits.double(), -1)[true]))
    return np.array(terms)


def naive_ll(loaded, seq: str) -> float:
    tokens = _tokens(loaded, seq)
    with torch.no_grad():
        lp = torch.log_softmax(loaded.model(tokens).logits[0].double(), -1)
    return float(sum(lp[t, tokens[0, t + 1]] for t in range(len(seq) + 1)))  # residues + <eos>


def test_pseudo_ppl_equals_one_mask_at_a_time() -> None:
    loaded = tiny_loaded()
    expected = naive_pll_terms(loaded, WT)
    for budget in (1, 60, 10_000):  # 1 copy per pass, a few, all at once
        got = pseudo_log_likelihoods(loaded, WT, toks_per_batch=budget)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    (score,) = score_sequences(loaded, [("wt", WT)], "pseudo-ppl")
    assert score.n_scored == len(WT)
    assert score.log_likelihood == pytest.approx(expected.sum(), rel=1e-5)
    assert score.perplexity == pytest.approx(np.exp(-expected.mean()), rel=1e-5)


def test_causal_equals_manual_log_softmax_sum() -> None:
    loaded = tiny_loaded("clm")
    seqs = [("a", WT), ("b", "MLLAV"), ("c", "G")]
    scores = score_sequences(loaded, seqs, "causal", toks_per_batch=30)  # padded batches
    for (_, seq), s in zip(seqs, scores, strict=True):
        assert s.n_scored == len(seq) + 1
        assert s.log_likelihood == pytest.approx(naive_ll(loaded, seq), rel=1e-5, abs=1e-5)


def test_strategy_must_match_objective(tmp_path: Path) -> None:
    (tmp_path / "x.fasta").write_text(f">x\n{WT}\n")
    with pytest.raises(UserError, match="causal-LM.*use --strategy pseudo-ppl"):
        score_fasta(
            ProteinLM(tiny_loaded("mlm")), tmp_path / "x.fasta", tmp_path / "o.csv", "causal"
        )
    with pytest.raises(UserError, match="masked-LM.*use --strategy causal"):
        score_variants(tiny_loaded("clm"), WT, [], "masked-marginals")
    assert not (tmp_path / "o.csv").exists()


def test_parse_mutant() -> None:
    muts = parse_mutant("K2R:T3S", WT)
    assert [(m.wt, m.position, m.mt, m.index) for m in muts] == [
        ("K", 2, "R", 1),
        ("T", 3, "S", 2),
    ]
    assert [m.index for m in parse_mutant("M24A", WT, offset=24)] == [0]
    assert parse_mutant("WT", WT) == []
    for text, match in [
        ("A2R", "does not match.*has K"),
        ("M0A", "outside"),
        ("K2R:K2A", "twice"),
        ("K2", "cannot parse"),
        ("", "empty"),
        ("K2J", "not in the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_mutant(text, WT)


def test_masked_marginals_equals_manual_computation() -> None:
    loaded = tiny_loaded()
    a = loaded.alphabet
    variant = parse_mutant("K2R:Q9E", WT)
    tokens = _tokens(loaded, WT)
    tokens[0, [2, 9]] = a.mask_idx  # residues 2 and 9 (1-based) are tokens 2 and 9 (BOS offset)
    with torch.no_grad():
        lp = torch.log_softmax(loaded.model(tokens).logits[0].double(), -1)
    expected = float(
        lp[2, a.tok_to_idx["R"]]
        - lp[2, a.tok_to_idx["K"]]
        + lp[9, a.tok_to_idx["E"]]
        - lp[9, a.tok_to_idx["Q"]]
    )
    single = parse_mutant("T3S", WT)
    got = score_variants(loaded, WT, [variant, single, []], "masked-marginals", toks_per_batch=30)
    assert got[0] == pytest.approx(expected, abs=1e-5)
    assert got[2] == 0.0
    # wt-marginals: the same sum from the unmasked wild type.
    with torch.no_grad():
        lpw = torch.log_softmax(loaded.model(_tokens(loaded, WT)).logits[0].double(), -1)
    s_idx, t_idx = a.tok_to_idx["S"], a.tok_to_idx["T"]
    (wt_m,) = score_variants(loaded, WT, [single], "wt-marginals")
    assert wt_m == pytest.approx(float(lpw[3, s_idx] - lpw[3, t_idx]), abs=1e-5)


def test_whole_sequence_strategies() -> None:
    mlm, clm = tiny_loaded(), tiny_loaded("clm")
    variant = parse_mutant("K2R:T3S", WT)
    mutant = "MRS" + WT[3:]
    (pll,) = score_variants(mlm, WT, [variant], "pseudo-ppl", toks_per_batch=200)
    assert pll == pytest.approx(
        naive_pll_terms(mlm, mutant).sum() - naive_pll_terms(mlm, WT).sum(), abs=1e-4
    )
    (ll,) = score_variants(clm, WT, [variant], "causal")
    assert ll == pytest.approx(naive_ll(clm, mutant) - naive_ll(clm, WT), abs=1e-4)
