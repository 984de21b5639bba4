"""Contact prediction from attention maps: ESM's recipe, fitted here (ESM never released it).

Recipe (Rao et al. 2020, "Transformer protein language models are unsupervised structure
learners"; ESM issue #249): every layer x head map of a sequence, BOS/EOS stripped, is
symmetrized (A + A^T) and APC-corrected (A - a_i a_j / a, the average-product correction that
removes the per-residue "background" attention, as in coevolution methods); the F = layers x
heads values of a pair (i, j) are the features of an L1-regularized logistic regression fitted
on pairs with |i - j| >= 6 of a few structures.

Choices made here, and why:

* Features are standardized for the fit (so the L1 penalty treats all heads alike whatever their
  scale); the scaling is folded back, so the stored coefficients act on raw APC features.
* ``C = 0.15`` (Rao et al.'s value) with liblinear. ``class_weight=None`` by default: precision
  at top-k only depends on the ranking, and unweighted fits keep the probabilities calibrated;
  ``balanced`` is available for heavily imbalanced, tiny fit sets.
* The fit is stored as JSON (no pickle: loading never runs code) with the layers and heads it
  uses, the attention layout it reads (depth, heads, objective: a model with another layout is
  refused, since its features mean something else) and the SHA-256 of the weights it was fitted
  on (another model of the same layout, such as a FAVOR+ fine-tune of ESM-2 carrying ESM-2's
  contact head, gets a warning, not a refusal). Config fields that change neither, such as a
  new option, leave a regression valid.

Metrics are precision at L, L/2 and L/5 (top-scored pairs, L = sequence length) in the short
(6-11), medium (12-23) and long (>= 24) separation ranges, counting only pairs whose two
residues are observed in the structure. The null baseline feeds the same maps with rows and
columns shuffled by one seeded permutation (the same on both axes, so each map stays a valid
attention pattern with the same statistics) through the same regression and metrics: it tells
how much of a score is position-specific signal rather than, say, a bias of the contact set.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protein_performer.atomic import write_text_atomic
from protein_performer.errors import UserError, check_format_header
from protein_performer.inference.loading import REGRESSION_FILE  # beside a .ckpt: <stem>.<it>

if TYPE_CHECKING:
    from protein_performer.inference.loading import LoadedModel
    from protein_performer.inference.structures import ContactTarget

log = logging.getLogger(__name__)

FORMAT_NAME = "protein_performer.contact_regression"
FORMAT_VERSION = 1
MIN_SEPARATION = 6
DEFAULT_C = 0.15
#: name -> (lowest, highest or None) separation |i - j|, both inclusive.
RANGES: dict[str, tuple[int, int | None]] = {
    "short": (6, 11),
    "medium": (12, 23),
    "long": (24, None),
}
#: name -> divisor of L for the number of top pairs.
TOPS: dict[str, int] = {"L": 1, "L/2": 2, "L/5": 5}
METRICS: tuple[str, ...] = tuple(f"P@{t}_{r}" for r in RANGES for t in TOPS)


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


def upper_pairs(L: int, min_sep: int = MIN_SEPARATION) -> tuple[np.ndarray, np.ndarray]:
    """Indices (i, j), i < j, with j - i >= min_sep."""
    return np.triu_indices(L, k=max(int(min_sep), 1))


def permutation_for(key: str, length: int, seed: int) -> np.ndarray:
    """The null baseline's permutation of one protein: seeded by (seed, crc32 of its id), so a
    protein's null does not depend on which other proteins are in the run."""
    rng = np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])
    return rng.permutation(length)


def permute_maps(maps: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Rows and columns of every map reordered by the same permutation: M[p][:, p]."""
    return maps[..., perm, :][..., :, perm]


# --------------------------------------------------------------------------------------------
# Regression
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


def weights_sha256(model: Any) -> str:
    """SHA-256 of a model's learned weights (names, dtypes, shapes, bytes; FAVOR+ random features
    and the tied LM-head alias left out), so a regression names the model it was fitted on and
    an exact and a FAVOR+ conversion of the same weights share it."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for name, tensor in sorted(model.state_dict().items()):
        if ".self_attn.favor." in name or (tensor.numel() and tensor.data_ptr() in seen):
            continue
        seen.add(tensor.data_ptr())
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_identity(loaded: Any) -> dict[str, Any]:
    """``layout`` and ``model_sha256`` of a loaded model, as a regression records them."""
    layout = attention_layout(loaded.config)
    return {"layout": layout, "model_sha256": weights_sha256(loaded.model)}


def default_regression_path(ckpt: str | os.PathLike[str]) -> Path:
    """Where a regression lives beside its checkpoint: inside an export directory, or next to a
    ``.ckpt`` as ``<stem>.contact_regression.json``."""
    path = Path(ckpt).expanduser()
    if path.is_dir():
        return path / REGRESSION_FILE
    return path.with_name(f"{path.stem}.{REGRESSION_FILE}")


@dataclass
class ContactRegression:
    """Logistic regression on APC features: p(contact) = sigmoid(features @ coef + intercept)."""

    coef: np.ndarray  # (F,), F = len(layers) * len(heads), layer-major
    intercept: float
    layers: list[int]
    heads: list[int]
    layout: dict[str, Any] | None = None  # attention_layout() of the model it reads
    meta: dict[str, Any] = field(default_factory=dict)
    model_sha256: str | None = None  # weights_sha256() of the model it was fitted on
    config_fingerprint: str | None = None  # written before 0.2 instead of layout

    def __post_init__(self) -> None:
        self.coef = np.asarray(self.coef, dtype=np.float64).reshape(-1)
        if self.coef.size != len(self.layers) * len(self.heads):
            raise UserError(
                f"contact regression has {self.coef.size} coefficients but "
                f"{len(self.layers)} layers x {len(self.heads)} heads = "
                f"{len(self.layers) * len(self.heads)} features"
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
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{path}: contact regression file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: not a readable JSON contact regression ({exc})") from None
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

    def check_model(self, loaded: Any, sha256: str | None = None) -> None:
        """Refuse a model whose attention layout differs from the one the fit reads; warn when
        its weights (``sha256``, computed if None) are not the ones it was fitted on."""
        config, source = loaded.config, str(loaded.source)
        ours = attention_layout(config)
        if self.layout is not None:
            bad = [f"{k} {v} vs {ours.get(k)}" for k, v in self.layout.items() if ours.get(k) != v]
            if bad:
                raise UserError(
                    f"the contact regression reads another attention layout than {source} "
                    f"({'; '.join(bad)}: regression vs model); fit one for this model with "
                    "`protein-performer contacts CKPT STRUCTURE... --out DIR`"
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
            sha256 = sha256 or weights_sha256(loaded.model)
            if sha256 != self.model_sha256:
                origin = self.meta.get("origin") or self.meta.get("checkpoint") or "another model"
                log.warning(
                    "the contact regression was fitted on other weights (%s, sha256 %s...) than "
                    "%s (%s...): fine if they are a fine-tune whose attention kept its meaning; "
                    "refit with `protein-performer contacts` to be sure",
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


def training_pairs(
    features: np.ndarray, contacts: np.ndarray, valid: np.ndarray, min_sep: int = MIN_SEPARATION
) -> tuple[np.ndarray, np.ndarray]:
    """(n, F) features and (n,) labels of the scoreable pairs i < j, j - i >= min_sep."""
    i, j = upper_pairs(features.shape[0], min_sep)
    keep = valid[i, j]
    return features[i[keep], j[keep]], contacts[i[keep], j[keep]].astype(np.int8)


def _l1_logistic(C: float, class_weight: str | None, seed: int):
    """sklearn's L1 logistic regression across versions (1.8 replaced ``penalty`` by
    ``l1_ratio``; passing the wrong one would silently fit L2)."""
    from sklearn.linear_model import LogisticRegression

    params = inspect.signature(LogisticRegression).parameters
    style = {"l1_ratio": 1.0} if params["penalty"].default == "deprecated" else {"penalty": "l1"}
    return LogisticRegression(
        C=C,
        solver="liblinear",
        class_weight=class_weight,
        random_state=seed,
        max_iter=1000,
        **style,
    )


def fit_regression(
    X: np.ndarray,
    y: np.ndarray,
    layers: Sequence[int],
    heads: Sequence[int],
    *,
    C: float = DEFAULT_C,
    class_weight: str | None = None,
    seed: int = 0,
    identity: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> ContactRegression:
    """Fit on pair features ``X`` (n, F) and labels ``y`` (n,) (see :func:`training_pairs`);
    ``identity``: :func:`model_identity` of the model the features came from."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y).astype(np.int64)
    if X.ndim != 2 or X.shape[1] != len(layers) * len(heads):
        raise ValueError(f"X must be (n, {len(layers) * len(heads)}), got {X.shape}")
    if len(np.unique(y)) < 2:
        raise UserError(
            f"cannot fit a contact regression: the {len(y)} training pairs are all "
            f"{'contacts' if y.all() else 'non-contacts'}; fit on more or larger structures"
        )
    if class_weight not in (None, "balanced"):
        raise UserError(f"class_weight must be none or balanced, got {class_weight!r}")
    mean = X.mean(0)
    scale = X.std(0)
    scale[scale == 0] = 1.0
    model = _l1_logistic(C, class_weight, seed).fit((X - mean) / scale, y)
    w = model.coef_.reshape(-1) / scale
    b = float(model.intercept_[0] - (w * mean).sum())
    info = {
        "C": float(C),
        "class_weight": class_weight,
        "solver": "liblinear",
        "standardized_fit": True,
        "min_separation": MIN_SEPARATION,
        "n_pairs": int(len(y)),
        "n_contacts": int(y.sum()),
        "n_nonzero": int((w != 0).sum()),
        **(meta or {}),
    }
    return ContactRegression(w, b, list(layers), list(heads), meta=info, **(identity or {}))


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------
def precision_at(
    pred: np.ndarray, contacts: np.ndarray, valid: np.ndarray, length: int | None = None
) -> dict[str, float]:
    """Precision of the top L/k scored pairs per separation range (``METRICS`` keys).

    Only pairs i < j with both residues observed (``valid``) compete. When a range has fewer
    scoreable pairs than L/k, all of them are taken (and the denominator is their number); NaN
    when it has none. ``length`` defaults to the map size (the sequence length).
    """
    L = pred.shape[0] if length is None else int(length)
    i, j = np.triu_indices(pred.shape[0], k=1)
    sep = j - i
    ok = valid[i, j]
    out: dict[str, float] = {}
    for rname, (lo, hi) in RANGES.items():
        sel = ok & (sep >= lo) & (sep <= (hi if hi is not None else sep.max(initial=0)))
        scores = pred[i[sel], j[sel]]
        truth = contacts[i[sel], j[sel]]
        order = np.argsort(-scores, kind="stable")
        for tname, div in TOPS.items():
            k = min(max(L // div, 1), len(order))
            out[f"P@{tname}_{rname}"] = float(truth[order[:k]].mean()) if k else math.nan
    return out


def mean_metrics(rows: Sequence[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """NaN-aware mean per key (a protein without pairs in a range does not count there)."""
    out = {}
    for key in keys:
        vals = np.asarray([r[key] for r in rows if key in r], dtype=np.float64)
        vals = vals[~np.isnan(vals)]
        out[key] = float(vals.mean()) if len(vals) else math.nan
    return out


def null_prediction(
    regression: ContactRegression, maps: np.ndarray, key: str, seed: int
) -> np.ndarray:
    """The regression's prediction from ``maps`` shuffled by this protein's permutation."""
    perm = permutation_for(key, maps.shape[-1], seed)
    return regression.predict_maps(permute_maps(maps, perm))


# --------------------------------------------------------------------------------------------
# Model -> maps -> contacts, and the benchmark behind `protein-performer contacts`
# --------------------------------------------------------------------------------------------
def model_maps(
    loaded: Any,
    sequence: str,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> np.ndarray:
    """(n_layers, n_heads, L, L) residue x residue maps (float32) of a loaded model."""
    from protein_performer.inference.attention_maps import full_maps

    return full_maps(loaded.model, sequence, layers=layers, heads=heads).numpy()


PRECISION_FILE = "precision.csv"
ID_COLUMNS = ("protein", "file", "chain", "length", "observed", "contacts", "fold")

#: What makes two targets the same protein: its structure file, chain and the sequence read.
TargetKey = tuple[str, str, str]


def _target_key(target: ContactTarget) -> TargetKey:
    return (str(target.structure.path.resolve()), target.structure.chain_id, target.sequence)


class _TargetFeatures:
    """Each target's attention maps and training pairs, computed once: cross-fitting reads a
    structure in every fold but one, and evaluation reads its maps again."""

    def __init__(self, loaded: LoadedModel, layers: list[int], heads: list[int]) -> None:
        self.loaded = loaded
        self.layers = layers
        self.heads = heads
        self._maps: dict[TargetKey, np.ndarray] = {}
        self._pairs: dict[TargetKey, tuple[np.ndarray, np.ndarray]] = {}

    def maps(self, target: ContactTarget) -> np.ndarray:
        """(n_layers, n_heads, L, L) maps of ``layers`` x ``heads``."""
        key = _target_key(target)
        if key not in self._maps:
            log.info("attention maps: %s (%d residues)", target.id, target.length)
            self._maps[key] = model_maps(self.loaded, target.sequence, self.layers, self.heads)
        return self._maps[key]

    def pairs(self, target: ContactTarget) -> tuple[np.ndarray, np.ndarray]:
        """(n, F) features and (n,) labels of the target's scoreable pairs."""
        key = _target_key(target)
        if key not in self._pairs:
            features = contact_features(self.maps(target))
            self._pairs[key] = training_pairs(features, target.contacts(), target.valid())
        return self._pairs[key]

    def forget_maps(self, target: ContactTarget) -> None:
        """Drop a target's maps (the largest arrays) once nothing reads them again."""
        self._maps.pop(_target_key(target), None)


@dataclass
class _Fitter:
    """Fits a regression on some targets' pairs, with the run's settings and model identity."""

    features: _TargetFeatures
    identity: dict[str, Any]
    C: float
    class_weight: str | None
    seed: int

    def fit(self, on: Sequence[ContactTarget], what: str) -> ContactRegression:
        X = np.concatenate([self.features.pairs(t)[0] for t in on])
        y = np.concatenate([self.features.pairs(t)[1] for t in on])
        log.info("fitting %s on %d pairs (%d contacts)", what, len(y), int(y.sum()))
        return fit_regression(
            X,
            y,
            self.features.layers,
            self.features.heads,
            C=self.C,
            class_weight=self.class_weight,
            seed=self.seed,
            identity=self.identity,
            meta={"checkpoint": self.features.loaded.source.name, "fit_on": [t.id for t in on]},
        )


@dataclass
class RegressionPlan:
    """Which regression scores each evaluated target, and which one is saved."""

    mode: str  # "given", "fit-on", "leave-one-out" or "<k>-fold" (the mean row's fold)
    per_target: list[ContactRegression]  # one per evaluated target, in order
    folds: list[str]  # each target's fold column: its cross-fitting fold, else "-"
    final: ContactRegression | None  # fitted for new proteins and saved; None when given


@dataclass
class ContactBenchmark:
    """What :func:`benchmark` measured and wrote."""

    rows: list[dict[str, Any]]  # one per target: ID_COLUMNS, METRICS and their null_ twins
    mean: dict[str, float]  # NaN-aware mean of every metric over the targets
    mode: str  # as RegressionPlan.mode
    regression: ContactRegression | None  # the final fit, or the given regression
    files: dict[str, Path]  # name -> path of each file written


def _fold_of(n: int, folds: int | None) -> list[int]:
    """Round-robin fold of each structure in the given order; None = leave-one-out."""
    k = n if folds is None or folds <= 0 else min(int(folds), n)
    return [i % k for i in range(n)]


def plan_regressions(
    targets: Sequence[ContactTarget],
    fitter: _Fitter,
    *,
    regression: ContactRegression | None,
    fit_targets: Sequence[ContactTarget] | None,
    folds: int | None,
) -> RegressionPlan:
    """The regression of each target: ``regression`` as is, one fit on ``fit_targets``, or
    cross-fitting over ``targets`` (each scored by a fit that never saw it) plus a final fit on
    all of them."""
    n = len(targets)
    if regression is not None:
        return RegressionPlan("given", [regression] * n, ["-"] * n, None)
    if fit_targets:
        overlap = {_target_key(t) for t in fit_targets} & {_target_key(t) for t in targets}
        if overlap:
            log.warning(
                "%d evaluated structure(s) are also in the fit set: optimistic", len(overlap)
            )
        final = fitter.fit(fit_targets, "the regression")
        return RegressionPlan("fit-on", [final] * n, ["-"] * n, final)
    folds_of = _fold_of(n, folds)
    k = max(folds_of) + 1
    fold_fits = [
        fitter.fit(
            [t for t, g in zip(targets, folds_of, strict=True) if g != f], f"fold {f + 1}/{k}"
        )
        for f in range(k)
    ]
    final = fitter.fit(targets, "the final regression (all structures)")
    return RegressionPlan(
        "leave-one-out" if k == n else f"{k}-fold",
        [fold_fits[g] for g in folds_of],
        [str(g) for g in folds_of],
        final,
    )


def evaluate(
    targets: Sequence[ContactTarget],
    plan: RegressionPlan,
    features: _TargetFeatures,
    seed: int,
) -> list[dict[str, Any]]:
    """One row per target: its identity columns, precision and the shuffled-map null's."""
    rows = []
    for t, reg, fold in zip(targets, plan.per_target, plan.folds, strict=True):
        maps = features.maps(t)
        contacts, valid = t.contacts(), t.valid()
        real = precision_at(reg.predict_maps(maps), contacts, valid, t.length)
        null = precision_at(null_prediction(reg, maps, t.id, seed), contacts, valid, t.length)
        i, j = upper_pairs(t.length, MIN_SEPARATION)
        rows.append(
            {
                "protein": t.id,
                "file": t.structure.path.name,
                "chain": t.structure.chain_id.strip() or "_",
                "length": t.length,
                "observed": int(t.observed.sum()),
                "contacts": int((contacts & valid)[i, j].sum()),
                "fold": fold,
                **real,
                **{f"null_{m}": v for m, v in null.items()},
            }
        )
        features.forget_maps(t)  # evaluated targets are not needed again
    return rows


def write_results(
    out: Path,
    rows: list[dict[str, Any]],
    mean: dict[str, float],
    plan: RegressionPlan,
    beside: Path | None,
) -> dict[str, Path]:
    """``out/precision.csv`` (the rows and their mean) and, when one was fitted, the final
    regression in ``out`` and, with ``beside`` (a checkpoint), next to it."""
    columns = [*ID_COLUMNS, *(c for m in METRICS for c in (m, f"null_{m}"))]
    mean_row = {
        "protein": "mean",
        "file": "",
        "chain": "",
        "length": float(np.mean([r["length"] for r in rows])),
        "observed": float(np.mean([r["observed"] for r in rows])),
        "contacts": float(np.mean([r["contacts"] for r in rows])),
        "fold": plan.mode,
        **mean,
    }
    files = {"precision": _write_csv(out / PRECISION_FILE, columns, [*rows, mean_row])}
    if plan.final is not None:
        plan.final.meta["evaluation"] = plan.mode
        files["regression"] = plan.final.save(out / REGRESSION_FILE)
        if beside is not None:
            files["regression_beside"] = plan.final.save(default_regression_path(beside))
    return files


def benchmark(
    loaded: LoadedModel,
    targets: Sequence[ContactTarget],
    out_dir: str | os.PathLike[str],
    *,
    fit_targets: Sequence[ContactTarget] | None = None,
    regression: ContactRegression | None = None,
    folds: int | None = None,
    C: float = DEFAULT_C,
    class_weight: str | None = None,
    seed: int = 0,
    save_beside: bool = False,
) -> ContactBenchmark:
    """Precision of contact prediction on ``targets``, with the shuffled-map null beside it,
    written to ``out_dir/precision.csv``.

    Exactly one way to get a regression: ``regression`` (apply as is), ``fit_targets`` (fit on
    those), or neither: cross-fitting over ``targets`` (``folds`` round-robin folds in the given
    order, leave-one-out when None), every protein scored by a fit that never saw it; a final
    fit on all targets is then saved for use on new proteins. Fitted regressions are written to
    ``out_dir/contact_regression.json`` (and beside the checkpoint with ``save_beside``).
    """
    if regression is not None and fit_targets:
        raise UserError("give either a fitted regression or structures to fit on, not both")
    identity = model_identity(loaded)
    if regression is not None:
        regression.check_model(loaded, identity["model_sha256"])
        layers, heads = regression.layers, regression.heads
    else:
        layers = list(range(1, loaded.config.depth + 1))
        heads = list(range(loaded.config.heads))
    if regression is None and not fit_targets and len(targets) < 2:
        raise UserError(
            "cross-fitting needs at least 2 structures; add structures, or pass --fit-on "
            "STRUCTURE... or --regression PATH"
        )
    features = _TargetFeatures(loaded, layers, heads)
    fitter = _Fitter(features, identity, C, class_weight, seed)
    plan = plan_regressions(
        targets, fitter, regression=regression, fit_targets=fit_targets, folds=folds
    )
    rows = evaluate(targets, plan, features, seed)
    mean = mean_metrics(rows, [*METRICS, *(f"null_{m}" for m in METRICS)])
    beside = loaded.source if save_beside else None
    files = write_results(Path(out_dir).expanduser(), rows, mean, plan, beside)
    return ContactBenchmark(rows, mean, plan.mode, plan.final or regression, files)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> Path:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_fmt(row.get(c, "")) for c in columns])
    return write_text_atomic(path, buf.getvalue())


def format_summary(result: ContactBenchmark) -> str:
    """Printed table: mean P@L, L/2, L/5 per range, model vs null."""
    lines = [f"contact precision ({result.mode}, {len(result.rows)} proteins): model / null"]
    for rname in RANGES:
        cells = []
        for tname in TOPS:
            m = result.mean[f"P@{tname}_{rname}"]
            n = result.mean[f"null_P@{tname}_{rname}"]
            cells.append(f"P@{tname} {_fmt(m) or '-'} / {_fmt(n) or '-'}")
        lines.append(f"  {rname:>6}: " + "   ".join(cells))
    return "\n".join(lines)
