"""A model as a Hugging Face ``EsmForMaskedLM`` directory (``export --format hf``).

``PerformerLM`` has ESM-2's architecture (fair-esm names, rotary, pre-LayerNorm, tied LM head), so
leaving for transformers is the import run backwards: the same name table
(:data:`convert_esm.HF_LAYER_MODULES`), an ``EsmConfig`` written from ``PerformerConfig``, ESM-2's
tokenizer files, and the contact regression as ``esm.contact_head`` (a regression that reads a
subset of layers and heads gets zero weight elsewhere: the same function). Only plain JSON and
safetensors are written, so ``transformers`` is not needed to export.

What cannot leave as is: transformers has no FAVOR+, so a FAVOR+ model is exported only with
``as_exact`` (the same weights under the exact softmax attention that FAVOR+ estimates; its
outputs then differ from the FAVOR+ model's by the approximation error, as ``convert-esm
--attention favor`` differs from ESM-2 the other way), and never with the ReLU kernel, which
approximates no softmax. Causal models are refused: HF's ESM is bidirectional.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protein_performer._version import __version__
from protein_performer.errors import UserError
from protein_performer.interop.convert_esm import ESM2_VOCAB, hf_name
from protein_performer.interop.export import write_json
from protein_performer.interop.ours import CONFIG_FILE, WEIGHTS_FILE
from protein_performer.interop.record import LoadedModel
from protein_performer.io.atomic import publish_directory
from protein_performer.io.json_safe import read_json
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.cores import drawn_keys, model_cores

log = logging.getLogger(__name__)

VOCAB_FILE = "vocab.txt"
SPECIAL_TOKENS = {
    "cls_token": "<cls>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
}
#: What the exported config says, and export warns, when the model has no contact regression.
NO_CONTACT_HEAD = (
    "none (transformers initializes esm.contact_head at random, so predict_contacts and "
    "return_contacts give meaningless maps)"
)
#: ESM-2's own config value (rotary positions make it irrelevant to the computation).
MAX_POSITION_EMBEDDINGS = 1026


def is_hf_export(path: Path) -> bool:
    """A directory this exporter wrote (or any HF ESM model): replaceable with --overwrite."""
    try:
        meta = read_json(path / CONFIG_FILE)
    except UserError:
        return False
    return isinstance(meta, dict) and meta.get("model_type") == "esm"


def check_exportable(loaded: LoadedModel, as_exact: bool) -> None:
    """Refuse what ``EsmForMaskedLM`` cannot compute, with what to do instead."""
    cfg = loaded.config
    if cfg.causal:
        raise UserError(
            f"{loaded.source} is a causal LM (objective clm); Hugging Face's ESM is a "
            "bidirectional masked LM and cannot run it: use --format native"
        )
    if tuple(loaded.alphabet.tokens) != ESM2_VOCAB:
        raise UserError(f"{loaded.source}: the vocabulary is not ESM-2's; use --format native")
    for core in model_cores(loaded.model):
        chain = core.cores()
        if any(p.numel() for p in core.parameters()):
            raise UserError(
                f"{loaded.source} uses {core.label or core.name}, which Hugging Face's ESM "
                "cannot express (its learned weights have no place there): use --format native"
            )
        if any(c.softmax == "none" for c in chain):
            raise UserError(
                f"{loaded.source} uses {core.label or core.name} (the {cfg.kernel} kernel), a "
                "generalized attention (like Performer-ReLU) that approximates no softmax: exact "
                "attention would compute another function; use --format native"
            )
        if any(c.softmax == "estimate" for c in chain) and not as_exact:
            raise UserError(
                f"{loaded.source} uses {core.label or core.name}, which transformers does not "
                "have. Pass --as-exact to export the same weights for exact softmax attention "
                "(the function it estimates: outputs then differ by the approximation error, "
                "like an exact-vs-FAVOR+ conversion of ESM-2), or keep --format native"
            )


def hf_config(loaded: LoadedModel) -> dict[str, Any]:
    """``EsmConfig`` fields (every one transformers writes) for the model."""
    cfg = loaded.config
    draws = bool(drawn_keys(loaded.model))  # random features: their kernel and m say which
    return {
        "architectures": ["EsmForMaskedLM"],
        "model_type": "esm",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.ff_dim,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "position_embedding_type": "rotary",
        "rope_theta": cfg.rotary_base,
        "layer_norm_eps": cfg.layer_norm_eps,
        "emb_layer_norm_before": False,
        "token_dropout": cfg.token_dropout,
        "pad_token_id": cfg.pad_idx,
        "mask_token_id": cfg.mask_idx,
        "eos_token_id": cfg.eos_idx,
        "bos_token_id": None,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "is_decoder": False,
        "add_cross_attention": False,
        "is_folding_model": False,
        "esmfold_config": None,
        "vocab_list": None,
        "use_cache": True,
        "dtype": "float32",
        # transformers' default (sdpa) attention returns no attention maps, and ESM's contact
        # head reads them: predict_contacts would fail on a plain from_pretrained(DIR). Eager
        # computes the same function; a caller can still ask for sdpa explicitly.
        "attn_implementation": "eager",
        "protein_performer": {
            "version": __version__,
            "source": loaded.source.name,
            "attention": cfg.attention,
            "kernel": cfg.kernel if draws else None,
            "nb_features": cfg.nb_features if draws else None,
            "contact_head": (
                "the model's contact regression"
                if loaded.contact_regression is not None
                else NO_CONTACT_HEAD
            ),
        },
    }


def contact_head(regression: ContactRegression, depth: int, heads: int) -> dict[str, torch.Tensor]:
    """``esm.contact_head`` weights computing ``regression`` (zeros for maps it does not read)."""
    grid = np.zeros((depth, heads), dtype=np.float64)
    for a, layer in enumerate(regression.layers):
        for b, head in enumerate(regression.heads):
            grid[layer - 1, head] = regression.coef_grid()[a, b]
    weight = torch.from_numpy(grid.reshape(1, -1)).float()
    bias = torch.tensor([regression.intercept], dtype=torch.float32)
    return {"esm.contact_head.regression.weight": weight, "esm.contact_head.regression.bias": bias}


def export_hf(
    loaded: LoadedModel,
    out_dir: str | os.PathLike[str],
    *,
    as_exact: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``vocab.txt``, ``tokenizer_config.json``
    and ``special_tokens_map.json`` for ``EsmForMaskedLM.from_pretrained``, atomically."""
    from safetensors.torch import save_file

    check_exportable(loaded, as_exact)
    # EsmForMaskedLM's weights are the parameters, the tied matrix once; what the cores draw
    # (FAVOR+'s random features and statistic, buffers) has no place there.
    state = {
        hf_name(k): v.detach().to("cpu", torch.float32).contiguous()
        for k, v in loaded.model.named_parameters()
    }
    if loaded.contact_regression is not None:
        regression = ContactRegression.from_dict(loaded.contact_regression, loaded.source)
        regression.check_model(loaded)
        state.update(contact_head(regression, loaded.config.depth, loaded.config.heads))
    else:
        log.warning(
            "%s has no contact regression, so the export's esm.contact_head is transformers' "
            "random initialization: predict_contacts and return_contacts give meaningless maps "
            "(the weights and logits are fine). For working contacts, fit a regression with "
            "`protein-performer contacts fit` and export again",
            loaded.source,
        )
    tokenizer = {"tokenizer_class": "EsmTokenizer", "model_max_length": 10**30, **SPECIAL_TOKENS}
    files: dict[str, Callable[[Path], Any]] = {
        WEIGHTS_FILE: lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        CONFIG_FILE: lambda p: write_json(p, hf_config(loaded)),
        VOCAB_FILE: lambda p: p.write_text("\n".join(ESM2_VOCAB) + "\n", encoding="utf-8"),
        "tokenizer_config.json": lambda p: write_json(p, tokenizer),
        "special_tokens_map.json": lambda p: write_json(p, SPECIAL_TOKENS),
    }
    return publish_directory(out_dir, files, overwrite, "a Hugging Face model", is_hf_export)
