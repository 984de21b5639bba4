"""model/favor/recurrent.py through FavorAttention's one call: prefill, extend and
token-by-token steps from a state equal the parallel causal forward."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.favor import KERNELS
from tests.model.favor.common import module, qkv


def steps(attn, q, k, v, mask, state=None, start=0, inplace=False):
    """Token-by-token forwards from ``state`` (None: the first token is a one-token prefill)
    -> the outputs (B, H, L - start, dv) and the last state."""
    outs = []
    for t in range(start, q.shape[2]):
        sl = slice(t, t + 1)
        o, state = attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, sl], state,
                        keep_state=True, inplace=inplace)  # fmt: skip
        outs.append(o)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_step_equals_parallel_causal(kernel, inplace):
    B, H, L, d = 2, 2, 19, 8
    q, k, v = qkv(B, H, L, d, seed=40)
    attn = module(kernel, True, chunk_size=4)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 12:] = True
    par = attn(q, k, v, key_padding_mask=mask)[0]
    seq, state = steps(attn, q, k, v, mask, inplace=inplace)
    assert state.kv.shape == (B, H, attn.feature_dim, d + 1)
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(seq, par, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("P", [9, 17])
def test_prefill_then_steps_and_extend_equal_parallel(kernel, P):
    """A prompt's state from one forward (a short prompt through the recurrent chunks, a long
    one, P > recurrent_chunk, through the scan and one parallel pass over its keys), then
    token steps or one extend: the parallel forward's outputs and the step-by-step state
    (generation's prefill + decode), padded rows included; extend never writes the state."""
    B, H, L, d = 2, 2, 25, 8
    q, k, v = qkv(B, H, L, d, seed=43)
    attn = module(kernel, True, chunk_size=12)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 6:P] = True  # row 1: a shorter prompt, right-padded up to P
    par = attn(q, k, v, key_padding_mask=mask)[0]
    head, state = attn(q[:, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P], keep_state=True)
    _, stepped = steps(attn, q[:, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P])
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(head, par[:, :, :P], rtol=tol, atol=tol)
    assert torch.allclose(
        state.kv * torch.exp(state.mu)[..., None, None],
        stepped.kv * torch.exp(stepped.mu)[..., None, None],
        rtol=tol,
        atol=0,
    )
    kv = state.kv.clone()
    rest = (q[:, :, P:], k[:, :, P:], v[:, :, P:], mask[:, P:])
    tail, none = attn(*rest, state)
    assert none is None and torch.equal(state.kv, kv)
    assert torch.allclose(tail, par[:, :, P:], rtol=tol, atol=tol)
    outs, _ = steps(attn, q, k, v, mask, state, start=P)
    assert torch.allclose(outs, par[:, :, P:], rtol=tol, atol=tol)


def test_a_state_needs_a_causal_core():
    attn = module("softmax", False)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        attn(q, q, q, keep_state=True)
