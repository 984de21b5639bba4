"""What the studies share: plan runs, train each through the real ``protein-performer train``
under a step or time budget, collect, tabulate; the parsers, tables, CSV, markdown and figures
of every study; and the unigram baseline and Spearman rho.

A study is a plan (``args -> [Run]``) and a table (``rows -> markdown``); this module does the
rest. Every run is a fresh ``protein-performer train`` process (printed so it can be repeated
by hand) with the project's ``TimeBudget`` callback: it stops a time budget and, for a step
budget, only records (``time_budget.json``: steps, training CPU / wall seconds, peak RSS and the
validation metrics against time). A run whose log ends with its budget's ``end`` event is
finished and, with ``--skip-existing`` (or ``--report-only``), never redone; so are the commands
after it (``Run.after``) whose output exists.

Studies are run as ``python scripts/studies/X.py`` from anywhere: Python puts this directory
first on ``sys.path``, so ``import harness`` works with no path edits.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("harness")

#: The repository checkout this script belongs to.
REPO = Path(__file__).resolve().parents[2]
#: The shared sequence data sets that sit beside the checkout (``../shared/data/sequences``).
SEQUENCES = REPO.parent / "shared" / "data" / "sequences"
#: The corpus of the CPU studies, and the bundled one of their ``--quick`` runs.
DEFAULT_DATA = [str(SEQUENCES / "uniprot_mmseqs_train.fasta"),
                str(SEQUENCES / "swissprot_opal_train.fasta")]
QUICK_DATA = [str(REPO / "protein_performer" / "data" / "demo" / "train.fasta")]
#: Attention variant -> overrides (everything else is shared by a study's variants).
ATTENTION: dict[str, list[str]] = {
    "exact": ["model.config.attention=exact"],
    "favor-softmax": ["model.config.attention=favor", "model.config.kernel=softmax"],
    "favor-relu": ["model.config.attention=favor", "model.config.kernel=relu"]}
#: The tiny model of the studies' ``--quick`` runs (``model.config.KEY=VALUE``).
QUICK_MODEL = ["dim=32", "depth=1", "heads=2", "ff_dim=64", "nb_features=16"]
BUDGET_LOG = "time_budget.json"
#: A step budget's TimeBudget only records: its seconds are out of reach.
_UNREACHED_S = 10**9


def setup_logging() -> None:
    """INFO and above to stderr (stdout stays free for results), with the time of each step."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """How long each run trains: ``steps`` optimizer steps, or ``seconds`` of ``clock`` time
    (``cpu``: the training process's CPU time, fair on a shared machine; ``wall``: for GPUs).
    Validation is never counted."""

    steps: int | None = None
    seconds: float | None = None
    clock: str = "cpu"

    def overrides(self) -> list[str]:
        seconds = str(_UNREACHED_S) if self.seconds is None else f"{self.seconds:g}"
        out = ["++callbacks.time_budget._target_=protein_performer.training.callbacks.TimeBudget",
               f"++callbacks.time_budget.seconds={seconds}",
               f"++callbacks.time_budget.clock={self.clock}"]
        if self.steps is not None:
            out += [f"trainer.max_steps={self.steps}", "trainer.max_epochs=-1"]
        return out

    def met(self, run_dir: Path) -> bool:
        """The run's budget log ends with this budget's ``end`` event (written after the last
        checkpoint)."""
        path = run_dir / BUDGET_LOG
        events = json.loads(path.read_text()) if path.is_file() else []
        if not events or events[-1]["event"] != "end":
            return False
        end = events[-1]
        want_s = _UNREACHED_S if self.seconds is None else float(f"{self.seconds:g}")
        return end["budget_s"] == want_s and (self.steps is None or end["step"] == self.steps)


def store_overrides(args: argparse.Namespace, store: Path, budget: Budget) -> list[str]:
    """What every run of a study on a ``preprocess`` store shares: ``--trainer``, the store, data
    loaded in the training process (so CPU time counts it), no progress bar or sanity
    validation, and the budget (for a time budget, an LR schedule of 20k steps: beyond reach)."""
    schedule = ["trainer.max_steps=20000"] if budget.steps is None else []
    return [f"trainer={args.trainer}", f"data.path={store}", "data.num_workers=0",
            "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", *schedule,
            *budget.overrides()]


@dataclass
class Run:
    """One training run and the commands that follow it.

    ``tags`` are what the tables group by (variant, seed, ...); ``after`` holds
    ``(label, command, output)``: run once the model is trained, skipped when ``output`` exists
    and the run was not retrained; ``result`` is the collected row.
    """

    name: str
    overrides: list[str]
    run_dir: Path
    tags: dict[str, Any] = field(default_factory=dict)
    after: list[tuple[str, list[str], Path]] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"

    def train_cmd(self) -> list[str]:
        return cli("train", *self.overrides, f"hydra.run.dir={self.run_dir}")


def cli(*args: str) -> list[str]:
    """``protein-performer ARGS`` run with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "protein_performer.cli.main", *args]


def shown(cmd: list[str], threads: int) -> str:
    """The command as a user would type it."""
    if cmd[1:3] == ["-m", "protein_performer.cli.main"]:
        cmd = ["protein-performer", *cmd[3:]]
    return f"OMP_NUM_THREADS={threads} " + shlex.join(cmd)


def call(cmd: list[str], threads: int, log_path: Path) -> None:
    """Run a child (``threads`` torch threads) with its output in ``log_path``; a failure stops
    the study with its tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.setdefault("PROTEIN_PERFORMER_ROOT", str(REPO))
    with log_path.open("w") as fh:
        fh.write(shown(cmd, threads) + "\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-5:]
        raise SystemExit(
            f"error: {shown(cmd, threads)} failed (exit {proc.returncode}); see {log_path}:\n"
            + "\n".join(tail)
        )


def execute(run: Run, budget: Budget, args: argparse.Namespace) -> None:
    """Train (unless finished and ``args.skip_existing``), then the commands after it."""
    logs = args.out.resolve() / "logs"
    trained = args.skip_existing and budget.met(run.run_dir)
    if not trained:
        # An interrupted run's checkpoints and budget log would mix with the new run's.
        shutil.rmtree(run.run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        log.info("training %s", run.name)
        call(run.train_cmd(), args.threads, logs / f"{run.name}.train.log")
        log.info("trained %s in %.1f min (wall)", run.name, (time.perf_counter() - t0) / 60)
    for label, cmd, output in run.after:
        if not (trained and output.exists()):
            call(cmd, args.threads, logs / f"{run.name}.{label}.log")


def run_all(runs: list[Run], budget: Budget, args: argparse.Namespace,
            collect: Callable[[Run], dict[str, Any]] | None = None) -> list[Run]:
    """Print every command, run the runs (``args.jobs`` at once; with ``args.report_only`` none:
    the finished ones are kept) and fill each ``result``: its tags, :func:`train_row`, and what
    ``collect(run)`` adds."""
    for run in runs:
        print(f"# {run.name}\n{shown(run.train_cmd(), args.threads)}", flush=True)
    if args.report_only:
        runs = [r for r in runs if budget.met(r.run_dir) and all(o.exists() for *_, o in r.after)]
        log.info("reporting the %d finished runs", len(runs))
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(lambda r: execute(r, budget, args), runs))
    if not runs:
        raise SystemExit("error: no finished run to report")
    for run in runs:
        extra = collect(run) if collect else {}
        run.result = {**run.tags, **train_row(run, args.threads), **extra}
    return runs


def train_row(run: Run, threads: int) -> dict[str, Any]:
    """What the budget log says of a run: steps, training and wall seconds, peak RSS, the last
    validation, the validation curve ``[(train_s, val/acc, val/ppl)]`` and the command."""
    events = json.loads((run.run_dir / BUDGET_LOG).read_text())
    vals = [e for e in events if e["event"] == "val"]
    end = next((e for e in reversed(events) if e["event"] == "end"), {})
    last = vals[-1] if vals else {}
    return {
        "name": run.name,
        "steps": end.get("step", math.nan),
        "train_cpu_s": end.get("train_s", math.nan),
        "wall_s": end.get("wall_s", math.nan),
        "peak_rss_mib": end.get("peak_rss_mib", math.nan),
        "val_acc": last.get("val/acc", math.nan),
        "val_ppl": last.get("val/ppl", math.nan),
        "curve": [
            (e["train_s"], e.get("val/acc", math.nan), e.get("val/ppl", math.nan)) for e in vals
        ],
        "command": shown(run.train_cmd(), threads),
    }


def preprocess(args: argparse.Namespace, split_by: str, workers: int) -> Path:
    """``protein-performer preprocess`` of ``args.data`` into ``OUT/store`` once (``--split-by
    split_by`` with ``--cluster-split``); a store made with other split settings is refused.
    Sets ``args.store_command``."""
    store = args.out.resolve() / "store"
    # fmt: off
    cmd = cli("preprocess", *args.data, "--out", str(store), "--on-invalid", "skip", "--split-by",
              split_by, "--cluster-split", f"{args.identity:g}", "--ood-frac",
              f"{args.ood_frac:g}", "--valid-frac", f"{args.valid_frac:g}", "--test-frac",
              f"{args.test_frac:g}", "--workers", str(workers), "--no-progress")
    # fmt: on
    args.store_command = shown(cmd, args.threads)
    print(f"# store\n{args.store_command}", flush=True)
    meta_path = store / "meta.json"
    if meta_path.is_file():
        split = json.loads(meta_path.read_text())["split"]
        want = (args.valid_frac, args.test_frac, args.ood_frac, args.identity, split_by)
        have = (split.get("valid_frac"), split.get("test_frac"), split.get("ood", {}).get("frac"),
                split.get("clusters", {}).get("min_seq_id"), split.get("mode"))
        if want != have:
            raise SystemExit(
                f"error: {store} was made with (valid, test, ood, identity, mode) = {have}, not "
                f"{want}: remove it or pick another --out")
        log.info("reusing %s", store)
        return store
    t0 = time.perf_counter()
    call(cmd, args.threads, args.out.resolve() / "logs" / "preprocess.log")
    log.info("preprocessed in %.0f s", time.perf_counter() - t0)
    return store


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parser(doc: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """A study's parser: the first paragraph of ``doc`` describes it, ``epilog`` (default: the
    rest of ``doc``) follows the options."""
    first, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(description=first, epilog=rest if epilog is None else epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def fresh_outputs(out_dir: Path, overwrite: bool) -> None:
    """Make ``out_dir``; an earlier run's outputs there are refused unless ``overwrite``, which
    removes them."""
    earlier = list(out_dir.glob("*"))
    if earlier:
        if not overwrite:
            print(f"error: {out_dir} holds an earlier run; pass --overwrite", file=sys.stderr)
            raise SystemExit(2)
        for p in earlier:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def cell(values: Iterable[Any], scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± sd`` over seeds of the finite numbers among ``values`` (sd: sample standard
    deviation; absent for one seed; ``-`` for none)."""
    vals = [v * scale for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return "-"
    sd = f" ± {statistics.stdev(vals):.{digits}f}" if len(vals) > 1 else ""
    return f"{statistics.fmean(vals):.{digits}f}" + sd


def select(rows: list[dict[str, Any]], /, **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns left-aligned, the others right-aligned."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = [f"| {' | '.join(header)} |", f"|{'|'.join(align)}|"]
    lines += [f"| {' | '.join(str(c) for c in row)} |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], fields: Sequence[str]) -> None:
    """The columns ``fields`` of ``rows`` (other keys dropped), written atomically."""
    from protein_performer.io.atomic import write_text_atomic

    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(fields), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, table.getvalue())


@contextmanager
def figure(path: Path, panels: int = 1, size: tuple[float, float] = (6.0, 4.0),
           title: str = "") -> Iterator[list[Any]]:
    """The axes of ``panels`` plots side by side (each ``size`` inches), saved to ``path`` (with
    ``title`` above them) when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]), squeeze=False)
    try:
        yield list(axes[0])
        if title:
            fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def write_markdown(path: Path, title: str, text: str) -> None:
    from protein_performer.io.atomic import write_text_atomic

    write_text_atomic(path, f"# {title}\n\n{text}")


# --------------------------------------------------------------------------------------------
# Baseline and metric
# --------------------------------------------------------------------------------------------


def unigram_log_probs(train: Any, objective: str, alphabet: Any) -> np.ndarray:
    """(V,) log-frequencies of the training residues, add-one smoothed over the residue letters
    (and ``<eos>`` for a causal LM, which must predict where a protein ends); -inf elsewhere."""
    from protein_performer.data.tokenizer import SEQUENCE_LETTERS

    counts = np.zeros(len(alphabet), dtype=np.float64)
    for i in range(len(train)):
        counts += np.bincount(train.tokens(i), minlength=len(alphabet))
    allowed = np.zeros(len(alphabet), dtype=bool)
    allowed[[alphabet.tokens.index(c) for c in SEQUENCE_LETTERS]] = True
    if objective == "clm":
        allowed[alphabet.eos_idx] = True
        counts[alphabet.eos_idx] = len(train)  # one <eos> per record
    counts = np.where(allowed, counts + 1.0, 0.0)
    logp = np.full(len(alphabet), -np.inf)
    logp[allowed] = np.log(counts[allowed] / counts.sum())
    return logp


def unigram_baseline(train: Any, heldout: Any, objective: str, max_len: int,
                     mlm_prob: float = 0.15, seed: int = 0) -> dict[str, Any]:
    """The empirical amino-acid baseline the Performer paper reports beside its models (a model
    that learnt nothing of context still knows residue frequencies: the floor to beat).

    Loss, perplexity and accuracy (always guessing the commonest residue) of the ``train``
    source's residue frequencies on ``heldout``, on exactly the positions ``evaluate`` scores
    with the same settings (the same ``ProteinDataset`` items: fixed crop, ``(index, 0)``
    masks): masked positions for MLM, every next-token prediction (``<eos>`` included) for CLM.
    """
    from protein_performer.data.dataset import ProteinDataset
    from protein_performer.data.masking import IGNORE_INDEX
    from protein_performer.data.tokenizer import Alphabet

    alphabet = Alphabet()
    logp = unigram_log_probs(train, objective, alphabet)
    best = int(np.argmax(logp))
    dataset = ProteinDataset(heldout, objective, max_len=max_len, crop="fixed", mlm_prob=mlm_prob,
                             seed=seed)
    nll, n, correct = 0.0, 0, 0
    for i in range(len(dataset)):
        targets = np.asarray(dataset[(i, 0)]["targets"])
        t = targets[targets != IGNORE_INDEX]
        nll -= float(logp[t].sum())
        n += int(t.size)
        correct += int((t == best).sum())
    loss = nll / max(n, 1)
    return {"records": len(heldout), "tokens": n, "loss": loss, "ppl": math.exp(loss),
            "acc": correct / max(n, 1)}


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rho as ``protein-performer score --label-col`` reports it (NaN, not a number,
    where it is undefined)."""
    from protein_performer.inference.scoring import label_spearman

    rho, _ = label_spearman([float(v) for v in x], [str(float(v)) for v in y])
    return math.nan if rho is None else rho
