"""export --format hf: transformers loads the directory with the same logits, tokens and contact
maps; FAVOR+ models need --as-exact; causal models are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from protein_performer.cli.main import main
from protein_performer.contacts.predict import predict_contacts
from protein_performer.data.tokenizer import Alphabet
from protein_performer.interop.export import export_model
from protein_performer.interop.identity import model_identity
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.performer import PerformerLM

SEQS = ["MKTAYIAKQRQISFVK", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPIL"]
TOL = 1e-4


def _model_dir(tmp_path: Path, name: str, **overrides) -> Path:
    """A small random model (ESM-2 layout, perturbed norms and biases) with a contact
    regression that reads a subset of layers and heads, exported natively."""
    shape = dict(dim=64, depth=2, heads=4, ff_dim=128, nb_features=32, token_dropout=True)
    cfg = PerformerConfig(**{**shape, "attention": "exact", **overrides})
    torch.manual_seed(0)
    model = PerformerLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    loaded = LoadedModel(model, cfg, Alphabet(), Path(name), torch.device("cpu"), "x")
    coef = np.random.default_rng(0).normal(size=3)
    reg = ContactRegression(coef, -2.0, [2], [0, 1, 3], **model_identity(loaded))
    loaded.contact_regression = reg.to_dict()
    return export_model(loaded, tmp_path / name)


def _tokens() -> torch.Tensor:
    a = Alphabet()
    tokens = a.encode_batch(SEQS)
    tokens[0, 3] = tokens[1, 20] = a.mask_idx
    return tokens


def test_round_trip_logits_tokenizer_and_contact_head(tmp_path: Path, capsys) -> None:
    src = _model_dir(tmp_path, "native")
    out = tmp_path / "hf"
    assert main(["export", str(src), str(out), "--format", "hf"]) == 0
    assert "as hf" in capsys.readouterr().out
    hf = transformers.EsmForMaskedLM.from_pretrained(out, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    encoded = tokenizer(SEQS, return_tensors="pt", padding=True)
    tokens = _tokens()
    ours_plain = Alphabet().encode_batch(SEQS)
    assert torch.equal(encoded["input_ids"], ours_plain)
    loaded = load_model(src, "cpu")
    with torch.no_grad():
        theirs = hf(input_ids=tokens, attention_mask=tokens.ne(1).long()).logits
        ours = loaded.model(tokens).logits
    real = tokens.ne(1)
    assert (theirs - ours)[real].abs().max() <= TOL
    for seq in SEQS:
        ids = torch.as_tensor(Alphabet().encode_with_specials(seq), dtype=torch.long)[None]
        with torch.no_grad():
            ref = hf.predict_contacts(ids, torch.ones_like(ids))[0].numpy()
        assert np.abs(predict_contacts(loaded, seq).dense - ref).max() <= TOL


def test_favor_needs_as_exact_and_causal_is_refused(tmp_path: Path, capsys) -> None:
    src = _model_dir(tmp_path, "favor", attention="favor")
    out = tmp_path / "hf"
    assert main(["export", str(src), str(out), "--format", "hf"]) == 2
    assert "--as-exact" in capsys.readouterr().err and not out.exists()
    assert main(["export", str(src), str(out), "--format", "hf", "--as-exact"]) == 0
    hf = transformers.EsmForMaskedLM.from_pretrained(out).eval()
    exact = load_model(src, "cpu", attention="exact").model
    tokens = _tokens()
    with torch.no_grad():
        delta = hf(input_ids=tokens, attention_mask=tokens.ne(1).long()).logits
        delta = (delta - exact(tokens).logits)[tokens.ne(1)].abs().max()
    assert delta <= TOL

    causal = _model_dir(tmp_path, "causal", objective="clm")
    assert main(["export", str(causal), str(tmp_path / "c"), "--format", "hf"]) == 2
    assert "causal" in capsys.readouterr().err
    relu = _model_dir(tmp_path, "relu", attention="favor", kernel="relu")
    argv = ["export", str(relu), str(tmp_path / "r"), "--format", "hf", "--as-exact"]
    assert main(argv) == 2
    assert "ReLU" in capsys.readouterr().err


def test_default_load_predicts_contacts_and_no_regression_warns(tmp_path: Path, caplog) -> None:
    # transformers' default (sdpa) attention returns no maps: the exported config asks for
    # eager, so a plain from_pretrained(DIR) gives the contact head what it reads.
    src = _model_dir(tmp_path, "native")
    out = tmp_path / "hf"
    assert main(["export", str(src), str(out), "--format", "hf"]) == 0
    hf = transformers.EsmForMaskedLM.from_pretrained(out).eval()
    assert hf.config._attn_implementation == "eager"
    seq = SEQS[0]
    ids = torch.as_tensor(Alphabet().encode_with_specials(seq), dtype=torch.long)[None]
    with torch.no_grad():
        ref = hf.predict_contacts(ids, torch.ones_like(ids))[0].numpy()
    assert np.abs(predict_contacts(load_model(src, "cpu"), seq).dense - ref).max() <= TOL

    bare = load_model(src, "cpu")
    bare.contact_regression = None
    caplog.clear()  # the INFO line of predict_contacts above, when an earlier test set INFO
    with caplog.at_level("WARNING"):
        assert main(["export", str(src), str(tmp_path / "bare"), "--format", "hf"]) == 0
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert not any("contact regression" in r.getMessage() for r in warned)
    export_model(bare, tmp_path / "bare_native")
    with caplog.at_level("WARNING"):
        argv = ["export", str(tmp_path / "bare_native"), str(tmp_path / "bare_hf"), "--format"]
        assert main([*argv, "hf"]) == 0
    assert any("random initialization" in r.getMessage() for r in caplog.records)
    config = (tmp_path / "bare_hf" / "config.json").read_text()
    assert "meaningless" in config


def test_linear_attention_and_position_memory_stay_native(tmp_path: Path, capsys) -> None:
    """A learned linear map or a position memory has no place in EsmForMaskedLM: refused in one
    line; the native export keeps them and reloads with the same logits."""
    tokens = _tokens()
    for name, extra in [("hedgehog", {"attention": "linear", "kernel": "hedgehog"}),
                        ("memory", {"attention": "favor", "position_memory": 64})]:
        src = _model_dir(tmp_path, name, **extra)
        argv = ["export", str(src), str(tmp_path / f"{name}-hf"), "--format", "hf", "--as-exact"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "--format native" in err
        loaded = load_model(src, "cpu")
        again = load_model(export_model(loaded, tmp_path / f"{name}-again"), "cpu")
        with torch.no_grad():
            a, b = loaded.model(tokens).logits, again.model(tokens).logits
        assert torch.equal(a, b)
        kinds = {type(m).__name__ for m in again.model.modules()}
        assert ("Hedgehog" in kinds) == (name == "hedgehog")
        assert ("PositionMemory" in kinds) == (name == "memory")
