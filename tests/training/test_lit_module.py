"""ProteinLMModule (loss, metrics, optimizer groups, LR schedule) and FeatureRedraw."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from protein_performer.training.callbacks import FeatureRedraw, redraw_generator
from protein_performer.training.lit_module import ProteinLMModule, warmup_cosine

TINY = {"dim": 16, "depth": 2, "heads": 2, "ff_dim": 32, "nb_features": 8}
PAD = 1


def make_module(seed: int = 0, **overrides) -> ProteinLMModule:
    torch.manual_seed(seed)
    return ProteinLMModule({**TINY, **overrides}, {"warmup_steps": 10, "min_lr_ratio": 0.1})


def make_batch(seed: int, B: int, T: int, n_targets: int) -> dict:
    """Random residues, the last two columns of row 0 padded, ``n_targets`` scored positions."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 24, (B, T), generator=g)
    padding_mask = torch.zeros(B, T, dtype=torch.bool)
    padding_mask[0, -2:] = True
    tokens[padding_mask] = PAD
    targets = torch.full((B, T), -100)
    real = (~padding_mask).nonzero()
    pick = real[torch.randperm(len(real), generator=g)[:n_targets]]
    targets[pick[:, 0], pick[:, 1]] = torch.randint(4, 24, (n_targets,), generator=g)
    return {"tokens": tokens, "targets": targets, "padding_mask": padding_mask, "ids": ["a"] * B}


def reference(module: ProteinLMModule, batch: dict) -> tuple[float, int, int]:
    with torch.no_grad():
        logits = module.model(batch["tokens"], padding_mask=batch["padding_mask"]).logits
    sel = batch["targets"] != -100
    nll = F.cross_entropy(logits[sel], batch["targets"][sel], reduction="sum").item()
    correct = int((logits[sel].argmax(-1) == batch["targets"][sel]).sum())
    return nll, int(sel.sum()), correct


def test_a_batch_with_coordinates_keys_the_memory_by_them() -> None:
    """Family rows with data.family_coordinates=aligned carry ``coordinates``: the loss is the
    model's on those keys (issue 41), not on member positions (what 0.6 trained on)."""
    module = make_module(objective="clm", positions="member", position_memory=32)
    cls = module.performer_config.cls_idx
    batch = make_batch(1, B=2, T=20, n_targets=12)
    batch["tokens"][:, 0] = batch["tokens"][:, 10] = cls  # two members a row
    member = torch.cat([torch.arange(10), torch.arange(10)]).expand(2, 20)
    shifted = torch.where(member > 0, member + 5, member)  # the second member 5 columns on
    shifted[:, :10] = member[:, :10]
    placed = dict(batch, coordinates=shifted)
    with torch.no_grad():
        want = module.model(batch["tokens"], padding_mask=batch["padding_mask"],
                            coordinates=shifted).logits  # fmt: skip
    sel = batch["targets"] != -100
    nll = F.cross_entropy(want[sel], batch["targets"][sel], reduction="sum").item()
    assert module.training_step(placed, 0).item() == pytest.approx(nll / int(sel.sum()), 1e-5)
    assert module.training_step(placed, 0).item() != pytest.approx(
        module.training_step(batch, 0).item(), rel=1e-6)


def test_training_loss_is_mean_ce_over_targets_only() -> None:
    module = make_module()
    batch = make_batch(0, B=3, T=12, n_targets=7)
    loss = module.training_step(batch, 0)
    nll, n, _ = reference(module, batch)
    assert loss.item() == pytest.approx(nll / n, rel=1e-5)
    # Scoring one more position changes the loss: the -100 positions really are left out.
    more = dict(batch, targets=batch["targets"].clone())
    free = ((more["targets"] == -100) & ~more["padding_mask"]).nonzero()[0]
    more["targets"][free[0], free[1]] = 5
    assert module.training_step(more, 0).item() != pytest.approx(loss.item(), rel=1e-6)
    loss.backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_validation_metrics_are_token_weighted_over_batches() -> None:
    module = make_module().eval()
    # Very different target counts, so the mean of per-batch means differs from the token mean.
    batches = [make_batch(1, B=2, T=10, n_targets=2), make_batch(2, B=4, T=16, n_targets=40)]
    refs = [reference(module, b) for b in batches]
    nll = sum(r[0] for r in refs)
    n = sum(r[1] for r in refs)
    correct = sum(r[2] for r in refs)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(batches, batch_size=None)  # the batch dicts as they are
    (metrics,) = trainer.validate(module, dataloaders=loader, verbose=False)
    assert metrics["val/loss"] == pytest.approx(nll / n, rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert metrics["val/acc"] == pytest.approx(correct / n, abs=1e-6)
    per_batch_mean = sum(r[0] / r[1] for r in refs) / 2
    assert abs(per_batch_mean - nll / n) > 1e-3  # the check above can tell them apart


def test_optimizer_groups_exclude_norms_biases_embeddings() -> None:
    module = make_module()
    module.total_steps = lambda: 100  # no trainer attached
    conf = module.configure_optimizers()
    optimizer = conf["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW)
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    params = dict(module.model.named_parameters())
    assert len(decay_of) == len(params)  # every parameter exactly once (tied ones once)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(decay_of)
    seen = {"norm": 0, "bias": 0, "embedding": 0, "linear": 0}
    for mod in module.model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(mod, nn.LayerNorm):
                assert decay_of[id(p)] == 0.0
                seen["norm"] += 1
            elif isinstance(mod, nn.Embedding):
                assert decay_of[id(p)] == 0.0
                seen["embedding"] += 1
            elif name == "bias":
                assert decay_of[id(p)] == 0.0
                seen["bias"] += 1
            elif isinstance(mod, nn.Linear) and name == "weight":
                assert decay_of[id(p)] == pytest.approx(0.01)
                seen["linear"] += 1
    assert all(seen.values()), seen


def test_warmup_cosine_values() -> None:
    w, total, floor = 10, 110, 0.1
    assert warmup_cosine(0, w, total, floor) == pytest.approx(0.1)
    assert warmup_cosine(4, w, total, floor) == pytest.approx(0.5)
    assert warmup_cosine(9, w, total, floor) == pytest.approx(1.0)
    assert warmup_cosine(10, w, total, floor) == pytest.approx(1.0)
    assert warmup_cosine(60, w, total, floor) == pytest.approx(0.55)  # half-way: mid of [0.1, 1]
    assert warmup_cosine(110, w, total, floor) == pytest.approx(0.1)
    assert warmup_cosine(500, w, total, floor) == pytest.approx(0.1)  # stays at the floor
    values = [warmup_cosine(s, w, total, floor) for s in range(total)]
    assert all(values[i] < values[i + 1] for i in range(w - 1))  # warmup rises
    assert all(values[i] >= values[i + 1] for i in range(w, total - 1))  # cosine falls


def test_scheduler_steps_lr_per_optimizer_step() -> None:
    module = make_module()
    module.total_steps = lambda: 110
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    assert sched["interval"] == "step"
    base = module.optim["lr"]
    lrs = []
    for _ in range(111):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched["scheduler"].step()
    assert lrs[0] == pytest.approx(base * 0.1)
    assert lrs[9] == pytest.approx(base)
    assert lrs[60] == pytest.approx(base * 0.55)
    assert lrs[110] == pytest.approx(base * 0.1)


def test_unknown_optim_key_is_a_user_error() -> None:
    from protein_performer.errors import UserError

    with pytest.raises(UserError, match="lr_max"):
        ProteinLMModule(TINY, {"lr_max": 1.0})


def test_checkpoint_hook_stores_performer_config() -> None:
    module = make_module()
    ckpt: dict = {}
    module.on_save_checkpoint(ckpt)
    assert ckpt["performer_config"] == module.performer_config.to_dict()
    assert ckpt["performer_config"]["dim"] == TINY["dim"]


# ---- FeatureRedraw ----------------------------------------------------------------------------
def omegas(module: ProteinLMModule) -> list[torch.Tensor]:
    out = [buf.clone() for layer in module.model.layers for buf in layer.self_attn.core.buffers()]
    assert out, "no FAVOR+ buffers found"
    return out


def fire(callback: FeatureRedraw, module: ProteinLMModule, step: int) -> None:
    callback.on_train_batch_start(SimpleNamespace(global_step=step), module, None, 0)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_redraw_identical_for_same_seed_and_step() -> None:
    # Two "ranks" with different initial weights and features converge on the same omega.
    a, b = make_module(seed=0), make_module(seed=1)
    assert not same(omegas(a), omegas(b))
    fire(FeatureRedraw(interval=5, seed=7), a, 0)
    fire(FeatureRedraw(interval=5, seed=7), b, 0)
    assert same(omegas(a), omegas(b))
    fire(FeatureRedraw(interval=5, seed=8), b, 0)
    assert not same(omegas(a), omegas(b))  # the seed matters


def test_redraw_schedule() -> None:
    module = make_module()
    cb = FeatureRedraw(interval=5, seed=3)
    initial = omegas(module)
    fire(cb, module, 0)  # start of training
    at0 = omegas(module)
    assert not same(initial, at0)
    for step in (0, 1, 4):  # step 0 again = a second micro-batch of the same optimizer step
        fire(cb, module, step)
        assert same(omegas(module), at0)
    fire(cb, module, 5)
    at5 = omegas(module)
    assert not same(at5, at0)
    rng_before = torch.get_rng_state()
    fire(cb, module, 10)
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG (dropout) untouched
    assert not same(omegas(module), at5)


def test_redraw_interval_from_model_config_and_disable() -> None:
    module = make_module(feature_redraw_interval=3)
    cb = FeatureRedraw(interval=None, seed=0)
    fire(cb, module, 0)
    at0 = omegas(module)
    fire(cb, module, 2)
    assert same(omegas(module), at0)
    fire(cb, module, 3)
    assert not same(omegas(module), at0)
    off = FeatureRedraw(interval=0)
    before = omegas(module)
    fire(off, module, 0)
    assert same(omegas(module), before)


def test_redraw_generator_depends_on_seed_and_step_only() -> None:
    draw = lambda s, t: torch.randn(4, generator=redraw_generator(s, t))  # noqa: E731
    assert torch.equal(draw(1, 10), draw(1, 10))
    assert not torch.equal(draw(1, 10), draw(1, 11))
    assert not torch.equal(draw(1, 10), draw(2, 10))
