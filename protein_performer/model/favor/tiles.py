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
share of the model and timing it would cost more than it saves. A tuned pair replaces the
default only when it is at least :data:`MARGIN` faster (timings are noisy; a noisy winner would
be kept for good). Processes sharing the cache (torchrun ranks) take turns through a file
lock: one tunes, the others read its result.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from protein_performer.errors import UserError
from protein_performer.io.atomic import exclusive_lock, write_text_atomic

log = logging.getLogger(__name__)

#: (chunk, segment) for small problems and when nothing was tuned.
DEFAULT_TILES = (128, 8192)
#: Tokens per row from which the tiles are tuned (shorter rows pay little for the scan).
TUNE_MIN_LENGTH = 2048
#: Heads x tokens from which the tiles are tuned (a 4k-token, 8-head layer is 32,768).
TUNE_MIN_TOKENS = 32768
#: The largest chunk and segment accepted (pinned, in a config or in the cache): a C x C
#: product per head and chunk, so a chunk of 1e9 asked for hundreds of GB.
MAX_CHUNK, MAX_SEGMENT = 4096, 1 << 20
CHUNKS = (64, 128, 256)
SEGMENTS = (1024, 2048, 8192)
#: How much faster than :data:`DEFAULT_TILES` a tuned pair must be to replace it.
MARGIN = 0.05
FORMAT = 2  # the cache file's layout and candidates; another value is ignored and re-tuned
_memo: dict[str, tuple[int, int]] = {}
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


def _read(path: Path) -> dict[str, tuple[int, int]]:
    """The stored pairs (only candidates: anything else is re-tuned); {} when unreadable."""
    try:
        data = json.loads(path.read_text())
    except (*_CACHE_ERRORS, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    tiles = data.get("tiles")
    valid = [DEFAULT_TILES, *((c, s) for c in CHUNKS for s in SEGMENTS)]
    if not isinstance(tiles, dict):
        return {}
    return {
        k: tuple(v)
        for k, v in tiles.items()
        if isinstance(v, list) and all(type(x) is int for x in v) and tuple(v) in valid
    }  # type(x) is int: [64.0, 1024.0] equals a candidate but would crash every scan


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


def _time(run, device: torch.device, reps: int = 2) -> float:
    """Best of ``reps`` timings of ``run()`` after one warm-up."""
    run()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _measure(measure, device: torch.device) -> tuple[tuple[int, int], dict[str, float]]:
    """Chunk first (at the default segment), then the segment for the best chunk: 5 timings
    instead of the full 3 x 3 grid (the two interact little: the segment only sets how many
    chunks share one pass). The default pair is among them; another wins only by MARGIN."""
    seen: dict[tuple[int, int], float] = {}
    segment = DEFAULT_TILES[1]
    for chunk in CHUNKS:
        seen[chunk, segment] = _time(lambda c=chunk: measure(c, segment), device)
    chunk = min((t, c) for (c, _), t in seen.items())[1]
    for seg in SEGMENTS:
        if (chunk, seg) not in seen:
            seen[chunk, seg] = _time(lambda s=seg: measure(chunk, s), device)
    best = min(seen, key=seen.__getitem__)
    if seen[best] > (1 - MARGIN) * seen[DEFAULT_TILES]:
        best = DEFAULT_TILES
    return best, {f"{c},{s}": round(t, 4) for (c, s), t in seen.items()}


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
            return _read(cache_dir() / "favor_tiles.json").get(key, DEFAULT_TILES)
        except _CACHE_ERRORS:
            return DEFAULT_TILES


def causal_tiles(
    q: torch.Tensor, M: int, dv: int, probe: Callable[[bool], Callable[[int, int], None]]
) -> tuple[int, int]:
    """(chunk, segment) for a causal scan over q (BH, L, d) with M features.

    ``probe(grad)`` builds, only when timing is needed, a callable ``(chunk, segment)`` that
    runs one representative scan (8 heads x 4,096 tokens of this head width, features and
    dtype, with backward when ``grad``: gradients are on and q needs them); both run apart
    from the caller (:func:`_apart`).
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
            stored = _read(path) if path is not None else {}
            if key in stored:
                _memo[key] = stored[key]
                return stored[key]
            start = time.perf_counter()
            best, seen = _apart(lambda: _measure(probe(grad), q.device), grad, q.device)
            _memo[key] = best
            where = "kept in memory only"
            if path is not None:
                tiles = {k: list(v) for k, v in {**_read(path), key: best}.items()}
                text = json.dumps({"format": FORMAT, "tiles": tiles}, indent=1)
                try:
                    write_text_atomic(path, text)
                    where = f"cached in {path}"
                except _CACHE_ERRORS as exc:  # a read-only or full cache: tuned again next time
                    where = f"not cached ({exc})"
        log.info(
            "FAVOR+ causal tiles for this machine: chunk %d, segment %d (tuned once in %.1f s, "
            "%s; seconds per candidate %s; pin with PROTEIN_PERFORMER_FAVOR_TILES=C,S)",
            *best,
            time.perf_counter() - start,
            where,
            seen,
        )
        return best
