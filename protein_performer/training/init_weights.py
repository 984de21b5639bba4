"""Start a training run from existing weights (``init_from=PATH``), e.g. converted ESM-2.

Unlike ``ckpt_path`` (which resumes a run: weights, optimizer, schedule, step), this only
copies model weights into a freshly built module, so the run's own config decides the attention
core, the optimizer and the schedule. That is how converted exact-attention ESM-2 weights are
fine-tuned with FAVOR+ (the Performer paper's §4.3 backward compatibility).

Strict about shapes: every weight of the new model must come from the source with the same
shape, and nothing in the source may be left over, so a wrong model size fails loudly instead of
training from a half-random start. What the cores declare drawn (FAVOR+'s ``omega`` and
``oprf_rho``) is not copied: the source may be exact or use another m, and the FeatureRedraw
callback draws omega at step 0. Every learned tensor is (a position memory's included).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from protein_performer.errors import UserError

log = logging.getLogger(__name__)

#: Config fields that change what the weights compute without changing any shape.
_SEMANTIC_FIELDS = ("token_dropout", "layer_norm_eps", "rotary_base", "objective")
_SHOW = 6


def init_from(module: Any, path: str | os.PathLike[str]) -> list[str]:
    """Copy the weights of ``path`` into ``module.model`` (a ``ProteinLMModule``'s PerformerLM).

    ``path`` is any source the one loader, ``protein_performer.interop.loading.load_model``,
    reads: a ``.ckpt``, an export directory such as ``protein-performer convert-esm`` writes,
    or an ESM-2 source (fair-esm ``.pt``, Hugging Face directory or cached id) read as exact
    attention. The source's contact regression, if any (ESM-2's contact head), goes into the
    module's checkpoints. Returns the names of the drawn tensors left as the module drew them.
    """
    from protein_performer.interop.loading import load_model
    from protein_performer.interop.weights import diff_state
    from protein_performer.model.cores import drawn_keys

    source = load_model(path, "cpu")
    model = module.model
    target_cfg, source_cfg = model.config, source.config
    if target_cfg.heads != source_cfg.heads:  # same shapes, different function: refuse
        raise UserError(
            f"init_from={path}: the weights were trained with heads={source_cfg.heads}, "
            f"model.config has heads={target_cfg.heads}; set model.config.heads="
            f"{source_cfg.heads}"
        )
    for name in _SEMANTIC_FIELDS:
        ours, theirs = getattr(target_cfg, name), getattr(source_cfg, name)
        if ours != theirs:
            log.warning(
                "init_from %s: model.config.%s=%r but the weights were trained with %r; the "
                "fine-tuned model starts from a different function (set model.config.%s=%r to "
                "keep it)",
                path,
                name,
                ours,
                theirs,
                name,
                theirs,
            )

    source_drawn, drawn = drawn_keys(source.model), drawn_keys(model)
    src_state = {k: v for k, v in source.model.state_dict().items() if k not in source_drawn}
    kept = sorted(drawn)
    diff = diff_state(model, src_state, drawn.__contains__)
    missing, unexpected = sorted(diff.missing), sorted(diff.unexpected)
    wrong = [f"{k} {theirs} -> {ours}" for k, theirs, ours in diff.mismatched]
    problems = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
        if keys:
            problems.append(f"{len(keys)} {label}: {', '.join(keys[:_SHOW])}")
    if problems:
        shape = (
            f"dim={source_cfg.dim} depth={source_cfg.depth} heads={source_cfg.heads} "
            f"ff_dim={source_cfg.ff_dim}"
        )
        raise UserError(
            f"init_from={path}: the weights do not fit model.config ({' | '.join(problems)}); "
            f"the source has {shape}: set model.config to that shape"
        )
    model.load_state_dict(src_state, strict=False)
    if source.contact_regression is not None:
        module.contact_regression = source.contact_regression
        log.info("carrying the contact regression of %s into this run's checkpoints", path)
    log.info(
        "initialized %s tensors from %s (%s attention source; drawn tensors kept: %d)",
        f"{len(src_state):,}",
        path,
        source_cfg.attention,
        len(kept),
    )
    return kept


def check_init_from(cfg: Any) -> None:
    """Fail before anything is built when the experiment needs ``init_from`` and has none.

    ``init_from_required: true`` marks experiments that only make sense from existing weights;
    without this check they would silently train from random weights.
    """
    if cfg.get("init_from_required") and not cfg.get("init_from") and not cfg.get("ckpt_path"):
        raise UserError(
            "this experiment fine-tunes existing weights: add init_from=PATH (an export from "
            "`protein-performer convert-esm`, a .ckpt, or an ESM-2 .pt / Hugging Face directory)"
        )


def maybe_init_from(module: Any, cfg: Any) -> str | None:
    """The ``train(cfg)`` hook: apply ``cfg.init_from`` when set; returns the path used.

    Skipped when resuming (``ckpt_path``): the checkpoint restores the weights anyway, and the
    source need not exist any more.
    """
    check_init_from(cfg)
    path = cfg.get("init_from")
    if not path or cfg.get("ckpt_path"):
        return None
    init_from(module, path)
    return str(path)
