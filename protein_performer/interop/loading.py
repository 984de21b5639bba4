"""Rebuild a model from a checkpoint alone, safely, and export it: weights I/O on the model
floor, below training (``init_from``, the distillation teacher) and inference (every command
taking CKPT), which both import it and nothing it imports.

Two on-disk forms load the same way (every inference command accepts either):

* a Lightning ``.ckpt`` written by ``protein-performer train``: the architecture is
  ``checkpoint["performer_config"]`` (or, for older checkpoints, ``hyper_parameters["config"]``),
  the weights ``state_dict`` under the ``model.`` prefix;
* an exported directory (``protein-performer export CKPT DIR``): ``config.json`` (format name and
  version, the architecture, the vocabulary) + ``model.safetensors`` (weights only).

Why so strict: a ``.ckpt`` is a pickle, and unpickling runs arbitrary code. Loading goes through
``protein_performer.io.checkpoints.safe_load`` (``weights_only=True``, a small allowlist); anything
else is refused with a message, never unpickled. A config read from a file is checked (types,
ranges, the weights' shapes from the safetensors header, a size that fits in memory) before
anything is allocated, and non-finite weights are refused. The FAVOR+ random features (``omega``
buffers) are part of the weights in both forms, so a loaded model reproduces the trained one
exactly; they are never redrawn on load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import UserError, check_format_header
from protein_performer.io.atomic import default_file_mode, fsync_path, make_temp_dir, replace_dir
from protein_performer.io.checkpoints import (
    CONTACT_REGRESSION_KEY,
    check_finite,
    load_lightning,
    read_safetensors_header,
)
from protein_performer.model.config import PerformerConfig
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
    source: Path  # the .ckpt file or the export directory
    device: torch.device
    kind: str  # "lightning" or "export"
    #: The contact regression stored with the model (``ContactRegression.to_dict()``), if any.
    contact_regression: dict[str, Any] | None = None


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


def check_fits_in_memory(config: PerformerConfig, where: object) -> None:
    """Refuse, before allocating anything, a model larger than this machine's memory: a
    damaged or crafted config (``depth: 200000``) must not take the machine down."""
    numel = config.estimated_numel()
    need, have = 4 * numel, _physical_memory()
    if need > have:
        raise UserError(
            f"{where}: the model config describes {numel:,} parameters ({need / 2**30:.1f} GiB "
            f"in float32), more than this machine's {have / 2**30:.1f} GiB of memory: the "
            "config is damaged, or the model needs a bigger machine"
        )


def _config_from(data: Any, path: Path, where: str) -> PerformerConfig:
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


def _check_weights_header(config: PerformerConfig, weights: Path) -> None:
    """The weights file's tensor names and shapes (read from its header alone) against the
    config's, so a file that does not fit is refused before any tensor is read."""
    found = read_safetensors_header(weights)
    one = dataclasses.replace(config, depth=1)
    with torch.device("meta"):  # shapes without memory: one block stands for every block
        shapes = {k: tuple(v.shape) for k, v in PerformerLM(one).state_dict().items()}
    block = {k[len("layers.0.") :]: v for k, v in shapes.items() if k.startswith("layers.0.")}
    top = {k: v for k, v in shapes.items() if not k.startswith("layers.")}
    problems: list[str] = []
    seen = 0
    for name, shape in found.items():
        parts = name.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit():
            want = block.get(parts[2]) if int(parts[1]) < config.depth else None
        else:
            want = top.get(name)
        if want is None:
            problems.append(f"unexpected {name}")
        elif want != shape:
            problems.append(f"{name} {shape} vs config {want}")
        else:
            seen += 1
    tied = 1 if "lm_head.weight" in top and "lm_head.weight" not in found else 0
    if not problems and seen + tied != len(top) + config.depth * len(block):
        problems.append(
            f"{len(top) + config.depth * len(block) - seen - tied} tensor(s) missing for "
            f"depth={config.depth}"
        )
    if problems:
        raise UserError(
            f"{weights}: the weights do not fit {CONFIG_FILE} ({len(problems)} problem(s): "
            f"{'; '.join(problems[:_SHOW_KEYS])}); the files do not belong together: re-export"
        )


Read = tuple[PerformerConfig, dict[str, torch.Tensor], dict[str, Any] | None]


def _read_lightning(path: Path) -> Read:
    ckpt = load_lightning(path)
    if "performer_config" in ckpt:
        config = _config_from(ckpt["performer_config"], path, "performer_config")
    else:
        hparams = ckpt.get("hyper_parameters")
        if not isinstance(hparams, dict) or "config" not in hparams:
            raise UserError(
                f"{path} stores no model config (neither 'performer_config' nor "
                "hyper_parameters['config']): it was not written by protein-performer's training"
            )
        config = _config_from(hparams["config"], path, "hyper_parameters.config")
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
    return config, state, ckpt.get(CONTACT_REGRESSION_KEY)


def _read_export(path: Path) -> Read:
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file():
        raise UserError(
            f"{path} is a directory but not an exported model (no {CONFIG_FILE}); create one "
            "with `protein-performer export CKPT DIR` or give a .ckpt file"
        )
    if not weights_path.is_file():
        raise UserError(f"{path}: {WEIGHTS_FILE} is missing next to {CONFIG_FILE}; re-export")
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{config_path}: not valid JSON ({exc}); re-export the model") from None
    check_format_header(meta, config_path, FORMAT_NAME, FORMAT_VERSION, "protein-performer export")
    vocab = meta.get("vocab")
    if vocab is not None and (not isinstance(vocab, list) or tuple(vocab) != Alphabet().tokens):
        raise UserError(
            f"{config_path}: the model's vocabulary differs from the ESM-2 vocabulary this "
            "version uses; it cannot be run with this tokenizer"
        )
    config = _config_from(meta.get("config"), config_path, "config")
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
        try:
            regression = json.loads((path / REGRESSION_FILE).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path / REGRESSION_FILE}: not valid JSON ({exc})") from None
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
    the model has no place for, and (name, state's shape, model's shape) where shapes differ."""

    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]

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
    return StateDiff(
        missing=[k for k in expected if k not in state and not optional(k)],
        unexpected=[k for k in state if k not in expected],
        mismatched=[
            (k, tuple(state[k].shape), tuple(v.shape))
            for k, v in expected.items()
            if k in state and tuple(state[k].shape) != tuple(v.shape)
        ],
    )


def _load_weights(model: PerformerLM, state: dict[str, torch.Tensor], path: Path) -> None:
    """Strict load with a message naming the first mismatching keys and shapes."""
    expected = model.state_dict()
    aliases = tied_aliases(model)
    diff = diff_state(model, state, aliases.__contains__)
    missing, unexpected = diff.missing, diff.unexpected
    wrong = [f"{k} {theirs} vs model {ours}" for k, theirs, ours in diff.mismatched]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {', '.join(missing[:_SHOW_KEYS])}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s): {', '.join(unexpected[:_SHOW_KEYS])}"
        )
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:_SHOW_KEYS])}")
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


def load_model(path: str | os.PathLike[str], device: str | torch.device = "auto") -> LoadedModel:
    """Rebuild the model of a ``.ckpt`` file or an export directory, in eval mode on ``device``.

    Raises ``UserError`` (naming the path) for a missing, truncated, corrupt, foreign or
    incompatible input, so CLIs report one line instead of a traceback.
    """
    src = Path(path).expanduser()
    if not src.exists():
        raise UserError(
            f"{src} does not exist: give a .ckpt from `protein-performer train` (e.g. "
            "outputs/<task>/<run>/checkpoints/last.ckpt) or a directory from "
            "`protein-performer export`"
        )
    target = resolve_device(device)
    if src.is_dir():
        config, state, regression = _read_export(src)
        kind = "export"
    else:
        config, state, regression = _read_lightning(src)
        kind = "lightning"
    check_finite(state, src)
    alphabet = Alphabet()
    if config.vocab_size != len(alphabet):
        raise UserError(
            f"{src}: vocab_size={config.vocab_size} but this version's vocabulary has "
            f"{len(alphabet)} tokens"
        )
    model = PerformerLM(config)
    _load_weights(model, state, src)
    model.to(target).eval()
    log.debug("loaded %s (%s, %s) on %s", src, config.objective, config.attention, target)
    return LoadedModel(model, config, alphabet, src, target, kind, regression)


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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
