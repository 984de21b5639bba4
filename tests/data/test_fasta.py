"""FASTA reading: normalisations, every bad-input case (error and skip), gzip, real files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from protein_performer.data.duplicate_ids import DuplicateIdChecker
from protein_performer.data.fasta import (
    FastaFormatError,
    InvalidReport,
    count_lines_and_records,
    read_fasta,
)
from protein_performer.errors import UserError
from tests.paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR / "data"


def write(tmp_path: Path, text: str | bytes, name: str = "in.fasta") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


def records(path: Path, **kw) -> list:
    return list(read_fasta(path, **kw))


def error(path: Path, **kw) -> FastaFormatError:
    with pytest.raises(FastaFormatError) as info:
        records(path, **kw)
    return info.value


# ------------------------------------------------------------------------------ normalisations
def test_multiline_lowercase_crlf_stop(tmp_path: Path) -> None:
    p = write(tmp_path, ">a desc here\r\nmkv\r\nLLa*\r\n\r\n>b\r\nACDE\r\n")
    recs = records(p)
    assert [(r.id, r.description, r.sequence) for r in recs] == [
        ("a", "desc here", "MKVLLA"),
        ("b", "", "ACDE"),
    ]
    assert [(r.number, r.line) for r in recs] == [(1, 1), (2, 5)]
    assert recs[0].path == str(p)


def test_blank_lines_and_trailing_whitespace_are_ignored(tmp_path: Path) -> None:
    p = write(tmp_path, "\n\n>a  \nMKV  \n\nLL\t\n\n>b x\nW\n")
    recs = records(p)
    assert [(r.id, r.sequence, r.line) for r in recs] == [("a", "MKVLL", 3), ("b", "W", 8)]


def test_no_trailing_newline_and_all_letters(tmp_path: Path) -> None:
    p = write(tmp_path, ">x\nLAGVSERTIDPKQNFYMHWCXBUZO.-")
    assert records(p)[0].sequence == "LAGVSERTIDPKQNFYMHWCXBUZO.-"


def test_gzip_detected_by_magic_and_identical(tmp_path: Path) -> None:
    text = "".join(f">r{i} d{i}\n{'ACDEFGHIKL' * (i % 7 + 1)}\nmk\n" for i in range(3000))
    plain = write(tmp_path, text)
    gz = write(tmp_path, gzip.compress(text.encode()), name="no_gz_extension.fa")
    a, b = records(plain), records(gz)
    assert len(a) == 3000
    assert [(r.id, r.sequence, r.line, r.number) for r in a] == [
        (r.id, r.sequence, r.line, r.number) for r in b
    ]
    assert count_lines_and_records(plain)[1] == count_lines_and_records(gz)[1] == 3000


def test_records_spanning_block_boundaries(tmp_path: Path) -> None:
    # Sequences long enough that the (256 KiB) blocks cut records; line numbers must stay exact.
    seq = "ACDEFGHIKLMNPQRSTVWY" * 3000
    lines = "\n".join(seq[i : i + 60] for i in range(0, len(seq), 60))
    p = write(tmp_path, "".join(f">s{i}\n{lines}\n" for i in range(40)))
    recs = records(p)
    per = 1 + len(lines.split("\n"))
    assert [r.line for r in recs] == [1 + i * per for i in range(40)]
    assert all(r.sequence == seq for r in recs)


def test_header_is_parsed(tmp_path: Path) -> None:
    title = ">sp|P69905|HBA_HUMAN Hemoglobin subunit alpha OS=Homo sapiens OX=9606"
    p = write(tmp_path, title + "\nM\n")
    h = records(p)[0].header
    assert (h.accession, h.entry_name, h.taxid) == ("P69905", "HBA_HUMAN", 9606)


# ------------------------------------------------------------------------------ bad records
BAD_RECORDS = [
    # (file text, kind, line of the problem, words the reason must contain)
    (">ok\nMKV\n>bad\nMK1V\n", "digit in sequence", 4, ["digit '1'", "column 3"]),
    (">ok\nMKV\n>bad\nMKV\nMK V\n", "whitespace in sequence", 5, ["space", "column 3"]),
    (">ok\nMKV\n>bad\nMKJV\n", "unknown letter", 4, ["'J'"]),
    (">ok\nMKV\n>bad\nMK*V\n", "'*' inside sequence", 4, ["'*'"]),
    (">ok\nMKV\n>bad\n>next\nMKV\n", "empty record", 3, ["empty"]),
    (">ok\nMKV\n>bad\n*\n", "empty record", 3, ["stop"]),
    (">ok\nMKV\n>\nMKV\n", "missing id", 3, ["no id"]),
    (">ok\nMKV\n>bad\nMK\u00e9V\n", "invalid character", 4, ["'é'"]),
    (">ok\nMKV\n>bad\nMK\u0131V\n", "invalid character", 4, ["'ı'"]),  # upper() is 'I'
]


@pytest.mark.parametrize(("text", "kind", "line", "words"), BAD_RECORDS)
def test_bad_record_error_names_file_line_record(
    tmp_path: Path, text: str, kind: str, line: int, words: list[str]
) -> None:
    p = write(tmp_path, text)
    err = error(p)
    assert (err.kind, err.line, err.record_number) == (kind, line, 2)
    msg = str(err)
    assert msg.startswith(f"{p}:{line}: record #2 ")
    assert "--on-invalid skip" in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize(("text", "kind", "line", "words"), BAD_RECORDS)
def test_bad_record_skipped_and_counted(
    tmp_path: Path, text: str, kind: str, line: int, words: list[str]
) -> None:
    p = write(tmp_path, text)
    report = InvalidReport()
    recs = records(p, on_invalid="skip", report=report)
    assert recs[0].id == "ok"
    assert all(r.id != "bad" for r in recs)
    assert report.skipped == 1 and report.by_reason == {kind: 1}
    assert report.examples[0].startswith(f"{p}:{line}: record #2")
    assert kind in report.summary()


def test_duplicate_ids_within_and_across_files(tmp_path: Path) -> None:
    a = write(tmp_path, ">x\nMKV\n>y\nMKV\n>x\nWW\n", "a.fa")
    err = error(a)
    assert (err.kind, err.line, err.record_number, err.record_id) == ("duplicate id", 5, 3, "x")
    assert "record #1 has the same id" in str(err)
    b = write(tmp_path, ">z\nMKV\n>y\nMKV\n", "b.fa")
    report = InvalidReport()
    got = list(read_fasta([a, b], on_invalid="skip", report=report))
    assert [r.id for r in got] == ["x", "y", "z"]
    assert report.by_reason == {"duplicate id": 2}
    assert f"record #2 of {a}" in report.examples[1]
    assert len(records(a, check_duplicates=False)) == 3


def test_duplicate_far_apart_and_order_of_errors(tmp_path: Path) -> None:
    body = "".join(f">r{i}\nMKV\n" for i in range(5000))
    p = write(tmp_path, body + ">r17\nMKV\n")
    err = error(p)
    assert (err.record_number, err.line) == (5001, 10001)
    assert "record #18 has the same id" in str(err)
    # An earlier bad letter is reported before a later duplicate, even inside one batch.
    p2 = write(tmp_path, ">a\nMKV\n>b\nMJV\n>a\nMKV\n", "order.fa")
    assert error(p2).kind == "unknown letter"


def test_skip_mode_keeps_good_records_in_order(tmp_path: Path) -> None:
    text = ">a\nMKV\n>b\nMK1\n>c\nmkv*\n>d\n>e\nMK V\n>f\nQQ\n"
    report = InvalidReport()
    recs = records(write(tmp_path, text), on_invalid="skip", report=report)
    assert [(r.id, r.sequence, r.number) for r in recs] == [
        ("a", "MKV", 1),
        ("c", "MKV", 3),
        ("f", "QQ", 6),
    ]
    assert report.skipped == 3
    assert sum(report.by_reason.values()) == 3


# ------------------------------------------------------------------------------ file-level
def test_text_before_first_header(tmp_path: Path) -> None:
    p = write(tmp_path, "\nsome notes\n>a\nMKV\n")
    err = error(p)
    assert (err.kind, err.line, err.record_number) == ("text before first header", 2, None)
    assert str(err).startswith(f"{p}:2: text before the first header")
    report = InvalidReport()
    recs = records(p, on_invalid="skip", report=report)
    assert [(r.id, r.line) for r in recs] == [("a", 3)]
    assert report.by_reason == {"text before first header": 1}


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        (b"", "empty file"),
        (b"\n\n  \n", "no records"),
        (b"just some text\nno header\n", "text before first header"),
    ],
)
def test_empty_or_no_records(tmp_path: Path, content: bytes, kind: str) -> None:
    p = write(tmp_path, content)
    err = error(p)
    assert err.kind == kind
    assert str(p) in str(err)
    if kind != "text before first header":
        assert err.file_level
        with pytest.raises(FastaFormatError):
            records(p, on_invalid="skip")  # file-level: skip cannot help
    else:
        with pytest.raises(FastaFormatError) as info:
            records(p, on_invalid="skip")
        assert info.value.kind == "no records"


@pytest.mark.parametrize("garbage", [b"\x00\x01\x02", b"\xff\xfe\x80"])
def test_binary_garbage_always_raises(tmp_path: Path, garbage: bytes) -> None:
    p = write(tmp_path, b">a\nMKV\n>b\nMK" + garbage + b"V\n>c\nMKV\n")
    for mode in ("error", "skip"):
        err = error(p, on_invalid=mode)
        assert (err.kind, err.line, err.file_level) == ("binary data", 4, True)
        assert "cannot skip" in str(err)


def test_truncated_gzip_reports_records_and_line(tmp_path: Path) -> None:
    text = "".join(f">r{i}\n{'ACDEFGHIKLMNPQRSTVWY' * 40}\n" for i in range(20000))
    full = gzip.compress(text.encode())
    p = write(tmp_path, full[: len(full) // 2], "cut.fa.gz")
    got: list = []
    with pytest.raises(FastaFormatError) as info:
        for rec in read_fasta(p, on_invalid="skip"):
            got.append(rec)
    err = info.value
    assert err.kind == "truncated gzip" and err.file_level
    n = len(got)
    assert 0 < n < 20000
    assert got[-1].id == f"r{n - 1}"  # every complete record before the break came out
    assert f"{n} complete record(s)" in str(err)
    assert f"inside record #{n + 1} 'r{n}'" in str(err)
    assert err.line is not None and err.line >= 2 * n + 1


def test_corrupt_gzip_stream(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(b">a\nMKV\n" * 1000))
    data[20:40] = b"\x00" * 20
    err = error(write(tmp_path, bytes(data), "bad.gz"))
    assert err.kind in ("truncated gzip", "binary data")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        records(tmp_path / "nope.fasta")
    with pytest.raises(UserError, match="directory"):
        records(tmp_path)
    with pytest.raises(ValueError):
        read_fasta(tmp_path / "x", on_invalid="ignore")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ id checker
def test_duplicate_id_checker_batches() -> None:
    chk = DuplicateIdChecker()
    rng = np.random.default_rng(0)
    seen: dict[str, int] = {}
    tag = 0
    for _ in range(40):
        ids = [f"id{int(x)}" for x in rng.integers(0, 20000, size=500)]
        out = chk.check(ids, np.arange(tag, tag + len(ids)))
        for i, ident in enumerate(ids):
            assert out[i] == seen.get(ident, -1)
            seen.setdefault(ident, tag + i)
        tag += len(ids)
    assert len(chk) == len(seen)
    assert len(chk._runs) < 12  # LSM merging keeps few runs
    long_ids = ["x" * 300 + str(i) for i in range(3)]
    assert chk.check(long_ids + long_ids[:1], [10**6, 10**6 + 1, 10**6 + 2, 7]).tolist() == [
        -1,
        -1,
        -1,
        10**6,
    ]


# ------------------------------------------------------------------------------ real data
REAL = [
    ("sequences/uniprot_mmseqs_train.fasta", 17801),
    ("sequences/swissprot_opal_train.fasta", 9434),
    ("sequences/long_proteins.fasta", 24),
    ("demo/some_proteins.fasta", 15),
    ("demo/few_proteins.fasta", 3),
]


@pytest.mark.parametrize(("rel", "n"), REAL)
def test_shared_files_parse(rel: str, n: int) -> None:
    path = SHARED / rel
    if not path.exists():
        pytest.skip(f"{path} not present (../shared is only on developer machines)")
    recs = list(read_fasta(path))
    assert len(recs) == n == count_lines_and_records(path)[1]
    assert all(r.sequence and r.sequence.isupper() for r in recs)
    if rel.startswith("demo/"):
        assert recs[0].header.db == "uniref"


# ------------------------------------------------------------------------------ block sizes
# The reader checks a block's letters in one pass and looks at a record on its own only when that
# check fails (a block with a problem). Records, errors and report must be the same wherever the
# block boundaries fall: with tiny blocks most records are checked alone in a clean block, with
# one large block every record shares a block with the problems.
def _outcome(path: Path, monkeypatch: pytest.MonkeyPatch, *, block: int, **kw):
    import protein_performer.data.fasta as fasta

    monkeypatch.setattr(fasta, "_BLOCK", block)
    report = InvalidReport(max_examples=100)
    got: list = []
    err = None
    try:
        for r in read_fasta(path, report=report, **kw):
            got.append((r.id, r.description, r.sequence, r.number, r.line, r.path))
    except FastaFormatError as exc:
        err = (str(exc), exc.kind, exc.line, exc.record_number, exc.record_id)
    return got, err, report.skipped, dict(report.by_reason), report.examples


MIXED = (
    ">a one\nMKVLA\nGGW\n"
    ">b\tx  y\nmkv\nlla*\n\n"  # lowercase, a stop, a blank line
    ">c\nMKV\nMK1V\n"  # a digit
    ">sp|P1|X_Y desc>with gt OS=Homo sapiens\nACDE\nFGHI\n"
    ">d  \nMKV  \nW\n"  # trailing blanks after the header and a sequence line
    ">e\n>f\nQQ\n"  # an empty record
    ">g\nMK V\n"  # a space
    ">a\nWW\n"  # a duplicate
    ">\nMKV\n"  # no id
    ">h\n*\n"  # only a stop
    ">i\nMJV\n"  # unknown letter
    ">j\nMK*V\n"  # '*' inside
    ">k\u00e9 caf\u00e9\nMKV\n"  # non-ASCII header (a block of its own text)
    ">l\nACDEFGHIKLMNPQRSTVWY\nXBUZO.-\n"
    ">m\x01n second title\nMKV\n"  # a SOH in the header, as in NCBI nr
    ">o\nLL"  # no final newline
)


@pytest.mark.parametrize("block", [1 << 20, 7, 16, 23, 64])
@pytest.mark.parametrize("on_invalid", ["skip", "error"])
def test_block_sizes_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int, on_invalid: str
) -> None:
    p = write(tmp_path, MIXED)
    exact = _outcome(p, monkeypatch, block=1 << 20, on_invalid=on_invalid)
    fast = _outcome(p, monkeypatch, block=block, on_invalid=on_invalid)
    assert fast == exact
    if on_invalid == "skip":
        got, err, skipped, _, _ = fast
        assert err is None and skipped == 8
        ids = ["a", "b", "sp|P1|X_Y", "d", "f", "k\u00e9", "l", "m\x01n", "o"]
        assert [g[0] for g in got] == ids
        assert got[1][2] == "MKVLLA" and got[3][2] == "MKVW"
    else:
        assert fast[1][1:] == ("digit in sequence", 10, 3, "c")


@pytest.mark.parametrize("block", [5, 40, 100, 1 << 20])
def test_errors_at_block_boundaries_are_located(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    # Many clean records, a bad one every so often: whatever block cuts where, clean blocks and
    # blocks with a problem agree to the line and column.
    recs = []
    for i in range(60):
        seq = "ACDEFGHIKL" * (i % 4 + 1)
        if i % 13 == 5:
            seq = seq[:7] + "J" + seq[8:]
        if i % 17 == 9:
            seq = seq[:3] + " " + seq[3:]
        lines = "\n".join(seq[j : j + 9] for j in range(0, len(seq), 9))
        recs.append(f">r{i} d{i}\n{lines}\n")
    p = write(tmp_path, "".join(recs) + ">r3\nMKV\n")
    for mode in ("error", "skip"):
        exact = _outcome(p, monkeypatch, block=1 << 20, on_invalid=mode)
        fast = _outcome(p, monkeypatch, block=block, on_invalid=mode)
        assert fast == exact
    got, _, skipped, by_reason, examples = fast  # the skip run
    assert len(got) + skipped == 61
    assert by_reason == {"unknown letter": 5, "whitespace in sequence": 3, "duplicate id": 1}
    assert examples[0].startswith(f"{p}:") and "column" in examples[0]


def test_block_pass_matches_record_check_on_real_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = SHARED / "sequences/swissprot_opal_train.fasta"
    if not path.exists():
        pytest.skip(f"{path} not present (../shared is only on developer machines)")
    fast = _outcome(path, monkeypatch, block=1 << 16)
    exact = _outcome(path, monkeypatch, block=1 << 20)
    assert fast == exact and fast[1] is None
    # Lower-case sequence lines fail the block pass, so every record is checked on its own.
    lines = path.read_text().split("\n")
    lower = write(tmp_path, "\n".join(ln if ln[:1] == ">" else ln.lower() for ln in lines))
    each = _outcome(lower, monkeypatch, block=1 << 16)
    assert [g[:5] for g in each[0]] == [g[:5] for g in fast[0]] and each[1:] == fast[1:]


def test_duplicate_checker_hash_depends_on_the_id_alone() -> None:
    # Ids of very different lengths in separate calls (and ids longer than the vectorised
    # limit): a repeat must be found whatever else was in the batch.
    chk = DuplicateIdChecker()
    first = ["a1", "b" * 30, "c" * 200, "d\u00e9"]
    assert chk.check(first, [0, 1, 2, 3]).tolist() == [-1, -1, -1, -1]
    assert chk.check(["c" * 200], [4]).tolist() == [2]
    assert chk.check(["zz", "a1"], [5, 6]).tolist() == [-1, 0]
    assert chk.check(["b" * 30, "x" * 90, "d\u00e9"], [7, 8, 9]).tolist() == [1, -1, 3]
    h1 = DuplicateIdChecker.hash_ids(["a1"])
    h2 = DuplicateIdChecker.hash_ids(["a1", "q" * 40, "r" * 100])[:1]
    assert h1.tolist() == h2.tolist()
