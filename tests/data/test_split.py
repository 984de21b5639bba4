"""Split assignment: deterministic, fraction-accurate, cluster-consistent."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

from protein_performer.data.split import (
    TEST,
    TRAIN,
    VALID,
    Splitter,
    assign_split,
    check_fractions,
    cluster_of_id,
    key_hash,
    split_key,
)
from protein_performer.errors import UserError

#: Regression pin for the split of r0..r15 at valid 0.3 / test 0.3.
PINNED = [1, 1, 0, 0, 1, 1, 0, 0, 1, 2, 0, 0, 0, 1, 1, 1]


def _rec(rid: str, cluster: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        id=rid, header=SimpleNamespace(cluster_id=cluster), path="x.fasta", number=1
    )


def test_hash_is_pinned() -> None:
    # Pinned values: a change in hashing would silently reshuffle every existing store.
    assert key_hash("sp|P69905|HBA_HUMAN") == int.from_bytes(
        hashlib.blake2b(b"sp|P69905|HBA_HUMAN", digest_size=8).digest(), "big"
    )
    assert [assign_split(f"r{i}", 0.3, 0.3) for i in range(16)] == PINNED
    assert 0.0 <= key_hash("x") / 2**64 < 1.0


def test_assign_split_agrees_with_fraction() -> None:
    for i in range(2000):
        k = f"k{i}"
        u = key_hash(k) / 2**64
        expected = TEST if u < 0.1 else VALID if u < 0.3 else TRAIN
        assert assign_split(k, 0.2, 0.1) == expected


def test_splitter_matches_assign_split() -> None:
    sp = Splitter(0.2, 0.1, "auto")
    for i in range(500):
        r = _rec(f"UniRef90_{i}", cluster=f"UniRef50_C{i % 37}" if i % 2 else None)
        assert sp(r) == assign_split(split_key(r), 0.2, 0.1)


def test_fractions_are_respected() -> None:
    keys = [f"id{i}" for i in range(20000)]
    codes = [assign_split(k, 0.1, 0.05) for k in keys]
    assert abs(codes.count(VALID) / len(keys) - 0.1) < 0.01
    assert abs(codes.count(TEST) / len(keys) - 0.05) < 0.008
    assert codes.count(TRAIN) + codes.count(VALID) + codes.count(TEST) == len(keys)


def test_zero_fractions_give_all_train() -> None:
    assert {assign_split(f"k{i}", 0.0, 0.0) for i in range(500)} == {TRAIN}


def test_growing_valid_frac_keeps_test_set() -> None:
    keys = [f"k{i}" for i in range(3000)]
    test_a = {k for k in keys if assign_split(k, 0.05, 0.1) == TEST}
    test_b = {k for k in keys if assign_split(k, 0.3, 0.1) == TEST}
    assert test_a == test_b and test_a


def test_split_key_modes() -> None:
    uniref = _rec("UniRef50_A0A5A9P0L4", cluster="UniRef50_A0A5A9P0L4")
    member = _rec("UniRef90_Q1", cluster="UniRef50_A0A5A9P0L4")  # a member of that cluster
    plain = _rec("sp|P1|P1_HUMAN")
    assert split_key(uniref) == split_key(member)  # same cluster -> same key -> same split
    assert split_key(member, "id") == "UniRef90_Q1"
    assert split_key(plain) == "sp|P1|P1_HUMAN"
    assert split_key(member, "cluster") == split_key(member)
    with pytest.raises(UserError, match="no UniRef cluster id"):
        split_key(plain, "cluster")
    with pytest.raises(UserError, match="unknown split mode"):
        split_key(plain, "bogus")  # type: ignore[arg-type]


def test_cluster_members_share_split() -> None:
    for c in range(200):
        codes = {
            Splitter(0.3, 0.3)(_rec(f"UniRef90_M{c}_{j}", cluster=f"UniRef50_C{c}"))
            for j in range(5)
        }
        assert len(codes) == 1


@pytest.mark.parametrize("v,t", [(-0.1, 0.0), (0.0, 1.0), (0.6, 0.5), (0.5, 0.5)])
def test_bad_fractions(v: float, t: float) -> None:
    with pytest.raises(UserError):
        check_fractions(v, t)


def test_only_uniref_ids_carry_clusters() -> None:
    """``cluster_of`` skips parsing non-UniRef headers; that is only right while the header
    parser takes cluster ids from UniRef ids alone."""
    from protein_performer.data.headers import parse_header

    for title in [
        "sp|P69905|HBA_HUMAN Hemoglobin OS=Homo sapiens OX=9606 GN=HBA1 PE=1 SV=2",
        "tr|W0FSK4|W0FSK4_9FLAV Genome polyprotein OS=Dengue virus 3 PE=4 SV=1 Split=0",
        "seq1 UniRef50_A0A5A9P0L4 RepID=X n=3",
        "XUniRef50_A0A5A9P0L4 x",
    ]:
        assert parse_header(title).cluster_id is None, title
    h = parse_header("UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Acipenser TaxID=7906")
    assert h.cluster_id == "UniRef50_A0A5A9P0L4"


IDS = [
    "UniRef50_A0A5A9P0L4",
    "UniRef90_Q8WZ42",
    "UniRef100_P69905",
    "UniRef50_",
    "UniRef75_X",
    "UniRef50_A|B",
    "UniRefX",
    "sp|P69905|HBA_HUMAN",
    "tr|W0FSK4|W0FSK4_9FLAV",
    "seq1",
]


def test_cluster_of_id_mirrors_parse_header() -> None:
    from protein_performer.data.headers import parse_header

    for rid in IDS:
        assert cluster_of_id(rid) == parse_header(rid + " some protein n=2").cluster_id, rid


def test_chunk_codes_match_per_record() -> None:
    """The preprocessing fast path (ids only) must agree with split_key on real headers."""
    from protein_performer.data.headers import parse_header

    ids = [f"{base}{i}" for i in range(300) for base in ("UniRef50_Z", "sp|P", "UniRef75_")]
    ids += IDS
    recs = [SimpleNamespace(id=i, header=parse_header(i + " x")) for i in ids]
    for mode in ("auto", "id"):
        sp = Splitter(0.2, 0.1, mode)  # type: ignore[arg-type]
        codes = sp.codes(ids)
        assert codes.dtype == np.uint8 and codes.shape == (len(ids),)
        assert codes.tolist() == [sp(r) for r in recs]
        assert set(codes.tolist()) == {TRAIN, VALID, TEST}
    with pytest.raises(UserError, match="no UniRef cluster id"):
        Splitter(0.1, 0.1, "cluster").codes(["UniRef50_A", "sp|P1|X"])
    assert Splitter(0.1, 0.1, "cluster").codes(["UniRef50_A"]).shape == (1,)
