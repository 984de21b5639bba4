"""Family rows (``data.layout=family``): exact layout, targets, budget and sampling, the no-leak
property on a real ``preprocess --cluster-split`` store, and the datamodule wiring."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from protein_performer.data.dataset import InMemorySource, ProteinCollator
from protein_performer.data.family import FamilyDataset
from protein_performer.data.homology import Families
from protein_performer.data.masking import IGNORE_INDEX
from protein_performer.data.sampler import TokenBudgetBatchSampler
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

A = Alphabet()
CLS, EOS = A.cls_idx, A.eos_idx
AMINO = "ACDEFGHIKLMNPQRSTVWY"


def _source(seqs: list[str]) -> InMemorySource:
    return InMemorySource([f"r{i}" for i in range(len(seqs))], [A.encode(s) for s in seqs])


def _ids(seq: str) -> list[int]:
    return A.encode(seq).tolist()


def test_clm_row_is_the_members_each_framed_by_cls_and_eos() -> None:
    src = _source(["MKT", "GW", "PPPP"])
    fam = Families.from_lists([[0, 1], [2]])
    ds = FamilyDataset(src, fam, objective="clm", max_len=64, row_tokens=64, seed=0)
    assert len(ds) == 2 and ds.model_lengths().tolist() == [9, 6]
    ab = [CLS, *_ids("MKT"), EOS, CLS, *_ids("GW"), EOS]
    ba = [CLS, *_ids("GW"), EOS, CLS, *_ids("MKT"), EOS]
    rows = {tuple(ds[(0, epoch)]["tokens"].tolist()) for epoch in range(12)}
    assert rows == {tuple(ab), tuple(ba)}  # random member order, both seen over epochs
    item = ds[(0, 0)]
    assert item["id"] == "family:r0" and item["tokens"].dtype == np.int64
    tokens = item["tokens"].tolist()
    # Next-token targets across the row, but <eos> -> <cls> (always the same) is not trained.
    expect = tokens[1:] + [IGNORE_INDEX]
    expect[tokens.index(EOS)] = IGNORE_INDEX
    assert item["targets"].tolist() == expect
    single = ds[(1, 0)]
    assert single["tokens"].tolist() == [CLS, *_ids("PPPP"), EOS]
    assert single["targets"].tolist() == [*_ids("PPPP"), EOS, IGNORE_INDEX]


def test_rows_are_functions_of_seed_epoch_index() -> None:
    rng = np.random.default_rng(0)
    seqs = ["".join(rng.choice(list(AMINO), int(rng.integers(20, 60)))) for _ in range(40)]
    fam = Families.from_lists([list(range(40))])
    ds = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=200, seed=7)
    again = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=200, seed=7)
    other = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=200, seed=8)
    a, b = ds[(0, 3)], again[(0, 3)]
    assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["targets"], b["targets"])
    assert not np.array_equal(ds[(0, 3)]["tokens"], ds[(0, 4)]["tokens"])
    assert not np.array_equal(ds[(0, 3)]["tokens"], other[(0, 3)]["tokens"])
    ds.set_epoch(3)
    assert np.array_equal(ds[0]["tokens"], a["tokens"])


def test_a_large_family_is_sampled_within_the_budget() -> None:
    rng = np.random.default_rng(1)
    seqs = ["".join(rng.choice(list(AMINO), int(rng.integers(20, 60)))) for _ in range(50)]
    fam = Families.from_lists([list(range(50))])
    ds = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=300, seed=0)
    assert ds.model_lengths().tolist() == [300]
    seen: set[int] = set()
    for epoch in range(20):
        tokens, _, taken = ds.row(0, epoch)
        assert 300 - 62 < len(tokens) <= 300  # full up to less than one member
        assert len(set(taken)) == len(taken) < 50  # a subset, no member twice
        assert int((tokens == CLS).sum()) == len(taken) == int((tokens == EOS).sum())
        starts = np.flatnonzero(tokens == CLS)
        for s, m in zip(starts, taken, strict=True):  # each member whole, in its slot
            assert tokens[s + 1 : s + 1 + len(seqs[m])].tolist() == _ids(seqs[m])
        seen |= set(taken)
    assert len(seen) > 45  # different subsets over epochs cover the family


def test_long_members_are_cropped_and_their_artificial_ends_not_trained() -> None:
    rng = np.random.default_rng(2)
    long = "".join(rng.choice(list(AMINO), 100))
    ds = FamilyDataset(
        _source([long, "MKT"]),
        Families.from_lists([[0, 1]]),
        objective="clm",
        max_len=22,
        row_tokens=1000,
        crop="fixed",
    )
    tokens, targets, taken = ds.row(0, 0)
    s = int(np.flatnonzero(tokens == CLS)[taken.index(0)])
    assert tokens[s + 1 : s + 21].tolist() == _ids(long[:20]) and tokens[s + 21] == EOS
    assert targets[s + 20] == IGNORE_INDEX  # last kept residue -> an early <eos>
    assert targets[s] == _ids(long[0])[0]  # a fixed crop starts at the real N-terminus


def test_mlm_masks_residues_over_the_row_and_keeps_the_members() -> None:
    rng = np.random.default_rng(3)
    seqs = ["".join(rng.choice(list(AMINO), int(rng.integers(30, 80)))) for _ in range(10)]
    fam = Families.from_lists([list(range(10))])
    src = _source(seqs)
    mlm = FamilyDataset(src, fam, objective="mlm", max_len=128, row_tokens=400, seed=5)
    clm = FamilyDataset(src, fam, objective="clm", max_len=128, row_tokens=400, seed=5)
    item = mlm[(0, 2)]
    plain, _, _ = clm.row(0, 2)
    tokens, targets = item["tokens"], item["targets"]
    assert len(tokens) == len(plain)
    special = np.isin(plain, [CLS, EOS])
    assert np.array_equal(tokens[special], plain[special])  # specials never masked
    chosen = targets != IGNORE_INDEX
    assert not np.any(chosen & special)
    assert np.array_equal(targets[chosen], plain[chosen])
    assert np.array_equal(tokens[~chosen], plain[~chosen])
    assert 0.08 < chosen.sum() / (~special).sum() < 0.25
    assert np.sum(tokens == A.mask_idx) > 0


def test_items_batch_through_the_unchanged_collator_and_sampler() -> None:
    rng = np.random.default_rng(4)
    seqs = ["".join(rng.choice(list(AMINO), int(rng.integers(20, 60)))) for _ in range(30)]
    fam = Families.from_lists([list(range(i, i + 5)) for i in range(0, 30, 5)])
    ds = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=150)
    lengths = ds.model_lengths()
    sampler = TokenBudgetBatchSampler(lengths, 300, shuffle=True, seed=0, tag_epoch=True)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=ProteinCollator(A))
    rows = 0
    for batch in loader:
        assert batch["tokens"].shape == batch["targets"].shape == batch["padding_mask"].shape
        assert batch["tokens"].numel() <= 300
        rows += len(batch["ids"])
    assert rows == len(ds) == 6
    for i in range(len(ds)):  # the sampler's lengths bound every row
        assert len(ds.row(i, 0)[0]) <= lengths[i]


def test_restrict_drops_members_outside_and_renumbers() -> None:
    fam = Families.from_lists([[10, 12, 14], [11], [13, 10]], keys=[10, 11, 13])
    sub = fam.restrict(np.array([10, 13, 14]))
    assert [sub[f].tolist() for f in range(len(sub))] == [[0, 2], [1, 0]]
    assert sub.keys.tolist() == [0, 1]
    assert fam.restrict(np.array([12])).keys.tolist() == [0]  # key gone: first member names it


def test_bad_arguments_are_user_errors() -> None:
    src = _source(["MKT"])
    with pytest.raises(UserError, match="family_max_tokens"):
        FamilyDataset(src, Families.from_lists([[0]]), row_tokens=2)
    with pytest.raises(UserError, match="outside"):
        FamilyDataset(src, Families.from_lists([[0, 3]]))


def test_memory_dropout_hides_later_members_with_its_probability() -> None:
    """data.family_memory_dropout=p: each member after the first has coordinates -1 (hidden from
    a position memory) with probability p, the others their member positions; the rows'
    members, crops and targets are those of p = 0 (the draw has its own stream), and p = 0 rows
    carry no coordinates. 400 rows of 6 members: 2,000 draws of p = 0.3, so the share hidden
    has a standard deviation of sqrt(0.3 * 0.7 / 2000) = 0.010; the bar is 4 of them."""
    rng = np.random.default_rng(5)
    seqs = ["".join(rng.choice(list(AMINO), int(rng.integers(5, 15)))) for _ in range(600)]
    fam = Families.from_lists([list(range(i, i + 6)) for i in range(0, 600, 6)])
    kw = {"objective": "clm", "max_len": 64, "row_tokens": 200, "seed": 3}
    plain = FamilyDataset(_source(seqs), fam, **kw)
    dropped = FamilyDataset(_source(seqs), fam, memory_dropout=0.3, **kw)
    hidden = []
    for index in range(len(fam)):
        for epoch in range(4):
            item, base = dropped[(index, epoch)], plain[(index, epoch)]
            assert "coordinates" not in base
            assert np.array_equal(item["tokens"], base["tokens"])
            assert np.array_equal(item["targets"], base["targets"])
            starts = np.flatnonzero(item["tokens"] == CLS)
            for m, part in enumerate(np.split(item["coordinates"], starts[1:])):
                gone = bool((part == -1).all())
                assert gone or np.array_equal(part, np.arange(len(part)))
                if m == 0:
                    assert not gone  # the first reads nothing anyway
                else:
                    hidden.append(gone)
    assert len(hidden) == 2000
    assert abs(np.mean(hidden) - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 2000)
    with pytest.raises(UserError, match="family_memory_dropout must be a probability"):
        FamilyDataset(_source(seqs), fam, memory_dropout=1.5)


# ---- on a real store (MMseqs2) ---------------------------------------------------------------
def _planted(path: Path, families: int = 24, members: int = 4, seed: int = 0) -> dict[str, int]:
    """Unrelated random families of near-duplicates (~5% substitutions): id -> family."""
    rng = np.random.default_rng(seed)
    family: dict[str, int] = {}
    lines = []
    for f in range(families):
        base = rng.choice(list(AMINO), size=int(rng.integers(80, 140)))
        for k in range(members):
            seq = base.copy()
            hit = rng.random(len(seq)) < 0.05
            seq[hit] = rng.choice(list(AMINO), size=int(hit.sum()))
            rid = f"sp|F{f:02d}M{k}|F{f:02d}M{k}_TEST"
            family[rid] = f
            lines += [f">{rid} planted", "".join(seq)]
    path.write_text("\n".join(lines) + "\n")
    return family


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("mmseqs") is None,
    reason="MMseqs2 (`mmseqs`) is not on PATH: apt-get install mmseqs2 to run these tests",
)
@pytest.mark.parametrize("method", ["search", "cluster"])
def test_family_rows_never_hold_a_held_out_record(tmp_path: Path, method: str) -> None:
    from protein_performer.data.datamodule import ProteinDataModule
    from protein_performer.data.homology import FAMILY_DIR
    from protein_performer.data.preprocess import preprocess
    from protein_performer.data.split import TRAIN
    from protein_performer.data.store import TokenStore

    planted = _planted(tmp_path / "f.fasta")
    store_dir = tmp_path / "store"
    preprocess(
        [tmp_path / "f.fasta"],
        store_dir,
        valid_frac=0.25,
        test_frac=0.25,
        cluster_identity=0.5,
        progress=False,
    )
    store = TokenStore(store_dir)
    dm = ProteinDataModule(
        str(store_dir),
        objective="clm",
        layout="family",
        family_method=method,
        family_max_tokens=2048,
        num_workers=0,
        family_memory_dropout=0.5,
    )
    dm.prepare_data()
    dm.setup("fit")
    train = dm.datasets["train"]
    assert isinstance(train, FamilyDataset)
    # training rows hide members from a memory, valid rows never do (read as a context is)
    assert train.memory_dropout == 0.5
    assert dm.datasets["valid"].memory_dropout == 0.0
    assert "coordinates" not in dm.datasets["valid"][0]
    source = dm.sources["train"]
    for i in range(len(train)):
        _, _, taken = train.row(i, 0)
        records = [int(source.indices[m]) for m in taken]
        assert all(int(store.split[r]) == TRAIN for r in records)  # no valid/test member
        assert len({planted[store.id(r)] for r in records}) == 1  # one planted family a row
        assert len(taken) == 4  # ... all of it (a 50% cluster is never split)
    cache = sorted(p.name for p in (store_dir / FAMILY_DIR).iterdir())
    assert cache == sorted(f"{s}.{method}.id0.3.npz" for s in ("train", "valid"))
    # A second datamodule reads the cache: the very same families.
    again = ProteinDataModule(str(store_dir), layout="family", family_method=method)
    again.setup("fit")
    fam, fam2 = dm._families["train"], again._families["train"]
    assert np.array_equal(fam.members, fam2.members) and np.array_equal(fam.offsets, fam2.offsets)
    assert fam.meta["sizes"]["median"] == 4


def test_family_layout_needs_a_store(tmp_path: Path) -> None:
    from protein_performer.data.datamodule import ProteinDataModule

    fasta = tmp_path / "f.fasta"
    _planted(fasta, families=2)
    with pytest.raises(UserError, match="layout=family needs data.path to be one store"):
        ProteinDataModule(str(fasta), layout="family")
    with pytest.raises(UserError, match="choose one"):
        ProteinDataModule(str(tmp_path), layout="family", concat=True)


def test_a_crafted_family_cache_with_falling_offsets_is_refused(tmp_path: Path) -> None:
    """Offsets that fall (or do not start at 0) made members of one family read another's
    (a traceback further on); the cache loader ignores such a file and rebuilds."""
    from protein_performer.data.homology import Families

    good = Families(np.array([0, 1, 2]), np.array([0, 2, 3, 4]), np.array([0, 1, 1, 2]))
    good.save(tmp_path / "ok.npz")
    assert Families.load(tmp_path / "ok.npz").sizes().tolist() == [2, 1, 1]
    for offsets in ([0, 3, 1, 4], [1, 2, 3, 4]):
        np.savez(tmp_path / "bad.npz", keys=good.keys, offsets=np.array(offsets),
                 members=good.members, meta=np.array("{}"))  # fmt: skip
        with pytest.raises(ValueError, match="never decrease"):
            Families.load(tmp_path / "bad.npz")


@pytest.mark.skipif(shutil.which("mmseqs") is None, reason="MMseqs2 is not installed")
def test_an_empty_split_has_families_described_too() -> None:
    """data.layout=family on a store whose valid split is empty: KeyError 'sizes' on the first
    run (issue 42 #18)."""
    from protein_performer.data.homology import build_families

    assert build_families([], "search").meta["sizes"] == {"families": 0}


# ---- aligned coordinates (issue 41) ----------------------------------------------------------
def _shifted(n: int = 4, width: int = 90, seed: int = 0) -> tuple[list[str], list[int]]:
    """Fragments of one random ancestor starting up to 30 residues apart, ~10% substitutions:
    their planted alignment is the difference of their starts."""
    rng = np.random.default_rng(seed)
    ancestor = rng.choice(list(AMINO), size=width + 30)
    starts = [0, 30, 12, 21][:n]
    seqs = []
    for s in starts:
        seq = ancestor[s : s + width].copy()
        hit = rng.random(width) < 0.1
        seq[hit] = rng.choice(list(AMINO), size=int(hit.sum()))
        seqs.append("".join(seq))
    return seqs, starts


def _planted_keys(member: int, on: int, starts: list[int], width: int) -> np.ndarray:
    at = np.arange(width) + starts[member] - starts[on] + 1
    return np.where((at >= 1) & (at <= width), at, -1)


@pytest.mark.skipif(shutil.which("mmseqs") is None, reason="MMseqs2 is not installed")
def test_search_families_place_shifted_fragments_on_their_first_member(tmp_path: Path) -> None:
    """A family search keeps MMseqs2's alignment of every member to the query; placed by it, a
    fragment's residues land on the first member's residues they share an ancestor site with
    (member positions would put them up to 30 apart). The alignments survive restrict and the
    cache, and an aligned family row carries them as its coordinates."""
    from protein_performer.data.homology import build_families

    seqs, starts = _shifted()
    fam = build_families(seqs, "search", 0.3)
    assert fam.meta["alignments"] == "cigar" and fam.alignments is not None
    agree = []
    for f in range(len(fam)):
        for at in range(fam.offsets[f], fam.offsets[f + 1]):
            m, q = int(fam.members[at]), int(fam.keys[f])
            got = fam.coordinates(at, len(seqs[m]))
            want = _planted_keys(m, q, starts, 90)
            placed = (got >= 0) & (want >= 0)
            agree.append(np.mean(got[placed] == want[placed]))
            assert placed.sum() >= 50
    assert len(agree) > 8 and np.mean(agree) > 0.97  # ends of the aligned range may differ
    fam.save(tmp_path / "f.npz")
    loaded = Families.load(tmp_path / "f.npz").restrict(np.array([0, 2, 3]))
    kept = fam.restrict(np.array([0, 2, 3]))
    for at in range(len(kept.members)):
        n = len(seqs[[0, 2, 3][kept.members[at]]])
        assert np.array_equal(loaded.coordinates(at, n), kept.coordinates(at, n))
    ds = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=400,
                       coordinates="aligned")  # fmt: skip
    for index in range(len(fam)):
        tokens, _, taken = ds.row(index, 1)
        item = ds[(index, 1)]
        coords = item["coordinates"]
        assert coords.shape == tokens.shape and np.array_equal(item["tokens"], tokens)
        cls = np.flatnonzero(tokens == CLS)
        assert coords[cls].tolist() == [0] * len(taken)  # every member's <cls> at 0
        members = np.split(np.arange(len(tokens)), cls[1:])
        for m, span in zip(taken, members, strict=True):  # a crop keeps its residues' keys
            full = fam.coordinates(int(np.flatnonzero(fam[index] == m)[0])
                                   + int(fam.offsets[index]), len(seqs[m]))  # fmt: skip
            window = tokens[span[1:-1]]
            start = seqs[m].find(A.decode(window))
            assert np.array_equal(coords[span[1:-1]], full[start : start + len(window)])
    plain = FamilyDataset(_source(seqs), fam, objective="clm", max_len=64, row_tokens=400)
    assert "coordinates" not in plain[(0, 1)]


def test_members_without_an_alignment_keep_their_member_positions() -> None:
    """Cluster families (no alignment) under data.family_coordinates=aligned: each member at
    its own member positions, 0 .. L + 1, as with no coordinates at all."""
    src = _source(["MKT", "GWAA"])
    ds = FamilyDataset(src, Families.from_lists([[0, 1]]), objective="clm", max_len=64,
                       row_tokens=64, coordinates="aligned")  # fmt: skip
    tokens, _, taken = ds.row(0, 0)
    want = np.concatenate([np.arange(len(src.tokens(m)) + 2) for m in taken])
    assert ds[(0, 0)]["coordinates"].tolist() == want.tolist()
    with pytest.raises(UserError, match="family_coordinates must be positions or aligned"):
        FamilyDataset(src, Families.from_lists([[0, 1]]), coordinates="columns")


def test_the_collator_pads_coordinates_with_unplaced() -> None:
    items = [
        {"id": "a", "tokens": np.array([CLS, 5, EOS]), "targets": np.array([5, EOS, -100]),
         "coordinates": np.array([0, 7, 8])},
        {"id": "b", "tokens": np.array([CLS, EOS]), "targets": np.array([EOS, -100]),
         "coordinates": np.array([0, 1])},
    ]  # fmt: skip
    batch = ProteinCollator(A)(items)
    assert batch["coordinates"].tolist() == [[0, 7, 8], [0, 1, -1]]
    assert "coordinates" not in ProteinCollator(A)([{k: v for k, v in it.items()
                                                     if k != "coordinates"} for it in items])


@pytest.mark.skipif(shutil.which("mmseqs") is None, reason="MMseqs2 is not installed")
def test_a_family_cache_without_alignments_is_read_or_searched_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A search cache written before 0.7 has no alignments: read as it is for member
    positions, searched again (with a warning naming it) when aligned coordinates are asked."""
    from protein_performer.data.homology import family_cache_path, store_families
    from protein_performer.data.preprocess import preprocess
    from protein_performer.data.store import TokenStore

    seqs, _ = _shifted()
    fasta = tmp_path / "f.fasta"
    fasta.write_text("".join(f">s{i}\n{s}\n" for i, s in enumerate(seqs)))
    preprocess([fasta], tmp_path / "store", valid_frac=0.0, test_frac=0.0, progress=False)
    store = TokenStore(tmp_path / "store")
    fam = store_families(store, "train")
    path = family_cache_path(store.path, "train", "search", 0.3)
    old = Families(fam.keys, fam.offsets, fam.members, fam.meta)  # as 0.6 wrote it
    old.save(path)
    assert store_families(store, "train").alignments is None  # read: positions need none
    with caplog.at_level("WARNING"):
        again = store_families(store, "train", aligned=True)
    assert again.alignments is not None and "holds no alignments" in caplog.text
    assert str(path) in caplog.text
    assert Families.load(path).alignments is not None  # the cache is rewritten
