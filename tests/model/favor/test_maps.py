"""model/favor/maps.py: implied attention rows sum to one and reproduce the forward
(check 5 of docs/FAVOR.md); the exact map reproduces exact attention."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.exact import exact_attention, exact_attention_map
from protein_performer.model.favor import KERNELS
from tests.model.favor.common import module, qkv


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_rows_sum_to_one_and_attention_map_matches_forward(kernel, causal):
    B, H, L, d = 1, 2, 24, 8
    q, k, v = qkv(B, H, L, d, seed=25)
    attn = module(kernel, causal, d=d, chunk_size=5, block_size=7)
    eye = torch.eye(L, dtype=torch.float64).expand(B, H, L, L)
    implied = attn(q, k, eye)[0]  # (B, H, L, L): row t = attention weights of query t
    assert torch.allclose(implied.sum(-1), torch.ones(B, H, L, dtype=torch.float64), atol=1e-9)
    if causal:
        assert float(implied.triu(1).abs().max()) < 1e-12
    amap = attn.attention_map(q, k, query_slice=slice(3, 17))
    assert amap.shape == (B, H, 14, L)
    assert torch.allclose(amap.sum(-1), torch.ones(B, H, 14, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(amap, implied[:, :, 3:17], atol=1e-9)
    assert torch.allclose(amap @ v, attn(q, k, v)[0][:, :, 3:17], atol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_attention_map_matches_exact_attention(causal):
    q, k, v = qkv(2, 2, 20, 8, seed=26)
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[1, 15:] = True
    amap = exact_attention_map(q, k, causal=causal, key_padding_mask=pad, query_slice=slice(2, 9))
    ref = exact_attention(q, k, v, causal=causal, key_padding_mask=pad)
    assert torch.allclose(amap.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
    assert torch.allclose(amap @ v, ref[:, :, 2:9], atol=1e-10)
