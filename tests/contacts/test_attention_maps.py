"""inference.attention_maps: implied FAVOR+/exact rows for a residue window, O(W x T) memory."""

from __future__ import annotations

import pytest
import torch

from protein_performer.contacts.attention import attention_maps, encode_sequence
from protein_performer.errors import UserError
from tests.model.test_model import tiny_model

SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEK"
VARIANTS = [(o, a) for o in ("mlm", "clm") for a in ("favor", "exact")]


@pytest.mark.parametrize(("objective", "attention"), VARIANTS)
def test_window_equals_model_attention_rows(objective: str, attention: str) -> None:
    model = tiny_model(depth=3, objective=objective, attention=attention)
    tokens = encode_sequence(model, SEQ)
    with torch.no_grad():
        full = model(tokens, attention_layers=[1, 2, 3]).attentions  # (1, H, T, T)
    got = attention_maps(model, SEQ, layers=[2, -1], heads=[3, 1], window=(7, 20))
    assert got.layers == [2, 3] and got.heads == [3, 1] and got.length == len(SEQ)
    for layer in (2, 3):
        ref = full[layer][0, [3, 1]][:, 8:21, 1:-1]  # residues 7..19 x all residues
        assert got.maps[layer].shape == (2, 13, len(SEQ))
        torch.testing.assert_close(got.maps[layer], ref, rtol=1e-5, atol=1e-6)
    kept = attention_maps(model, SEQ, layers=[1], window=(0, 10), strip_special=False)
    rows = kept.maps[1]  # (H, 10, T) incl. <cls>/<eos> columns
    torch.testing.assert_close(rows.sum(-1), torch.ones(rows.shape[:2]), rtol=0, atol=1e-5)
    if objective == "clm":  # causal: residue 0 (token 1) sees only <cls> and itself
        assert rows[:, 0, 2:].abs().max() == 0


@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_maps_are_the_implied_attention(attention: str) -> None:
    """map @ V reproduces the layer's attention output: the map is what the model computes."""
    model = tiny_model(attention=attention)
    tokens = encode_sequence(model, SEQ)
    attn = model.layers[0].self_attn
    with torch.no_grad():
        pad = tokens.eq(model.config.pad_idx)
        x = model.layers[0].self_attn_layer_norm(model.embed(tokens, pad))
        q, k = attn.rotated_qk(x)
        v = attn._split_heads(attn.v_proj(x))  # (1, H, T, d)
        out = attn.core(q, k, v)[0]
    maps = attention_maps(model, SEQ, layers=[1], window=(3, 30), strip_special=False).maps[1]
    torch.testing.assert_close(maps @ v[0], out[0, :, 4:31], rtol=1e-4, atol=1e-5)


def test_memory_is_window_times_length(monkeypatch) -> None:
    """No T x T block is ever formed: every map the attention module returns is (1, 1, W, T)."""
    model = tiny_model()
    long_seq = (SEQ * 6)[:300]
    seen: list[tuple[int, ...]] = []
    cls = type(model.layers[0].self_attn)
    original = cls.attention_map

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(cls, "attention_map", spy)
    got = attention_maps(model, long_seq, layers=[1], window=(100, 116), key_window=(90, 140))
    assert got.maps[1].shape == (4, 16, 50)
    assert seen and all(s == (1, 1, 16, 302) for s in seen)


def test_stops_after_deepest_requested_layer_and_sink() -> None:
    model = tiny_model(depth=3)
    calls: list[int] = []
    handle = model.layers[2].register_forward_hook(lambda *a: calls.append(1))
    try:
        received: dict[int, tuple] = {}
        got = attention_maps(
            model, SEQ, layers=[1, 2], sink=lambda i, m: received.update({i: tuple(m.shape)})
        )
    finally:
        handle.remove()
    assert calls == []  # layer 3 never ran
    assert got.maps == {} and received == {1: (4, len(SEQ), len(SEQ)), 2: (4, len(SEQ), len(SEQ))}
    assert not model.layers[0].self_attn._forward_hooks  # hooks removed


def test_errors() -> None:
    model = tiny_model()
    with pytest.raises(UserError, match="window"):
        attention_maps(model, SEQ, window=(10, 10))
    with pytest.raises(UserError, match="window"):
        attention_maps(model, SEQ, window=(0, len(SEQ) + 1))
    with pytest.raises(UserError, match="layer 5"):
        attention_maps(model, SEQ, layers=[5])
    with pytest.raises(UserError, match="head"):
        attention_maps(model, SEQ, heads=[4])
