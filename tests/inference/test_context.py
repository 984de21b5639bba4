"""Family context (inference/context.py, PerformerLM.extend, the cores' extend): scoring after
a cached context equals the causal forward of the concatenated row; the context is immutable
and of fixed size for FAVOR+; masked models refuse one; generation after it is seeded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.data.tokenizer import STANDARD_AA, Alphabet
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.context import FamilyContext
from protein_performer.interop.record import LoadedModel
from protein_performer.model.attention import state_tensors
from protein_performer.model.config import PerformerConfig
from protein_performer.model.favor import KERNELS
from protein_performer.model.performer import PerformerLM
from protein_performer.model.rotary import member_positions

FAMILY = [
    ("h1", "MKTAYIAKQRQISFVKSHFSRQ"),
    ("h2", "MKTAYLAKQRQISFVKSHFARQLEE"),
    ("h3", "MRTAYIAKQRQLSFVKSHF"),
]
CANDIDATES = ["MKTAYIAKQRQISFVKSHFSRQ", "MKSAYIAKQ", "MKTAYIAKQRQISWVKSHFSRQAAG"]
VARIANTS = [(a, k) for a in ("favor", "exact") for k in (KERNELS if a == "favor" else ["-"])]


#: The newer cores, through the same model calls: linear attention (alone and with its exact
#: window) and the position memory (which needs member positions: a config says so).
CORES = {
    "linear": {"attention": "linear", "kernel": "taylor"},
    "window": {"attention": "linear", "kernel": "taylor", "local_window": 4},
    "memory": {"attention": "favor", "position_memory": 64},
}
NEEDS_MEMBER = {"memory"}


def tiny_lm(
    attention: str = "favor",
    kernel: str = "softmax",
    positions: str = "sequence",
    objective: str = "clm",
    seed: int = 0,
    chunk: int | None = 8,
    **extra,
) -> ProteinLM:
    torch.manual_seed(seed)
    config = PerformerConfig(
        dim=32,
        depth=2,
        heads=4,
        ff_dim=64,
        objective=objective,
        attention=attention,
        kernel=kernel if attention != "exact" else "softmax",
        nb_features=16,
        positions=positions,
        favor_chunk_size=chunk,
        **extra,
    )
    model = PerformerLM(config).eval()
    for layer in model.layers:  # a stabilizer that matters: softmax_opt's fixed statistic
        core = layer.self_attn.core
        if hasattr(core, "oprf_rho"):
            core.oprf_rho.fill_(0.7)
    loaded = LoadedModel(model, config, Alphabet(), Path("tiny"), torch.device("cpu"), "memory")
    return ProteinLM(loaded)


def concatenated_terms(
    lm: ProteinLM, family: list[tuple[str, str]], seq: str, eos: bool = True
) -> np.ndarray:
    """Log-likelihoods of seq's residues (and <eos>) in one causal forward of the row."""
    a = lm.alphabet
    ids: list[int] = []
    for _, s in family:
        ids += [a.cls_idx, *a.encode(s).tolist(), a.eos_idx]
    start = len(ids)
    ids += [a.cls_idx, *a.encode(seq).tolist(), *([a.eos_idx] if eos else [])]
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        lp = torch.log_softmax(lm.model(tokens).logits[0].float(), -1)  # (T, V)
    picked = lp[start : len(ids) - 1].gather(-1, tokens[0, start + 1 :, None])[:, 0]
    return picked.double().numpy()


def concatenated_scores(lm: ProteinLM, family: list[tuple[str, str]], seq: str) -> float:
    """Mean log-likelihood of seq's residues and <eos> in one causal forward of the row."""
    return float(concatenated_terms(lm, family, seq).mean())


@pytest.mark.parametrize("positions", ["sequence", "member"])
@pytest.mark.parametrize(("attention", "kernel"), VARIANTS)
def test_context_scores_equal_the_concatenated_forward(attention, kernel, positions):
    lm = tiny_lm(attention, kernel, positions)
    ctx = lm.context(FAMILY)
    got = lm.score(CANDIDATES, context=ctx)
    want = [concatenated_scores(lm, FAMILY, s) for s in CANDIDATES]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # and the context matters: without it the numbers differ
    assert not np.allclose(lm.score(CANDIDATES), got, atol=1e-4)


@pytest.mark.parametrize("positions", ["sequence", "member"])
@pytest.mark.parametrize("name", CORES)
def test_linear_and_memory_contexts_continue_the_row(name, positions):
    """``lm.context`` with the linear cores and with the position memory: scores after it equal
    the concatenated forward, and so do the log-probs of sequences generated after it (each
    token a step from the context's states: step == forward); the context is never written."""
    if name in NEEDS_MEMBER and positions != "member":
        with pytest.raises(UserError, match="needs positions=member"):
            tiny_lm(positions=positions, **CORES[name])
        return
    lm = tiny_lm(positions=positions, **CORES[name])
    ctx = lm.context(FAMILY)
    before = [t.clone() for t in state_tensors(ctx.states)]
    got = lm.score(CANDIDATES, context=ctx)
    want = [concatenated_scores(lm, FAMILY, s) for s in CANDIDATES]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert not np.allclose(lm.score(CANDIDATES), got, atol=1e-4)
    for prompt in ("", "MK"):
        for g in lm.iter_generate(n=3, max_length=15, prompt=prompt, context=ctx, seed=3):
            terms = concatenated_terms(lm, FAMILY, g.sequence, eos=g.ended == "eos")
            np.testing.assert_allclose(g.token_log_probs, terms[len(prompt) :], atol=1e-4)
    assert all(map(torch.equal, before, state_tensors(ctx.states)))



@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_extend_in_segments_equals_one_forward(attention):
    """The model-level primitive: a row read in pieces from states equals the row at once,
    also for a batch of continuations with right padding (the state broadcast over it)."""
    lm = tiny_lm(attention, chunk=4)
    model, a = lm.model, lm.alphabet
    row = torch.tensor([[a.cls_idx, *a.encode("MKTAYIAKQRQISFVKSHF").tolist(), a.eos_idx]])
    with torch.inference_mode():
        whole = model(row).logits
        first, states = model.extend(row[:, :9], None, 0, return_states=True)
        second, _ = model.extend(row[:, 9:], states, 9)
        torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)
        batch = torch.full((2, 12), a.pad_idx)
        batch[0, :12] = row[0, 9:]
        batch[1, :5] = row[0, 9:14]
        both, _ = model.extend(batch, states, 9)
        torch.testing.assert_close(both[0], whole[0, 9:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(both[1, :5], whole[0, 9:14], atol=1e-5, rtol=1e-5)


def test_member_positions_restart_at_every_cls():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 2, 0, 9, 2]])
    assert member_positions(tokens, 0, offset=3).tolist() == [[3, 4, 0, 1, 2, 3, 0, 1, 2]]
    lm = tiny_lm(positions="member")
    one = lm.alphabet.encode_batch(["MKTAYIAKQ"])
    seq = tiny_lm(positions="sequence")
    with torch.inference_mode():  # a lone sequence: the same positions in both modes
        torch.testing.assert_close(lm.model(one).logits, seq.model(one).logits, atol=0, rtol=0)


def test_config_positions_default_and_old_checkpoints():
    config = PerformerConfig()
    assert config.positions == "member" and config.context_tokens is None
    old = {k: v for k, v in config.to_dict().items() if k not in ("positions", "context_tokens")}
    assert PerformerConfig.from_dict(old).positions == "sequence"
    with pytest.raises(UserError, match="positions"):
        PerformerConfig(positions="row").validate()


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_context_is_immutable(attention):
    lm = tiny_lm(attention)
    ctx = lm.context(FAMILY)
    before = [t.clone() for s in ctx.states for t in s]
    first = lm.score(CANDIDATES[:1], context=ctx)[0]
    rng = np.random.default_rng(0)
    many = ["".join(rng.choice(list(STANDARD_AA), size=rng.integers(3, 9))) for _ in range(1000)]
    scores = lm.score(many, toks_per_batch=2048, context=ctx)
    assert np.isfinite(scores).all()
    lm.generate(n=2, max_length=6, context=ctx, seed=1)
    last = lm.score(CANDIDATES[:1], context=ctx)[0]
    assert first == last
    after = [t for s in ctx.states for t in s]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_favor_context_bytes_do_not_grow_with_the_context():
    lm = tiny_lm("favor", chunk=None)
    rng = np.random.default_rng(0)

    def family(tokens: int) -> list[str]:
        n = tokens // 100
        return ["".join(rng.choice(list(STANDARD_AA), size=98)) for _ in range(n)]

    small, large = lm.context(family(1000)), lm.context(family(64000))
    assert small.n_tokens == 1000 and large.n_tokens == 64000
    assert small.nbytes == large.nbytes > 0
    exact = tiny_lm("exact")
    assert exact.context(family(1000)).nbytes > small.nbytes  # a KV cache grows instead
    # what a candidate token reads: nothing of a fixed-size state, the whole context as soon
    # as one layer keeps a KV cache (a hybrid stack's exact layers: issue 40)
    assert small.attended_tokens == 0
    assert exact.context(family(1000)).attended_tokens == 1000
    assert tiny_lm("favor", exact_every=2).context(family(1000)).attended_tokens == 1000


def test_max_tokens_drops_whole_members_and_reports(caplog):
    lm = tiny_lm()
    with caplog.at_level("WARNING"):
        ctx = lm.context(FAMILY, max_tokens=60)
    assert ctx.members == ("h1", "h2") and ctx.dropped == ("h3",) and ctx.n_tokens == 24 + 27
    assert "read 2 of 3 homolog(s) (51 tokens): the other 1 would pass 60 tokens" in caplog.text
    with pytest.raises(UserError, match="smaller than the first homolog"):
        lm.context(FAMILY, max_tokens=10)


def test_context_from_a_fasta_file(tmp_path):
    fasta = tmp_path / "family.fasta"
    fasta.write_text("".join(f">{rid} some description\n{seq}\n" for rid, seq in FAMILY))
    lm = tiny_lm()
    ctx = lm.context(fasta)
    assert isinstance(ctx, FamilyContext) and ctx.members == ("h1", "h2", "h3")
    np.testing.assert_array_equal(
        lm.score(CANDIDATES, context=ctx), lm.score(CANDIDATES, context=lm.context(FAMILY))
    )


def test_masked_model_refuses_a_context():
    lm = tiny_lm(objective="mlm")
    with pytest.raises(UserError, match="masked LM .* needs a causal model"):
        lm.context(FAMILY)


def test_score_variants_with_context_is_the_difference_of_scores():
    lm = tiny_lm()
    ctx = lm.context(FAMILY)
    wt = CANDIDATES[0]
    got = lm.score_variants(wt, ["wt", "K2R", "M1A:K2R"], context=ctx)
    ll = {}
    for s in (wt, "M" + "R" + wt[2:], "A" + "R" + wt[2:]):
        ll[s] = lm.score(s, context=ctx)[0] * (len(s) + 1)
    assert got[0] == 0.0
    np.testing.assert_allclose(
        got[1:], [ll["MR" + wt[2:]] - ll[wt], ll["AR" + wt[2:]] - ll[wt]], atol=1e-4
    )
    assert not np.allclose(got, lm.score_variants(wt, ["wt", "K2R", "M1A:K2R"]), atol=1e-6)


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_generate_with_context_is_seeded_and_standard(attention):
    lm = tiny_lm(attention)
    ctx = lm.context(FAMILY)
    one = lm.generate(n=4, max_length=20, context=ctx, seed=3, batch_size=4)
    again = lm.generate(n=4, max_length=20, context=ctx, seed=3, batch_size=1)
    assert one == again
    assert all(set(s) <= set(STANDARD_AA) and 1 <= len(s) <= 20 for s in one)
    assert one != lm.generate(n=4, max_length=20, seed=3, batch_size=4)


def test_exact_extend_in_query_blocks(monkeypatch):
    """A long prefill segment after a long cache attends in query blocks (bounded masks)."""
    from protein_performer.model import exact

    lm = tiny_lm("exact")
    want = lm.score(CANDIDATES, context=lm.context(FAMILY))
    monkeypatch.setattr(exact, "_MASK_ELEMENTS", 200)
    got = lm.score(CANDIDATES, context=lm.context(FAMILY))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_cli_context_flags(tmp_path, capsys):
    """`score`, `score-variants` and `generate` with --context read the family once and give
    the API's numbers; --max-context-tokens alone and a masked model are one error line."""
    import csv

    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model

    lm = tiny_lm()
    ckpt = export_model(lm.loaded, tmp_path / "clm")
    homologs = tmp_path / "homologs.fasta"
    homologs.write_text("".join(f">{i}\n{s}\n" for i, s in FAMILY))
    cands = tmp_path / "cands.fasta"
    cands.write_text("".join(f">c{i}\n{s}\n" for i, s in enumerate(CANDIDATES)))
    out = tmp_path / "s.csv"
    argv = ["score", str(ckpt), str(cands), str(out), "--context", str(homologs), "--no-progress"]
    assert main([*argv, "--device", "cpu"]) == 0
    assert "read 3 of 3 homolog(s)" in capsys.readouterr().err
    with open(out, newline="") as fh:
        got = [float(r["mean_log_likelihood"]) for r in csv.DictReader(fh)]
    ctx = lm.context(str(homologs))
    want = lm.score(CANDIDATES, strategy="causal", context=ctx)
    assert np.allclose(got, want, atol=1e-5)
    assert not np.allclose(got, lm.score(CANDIDATES, strategy="causal"), atol=1e-3)

    wt = tmp_path / "wt.fasta"
    wt.write_text(f">wt\n{CANDIDATES[0]}\n")
    dms = tmp_path / "dms.csv"
    dms.write_text("mutant\nK2R\nT3S\n")
    v = tmp_path / "v.csv"
    argv = ["score-variants", str(ckpt), str(wt), str(dms), str(v), "--context", str(homologs)]
    assert main([*argv, "--device", "cpu"]) == 0
    with open(v, newline="") as fh:
        scores = [float(r["causal"]) for r in csv.DictReader(fh)]
    want = lm.score_variants(CANDIDATES[0], ["K2R", "T3S"], context=ctx)
    assert np.allclose(scores, want, atol=1e-5)

    g = tmp_path / "g.fasta"
    argv = ["generate", str(ckpt), str(g), "--num", "2", "--max-length", "12"]
    assert main([*argv, "--context", str(homologs), "--max-context-tokens", "30"]) == 0
    assert "read 1 of 3 homolog(s) (24 tokens)" in capsys.readouterr().err  # h1: 22 aa + 2
    assert g.read_text().count(">") == 2

    capsys.readouterr()
    assert (
        main(
            ["score", str(ckpt), str(cands), str(tmp_path / "x.csv"), "--max-context-tokens", "9"]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("error: --max-context-tokens needs --context")
    mlm = export_model(tiny_lm(objective="mlm").loaded, tmp_path / "mlm")
    assert (
        main(["score", str(mlm), str(cands), str(tmp_path / "y.csv"), "--context", str(homologs)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "y.csv").exists()


def test_an_unbounded_context_says_what_it_reads_and_shows_progress(
    caplog, capsys, monkeypatch
) -> None:
    """No trained row length: one line with the count before the prefill, then progress."""
    import logging

    from protein_performer.inference.context import build_context

    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "0")
    lm = tiny_lm()
    assert lm.loaded.config.context_tokens is None
    with caplog.at_level(logging.INFO, logger="protein_performer.inference.context"):
        ctx = build_context(lm.loaded, FAMILY * 4, segment=32)
    tokens = sum(len(s) + 2 for _, s in FAMILY * 4)
    assert ctx.n_tokens == tokens
    assert f"reading 12 homolog(s), {tokens} tokens" in caplog.text
    err = capsys.readouterr().err
    assert "context" in err and f"{tokens}" in err, err


def test_a_context_for_a_model_never_trained_on_family_rows_warns_once(caplog) -> None:
    """Issue 45 #4: the demo causal model (single rows, no context_tokens recorded) gets one
    warning that its checkpoint records no family-row training; a family-trained one none."""
    lm = tiny_lm()
    with caplog.at_level("WARNING"):
        lm.context(FAMILY)
        lm.context(FAMILY, orders=1)
    said = [r.getMessage() for r in caplog.records if "family rows" in r.getMessage()]
    assert len(said) == 1 and "records no training on family rows" in said[0], said
    caplog.clear()
    trained = tiny_lm(context_tokens=4096)
    with caplog.at_level("WARNING"):
        trained.context(FAMILY)
    assert "family rows" not in caplog.text


def test_cli_says_what_the_context_read_once(tmp_path, capsys, caplog) -> None:
    """Issue 45 #4: homologs past the trained row length are reported once, with the limit's
    origin and the flag that reads more (not a warning and a second line)."""
    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model

    ckpt = export_model(tiny_lm(context_tokens=60).loaded, tmp_path / "clm")
    homologs = tmp_path / "homologs.fasta"
    homologs.write_text("".join(f">{i}\n{s}\n" for i, s in FAMILY))
    cands = tmp_path / "cands.fasta"
    cands.write_text(f">c\n{CANDIDATES[0]}\n")
    with caplog.at_level("INFO"):
        assert main(["score", str(ckpt), str(cands), str(tmp_path / "s.csv"), "--context",
                     str(homologs), "--no-progress"]) == 0  # fmt: skip
    said = capsys.readouterr().err + caplog.text
    assert said.count("of 3 homolog(s)") == 1 and "left out" not in said, said
    assert "the other 1 would pass 60 tokens, the row length this model was trained on; " \
        "--max-context-tokens N reads more" in said


def test_a_string_is_a_path_never_a_guessed_sequence(tmp_path, monkeypatch):
    """Issue 42 item 9: a missing file named without a dot or separator is an error, not a
    1-member family; ``-`` reads standard input; sequences come as a list."""
    import io

    lm = tiny_lm()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="MKTAYIAK does not exist"):
        lm.context("MKTAYIAK")
    fasta = "".join(f">{i}\n{s}\n" for i, s in FAMILY)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(fasta.encode())))
    from_stdin = lm.context("-")
    assert from_stdin.members == lm.context(FAMILY).members
    assert len(lm.context(["MKTAYIAK"]).members) == 1


def test_a_context_serves_only_a_model_with_the_same_cores():
    """Asked of the cores, not the attention's name: a memory model's context (its states hold
    the memory) is refused by a plain FAVOR+ model in one line (issue 40)."""
    memory = tiny_lm(positions="member", position_memory=64)
    plain = tiny_lm(positions="member")
    ctx = memory.context(FAMILY)
    assert ctx.cores == ("memory+favor",) * 2
    with pytest.raises(UserError, match="memory\\+favor attention, this model's is favor"):
        plain.score(CANDIDATES, context=ctx)


def test_context_and_fasta_cannot_both_read_standard_input():
    """Issue 42 item 9: `--context -` with FASTA `-` is one line, not a second read of stdin."""
    import argparse

    from protein_performer.cli._model import load_context

    args = argparse.Namespace(context="-", fasta="-", max_context_tokens=None)
    with pytest.raises(UserError, match="would both read standard input"):
        load_context(tiny_lm(), args)
