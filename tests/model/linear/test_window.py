"""The sliding-window core against a plain quadratic reference: values, gradients, padding,
causal leakage, the recurrent step == one forward, and the model wiring."""

import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.model.config import PerformerConfig
from protein_performer.model.linear.core import LinearAttention
from protein_performer.model.linear.window import SlidingWindow
from protein_performer.model.performer import PerformerLM


def _core(causal: bool, window: int, kernel: str = "hedgehog", seed: int = 0) -> SlidingWindow:
    torch.manual_seed(seed)
    core = SlidingWindow(LinearAttention(3, 8, kernel, causal, chunk_size=8), 3, window)
    with torch.no_grad():  # a trained-looking map and scale, not the init
        for p in core.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return core


def _reference(core: SlidingWindow, q, k, v, mask=None):
    """Dense (L, L) weights in float64: g e^{s - m} inside the window, phi.phi outside."""
    q, k, v = q.double(), k.double(), v.double()
    L, d, w = q.shape[2], q.shape[-1], core.window
    fmap = core.inner.feature_map
    lin = fmap(q) @ fmap(k).mT
    s = q @ k.mT / d**0.5
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    near = ((i - j >= 0) & (i - j < w)) if core.causal else (i - j).abs() < w
    real = torch.ones(q.shape[0], 1, L, L, dtype=torch.bool)
    if mask is not None:
        real = real & ~mask[:, None, None, :]
    if core.causal:
        real = real & (j <= i)
    m = s.masked_fill(~(near & real), float("-inf")).amax(-1, keepdim=True)
    m = m.nan_to_num(0.0, neginf=0.0)  # a padded query with no real key in its window
    g = core.window_log_scale.double().exp()[None, :, None, None]
    weights = torch.where(near, g * torch.exp(s - m), lin).masked_fill(~real, 0.0)
    return (weights / weights.sum(-1, keepdim=True)) @ v


def _qkv(seed: int, B=2, H=3, L=29, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("kernel", ["hedgehog", "taylor"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 4, 40])
def test_window_matches_reference_values_and_gradients(kernel, causal, window):
    core = _core(causal, window, kernel)
    q, k, v = _qkv(1)
    mask = torch.zeros(2, 29, dtype=torch.bool)
    mask[1, 23:] = True  # right padding
    out, state = core(q, k, v, mask)
    assert state is None
    ref = _reference(core, q, k, v, mask)
    torch.testing.assert_close(out.double()[0], ref[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.double()[1, :, :23], ref[1, :, :23], atol=1e-5, rtol=1e-4)
    g = torch.randn_like(out)
    g[1, :, 23:] = 0
    params = (q, k, v, *core.parameters())
    grads = torch.autograd.grad((out * g).sum(), params, allow_unused=True)
    want = torch.autograd.grad((ref * g.double()).sum(), params, allow_unused=True)
    for got, exp in zip(grads, want, strict=True):
        if exp is None:  # the Taylor map has no parameters of its own
            continue
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), exp.double(), atol=1e-4, rtol=1e-3)
    rows = core.attention_map(q, k, mask)
    torch.testing.assert_close((rows.double() @ v.double())[0], ref[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [3, 8])
def test_step_and_split_continuation_equal_one_forward(window):
    core = _core(True, window)
    q, k, v = (t.detach() for t in _qkv(4, L=21))
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[1, 5] = True  # a padded key mid-row never enters the ring or the sum
    full, _ = core(q, k, v, mask)
    state, steps = None, []
    for t in range(21):
        out, state = core(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                          mask[:, t : t + 1], state, keep_state=True)
        steps.append(out)
        assert state.k.shape[2] == window  # constant size
    torch.testing.assert_close(torch.cat(steps, 2), full, atol=1e-5, rtol=1e-4)
    head, mid = core(q[:, :, :9], k[:, :, :9], v[:, :, :9], mask[:, :9], keep_state=True)
    tail, _ = core(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], mask[:, 9:], mid, keep_state=True)
    torch.testing.assert_close(torch.cat([head, tail], 2), full, atol=1e-5, rtol=1e-4)
    # a batch-1 state serves every row (a family context broadcast over candidates)
    _, one = core(q[:1, :, :9], k[:1, :, :9], v[:1, :, :9], keep_state=True)
    both, _ = core(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], None, one)
    again, _ = core(q[1:, :, 9:], k[1:, :, 9:], v[1:, :, 9:], None, one)
    torch.testing.assert_close(both[1:], again)


def test_model_wiring_and_validation():
    cfg = dict(vocab_size=33, dim=16, depth=2, heads=2, ff_dim=32, attention="linear",
               kernel="hedgehog", local_window=4)
    model = PerformerLM(PerformerConfig(**cfg))
    assert isinstance(model.layers[0].self_attn.core, SlidingWindow)
    assert model.num_parameters() == PerformerConfig(**cfg).estimated_numel()
    tokens = torch.randint(4, 24, (2, 12))
    assert torch.isfinite(model(tokens).logits).all()
    with pytest.raises(UserError, match="needs attention=linear"):
        PerformerConfig(**{**cfg, "attention": "favor", "kernel": "softmax"}).validate()
    with pytest.raises(UserError, match="local_window"):
        PerformerConfig(**{**cfg, "local_window": -1}).validate()
