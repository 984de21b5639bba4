"""Import pretrained ESM-2 weights (fair-esm ``.pt`` or Hugging Face ``EsmForMaskedLM``).

``PerformerLM`` uses fair-esm's ``ESM2`` module names and order of operations, so importing is a
renaming plus a config derived from the source: with ``attention="exact"`` the converted model
computes ESM-2's forward (logits and hidden states to float32 round-off); with
``attention="favor"`` the same weights run in linear time with freshly drawn random features
(seeded, so a conversion is reproducible).

Both readers are strict: every source tensor is either mapped or on a short list of tensors we
deliberately drop (rotary ``inv_freq`` tables, recomputed from ``rotary_base``; HF's unused
pooler), and every model weight must be filled. Anything else is a ``UserError`` naming the
keys, because a silently half-loaded protein LM still produces plausible-looking numbers.
ESM-2's contact head (a logistic regression over all layer x head attention maps; fair-esm keeps
it in a ``<name>-contact-regression.pt`` beside the model) becomes the model's contact
regression, stored with the export (``contact_regression.json``).

A Hugging Face model id (``facebook/esm2_t6_8M_UR50D``) is resolved in the local Hugging Face
cache only (``HF_HUB_CACHE``, ``HF_HOME``; nothing is downloaded).

The readers (:func:`read_fair_esm`, :func:`read_hf`) give an :class:`EsmSource` and
:func:`build_esm` the model; the two ESM-2 sources of the one loader (``fair_esm.py``,
``hf_esm.py``) are those calls behind a ``detect``. This module imports nothing from the
dispatcher (``loading.py``), so the dispatcher can import it.

fair-esm checkpoints are pickles, read with ``protein_performer.io.checkpoints.safe_load``
(``weights_only=True``; the fair-esm allowlist adds ``argparse.Namespace``, since ESM-2's
``cfg["model"]`` and ESM-1's ``args`` are Namespaces). HF directories are read
with ``safetensors`` and ``json`` alone, so ``transformers`` is not needed at run time.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protein_performer.data.tokenizer import Alphabet
from protein_performer.errors import Rule, UserError, check_group
from protein_performer.interop.identity import model_identity
from protein_performer.interop.record import LoadedModel, LoadOptions, check_fits_in_memory
from protein_performer.interop.weights import diff_state, not_imported
from protein_performer.io.checkpoints import check_finite, safe_load
from protein_performer.io.json_safe import read_json
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.performer import PerformerLM

log = logging.getLogger(__name__)

#: ESM-2's vocabulary (fair-esm ``Alphabet.from_architecture("ESM-1b")``, HF ``vocab.txt``).
ESM2_VOCAB: tuple[str, ...] = (
    "<cls>", "<pad>", "<eos>", "<unk>",
    "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q", "N", "F", "Y", "M", "H",
    "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>",
)  # fmt: skip
#: fair-esm's special indices for that vocabulary.
ESM2_SPECIALS = {"cls_idx": 0, "pad_idx": 1, "eos_idx": 2, "mask_idx": 32}
_SHOW_KEYS = 8  # offending keys named in an error message
_SIZE, _FLAG = Rule(int, 1), Rule(bool)
#: Types of the HF config.json values read here: a string for a number or "no" for a bool is
#: refused, not converted (bool("no") is True).
_HF_VALUES: dict[str, Rule] = {
    **dict.fromkeys(
        ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"), _SIZE
    ),
    "num_attention_heads": _SIZE,
    "pad_token_id": Rule(int, 0, nullable=True),
    "mask_token_id": Rule(int, 0, nullable=True),
    "layer_norm_eps": Rule(float, 0.0, low_open=True),
    "rope_theta": Rule(float, 0.0, low_open=True),
    **dict.fromkeys(
        ("token_dropout", "is_folding_model", "emb_layer_norm_before", "is_decoder"), _FLAG
    ),
    **dict.fromkeys(("add_cross_attention", "tie_word_embeddings"), _FLAG),
    **dict.fromkeys(("model_type", "position_embedding_type", "hidden_act"), Rule(str)),
}
#: The same for a fair-esm checkpoint's cfg["model"] / args.
_FAIR_VALUES: dict[str, Rule] = {
    **dict.fromkeys(("encoder_attention_heads", "attention_heads", "encoder_layers"), _SIZE),
    **dict.fromkeys(("layers", "encoder_embed_dim", "embed_dim"), _SIZE),
    **dict.fromkeys(("encoder_ffn_embed_dim", "ffn_embed_dim"), _SIZE),
    "token_dropout": _FLAG,
}
_ESM1_ARCHS = ("roberta_large", "protein_bert_base", "msa_transformer")


@dataclass
class EsmSource:
    """A source checkpoint read into our parameter names, before a model is built."""

    path: Path
    kind: str  # "fair-esm" or "hf"
    dim: int
    depth: int
    heads: int
    ff_dim: int
    token_dropout: bool
    layer_norm_eps: float
    rotary_base: float
    state: dict[str, torch.Tensor]  # our names (``lm_head.weight`` excluded: it is tied)
    dropped: list[str] = field(default_factory=list)  # source keys deliberately not imported
    contact_head: tuple[torch.Tensor, torch.Tensor] | None = None  # weight (1, F), bias (1,)

    def config(self, attention: str, kernel: str, nb_features: int | None) -> PerformerConfig:
        """The source's architecture as a ``PerformerConfig`` (MLM, no dropout) with the
        attention core asked for: the weights say the shape, the caller the kernel."""
        try:
            return PerformerConfig(
                vocab_size=len(ESM2_VOCAB),
                **ESM2_SPECIALS,
                dim=self.dim,
                depth=self.depth,
                heads=self.heads,
                ff_dim=self.ff_dim,
                dropout=0.0,
                objective="mlm",
                attention=attention,
                kernel=kernel,
                nb_features=nb_features,
                rotary_base=self.rotary_base,
                layer_norm_eps=self.layer_norm_eps,
                token_dropout=self.token_dropout,
            ).validate()
        except UserError as exc:
            raise UserError(f"{self.path}: {exc}") from None


def _pop_contact_head(
    state: dict[str, Any], prefix: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Remove ``<prefix>contact_head.regression.{weight,bias}`` from ``state``; None if absent."""
    names = [f"{prefix}contact_head.regression.{p}" for p in ("weight", "bias")]
    if not any(n in state for n in names):
        return None
    weight, bias = (state.pop(n, None) for n in names)
    if weight is None or bias is None:
        raise UserError(f"half a contact head: {', '.join(n for n in names if n in state)}")
    return weight, bias


def keys_message(keys: list[str]) -> str:
    more = f" (+{len(keys) - _SHOW_KEYS} more)" if len(keys) > _SHOW_KEYS else ""
    return ", ".join(keys[:_SHOW_KEYS]) + more


def _check_vocab(path: Path, where: str, tokens: list[str] | tuple[str, ...]) -> None:
    ours = Alphabet().tokens
    if tuple(tokens) != ours:
        diff = [
            f"{i}: {a!r} vs ours {b!r}"
            for i, (a, b) in enumerate(zip(tokens, ours, strict=False))
            if a != b
        ]
        raise UserError(
            f"{path}: the vocabulary in {where} ({len(tokens)} tokens) differs from the ESM-2 "
            f"vocabulary protein-performer uses ({len(ours)} tokens): "
            f"{'; '.join(diff[:3]) or 'different length'}. Only ESM-2-vocabulary models convert"
        )


# --------------------------------------------------------------------------------------------
# Renaming: one table per source format
# --------------------------------------------------------------------------------------------
Rule = tuple[re.Pattern[str], str]

_FAIR_RULES: list[Rule] = [
    (re.compile(r"^embed_tokens\.weight$"), "embed_tokens.weight"),
    (
        re.compile(
            r"^layers\.(\d+)\.(self_attn\.(?:q|k|v|out)_proj|self_attn_layer_norm|fc1|fc2|"
            r"final_layer_norm)\.(weight|bias)$"
        ),
        r"layers.\1.\2.\3",
    ),
    (re.compile(r"^emb_layer_norm_after\.(weight|bias)$"), r"emb_layer_norm_after.\1"),
    (re.compile(r"^lm_head\.(dense|layer_norm)\.(weight|bias)$"), r"lm_head.\1.\2"),
    (re.compile(r"^lm_head\.bias$"), "lm_head.bias"),
]
_FAIR_DROP = [
    re.compile(r"^layers\.\d+\.self_attn\.rot_emb\.inv_freq$"),  # recomputed from rotary_base
]
_FAIR_TIED = "lm_head.weight"

#: Our per-layer module names -> Hugging Face ``EsmLayer`` module names (import and export).
HF_LAYER_MODULES = {
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "self_attn_layer_norm": "attention.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "final_layer_norm": "LayerNorm",
}
#: Our other weight names -> Hugging Face ``EsmForMaskedLM`` names.
HF_TOP_NAMES = {
    "embed_tokens.weight": "esm.embeddings.word_embeddings.weight",
    "emb_layer_norm_after.weight": "esm.encoder.emb_layer_norm_after.weight",
    "emb_layer_norm_after.bias": "esm.encoder.emb_layer_norm_after.bias",
    **{
        f"lm_head.{m}.{p}": f"lm_head.{m}.{p}"
        for m in ("dense", "layer_norm")
        for p in ("weight", "bias")
    },
    "lm_head.bias": "lm_head.bias",
}
_HF_LAYER = r"^esm\.encoder\.layer\.(\d+)\."
_HF_RULES: list[Rule] = [
    *(
        (re.compile(_HF_LAYER + re.escape(theirs) + r"\.(weight|bias)$"), rf"layers.\1.{ours}.\2")
        for ours, theirs in HF_LAYER_MODULES.items()
    ),
    *((re.compile("^" + re.escape(theirs) + "$"), ours) for ours, theirs in HF_TOP_NAMES.items()),
]


def hf_name(name: str) -> str:
    """Our weight name -> its Hugging Face ``EsmForMaskedLM`` name (the inverse of the rules)."""
    found = re.match(r"^layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if found:
        return f"esm.encoder.layer.{found[1]}.{HF_LAYER_MODULES[found[2]]}.{found[3]}"
    return HF_TOP_NAMES[name]


_HF_DROP = [
    re.compile(r"rotary_embeddings\.inv_freq$"),  # per layer (old) or model level (new)
    re.compile(r"^esm\.pooler\."),  # EsmModel's unused CLS pooler
    re.compile(r"^esm\.embeddings\.position_ids$"),  # an arange buffer, no information
]
_HF_TIED = "lm_head.decoder.weight"
#: TF-era LayerNorm names: transformers 5 writes ESM checkpoints with ``LayerNorm.gamma/beta``
#: (its saving reverses the renaming it applies on load); the Hub's files use ``weight/bias``.
_LEGACY_NORM = re.compile(r"(?<=LayerNorm\.)(gamma|beta)$")
_NORM_NAMES = {"gamma": "weight", "beta": "bias"}


def _rename(
    state: Mapping[str, torch.Tensor],
    rules: list[Rule],
    drop: list[re.Pattern[str]],
    tied: str,
    path: Path,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Source names -> ours; unknown keys and a decoder that is not the embedding are errors."""
    out: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    unknown: list[str] = []
    tied_tensor = None
    for key, tensor in state.items():
        if key == tied:
            tied_tensor = tensor
            continue
        if any(p.search(key) for p in drop):
            dropped.append(key)
            continue
        for pattern, repl in rules:
            if pattern.match(key):
                out[pattern.sub(repl, key)] = tensor
                break
        else:
            unknown.append(key)
    if unknown:
        raise UserError(
            f"{path}: {len(unknown)} weight(s) this converter does not know: "
            f"{keys_message(sorted(unknown))}. Not an ESM-2 masked-LM checkpoint, or one with "
            "extra modules (a fine-tuning head?); convert the plain ESM-2 weights instead"
        )
    embed = out.get("embed_tokens.weight")
    if tied_tensor is not None and embed is not None and not torch.equal(tied_tensor, embed):
        raise UserError(
            f"{path}: the LM-head decoder ({tied}) differs from the token embedding; ESM-2 ties "
            "them and so does protein-performer, so an untied head cannot be converted"
        )
    return out, dropped


def _depth_from(state: Mapping[str, torch.Tensor], path: Path) -> int:
    indices = {int(m.group(1)) for k in state if (m := re.match(r"^layers\.(\d+)\.", k))}
    if not indices:
        raise UserError(f"{path}: no transformer layers found in the weights")
    depth = max(indices) + 1
    if indices != set(range(depth)):
        gaps = sorted(set(range(depth)) - indices)
        raise UserError(
            f"{path}: layer(s) {gaps} missing from the weights (found up to {depth - 1})"
        )
    return depth


def _shape(state: Mapping[str, torch.Tensor], key: str, path: Path) -> tuple[int, ...]:
    if key not in state:
        raise UserError(f"{path}: required weight {key} is missing")
    return tuple(state[key].shape)


def _source(
    src: Path,
    kind: str,
    renamed: tuple[dict[str, torch.Tensor], list[str]],
    contact_head: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    config: Path,
    declared: Mapping[str, tuple[Any, str]],
    heads: Any,
    no_heads: str,
    token_dropout: bool,
    layer_norm_eps: float,
    rotary_base: float,
) -> EsmSource:
    """The check both readers end with: the sizes the weights have (``dim``, ``depth``,
    ``ff_dim``, ``vocab``) against what ``config`` declares (config key -> (value, size)), ESM-2's
    vocabulary size and a head count (``no_heads`` is the message when there is none)."""
    mapped, dropped = renamed
    vocab, dim = _shape(mapped, "embed_tokens.weight", src)
    depth = _depth_from(mapped, src)
    ff_dim = _shape(mapped, "layers.0.fc1.weight", src)[0]
    sizes = {"dim": dim, "depth": depth, "ff_dim": ff_dim, "vocab": vocab}
    bad = [
        f"{key}={value} but weights say {sizes[size]}"
        for key, (value, size) in declared.items()
        if value not in (None, sizes[size])
    ]
    if bad:
        raise UserError(f"{config}: config and weights disagree: {'; '.join(bad)}")
    if vocab != len(ESM2_VOCAB):
        raise UserError(
            f"{src}: embedding has {vocab} rows, ESM-2's vocabulary has {len(ESM2_VOCAB)}"
        )
    if heads is None:  # checked as a positive int by the reader's check_group
        raise UserError(no_heads)
    return EsmSource(
        path=src,
        kind=kind,
        dim=dim,
        depth=depth,
        heads=int(heads),
        ff_dim=ff_dim,
        token_dropout=token_dropout,
        layer_norm_eps=layer_norm_eps,
        rotary_base=rotary_base,
        state=mapped,
        dropped=dropped,
        contact_head=contact_head,
    )


# --------------------------------------------------------------------------------------------
# fair-esm .pt
# --------------------------------------------------------------------------------------------
def _as_dict(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    if isinstance(obj, argparse.Namespace):
        return vars(obj)
    if isinstance(obj, Mapping):
        return dict(obj)
    return None


def _arg(args: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """First present name: ESM-2's fairseq cfg says ``encoder_layers``, fair-esm's upgraded
    ESM-1 args say ``layers``."""
    for name in names:
        if args.get(name) is not None:
            return args[name]
    return default


def _strip_fairseq_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """fair-esm's own upgrade: drop ``encoder.sentence_encoder.`` then ``encoder.``."""
    pattern = re.compile(r"^(encoder\.sentence_encoder\.|encoder\.)")
    return {pattern.sub("", k): v for k, v in state.items()}


def read_fair_esm(src: Path, data: Mapping[str, Any]) -> EsmSource:
    """A fair-esm checkpoint's contents (``data``, read by the loader through ``safe_load``
    with the fair-esm allowlist), as ``esm.pretrained.load_model_and_alphabet_local`` reads
    them."""
    cfg = _as_dict(data.get("cfg"))
    model_cfg = _as_dict(cfg.get("model")) if cfg else None
    args = _as_dict(data.get("args"))
    state = _strip_fairseq_prefix(data["model"])
    head = _pop_contact_head(state, "")
    companion = src.with_name(f"{src.stem}-contact-regression.pt")  # as fair-esm ships it
    if head is None and companion.is_file():
        extra = safe_load(companion, "fair-esm", what="a fair-esm contact regression")
        if isinstance(extra, Mapping) and isinstance(extra.get("model"), Mapping):
            head = _pop_contact_head(_strip_fairseq_prefix(extra["model"]), "")

    arch = (
        (args or {}).get("arch") or (model_cfg or {}).get("arch") or (model_cfg or {}).get("_name")
    )
    legacy = [
        k
        for k in state
        if k.startswith(("embed_positions", "emb_layer_norm_before", "layers.0.self_attn.bias_k"))
    ]
    if arch in _ESM1_ARCHS or legacy or any("row_self_attention" in k for k in state):
        raise UserError(
            f"{src}: this is an ESM-1/ESM-1b/MSA Transformer checkpoint (arch {arch!r}; "
            f"{'learned positional embeddings' if legacy else 'no rotary embeddings'}), not "
            "ESM-2. protein-performer reproduces ESM-2 only (rotary positions, pre-LayerNorm, "
            "final LayerNorm); use an esm2_* checkpoint"
        )
    hparams = model_cfg if model_cfg is not None else args
    check_group(hparams, f"{src}: ", _FAIR_VALUES)
    if hparams is None:
        raise UserError(
            f"{src}: no architecture found (neither cfg['model'] nor args); cannot tell the "
            "number of attention heads. Re-save with 'cfg': {'model': {...}} as fair-esm does"
        )
    non_tensors = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    if non_tensors:
        raise UserError(f"{src}: non-tensor entries in 'model': {keys_message(non_tensors)}")

    _check_vocab(src, "fair-esm's ESM-2 alphabet", ESM2_VOCAB)
    return _source(
        src,
        "fair-esm",
        _rename(state, _FAIR_RULES, _FAIR_DROP, _FAIR_TIED, src),
        head,
        config=src,
        declared={
            "encoder_layers": (_arg(hparams, "encoder_layers", "layers"), "depth"),
            "encoder_embed_dim": (_arg(hparams, "encoder_embed_dim", "embed_dim"), "dim"),
            "encoder_ffn_embed_dim": (
                _arg(hparams, "encoder_ffn_embed_dim", "ffn_embed_dim"),
                "ff_dim",
            ),
        },
        heads=_arg(hparams, "encoder_attention_heads", "attention_heads"),
        no_heads=f"{src}: the config does not say encoder_attention_heads",
        # fair-esm's ESM2 defaults to token dropout; every released ESM-2 uses it.
        token_dropout=bool(_arg(hparams, "token_dropout", default=True)),
        layer_norm_eps=1e-5,  # ESM1bLayerNorm is torch's LayerNorm with its default eps
        rotary_base=10000.0,  # fair-esm's RotaryEmbedding hard-codes it
    )


# --------------------------------------------------------------------------------------------
# Hugging Face EsmForMaskedLM directory
# --------------------------------------------------------------------------------------------
def read_hf(src: Path) -> EsmSource:
    """Read ``config.json`` + ``model.safetensors`` (sharded ``*.safetensors`` too)."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise UserError(f"{src}: no config.json; not a Hugging Face model directory")
    hf = read_json(config_path, "re-download or re-save the model")
    if not isinstance(hf, dict):
        raise UserError(
            f"{config_path}: expected a JSON object of config fields, got a list or value"
        )
    check_group(hf, f"{config_path}: ", _HF_VALUES)
    if hf.get("model_type") != "esm":
        raise UserError(f"{config_path}: model_type is {hf.get('model_type')!r}, not 'esm'")
    if hf.get("is_folding_model"):
        raise UserError(f"{config_path}: an ESMFold model; convert its ESM-2 language model")
    position = hf.get("position_embedding_type", "absolute")
    if position != "rotary" or hf.get("emb_layer_norm_before"):
        raise UserError(
            f"{config_path}: position_embedding_type={position!r}"
            f"{', emb_layer_norm_before=true' if hf.get('emb_layer_norm_before') else ''}: this "
            "is an ESM-1/ESM-1b-style model (learned positions). protein-performer reproduces "
            "ESM-2 only (rotary positions); use an esm2_* model"
        )
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise UserError(f"{config_path}: hidden_act={act!r}; ESM-2 (and this model) use 'gelu'")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise UserError(f"{config_path}: a decoder/cross-attention ESM is not ESM-2's MLM")
    if hf.get("tie_word_embeddings") is False:
        raise UserError(f"{config_path}: tie_word_embeddings=false; ESM-2's LM head is tied")
    if hf.get("vocab_list"):
        _check_vocab(src, "config.json vocab_list", hf["vocab_list"])
    vocab_file = src / "vocab.txt"
    if vocab_file.is_file():
        _check_vocab(src, "vocab.txt", vocab_file.read_text(encoding="utf-8").split())
    for name, ours in (("pad_token_id", 1), ("mask_token_id", 32)):
        if hf.get(name) is not None and hf[name] != ours:
            raise UserError(f"{config_path}: {name}={hf[name]}, ESM-2's is {ours}")

    files = sorted(src.glob("*.safetensors"))
    if not files:
        bins = [p.name for p in src.glob("*.bin")]
        hint = f" (found {', '.join(bins)}: re-save with safe_serialization=True)" if bins else ""
        raise UserError(f"{src}: no .safetensors weights{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file), device="cpu"))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{file}: cannot read the weights ({exc})") from None
    if any(k.startswith("esm.embeddings.position_embeddings") for k in state):
        raise UserError(f"{src}: learned position embeddings found: not an ESM-2 (rotary) model")

    state = {_LEGACY_NORM.sub(lambda m: _NORM_NAMES[m.group(1)], k): v for k, v in state.items()}
    head = _pop_contact_head(state, "esm.")
    return _source(
        src,
        "hf",
        _rename(state, _HF_RULES, _HF_DROP, _HF_TIED, src),
        head,
        config=config_path,
        declared={
            "hidden_size": (hf.get("hidden_size"), "dim"),
            "num_hidden_layers": (hf.get("num_hidden_layers"), "depth"),
            "intermediate_size": (hf.get("intermediate_size"), "ff_dim"),
            "vocab_size": (hf.get("vocab_size"), "vocab"),
        },
        heads=hf.get("num_attention_heads"),
        no_heads=f"{config_path}: num_attention_heads missing",
        token_dropout=bool(hf.get("token_dropout", False)),
        # EsmConfig's default is 1e-12; the released ESM-2 configs all say 1e-5.
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        rotary_base=float(hf.get("rope_theta", 10000.0)),
    )


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hf_cache_dir() -> Path:
    """The Hugging Face hub cache, found as ``huggingface_hub`` finds it."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return xdg / "huggingface" / "hub"


def hf_snapshot(text: str) -> Path | None:
    """The cached snapshot directory of ``text`` when it has a Hugging Face model id's shape
    (``owner/name``), else None; never downloads. An id missing from the cache is an error
    that also covers the reading as a local path, since ``runs/last.ckpt`` has that shape too.
    """
    if not _HF_ID.match(text):
        return None
    cache = _hf_cache_dir()
    repo = cache / f"models--{text.replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
    if ref.is_file():
        snapshot: Path | None = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
    else:
        snapshot = snapshots[0] if len(snapshots) == 1 else None
    if snapshot is None or not (snapshot / "config.json").is_file():
        raise UserError(
            f"{text}: no such file or directory, and as a model id not in the local Hugging "
            f"Face cache ({cache}); protein-performer never downloads weights: fetch it "
            f"yourself (`hf download {text}`), point HF_HOME or HF_HUB_CACHE at the cache "
            "holding it, or give a local path"
        )
    return snapshot


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def build_esm(source: EsmSource, options: LoadOptions) -> LoadedModel:
    """A ``PerformerLM`` holding an ESM-2 source's weights, eval mode, on CPU, with the attention
    ``options`` ask for (default: exact attention, the softmax kernel).

    FAVOR+ features come from ``torch.Generator().manual_seed(seed)`` (layer by layer, as
    ``redraw_features``), so the same source, options and seed give bit-identical models on
    any device. The global RNG is left untouched.
    """
    seed = options.seed
    config = source.config(options.attention or "exact", options.kernel or "softmax",
                           options.nb_features)  # fmt: skip
    check_fits_in_memory(config, source.path)
    check_finite(source.state, source.path)
    with torch.random.fork_rng(devices=[]):
        model = PerformerLM(config)
    diff = diff_state(model, source.state, not_imported(model))
    missing, unexpected = sorted(diff.missing), sorted(diff.unexpected)
    wrong = [f"{k} {theirs} vs {ours}" for k, theirs, ours in diff.mismatched]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {keys_message(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {keys_message(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} with wrong shape: {keys_message(wrong)}")
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
        loaded.contact_regression = head_regression(source, loaded).to_dict()
    if source.dropped:
        log.info("not imported (recomputed or unused): %s", keys_message(sorted(source.dropped)))
    return loaded


def head_regression(source: EsmSource, loaded: LoadedModel) -> ContactRegression:
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
