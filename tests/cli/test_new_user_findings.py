"""What a new user hit on 0.3.0 (issue 35), each fixed and checked here: messages that name the
caller's own way out, exit statuses, progress totals, numbers and baselines that mean something.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from protein_performer.cli._lifetime import SIGTERM_EXIT, resume_hint
from protein_performer.cli.main import main
from protein_performer.data.dataset import InMemorySource, unigram_perplexity
from protein_performer.data.fasta import count_records_and_residues
from protein_performer.data.homology import size_summary
from protein_performer.data.inputs import input_records
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.scoring import matching_offset
from protein_performer.io.progress import LineProgress, total_later
from tests.inference.test_embedding import tiny_loaded
from tests.interop.test_loading import fit_checkpoint
from tests.paths import DEMO_DATA, REPO

WT = "MKTAYIAKQRQISFVKSHFSRQ"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_checkpoint(tmp_path_factory.mktemp("fit"))[0]


def test_embed_contacts_without_regression_names_no_flag_embed_lacks(
    ckpt: Path, tmp_path: Path, capsys
) -> None:
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{WT}\n")
    argv = ["embed", str(ckpt), str(fasta), str(tmp_path / "e.h5"), "--include", "contacts"]
    assert main([*argv, "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no contact regression" in err and "--save-beside" in err
    assert "pass --regression" not in err  # embed has no such flag


def test_python_predict_contacts_error_names_the_argument() -> None:
    with pytest.raises(UserError) as info:
        ProteinLM(tiny_loaded()).predict_contacts(WT)
    assert "regression='DIR/contact_regression.json'" in str(info.value)
    assert "--regression" not in str(info.value)


def test_matching_offset_finds_the_numbering_of_the_table() -> None:
    wt = "HPETLVKVKDAEDQLGARVG"  # BLAT's first residues: position 24 in the scan's numbering
    names = [f"{wt[i]}{i + 24}A" for i in range(0, 20, 3)] + ["H24C:P25G"]
    best, count, parsed = matching_offset(names, wt)
    assert (best, count, parsed) == (24, len(names), len(names))
    assert matching_offset(["WT", "junk"], wt) is None


def test_score_variants_with_the_wrong_offset_exits_2_and_names_the_right_one(
    ckpt: Path, tmp_path: Path, capsys
) -> None:
    wt = tmp_path / "wt.fasta"
    wt.write_text(f">wt\n{WT}\n")
    dms = tmp_path / "dms.csv"  # numbered from 11: K2R of the sequence is K12R here
    dms.write_text("mutant,fit\nK12R,1\nT13S:Q19E,2\nA14R,3\n")
    out = tmp_path / "out.csv"
    assert main(["score-variants", str(ckpt), str(wt), str(dms), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "none of its 3 row(s) fits the wild type with --offset 1" in err
    assert "pass --offset 11" in err and not out.exists()
    argv = ["score-variants", str(ckpt), str(wt), str(dms), str(out), "--offset", "11"]
    assert main([*argv, "--no-progress"]) == 0
    assert "scored 3 of 3" in capsys.readouterr().out


def test_a_stopped_command_with_resume_says_how_to_continue(tmp_path: Path, capsys) -> None:
    out = tmp_path / "emb.h5"
    parts = tmp_path / "emb.h5.parts"
    parts.mkdir()
    (parts / "run0000-w000000000.h5").write_bytes(b"")
    with pytest.raises(SystemExit) as info, resume_hint(out):
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, as a scheduler sends it
    assert info.value.code == SIGTERM_EXIT
    err = capsys.readouterr().err
    assert "SIGTERM: 1 finished part(s) kept" in err and "--resume" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back


@pytest.mark.parametrize("block", [7, 1 << 18])  # tiny blocks split headers and lines
def test_count_records_and_residues_equals_the_parsed_file(
    block: int, tmp_path: Path, monkeypatch
) -> None:
    import protein_performer.data.fasta as fasta

    path = tmp_path / "x.fasta"
    path.write_text(">a desc with > sign\nMKT\r\nAYI*\n\n>b\nmll\n>c only>header\nW\n")
    monkeypatch.setattr(fasta, "_BLOCK", block)
    records = list(input_records(path))
    residues = sum(len(r.sequence) for r in records)
    assert count_records_and_residues(path) == (len(records), residues)
    demo = REPO / "protein_performer" / "data" / "demo" / "some_proteins.fasta"
    parsed = list(input_records(demo))
    assert count_records_and_residues(demo) == (15, sum(len(r.sequence) for r in parsed))


def test_progress_gets_its_total_from_the_background_count() -> None:
    bar = LineProgress(None, "res", "embed")
    total_later(bar, lambda: 123)
    for _ in range(200):
        if bar.total is not None:
            break
        time.sleep(0.01)
    bar.close()
    assert bar.total == 123


def test_unigram_perplexity_is_the_cross_entropy_of_train_frequencies() -> None:
    train = InMemorySource(["a", "b"], [np.array([4, 4, 5]), np.array([4])])  # L L A L
    valid = InMemorySource(["c"], [np.array([4, 5])])  # L A
    p_l, p_a = (3 + 1) / 6, (1 + 1) / 6  # add-one over the letters training saw
    want = np.exp(-(np.log(p_l) + np.log(p_a)) / 2)
    assert unigram_perplexity(train, valid) == pytest.approx(want, rel=1e-12)
    assert unigram_perplexity(train, InMemorySource([], [])) is None


def test_lightning_tips_and_eval_mode_warnings_are_silenced() -> None:
    from protein_performer.training.quiet import quiet_lightning

    quiet_lightning()
    logger = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    tip = logger.makeRecord(logger.name, logging.INFO, "", 0, "💡 Tip: try litlogger", (), None)
    other = logger.makeRecord(logger.name, logging.INFO, "", 0, "GPU available: False", (), None)
    assert not logger.filter(tip) and logger.filter(other)
    with warnings.catch_warnings(record=True) as caught:
        quiet_lightning()  # catch_warnings reset the filters: install them again inside
        warnings.warn("Found 3 module(s) in eval mode at the start of training. x", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]


def test_ood_taxa_that_holds_out_nothing_says_why(tmp_path: Path, caplog) -> None:
    from protein_performer.data.preprocess import preprocess

    src = DEMO_DATA / "some_proteins.fasta"  # UniRef50 ids, no TaxID=
    with caplog.at_level(logging.WARNING):
        summary = preprocess([src], tmp_path / "store", ood_taxa=[9606], progress=False)
    assert summary.splits["ood"] == 0
    assert "no record's header carries a taxon" in caplog.text


def test_numbers_are_formatted() -> None:
    from protein_performer.cli.preprocess import _sig

    sizes = np.array([1, 2, 3, 100, 120, 130, 7, 8, 9, 10, 11])
    summary = size_summary(sizes)
    assert summary["p90"] == round(float(np.percentile(sizes, 90)), 1) == 120.0
    assert summary["median"] == 9.0 and summary["p99"] == round(float(np.percentile(sizes, 99)), 1)
    assert _sig(0.0312345) == "0.0312" and _sig(4.5678) == "4.57" and _sig(1234.5) == "1,234"
