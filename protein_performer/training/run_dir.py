"""A run directory keeps its history: metrics survive a resume, and a relaunch never starts a
named run over on top of its own files.

* :class:`RunCSVLogger` is Lightning's ``CSVLogger`` whose ``metrics.csv`` is appended to, not
  deleted, when a run resumes (Lightning's writer removes the previous file on start, so a
  preempted-and-resumed run kept only its last segment). Rows of the previous launch from the
  step the new launch starts at onward (logged after the checkpoint it resumes from, so about to
  be logged again) are dropped, so the file holds each step once.
* :func:`check_fresh_run_dir` refuses a launch without ``ckpt_path`` into a directory holding a
  previous run's checkpoints or metrics (Lightning would delete the metrics and write
  ``last-v1.ckpt`` beside the stale ``last.ckpt``); ``overwrite=true`` moves those files
  aside into ``replaced-<time>/`` and starts over: nothing is deleted.
"""

from __future__ import annotations

import csv
import logging
import os
import time
from pathlib import Path
from typing import Any

from lightning_fabric.loggers.csv_logs import _ExperimentWriter as _FabricWriter
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment

from protein_performer.errors import UserError

log = logging.getLogger(__name__)

#: What a run leaves in its directory, relative to it: the files that make it "a run".
RUN_FILES = ("checkpoints", "csv/metrics.csv", "training_curve.json", "training_curve.png")
HPC_PATTERN = "hpc_ckpt_*.ckpt"


class _AppendingWriter(ExperimentWriter):
    """Lightning's writer, minus the deletion of a previous ``metrics.csv``."""

    def __init__(self, log_dir: str) -> None:
        self._previous: list[dict[str, str]] | None = None
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        # Lightning's version deletes metrics.csv here; read it instead, to append after it.
        path = Path(self.metrics_file_path)
        if path.is_file():
            try:
                with open(path, newline="", encoding="utf-8") as fh:
                    reader = csv.DictReader(fh)
                    self._previous = list(reader)
                    self.metrics_keys = sorted(reader.fieldnames or [])
            except (OSError, UnicodeDecodeError, csv.Error) as exc:
                raise UserError(
                    f"{path}: cannot read the previous metrics to append to ({exc}); move the "
                    "file away to keep it, then relaunch"
                ) from None

    def save(self) -> None:
        """On the first save of this launch, rewrite the previous rows that precede its first
        step (a no-op for a fresh run), then append as Lightning does."""
        if self._previous is not None and self.metrics:
            start = min(int(m.get("step", 0)) for m in self.metrics)
            kept = [row for row in self._previous if _step(row) < start]
            if len(kept) < len(self._previous):
                log.info(
                    "%s: %d row(s) logged after the resumed checkpoint replaced by this run's",
                    self.metrics_file_path,
                    len(self._previous) - len(kept),
                )
            self._previous = None
            self._record_new_keys()
            tmp = Path(self.metrics_file_path + ".tmp")
            with open(tmp, "w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, self.metrics_file_path)
        _FabricWriter.save(self)


def _step(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or "inf")
    except ValueError:
        return float("inf")


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` holds the whole history of a resumed run."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """Lightning's property, with the appending writer."""
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def _rank() -> int:
    """This process's global rank from the launcher's environment (0 when not distributed):
    the trainer, which knows it for sure, does not exist yet."""
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def previous_run_files(run_dir: Path) -> list[Path]:
    """The files of an earlier launch in ``run_dir``: checkpoints, metrics, the curve."""
    found = [p for p in sorted(run_dir.glob(HPC_PATTERN)) if p.is_file()]
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.glob("*.ckpt"))):
            found.append(path)
    return found


def check_fresh_run_dir(run_dir: str | os.PathLike[str], overwrite: bool) -> None:
    """A launch without ``ckpt_path`` must not start over on a previous run's files.

    Refused with one line unless ``overwrite``; with it, rank 0 moves those files into
    ``replaced-<time>/`` (a rename, so checkpoints of any size cost nothing) and the run starts
    clean: no ``last-v1.ckpt`` beside a stale ``last.ckpt``, no metrics deleted.
    """
    root = Path(run_dir)
    found = previous_run_files(root)
    if not found:
        return
    names = ", ".join(str(p.relative_to(root)) for p in found[:4])
    if not overwrite:
        raise UserError(
            f"run directory {root} already holds a run ({names}): resume it with "
            "ckpt_path=last, choose another run_name, or pass overwrite=true to start over "
            "(the previous files are moved into a replaced-<time>/ folder, not deleted)"
        )
    if _rank() != 0:
        return
    aside = root / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while aside.exists():
        n += 1
        aside = root / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    for path in found:
        target = aside / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    log.warning("overwrite=true: the previous run's %s moved into %s", names, aside)


#: What Hydra writes into a run directory before the run's own code starts.
HYDRA_ONLY = (".hydra",)


def remove_unused_run_dir(run_dir: str | os.PathLike[str], log_name: str) -> bool:
    """After a launch that failed before training wrote anything, remove the run directory
    made for it (Hydra's ``.hydra/`` and ``log_name`` log, and empty folders such as the
    logger's ``csv/`` are all it holds), and the ``outputs/<task>/`` folders above it left
    empty, so failed launches leave no debris. A directory holding any other file (a run's
    checkpoints or metrics, the user's own) is kept. True when removed."""
    import shutil

    root = Path(run_dir)
    if _rank() != 0 or not root.is_dir():  # rank 0 owns the directory
        return False
    for path in root.rglob("*"):
        top = path.relative_to(root).parts[0]
        if top not in (*HYDRA_ONLY, log_name) and not path.is_dir():
            return False
    shutil.rmtree(root, ignore_errors=True)
    for parent in list(root.parents)[:2]:  # outputs/<task>/, then outputs/
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
    return not root.exists()
