"""The linear core and its maps against plain quadratic references (values, gradients, padding,
causality, state continuation == one forward)."""

import math

import pytest
import torch

from protein_performer.model.linear.core import LinearAttention
from protein_performer.model.linear.maps import Hedgehog, Taylor


def _reference(core: LinearAttention, q, k, v, key_padding_mask=None):
    """phi(q) phi(k)^T, masked and normalized, times v: quadratic memory, plain autograd."""
    qf, kf = core.feature_map(q.double()), core.feature_map(k.double())
    scores = qf @ kf.mT  # (B, H, L, L)
    L = q.shape[2]
    if core.causal:
        scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), 0.0)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return (scores / scores.sum(-1, keepdim=True)) @ v.double()


def _qkv(seed: int, B=2, H=3, L=37, d=8, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, L, d, generator=g) * scale).requires_grad_() for _ in range(3)]


def test_taylor_kernel_is_the_second_order_series_of_exp():
    """phi(q).phi(k) = 1 + s + s^2/2, s = q.k / sqrt(d): the Based map, no draw."""
    d = 8
    fmap = Taylor(1, d)
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(7, d, dtype=torch.float64)
    s = q @ k.T / math.sqrt(d)
    assert fmap(q).shape[-1] == Taylor.feature_dim(d) == 1 + d + d * (d + 1) // 2
    torch.testing.assert_close(fmap(q) @ fmap(k).T, 1 + s + s * s / 2)
    # exact for small logits: the series' error is O(s^3)
    small = 0.05 * q
    err = (fmap(small) @ fmap(k).T - torch.exp(small @ k.T / math.sqrt(d))).abs().max()
    assert err < (0.05 * q.norm(dim=1).max() * k.norm(dim=1).max() / math.sqrt(d)) ** 3


@pytest.mark.parametrize("kernel", ["taylor", "hedgehog"])
@pytest.mark.parametrize("causal", [True, False])
def test_core_matches_reference_values_and_gradients(kernel, causal):
    core = LinearAttention(3, 8, kernel, causal, chunk_size=8)
    if kernel == "hedgehog":  # a trained-looking map, not the identity it starts from
        with torch.no_grad():
            core.feature_map.weight.add_(0.3 * torch.randn_like(core.feature_map.weight))
    q, k, v = _qkv(0)
    mask = torch.zeros(2, 37, dtype=torch.bool)
    mask[1, 30:] = True  # right padding
    out, _ = core(q, k, v, mask)
    ref = _reference(core, q, k, v, mask)
    torch.testing.assert_close(out.double()[0], ref[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.double()[1, :, :30], ref[1, :, :30], atol=1e-5, rtol=1e-4)
    g = torch.randn_like(out)
    g[1, :, 30:] = 0
    grads = torch.autograd.grad((out * g).sum(), (q, k, v, *core.parameters()))
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), (q, k, v, *core.parameters()))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("kernel", ["taylor", "hedgehog"])
def test_state_continuation_and_steps_equal_one_forward(kernel):
    """prefill + continuation from the state, and token-by-token steps, equal the forward of
    the whole row; the state has the same size whatever the row length."""
    core = LinearAttention(3, 8, kernel, causal=True, chunk_size=8)
    q, k, v = (t.detach() for t in _qkv(2))
    full, _ = core(q, k, v)
    head, state = core(q[:, :, :13], k[:, :, :13], v[:, :, :13], keep_state=True)
    tail, after = core(q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], state=state, keep_state=True)
    torch.testing.assert_close(torch.cat([head, tail], 2), full, atol=1e-5, rtol=1e-4)
    assert after.kv.shape == state.kv.shape
    steps, s = [], None
    for t in range(q.shape[2]):
        sl = slice(t, t + 1)
        o, s = core(q[:, :, sl], k[:, :, sl], v[:, :, sl], state=s, keep_state=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s.kv, after.kv, atol=1e-4, rtol=1e-4)


def test_hedgehog_starts_as_normalized_exp_features():
    """W = I, b = 0: phi(x) = [softmax(x), softmax(-x)] of x = z d^-1/4."""
    fmap = Hedgehog(2, 4)
    z = torch.randn(1, 2, 3, 4)
    x = z * 4**-0.25
    torch.testing.assert_close(fmap(z), torch.cat([x.softmax(-1), (-x).softmax(-1)], -1))
