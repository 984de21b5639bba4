"""The causal scan's tile sizes (chunk, segment), chosen per machine at first use and cached.

Why: the scan's cost is a handful of GEMMs whose shapes the chunk size C (the in-chunk C x C
products against the (M, dv+1) state updates) and the segment size (tokens per scan segment,
i.e. how much stays in cache) set; which pair is fastest depends on the CPU's caches and
vector units, the thread count, the feature count M and the head width (measured on one
2-core machine, 1 thread, 8 heads of 64, m = 272: fwd+bwd at L = 8,192 and 16,384 ran 1.5x
and 1.65x faster with segments of 2,048 tokens than with the former constant 8,192; see
docs/RESULTS.md). A constant is wrong somewhere, so the first large causal call times a few
candidates on a problem with its head width, feature count and dtype and stores the winner in
``favor_tiles.json`` under the cache directory (``PROTEIN_PERFORMER_CACHE_DIR``, else
``$XDG_CACHE_HOME/protein_performer``, else ``~/.cache/protein_performer``).
``PROTEIN_PERFORMER_FAVOR_TILES=C,S`` pins the pair (no timing), e.g. for runs that must be
bitwise reproducible across machines: tiles change the order of floating-point sums, not the
math (outputs agree to float rounding).

Sequences shorter than :data:`TUNE_MIN_LENGTH` and problems smaller than
:data:`TUNE_MIN_TOKENS` (heads x tokens) use :data:`DEFAULT_TILES`: there the scan is a small
share of the model and timing it would cost more than it saves. Processes sharing the cache
(torchrun ranks) take turns through a file lock: one tunes, the others read its result.

Choices that stay right (a pair tuned on a busy machine was once kept for good, and was slower
than the default on the quiet machine): the candidates are timed in :data:`REPEATS`
interleaved rounds (every candidate once per round, the order rotated), so a load that comes
and goes hits them alike; a pair replaces the default only when it is at least :data:`MARGIN`
faster in every round. Each entry records when it was measured and the machine's load then.
A measurement under load (other processes using more than :data:`BUSY_LOAD` of each core
during the timing rounds, read from /proc, :func:`machine_load`) keeps the default and is
cached as provisional, measured again after :data:`RECHECK_PROVISIONAL` seconds; a cached
winner older than :data:`RECHECK_WINNER` seconds is timed against the default again and
dropped when it no longer wins.
``PROTEIN_PERFORMER_FAVOR_RETUNE=1`` re-tunes on purpose (each shape this process meets is
measured again and its entry replaced). The timings come from one function
(``causal_tiles(..., clock=)``), so tests give it made-up times.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import platform
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from protein_performer.errors import UserError
from protein_performer.io.atomic import exclusive_lock, write_text_atomic
from protein_performer.model.config import MAX_CHUNK

log = logging.getLogger(__name__)

#: (chunk, segment) for small problems and when nothing was tuned.
DEFAULT_TILES = (128, 8192)
#: Tokens per row from which the tiles are tuned (shorter rows pay little for the scan).
TUNE_MIN_LENGTH = 2048
#: Heads x tokens from which the tiles are tuned (a 4k-token, 8-head layer is 32,768).
TUNE_MIN_TOKENS = 32768
#: The largest segment a pinned pair may give; its chunk is bounded as a config's
#: (:data:`~protein_performer.model.config.MAX_CHUNK`).
MAX_SEGMENT = 1 << 20
CHUNKS = (64, 128, 256)
SEGMENTS = (1024, 2048, 8192)
_CANDIDATES = {DEFAULT_TILES, *((c, s) for c in CHUNKS for s in SEGMENTS)}
#: How much faster than :data:`DEFAULT_TILES` a tuned pair must be, in every round, to replace it.
MARGIN = 0.05
#: Interleaved timing rounds of the candidates.
REPEATS = 3
#: Load per core from other processes during the timing (:func:`machine_load`) above which a
#: measurement is provisional.
BUSY_LOAD = 0.25
#: Seconds after which a provisional entry is measured again, and a cached winner re-checked.
RECHECK_PROVISIONAL, RECHECK_WINNER = 3600.0, 7 * 86400.0
FORMAT = 3  # the cache file's layout and candidates; another value is ignored and re-tuned
_memo: dict[str, tuple[int, int]] = {}
Tiles = tuple[int, int]
#: Seconds of one scan with the given tiles.
Timing = Callable[[Tiles], float]
_lock = threading.Lock()
#: What may go wrong with the cache file; tuning then runs on, kept in memory only.
_CACHE_ERRORS = (OSError, RuntimeError, UserError)


def cache_dir() -> Path:
    """Where per-machine measurements are kept."""
    env = os.environ
    if env.get("PROTEIN_PERFORMER_CACHE_DIR"):
        return Path(env["PROTEIN_PERFORMER_CACHE_DIR"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "protein_performer"


def _pinned() -> tuple[int, int] | None:
    text = os.environ.get("PROTEIN_PERFORMER_FAVOR_TILES", "").strip()
    if not text:
        return None
    try:
        chunk, segment = (int(p) for p in text.split(","))
    except ValueError:
        chunk = segment = 0
    if not (0 < chunk <= MAX_CHUNK and 0 < segment <= MAX_SEGMENT):
        raise UserError(
            f"PROTEIN_PERFORMER_FAVOR_TILES={text!r}: expected 'CHUNK,SEGMENT', integers in "
            f"1..{MAX_CHUNK} and 1..{MAX_SEGMENT}, e.g. 128,8192"
        )
    return chunk, segment


@functools.cache
def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(q: torch.Tensor, M: int, dv: int, grad: bool) -> str:
    device, d = q.device, q.shape[-1]
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    phase = "fwd+bwd" if grad else "fwd"
    return (
        f"{device.type}|{_processor(device)}|threads={threads}|{str(q.dtype)[6:]}|M={M}|d={d}"
        f"|dv={dv}|{phase}"
    )


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """The stored entries (``tiles``, ``at``, ``provisional``...; only candidate pairs of
    integers: anything else is re-tuned); {} when unreadable."""
    try:
        data = json.loads(_read_regular(path))
    except (*_CACHE_ERRORS, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    entries = data.get("tiles")
    return {k: v for k, v in entries.items() if _valid(v)} if isinstance(entries, dict) else {}


#: Larger than any cache this module writes (a few KB): a bigger file is not ours.
_MAX_CACHE_BYTES = 1 << 22
_warned: set[str] = set()


def _read_regular(path: Path) -> str:
    """The text of ``path`` when it is a regular file of sane size; a FIFO (where ``read_text``
    waited forever), a device or a directory is ignored with one warning and re-tuned over
    (the atomic write replaces it with a regular file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_CACHE_BYTES:
            if str(path) not in _warned:
                _warned.add(str(path))
                log.warning("ignoring %s: not a regular file of at most %d bytes", path,
                            _MAX_CACHE_BYTES)  # fmt: skip
            raise ValueError(f"{path} is not a tile cache")
        return fh.read(_MAX_CACHE_BYTES).decode("utf-8")


def _valid(entry: Any) -> bool:  # noqa: ANN401 - JSON
    """An entry as :func:`causal_tiles` writes it. ``type(x) is int``: ``[64.0, 1024.0]``
    equals a candidate in Python but would crash every scan."""
    if not isinstance(entry, dict):
        return False
    pair, at = entry.get("tiles"), entry.get("at")
    return (
        isinstance(pair, list)
        and all(type(x) is int for x in pair)
        and tuple(pair) in _CANDIDATES
        and type(at) in (int, float)
        and math.isfinite(at)
        and isinstance(entry.get("provisional"), bool)
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Holds ``path``'s lock while this process tunes and writes (others wait, then read the
    result); without one (a read-only cache) it simply goes on."""
    with contextlib.ExitStack() as stack:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(exclusive_lock(path, "tuned FAVOR+ tiles", wait=True))
        except _CACHE_ERRORS:
            pass
        yield


class CpuMark(NamedTuple):
    """CPU seconds used so far by the whole machine and by this process, and when (Linux)."""

    machine: float
    own: float
    wall: float


def cpu_mark() -> CpuMark | None:
    """The machine's busy CPU seconds (``/proc/stat``: every state but idle and iowait) and
    this process's (``/proc/self/stat``: user + system, all threads); None without /proc."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = sum(ticks) - ticks[3] - ticks[4]
    return CpuMark(busy / hz, (int(own[11]) + int(own[12])) / hz, time.monotonic())


def machine_load(threads: int, since: CpuMark | None = None) -> float:
    """Load per core from other processes: with ``since`` (a :func:`cpu_mark` taken before a
    timing), the CPU time the rest of the machine took since then over the wall time and the
    cores, so a neighbour that started a second before counts in full; else (no /proc) the
    1-minute load average less this process's ``threads``, over the cores (0 where there is
    none). Why not only the average: it lags a new neighbour by most of a minute (issue 43)."""
    cpus = os.cpu_count() or 1
    now = cpu_mark() if since is not None else None
    if since is not None and now is not None and now.wall > since.wall:
        other = (now.machine - since.machine) - (now.own - since.own)
        return max(0.0, other) / ((now.wall - since.wall) * cpus)
    try:
        average = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0
    return max(0.0, average - threads) / cpus


def _timer(
    measure: Callable[[int, int], None], device: torch.device, clock: Callable[[], float]
) -> Timing:
    """Seconds of one ``measure(chunk, segment)`` by ``clock``, each pair run once untimed
    first (a warm-up)."""
    warmed: set[Tiles] = set()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_one(pair: Tiles) -> float:
        if pair not in warmed:
            measure(*pair)
            warmed.add(pair)
        sync()
        start = clock()
        measure(*pair)
        sync()
        return clock() - start

    return time_one


def _rounds(time_one: Timing, candidates: list[Tiles]) -> dict[Tiles, list[float]]:
    """:data:`REPEATS` rounds, each timing every candidate once, the order rotated by one per
    round: timing a candidate's repeats back to back let a burst of load pick the winner."""
    times: dict[Tiles, list[float]] = {c: [] for c in candidates}
    for r in range(REPEATS):
        k = r % len(candidates)
        for pair in candidates[k:] + candidates[:k]:
            times[pair].append(time_one(pair))
    return times


def _wins(times: dict[Tiles, list[float]], pair: Tiles) -> bool:
    """Whether ``pair`` beat the default by :data:`MARGIN` in every round."""
    return all(
        t <= (1 - MARGIN) * d for t, d in zip(times[pair], times[DEFAULT_TILES], strict=True)
    )


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _measure(time_one: Timing) -> tuple[Tiles, dict[str, list[float]]]:
    """Chunk first (at the default segment), then the segment for the best chunk, the default
    timed in both stages' rounds (the two interact little: the segment only sets how many
    chunks share one pass); the winner is the fastest by median of the pairs that beat the
    default in every round (:func:`_wins`), else the default."""
    first = _rounds(time_one, [(c, DEFAULT_TILES[1]) for c in CHUNKS])
    chunk = min(first, key=lambda p: _median(first[p]))[0]
    second = _rounds(
        time_one, list(dict.fromkeys([*((chunk, s) for s in SEGMENTS), DEFAULT_TILES]))
    )
    winners = [p for p in second if p != DEFAULT_TILES and _wins(second, p)]
    best = min(winners, key=lambda p: _median(second[p])) if winners else DEFAULT_TILES
    return best, _seconds({**first, **second})


def _recheck(time_one: Timing, cached: Tiles) -> tuple[Tiles, dict[str, list[float]]]:
    """A cached winner timed against the default in interleaved rounds: kept only while it
    still wins (:func:`_wins`), else dropped for the default."""
    times = _rounds(time_one, [cached, DEFAULT_TILES])
    return (cached if _wins(times, cached) else DEFAULT_TILES), _seconds(times)


def _seconds(times: dict[Tiles, list[float]]) -> dict[str, list[float]]:
    """Timings as the cache and the log line show them: ``"chunk,segment": [per round]``."""
    return {f"{c},{s}": [round(t, 4) for t in ts] for (c, s), ts in times.items()}


def _apart(fn: Callable[[], Any], grad: bool, device: torch.device) -> Any:
    """``fn()`` in a thread of its own, with gradients on or off as ``grad`` says.

    Why: grad mode, inference mode, autocast, saved-tensor hooks and the current CUDA device
    are per thread. Tuning starts inside a model's forward, possibly under activation
    checkpointing (whose hooks would capture the probe's saved tensors and re-run the block:
    a deadlock), ``inference_mode`` or autocast; none of that may reach the probe, and the
    probe's graph must not touch the caller's.
    """
    threads, result = torch.get_num_threads(), {}

    def run() -> None:
        try:
            torch.set_num_threads(threads)  # OpenMP's setting is per thread too
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                result["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=run, name="favor-tiles")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _fixed(q: torch.Tensor) -> tuple[int, int] | None:
    """The tiles when no measurement applies: pinned, or a problem too small to tune."""
    pinned = _pinned()
    if pinned is not None:
        return pinned
    BH, L, _ = q.shape
    return DEFAULT_TILES if L < TUNE_MIN_LENGTH or BH * L < TUNE_MIN_TOKENS else None


def tiles_in_use(q: torch.Tensor, M: int, dv: int) -> tuple[int, int]:
    """The (chunk, segment) a causal scan over q would run with now, without measuring
    (benchmarks count the chunk's FLOPs with it)."""
    fixed = _fixed(q)
    if fixed is not None:
        return fixed
    key = _key(q, M, dv, torch.is_grad_enabled() and q.requires_grad)
    with _lock:
        if key in _memo:
            return _memo[key]
        try:
            entry = _read(cache_dir() / "favor_tiles.json").get(key)
        except _CACHE_ERRORS:
            return DEFAULT_TILES
        return tuple(entry["tiles"]) if entry else DEFAULT_TILES  # type: ignore[return-value]


def _due(entry: dict[str, Any] | None, now: float) -> str | None:
    """What an entry needs before use: ``"tune"`` (none, provisional and old, or a re-tune
    asked for), ``"recheck"`` (a winner older than :data:`RECHECK_WINNER`), or None."""
    if entry is None or os.environ.get("PROTEIN_PERFORMER_FAVOR_RETUNE", "") not in ("", "0"):
        return "tune"
    age = now - entry["at"]
    if entry["provisional"]:
        return "tune" if age >= RECHECK_PROVISIONAL else None
    winner = tuple(entry["tiles"]) != DEFAULT_TILES
    return "recheck" if winner and age >= RECHECK_WINNER else None


def causal_tiles(
    q: torch.Tensor,
    M: int,
    dv: int,
    probe: Callable[[bool], Callable[[int, int], None]],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, int]:
    """(chunk, segment) for a causal scan over q (BH, L, d) with M features.

    ``probe(grad)`` builds, only when timing is needed, a callable ``(chunk, segment)`` that
    runs one representative scan (8 heads x 4,096 tokens of this head width, features and
    dtype, with backward when ``grad``: gradients are on and q needs them); both run apart
    from the caller (:func:`_apart`). ``clock`` times each run (tests pass made-up times).
    """
    fixed = _fixed(q)
    if fixed is not None:
        return fixed
    grad = torch.is_grad_enabled() and q.requires_grad
    key = _key(q, M, dv, grad)
    with _lock:
        if key in _memo:
            return _memo[key]
        try:
            path = cache_dir() / "favor_tiles.json"
        except _CACHE_ERRORS:  # no home directory: tune, keep it in memory
            path = None
        with _file_lock(path) if path is not None else contextlib.nullcontext():
            entry = _read(path).get(key) if path is not None else None
            due = _due(entry, time.time())
            if due is None:
                _memo[key] = tuple(entry["tiles"])  # type: ignore[index]
                return _memo[key]
            start = time.perf_counter()
            threads = torch.get_num_threads()

            def measure() -> tuple[Tiles, dict[str, list[float]]]:
                time_one = _timer(probe(grad), q.device, clock)
                if due == "tune":
                    return _measure(time_one)
                return _recheck(time_one, tuple(entry["tiles"]))  # type: ignore[index, arg-type]

            mark = cpu_mark()
            best, seen = _apart(measure, grad, q.device)
            load = machine_load(threads, mark)
            provisional = load > BUSY_LOAD
            if provisional:  # a loaded machine's timings are not trusted with a choice
                best = DEFAULT_TILES
            _memo[key] = best
            record = {
                "tiles": list(best),
                "at": round(time.time(), 1),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "load_per_core": round(load, 3),
                "cpus": os.cpu_count() or 1,
                "provisional": provisional,
                "seconds": seen,
            }
            where = "kept in memory only"
            if path is not None:
                entries = {**_read(path), key: record}
                text = json.dumps({"format": FORMAT, "tiles": entries}, indent=1)
                try:
                    write_text_atomic(path, text)
                    where = f"cached in {path}" + (" as provisional" if provisional else "")
                except _CACHE_ERRORS as exc:  # a read-only or full cache: tuned again next time
                    where = f"not cached ({exc})"
        what = "re-checked" if due == "recheck" else "tuned"
        log.info(
            "FAVOR+ causal tiles for this machine: chunk %d, segment %d (%s in %.1f s under a "
            "load of %.2f per core from other work, %s; seconds per candidate and round %s; "
            "pin with PROTEIN_PERFORMER_FAVOR_TILES=C,S, re-tune with "
            "PROTEIN_PERFORMER_FAVOR_RETUNE=1)",
            *best,
            what,
            time.perf_counter() - start,
            load,
            where,
            seen,
        )
        return best
