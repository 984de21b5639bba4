"""Every registered attention core and wrapper combination through one suite (issue 40).

The combinations come from the registry (a new core or wrapper is tested here without a line
added, except its reference below): values against the core's reference, gradients, padding,
causal leakage, split == whole, step == forward, a constant state size where the core declares
one, the weight hash over every learned tensor, the exact swap, export refusals and 0.5's key
paths. Tiny shapes, float64 where values are compared.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from protein_performer.interop.identity import weights_sha256
from protein_performer.model.attention import state_tensors
from protein_performer.model.config import ATTENTIONS, PerformerConfig
from protein_performer.model.cores import (
    CORES,
    WRAPPERS,
    AttentionCore,
    build_core,
    drawn_keys,
    model_cores,
    names,
)
from protein_performer.model.exact import ExactAttention
from protein_performer.model.favor import FavorAttention
from protein_performer.model.linear.core import LinearAttention
from protein_performer.model.linear.memory import PositionMemory
from protein_performer.model.linear.window import SlidingWindow
from protein_performer.model.performer import PerformerLM
from protein_performer.model.rotary import member_positions
from tests.model.linear.test_memory import _reference as memory_reference

KERNEL = {"favor": "softmax", "linear": "hedgehog", "exact": "softmax"}
SETS = {"window": {"local_window": 3}, "memory": {"position_memory": 12, "memory_window": 2}}


def _combos() -> list[tuple[str, tuple[str, ...]]]:
    """(core, wrappers) for every registered core and every subset of wrappers that fits it."""
    out = []
    for name, cls in sorted(CORES.items()):
        for n in range(len(WRAPPERS) + 1):
            for chosen in itertools.combinations(sorted(WRAPPERS), n):
                inner: type[AttentionCore] = cls
                ok = True
                for w in sorted(chosen, key=lambda w: WRAPPERS[w].order):
                    ok = ok and WRAPPERS[w].wraps(inner)
                    inner = WRAPPERS[w]
                if ok:
                    out.append((name, chosen))
    return out


names()  # the registry loads its modules before the combinations are listed
COMBOS = _combos()
IDS = ["+".join((c, *w)) for c, w in COMBOS]


def _config(core: str, wrappers: tuple[str, ...], causal: bool = True, **extra) -> PerformerConfig:
    fields = dict(vocab_size=33, dim=16, depth=2, heads=2, ff_dim=32, nb_features=16,
                  attention=core, kernel=KERNEL[core], objective="clm" if causal else "mlm",
                  favor_chunk_size=4)  # fmt: skip
    for w in wrappers:
        fields.update(SETS[w])
    return PerformerConfig(**{**fields, **extra}).validate()


def _core(core: str, wrappers: tuple[str, ...], causal: bool) -> AttentionCore:
    """The combination as the registry builds it, float64, its learned tensors moved off their
    initial values (a trained-looking core: a memory's gate open, a map not the identity)."""
    torch.manual_seed(0)
    built = build_core(_config(core, wrappers, causal)).double()
    with torch.no_grad():
        for p in built.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return built


def _row(B: int = 2, L: int = 23, seed: int = 0):
    """Family rows (members of 7 and 8 tokens, member positions), q, k, v (B, 2, L, 8) float64
    and right padding on the last row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 24, (B, L), generator=g)
    tokens[:, [0, 7, 15]] = 0
    pos = member_positions(tokens, 0)
    q, k, v = (torch.randn(B, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[-1, L - 4 :] = True
    return q, k, v, mask, pos


def _map_reference(core: AttentionCore, q, k, v, mask, pos) -> torch.Tensor:
    """Attention rows times values: what a core without a memory computes."""
    return core.attention_map(q, k, mask) @ v


def _memory_ref(core: PositionMemory, q, k, v, mask, pos) -> torch.Tensor:
    inner = REFERENCES[type(core.inner)](core.inner, q, k, v, mask, pos)
    return memory_reference(core, q, k, v, pos, mask, inner)


#: Each registered class's reference (a new core adds its own here: the test below asks).
REFERENCES = {
    ExactAttention: _map_reference,
    FavorAttention: _map_reference,
    LinearAttention: _map_reference,
    SlidingWindow: _map_reference,
    PositionMemory: _memory_ref,
}


def test_registry_names_the_cores_and_wrappers_a_config_may_ask_for():
    assert set(names()) == set(ATTENTIONS)
    assert {"window", "memory"} <= set(WRAPPERS)
    assert {cls for cls in [*CORES.values(), *WRAPPERS.values()]} <= set(REFERENCES)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_values_gradients_and_padding_against_the_reference(core, wrappers, causal):
    c = _core(core, wrappers, causal)
    q, k, v, mask, pos = _row()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = c(q, k, v, mask, positions=pos)
    ref = REFERENCES[type(c)](c, q, k, v, mask, pos)
    real = ~mask[:, None, :, None]
    torch.testing.assert_close(out * real, ref * real, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(out) * real
    params = [p for p in c.parameters() if p.requires_grad]
    got = torch.autograd.grad((out * g).sum(), (q, k, v, *params), allow_unused=True)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v, *params), allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # padded keys change nothing: other values there leave every real row as it was
    k2 = k.detach().clone().transpose(1, 2)  # (B, L, H, d): the mask indexes dims 0 and 1
    v2 = v.detach().clone().transpose(1, 2)
    k2[mask], v2[mask] = 7.0, -7.0
    again, _ = c(q.detach(), k2.transpose(1, 2), v2.transpose(1, 2), mask, positions=pos)
    torch.testing.assert_close(again * real, out.detach() * real)


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_causal_cores_never_read_later_tokens(core, wrappers):
    c = _core(core, wrappers, True)
    q, k, v, _, pos = _row(B=1)
    out, _ = c(q, k, v, positions=pos)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] += 3.0
    v2[:, :, 12:] -= 2.0
    later, _ = c(q, k2, v2, positions=pos)
    torch.testing.assert_close(later[:, :, :12], out[:, :, :12])
    assert not torch.allclose(later[:, :, 12:], out[:, :, 12:])


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_split_and_steps_equal_one_forward(core, wrappers):
    """A state continues the row: prefill + extend (split at a member's start, as a family
    context is read) and one step per token give the one-pass outputs."""
    c = _core(core, wrappers, True).eval()
    q, k, v, mask, pos = _row()
    with torch.no_grad():
        whole, _ = c(q, k, v, mask, positions=pos)
        s = slice(0, 15), slice(15, None)
        head, state = c(q[:, :, s[0]], k[:, :, s[0]], v[:, :, s[0]], mask[:, s[0]],
                        positions=pos[:, s[0]], keep_state=True)  # fmt: skip
        tail, _ = c(q[:, :, s[1]], k[:, :, s[1]], v[:, :, s[1]], mask[:, s[1]], state,
                    positions=pos[:, s[1]])  # fmt: skip
        real = ~mask[:, None, :, None]
        torch.testing.assert_close(torch.cat([head, tail], 2) * real, whole * real)
        steps, state = [], None
        for t in range(q.shape[2]):
            t_ = slice(t, t + 1)
            out, state = c.step(q[:, :, t_], k[:, :, t_], v[:, :, t_], state, mask[:, t_],
                                positions=pos[:, t_])  # fmt: skip
            steps.append(out)
        torch.testing.assert_close(torch.cat(steps, 2) * real, whole * real)


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_state_size_is_constant_in_the_context_where_the_core_says_so(core, wrappers):
    """A context of 2 or 8 members of 8 tokens: the same bytes unless the core declares a state
    that grows (a KV cache), which then grows."""
    c = _core(core, wrappers, True).eval()

    def nbytes(members: int) -> int:
        tokens = torch.full((1, 8 * members), 5)
        tokens[:, ::8] = 0
        pos = member_positions(tokens, 0)
        q = torch.randn(1, 2, tokens.shape[1], 8, dtype=torch.float64)
        with torch.no_grad():
            _, state = c(q, q, q, positions=pos, keep_state=True)
        return sum(t.numel() * t.element_size() for t in state_tensors((state,)))

    small, large = nbytes(2), nbytes(8)
    assert (large > small) if c.state_grows else (large == small)


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_hash_covers_every_learned_tensor_and_skips_what_is_drawn(core, wrappers):
    torch.manual_seed(0)
    model = PerformerLM(_config(core, wrappers))
    base = weights_sha256(model)
    drawn = drawn_keys(model)
    for key in model.state_dict():
        t = model.state_dict()[key]
        saved = t.clone()
        with torch.no_grad():
            t.add_(0.5)
        changed = weights_sha256(model) != base
        with torch.no_grad():
            t.copy_(saved)
        assert changed == (key not in drawn), key
    assert weights_sha256(model) == base
    assert drawn == {k for k in model.state_dict() if k.endswith(("omega", "oprf_rho"))}


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_exact_swap_keeps_the_wrappers_or_refuses_in_one_line(core, wrappers):
    from protein_performer.interop.loading import load_model
    from protein_performer.interop.record import LoadedModel

    config = _config(core, wrappers)
    torch.manual_seed(0)
    model = PerformerLM(config).eval()
    loaded = LoadedModel(model, config, Alphabet(), Path("m"), torch.device("cpu"), "lightning")
    inner = model_cores(model)[0].cores()[-1]
    refused = any(True for _ in inner.parameters()) or not all(
        WRAPPERS[w].wraps(ExactAttention) for w in wrappers
    )
    if refused:  # learned tensors only this core has: no exact twin computes them
        with pytest.raises(UserError) as err:
            load_model(loaded, "cpu", attention="exact")
        assert "\n" not in str(err.value)
        return
    swapped = load_model(loaded, "cpu", attention="exact")
    kinds = {tuple(type(c) for c in outer.cores()) for outer in model_cores(swapped.model)}
    assert kinds == {(*(WRAPPERS[w] for w in reversed(wrappers)), ExactAttention)}
    assert weights_sha256(swapped.model) == weights_sha256(model)


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_hf_export_refuses_what_esm_cannot_compute_in_one_line(core, wrappers):
    from protein_performer.interop.export_hf import check_exportable
    from protein_performer.interop.record import LoadedModel

    config = _config(core, wrappers, causal=False)
    model = PerformerLM(config)
    loaded = LoadedModel(model, config, Alphabet(), Path("m"), torch.device("cpu"), "lightning")
    if core == "exact" and not wrappers:
        check_exportable(loaded, as_exact=False)
        return
    with pytest.raises(UserError) as err:
        check_exportable(loaded, as_exact=False)
    message = str(err.value)
    assert "\n" not in message and ("--format native" in message or "--as-exact" in message)
    if core == "favor" and not wrappers:
        check_exportable(loaded, as_exact=True)


@pytest.mark.parametrize(("core", "wrappers"), COMBOS, ids=IDS)
def test_files_of_0_5_load_with_their_old_key_paths(core, wrappers, tmp_path):
    """0.5 kept a layer's core under its attention's name (``self_attn.favor.omega``); a
    checkpoint and an export written that way load into today's ``self_attn.core``."""
    from safetensors.torch import save_file

    from protein_performer.interop.export import export_model
    from protein_performer.interop.loading import load_model
    from protein_performer.interop.ours import FORMAT_NAME
    from protein_performer.interop.record import LoadedModel
    from protein_performer.io.checkpoints import save_atomic

    config = _config(core, wrappers)
    torch.manual_seed(0)
    model = PerformerLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))

    def old_key(key: str) -> str:  # layers.{i}.self_attn.core. -> .self_attn.{its attention}.
        parts = key.split(".")
        if parts[0] != "layers" or parts[2:4] != ["self_attn", "core"]:
            return key
        return ".".join([*parts[:3], config.layer_attention(int(parts[1]) + 1), *parts[4:]])

    old = {old_key(k): v for k, v in model.state_dict().items()}
    ckpt = tmp_path / "old.ckpt"
    save_atomic({"state_dict": {f"model.{k}": v for k, v in old.items()},
                 "hyper_parameters": {"config": config.to_dict()}}, ckpt)  # fmt: skip
    out = export_model(LoadedModel(model, config, Alphabet(), ckpt, torch.device("cpu"), "x"),
                       tmp_path / "export")  # fmt: skip
    weights = out / "model.safetensors"
    tensors = {k: v.contiguous() for k, v in old.items() if k != "lm_head.weight"}
    save_file(tensors, str(weights), metadata={"format": FORMAT_NAME})
    want = model.state_dict()
    resumed = PerformerLM(config)  # a training resume: Lightning's strict load_state_dict
    resumed.load_state_dict(old, strict=True)
    assert all(torch.equal(resumed.state_dict()[k], want[k]) for k in want)
    for src in (ckpt, out):
        got = load_model(src, "cpu").model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_memory_needs_member_positions_and_says_so_in_one_line():
    with pytest.raises(UserError, match="needs positions=member") as err:
        _config("favor", ("memory",), positions="sequence")
    assert "\n" not in str(err.value)


def test_a_config_of_a_hybrid_stack_counts_its_exact_layers():
    config = _config("favor", ("memory",), depth=3, exact_every=2)
    kinds = [type(c.cores()[-1]) for c in model_cores(PerformerLM(config))]
    assert kinds == [ExactAttention, FavorAttention, ExactAttention]
    assert PerformerLM(config).num_parameters() <= config.estimated_numel()
    assert dataclasses.replace(config, exact_every=0).validate()


def test_init_from_copies_every_learned_tensor_and_keeps_what_is_drawn(tmp_path):
    """``init_from`` asks the cores what they draw: a memory model's gate and offsets are
    copied (0.5 matched the path ``self_attn.favor`` and left them out), omega is kept."""
    from protein_performer.interop.export import export_model
    from protein_performer.interop.record import LoadedModel
    from protein_performer.training.init_weights import init_from
    from protein_performer.training.lit_module import ProteinLMModule

    config = _config("favor", ("memory",))
    torch.manual_seed(0)
    source = PerformerLM(config)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.1)
    src = export_model(
        LoadedModel(source, config, Alphabet(), Path("s"), torch.device("cpu"), "x"),
        tmp_path / "src",
    )
    module = ProteinLMModule(config.to_dict())
    omega = module.model.layers[0].self_attn.core.inner.omega.clone()
    kept = init_from(module, src)
    assert kept == [f"layers.{i}.self_attn.core.inner.omega" for i in range(config.depth)]
    core = module.model.layers[0].self_attn.core
    assert torch.equal(core.gate_bias, source.layers[0].self_attn.core.gate_bias)
    assert torch.equal(core.inner.omega, omega)


def test_a_new_core_is_one_class_and_one_register(monkeypatch):
    """What a new module in model/cores/ does: a subclass with ``@register``; a config names
    it, the model builds it, the memory wraps it, nothing else is edited."""
    from protein_performer.model.cores import registry

    monkeypatch.setattr(registry, "CORES", dict(registry.CORES))

    @registry.register("uniform")
    class Uniform(AttentionCore):
        """Every real key weighs the same (causal: those up to the query)."""

        def __init__(self, causal: bool) -> None:
            super().__init__()
            self.causal = causal

        @classmethod
        def from_config(cls, config):
            return cls(config.causal)

        def attention_map(self, q, k, key_padding_mask=None, query_slice=None):
            w = torch.ones(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=q.dtype)
            if self.causal:
                w = w.tril()
            if key_padding_mask is not None:
                w = w.masked_fill(key_padding_mask[:, None, None, :], 0.0)
            return w / w.sum(-1, keepdim=True)

        def attend(self, q, k, v, key_padding_mask, state, *, keep_state, inplace, positions):
            return self.attention_map(q, k, key_padding_mask) @ v, None

    config = _config("favor", ("memory",), attention="uniform")
    model = PerformerLM(config)
    assert [type(c) for c in model_cores(model)[0].cores()] == [PositionMemory, Uniform]
    assert torch.isfinite(model(torch.randint(4, 24, (2, 9))).logits).all()
