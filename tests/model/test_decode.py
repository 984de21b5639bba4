"""model/decode.py: the traced decoding step gives PerformerLM.step's numbers (exactly in eager
mode, to float rounding compiled), and names the models it cannot run."""

from __future__ import annotations

import pytest
import torch

from protein_performer.model.config import PerformerConfig
from protein_performer.model.decode import CompiledStep, unsupported
from protein_performer.model.performer import PerformerLM


def causal(seed: int = 0, **kw) -> PerformerLM:
    torch.manual_seed(seed)
    base = dict(dim=32, depth=2, heads=4, ff_dim=64, nb_features=16, objective="clm")
    return PerformerLM(PerformerConfig(**{**base, **kw})).eval()


def run(model: PerformerLM, step, tokens: torch.Tensor, start: int, pad_from: int):
    """Logits and states of steps over tokens[:, start:] after a prefill; row 1 finished
    (padded) from ``pad_from``."""
    B, T = tokens.shape
    pad = torch.tensor([False, True, False])
    out = []
    with torch.inference_mode():
        _, states = model.prefill(tokens[:, :start])
        for t in range(start, T):
            logits, states = step(tokens[:, t], torch.full((B,), t), states,
                                  pad if t >= pad_from else None)  # fmt: skip
            out.append(logits)
    return torch.stack(out, 1), states


@pytest.mark.parametrize("positions", ["sequence", "member"])
@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt"])
def test_the_traced_step_in_eager_mode_is_model_step_exactly(kernel: str, positions: str):
    model = causal(kernel=kernel, positions=positions)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 24, (3, 20), generator=g)
    tokens[:, 0] = model.config.cls_idx
    want, want_states = run(model, model.step, tokens, 6, 11)
    got, states = run(model, CompiledStep(model, compile=False), tokens, 6, 11)
    assert torch.equal(got, want)
    for a, b in zip(states, want_states, strict=True):
        assert torch.equal(a.kv, b.kv) and torch.equal(a.mu, b.mu)


def test_models_it_cannot_run_are_named():
    assert "ExactAttention" in unsupported(causal(attention="exact"))
    assert "LinearAttention" in unsupported(causal(attention="linear", kernel="taylor"))
    assert "'relu'" in unsupported(causal(kernel="relu"))
    assert "masked LM" in unsupported(causal(objective="mlm"))
    assert unsupported(causal()) is None
    with pytest.raises(ValueError, match="no compiled step"):
        CompiledStep(causal(attention="exact"))


@pytest.mark.slow  # torch.compile: tens of seconds
def test_the_compiled_step_equals_the_eager_one():
    model = causal()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, 24, (3, 16), generator=g)
    tokens[:, 0] = model.config.cls_idx
    want, _ = run(model, model.step, tokens, 5, 9)
    got, _ = run(model, CompiledStep(model), tokens, 5, 9)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
