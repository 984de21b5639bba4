"""Linearize a softmax protein LM: attention transfer, then an optional LoRA fine-tune.

Why: swapping a trained model's softmax for linear attention and fine-tuning the whole model
(the FAVOR+ recipe, ``scripts/studies/linearize_benchmark.py``) costs full-model steps and
still leaves a gap. Attention transfer (Hedgehog, arXiv 2402.04347; LoLCATs, arXiv 2410.10254)
trains only the linear attention's own parameters (the Hedgehog map, the sliding window's
scale: a few thousand numbers a layer), layer by layer, to reproduce each softmax layer's
output on the softmax layer's own q, k, v. Every other weight is shared and frozen, so one
teacher forward per batch gives every layer's inputs and targets, and the layers fit in
parallel (the loss is a sum of independent per-layer MSEs). A short LoRA fine-tune on MLM
(+ KL to the exact twin) then repairs what the maps could not; the adapters are merged, so
the result is a plain linear-attention model.

Stages run as a plain loop (no Lightning: the teacher's hooks and the per-layer losses do not
fit a LightningModule's one loss), with what ``train`` promises: progress lines, a stop with
one line on a non-finite loss, a resume state written atomically every ``save_every`` steps
(``<OUT>.linearize.pt``), and the output directory published atomically at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protein_performer.data.bundled import DEMO_TRAIN, bundled_path
from protein_performer.errors import UserError
from protein_performer.interop.export import export_model
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel, resolve_device
from protein_performer.io.checkpoints import safe_load, save_atomic
from protein_performer.io.progress import progress
from protein_performer.model.cores import model_cores, upgrade_keys
from protein_performer.model.performer import PerformerLM
from protein_performer.training.distill import distill_kl
from protein_performer.training.linearize_options import LinearizeOptions

log = logging.getLogger(__name__)

#: LoRA on the attention projections, LoLCATs' choice (r=8 on q/k/v/o).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
STATE_VERSION = 1
#: What ``data`` may be: FASTA file(s), one store directory, or None (the demo set).
Data = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


@dataclass
class LinearizeResult:
    out: Path
    transfer_steps: int
    lora_steps: int
    seconds: float  # fitting time of this process (a resumed run counts its own part)
    curve: list[dict[str, float]] = field(default_factory=list)  # per-step losses


# --------------------------------------------------------------------------------------------
# The student: the teacher's weights with a linear core
# --------------------------------------------------------------------------------------------
def _core_params(model: nn.Module, teacher: nn.Module | None = None) -> dict[str, nn.Parameter]:
    """The attention cores' parameters (asked of the cores), by name, less those ``teacher``
    has a value for (a position memory's, copied): what the transfer fits."""
    ids = {id(p) for core in model_cores(model) for p in core.parameters()}
    given = set() if teacher is None else set(teacher.state_dict())
    return {n: p for n, p in model.named_parameters() if id(p) in ids and n not in given}


def linear_student(teacher: PerformerLM, kernel: str, window: int) -> PerformerLM:
    """A copy of ``teacher`` (an exact-attention model) with ``kernel`` linear attention and an
    exact ``window``: every weight shared (a position memory's too: it stays around the new
    core), the new cores' own at their initial values."""
    config = dataclasses.replace(
        teacher.config, attention="linear", kernel=kernel, local_window=window, exact_every=0
    )
    student = PerformerLM(config).to(next(teacher.parameters()).device)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    own = set(_core_params(student, teacher))
    if unexpected or set(missing) - own - {"lm_head.weight"}:  # pragma: no cover - by design
        raise RuntimeError(f"student does not fit the teacher: {missing}, {unexpected}")
    return student


def _teacher_from(src: str | os.PathLike[str] | LoadedModel, device: str) -> LoadedModel:
    """The softmax teacher: exact attention (FAVOR+ weights swapped in memory), any wrapper
    (a position memory) kept; a core that approximates no softmax is refused."""
    loaded = load_model(src, device)
    if loaded.task is not None:
        raise UserError(
            f"{loaded.source} is a fine-tuned model with a task head; linearize its base model"
        )
    attention = [core.cores()[-1] for core in model_cores(loaded.model)]
    other = next((c for c in attention if c.softmax == "none"), None)
    if other is not None:
        raise UserError(
            f"{loaded.source} uses {other.label or other.name}, which approximates no softmax; "
            "linearize the softmax model it came from"
        )
    if any(c.softmax != "exact" for c in attention):
        loaded = load_model(loaded, device, attention="exact")  # FAVOR+ weights: in memory
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    return loaded


# --------------------------------------------------------------------------------------------
# Data: a deterministic stream of batches, so a resumed run sees the batches it would have
# --------------------------------------------------------------------------------------------
def _data_paths(data: Data) -> list[str]:
    """FASTA file(s) or one store as resolved path strings (the demo set when None)."""
    if data is None:
        return [str(bundled_path(DEMO_TRAIN))]
    given = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    return [str(Path(d).expanduser().resolve()) for d in given]


def data_module(data: Data, options: LinearizeOptions, objective: str) -> Any:
    from protein_performer.data.datamodule import ProteinDataModule

    dm = ProteinDataModule(
        _data_paths(data), objective=objective, max_len=options.max_len,
        max_tokens=options.max_tokens, valid_frac=options.heldout_frac,
        test_frac=options.heldout_frac, seed=options.seed, split_flag="--heldout-frac",
    )  # fmt: skip
    dm.setup("fit")
    return dm


def batch_stream(dm: Any, options: LinearizeOptions, start: int) -> Iterator[dict[str, Any]]:
    """The training split's batches from global step ``start`` on: epoch after epoch of
    token-budget batches, reshuffled by (seed, epoch)."""
    from protein_performer.data.sampler import TokenBudgetBatchSampler

    dataset = dm.datasets["train"]
    sampler = TokenBudgetBatchSampler(
        dataset.model_lengths(), options.max_tokens, seed=options.seed, num_replicas=1, rank=0
    )
    per_epoch = len(sampler)
    step = start
    while True:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        for i, indices in enumerate(sampler):
            if i < skip:
                continue
            yield dm.collator([dataset[j] for j in indices])
            step += 1
        skip = 0


# --------------------------------------------------------------------------------------------
# Stage 1: attention transfer
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_attention(teacher: PerformerLM, batch: dict[str, Any]) -> tuple[Tensor, list]:
    """One teacher forward: logits and, per layer, the core's (q, k, v, mask, positions,
    output): the rotary positions a position memory reads."""
    captured: list[tuple[Tensor, ...]] = []

    def grab(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        q, k, v = args[:3]
        mask = kwargs.get("key_padding_mask", args[3] if len(args) > 3 else None)
        out = out[0] if isinstance(out, tuple) else out
        captured.append((q, k, v, mask, kwargs.get("positions"), out))

    hooks = [
        layer.self_attn.core.register_forward_hook(grab, with_kwargs=True)
        for layer in teacher.layers
    ]
    try:
        device = next(teacher.parameters()).device
        logits = teacher(batch["tokens"].to(device), batch["padding_mask"].to(device)).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, captured


def transfer_loss(student: PerformerLM, captured: list, per_layer: bool = False) -> Any:
    """Sum over layers of the MSE between the student core's output on the teacher's q, k, v
    and the teacher core's output, over real tokens (``per_layer``: the list of them)."""
    losses = []
    for layer, (q, k, v, mask, positions, want) in zip(student.layers, captured, strict=True):
        got = layer.self_attn.core(q, k, v, key_padding_mask=mask, positions=positions)
        got = got[0] if isinstance(got, tuple) else got
        err = (got.float() - want.float()).pow(2).mean(-1)  # (B, H, L)
        if mask is not None:
            keep = (~mask.bool())[:, None, :].to(err.dtype)
            losses.append((err * keep).sum() / (keep.sum() * err.shape[1]).clamp_min(1))
        else:
            losses.append(err.mean())
    return losses if per_layer else torch.stack(losses).sum()


# --------------------------------------------------------------------------------------------
# The loop both stages share
# --------------------------------------------------------------------------------------------
def _diverged(stage: str, step: int, last: tuple[int, float] | None, flag: str) -> UserError:
    since = f"last finite loss {last[1]:.4g} at step {last[0]}" if last else "no finite loss yet"
    return UserError(
        f"linearize stopped in the {stage} stage at step {step}: non-finite loss ({since}); "
        f"try a lower {flag}, and rerun with --resume to continue from the last state saved "
        "before the divergence (nothing non-finite was saved)"
    )


#: The resume state's suffix: ``OUT.linearize.pt``, a sidecar of OUT (an output of its own).
STATE_SUFFIX = ".linearize.pt"


def state_path(out: str | os.PathLike[str]) -> Path:
    """The resume state of a linearization into ``out``: beside it, removed when it is done."""
    out = Path(out).expanduser()
    return out.with_name(out.name + STATE_SUFFIX)


def _saved_state(student: nn.Module, cores: dict[str, nn.Parameter],
                 optimizer: torch.optim.Optimizer, stage: str, step: int, key: dict[str, Any],
                 curve: list) -> dict[str, Any]:
    trainable = {n: p.detach().cpu() for n, p in student.named_parameters() if p.requires_grad}
    fitted = {n: p.detach().cpu() for n, p in cores.items()}
    return {
        "version": STATE_VERSION, "key": key, "stage": stage, "step": step,
        "cores": fitted, "trainable": trainable, "optimizer": optimizer.state_dict(),
        "curve": curve,
    }  # fmt: skip


def _run_key(src: Any, data: Any, options: LinearizeOptions) -> dict[str, Any]:
    where = src.source if isinstance(src, LoadedModel) else Path(src).expanduser().resolve()
    return {"source": str(where), "data": _data_paths(data),
            "options": dataclasses.asdict(options)}


def _read_state(path: Path, key: dict[str, Any]) -> dict[str, Any]:
    state = safe_load(path, what="a linearize resume state")
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise UserError(f"{path} is not a linearize resume state of this version; delete it")
    if state.get("key") != key:
        raise UserError(
            f"{path} holds a linearization with other source, data or options "
            f"({state.get('key')}); rerun that command with --resume, or delete {path} to "
            "start this one"
        )
    return state


def _check_tensors(path: Path, what: str, saved: Any, own: dict[str, Tensor]) -> None:
    """``saved`` names exactly the tensors of ``own``, with their shapes, all finite."""
    if not isinstance(saved, dict) or set(saved) != set(own):
        names = sorted(set(saved) ^ set(own)) if isinstance(saved, dict) else []
        raise UserError(
            f"{path}: its {what} are not this model's ({', '.join(names[:3]) or type(saved)}"
            f"{' ...' if len(names) > 3 else ''}); delete it to start over"
        )
    for name, value in saved.items():
        if not isinstance(value, Tensor) or value.shape != own[name].shape:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise UserError(
                f"{path}: {what} {name} has shape {shape}, the model's is "
                f"{tuple(own[name].shape)}; delete it to start over"
            )
        if not bool(torch.isfinite(value).all()):
            raise UserError(f"{path}: {what} {name} is not finite; delete it to start over")


def check_state(path: Path, state: dict[str, Any], options: LinearizeOptions,
                cores: dict[str, Tensor]) -> None:
    """A resume state read back is what this run would have saved: its stage and step within
    the options, one finite curve entry per step fitted (so the steps it reports are true),
    the model's core tensors with their shapes, all finite. A corrupt or crafted state is one
    line instead of exporting non-finite weights or a traceback."""
    stage, step, curve = state.get("stage"), state.get("step"), state.get("curve")
    total = {"transfer": options.steps, "lora": options.lora_steps}.get(stage)
    if total is None or not isinstance(step, int) or isinstance(step, bool):
        raise UserError(f"{path}: stage {stage!r} step {step!r} is no linearize stage; delete it")
    if not 0 <= step <= total:
        raise UserError(f"{path}: {stage} step {step} is outside 0..{total}; delete it")
    want = [("transfer", i + 1) for i in range(options.steps if stage == "lora" else step)]
    want += [("lora", i + 1) for i in range(step if stage == "lora" else 0)]
    ok = isinstance(curve, list) and all(isinstance(c, dict) for c in curve)
    if not ok or [(c.get("stage"), c.get("step")) for c in curve] != want:
        raise UserError(
            f"{path}: its curve does not record the {step} {stage} step(s) it claims; delete it"
        )
    if not all(isinstance(c.get("loss"), float) and math.isfinite(c["loss"]) for c in curve):
        raise UserError(f"{path}: its curve holds a non-finite loss; delete it to start over")
    _check_tensors(path, "core tensors", state.get("cores"), cores)


def _fit(params: list[nn.Parameter], loss_of: Any, batches: Iterator, stage: str, first: int,
         steps: int, lr: float, save: Any, save_every: int, show: bool, curve: list,
         optimizer_state: dict | None) -> None:
    """``steps`` AdamW steps of ``loss_of(batch)`` from step ``first`` (a resume), saving every
    ``save_every``; UserError on a non-finite loss, before anything non-finite is saved."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if optimizer_state is not None:
        try:
            optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise UserError(f"the resume state's optimizer does not fit the model ({exc}); "
                            "delete the state to start over") from None  # fmt: skip
        for value in optimizer.state.values():
            if not all(bool(torch.isfinite(v).all()) for v in value.values()
                       if isinstance(v, Tensor)):  # fmt: skip
                raise UserError("the resume state's optimizer holds non-finite values; delete "
                                "the state to start over")  # fmt: skip
    last: tuple[int, float] | None = None
    flag = "--lr" if stage == "transfer" else "--lora-lr"
    with progress(total=steps, unit="step", desc=stage, enabled=show) as bar:
        bar.update(first)
        for step in range(first, steps):
            loss = loss_of(next(batches))
            value = float(loss.detach())
            if not math.isfinite(value):
                raise _diverged(stage, step, last, flag)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            if not all(bool(torch.isfinite(p).all()) for p in params):
                raise _diverged(stage, step, last, flag)
            last = (step + 1, value)
            curve.append({"stage": stage, "step": step + 1, "loss": value})
            bar.update(1)
            if (step + 1) % save_every == 0 and step + 1 < steps:
                save(optimizer, stage, step + 1)
        save(optimizer, stage, steps)


def lora_settings(options: LinearizeOptions) -> dict[str, Any]:
    return {"r": options.lora_rank, "lora_alpha": 2 * options.lora_rank, "lora_dropout": 0.0,
            "target_modules": list(LORA_TARGETS)}


def fit_linear(
    src: str | os.PathLike[str] | LoadedModel,
    out: str | os.PathLike[str],
    data: Data = None,
    options: LinearizeOptions | None = None,
    *,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
    after_transfer: Callable[[PerformerLM], None] | None = None,
) -> LinearizeResult:
    """Fit a linear-attention twin of ``src`` (any source the loader reads; an exact-attention
    model is its teacher) on ``data`` (FASTA or store; None: the demo set) and export it to
    ``out``. ``resume`` continues from ``out``'s resume state (the same source, data and
    options); without it an existing state is an error, so a run never silently restarts.
    ``after_transfer`` sees the model between the stages (a study measures transfer alone and
    transfer + LoRA in one run)."""
    from protein_performer.interop.finetuned import add_lora

    options = (options or LinearizeOptions()).check()
    device = str(resolve_device(device))
    started = time.perf_counter()
    key = _run_key(src, data, options)
    spot = state_path(out)
    saved = None
    if spot.exists():
        if not resume:
            raise UserError(
                f"{spot} holds an unfinished linearization: rerun with --resume to continue "
                "it, or delete it to start over"
            )
        saved = _read_state(spot, key)
    teacher = _teacher_from(src, device)
    if options.lora_steps and options.lora_rank > teacher.config.dim:
        raise UserError(
            f"linearize: --lora-rank {options.lora_rank} exceeds the model width "
            f"{teacher.config.dim}; a rank above it adds parameters and no capacity"
        )
    torch.manual_seed(options.seed)
    student = linear_student(teacher.model, options.kernel, options.window).train()
    for p in student.parameters():
        p.requires_grad_(False)
    cores = _core_params(student, teacher.model)
    if saved is not None:
        saved["cores"] = upgrade_keys(saved["cores"])
        check_state(spot, saved, options, cores)
        for name, value in saved["cores"].items():
            cores[name].data.copy_(value)
    paths = _data_paths(data)
    log.info("linearize: reading %s and splitting off held-out records", ", ".join(paths)
             if data is not None else f"the bundled demo set ({paths[0]})")  # fmt: skip
    dm = data_module(data, options, teacher.config.objective)
    curve: list[dict[str, float]] = list(saved["curve"]) if saved else []

    def save(optimizer: torch.optim.Optimizer, stage: str, step: int) -> None:
        save_atomic(_saved_state(student, cores, optimizer, stage, step, key, curve), spot)

    stage = saved["stage"] if saved else "transfer"
    first = saved["step"] if saved else 0
    if stage == "transfer":
        for p in cores.values():
            p.requires_grad_(True)

        def transfer(batch: dict[str, Any]) -> Tensor:
            return transfer_loss(student, teacher_attention(teacher.model, batch)[1])

        _fit(list(cores.values()), transfer, batch_stream(dm, options, first), "transfer",
             first, options.steps, options.lr, save, options.save_every, show_progress, curve,
             saved["optimizer"] if saved else None)
        for p in cores.values():
            p.requires_grad_(False)
        stage, first, saved = "lora", 0, None
    if after_transfer is not None:
        after_transfer(student)
    model: nn.Module = student
    if options.lora_steps:
        torch.manual_seed(options.seed + 1)  # the adapters' draw, the same in a resumed run
        adapters = add_lora(student, lora_settings(options))
        if saved is not None:
            own = dict(student.named_parameters())
            trainable = {n: p for n, p in own.items() if p.requires_grad}
            _check_tensors(spot, "adapter tensors", saved.get("trainable"), trainable)
            for name, value in saved["trainable"].items():
                own[name].data.copy_(value)
        weight = options.kl_weight

        def tune(batch: dict[str, Any]) -> Tensor:
            tokens = batch["tokens"].to(device)
            pad = batch["padding_mask"].to(device)
            logits = student(tokens, pad).logits
            mlm = F.cross_entropy(logits.float().flatten(0, 1),
                                  batch["targets"].to(device).flatten(), ignore_index=-100)
            if not weight:
                return mlm
            with torch.no_grad():
                exact = teacher.model(tokens, pad).logits
            return (1 - weight) * mlm + weight * distill_kl(logits, exact, pad, 1.0)

        params = [p for p in student.parameters() if p.requires_grad]
        _fit(params, tune, batch_stream(dm, options, options.steps + first), "lora", first,
             options.lora_steps, options.lora_lr, save, options.save_every, show_progress,
             curve, saved["optimizer"] if saved else None)
        model = adapters.merge_and_unload()
    model.eval()
    result = LoadedModel(
        model, model.config, teacher.alphabet, teacher.source, torch.device(device), "export"
    )
    written = export_model(result, out, overwrite=overwrite)
    spot.unlink(missing_ok=True)
    return LinearizeResult(written, options.steps, options.lora_steps,
                           time.perf_counter() - started, curve)

