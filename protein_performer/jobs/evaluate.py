"""``eval``: perplexity and accuracy of a checkpoint on held-out data
(:func:`protein_performer.inference.evaluate.measure`) into ``metrics.json`` (everything) and
``bins.csv`` (one row per length bin, then ``all``), and the summary the command prints.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from protein_performer.inference.api import ProteinLM
from protein_performer.io.atomic import write_text_atomic
from protein_performer.io.tables import table_writer

BIN_COLUMNS = ("bin", "records", "tokens", "loss", "ppl", "acc")


def evaluate(
    lm: ProteinLM,
    data: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    **settings: Any,  # noqa: ANN401 - measure's keywords
) -> dict[str, Any]:
    """``lm.measure(data, **settings)``; write ``metrics.json`` and ``bins.csv`` to ``out_dir``
    and return the metrics (``overall``, ``bins``, settings, output paths)."""
    result = lm.measure(data, **settings)
    out_dir = Path(out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, bins_path = out_dir / "metrics.json", out_dir / "bins.csv"
    write_text_atomic(metrics_path, json.dumps(result, indent=2) + "\n")
    table = io.StringIO()
    writer = table_writer(table)
    writer.writerow(BIN_COLUMNS)
    for row in [{"bin": "all", **result["overall"]}, *result["bins"]]:
        writer.writerow(["" if row[c] is None else row[c] for c in BIN_COLUMNS])
    write_text_atomic(bins_path, table.getvalue())
    result["files"] = {"metrics": str(metrics_path), "bins": str(bins_path)}
    return result


def format_table(result: dict[str, Any]) -> str:
    """The printed summary: one line per bin plus the overall line."""

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        f"{result['checkpoint']} on {result['data']} ({result['source']}); {result['method']}",
        f"{'bin':>12} {'records':>8} {'tokens':>10} {'loss':>8} {'ppl':>9} {'acc':>7}",
    ]
    for row in [*result["bins"], {"bin": "all", **result["overall"]}]:
        lines.append(
            f"{row['bin']:>12} {row['records']:>8} {row['tokens']:>10} "
            f"{fmt(row['loss'], '.4f'):>8} {fmt(row['ppl'], '.3f'):>9} {fmt(row['acc'], '.4f'):>7}"
        )
    return "\n".join(lines)
