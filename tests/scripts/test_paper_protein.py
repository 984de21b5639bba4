"""The pieces of the paper's protein experiments: CPU-time budget, concatenated rows, unigram
baseline, and ``scripts/studies/paper_protein.py`` end to end (``--quick``, slow: it trains 9
models)."""

from __future__ import annotations

import csv
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from protein_performer.data.dataset import ConcatSource, ProteinDataset
from protein_performer.data.masking import IGNORE_INDEX
from protein_performer.data.tokenizer import SEQUENCE_LETTERS, Alphabet
from protein_performer.training.compose import compose_config
from protein_performer.training.train import train
from scripts.studies.harness import unigram_baseline
from tests.data.test_dataset import in_memory_source
from tests.training.test_train import TINY

#: test_train's tiny model, run by a time budget instead of a step count.
BUDGETED = [
    *TINY,
    "trainer.num_sanity_val_steps=0",
    "callbacks.training_curve=null",  # its matplotlib figure is most of a tiny run
    "trainer.max_epochs=-1",
    "trainer.max_steps=100000",
    "trainer.limit_val_batches=1",
    "++callbacks.time_budget._target_=protein_performer.training.callbacks.TimeBudget",
]


@pytest.mark.slow  # the default suite's time budget (make test <= 2 min)
def test_cpu_budget_stops_training_and_logs_validations(tmp_path: Path) -> None:
    """2 CPU-seconds of training: stops there (not at max_steps), validates at the stop too,
    and the logged training time excludes validation."""
    cfg = compose_config(
        [
            *BUDGETED,
            "++callbacks.time_budget.seconds=2",
            "trainer.val_check_interval=10",
            "data.concat=true",  # rows of exactly max_len: the concatenated setting
        ],
        output_dir=tmp_path,
    )
    cpu0 = time.process_time()
    result = train(cfg)
    spent = time.process_time() - cpu0
    events = json.loads((tmp_path / "time_budget.json").read_text())
    vals = [e for e in events if e["event"] == "val"]
    end = events[-1]
    assert end["event"] == "end" and end["clock"] == "cpu" and end["peak_rss_mib"] > 50
    assert 2.0 <= end["train_s"] < 4.0, end  # the batch that crossed the line, no more
    assert 10 <= end["step"] < 100000
    assert len(vals) >= 1 and vals[-1]["step"] == end["step"]  # validated at the stop
    assert all(math.isfinite(v["val/acc"]) for v in vals)
    steps = [v["step"] for v in vals]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert spent > end["train_s"]  # the run spent CPU on validation/setup outside the budget
    assert Path(result["last_checkpoint"]).is_file()


def test_concat_source_rows() -> None:
    a = Alphabet()
    src = in_memory_source([("a", "ACDE"), ("b", "FG"), ("c", "HIKLMN")])
    cat = ConcatSource(src, chunk=5, eos_idx=a.eos_idx)
    # ACDE<eos>FG<eos>HIKLMN<eos> = 15 tokens -> 3 rows of 5, nothing dropped.
    assert len(cat) == 3 and list(cat.lengths) == [5, 5, 5]
    flat = np.concatenate([cat.tokens(i) for i in range(3)])
    want = [*a.encode("ACDE"), a.eos_idx, *a.encode("FG"), a.eos_idx, *a.encode("HIKLMN")]
    assert flat.tolist() == [*want, a.eos_idx]
    assert len(ConcatSource(src, chunk=4, eos_idx=a.eos_idx)) == 3  # 15 // 4: tail dropped
    # As model rows: <cls> + 5 + <eos>; masking never picks the <eos> inside a row.
    ds = ProteinDataset(cat, "mlm", max_len=7, crop="fixed", mlm_prob=0.9, seed=0)
    item = ds[(0, 0)]
    assert len(item["tokens"]) == 7
    assert item["targets"][5] == IGNORE_INDEX  # the inner <eos> (position 1 + 4)


def test_unigram_baseline_positions_and_values() -> None:
    train_src = in_memory_source([("t1", "AAAAAAAC"), ("t2", "AAAC")])
    held = in_memory_source([("h1", "ACAC"), ("h2", "AAAA")])
    clm = unigram_baseline(train_src, held, "clm", max_len=64)
    # Every next-token prediction incl. <eos>: 4 + 1 per record.
    assert clm["tokens"] == 10 and clm["records"] == 2
    # Add-one over the residue letters and <eos>: A 10+1, C 3, eos 2+1, every other letter 1.
    total = 11 + 3 + 3 + len(SEQUENCE_LETTERS) - 2
    want = -(6 * math.log(11 / total) + 2 * math.log(3 / total) + 2 * math.log(3 / total)) / 10
    assert clm["loss"] == pytest.approx(want)
    assert clm["acc"] == pytest.approx(6 / 10)  # always guessing A
    mlm = unigram_baseline(train_src, held, "mlm", max_len=64, mlm_prob=0.5, seed=3)
    ds = ProteinDataset(held, "mlm", max_len=64, crop="fixed", mlm_prob=0.5, seed=3)
    masked = sum(int((ds[(i, 0)]["targets"] != IGNORE_INDEX).sum()) for i in range(2))
    assert mlm["tokens"] == masked > 0


@pytest.mark.slow  # own interpreter; test_scripts.py checks every script's --help at once
def test_help(run_script) -> None:
    out = run_script("studies/paper_protein.py", "--help").stdout
    assert "CPU time" in out and "--quick" in out and "--trainer" in out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mmseqs") is None, reason="needs MMseqs2 (`mmseqs` on PATH)")
def test_quick_end_to_end(tmp_path: Path, run_script) -> None:
    run_script("studies/paper_protein.py", "--quick", "--out", str(tmp_path), timeout=900)
    with (tmp_path / "runs.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["part"], r["variant"]) for r in rows} == {
        *((p, v) for p in ("uni", "bid") for v in ("exact", "favor-softmax", "favor-relu")),
        ("concat", "favor-relu"),
        ("concat", "exact"),
        ("concat", "exact-small"),
    }
    for r in rows:
        assert float(r["train_cpu_s"]) >= 3.0 and int(r["steps"]) > 0, r
        if r["part"] != "concat":
            for key in ("test_acc", "test_ppl", "ood_acc", "ood_ppl"):
                assert math.isfinite(float(r[key])), (key, r)
    table = (tmp_path / "table2.md").read_text()
    assert "unigram baseline" in table and "OOD" in table
    assert (tmp_path / "fig6.png").stat().st_size > 0 and (tmp_path / "fig7.png").is_file()
    meta = json.loads((tmp_path / "store" / "meta.json").read_text())
    assert meta["splits"]["ood"]["records"] > 0 and meta["split"]["mode"] == "id"
