"""A model's contact regression: ESM's contact head as data, stored with the weights.

Logistic regression on attention maps (Rao et al. 2020; ESM's ``ContactPredictionHead``): every
layer x head map of a sequence, BOS/EOS stripped, symmetrized (A + A^T) and APC-corrected
(A - a_i a_j / a, the average-product correction) gives the F = layers x heads features of a
pair (i, j); p(contact) = sigmoid(features @ coef + intercept).

This is the record, below training and inference: a converted ESM-2 contact head
(``model.convert_esm``), a training checkpoint (``init_from`` carries it) and an export directory
all store it as JSON (no pickle: loading never runs code) with the layers and heads it uses, the
attention layout it reads (depth, heads, objective: a model with another layout is refused,
since its features mean something else) and the SHA-256 of the weights it was fitted on
(``interop.identity.weights_sha256``; another model of the same layout, such as a FAVOR+
fine-tune of ESM-2 carrying ESM-2's contact head, gets a warning, not a refusal). Fitting it and
measuring it on structures is ``contacts.fit``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.errors import UserError, check_format_header
from protein_performer.io.atomic import write_text_atomic
from protein_performer.io.json_safe import read_json

log = logging.getLogger(__name__)

FORMAT_NAME = "protein_performer.contact_regression"
FORMAT_VERSION = 1
#: Larger than any coefficient or intercept a fit gives (features are attention values, O(1)).
MAX_COEF = 1e6


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------
def symmetrize(x: np.ndarray) -> np.ndarray:
    """A + A^T over the last two axes."""
    return x + np.swapaxes(x, -1, -2)


def apc(x: np.ndarray) -> np.ndarray:
    """Average product correction over the last two axes: x_ij - (sum_i x_ij)(sum_j x_ij)/sum x.

    Same formula as ESM's ``apc`` (``esm/modules.py``).
    """
    a1 = x.sum(-1, keepdims=True)
    a2 = x.sum(-2, keepdims=True)
    a12 = x.sum((-1, -2), keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = np.where(a12 != 0, a1 * a2 / np.where(a12 != 0, a12, 1), 0.0)
    return x - corr


def contact_features(maps: np.ndarray) -> np.ndarray:
    """(n_layers, n_heads, L, L) maps -> (L, L, F) APC(symmetrize(maps)), F layer-major."""
    maps = np.asarray(maps, dtype=np.float32)
    if maps.ndim != 4 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"maps must be (layers, heads, L, L), got {maps.shape}")
    n_layers, n_heads, L, _ = maps.shape
    feats = apc(symmetrize(maps)).reshape(n_layers * n_heads, L, L)  # (F, L, L)
    return np.ascontiguousarray(np.moveaxis(feats, 0, -1))  # (L, L, F)


# --------------------------------------------------------------------------------------------
# The regression and the model it belongs to
# --------------------------------------------------------------------------------------------
def config_fingerprint(config: Any) -> str:
    """sha256 (first 16 hex) of the whole model config as canonical JSON: what regressions
    written before 0.2 recorded. Any new config field changes it, so it is only warned about."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    blob = json.dumps(data, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def attention_layout(config: Any) -> dict[str, Any]:
    """What a regression's features depend on besides the weights: the layer x head grid and
    whether attention is causal. Kernel, m or exact-vs-FAVOR+ approximate the same maps."""
    return {"depth": int(config.depth), "heads": int(config.heads), "objective": config.objective}


@dataclass
class ContactRegression:
    """Logistic regression on APC features: p(contact) = sigmoid(features @ coef + intercept)."""

    coef: np.ndarray  # (F,), F = len(layers) * len(heads), layer-major
    intercept: float
    layers: list[int]
    heads: list[int]
    layout: dict[str, Any] | None = None  # attention_layout() of the model it reads
    meta: dict[str, Any] = field(default_factory=dict)
    model_sha256: str | None = None  # interop.identity.weights_sha256 of its model
    config_fingerprint: str | None = None  # written before 0.2 instead of layout

    def __post_init__(self) -> None:
        """Refuse what would predict silent nonsense: NaN or infinite numbers (all-NaN or
        all-1.0 maps), magnitudes no fit reaches (overflow), no or negative layers and heads."""
        self.coef = np.asarray(self.coef, dtype=np.float64).reshape(-1)
        if self.coef.size != len(self.layers) * len(self.heads):
            raise UserError(
                f"contact regression has {self.coef.size} coefficients but "
                f"{len(self.layers)} layers x {len(self.heads)} heads = "
                f"{len(self.layers) * len(self.heads)} features"
            )
        numbers = np.append(self.coef, self.intercept)
        if not np.isfinite(numbers).all() or np.abs(numbers).max() > MAX_COEF:
            raise UserError(
                "contact regression coefficients and intercept must be finite and at most "
                f"{MAX_COEF:g} in size (largest: {np.abs(numbers).max():g})"
            )
        if not self.layers or not self.heads or min(self.layers) < 1 or min(self.heads) < 0:
            raise UserError(
                f"contact regression layers {self.layers} (from 1) and heads {self.heads} "
                "(from 0) are out of range"
            )

    def coef_grid(self) -> np.ndarray:
        """Coefficients as (n_layers, n_heads)."""
        return self.coef.reshape(len(self.layers), len(self.heads))

    def logits(self, features: np.ndarray) -> np.ndarray:
        """(..., F) -> (...)."""
        return features.astype(np.float64) @ self.coef + self.intercept

    def predict(self, features: np.ndarray) -> np.ndarray:
        """(L, L, F) features -> (L, L) contact probabilities (symmetric: features are)."""
        return 1.0 / (1.0 + np.exp(-self.logits(features)))

    def predict_maps(self, maps: np.ndarray) -> np.ndarray:
        """(n_layers, n_heads, L, L) maps for exactly ``layers`` x ``heads`` -> (L, L)."""
        if maps.shape[:2] != (len(self.layers), len(self.heads)):
            raise ValueError(
                f"maps are {maps.shape[:2]} layers x heads; the regression needs "
                f"{(len(self.layers), len(self.heads))}"
            )
        return self.predict(contact_features(maps))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "layers": list(map(int, self.layers)),
            "heads": list(map(int, self.heads)),
            "feature_order": "layer-major: feature f = layer_index * len(heads) + head_index; "
            "each the APC-corrected symmetrized residue x residue attention map",
            "coef": [float(c) for c in self.coef],
            "intercept": float(self.intercept),
            "layout": self.layout,
            "model_sha256": self.model_sha256,
            **({"config_fingerprint": self.config_fingerprint} if self.config_fingerprint else {}),
            **{k: v for k, v in self.meta.items() if k not in _RESERVED},
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON atomically (temporary sibling + rename)."""
        return write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ContactRegression:
        path = Path(path).expanduser()
        if not path.exists():
            raise UserError(f"{path}: contact regression file not found")
        data = read_json(path, "refit the contact regression")
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Any, where: object) -> ContactRegression:
        """The regression of :meth:`to_dict`'s JSON (a file, or one stored with a model)."""
        check_format_header(data, where, FORMAT_NAME, FORMAT_VERSION, "contact regression")
        try:
            return cls(
                coef=np.asarray(data["coef"], dtype=np.float64),
                intercept=float(data["intercept"]),
                layers=[int(i) for i in data["layers"]],
                heads=[int(h) for h in data["heads"]],
                layout=data.get("layout"),
                model_sha256=data.get("model_sha256"),
                config_fingerprint=data.get("config_fingerprint"),
                meta={k: v for k, v in data.items() if k not in _RESERVED},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{where}: malformed contact regression ({exc!r}); refit it") from None
        except UserError as exc:
            raise UserError(f"{where}: {exc}; refit it") from None

    def check_model(self, loaded: Any, sha256: str | None = None) -> None:
        """Refuse a model whose attention layout differs from the one the fit reads; warn when
        its weights (``sha256``; None: ``loaded.weights_sha256()``, hashed only when the
        regression names weights) are not the ones it was fitted on."""
        config, source = loaded.config, str(loaded.source)
        ours = attention_layout(config)
        if self.layout is not None:
            bad = [f"{k} {v} vs {ours.get(k)}" for k, v in self.layout.items() if ours.get(k) != v]
            if bad:
                raise UserError(
                    f"the contact regression reads another attention layout than {source} "
                    f"({'; '.join(bad)}: regression vs model); fit one for this model with "
                    "`protein-performer contacts fit CKPT STRUCTURE... --out-dir DIR`"
                )
        elif self.config_fingerprint not in (None, config_fingerprint(config)):
            log.warning(
                "the contact regression predates layouts and was fitted on a model with another "
                "config than %s; check that it reads the same layers and heads",
                source,
            )
        if max(self.layers) > config.depth or max(self.heads) >= config.heads:
            raise UserError(f"the contact regression uses layers/heads that {source} lacks")
        if self.model_sha256 is not None:
            sha256 = sha256 or loaded.weights_sha256()
            if sha256 != self.model_sha256:
                origin = self.meta.get("origin") or self.meta.get("checkpoint") or "another model"
                log.warning(
                    "the contact regression was fitted on other weights (%s, sha256 %s...) than "
                    "%s (%s...): fine if they are a fine-tune whose attention kept its meaning; "
                    "refit with `protein-performer contacts fit` to be sure",
                    origin,
                    self.model_sha256[:12],
                    source,
                    sha256[:12],
                )


_RESERVED = (
    "format",
    "format_version",
    "layers",
    "heads",
    "feature_order",
    "coef",
    "intercept",
    "layout",
    "model_sha256",
    "config_fingerprint",
)
