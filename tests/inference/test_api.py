"""inference.api: `pp.load` and `ProteinLM` equal the CLI files, stream, refuse bad input."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import protein_performer as pp
from protein_performer.cli.main import main
from protein_performer.data.tokenizer import STANDARD_AA
from protein_performer.inference.api import ProteinLM
from protein_performer.interop.export import export_model
from tests.inference.test_embedding import tiny_loaded

SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "MLLAVLYCLAVF", "GS"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("api")
    fasta = tmp / "in.fasta"
    fasta.write_text("".join(f">s{i} record {i}\n{s}\n" for i, s in enumerate(SEQS)))
    return {
        "mlm": export_model(tiny_loaded("mlm"), tmp / "mlm"),
        "clm": export_model(tiny_loaded("clm"), tmp / "clm"),
        "fasta": fasta,
    }


def test_load_exposes_the_model(models) -> None:
    lm = pp.load(models["mlm"], device="cpu")
    assert isinstance(lm, pp.ProteinLM)
    assert lm.objective == "mlm" and lm.config.depth == 2
    assert lm.alphabet.mask_idx == 32 and not lm.model.training
    assert lm.dtype == torch.float32 and lm.device.type == "cpu"
    with pytest.raises(pp.UserError, match="does not exist"):
        pp.load(models["mlm"] / "nope")


def test_load_takes_the_loaders_attention_options(models) -> None:
    """``pp.load`` is the one loader plus dtype and threads: the same options, the same model."""
    from protein_performer.interop.loading import load_model

    lm = pp.load(models["mlm"], device="cpu", attention="exact")
    assert lm.config.attention == "exact" and lm.loaded.kind == "export"
    exact = load_model(models["mlm"], "cpu", attention="exact").model
    tokens = lm.alphabet.encode_batch(SEQS)
    with torch.no_grad():
        assert torch.equal(lm.model(tokens).logits, exact(tokens).logits)
    with pytest.raises(pp.UserError, match="unknown kernel"):
        pp.load(models["mlm"], device="cpu", kernel="cosine")


def test_load_chooses_threads_as_the_cli_does(models, monkeypatch, caplog) -> None:
    """No ``threads``: the free cores (a fake load: 6 cores, 4 other processes running), said
    in one logged line; ``threads=N`` and ``OMP_NUM_THREADS`` win; a bad value is refused."""
    import logging

    from protein_performer.io import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: set(range(6)))
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: len(cpus))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 6)
    monkeypatch.setattr(threads, "running_elsewhere", lambda: 4)
    with caplog.at_level(logging.INFO, logger="protein_performer.inference.api"):
        pp.load(models["mlm"], device="cpu")
    assert torch.get_num_threads() == 2
    assert [r.getMessage() for r in caplog.records] == [
        "threads: 2 (6 core(s), less 4 other process(es) running now); change with threads=N"
    ]
    pp.load(models["mlm"], device="cpu", threads=3)
    assert torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pp.load(models["mlm"], device="cpu")
    assert torch.get_num_threads() == 1
    with pytest.raises(pp.UserError, match="threads must be a positive integer"):
        pp.load(models["mlm"], device="cpu", threads=0)


def test_embed_equals_the_cli_file(models, tmp_path: Path) -> None:
    lm = pp.load(models["mlm"], device="cpu")
    out = tmp_path / "e.h5"
    argv = ["embed", str(models["mlm"]), str(models["fasta"]), str(out), "--no-progress"]
    assert main([*argv, "--include", "mean", "per_tok", "bos", "--repr-layers", "0", "-1"]) == 0
    mean = lm.embed(SEQS)
    per_tok = lm.embed([(f"s{i}", s) for i, s in enumerate(SEQS)], pooling=None)
    both = lm.embed(SEQS, layers=(0, -1), pooling="bos")
    assert mean.shape == (3, 16) and mean.dtype == np.float32
    assert [a.shape for a in per_tok] == [(len(s), 16) for s in SEQS]
    assert set(both) == {0, -1}
    ids, got = pp.read_embeddings(out)  # the ids come with the arrays, in file order
    np.testing.assert_array_equal(got, mean)
    assert ids == [f"s{i}" for i in range(len(SEQS))]
    for a, b in zip(pp.read_embeddings(out, kind="per_tok").values, per_tok, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pp.read_embeddings(out, kind="bos", layer=0).values, both[0])
    np.testing.assert_array_equal(pp.read_embeddings(out, kind="bos").values, both[-1])


def test_score_equals_the_cli_table(models, tmp_path: Path) -> None:
    for kind in ("mlm", "clm"):
        out = tmp_path / f"{kind}.csv"
        assert (
            main(["score", str(models[kind]), str(models["fasta"]), str(out), "--no-progress"])
            == 0
        )
        with open(out, newline="") as fh:
            rows = list(csv.DictReader(fh))
        got = pp.load(models[kind], device="cpu").score(SEQS)
        want = np.array([float(r["mean_log_likelihood"]) for r in rows])
        np.testing.assert_allclose(got, want, atol=5e-7, rtol=0)  # the CSV keeps 6 decimals
        assert [int(r["n_scored"]) for r in rows] == [len(s) + (kind == "clm") for s in SEQS]


def test_iter_embed_streams_window_by_window(models) -> None:
    """Memory is bounded by a window: the input is consumed lazily, results come in order, and
    the values do not depend on how records were windowed or batched."""
    lm = pp.load(models["mlm"], device="cpu")
    rng = np.random.default_rng(0)
    seqs = ["".join(rng.choice(list(STANDARD_AA), size=8)) for _ in range(200)]
    taken = 0

    def source():
        nonlocal taken
        for i, s in enumerate(seqs):
            taken += 1
            yield f"r{i}", s

    stream = lm.iter_embed(source(), toks_per_batch=10)  # window: 32 x 10 tokens = 32 records
    first = list(itertools.islice(stream, 1))
    assert first[0][0] == "r0" and taken == 32
    rest = list(stream)
    assert [rid for rid, _ in first + rest] == [f"r{i}" for i in range(200)]
    together = lm.embed(seqs, toks_per_batch=100_000)
    np.testing.assert_allclose(np.stack([e for _, e in first + rest]), together, atol=1e-6)


def test_bad_sequences_name_their_index(models) -> None:
    lm = pp.load(models["mlm"], device="cpu")
    bad = r"sequence 1 \(0-based index in the list\): invalid residue 'J' at position 3"
    with pytest.raises(pp.UserError, match=bad):  # issue 45 #8: not "sequence 1 (1)"
        lm.embed(["MKT", "MKJ"])
    with pytest.raises(pp.UserError, match=r"sequence 0 \(id x\) is empty"):
        lm.score([("x", "  ")])
    with pytest.raises(pp.UserError, match="pooling"):
        lm.embed(["MKT"], pooling="max")
    with pytest.raises(pp.UserError, match="out of range"):
        lm.embed(["MKT"], layers=7)
    empty = lm.embed([], layers=(0, -1))  # no sequences: the same types, zero rows
    assert set(empty) == {0, -1} and empty[0].shape == (0, 16)


def test_fill_mask_is_the_model_softmax(models) -> None:
    lm = pp.load(models["mlm"], device="cpu")
    seq = "MKTAYIAK<mask>RQISF<mask>"
    got = lm.fill_mask(seq, top_k=4)
    a = lm.alphabet
    tokens = torch.tensor(
        [[a.cls_idx, *a.encode("MKTAYIAK"), a.mask_idx, *a.encode("RQISF"), a.mask_idx, a.eos_idx]]
    )
    with torch.no_grad():
        probs = torch.softmax(lm.model(tokens).logits[0], -1)
    assert len(got) == 2
    for pos, fills in zip((9, 15), got, strict=True):
        assert len(fills) == 4
        ps = [p for _, p in fills]
        assert ps == sorted(ps, reverse=True)
        best = max(STANDARD_AA, key=lambda c: float(probs[pos, a.tok_to_idx[c]]))
        assert fills[0][0] == best
        for residue, p in fills:
            assert p == pytest.approx(float(probs[pos, a.tok_to_idx[residue]]), abs=1e-7)
    with pytest.raises(pp.UserError, match="no <mask>"):
        lm.fill_mask("MKT")
    with pytest.raises(pp.UserError, match="only <mask>"):
        lm.fill_mask("MK<cls>T")
    with pytest.raises(pp.UserError, match="needs a masked LM"):
        pp.load(models["clm"], device="cpu").fill_mask("MK<mask>")


def test_score_variants_matches_the_sequence_scores(models) -> None:
    """Causal variant scores are LL(mutant) - LL(wt): the difference of two ``score`` values
    times their token counts."""
    lm = pp.load(models["clm"], device="cpu")
    wt = SEQS[0]
    got = lm.score_variants(wt, ["K2R", "wt", "T3S:Q9E"])
    mutant = "MRTAYIAKQRQISFVKSHFSRQ"
    n = len(wt) + 1
    assert got[0] == pytest.approx((lm.score([mutant])[0] - lm.score([wt])[0]) * n, abs=1e-4)
    assert got[1] == 0.0
    with pytest.raises(pp.UserError, match=r"mutant 0 \('A2R'\): .*wild-type letter"):
        lm.score_variants(wt, ["A2R"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_is_close_to_fp32(models, precision: str) -> None:
    """Half-precision weights: each rounding is relative 2^-8 (bf16) / 2^-11 (fp16); about ten
    sequential roundings per block over two blocks bound the drift by ~20 * 2^-8 < 0.08 of the
    activations' scale (fp16's bound is 8x tighter; the same loose bound is used for both)."""
    full = pp.load(models["mlm"], device="cpu")
    half = pp.load(models["mlm"], device="cpu", dtype=precision)
    assert half.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    omegas = [layer.self_attn.core.omega for layer in half.model.layers]
    assert all(o.dtype == torch.float32 for o in omegas)  # the random features stay as drawn
    assert torch.equal(omegas[0], full.model.layers[0].self_attn.core.omega)
    a, b = full.embed(SEQS, pooling=None), half.embed(SEQS, pooling=None)
    for x, y in zip(a, b, strict=True):
        assert y.dtype == np.float32
        assert np.abs(x - y).max() <= 0.08 * np.abs(x).max()
    np.testing.assert_allclose(half.score(SEQS[:1]), full.score(SEQS[:1]), atol=0.08)


def test_embed_and_score_read_a_preprocessed_store(models, tmp_path: Path) -> None:
    """A store from `preprocess` is an input like its FASTA: same records, same numbers."""
    store = tmp_path / "store"
    assert main(["preprocess", str(models["fasta"]), "--out", str(store), "--no-progress"]) == 0
    outs = {}
    for name, src in (("fasta", models["fasta"]), ("store", store)):
        outs[name] = (tmp_path / f"{name}.h5", tmp_path / f"{name}.csv")
        common = [str(models["mlm"]), str(src)]
        assert main(["embed", *common, str(outs[name][0]), "--no-progress"]) == 0
        assert main(["score", *common, str(outs[name][1]), "--no-progress"]) == 0
    assert outs["fasta"][1].read_text() == outs["store"][1].read_text()
    with h5py.File(outs["fasta"][0]) as a, h5py.File(outs["store"][0]) as b:
        for name in ("ids", "lengths", "record_numbers", "header_bytes", "mean/2"):
            np.testing.assert_array_equal(a[name][:], b[name][:])


def test_logits_equal_the_models_forward_whatever_the_batching() -> None:
    lm = ProteinLM(tiny_loaded())
    seqs = ["MKTAYIAKQRQ", "MLL", "ACDEFGHIKLMNPQRSTVWY"]
    small, large = lm.logits(seqs, toks_per_batch=8), lm.logits(seqs, toks_per_batch=4096)
    for seq, a, b in zip(seqs, small, large, strict=True):
        tokens = torch.as_tensor(lm.alphabet.encode_with_specials(seq))[None]
        with torch.no_grad():
            want = lm.model(tokens).logits[0].float().numpy()  # (L + 2, V)
        assert a.shape == (len(seq) + 2, lm.config.vocab_size)
        np.testing.assert_allclose(a, want, atol=1e-5)
        np.testing.assert_allclose(b, want, atol=1e-5)


def test_attention_is_the_implied_maps_the_report_draws() -> None:
    from protein_performer.contacts.attention import full_maps

    lm = ProteinLM(tiny_loaded())
    seq = "MKTAYIAKQRQISF"
    everything = lm.attention(seq)
    want = full_maps(lm.model, seq).numpy()  # (depth, heads, L, L)
    np.testing.assert_allclose(everything, want, atol=1e-6)
    part = lm.attention(seq, layers=[-1], heads=[1], window=(3, 7))
    assert part.shape == (1, 1, 4, len(seq))
    np.testing.assert_allclose(part[0, 0], want[-1, 1, 3:7], atol=1e-6)
    assert np.all(part.sum(-1) < 1.0) and np.all(part >= 0)  # <cls>/<eos> weight left out


def test_non_finite_outputs_are_one_message_per_method(models) -> None:
    """NaN never becomes a number: every method that hands out the model's numbers refuses
    non-finite ones in the same words, naming the sequence where there is one."""
    lm = pp.load(models["mlm"], device="cpu")
    with torch.no_grad():
        lm.model.embed_tokens.weight.fill_(float("nan"))
    tail = "; its weights or precision are broken (try --precision fp32)"
    calls = {
        "non-finite embeddings": lambda: lm.embed([("a", "MKT")]),
        "non-finite logits": lambda: lm.logits([("a", "MKT")]),
        "a non-finite log-likelihood": lambda: lm.score([("a", "MKT")]),
    }
    for what, call in calls.items():
        with pytest.raises(pp.UserError) as err:
            call()
        assert str(err.value) == f"sequence a: the model gave {what}{tail}", what
    with pytest.raises(pp.UserError) as err:
        lm.score_variants("MKT", ["K2A"])
    assert str(err.value) == f"the model gave non-finite variant scores{tail}"


def test_masked_models_are_refused_where_a_causal_one_is_needed(models) -> None:
    """One wording for every left-to-right reader: decoding, a family context, generation."""
    lm = pp.load(models["mlm"], device="cpu")
    tokens = lm.alphabet.encode_batch(["MKT"])
    said = r"is a masked LM \(objective mlm\): {} needs a causal model \(objective clm\)"
    decoding = "^this model " + said.format("token-by-token decoding") + "$"
    with pytest.raises(pp.UserError, match=decoding):
        lm.model.prefill(tokens)
    with pytest.raises(pp.UserError, match=said.format("a family context") + ", whose"):
        lm.context(["MKT"])
