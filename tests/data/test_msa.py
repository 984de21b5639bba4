"""MSAs as family context (data/msa.py through data/inputs.read_homologs): A2M/A3M/Stockholm
rows -> homologs without gaps whose residues carry reference coordinates; bad MSAs are one
located error; the FASTA of `homologs` carries its aligned ranges back as coordinates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protein_performer.data.hits import Homolog, hit_coordinates
from protein_performer.data.homology import write_homologs
from protein_performer.data.inputs import read_homologs
from protein_performer.data.msa import UNPLACED, place
from protein_performer.errors import UserError

#: The reference (first row) is residues 1..10 of its protein; h1 a fragment of its second
#: half, h2 two inserted residues after T3 and a gap at the end, h3 terminal insertions.
A2M = """>ref/1-10
MKTAYIAKQR
>h1 fragment
-----IAKQR
>h2 insertion
MKTaaAYIAKQ-
>h3 terminal
mmMKTAY...IAKQRkk
"""
WANT = {
    "h1": ("IAKQR", [6, 7, 8, 9, 10]),
    "h2": ("MKTAAAYIAKQ", [1, 2, 3, -1, -1, 4, 5, 6, 7, 8, 9]),  # one residue per column
    "h3": ("MMMKTAYIAKQRKK", [-1, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, -1, -1]),
}


def _check(found) -> None:
    reference, members = found
    assert reference.id == "ref/1-10" and reference.coordinates.tolist() == list(range(1, 11))
    assert [m.id for m in members] == list(WANT)  # the reference is not a homolog
    for m in members:
        seq, coords = WANT[m.id]
        assert m.sequence == seq
        assert m.coordinates.tolist() == coords


def test_a2m_rows_lose_their_gaps_and_carry_reference_coordinates(tmp_path: Path) -> None:
    path = tmp_path / "family.a2m"
    path.write_text(A2M)
    _check(read_homologs(path))


def test_an_a3m_and_a_gapped_fasta_read_as_the_a2m(tmp_path: Path) -> None:
    """A3M leaves out the '.' pads and may start with '#' lines; a FASTA with gaps is an MSA
    by its content, whatever its name."""
    a3m = tmp_path / "family.a3m"
    a3m.write_text("#10\t1\n" + A2M.replace(".", ""))
    _check(read_homologs(a3m))
    fasta = tmp_path / "family.fasta"
    fasta.write_text(A2M)
    _check(read_homologs(fasta))


def test_a_region_id_shifts_the_coordinates_to_the_full_protein(tmp_path: Path) -> None:
    path = tmp_path / "family.a2m"
    path.write_text(A2M.replace(">ref/1-10", ">ref/21-30"))
    reference, got = read_homologs(path)
    assert reference.coordinates.tolist() == list(range(21, 31))
    assert got[0].coordinates.tolist() == [26, 27, 28, 29, 30]
    assert got[2].coordinates[:3].tolist() == [-1, -1, 21]


def test_stockholm_interleaved_blocks_are_placed_column_for_column(tmp_path: Path) -> None:
    path = tmp_path / "family.sto"
    path.write_text(
        "# STOCKHOLM 1.0\n#=GF ID test\n\n"
        "ref   MKTAY..\nh1    --TAYaa\n\n"
        "ref   IAKQR\nh1    IAK--\n#=GC RF xxxxx..xxxxx\n//\n"
    )
    _, (h1,) = read_homologs(path)
    assert h1.sequence == "TAYAAIAK"
    # T A Y at their columns; the two insertions nearer Y (left) and I (right), whose columns
    # Y and I hold: unplaced; I A K
    assert h1.coordinates.tolist() == [3, 4, 5, -1, -1, 6, 7, 8]
    sniffed = tmp_path / "family.txt"
    sniffed.write_text(path.read_text())
    assert read_homologs(sniffed)[1][0].coordinates.tolist() == h1.coordinates.tolist()


def test_a_plain_fasta_has_no_coordinates(tmp_path: Path) -> None:
    path = tmp_path / "h.fasta"
    path.write_text(">a\nmktayiak\n>b\nMKTAY\n")  # lower case alone is not an alignment
    reference, got = read_homologs(path)
    assert reference is None
    assert [(m.sequence, m.coordinates) for m in got] == [("MKTAYIAK", None), ("MKTAY", None)]


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.a2m", ">ref\nMKTAY\n>h1\nMKT-\n", ":3: record #2 'h1': 4 match columns"),
        ("bad.a2m", ">ref\n--.---\n>h1\nMKTAY\n", ":1: record #1 'ref': the reference (the"),
        ("bad.a2m", ">ref\nMKTAY\n>h1\nMKJAY\n", ":4: record #2 'h1': unknown letter 'J'"),
        ("one.a2m", ">ref\nMKTAY\n", "only the reference"),
        ("bad.sto", "# STOCKHOLM 1.0\nref MKTAY\nh1 MKT\n//\n", ":3: record #2 'h1': 3 columns"),
        ("bad.sto", "# STOCKHOLM 1.0\nref MKTAY\nh1 MK?AY\n//\n", ":3: invalid character '?'"),
        ("bad.sto", ">ref\nMKTAY\n", ":1: not Stockholm"),
    ],
)
def test_a_bad_msa_is_one_located_error(tmp_path: Path, name: str, text: str, where: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        read_homologs(path)
    message = str(exc.value)
    assert "\n" not in message and str(path) in message and where in message


def test_a_homolog_row_of_gaps_only_is_left_out_with_a_warning(tmp_path, caplog) -> None:
    a2m, sto = tmp_path / "f.a2m", tmp_path / "f.sto"
    a2m.write_text(">ref\nMKTAY\n>e1\n--..---\n>h1\nMKTAY\n>e2\n-----\n")
    sto.write_text("# STOCKHOLM 1.0\nref MKTAY\ne1 -..--\nh1 MKTAY\n//\n")
    assert [m.id for m in read_homologs(a2m)[1]] == ["h1"]
    assert "left out 2 homolog row(s) with gaps only (the first: " in caplog.text
    assert f"{a2m}:3: record #2 'e1'" in caplog.text
    assert [m.id for m in read_homologs(sto)[1]] == ["h1"]
    assert f"{sto}:3: record #2 'e1'" in caplog.text


def test_place_ties_go_left_and_terminals_are_unplaced() -> None:
    ref = np.array([0.0, 1.0, 2.0])
    got = place(ref, np.array([-0.5, 0.5, 1.6, 2.0, 3.0]), np.array([0, 0, 1, 1, 0], bool))
    assert got.tolist() == [UNPLACED, UNPLACED, UNPLACED, 2, UNPLACED]  # 2.0 is exactly at 2


def _hit(header: str, seq: str, query: str, qs: int, qe: int, ts: int, te: int) -> Homolog:
    return Homolog(header, seq, query, 0.9, 1e-20, 80.0, 0.5, 0.9, qs, qe, ts, te, 40, len(seq))


def test_homologs_fasta_carries_its_ranges_back_as_coordinates(tmp_path: Path) -> None:
    """`homologs` writes the record's own header, the query and the alignment; read back as
    context, a hit is placed on its query's residues by its aligned ranges."""
    hits = [
        _hit("sp|P1|A_HUMAN Protein A OS=Homo sapiens", "MKTAYIAKQR", "q1", 11, 18, 2, 9),
        _hit("sp|P2|B_HUMAN Protein B", "AYIAK", "q1", 4, 8, 1, 5),
    ]
    fasta, tsv = tmp_path / "hits.fasta", tmp_path / "hits.tsv"
    write_homologs(hits, fasta, tsv)
    text = fasta.read_text().splitlines()
    assert text[0].startswith(">sp|P1|A_HUMAN Protein A OS=Homo sapiens query=q1 fident=0.900 ")
    assert "qstart=11 qend=18 tstart=2 tend=9 qlen=40 tlen=10" in text[0]
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    assert rows[0][:4] == ["query", "target", "fident", "evalue"]
    assert rows[1][:2] == ["q1", "sp|P1|A_HUMAN"]
    assert rows[2][-7:] == ["4", "8", "1", "5", "40", "5", ""]
    _, got = read_homologs(fasta)
    assert got[0].coordinates.tolist() == [-1, 11, 12, 13, 14, 15, 16, 17, 18, -1]
    assert got[1].coordinates.tolist() == [4, 5, 6, 7, 8]
    assert hit_coordinates("no fields here", 5) is None


def test_a_hits_cigar_places_its_residues_exactly() -> None:
    """MMseqs2's CIGAR (M both, I a query residue facing a gap, D a target residue facing one):
    matched residues at their query residue, insertions at the nearer one around them; the
    ranges alone would stretch the target's 9 aligned residues over the query's 8."""
    header = "query=q qstart=3 qend=10 tstart=2 tend=10 cigar=2M3D2M2I2M"
    # target 2..10: M M (q3 q4), D D D (between q4 and q5: q4, q4|q5 tie -> q4, q5, which
    # the M residues hold: unplaced), M M (q5 q6), I I (q7 q8 skipped), M M (q9 q10)
    _, got = hit_coordinates(header, 11)
    assert got.tolist() == [-1, 3, 4, -1, -1, -1, 5, 6, 9, 10, -1]
    _, stretched = hit_coordinates(header.rsplit(" ", 1)[0], 11)
    assert stretched.tolist()[1:10] == [3, 4, 5, 6, -1, 7, 8, 9, 10]  # 6 twice: the first
    # a CIGAR that does not span the ranges is not trusted: the ranges are stretched
    assert hit_coordinates(header.replace("2M2I2M", "2M"), 11)[1].tolist() == stretched.tolist()


def test_hits_of_several_queries_are_read_without_coordinates(tmp_path, caplog) -> None:
    fasta = tmp_path / "hits.fasta"
    write_homologs([_hit("a", "MKTAY", "q1", 1, 5, 1, 5), _hit("b", "MKTAY", "q2", 1, 5, 1, 5)],
                   fasta)  # fmt: skip
    _, got = read_homologs(fasta)
    assert all(m.coordinates is None for m in got)
    assert "hits of 2 queries" in caplog.text
