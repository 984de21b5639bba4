"""``visualize(cfg) -> {name: png path}``: pictures of a model's attention for one sequence.

A pure function of a composed config (``conf/visualize.yaml``), so tests and notebooks call it
directly; ``run(overrides)`` composes with Hydra's compose API
(``protein_performer.hydra_compose``).

Memory stays O(window x L): attention rows are streamed layer by layer (``attention_maps``'s
``sink``) into the two reductions the pictures need, the window x window panels and the 20 x 20
amino-acid sums, and never kept for all layers at once.

The amino-acid similarity (the Performer paper's Fig. 13 idea; also Vig et al. 2021) is a
log-odds: total attention from residues of type a to residues of type b, summed over layers,
heads and query positions (self-attention i == j excluded), divided by what attention spread
uniformly over the other residues would give, log2, symmetrized. A model whose attention
ignores residue types scores 0 everywhere; types that never occur stay NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.errors import UserError
from protein_performer.viz.plots import AMINO_ACIDS

log = logging.getLogger(__name__)

CONFIG_NAME = "visualize"
_AA_INDEX = {a: i for i, a in enumerate(AMINO_ACIDS)}


class SimilarityAccumulator:
    """Sums attention between amino-acid types over streamed (H', W, L) row blocks, and what
    uniform attention (each row's mass spread evenly over the other L - 1 residues) would give,
    so that type frequencies and the excluded diagonal cancel out of the ratio."""

    def __init__(self, sequence: str, row_start: int = 0) -> None:
        idx = np.array([_AA_INDEX.get(c, -1) for c in sequence.upper()])
        self.cols = np.zeros((len(sequence), 20))
        known = idx >= 0
        self.cols[np.nonzero(known)[0], idx[known]] = 1.0  # (L, 20) one-hot, 0 rows for X etc.
        self.counts = self.cols.sum(0)  # (20,)
        self.row_start = row_start
        self.observed = np.zeros((20, 20))
        self.expected = np.zeros((20, 20))

    def add(self, maps: np.ndarray) -> None:
        """maps (H', W, L) rows for residues row_start .. row_start + W - 1."""
        a = np.asarray(maps, dtype=np.float64).sum(0)  # (W, L)
        W, L = a.shape
        rows = np.arange(W)
        a[rows, rows + self.row_start] = 0.0  # self-attention says nothing about similarity
        one_hot = self.cols[self.row_start : self.row_start + W]  # (W, 20)
        self.observed += one_hot.T @ a @ self.cols  # (20, 20)
        mass = one_hot.T @ a.sum(1)  # (20,) row mass per query type
        others = self.counts[None, :] - np.eye(20)  # (20, 20): b-residues other than i itself
        self.expected += mass[:, None] * others / max(L - 1, 1)

    def matrix(self) -> np.ndarray:
        """Symmetric log2(observed / expected), NaN where a type is absent."""
        return log_odds(self.observed, self.expected)


def log_odds(observed: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """log2 of the symmetrized ratio; NaN where either side is 0."""
    o, e = observed + observed.T, expected + expected.T
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log2(o / e)
    out[~np.isfinite(out)] = np.nan
    return out


def _sequence(cfg: Any) -> tuple[str, str]:
    """(record id, sequence) from ``sequence=``, ``fasta=``/``record=`` or the structure."""
    if cfg.get("sequence"):
        if cfg.get("fasta"):
            raise UserError("give sequence=... or fasta=..., not both")
        return "sequence", str(cfg.sequence).strip().upper()
    if cfg.get("fasta"):
        from protein_performer.inference.embedding import read_records

        records = read_records(Path(str(cfg.fasta)), "error")
        want = cfg.get("record")
        if want is None:
            return records[0].id, records[0].sequence
        want = str(want)
        for r in records:  # the id as written, or its UniProt accession or entry name
            if want in (r.id, r.header.accession, r.header.entry_name):
                return r.id, r.sequence
        shown = ", ".join(r.id for r in records[:5])
        raise UserError(
            f"{cfg.fasta}: no record {want!r} (by id, accession or entry name; ids start: "
            f"{shown}, ...)"
        )
    if cfg.get("structure"):
        return "", ""  # the structure's own sequence, filled in by the caller
    raise UserError("visualize needs sequence=..., fasta=... (record=ID) or structure=...")


def _window(cfg: Any, length: int) -> tuple[int, int]:
    win = cfg.get("window")
    if win is None:
        cap = int(cfg.get("max_window") or length)
        if length > cap:
            log.info("window: residues [0, %d) of %d (set window=[start,end])", cap, length)
        return 0, min(length, cap)
    if len(win) != 2:
        raise UserError(f"window must be [start, end], got {list(win)}")
    return int(win[0]), int(win[1])


def _as_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _regression(cfg: Any, loaded: Any):
    """``regression=PATH``, else the model's own or the one beside the checkpoint, else None."""
    from protein_performer.inference.contact_maps import find_regression

    return find_regression(loaded, cfg.get("regression") or None, required=False)


def unsupervised_contacts(maps: np.ndarray) -> np.ndarray:
    """Mean over layers and heads of APC(symmetrized maps): a fit-free contact score."""
    from protein_performer.inference.contacts import contact_features

    return contact_features(maps).mean(-1)


def visualize(cfg: Any) -> dict[str, Path]:
    """Write the requested PNGs to ``cfg.out_dir``; returns {name: path} for the names
    ``grid``, ``similarity`` and ``contacts`` that were drawn."""
    from protein_performer.inference.attention_maps import (
        attention_maps,
        resolve_heads,
        resolve_layers,
    )
    from protein_performer.inference.loading import load_model
    from protein_performer.viz import plots

    out_dir = Path(str(cfg.out_dir)).expanduser()
    record_id, sequence = _sequence(cfg)
    target = None
    if cfg.get("structure") and bool(cfg.get("contacts", True)):
        from protein_performer.inference.structures import contact_target

        target = contact_target(
            str(cfg.structure), chain=cfg.get("chain"), sequence=sequence or None
        )
        if not sequence:
            record_id, sequence = target.id, target.sequence
    if not sequence:
        raise UserError("no sequence to visualize")
    loaded = load_model(str(cfg.ckpt), str(cfg.get("device", "auto")))
    model = loaded.model
    layers = resolve_layers(model, _as_list(cfg.get("layers")))
    heads = resolve_heads(model, _as_list(cfg.get("heads")))
    start, end = _window(cfg, len(sequence))
    name = record_id or "sequence"
    files: dict[str, Path] = {}

    want_grid = bool(cfg.get("grid", True))
    want_sim = bool(cfg.get("similarity", True))
    if want_grid or want_sim:
        panels: dict[int, np.ndarray] = {}
        sim = SimilarityAccumulator(sequence, start)

        def sink(layer: int, maps: Any) -> None:
            rows = maps.numpy()  # (H', W, L)
            if want_grid:
                panels[layer] = rows[:, :, start:end]
            if want_sim:
                sim.add(rows)

        attention_maps(model, sequence, layers=layers, heads=heads, window=(start, end), sink=sink)
        if want_grid:
            grid = np.stack([panels[i] for i in layers])  # (n_layers, n_heads, W, W)
            files["grid"] = plots.attention_grid(
                grid,
                layers,
                heads,
                out_dir / "attention_grid.png",
                row_start=start,
                col_start=start,
                title=f"{name}: attention, residues [{start}, {end})",
                dpi=int(cfg.get("dpi", 120)),
            )
        if want_sim:
            files["similarity"], r = plots.similarity_vs_blosum(
                sim.matrix(),
                out_dir / "aa_similarity.png",
                title=f"{name} ({len(layers)} layers x {len(heads)} heads)",
                dpi=int(cfg.get("dpi", 120)),
            )
            log.info(
                "amino-acid similarity from attention vs BLOSUM62: Pearson r = %.3f over the 210 "
                "amino-acid pairs (1: attention scores substitutions as BLOSUM62 does, 0: "
                "unrelated)",
                r,
            )

    if target is not None:
        from protein_performer.inference.contacts import model_maps

        regression = _regression(cfg, loaded)
        if regression is not None:
            regression.check_model(loaded)
            pred = regression.predict_maps(
                model_maps(loaded, target.sequence, regression.layers, regression.heads)
            )
            how, quantity = "logistic regression", "predicted contact probability"
        else:
            pred = unsupervised_contacts(model_maps(loaded, target.sequence))
            how, quantity = "unsupervised (mean APC, no regression)", "mean APC attention score"
        files["contacts"] = plots.contact_comparison(
            pred,
            target.contacts(),
            target.valid(),
            out_dir / "contacts.png",
            title=f"{target.id} ({target.length} aa): {how}",
            quantity=quantity,
            dpi=int(cfg.get("dpi", 120)),
        )
    return files


def compose(overrides: Sequence[str] = ()) -> Any:
    """``conf/visualize.yaml`` with overrides (paths and the sequence taken verbatim)."""
    from protein_performer.hydra_compose import compose_entry

    return compose_entry(
        CONFIG_NAME,
        overrides,
        direct_keys=("ckpt", "sequence", "fasta", "record", "structure", "regression", "chain"),
        required=("ckpt",),
        example="protein-performer visualize ckpt=last.ckpt sequence=MKTAYIAKQR",
    )


def run(overrides: Sequence[str]) -> dict[str, Path]:
    """Compose and visualize (the CLI prints the paths)."""
    return visualize(compose(overrides))
