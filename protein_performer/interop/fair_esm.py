"""fair-esm ESM-2 checkpoints (``esm2_t6_8M_UR50D.pt``), one source of the one loader: a pickle
(read once by the dispatcher through ``safe_load``) holding a ``model`` state dict and no
``state_dict``; renamed and built by ``convert_esm``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protein_performer.interop.convert_esm import build_esm, read_fair_esm
from protein_performer.interop.record import LoadedModel, LoadOptions


def detect(path: Path, data: Any) -> bool:
    """A file whose contents hold fair-esm's ``model`` mapping (ours hold ``state_dict``)."""
    return (
        isinstance(data, Mapping)
        and "state_dict" not in data
        and isinstance(data.get("model"), Mapping)
    )


def read(path: Path, data: Any, options: LoadOptions) -> LoadedModel:
    """The ESM-2 model with the attention ``options`` ask for (default: exact)."""
    return build_esm(read_fair_esm(path, data), options)
