"""preprocess + the `preprocess` and `stats` subcommands, end to end on small real FASTA."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from Bio.SeqIO.FastaIO import SimpleFastaParser

from protein_performer.cli.main import main
from protein_performer.data import preprocess as pp
from protein_performer.data.preprocess import preprocess
from protein_performer.data.split import assign_split
from protein_performer.data.store import TokenStore
from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError
from tests.paths import DEMO_DATA, REPO

ROOT = REPO
DEMO = DEMO_DATA / "train.fasta"  # 2000 real UniProt records, bundled

UNIREF = """>UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Acipenser ruthenus TaxID=7906
MKTAYIAKQRQISFVKSHFSRQ
>UniRef50_Q8WZ42 Titin n=12 Tax=Homo sapiens TaxID=9606 RepID=TITIN_HUMAN
mttqapTFTQPLQSVVVLEGSTATFEAHISGFPVPEVSWFRDGQVISTSTLPGVQISFSDGRAKLTIPAVTKANSGRYSLKATNGSGQATSTAEL*
>UniRef50_P69905 Hemoglobin subunit alpha n=3 Tax=Homo sapiens TaxID=9606
MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHF
DLSHGSAQVKGHGKKVADALTNAVAHV
"""

BAD = """>ok1 fine
MKTAYIAKQR
>bad_j unknown letter
MKTJAYIAK
>ok2
LLLL
>bad_digit
MK7AA
>ok1 duplicate id
MKKK
>empty
>ok3
ACDEFGHIKLMNPQRSTVWY
"""


def _read(path: Path) -> list[tuple[str, str]]:
    with open(path) as fh:
        return [(t.split(None, 1)[0], s.upper().rstrip("*")) for t, s in SimpleFastaParser(fh)]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pp") / "store"
    s = preprocess([DEMO], out, valid_frac=0.1, test_frac=0.1, progress=False)
    assert s.records == 2000 and s.skipped == 0
    return out


def test_random_access_matches_input(demo_store: Path) -> None:
    store = TokenStore(demo_store)
    recs = _read(DEMO)
    assert len(store) == len(recs)
    a = Alphabet()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(recs), 200, replace=False).tolist():
        rid, seq = recs[i]
        assert store.id(i) == rid
        np.testing.assert_array_equal(store.tokens(i), a.encode(seq))
        assert store.length(i) == len(seq)
        assert int(store.split[i]) == assign_split(rid, 0.1, 0.1)
    assert store.header(0)["accession"] == "Q6GZX3"
    assert store.header(0)["organism"].startswith("Frog virus 3")
    m = store.meta
    assert m["num_residues"] == sum(len(s) for _, s in recs)
    counts = {k: v["records"] for k, v in m["splits"].items()}
    assert sum(counts.values()) == 2000
    assert 120 < counts["valid"] < 280 and 120 < counts["test"] < 280
    assert np.array_equal(
        np.sort(np.concatenate([store.indices(k) for k in counts])), np.arange(2000)
    )
    assert m["inputs"][0]["size"] == DEMO.stat().st_size
    assert m["split"]["valid_frac"] == 0.1 and m["invalid"]["skipped"] == 0


def test_rerun_is_byte_identical(demo_store: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    preprocess([DEMO], again, valid_frac=0.1, test_frac=0.1, progress=True)  # bar: no effect
    assert _files(again) == _files(demo_store)
    preprocess([DEMO], again, valid_frac=0.1, test_frac=0.1, progress=False, overwrite=True)
    assert _files(again) == _files(demo_store)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no temp leftovers


def test_uniref_gzip_cluster_split_and_normalisation(tmp_path: Path) -> None:
    fa = tmp_path / "u.fasta.gz"
    with gzip.open(fa, "wt") as fh:
        fh.write(UNIREF)
    s = preprocess([fa], tmp_path / "s", valid_frac=0.3, test_frac=0.3, progress=False)
    store = TokenStore(tmp_path / "s")
    assert s.records == 3
    for i, (rid, seq) in enumerate(_read_gz(fa)):
        assert store.sequence(i) == seq  # upper-cased, stop stripped, lines joined
        # the split hashes the cluster key, so every member of a cluster goes the same way
        assert int(store.split[i]) == assign_split("cluster:" + rid, 0.3, 0.3)
        assert store.header(i)["cluster_id"] == rid
    assert store.header(1)["n_members"] == 12


def _read_gz(path: Path) -> list[tuple[str, str]]:
    with gzip.open(path, "rt") as fh:
        return [(t.split(None, 1)[0], s.upper().rstrip("*")) for t, s in SimpleFastaParser(fh)]


def test_split_by_id_differs_from_cluster(tmp_path: Path) -> None:
    ids = [f"UniRef50_X{i}" for i in range(200)]
    fa = tmp_path / "c.fasta"
    fa.write_text("".join(f">{i}\nMKV\n" for i in ids))
    preprocess([fa], tmp_path / "a", valid_frac=0.3, test_frac=0.3, progress=False)
    preprocess(
        [fa], tmp_path / "b", valid_frac=0.3, test_frac=0.3, progress=False, split_mode="id"
    )
    a, b = TokenStore(tmp_path / "a").split, TokenStore(tmp_path / "b").split
    assert list(a) == [assign_split("cluster:" + i, 0.3, 0.3) for i in ids]
    assert list(b) == [assign_split(i, 0.3, 0.3) for i in ids]
    with pytest.raises(UserError, match="cluster"):
        preprocess([DEMO], tmp_path / "c", split_mode="cluster", progress=False)
    assert not (tmp_path / "c").exists()


def test_failure_mid_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pp, "_CHUNK_RECORDS", 2)  # several chunks are on disk before the error
    good = "".join(f">g{i}\nMKVL\n" for i in range(9))
    fa = tmp_path / "in.fasta"
    fa.write_text(good + ">late_bad\nMKJ\n")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"late_bad"):
        preprocess([fa], out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta"]
    # An existing store survives a failed --overwrite run untouched.
    fb = tmp_path / "ok.fasta"
    fb.write_text(good)
    preprocess([fb], out, progress=False)
    before = _files(out)
    with pytest.raises(UserError):
        preprocess([fa], out, progress=False, overwrite=True)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta", "ok.fasta", "out"]


def test_skip_mode_counts_and_records_in_meta(tmp_path: Path) -> None:
    fa = tmp_path / "bad.fasta"
    fa.write_text(BAD)
    with pytest.raises(UserError, match=r"bad_j"):
        preprocess([fa], tmp_path / "e", progress=False)
    s = preprocess([fa], tmp_path / "s", on_invalid="skip", progress=False)
    assert s.records == 3 and s.skipped == 4
    store = TokenStore(tmp_path / "s")
    assert [store.id(i) for i in range(len(store))] == ["ok1", "ok2", "ok3"]
    inv = store.meta["invalid"]
    assert inv["skipped"] == 4 and sum(inv["by_reason"].values()) == 4
    assert any("bad_j" in e for e in inv["examples"])
    assert store.meta["on_invalid"] == "skip"
    only_bad = tmp_path / "only_bad.fasta"
    only_bad.write_text(">x\nJJJ\n")
    with pytest.raises(UserError, match="no valid records"):
        preprocess([only_bad], tmp_path / "n", on_invalid="skip", progress=False)
    assert not (tmp_path / "n").exists()


def test_argument_errors(tmp_path: Path, demo_store: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        preprocess([tmp_path / "missing.fasta"], tmp_path / "o")
    with pytest.raises(UserError, match="valid_frac"):
        preprocess([DEMO], tmp_path / "o", valid_frac=0.6, test_frac=0.5)
    with pytest.raises(UserError, match="already exists"):
        preprocess([DEMO], demo_store)


def test_cli_preprocess_and_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    args = ["preprocess", str(DEMO), "--out", str(out), "--no-progress", "--valid-frac", "0.1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "2,000 records" in text and "MB/s" in text and "skipped 0" in text
    assert main(args) == 2  # exists, no --overwrite
    assert "error:" in capsys.readouterr().err

    assert main(["stats", str(out), str(DEMO), "--json"]) == 0
    st_store, st_fasta = json.loads(capsys.readouterr().out)
    lengths = np.array([len(s) for _, s in _read(DEMO)])
    for st in (st_store, st_fasta):
        assert st["records"] == 2000 and st["residues"] == int(lengths.sum())
        ln = st["length"]
        assert ln["min"] == lengths.min() and ln["max"] == lengths.max()
        assert ln["median"] == pytest.approx(np.median(lengths))
        assert ln["p95"] == pytest.approx(np.percentile(lengths, 95))
        assert ln["mean"] == pytest.approx(lengths.mean())
        assert st["over_1022"] == int((lengths > 1022).sum())
        assert sum(st["composition"].values()) == int(lengths.sum())
    assert st_store["composition"] == st_fasta["composition"]
    assert st_store["nonstandard"] == st_fasta["nonstandard"]
    assert sum(v["records"] for v in st_store["splits"].values()) == 2000
    assert "splits" not in st_fasta

    assert main(["stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "records   2,000" in text and "train" in text and "top aa" in text


def test_cli_skip_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fa = tmp_path / "bad.fasta"
    fa.write_text(BAD)
    out = tmp_path / "s"
    assert (
        main(["preprocess", str(fa), "--out", str(out), "--no-progress", "--on-invalid", "skip"])
        == 0
    )
    assert "skipped 4 invalid records" in capsys.readouterr().out
    assert main(["stats", str(fa), "--on-invalid", "skip", "--json"]) == 0
    (st,) = json.loads(capsys.readouterr().out)
    assert st["records"] == 3 and st["skipped"] == 4


def test_console_script_bad_fasta_exits_2(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("protein-performer")
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    fa = tmp_path / "bad.fasta"
    fa.write_text(BAD)
    proc = subprocess.run(
        [str(exe), "preprocess", str(fa), "--out", str(tmp_path / "s"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "bad_j" in lines[0] and str(fa) in lines[0]
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------------------ parallel path
# workers > 1 cuts plain files into byte ranges (tiny ones here, via the private knob) read in
# worker processes; shards are concatenated in order. Everything must match workers=1: the
# store byte for byte, and the first error's message (file, line, record number, id).
def _both(tmp_path: Path, inputs: list[Path], name: str, range_bytes: int = 300, **kw):
    """(serial, parallel) outcomes: the store's files, or the error message."""
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"{name}_{workers}"
        try:
            s = preprocess(
                inputs, out, progress=False, workers=workers, _range_bytes=range_bytes, **kw
            )
            outs.append((_files(out), s.records, s.skipped, s.skipped_reasons))
        except UserError as exc:
            outs.append(str(exc))
            assert not out.exists()
    return outs


def _many(n: int, bad: dict[int, str] | None = None, start: int = 0) -> str:
    """``n`` records with multi-line sequences; ``bad`` maps a record index to its sequence."""
    recs = []
    for i in range(start, start + n):
        seq = (bad or {}).get(i, "ACDEFGHIKLMNPQRSTVWY"[i % 20 :] + "mkv" * (i % 7))
        lines = "\n".join(seq[j : j + 13] for j in range(0, len(seq), 13))
        recs.append(f">r{i} desc {i}\n{lines}\n")
    return "".join(recs)


def test_workers_give_byte_identical_store(tmp_path: Path) -> None:
    from protein_performer.data.preprocess import _cuts

    fa = tmp_path / "a.fasta"
    fa.write_bytes(("\n\n" + _many(150)).replace("\n", "\r\n", 40).encode())
    assert len(_cuts(fa, fa.stat().st_size, 300)) > 10  # many ranges
    fb = tmp_path / "b.fasta.gz"  # a gzip file is one range of its own
    with gzip.open(fb, "wt") as fh:
        fh.write(_many(30, start=1000))
    serial, parallel = _both(tmp_path, [fa, fb], "ok", valid_frac=0.2, test_frac=0.2)
    assert isinstance(serial, tuple) and serial == parallel
    assert serial[1] == 150 + 30
    serial, parallel = _both(tmp_path, [DEMO], "demo", range_bytes=60_000)
    assert isinstance(serial, tuple) and serial == parallel and serial[1] == 2000
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["a.fasta", "b.fasta.gz", "demo_1", "demo_3", "ok_1", "ok_3"]  # no temps


@pytest.fixture
def fork_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fork instead of spawn: the same code in the workers, without re-importing it in each
    (test_workers_give_byte_identical_store covers spawn)."""
    import multiprocessing

    if "fork" in multiprocessing.get_all_start_methods():
        monkeypatch.setattr(pp, "_START_METHOD", "fork")


@pytest.mark.slow  # worker processes; test_workers_give_byte_identical_store is the fast check
@pytest.mark.usefixtures("fork_workers")
def test_workers_report_the_first_error_in_file_order(tmp_path: Path) -> None:
    # Errors in later ranges, the earliest one first in file order; duplicates across ranges
    # (before or after a format error) and text before the first header.
    cases = {
        "late_bad": _many(120, {90: "MKJV"}),
        "two_bad": _many(120, {40: "MK1V", 100: "MJ"}),
        "dup_first": _many(120, {70: "MK V"}) + _many(5, start=20),
        "bad_first": _many(60, {30: "MK*V"}) + _many(5, start=10),
        "dup_far": _many(100) + _many(1, start=3),
        "leading": "junk line\n" + _many(40),
        "binary": _many(90) + ">nul\nMK\x00V\n" + _many(30, {10: "MJ"}, start=90),
    }
    msgs = {}
    for name, text in cases.items():
        fa = tmp_path / f"{name}.fasta"
        fa.write_text(text)
        serial, parallel = _both(tmp_path, [fa], name)
        assert isinstance(serial, str) and serial == parallel, name
        msgs[name] = parallel
    assert "record #41 'r40'" in msgs["two_bad"] and "digit" in msgs["two_bad"]
    assert "record #101 'r3'" in msgs["dup_far"]
    assert "duplicate id: record #4 has the same id" in msgs["dup_far"]
    nul_line = _many(90).count("\n") + 2
    assert "binary data" in msgs["binary"] and f"binary.fasta:{nul_line}:" in msgs["binary"]


@pytest.mark.slow  # worker processes
@pytest.mark.usefixtures("fork_workers")
def test_workers_skip_mode_matches(tmp_path: Path) -> None:
    fa = tmp_path / "bad.fasta"
    bad = {i: "MKJV" for i in range(5, 120, 9)} | {33: "MK1", 77: "M K"}
    fa.write_text("junk\n" + _many(120, bad) + _many(6, start=50) + BAD)
    fb = tmp_path / "b.fasta"
    fb.write_text(_many(20, start=110))  # duplicates of the first file's records
    serial, parallel = _both(tmp_path, [fa, fb], "skip", on_invalid="skip")
    assert isinstance(serial, tuple) and serial == parallel  # meta.json (report) included
    _, records, skipped, reasons = serial
    # r51..r55 and ok1 repeat in the first file, r110..r119 but the invalid r113 in the second
    assert reasons["duplicate id"] == 5 + 1 + 9
    assert skipped == sum(reasons.values()) and reasons["text before first header"] == 1
    assert records == 120 + 6 + 7 + 20 - (skipped - 1)


def test_read_fasta_byte_ranges_match_the_whole_file(tmp_path: Path) -> None:
    from protein_performer.data.fasta import count_lines_and_records, read_fasta
    from protein_performer.data.preprocess import _cuts

    fa = tmp_path / "a.fasta"
    fa.write_text("\n" + _many(80, {50: "MKJ"}))
    size = fa.stat().st_size
    bounds = [0, *_cuts(fa, size, 200), size]
    got, line, number = [], 1, 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        kw = {"byte_range": (a, b), "start_line": line, "start_number": number}
        got += [
            (r.id, r.line, r.number, r.sequence) for r in read_fasta(fa, on_invalid="skip", **kw)
        ]
        nl, hd = count_lines_and_records(fa, a, b)
        line, number = line + nl, number + hd
    whole = [(r.id, r.line, r.number, r.sequence) for r in read_fasta(fa, on_invalid="skip")]
    assert got == whole and len(whole) == 79
    assert (line - 1, number) == count_lines_and_records(fa)
    with pytest.raises(ValueError, match="header"):
        list(read_fasta(fa, byte_range=(5, size)))
