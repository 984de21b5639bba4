"""inference.generation: RNN-mode sampling equals the parallel model, is seeded, obeys limits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import protein_performer as pp
from protein_performer.cli.main import main
from protein_performer.data.tokenizer import STANDARD_AA
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.scoring import causal_log_likelihoods
from protein_performer.interop.export import export_model
from protein_performer.model.attention import state_tensors
from protein_performer.model.config import KERNELS
from tests.inference.test_embedding import tiny_loaded

#: (attention, kernel, other config keys): every core, the linear one and the position memory
#: through the same model calls.
VARIANTS = [("favor", k, {}) for k in KERNELS] + [
    ("exact", "softmax", {}),
    ("linear", "taylor", {}),
    ("linear", "taylor", {"local_window": 4}),
    ("favor", "softmax", {"position_memory": 64, "positions": "member"}),
]


def causal_lm(
    attention: str = "favor", kernel: str = "softmax", seed: int = 0, **extra
) -> ProteinLM:
    loaded = tiny_loaded("clm", seed=seed, attention=attention, kernel=kernel, **extra)
    if kernel == "softmax_opt":  # a trained model has a non-zero statistic: exercise it
        for layer in loaded.model.layers:
            layer.self_attn.core.oprf_rho.fill_(0.4)
    return ProteinLM(loaded)


@pytest.mark.parametrize(("attention", "kernel", "extra"), VARIANTS)
@pytest.mark.parametrize("prompt", ["", "MKTAY"])
def test_step_log_probs_equal_the_parallel_forward(
    attention: str, kernel: str, extra: dict, prompt: str
):
    lm = causal_lm(attention, kernel, **extra)
    for g in lm.iter_generate(n=3, max_length=40, prompt=prompt, seed=3, batch_size=3):
        assert g.sequence.startswith(prompt)
        (terms,) = causal_log_likelihoods(lm.loaded, [g.sequence])
        n = len(g.token_log_probs)
        assert n == len(g.sequence) - len(prompt) + (g.ended == "eos")
        np.testing.assert_allclose(
            g.token_log_probs, terms[len(prompt) : len(prompt) + n], atol=1e-4, rtol=0
        )


def test_same_seed_same_sequences_whatever_the_batch() -> None:
    lm = causal_lm()
    kw = {"n": 7, "max_length": 30, "seed": 11}
    ref = lm.generate(**kw, batch_size=1)
    assert lm.generate(**kw, batch_size=3) == ref
    assert lm.generate(**kw, batch_size=7) == ref
    assert lm.generate(**{**kw, "seed": 12}, batch_size=7) != ref
    assert len(set(ref)) > 1  # records have their own streams


def test_prompts_of_different_lengths_are_padded_correctly() -> None:
    """A batch of right-padded prompts: each row generates what it generates alone."""
    for attention in ("favor", "exact"):
        lm = causal_lm(attention)
        prompts = ["M", "MKTAYIAKQR", "MKV"]
        together = lm.generate(n=3, max_length=25, prompt=prompts, seed=5, batch_size=3)
        alone = lm.generate(n=3, max_length=25, prompt=prompts, seed=5, batch_size=1)
        assert together == alone
        assert [s[: len(p)] for s, p in zip(together, prompts, strict=True)] == prompts


def test_lengths_and_alphabet() -> None:
    lm = causal_lm()
    for g in lm.iter_generate(n=6, max_length=12, min_length=12, seed=1):
        assert len(g.sequence) == 12 and g.ended == "max_length"
    for s in lm.generate(n=10, max_length=20, seed=2):
        assert 1 <= len(s) <= 20 and set(s) <= set(STANDARD_AA)
    with pytest.raises(pp.UserError, match="min_length"):
        lm.generate(n=1, max_length=5, min_length=6)
    with pytest.raises(pp.UserError, match="more than max_length"):
        lm.generate(n=1, max_length=3, prompt="MKTAY")
    with pytest.raises(pp.UserError, match="prompt 0: invalid residue 'J'"):
        lm.generate(n=1, prompt="MJ")
    with pytest.raises(pp.UserError, match="seed must be a non-negative"):
        lm.generate(n=1, seed=-1)


def test_greedy_and_truncation() -> None:
    lm = causal_lm()
    greedy = lm.generate(n=2, max_length=15, temperature=0, seed=0)
    assert greedy[0] == greedy[1] == lm.generate(n=1, max_length=15, temperature=0, seed=9)[0]
    assert lm.generate(n=2, max_length=15, top_k=1, seed=4) == greedy
    assert lm.generate(n=2, max_length=15, top_p=1e-9, seed=4) == greedy


def test_min_length_forbids_an_early_eos() -> None:
    lm = causal_lm()
    for g in lm.iter_generate(n=8, max_length=40, min_length=10, seed=6):
        assert len(g.sequence) >= 10


def test_masked_model_cannot_generate() -> None:
    with pytest.raises(pp.UserError, match="masked LM.*needs a causal model"):
        ProteinLM(tiny_loaded("mlm")).iter_generate(n=1)


def test_generate_cli(tmp_path: Path, capsys) -> None:
    ckpt = export_model(causal_lm().loaded, tmp_path / "m")
    outs = []
    for bs in ("1", "4"):
        out = tmp_path / f"g{bs}.fasta"
        base = ["generate", str(ckpt), str(out), "--num", "5", "--max-length", "30", "--seed", "7"]
        assert main([*base, "--batch-size", bs, "--no-progress"]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    lines = outs[0].decode().splitlines()
    headers, seqs = lines[0::2], lines[1::2]
    assert len(headers) == 5 and headers[0].startswith(">gen0 index=0 seed=7 length=")
    fasta = tmp_path / "g1.fasta"
    scores = tmp_path / "s.csv"
    assert main(["score", str(ckpt), str(fasta), str(scores), "--no-progress"]) == 0
    score_rows = scores.read_text().splitlines()[1:]
    for header, seq, row in zip(headers, seqs, score_rows, strict=True):
        assert f"length={len(seq)}" in header
        assert header.endswith(f"mean_log_likelihood={row.split(',')[4]}")
    capsys.readouterr()
    base[2] = "-"
    assert main([*base, "--batch-size", "2", "--no-progress"]) == 0
    assert capsys.readouterr().out.encode() == outs[0]


@pytest.mark.slow  # a subprocess; test_masked_model_cannot_generate is the fast check
def test_generate_cli_refuses_a_masked_model_in_one_line(tmp_path: Path) -> None:
    ckpt = export_model(tiny_loaded("mlm"), tmp_path / "m")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "protein_performer.cli.main",
            "generate",
            str(ckpt),
            str(tmp_path / "x.fasta"),
            "--num",
            "1",
            "--max-length",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "generation needs a causal model" in proc.stderr
    assert not (tmp_path / "x.fasta").exists()


def test_state_is_constant_size() -> None:
    """RNN mode keeps an (m x (d+1)) state per head whatever the context length."""
    lm = causal_lm()
    a = lm.alphabet
    tokens = torch.tensor([[a.cls_idx, *a.encode("MKTAYIAK").tolist()]])
    _, states = lm.model.prefill(tokens)
    sizes = [s.kv.numel() for s in states]
    pos = torch.tensor([tokens.shape[1]])
    for _ in range(50):
        _, states = lm.model.step(torch.tensor([a.tok_to_idx["A"]]), pos, states)
        pos = pos + 1
    assert [s.kv.numel() for s in states] == sizes


@pytest.mark.parametrize(("attention", "kernel", "extra"), VARIANTS)
def test_steps_equal_the_forward_and_write_given_states_only_in_place(
    attention: str, kernel: str, extra: dict
):
    """PerformerLM.step, in place or not, after a prefill and after a batch-1 state broadcast
    over the batch (a family context's): logits equal the parallel causal forward (<= 1e-4);
    the states it was given are written only when ``inplace`` gives them up, and a shared
    batch-1 context state never is."""
    lm = causal_lm(attention, kernel, **extra)
    model = lm.model
    g = torch.Generator().manual_seed(0)
    row = torch.randint(4, 24, (2, 24), generator=g)
    row[:, 0] = lm.alphabet.cls_idx
    row[1, :8] = row[0, :8]  # a shared start: the broadcast case
    ref = model(row).logits  # (2, 24, V), causal
    P = 8
    with torch.inference_mode():
        shared = model.extend(row[:1, :P], None, return_states=True)[1]  # batch 1
        for start in ("prefill", "broadcast"):
            for inplace in (False, True):
                if start == "prefill":
                    given = model.prefill(row[:, :P])[1]
                    states, first = given, P
                else:
                    given = shared
                    logits, states = model.extend(row[:, P : P + 2], shared, P, None, True)
                    torch.testing.assert_close(logits, ref[:, P : P + 2], atol=1e-4, rtol=0)
                    first = P + 2
                before = [t.clone() for t in state_tensors(given)]
                for t in range(first, 24):
                    pos = torch.full((2,), t)
                    out, states = model.step(row[:, t], pos, states, inplace=inplace)
                    torch.testing.assert_close(out, ref[:, t], atol=1e-4, rtol=0)
                after = state_tensors(given)
                if not inplace or start == "broadcast":
                    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))



def test_sampling_rows_at_once_draws_what_each_row_draws_alone() -> None:
    """The batched draw: every option, every row as if drawn alone (its own stream)."""
    from protein_performer.inference.generation import SamplingOptions, _choose, record_generator

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 33, generator=g) * 3
    allowed = torch.rand(6, 33, generator=g) > 0.3
    for kw in ({}, {"top_k": 4}, {"top_p": 0.6}, {"top_k": 9, "top_p": 0.8, "temperature": 0.5},
               {"temperature": 0}, {"top_k": 40}):  # fmt: skip
        opts = SamplingOptions(max_length=10, **kw)
        together = _choose(logits, allowed, opts, [record_generator(0, i) for i in range(6)])
        alone = [
            _choose(logits[i : i + 1], allowed[i : i + 1], opts, [record_generator(0, i)])[0]
            for i in range(6)
        ]
        assert together == alone
        assert all(bool(allowed[i, t]) for i, t in enumerate(together))


def _generate_with_compile(monkeypatch, attention: str, compile_fn) -> tuple[list, list]:
    """Sequences and log-probs with PROTEIN_PERFORMER_COMPILE_STEP=1 and ``torch.compile``
    replaced by ``compile_fn``, and without the switch."""
    from protein_performer.inference import generation

    lm = causal_lm(attention)
    kw = {"n": 4, "max_length": 25, "prompt": "MK", "seed": 5, "batch_size": 2}
    plain = list(lm.iter_generate(**kw))
    monkeypatch.setenv(generation.COMPILE_ENV, "1")
    monkeypatch.setattr(torch, "compile", compile_fn)
    switched = list(lm.iter_generate(**kw))
    return plain, switched


def test_the_compile_switch_decodes_the_same_sequences(monkeypatch) -> None:
    """With the switch, generation runs the traced step (here uncompiled, its eager numbers):
    the same sequences as model.step, log-probs to float rounding (it reads transposed
    weights)."""
    plain, switched = _generate_with_compile(monkeypatch, "favor", lambda fn, **kw: fn)
    assert [g.sequence for g in switched] == [g.sequence for g in plain]
    for a, b in zip(switched, plain, strict=True):
        np.testing.assert_allclose(a.token_log_probs, b.token_log_probs, rtol=1e-6, atol=1e-6)


def test_the_compile_switch_falls_back_in_one_line(monkeypatch, caplog) -> None:
    """A compiler that fails, or a model the traced step cannot run, decodes eagerly after one
    warning line; the sequences are the eager ones."""

    def broken(fn, **kw):
        def fail(*args):
            raise RuntimeError("no C++ compiler\ndetails")

        return fail

    for attention in ("favor", "exact"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            plain, switched = _generate_with_compile(monkeypatch, attention, broken)
        assert [g.sequence for g in switched] == [g.sequence for g in plain]
        notes = [r.getMessage() for r in caplog.records if "COMPILE_STEP" in r.getMessage()]
        assert len(notes) == 1 and "\n" not in notes[0]
        assert ("no C++ compiler" if attention == "favor" else "exact attention") in notes[0]


def test_the_traced_step_is_the_default_and_compiled_where_it_pays(monkeypatch, caplog) -> None:
    """Issue 43: unset, the switch runs the traced step eagerly, and compiles it only for a
    batch size that decodes at least COMPILE_PAYS_STEPS tokens in the run (a short last batch
    stays uncompiled: no second compile); "0" pins model.step, "1" the compiled step; another
    value is refused. Every kind draws model.step's sequences (torch.compile replaced by the
    identity here: its eager numbers); a compile is said in one line."""
    from protein_performer.errors import UserError
    from protein_performer.inference import generation

    monkeypatch.delenv(generation.COMPILE_ENV, raising=False)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    lm = causal_lm("favor")
    model = lm.model

    def compiled(step) -> bool:
        return step.traced._compiled_for is not None

    assert not compiled(generation.decoding_step(model))
    assert not compiled(generation.decoding_step(model, generation.COMPILE_PAYS_STEPS - 1))
    assert compiled(generation.decoding_step(model, generation.COMPILE_PAYS_STEPS))
    monkeypatch.setenv(generation.COMPILE_ENV, "0")
    assert generation.decoding_step(model, 10**9) == model.step
    kw = {"n": 5, "max_length": 20, "prompt": "MK", "seed": 3, "batch_size": 2}
    plain = list(lm.iter_generate(**kw))
    monkeypatch.setenv(generation.COMPILE_ENV, "sometimes")
    with pytest.raises(UserError, match="expected 1, 0 or auto"):
        generation.decoding_step(model)
    monkeypatch.delenv(generation.COMPILE_ENV)
    traced = list(lm.iter_generate(**kw))
    monkeypatch.setattr(generation, "COMPILE_PAYS_STEPS", 40)  # 2 batches of 2 x 20 tokens
    with caplog.at_level("INFO", logger="protein_performer"):
        auto = list(lm.iter_generate(**kw))
    for run in (traced, auto):
        assert [g.sequence for g in run] == [g.sequence for g in plain]
        for a, b in zip(run, plain, strict=True):
            np.testing.assert_allclose(a.token_log_probs, b.token_log_probs, rtol=1e-6, atol=1e-6)
    notes = [r.getMessage() for r in caplog.records if "compiling the decoding" in r.getMessage()]
    assert notes == ["compiling the decoding step for batch size 2 (once; tens of seconds)"]


def test_a_memory_model_decodes_through_the_traced_step_after_a_family(monkeypatch, caplog):
    """Issue 40: a model with the position memory (family_clm's) generates after a family
    context through the traced step, with no line about decoding eagerly, and draws
    model.step's sequences."""
    from protein_performer.inference import generation
    from protein_performer.model.decode import CompiledStep

    monkeypatch.delenv(generation.COMPILE_ENV, raising=False)
    lm = causal_lm(position_memory=64, positions="member")
    ctx = lm.context(["MKTAYIAKQRQISFVK", "MKSAYIAKQRQLSFVR", "MRTAYLAKQRQISFV"])
    kw = {"n": 4, "max_length": 30, "prompt": "MK", "seed": 2, "batch_size": 2, "context": ctx}
    with caplog.at_level("INFO", logger="protein_performer"):
        traced = list(lm.iter_generate(**kw))
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]
    assert isinstance(generation.decoding_step(lm.model).traced, CompiledStep)
    monkeypatch.setenv(generation.COMPILE_ENV, "0")
    plain = list(lm.iter_generate(**kw))
    assert [g.sequence for g in traced] == [g.sequence for g in plain]
    for a, b in zip(traced, plain, strict=True):
        np.testing.assert_allclose(a.token_log_probs, b.token_log_probs, rtol=1e-5, atol=1e-5)


class _ClosedAfter:
    """A standard output whose reader goes away after ``n`` writes (``| head``)."""

    def __init__(self, n: int) -> None:
        import os

        self.left, self.fd = n, os.open(os.devnull, os.O_WRONLY)

    def write(self, text: str) -> int:
        if self.left == 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return len(text)

    def flush(self) -> None:
        if self.left == 0:
            raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


def test_generate_into_a_closed_pipe_says_how_many(tmp_path: Path, capsys, monkeypatch) -> None:
    ckpt = export_model(causal_lm().loaded, tmp_path / "m")
    monkeypatch.setattr(sys, "stdout", _ClosedAfter(3))
    argv = ["generate", str(ckpt), "-", "--num", "8", "--max-length", "12", "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "generated 3 of 8 sequence(s): standard output was closed after them" in err, err


def test_a_huge_count_streams_and_zero_is_refused(tmp_path: Path, capsys) -> None:
    """``--num 1e15`` built a list of 1e15 prompts first (MemoryError); ``--num 0`` wrote an
    empty file with exit 0 (issue 42 #17, #20)."""
    lm = causal_lm()
    first = next(lm.iter_generate(n=10**15, max_length=10, seed=3))
    assert first.index == 0 and first.sequence == lm.generate(n=1, max_length=10, seed=3)[0]
    ckpt = export_model(lm.loaded, tmp_path / "m")
    out = tmp_path / "none.fasta"
    argv = ["generate", str(ckpt), str(out), "--num", "0", "--max-length", "5", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --num must be at least 1, got 0"] and not out.exists()
