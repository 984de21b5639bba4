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
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: The repository checkout this script belongs to.
REPO = Path(__file__).resolve().parents[1]

COMMANDS = ("train", "preprocess", "embed", "export")
#: A small model whose checkpoint (~10 MB with the optimizer) takes several 1 MiB writes.
MODEL = ["model.config.dim=128", "model.config.depth=4", "model.config.heads=4",
         "model.config.ff_dim=512", "model.config.nb_features=32"]
TRAIN = ["experiment=demo", *MODEL, "data.limit_records=200", "data.max_len=128",
         "data.max_tokens=1024", "data.num_workers=0", "trainer.max_epochs=-1",
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
    argv: Callable[[int], list[str]]
    fingerprint: Callable[[], Any]  # raises if the output is missing or does not load
    extra: dict[str, Any] = field(default_factory=dict)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "protein_performer.cli.main", *args]


def _temps(output: Path, pid: int | None = None) -> list[str]:
    """Names of ``output``'s temporaries (files or directories; of process ``pid`` only, if
    given: their names carry the writer's pid)."""
    from protein_performer.io.atomic import temp_prefix

    prefix = f".{output.name}." if pid is None else temp_prefix(output, pid)
    try:
        names = [p.name for p in output.parent.iterdir()]
    except OSError:
        return []
    return sorted(n for n in names
                  if n.startswith(prefix) and ".tmp" in n and not n.endswith(".lock"))


def _temp_size(output: Path, pid: int) -> int | None:
    """Bytes process ``pid`` has written so far to ``output``'s temporaries, None if it has
    none."""
    found = None
    for name in _temps(output, pid):
        with contextlib.suppress(OSError):  # published or removed meanwhile
            found = (found or 0) + _size(output.parent / name)
    return found


def run_and_kill(argv: list[str], output: Path, target: int, timeout: float, log: Path,
                 cwd: Path) -> Trial:
    """Run ``argv``; SIGKILL it once ``output``'s temporary holds ``target`` bytes."""
    trial = Trial("", 0, target)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=fh, env=env, cwd=cwd)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            size = _temp_size(output, proc.pid)
            if (size is not None and size >= target) or time.monotonic() > deadline:
                proc.kill()
                trial.killed = True
                trial.temp_bytes = size or 0
                break
            time.sleep(0.0005)
        proc.wait()
    trial.in_write = trial.killed and trial.temp_bytes > 0 and bool(_temps(output, proc.pid))
    return trial


def _train(work: Path) -> Scenario:
    run_dir = work / "outputs" / "demo" / "faults"
    last = run_dir / "checkpoints" / "last.ckpt"
    state = {"step": 2}

    def fingerprint() -> int:
        from protein_performer.io.checkpoints import load_lightning

        return int(load_lightning(last)["global_step"])

    def argv(_: int) -> list[str]:
        return _cli("train", *TRAIN, f"trainer.max_steps={state['step'] + 3}", "ckpt_path=last")

    subprocess.run(_cli("train", *TRAIN, "trainer.max_steps=2"), cwd=work, check=True,
                   capture_output=True)  # fmt: skip
    return Scenario("train", last, argv, fingerprint, {"state": state})


def _write_fasta(path: Path, records: int, length: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", dtype=np.uint8)
    with open(path, "w") as fh:
        for i in range(records):
            n = int(rng.integers(length // 2, length * 3 // 2))
            fh.write(f">seq{i}\n{letters[rng.integers(0, 20, n)].tobytes().decode()}\n")


def _preprocess(work: Path, quick: bool) -> Scenario:
    fasta = work / "big.fasta"
    _write_fasta(fasta, 20_000 if quick else 60_000, 400, 0)
    store = work / "store"

    def fingerprint() -> int:
        from protein_performer.data.store import TokenStore

        s = TokenStore(store)
        return int(len(s)) + int(s.lengths.sum())

    def argv(_: int) -> list[str]:
        return _cli("preprocess", str(fasta), "--out", str(store), "--overwrite",
                    "--no-progress", "--workers", "1")  # fmt: skip

    subprocess.run(argv(0), cwd=work, check=True, capture_output=True)
    return Scenario("preprocess", store, argv, fingerprint)


def _model(work: Path) -> Path:
    """An export of the training scenario's model size (made once, shared)."""
    model = work / "model"
    if not model.exists():
        import torch

        from protein_performer.data.tokenizer import Alphabet
        from protein_performer.interop.export import export_model
        from protein_performer.interop.record import LoadedModel
        from protein_performer.model.config import PerformerConfig
        from protein_performer.model.performer import PerformerLM

        torch.manual_seed(0)
        config = PerformerConfig(dim=128, depth=4, heads=4, ff_dim=512, nb_features=32)
        loaded = LoadedModel(PerformerLM(config), config, Alphabet(), model, torch.device("cpu"),
                             "export")
        export_model(loaded, model)
    return model


def _embed(work: Path, quick: bool) -> Scenario:
    fasta = work / "emb.fasta"
    _write_fasta(fasta, 60 if quick else 200, 300, 1)
    out = work / "emb.h5"
    model = _model(work)

    def fingerprint() -> tuple[int, int]:
        import protein_performer as pp

        ids, _ = pp.read_embeddings(out, kind="per_tok")  # every array read back
        return len(ids), out.stat().st_size

    def argv(_: int) -> list[str]:
        return _cli("embed", str(model), str(fasta), str(out), "--include", "per_tok", "mean",
                    "--overwrite", "--no-progress", "--device", "cpu")  # fmt: skip

    subprocess.run(argv(0), cwd=work, check=True, capture_output=True)
    return Scenario("embed", out, argv, fingerprint)


def _export(work: Path) -> Scenario:
    out = work / "exported"
    model = _model(work)

    def fingerprint() -> float:
        from protein_performer.interop.loading import load_model

        loaded = load_model(out, "cpu")
        return float(sum(float(p.detach().double().sum()) for p in loaded.model.parameters()))

    def argv(_: int) -> list[str]:
        return _cli("export", str(model), str(out), "--overwrite")

    subprocess.run(argv(0), cwd=work, check=True, capture_output=True)
    return Scenario("export", out, argv, fingerprint)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def run_scenario(s: Scenario, trials: int, rng: np.random.Generator, log: Path) -> list[Trial]:
    done: list[Trial] = []
    previous = s.fingerprint()
    for i in range(trials):
        full = _size(s.output)
        # Mostly inside the write; one draw in five beyond its end, so that some runs finish
        # and publish a new output (the second branch of "previous or new").
        target = int(rng.integers(1, max(2, full * 5 // 4)))
        left_before = _temps(s.output)
        trial = run_and_kill(s.argv(i), s.output, target, 300, log, log.parent)
        trial.command, trial.index = s.name, i
        if done:  # this run started over what the last kill left: were those removed?
            done[-1].stale_cleaned = not (set(left_before) & set(_temps(s.output)))
        try:
            now = s.fingerprint()
            trial.outcome = "previous" if now == previous else "new"
            previous = now
            if "state" in s.extra:
                s.extra["state"]["step"] = int(now)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            trial.outcome = "BROKEN"
            trial.detail = f"{type(exc).__name__}: {str(exc)[:300]}"
        done.append(trial)
        print(
            f"  {s.name} #{i}: target {target:,} B, "
            + (f"killed at {trial.temp_bytes:,} B" if trial.killed else "finished first")
            + (" inside the write" if trial.in_write else "")
            + f" -> {trial.outcome}",
            flush=True,
        )
    if done:
        subprocess.run(s.argv(trials), cwd=log.parent, capture_output=True)
        done[-1].stale_cleaned = not _temps(s.output)
    return done


def summarize(results: list[Trial]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for t in results:
        row = table.setdefault(
            t.command,
            {"trials": 0, "in_write": 0, "missed": 0, "previous": 0, "new": 0, "broken": 0,
             "stale_left": 0},
        )  # fmt: skip
        row["trials"] += 1
        row["in_write"] += t.in_write
        row["missed"] += not t.killed
        row[t.outcome.lower() if t.outcome != "BROKEN" else "broken"] += 1
        row["stale_left"] += t.stale_cleaned is False
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=None,
                   help="kills per command (default: 20; --quick: 2)")
    p.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS))
    p.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="2 trials per command, smaller inputs")
    args = p.parse_args(argv)
    trials = args.trials or (2 if args.quick else 20)
    work = args.out or Path(__import__("tempfile").mkdtemp(prefix="pp-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    makers = {"train": lambda: _train(work), "preprocess": lambda: _preprocess(work, args.quick),
              "embed": lambda: _embed(work, args.quick), "export": lambda: _export(work)}
    results: list[Trial] = []
    for name in args.commands:
        print(f"{name}: preparing the first complete output", flush=True)
        results += run_scenario(makers[name](), trials, rng, work / f"{name}.log")
    table = summarize(results)
    print(f"\n{'command':<11}" + "".join(f"{k:>11}" for k in next(iter(table.values()))))
    for name, row in table.items():
        print(f"{name:<11}" + "".join(f"{v:>11}" for v in row.values()))
    report = {"seed": args.seed, "trials": [asdict(t) for t in results], "summary": table}
    (work / "report.json").write_text(json.dumps(report, indent=1))
    print(f"report: {work / 'report.json'}")
    broken = sum(row["broken"] + row["stale_left"] for row in table.values())
    if args.out is None and not broken:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
