"""Issue 45 #5 and #13: pseudo-perplexity's progress (with an ETA) and its cheaper spaced
estimate; per-position scores with and without a family context; the ensemble flags of
`score`."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.errors import UserError
from protein_performer.inference.scoring import pll_position_sets, pseudo_log_likelihoods
from protein_performer.interop.export import export_model
from tests.inference.test_context import CANDIDATES, FAMILY, tiny_lm

SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV", "MLLAVLYCLAVF"]


def test_spaced_sets_cover_every_residue_once() -> None:
    for length, rate, passes in ((32, None, 32), (32, 0.1, 10), (32, 0.5, 2), (5, 0.1, 5)):
        sets = pll_position_sets(length, rate)
        assert len(sets) == passes
        assert sorted(i for s in sets for i in s) == list(range(length))


def test_rate_estimate_is_exact_at_one_residue_per_pass_and_close_otherwise() -> None:
    lm = tiny_lm(objective="mlm")
    exact = pseudo_log_likelihoods(lm.loaded, SEQS[0])
    same = pseudo_log_likelihoods(lm.loaded, SEQS[0], rate=1 / len(SEQS[0]))
    np.testing.assert_allclose(same, exact, atol=1e-6)  # a stride of L: one residue a pass
    rough = pseudo_log_likelihoods(lm.loaded, SEQS[0], rate=0.25)
    assert rough.shape == exact.shape and not np.allclose(rough, exact)
    got = lm.score(SEQS, pll_rate=0.25)
    assert got[0] == pytest.approx(rough.mean())
    with pytest.raises(UserError, match="pll_rate must be in"):
        lm.score(SEQS, pll_rate=0.9)
    with pytest.raises(UserError, match="pll_rate is for strategy 'pseudo-ppl'"):
        tiny_lm().score(SEQS, pll_rate=0.1)


def test_score_progress_shows_an_eta(capsys, monkeypatch) -> None:
    """In a log (stderr not a terminal), the score's lines carry the total and remaining time."""
    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "0")
    tiny_lm(objective="mlm").score(SEQS, progress=True)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("score:")]
    total = sum(len(s) for s in SEQS)
    assert lines and all(f"/{total}" in x and "<" in x for x in lines), lines


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_per_position_scores_sum_to_the_score(objective) -> None:
    lm = tiny_lm(objective=objective)
    means = lm.score(SEQS)
    terms = lm.score(SEQS, per_position=True)
    extra = 1 if objective == "clm" else 0  # causal: the <eos> term last
    assert [t.shape for t in terms] == [(len(s) + extra,) for s in SEQS]
    np.testing.assert_allclose([t.mean() for t in terms], means, atol=1e-9)


def test_per_position_scores_with_a_context_and_an_ensemble() -> None:
    lm = tiny_lm()
    ctx = lm.context(FAMILY)
    terms = lm.score(CANDIDATES, context=ctx, per_position=True)
    np.testing.assert_allclose([t.mean() for t in terms], lm.score(CANDIDATES, context=ctx))
    bare = lm.score(CANDIDATES, per_position=True)
    assert not np.allclose(terms[0], bare[0])
    ens = lm.context(FAMILY, orders=1)
    per_prompt = [lm.score(CANDIDATES, context=p.context, per_position=True)
                  for p in ens.prompts]  # fmt: skip
    got = lm.score(CANDIDATES, context=ens, per_position=True)
    for i in range(len(CANDIDATES)):
        np.testing.assert_allclose(got[i], np.mean([p[i] for p in per_prompt], axis=0))


def test_score_cli_takes_the_ensemble_flags_and_pll_rate(tmp_path, capsys) -> None:
    lm = tiny_lm()
    ckpt = export_model(lm.loaded, tmp_path / "clm")
    homologs = tmp_path / "homologs.fasta"
    homologs.write_text("".join(f">{i}\n{s}\n" for i, s in FAMILY))
    cands = tmp_path / "cands.fasta"
    cands.write_text("".join(f">c{i}\n{s}\n" for i, s in enumerate(CANDIDATES)))
    out = tmp_path / "s.csv"
    assert main(["score", str(ckpt), str(cands), str(out), "--context", str(homologs),
                 "--context-orders", "1", "--context-tokens", "60,200", "--no-progress"]) == 0
    assert "4 prompt(s)" in capsys.readouterr().err
    with open(out, newline="") as fh:
        got = [float(r["mean_log_likelihood"]) for r in csv.DictReader(fh)]
    ens = lm.context(str(homologs), orders=1, tokens=[60, 200])
    np.testing.assert_allclose(got, lm.score(CANDIDATES, context=ens), atol=1e-5)

    mlm = export_model(tiny_lm(objective="mlm").loaded, tmp_path / "mlm")
    est = tmp_path / "est.csv"
    assert main(["score", str(mlm), str(cands), str(est), "--pll-rate", "0.25",
                 "--no-progress"]) == 0  # fmt: skip
    assert "(--pll-rate 0.25 estimate)" in capsys.readouterr().out
    with open(est, newline="") as fh:
        got = [float(r["mean_log_likelihood"]) for r in csv.DictReader(fh)]
    np.testing.assert_allclose(got, tiny_lm(objective="mlm").score(CANDIDATES, pll_rate=0.25),
                               atol=1e-5)


def test_generate_takes_the_ensemble_flags(tmp_path, capsys) -> None:
    """Sequence i follows prompt i mod P: the same sequence as generating it after that
    prompt's context alone (seeded by (seed, i) whatever the batch)."""
    lm = tiny_lm()
    ckpt = export_model(lm.loaded, tmp_path / "clm")
    homologs = tmp_path / "homologs.fasta"
    homologs.write_text("".join(f">{i}\n{s}\n" for i, s in FAMILY))
    out = tmp_path / "g.fasta"
    assert main(["generate", str(ckpt), str(out), "--num", "4", "--max-length", "12",
                 "--context", str(homologs), "--context-orders", "1", "--no-progress"]) == 0
    text = out.read_text().split(">")[1:]
    ens = lm.context(str(homologs), orders=1)
    assert len(ens.prompts) == 2
    for i, record in enumerate(text):
        header, seq = record.split("\n")[:2]
        label = ens.prompts[i % 2].label
        assert f"context={label}" in header
        alone = list(lm.iter_generate(n=i + 1, max_length=12,
                                      context=ens.prompts[i % 2].context))[i]  # fmt: skip
        assert seq == alone.sequence
