"""model/favor/causal.py and scan.py: the causal fused path never lets a future token move
a past output or gradient (check 6 of docs/FAVOR.md), and its chunks, segments and
stabilizers equal the dense reference in values and gradients (check 8)."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.favor import (
    KERNELS,
    draw_omega,
    favor_attention,
    oprf_coefficients,
    random_features,
)
from tests.model.favor.common import dense_reference, gen, module, qkv


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_appending_future_tokens_leaves_past_outputs_unchanged(kernel, chunk):
    q, k, v = qkv(2, 2, 30, 8, seed=27)
    attn = module(kernel, True, chunk_size=chunk)
    before = attn(q, k, v)[0]
    extra = qkv(2, 2, 11, 8, seed=28, scale=6.0)  # large-norm future keys test the stabilizer
    after = attn(*(torch.cat([a, b], dim=2) for a, b in zip((q, k, v), extra, strict=True)))[0]
    assert torch.allclose(after[:, :, :30], before, rtol=1e-9, atol=1e-12)


def test_future_keys_do_not_move_past_gradients():
    q, k, v = qkv(1, 2, 20, 8, seed=29)
    attn = module("softmax", True, chunk_size=6)
    k2 = k.clone().requires_grad_()
    k_long = torch.cat([k2, 5 * torch.randn(1, 2, 9, 8, dtype=torch.float64)], dim=2)
    q_long = torch.cat([q, torch.randn(1, 2, 9, 8, dtype=torch.float64)], dim=2)
    v_long = torch.cat([v, torch.randn(1, 2, 9, 8, dtype=torch.float64)], dim=2)
    attn(q_long, k_long, v_long)[0][:, :, :20].sum().backward()
    k1 = k.clone().requires_grad_()
    attn(q, k1, v)[0].sum().backward()
    assert torch.allclose(k2.grad, k1.grad, atol=1e-10)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk", [1, 3, 8, 17, 64])
def test_chunked_causal_equals_dense_reference_values_and_grads(kernel, chunk):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 8, seed=34, scale=0.8))
    attn = module(kernel, True, chunk_size=chunk)
    attn.chunk_size = chunk
    rho = 0.3 if kernel == "softmax_opt" else None
    ref = dense_reference(q, k, v, attn.omega, kernel, True, rho)
    out = attn(q, k, v)[0]
    tol = 1e-6 if kernel == "trig" else 1e-9
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
    w = torch.randn(out.shape, generator=gen(35), dtype=torch.float64)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt"])
def test_causal_exp_features_per_segment_equal_dense_reference(kernel):
    """Heads cut into many segments, whose features are computed per segment (fwd and bwd).

    The key stabilizer is a running max that continues across segment boundaries: key norms
    grow along the sequence so it keeps rising. L is not a multiple of the chunk and one sequence
    has pads in the middle. Values and float64 gradients match the dense reference over the real
    keys, and appending large-norm future tokens leaves every past output unchanged.
    """
    B, H, L, d = 2, 2, 45, 8
    q, k, v = qkv(B, H, L, d, seed=60, scale=0.8)
    k = k * torch.linspace(0.3, 2.0, L, dtype=torch.float64)[:, None]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 17:21] = True
    omega = draw_omega(16, d, generator=gen(61), dtype=torch.float64)
    rho = 0.3 if kernel == "softmax_opt" else None
    kw = dict(kernel=kernel, causal=True, oprf_rho=rho, chunk_size=4, segment_size=8)
    out = favor_attention(q, k, v, omega, key_padding_mask=pad, **kw)  # 6 segments per head
    fkw = {} if rho is None else {"rho": rho}
    qf, kf = (random_features(t * d**-0.25, omega, kernel, **fkw) for t in (q, k))
    a = (qf @ kf.mT).tril() * ~pad[:, None, None, :]
    ref = (a @ v) / a.sum(-1, keepdim=True)
    assert torch.allclose(out, ref, rtol=1e-9, atol=1e-9)
    w = torch.randn(out.shape, generator=gen(62), dtype=torch.float64)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(g_out, g_ref, strict=True):
        assert torch.allclose(got, want, rtol=1e-7, atol=1e-7)
    extra = qkv(B, H, 11, d, seed=63, scale=6.0)
    longer = [torch.cat([a.detach(), b], dim=2) for a, b in zip((q, k, v), extra, strict=True)]
    pad_long = torch.cat([pad, torch.zeros(B, 11, dtype=torch.bool)], dim=1)
    after = favor_attention(*longer, omega, key_padding_mask=pad_long, **kw)
    assert torch.allclose(after[:, :, :L], out.detach(), rtol=1e-9, atol=1e-12)


def test_causal_exp_stabilizer_carries_across_segments_at_extreme_logits():
    """An early key whose log-feature is far beyond float32's exp range sets the running max mu.

    Later segments must continue that max (a restarted one would rescale the carried state by
    exp(mu_before - mu) = overflow). float32 output and gradients stay finite and match float64.
    """
    B, H, L, d, m = 1, 2, 40, 16, 32
    omega = draw_omega(m, d, generator=gen(64), dtype=torch.float64)
    rho = 20.0
    b = float(oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d)[1])
    q, k, v = qkv(B, H, L, d, seed=65)
    k[:, :, 3] = b * omega[omega.norm(dim=-1).argmax()] * d**0.25  # maximizes its log-feature
    logf = random_features(k * d**-0.25, omega, "softmax_opt", rho=rho).log()
    assert float(logf[:, :, 3].max() - logf[:, :, 8:].amax(-1).max()) > 100  # the premise
    kw = dict(kernel="softmax_opt", causal=True, oprf_rho=rho, chunk_size=4, segment_size=8)
    outs, grads = [], []
    for dtype in (torch.float32, torch.float64):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = favor_attention(*inputs, omega.to(dtype), **kw)
        grads.append(torch.autograd.grad(out.pow(2).sum(), inputs))
        outs.append(out.double())
    assert torch.isfinite(outs[0]).all() and all(torch.isfinite(g).all() for g in grads[0])
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk,segment", [(1, 3), (4, 8), (5, 100)])
@pytest.mark.parametrize("jumpy", [False, True])
def test_causal_backward_gradcheck(chunk, segment, jumpy):
    """float64 gradcheck of the fused causal backward, segments and chunks of several sizes.

    jumpy: one key's log-feature is far above every earlier one (FAVOR++ at a large statistic),
    so the running stabilizer rises by more than the factorized intra-chunk weights allow and
    the scan takes the exact-decay path (forward and backward).
    """
    d, m, L = 4, 6, 13
    omega = draw_omega(m, d, generator=gen(38), dtype=torch.float64)
    g = gen(39)
    q, k, v = (torch.randn(1, 1, L, d, generator=g, dtype=torch.float64) for _ in range(3))
    rho = 40.0 if jumpy else 0.3
    if jumpy:
        b = float(oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d)[1])
        k[:, :, 6] = b * omega[omega.norm(dim=-1).argmax()] * d**0.25
        logf = random_features(k * d**-0.25, omega, "softmax_opt", rho=rho).log()
        assert float(logf[:, :, 6].max() - logf[:, :, :6].amax(-1).max()) > 60  # the premise

    def fn(a, b, c):
        kw = dict(kernel="softmax_opt", causal=True, oprf_rho=rho)
        return favor_attention(a, b, c, omega, chunk_size=chunk, segment_size=segment, **kw)

    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)
