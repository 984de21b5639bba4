"""data.inputs: what the inference commands read, and the warning for DNA/RNA-looking input."""

from __future__ import annotations

import gzip
import io
import logging
import sys
from pathlib import Path

import pytest

from protein_performer.cli.stats import collect
from protein_performer.data.inputs import input_records, input_totals, open_input, read_records
from protein_performer.data.preprocess import preprocess
from protein_performer.errors import UserError


@pytest.mark.parametrize(
    ("text", "warned"),
    [
        (">a\nACGTACGTNN\n>b\nacguuagc\n", True),
        (">a\nACGTACGT\n>b\nMKTAYIAK\n", False),  # one protein: not every record is DNA
    ],
    ids=["dna-rna", "mixed"],
)
def test_nucleotide_input_gets_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, warned: bool
) -> None:
    fasta = tmp_path / "in.fasta"
    fasta.write_text(text)
    with caplog.at_level(logging.WARNING, logger="protein_performer.data.inputs"):
        assert len(list(input_records(fasta))) == 2
        assert len(read_records(fasta)) == 2
    said = [r.message for r in caplog.records if "looks like DNA or RNA" in r.message]
    assert len(said) == (2 if warned else 0), said
    assert not warned or "all 2 record(s) hold only A/C/G/T/U/N" in said[0]


def test_one_rule_tells_a_store_from_fasta(tmp_path: Path, monkeypatch) -> None:
    """``open_input`` answers "store or FASTA?" for every reader (records, totals, stats): a
    directory is a store, ``-`` standard input, anything else a FASTA file, plain or gzip."""
    text = ">a one\nMKTAY\n>b two\nGSLLV\n"
    fasta, packed = tmp_path / "in.fasta", tmp_path / "in.fasta.gz"
    fasta.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    store = tmp_path / "store"
    preprocess([fasta], store, valid_frac=0.0, test_frac=0.0, progress=False)
    want = [("a", "MKTAY", 1), ("b", "GSLLV", 2)]
    for path in (fasta, packed, store):
        assert [(r.id, r.sequence, r.number) for r in input_records(path)] == want, path
        assert input_totals(path) == (2, 10) and collect(path)["records"] == 2
    assert open_input(store).store is not None and open_input(packed).store is None
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert [r.id for r in input_records("-")] == ["a", "b"] and input_totals("-") is None
    plain_dir = tmp_path / "not_a_store"
    plain_dir.mkdir()
    for path, said in ((plain_dir, "is not a preprocessed store"),
                       (tmp_path / "missing.fa", "does not exist or is not a file")):  # fmt: skip
        for read in (lambda p: list(input_records(p)), collect):
            with pytest.raises(UserError, match=said):
                read(path)
        assert input_totals(path) is None


def test_every_reader_asks_open_input(tmp_path: Path) -> None:
    """Issue 44: ``homologs``' database and query, the FASTA readers and training's data.path
    ask :func:`open_input` too, so a directory that is not a store, a missing file and a
    directory where a FASTA is wanted read the same everywhere."""
    from protein_performer.data.datamodule import ProteinDataModule
    from protein_performer.data.homology import find_homologs
    from protein_performer.data.inputs import read_homologs

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n")
    plain_dir = tmp_path / "not_a_store"
    plain_dir.mkdir()
    with pytest.raises(UserError, match="not_a_store is not a preprocessed store"):
        find_homologs(fasta, plain_dir)
    with pytest.raises(UserError, match="missing.fa does not exist or is not a file; give a "
                       "FASTA file or a store directory"):  # fmt: skip
        find_homologs(fasta, tmp_path / "missing.fa")
    with pytest.raises(UserError, match="not_a_store does not exist or is not a file; give "
                       "the query FASTA"):  # fmt: skip
        find_homologs(plain_dir, fasta)
    for read, give in ((read_records, "a FASTA file"), (read_homologs, "a FASTA file or an MSA")):
        with pytest.raises(UserError, match=f"not_a_store does not exist or is not a file; "
                           f"give {give}$"):  # fmt: skip
            read(plain_dir)
    for paths in ([plain_dir], [fasta, plain_dir]):
        with pytest.raises(UserError, match="not_a_store is not a preprocessed store"):
            ProteinDataModule([str(p) for p in paths]).setup("fit")
    store = tmp_path / "store"
    preprocess([fasta], store, valid_frac=0.0, test_frac=0.0, progress=False)
    with pytest.raises(UserError, match="data.path mixes a directory .*store"):
        ProteinDataModule([str(fasta), str(store)]).setup("fit")



def test_a_family_datamodule_opens_its_store_once(tmp_path: Path, monkeypatch) -> None:
    """Issue 44: the splits and each split's families read one store, opened once by
    :func:`open_input` (the families opened it again per split). Empty splits: no MMseqs2 run."""
    from protein_performer.data import store as store_module
    from protein_performer.data.datamodule import ProteinDataModule

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nMKTAYIAKQRQISFVKSHFSRA\n")
    store = tmp_path / "store"
    preprocess([fasta], store, valid_frac=0.0, test_frac=0.0, progress=False)
    opened = []
    real_init = store_module.TokenStore.__init__

    def counted(self, path) -> None:  # noqa: ANN001 - TokenStore's own signature
        opened.append(path)
        real_init(self, path)

    monkeypatch.setattr(store_module.TokenStore, "__init__", counted)
    dm = ProteinDataModule(str(store), objective="clm", layout="family")
    sources = dm._load_sources()
    for split in ("valid", "test"):
        assert len(dm._store_families(split).offsets) == 1  # no family in an empty split
    assert len(opened) == 1, opened
    assert sources["train"].store is dm._store()
