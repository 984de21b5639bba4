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

import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protein_performer.contacts.attention import encode_sequence, run_with_qk
from protein_performer.contacts.fit import MIN_SEPARATION, default_regression_path
from protein_performer.data.headers import IdLookup
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.columns import (
    HEADER_COLUMNS,
    RECORD_COLUMNS,
    Column,
    Layout,
    checked_offsets,
    checked_rows,
    header_column,
    merge_columns,
    open_columns,
    read_ids,
    record_columns,
    write_columns,
)
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


@dataclass
class ContactMap:
    """Contact probabilities of one sequence (residues 0-based, no BOS/EOS).

    ``dense``: the (L, L) map, symmetric, or None above the dense limit; then ``i``, ``j``
    (i < j) and ``p`` hold the top pairs, most probable first.
    """

    length: int
    dense: np.ndarray | None = None
    i: np.ndarray | None = None
    j: np.ndarray | None = None
    p: np.ndarray | None = None


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


# --------------------------------------------------------------------------------------------
# FASTA -> HDF5
# --------------------------------------------------------------------------------------------
FORMAT_NAME = "protein_performer.contacts"
FORMAT_VERSION = 1
DTYPES = {"float16": np.float16, "float32": np.float32}


@dataclass
class ContactsSummary:
    path: Path
    num_records: int
    dense: int
    sparse: int


def contact_ragged(dtype: str) -> dict[str, tuple[Column, ...]]:
    """The ragged columns of contact maps (``dense_*``, ``pair_*``), in files of
    ``contacts predict`` and of ``embed --include contacts`` alike."""
    values = DTYPES[dtype]
    return {
        "dense_offsets": (Column("dense_values", values),),
        "pair_offsets": (
            Column("pair_i", np.int32),
            Column("pair_j", np.int32),
            Column("pair_p", values),
        ),
    }


def contact_columns(
    maps: Sequence[ContactMap], dtype: str
) -> dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Records' maps as the ragged values of :func:`contact_ragged` (dense maps row-major)."""
    np_dtype = DTYPES[dtype]
    dense = [m.dense.reshape(-1) for m in maps if m.dense is not None]
    sparse = [m for m in maps if m.dense is None]

    def cat(arrays: list[np.ndarray], dt: Any) -> np.ndarray:  # noqa: ANN401
        return np.concatenate(arrays).astype(dt) if arrays else np.zeros(0, dt)

    return {
        "dense_offsets": (
            np.asarray([0 if m.dense is None else m.dense.size for m in maps]),
            {"dense_values": cat(dense, np_dtype)},
        ),
        "pair_offsets": (
            np.asarray([0 if m.p is None else len(m.p) for m in maps]),
            {
                "pair_i": cat([m.i for m in sparse], np.int32),
                "pair_j": cat([m.j for m in sparse], np.int32),
                "pair_p": cat([m.p for m in sparse], np_dtype),
            },
        ),
    }


def predict_contacts_fasta(
    loaded: LoadedModel,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    regression: ContactRegression | None = None,
    *,
    dtype: str = "float16",
    dense_max_length: int = DEFAULT_DENSE_MAX_LENGTH,
    top_k_per_length: float = DEFAULT_TOP_K_PER_LENGTH,
    min_separation: int = MIN_SEPARATION,
    on_invalid: str = "error",
    progress: bool = True,
    regression_source: str = "",
    toks_per_batch: int = 512,
) -> ContactsSummary:
    """Contact maps of every record (FASTA or store) into one columnar HDF5 file.

    Layout (:mod:`protein_performer.io.columns`; one array per field)::

        /                 attrs: format, format_version, checkpoint, model_sha256, regression
                                 (its JSON), regression_source, dtype, dense_max_length,
                                 top_k_per_length, min_separation, num_records
        ids               (N,) utf-8, record ids in input order
        lengths           (N,) int64
        record_numbers    (N,) int64, 1-based position in the input
        header_bytes      (sum,) uint8, gzip: the FASTA header lines (no '>'), back to back;
        header_offsets    (N+1,) int64: record n's header is header_bytes[o[n]:o[n+1]]
        dense_offsets     (N+1,) int64 into dense_values; record n's map is
                          dense_values[o[n]:o[n+1]].reshape(L, L) (empty when sparse)
        dense_values      (sum L^2 of dense records,) probabilities, row-major
        pair_offsets      (N+1,) int64 into pair_i/pair_j/pair_p (empty when dense)
        pair_i, pair_j    int32 residue indices (0-based, i < j); pair_p probabilities,
                          most probable first within a record

    Written like ``embed``'s file: windows of records (about ``toks_per_batch`` * 32 residues;
    dense maps are L^2 each, hence the small default) become parts, merged at the end, so
    ranks of a ``torchrun``/SLURM job split the records
    (:mod:`protein_performer.io.sharding`).
    """
    from protein_performer.data.inputs import input_records, total_in_background
    from protein_performer.io.progress import progress as progress_bar
    from protein_performer.io.sharding import rank_label, run_sharded, windows

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    regression = regression or find_regression(loaded)
    sha = loaded.weights_sha256()
    regression.check_model(loaded, sha)
    layout = Layout(RECORD_COLUMNS, {**HEADER_COLUMNS, **contact_ragged(dtype)})
    attrs = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checkpoint": str(loaded.source),
        "model_sha256": sha,
        "regression": json.dumps(regression.to_dict(), sort_keys=True),
        "regression_source": regression_source,
        "dtype": dtype,
        "dense_max_length": dense_max_length,
        "top_k_per_length": top_k_per_length,
        "min_separation": min_separation,
    }
    kinds = {"dense": 0, "sparse": 0}
    bar = progress_bar(None, "res", rank_label("contacts"), progress)
    total_in_background(bar, fasta, "residues")

    def write_part(part: Path, window: list) -> None:
        maps = []
        for n, r in enumerate(window):
            beat(f"{n}/{len(window)} records of this window")
            maps.append(
                predict_contacts(
                    loaded,
                    r.sequence,
                    regression,
                    dense_max_length=dense_max_length,
                    top_k_per_length=top_k_per_length,
                    min_separation=min_separation,
                    checked=True,
                )
            )
        kinds["dense"] += sum(m.dense is not None for m in maps)
        kinds["sparse"] += sum(m.dense is None for m in maps)
        ragged = {"header_offsets": header_column(window), **contact_columns(maps, dtype)}
        write_columns(part, layout, attrs, record_columns(window), ragged)
        bar.update(sum(len(r.sequence) for r in window))

    def merge(parts: list[Path]) -> int:
        if not parts:
            raise UserError(f"{fasta}: no valid records to process")
        return merge_columns(Path(out), layout, attrs, parts)

    records = input_records(fasta, on_invalid)
    with bar:
        _, total = run_sharded(
            Path(out).expanduser(),
            ".h5",
            windows(records, toks_per_batch, lambda r: len(r.sequence)),
            write_part,
            merge,
            fresh=True,
        )
    return ContactsSummary(Path(out), total, kinds["dense"], kinds["sparse"])


def read_contacts(
    path: str | os.PathLike[str], ids: Sequence[str] | None = None
) -> dict[str, ContactMap]:
    """The maps of ``ids`` (all when None) from a ``contacts predict`` file."""
    from protein_performer.errors import check_format_header

    src = Path(path).expanduser()
    if not src.is_file():
        raise UserError(f"{src} does not exist or is not a file")
    try:
        with open_columns(src, "contacts predict files", "re-run contacts predict") as h5:
            header = {k: h5.attrs.get(k) for k in ("format", "format_version")}
            if header["format_version"] is not None:
                header["format_version"] = int(header["format_version"])
            check_format_header(header, src, FORMAT_NAME, FORMAT_VERSION, "contacts predict file")
            return read_maps(h5, src, ids)
    except (OSError, KeyError, ValueError) as exc:  # truncated or damaged: h5py's own errors
        raise UserError(
            f"{src}: not a readable contacts file ({str(exc).splitlines()[0][:200]}); "
            "it is truncated or damaged: re-run contacts predict"
        ) from None


def read_maps(
    h5: Any,
    path: str | os.PathLike[str],
    ids: Sequence[str] | None = None,  # noqa: ANN401
) -> dict[str, ContactMap]:
    """The maps of ``ids`` (all when None) from an open file with :func:`contact_ragged`."""
    if isinstance(ids, str):  # one id, not its letters
        ids = [ids]
    all_ids = read_ids(h5)
    lookup = IdLookup(all_ids)
    rows = [lookup.find(rid) for rid in ids] if ids is not None else range(len(all_ids))
    missing = [rid for rid, n in zip(ids, rows, strict=True) if n is None] if ids else []
    if missing:
        raise UserError(
            f"{path}: no record(s) {', '.join(missing[:5])} (by id, UniProt accession or entry "
            "name)"
        )
    lengths = np.asarray(h5["lengths"][:], dtype=np.int64)
    if lengths.shape != (len(all_ids),) or (lengths < 0).any():
        raise UserError(f"{path}: lengths do not match the ids: the file is damaged; re-create it")
    count = len(all_ids)
    # Values of the right kind, and the pairs' three columns of one length (a text column
    # would come back as bytes, a short one would misalign the pairs).
    dense = checked_rows(h5, "dense_values", None, "f", 1)
    pair_i = checked_rows(h5, "pair_i", None, "iu", 1)
    for name, kind in (("pair_j", "iu"), ("pair_p", "f")):
        checked_rows(h5, name, len(pair_i), kind, 1)
    doff = checked_offsets(h5, "dense_offsets", count, dense.shape[0], path)
    poff = checked_offsets(h5, "pair_offsets", count, len(pair_i), path)
    dense = np.diff(doff.astype(np.int64))
    if ((dense != 0) & (dense != lengths * lengths)).any():
        raise UserError(f"{path}: dense_offsets disagrees with the record lengths; re-create it")
    out: dict[str, ContactMap] = {}
    for n in rows:
        rid = all_ids[n]
        L = int(lengths[n])
        if doff[n + 1] > doff[n]:
            out[rid] = ContactMap(L, dense=h5["dense_values"][doff[n] : doff[n + 1]].reshape(L, L))
        else:
            sl = slice(int(poff[n]), int(poff[n + 1]))
            out[rid] = ContactMap(L, i=h5["pair_i"][sl], j=h5["pair_j"][sl], p=h5["pair_p"][sl])
    return out
