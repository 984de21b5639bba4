#!/usr/bin/env python
"""Training steps/s of `experiment=demo` beside a CPU hog: the chosen threads against torch's.

What is measured: ``train(cfg)`` of ``experiment=demo`` (the README's CPU demo, with its 2
DataLoader workers) for ``--steps`` optimizer steps, with ``--hogs`` single-thread busy loops
running beside it (another user's job on a shared machine). Steps/s is counted from the end of
step ``--warmup`` to the end of the last step (no start-up, no validation: it runs once, after
the last step). Two variants, interleaved in every repeat so a drifting load hits both alike:

- ``default``: what ``train`` does now, threads from the free cores less the data workers
  (``io/threads.py``; the chosen number is in the row);
- ``former``: ``threads=T`` with T the intra-op threads torch starts with (one per core), what
  ``train`` left in place before it chose.

Every case runs in a fresh process (this script with ``--case JSON``), so the threads one case
sets never reach the next. The row records the machine's runnable-task count (``/proc/loadavg``)
just before the case started, hogs included, as what else was running.

Examples::

    python scripts/bench/bench_train_threads.py --quick              # 8 steps, one repeat
    python scripts/bench/bench_train_threads.py --steps 40 --repeats 3 --hogs 1
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common

log = logging.getLogger("bench_train_threads")

VARIANTS = ("default", "former")
#: A single-threaded busy loop: one core's worth of someone else's work.
HOG = "while True:\n    pass\n"


def step_timer(warmup: int, fields: dict[str, Any]) -> Any:
    """Hydra target of the case's extra callback: times the end of step ``warmup`` and of the
    last step, and emits the RESULT (``fields`` plus steps/s and the threads it ran with) when
    training ends. Lightning is imported here, not at ``--help``."""
    import torch
    from pytorch_lightning import Callback

    class StepTimer(Callback):
        t0: float | None = None
        t1: float | None = None
        steps = 0

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            now = time.perf_counter()
            if trainer.global_step == warmup:
                self.t0 = now
            elif self.t0 is not None:
                self.t1, self.steps = now, trainer.global_step - warmup

        def on_train_end(self, trainer: Any, *args: Any) -> None:
            if self.t0 is not None and self.t1 is not None:
                common.emit({**fields, "threads": torch.get_num_threads(), "steps": self.steps,
                             "steps_per_s": self.steps / (self.t1 - self.t0)})  # fmt: skip

    return StepTimer()


def run_case(case: dict[str, Any]) -> None:
    """Child: one training run of the demo (the package's ``train(cfg)``, as the CLI runs it)."""
    import torch
    from omegaconf import open_dict

    from protein_performer.training.compose import compose_config
    from protein_performer.training.train import train

    torch_default = torch.get_num_threads()  # before anything sets it: torch's own choice
    fields = {"variant": case["variant"], "repeat": case["repeat"], "torch_default": torch_default}
    overrides = [
        "experiment=demo", f"trainer.max_steps={case['steps']}",
        f"trainer.val_check_interval={case['steps']}", "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar", "trainer.enable_model_summary=false", f"seed={case['seed']}",
        "+callbacks.step_timer._target_=bench_train_threads.step_timer",
        f"+callbacks.step_timer.warmup={case['warmup']}",
    ]  # fmt: skip
    if case["variant"] == "former":
        overrides.append(f"threads={torch_default}")
    os.environ.setdefault("PROTEIN_PERFORMER_EXTRA_TARGETS", "bench_train_threads.")
    with tempfile.TemporaryDirectory() as out:
        cfg = compose_config(overrides, output_dir=Path(out) / "run")
        with open_dict(cfg):
            cfg.callbacks.step_timer.fields = fields
        train(cfg)


def _runnable() -> int | None:
    from protein_performer.io.threads import running_elsewhere

    others = running_elsewhere()
    return None if others is None else others + 1


def run_parent(args: Any) -> int:
    rows: list[dict[str, Any]] = []
    steps, warmup = (8, 3) if args.quick else (args.steps, args.warmup)
    for repeat in range(1 if args.quick else args.repeats):
        for variant in VARIANTS:
            hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
            try:
                time.sleep(0.5)  # let the hogs reach the run queue before the case looks
                running = _runnable()
                case = {"variant": variant, "repeat": repeat, "steps": steps, "warmup": warmup,
                        "seed": args.seed}  # fmt: skip
                results, note = common.spawn_case(__file__, case, args.timeout)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            if not results:
                log.warning("%s repeat %d: %s", variant, repeat, note or "no result")
                continue
            row = {**results[-1], "hogs": args.hogs, "runnable_before": running}
            log.info("%s", row)
            rows.append(row)
    fields = ["variant", "repeat", "threads", "torch_default", "steps", "steps_per_s", "hogs",
              "runnable_before"]  # fmt: skip
    with (args.out / "train_threads.csv").open("w") as fh:
        fh.write(",".join(fields) + "\n")
        for row in rows:
            fh.write(",".join(str(row[k]) for k in fields) + "\n")
    for variant in VARIANTS:
        rates = [r["steps_per_s"] for r in rows if r["variant"] == variant]
        if rates:
            chosen = sorted({r["threads"] for r in rows if r["variant"] == variant})
            print(f"{variant}: median {statistics.median(rates):.3f} steps/s over {len(rates)} "
                  f"run(s), threads {chosen}, {args.hogs} hog(s)")  # fmt: skip
    return 0 if len(rows) == 2 * (1 if args.quick else args.repeats) else 1


def main() -> int:
    p = common.bench_parser(__doc__, "", ".bench/train_threads")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="steps before the clock starts")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats of both variants")
    p.add_argument("--hogs", type=int, default=1, help="single-thread busy loops beside it")
    p.add_argument("--timeout", type=float, default=600, help="seconds per case")
    common.add_final_args(p, "8 steps, one repeat (a smoke run)")
    args = p.parse_args()
    if args.case is None and args.warmup >= args.steps and not args.quick:
        p.error("--warmup must be below --steps")
    return common.dispatch(args, run_case, run_parent)


if __name__ == "__main__":
    sys.exit(main())
