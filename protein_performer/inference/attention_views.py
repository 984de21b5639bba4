"""The arrays ``visualize`` draws: attention panels for a window, and contact maps.

Kept apart from the drawing (``viz/``, arrays in, PNGs out) and from the command (argument
parsing), so a notebook gets the same arrays the pictures show. Memory stays O(window x L):
attention rows are streamed layer by layer (``attention_maps``'s ``sink``) into the window x
window panels and into any other reduction the caller passes (``row_sinks``, e.g. the
amino-acid sums of ``viz.similarity``), never kept for all layers at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from protein_performer.errors import UserError

if TYPE_CHECKING:
    from protein_performer.contacts.structures import ContactTarget
    from protein_performer.interop.record import LoadedModel

log = logging.getLogger(__name__)

#: Residues shown when no window is asked for (from the start of the sequence).
DEFAULT_MAX_WINDOW = 512


@dataclass(frozen=True)
class AttentionViews:
    """Attention panels of ``layers`` x ``heads`` over residues ``[start, end)``."""

    layers: list[int]
    heads: list[int]
    start: int
    end: int
    grid: np.ndarray | None  # (n_layers, n_heads, W, W), None when not asked for


@dataclass(frozen=True)
class ContactView:
    """Predicted vs true contacts of one structure, and how the prediction was made."""

    predicted: np.ndarray  # (L, L)
    true: np.ndarray  # (L, L) bool
    valid: np.ndarray  # (L, L) bool: both residues observed
    how: str
    quantity: str


def resolve_window(
    length: int, window: Sequence[int] | None, max_window: int | None = DEFAULT_MAX_WINDOW
) -> tuple[int, int]:
    """``[start, end)`` from the one asked for, else the first ``max_window`` residues."""
    if window is None:
        cap = int(max_window or length)
        if length > cap:
            log.info("window: residues [0, %d) of %d (give --window START END)", cap, length)
        return 0, min(length, cap)
    if len(window) != 2:
        raise UserError(f"window must be START END, got {list(window)}")
    return int(window[0]), int(window[1])


def attention_views(
    loaded: LoadedModel,
    sequence: str,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    window: Sequence[int] | None = None,
    max_window: int | None = DEFAULT_MAX_WINDOW,
    grid: bool = True,
    row_sinks: Sequence[Callable[[np.ndarray], None]] = (),
) -> AttentionViews:
    """Stream the attention rows of the window once; keep the window x window panels when
    ``grid`` and hand every (H', W, L) row block to each of ``row_sinks``.

    ``layers`` are 1..depth (negative from the end), ``heads`` 0-based; None means all."""
    from protein_performer.contacts.attention import attention_maps, resolve_selection

    model = loaded.model
    chosen_layers, chosen_heads = resolve_selection(model, layers, heads)
    start, end = resolve_window(len(sequence), window, max_window)
    panels: dict[int, np.ndarray] = {}

    def sink(layer: int, maps: Any) -> None:
        rows = maps.numpy()  # (H', W, L)
        if grid:
            panels[layer] = rows[:, :, start:end]
        for each in row_sinks:
            each(rows)

    if grid or row_sinks:
        attention_maps(
            model,
            sequence,
            layers=chosen_layers,
            heads=chosen_heads,
            window=(start, end),
            sink=sink,
        )
    stacked = np.stack([panels[i] for i in chosen_layers]) if grid else None
    return AttentionViews(chosen_layers, chosen_heads, start, end, stacked)


def unsupervised_contacts(maps: np.ndarray) -> np.ndarray:
    """Mean over layers and heads of APC(symmetrized maps): a fit-free contact score."""
    from protein_performer.model.contact_head import contact_features

    return contact_features(maps).mean(-1)


def contact_view(
    loaded: LoadedModel, target: ContactTarget, regression: str | None = None
) -> ContactView:
    """Contacts of ``target`` from the regression at ``regression``, else the model's own or
    the one beside the checkpoint, else the unsupervised mean-APC score."""
    from protein_performer.contacts.fit import model_maps
    from protein_performer.contacts.predict import find_regression

    reg = find_regression(loaded, regression or None, required=False)
    if reg is not None:
        reg.check_model(loaded)
        pred = reg.predict_maps(model_maps(loaded, target.sequence, reg.layers, reg.heads))
        how, quantity = "logistic regression", "predicted contact probability"
    else:
        pred = unsupervised_contacts(model_maps(loaded, target.sequence))
        how, quantity = "unsupervised (mean APC, no regression)", "mean APC attention score"
    return ContactView(pred, target.contacts(), target.valid(), how, quantity)
