"""``protein-performer visualize CKPT [FASTA record=ID | sequence=... | structure=...]``.

``visualize(cfg) -> {name: png path}`` is a pure function of a composed config
(``conf/visualize.yaml``), so tests and notebooks call it directly; ``compose(overrides)`` composes
with Hydra's compose API (``protein_performer.training.compose``). It lives here, on the floor that
may use both: inference loads the model and streams attention, viz/ draws the arrays.

Memory stays O(window x L): attention rows are streamed layer by layer (``attention_maps``'s
``sink``) into the two reductions the pictures need, the window x window panels and the 20 x 20
amino-acid sums (``viz.similarity``), and never kept for all layers at once.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protein_performer.cli._common import (
    add_command,
    add_threads,
    apply_threads,
    positional_overrides,
)
from protein_performer.errors import UserError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

CONFIG_NAME = "visualize"

HELP = "PNGs of attention maps, aa similarity vs BLOSUM62, contacts (Hydra overrides)"
DESCRIPTION = """\
PNG pictures of a model's attention for one sequence, configured by Hydra (conf/visualize.yaml)
with key=value overrides; CKPT and FASTA may come first without a key, like the other inference
commands (`visualize CKPT FASTA record=ID` = `visualize ckpt=CKPT fasta=FASTA record=ID`):

  ckpt=PATH            a .ckpt file or an exported model directory (required)
  sequence=MKT...      the sequence, or
  fasta=PATH record=ID a FASTA record by id, UniProt accession or entry name (record omitted:
                       the first one)
  structure=PATH       a PDB/mmCIF file: adds predicted vs true contacts (and supplies the
                       sequence when none is given); chain=A picks the chain (_ = blank id)
  layers=[1,-1]        layers (1..depth, negative from the end; default: all)
  heads=[0,3]          heads (0-based; default: all)
  window=[0,128]       residue window [start, end), 0-based (default: the first max_window=512)
  regression=PATH     contact regression JSON (default: the one beside the checkpoint, else an
                       unsupervised mean-APC score)
  grid=true similarity=true contacts=true device=auto dpi=120 out_dir=DIR

Writes attention_grid.png (layers x heads, the window's rows and columns), aa_similarity.png
(20 x 20 attention log-odds between amino-acid types beside BLOSUM62, Pearson r in the title)
and, with a structure, contacts.png (upper triangle predicted, lower triangle true C-beta < 8 A).
FAVOR+ maps are the implied attention rows (what the model computes without forming them).
"""

EPILOG = """\
examples:
  protein-performer visualize last.ckpt sequence=MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ
  protein-performer visualize model_dir long.fasta record=Q8WZ42 window=[1000,1256]
  protein-performer visualize ckpt=last.ckpt structure=1GBT_A.pdb layers=[-1] out_dir=pics
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "visualize",
        HELP,
        DESCRIPTION,
        EPILOG,
        usage="%(prog)s [-h] [--threads N] (CKPT | ckpt=PATH) (FASTA [record=ID] | sequence=SEQ | "
        "structure=PATH) [OVERRIDE ...]",
    )
    add_threads(p)
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    files = visualize(compose(positional_overrides(args, ("ckpt", "fasta"), "visualize")))
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0


# --------------------------------------------------------------------------------------------
# visualize(cfg): load the model, stream its attention, hand the arrays to viz/ to draw
# --------------------------------------------------------------------------------------------
def _sequence(cfg: Any) -> tuple[str, str]:
    """(record id, sequence) from ``sequence=``, ``fasta=``/``record=`` or the structure."""
    if cfg.get("sequence"):
        if cfg.get("fasta"):
            raise UserError("give sequence=... or fasta=..., not both")
        return "sequence", str(cfg.sequence).strip().upper()
    if cfg.get("fasta"):
        from protein_performer.data.inputs import read_records

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
    from protein_performer.contacts.predict import find_regression

    return find_regression(loaded, cfg.get("regression") or None, required=False)


def unsupervised_contacts(maps: np.ndarray) -> np.ndarray:
    """Mean over layers and heads of APC(symmetrized maps): a fit-free contact score."""
    from protein_performer.model.contact_head import contact_features

    return contact_features(maps).mean(-1)


def visualize(cfg: Any) -> dict[str, Path]:
    """Write the requested PNGs to ``cfg.out_dir``; returns {name: path} for the names
    ``grid``, ``similarity`` and ``contacts`` that were drawn."""
    import numpy as np

    from protein_performer.contacts.attention import (
        attention_maps,
        resolve_heads,
        resolve_layers,
    )
    from protein_performer.interop.loading import load_model
    from protein_performer.viz import plots
    from protein_performer.viz.similarity import SimilarityAccumulator

    out_dir = Path(str(cfg.out_dir)).expanduser()
    record_id, sequence = _sequence(cfg)
    target = None
    if cfg.get("structure") and bool(cfg.get("contacts", True)):
        from protein_performer.contacts.structures import contact_target

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
        from protein_performer.contacts.fit import model_maps

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
    from protein_performer.training.compose import compose_config

    return compose_config(
        overrides,
        name=CONFIG_NAME,
        direct_keys=("ckpt", "sequence", "fasta", "record", "structure", "regression", "chain"),
        required=("ckpt",),
        example="protein-performer visualize ckpt=last.ckpt sequence=MKTAYIAKQR",
    )
