#!/usr/bin/env python
"""Fault injection: kill -9 ``train``, ``preprocess``, ``embed`` and ``export`` inside their
writes, and check that the previous or the new complete output is always there and loads.

Each command first writes a complete output once. Every trial then reruns it over that output
(``--overwrite``, or ``ckpt_path=last`` for training) and SIGKILLs it when the output's temporary
file (or temporary directory) reaches a random byte size (uniform up to 1.25 x the output's
size), so most kills land inside the write; a trial whose command finishes first counts as a
miss and must leave the new output. After each kill the output must load (a checkpoint through
the safe loader, a store with ``TokenStore``, embeddings with ``read_embeddings``, an export with
``load_model``) and be either the previous version or a new one; the next trial's run must
remove the temporaries the killed one left.

    python scripts/fault_injection.py                      # 20 trials per command (~10 min)
    python scripts/fault_injection.py --trials 50 --seed 3 --out runs/faults
    python scripts/fault_injection.py --quick              # 2 trials each, seconds to minutes

Prints a table (trials, kills inside a write, misses, outcomes) and writes ``report.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _checks
import numpy as np

#: A small model whose checkpoint (~10 MB with the optimizer) takes several 1 MiB writes.
MODEL = {"dim": 128, "depth": 4, "heads": 4, "ff_dim": 512, "nb_features": 32}
TRAIN = ["experiment=demo", *(f"model.config.{k}={v}" for k, v in MODEL.items()),
         "data.limit_records=200", "data.max_len=128", "data.max_tokens=1024",
         "data.num_workers=0", "trainer.max_epochs=-1",
         "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
         "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
         "callbacks.progress_bar=null", "callbacks.training_curve=null", "logger=csv",
         "run_name=faults"]


@dataclass
class Trial:
    """One kill: where it landed and what was left."""

    command: str
    index: int
    target_bytes: int
    killed: bool = False  # False: the command finished before reaching the target
    in_write: bool = False  # a temporary existed at the kill and was never published
    temp_bytes: int = 0
    outcome: str = ""  # previous | new | BROKEN
    detail: str = ""
    stale_cleaned: bool | None = None  # did the next run remove what this one left?


@dataclass
class Scenario:
    """A command, the output it replaces, and how to check that output."""

    name: str
    output: Path
    args: Callable[[Any], Sequence[object]]  # the command's arguments, given the fingerprint
    fingerprint: Callable[[Path], Any]  # raises if the output is missing or does not load


def _temps(output: Path, pid: int | None = None) -> list[str]:
    """Names of ``output``'s temporaries (files or directories; of process ``pid`` only, if
    given: their names carry the writer's pid)."""
    from protein_performer.io.atomic import temp_prefix

    prefix = f".{output.name}." if pid is None else temp_prefix(output, pid)
    found = output.parent.glob(f"{prefix}*.tmp*")  # nothing while the folder does not exist
    return sorted(p.name for p in found if not p.name.endswith(".lock"))


def _temp_size(output: Path, pid: int) -> int:
    """Bytes process ``pid`` has written so far to ``output``'s temporaries."""
    found = 0
    for name in _temps(output, pid):
        with contextlib.suppress(OSError):  # published or removed meanwhile
            found += _size(output.parent / name)
    return found


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def run_and_kill(trial: Trial, argv: list[str], output: Path, log: Path) -> Trial:
    """Run ``argv``; SIGKILL it once ``output``'s temporary holds ``trial.target_bytes`` bytes
    (or after 300 s)."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=fh, env=_checks.ENV, cwd=log.parent)
        deadline = time.monotonic() + 300
        while proc.poll() is None:
            size = _temp_size(output, proc.pid)
            if size >= trial.target_bytes or time.monotonic() > deadline:
                proc.kill()
                trial.killed = True
                trial.temp_bytes = size
                break
            time.sleep(0.0005)
        proc.wait()
    trial.in_write = trial.killed and trial.temp_bytes > 0 and bool(_temps(output, proc.pid))
    return trial


def _random_fasta(path: Path, records: int, length: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", dtype=np.uint8)
    with open(path, "w") as fh:
        for i in range(records):
            n = int(rng.integers(length // 2, length * 3 // 2))
            fh.write(f">seq{i}\n{letters[rng.integers(0, 20, n)].tobytes().decode()}\n")
    return path


def _train(work: Path, quick: bool) -> Scenario:
    """Resumed training (``ckpt_path=last``, 3 steps more each time; the first run starts)."""
    from protein_performer.io.checkpoints import load_lightning

    return Scenario("train", work / "outputs" / "demo" / "faults" / "checkpoints" / "last.ckpt",
                    lambda step: ["train", *TRAIN,
                                  f"trainer.max_steps={2 if step is None else step + 3}",
                                  "ckpt_path=last"],
                    lambda last: int(load_lightning(last)["global_step"]))  # fmt: skip


def _preprocess(work: Path, quick: bool) -> Scenario:
    from protein_performer.data.store import TokenStore

    fasta = _random_fasta(work / "big.fasta", 20_000 if quick else 60_000, 400, 0)
    args = ["preprocess", fasta, "--out", work / "store", "--overwrite", "--no-progress",
            "--workers", "1"]  # fmt: skip
    return Scenario("preprocess", work / "store", lambda _: args,
                    lambda store: TokenStore(store).lengths.tolist())


def _model(work: Path) -> Path:
    """An export of the training scenario's model size (made once, shared)."""
    if not (work / "model").exists():
        from protein_performer.model.config import PerformerConfig

        _checks.tiny_export(work / "model", PerformerConfig(**MODEL))
    return work / "model"


def _embed(work: Path, quick: bool) -> Scenario:
    import protein_performer as pp

    fasta = _random_fasta(work / "emb.fasta", 60 if quick else 200, 300, 1)
    out = work / "emb.h5"
    args = ["embed", _model(work), fasta, out, "--include", "per_tok", "mean", "--overwrite",
            "--no-progress", "--device", "cpu"]  # fmt: skip
    # Every array read back; the size tells a new file from the previous one.
    return Scenario("embed", out, lambda _: args,
                    lambda h5: (len(pp.read_embeddings(h5, kind="per_tok")[0]), h5.stat().st_size))


def _export(work: Path, quick: bool) -> Scenario:
    from protein_performer.interop.loading import load_model

    args = ["export", _model(work), work / "exported", "--overwrite"]
    return Scenario("export", work / "exported", lambda _: args,
                    lambda out: sum(float(p.detach().double().sum())
                                    for p in load_model(out, "cpu").model.parameters()))


SCENARIOS = {"train": _train, "preprocess": _preprocess, "embed": _embed, "export": _export}


def run_scenario(s: Scenario, trials: int, rng: np.random.Generator, log: Path) -> list[Trial]:
    done: list[Trial] = []
    _checks.setup(*s.args(None), cwd=log.parent)
    previous = s.fingerprint(s.output)
    for i in range(trials):
        full = _size(s.output)
        # Mostly inside the write; one draw in five beyond its end, so that some runs finish
        # and publish a new output (the second branch of "previous or new").
        target = int(rng.integers(1, max(2, full * 5 // 4)))
        left_before = _temps(s.output)
        trial = run_and_kill(Trial(s.name, i, target), _checks.cli(*s.args(previous)), s.output,
                             log)  # fmt: skip
        if done:  # this run started over what the last kill left: were those removed?
            done[-1].stale_cleaned = not (set(left_before) & set(_temps(s.output)))
        try:
            now = s.fingerprint(s.output)
            trial.outcome = "previous" if now == previous else "new"
            previous = now
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            trial.outcome = "BROKEN"
            trial.detail = f"{type(exc).__name__}: {str(exc)[:300]}"
        done.append(trial)
        landed = f"killed at {trial.temp_bytes:,} B" if trial.killed else "finished first"
        inside = " inside the write" if trial.in_write else ""
        print(f"  {s.name} #{i}: target {target:,} B, {landed}{inside} -> {trial.outcome}",
              flush=True)  # fmt: skip
    if done:
        subprocess.run(_checks.cli(*s.args(previous)), cwd=log.parent, env=_checks.ENV,
                       capture_output=True)  # fmt: skip
        done[-1].stale_cleaned = not _temps(s.output)
    return done


def summarize(results: list[Trial]) -> dict[str, dict[str, int]]:
    """Per command: trials, kills inside a write, misses, outcomes, temporaries left behind."""
    columns = ("trials", "in_write", "missed", "previous", "new", "broken", "stale_left")
    table: dict[str, dict[str, int]] = {}
    for t in results:
        row = table.setdefault(t.command, dict.fromkeys(columns, 0))
        row["trials"] += 1
        row["in_write"] += t.in_write
        row["missed"] += not t.killed
        row[t.outcome.lower()] += 1
        row["stale_left"] += t.stale_cleaned is False
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=None,
                   help="kills per command (default: 20; --quick: 2)")
    p.add_argument("--commands", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="2 trials per command, smaller inputs")
    args = p.parse_args(argv)
    trials = args.trials or (2 if args.quick else 20)
    work = _checks.work_dir(args.out, "pp-faults-")
    rng = np.random.default_rng(args.seed)
    results: list[Trial] = []
    for name in args.commands:
        print(f"{name}: preparing the first complete output", flush=True)
        results += run_scenario(SCENARIOS[name](work, args.quick), trials, rng,
                                work / f"{name}.log")
    table = summarize(results)
    print(f"\n{'command':<11}" + "".join(f"{k:>11}" for k in next(iter(table.values()))))
    for name, row in table.items():
        print(f"{name:<11}" + "".join(f"{v:>11}" for v in row.values()))
    report = {"seed": args.seed, "trials": [asdict(t) for t in results], "summary": table}
    _checks.write_report(work, report)
    print(f"report: {work / 'report.json'}")
    broken = sum(row["broken"] + row["stale_left"] for row in table.values())
    if args.out is None and not broken:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
