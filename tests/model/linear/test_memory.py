"""The position memory against its definition, written out as an O(L^2) loop-free reference."""

import pytest
import torch

from protein_performer.model.exact import ExactAttention
from protein_performer.model.linear.core import LinearAttention
from protein_performer.model.linear.memory import PositionMemory, member_layout
from protein_performer.model.rotary import member_positions


def _rows(seed: int):
    """Two family rows of members of unequal lengths (member positions), the second padded."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 24, (2, 41), generator=g)
    for b, starts in enumerate([(0, 9, 20, 33), (0, 12, 25)]):
        tokens[b, list(starts)] = 0
    mask = torch.zeros(2, 41, dtype=torch.bool)
    mask[1, 36:] = True
    return member_positions(tokens, 0), mask


def _reference(mem: PositionMemory, q, k, v, pos, mask, inner_out, members=None):
    """The definition, loop-free in O(L^2 W): for each offset D the mean key of the real keys
    j (j <= t when causal; in another member than t's unless the memory reads its own) at
    position p_t + D and the mean value at p_t + D + 1 when causal
    (at p_t + D when not), positions < P; softmax over the offsets that hold both; the gate's
    mix with the inner core's output. ``members`` (B, L): where ``pos`` are not member positions
    (aligned coordinates), the members they belong to."""
    W, P = mem.window, mem.max_positions
    q, k, v = q.double(), k.double(), v.double()
    d = q.shape[-1]
    delta = pos[:, None, :] - pos[:, :, None]  # (B, t, j): p_j - p_t
    ok = ~mask[:, None, :] & (pos[:, None, :] < P) & (pos[:, :, None] < P)
    L = pos.shape[1]
    if not mem.reads_own:  # only the other members (causal: with j <= t, the earlier ones)
        member = member_layout(pos) if members is None else members
        ok &= member[:, None, :] != member[:, :, None]
    if mem.causal:
        ok &= torch.ones(L, L, dtype=torch.bool).tril()
    offsets = torch.arange(-W, W + 1)
    k_hit = ((delta[..., None] == offsets) & ok[..., None])[:, None].double()  # (B, 1, t, j, D)
    v_hit = ((delta[..., None] == offsets + int(mem.causal)) & ok[..., None])[:, None].double()
    k_count, v_count = k_hit.sum(3), v_hit.sum(3)  # (B, 1, t, D)
    mean_k = torch.einsum("bxtjo,bhjd->bhtod", k_hit, k) / k_count.clamp_min(1e-12)[..., None]
    mean_v = torch.einsum("bxtjo,bhjd->bhtod", v_hit, v) / v_count.clamp_min(1e-12)[..., None]
    count = k_count * v_count
    scores = (mean_k * q[:, :, :, None]).sum(-1) / d**0.5 + mem.offset_logits.double()[:, None]
    weights = scores.masked_fill(count == 0, float("-inf")).softmax(-1).nan_to_num(0.0)
    read = (weights[..., None] * mean_v).sum(-2)
    gate = torch.sigmoid((q * mem.gate_weight.double()[:, None]).sum(-1, keepdim=True)
                         + mem.gate_bias.double()[:, None, None])
    gate = gate * (count > 0).any(-1, keepdim=True)
    return inner_out.double() + gate * (read - inner_out.double())


def _randomized(mem: PositionMemory) -> PositionMemory:
    """``mem`` with random offsets and gate weights (at 0 every offset would weigh alike), so
    every term of the definition is exercised."""
    with torch.no_grad():
        mem.offset_logits.normal_()
        mem.gate_weight.normal_()
    return mem


def _random_memory(causal: bool, own: bool) -> PositionMemory:
    """A small memory around exact attention (2 heads of 6, 11 positions, W = 2)."""
    return _randomized(PositionMemory(ExactAttention(causal=causal), 2, 6, max_positions=11,
                                      window=2, reads_own=own))


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_memory_matches_its_definition(causal, own):
    torch.manual_seed(0)
    mem = _random_memory(causal, own)
    pos, mask = _rows(0)
    q, k, v = (torch.randn(2, 2, 41, 6) for _ in range(3))
    out, _ = mem(q, k, v, mask, positions=pos)
    inner = ExactAttention(causal=causal)(q, k, v, mask)[0]
    inner = inner[0] if isinstance(inner, tuple) else inner
    ref = _reference(mem, q, k, v, pos, mask, inner)
    torch.testing.assert_close(out.double()[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double()[1, :, :36], ref[1, :, :36], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_memory_gradients_match_its_definition(causal, own):
    """The banded read's own backward against autograd through the definition: gradients of
    q, k, v and of the memory's learned offsets and gate (float64, both rows, padding too)."""
    torch.manual_seed(5)
    mem = _random_memory(causal, own).double()
    pos, mask = _rows(6)
    q, k, v = (torch.randn(2, 2, 41, 6, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    weight = torch.randn(2, 2, 41, 6, dtype=torch.float64) * ~mask[:, None, :, None]
    inner = ExactAttention(causal=causal)(q, k, v, mask)[0]
    inner = inner[0] if isinstance(inner, tuple) else inner
    params = [q, k, v, mem.offset_logits, mem.gate_weight, mem.gate_bias]
    ref = torch.autograd.grad((_reference(mem, q, k, v, pos, mask, inner) * weight).sum(), params)
    out, _ = mem(q, k, v, mask, positions=pos)
    got = torch.autograd.grad((out * weight).sum(), params)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-9, rtol=1e-7)


def test_member_layout_counts_members():
    pos, _ = _rows(1)
    assert member_layout(pos)[0].tolist() == [0] * 9 + [1] * 11 + [2] * 13 + [3] * 8


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("split", [20, 25])
def test_memory_state_continues_the_row_and_has_a_fixed_size(split, own):
    """A row split after its second member (a family context, then candidates) or inside its
    third gives the same outputs as the whole row, and so do single-token steps (the memory
    that reads only the other members keeps apart the member it ended in); the memory state
    holds the longest member seen (11 tokens, then 13), not max_positions slots."""
    torch.manual_seed(1)
    inner = LinearAttention(2, 6, "taylor", causal=True, chunk_size=8)
    mem = PositionMemory(inner, 2, 6, max_positions=16, window=3, reads_own=own)
    with torch.no_grad():
        mem.offset_logits.normal_()
        mem.gate_weight.normal_()
    pos, _ = _rows(2)
    pos = pos[:1]
    q, k, v = (torch.randn(1, 2, 41, 6) for _ in range(3))
    full, _ = mem(q, k, v, positions=pos)
    a, state = mem(q[:, :, :split], k[:, :, :split], v[:, :, :split],
                   positions=pos[:, :split], keep_state=True)
    b, after = mem(q[:, :, split:], k[:, :, split:], v[:, :, split:], state=state,
                   positions=pos[:, split:], keep_state=True)
    torch.testing.assert_close(torch.cat([a, b], 2), full, atol=1e-5, rtol=1e-4)
    assert state.mem.shape == (1, 2, 11, 6 + 6 + 1)
    assert after.mem.shape == (1, 2, 13, 6 + 6 + 1)
    steps, s = [], None
    for t in range(41):
        sl = slice(t, t + 1)
        o, s = mem(q[:, :, sl], k[:, :, sl], v[:, :, sl], state=s, positions=pos[:, sl],
                   keep_state=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), full, atol=1e-5, rtol=1e-4)


def test_no_memory_in_reach_leaves_the_core_output():
    """Positions past P read nothing: the output is the inner core's, untouched."""
    mem = PositionMemory(ExactAttention(causal=True), 2, 6, max_positions=4, window=1)
    q, k, v = (torch.randn(1, 2, 10, 6) for _ in range(3))
    pos = torch.arange(10)[None] + 50
    out, _ = mem(q, k, v, positions=pos)
    inner = ExactAttention(causal=True)(q, k, v)[0]
    inner = inner[0] if isinstance(inner, tuple) else inner
    torch.testing.assert_close(out, inner)


def test_hybrid_stack_puts_exact_attention_in_every_nth_layer_from_the_last():
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    cfg = PerformerConfig(dim=32, depth=5, heads=2, ff_dim=64, objective="clm", exact_every=2,
                          nb_features=16)
    cores = [type(layer.self_attn.core).__name__ for layer in PerformerLM(cfg).layers]
    assert cores == ["ExactAttention", "FavorAttention"] * 2 + ["ExactAttention"]
    with pytest.raises(Exception, match="exact_every"):
        PerformerConfig(depth=2, exact_every=3).validate()


def test_memory_state_has_the_same_bytes_after_1k_and_64k_context_tokens():
    """The family state is constant in the context's length (issue 30's test): members of 100
    tokens, 1,024 or 65,536 tokens of them; its slots are the longest member's 100, not P."""
    inner = LinearAttention(1, 4, "taylor", causal=True)
    mem = PositionMemory(inner, 1, 4, max_positions=128, window=2)

    def state_bytes(tokens: int) -> int:
        pos = (torch.arange(tokens) % 100)[None]
        q, k, v = (torch.randn(1, 1, tokens, 4) for _ in range(3))
        _, state = mem(q, k, v, positions=pos, keep_state=True)
        return state.mem.nbytes + state.inner.kv.nbytes

    with torch.no_grad():
        assert state_bytes(1024) == state_bytes(65536) == 4 * (100 * 9 + 15 * 5)


def _causal_memory(seed: int, own: bool) -> PositionMemory:
    """A causal memory over linear attention (2 heads of 6, P = 16, W = 3) whose offsets and
    gate are drawn from ``seed``."""
    torch.manual_seed(seed)
    return _randomized(PositionMemory(LinearAttention(2, 6, "taylor", causal=True), 2, 6, 16,
                                      window=3, reads_own=own))


@pytest.mark.parametrize("own", [False, True])
def test_a_long_causal_row_is_read_in_chunks_with_the_same_result(monkeypatch, own):
    """Chunks of the row with the memory carried between them (a long context's prefill)
    give the one-pass outputs and state."""
    from protein_performer.model.linear import memory as memory_module

    mem = _causal_memory(3, own)
    pos, mask = _rows(4)
    q, k, v = (torch.randn(2, 2, 41, 6) for _ in range(3))
    whole, state = mem(q, k, v, mask, positions=pos, keep_state=True)
    monkeypatch.setattr(memory_module, "READ_CHUNK", 7)
    chunked, chunked_state = mem(q, k, v, mask, positions=pos, keep_state=True)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chunked_state.mem, state.mem, atol=1e-5, rtol=1e-4)
    if not own:
        torch.testing.assert_close(chunked_state.part, state.part, atol=1e-5, rtol=1e-4)
        assert torch.equal(chunked_state.last, state.last)


def test_weights_do_not_depend_on_the_positions_held():
    """A 0.5 memory checkpoint (P = 1,024, its state then sized by P) loads into a model that
    holds fewer positions, strictly, and reads short members alike: the learned tensors are
    per head and offset, never per position."""
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(7)
    shape = dict(dim=24, depth=2, heads=2, ff_dim=32, nb_features=16, objective="clm")
    old = PerformerLM(PerformerConfig(**shape, position_memory=1024))
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.1 * torch.randn_like(p))
    new = PerformerLM(PerformerConfig(**shape, position_memory=64))
    new.load_state_dict(old.state_dict(), strict=True)
    tokens = torch.randint(4, 24, (1, 40))
    tokens[0, [0, 20]] = 0
    old.eval(), new.eval()
    with torch.no_grad():
        torch.testing.assert_close(new(tokens).logits, old(tokens).logits)


def test_layers_share_one_layout_per_batch_and_a_changed_batch_gets_its_own(monkeypatch):
    """The layout a stateless read shares across layers (held by the positions tensor) gives
    what each layer working it out alone gives, also under inference mode (no version
    counters: no sharing) and after the positions change in place."""
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.linear import memory as memory_module
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(5)
    config = PerformerConfig(dim=16, depth=3, heads=2, nb_features=8, objective="clm",
                             position_memory=32, memory_window=2).validate()  # fmt: skip
    model = PerformerLM(config).eval()
    for module in model.modules():
        if isinstance(module, PositionMemory):
            with torch.no_grad():
                module.gate_bias.fill_(2.0)
    tokens = torch.randint(4, 24, (2, 30))
    tokens[:, ::10] = config.cls_idx
    shared = model(tokens).logits
    with torch.inference_mode():
        inferred = model(tokens).logits
    core = model.layers[0].self_attn.core
    x = torch.randn(2, 2, 30, 8)
    positions = torch.arange(30).repeat(2, 1) % 10
    with torch.no_grad():
        core(x, x, x, None, None, positions=positions)  # its layout now held by positions
        positions[1] = torch.arange(30) % 15  # other members, in the same tensor
        changed = core(x, x, x, None, None, positions=positions)[0]
        fresh = core(x, x, x, None, None, positions=positions.clone())[0]
    torch.testing.assert_close(changed, fresh)
    layouts = []
    real = memory_module.PositionMemory._layout

    def counted(self, *args):
        layouts.append(1)
        return real(self, *args)

    monkeypatch.setattr(memory_module.PositionMemory, "_layout", counted)
    model(tokens)
    assert len(layouts) == 1  # one per batch, not per layer
    monkeypatch.setattr(memory_module.PositionMemory, "_shared", lambda self, *a: None)
    alone = model(tokens).logits
    torch.testing.assert_close(shared, alone)
    torch.testing.assert_close(inferred, alone)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_members_hidden_by_coordinates_neither_read_nor_are_read(causal, own, monkeypatch):
    """A training row's members hidden from the memory (``data.family_memory_dropout``:
    coordinates -1, the others' their member positions) get the core's output, and the others
    read the memory as if the hidden ones were not there: values and float64 gradients against
    the definition. Such coordinates keep the copying scatter (no key repeats in a member), and
    coordinates equal to the member positions give what none give."""
    from protein_performer.model.linear import memory as memory_module

    torch.manual_seed(3)
    mem = _random_memory(causal, own).double()
    with torch.no_grad():
        mem.gate_bias.fill_(1.0)
    pos, mask = _rows(7)
    members = member_layout(pos)
    hidden = (members == 1) | ((members == 2) & (torch.arange(2)[:, None] == 1))
    keys = torch.where(hidden, -1, pos)
    q, k, v = (torch.randn(2, 2, 41, 6, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    weight = torch.randn(2, 2, 41, 6, dtype=torch.float64) * ~mask[:, None, :, None]
    inner = ExactAttention(causal=causal)(q, k, v, mask)[0]
    inner = inner[0] if isinstance(inner, tuple) else inner
    # hidden tokens are padding to the memory, and read nothing: the core's output
    ref = _reference(mem, q, k, v, pos, mask | hidden, inner)
    ref = torch.where(hidden[:, None, :, None], inner.double(), ref)
    uniques = []
    layout = memory_module.PositionMemory._layout

    def noted(self, *args):
        lay = layout(self, *args)
        uniques.append(lay.unique)
        return lay

    monkeypatch.setattr(memory_module.PositionMemory, "_layout", noted)
    out, _ = mem(q, k, v, mask, positions=pos, coordinates=keys)
    assert uniques == [True]
    torch.testing.assert_close(out[0], ref[0], atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(out[1, :, :36], ref[1, :, :36], atol=1e-9, rtol=1e-7)
    params = [q, k, v, mem.offset_logits, mem.gate_weight, mem.gate_bias]
    got = torch.autograd.grad((out * weight).sum(), params, retain_graph=True)
    want = torch.autograd.grad((ref * weight).sum(), params)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-9, rtol=1e-7)
    same, _ = mem(q, k, v, mask, positions=pos, coordinates=pos)
    none, _ = mem(q, k, v, mask, positions=pos)
    torch.testing.assert_close(same, none, atol=0, rtol=0)
    repeated = torch.where(pos > 3, pos - 1, pos)  # positions 3 and 4 share a column
    mem(q, k, v, mask, positions=pos, coordinates=repeated)
    assert uniques[-2:] == [True, False]


@pytest.mark.parametrize("own", [False, True])
def test_candidates_after_a_context_read_what_the_whole_rows_read(own):
    """A batch of one-member candidates after a batch-1 context (the scoring path: the memory
    that reads only the other members reads the held memory alone) gives, row by row, the
    tail of the whole row context + candidate, also for a row that continues the context's
    last member and for a padded one."""
    mem = _causal_memory(11, own)
    pos, _ = _rows(6)
    ctx = pos[:1, :33]  # members of 9, 11 and 13 tokens
    q, k, v = (torch.randn(1, 2, 33, 6) for _ in range(3))
    _, state = mem(q, k, v, positions=ctx, keep_state=True)
    starts = [0, 13, 0]  # row 1 continues the last member (positions 0 .. 12)
    cand = torch.stack([torch.arange(8) + s for s in starts])
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[2, 5:] = True
    qc, kc, vc = (torch.randn(3, 2, 8, 6) for _ in range(3))
    with torch.inference_mode():
        batch, _ = mem(qc, kc, vc, pad, state, positions=cand)
    for b in range(3):
        n = int((~pad[b]).sum())
        whole, _ = mem(torch.cat([q, qc[b : b + 1, :, :n]], 2),
                       torch.cat([k, kc[b : b + 1, :, :n]], 2),
                       torch.cat([v, vc[b : b + 1, :, :n]], 2),
                       positions=torch.cat([ctx, cand[b : b + 1, :n]], 1))  # fmt: skip
        torch.testing.assert_close(batch[b : b + 1, :, :n], whole[:, :, 33:],
                                   atol=1e-5, rtol=1e-4)  # fmt: skip


def test_a_lone_sequence_reads_nothing_and_trained_offsets_still_get_a_gradient():
    """A row of one member with nothing held reads nothing (the inner core's output, not a
    read under a mask); where the offsets are trained they get a zero gradient, never none
    (an optimizer's momentum and DDP's reduction expect one every step)."""
    torch.manual_seed(12)
    mem = PositionMemory(ExactAttention(causal=True), 2, 6, max_positions=16, window=2)
    q, k, v = (torch.randn(2, 2, 10, 6) for _ in range(3))
    pos = torch.arange(10).repeat(2, 1)
    inner = ExactAttention(causal=True)(q, k, v)[0]
    with torch.inference_mode():
        torch.testing.assert_close(mem(q, k, v, positions=pos)[0], inner)
    mem(q, k, v, positions=pos.clone())[0].square().sum().backward()
    assert mem.offset_logits.grad is not None
    assert not mem.offset_logits.grad.any()


def test_a_layout_shared_under_inference_mode_is_not_reused_for_gradients():
    """The layout held by a positions tensor, worked out under inference mode (inference
    tensors), is not what a later call that records gradients reads (it could not save them
    for its backward)."""
    torch.manual_seed(13)
    mem = PositionMemory(ExactAttention(causal=True), 2, 6, max_positions=16, window=2)
    q, k, v = (torch.randn(1, 2, 20, 6) for _ in range(3))
    pos = (torch.arange(20) % 10)[None]  # two members
    with torch.inference_mode():
        first = mem(q, k, v, positions=pos)[0].clone()
    again = mem(q, k, v, positions=pos)[0]
    again.sum().backward()
    torch.testing.assert_close(again.detach(), first)
