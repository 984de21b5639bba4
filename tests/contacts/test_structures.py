"""inference.structures: parsing, chains, Cβ contacts, alignment to a sequence, errors.

The fixture ``tests/fixtures/tiny_blank_chain.pdb`` is hand-made so every number is known: two
antiparallel strands (residues 1-6 at y = 0, residues 10-15 at y = 5 A, 3.8 A apart along x),
residues 7-9 unobserved (a numbering gap and a chain break), a blank chain id, a glycine (Cα
only), a lysine without Cβ, a second chain B and a water. Cross-strand pairs at the same x
(5 A) or one step apart (6.3 A) are contacts, two steps apart (9.1 A) are not; within a strand
only neighbours up to 7.6 A are. Counting |i - j| >= 6 in observed-residue indices gives 9
contacts; in the 15-residue sequence (gap restored) 13.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest

from protein_performer.contacts.structures import (
    align_to_sequence,
    contact_target,
    read_chain,
    structure_format,
)
from protein_performer.errors import UserError
from tests.paths import FIXTURES
from tests.paths import SHARED as SHARED_DIR

TINY = FIXTURES / "tiny_blank_chain.pdb"
TINY_OBSERVED = "MKGAYLVKTWER"
TINY_FULL = "MKGAYLPDEVKTWER"  # residues 7-9 (PDE) are not in the structure
SHARED = SHARED_DIR / "data" / "structures"


def n_contacts(target, min_sep: int = 6) -> int:
    i, j = np.triu_indices(target.length, min_sep)
    return int((target.contacts() & target.valid())[i, j].sum())


def test_tiny_fixture_blank_chain_gly_break() -> None:
    chain = read_chain(TINY)  # first protein chain: the blank one
    assert chain.chain_id == " "
    assert chain.sequence == TINY_OBSERVED
    assert chain.residue_ids == ["1", "2", "3", "4", "5", "6", "10", "11", "12", "13", "14", "15"]
    assert chain.n_cb_from_ca == 1  # the lysine without CB
    assert chain.chain_breaks == 1
    assert chain.seqres is None
    # glycine (index 2) uses its CA; others their CB (z = 0 by construction)
    assert np.allclose(chain.cb[:, 2], 0.0)
    for blank in ("", " ", "_"):
        assert read_chain(TINY, blank).sequence == TINY_OBSERVED
    assert read_chain(TINY, "B").sequence == "GSA"


def test_tiny_contacts_observed_and_aligned() -> None:
    observed = contact_target(TINY)
    assert observed.sequence_source == "observed"
    assert n_contacts(observed) == 9
    assert observed.observed.all()
    full = contact_target(TINY, chain="_", sequence=TINY_FULL)
    assert full.sequence_source == "given" and full.identity == 1.0
    assert full.observed.tolist() == [True] * 6 + [False] * 3 + [True] * 6
    assert np.isnan(full.cb[6:9]).all()
    assert n_contacts(full) == 13
    # unobserved residues are neither contacts nor scoreable
    assert not full.valid()[7].any() and not full.contacts()[7].any()


def test_seqres_is_used_when_present(tmp_path: Path) -> None:
    names = [
        "MET", "LYS", "GLY", "ALA", "TYR", "LEU", "PRO", "ASP",
        "GLU", "VAL", "LYS", "THR", "TRP", "GLU", "ARG",
    ]  # fmt: skip
    seqres = [
        f"SEQRES{n + 1:4d}  {len(names):5d}  " + " ".join(names[13 * n : 13 * n + 13])
        for n in range(2)
    ]
    path = tmp_path / "with_seqres.pdb"
    path.write_text("\n".join(seqres) + "\n" + TINY.read_text())
    target = contact_target(path)
    assert target.sequence_source == "seqres" and target.sequence == TINY_FULL
    assert n_contacts(target) == 13
    assert contact_target(path, sequence_source="observed").sequence == TINY_OBSERVED


def test_alignment_handles_gap_and_mismatch() -> None:
    positions, identity, coverage = align_to_sequence("MKGAYLVKTWER", "SSMKGAYLPDEVKTWQRGG")
    assert positions.tolist() == [2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16]
    assert identity == pytest.approx(11 / 12) and coverage == 1.0


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        read_chain(tmp_path / "missing.pdb")
    with pytest.raises(UserError, match="no chain 'Z'.*' ', 'B'"):
        read_chain(TINY, "Z")
    bad = tmp_path / "bad.cif"
    bad.write_text("data_x\nloop_\n_atom_site.id\n_atom_site.Cartn_x\n1\n")
    with pytest.raises(UserError, match="bad.cif"):
        read_chain(bad)
    junk = tmp_path / "junk.dat"
    junk.write_text("hello\nworld\n")
    with pytest.raises(UserError, match="neither PDB nor mmCIF"):
        read_chain(junk)
    with pytest.raises(UserError, match="do not match"):
        contact_target(TINY, sequence="WWWWWWWWWWWWWWWWWWWWWWWWW")


def test_format_by_content(tmp_path: Path) -> None:
    copy = tmp_path / "noext"
    shutil.copy(TINY, copy)
    assert structure_format(copy, copy.read_text()) == "pdb"
    assert read_chain(copy).sequence == TINY_OBSERVED


@pytest.fixture(scope="module")
def shared_rows() -> dict[str, dict[str, str]]:
    if not (SHARED / "chains.csv").is_file():
        pytest.skip("../shared/data/structures not available")
    with open(SHARED / "chains.csv", newline="") as fh:
        return {row["file"]: row for row in csv.DictReader(fh)}


@pytest.mark.parametrize("name", ["2N2U_A.pdb", "1A8O_A.pdb", "4UV3_A.pdb"])
def test_shared_structures_match_chains_csv(shared_rows, name: str) -> None:
    from Bio import SeqIO

    row = shared_rows[name]
    target = contact_target(SHARED / name, chain=row["chain"])
    assert target.length == int(row["n_res"])
    assert target.structure.chain_breaks == int(row["chain_breaks"])
    assert n_contacts(target) == int(row["n_contacts_cb8_sep6"])
    fasta = {r.id: str(r.seq) for r in SeqIO.parse(SHARED / "chains.fasta", "fasta")}
    assert target.sequence == fasta[Path(name).stem] == row["sequence"]


def test_mmcif_round_trip(shared_rows, tmp_path: Path) -> None:
    from Bio.PDB import MMCIFIO, PDBParser

    name = "1A8O_A.pdb"
    structure = PDBParser(QUIET=True).get_structure("x", SHARED / name)
    io = MMCIFIO()
    io.set_structure(structure)
    cif = tmp_path / "1A8O_A.cif"
    io.save(str(cif))
    target = contact_target(cif, chain="A")
    assert target.structure.path == cif
    assert target.sequence == shared_rows[name]["sequence"]
    assert n_contacts(target) == int(shared_rows[name]["n_contacts_cb8_sep6"])
    sniffed = tmp_path / "1A8O_A_noext"
    shutil.copy(cif, sniffed)
    assert contact_target(sniffed).sequence == target.sequence
