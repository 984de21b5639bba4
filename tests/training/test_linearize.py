"""`linearize`: attention transfer moves a tiny exact model's linear twin towards its softmax
outputs, the LoRA merge keeps predictions, a killed run resumes to the same result, bad input
is one line."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.cli.main import main
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.export import export_model
from protein_performer.interop.finetuned import add_lora
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from protein_performer.training import linearize as lz

OPTIONS = dict(window=2, max_tokens=512, max_len=64, heldout_frac=0.1, save_every=2)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A tiny exact MLM whose attention is peaked (large q/k weights), exported."""
    torch.manual_seed(0)
    cfg = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, attention="exact")
    model = PerformerLM(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
            layer.self_attn.k_proj.weight.mul_(40)
    root = tmp_path_factory.mktemp("linearize")
    loaded = LoadedModel(model, cfg, Alphabet(), root / "src", torch.device("cpu"), "export")
    export_model(loaded, root / "exact")
    rng = np.random.default_rng(0)
    with open(root / "seqs.fasta", "w") as f:
        for i in range(40):
            f.write(f">s{i}\n{''.join(rng.choice(list('ACDEFGHIKLMNPQRSTVWY'), 30))}\n")
    return root


def _batch(seed: int = 1) -> dict:
    tokens = torch.from_numpy(np.random.default_rng(seed).integers(4, 24, (4, 30)))
    return {"tokens": tokens, "padding_mask": torch.zeros_like(tokens, dtype=torch.bool)}


def test_transfer_moves_attention_towards_the_softmax_outputs(teacher_dir, tmp_path):
    teacher = load_model(teacher_dir / "exact", "cpu")
    _, captured = lz.teacher_attention(teacher.model, _batch())
    swap = lz.linear_student(teacher.model, "hedgehog", 2)
    with torch.no_grad():
        before = [float(x) for x in lz.transfer_loss(swap, captured, per_layer=True)]
    lz.fit_linear(teacher_dir / "exact", tmp_path / "lin", teacher_dir / "seqs.fasta",
                  lz.LinearizeOptions(steps=12, lr=0.1, **OPTIONS), show_progress=False)
    fitted = load_model(tmp_path / "lin", "cpu")
    assert fitted.config.attention == "linear" and fitted.config.local_window == 2
    with torch.no_grad():
        after = [float(x) for x in lz.transfer_loss(fitted.model, captured, per_layer=True)]
    # every layer closer, on a batch it never saw (12 steps at lr 0.1 gave 20% here)
    assert all(a < 0.9 * b for a, b in zip(after, before, strict=True)), (before, after)
    assert not lz.state_path(tmp_path / "lin").exists()  # the resume state goes with success


def test_lora_merge_leaves_predictions_unchanged():
    torch.manual_seed(0)
    cfg = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, attention="exact")
    student = lz.linear_student(PerformerLM(cfg), "hedgehog", 2).eval()
    adapters = add_lora(student, lz.lora_settings(lz.LinearizeOptions(lora_rank=4)))
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0: a trained adapter is not
                p.normal_(0, 0.1)
    tokens = _batch()["tokens"]
    want = student(tokens).logits
    merged = adapters.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(tokens).logits, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, lz.linear_student(PerformerLM(cfg), "hedgehog", 2)(
        tokens).logits)  # the adapters did change the model


def _cut_at_third_step(monkeypatch, src, out, data, options) -> None:
    """A run into ``out`` killed (Ctrl-C) inside its third transfer step: its resume state
    holds step 2."""
    real, calls = lz.transfer_loss, []

    def dies_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(lz, "transfer_loss", dies_at_third)
    with pytest.raises(KeyboardInterrupt):
        lz.fit_linear(src, out, data, options, show_progress=False)
    monkeypatch.setattr(lz, "transfer_loss", real)


def test_killed_run_resumes_to_the_same_model(teacher_dir, tmp_path, monkeypatch):
    options = lz.LinearizeOptions(steps=4, lora_steps=2, kl_weight=0.5, **OPTIONS)
    src, data = teacher_dir / "exact", teacher_dir / "seqs.fasta"
    whole = lz.fit_linear(src, tmp_path / "whole", data, options, show_progress=False)
    _cut_at_third_step(monkeypatch, src, tmp_path / "cut", data, options)
    assert lz.state_path(tmp_path / "cut").is_file()  # saved after step 2
    with pytest.raises(UserError, match="--resume"):  # never a silent restart
        lz.fit_linear(src, tmp_path / "cut", data, options, show_progress=False)
    with pytest.raises(UserError, match="other source, data or options"):
        lz.fit_linear(src, tmp_path / "cut", data, lz.LinearizeOptions(steps=5, **OPTIONS),
                      resume=True, show_progress=False)
    resumed = lz.fit_linear(src, tmp_path / "cut", data, options, resume=True,
                            show_progress=False)
    assert [r["step"] for r in resumed.curve] == [r["step"] for r in whole.curve]
    a, b = load_model(whole.out, "cpu").model, load_model(resumed.out, "cpu").model
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, msg=name)


def test_non_finite_loss_stops_with_one_line(teacher_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lz, "transfer_loss", lambda *a, **k: torch.tensor(float("nan")))
    with pytest.raises(UserError, match="non-finite loss .* --lr"):
        lz.fit_linear(teacher_dir / "exact", tmp_path / "o", teacher_dir / "seqs.fasta",
                      lz.LinearizeOptions(steps=3, **OPTIONS), show_progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["missing.pt", "out"], "missing.pt does not exist"),
        (["garbage.pt", "out"], "garbage.pt"),
        (["EXACT", "out", "--kernel", "taylor", "--window", "0"], "nothing to fit"),
        (["LINEAR", "out"], "approximates no softmax; linearize the softmax model"),
        (["EXACT", "out", "--lora-rank", "100000000", "--lora-steps", "1"],
         "--lora-rank 100000000 exceeds the model width 16"),
        (["EXACT", "out", "--data", "SEQS", "--max-len", "1000000000000"],
         "max_len must be in 3..2147483647"),
    ],
)
def test_bad_input_is_one_error_line(teacher_dir, tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    if "LINEAR" in argv:
        twin = lz.linear_student(load_model(teacher_dir / "exact", "cpu").model, "hedgehog", 0)
        export_model(LoadedModel(twin, twin.config, Alphabet(), tmp_path / "l",
                                 torch.device("cpu"), "export"), tmp_path / "linear")
    names = {"EXACT": str(teacher_dir / "exact"), "LINEAR": str(tmp_path / "linear"),
             "SEQS": str(teacher_dir / "seqs.fasta")}
    argv = [names.get(a, a) for a in argv]
    assert main(["linearize", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0], err
    assert not (tmp_path / "out").exists()


def test_api_returns_the_linearized_model(teacher_dir, tmp_path):
    import protein_performer as pp

    lm = pp.linearize(teacher_dir / "exact", tmp_path / "lin", teacher_dir / "seqs.fasta",
                      device="cpu", show_progress=False, steps=2, **OPTIONS)
    assert isinstance(lm, pp.ProteinLM) and lm.config.attention == "linear"
    with pytest.raises(UserError, match="unknown option"):
        pp.linearize(teacher_dir / "exact", tmp_path / "x", steps=2, windw=3)


def test_cli_stop_says_how_to_resume(teacher_dir, tmp_path, monkeypatch, capsys):
    real, calls = lz.transfer_loss, []

    def dies_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    argv = ["linearize", str(teacher_dir / "exact"), str(tmp_path / "lin"), "--data",
            str(teacher_dir / "seqs.fasta"), "--steps", "4", "--window", "2", "--max-len", "64",
            "--max-tokens", "512", "--save-every", "2", "--no-progress", "--device", "cpu"]
    monkeypatch.setattr(lz, "transfer_loss", dies_at_third)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 130
    assert "keeps the last saved state; rerun the same command with --resume" in (
        capsys.readouterr().err)
    monkeypatch.setattr(lz, "transfer_loss", real)
    assert main([*argv, "--resume"]) == 0
    assert "4 transfer + 0 LoRA steps" in capsys.readouterr().out


def _first_core(state: dict) -> str:
    return sorted(state["cores"])[0]


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda s: s["cores"][_first_core(s)].fill_(float("nan")), "is not finite"),
        (lambda s: s.update(step=4), "does not record the 4 transfer step"),
        (lambda s: s.update(step=10**6), "outside 0..4"),
        (lambda s: s["cores"].update(bogus=torch.zeros(2)), "not this model's (bogus"),
        (lambda s: s["cores"].update({_first_core(s): torch.zeros(3, 3)}), "has shape (3, 3)"),
        (lambda s: s["curve"][0].update(loss=float("inf")), "non-finite loss"),
    ],
)
def test_a_corrupt_resume_state_is_one_line(teacher_dir, tmp_path, monkeypatch, edit, says):
    """A state that would export non-finite weights, claim steps never fitted or name other
    tensors is refused before anything is fitted or written."""
    options = lz.LinearizeOptions(steps=4, lora_steps=0, **OPTIONS)
    src, data = teacher_dir / "exact", teacher_dir / "seqs.fasta"
    _cut_at_third_step(monkeypatch, src, tmp_path / "cut", data, options)
    spot = lz.state_path(tmp_path / "cut")
    state = torch.load(spot, weights_only=True)
    edit(state)
    torch.save(state, spot)
    with pytest.raises(UserError, match=re.escape(says)):
        lz.fit_linear(src, tmp_path / "cut", data, options, resume=True, show_progress=False)
    assert not (tmp_path / "cut").exists()


def test_a_memory_clm_linearizes_with_its_memory_kept():
    """Issue 40: a FAVOR+ CLM with a position memory is its own teacher (swapped to exact in
    memory, the memory kept around the new core); the student keeps the memory's learned
    tensors and fits only the new linear core's, on the teacher's member positions."""
    torch.manual_seed(0)
    cfg = PerformerConfig(dim=16, depth=2, heads=2, ff_dim=32, objective="clm",
                          position_memory=16, memory_window=2, nb_features=16)  # fmt: skip
    model = PerformerLM(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.core.gate_bias.fill_(1.5)
    src = LoadedModel(model, cfg, Alphabet(), Path("memory.ckpt"), torch.device("cpu"), "x")
    teacher = lz._teacher_from(src, "cpu")
    assert teacher.config.attention == "exact" and teacher.config.position_memory == 16
    student = lz.linear_student(teacher.model, "hedgehog", 2)
    assert torch.equal(student.layers[0].self_attn.core.gate_bias, torch.full((2,), 1.5))
    fitted = lz._core_params(student, teacher.model)
    assert fitted and all(".core.inner." in n for n in fitted)  # not the memory's own
    tokens = torch.randint(4, 24, (2, 24))
    tokens[:, [0, 12]] = 0  # two members a row: member positions restart at the second
    batch = {"tokens": tokens, "padding_mask": torch.zeros_like(tokens, dtype=torch.bool)}
    _, captured = lz.teacher_attention(teacher.model, batch)
    assert captured[0][4] is not None  # the positions the memory reads
    losses = lz.transfer_loss(student, captured, per_layer=True)
    assert len(losses) == 2 and all(torch.isfinite(x) for x in losses)


def test_the_readme_line_and_the_api_fit_the_bundled_set_from_anywhere(
    teacher_dir, tmp_path, monkeypatch, capsys, caplog
):
    """Issue 45 #1: with no data, the bundled demo set (inside the package) is found from any
    directory: the README's own `linearize CKPT ...` line as written, and `pp.linearize(CKPT,
    out)`."""
    import protein_performer as pp
    from tests.test_readme import fill, readme_lines

    monkeypatch.chdir(tmp_path)
    line = next(x for x in readme_lines() if x.startswith("protein-performer linearize CKPT"))
    assert "--data" not in line
    argv = fill(line, {"dir": str(tmp_path), "CKPT": str(teacher_dir / "exact"), "CLM_CKPT": ""})
    with caplog.at_level("INFO", logger="protein_performer.training.linearize"):
        assert main([*argv, "--no-progress", "--device", "cpu"]) == 0, capsys.readouterr().err
    assert "linearize: reading the bundled demo set" in caplog.text  # before a silent wait
    assert load_model(tmp_path / "linear_model", "cpu").config.attention == "linear"
    lm = pp.linearize(teacher_dir / "exact", tmp_path / "api", device="cpu",
                      show_progress=False, steps=1, max_len=64, max_tokens=512)
    assert lm.config.attention == "linear"
