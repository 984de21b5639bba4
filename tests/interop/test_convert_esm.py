"""ESM-2 import through the one loader: exactness against fair-esm and transformers, FAVOR+
swap, refusals, CLI (``convert-esm`` = load + export).

The source models are small, randomly initialized ESM-2s built here (no downloads); LayerNorm
and bias parameters are perturbed so that a swapped or dropped one shows in the outputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import esm
import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.interop.export import export_model
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from tests.paths import FIXTURES, REPO

DEMO_FASTA = REPO / "protein_performer" / "data" / "demo" / "some_proteins.fasta"
TINY_PDB = FIXTURES / "tiny_blank_chain.pdb"
TOL = 1e-4
SEQS = [("short", "MKTAYIAKQRQISFVK"), ("long", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPIL")]


def _convert(src, out: Path, **options) -> LoadedModel:
    """What ``convert-esm`` does: the one loader, then an export."""
    loaded = load_model(src, "cpu", **options)
    export_model(loaded, out)
    return loaded


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _tokens() -> torch.Tensor:
    """A padded batch in ESM-2's layout, with <mask> tokens in both rows."""
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    _, _, tokens = alphabet.get_batch_converter()(SEQS)
    tokens[0, 3] = alphabet.mask_idx
    tokens[1, [5, 6, 20]] = alphabet.mask_idx
    assert tokens.eq(alphabet.padding_idx).any()
    return tokens


def _fair_esm_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = esm.model.esm2.ESM2(
        num_layers=2,
        embed_dim=64,
        attention_heads=4,
        alphabet=esm.data.Alphabet.from_architecture("ESM-1b"),
        token_dropout=True,
    )
    _perturb(model)
    return model.eval()


def _save_fair_esm(model: torch.nn.Module, path: Path, layout: str = "cfg") -> Path:
    """Save as the released esm2_*.pt files are laid out (fairseq prefixes, cfg Namespace), or
    in the older ``args`` layout with unprefixed keys."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("contact_head")}
    hparams = argparse.Namespace(
        encoder_layers=2,
        encoder_embed_dim=64,
        encoder_ffn_embed_dim=256,
        encoder_attention_heads=4,
        token_dropout=True,
    )
    if layout == "cfg":
        state = {
            (f"encoder.{k}" if k.startswith("lm_head") else f"encoder.sentence_encoder.{k}"): v
            for k, v in state.items()
        }
        data = {"model": state, "args": None, "cfg": {"model": hparams}}
    else:
        data = {"model": state, "args": hparams}
    torch.save(data, path)
    return path


@pytest.fixture(scope="module")
def fair(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = _fair_esm_model()
    return model, _save_fair_esm(model, tmp_path_factory.mktemp("fair") / "esm2_t2_tiny.pt")


def _max_diffs(ref_logits, ref_hidden, out) -> dict[str, float]:
    diffs = {"logits": (ref_logits - out.logits).abs().max().item()}
    for layer, h in ref_hidden.items():
        diffs[f"layer {layer}"] = (h - out.hidden_states[layer]).abs().max().item()
    return diffs


@pytest.mark.parametrize("layout", ["cfg", "args"])
def test_fair_esm_exact(fair, tmp_path, layout):
    model, _ = fair
    src = _save_fair_esm(model, tmp_path / "esm2.pt", layout)
    result = _convert(src, tmp_path / "out", attention="exact")
    assert result.kind == "fair-esm"
    cfg = result.config
    assert (cfg.dim, cfg.depth, cfg.heads, cfg.ff_dim) == (64, 2, 4, 256)
    assert cfg.token_dropout and cfg.layer_norm_eps == 1e-5 and cfg.attention == "exact"
    loaded = load_model(tmp_path / "out", "cpu")
    tokens = _tokens()
    with torch.no_grad():
        ref = model(tokens, repr_layers=[0, 1, 2])
        out = loaded.model(tokens, repr_layers=[0, 1, 2])
    diffs = _max_diffs(ref["logits"], ref["representations"], out)
    assert set(diffs) == {"logits", "layer 0", "layer 1", "layer 2"}
    assert max(diffs.values()) <= TOL, diffs
    with torch.no_grad():  # the .pt itself, read by the one loader, is the same model
        assert torch.equal(load_model(src, "cpu").model(tokens).logits, out.logits)


def test_hf_exact(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.EsmConfig(
        vocab_size=33,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        position_embedding_type="rotary",
        token_dropout=True,
        pad_token_id=1,
        mask_token_id=32,
        layer_norm_eps=1e-5,
        emb_layer_norm_before=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = transformers.EsmForMaskedLM(config).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    result = _convert(tmp_path / "hf", tmp_path / "out")
    assert result.kind == "hf" and result.config.token_dropout
    loaded = load_model(tmp_path / "out", "cpu")
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(input_ids=tokens, attention_mask=tokens.ne(1).long(), output_hidden_states=True)
        out = loaded.model(tokens, repr_layers=[0, 1, 2])
    assert len(ref.hidden_states) == 3
    diffs = _max_diffs(ref.logits, dict(enumerate(ref.hidden_states)), out)
    assert max(diffs.values()) <= TOL, diffs


def test_favor_swap_close_and_reproducible(tmp_path):
    model = _fair_esm_model()
    # Small q/k norms keep attention logits small, where FAVOR+ is accurate.
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(0.2)
            layer.self_attn.k_proj.weight.mul_(0.2)
    src = _save_fair_esm(model, tmp_path / "esm2.pt")
    _convert(src, tmp_path / "exact")
    res = _convert(src, tmp_path / "favor", attention="favor", nb_features=256, seed=3)
    assert res.config.attention == "favor" and res.config.nb_features == 256
    tokens = _tokens()
    exact = load_model(tmp_path / "exact", "cpu").model
    favor = load_model(tmp_path / "favor", "cpu").model
    with torch.no_grad():
        le, lf = exact(tokens).logits, favor(tokens).logits
        again = load_model(tmp_path / "favor", "cpu").model(tokens).logits
    real = tokens.ne(1)
    rel = (le - lf)[real].norm() / le[real].norm()
    assert rel < 0.05, rel
    assert torch.equal(lf, again)  # omega is stored: reload gives the same outputs
    # Same seed -> bit-identical export; another seed -> other features.
    _convert(src, tmp_path / "favor2", attention="favor", nb_features=256, seed=3)
    _convert(src, tmp_path / "favor3", attention="favor", nb_features=256, seed=4)
    omega = "layers.0.self_attn.core.omega"
    sd = [load_model(tmp_path / d, "cpu").model.state_dict()[omega] for d in ("favor", "favor2")]
    assert torch.equal(sd[0], sd[1])
    other = load_model(tmp_path / "favor3", "cpu").model.state_dict()[omega]
    assert not torch.equal(sd[0], other)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    with torch.serialization.safe_globals([argparse.Namespace]):
        data = torch.load(src, weights_only=True, map_location="cpu")
    edit(data)
    torch.save(data, dst)
    return dst


def test_unknown_and_missing_keys(fair, tmp_path):
    _, src = fair
    extra = "encoder.sentence_encoder.layers.0.adapter.weight"

    def add_key(d):
        d["model"][extra] = torch.zeros(3)

    def drop_key(d):
        del d["model"]["encoder.sentence_encoder.layers.1.fc2.bias"]

    with pytest.raises(UserError, match=r"does not know: layers\.0\.adapter\.weight"):
        load_model(_rewrite(src, tmp_path / "extra.pt", add_key), "cpu")
    with pytest.raises(UserError, match=r"1 missing: layers\.1\.fc2\.bias"):
        _convert(_rewrite(src, tmp_path / "miss.pt", drop_key), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_esm1b_checkpoint_refused(tmp_path):
    state = {
        "encoder.sentence_encoder.embed_tokens.weight": torch.zeros(33, 16),
        "encoder.sentence_encoder.embed_positions.weight": torch.zeros(1026, 16),
        "encoder.sentence_encoder.emb_layer_norm_before.weight": torch.ones(16),
    }
    args = argparse.Namespace(arch="roberta_large", layers=1, embed_dim=16, attention_heads=2)
    torch.save({"model": state, "args": args}, tmp_path / "esm1b_t33_650M_UR50S.pt")
    with pytest.raises(UserError, match="ESM-1.*not\\s+ESM-2"):
        load_model(tmp_path / "esm1b_t33_650M_UR50S.pt", "cpu")
    hf = tmp_path / "hf_esm1b"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"model_type": "esm", "position_embedding_type": "absolute"})
    )
    with pytest.raises(UserError, match="ESM-1/ESM-1b-style"):
        load_model(hf, "cpu")


class _Opaque:
    """Stands for any class a malicious pickle could ask to rebuild."""


def test_pickled_code_refused(tmp_path):
    torch.save({"model": {}, "args": Path("x")}, tmp_path / "ok_types.pt")  # paths are allowed
    with pytest.raises(UserError, match="no architecture|no transformer layers"):
        load_model(tmp_path / "ok_types.pt", "cpu")
    torch.save({"model": {}, "args": _Opaque()}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match="other than tensors.*refusing to load"):
        load_model(tmp_path / "evil.pt", "cpu")


def test_cli_end_to_end(fair, tmp_path, capsys):
    import h5py

    from protein_performer.cli.main import main

    _, src = fair
    fasta = tmp_path / "two.fasta"
    records = DEMO_FASTA.read_text().split(">")[1:3]
    # Two demo records, shortened so that pseudo-perplexity (L passes each) stays fast.
    fasta.write_text(
        "".join(
            ">" + r.splitlines()[0] + "\n" + "".join(r.splitlines()[1:])[:60] + "\n"
            for r in records
        )
    )
    out = tmp_path / "esm2_favor"
    argv = ["convert-esm", str(src), str(out), "--attention", "favor", "--nb-features", "32"]
    assert main(argv) == 0
    assert "converted fair-esm ESM-2" in capsys.readouterr().out
    assert main(argv) == 2  # exists: refuses without --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--kernel", "softmax_hyp"]) == 0
    assert load_model(out, "cpu").config.kernel == "softmax_hyp"
    assert main(["convert-esm", str(tmp_path / "nope.pt"), str(tmp_path / "x")]) == 2

    emb = tmp_path / "emb.h5"
    assert main(["embed", str(out), str(fasta), str(emb), "--no-progress"]) == 0
    with h5py.File(emb) as f:
        assert len(f["ids"]) == 2 and f["mean/2"].shape[0] == 2
    scores = tmp_path / "scores.csv"
    assert main(["score", str(out), str(fasta), str(scores), "--no-progress"]) == 0
    assert len(scores.read_text().strip().splitlines()) == 3

    # The other commands that take a checkpoint read the converted directory too.
    wt = tmp_path / "wt.fasta"
    wt.write_text(">wt\nMKTAYIAKQR\n")
    mutations = tmp_path / "dms.csv"
    mutations.write_text("mutant,fit\nM1A,0.1\nK2E,0.5\nT3P:A4G,-0.2\n")
    variants = tmp_path / "variants.csv"
    argv = ["score-variants", str(out), str(wt), str(mutations), str(variants)]
    argv += ["--label-col", "fit", "--no-progress"]
    assert main(argv) == 0
    assert len(variants.read_text().strip().splitlines()) == 4
    argv = ["eval", str(out), str(fasta), "--out-dir", str(tmp_path / "ev"), "--no-progress"]
    assert main(argv) == 0
    assert (tmp_path / "ev" / "metrics.json").is_file()
    pdbs = [shutil.copy(TINY_PDB, tmp_path / f"tiny{i}.pdb") for i in range(2)]
    assert (
        main(["contacts", "fit", str(out), *map(str, pdbs), "--out-dir", str(tmp_path / "c")]) == 0
    )
    assert any((tmp_path / "c").iterdir())


def test_init_from_converted_weights(fair, tmp_path):
    from omegaconf import OmegaConf

    from protein_performer.training.init_weights import init_from, maybe_init_from
    from protein_performer.training.lit_module import ProteinLMModule

    _, src = fair
    _convert(src, tmp_path / "exact")
    shape = dict(dim=64, depth=2, heads=4, ff_dim=256, token_dropout=True)
    module = ProteinLMModule({**shape, "attention": "favor", "nb_features": 16})
    omega = module.model.layers[0].self_attn.core.omega.clone()
    kept = init_from(module, tmp_path / "exact")
    assert kept == [f"layers.{i}.self_attn.core.omega" for i in range(2)]
    source = load_model(tmp_path / "exact", "cpu").model.state_dict()
    for name, value in module.model.state_dict().items():
        if name not in kept:
            assert torch.equal(value, source[name]), name
    assert torch.equal(module.model.layers[0].self_attn.core.omega, omega)

    wrong = ProteinLMModule({**shape, "dim": 32, "ff_dim": 128})
    with pytest.raises(UserError, match="do not fit model.config"):
        init_from(wrong, tmp_path / "exact")
    with pytest.raises(UserError, match="heads=4"):
        init_from(ProteinLMModule({**shape, "heads": 8}), tmp_path / "exact")
    with pytest.raises(UserError, match="add init_from=PATH"):
        maybe_init_from(module, OmegaConf.create({"init_from": None, "init_from_required": True}))
    assert maybe_init_from(module, OmegaConf.create({"init_from": None})) is None


def _hf_model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.EsmConfig(
        vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, position_embedding_type="rotary", token_dropout=True,
        pad_token_id=1, mask_token_id=32, layer_norm_eps=1e-5, emb_layer_norm_before=False,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"  # the attention maps transformers' contact head reads
    hf = transformers.EsmForMaskedLM(config).eval()
    _perturb(hf)
    return hf


def _single(seq: str) -> torch.Tensor:
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    return alphabet.get_batch_converter()([("x", seq)])[2]


def test_contact_head_from_the_hf_cache_matches_transformers(tmp_path, monkeypatch):
    from protein_performer.contacts.predict import predict_contacts

    hf = _hf_model()
    snapshot = tmp_path / "hub" / "models--tiny--esm2_t2" / "snapshots" / "0123abc"
    hf.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        load_model("tiny/not_there", "cpu")
    result = _convert("tiny/esm2_t2", tmp_path / "exact")
    assert result.contact_regression is not None
    assert (tmp_path / "exact" / "contact_regression.json").is_file()
    loaded = load_model(tmp_path / "exact", "cpu")
    direct = load_model("tiny/esm2_t2", "cpu")  # the cached id, without converting first
    assert direct.kind == "hf" and direct.contact_regression == loaded.contact_regression
    for _, seq in SEQS:
        tokens = _single(seq)
        with torch.no_grad():
            ref = hf.predict_contacts(tokens, tokens.ne(1).long())[0]
        ours = predict_contacts(loaded, seq).dense
        assert ours.shape == ref.shape == (len(seq), len(seq))
        assert abs(ours - ref.numpy()).max() <= TOL
    # The FAVOR+ conversion carries the same head; its maps are approximate, its layout the same.
    _convert("tiny/esm2_t2", tmp_path / "favor", attention="favor", nb_features=32)
    favor = load_model(tmp_path / "favor", "cpu")
    assert favor.contact_regression["coef"] == loaded.contact_regression["coef"]
    assert predict_contacts(favor, SEQS[0][1]).dense.shape == (16, 16)


def test_fair_esm_contact_head_file_and_init_from(tmp_path):
    from protein_performer.contacts.predict import predict_contacts
    from protein_performer.training.init_weights import init_from
    from protein_performer.training.lit_module import ProteinLMModule

    model = _fair_esm_model()
    src = _save_fair_esm(model, tmp_path / "esm2_t2.pt")
    head = {k: v for k, v in model.state_dict().items() if k.startswith("contact_head")}
    torch.save({"model": head}, tmp_path / "esm2_t2-contact-regression.pt")  # fair-esm's layout
    _convert(src, tmp_path / "exact")
    loaded = load_model(tmp_path / "exact", "cpu")
    seq = SEQS[1][1]
    with torch.no_grad():
        ref = model.predict_contacts(_single(seq))[0].numpy()
    assert abs(predict_contacts(loaded, seq).dense - ref).max() <= TOL

    shape = dict(dim=64, depth=2, heads=4, ff_dim=256, token_dropout=True)
    module = ProteinLMModule({**shape, "attention": "favor", "nb_features": 16})
    init_from(module, tmp_path / "exact")
    assert module.contact_regression == loaded.contact_regression
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["contact_regression"] == loaded.contact_regression
