"""The one loader: every source a command or ``protein_performer.load`` accepts becomes a
model through :func:`load_model`, so training (``init_from``, the distillation teacher) and
inference (every command taking CKPT, ``convert-esm`` = load + export) read weights one way.
Weights I/O sits on the model floor, below training and inference, which import it.

Sources, told apart by their contents, not their names:

* a Lightning checkpoint (``protein-performer train``): the architecture is
  ``checkpoint["performer_config"]`` (or, for older checkpoints, ``hyper_parameters["config"]``),
  the weights ``state_dict`` under the ``model.`` prefix;
* an exported directory (``export``, ``convert-esm``): ``config.json`` (format name and
  version, the architecture, the vocabulary) + ``model.safetensors`` (weights only);
* pretrained ESM-2: a fair-esm ``.pt``, a Hugging Face ``EsmForMaskedLM`` directory or a model
  id in the local Hugging Face cache (never downloaded), read by ``interop.convert_esm``'s
  private readers and built here (exact attention unless asked otherwise).

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
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError, check_format_header
from protein_performer.interop.convert_esm import (
    EsmSource,
    _hf_snapshot,
    _keys_message,
    _read_fair_esm,
    _read_hf,
)
from protein_performer.interop.finetuned import is_finetuned, read_finetuned
from protein_performer.io.atomic import (
    default_file_mode,
    disk_full_error,
    fsync_path,
    is_disk_full,
    make_temp_dir,
    replace_dir,
)
from protein_performer.io.checkpoints import (
    CONTACT_REGRESSION_KEY,
    check_finite,
    read_safetensors_header,
    safe_load,
)
from protein_performer.io.json_safe import read_json
from protein_performer.model.config import ATTENTIONS, KERNELS, PerformerConfig
from protein_performer.model.contact_head import ContactRegression, model_identity
from protein_performer.model.performer import PerformerLM

log = logging.getLogger(__name__)

FORMAT_NAME = "protein_performer.model"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: The model's own contact regression (converted ESM-2 head or a fit), inside an export directory.
REGRESSION_FILE = "contact_regression.json"
#: Prefix of the model's weights inside the LightningModule's state dict.
LIGHTNING_PREFIX = "model."
_SHOW_KEYS = 5  # how many offending keys an error message names


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, on ``device``) and what it was built from."""

    model: PerformerLM
    config: PerformerConfig
    alphabet: Alphabet
    source: Path  # the file or directory read (for a Hugging Face id, its cached snapshot)
    device: torch.device
    kind: str  # "lightning", "export", "fair-esm" or "hf"
    #: The contact regression stored with the model (``ContactRegression.to_dict()``), if any.
    contact_regression: dict[str, Any] | None = None
    #: A fine-tuned model's task head (``model.task_heads.TaskHead``; ``interop.finetuned``).
    task: Any = None
    #: A fine-tuned model's LoRA settings and PEFT ``LoraModel`` (None once merged or for
    #: ``full``/``frozen`` fine-tunes).
    lora: dict[str, Any] | None = None
    adapters: Any = None


# --------------------------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------------------------
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available) -> a torch device.

    Asking for CUDA on a machine without it is an error rather than a silent CPU fallback: a
    user who asked for the GPU and gets a 50x slower run deserves to know why (ESM's ignored
    ``--nogpu`` is the cautionary tale).
    """
    if isinstance(device, torch.device):
        device = str(device)
    name = str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UserError(
                f"device {device!r} requested but CUDA is not available (torch "
                f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); use "
                "--device cpu or --device auto"
            )
        if name.startswith("cuda:"):
            index = name.split(":", 1)[1]
            if not index.isdigit() or int(index) >= torch.cuda.device_count():
                raise UserError(
                    f"device {device!r} does not exist: this machine has "
                    f"{torch.cuda.device_count()} CUDA device(s) (cuda:0..)"
                )
        return torch.device(name)
    raise UserError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto")


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 62


def _available_memory() -> tuple[int, str]:
    """Bytes this process can allocate now and what they are: Linux's ``MemAvailable`` (free
    plus reclaimable cache), else the machine's total. Total RAM alone let a model that fits
    only on an idle machine start swapping, or be killed, minutes into building it."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available"
    except (OSError, ValueError, IndexError):
        pass
    return _physical_memory(), "total"


def check_fits_in_memory(config: PerformerConfig, where: object) -> None:
    """Refuse, before allocating anything, a model larger than the memory available now: a
    damaged or crafted config (``depth: 200000``) must not take the machine down."""
    numel = config.estimated_numel()
    (have, what), need = _available_memory(), 4 * numel
    if need > have:
        raise UserError(
            f"{where}: the model config describes {numel:,} parameters ({need / 2**30:.1f} GiB "
            f"in float32), more than this machine's {have / 2**30:.1f} GiB of {what} memory: "
            "the config is damaged, or the model needs a bigger (or less busy) machine"
        )


def config_from(data: Any, path: Path, where: str) -> PerformerConfig:
    """A validated config (types, ranges, a size that fits in memory) from a file's data."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UserError(
            f"{path}: {where} must be a mapping of config fields, got {type(data).__name__}"
        )
    try:
        config = PerformerConfig.from_dict(data)
    except UserError as exc:
        raise UserError(f"{path}: {where}: {exc}") from None
    check_fits_in_memory(config, f"{path}: {where}")
    return config


class _NoRandomInit(TorchFunctionMode):
    """Skips random initialisation of meta tensors (there is nothing to fill): torch's first
    ``normal_`` on the meta device imports its reference kernels, about 5 s of CPU, which every
    load would otherwise pay just to learn the model's shapes."""

    _SKIP = frozenset({"normal_", "uniform_", "trunc_normal_"})

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,  # noqa: ANN401 - torch's protocol
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:  # noqa: ANN401
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self._SKIP:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def _check_shapes(
    config: PerformerConfig, found: Mapping[str, tuple[int, ...]], where: object, fix: str
) -> None:
    """Tensor names and shapes (a safetensors header, a checkpoint's state dict) against those
    ``config`` implies, before the model is built: a config edited to ``depth: 20000`` beside
    a normal state dict is refused at once, not after allocating 20000 layers."""
    one = dataclasses.replace(config, depth=1)
    # Shapes without memory: one block stands for every block.
    with torch.device("meta"), _NoRandomInit():
        shapes = {k: tuple(v.shape) for k, v in PerformerLM(one).state_dict().items()}
    block = {k[len("layers.0.") :]: v for k, v in shapes.items() if k.startswith("layers.0.")}
    top = {k: v for k, v in shapes.items() if not k.startswith("layers.")}
    unexpected: list[str] = []
    wrong: list[str] = []
    for name, shape in found.items():
        parts = name.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit():
            want = block.get(parts[2]) if int(parts[1]) < config.depth else None
        else:
            want = top.get(name)
        if want is None:
            unexpected.append(name)
        elif want != tuple(shape):
            wrong.append(f"{name} {tuple(shape)} vs model {want}")
    expected = len(top) + config.depth * len(block)
    matched = len(found) - len(unexpected)
    tied = "lm_head.weight" in top and "lm_head.weight" not in found
    missing: list[str] = []
    if matched + tied < expected:
        tops = (n for n in top if n not in found and n != "lm_head.weight")
        # Generated lazily, stopping at the first few: a depth of 20000 is counted, not listed.
        layers = (f"layers.{i}.{k}" for i in range(config.depth) for k in block)
        for name in chain(tops, (n for n in layers if n not in found)):
            missing.append(name)
            if len(missing) == _SHOW_KEYS:
                break
    count = expected - matched - tied
    named = f"{count} missing key(s) for depth={config.depth}: {', '.join(missing)}"
    problems = _misfit(named if missing else "", unexpected, wrong)
    if problems:
        raise UserError(f"{where}: {' | '.join(problems)}; {fix}")


def _misfit(missing: str, unexpected: list[str], wrong: list[str]) -> list[str]:
    """The parts of a "weights do not fit" message: the missing keys' line as the caller words
    it, then the first unexpected keys and shape mismatches."""
    problems = [missing] if missing else []
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s): {', '.join(unexpected[:_SHOW_KEYS])}"
        )
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:_SHOW_KEYS])}")
    return problems


def _check_weights_header(config: PerformerConfig, weights: Path) -> None:
    """The weights file's tensor names and shapes (read from its header alone) against the
    config's, so a file that does not fit is refused before any tensor is read."""
    _check_shapes(
        config,
        read_safetensors_header(weights),
        f"{weights}: the weights do not fit {CONFIG_FILE}",
        "the files do not belong together: re-export",
    )


Read = tuple[PerformerConfig, dict[str, torch.Tensor], dict[str, Any] | None]


def _read_lightning(path: Path, ckpt: Any) -> Read:
    """A Lightning checkpoint's contents (read by :func:`_read_file`) -> config and weights."""
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        what = (
            f"a dict with keys {sorted(map(str, ckpt))[:8]}"
            if isinstance(ckpt, dict)
            else type(ckpt).__name__
        )
        raise UserError(
            f"{path} is not a protein-performer Lightning checkpoint (no 'state_dict') nor a "
            f"fair-esm ESM-2 one (no 'model'); it holds {what}. Give a .ckpt from "
            "`protein-performer train`, a fair-esm .pt or an exported directory"
        )
    check_finite(ckpt["state_dict"], path)
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
    _check_shapes(
        config,
        {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)},
        f"{path}: the weights do not fit the stored model config",
        "the file was edited or written by an incompatible version",
    )
    return config, state, ckpt.get(CONTACT_REGRESSION_KEY)


def _read_export(path: Path) -> Read:
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
    _check_weights_header(config, weights_path)
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


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier entry's storage (the tied LM-head matrix)."""
    seen: set[int] = set()
    aliases: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen and tensor.numel():
            aliases.add(name)
        seen.add(ptr)
    return aliases


@dataclass
class StateDiff:
    """How a state dict fails to fit a model: names the model has and the state lacks, names
    the model has no place for, and (name, state's, model's) where shapes differ or the kinds
    of number do (the dtypes then named too)."""

    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, str, str]]

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)


def diff_state(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    optional: Callable[[str], bool] = lambda name: False,
) -> StateDiff:
    """``state`` against ``model``'s own state dict, before ``model.load_state_dict(state,
    strict=False)`` copies it in: every weight is compared, and only the names ``optional``
    accepts (a tied alias, FAVOR+ features drawn rather than loaded) may be absent."""
    expected = model.state_dict()
    mismatched = []
    for k, ours in expected.items():
        theirs = state.get(k)
        if theirs is None:
            continue
        # A float tensor stored as integers (a safetensors header whose dtype lies) would
        # otherwise be read as integers and cast, silently.
        kinds = _number_kind(theirs) != _number_kind(ours)
        if kinds or tuple(theirs.shape) != tuple(ours.shape):
            spec = (f"{tuple(t.shape)}" + (f" {t.dtype}" if kinds else "") for t in (theirs, ours))
            mismatched.append((k, *spec))
    return StateDiff(
        missing=[k for k in expected if k not in state and not optional(k)],
        unexpected=[k for k in state if k not in expected],
        mismatched=mismatched,
    )


def _number_kind(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.bool:
        return "bool"
    return "float" if tensor.is_floating_point() or tensor.is_complex() else "integer"


def _load_weights(model: PerformerLM, state: dict[str, torch.Tensor], path: Path) -> None:
    """Strict load with a message naming the first mismatching keys and shapes."""
    expected = model.state_dict()
    aliases = tied_aliases(model)
    diff = diff_state(model, state, aliases.__contains__)
    missing, unexpected = diff.missing, diff.unexpected
    wrong = [f"{k} {theirs} vs model {ours}" for k, theirs, ours in diff.mismatched]
    problems = _misfit(
        f"{len(missing)} missing key(s): {', '.join(missing[:_SHOW_KEYS])}" if missing else "",
        unexpected,
        wrong,
    )
    if problems:
        raise UserError(
            f"{path}: the weights do not fit the stored model config: {' | '.join(problems)}. "
            "The file was edited or written by an incompatible version"
        )
    full = dict(state)
    for k in aliases:
        full.setdefault(k, state.get(k, expected[k]))
    model.load_state_dict(full, strict=False)
    # Re-tie: load_state_dict copies into the shared Parameter, but an alias given explicitly
    # (Lightning stores both names) must not silently untie anything.
    if model.lm_head.weight is not model.embed_tokens.weight:  # pragma: no cover - defensive
        model.lm_head.weight = model.embed_tokens.weight


# --------------------------------------------------------------------------------------------
# ESM-2 weights and attention swaps
# --------------------------------------------------------------------------------------------
def _generated(name: str) -> bool:
    """Buffers drawn rather than imported (FAVOR+ random features)."""
    return ".self_attn.favor." in name


def _not_imported(name: str) -> bool:
    """Model entries no ESM-2 source supplies: FAVOR+ features and the tied LM-head alias."""
    return _generated(name) or name == "lm_head.weight"


def _build_esm(source: EsmSource, config: PerformerConfig, seed: int) -> LoadedModel:
    """A ``PerformerLM`` holding an ESM-2 source's weights, eval mode, on CPU.

    FAVOR+ features come from ``torch.Generator().manual_seed(seed)`` (layer by layer, as
    ``redraw_features``), so the same source, options and seed give bit-identical models on
    any device. The global RNG is left untouched.
    """
    check_fits_in_memory(config, source.path)
    check_finite(source.state, source.path)
    with torch.random.fork_rng(devices=[]):
        model = PerformerLM(config)
    diff = diff_state(model, source.state, _not_imported)
    missing, unexpected = sorted(diff.missing), sorted(diff.unexpected)
    wrong = [f"{k} {theirs} vs {ours}" for k, theirs, ours in diff.mismatched]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {_keys_message(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_keys_message(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} with wrong shape: {_keys_message(wrong)}")
    if problems:
        raise UserError(
            f"{source.path}: the weights do not form an ESM-2 of the declared shape "
            f"({source.depth} layers, dim {source.dim}, {source.heads} heads): "
            f"{' | '.join(problems)}"
        )
    model.load_state_dict(source.state, strict=False)
    model.redraw_features(torch.Generator().manual_seed(seed))
    model.eval()
    loaded = LoadedModel(model, config, Alphabet(), source.path, torch.device("cpu"), source.kind)
    if source.contact_head is not None:
        loaded.contact_regression = _head_regression(source, loaded).to_dict()
    if source.dropped:
        log.info("not imported (recomputed or unused): %s", _keys_message(sorted(source.dropped)))
    return loaded


def _head_regression(source: EsmSource, loaded: LoadedModel) -> ContactRegression:
    """ESM-2's contact head as a regression: same features (every layer x head map,
    layer-major, symmetrized, APC), same logistic link."""
    weight, bias = source.contact_head  # type: ignore[misc]
    coef = weight.detach().double().reshape(-1).numpy()
    if coef.size != source.depth * source.heads or bias.numel() != 1:
        raise UserError(
            f"{source.path}: the contact head has {coef.size} weights and {bias.numel()} bias; "
            f"ESM-2's reads {source.depth} layers x {source.heads} heads and has one bias"
        )
    return ContactRegression(
        coef,
        float(bias.reshape(-1)[0]),
        list(range(1, source.depth + 1)),
        list(range(source.heads)),
        meta={"origin": f"ESM-2 contact head of {source.path.name}"},
        **model_identity(loaded),
    )


def _swap_attention(model: PerformerLM, config: PerformerConfig, seed: int) -> PerformerLM:
    """A copy of ``model`` with the same weights and ``config``'s attention core (eval mode).

    The backward-compatibility question of the Performer paper (§4.3): every weight is shared,
    only the attention kernel changes; FAVOR+ features are drawn from ``seed`` with a generator
    on the model's device (the source's own features are not carried over, so the result
    depends on ``seed`` alone).
    """
    with torch.random.fork_rng(devices=[]):
        twin = PerformerLM(config).to(next(model.parameters()).device)
    weights = {k: v for k, v in model.state_dict().items() if not _generated(k)}
    diff = diff_state(twin, weights, _not_imported)
    if diff:  # pragma: no cover - same architecture by design
        raise RuntimeError(f"swap failed: {diff}")
    twin.load_state_dict(weights, strict=False)
    generator = torch.Generator(device=twin.embed_tokens.weight.device).manual_seed(seed)
    twin.redraw_features(generator)
    return twin.eval()


def _check_options(attention: str | None, kernel: str | None, nb_features: int | None) -> None:
    if attention is not None and attention not in ATTENTIONS:
        raise UserError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if kernel is not None and kernel not in KERNELS:
        raise UserError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if nb_features is not None and nb_features <= 0:
        raise UserError(f"nb_features must be a positive integer, got {nb_features}")


def _retarget(
    loaded: LoadedModel,
    attention: str | None,
    kernel: str | None,
    nb_features: int | None,
    seed: int,
) -> LoadedModel:
    """``loaded`` with the attention asked for; unchanged (stored features kept) when the
    options leave its config as it is."""
    config = dataclasses.replace(
        loaded.config,
        attention=attention or loaded.config.attention,
        kernel=kernel or loaded.config.kernel,
        nb_features=nb_features or loaded.config.nb_features,
    )
    if config == loaded.config:
        return loaded
    try:
        config.validate()
    except UserError as exc:
        raise UserError(f"{loaded.source}: {exc}") from None
    model = _swap_attention(loaded.model, config, seed)
    return dataclasses.replace(loaded, model=model, config=config)


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------
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
    snapshot = _hf_snapshot(text)
    if snapshot is None:
        raise UserError(f"{src} does not exist: {_ACCEPTED}")
    return snapshot


def _is_hf_dir(path: Path) -> bool:
    """A Hugging Face config (``model_type``) rather than our export header (``format``);
    anything unreadable goes to the export reader, whose messages name the problem."""
    try:
        meta = read_json(path / CONFIG_FILE)
    except UserError:
        return False
    return isinstance(meta, dict) and "model_type" in meta and "format" not in meta


def _read_ours(src: Path, kind: str, read: Read) -> LoadedModel:
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
    _load_weights(model, state, src)
    model.eval()
    return LoadedModel(model, config, alphabet, src, torch.device("cpu"), kind, regression)


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
    if isinstance(source, LoadedModel):
        target = resolve_device(device)
        loaded = _retarget(source, attention, kernel, nb_features, seed)
    else:
        src = _locate(source)
        target = resolve_device(device)
        if src.is_dir() and _is_hf_dir(src):
            esm: EsmSource | None = _read_hf(src)
        elif src.is_dir():
            esm = None
            loaded = _read_ours(src, "export", _read_export(src))
        else:
            data = safe_load(src, "fair-esm", what=_ACCEPTED.removeprefix("give "))
            fair = isinstance(data, Mapping) and "state_dict" not in data
            if fair and isinstance(data.get("model"), Mapping):
                esm = _read_fair_esm(src, data)
            elif is_finetuned(data):  # `protein-performer finetune`: backbone + task head
                esm = None
                loaded = read_finetuned(src, data)
                if attention or kernel or nb_features:
                    raise UserError(
                        f"{src} is a fine-tuned model: its head was trained on this attention "
                        "core; load it without attention/kernel/nb_features"
                    )
            else:
                esm = None
                loaded = _read_ours(src, "lightning", _read_lightning(src, data))
        if esm is not None:
            config = esm.config(attention or "exact", kernel or "softmax", nb_features)
            loaded = _build_esm(esm, config, seed)
        else:
            loaded = _retarget(loaded, attention, kernel, nb_features, seed)
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
# Export
# --------------------------------------------------------------------------------------------
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

    from protein_performer import __version__

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


def publish_directory(
    out_dir: str | os.PathLike[str],
    files: Mapping[str, Callable[[Path], Any]],
    overwrite: bool,
    what: str,
    is_ours: Callable[[Path], bool],
) -> Path:
    """Write ``files`` (name -> writer of that path) into a temporary sibling of ``out_dir`` and
    put it in place atomically. A non-empty ``out_dir`` is replaced only when ``is_ours`` says
    it holds ``what`` and ``overwrite`` is set: an unrelated directory is never deleted."""
    out = Path(out_dir).expanduser()
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{out} exists and is not a directory; choose another output")
        if any(out.iterdir()):
            if not is_ours(out):
                raise UserError(f"{out} is a non-empty directory that is not {what}; refusing")
            if not overwrite:
                raise UserError(f"{out} already holds {what}; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out)
    try:
        for name, write in files.items():
            write(tmp / name)
            os.chmod(tmp / name, default_file_mode())
            fsync_path(tmp / name)
        replace_dir(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # safetensors says so in its own exception type
            raise disk_full_error(out) from None
        raise
    return out
