"""model/decode.py: the traced decoding step gives PerformerLM.step's numbers (to float rounding:
it reads a copy of the weights), eager, traced by TorchScript or compiled, writes states only
when given them, and names the models it cannot run."""

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


def run(model: PerformerLM, step, tokens: torch.Tensor, start: int, pad_from: int, **kw):
    """Logits and states of steps over tokens[:, start:] after a prefill; row 1 finished
    (padded) from ``pad_from``."""
    B, T = tokens.shape
    pad = torch.tensor([False, True, False])
    out = []
    with torch.inference_mode():
        _, states = model.prefill(tokens[:, :start])
        for t in range(start, T):
            logits, states = step(tokens[:, t], torch.full((B,), t), states,
                                  pad if t >= pad_from else None, **kw)  # fmt: skip
            out.append(logits)
    return torch.stack(out, 1), states


@pytest.mark.parametrize("mode", ["eager", "trace"])
@pytest.mark.parametrize("positions", ["sequence", "member"])
@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt"])
@pytest.mark.parametrize("inplace", [False, True])
def test_the_traced_step_is_model_step(kernel: str, positions: str, inplace: bool, mode: str):
    model = causal(kernel=kernel, positions=positions)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 24, (3, 20), generator=g)
    tokens[:, 0] = model.config.cls_idx
    want, want_states = run(model, model.step, tokens, 6, 11)
    got, states = run(model, CompiledStep(model, mode=mode), tokens, 6, 11, inplace=inplace)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(states, want_states, strict=True):
        torch.testing.assert_close(a.kv, b.kv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a.mu, b.mu, atol=1e-6, rtol=1e-6)


def test_one_trace_per_batch_size_and_the_same_numbers_as_eager():
    """The TorchScript trace records the eager function's ops (bit for bit the same numbers,
    batch 1 and 3 alike), once per batch size, whatever the prompt and position."""
    model = causal()
    eager, traced = CompiledStep(model, mode="eager"), CompiledStep(model, mode="trace")
    g = torch.Generator().manual_seed(6)
    for B, length in ((1, 9), (3, 12), (1, 30), (3, 5)):
        tokens = torch.randint(4, 24, (B, length), generator=g)
        tokens[:, 0] = model.config.cls_idx
        want, want_states = run(model, eager, tokens[:3], length - 4, length, inplace=True)
        got, states = run(model, traced, tokens[:3], length - 4, length, inplace=True)
        assert torch.equal(got, want)
        assert all(torch.equal(a.kv, b.kv) for a, b in zip(states, want_states, strict=True))
    assert sorted(B for B, _ in traced._traced) == [1, 3]
    assert all(isinstance(f, torch.jit.ScriptFunction) for f in traced._traced.values())


def test_a_failed_trace_runs_eagerly_after_one_line(monkeypatch, caplog):
    def broken(*args, **kw):
        raise RuntimeError("tracer says no\ndetails")

    monkeypatch.setattr(torch.jit, "trace", broken)
    model = causal()
    tokens = torch.randint(4, 24, (3, 10), generator=torch.Generator().manual_seed(7))
    with caplog.at_level("INFO", logger="protein_performer"):
        got, _ = run(model, CompiledStep(model, mode="trace"), tokens, 5, 8)
    want, _ = run(model, CompiledStep(model, mode="eager"), tokens, 5, 8)
    assert torch.equal(got, want)
    notes = [r.getMessage() for r in caplog.records if "tracing" in r.getMessage()]
    assert notes == ["tracing the decoding step failed (tracer says no); it runs eagerly"]


def test_states_are_written_only_when_given_up():
    """``inplace=False`` leaves a state as it was (a family context's states serve many
    candidates); ``inplace=True`` updates the sums in place, as model.step does."""
    model = causal()
    step = CompiledStep(model, mode="trace")
    tokens = torch.randint(4, 24, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        _, states = model.prefill(tokens)
        before = [s.kv.clone() for s in states]
        _, kept = step(torch.tensor([5]), torch.tensor([7]), states)
        assert all(torch.equal(s.kv, b) for s, b in zip(states, before, strict=True))
        _, new = step(torch.tensor([5]), torch.tensor([7]), states, inplace=True)
        assert all(n.kv is s.kv for n, s in zip(new, states, strict=True))
        for n, k in zip(new, kept, strict=True):
            assert torch.equal(n.kv, k.kv) and not torch.equal(n.kv, before[0])


def test_a_changed_parameter_rebuilds_the_weights():
    model = causal()
    step = CompiledStep(model, mode="trace")
    tokens, positions = torch.tensor([5]), torch.tensor([3])
    with torch.inference_mode():
        _, states = model.prefill(torch.randint(4, 24, (1, 3)))
        first, _ = step(tokens, positions, states)
    with torch.no_grad():
        # not a constant: the final LayerNorm would take a uniform shift back out
        model.layers[1].fc2.bias.add_(torch.linspace(-1, 1, model.config.dim))
    with torch.inference_mode():
        got, _ = step(tokens, positions, states)
        want, _ = model.step(tokens, positions, states)
    assert not torch.allclose(got, first)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_models_it_cannot_run_are_named():
    assert "layer 1 has exact attention, which has no traced step" in unsupported(
        causal(attention="exact")
    )
    assert "taylor linear attention, which" in unsupported(
        causal(attention="linear", kernel="taylor")
    )
    assert unsupported(causal(position_memory=16)) is None  # the memory runs in the step
    assert "layer 1 has exact attention, which" in unsupported(
        causal(attention="exact", position_memory=16)
    )
    assert "'relu'" in unsupported(causal(kernel="relu"))
    assert "masked LM" in unsupported(causal(objective="mlm"))
    assert unsupported(causal()) is None
    wrapped = causal()
    wrapped.layers[1].fc1 = torch.nn.Sequential(wrapped.layers[1].fc1)  # an adapter's stand-in
    assert "layer 2's projections are replaced" in unsupported(wrapped)
    with pytest.raises(ValueError, match="no compiled step"):
        CompiledStep(causal(attention="exact"))


def memory_model(reads_own: bool, seed: int = 0) -> PerformerLM:
    """A causal model with the position memory, its offsets and gates drawn (at init the
    gate is nearly shut), so the memory's read moves the logits."""
    model = causal(seed, position_memory=200, memory_window=3, memory_reads_own=reads_own)
    with torch.no_grad():
        for layer in model.layers:
            mem = layer.self_attn.core
            mem.offset_logits.normal_()
            mem.gate_weight.normal_()
            mem.gate_bias.zero_()
    return model


def family(B: int, lengths: tuple[int, ...], seed: int) -> torch.Tensor:
    """A family row per batch row: <cls> member <cls> member ... (residue tokens)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 24, (B, sum(lengths)), generator=g)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    tokens[:, starts] = 0  # <cls>
    return tokens


def member_run(model: PerformerLM, step, context: torch.Tensor, new: torch.Tensor,
               pad_from: int | None = None, **kw):  # fmt: skip
    """Logits (B, T, V) and states of stepping tokens ``new`` (B, T) after a prefill of the
    family ``context`` (B, L), at member positions (restarting at a <cls>); row 1 a pad from
    step ``pad_from``."""
    B = new.shape[0]
    out, pos = [], torch.zeros(B, dtype=torch.long)
    with torch.inference_mode():
        _, states = model.prefill(context)
        for t in range(new.shape[1]):
            pos = torch.where(new[:, t] == 0, 0, pos + 1) if t else pos
            pad = None
            if pad_from is not None and t >= pad_from:
                pad = torch.arange(B) == 1
            logits, states = step(new[:, t], pos, states, pad, **kw)
            out.append(logits)
    return torch.stack(out, 1), states


@pytest.mark.parametrize(("mode", "inplace"), [("eager", True), ("trace", False), ("trace", True)])
@pytest.mark.parametrize("reads_own", [False, True])
def test_the_traced_step_runs_the_position_memory(mode: str, reads_own: bool, inplace: bool):
    """A family context (three homologs), then a new member decoded token by token that
    crosses a <cls> into a second one: eager or traced, the step gives model.step's numbers
    and states, and both the whole row's forward (the memory that reads the other members,
    of 0.7, and the one that reads its own too, of older checkpoints); the memory's read
    moves the logits (the gate shut gives others)."""
    model = memory_model(reads_own)
    context = family(3, (11, 14, 9), seed=1)
    new = family(3, (13, 8), seed=2)
    want, want_states = member_run(model, model.step, context, new, 15)
    got, states = member_run(model, CompiledStep(model, mode=mode), context, new, 15,
                             inplace=inplace)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(states, want_states, strict=True):
        for x, y in zip(a, b, strict=True):
            if isinstance(x, tuple):  # the inner FAVOR+ state
                torch.testing.assert_close(x.kv, y.kv, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(x.mu, y.mu, atol=1e-6, rtol=1e-6)
            else:
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    with torch.inference_mode():
        whole = model(torch.cat([context, new], 1)).logits[:, context.shape[1] :]
    torch.testing.assert_close(got[0], whole[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1:, :15], whole[1:, :15], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.core.gate_bias.fill_(-1e4)
    shut, _ = member_run(model, CompiledStep(model, mode=mode), context, new, 15)
    assert (shut - got).abs().amax() > 1e-2


def test_a_memory_that_outgrows_its_slots_is_traced_once_more():
    """A long context of short members holds STEP_SLOTS slots (not its length); a member
    decoded past them doubles the memory on the host and traces the step once more (a graph
    per batch size and memory size), with model.step's numbers throughout."""
    from protein_performer.model.linear.memory import STEP_SLOTS

    model = memory_model(False)
    context = family(1, (20,) * 12, seed=3)  # 240 tokens, members of 20
    new = family(1, (STEP_SLOTS + 20,), seed=4)
    traced = CompiledStep(model, mode="trace")
    want, want_states = member_run(model, model.step, context, new, inplace=True)
    got, states = member_run(model, traced, context, new, inplace=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    slots = sorted({b[1] for k in traced._traced for b in k[1:-1]})  # buffers (B, S, H, C)
    assert len(traced._traced) == 2 and slots == [STEP_SLOTS, 2 * STEP_SLOTS]
    assert all(isinstance(f, torch.jit.ScriptFunction) for f in traced._traced.values())
    assert [s.mem.shape[2] for s in states] == [s.mem.shape[2] for s in want_states]
    assert states[0].mem.shape[2] == 2 * STEP_SLOTS < context.shape[1]


@pytest.mark.slow  # dynamo traces the step once per memory size (seconds), no compiler
def test_the_compiled_step_runs_the_memory_and_recompiles_per_memory_size(monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    from protein_performer.model.linear.memory import STEP_SLOTS

    counter, real = CompileCounterWithBackend("eager"), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    torch._dynamo.reset()
    for reads_own in (False, True):
        model = memory_model(reads_own)
        context = family(2, (20, 17, 23), seed=5)
        new = family(2, (STEP_SLOTS + 8, 5), seed=6)
        want, _ = member_run(model, model.step, context, new, 40)
        got, _ = member_run(model, CompiledStep(model), context, new, 40, inplace=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 4  # two memory sizes, each memory kind


@pytest.mark.slow  # torch.compile: tens of seconds
def test_the_compiled_step_equals_the_eager_one():
    model = causal()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, 24, (3, 16), generator=g)
    tokens[:, 0] = model.config.cls_idx
    want, _ = run(model, model.step, tokens, 5, 9)
    got, _ = run(model, CompiledStep(model), tokens, 5, 9)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # dynamo's first trace: seconds
def test_one_graph_serves_every_prompt_length_and_position(monkeypatch):
    """A prefill's stabilizer is a strided slice whose strides depend on the prompt length,
    and a step's output is contiguous: the step must not be traced again for either."""
    from torch._dynamo.testing import CompileCounter

    counter, real = CompileCounter(), torch.compile  # dynamo's trace alone: no compiler
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    torch._dynamo.reset()
    model = causal()
    step = CompiledStep(model)
    g = torch.Generator().manual_seed(4)
    for length in (3, 40, 9):
        tokens = torch.randint(4, 24, (1, length), generator=g)
        run(model, step, tokens.expand(3, -1), length - 2, length, inplace=True)
    assert counter.frame_count == 1


@pytest.mark.slow  # dynamo traces the step once per kernel (seconds), no compiler
@pytest.mark.parametrize(
    ("kernel", "positions"), [("softmax_hyp", "sequence"), ("softmax_opt", "member")]
)
def test_every_exp_kernel_traces_to_the_eager_numbers(monkeypatch, kernel: str, positions: str):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    model = causal(kernel=kernel, positions=positions)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, 24, (3, 14), generator=g)
    tokens[:, 0] = model.config.cls_idx
    tokens[0, 7] = model.config.cls_idx  # a second member in row 0
    want, _ = run(model, model.step, tokens, 4, 10)
    got, _ = run(model, CompiledStep(model), tokens, 4, 10, inplace=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
