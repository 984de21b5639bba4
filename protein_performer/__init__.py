"""protein_performer: Performer (FAVOR+) protein language models for long sequences.

``import protein_performer as pp; lm = pp.load("last.ckpt")`` is the Python entry point
(``docs/API.md``). The names below are imported on first use, so ``import protein_performer``
(and the CLI's ``--help``) stays fast and torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protein_performer._version import __version__

__all__ = ["ProteinLM", "UserError", "__version__", "linearize", "load", "read_embeddings"]

if TYPE_CHECKING:
    from protein_performer.errors import UserError
    from protein_performer.inference.api import ProteinLM, load
    from protein_performer.jobs.embeddings_file import read_embeddings

_LAZY = {
    "load": "protein_performer.inference.api",
    "ProteinLM": "protein_performer.inference.api",
    "UserError": "protein_performer.errors",
    "read_embeddings": "protein_performer.jobs.embeddings_file",
}


def linearize(
    src: Any, out: Any, data: Any = None, *, device: str = "auto", resume: bool = False,
    overwrite: bool = False, show_progress: bool = True, **options: Any
) -> ProteinLM:
    """``protein-performer linearize SRC OUT`` (``training.linearize.fit_linear``) with the
    ``LinearizeOptions`` fields as keywords; returns ``load(out, device)``. Here, not in a
    module, because it joins training (the fit) and inference (the loaded model)."""
    from protein_performer.inference.api import load
    from protein_performer.training.linearize import fit_linear
    from protein_performer.training.linearize_options import LinearizeOptions

    fit_linear(src, out, data, LinearizeOptions.of(**options), device=device, resume=resume,
               overwrite=overwrite, show_progress=show_progress)
    return load(out, device)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'protein_performer' has no attribute {name!r}")
