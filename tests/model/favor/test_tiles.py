"""The causal scan's tiles: tuned once per machine and shape, cached, pinnable; the choice
changes the order of sums, never the result. The tuning rule is tested on a made-up clock
(``causal_tiles(..., clock=)``): no test here depends on how fast the machine is."""

from __future__ import annotations

import json
import time

import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.model.favor import tiles
from protein_performer.model.favor.module import FavorAttention

PATH = "favor_tiles.json"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory, no in-process memory of earlier tunings, a quiet machine."""
    monkeypatch.setenv("PROTEIN_PERFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PROTEIN_PERFORMER_FAVOR_TILES", raising=False)
    monkeypatch.delenv("PROTEIN_PERFORMER_FAVOR_RETUNE", raising=False)
    monkeypatch.setattr(tiles, "_memo", {})
    monkeypatch.setattr(tiles, "machine_load", lambda threads, since=None: 0.0)
    return tmp_path


class Probe:
    """A scan whose cost is known, on a made-up clock: (64, 1024) is fastest. ``burst``: the
    n-th run of a pair (its warm-up is run 0) costs this much instead."""

    COST = {64: 2, 128: 4, 256: 6}, {1024: 0, 2048: 2, 8192: 1}

    def __init__(self, burst: dict[tuple[tuple[int, int], int], float] | None = None):
        self.calls: list[tuple[int, int]] = []
        self.now = 0.0
        self.burst = burst or {}

    def cost(self, chunk: int, segment: int) -> float:
        return self.COST[0][chunk] + self.COST[1][segment]

    def __call__(self, chunk: int, segment: int) -> None:
        run = self.calls.count((chunk, segment))
        self.calls.append((chunk, segment))
        self.now += self.burst.get(((chunk, segment), run), self.cost(chunk, segment))

    def clock(self) -> float:
        return self.now


def tune(probe: Probe, q: torch.Tensor | None = None) -> tuple[int, int]:
    return tiles.causal_tiles(big() if q is None else q, 32, 17, lambda grad: probe, probe.clock)


def stored(path) -> dict:
    return json.loads((path / PATH).read_text())["tiles"]


def big(requires_grad=False):
    return torch.zeros(8, tiles.TUNE_MIN_TOKENS // 8, 16, requires_grad=requires_grad)


def test_tunes_once_picks_the_fastest_and_caches_per_shape(fresh):
    probe = Probe()
    assert tune(probe) == (64, 1024)
    # chunks at the default segment (3), then the best chunk's segments and the default (4);
    # each pair warmed up once, then timed in every round of its stage
    assert len(set(probe.calls)) == 5
    assert len(probe.calls) == 5 + tiles.REPEATS * (3 + 4)
    ((entry),) = stored(fresh).values()
    assert entry["tiles"] == [64, 1024] and entry["provisional"] is False
    assert entry["load_per_core"] == 0.0 and entry["measured"].endswith("Z")
    assert len(entry["seconds"]["64,1024"]) == tiles.REPEATS
    # a new process (memo cleared) reads the file instead of timing
    tiles._memo.clear()
    again = Probe()
    assert tune(again) == (64, 1024) and not again.calls
    # another shape or phase is another key
    assert tune(again, big(requires_grad=True)) == (64, 1024)
    assert again.calls
    assert len(stored(fresh)) == 2


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
    (fresh / PATH).write_text("{not json")
    probe = Probe()
    assert tune(probe) == (64, 1024) and probe.calls
    path = fresh / PATH
    path.write_text(json.dumps({"format": tiles.FORMAT + 1, "tiles": {}}))
    tiles._memo.clear()
    probe = Probe()
    tune(probe)
    assert probe.calls and json.loads(path.read_text())["format"] == tiles.FORMAT


def test_a_cache_entry_of_floats_is_retuned(fresh):
    """[64.0, 1024.0] equals a candidate in Python but crashed every long causal forward."""
    key = tiles._key(big(), 32, 17, False)
    entry = {"tiles": [64.0, 1024.0], "at": time.time(), "provisional": False}
    (fresh / PATH).write_text(json.dumps({"format": tiles.FORMAT, "tiles": {key: entry}}))
    probe = Probe()
    chosen = tune(probe)
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
    ((key, entry),) = stored(fresh).items()
    chosen = entry["tiles"]
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
    assert sorted(key.rsplit("|", 1)[1] for key in stored(fresh)) == ["fwd", "fwd+bwd"]
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    monkeypatch.setenv("PROTEIN_PERFORMER_FAVOR_TILES", "128,8192")
    attn(q, k, v)[0].square().sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3)


class NearlyEven(Probe):
    """Every pair 2% faster than the default: within the noise margin."""

    def cost(self, chunk: int, segment: int) -> float:
        return 1.0 if (chunk, segment) == tiles.DEFAULT_TILES else 0.98


def test_a_winner_within_the_noise_margin_keeps_the_default(fresh):
    probe = NearlyEven()
    assert tune(probe) == tiles.DEFAULT_TILES
    assert probe.calls


def test_a_winner_must_win_every_round(fresh):
    """A burst of load in one round (the fastest pair's 2nd timing costs 50, the default 5):
    that pair is not consistent, the fastest pair that wins every round is kept."""
    probe = Probe(burst={((64, 1024), 2): 50.0})
    assert tune(probe) == (64, 8192)
    # Every other pair loses one round of the second stage (run 2 of a new pair, run 5 of one
    # timed in the first stage too): none wins consistently, the default stays.
    pairs = [(c, s) for c in tiles.CHUNKS for s in tiles.SEGMENTS if (c, s) != tiles.DEFAULT_TILES]
    everywhere = Probe(burst={(pair, run): 50.0 for pair in pairs for run in (2, 5)})
    tiles._memo.clear()
    (fresh / PATH).unlink()
    assert tune(everywhere) == tiles.DEFAULT_TILES


def test_a_loaded_machine_keeps_the_default_as_provisional(fresh, monkeypatch):
    """Timings under load choose nothing: the default, cached as provisional, is used until
    RECHECK_PROVISIONAL has passed; then a quiet machine tunes for good."""
    monkeypatch.setattr(tiles, "machine_load", lambda threads, since=None: 1.0)
    assert tune(Probe()) == tiles.DEFAULT_TILES
    ((key, entry),) = stored(fresh).items()
    assert entry["provisional"] is True and entry["load_per_core"] == 1.0
    monkeypatch.setattr(tiles, "machine_load", lambda threads, since=None: 0.0)
    tiles._memo.clear()
    probe = Probe()
    assert tune(probe) == tiles.DEFAULT_TILES and not probe.calls  # not yet re-checked
    entry["at"] -= tiles.RECHECK_PROVISIONAL + 1  # "at" is rounded to 0.1 s
    (fresh / PATH).write_text(json.dumps({"format": tiles.FORMAT, "tiles": {key: entry}}))
    tiles._memo.clear()
    assert tune(probe) == (64, 1024) and probe.calls
    assert stored(fresh)[key]["provisional"] is False


class Slower(Probe):
    """The machine changed: (64, 1024) is now slower than the default."""

    def cost(self, chunk: int, segment: int) -> float:
        return 9.0 if (chunk, segment) == (64, 1024) else super().cost(chunk, segment)


@pytest.mark.parametrize(("probe", "kept"), [(Slower(), False), (Probe(), True)])
def test_an_old_winner_is_rechecked_and_dropped_when_slower(fresh, probe, kept):
    assert tune(Probe()) == (64, 1024)
    ((key, entry),) = stored(fresh).items()
    entry["at"] -= tiles.RECHECK_WINNER + 1  # "at" is rounded to 0.1 s: older by a second
    (fresh / PATH).write_text(json.dumps({"format": tiles.FORMAT, "tiles": {key: entry}}))
    tiles._memo.clear()
    want = (64, 1024) if kept else tiles.DEFAULT_TILES
    assert tune(probe) == want
    assert set(probe.calls) == {(64, 1024), tiles.DEFAULT_TILES}  # the two, nothing else
    again = stored(fresh)[key]
    assert again["tiles"] == list(want) and again["at"] > entry["at"]


def test_retune_on_purpose(fresh, monkeypatch):
    assert tune(Probe()) == (64, 1024)
    tiles._memo.clear()
    monkeypatch.setenv("PROTEIN_PERFORMER_FAVOR_RETUNE", "1")
    probe = Slower()
    assert tune(probe) == (64, 8192) and len(set(probe.calls)) == 5
    assert stored(fresh)[tiles._key(big(), 32, 17, False)]["tiles"] == [64, 8192]


def test_an_unwritable_cache_still_tunes(fresh, monkeypatch):
    blocker = fresh / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PROTEIN_PERFORMER_CACHE_DIR", str(blocker / "cache"))
    probe = Probe()
    assert tune(probe) == (64, 1024)
    calls = len(probe.calls)
    assert tune(probe) == (64, 1024)
    assert len(probe.calls) == calls  # kept in memory for this process


TUNE_IN_A_PROCESS = """
import torch
from protein_performer.model.favor import tiles
tiles.machine_load = lambda threads, since=None: 0.0
calls, now = [], [0.0]
def probe(grad):
    def run(chunk, segment):
        calls.append((chunk, segment))
        now[0] += {64: 2, 128: 4, 256: 6}[chunk] + {1024: 0, 2048: 2, 8192: 1}[segment]
    return run
print(tiles.causal_tiles(torch.zeros(8, 4096, 16), 32, 17, probe, lambda: now[0]), len(calls))
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
    assert outs[0] == "(64, 1024) 0" and outs[1] == f"(64, 1024) {5 + 7 * tiles.REPEATS}", outs


def test_a_fifo_as_the_cache_is_ignored_with_one_warning(fresh, caplog):
    """``read_text`` of a FIFO waited forever for a writer (issue 42 #16)."""
    import logging
    import os
    import threading

    os.mkfifo(fresh / PATH)
    done: list[tuple[int, int]] = []
    worker = threading.Thread(target=lambda: done.append(tune(Probe())), daemon=True)
    with caplog.at_level(logging.WARNING, logger=tiles.__name__):
        worker.start()
        worker.join(timeout=30)
    if worker.is_alive():
        pytest.fail("the tiles cache hung on a FIFO (its thread still holds the tiles lock)")
    assert done == [(64, 1024)]
    warnings = [r for r in caplog.records if "not a regular file" in r.getMessage()]
    assert len(warnings) == 1
    assert (fresh / PATH).is_file()  # the tuned result replaced it


class Busy(Probe):
    """A probe on the made-up clock whose runs also take real time (sleeping, so this process
    itself adds almost no CPU time to what the load meter sees)."""

    def __call__(self, chunk: int, segment: int) -> None:
        super().__call__(chunk, segment)
        time.sleep(0.01)


def test_machine_load_counts_other_processes_cpu_time_during_the_timing(monkeypatch):
    """The load is the rest of the machine's CPU time between two /proc readings over the wall
    time and the cores; this process's own time is not counted."""
    marks = iter([tiles.CpuMark(machine=103.0, own=12.0, wall=11.0)])
    monkeypatch.setattr(tiles, "cpu_mark", lambda: next(marks))
    monkeypatch.setattr(tiles.os, "cpu_count", lambda: 2)
    since = tiles.CpuMark(machine=100.0, own=10.0, wall=10.0)
    assert tiles.machine_load(1, since) == pytest.approx(0.5)  # (3 - 2) CPU s / (1 s x 2)


@pytest.mark.skipif(tiles.cpu_mark() is None, reason="needs Linux /proc")
def test_a_hog_started_just_before_tuning_makes_it_provisional(tmp_path, monkeypatch):
    """Issue 43: a CPU hog started a moment before the tuning is load (the 1-minute average
    had not seen it yet, so such timings were once cached as quiet): the default is kept,
    cached as provisional, with the hog's share in load_per_core. The real load meter."""
    import subprocess
    import sys

    monkeypatch.setenv("PROTEIN_PERFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PROTEIN_PERFORMER_FAVOR_TILES", raising=False)
    monkeypatch.delenv("PROTEIN_PERFORMER_FAVOR_RETUNE", raising=False)
    monkeypatch.setattr(tiles, "_memo", {})
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        assert tune(Busy()) == tiles.DEFAULT_TILES
    finally:
        hog.kill()
        hog.wait()
    ((entry),) = stored(tmp_path).values()
    cpus = tiles.os.cpu_count() or 1
    assert entry["provisional"] is True
    assert entry["load_per_core"] >= 0.8 / cpus  # the hog alone: one core, nearly all the time
