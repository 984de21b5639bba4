"""How many CPU threads a command uses by default, and the one line that says so.

torch's default is one intra-op thread per CPU the machine has. On a machine other processes
keep busy that collapses: OpenMP threads wait for each other at every op, so a thread that
loses its core stalls the others (measured in docs/RESULTS.md, issue 23). So the commands
default to the cores this process may use (its CPU affinity, one thread per physical core),
less the processes running on it right now when the whole machine is visible (a shared node;
under a scheduler that binds the process to its CPUs, those CPUs are its own), at least 1.
"Right now" is the kernel's count of runnable tasks (``/proc/loadavg``), not the 1-minute
load average, which would still count a command that just finished.
``OMP_NUM_THREADS`` and ``--threads N`` override it. Training chooses the same way (its key is
``threads=N``), counting its DataLoader worker processes against the same cores.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity; every CPU where that is unknown)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int]) -> int:
    """Physical cores among ``cpus`` (hyper-threads share one), from Linux's topology files;
    the number of CPUs where those are missing."""
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def default_threads(reserve: int = 0) -> tuple[int, str]:
    """(threads, why) for a command given no ``--threads``; ``reserve`` cores are left to this
    command's own helper processes (DataLoader workers), at least 1 thread still."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return clamp_threads(int(env), "OMP_NUM_THREADS"), "OMP_NUM_THREADS"
    cpus = usable_cpus()
    cores = physical_cores(cpus)
    workers = f", less {reserve} data worker(s)" if reserve else ""
    if len(cpus) < (os.cpu_count() or len(cpus)):
        return max(1, cores - reserve), f"the {cores} core(s) this process is bound to{workers}"
    others = running_elsewhere()
    if others is None:
        return max(1, cores - reserve), f"{cores} core(s){workers}"
    n = max(1, min(cores, cores - others - reserve))
    if others == 0 or n == cores:
        return n, f"{cores} core(s), {others} other process(es) running{workers}"
    return n, f"{cores} core(s), less {others} other process(es) running now{workers}"


def running_elsewhere() -> int | None:
    """Tasks running or runnable now besides this one (``/proc/loadavg``'s fourth field);
    None where the kernel does not say."""
    try:
        running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        return max(0, int(running) - 1)
    except (OSError, IndexError, ValueError):
        return None


def set_threads(requested: int | None, *, flag: str = "--threads N", reserve: int = 0) -> str:
    """Set torch's intra-op threads (``requested``, else :func:`default_threads` leaving
    ``reserve`` cores) and return the line that says how many and why, or how to change it
    (``flag``: the command's own way to ask)."""
    import torch

    if requested is not None:
        requested = clamp_threads(requested, flag.split()[0].rstrip("=N"))
        torch.set_num_threads(requested)
        return f"threads: {requested} ({flag})"
    n, why = default_threads(reserve)
    torch.set_num_threads(n)
    return f"threads: {n} ({why}); change with {flag}"


def clamp_threads(n: int, source: str) -> int:
    """``n`` threads at most one per CPU this process may use, with one warning: far more
    threads than CPUs only wait for each other (``--threads 5000`` ran a 1 s job in 33 s), and
    OpenMP crashed on 100,000 (exit 139, no message)."""
    limit = len(usable_cpus())
    if n <= limit:
        return n
    log.warning("%s=%d is more than the %d CPU(s) this process may use: using %d threads",
                source, n, limit, limit)  # fmt: skip
    return limit
