"""Hugging Face ``EsmForMaskedLM`` directories (or a model id in the local cache, resolved by the
dispatcher to its snapshot), one source of the one loader; renamed and built by ``convert_esm``
with ``safetensors`` and ``json`` alone (no ``transformers`` at run time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protein_performer.errors import UserError
from protein_performer.interop.convert_esm import build_esm, read_hf
from protein_performer.interop.ours import CONFIG_FILE
from protein_performer.interop.record import LoadedModel, LoadOptions
from protein_performer.io.json_safe import read_json


def detect(path: Path, data: Any) -> bool:
    """A directory whose ``config.json`` is Hugging Face's (``model_type``) rather than our
    export header (``format``); anything unreadable is left to the export reader, whose
    messages name the problem."""
    if not path.is_dir():
        return False
    try:
        meta = read_json(path / CONFIG_FILE)
    except UserError:
        return False
    return isinstance(meta, dict) and "model_type" in meta and "format" not in meta


def read(path: Path, data: Any, options: LoadOptions) -> LoadedModel:
    """The ESM-2 model with the attention ``options`` ask for (default: exact)."""
    return build_esm(read_hf(path), options)
