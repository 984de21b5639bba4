"""Token store: layout, O(1) access, determinism, atomicity, clear errors on bad stores."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from protein_performer.data.store import (
    FORMAT_VERSION,
    LENGTHS,
    META,
    TOKENS,
    StoreWriter,
    TokenStore,
    is_store,
)
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError

RECORDS = [  # (id, sequence, split, description)
    ("sp|P1|A_HUMAN", "MKTAYIAK", 0, "Hemo OS=Homo sapiens OX=9606 PE=1 SV=2"),
    ("UniRef50_Q2", "LAGV", 1, "Some protein n=3 Tax=Acipenser TaxID=7906"),
    ("r3", "XBUZO", 2, ""),
    ("ид-4", "C" * 300, 0, "unicode ✓"),
    ("r5", "M", 0, ""),
]


def _write(out: Path, records=RECORDS, chunk: int = 1000, **kw) -> Path:
    with StoreWriter(out, **kw) as w:
        for a in range(0, len(records), chunk):
            ids, seqs, splits, hdrs = (list(c) for c in zip(*records[a : a + chunk], strict=True))
            w.write_chunk(ids, seqs, splits, hdrs)
        w.commit({"note": "test"})
    return out


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_roundtrip_and_layout(tmp_path: Path, chunk: int) -> None:
    out = _write(tmp_path / "store", chunk=chunk)
    s = TokenStore(out)
    a = Alphabet()
    assert len(s) == len(RECORDS)
    for i, (rid, seq, split, hdr) in enumerate(RECORDS):
        assert s.id(i) == rid
        assert s.tokens(i).dtype == np.uint8
        np.testing.assert_array_equal(s.tokens(i), a.encode(seq))
        assert s.length(i) == len(seq) == int(s.lengths[i])
        assert s.sequence(i) == seq
        assert int(s.split[i]) == split
        assert s.description(i) == hdr
        assert s.header_line(i) == (f"{rid} {hdr}" if hdr else rid)
    assert s.header(0)["taxid"] == 9606 and s.header(0)["accession"] == "P1"
    assert s.header(1)["cluster_id"] == "UniRef50_Q2" and s.header(1)["n_members"] == 3
    assert s.header(3)["description"] == "unicode ✓"
    assert s.id(-1) == "r5"
    with pytest.raises(IndexError):
        s.tokens(len(RECORDS))
    np.testing.assert_array_equal(s.indices("train"), [0, 3, 4])
    np.testing.assert_array_equal(s.indices("valid"), [1])
    np.testing.assert_array_equal(s.indices("test"), [2])
    np.testing.assert_array_equal(s.indices("all"), np.arange(5))
    assert s.indices("train").dtype == np.int64
    # Raw files are plain little-endian arrays other tools can read without us.
    raw = np.fromfile(out / LENGTHS, dtype="<i4")
    np.testing.assert_array_equal(raw, [len(r[1]) for r in RECORDS])
    assert (out / TOKENS).stat().st_size == sum(len(r[1]) for r in RECORDS)
    m = s.meta
    assert m["format_version"] == FORMAT_VERSION and m["num_records"] == 5
    assert m["splits"]["train"] == {"records": 3, "residues": 8 + 300 + 1}
    assert m["vocab"] == list(a.tokens) and m["note"] == "test"
    assert m["max_length"] == 300


def test_mixed_chunk_sizes_are_identical(tmp_path: Path) -> None:
    a = _write(tmp_path / "a")
    with StoreWriter(tmp_path / "b") as w:
        ids, seqs, splits, hdrs = (list(col) for col in zip(*RECORDS, strict=True))
        w.write_chunk(ids[:2], seqs[:2], splits[:2], hdrs[:2])
        w.write_chunk(ids[2:3], seqs[2:3], splits[2:3], hdrs[2:3])
        w.write_chunk(ids[3:], seqs[3:], splits[3:], hdrs[3:])
        w.commit({"note": "test"})
    for name in sorted(p.name for p in a.iterdir()):
        assert (a / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_header_line_breaks_cannot_shift_records(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "s") as w:
        w.write_chunk(["a", "b"], ["MK", "LL"], [0, 0], ["a x\ny", "b\r"])
        w.commit()
    s = TokenStore(tmp_path / "s")
    assert [s.description(0), s.description(1)] == ["a x y", "b "]


@pytest.mark.parametrize("seq", ["MKJ", "mk", "MK1", "MKé"])
def test_writer_rejects_non_vocabulary(tmp_path: Path, seq: str) -> None:
    with pytest.raises(ValueError, match="invalid residue"), StoreWriter(tmp_path / "s") as w:
        w.write_chunk(["a"], [seq], [0], [""])
        w.commit()
    assert list(tmp_path.iterdir()) == []


def test_byte_identical_rewrite(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", chunk=2)
    b = _write(tmp_path / "b", chunk=3)  # chunking must not show in the output
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert "tmp" not in (a / META).read_text()


def test_pickle_reopens_lazily(tmp_path: Path) -> None:
    s = TokenStore(_write(tmp_path / "s"))
    s.tokens(0)  # open the maps
    s2 = pickle.loads(pickle.dumps(s))
    assert s2._mm is None
    np.testing.assert_array_equal(s2.tokens(3), s.tokens(3))


def test_exception_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "store"
    with pytest.raises(RuntimeError), StoreWriter(out) as w:
        w.write_chunk(["a"], ["MK"], [0], [""])
        w.write_chunk(["b"], ["MK"], [0], [""])
        raise RuntimeError("crash mid-way")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # temporary sibling removed too


def test_no_commit_publishes_nothing(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "s") as w:
        w.write_chunk(["a"], ["MK"], [0], [""])
    assert list(tmp_path.iterdir()) == []


def test_overwrite_rules(tmp_path: Path) -> None:
    out = _write(tmp_path / "s")
    with pytest.raises(UserError, match="--overwrite"):
        StoreWriter(out)
    _write(out, records=RECORDS[:2], overwrite=True)
    assert len(TokenStore(out)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # old copy cleaned up
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("x")
    with pytest.raises(UserError, match="not a preprocessed store"):
        StoreWriter(precious, overwrite=True)
    assert (precious / "thesis.tex").exists()


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        TokenStore(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a preprocessed store"):
        TokenStore(tmp_path / "empty")
    assert not is_store(tmp_path / "empty")

    out = _write(tmp_path / "s")
    assert is_store(out)
    with open(out / TOKENS, "r+b") as fh:  # truncated tokens
        fh.truncate(10)
    with pytest.raises(UserError, match="corrupt: tokens.bin"):
        TokenStore(out)

    out2 = _write(tmp_path / "s2")
    meta = json.loads((out2 / META).read_text())
    meta["format_version"] = 999
    (out2 / META).write_text(json.dumps(meta))
    with pytest.raises(UserError, match="format version 999"):
        TokenStore(out2)

    out3 = _write(tmp_path / "s3")
    (out3 / "ids.offsets.bin").unlink()
    with pytest.raises(UserError, match="missing"):
        TokenStore(out3)


def _crafted(tmp_path: Path, name: str, edit) -> Path:
    """A valid store with one file rewritten by ``edit(bytes) -> bytes`` (sizes kept)."""
    out = _write(tmp_path / name)
    path = out / name
    path.write_bytes(edit(path.read_bytes()))
    return out


def _swap_int64(data: bytes, i: int, j: int) -> bytes:
    a = np.frombuffer(data, "<i8").copy()
    a[i], a[j] = a[j], a[i]
    return a.tobytes()


@pytest.mark.parametrize(
    ("name", "edit", "says"),
    [
        # A lying id index: ids read from the wrong places.
        ("ids.offsets.bin", lambda d: _swap_int64(d, 1, 2), "ids.offsets.bin is not a rising"),
        # A description holding a newline (a fake record in `homologs` output).
        ("descriptions.txt", lambda d: d.replace(b"Hemo ", b"\n>ev "), "line break"),
        ("ids.bin", lambda d: d.replace(b"r3", b"\xff\xfe"), "ids.bin is not UTF-8"),
        ("lengths.bin", lambda d: b"\xf8\xff\xff\xff" + d[4:], "negative lengths"),  # -8
        ("offsets.bin", lambda d: _swap_int64(d, 1, 2), "disagrees with offsets"),
        ("split.bin", lambda d: b"\x09" + d[1:], "unknown split code"),
    ],
)
def test_a_crafted_store_is_one_line_when_opened(tmp_path: Path, name, edit, says) -> None:
    out = _crafted(tmp_path, name, edit)
    with pytest.raises(UserError, match=says):
        TokenStore(out)


def test_a_token_outside_the_vocabulary_names_the_record(tmp_path: Path) -> None:
    out = _crafted(tmp_path, TOKENS, lambda d: d[:9] + b"\xc8" + d[10:])
    store = TokenStore(out)
    with pytest.raises(UserError, match="token 200 in record 1"):
        store.tokens(1)
    meta = json.loads((out / META).read_text())
    meta["vocab"] = meta["vocab"][:10]  # a shortened vocabulary
    (out / META).write_text(json.dumps(meta))
    with pytest.raises(UserError, match="outside its vocabulary of 10"):
        TokenStore(out).tokens(0)
