"""Tiny-model tests of the Performer LM: shapes, ESM-2 equivalence, causality, padding, rotary."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from protein_performer.errors import UserError
from protein_performer.model.attention import state_tensors
from protein_performer.model.config import KERNELS, PerformerConfig, default_nb_features
from protein_performer.model.performer import PerformerLM, PerformerOutput
from protein_performer.model.rotary import RotaryEmbedding, apply_rotary, rotate_half

VARIANTS = [(o, a) for o in ("mlm", "clm") for a in ("favor", "exact")]


def tiny_config(**overrides) -> PerformerConfig:
    base = dict(dim=32, depth=2, heads=4, ff_dim=64, nb_features=16)
    base.update(overrides)
    return PerformerConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> PerformerLM:
    torch.manual_seed(seed)
    model = PerformerLM(tiny_config(**overrides))
    # Non-trivial LayerNorm/bias parameters so that a mistake in their use shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def random_tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """``<cls>`` residues ``<eos>``, residues drawn from the 20 standard amino acids (4..23)."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(4, 24, (batch, length - 2), generator=g)
    cls = torch.zeros(batch, 1, dtype=torch.long)
    eos = torch.full((batch, 1), 2, dtype=torch.long)
    return torch.cat([cls, body, eos], dim=1)


def esm2_reference_logits(model: PerformerLM, tokens: torch.Tensor) -> torch.Tensor:
    """ESM-2's forward written out from fair-esm's code (q scaled before rotary, -inf masked
    softmax, erf GELU, RobertaLMHead), reading our model's weights."""
    cfg = model.config
    pad = tokens.eq(cfg.pad_idx)
    x = model.embed_tokens.weight[tokens]
    if cfg.token_dropout:
        is_mask = tokens == cfg.mask_idx
        x = x.masked_fill(is_mask.unsqueeze(-1), 0.0)
        ratio = is_mask.sum(-1).to(x.dtype) / (~pad).sum(-1)
        x = x * (1 - 0.15 * 0.8) / (1 - ratio)[:, None, None]
    x = x * (1 - pad.unsqueeze(-1).type_as(x))

    def ln(mod, h):
        mu = h.mean(-1, keepdim=True)
        var = (h - mu).pow(2).mean(-1, keepdim=True)
        return (h - mu) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias

    def gelu(h):
        return h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))

    B, T = tokens.shape
    H, d = cfg.heads, cfg.head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.einsum("i,j->ij", torch.arange(T).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rot(h):
        h1, h2 = h[..., : d // 2], h[..., d // 2 :]
        return h * cos + torch.cat((-h2, h1), -1) * sin

    for layer in model.layers:
        a = layer.self_attn
        h = ln(layer.self_attn_layer_norm, x)
        q = (h @ a.q_proj.weight.T + a.q_proj.bias) * d**-0.5
        k = h @ a.k_proj.weight.T + a.k_proj.bias
        v = h @ a.v_proj.weight.T + a.v_proj.bias
        q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))
        q, k = rot(q), rot(k)
        w = q @ k.transpose(-1, -2)
        w = w.masked_fill(pad[:, None, None, :], float("-inf"))
        if cfg.causal:
            w = w.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        o = (w.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * d)
        x = x + o @ a.out_proj.weight.T + a.out_proj.bias
        h = gelu(ln(layer.final_layer_norm, x) @ layer.fc1.weight.T + layer.fc1.bias)
        x = x + h @ layer.fc2.weight.T + layer.fc2.bias
    x = ln(model.emb_layer_norm_after, x)
    head = model.lm_head
    x = ln(head.layer_norm, gelu(x @ head.dense.weight.T + head.dense.bias))
    return x @ model.embed_tokens.weight.T + head.bias


@pytest.mark.parametrize("objective,attention", VARIANTS)
def test_shapes(objective: str, attention: str) -> None:
    model = tiny_model(objective=objective, attention=attention)
    tokens = random_tokens(3, 11)
    out = model(tokens, repr_layers=(0, 1, 2), attention_layers=(1, 2))
    assert isinstance(out, PerformerOutput)
    assert out.logits.shape == (3, 11, 33)
    assert sorted(out.hidden_states) == [0, 1, 2]
    assert all(h.shape == (3, 11, 32) for h in out.hidden_states.values())
    assert sorted(out.attentions) == [1, 2]
    assert all(a.shape == (3, 4, 11, 11) for a in out.attentions.values())
    assert model(tokens).attentions is None
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("objective", ["mlm", "clm"])
@pytest.mark.parametrize("token_dropout", [False, True])
def test_exact_twin_matches_esm2_reference(objective: str, token_dropout: bool) -> None:
    model = tiny_model(objective=objective, attention="exact", token_dropout=token_dropout)
    tokens = random_tokens(2, 12)
    tokens[0, 3] = tokens[0, 7] = model.config.mask_idx
    tokens[1, 8:] = model.config.pad_idx
    with torch.no_grad():
        ours = model(tokens).logits
        ref = esm2_reference_logits(model, tokens)
    real = tokens != model.config.pad_idx
    torch.testing.assert_close(ours[real], ref[real], atol=2e-5, rtol=1e-5)


def test_token_dropout_changes_masked_inputs_only_when_enabled() -> None:
    tokens = random_tokens(1, 10)
    tokens[0, 4] = 32
    off = tiny_model(attention="exact")
    on = tiny_model(attention="exact", token_dropout=True)
    pad = tokens.eq(1)
    x_off, x_on = off.embed(tokens, pad), on.embed(tokens, pad)
    assert torch.equal(x_on[0, 4], torch.zeros(32))
    torch.testing.assert_close(x_on[0, 0], x_off[0, 0] * (1 - 0.12) / (1 - 0.1))


def test_tied_head_shares_storage() -> None:
    model = tiny_model()
    assert model.lm_head.weight is model.embed_tokens.weight
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["embed_tokens.weight"].data_ptr()
    with torch.no_grad():
        model.embed_tokens.weight[5, 0] = 123.0
    assert model.lm_head.weight[5, 0].item() == 123.0
    naive = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.num_parameters() == naive - 33 * 32
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once, under the embedding


def test_padding_row_and_positions_are_zero() -> None:
    model = tiny_model()
    assert torch.equal(model.embed_tokens.weight[1], torch.zeros(32))
    with torch.no_grad():  # a converted checkpoint may carry a non-zero pad row
        model.embed_tokens.weight[1] = 1.0
    tokens = random_tokens(1, 6)
    tokens = torch.cat([tokens, torch.ones(1, 3, dtype=torch.long)], dim=1)
    out = model(tokens, repr_layers=(0,))
    assert torch.equal(out.hidden_states[0][0, 6:], torch.zeros(3, 32))


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_causal_model_ignores_future_tokens(attention: str) -> None:
    tokens = random_tokens(2, 14)
    changed = tokens.clone()
    changed[:, 8:] = torch.randint(4, 24, (2, 6), generator=torch.Generator().manual_seed(9))
    clm = tiny_model(objective="clm", attention=attention)
    with torch.no_grad():
        a, b = clm(tokens).logits, clm(changed).logits
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-3)
    # The bidirectional twin must see the change: the check above can fail.
    mlm = tiny_model(objective="mlm", attention=attention)
    with torch.no_grad():
        a, b = mlm(tokens).logits, mlm(changed).logits
    assert not torch.allclose(a[:, :8], b[:, :8], atol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_runs_causally(kernel: str) -> None:
    model = tiny_model(objective="clm", kernel=kernel)
    tokens = random_tokens(1, 12)
    changed = tokens.clone()
    changed[0, 9] = 4 if tokens[0, 9] != 4 else 5
    with torch.no_grad():
        a, b = model(tokens).logits, model(changed).logits
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-5, rtol=1e-5)


def test_favor_chunk_size_reaches_the_core_and_changes_nothing() -> None:
    tokens = random_tokens(2, 14)
    a = tiny_model(objective="clm")
    b = tiny_model(objective="clm", favor_chunk_size=4)
    assert b.layers[0].self_attn.core.chunk_size == 4
    with torch.no_grad():
        torch.testing.assert_close(a(tokens).logits, b(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("objective,attention", VARIANTS)
def test_appending_pads_leaves_real_logits_unchanged(objective: str, attention: str) -> None:
    model = tiny_model(objective=objective, attention=attention)
    short = random_tokens(2, 9)
    short[1, 6:] = model.config.pad_idx  # ragged batch: row 1 already padded
    padded = torch.cat([short, torch.full((2, 5), model.config.pad_idx)], dim=1)
    with torch.no_grad():
        a, b = model(short).logits, model(padded).logits[:, :9]
    real = short != model.config.pad_idx
    tol = 1e-6 if attention == "exact" else 1e-5
    torch.testing.assert_close(a[real], b[real], atol=tol, rtol=tol)
    # Explicit mask and derived mask agree.
    with torch.no_grad():
        c = model(padded, padding_mask=padded.eq(model.config.pad_idx)).logits[:, :9]
    torch.testing.assert_close(b, c)


def test_rotary_matches_esm2_and_is_relative() -> None:
    x = torch.arange(8.0)
    assert torch.equal(rotate_half(x), torch.tensor([-4.0, -5, -6, -7, 0, 1, 2, 3]))
    d, L = 8, 7
    rot = RotaryEmbedding(d)
    cos, sin = rot.tables(L, torch.device("cpu"), torch.float32)
    # Pair (j, j + d/2) rotates by angle pos * base^(-2j/d) (ESM-2's half-split pairing).
    pos, j = 5, 1
    angle = pos * 10000 ** (-2 * j / d)
    assert math.isclose(cos[pos, j].item(), math.cos(angle), rel_tol=1e-6)
    assert math.isclose(sin[pos, j + d // 2].item(), math.sin(angle), rel_tol=1e-6)
    v = torch.zeros(d)
    v[j] = 1.0
    rotated = apply_rotary(v, cos[pos], sin[pos])
    assert math.isclose(rotated[j].item(), math.cos(angle), rel_tol=1e-6)
    assert math.isclose(rotated[j + d // 2].item(), math.sin(angle), rel_tol=1e-6)

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, L, d, generator=g), torch.randn(1, 1, L, d, generator=g)
    q0, k0 = rot(q, k)
    q5, k5 = rot(q, k, offset=5)
    s0, s5 = q0 @ k0.transpose(-1, -2), q5 @ k5.transpose(-1, -2)
    torch.testing.assert_close(s0, s5, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(s0, q @ k.transpose(-1, -2), atol=1e-3)  # rotary does something
    # The cache serves shorter lengths and offsets from one table without changing values.
    long_cos, _ = rot.tables(50, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(long_cos[:L], cos)
    torch.testing.assert_close(
        rot.tables(3, torch.device("cpu"), torch.float32, offset=4)[0], long_cos[4:7]
    )


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_runs_at_unseen_length(attention: str) -> None:
    model = tiny_model(attention=attention)
    with torch.no_grad():
        model(random_tokens(1, 16))
        out = model(random_tokens(1, 300))
    assert out.logits.shape == (1, 300, 33)
    assert torch.isfinite(out.logits).all()


def test_hidden_states_convention() -> None:
    model = tiny_model(attention="exact")
    tokens = random_tokens(2, 10)
    out = model(tokens, repr_layers=(0, -1, 1))
    assert sorted(out.hidden_states) == [0, 1, 2]
    # Last layer is after the final norm: the LM head applied to it gives the logits.
    torch.testing.assert_close(model.lm_head(out.hidden_states[2]), out.logits)
    h1 = out.hidden_states[1]
    torch.testing.assert_close(model.layers[1](h1)[0], _pre_norm_last(model, tokens))
    assert sorted(model(tokens, repr_layers=(-3, -2)).hidden_states) == [0, 1]
    with pytest.raises(UserError, match="out of range"):
        model(tokens, repr_layers=(3,))
    with pytest.raises(UserError, match="out of range"):
        model(tokens, attention_layers=(0,))
    with pytest.raises(UserError, match="head"):
        model(tokens, attention_layers=(1,), attention_heads=(4,))


def _pre_norm_last(model: PerformerLM, tokens: torch.Tensor) -> torch.Tensor:
    """Output of the last block before the final norm, captured with a hook."""
    captured = {}
    handle = model.layers[-1].register_forward_hook(lambda m, i, o: captured.update(x=o[0]))
    model(tokens)
    handle.remove()
    return captured["x"]


@pytest.mark.parametrize("objective,attention", VARIANTS)
def test_attention_maps(objective: str, attention: str) -> None:
    model = tiny_model(objective=objective, attention=attention)
    tokens = random_tokens(2, 10)
    tokens[1, 7:] = model.config.pad_idx
    with torch.no_grad():
        out = model(tokens, attention_layers=(-1,), attention_heads=(0, 2))
    ((layer, maps),) = out.attentions.items()
    assert layer == 2 and maps.shape == (2, 2, 10, 10)
    real = tokens != model.config.pad_idx
    sums = maps.sum(-1)  # (B, H', T)
    torch.testing.assert_close(
        sums[real[:, None, :].expand_as(sums)],
        torch.ones(int(real.sum()) * 2),
        atol=1e-5,
        rtol=1e-5,
    )
    assert torch.equal(maps[1, :, 7:], torch.zeros(2, 3, 10))  # pad rows zeroed, like ESM-2
    assert torch.equal(maps[1, :, :, 7:], torch.zeros(2, 10, 3))  # no weight on pad keys
    if objective == "clm":
        assert torch.equal(maps.triu(1), torch.zeros_like(maps))
    # Selected heads are the same as those of the full map.
    with torch.no_grad():
        full = model(tokens, attention_layers=(2,)).attentions[2]
    torch.testing.assert_close(full[:, [0, 2]], maps)


def test_redraw_is_reproducible_across_instances() -> None:
    def omegas(model: PerformerLM) -> list[torch.Tensor]:
        return [b.clone() for layer in model.layers for b in layer.self_attn.core.buffers()]

    a, b = tiny_model(seed=1), tiny_model(seed=2)
    assert omegas(a) and not all(
        torch.equal(x, y) for x, y in zip(omegas(a), omegas(b), strict=True)
    )
    a.redraw_features(torch.Generator().manual_seed(7))
    b.redraw_features(torch.Generator().manual_seed(7))
    oa, ob = omegas(a), omegas(b)
    assert all(torch.equal(x, y) for x, y in zip(oa, ob, strict=True))
    assert not torch.equal(oa[0], oa[-1])  # layers get different features
    a.redraw_features(torch.Generator().manual_seed(8))
    assert not torch.equal(omegas(a)[0], oa[0])
    # Features are persistent buffers: they travel in the checkpoint.
    assert any("self_attn.core." in k for k in a.state_dict())
    tiny_model(attention="exact").redraw_features()  # no-op without FAVOR+


def _loss(model: PerformerLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


@pytest.mark.parametrize("objective,attention", VARIANTS)
def test_gradient_reaches_every_parameter(objective: str, attention: str) -> None:
    model = tiny_model(objective=objective, attention=attention).train()
    _loss(model, random_tokens(2, 10)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_gradient_checkpointing_gives_same_gradients(attention: str) -> None:
    tokens = random_tokens(2, 10)
    grads = []
    for ckpt in (False, True):
        model = tiny_model(attention=attention, dropout=0.1, gradient_checkpointing=ckpt).train()
        assert all(layer.gradient_checkpointing == ckpt for layer in model.layers)
        torch.manual_seed(3)
        _loss(model, tokens).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_param_groups() -> None:
    model = tiny_model()
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.embed_tokens.weight) in no_decay_ids
    assert id(model.layers[0].self_attn_layer_norm.weight) in no_decay_ids
    assert id(model.lm_head.bias) in no_decay_ids
    assert id(model.layers[0].fc1.bias) in no_decay_ids
    assert {id(p) for p in decay["params"]} == {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)
    }


def test_param_groups_leave_the_memory_gates_and_offsets_undecayed() -> None:
    """The position memory's 2-D offset logits and gate weights are logits, declared by the
    core (``no_decay``): out of weight decay like biases, the Linear weights still in it."""
    from protein_performer.model.linear.memory import PositionMemory

    config = PerformerConfig(dim=16, depth=2, heads=2, nb_features=8, objective="clm",
                             position_memory=16, memory_window=2).validate()  # fmt: skip
    model = PerformerLM(config)
    decay, no_decay = model.param_groups(0.1)
    memories = [m for m in model.modules() if isinstance(m, PositionMemory)]
    assert len(memories) == 2
    gates = {id(p) for m in memories for p in (m.offset_logits, m.gate_weight, m.gate_bias)}
    assert gates <= {id(p) for p in no_decay["params"]}
    assert {id(p) for p in decay["params"]} == {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)
    }


def test_config_round_trip_and_validation() -> None:
    cfg = tiny_config(objective="clm", kernel="relu", favor_chunk_size=64, token_dropout=True)
    data = cfg.to_dict()
    assert PerformerConfig.from_dict(data) == cfg
    assert cfg.causal and cfg.head_dim == 8
    with pytest.raises(UserError, match="unknown model config key.*dimm"):
        PerformerConfig.from_dict({**data, "dimm": 3})
    bad = {
        "heads": (dict(heads=5), "not divisible"),
        "odd head": (dict(dim=36, heads=12), "even"),
        "kernel": (dict(kernel="cosine"), "unknown kernel 'cosine'"),
        "objective": (dict(objective="mlm2"), "unknown objective"),
        "attention": (dict(attention="flash"), "unknown attention"),
        "pad": (dict(pad_idx=40), "pad_idx"),
        "depth": (dict(depth=0), "depth"),
        "dropout": (dict(dropout=1.0), "dropout"),
    }
    for overrides, message in bad.values():
        with pytest.raises(UserError, match=message):
            PerformerConfig.from_dict(dataclasses.asdict(tiny_config(**overrides)))
        with pytest.raises(UserError, match=message):
            PerformerLM(tiny_config(**overrides))


def test_nb_features_default_is_d_log_d_and_stored_resolved() -> None:
    # m = d ln d rounded up to a multiple of 16 (issue 14): 48 at ESM-2 8M's d=16, 272 at d=64.
    expected = {2: 16, 8: 32, 16: 48, 32: 112, 64: 272, 128: 624}
    for d, m in expected.items():
        assert default_nb_features(d) == m
        assert m >= d * math.log(d) and m % 16 == 0 and m - d * math.log(d) < 16
    esm8m = PerformerConfig()  # the ESM-2 8M shape: 20 heads of 16
    assert esm8m.head_dim == 16 and esm8m.nb_features == 48
    assert PerformerConfig(dim=512, heads=8).nb_features == 272
    # A checkpoint stores the resolved number, and a stored number is never re-resolved.
    assert esm8m.to_dict()["nb_features"] == 48
    wide = PerformerConfig.from_dict({"nb_features": None, "dim": 512, "heads": 8})
    assert wide.nb_features == 272
    assert PerformerConfig.from_dict({**esm8m.to_dict(), "nb_features": 256}).nb_features == 256
    model = PerformerLM(tiny_config(nb_features=None))
    favor = model.layers[0].self_attn.core
    assert favor is not None and favor.omega.shape == (default_nb_features(8), 8)



CORES = {
    "favor": {"attention": "favor"},
    "exact": {"attention": "exact"},
    "linear": {"attention": "linear", "kernel": "taylor"},
    "window": {"attention": "linear", "kernel": "taylor", "local_window": 4},
    "memory": {"attention": "favor", "position_memory": 8},
}


class _ShiftedLinear(torch.nn.Linear):
    """A projection whose forward is not its weight alone (as a LoRA adapter's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.5


def test_steps_run_a_replaced_projection_forward() -> None:
    """A decoding step stacks q, k, v into one GEMM only for plain Linear layers: with a
    replaced projection (LoRA's) the steps still equal the causal forward."""
    model = tiny_model(objective="clm")
    for layer in model.layers:
        old = layer.self_attn.q_proj
        new = _ShiftedLinear(old.in_features, old.out_features)
        new.load_state_dict(old.state_dict())
        layer.self_attn.q_proj = new
    tokens = random_tokens(2, 12)
    with torch.inference_mode():
        ref = model(tokens).logits
        logits, states = model.prefill(tokens[:, :6])
        for t in range(6, 12):
            out, states = model.step(tokens[:, t], torch.full((2,), t), states, inplace=True)
            torch.testing.assert_close(out, ref[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_in_place_steps_reuse_their_buffers(attention: str) -> None:
    """inplace=True gives the state up: FAVOR+ updates the prompt's own sum, exact grows its
    cache into the spare room of one buffer (allocated by the first step); the outputs are
    those of copying steps, which leave their states as they were."""
    core = tiny_model(objective="clm", attention=attention).layers[0].self_attn.core
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 40, 8, generator=g) for _ in range(3))
    _, given = core(q[:, :, :4], k[:, :, :4], v[:, :, :4], keep_state=True)
    copied = type(given)(*(t.clone() for t in given))
    storages = set()
    for t in range(4, 40):
        sl = slice(t, t + 1)
        before = [x.clone() for x in copied]
        one, given = core(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, given,
                          keep_state=True, inplace=True)  # fmt: skip
        two, after = core(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, copied, keep_state=True)
        assert torch.equal(one, two)
        assert all(map(torch.equal, before, copied))
        copied = after
        storages.add(given[0].untyped_storage().data_ptr())
    assert len(storages) == 1


@pytest.mark.parametrize("name", CORES)
def test_cores_share_one_interface(name: str) -> None:
    """Every core through its one call: a prefill (from no state, keeping it), then an extend
    from that state or one-token steps (at their rotary positions), equal the parallel causal
    forward; the state given is never written; the map rows sum to 1 and reproduce the
    forward (map @ V; the memory mixes values by position, so not there)."""
    core = tiny_model(objective="clm", **CORES[name]).layers[0].self_attn.core
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))  # (B, H, L, d)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 7:] = True  # right padding, as in generation
    real = ~pad[:, None, :, None]
    ref, none = core(q, k, v, pad)
    assert none is None
    for start in (1, 5):
        head, state = core(q[:, :, :start], k[:, :, :start], v[:, :, :start], pad[:, :start],
                           keep_state=True)  # fmt: skip
        before = [t.clone() for t in state_tensors(state)]
        rest = (q[:, :, start:], k[:, :, start:], v[:, :, start:], pad[:, start:])
        tail, _ = core(*rest, state, positions=start)
        assert all(map(torch.equal, before, state_tensors(state)))
        outs = [head]
        for t in range(start, 9):
            sl = slice(t, t + 1)
            out, state = core(q[:, :, sl], k[:, :, sl], v[:, :, sl], pad[:, sl], state,
                              keep_state=True, inplace=True, positions=t)  # fmt: skip
            outs.append(out)
        got = torch.cat(outs, 2)  # (B, H, L, d)
        torch.testing.assert_close(got * real, ref * real)
        keep = real[:, :, start:]
        torch.testing.assert_close(tail * keep, ref[:, :, start:] * keep)
    maps = core.attention_map(q, k, key_padding_mask=pad)  # (B, H, L, L)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 4, 9))
    assert torch.equal(maps.triu(1), torch.zeros_like(maps))
    if name != "memory":
        torch.testing.assert_close((maps @ v) * real, ref * real, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("objective,attention", VARIANTS)
def test_map_blocks_are_the_residue_map(objective: str, attention: str) -> None:
    """A core's contact-map blocks: S = A + A^T between residues (rows normalized over every
    token) and its row sums; causal FAVOR+ has no block form and says so."""
    core = tiny_model(objective=objective, attention=attention).layers[0].self_attn.core
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 1, 12, 8, generator=g) for _ in range(2))  # <cls> 10 residues <eos>
    if attention == "favor" and objective == "clm":
        with pytest.raises(UserError, match="causal FAVOR"):
            core.map_blocks(q, k, 10, 4)
        return
    blocks = core.map_blocks(q, k, 10, 4)
    a = core.attention_map(q, k)[0, 0, 1:11, 1:11]  # (L, L) residues
    s = a + a.T
    torch.testing.assert_close(blocks.sums, s.sum(-1))
    acc = torch.zeros(3, 6)
    blocks.add_upper_block(acc, 4, 2.0)  # rows 4..6, columns 4..9
    torch.testing.assert_close(acc, 2.0 * s[4:7, 4:])


def test_model_built_under_inference_mode_runs_and_sees_weight_edits() -> None:
    """Regression: the stacked q/k/v projection keyed its cache on version counters, which
    parameters made under ``torch.inference_mode`` lack ("Inference tensors do not track version
    counter"). Such a model must run, give the three-GEMM values, and see an in-place edit."""
    torch.manual_seed(0)
    cfg = PerformerConfig(dim=32, depth=1, heads=2, ff_dim=64, objective="clm")
    tokens = torch.randint(4, 24, (2, 12))
    with torch.inference_mode():
        model = PerformerLM(cfg).eval()
        attn = model.layers[0].self_attn
        fused = model(tokens).logits
        attn.q_proj.weight.mul_(0.5)
        edited = model(tokens).logits
    assert torch.isfinite(fused).all()
    assert not torch.allclose(fused, edited)
    with torch.inference_mode():
        x = torch.randn(2, 12, 32)
        weight, bias = attn._qkv_weights()
        stacked = torch.nn.functional.linear(x, weight, bias)
        separate = torch.cat([m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], -1)
    torch.testing.assert_close(stacked, separate)
