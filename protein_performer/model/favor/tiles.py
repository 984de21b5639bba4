"""The causal scan's tile sizes (chunk, segment), chosen per machine at first use and cached.

Why: the scan's cost is a handful of GEMMs whose shapes the chunk size C (the in-chunk C x C
products against the (M, dv+1) state updates) and the segment size (tokens per scan segment,
i.e. how much stays in cache) set; which pair is fastest depends on the CPU's caches and
vector units, the thread count, the feature count M and the head width (measured on one
2-core machine, 1 thread, 8 heads of 64, m = 272: fwd+bwd at L = 8,192 and 16,384 ran 1.5x
and 1.65x faster with segments of 2,048 tokens than with the former constant 8,192; see
docs/RESULTS.md). A constant is wrong somewhere, so the first large causal call times a few candidates on a problem of
its own shape and the winner is stored in ``favor_tiles.json`` under the cache directory
(``PROTEIN_PERFORMER_CACHE_DIR``, else ``$XDG_CACHE_HOME/protein_performer``, else
``~/.cache/protein_performer``). ``PROTEIN_PERFORMER_FAVOR_TILES=C,S`` pins the pair (no
timing), e.g. for runs that must be bitwise reproducible across machines: tiles change the
order of floating-point sums, not the math (outputs agree to float rounding).

Problems smaller than :data:`TUNE_MIN_TOKENS` (heads x tokens) use :data:`DEFAULT_TILES`:
there the scan is a small share of the model and timing it would cost more than it saves.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from protein_performer.errors import UserError
from protein_performer.io.atomic import write_text_atomic

log = logging.getLogger(__name__)

#: (chunk, segment) for small problems and when nothing was tuned.
DEFAULT_TILES = (128, 8192)
#: Heads x tokens from which the tiles are tuned (a 4k-token, 8-head layer is 32,768).
TUNE_MIN_TOKENS = 32768
CHUNKS = (64, 128, 256)
SEGMENTS = (1024, 2048, 8192)
FORMAT = 1  # the cache file's layout; another value is ignored and re-tuned
_memo: dict[str, tuple[int, int]] = {}
_lock = threading.Lock()


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
    if chunk <= 0 or segment <= 0:
        raise UserError(
            f"PROTEIN_PERFORMER_FAVOR_TILES={text!r}: expected two positive integers "
            "'CHUNK,SEGMENT', e.g. 128,8192"
        )
    return chunk, segment


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


def _key(device: torch.device, M: int, d: int, dv: int, grad: bool) -> str:
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    phase = "fwd+bwd" if grad else "fwd"
    return f"{device.type}|{_processor(device)}|threads={threads}|M={M}|d={d}|dv={dv}|{phase}"


def _read(path: Path) -> dict[str, list[int]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    tiles = data.get("tiles")
    return tiles if isinstance(tiles, dict) else {}


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
    chunks share one pass)."""
    seen: dict[tuple[int, int], float] = {}
    segment = DEFAULT_TILES[1]
    for chunk in CHUNKS:
        seen[chunk, segment] = _time(lambda c=chunk: measure(c, segment), device)
    chunk = min((t, c) for (c, _), t in seen.items())[1]
    for seg in SEGMENTS:
        if (chunk, seg) not in seen:
            seen[chunk, seg] = _time(lambda s=seg: measure(chunk, s), device)
    best = min(seen, key=seen.__getitem__)
    return best, {f"{c},{s}": round(t, 4) for (c, s), t in seen.items()}


def _known(q: torch.Tensor, M: int, dv: int) -> tuple[str, tuple[int, int] | None]:
    """(cache key, the tiles already decided for this call: pinned, small, remembered or
    stored; None when they must be measured). Call with ``_lock`` held."""
    pinned = _pinned()
    if pinned is not None:
        return "", pinned
    BH, L, d = q.shape
    if BH * L < TUNE_MIN_TOKENS:
        return "", DEFAULT_TILES
    key = _key(q.device, M, d, dv, torch.is_grad_enabled() and q.requires_grad)
    if key not in _memo:
        stored = _read(cache_dir() / "favor_tiles.json").get(key)
        if isinstance(stored, list) and [type(x) for x in stored] == [int, int]:
            _memo[key] = (stored[0], stored[1])
    return key, _memo.get(key)


def tiles_in_use(q: torch.Tensor, M: int, dv: int) -> tuple[int, int]:
    """The (chunk, segment) a causal scan over q would run with now, without measuring
    (benchmarks count the chunk's FLOPs with it)."""
    with _lock:
        return _known(q, M, dv)[1] or DEFAULT_TILES


def causal_tiles(
    q: torch.Tensor, M: int, dv: int, probe: Callable[[], Callable[[int, int], None]]
) -> tuple[int, int]:
    """(chunk, segment) for a causal scan over q (BH, L, d) with M features.

    ``probe()`` builds, only when timing is needed, a callable ``(chunk, segment)`` that runs
    one representative scan (8 heads x 4,096 tokens of this shape, with backward when
    gradients are on).
    """
    with _lock:
        key, known = _known(q, M, dv)
        if known is not None:
            return known
        start = time.perf_counter()
        best, seen = _measure(probe(), q.device)
        _memo[key] = best
        path = cache_dir() / "favor_tiles.json"
        tiles = {**_read(path), key: list(best)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps({"format": FORMAT, "tiles": tiles}, indent=1))
            where = f"cached in {path}"
        except OSError as exc:  # a read-only home still runs, it just tunes again next time
            where = f"not cached ({exc.strerror or exc})"
        log.info(
            "FAVOR+ causal tiles for this machine: chunk %d, segment %d (tuned once in %.1f s, "
            "%s; seconds per candidate %s; pin with PROTEIN_PERFORMER_FAVOR_TILES=C,S)",
            *best,
            time.perf_counter() - start,
            where,
            seen,
        )
        return best
