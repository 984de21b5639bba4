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

import inspect
import logging
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protein_performer.errors import UserError, shown
from protein_performer.interop.identity import model_identity
from protein_performer.interop.ours import REGRESSION_FILE  # beside a .ckpt: <stem>.<it>
from protein_performer.io.atomic import write_text_atomic
from protein_performer.model.contact_head import ContactRegression, contact_features

if TYPE_CHECKING:
    from protein_performer.contacts.structures import ContactTarget
    from protein_performer.interop.record import LoadedModel

log = logging.getLogger(__name__)

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
def default_regression_path(ckpt: str | os.PathLike[str]) -> Path:
    """Where a regression lives beside its checkpoint: inside an export directory, or next to a
    ``.ckpt`` as ``<stem>.contact_regression.json``."""
    path = Path(ckpt).expanduser()
    if path.is_dir():
        return path / REGRESSION_FILE
    return path.with_name(f"{path.stem}.{REGRESSION_FILE}")


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
    loaded: LoadedModel,
    sequence: str,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> np.ndarray:
    """(n_layers, n_heads, L, L) residue x residue maps (float32) of a loaded model."""
    from protein_performer.contacts.attention import full_maps

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
            log.info("attention maps: %s (%d residues)", shown(target.id), target.length)
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
    import io

    from protein_performer.io.tables import table_writer

    buf = io.StringIO()
    writer = table_writer(buf, lineterminator="\n")
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
