"""Header parsing: UniProt sp/tr, UniRef (full and bare), and odd headers never raise."""

from __future__ import annotations

import json

import pytest

from protein_performer.data.headers import HeaderInfo, parse_header


def test_uniprot_swissprot() -> None:
    h = parse_header(
        ">sp|P69905|HBA_HUMAN Hemoglobin subunit alpha OS=Homo sapiens OX=9606 GN=HBA1 PE=1 SV=2"
    )
    assert h == HeaderInfo(
        id="sp|P69905|HBA_HUMAN",
        description="Hemoglobin subunit alpha OS=Homo sapiens OX=9606 GN=HBA1 PE=1 SV=2",
        db="sp",
        accession="P69905",
        entry_name="HBA_HUMAN",
        protein_name="Hemoglobin subunit alpha",
        organism="Homo sapiens",
        taxid=9606,
        gene="HBA1",
        pe=1,
        sv=2,
    )


def test_trembl_with_unknown_key() -> None:
    h = parse_header(
        "tr|W0FSK4|W0FSK4_9FLAV Genome polyprotein (Fragment) OS=Dengue virus 3 PE=4 SV=1 Split=0"
    )
    assert (h.db, h.accession, h.entry_name) == ("tr", "W0FSK4", "W0FSK4_9FLAV")
    assert h.protein_name == "Genome polyprotein (Fragment)"
    assert (h.organism, h.taxid, h.gene, h.pe, h.sv) == ("Dengue virus 3", None, None, 4, 1)


def test_uniref_full() -> None:
    h = parse_header(
        "UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Acipenser ruthenus TaxID=7906 "
        "RepID=A0A5A9P0L4_ACIRU"
    )
    assert h.to_dict() == {
        "id": "UniRef50_A0A5A9P0L4",
        "description": "Peptidylprolyl isomerase n=1 Tax=Acipenser ruthenus TaxID=7906 "
        "RepID=A0A5A9P0L4_ACIRU",
        "db": "uniref",
        "accession": "A0A5A9P0L4",
        "protein_name": "Peptidylprolyl isomerase",
        "organism": "Acipenser ruthenus",
        "taxid": 7906,
        "cluster_id": "UniRef50_A0A5A9P0L4",
        "n_members": 1,
        "rep_id": "A0A5A9P0L4_ACIRU",
    }


def test_uniref_bare_and_uniparc() -> None:
    h = parse_header("UniRef50_A0A1E3NP16")
    assert (h.id, h.description, h.db, h.cluster_id, h.accession) == (
        "UniRef50_A0A1E3NP16",
        "",
        "uniref",
        "UniRef50_A0A1E3NP16",
        "A0A1E3NP16",
    )
    assert h.protein_name is None and h.organism is None
    assert parse_header("UniRef90_UPI000836A30F").accession == "UPI000836A30F"


@pytest.mark.parametrize(
    "title",
    [
        "",
        ">",
        "   ",
        "plain_id",
        "id\twith tab description",
        "sp|",
        "sp||",
        "gi|12345|ref|NP_000001.1| some protein",
        "tr|X|Y OX=notanumber PE= SV=2.5 OS=",
        "UniRefXX_foo n=abc",
        "id =weird = text KEY=",
        "x " + "OS=a " * 50,
        "id desc with ünïcödé OS=Bos taurus",
    ],
)
def test_odd_headers_never_raise(title: str) -> None:
    h = parse_header(title)
    json.dumps(h.to_dict())
    assert h.id == (title.lstrip(">").split() or [""])[0]


def test_odd_header_fields() -> None:
    h = parse_header("tr|X|Y OX=notanumber PE= SV=2.5 OS=")
    assert (h.db, h.accession, h.taxid, h.pe, h.sv) == ("tr", "X", None, None, None)
    assert h.organism is None
    g = parse_header("gi|12345|ref|NP_000001.1| some protein")
    assert (g.db, g.accession, g.protein_name) == (None, None, "some protein")
    t = parse_header("id\twith tab description")
    assert (t.id, t.description) == ("id", "with tab description")
