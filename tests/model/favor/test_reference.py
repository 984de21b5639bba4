"""model/favor/reference.py, the spec: every fused path equals it, and it carries gradients
to omega (which favor_attention then runs)."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.favor import (
    KERNELS,
    draw_omega,
    favor_attention,
    favor_attention_reference,
)
from tests.model.favor.common import gen, qkv


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_paths_equal_the_reference(kernel, causal, padded, dtype):
    """Every kernel x causal x padding x dtype: the fused path (custom backward, key blocks,
    scan chunks and segments, features recomputed in backward) gives the plain-autograd
    reference's values and gradients. float32 tolerances: a few hundred ulps of the outputs'
    scale (sums of 23 terms, features through exp); trig's signed features cancel, x10."""
    B, H, L, d = 2, 2, 23, 8
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(B, H, L, d, seed=50, scale=1.2))
    om = draw_omega(16, d, generator=gen(51)).to(dtype)
    mask = None
    if padded:
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[1, 15:] = True
        mask[0, 3] = True
    rho = 0.3 if kernel == "softmax_opt" and causal else None
    kw = dict(kernel=kernel, causal=causal, key_padding_mask=mask, oprf_rho=rho)
    out = favor_attention(q, k, v, om, block_size=6, chunk_size=4, segment_size=8, **kw)
    ref = favor_attention_reference(q, k, v, om, **kw)
    w = torch.randn(out.shape, generator=gen(52), dtype=torch.float64).to(dtype)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    if dtype == torch.float64:
        tol = 1e-7 if kernel == "trig" else 1e-10
    else:
        tol = 3e-4 if kernel == "trig" else 3e-5
    assert out.dtype == dtype and torch.allclose(out, ref, rtol=tol, atol=tol)
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)


def test_reference_carries_gradients_to_omega_and_favor_attention_uses_it():
    """omega (or rho) needing gradients takes the reference path, whose values match."""
    q, k, v = qkv(1, 2, 15, 8, seed=53)
    om = draw_omega(16, 8, generator=gen(54)).double()
    for causal in (False, True):
        fused = favor_attention(q, k, v, om, causal=causal)
        omg = om.clone().requires_grad_()
        out = favor_attention(q, k, v, omg, causal=causal)
        assert torch.allclose(out, fused, atol=1e-10)
        (grad,) = torch.autograd.grad(out.pow(2).sum(), omg)
        assert torch.isfinite(grad).all() and float(grad.abs().max()) > 0
