"""The one line every command that writes files ends with: ``wrote PATH[, PATH...]: DETAIL``.

Why one helper: a user (or a script grepping a log) learns one shape, and a command cannot end
silently or name its output differently from the next. The line goes to standard output,
or to standard error when standard output carries the data (an output given as ``-``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike[str]


def say_wrote(paths: PathLike | Sequence[PathLike], detail: str = "") -> None:
    """Print ``wrote PATHS: DETAIL`` once (``-`` is named ``standard output``)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    names = ["standard output" if os.fspath(p) == "-" else os.fspath(p) for p in items]
    piped = any(os.fspath(p) == "-" for p in items)
    print(f"wrote {', '.join(names)}" + (f": {detail}" if detail else ""),
          file=sys.stderr if piped else sys.stdout)


def say_wrote_run(result: dict[str, Any]) -> None:
    """``train`` / ``finetune``: the run directory, with its checkpoints and metrics."""
    out = result.get("output_dir")
    if not out:
        return
    ckpts = sorted(p.name for p in Path(out, "checkpoints").glob("*.ckpt"))
    held = [f"{len(ckpts)} checkpoint(s)" + (f" ({', '.join(ckpts)})" if ckpts else "")]
    held += [n for n in ("csv/metrics.csv", "training_curve.png") if Path(out, n).is_file()]
    say_wrote(out, ", ".join(held))
