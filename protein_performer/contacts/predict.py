"""Contact probabilities of any sequence from a model's attention, dense or top-k, bounded memory.

ESM-2's contact head and the regressions ``protein-performer contacts`` fits are one logistic
regression on APC(symmetrize(A_f)) over every layer x head map A_f (BOS/EOS stripped, rows
normalized over all tokens). Everything before the sigmoid is linear in the maps:

    logit_ij = b + sum_f w_f (S_f,ij - r_f,i r_f,j / s_f),  S_f = A_f + A_f^T,
    r_f = S_f 1 (row sums = A_f's row sums + column sums),  s_f = sum_i r_f,i

so the logits are accumulated head by head and window by window, never holding one L x L map:

* pass 1, per head: the row and column sums of A_f, the only global quantities APC needs
  (FAVOR+: A = Qn K^T, so both are O(L M); exact: one sweep over blocks of rows, O(window x L));
* pass 2, per window of rows [a, b): S_f[a:b, a:] for every head (the upper triangle: S is
  symmetric), weighted and summed, minus the rank-F APC term.

Up to ``dense_max_length`` residues the windows fill the whole (L, L) map. Above it only the top
``k * L`` pairs (i < j, j - i >= ``min_separation``) are kept while sweeping, so memory is
O(window x L + layers x heads x L) and titin's 34k residues need no 34k x 34k array. Heads the
regression gives weight 0 (L1 fits zero many) are skipped. Causal FAVOR+ models are refused:
their implied map is not a product of two feature blocks (exact causal maps are supported).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator

import numpy as np
import torch

from protein_performer.contacts.attention import encode_sequence, run_with_qk
from protein_performer.contacts.fit import MIN_SEPARATION, default_regression_path

# ``read_contacts`` is read from here by its documented path (``contacts predict --help``,
# the README); it lives with the maps' columns.
from protein_performer.contacts.map_columns import ContactMap, read_contacts  # noqa: F401
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.progress import beat
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.cores.base import MapBlocks

log = logging.getLogger(__name__)

DEFAULT_DENSE_MAX_LENGTH = 4096
DEFAULT_TOP_K_PER_LENGTH = 2.0
#: Elements of the (window, L) accumulator: sets the rows per window. Larger windows recompute
#: the FAVOR+ features of the columns less often; this one is 128 MB.
_BLOCK_ELEMENTS = 1 << 25
#: How each caller hands over a regression file, for the one line a missing regression gives.
PASS_REGRESSION = {
    "cli": "or pass --regression DIR/contact_regression.json",
    "python": "or pass regression='DIR/contact_regression.json'",
    "embed": "embed reads only the model's own; `contacts predict --regression FILE` takes a file",
}


def how_to_fit(caller: str = "cli") -> str:
    """What to do without a regression, in the words of the caller (``PASS_REGRESSION``): a
    CLI flag, a Python argument, or nothing to pass (``embed`` reads the model's own)."""
    return (
        "fit one on structures with `protein-performer contacts fit CKPT STRUCTURE... --out-dir "
        f"DIR --save-beside` ({PASS_REGRESSION[caller]}); a model converted from ESM-2 by "
        "`convert-esm` carries ESM-2's contact head"
    )


# --------------------------------------------------------------------------------------------
# Which regression
# --------------------------------------------------------------------------------------------
def find_regression(
    loaded: LoadedModel,
    path: str | os.PathLike[str] | None = None,
    required: bool = True,
    caller: str = "cli",
) -> ContactRegression | None:
    """``path`` if given, else the model's own: the file stored with it (in an export
    directory, or beside a ``.ckpt`` by ``contacts --save-beside``, which wins over a regression
    the checkpoint carries, e.g. ESM-2's head through ``init_from``), else the carried one. None
    at all is one line saying how to get one, in the ``caller``'s words (:func:`how_to_fit`),
    or None when not ``required``."""
    if path is not None:
        return ContactRegression.load(path)
    beside = default_regression_path(loaded.source)
    if beside.is_file():
        log.info("using the contact regression stored with the checkpoint: %s", beside)
        return ContactRegression.load(beside)
    if loaded.contact_regression is not None:
        return ContactRegression.from_dict(loaded.contact_regression, loaded.source)
    if not required:
        return None
    raise UserError(f"{loaded.source} has no contact regression: {how_to_fit(caller)}")


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------
def window_rows(length: int) -> int:
    """Rows per window: the (window, L) float32 accumulator is about 128 MB."""
    return max(16, min(length, _BLOCK_ELEMENTS // (length + 2)))


def _heads(
    loaded: LoadedModel, tokens: torch.Tensor, regression: ContactRegression, window: int
) -> tuple[list[MapBlocks], list[float]]:
    """Every head the regression weighs (nonzero coefficient) as a block source, from its
    layer's attention core (which refuses maps it cannot give in blocks)."""
    L = tokens.shape[1] - 2
    grid = regression.coef_grid()
    heads: list[MapBlocks] = []
    weights: list[float] = []

    def on_layer(layer: int, module, q, k, padding_mask) -> None:
        row = regression.layers.index(layer)
        for col, h in enumerate(regression.heads):
            if grid[row, col] == 0:
                continue
            qh, kh = q[:, h : h + 1].float(), k[:, h : h + 1].float()  # (1, 1, T, d)
            heads.append(module.core.map_blocks(qh, kh, L, window))
            weights.append(float(grid[row, col]))

    try:
        run_with_qk(loaded.model, tokens, sorted(regression.layers), on_layer)
    except UserError as exc:
        raise UserError(f"{loaded.source}: {exc}") from None
    return heads, weights


def _logit_windows(
    heads: list[MapBlocks], weights: list[float], intercept: float, L: int, window: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(a, logits of S[a:b, a:]) for consecutive windows [a, b) of rows."""
    if heads:
        sums = torch.stack([h.sums for h in heads])  # (F, L)
        total = sums.sum(-1)
        g = torch.tensor(weights, device=sums.device) / torch.where(total != 0, total, 1)
        g = torch.where(total != 0, g, 0)  # (F,): APC's w_f / s_f
    for a in range(0, L, window):
        b = min(L, a + window)
        beat(f"rows {a}/{L} of a {L}-residue contact map")
        if not heads:
            yield a, torch.full((b - a, L - a), intercept)
            continue
        acc = torch.zeros(b - a, L - a, device=sums.device)
        for head, w in zip(heads, weights, strict=True):
            head.add_upper_block(acc, a, w)
        acc.sub_((sums[:, a:b].T * g) @ sums[:, a:])  # rank-F APC term
        yield a, acc.add_(intercept)


def _dense(windows: Iterator[tuple[int, torch.Tensor]], L: int) -> np.ndarray:
    out = torch.zeros(L, L)
    for a, acc in windows:
        out[a : a + acc.shape[0], a:] = acc.cpu()
    out = torch.triu(out) + torch.triu(out, 1).T
    return torch.sigmoid(out).numpy()


def _top_pairs(
    windows: Iterator[tuple[int, torch.Tensor]], k: int, min_sep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k highest-logit pairs i < j, j - i >= min_sep, merged window by window."""
    best = torch.empty(0)
    bi = torch.empty(0, dtype=torch.long)
    bj = torch.empty(0, dtype=torch.long)
    for a, acc in windows:
        acc = acc.cpu()
        W, K = acc.shape
        eligible = torch.ones(W, K, dtype=torch.bool).triu_(min_sep)  # column c = row r + sep
        values = acc.masked_fill_(~eligible, float("-inf")).reshape(-1)
        n = min(k, int(eligible.sum()))
        if n == 0:
            continue
        top, idx = torch.topk(values, n)
        best = torch.cat([best, top])
        bi = torch.cat([bi, a + idx // K])
        bj = torch.cat([bj, a + idx % K])
        if len(best) > k:
            best, keep = torch.topk(best, k)
            bi, bj = bi[keep], bj[keep]
    order = torch.argsort(best, descending=True, stable=True)
    return bi[order].numpy(), bj[order].numpy(), torch.sigmoid(best[order]).numpy()


@torch.inference_mode()
def predict_contacts(
    loaded: LoadedModel,
    sequence: str,
    regression: ContactRegression | None = None,
    *,
    dense_max_length: int = DEFAULT_DENSE_MAX_LENGTH,
    top_k_per_length: float = DEFAULT_TOP_K_PER_LENGTH,
    min_separation: int = MIN_SEPARATION,
    checked: bool = False,
) -> ContactMap:
    """Contact probabilities of ``sequence``: the (L, L) map up to ``dense_max_length``
    residues, else the top ``top_k_per_length * L`` pairs with j - i >= ``min_separation``.

    ``regression``: the model's own when None (:func:`find_regression`). ``checked``: the
    caller already ran ``regression.check_model`` (a FASTA run checks once, not per record).
    """
    if regression is None:
        regression = find_regression(loaded)
    if not checked:
        regression.check_model(loaded)
    if dense_max_length < 1 or top_k_per_length <= 0 or min_separation < 1:
        raise UserError(
            "dense_max_length and min_separation must be >= 1 and top_k_per_length > 0; got "
            f"{dense_max_length}, {min_separation}, {top_k_per_length}"
        )
    tokens = encode_sequence(loaded.model, sequence, loaded.alphabet)
    L = tokens.shape[1] - 2
    window = window_rows(L)
    heads, weights = _heads(loaded, tokens, regression, window)
    windows = _logit_windows(heads, weights, regression.intercept, L, window)
    if dense_max_length >= L:
        return ContactMap(L, dense=_dense(windows, L))
    k = max(1, math.ceil(top_k_per_length * L))
    i, j, p = _top_pairs(windows, k, min_separation)
    return ContactMap(L, i=i, j=j, p=p)
