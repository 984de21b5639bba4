"""What the checks in scripts/ share (``attack_cases``, ``fault_injection``,
``compare_outputs``): the CLI in a fresh process, seeded tiny exports, the work folder and its
``report.json``. Not a script: the checks import it by name."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: The repository checkout these scripts belong to.
REPO = Path(__file__).resolve().parents[1]
#: The children's environment: this checkout's package, one intra-op thread each (the checks
#: run on small shared machines), no warnings in the stderr a check reads.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def cli(*args: str | Path) -> list[str]:
    """``protein-performer ARGS`` with this interpreter (paths as they are spelled)."""
    return [sys.executable, "-m", "protein_performer.cli.main", *map(str, args)]


def setup(*args: str | Path, cwd: Path | None = None) -> None:
    """Run ``protein-performer ARGS`` to the end to make a check's input (a failure stops)."""
    subprocess.run(cli(*args), cwd=cwd, env=ENV, check=True, capture_output=True)


def tiny_lm(source: Path, config: Any) -> Any:  # noqa: ANN401 - a PerformerConfig / LoadedModel
    """A seeded random ``LoadedModel`` of ``config`` in eval mode on the CPU (any version's
    ``PerformerConfig``: compare_outputs builds it with the older checkout's package)."""
    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(0)
    return LoadedModel(PerformerLM(config).eval(), config, Alphabet(), source,
                       torch.device("cpu"), "export")  # fmt: skip


def tiny_export(path: Path, config: Any) -> Path:  # noqa: ANN401 - a PerformerConfig
    """:func:`tiny_lm` exported to ``path`` (what the CLI reads)."""
    from protein_performer.interop.export import export_model

    return export_model(tiny_lm(path, config), path)


def reference_file(path: Path, dms_id: str, target_seq: str | None = None) -> Path:
    """A one-assay ProteinGym reference (the repository's TEM-1 scan) with ``dms_id``
    (attack_cases and tests/jobs/test_proteingym.py)."""
    with open(REPO / "data" / "proteingym" / "reference_two_assays.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    row["DMS_id"] = dms_id
    if target_seq is not None:
        row["target_seq"] = target_seq
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    return path


def work_dir(out: Path | None, prefix: str) -> Path:
    """``--out`` (created), else a fresh temporary folder."""
    work = out or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def write_report(work: Path, report: dict[str, Any]) -> Path:
    """``work/report.json``, written atomically (a killed check leaves no half report)."""
    from protein_performer.io.atomic import write_text_atomic

    return write_text_atomic(work / "report.json", json.dumps(report, indent=1))
