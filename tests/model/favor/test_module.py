"""model/favor/module.py: FavorAttention's contract: padding invariance (check 7 of
docs/FAVOR.md), finite numbers at long lengths, large norms and bf16 autocast (check 9),
shapes, omega redraws and the state dict, FAVOR++'s running statistic."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.exact import exact_attention
from protein_performer.model.favor import KERNELS, FavorAttention, favor_attention
from tests.model.favor.common import gen, module, qkv


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(kernel, causal):
    B, H, L, d, extra = 2, 2, 12, 8, 9
    q, k, v = qkv(B, H, L, d, seed=30)
    attn = module(kernel, causal, d=d, chunk_size=5, block_size=8)
    garbage = qkv(B, H, extra, d, seed=31, scale=20.0)  # huge values must not matter
    padded = [torch.cat([a, b], dim=2) for a, b in zip((q, k, v), garbage, strict=True)]
    mask = torch.zeros(B, L + extra, dtype=torch.bool)
    mask[:, L:] = True
    # Sequence 1 is shorter: its own pads in the middle of the unpadded length too.
    mask[1, 8:] = True
    out = attn(*padded, key_padding_mask=mask)[0]
    ref0 = attn(q[:1], k[:1], v[:1])[0]
    ref1 = attn(q[1:, :, :8], k[1:, :, :8], v[1:, :, :8])[0]
    assert torch.allclose(out[:1, :, :L], ref0, atol=1e-10)
    assert torch.allclose(out[1:, :, :8], ref1, atol=1e-10)
    assert torch.isfinite(out).all()
    ex = exact_attention(*padded, causal=causal, key_padding_mask=mask)
    assert torch.allclose(ex[:1, :, :L], exact_attention(q[:1], k[:1], v[:1], causal=causal))


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padding_causal_is_finite_and_invariant(kernel):
    """Rows before the first real key see no key: 0 out, like exact attention (a stabilizer
    once clamped the key row term in place, giving trig's leading pads features)."""
    q, k, v = qkv(1, 1, 10, 8, seed=32)
    attn = module(kernel, True, chunk_size=4)
    pads = qkv(1, 1, 6, 8, seed=33, scale=10.0)
    padded = [torch.cat([b, a], dim=2) for a, b in zip((q, k, v), pads, strict=True)]
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[:, :6] = True
    out = attn(*padded, key_padding_mask=mask)[0]
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, :, 6:], attn(q, k, v)[0], atol=1e-10)
    assert float(out[:, :, :6].abs().max()) == 0.0
    ex = exact_attention(*padded, causal=True, key_padding_mask=mask)
    assert torch.isfinite(ex).all() and float(ex[:, :, :6].abs().max()) == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_is_finite(causal):
    L = 65536
    g = gen(41)
    q, k, v = (torch.randn(1, 1, L, 8, generator=g).requires_grad_() for _ in range(3))
    attn = FavorAttention(8, 16, causal=causal, generator=gen(42))
    out = attn(q, k, v)[0]
    assert out.shape == (1, 1, L, 8) and torch.isfinite(out).all()
    out.pow(2).mean().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_large_norm_inputs_under_bf16_autocast_are_finite(kernel, causal):
    """Outputs and gradients stay finite far beyond exp's range (causal: the row rescaling).

    In training mode softmax_opt's running rho grows to ~20 after the first call, which scales
    the logits up further (B = sqrt(1 - 4A) ~ 4): the hardest case for the causal backward.
    """
    attn = FavorAttention(16, 32, causal=causal, kernel=kernel, generator=gen(44), chunk_size=64)
    for scale in (30.0, 10.0):  # |x|^2 ~ 3600 and ~ 400: logits far beyond exp's range
        q, k, v = qkv(1, 2, 300, 16, seed=43, scale=scale, dtype=torch.float32)
        q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attn(q, k, v)[0]
        assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
        out.float().sum().backward()
        assert all(torch.isfinite(t.grad.float()).all() for t in (q, k, v)), scale


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast_computes_features_in_float32(causal):
    """With bf16 inputs, the only error left is the final cast (relative 2^-8)."""
    q, k, v = (t.bfloat16() for t in qkv(1, 2, 64, 16, seed=45, scale=1.5, dtype=torch.float32))
    attn = FavorAttention(16, 64, causal=causal, generator=gen(46))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = attn(q, k, v)[0]
    ref = attn(q.float(), k.float(), v.float())[0]
    assert low.dtype == torch.bfloat16
    err = (low.float() - ref).abs()
    assert bool((err <= 2**-8 * ref.abs() + 1e-6).all()), float(err.max())


def test_shapes_exact_attention_and_accuracy_at_large_m():
    q, k, v = qkv(2, 3, 50, 16, seed=47, scale=0.5)
    for causal in (False, True):
        ref = exact_attention(q, k, v, causal=causal)
        manual = (
            torch.softmax(
                (q @ k.mT / 4).masked_fill(
                    causal & ~torch.ones(50, 50, dtype=torch.bool).tril(), float("-inf")
                ),
                -1,
            )
            @ v
        )
        assert torch.allclose(ref, manual, atol=1e-10)
        attn = module("softmax_hyp", causal, d=16, m=2048)
        out = attn(q, k, v)[0]
        assert out.shape == (2, 3, 50, 16)
        rel = (out - ref).norm() / ref.norm()
        base = (v.mean(-2, keepdim=True).expand_as(ref) - ref).norm() / ref.norm()
        assert rel < 0.25 * base


def test_redraw_changes_omega_reproducibly_and_lives_in_state_dict():
    attn = FavorAttention(8, 24, generator=gen(48))
    first = attn.omega.clone()
    attn.redraw(gen(49))
    assert not torch.equal(first, attn.omega)
    other = FavorAttention(8, 24, generator=gen(50))
    other.redraw(gen(49))
    assert torch.equal(other.omega, attn.omega)
    sd = attn.state_dict()
    assert "omega" in sd and sd["omega"].shape == (24, 8)
    fresh = FavorAttention(8, 24, generator=gen(51))
    fresh.load_state_dict(sd)
    q, k, v = qkv(1, 1, 10, 8, seed=52, dtype=torch.float32)
    assert torch.equal(fresh(q, k, v)[0], attn(q, k, v)[0])


def test_causal_softmax_opt_statistic_is_fixed_and_updated_only_in_training():
    attn = FavorAttention(8, 16, causal=True, kernel="softmax_opt", generator=gen(56))
    q, k, v = qkv(1, 1, 12, 8, seed=57, dtype=torch.float32)
    attn.eval()
    attn(q, k, v)
    assert float(attn.oprf_rho) == 0.0
    attn.train()
    attn(q, k, v)
    assert float(attn.oprf_rho) > 0.0
    with pytest.raises(ValueError):
        favor_attention(q, k, v, attn.omega, kernel="softmax_opt", causal=True)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_oprf_rho_updates_once_per_step_under_activation_checkpointing(use_reentrant):
    """The checkpoint replay of the forward (inside backward) must not update rho again."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 12, 8, seed=58, dtype=torch.float32))
    rhos = []
    for ckpt in (False, True):
        attn = FavorAttention(8, 16, causal=True, kernel="softmax_opt", generator=gen(59)).train()

        def block(q, k, v, attn=attn):  # an op after attention makes the replay run through it
            return attn(q, k, v)[0].exp()

        for _ in range(2):  # two training steps
            out = (
                checkpoint(block, q, k, v, use_reentrant=use_reentrant) if ckpt else block(q, k, v)
            )
            out.sum().backward()
        rhos.append(float(attn.oprf_rho))
    assert rhos[0] > 0.0 and rhos[1] == rhos[0]


def test_model_with_gradient_checkpointing_updates_oprf_rho_once_per_step():
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    tokens = torch.randint(4, 24, (2, 12), generator=gen(60))
    rhos = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = PerformerConfig(
            dim=32,
            depth=2,
            heads=4,
            ff_dim=64,
            nb_features=16,
            objective="clm",
            kernel="softmax_opt",
            gradient_checkpointing=ckpt,
        )
        model = PerformerLM(cfg).train()
        model(tokens).logits.logsumexp(-1).sum().backward()
        rhos.append([float(layer.self_attn.core.oprf_rho) for layer in model.layers])
    assert all(r > 0 for r in rhos[0]) and rhos[1] == rhos[0]
