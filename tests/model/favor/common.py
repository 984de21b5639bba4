"""Helpers shared by the FAVOR+ tests: seeded generators and inputs, a float64 module,
the dense (quadratic) reference with a causal mask."""

from __future__ import annotations

import torch

from protein_performer.model.favor import FavorAttention, random_features


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv(B=2, H=2, L=40, d=8, seed=0, scale=1.0, dtype=torch.float64):
    g = gen(seed)
    return tuple(torch.randn(B, H, L, d, generator=g, dtype=dtype) * scale for _ in range(3))


def module(kernel="softmax", causal=False, d=8, m=16, seed=1, **kw) -> FavorAttention:
    attn = FavorAttention(d, m, causal=causal, kernel=kernel, generator=gen(seed), **kw).double()
    if kernel == "softmax_opt" and causal:
        attn.oprf_rho.fill_(0.3)
    return attn.eval()


def dense_reference(q, k, v, omega, kernel, causal, rho=None):
    """phi(Q) phi(K)^T masked and normalized, from the unstabilized public feature map."""
    d = q.shape[-1]
    x, y = q * d**-0.25, k * d**-0.25
    kw = {} if rho is None else {"rho": rho}
    a = random_features(x, omega, kernel, **kw) @ random_features(y, omega, kernel, **kw).mT
    if causal:
        a = a.tril()
    return (a @ v) / a.sum(-1, keepdim=True)
