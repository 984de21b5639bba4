"""Export: a model to the directory ``ours.read_export`` reads back (``config.json`` +
``model.safetensors`` + ``contact_regression.json``), published atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protein_performer._version import __version__
from protein_performer.interop.loading import load_model
from protein_performer.interop.ours import (
    CONFIG_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    REGRESSION_FILE,
    WEIGHTS_FILE,
)
from protein_performer.interop.record import LoadedModel
from protein_performer.interop.weights import tied_aliases
from protein_performer.io.atomic import publish_directory


def is_export_dir(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()


def export_model(
    path_or_loaded: str | os.PathLike[str] | LoadedModel,
    out_dir: str | os.PathLike[str],
    overwrite: bool = False,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ ``contact_regression.json`` when the
    model has one) to ``out_dir``, atomically.

    The directory is assembled under a temporary sibling name and renamed into place only when
    complete, so an interrupted export never leaves something that looks loadable. Tied weights
    are stored once (safetensors refuses aliased tensors); the FAVOR+ ``omega`` buffers are
    stored like any weight. ``overwrite`` replaces an existing export directory (only one:
    an unrelated non-empty directory is never deleted).
    """
    from safetensors.torch import save_file

    loaded = (
        path_or_loaded
        if isinstance(path_or_loaded, LoadedModel)
        else load_model(path_or_loaded, device="cpu")
    )
    model = loaded.model
    aliases = tied_aliases(model)
    state = {
        k: v.detach().to("cpu").contiguous()
        for k, v in model.state_dict().items()
        if k not in aliases
    }
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "protein_performer_version": __version__,
        "config": loaded.config.to_dict(),
        "vocab": list(loaded.alphabet.tokens),
        "tied_weights": sorted(aliases),
        "source": loaded.source.name,
    }
    files: dict[str, Callable[[Path], Any]] = {
        WEIGHTS_FILE: lambda p: save_file(state, str(p), metadata={"format": FORMAT_NAME}),
        CONFIG_FILE: lambda p: write_json(p, meta),
    }
    if loaded.contact_regression is not None:
        files[REGRESSION_FILE] = lambda p: write_json(p, loaded.contact_regression)
    return publish_directory(out_dir, files, overwrite, "an export", is_export_dir)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
