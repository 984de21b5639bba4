"""Homology-aware splits: ``preprocess --cluster-split`` (real MMseqs2) and the OOD split."""

from __future__ import annotations

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
