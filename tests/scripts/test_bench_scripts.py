"""Smoke tests for the benchmark scripts: tiny configurations, real subprocesses.

Why: the scripts are run rarely and by hand (on a quiet machine or a GPU), so a broken CLI or a
renamed column would only surface then. Numbers are not checked for speed, only for existence
and finiteness.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

# Each benchmark case is a fresh interpreter; test_scripts.py checks every CLI by default.
pytestmark = pytest.mark.slow


def _rows(path: Path) -> list[dict[str, str]]:
    assert path.is_file(), f"missing {path}"
    with path.open() as fh:
        return list(csv.DictReader(fh))


def _finite(value: str) -> bool:
    return math.isfinite(float(value))


@pytest.mark.parametrize("script", ["bench/bench_attention.py", "bench/bench_favor_accuracy.py"])
def test_help(script: str, run_script) -> None:
    assert "usage" in run_script(script, "--help").stdout


def test_bench_attention_quick(tmp_path: Path, run_script) -> None:
    # Only ours (both modes): every case is a fresh interpreter, so each costs an `import torch`.
    proc = run_script(
        "bench/bench_attention.py",
        "--quick",
        "--impls",
        "ours",
        "--lengths",
        "128",
        "--matmul-n",
        "256",
        "--out",
        str(tmp_path),
    )
    rows = _rows(tmp_path / "attention.csv")
    for col in (
        "impl",
        "causal",
        "L",
        "mode",
        "status",
        "time_s",
        "peak_mem_mib",
        "useful_frac",
        "matmul_gflops",
    ):
        assert col in rows[0], col
    got = {(r["impl"], r["causal"], r["mode"]) for r in rows if r["status"] == "ok"}
    for causal in ("False", "True"):
        for mode in ("fwd", "fwd+bwd"):
            assert ("ours", causal, mode) in got, (causal, mode, rows)
    for r in rows:
        for col in ("time_s", "peak_mem_mib", "useful_frac", "matmul_gflops"):
            assert _finite(r[col]), (col, r)
        assert float(r["time_s"]) > 0
    assert (tmp_path / "attention.png").stat().st_size > 1000
    assert "| target | goal | measured | pass |" in proc.stdout
    assert (tmp_path / "attention.md").is_file()


def test_bench_favor_accuracy_quick(tmp_path: Path, run_script) -> None:
    proc = run_script(
        "bench/bench_favor_accuracy.py",
        "--quick",
        "--seeds",
        "1",
        "--fig4-len",
        "128",
        "--tau-len",
        "128",
        "--fig4-m",
        "16,32",
        "--out",
        str(tmp_path),
    )
    fig4 = _rows(tmp_path / "fig4.csv")
    assert {r["features"] for r in fig4} == {"positive", "trig", "uniform"}
    assert {r["draw"] for r in fig4} >= {"ORF", "IID"}
    assert all(_finite(r["mse_mean"]) and float(r["mse_mean"]) >= 0 for r in fig4)
    tau = _rows(tmp_path / "tau.csv")
    methods = {r["method"] for r in tau}
    assert "ours/softmax" in methods and "uniform (mean of V)" in methods
    assert {float(r["tau"]) for r in tau} == {0.25, 0.5, 1.0, 2.0}
    assert all(_finite(r["rel_err_mean"]) for r in tau)
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    md = (tmp_path / "accuracy.md").read_text()
    assert "Fig. 4" in md and "tau=1" in md
    assert "| method |" in proc.stdout


def test_bench_generate_quick(tmp_path: Path, run_script) -> None:
    run_script("bench/bench_generate.py", "--quick", "--out", str(tmp_path), timeout=300)
    rows = _rows(tmp_path / "generate_per_token.csv")
    assert [int(r["position"]) for r in rows] == [16, 64]
    assert all(_finite(r["ms_per_token"]) and float(r["ms_per_token"]) > 0 for r in rows)
    assert len({r["state_kib"] for r in rows}) == 1  # the RNN state does not grow
    assert "ours: 32 tokens / 16 tokens" in (tmp_path / "generate.md").read_text()
    family = _rows(tmp_path / "generate_family.csv")  # a memory model after a family context
    assert {(r["model"], r["step"]) for r in family} == {
        ("memory", "eager"),
        ("memory", "traced"),
        ("favor", "traced"),
    }
    assert all(_finite(r["median_ms_per_token"]) for r in family)
    grown = _rows(tmp_path / "generate_family_per_token.csv")
    assert [int(r["homologs"]) for r in grown] == [1, 4]
    assert len({r["state_kib"] for r in grown}) == 1  # the memory's slots: its longest member


def test_bench_precision_quick(tmp_path: Path, run_script) -> None:
    run_script("bench/bench_precision.py", "--quick", "--threads", "1", "--out", str(tmp_path))
    table = (tmp_path / "precision.md").read_text().splitlines()
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in table
        if "| bf16" in line or "| fp16" in line
    }
    assert set(rows) == {"bf16", "fp16"}
    for cells in rows.values():
        assert all(_finite(c) for c in cells)
    # fp16 keeps 3 more mantissa bits than bf16: its embedding error is the smaller one
    assert float(rows["fp16"][0]) < float(rows["bf16"][0])


def test_bench_embed_store_quick(tmp_path: Path, run_script) -> None:
    run_script("bench/bench_embed_store.py", "--quick", "--out", str(tmp_path), timeout=600)
    report = (tmp_path / "embed_store.md").read_text()
    rows = [line.split("|")[1:-1] for line in report.splitlines() if line.startswith("| 1000")]
    assert len(rows) == 1 and all(cell.strip() for cell in rows[0])
    assert "extrapolated to UniRef50" in report


def test_bench_context_quick(tmp_path: Path, run_script) -> None:
    run_script("bench/bench_context.py", "--quick", "--out", str(tmp_path), timeout=900)
    rows = _rows(tmp_path / "context.csv")
    assert {(r["impl"], r["tokens"]) for r in rows} == {
        (impl, t) for impl in ("favor", "exact") for t in ("1024", "4096")
    }
    assert all(r["status"] == "ok" and _finite(r["ms_per_candidate"]) for r in rows)
    favor = {r["context_kib"] for r in rows if r["impl"] == "favor"}
    assert len(favor) == 1  # the FAVOR+ context does not grow

