"""``score-variants``: every row of a deep-mutational-scan table scored against one wild type
(``lm.score_variants``), written back with all its columns plus the score.

A row whose mutation does not fit the wild type (wrong letter, position outside, unparseable)
gets an empty score and is listed by its CSV line number, never a crash; a ProteinGym file is
read as it is (``mutant``, Spearman vs ``DMS_score``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protein_performer.data.inputs import read_records
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.inference.context import FamilyContext
from protein_performer.inference.ensemble import ContextEnsemble, context_record
from protein_performer.inference.scoring import (
    VARIANT_STRATEGIES,
    label_spearman,
    offset_hint,
    parse_mutant,
)
from protein_performer.io.atomic import text_output, write_text_atomic
from protein_performer.io.outputs import sidecar
from protein_performer.io.tables import delimiter, table_writer

#: The logger's name as the CLI has always printed it (``WARNING <name>: ...``).
log = logging.getLogger("protein_performer.inference.scoring")

#: The columns of a ProteinGym substitution file (``DMS_score_bin`` too, unused here).
PROTEINGYM_COLUMNS = frozenset({"mutant", "DMS_score"})
#: The sidecar beside OUT recording the context a table was scored with (with --context only).
CONTEXT_SIDECAR = ".context.json"
_SHOW_ROWS = 20  # rows named in the warning summary before "and N more"


@dataclass
class VariantSummary:
    """What ``score_variants_file`` did: counts, skipped rows, and the correlation if asked."""

    out: Path
    rows: int
    scored: int
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (line, mutant, reason)
    spearman: float | None = None
    spearman_n: int = 0
    label_col: str | None = None
    detected: str | None = None  # the line saying which columns were taken by default

    def skipped_summary(self) -> str:
        """One warning naming the CSV lines (1-based, the header is line 1) left unscored."""
        shown = "; ".join(
            f"line {line} ({mut!r}: {why})" for line, mut, why in self.skipped[:_SHOW_ROWS]
        )
        more = len(self.skipped) - _SHOW_ROWS
        tail = f"; and {more} more" if more > 0 else ""
        return (
            f"{len(self.skipped)} of {self.rows} row(s) not scored (empty score; CSV line "
            f"numbers, header = line 1): {shown}{tail}"
        )


def wild_type(path: str | os.PathLike[str]) -> tuple[str, str]:
    records = read_records(path)
    if len(records) != 1:
        raise UserError(
            f"{path}: WT needs exactly one record (the wild type), found {len(records)}"
        )
    return records[0].id, records[0].sequence


def score_variants_file(
    lm: ProteinLM,
    wt_fasta: str | os.PathLike[str],
    mutations: str | os.PathLike[str],
    out: str | os.PathLike[str],
    strategy: str = "masked-marginals",
    offset: int = 1,
    mutation_col: str = "mutant",
    label_col: str | None = None,
    score_col: str | None = None,
    toks_per_batch: int = 4096,
    limit_rows: int | None = None,
    progress: bool = True,
    context: FamilyContext | ContextEnsemble | None = None,
    per_prompt: bool = False,
) -> VariantSummary:
    """Score every row of a DMS table; write all input columns plus the score (atomically).

    With a context, what built it goes to ``OUT.context.json`` (:func:`context_record`); with
    an ensemble and ``per_prompt``, one more column per prompt (``SCORE:LABEL``) beside the
    mean.

    The input is read as UTF-8 with an optional byte-order mark (spreadsheet exports);
    delimiter by extension (``.tsv``/``.tab`` -> tab, else comma), same for the output.
    """
    if limit_rows is not None and (
        not isinstance(limit_rows, int) or isinstance(limit_rows, bool) or limit_rows < 1
    ):  # 0 or -1 read as "one row" before: never a silent partial score
        raise UserError(f"limit_rows={limit_rows!r}: give a whole number >= 1, or None for all")
    lm.check_strategy(strategy, VARIANT_STRATEGIES)
    _, wt_seq = wild_type(wt_fasta)
    path = Path(mutations).expanduser()
    if not path.is_file():
        raise UserError(f"{path} does not exist or is not a file; give the mutations CSV")
    score_col = score_col or strategy
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh, delimiter=delimiter(path))
            header = next(reader, None)
            if header is None:
                raise UserError(f"{path} is empty: expected a header row with {mutation_col!r}")
            rows: list[tuple[int, list[str]]] = []
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                rows.append((reader.line_num, row))
                if limit_rows is not None and len(rows) >= limit_rows:
                    break
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc}); save the table as UTF-8 CSV") from None
    except csv.Error as exc:
        raise UserError(f"{path}: malformed CSV ({exc})") from None
    detected = None
    if label_col is None and set(header) >= PROTEINGYM_COLUMNS and mutation_col == "mutant":
        label_col = "DMS_score"  # a ProteinGym DMS file, read as it is
        detected = (
            f"{path.name}: ProteinGym DMS columns found: mutations from 'mutant', Spearman vs "
            "'DMS_score' (--label-col and --mutation-col choose others)"
        )
    ragged = [(line, len(row)) for line, row in rows if len(row) != len(header)]
    if ragged:  # a cell too many or too few shifts every later column: never guess
        shown = ", ".join(f"line {line} has {n}" for line, n in ragged[:10])
        more = f" (+{len(ragged) - 10} more)" if len(ragged) > 10 else ""
        raise UserError(
            f"{path}: {len(ragged)} malformed row(s) whose number of cells differs from the "
            f"header's {len(header)}: {shown}{more}; fix or remove them (a delimiter inside a "
            "cell needs quotes)"
        )

    def column(name: str, flag: str) -> int:
        if name not in header:
            raise UserError(
                f"{path}: no column {name!r} ({flag}); columns are: "
                + ", ".join(repr(h) for h in header)
            )
        return header.index(name)

    mut_i = column(mutation_col, "--mutation-col")
    label_i = column(label_col, "--label-col") if label_col is not None else None
    if score_col in header:
        raise UserError(
            f"{path} already has a column {score_col!r}; choose another name with --score-col"
        )

    parsed: list[str | None] = []
    skipped: list[tuple[int, str, str]] = []
    for line, row in rows:
        text = row[mut_i] if mut_i < len(row) else ""
        try:
            parse_mutant(text, wt_seq, offset, lm.alphabet)
            parsed.append(text)
        except ValueError as exc:
            parsed.append(None)
            skipped.append((line, text, str(exc)))
    valid = [v for v in parsed if v is not None]
    if not rows:
        raise UserError(f"{path} has no rows to score (only its header)")
    hint = None
    if skipped:
        hint = offset_hint([text for _, text, _ in skipped] + valid, wt_seq, offset, len(valid))
    if not valid:
        raise UserError(
            f"{path}: none of its {len(rows)} row(s) fits the wild type with --offset {offset}; "
            + (hint or "check the wild type and the mutation column (e.g. A42G)")
        )
    prompts = list(context.prompts) if isinstance(context, ContextEnsemble) and per_prompt else []
    if per_prompt and not prompts:
        raise UserError("per_prompt needs a context ensemble (--context with --context-* lists)")
    each = [
        lm.score_variants(
            wt_seq, valid, strategy, offset, toks_per_batch, progress, context=p.context
        )
        for p in prompts
    ]
    values = (
        np.mean(each, axis=0)
        if each
        else lm.score_variants(
            wt_seq, valid, strategy, offset, toks_per_batch, progress, context=context
        )
    )
    columns = [values, *each]
    names = [score_col, *(f"{score_col}:{p.label}" for p in prompts)]
    clash = [n for n in names[1:] if n in header]
    if clash:
        raise UserError(f"{path} already has a column {clash[0]!r}; choose another --score-col")

    def spread(column: np.ndarray) -> list[float | None]:
        it = iter(column.tolist())
        return [None if v is None else next(it) for v in parsed]

    table = [spread(c) for c in columns]
    scores = table[0]

    width = len(header)
    record_path = None if str(out) == "-" else sidecar(out, CONTEXT_SIDECAR)
    if record_path is not None:  # never beside a table it does not describe, even after a kill
        record_path.unlink(missing_ok=True)
    with text_output(out) as fh:
        writer = table_writer(fh, delimiter(out))
        writer.writerow([*header, *names])
        for n, (_, row) in enumerate(rows):
            cells = row + [""] * (width - len(row))
            writer.writerow([*cells, *("" if c[n] is None else f"{c[n]:.6f}" for c in table)])
    if context is not None and record_path is not None:
        record = json.dumps(context_record(context), sort_keys=True, indent=1) + "\n"
        write_text_atomic(record_path, record)

    summary = VariantSummary(
        Path(out), len(rows), len(valid), skipped, label_col=label_col, detected=detected
    )
    if label_i is not None:
        labels = [row[label_i] if label_i < len(row) else "" for _, row in rows]
        summary.spearman, summary.spearman_n = label_spearman(scores, labels)
    if skipped:
        log.warning("%s", summary.skipped_summary())
    if hint:
        log.warning("%s", hint)
    return summary
