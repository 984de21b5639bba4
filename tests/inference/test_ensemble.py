"""PoET-style context ensembles: prompts averaged, built deterministically, filters exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.ensemble import ContextEnsemble, identity_to
from protein_performer.interop.export import export_model
from tests.inference.test_embedding import tiny_loaded

WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"


def _mutate(seq: str, where: list[int], to: str = "W") -> str:
    chars = list(seq)
    for i in where:
        chars[i] = to
    return "".join(chars)


#: The query itself, one with 5 of 33 letters changed inside (identity 28/33), and more.
HOMOLOGS = [
    ("same", WT),
    ("five", _mutate(WT, [5, 10, 15, 20, 25])),
    ("ten", _mutate(WT, [3, 6, 9, 12, 15, 18, 21, 24, 27, 30])),
    ("other", "GSGSPPGNNDDEEGGHHPPGWWCC"),
    ("short", WT[:20]),
]


@pytest.fixture(scope="module")
def lm() -> ProteinLM:
    return ProteinLM(tiny_loaded("clm"))


def test_identity_is_identical_pairs_over_the_shorter_length() -> None:
    ident = identity_to(WT, [s for _, s in HOMOLOGS])
    assert ident[0] == 1.0
    assert ident[1] == pytest.approx(28 / 33)
    assert ident[2] == pytest.approx(23 / 33)
    assert ident[3] < 0.3  # unrelated: a chance match of a few letters
    assert ident[4] == 1.0  # a fragment of the query


def test_identity_filters_drop_what_they_say(lm: ProteinLM) -> None:
    ens = lm.context(HOMOLOGS, query=WT, max_identity=[1.0, 0.9, 0.75])
    assert isinstance(ens, ContextEnsemble) and len(ens.prompts) == 3
    members = {p.max_identity: set(p.context.members) for p in ens.prompts}
    ident = dict(zip([rid for rid, _ in HOMOLOGS], ens.identities, strict=True))
    assert members[1.0] == {rid for rid, _ in HOMOLOGS}
    for limit in (0.9, 0.75):  # kept: exactly those at most `limit` identical
        assert members[limit] == {rid for rid, x in ident.items() if x <= limit}
    assert members[0.9] == {"five", "ten", "other"} and members[0.75] == {"ten", "other"}
    with pytest.raises(UserError, match="more identical to the query"):
        lm.context([HOMOLOGS[0]], query=WT, max_identity=[0.5])


def test_ensemble_score_is_the_mean_of_its_prompts_scored_one_by_one(lm: ProteinLM) -> None:
    ens = lm.context(
        HOMOLOGS, query=WT, max_identity=[1.0, 0.9], tokens=[40, 200], orders=1, seed=3
    )
    assert len(ens.prompts) == 2 * 2 * 2  # identities x budgets x (order, reversed)
    orders = {p.order for p in ens.prompts}
    assert orders == {"random 0", "random 0 reversed"}
    mutants = ["K2R", "T3S:Q9E", "L23A"]
    one_by_one = [lm.score_variants(WT, mutants, context=p.context) for p in ens.prompts]
    np.testing.assert_allclose(
        lm.score_variants(WT, mutants, context=ens), np.mean(one_by_one, axis=0), rtol=0,
        atol=1e-12,
    )  # fmt: skip
    seqs = [WT, WT[:25]]
    each = [lm.score(seqs, context=p.context) for p in ens.prompts]
    np.testing.assert_allclose(lm.score(seqs, context=ens), np.mean(each, axis=0), atol=1e-12)
    # generate spreads its sequences over the prompts in turn (issue 45: ensemble flags)
    assert len(lm.generate(n=2, max_length=10, context=ens)) == 2


def test_same_options_give_the_same_bytes(tmp_path: Path, capsys) -> None:
    clm = export_model(tiny_loaded("clm"), tmp_path / "clm")
    (tmp_path / "wt.fasta").write_text(f">wt\n{WT}\n")
    (tmp_path / "h.fasta").write_text("".join(f">{rid}\n{seq}\n" for rid, seq in HOMOLOGS))
    (tmp_path / "dms.csv").write_text("mutant,fit\nK2R,1\nT3S:Q9E,2\nL23A,0\n")
    outs = []
    for run in ("a", "b"):
        out = tmp_path / f"{run}.csv"
        argv = ["score-variants", str(clm), str(tmp_path / "wt.fasta"), str(tmp_path / "dms.csv"),
                str(out), "--context", str(tmp_path / "h.fasta"), "--context-max-identity",
                "1.0,0.8", "--context-tokens", "40,200", "--context-orders", "2",
                "--context-seed", "7", "--per-prompt", "--no-progress"]  # fmt: skip
        assert main(argv) == 0
        outs.append(out)
    assert "context: 16 prompt(s)" in capsys.readouterr().err
    a, b = outs
    assert a.read_bytes() == b.read_bytes()
    assert Path(f"{a}.context.json").read_bytes() == Path(f"{b}.context.json").read_bytes()
    record = json.loads(Path(f"{a}.context.json").read_text())
    assert record["seed"] == 7 and len(record["prompts"]) == 16
    header = a.read_text().splitlines()[0].split(",")
    assert header[:3] == ["mutant", "fit", "causal"] and len(header) == 3 + 16
    rows = [line.split(",") for line in a.read_text().splitlines()[1:]]
    for row in rows:  # the mean column is the mean of the per-prompt columns
        per = np.array([float(x) for x in row[3:]])
        assert float(row[2]) == pytest.approx(per.mean(), abs=2e-6)
    # Another seed, other orders: other prompts.
    argv[argv.index("7")] = "8"
    argv[argv.index(str(b))] = str(tmp_path / "c.csv")
    assert main(argv) == 0
    other = json.loads(Path(f"{tmp_path / 'c.csv'}.context.json").read_text())
    assert other["prompts"] != record["prompts"]


def test_an_ensemble_too_large_to_hold_is_one_line(lm: ProteinLM) -> None:
    """``--context-orders 1e8`` drew 4.4 GB of orders before anything said so (issue 42 #17)."""
    import time

    start = time.perf_counter()
    with pytest.raises(UserError, match=r"ensemble of 200000000 prompts .* more than 1024"):
        lm.context(HOMOLOGS, query=WT, orders=10**8)
    assert time.perf_counter() - start < 5
