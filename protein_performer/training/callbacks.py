"""Training callbacks: FAVOR+ feature redraws, the training-curve figure, a CPU-time budget,
and progress that suits where it is written.

They live outside the LightningModule because they are about *when* things happen during a run
(optimizer-step boundaries, end of fit), not about the loss.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ProgressBar

from protein_performer.errors import UserError
from protein_performer.io.atomic import write_text_atomic

log = logging.getLogger(__name__)


def redraw_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, step).

    Every data-parallel rank builds the same generator at the same step, so all ranks draw the
    same ω without a broadcast, and a resumed run redraws exactly what an unbroken run would.
    SeedSequence mixes the pair so nearby (seed, step) pairs give unrelated streams.
    """
    state = np.random.SeedSequence([int(seed), int(step)]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(state[0]) << 32 | int(state[1]))
    return generator


class FeatureRedraw(Callback):
    """Redraw the FAVOR+ random features every ``interval`` optimizer steps (and at step 0).

    Runs in ``on_train_batch_start`` so the redraw precedes the forward pass of the step it
    belongs to; with gradient accumulation the micro-batches of one optimizer step share one ω.
    The generator is seeded from (seed, global_step), which keeps DDP ranks identical with no
    communication and uses none of the global RNG (so dropout streams are unaffected). A resumed
    run does not redraw on resume: ω comes back from the checkpoint (it is a buffer).

    Args:
        interval: optimizer steps between redraws; ``None`` reads the model config's
            ``feature_redraw_interval``; 0 disables redraws.
        seed: base seed of the redraw stream.
    """

    def __init__(self, interval: int | None = None, seed: int = 0) -> None:
        super().__init__()
        if interval is not None and interval < 0:
            raise ValueError(f"interval must be >= 0 or None, got {interval}")
        self.interval = interval
        self.seed = seed
        self._last_step: int | None = None

    def _interval(self, pl_module: pl.LightningModule) -> int:
        if self.interval is not None:
            return self.interval
        config = getattr(pl_module, "performer_config", None)
        return int(getattr(config, "feature_redraw_interval", 0) or 0)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        interval = self._interval(pl_module)
        step = trainer.global_step
        if interval <= 0 or step == self._last_step or step % interval:
            return
        self._last_step = step
        pl_module.model.redraw_features(generator=redraw_generator(self.seed, step))
        log.debug("redrew FAVOR+ features at step %d", step)


class TrainingCurvePlot(Callback):
    """Write ``training_curve.png`` (and the numbers as JSON) at the end of fit.

    The metrics are collected here as they are logged instead of read back from a logger, so the
    figure works with any logger (or none).

    Args:
        dirpath: where to write; defaults to the trainer's ``default_root_dir``.
        filename: stem of the PNG and JSON files.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "training_curve") -> None:
        super().__init__()
        self.dirpath = dirpath
        self.filename = filename
        self.train: list[tuple[int, float]] = []
        self.val: dict[str, list[tuple[int, float]]] = {"val/loss": [], "val/ppl": []}
        self.path: Path | None = None
        self.unigram: float | None = None  # the reference line: see unigram_perplexity
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # 0, or the step a resumed run starts from
        if self.unigram is None and trainer.is_global_zero:
            self.unigram = _unigram_of(trainer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        value = trainer.callback_metrics.get("train/loss")
        # One point per completed optimizer step: with accumulation, micro-batches that did not
        # step the optimizer leave global_step unchanged.
        if value is not None and step > self._last_step:
            self._last_step = step
            self.train.append((step, float(value)))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_validation_epoch_end: callbacks run that hook before the LightningModule's, so
        # this epoch's val metrics are not logged yet there.
        if trainer.sanity_checking:
            return
        for key, points in self.val.items():
            value = trainer.callback_metrics.get(key)
            if value is not None:
                points.append((trainer.global_step, float(value)))

    def state_dict(self) -> dict[str, Any]:
        # Saved in checkpoints so a resumed run's figure covers the whole run.
        return {"train": self.train, "val": self.val, "unigram": self.unigram}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train = [tuple(p) for p in state_dict.get("train", [])]
        self.val = {k: [tuple(p) for p in v] for k, v in state_dict.get("val", self.val).items()}
        self.unigram = state_dict.get("unigram")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or not self.train:
            return
        out_dir = Path(self.dirpath or trainer.default_root_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"{self.filename}.png"
        curve = json.dumps({"train/loss": self.train, **self.val, "unigram_ppl": self.unigram})
        write_text_atomic(out_dir / f"{self.filename}.json", curve)
        plot_training_curve(self.train, self.val, self.path, self.unigram)
        log.info("training curve: %s", self.path)


def _unigram_of(trainer: pl.Trainer) -> float | None:
    """The unigram perplexity of the run's data module (train frequencies on valid), or None
    when it has no record sources (a data module of the user's own)."""
    from protein_performer.data.dataset import unigram_perplexity

    sources = getattr(getattr(trainer, "datamodule", None), "sources", None)
    if not isinstance(sources, dict) or "train" not in sources or "valid" not in sources:
        return None
    return unigram_perplexity(sources["train"], sources["valid"])


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average, so the first points are not biased towards zero."""
    if window <= 1 or len(values) < 2:
        return values
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    out = np.empty_like(values)
    for i in range(len(values)):
        lo = max(0, i + 1 - window)
        out[i] = (cumsum[i + 1] - cumsum[lo]) / (i + 1 - lo)
    return out


def plot_training_curve(
    train: list[tuple[int, float]],
    val: dict[str, list[tuple[int, float]]],
    path: Path,
    unigram: float | None = None,
) -> None:
    """Two panels: train/val loss vs step (raw train faint, smoothed solid) and val/ppl vs step,
    with ``unigram`` (the train set's residue frequencies' perplexity on valid) for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(10, 4))
    steps = np.array([s for s, _ in train])
    losses = np.array([v for _, v in train])
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8)
    window = max(1, len(losses) // 20)
    ax_loss.plot(steps, _smooth(losses, window), color="tab:blue", label="train/loss")
    if val["val/loss"]:
        vs, vl = zip(*val["val/loss"], strict=True)
        ax_loss.plot(vs, vl, "o-", color="tab:orange", label="val/loss")
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)", title="loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if val["val/ppl"]:
        ps, pv = zip(*val["val/ppl"], strict=True)
        ax_ppl.plot(ps, pv, "o-", color="tab:orange", label="val/ppl")
        if unigram is not None:
            # What residue frequencies alone give: a model must beat this to use any context.
            label = f"unigram (train frequencies): {unigram:.2f}"
            ax_ppl.axhline(unigram, color="grey", ls="--", lw=0.8, label=label)
        ax_ppl.legend()
    else:
        ax_ppl.text(0.5, 0.5, "no validation run", ha="center", va="center")
    ax_ppl.set(xlabel="optimizer step", ylabel="perplexity", title="validation perplexity")
    ax_ppl.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # titles and legends never cut off
    plt.close(fig)


class TimeBudget(Callback):
    """Stop training after ``seconds`` of *training* time, and log when each validation ran.

    ``clock="cpu"`` counts this process's CPU seconds (``time.process_time``: every thread of the
    process, no child processes, so use ``data.num_workers=0`` and count loading too). That is
    the fair budget on a shared machine: a variant slowed by other jobs still gets the same
    compute, where ``trainer.max_time`` (wall clock) would hand it less. ``clock="wall"`` counts
    seconds since training started (for GPUs, where CPU time says little). Validation time is not
    counted in either, so validating more often does not shrink the budget.

    Lightning validates once more when ``should_stop`` is set, so the last checkpoint and the
    last logged validation are at the end of the budget. Events go to ``<root>/<filename>`` as
    one JSON list, rewritten atomically: ``{"event": "val"|"end", "train_s", "wall_s", "step",
    val metrics}``; ``end`` also holds ``peak_rss_mib`` (this process's peak resident memory).
    """

    def __init__(
        self, seconds: float, clock: str = "cpu", filename: str = "time_budget.json"
    ) -> None:
        super().__init__()
        if clock not in ("cpu", "wall"):
            raise UserError(f"TimeBudget clock must be cpu or wall, got {clock!r}")
        if not seconds > 0:
            raise UserError(f"TimeBudget seconds must be > 0, got {seconds}")
        self.seconds = float(seconds)
        self.clock = clock
        self.filename = filename
        self.events: list[dict[str, Any]] = []
        self._start: float | None = None
        self._wall0 = 0.0
        self._excluded = 0.0
        self._val0: float | None = None

    def _now(self) -> float:
        return time.process_time() if self.clock == "cpu" else time.monotonic()

    def used(self) -> float:
        """Training seconds spent so far on this callback's clock (validation excluded)."""
        if self._start is None:
            return 0.0
        running_val = self._now() - self._val0 if self._val0 is not None else 0.0
        return self._now() - self._start - self._excluded - running_val

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._wall0 = self._now(), time.monotonic()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.used() >= self.seconds:
            trainer.should_stop = True

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None and not trainer.sanity_checking:
            self._val0 = self._now()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val0 is None:
            return
        self._excluded += self._now() - self._val0
        self._val0 = None
        metrics = trainer.callback_metrics.items()
        self._record(trainer, "val", **{k: float(v) for k, v in metrics if k.startswith("val/")})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # ru_maxrss is KiB on Linux.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self._record(trainer, "end", peak_rss_mib=peak, budget_s=self.seconds, clock=self.clock)

    def _record(self, trainer: pl.Trainer, event: str, **extra: Any) -> None:
        if not trainer.is_global_zero:
            return
        self.events.append(
            {
                "event": event,
                "train_s": self.used(),
                "wall_s": time.monotonic() - self._wall0,
                "step": trainer.global_step,
                **extra,
            }
        )
        out = Path(trainer.default_root_dir) / self.filename
        write_text_atomic(out, json.dumps(self.events, indent=1) + "\n")


class LineProgressBar(ProgressBar):
    """Training progress as one line every ``interval`` seconds, for logs (SLURM, ``| tee``).

    Lightning's tqdm bar rewrites itself with carriage returns, and a log file keeps every
    rewrite; this bar prints the step, the epoch, the logged metrics and the speed instead, plus
    a line after every validation and one at the end.
    """

    def __init__(self, interval: float | None = None) -> None:
        super().__init__()
        from protein_performer.io.progress import interval as default_interval

        self.every = default_interval() if interval is None else interval
        self._enabled = True
        self._start = self._last = time.monotonic()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _line(self, trainer: pl.Trainer, what: str, metrics: dict[str, Any]) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        step, total = trainer.global_step, trainer.max_steps
        rate = step / max(1e-9, time.monotonic() - self._start)
        shown = " ".join(
            f"{k}={float(v):.4g}"
            for k, v in sorted(metrics.items())
            if k != "v_num"
            and isinstance(v, (int, float, torch.Tensor))
            and torch.numel(torch.as_tensor(v)) == 1
        )
        of = f"/{total}" if total and total > 0 else ""
        print(
            f"{what}: step {step}{of} epoch {trainer.current_epoch} {shown} ({rate:.2f} steps/s)",
            file=sys.stderr,
            flush=True,
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = self._last = time.monotonic()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._line(trainer, "train", self.get_metrics(trainer, pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            val = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            self._line(trainer, "val", val)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._line(trainer, "done", self.get_metrics(trainer, pl_module))


def progress_bar(refresh_rate: int = 1, interval: float | None = None) -> ProgressBar:
    """Lightning's tqdm bar on a terminal, :class:`LineProgressBar` in a log file."""
    from pytorch_lightning.callbacks import TQDMProgressBar

    from protein_performer.io.progress import on_terminal

    return TQDMProgressBar(refresh_rate) if on_terminal() else LineProgressBar(interval)
