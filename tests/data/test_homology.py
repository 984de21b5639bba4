"""Homology-aware splits: ``preprocess --cluster-split`` (real MMseqs2) and the OOD split."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from protein_performer.cli.main import main
from protein_performer.data.preprocess import preprocess
from protein_performer.data.split import OOD, SPLIT_CODES, Groups, Splitter, taxid_of
from protein_performer.data.store import TokenStore

needs_mmseqs = pytest.mark.skipif(
    shutil.which("mmseqs") is None,
    reason="MMseqs2 (`mmseqs`) is not on PATH: apt-get install mmseqs2 to run these tests",
)
AMINO = "ACDEFGHIKLMNPQRSTVWY"
FAMILIES, MEMBERS = 40, 3


def _family_fasta(path: Path, seed: int = 0) -> dict[str, int]:
    """Random unrelated families of ``MEMBERS`` near-duplicates (~5% substitutions each).

    Unrelated random sequences share ~5% identity, family members ~90%, so MMseqs2 at 50%
    identity must put each family (and nothing else) in one cluster. Returns id -> family.
    Family f's members carry ``OX=1000+f`` so taxa can be held out too. The ids are
    UniProt-style, which MMseqs2 would shorten if it were given them.
    """
    rng = np.random.default_rng(seed)
    family: dict[str, int] = {}
    lines = []
    for f in range(FAMILIES):
        base = rng.choice(list(AMINO), size=int(rng.integers(90, 160)))
        for k in range(MEMBERS):
            seq = base.copy()
            hit = rng.random(len(seq)) < 0.05
            seq[hit] = rng.choice(list(AMINO), size=int(hit.sum()))
            rid = f"tr|F{f:02d}M{k}|F{f:02d}M{k}_TEST"  # MMseqs2 would shorten such ids
            family[rid] = f
            lines += [f">{rid} planted near-duplicate OS=Testus {f} OX={1000 + f}", "".join(seq)]
    path.write_text("\n".join(lines) + "\n")
    return family


def _splits_by_family(store: TokenStore, family: dict[str, int]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for i in range(len(store)):
        out.setdefault(family[store.id(i)], set()).add(int(store.split[i]))
    return out


@pytest.fixture(scope="module")
def clustered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, int]]:
    """The planted families preprocessed through the CLI with --cluster-split (one MMseqs2 run,
    ~12 s of fixed k-mer-table cost, shared by the tests below)."""
    if shutil.which("mmseqs") is None:
        pytest.skip("MMseqs2 (`mmseqs`) is not on PATH: apt-get install mmseqs2")
    tmp = tmp_path_factory.mktemp("clustered")
    fasta = tmp / "families.fasta"
    family = _family_fasta(fasta)
    out = tmp / "store"
    args = ["preprocess", str(fasta), "--out", str(out), "--cluster-split", "0.5"]
    fracs = ["--valid-frac", "0.2", "--test-frac", "0.2", "--ood-frac", "0.15"]
    assert main([*args, *fracs, "--workers", "1", "--no-progress"]) == 0
    return fasta, out, family


@pytest.mark.slow  # MMseqs2 (~12 s fixed cost); the error paths below are the fast checks
def test_cluster_split_keeps_near_duplicates_together(
    clustered: tuple[Path, Path, dict[str, int]], tmp_path: Path
) -> None:
    fasta, store_dir, family = clustered
    store = TokenStore(store_dir)
    by_family = _splits_by_family(store, family)
    assert all(len(codes) == 1 for codes in by_family.values()), by_family
    used = {next(iter(c)) for c in by_family.values()}
    assert used == {0, 1, 2, OOD}, used  # 40 families: every split gets some
    meta = store.meta["split"]
    assert meta["clusters"]["clusters"] == FAMILIES
    assert meta["clusters"]["min_seq_id"] == 0.5 and meta["clusters"]["tool"].startswith("mmseqs")
    assert meta["ood"]["frac"] == 0.15 and "mmseqs:" in meta["hash"]
    assert store.meta["splits"]["ood"]["records"] == len(store.indices("ood")) > 0

    # Hashing ids instead scatters the planted families (what --cluster-split exists to stop).
    plain = tmp_path / "plain"
    preprocess([fasta], plain, valid_frac=0.2, test_frac=0.2, progress=False)
    assert any(len(c) > 1 for c in _splits_by_family(TokenStore(plain), family).values())


@pytest.mark.slow  # a second MMseqs2 run (~12 s)
def test_cluster_split_is_deterministic(
    clustered: tuple[Path, Path, dict[str, int]], tmp_path: Path
) -> None:
    """A re-run (through the API this time) writes the very same store."""
    fasta, store_dir, _ = clustered
    again = tmp_path / "again"
    preprocess(
        [fasta],
        again,
        valid_frac=0.2,
        test_frac=0.2,
        cluster_identity=0.5,
        ood_frac=0.15,
        progress=False,
    )
    for name in ("split.bin", "meta.json", "tokens.bin", "ids.bin"):
        assert (again / name).read_bytes() == (store_dir / name).read_bytes(), name


@pytest.mark.slow  # the MMseqs2-clustered store
def test_stats_shows_the_ood_split(
    clustered: tuple[Path, Path, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, store_dir, _ = clustered
    assert main(["stats", str(store_dir)]) == 0
    assert "ood" in capsys.readouterr().out


@pytest.mark.slow
@needs_mmseqs
def test_split_by_id_uses_clusters_only_for_ood(tmp_path: Path) -> None:
    """The paper's layout: test is a random sample (relatives in train), ood whole clusters."""
    fasta = tmp_path / "families.fasta"
    family = _family_fasta(fasta, seed=1)
    preprocess(
        [fasta],
        tmp_path / "s",
        valid_frac=0.2,
        test_frac=0.3,
        split_mode="id",
        cluster_identity=0.5,
        ood_frac=0.2,
        progress=False,
    )
    by_family = _splits_by_family(TokenStore(tmp_path / "s"), family)
    held = [c for c in by_family.values() if OOD in c]
    assert held and all(c == {OOD} for c in held)  # a held-out family is held out whole
    assert any(len(c) > 1 for c in by_family.values())  # the rest is split record by record


def test_ood_taxa_without_clustering(tmp_path: Path) -> None:
    fasta = tmp_path / "families.fasta"
    family = _family_fasta(fasta, seed=2)
    store_dir = tmp_path / "s"
    preprocess([fasta], store_dir, ood_taxa=[1003, 1007], progress=False)
    store = TokenStore(store_dir)
    ood = {store.id(int(i)) for i in store.indices("ood")}
    assert ood == {rid for rid, f in family.items() if f in (3, 7)}
    assert store.meta["split"]["ood"]["taxa"] == [1003, 1007]


@dataclass
class _Rec:
    id: str
    description: str


def test_taxid_and_ood_codes() -> None:
    assert taxid_of("Hemoglobin OS=Homo sapiens OX=9606 GN=HBA1") == 9606
    assert taxid_of("Titin n=12 Tax=Homo sapiens TaxID=9606 RepID=TITIN_HUMAN") == 9606
    assert taxid_of("no taxon here BOX=3") is None
    assert SPLIT_CODES["ood"] == OOD
    ids = [f"r{i}" for i in range(4000)]
    codes = Splitter(0.1, 0.1, "id", Groups(ood_frac=0.25)).codes(ids)
    assert 0.22 < float(np.mean(codes == OOD)) < 0.28
    one = Splitter(0.1, 0.1, "id", Groups(ood_frac=0.25, ood_taxa=frozenset({9606})))
    assert [one(_Rec(i, "")) for i in ids[:200]] == list(codes[:200])  # record = chunk answer
    assert one(_Rec("r0", "Hemoglobin OS=Homo sapiens OX=9606")) == OOD
    # OOD draws are independent of the valid/test bands: growing ood never moves a record
    # between train, valid and test.
    smaller = Splitter(0.1, 0.1, "id", Groups(ood_frac=0.1)).codes(ids)
    keep = codes != OOD
    assert np.array_equal(codes[keep], np.where(smaller == OOD, codes, smaller)[keep])


def test_cli_without_mmseqs_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fasta = tmp_path / "families.fasta"
    _family_fasta(fasta)
    monkeypatch.setenv("PATH", str(tmp_path))  # a real PATH without mmseqs on it
    rc = main(["preprocess", str(fasta), "--out", str(tmp_path / "s"), "--cluster-split", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: --cluster-split needs MMseqs2") and "apt-get" in err[0]
    assert not (tmp_path / "s").exists()


def test_cli_rejects_bad_fractions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fasta = tmp_path / "families.fasta"
    _family_fasta(fasta)
    rc = main(["preprocess", str(fasta), "--out", str(tmp_path / "s"), "--ood-frac", "0.97"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ood_frac + valid_frac + test_frac must be < 1")


# ---- protein-performer homologs ------------------------------------------------------------
def _records(path: Path) -> list[tuple[str, str]]:
    """(header line, sequence) pairs of a FASTA file, parsed by hand (one line per sequence)."""
    lines = path.read_text().splitlines()
    return [(lines[i][1:], lines[i + 1]) for i in range(0, len(lines), 2)]


def _query(tmp_path: Path, db: Path, rid: str) -> Path:
    query = tmp_path / "query.fasta"
    header, seq = next(r for r in _records(db) if r[0].split()[0] == rid)
    query.write_text(f">{header}\n{seq}\n")
    return query


@pytest.mark.slow
@needs_mmseqs
def test_homologs_command_retrieves_the_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real MMseqs2 on the planted families: family 5's query finds its two siblings (itself
    left out), from a FASTA database and from a store, in both OUT spellings."""
    db = tmp_path / "db.fasta"
    family = _family_fasta(db)
    query = _query(tmp_path, db, "tr|F05M0|F05M0_TEST")
    siblings = {r for r, f in family.items() if f == 5} - {"tr|F05M0|F05M0_TEST"}
    out = tmp_path / "hits.fasta"
    assert main(["homologs", str(query), str(db), str(out), "--threads", "1"]) == 0
    assert "wrote 2 homolog(s)" in capsys.readouterr().err
    hits = _records(out)
    by_id = {h.split()[0]: (h, s) for h, s in _records(db)}
    assert {h.split()[0] for h, _ in hits} == siblings
    for h, s in hits:  # the record's own header and sequence, then the query and alignment
        own, seq = by_id[h.split()[0]]
        assert s == seq and h.startswith(f"{own} query=tr|F05M0|F05M0_TEST fident=")
    # Given back as context, each hit is placed on the query by its aligned ranges.
    from protein_performer.data.inputs import read_homologs

    for m in read_homologs(out)[1]:
        placed = m.coordinates[m.coordinates >= 0]
        assert len(placed) > 0.8 * len(m.sequence) and np.all(np.diff(placed) >= 0)

    store = tmp_path / "store"
    preprocess([db], store, progress=False)
    out2 = tmp_path / "hits2.fasta"
    argv = ["homologs", str(query), str(store), "--out", str(out2), "--keep-identical"]
    assert main([*argv, "--max-seqs", "2", "--threads", "1"]) == 0
    hits2 = _records(out2)
    assert len(hits2) == 2 and hits2[0][0].split()[0] == "tr|F05M0|F05M0_TEST"  # best first
    assert hits2[1][0].split()[0] in siblings
    # Existing output: refused without --overwrite, before any search.
    assert main([*argv, "--threads", "1"]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.slow
@needs_mmseqs
def test_homologs_reads_its_query_from_standard_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44: the query is opened by ``open_input`` as every input is, so ``-`` reads
    standard input (before: refused as a missing file) and finds what the file finds."""
    import io
    import sys

    from protein_performer.data import stdin

    db = tmp_path / "db.fasta"
    _family_fasta(db)
    query = _query(tmp_path, db, "tr|F05M0|F05M0_TEST")
    from_file, from_stdin = tmp_path / "file.fasta", tmp_path / "stdin.fasta"
    assert main(["homologs", str(query), str(db), str(from_file), "--threads", "1"]) == 0
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(query.read_bytes())))
    monkeypatch.setattr(stdin, "_stdin_copies", [])
    assert main(["homologs", "-", str(db), str(from_stdin), "--threads", "1"]) == 0
    assert "wrote 2 homolog(s)" in capsys.readouterr().err
    assert from_stdin.read_bytes() == from_file.read_bytes()


@pytest.mark.slow
@needs_mmseqs
def test_homologs_groups_hits_by_query_with_their_alignments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 45 #12: several queries in one call, each one's hits under it (a record found by
    two queries is under both), identity, E-value, coverage and aligned ranges in each header
    and in --tsv, the same numbers."""
    import csv

    db = tmp_path / "db.fasta"
    family = _family_fasta(db)
    records = dict(_records(db))
    wanted = ["tr|F07M1|F07M1_TEST", "tr|F05M0|F05M0_TEST", "tr|F05M1|F05M1_TEST"]
    query = tmp_path / "queries.fasta"
    by_id = {h.split()[0]: (h, s) for h, s in records.items()}
    query.write_text("".join(f">{by_id[q][0]}\n{by_id[q][1]}\n" for q in wanted))
    out, tsv = tmp_path / "hits.fasta", tmp_path / "hits.tsv"
    argv = ["homologs", str(query), str(db), str(out), "--tsv", str(tsv), "--threads", "1"]
    assert main(argv) == 0
    assert "wrote 6 homolog(s) of 3 query(ies)" in capsys.readouterr().err
    hits = _records(out)
    fields = [dict(w.split("=", 1) for w in h.split() if "=" in w and w[0].islower())
              for h, _ in hits]  # fmt: skip
    assert [f["query"] for f in fields] == [q for q in wanted for _ in range(2)]  # query order
    for (h, _), f in zip(hits, fields, strict=True):
        assert family[h.split()[0]] == family[f["query"]] and h.split()[0] != f["query"]
        assert 0.8 <= float(f["fident"]) <= 1 and float(f["evalue"]) < 1e-10
        assert 1 <= int(f["qstart"]) <= int(f["qend"]) <= int(f["qlen"])
        assert 1 <= int(f["tstart"]) <= int(f["tend"]) <= int(f["tlen"])
    for k in range(0, len(fields), 2):  # best first within a query
        assert float(fields[k]["evalue"]) <= float(fields[k + 1]["evalue"])
    with open(tsv, newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    assert [r["target"] for r in rows] == [h.split()[0] for h, _ in hits]
    for r, f in zip(rows, fields, strict=True):
        assert all(r[k] == f[k] for k in ("query", "fident", "evalue", "qcov", "qstart", "tend"))
    found = [h.split()[0] for h, _ in hits]
    assert found.count("tr|F05M2|F05M2_TEST") == 2  # a hit of two queries is under both


def test_homologs_never_writes_over_an_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "db.fasta"
    _family_fasta(db)
    before = db.read_bytes()
    query = _query(tmp_path, db, "tr|F01M0|F01M0_TEST")
    assert main(["homologs", str(query), str(db), str(db), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "never replaces an input" in err[0]
    assert db.read_bytes() == before
    assert main(["homologs", str(query), str(db)]) == 2
    assert capsys.readouterr().err.startswith("error: no output given")


def test_homologs_tsv_is_a_file_of_its_own(tmp_path: Path, capsys) -> None:
    """--tsv names its own output: not the FASTA, not standard output, never an input; all
    refused before any search."""
    db = tmp_path / "db.fasta"
    _family_fasta(db)
    query = _query(tmp_path, db, "tr|F01M0|F01M0_TEST")
    out = tmp_path / "h.fasta"
    for tsv, said in ((out, "a file of its own"), ("-", "a file of its own"),
                      (db, "never replaces an input")):  # fmt: skip
        assert main(["homologs", str(query), str(db), str(out), "--tsv", str(tsv)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and said in err[0]
    assert not out.exists()


def test_homologs_without_mmseqs_is_one_error_line(tmp_path: Path) -> None:
    """The console script in a fresh process whose PATH has no mmseqs (nothing faked)."""
    import subprocess
    import sys

    db = tmp_path / "db.fasta"
    _family_fasta(db)
    query = _query(tmp_path, db, "tr|F01M0|F01M0_TEST")
    out = tmp_path / "hits.fasta"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "protein_performer.cli.main",
            "homologs",
            str(query),
            str(db),
            str(out),
        ],
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("error: homologs needs MMseqs2, but `mmseqs` is not on PATH")
    assert "apt-get install mmseqs2" in err[0] and not out.exists()


def test_a_hanging_mmseqs_says_so_and_stops_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    """A fake ``mmseqs`` that hangs (its child too): lines while it runs, one error line at
    --mmseqs-timeout, and no process left behind."""
    import logging
    import os
    import time

    db = tmp_path / "db.fasta"
    _family_fasta(db)
    query = _query(tmp_path, db, "tr|F01M0|F01M0_TEST")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "mmseqs"
    pidfile = tmp_path / "child.pid"
    log = "createdb q.fa tmp/query\nConverting sequences\nprefilter tmp/query tmp/target"
    fake.write_text(f"#!/bin/sh\necho '{log}'\nsleep 60 &\necho $! > {pidfile}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PROTEIN_PERFORMER_PROGRESS_INTERVAL", "0.2")
    argv = ["homologs", str(query), str(db), str(tmp_path / "h.fasta"), "--mmseqs-timeout", "1"]
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="protein_performer.io.processes"):
        assert main(argv) == 2
    assert time.monotonic() - start < 15
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not finish within --mmseqs-timeout 1 s" in err[0], err
    assert "(in its prefilter step)" in err[0]
    assert re.search(r"on \S+ against \S+: prefilter step, \d+ s so far", caplog.text)
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")
    time.sleep(0.2)
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] in "ZX"  # gone


def test_homologs_with_no_hit_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """An empty FASTA would only be refused later by --context: one line now instead."""
    from protein_performer.data import homology

    db = tmp_path / "db.fasta"
    _family_fasta(db)
    query = _query(tmp_path, db, "tr|F01M0|F01M0_TEST")
    monkeypatch.setattr(homology, "find_homologs", lambda *a, **k: [])
    out = tmp_path / "hits.fasta"
    assert main(["homologs", str(query), str(db), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no homolog of" in err[0] and "nothing written" in err[0]
    assert not out.exists()
