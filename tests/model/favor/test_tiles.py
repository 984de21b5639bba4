"""The causal scan's tiles: tuned once per machine and shape, cached, pinnable; the choice
changes the order of sums, never the result."""

from __future__ import annotations

import json
import time

import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.model.favor import tiles
from protein_performer.model.favor.module import FavorAttention


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no in-process memory of earlier tunings."""
    monkeypatch.setenv("PROTEIN_PERFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PROTEIN_PERFORMER_FAVOR_TILES", raising=False)
    monkeypatch.setattr(tiles, "_memo", {})
    return tmp_path


class Probe:
    """A scan whose cost is known: (chunk, segment) = (64, 1024) is fastest."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, chunk: int, segment: int) -> None:
        self.calls.append((chunk, segment))
        cost = {64: 2, 128: 4, 256: 6}[chunk] + {1024: 0, 2048: 2, 8192: 1}[segment]
        time.sleep(0.002 * cost)


def big(requires_grad=False):
    return torch.zeros(8, tiles.TUNE_MIN_TOKENS // 8, 16, requires_grad=requires_grad)


def test_tunes_once_picks_the_fastest_and_caches_per_shape(fresh):
    probe = Probe()
    assert tiles.causal_tiles(big(), 32, 17, lambda grad: probe) == (64, 1024)
    # chunk first at the default segment (3), then the best chunk's other segments (2); each
    # timed after a warm-up, twice
    assert len(set(probe.calls)) == 5 and len(probe.calls) == 15
    stored = json.loads((fresh / "favor_tiles.json").read_text())
    assert stored["format"] == tiles.FORMAT and list(stored["tiles"].values()) == [[64, 1024]]
    # a new process (memo cleared) reads the file instead of timing
    tiles._memo.clear()
    again = Probe()
    assert tiles.causal_tiles(big(), 32, 17, lambda grad: again) == (64, 1024) and not again.calls
    # another shape or phase is another key
    assert tiles.causal_tiles(big(requires_grad=True), 32, 17, lambda grad: again) == (64, 1024)
    assert again.calls
    assert len(json.loads((fresh / "favor_tiles.json").read_text())["tiles"]) == 2


def test_small_problems_and_pins_skip_timing(fresh, monkeypatch):
    def never():
        raise AssertionError("no timing expected")

    small = torch.zeros(2, 100, 16)
    assert tiles.causal_tiles(small, 32, 17, never) == tiles.DEFAULT_TILES
    many_short = torch.zeros(1280, 100, 16)  # a batch of short rows: the scan costs little
    assert tiles.causal_tiles(many_short, 32, 17, never) == tiles.DEFAULT_TILES
    monkeypatch.setenv("PROTEIN_PERFORMER_FAVOR_TILES", "32,1024")
    assert tiles.causal_tiles(big(), 32, 17, never) == (32, 1024)
    for text in ("32", "1000000000,8192", "128,1000000000000"):
        monkeypatch.setenv("PROTEIN_PERFORMER_FAVOR_TILES", text)
        with pytest.raises(UserError, match=r"integers in 1\.\.4096 and 1\.\.1048576"):
            tiles.causal_tiles(big(), 32, 17, never)


def test_a_damaged_or_older_cache_is_retuned(fresh):
    (fresh / "favor_tiles.json").write_text("{not json")
    probe = Probe()
    assert tiles.causal_tiles(big(), 32, 17, lambda grad: probe) == (64, 1024) and probe.calls
    path = fresh / "favor_tiles.json"
    path.write_text(json.dumps({"format": tiles.FORMAT + 1, "tiles": {}}))
    tiles._memo.clear()
    probe = Probe()
    tiles.causal_tiles(big(), 32, 17, lambda grad: probe)
    assert probe.calls and json.loads(path.read_text())["format"] == tiles.FORMAT


def test_a_cache_entry_of_floats_is_retuned(fresh):
    """[64.0, 1024.0] equals a candidate in Python but crashed every long causal forward."""
    key = tiles._key(big(), 32, 17, False)
    path = fresh / "favor_tiles.json"
    path.write_text(json.dumps({"format": tiles.FORMAT, "tiles": {key: [64.0, 1024.0]}}))
    probe = Probe()
    chosen = tiles.causal_tiles(big(), 32, 17, lambda grad: probe)
    assert probe.calls and all(type(x) is int for x in chosen)


def test_the_real_probe_tunes_and_the_result_matches_the_default_tiles(fresh, monkeypatch):
    """A causal layer large enough to tune (8 heads x 4,096 tokens) times the real scan; its
    output equals the one with the default tiles pinned to float32 rounding."""
    torch.manual_seed(0)
    attn = FavorAttention(8, nb_features=16, causal=True)
    q, k, v = (torch.randn(1, 8, 4096, 8) for _ in range(3))
    rng = torch.get_rng_state()
    tuned = attn(q, k, v)[0]
    assert torch.equal(rng, torch.get_rng_state())  # tuning draws from its own generator
    ((key, chosen),) = json.loads((fresh / "favor_tiles.json").read_text())["tiles"].items()
    assert key.endswith("|fwd") and chosen[0] in tiles.CHUNKS and chosen[1] in tiles.SEGMENTS
    monkeypatch.setenv("PROTEIN_PERFORMER_FAVOR_TILES", "128,8192")
    pinned = attn(q, k, v)[0]
    assert torch.allclose(tuned, pinned, atol=1e-5, rtol=1e-4)


def test_tuning_inside_checkpointing_and_inference_mode(fresh, monkeypatch):
    """Tuning starts inside a model's forward: under activation checkpointing (whose hooks
    would capture the probe's saved tensors) and under inference_mode it runs apart, and the
    gradients equal those with the tiles pinned."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    attn = FavorAttention(8, nb_features=16, causal=True)
    q, k, v = (torch.randn(1, 8, 4096, 8, requires_grad=True) for _ in range(3))
    with torch.inference_mode():
        attn(q, k, v)
    out, _ = checkpoint(attn, q, k, v, use_reentrant=False)
    out.square().sum().backward()
    stored = json.loads((fresh / "favor_tiles.json").read_text())["tiles"]
    assert sorted(key.rsplit("|", 1)[1] for key in stored) == ["fwd", "fwd+bwd"]
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    monkeypatch.setenv("PROTEIN_PERFORMER_FAVOR_TILES", "128,8192")
    attn(q, k, v)[0].square().sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3)


class NearlyEven(Probe):
    """Every pair 2% faster than the default: within the noise margin."""

    def __call__(self, chunk: int, segment: int) -> None:
        self.calls.append((chunk, segment))
        time.sleep(0.025 * (1.0 if (chunk, segment) == tiles.DEFAULT_TILES else 0.98))


def test_a_winner_within_the_noise_margin_keeps_the_default(fresh):
    probe = NearlyEven()
    assert tiles.causal_tiles(big(), 32, 17, lambda grad: probe) == tiles.DEFAULT_TILES
    assert probe.calls


def test_an_unwritable_cache_still_tunes(fresh, monkeypatch):
    blocker = fresh / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PROTEIN_PERFORMER_CACHE_DIR", str(blocker / "cache"))
    probe = Probe()
    assert tiles.causal_tiles(big(), 32, 17, lambda grad: probe) == (64, 1024)
    calls = len(probe.calls)
    assert tiles.causal_tiles(big(), 32, 17, lambda grad: probe) == (64, 1024)
    assert len(probe.calls) == calls  # kept in memory for this process


TUNE_IN_A_PROCESS = """
import sys, time, torch
from protein_performer.model.favor import tiles
calls = []
def probe(grad):
    def run(chunk, segment):
        calls.append((chunk, segment))
        time.sleep(0.005 * ({64: 2, 128: 4, 256: 6}[chunk] + {1024: 0, 2048: 2, 8192: 1}[segment]))
    return run
print(tiles.causal_tiles(torch.zeros(8, 4096, 16), 32, 17, probe), len(calls))
"""


def test_processes_sharing_a_cache_tune_once(fresh):
    """Two processes (torchrun ranks on one machine) start tuning at once: the file lock lets
    one measure while the other waits, then reads its result instead of measuring again."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PROTEIN_PERFORMER_CACHE_DIR": str(fresh)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TUNE_IN_A_PROCESS], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = sorted(proc.communicate(timeout=120)[0].strip() for proc in procs)
    assert all(proc.returncode == 0 for proc in procs)
    assert outs[0] == "(64, 1024) 0" and outs[1] == "(64, 1024) 15", outs
