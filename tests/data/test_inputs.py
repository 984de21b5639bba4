"""data.inputs: what the inference commands read, and the warning for DNA/RNA-looking input."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from protein_performer.data.inputs import input_records, read_records


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
