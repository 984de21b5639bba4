"""The one loader: every source a command or ``protein_performer.load`` accepts becomes a
model through :func:`load_model`, so training (``init_from``, the distillation teacher) and
inference (every command taking CKPT, ``convert-esm`` = load + export) read weights one way.
Weights I/O sits on the model floor, below training and inference, which import it.

Sources, told apart by their contents, not their names: one module each, with
``detect(path, data)`` and ``read(path, data, options)``, walked in :data:`SOURCES`' order
(transformers' ``from_pretrained`` dispatch, one small reader per format):

* ``hf_esm``: a Hugging Face ``EsmForMaskedLM`` directory, or a model id in the local Hugging
  Face cache (never downloaded);
* ``fair_esm``: a fair-esm ESM-2 ``.pt`` (both ESM-2 readers build exact attention unless asked
  otherwise);
* ``finetuned``: a ``protein-performer finetune`` checkpoint (backbone, task head, LoRA);
* ``ours``: a Lightning checkpoint of ``protein-performer train`` or an export directory of
  ``export``/``convert-esm``; it takes what the others did not claim and names the problem.

The loaded record (:class:`~protein_performer.interop.record.LoadedModel`) and the weight
checks (``weights.py``) live apart from the readers; ``export.py`` writes what ``ours`` reads.

Why so strict: a ``.ckpt`` or ``.pt`` is a pickle, and unpickling runs arbitrary code. Files are
read once through ``protein_performer.io.checkpoints.safe_load`` (``weights_only=True``, the
fair-esm allowlist: the Lightning one plus ``argparse.Namespace``); anything else is refused
with a message, never unpickled. A config read from a file is checked (types, ranges, the
weights' shapes from the safetensors header, a size that fits in memory) before anything is
allocated, and non-finite weights are refused. The FAVOR+ random features (``omega`` buffers)
are part of the weights of our own checkpoints, so a loaded model reproduces the trained one
exactly; they are drawn (from ``seed``) only when the attention asked for differs from the
stored one, or for ESM-2 weights, which have none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from protein_performer.errors import UserError
from protein_performer.interop import fair_esm, finetuned, hf_esm, ours
from protein_performer.interop.convert_esm import hf_snapshot
from protein_performer.interop.record import LoadedModel, LoadOptions, resolve_device
from protein_performer.interop.weights import diff_state, not_imported
from protein_performer.io.checkpoints import safe_load
from protein_performer.model.config import KERNELS, PerformerConfig
from protein_performer.model.cores import drawn_keys, names
from protein_performer.model.performer import PerformerLM

log = logging.getLogger(__name__)

#: The sources, in the order their ``detect`` is asked; ``ours`` takes the rest.
SOURCES = (hf_esm, fair_esm, finetuned, ours)


_ACCEPTED = (
    "give a .ckpt from `protein-performer train` (e.g. outputs/<task>/<run>/checkpoints/"
    "last.ckpt), a directory from `protein-performer export` or `convert-esm`, a fair-esm "
    "ESM-2 .pt, a Hugging Face EsmForMaskedLM directory or a Hugging Face model id in the "
    "local cache (facebook/esm2_t6_8M_UR50D)"
)


def _locate(source: str | os.PathLike[str]) -> Path:
    """The existing file or directory ``source`` names (a Hugging Face id: its snapshot)."""
    text = os.fspath(source)
    src = Path(text).expanduser()
    if src.exists():
        return src
    snapshot = hf_snapshot(text)
    if snapshot is None:
        raise UserError(f"{src} does not exist: {_ACCEPTED}")
    return snapshot


def load_model(
    source: str | os.PathLike[str] | LoadedModel,
    device: str | torch.device = "auto",
    *,
    attention: str | None = None,
    kernel: str | None = None,
    nb_features: int | None = None,
    seed: int = 0,
) -> LoadedModel:
    """The model of ``source``, in eval mode on ``device``: the one loader.

    ``source``: a Lightning ``.ckpt``, an export directory, a fair-esm ESM-2 ``.pt``, a Hugging
    Face ``EsmForMaskedLM`` directory, a Hugging Face model id in the local cache, or a
    ``LoadedModel`` already in memory (its module is moved, not copied, unless the attention
    changes). ``attention`` (``exact``/``favor``), ``kernel`` and ``nb_features`` default to
    the stored ones, and for ESM-2 weights to exact attention with the softmax kernel; a
    changed core gets FAVOR+ features drawn from ``seed``: on CPU for files (the same features
    on any device), on the model's device for a model in memory.

    Raises ``UserError`` (naming the path) for a missing, truncated, corrupt, foreign or
    incompatible input, so CLIs report one line instead of a traceback.
    """
    _check_options(attention, kernel, nb_features)
    options = LoadOptions(attention, kernel, nb_features, seed)
    if isinstance(source, LoadedModel):
        target = resolve_device(device)
        loaded = source
    else:
        src = _locate(source)
        target = resolve_device(device)
        # A file is unpickled once, safely; every reader gets its contents.
        what = _ACCEPTED.removeprefix("give ")
        data = None if src.is_dir() else safe_load(src, "fair-esm", what=what)
        reader = next(s for s in SOURCES if s.detect(src, data))
        loaded = reader.read(src, data, options)
    loaded = _retarget(loaded, options)
    loaded.model.to(target).eval()
    loaded.device = target
    log.debug(
        "loaded %s (%s, %s, %s) on %s",
        loaded.source,
        loaded.kind,
        loaded.config.objective,
        loaded.config.attention,
        target,
    )
    return loaded


# --------------------------------------------------------------------------------------------
# Attention swaps
# --------------------------------------------------------------------------------------------
def _swap_attention(model: PerformerLM, config: PerformerConfig, seed: int) -> PerformerLM:
    """A copy of ``model`` with the same weights and ``config``'s attention core (eval mode).

    The backward-compatibility question of the Performer paper (§4.3): every weight is shared,
    only the attention kernel changes; FAVOR+ features are drawn from ``seed`` with a generator
    on the model's device (the source's own features are not carried over, so the result
    depends on ``seed`` alone). Wrappers stay around the new core with their learned tensors
    (a position memory's gate and offsets); a learned tensor that has no place in the new core
    (a Hedgehog map swapped for exact) is refused in one line.
    """
    with torch.random.fork_rng(devices=[]):
        twin = PerformerLM(config).to(next(model.parameters()).device)
    drawn = drawn_keys(model)
    weights = {k: v for k, v in model.state_dict().items() if k not in drawn}
    diff = diff_state(twin, weights, not_imported(twin))
    if diff:
        why, keys = (
            ("have no place there", diff.unexpected)
            if diff.unexpected
            else ("would start untrained", diff.missing or [m[0] for m in diff.mismatched])
        )
        raise UserError(
            f"cannot run these weights with {config.attention} attention: {len(keys)} learned "
            f"tensor(s) {why} ({', '.join(keys[:3])})"
        )
    twin.load_state_dict(weights, strict=False)
    generator = torch.Generator(device=twin.embed_tokens.weight.device).manual_seed(seed)
    twin.redraw_features(generator)
    return twin.eval()


def _check_options(attention: str | None, kernel: str | None, nb_features: int | None) -> None:
    if attention is not None and attention not in names():
        raise UserError(f"unknown attention {attention!r}; choose one of {', '.join(names())}")
    if kernel is not None and kernel not in KERNELS:
        raise UserError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if nb_features is not None and nb_features <= 0:
        raise UserError(f"nb_features must be a positive integer, got {nb_features}")


def _retarget(loaded: LoadedModel, options: LoadOptions) -> LoadedModel:
    """``loaded`` with the attention asked for; unchanged (stored features kept) when the
    options leave its config as it is (an ESM-2 source is built with them already)."""
    config = dataclasses.replace(
        loaded.config,
        attention=options.attention or loaded.config.attention,
        kernel=options.kernel or loaded.config.kernel,
        nb_features=options.nb_features or loaded.config.nb_features,
    )
    if config == loaded.config:
        return loaded
    try:
        config.validate()
    except UserError as exc:
        raise UserError(f"{loaded.source}: {exc}") from None
    model = _swap_attention(loaded.model, config, options.seed)
    return dataclasses.replace(loaded, model=model, config=config)
