"""``protein-performer benchmark proteingym``: every assay of a ProteinGym reference file,
scored zero-shot and summarised in the leaderboard's own CSV layout.

ProteinGym (Notin et al. 2023) ships one CSV per deep mutational scan (``mutant`` such as
``A42G:K45R``, numbered from 1 on the assay's ``target_seq``; ``DMS_score``, higher = fitter;
``DMS_score_bin``) and a reference file with one row per assay (``DMS_id``, ``DMS_filename``,
``target_seq``, and for the averages ``UniProt_ID``, ``coarse_selection_type``,
``MSA_Neff_L_category``, ``taxon`` when present).

Layout of ``OUT_DIR`` (the leaderboard's names, so its tools and readers open it):

* ``scores/<DMS_id>.csv``: ``mutant, DMS_score, DMS_score_bin, <model name>``, and
  ``scores/<DMS_id>.json``: what scored it (model digests, strategy, context). An assay whose
  two files exist and match this run is read back instead of scored again: a killed run
  continues where it stopped, and a rerun reproduces its numbers from the files.
* ``<Metric>/DMS_substitutions_<Metric>_DMS_level.csv`` per metric of
  :data:`~protein_performer.inference.dms_metrics.METRICS`: one row per assay (``DMS ID``).
* ``<Metric>/Summary_performance_DMS_substitutions_<Metric>.csv``: the leaderboard row
  (``Model_rank, Model_name, Model type, Average_<Metric>, ...``), averaged as ProteinGym
  averages (:func:`~protein_performer.inference.dms_metrics.leaderboard_average`). Columns the
  reference gives no data for stay empty; the bootstrap standard error needs other models'
  scores and stays empty.

Values are rounded to 3 decimals, as the leaderboard's files.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.dms_metrics import METRICS, assay_metrics, leaderboard_average
from protein_performer.inference.embedding import features_sha256
from protein_performer.io.atomic import text_output, write_text_atomic
from protein_performer.model.contact_head import weights_sha256

#: The logger's name as the CLI has always printed it (``WARNING <name>: ...``).
log = logging.getLogger("protein_performer.inference.proteingym")

REFERENCE_COLUMNS = ("DMS_id", "DMS_filename", "target_seq")
#: The leaderboard's per-assay columns after the model's, and its summary columns.
DMS_LEVEL_COLUMNS = (
    "number_mutants",
    "UniProt_ID",
    "Selection Type",
    "MSA_Neff_L_category",
    "Taxon",
)
SELECTION_TYPES = ("Activity", "Binding", "Expression", "OrganismalFitness", "Stability")
MSA_DEPTHS = ("Low", "Medium", "High")
TAXA = {"Human": "Taxa_Human", "Eukaryote": "Taxa_Other_Eukaryote",
        "Prokaryote": "Taxa_Prokaryote", "Virus": "Taxa_Virus"}  # fmt: skip


def summary_columns(metric: str) -> list[str]:
    """The leaderboard's ``Summary_performance_...`` columns for ``metric``."""
    return [
        "Model_rank", "Model_name", "Model type", f"Average_{metric}",
        f"Bootstrap_standard_error_{metric}", *(f"Function_{s}" for s in SELECTION_TYPES),
        *(f"{d}_MSA_depth" for d in MSA_DEPTHS), *TAXA.values(), "Model details", "References",
    ]  # fmt: skip


@dataclass(frozen=True)
class Assay:
    """One row of the reference file."""

    dms_id: str
    filename: str
    target_seq: str
    uniprot: str
    selection: str
    msa_depth: str
    taxon: str


@dataclass
class AssayResult:
    assay: Assay
    number_mutants: int
    metrics: dict[str, float | None]
    reused: bool
    seconds: float


@dataclass
class BenchmarkSummary:
    out_dir: Path
    results: list[AssayResult] = field(default_factory=list)
    averages: dict[str, float | None] = field(default_factory=dict)


def _read_csv(path: Path, what: str) -> tuple[list[str], list[dict[str, str]]]:
    if not path.is_file():
        raise UserError(f"{path} does not exist or is not a file ({what})")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            return list(reader.fieldnames or []), rows
    except (UnicodeDecodeError, csv.Error) as exc:
        raise UserError(f"{path}: not a readable CSV ({exc}) ({what})") from None


def read_reference(path: str | os.PathLike[str]) -> list[Assay]:
    """The assays of a ProteinGym reference file, in its order; a missing column or a
    repeated ``DMS_id`` is one error naming the file (and line)."""
    src = Path(path).expanduser()
    header, rows = _read_csv(src, "the ProteinGym reference file")
    missing = [c for c in REFERENCE_COLUMNS if c not in header]
    if missing:
        raise UserError(
            f"{src}: no column(s) {', '.join(missing)}; a ProteinGym reference file has "
            f"{', '.join(REFERENCE_COLUMNS)} (and UniProt_ID, coarse_selection_type, ...)"
        )
    assays, seen = [], set()
    for line, row in enumerate(rows, start=2):
        dms_id = (row.get("DMS_id") or "").strip()
        seq = (row.get("target_seq") or "").strip().upper()
        if not dms_id or not seq or not (row.get("DMS_filename") or "").strip():
            raise UserError(f"{src}, line {line}: empty DMS_id, DMS_filename or target_seq")
        if dms_id in seen:
            raise UserError(f"{src}, line {line}: DMS_id {dms_id!r} is listed twice")
        seen.add(dms_id)
        assays.append(
            Assay(
                dms_id,
                row["DMS_filename"].strip(),
                seq,
                (row.get("UniProt_ID") or dms_id).strip(),
                (row.get("coarse_selection_type") or "").strip(),
                (row.get("MSA_Neff_L_category") or "").strip().capitalize(),
                (row.get("taxon") or "").strip(),
            )  # fmt: skip
        )
    if not assays:
        raise UserError(f"{src} lists no assays")
    return assays


def _score_bin(text: str, path: Path, line: int) -> int:
    """A ``DMS_score_bin`` cell: 0 or 1 (``1.0`` too); 0.7 was truncated to 0 and 2, -1 or inf
    were tracebacks."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value not in (0.0, 1.0):
        raise UserError(f"{path}, line {line}: DMS_score_bin must be 0 or 1, got {text!r}")
    return int(value)


def read_assay(path: Path) -> tuple[list[str], list[float], list[int] | None]:
    """``mutant``, ``DMS_score`` and (when present) ``DMS_score_bin`` of a ProteinGym file."""
    header, rows = _read_csv(path, "a ProteinGym DMS file")
    for col in ("mutant", "DMS_score"):
        if col not in header:
            raise UserError(
                f"{path}: no column {col!r}; ProteinGym DMS files have mutant, DMS_score"
            )
    mutants, labels, fit = [], [], []
    has_bin = "DMS_score_bin" in header
    needed = ("mutant", "DMS_score", "DMS_score_bin") if has_bin else ("mutant", "DMS_score")
    for line, row in enumerate(rows, start=2):
        if any(row.get(col) is None for col in needed):
            raise UserError(
                f"{path}, line {line}: fewer fields than the header's {len(header)} (no "
                f"{', '.join(c for c in needed if row.get(c) is None)})"
            )
        try:
            y = float(row["DMS_score"])
        except ValueError:
            raise UserError(
                f"{path}, line {line}: DMS_score {row['DMS_score']!r} is not a number"
            ) from None
        if not math.isfinite(y):
            raise UserError(f"{path}, line {line}: DMS_score is {row['DMS_score']!r}")
        b = _score_bin(row["DMS_score_bin"], path, line) if has_bin else 0
        mutants.append(row["mutant"].strip())
        labels.append(y)
        fit.append(b)
    if not mutants:
        raise UserError(f"{path} has no rows")
    return mutants, labels, fit if has_bin else None


def _round(value: float | None) -> str:
    return "" if value is None else f"{round(value, 3):.3f}"


ContextFor = Callable[[Assay], tuple[Any, dict[str, Any] | None]]


def run_proteingym(
    lm: ProteinLM,
    reference: str | os.PathLike[str],
    dms_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    strategy: str,
    model_name: str,
    context_for: ContextFor | None = None,
    toks_per_batch: int = 4096,
    progress: bool = True,
    overwrite: bool = False,
) -> BenchmarkSummary:
    """Score every assay of ``reference`` (files in ``dms_dir``) into ``out_dir`` and write the
    per-assay and summary tables (module docstring). ``context_for(assay)`` gives the family
    context of an assay (or None) and its record for the run file. Assays already scored by
    this run are read back; scores of another run are refused unless ``overwrite``."""
    assays = read_reference(reference)
    dms = Path(dms_dir).expanduser()
    files = {a.dms_id: dms / a.filename for a in assays}
    absent = [str(p) for p in files.values() if not p.is_file()]
    if absent:
        raise UserError(
            f"{len(absent)} DMS file(s) named by {reference} are not in {dms}: "
            + ", ".join(absent[:5])
        )
    out = Path(out_dir).expanduser()
    (out / "scores").mkdir(parents=True, exist_ok=True)
    summary = BenchmarkSummary(out)
    say = sys.stderr
    # What every assay's run file records of the model: hashed once for the run, not per assay.
    model = {
        "model_sha256": weights_sha256(lm.model),
        "features_sha256": features_sha256(lm.model),
    }
    for n, assay in enumerate(assays, start=1):
        start = time.perf_counter()
        mutants, labels, fit = read_assay(files[assay.dms_id])
        context, context_record = context_for(assay) if context_for else (None, None)
        record = {**model, "strategy": strategy, "context": context_record, "rows": len(mutants)}
        scores_csv = out / "scores" / f"{assay.dms_id}.csv"
        scores_json = scores_csv.with_suffix(".json")
        scores = _reuse(scores_csv, scores_json, record, model_name, mutants, overwrite)
        reused = scores is not None
        if scores is None:
            try:
                scores = lm.score_variants(
                    assay.target_seq, mutants, strategy, 1, toks_per_batch, progress,
                    context=context,
                ).tolist()  # fmt: skip
            except UserError as exc:
                raise UserError(f"{files[assay.dms_id]} ({assay.dms_id}): {exc}") from None
            with text_output(scores_csv) as fh:
                writer = csv.writer(fh)
                writer.writerow(["mutant", "DMS_score", "DMS_score_bin", model_name])
                for i, m in enumerate(mutants):
                    b = "" if fit is None else fit[i]
                    writer.writerow([m, repr(labels[i]), b, f"{scores[i]:.6f}"])
            write_text_atomic(scores_json, json.dumps(record, sort_keys=True, indent=1) + "\n")
            scores = _read_scores(scores_csv, model_name)  # the metrics of what the file holds
        metrics = assay_metrics(scores, labels, fit)
        seconds = time.perf_counter() - start
        summary.results.append(AssayResult(assay, len(mutants), metrics, reused, seconds))
        how = "reused" if reused else f"{seconds:.1f} s"
        shown = ", ".join(f"{k} {_round(v) or 'n/a'}" for k, v in metrics.items())
        print(
            f"[{n}/{len(assays)}] {assay.dms_id}: {len(mutants)} mutants, {shown} ({how})",
            file=say, flush=True,
        )  # fmt: skip
    summary.averages = _write_tables(summary, lm, strategy, model_name, context_for is not None)
    return summary


def _read_scores(path: Path, model_name: str) -> list[float]:
    _, rows = _read_csv(path, "scores of an earlier run")
    return [float(r[model_name]) for r in rows]


def _reuse(
    scores_csv: Path,
    scores_json: Path,
    record: dict[str, Any],
    model_name: str,
    mutants: Sequence[str],
    overwrite: bool,
) -> list[float] | None:
    """The scores an earlier run of the same model and options wrote, or None to score."""
    from protein_performer.io.json_safe import read_json

    if not scores_csv.is_file() or not scores_json.is_file():
        return None
    if read_json(scores_json, "delete it to score the assay again") != record:
        if overwrite:
            return None
        raise UserError(
            f"{scores_csv} was scored by another model or with other options ({scores_json}); "
            "pass --overwrite to score again, or choose another OUT_DIR"
        )
    try:
        header, rows = _read_csv(scores_csv, "scores of an earlier run")
        values = [float(r[model_name]) for r in rows]
        same = [r["mutant"] for r in rows] == list(mutants)
    except (KeyError, TypeError, ValueError):
        same = False
    if not same:  # damaged, or another model name: score again
        log.warning("%s does not match its assay; scoring it again", scores_csv)
        return None
    return values


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _write_tables(
    summary: BenchmarkSummary, lm: ProteinLM, strategy: str, model_name: str, context: bool
) -> dict[str, float | None]:
    """The per-assay and summary CSVs of every metric; returns the averages."""
    results = summary.results
    proteins = [r.assay.uniprot for r in results]
    selection = [r.assay.selection or "all" for r in results]
    c = lm.config
    details = f"{c.objective} {c.attention}, depth {c.depth}, dim {c.dim}; {strategy}" + (
        "; homologs as context" if context else ""
    )
    averages: dict[str, float | None] = {}
    for metric in METRICS:
        folder = summary.out_dir / metric
        folder.mkdir(exist_ok=True)
        values = [r.metrics[metric] for r in results]
        with text_output(folder / f"DMS_substitutions_{metric}_DMS_level.csv") as fh:
            writer = csv.writer(fh)
            writer.writerow(["DMS ID", model_name, *DMS_LEVEL_COLUMNS])
            for r, v in zip(results, values, strict=True):
                a = r.assay
                writer.writerow(
                    [a.dms_id, _round(v), r.number_mutants, a.uniprot, a.selection, a.msa_depth,
                     a.taxon]
                )  # fmt: skip
        average = leaderboard_average(values, proteins, selection)
        averages[metric] = average
        row: dict[str, str] = {
            "Model_rank": "1", "Model_name": model_name,
            "Model type": "Hybrid model" if context else "Protein language model",
            f"Average_{metric}": _round(average), "Model details": details, "References": "",
        }  # fmt: skip
        for s in SELECTION_TYPES:
            row[f"Function_{s}"] = _round(
                _group_mean(results, values, lambda a, s=s: a.selection == s)
            )
        for d in MSA_DEPTHS:
            row[f"{d}_MSA_depth"] = _round(
                _group_mean(results, values, lambda a, d=d: a.msa_depth == d)
            )
        for taxon, col in TAXA.items():
            row[col] = _round(_group_mean(results, values, lambda a, t=taxon: a.taxon == t))
        columns = summary_columns(metric)
        with text_output(folder / f"Summary_performance_DMS_substitutions_{metric}.csv") as fh:
            writer = csv.writer(fh)
            writer.writerow(columns)
            writer.writerow([row.get(col, "") for col in columns])
    return averages


def _group_mean(
    results: Sequence[AssayResult], values: Sequence[float | None], keep: Callable[[Assay], bool]
) -> float | None:
    """Mean over the proteins of the assays ``keep`` picks (each protein's assays averaged
    first, as the leaderboard's category columns)."""
    by_protein: dict[str, list[float]] = {}
    for r, v in zip(results, values, strict=True):
        if v is not None and keep(r.assay):
            by_protein.setdefault(r.assay.uniprot, []).append(v)
    return _mean([float(np.mean(vs)) for vs in by_protein.values()])
