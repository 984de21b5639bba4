"""``protein-performer benchmark proteingym``: every assay of a ProteinGym reference file,
scored zero-shot and summarised in the leaderboard's own CSV layout.

ProteinGym (Notin et al. 2023) ships one CSV per deep mutational scan (``mutant`` such as
``A42G:K45R``, numbered from 1 on the assay's ``target_seq``; ``DMS_score``, higher = fitter;
``DMS_score_bin``) and a reference file with one row per assay (``DMS_id``, ``DMS_filename``,
``target_seq``, and for the averages ``UniProt_ID``, ``coarse_selection_type``,
``MSA_Neff_L_category``, ``taxon`` when present).

Layout of ``OUT_DIR`` (the leaderboard's names, so its tools and readers open it):

* ``scores/<DMS_id>.csv``: ``mutant, DMS_score, DMS_score_bin, <model name>``, and
  ``scores/<DMS_id>.json``: the key of what the scores depend on (model digests, strategy,
  context, the wild type's and the DMS file's sha256) and the sha256 of the ``.csv`` it vouches
  for. An assay whose run file vouches for its table and holds this run's key is read back
  instead of scored again: a killed run continues where it stopped, a rerun reproduces its
  numbers from the files, and a table the run file does not vouch for (a kill between the two
  files) is scored again. ``DMS_id`` must be a plain file name.
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
import hashlib
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

from protein_performer.errors import UserError, shown
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.dms_metrics import METRICS, assay_metrics, leaderboard_average
from protein_performer.interop.identity import model_hashes
from protein_performer.io.atomic import text_output, write_text_atomic
from protein_performer.io.outputs import claim_output
from protein_performer.io.tables import table_writer, text_cell

#: The logger's name as the CLI has always printed it (``WARNING <name>: ...``).
log = logging.getLogger("protein_performer.inference.proteingym")

REFERENCE_COLUMNS = ("DMS_id", "DMS_filename", "target_seq")
#: The columns of ``scores/<DMS_id>.csv`` before the model's own.
SCORE_COLUMNS = ("mutant", "DMS_score", "DMS_score_bin")
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
        _check_file_name(dms_id, f"{src}, line {line}: DMS_id")
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


def _check_file_name(name: str, where: str) -> None:
    """``name`` (an assay's id) names files (``scores/<DMS_id>.csv``, ``<DMS_id>.fasta``), so it
    must be a plain file name: no separator, not ``.``/``..``, no leading dot (the lock and
    temporary files' names), printable. Anything else could write outside OUT_DIR."""
    bad = (
        name in (".", "..")
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", os.sep, os.altsep or "/"))
        or not name.isprintable()
    )
    if bad:
        raise UserError(
            f"{where} {shown(name)} cannot name a file (a path, '..', a leading dot or an "
            "unprintable character); ProteinGym's ids are plain names such as "
            "BLAT_ECOLX_Stiffler_2015"
        )


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
    check_model_name(model_name)
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
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT_DIR {out} exists and is not a directory; choose another OUT_DIR")
    inputs = [reference, dms, *files.values()]
    # Claimed as one resumable output (every file below it goes through the one lock); the
    # replacement of another run's scores is decided per assay (_reuse) with ``overwrite``.
    with claim_output(out, inputs, overwrite, "benchmark scores and tables", exists_ok=True):
        (out / "scores").mkdir(parents=True, exist_ok=True)
        return _run_assays(lm, assays, files, out, strategy, model_name, context_for,
                           toks_per_batch, progress, overwrite)  # fmt: skip


def _run_assays(
    lm: ProteinLM,
    assays: list[Assay],
    files: dict[str, Path],
    out: Path,
    strategy: str,
    model_name: str,
    context_for: ContextFor | None,
    toks_per_batch: int,
    progress: bool,
    overwrite: bool,
) -> BenchmarkSummary:
    """The body of :func:`run_proteingym`, run while OUT_DIR is claimed."""
    summary = BenchmarkSummary(out)
    say = sys.stderr
    # What every assay's run file records of the model: hashed once for the run, not per assay.
    model = model_hashes(lm.model)
    for n, assay in enumerate(assays, start=1):
        start = time.perf_counter()
        mutants, labels, fit = read_assay(files[assay.dms_id])
        context, context_record = context_for(assay) if context_for else (None, None)
        record = {
            **model, "strategy": strategy, "context": context_record, "rows": len(mutants),
            "target_seq_sha256": _sha256(assay.target_seq.encode()),
            "dms_sha256": _sha256(files[assay.dms_id].read_bytes()),
        }  # fmt: skip
        scores_csv = out / "scores" / f"{assay.dms_id}.csv"
        scores_json = scores_csv.with_suffix(".json")
        scores = _reuse(scores_csv, scores_json, record, model_name, overwrite)
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
                writer = table_writer(fh)
                writer.writerow(SCORE_COLUMNS + (model_name,))
                for i, m in enumerate(mutants):
                    b = "" if fit is None else fit[i]
                    writer.writerow([m, repr(labels[i]), b, f"{scores[i]:.6f}"])
            # The run file vouches for exactly these bytes: a kill between the two files, or
            # a table changed since, never passes for this run's scores.
            vouched = {**record, "scores_sha256": _sha256(scores_csv.read_bytes())}
            write_text_atomic(scores_json, json.dumps(vouched, sort_keys=True, indent=1) + "\n")
            scores = _read_scores(scores_csv)  # the metrics of what the file holds
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_scores(path: Path) -> list[float]:
    """The model's column (the fourth, whatever its name) of a scores file this run vouched
    for."""
    with open(path, newline="", encoding="utf-8") as fh:
        return [float(row[3]) for row in list(csv.reader(fh))[1:]]


def _reuse(
    scores_csv: Path,
    scores_json: Path,
    record: dict[str, Any],
    model_name: str,
    overwrite: bool,
) -> list[float] | None:
    """The scores an earlier run with the same key (``record``: the model's digests, strategy,
    context, the wild type's and the DMS file's digests) wrote, or None to score.

    A run file of another key (another model, wild type, DMS file, options; or one written
    before the key had digests) is refused unless ``overwrite``. With this run's key, the
    table is reused only when the run file vouches for its exact bytes (``scores_sha256``);
    one it does not vouch for (a run stopped between the two files, an edited table) is
    scored again."""
    from protein_performer.io.json_safe import read_json

    if not scores_csv.is_file():
        return None
    if not scores_json.is_file():
        log.warning("%s has no run file %s; scoring it again", scores_csv, scores_json.name)
        return None
    found = read_json(scores_json, "delete it to score the assay again")
    found = found if isinstance(found, dict) else {}
    key = {k: v for k, v in found.items() if k != "scores_sha256"}
    if key != record:
        if overwrite:
            return None
        differ = sorted(k for k in set(key) | set(record) if key.get(k) != record.get(k))
        raise UserError(
            f"{scores_csv} was scored by another model, wild type, DMS file or options "
            f"(differs: {', '.join(differ)}; {scores_json}); pass --overwrite to score again, "
            "or choose another OUT_DIR"
        )
    if found.get("scores_sha256") != _sha256(scores_csv.read_bytes()):
        log.warning(
            "%s is not the table its run file %s vouches for (a run stopped between them?); "
            "scoring it again", scores_csv, scores_json.name,
        )  # fmt: skip
        return None
    with open(scores_csv, newline="", encoding="utf-8") as fh:
        header = next(csv.reader(fh), [])
    if header[3:] != [text_cell(model_name)]:  # the same scores under another --model-name
        log.warning("%s names its scores %s; scoring it again", scores_csv, header[3:])
        return None
    return _read_scores(scores_csv)


def check_model_name(name: str) -> None:
    """``--model-name`` heads a column beside the tables' own: an empty or clashing name would
    make the tables unreadable (or every rerun score again)."""
    taken = {*SCORE_COLUMNS, "DMS ID", *DMS_LEVEL_COLUMNS}
    if not name.strip() or name in taken:
        raise UserError(
            f"--model-name {shown(name)} is empty or a column the tables already have "
            f"({', '.join(sorted(taken))}); choose another name"
        )


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
            writer = table_writer(fh)
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
            writer = table_writer(fh)
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
