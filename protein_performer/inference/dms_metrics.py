"""Zero-shot fitness metrics of a mutation scan, as ProteinGym defines them (one place).

ProteinGym (Notin et al. 2023) reports per assay, with ``DMS_score`` (higher = fitter) and its
binarization ``DMS_score_bin`` (1 = fit, by the assay's cutoff):

* ``Spearman``: rank correlation of model score and ``DMS_score`` (its primary metric);
* ``AUC``: area under the ROC curve of the model score for ``DMS_score_bin``;
* ``MCC``: Matthews correlation of ``DMS_score_bin`` with the model score binarized at its own
  median (``score >= median`` -> 1);
* ``NDCG``: normalized discounted cumulative gain over the top 10% by model score (k = floor(n
  / 10)), gains the ``DMS_score`` min-max scaled to [0, 1], discount ``log2(rank + 1)``, ties in
  the model score broken by row order;
* ``Top_recall``: the share of the top 10% by ``DMS_score`` (above its 90th percentile) that
  are also in the top 10% by model score.

A metric that is not defined (fewer than 3 rows, a constant column, one class only) is None,
never a number. Summaries over assays average as the leaderboard does: over assays of a
protein (``UniProt_ID``) within a selection type, then over proteins, then over selection types
(:func:`leaderboard_average`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

METRICS = ("Spearman", "AUC", "MCC", "NDCG", "Top_recall")


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def spearman(scores: Sequence[float], labels: Sequence[float]) -> float | None:
    """Spearman's rho (scipy), None below 3 pairs or for a constant column."""
    x, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    from scipy.stats import spearmanr

    return _finite(spearmanr(x, y).statistic)


def auc(scores: Sequence[float], fit: Sequence[int]) -> float | None:
    """ROC AUC of ``scores`` for the binary labels ``fit`` (None with one class only)."""
    y = np.asarray(fit, np.int64)
    if len(np.unique(y)) < 2:
        return None
    from sklearn.metrics import roc_auc_score

    return _finite(roc_auc_score(y, np.asarray(scores, np.float64)))


def mcc(scores: Sequence[float], fit: Sequence[int]) -> float | None:
    """MCC of ``fit`` with the scores cut at their median (``>=`` -> 1), as ProteinGym."""
    x, y = np.asarray(scores, np.float64), np.asarray(fit, np.int64)
    if len(x) < 2 or len(np.unique(y)) < 2:
        return None
    from sklearn.metrics import matthews_corrcoef

    predicted = (x >= np.median(x)).astype(np.int64)
    if len(np.unique(predicted)) < 2:
        return None
    return _finite(matthews_corrcoef(y, predicted))


def _ranks(values: np.ndarray) -> np.ndarray:
    """1-based rank by ``values``, highest first, ties by row order."""
    return np.argsort(np.argsort(-values, kind="stable"), kind="stable") + 1


def ndcg(
    scores: Sequence[float], labels: Sequence[float], top_percent: float = 10.0
) -> float | None:
    """ProteinGym's NDCG@top 10% (see the module docstring); None when no row has a gain."""
    x, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
    if len(y) < 1 or np.ptp(y) == 0:
        return None
    k = int(np.floor(len(y) * top_percent / 100))
    gains = (y - y.min()) / (y.max() - y.min())

    def dcg(ranks: np.ndarray) -> float:
        keep = (ranks <= k) & (gains != 0)
        return float(np.sum(gains[keep] / np.log2(ranks[keep] + 1)))

    ideal = dcg(_ranks(gains))
    return dcg(_ranks(x)) / ideal if ideal > 0 else None


def top_recall(
    scores: Sequence[float], labels: Sequence[float], top_percent: float = 10.0
) -> float | None:
    """Share of the top ``top_percent``% by label also in the top ``top_percent``% by score."""
    x, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
    if len(y) < 1:
        return None
    true_top = y > np.percentile(y, 100 - top_percent)
    model_top = x > np.percentile(x, 100 - top_percent)
    return float((true_top & model_top).sum() / true_top.sum()) if true_top.sum() else None


def assay_metrics(
    scores: Sequence[float], labels: Sequence[float], fit: Sequence[int] | None
) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` for one assay (AUC and MCC need ``fit``)."""
    return {
        "Spearman": spearman(scores, labels),
        "AUC": None if fit is None else auc(scores, fit),
        "MCC": None if fit is None else mcc(scores, fit),
        "NDCG": ndcg(scores, labels),
        "Top_recall": top_recall(scores, labels),
    }


def leaderboard_average(
    values: Sequence[float | None], proteins: Sequence[str], selection: Sequence[str]
) -> float | None:
    """ProteinGym's average over assays: mean over each (protein, selection type)'s assays,
    then over the proteins of a selection type, then over selection types (so a protein with
    many assays, or a selection type with many proteins, does not dominate). None-valued
    assays are left out; None when none is left."""
    by_group: dict[tuple[str, str], list[float]] = defaultdict(list)
    for v, p, s in zip(values, proteins, selection, strict=True):
        if v is not None:
            by_group[(s, p)].append(v)
    by_type: dict[str, list[float]] = defaultdict(list)
    for (s, _), vs in by_group.items():
        by_type[s].append(float(np.mean(vs)))
    if not by_type:
        return None
    return float(np.mean([np.mean(vs) for vs in by_type.values()]))
