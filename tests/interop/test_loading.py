"""interop.loading, the one loader: rebuild from a real Lightning checkpoint, export round trip,
attention swaps on request, clear errors."""

from __future__ import annotations

import json
import pathlib
import zipfile
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from protein_performer.data.dataset import ProteinCollator, ProteinDataset
from protein_performer.errors import UserError
from protein_performer.interop.export import export_model
from protein_performer.interop.loading import load_model
from protein_performer.interop.ours import CONFIG_FILE, WEIGHTS_FILE
from protein_performer.interop.record import resolve_device
from protein_performer.training.callbacks import FeatureRedraw
from protein_performer.training.lit_module import ProteinLMModule
from tests.data.test_dataset import in_memory_source

TINY = {"dim": 16, "depth": 2, "heads": 2, "ff_dim": 32, "nb_features": 8}
SEQS = [("a", "MKTAYIAKQRQISFVKSHFSRQ"), ("b", "MLLAVLYCLAVFALSS"), ("c", "GSHMKK")]
TOKENS = torch.tensor(
    [[0, 20, 15, 11, 5, 19, 12, 5, 15, 16, 10, 2], [0, 6, 6, 7, 2, 1, 1, 1, 1, 1, 1, 1]]
)


class _PathState(pl.Callback):
    """Puts a ``pathlib.Path`` into the checkpoint, as a user callback legitimately might."""

    def state_dict(self) -> dict:
        return {"where": pathlib.Path("/tmp/somewhere")}


def fit_checkpoint(tmp: Path, objective: str = "mlm", extra_callbacks: tuple = ()) -> tuple:
    """A real ``pl.Trainer`` fit (2 steps) that redraws FAVOR features every step, so the
    checkpoint's omega differs from anything a fresh model would draw."""
    torch.manual_seed(0)
    source = in_memory_source(SEQS)
    data = ProteinDataset(source, objective, max_len=32, crop="fixed")
    loader = DataLoader(data, batch_size=2, collate_fn=ProteinCollator())
    module = ProteinLMModule({**TINY, "objective": objective}, {"warmup_steps": 1})
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        callbacks=[checkpoint, FeatureRedraw(interval=1, seed=123), *extra_callbacks],
    )
    trainer.fit(module, loader)
    return tmp / "ckpt" / "last.ckpt", module.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ProteinLMModule]:
    return fit_checkpoint(tmp_path_factory.mktemp("fit"), extra_callbacks=(_PathState(),))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_checkpoint_rebuilds_the_trained_model_exactly(trained) -> None:
    path, module = trained
    loaded = load_model(path, device="cpu")
    assert loaded.kind == "lightning" and not loaded.model.training
    assert loaded.config.to_dict() == module.performer_config.to_dict()
    assert torch.equal(_logits(loaded.model), _logits(module.model))
    omega = loaded.model.layers[0].self_attn.core.omega
    assert torch.equal(omega, module.model.layers[0].self_attn.core.omega)
    # The features were redrawn during training: a freshly built model would differ.
    fresh = type(loaded.model)(loaded.config)
    assert not torch.equal(fresh.layers[0].self_attn.core.omega, omega)


def test_export_round_trip_gives_identical_logits(trained, tmp_path: Path) -> None:
    path, module = trained
    out = export_model(path, tmp_path / "exported")
    meta = json.loads((out / CONFIG_FILE).read_text())
    assert meta["format_version"] == 1 and meta["vocab"][:4] == [
        "<cls>",
        "<pad>",
        "<eos>",
        "<unk>",
    ]
    assert meta["config"]["dim"] == 16
    loaded = load_model(out, device="cpu")
    assert loaded.kind == "export"
    assert torch.equal(_logits(loaded.model), _logits(module.model))
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    # omega matters: redrawing it changes the logits, so the equality above is not vacuous.
    loaded.model.redraw_features(torch.Generator().manual_seed(99))
    assert not torch.allclose(_logits(loaded.model), _logits(module.model))
    # No temporary directory left next to the export.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


def _omega(loaded) -> torch.Tensor:
    return loaded.model.layers[0].self_attn.core.omega


def test_attention_options_swap_the_core_and_nothing_else(trained) -> None:
    path, module = trained
    same = load_model(path, "cpu", attention="favor")  # as stored: the trained features kept
    assert torch.equal(_logits(same.model), _logits(module.model))
    exact = load_model(path, "cpu", attention="exact")
    assert exact.config.attention == "exact" and exact.kind == "lightning"
    assert exact.config.nb_features == same.config.nb_features
    in_memory = load_model(same, "cpu", attention="exact")  # a model in memory: no re-read
    assert torch.equal(_logits(in_memory.model), _logits(exact.model))
    assert same.config.attention == "favor"  # the source is left as it was
    drawn = [load_model(path, "cpu", nb_features=16, seed=s) for s in (0, 0, 1)]
    assert drawn[0].config.nb_features == 16 and _omega(drawn[0]).shape[0] == 16
    assert torch.equal(_omega(drawn[0]), _omega(drawn[1]))
    assert not torch.equal(_omega(drawn[0]), _omega(drawn[2]))
    for options, match in (
        ({"attention": "flash"}, "unknown attention 'flash'"),
        ({"kernel": "cosine"}, "unknown kernel"),
        ({"nb_features": 0}, "nb_features must be a positive integer"),
    ):
        with pytest.raises(UserError, match=match):
            load_model(path, "cpu", **options)


def test_a_missing_path_shaped_like_a_model_id_names_both_readings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"runs/last\.ckpt: no such file.*Hugging Face cache"):
        load_model("runs/last.ckpt", "cpu")


def test_export_with_foreign_or_future_format_is_refused(trained, tmp_path: Path) -> None:
    path, _ = trained
    out = export_model(path, tmp_path / "exported")
    meta = json.loads((out / CONFIG_FILE).read_text())
    for edit, message in (
        ({"format": "something.else"}, "not a protein-performer export"),
        ({"format_version": 999}, "format version 999 is newer"),
    ):
        (out / CONFIG_FILE).write_text(json.dumps({**meta, **edit}))
        with pytest.raises(UserError, match=message):
            load_model(out, device="cpu")


def test_export_refuses_to_clobber(trained, tmp_path: Path) -> None:
    path, _ = trained
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not an export"):
        export_model(path, other)
    out = export_model(path, tmp_path / "exp")
    with pytest.raises(UserError, match="--overwrite"):
        export_model(path, out)
    assert export_model(path, out, overwrite=True) == out
    assert (other / "keep.txt").exists()


def test_allowlisted_types_load_and_others_are_refused(trained, tmp_path: Path) -> None:
    path, module = trained
    ckpt = torch.load(path, weights_only=False)
    assert any(isinstance(v, dict) and "where" in v for v in ckpt["callbacks"].values())
    assert torch.equal(_logits(load_model(path, "cpu").model), _logits(module.model))
    ckpt["evil"] = zipfile.ZipInfo("x")  # any non-allowlisted class
    bad = tmp_path / "evil.ckpt"
    torch.save(ckpt, bad)
    with pytest.raises(UserError, match=r"evil\.ckpt.*zipfile\.ZipInfo"):
        load_model(bad, "cpu")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, src: p, "does not exist"),
        (lambda p, src: (p.write_bytes(b""), p)[1], "empty"),
        (lambda p, src: (p.write_bytes(src.read_bytes()[:3000]), p)[1], "truncated"),
        (lambda p, src: (p.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40), p)[1], "damaged"),
        (lambda p, src: (p.write_text(">seq\nMKV\n"), p)[1], "not a PyTorch checkpoint"),
        (lambda p, src: (torch.save(torch.zeros(3), p), p)[1], "not a protein-performer"),
        (lambda p, src: (torch.save({"state_dict": {}}, p), p)[1], "no model config"),
    ],
    ids=["missing", "empty", "truncated", "corrupt", "text", "tensor", "no-config"],
)
def test_bad_files_give_user_errors_naming_the_path(trained, tmp_path: Path, make, match) -> None:
    path = make(tmp_path / "bad.ckpt", trained[0])
    with pytest.raises(UserError, match=match) as info:
        load_model(path, "cpu")
    assert str(tmp_path / "bad.ckpt") in str(info.value)


def _edited(src: Path, dst: Path, edit) -> Path:
    ckpt = torch.load(src, weights_only=False)  # our own test file: trusted
    edit(ckpt)
    torch.save(ckpt, dst)
    return dst


def test_incompatible_checkpoints_name_the_problem(trained, tmp_path: Path) -> None:
    src = trained[0]

    def unknown_field(c):
        c["performer_config"]["n_layers"] = 3

    def invalid_value(c):
        c["performer_config"]["heads"] = 3

    def drop_key(c):
        del c["state_dict"]["model.layers.1.fc2.weight"]

    def wrong_shape(c):
        c["state_dict"]["model.layers.0.fc1.bias"] = torch.zeros(7)

    def extra_key(c):
        c["state_dict"]["model.layers.9.fc1.bias"] = torch.zeros(7)

    cases = [
        (unknown_field, "unknown model config key.*n_layers"),
        (invalid_value, "not divisible"),
        (drop_key, "missing key.*layers.1.fc2.weight"),
        (wrong_shape, r"layers.0.fc1.bias \(7,\) vs model \(32,\)"),
        (extra_key, "unexpected key.*layers.9.fc1.bias"),
    ]
    for i, (edit, match) in enumerate(cases):
        path = _edited(src, tmp_path / f"c{i}.ckpt", edit)
        with pytest.raises(UserError, match=match) as info:
            load_model(path, "cpu")
        assert str(path) in str(info.value)


def test_bad_export_directories(trained, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not an exported model"):
        load_model(tmp_path, "cpu")
    out = export_model(trained[0], tmp_path / "exp")
    meta = json.loads((out / CONFIG_FILE).read_text())
    meta["config"]["bogus"] = 1
    (out / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(UserError, match="bogus"):
        load_model(out, "cpu")
    out2 = export_model(trained[0], tmp_path / "exp2")
    weights = out2 / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match="safetensors") as info:
        load_model(out2, "cpu")
    assert str(weights) in str(info.value)


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="unknown device"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    with pytest.raises(UserError, match="does not exist"):
        resolve_device("cuda:3")


def test_non_finite_weights_are_refused_on_load_and_never_saved(trained, tmp_path: Path) -> None:
    from protein_performer.io.checkpoints import save_atomic

    src = trained[0]

    def poison(c):
        c["state_dict"]["model.layers.0.fc1.bias"][0] = float("nan")

    bad = _edited(src, tmp_path / "nan.ckpt", poison)
    with pytest.raises(UserError, match=r"not finite \(NaN or inf in 1 tensor\(s\): model\."):
        load_model(bad, "cpu")
    ckpt = torch.load(bad, weights_only=False)
    target = tmp_path / "last.ckpt"
    target.write_bytes(src.read_bytes())
    with pytest.raises(UserError, match="not writing"):
        save_atomic(ckpt, target)
    assert target.read_bytes() == src.read_bytes()  # the previous checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "nan.ckpt"]


@pytest.mark.parametrize("exact_every", [1, 2, 3])
def test_hybrid_stacks_load_back(tmp_path: Path, exact_every: int) -> None:
    """A stack with exact blocks among FAVOR+ ones (their buffers differ) passes the shape
    check and reloads with the same logits (the check built a one-block copy of the config,
    which exact_every > 1 made invalid)."""
    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    cfg = PerformerConfig(dim=32, depth=3, heads=2, ff_dim=64, nb_features=8,
                          objective="clm", exact_every=exact_every)
    torch.manual_seed(0)
    model = PerformerLM(cfg).eval()
    loaded = LoadedModel(model, cfg, Alphabet(), Path("hybrid"), torch.device("cpu"), "x")
    out = export_model(loaded, tmp_path / "hybrid")
    tokens = torch.randint(4, 24, (1, 12))
    again = load_model(out, "cpu").model.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, model(tokens).logits)
