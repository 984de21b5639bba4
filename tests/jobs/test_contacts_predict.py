"""jobs.contacts: the file ``contacts predict`` writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protein_performer.contacts.map_columns import read_contacts
from protein_performer.contacts.predict import predict_contacts
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.jobs.contacts import predict_contacts_fasta
from tests.contacts.test_contact_maps import _loaded, _regression, _sequence


def test_fasta_to_columnar_hdf5(tmp_path: Path) -> None:
    """``contacts predict``'s driver (``jobs.contacts``) writes the maps ``predict_contacts``
    gives, read back by ``read_contacts``."""
    import h5py

    loaded = _loaded("favor")
    reg = _regression(loaded)
    seqs = {"short": _sequence(20, 1), "long": _sequence(70, 2), "mid": _sequence(40, 3)}
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">{k} some protein\n{v}\n" for k, v in seqs.items()))
    out = tmp_path / "contacts.h5"
    lm = ProteinLM(loaded)
    summary = predict_contacts_fasta(
        lm, fasta, out, reg, dtype="float32", dense_max_length=64, progress=False
    )
    assert (summary.num_records, summary.dense, summary.sparse) == (3, 2, 1)
    back = read_contacts(out)
    assert list(back) == ["short", "long", "mid"]
    with h5py.File(out) as h5:
        off = h5["header_offsets"][:]
        assert h5["header_bytes"][off[1] : off[2]].tobytes() == b"long some protein"
    for rid, seq in seqs.items():
        want = predict_contacts(loaded, seq, reg, dense_max_length=64)
        got = back[rid]
        assert got.length == len(seq)
        if len(seq) <= 64:
            np.testing.assert_array_equal(got.dense, want.dense)
        else:
            assert got.dense is None and len(got.p) == 2 * len(seq)
            np.testing.assert_array_equal(got.i, want.i)
            np.testing.assert_array_equal(got.p, want.p)
    half = tmp_path / "half.h5"
    predict_contacts_fasta(lm, fasta, half, reg, progress=False)
    assert read_contacts(half, ["mid"])["mid"].dense.dtype == np.float16
    with pytest.raises(UserError, match="no record"):
        read_contacts(half, ["nope"])
