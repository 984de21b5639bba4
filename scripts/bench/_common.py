"""What the benchmarks share: the preamble every benchmark starts from, and the helpers of the
fresh-process ones (``bench_attention.py``, ``bench_train.py``, ``bench_embed.py``, ...).

Benchmarks are run as ``python scripts/bench/X.py`` from anywhere: Python puts this directory
first on ``sys.path``, so ``import _common`` works with no path edits, and ``protein_performer``
imports from the installed (editable) package.

The preamble: ``REPO`` (the checkout), ``SEQUENCES`` (the shared data sets beside it) and
:func:`setup_logging` (INFO to stderr); what several benchmarks measure with or write: a seeded
random model (:func:`random_lm`, :func:`random_clm`, :func:`random_export`), titin, CSV rows and
the markdown report.

The benchmark protocol: the parent re-invokes the script with ``--case JSON`` once per case
(peak memory is only meaningful in a fresh process, and a case that runs too long is killed by a
timeout instead of hanging the run); the child prints one ``RESULT {...}`` line per measurement.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

#: The repository checkout this script belongs to.
REPO = Path(__file__).resolve().parents[2]
#: The shared sequence data sets that sit beside the checkout (``../shared/data/sequences``).
SEQUENCES = REPO.parent / "shared" / "data" / "sequences"
#: The long proteins of the shared data, titin (34,350 aa) among them.
LONG_PROTEINS = SEQUENCES / "long_proteins.fasta"
#: The log line of every script unless it asks for another.
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
#: The log line of the long-running studies and benchmarks: when each step happened.
TIMED_LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"


def setup_logging(fmt: str = LOG_FORMAT) -> None:
    """INFO and above to stderr (stdout stays free for results)."""
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr)


def titin(fasta: Path = LONG_PROTEINS) -> str | None:
    """Titin's sequence (the record whose id names TITIN) from ``fasta``; None without one."""
    from protein_performer.data.fasta import read_fasta

    if fasta.is_file():
        for rec in read_fasta(fasta):
            if "TITIN" in rec.id.upper():
                return rec.sequence
    return None


def verdict(ok: bool) -> str:
    """How every script's target table marks a measured target."""
    return "PASS" if ok else "FAIL"


# --------------------------------------------------------------------------------------------
# Benchmarks: the child/parent protocol
# --------------------------------------------------------------------------------------------

RESULT_MARK = "RESULT "
#: Exit status of a child that :class:`PeakSampler` stopped at the memory limit.
MEM_LIMIT_EXIT = 3


# --------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------


def start_case(case: dict[str, Any]) -> int | None:
    """What a child does first: its torch threads (``case["threads"]``, 0 or absent: torch's
    default); returns the :class:`PeakSampler` limit in bytes, None on CUDA (its allocator
    raises ``OutOfMemoryError`` itself) or without ``case["mem_limit_gib"]``."""
    import torch

    if case.get("threads"):
        torch.set_num_threads(int(case["threads"]))
    if case["device"] == "cpu" and case.get("mem_limit_gib"):
        return int(case["mem_limit_gib"] * 2**30)
    return None


def emit(payload: dict[str, Any]) -> None:
    """One machine-readable line; libraries may print other lines to stdout."""
    sys.stdout.write(RESULT_MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


class PeakSampler:
    """Tracks the peak RSS of this process from a background thread.

    Why: ``ru_maxrss`` cannot be reset between phases, so a phase whose peak stays below an
    earlier transient (e.g. during ``import torch``) would be invisible to it. The sampler also
    enforces the memory limit, turning a would-be OOM kill of the shared machine into a clean
    ``oom`` record.
    """

    def __init__(self, limit_bytes: int | None, interval_s: float = 0.001) -> None:
        import psutil

        self._proc = psutil.Process()
        self._limit = limit_bytes
        self._interval = interval_s
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            if rss > self.peak:
                self.peak = rss
            if self._limit is not None and rss > self._limit:
                emit({"status": "oom", "note": f"RSS {rss / 2**30:.2f} GiB over the limit"})
                os._exit(MEM_LIMIT_EXIT)
            time.sleep(self._interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        self.peak = self._proc.memory_info().rss


def maxrss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def release_free_memory() -> None:
    """Give freed heap back to the OS, so one phase's leftovers do not raise the next baseline.

    Why: glibc keeps freed blocks in its arenas; without a trim the fwd+bwd phase would start from
    the RSS the fwd phase left behind and its peak delta would read too low.
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        import contextlib
        import ctypes

        with contextlib.suppress(OSError, AttributeError):  # not glibc (e.g. musl): no trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def time_phase(step: Callable[[], Any], device: Any, repeats: int,
               budget_s: float = math.inf) -> tuple[float, float, int]:
    """(median, best, repeats) seconds of ``step``: one warm-up call, then up to ``repeats``
    timed calls or until ``budget_s`` is spent (CUDA synchronized around each).

    A warm-up longer than ``budget_s`` is itself the measurement (repeats = 0): at such sizes the
    first-call overhead is negligible and a second run would double the cost of the longest cases.
    """
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    step()  # warm-up: first call allocates, JIT-selects kernels, faults in pages
    sync()
    warm = time.perf_counter() - t0
    if warm >= budget_s:
        return warm, warm, 0
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < budget_s):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times[0], len(times)


def start_phase(sampler: PeakSampler, device: Any) -> Callable[[], int]:
    """Begin a measured phase; returns a function giving its peak memory in bytes so far.

    CPU: the peak RSS since now minus the RSS now, from ``ru_maxrss`` when the phase raised it
    (exact), otherwise from ``sampler``. CUDA: ``torch.cuda.max_memory_allocated`` minus the
    allocation now. Freed heap (and the CUDA cache) is released first.
    """
    release_free_memory()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        return lambda: torch.cuda.max_memory_allocated(device) - base
    sampler.reset()
    base = sampler.peak
    maxrss_before = maxrss_bytes()

    def cpu_peak() -> int:
        maxrss = maxrss_bytes()
        return max(sampler.peak, maxrss if maxrss > maxrss_before else 0) - base

    return cpu_peak


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def spawn_case(script: str | Path, case: dict[str, Any],
               timeout: float) -> tuple[list[dict[str, Any]], str]:
    """Run ``script --case JSON`` in a fresh interpreter; its RESULT payloads and a failure note.

    The payloads printed before a timeout are kept (a child may report after every step).
    """
    cmd = [sys.executable, str(Path(script).resolve()), "--case", json.dumps(case)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, note = proc.stdout, ""
        if proc.returncode not in (0, MEM_LIMIT_EXIT):
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
            note = f"exit {proc.returncode}: {tail}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        note = f"timeout after {timeout:.0f} s"
    results = [
        json.loads(line[len(RESULT_MARK) :])
        for line in out.splitlines()
        if line.startswith(RESULT_MARK)
    ]
    return results, note


def failure(results: list[dict[str, Any]], note: str) -> tuple[str, str]:
    """Status and reason of a case that measured nothing: ``oom`` (a child's record says so),
    ``timeout`` or ``error`` (from :func:`spawn_case`'s note)."""
    oom = [r for r in results if r.get("status") == "oom"]
    if oom:
        return "oom", oom[0].get("note") or "no result"
    return ("timeout" if "timeout" in note else "error"), note or "no result"


def default_mem_limit_gib() -> float:
    import psutil

    return round(0.6 * psutil.virtual_memory().available / 2**30, 1)


def write_rows_csv(rows: Iterable[Any], path: Path, row_type: type) -> None:
    """Rows of the dataclass ``row_type`` as CSV, one column per field in declaration order."""
    write_dicts_csv([asdict(row) for row in rows], path, [f.name for f in fields(row_type)])


def write_dicts_csv(rows: list[dict[str, Any]], path: Path,
                    fieldnames: Iterable[str] | None = None) -> None:
    """Dict rows as CSV: the columns ``fieldnames`` (default: the first row's keys; ``L`` when
    there is no row), other keys dropped."""
    fields = list(fieldnames or (rows[0] if rows else ["L"]))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_report(path: Path, lines: list[str]) -> None:
    """The markdown report: written to ``path`` (its directory created) and printed."""
    report = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report)
    print(report)


def random_lm(source: str = "random", **config: Any) -> Any:
    """A ``LoadedModel`` of a seeded random ``PerformerLM(PerformerConfig(**config))`` in eval
    mode on the CPU: speed, memory and storage do not depend on trained weights."""
    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(0)
    cfg = PerformerConfig(**config)
    return LoadedModel(PerformerLM(cfg).eval(), cfg, Alphabet(), Path(source),
                       torch.device("cpu"), "memory")


def random_export(path: Path, **config: Any) -> Path:
    """:func:`random_lm` exported to ``path`` (what the CLI and ``protein_performer.load``
    read)."""
    from protein_performer.interop.export import export_model

    return export_model(random_lm(**config), path)


#: The ESM-2 8M shape: what the decoding benchmarks time (:func:`random_clm`).
ESM2_8M = {"dim": 320, "depth": 6, "heads": 20, "ff_dim": 1280}


def random_clm(shape: dict[str, int] = ESM2_8M, **config: Any) -> Any:
    """The ``ProteinLM`` (what ``protein_performer.load`` returns) of a causal :func:`random_lm`
    of ``shape``, with ``config`` over the default FAVOR+ config."""
    from protein_performer.inference.api import ProteinLM

    return ProteinLM(random_lm(**shape, objective="clm", **config))


def bench_parser(doc: str, epilog: str, out: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, with ``--out`` and ``--device``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=epilog)
    p.add_argument("--out", type=Path, default=Path(out), help="output directory")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    return p


def add_mem_limit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mem-limit-gib", type=float, default=0.0,
                   help="CPU: abort a case as 'oom' above this RSS (default 60%% of available)")


def add_final_args(p: argparse.ArgumentParser, quick_help: str) -> None:
    """``--seed``, ``--quick`` and the hidden ``--case JSON`` that makes a process a child."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)


def dispatch(args: argparse.Namespace, run_case: Callable[[dict[str, Any]], Any],
             run_parent: Callable[[argparse.Namespace], int]) -> int:
    """Log to stderr; a child (``--case JSON``) runs its case, the parent creates ``--out`` and
    runs every case (``run_parent``). Returns the exit status."""
    setup_logging(TIMED_LOG_FORMAT)
    if args.case is not None:
        run_case(json.loads(args.case))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    return run_parent(args)
