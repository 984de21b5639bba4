"""jobs.score: the table score writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protein_performer.inference.api import ProteinLM
from protein_performer.jobs.score import score_fasta
from tests.inference.test_embedding import tiny_loaded
from tests.inference.test_scoring import WT, read_csv


def test_score_fasta_writes_tsv(tmp_path: Path) -> None:
    (tmp_path / "x.fasta").write_text(f">x desc\n{WT}\n>y\nMLLAV\n")
    score_fasta(
        ProteinLM(tiny_loaded("clm")),
        tmp_path / "x.fasta",
        tmp_path / "o.tsv",
        "causal",
        progress=False,
    )
    rows = read_csv(tmp_path / "o.tsv", "\t")
    assert rows[0] == [
        "id",
        "length",
        "n_scored",
        "log_likelihood",
        "mean_log_likelihood",
        "perplexity",
    ]
    assert [r[:3] for r in rows[1:]] == [["x", "22", "23"], ["y", "5", "6"]]
    ll, mean, ppl = map(float, rows[1][3:])
    assert mean == pytest.approx(ll / 23, abs=1e-5) and ppl == pytest.approx(np.exp(-mean), 1e-4)
