"""Our own formats, one source of the one loader: a Lightning checkpoint of ``protein-performer
train`` (the architecture in ``checkpoint["performer_config"]``, or for older checkpoints
``hyper_parameters["config"]``; the weights in ``state_dict`` under the ``model.`` prefix) and an
export directory of ``export``/``convert-esm`` (``config.json``: format name and version, the
architecture, the vocabulary; ``model.safetensors``: weights only; optional
``contact_regression.json``). ``export.py`` writes the directory these constants describe.

The other readers claim their sources first; this one takes the rest, so a file that is none of
them gets its message from here (naming what it holds and what to give instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError, check_format_header
from protein_performer.interop.record import LoadedModel, LoadOptions, config_from
from protein_performer.interop.weights import check_shapes, load_weights
from protein_performer.io.checkpoints import (
    CONTACT_REGRESSION_KEY,
    check_finite,
    checked_lightning,
    contents,
    read_safetensors_header,
)
from protein_performer.io.json_safe import read_json
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM

FORMAT_NAME = "protein_performer.model"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: The model's own contact regression (converted ESM-2 head or a fit), inside an export directory.
REGRESSION_FILE = "contact_regression.json"
#: Prefix of the model's weights inside the LightningModule's state dict.
LIGHTNING_PREFIX = "model."

Read = tuple[PerformerConfig, dict[str, torch.Tensor], dict[str, Any] | None]


def detect(path: Path, data: Mapping[str, Any] | None) -> bool:
    """Ours takes whatever the other sources did not claim (its readers say what is wrong)."""
    return True


def read(path: Path, data: Any, options: LoadOptions) -> LoadedModel:
    """An export directory or a Lightning checkpoint's contents -> the stored model (eval, CPU);
    the dispatcher swaps its attention core if ``options`` ask."""
    if path.is_dir():
        return build(path, "export", read_export(path))
    return build(path, "lightning", read_lightning(path, data))


def check_weights_header(config: PerformerConfig, weights: Path) -> None:
    """The weights file's tensor names and shapes (read from its header alone) against the
    config's, so a file that does not fit is refused before any tensor is read."""
    check_shapes(
        config,
        read_safetensors_header(weights),
        f"{weights}: the weights do not fit {CONFIG_FILE}",
        "the files do not belong together: re-export",
    )


def read_lightning(path: Path, ckpt: Any) -> Read:
    """A Lightning checkpoint's contents (read by ``safe_load``) -> config and weights."""
    checked_lightning(
        ckpt,
        path,
        f"{path} is not a protein-performer Lightning checkpoint (no 'state_dict') nor a "
        f"fair-esm ESM-2 one (no 'model'); it holds {contents(ckpt)}. Give a .ckpt from "
        "`protein-performer train`, a fair-esm .pt or an exported directory",
    )
    if "performer_config" in ckpt:
        config = config_from(ckpt["performer_config"], path, "performer_config")
    else:
        hparams = ckpt.get("hyper_parameters")
        if not isinstance(hparams, dict) or "config" not in hparams:
            raise UserError(
                f"{path} stores no model config (neither 'performer_config' nor "
                "hyper_parameters['config']): it was not written by protein-performer's training"
            )
        config = config_from(hparams["config"], path, "hyper_parameters.config")
    state = {
        k[len(LIGHTNING_PREFIX) :]: v
        for k, v in ckpt["state_dict"].items()
        if k.startswith(LIGHTNING_PREFIX)
    }
    if not state:
        raise UserError(
            f"{path}: its state_dict has no '{LIGHTNING_PREFIX}*' weights (keys start with "
            f"{sorted({k.split('.')[0] for k in ckpt['state_dict']})[:5]}); not a "
            "protein-performer checkpoint"
        )
    check_shapes(
        config,
        {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)},
        f"{path}: the weights do not fit the stored model config",
        "the file was edited or written by an incompatible version",
    )
    return config, state, ckpt.get(CONTACT_REGRESSION_KEY)


def read_export(path: Path) -> Read:
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file():
        raise UserError(
            f"{path} is a directory but not an exported model (no {CONFIG_FILE}) nor a Hugging "
            "Face EsmForMaskedLM directory; create one with `protein-performer export CKPT "
            "DIR` or give a .ckpt file"
        )
    if not weights_path.is_file():
        raise UserError(f"{path}: {WEIGHTS_FILE} is missing next to {CONFIG_FILE}; re-export")
    meta = read_json(config_path, "re-export the model")
    check_format_header(meta, config_path, FORMAT_NAME, FORMAT_VERSION, "protein-performer export")
    vocab = meta.get("vocab")
    if vocab is not None and (not isinstance(vocab, list) or tuple(vocab) != Alphabet().tokens):
        raise UserError(
            f"{config_path}: the model's vocabulary differs from the ESM-2 vocabulary this "
            "version uses; it cannot be run with this tokenizer"
        )
    config = config_from(meta.get("config"), config_path, "config")
    check_weights_header(config, weights_path)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        state = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(
            f"{weights_path}: cannot read the weights: truncated or corrupt safetensors file "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); re-export"
        ) from None
    regression = None
    if (path / REGRESSION_FILE).is_file():
        regression = read_json(path / REGRESSION_FILE, "re-export the model or refit it")
    return config, state, regression


def build(src: Path, kind: str, read: Read) -> LoadedModel:
    """A model (eval mode, CPU) from our own config and weights."""
    config, state, regression = read
    check_finite(state, src)
    alphabet = Alphabet()
    if config.vocab_size != len(alphabet):
        raise UserError(
            f"{src}: vocab_size={config.vocab_size} but this version's vocabulary has "
            f"{len(alphabet)} tokens"
        )
    model = PerformerLM(config)
    load_weights(model, state, src)
    model.eval()
    return LoadedModel(model, config, alphabet, src, torch.device("cpu"), kind, regression)
