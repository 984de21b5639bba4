"""model/favor/bidirectional.py: the bidirectional fused path equals the dense reference in
values and gradients (check 8 of docs/FAVOR.md), per-head statistics and head tiles."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.favor import (
    KERNELS,
    draw_omega,
    favor_attention,
    favor_attention_reference,
    oprf_rho,
)
from tests.model.favor.common import dense_reference, gen, module, qkv


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "relu"])
def test_bidirectional_equals_dense_reference_values_and_grads(kernel):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 8, seed=36, scale=0.8))
    attn = module(kernel, False, block_size=10)
    ref = dense_reference(q, k, v, attn.omega, kernel, False)
    out = attn(q, k, v)[0]
    assert torch.allclose(out, ref, atol=1e-10)
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-8)


def test_softmax_opt_bidirectional_uses_per_head_statistics():
    q, k, v = qkv(1, 2, 30, 8, seed=37)
    attn = module("softmax_opt", False)
    rho = oprf_rho(q * 8**-0.25, k * 8**-0.25)  # (1, 2)
    out = attn(q, k, v)[0]
    for h in range(2):
        ref = dense_reference(
            q[:, h], k[:, h], v[:, h], attn.omega, "softmax_opt", False, rho[0, h]
        )
        assert torch.allclose(out[:, h], ref, atol=1e-10)


def test_softmax_opt_bidirectional_grads_equal_dense_reference():
    """The fused backward treats rho as a constant: equal to the dense map at that fixed rho."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 8, seed=36, scale=0.8))
    attn = module("softmax_opt", False, block_size=10)
    rho = oprf_rho(q.detach() * 8**-0.25, k.detach() * 8**-0.25)[0]  # (H,)
    om = attn.omega
    heads = [
        dense_reference(q[:, h], k[:, h], v[:, h], om, "softmax_opt", False, rho[h])
        for h in range(2)
    ]
    ref = torch.stack(heads, dim=1)
    out = attn(q, k, v)[0]
    assert torch.allclose(out, ref, atol=1e-10)
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-8)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bidirectional_head_tiles_equal_the_reference(kernel, monkeypatch):
    """A small L2 cache makes the fused bidirectional path split heads into tiles (and rows into
    blocks): values and gradients still equal the reference's, per-head FAVOR++ included."""
    import protein_performer.model.favor.bidirectional as favor

    # Caches for 64 rows of M=16 float64 features over all threads.
    monkeypatch.setattr(favor, "_l2_bytes", lambda: 2 * 16 * 8 * 64 // torch.get_num_threads())
    B, H, L, d = 2, 3, 100, 8
    q, k, v = (t.requires_grad_() for t in qkv(B, H, L, d, seed=55, scale=1.2))
    om = draw_omega(16, d, generator=gen(56)).double()
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 71:] = True
    kw = dict(kernel=kernel, key_padding_mask=mask)
    assert favor._tile(B * H, L, 16, 2048, q) == (1, 64)  # 6 tiles of 1 head, 2 row blocks
    out = favor_attention(q, k, v, om, **kw)
    ref = favor_attention_reference(q, k, v, om, **kw)
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_block_fused_path_equals_the_reference_with_pads(kernel):
    """Issue 43: when one block holds every row the exp kernels take the fused, transposed
    features (:func:`_fused_exp`, base 2): values and gradients equal the reference's with
    pads, a fully padded row and per-head FAVOR++, float64 and float32 (its tolerance)."""
    B, H, L, d = 3, 2, 50, 8
    q, k, v = (t.requires_grad_() for t in qkv(B, H, L, d, seed=57, scale=1.1))
    om = draw_omega(16, d, generator=gen(58)).double()
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 31:] = True
    mask[2, :] = True  # no real key: output 0, gradient 0
    kw = dict(kernel=kernel, key_padding_mask=mask)
    out = favor_attention(q, k, v, om, **kw)  # default block_size: one block
    ref = favor_attention_reference(q, k, v, om, **kw)
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)
    f32 = [t.detach().float() for t in (q, k, v)]
    out32 = favor_attention(*f32, om.float(), **kw)
    assert torch.allclose(out32.double(), ref.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [4, 2048])
@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt"])
def test_bidirectional_exp_backward_gradcheck_with_padding(kernel, block):
    """float64 gradcheck of _BidiExpFavor's backward: pads, several blocks, a fully padded row."""
    g = gen(53)
    q, k, v = (
        (torch.randn(3, 2, 11, 4, generator=g, dtype=torch.float64) * 1.2).requires_grad_()
        for _ in range(3)
    )
    om = draw_omega(6, 4, generator=gen(54)).double()
    mask = torch.zeros(3, 11, dtype=torch.bool)
    mask[0, 7:] = True
    mask[1, [0, 4, 5]] = True
    mask[2, :] = True  # no real key: output 0, gradient 0
    rho = 0.3 if kernel == "softmax_opt" else None

    def fn(a, b, c):
        return favor_attention(
            a, b, c, om, kernel=kernel, key_padding_mask=mask, oprf_rho=rho, block_size=block
        )

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=False)
