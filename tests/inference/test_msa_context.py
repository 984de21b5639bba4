"""An MSA as family context (issue 41): gaps never become tokens, the reference is not read as a
homolog, and a position memory keys the homologs by their aligned coordinates, so a variant of
the reference reads shifted fragments that member positions cannot line up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.data.msa import Member
from protein_performer.data.tokenizer import STANDARD_AA, Alphabet
from protein_performer.inference.api import ProteinLM
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM
from tests.inference.test_context import tiny_lm

A2M = """>wt/1-12
MKTAYIAKQRQI
>h1
--TAYIAKQR--
>h2
MKTaaAYIAKQRQ-.
"""


def test_an_a2m_context_reads_no_gap_and_no_reference(tmp_path: Path) -> None:
    """Regression: an A2M given as context was read as FASTA, its '-'/'.' as tokens and its
    reference as a homolog (the same row as this FASTA of gapped rows)."""
    path = tmp_path / "family.a2m"
    path.write_text(A2M)
    lm = tiny_lm("favor", positions="member", position_memory=64)
    ctx = lm.context(str(path))
    assert ctx.members == ("h1", "h2")
    assert ctx.n_tokens == (8 + 2) + (13 + 2)  # TAYIAKQR, MKTAAAYIAKQRQ: no gap, no wt
    assert ctx.aligned and ctx.coordinates[0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    plain = lm.context([("h1", "TAYIAKQR"), ("h2", "MKTAAAYIAKQRQ")])
    assert plain.n_tokens == ctx.n_tokens and not plain.aligned
    # The memory's state is keyed by the coordinates: it differs from member positions'.
    aligned_mem, member_mem = ctx.states[0].mem, plain.states[0].mem
    assert aligned_mem.shape != member_mem.shape or not torch.allclose(aligned_mem, member_mem)


def test_cli_score_reads_an_a2m_as_an_msa(tmp_path: Path, capsys) -> None:
    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model

    lm = tiny_lm("favor", positions="member", position_memory=64)
    ckpt = export_model(lm.loaded, tmp_path / "clm")
    path = tmp_path / "family.a2m"
    path.write_text(A2M)
    cands = tmp_path / "c.fasta"
    cands.write_text(">wt\nMKTAYIAKQRQI\n")
    argv = ["score", str(ckpt), str(cands), str(tmp_path / "s.csv"), "--context", str(path)]
    assert main([*argv, "--no-progress", "--device", "cpu"]) == 0
    assert "read 2 of 2 homolog(s) (25 tokens)" in capsys.readouterr().err
    bad = tmp_path / "bad.a2m"
    bad.write_text(">wt\nMKTAY\n>h1\nMKT\n")
    assert main([*argv[:-1], str(bad), "--device", "cpu", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad}:3: record #2 'h1': 3 match")


# --------------------------------------------------------------------------------------------
# A hand-made model whose only skill is copying through the memory
# --------------------------------------------------------------------------------------------
def copying_lm() -> ProteinLM:
    """One layer whose output is the position memory's read: q = k = 0 (scores are the offset
    bias alone, peaked at D = 0), v = the token, the gate open, out_proj a gain, no FFN, the
    LM head tied to one-hot embeddings. It predicts, at position p, the mean homolog residue
    keyed at p + 1: the next residue exactly when the homologs are keyed where the candidate's
    residues are."""
    vocab, dim = 33, 64
    config = PerformerConfig(
        dim=dim, depth=1, heads=1, ff_dim=4, objective="clm", attention="exact",
        positions="member", position_memory=128, memory_window=2,
    )  # fmt: skip
    model = PerformerLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed_tokens.weight[:, :vocab] = 4 * torch.eye(vocab)
        for norm in (model.layers[0].self_attn_layer_norm, model.layers[0].final_layer_norm,
                     model.emb_layer_norm_after, model.lm_head.layer_norm):  # fmt: skip
            norm.weight.fill_(1.0)
        attn = model.layers[0].self_attn
        attn.v_proj.weight.copy_(torch.eye(dim))
        attn.out_proj.weight.copy_(5 * torch.eye(dim))
        memory = attn.core
        memory.offset_logits[0, memory.window] = 30.0  # D = 0
        memory.gate_bias.fill_(30.0)
        model.lm_head.dense.weight.copy_(torch.eye(dim))
    loaded = LoadedModel(model, config, Alphabet(), Path("copying"), torch.device("cpu"), "memory")
    return ProteinLM(loaded)


def shifted_family(tmp_path: Path) -> tuple[str, Path, list[Member]]:
    """A 60-residue wild type and three fragments of it starting 10, 25 and 40 residues in, as
    an A2M (fragments padded with '-') and as the same homologs unaligned."""
    rng = np.random.default_rng(7)
    wt = "".join(rng.choice(list(STANDARD_AA), 60))
    starts = (10, 25, 40)
    rows = [f">wt\n{wt}\n"] + [f">f{s}\n{'-' * s}{wt[s:]}\n" for s in starts]
    path = tmp_path / "fragments.a2m"
    path.write_text("".join(rows))
    return wt, path, [Member(f"f{s}", wt[s:]) for s in starts]


def test_aligned_coordinates_read_shifted_fragments_member_positions_do_not(tmp_path) -> None:
    """Issue 41's "done when": scoring the wild type and its variants after an A2M of shifted
    fragments reads them at the wild type's coordinates; the same homologs placed by their
    own member positions give the model nothing to copy."""
    lm = copying_lm()
    wt, a2m, unaligned = shifted_family(tmp_path)
    aligned_ctx, member_ctx = lm.context(str(a2m)), lm.context(unaligned)
    assert aligned_ctx.aligned and not member_ctx.aligned
    aligned = lm.score([wt], context=aligned_ctx)[0]
    member = lm.score([wt], context=member_ctx)[0]
    alone = lm.score([wt])[0]
    # (mean log-likelihoods: the first 10 residues, which no fragment covers, cost alike)
    assert aligned - member > 10.0 and abs(member - alone) < 3.0, (aligned, member, alone)
    # Variants: substitutions where the fragments cover the wild type are read as unlike the
    # family at once with aligned coordinates; by member positions, not so.
    mutants = [f"{wt[i]}{i + 1}{'W' if wt[i] != 'W' else 'C'}" for i in (20, 35, 50)]
    got = lm.score_variants(wt, mutants, context=aligned_ctx)
    by_member = lm.score_variants(wt, mutants, context=member_ctx)
    assert np.all(got < -5.0) and np.all(got < by_member - 5.0), (got, by_member)


def test_a_model_trained_on_aligned_rows_warns_of_an_unaligned_context(caplog) -> None:
    """Such a model reads homologs at member positions worse than none (issue 41's shifted
    table): a context without coordinates says so; one trained on member positions does not."""
    lm = tiny_lm("favor", positions="member", position_memory=64, family_coordinates="aligned")
    homologs = [("h1", "TAYIAKQR"), ("h2", "MKTAAAYIAKQRQ")]
    with caplog.at_level("WARNING"):
        ctx = lm.context(homologs)
    assert not ctx.aligned and "no homolog carries coordinates" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        tiny_lm("favor", positions="member", position_memory=64).context(homologs)
    assert "no homolog carries coordinates" not in caplog.text


def test_a_candidate_is_never_placed_by_its_own_alignment(tmp_path) -> None:
    """No leak: the scores of candidates after an aligned context do not depend on how the
    candidates themselves would align (they carry no coordinates; only the context does)."""
    lm = copying_lm()
    wt, a2m, _ = shifted_family(tmp_path)
    ctx = lm.context(str(a2m))
    tokens = lm.alphabet.encode_batch([wt])
    want, _ = lm.loaded.model.extend(tokens, ctx.states, ctx.offset)
    # the call a candidate gets: no coordinates, whatever the context holds
    again, _ = lm.loaded.model.extend(tokens, ctx.states, ctx.offset, coordinates=None)
    assert torch.equal(want, again)
    assert lm.score([wt], context=ctx)[0] == pytest.approx(
        float(torch.log_softmax(want[0, :-1].float(), -1).gather(-1, tokens[0, 1:, None]).mean()),
        abs=1e-5,
    )


def test_a_wild_type_that_is_not_the_reference_is_warned_about(tmp_path, caplog) -> None:
    lm = copying_lm()
    wt, a2m, _ = shifted_family(tmp_path)
    ctx = lm.context(str(a2m))
    assert ctx.reference.sequence == wt and ctx.reference.coordinates[0] == 1
    lm.score_variants(wt, ["wt"], context=ctx)
    assert "is not the wild type" not in caplog.text
    other = wt[:30] + ("W" if wt[30] != "W" else "C") + wt[31:]
    lm.score_variants(other, ["wt"], context=ctx)
    assert "the context's reference 'wt' (its first row, residues 1-60)" in caplog.text


def test_benchmark_context_dir_reads_msas_and_plain_fasta(tmp_path, capsys) -> None:
    """`benchmark proteingym --context-dir` takes <DMS_id>.a2m as well as .fasta; a plain
    context (no --context-* option) runs too (it failed on its run record before)."""
    import json

    from protein_performer.cli.main import main
    from protein_performer.interop.export import export_model
    from tests.paths import REPO

    pg = REPO / "data" / "proteingym"
    lm = tiny_lm("favor", positions="member", position_memory=300)
    ckpt = export_model(lm.loaded, tmp_path / "clm")
    wt = (pg / "BLAT_ECOLX.fasta").read_text().split("\n", 1)[1].replace("\n", "")
    folder = tmp_path / "ctx"
    folder.mkdir()
    (folder / "BLAT_ECOLX_Stiffler_2015.a2m").write_text(
        f">BLAT_ECOLX\n{wt}\n"
        f">frag\n{'-' * 40}{wt[40:120]}gsa{wt[120:200]}{'-' * (len(wt) - 200)}\n"
        f">frag2\n{'-' * 100}{wt[100:]}\n"
    )
    (folder / "BLAT_ECOLX_Stiffler_2015_cefotaxime.fasta").write_text(f">h\n{wt[20:220]}\n")
    out = tmp_path / "pg"
    argv = ["benchmark", "proteingym", str(pg / "reference_two_assays.csv"), str(pg), str(out),
            str(ckpt), "--context-dir", str(folder), "--no-progress", "--device", "cpu"]
    assert main(argv) == 0, capsys.readouterr().err
    records = {p.stem: json.loads(p.read_text()) for p in (out / "scores").glob("*.json")}
    assert records["BLAT_ECOLX_Stiffler_2015"]["context"]["aligned"] is True
    assert records["BLAT_ECOLX_Stiffler_2015_cefotaxime"]["context"]["aligned"] is False


@pytest.mark.parametrize("segment", [4096, 20])
@pytest.mark.parametrize("attention", ["favor", "exact"])
def test_aligned_context_scores_equal_the_concatenated_forward(tmp_path, attention, segment):
    """The state an aligned context leaves (read in one segment or several) is the row's: a
    candidate scored after it gets the terms of one causal forward of context + candidate with
    the homologs keyed by coordinates and the candidate by its member positions."""
    from protein_performer.data.inputs import read_homologs
    from protein_performer.inference.context import build_context, member_coordinates

    lm = tiny_lm(attention, positions="member", position_memory=128, chunk=8)
    wt, a2m, _ = shifted_family(tmp_path)
    ctx = build_context(lm.loaded, str(a2m), segment=segment)
    _, members = read_homologs(a2m)
    a = lm.alphabet
    ids = [t for m in members for t in (a.cls_idx, *a.encode(m.sequence), a.eos_idx)]
    keys = [int(c) for m in members for c in member_coordinates(m)]
    start = len(ids)
    ids += [a.cls_idx, *a.encode(wt), a.eos_idx]
    keys += list(range(len(wt) + 2))
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        logits = lm.model(tokens, coordinates=torch.tensor([keys])).logits[0]
        unaligned = lm.model(tokens).logits[0]

    def mean_ll(lg: torch.Tensor) -> float:
        lp = torch.log_softmax(lg.float(), -1)[start:-1]
        return float(lp.gather(-1, tokens[0, start + 1 :, None]).mean())

    got = lm.score([wt], context=ctx)[0]
    assert got == pytest.approx(mean_ll(logits), abs=1e-4)
    assert abs(got - mean_ll(unaligned)) > 1e-4  # the coordinates changed what was read


def test_an_ensemble_over_an_msa_keeps_its_coordinates_and_reference(tmp_path) -> None:
    """Every prompt of an ensemble built from an A2M reads the homologs at their coordinates
    and knows the reference (orders and identity filters reorder members, not residues)."""
    lm = copying_lm()
    wt, a2m, _ = shifted_family(tmp_path)
    ens = lm.context(str(a2m), query=wt, max_identity=[1.0], tokens=[200, None], orders=1)
    assert len(ens.prompts) == 4  # 2 budgets x (1 order + its reverse)
    for p in ens.prompts:
        assert p.context.aligned and p.context.reference.sequence == wt
        assert p.record()["aligned"] is True
    whole = [p for p in ens.prompts if p.tokens is None]
    assert all(len(p.context.members) == 3 for p in whole)
    # the copying model reads the same columns whatever the members' order
    got = lm.score([wt], context=whole[1].context)[0]
    assert got == pytest.approx(lm.score([wt], context=lm.context(str(a2m)))[0], abs=1e-4)


def test_an_a2m_on_standard_input_is_read_as_an_msa(tmp_path, monkeypatch) -> None:
    import io
    import sys

    from protein_performer.data import stdin
    from protein_performer.data.inputs import read_homologs

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(A2M.encode())))
    monkeypatch.setattr(stdin, "_stdin_copies", [])
    reference, members = read_homologs("-")
    assert reference.id == "wt/1-12" and [m.id for m in members] == ["h1", "h2"]
    assert members[0].coordinates.tolist() == [3, 4, 5, 6, 7, 8, 9, 10]


def test_members_given_in_python_need_one_coordinate_per_residue() -> None:
    from protein_performer.errors import UserError

    lm = copying_lm()
    with pytest.raises(UserError, match=r"homolog 0 \(h\): \(3,\) coordinates for 4 residues"):
        lm.context([Member("h", "MKTA", np.array([1, 2, 3]))])
    ctx = lm.context([Member("h", "MKTA", np.array([5, 6, 7, 8])), Member("u", "MKT")])
    assert ctx.aligned and ctx.coordinates[1] is None


@pytest.mark.parametrize("causal", [True, False])
def test_the_memory_keyed_by_coordinates_matches_its_definition(causal) -> None:
    """The position memory with ``coordinates`` is its definition (tests/model/linear/
    test_memory.py's reference) with the coordinates in place of the positions: keys j <= t
    (causal) at coordinate c_t + D, values at c_t + D + 1; unplaced tokens (-1) neither enter
    nor read. Members are still found by their member positions. Coordinates rise strictly
    along a member, with gaps and unplaced tokens, as data.msa makes them."""
    from protein_performer.model.exact import ExactAttention
    from protein_performer.model.linear.memory import PositionMemory, member_layout
    from tests.model.linear.test_memory import _reference, _rows

    torch.manual_seed(1)
    mem = PositionMemory(ExactAttention(causal=causal), 2, 6, max_positions=30, window=2)
    with torch.no_grad():
        mem.offset_logits.normal_()
        mem.gate_weight.normal_()
    pos, mask = _rows(3)
    g = torch.Generator().manual_seed(4)
    step = torch.randint(1, 3, pos.shape, generator=g)  # coordinates skip some columns
    member = member_layout(pos)
    start = torch.randint(1, 7, (2, int(member.max()) + 1), generator=g).gather(1, member)
    first = pos == 0
    coords = torch.zeros_like(pos)
    for b in range(2):
        c = 0
        for t in range(pos.shape[1]):
            c = 0 if first[b, t] else (int(start[b, t]) if pos[b, t] == 1 else c + int(step[b, t]))
            coords[b, t] = c
    unplaced = (torch.rand(pos.shape, generator=g) < 0.15) & ~first
    coords[unplaced] = -1
    q, k, v = (torch.randn(2, 2, 41, 6) for _ in range(3))
    out, _ = mem(q, k, v, mask, positions=pos, coordinates=coords)
    inner = ExactAttention(causal=causal)(q, k, v, mask)[0]
    inner = inner[0] if isinstance(inner, tuple) else inner
    ref = _reference(mem, q, k, v, coords.clamp_min(0), mask | unplaced, inner)
    real = (~mask & ~unplaced)[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out.double()[real], ref[real], atol=1e-5, rtol=1e-5)
    # an unplaced token reads nothing: its output is the inner core's
    alone = (~mask & unplaced)[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[alone], inner[alone], atol=1e-6, rtol=1e-6)
