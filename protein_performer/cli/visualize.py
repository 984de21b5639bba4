"""``protein-performer visualize CKPT [FASTA] [--record ID] [--window START END] ...``: PNGs.

The arrays come from ``inference.attention_views`` (attention streamed in O(window x L)
memory, contact maps), the pictures from ``viz`` (arrays in, PNGs out); this module only picks
the sequence, and says which files it wrote.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from protein_performer.cli._args import (
    FASTA_HELP,
    add_ckpt,
    add_command,
    add_model_options,
    add_no_progress,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._model import load_lm
from protein_performer.cli._wrote import say_wrote
from protein_performer.errors import UserError

log = logging.getLogger(__name__)

HELP = "PNGs of attention maps, aa similarity vs BLOSUM62, contacts"
DESCRIPTION = """\
PNG pictures of a model's attention for one sequence: a FASTA record (--record: its id,
UniProt accession or entry name; the first record without it), --sequence, or the sequence of
--structure.

  --structure PATH    a PDB/mmCIF file: adds predicted vs true contacts (and supplies the
                      sequence when none is given); --chain picks the chain (_ = blank id)
  --layers N...       layers (1..depth, negative from the end; default: all)
  --heads N...        heads (0-based; default: all)
  --window START END  residue window [START, END), 0-based (default: the first --max-window)
  --regression PATH   contact regression JSON (default: the model's own or the one beside the
                      checkpoint, else an unsupervised mean-APC score)

  --html PATH         write ONE self-contained interactive HTML report instead of the PNGs:
                      every layer x head (selectors), their mean, the APC map, an entropy
                      track, similarity vs BLOSUM62 and, with --structure, predicted vs true
                      contacts (without one, a regression's predicted contacts alone); opens
                      from disk with no internet. Map data stays under
                      --html-budget-mb (default 20 MB; views are block-averaged above it, plus
                      full-resolution windows), whatever the length

Writes to --out-dir (default outputs/visualize/<time>/) attention_grid.png (layers x heads, the
window's rows and columns), aa_similarity.png (20 x 20 attention log-odds between amino-acid
types beside BLOSUM62, Pearson r in the title) and, with a structure, contacts.png (upper
triangle predicted, lower triangle true C-beta < 8 A); --no-grid, --no-similarity and
--no-contacts leave one out. FAVOR+ maps are the implied attention rows (what the model
computes without forming them).
"""

EPILOG = """\
examples:
  protein-performer visualize last.ckpt --sequence MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ
  protein-performer visualize model_dir long.fasta --record Q8WZ42 --window 1000 1256
  protein-performer visualize last.ckpt --structure 1GBT_A.pdb --layers -1 --out-dir pics
  protein-performer visualize last.ckpt proteins.fasta --record P69905 --html report.html
"""

FILES = {
    "grid": "attention_grid.png",
    "similarity": "aa_similarity.png",
    "contacts": "contacts.png",
}


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out_dir", "html")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "visualize", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument("fasta", metavar="FASTA", nargs="?", default=None, help=FASTA_HELP)
    p.add_argument("--record", metavar="ID", help="the FASTA record: id, accession or entry name")
    p.add_argument("--sequence", metavar="SEQ", help="the sequence itself, instead of FASTA")
    p.add_argument("--structure", metavar="PATH", help="a PDB/mmCIF file: adds contacts.png")
    p.add_argument("--chain", default=None, help="the structure's chain (default: the first)")
    p.add_argument("--layers", type=int, nargs="+", metavar="N", help="layers (default: all)")
    p.add_argument("--heads", type=int, nargs="+", metavar="N", help="heads (default: all)")
    p.add_argument(
        "--window",
        type=int,
        nargs=2,
        metavar=("START", "END"),
        help="residues [START, END), 0-based (default: from 0, at most --max-window)",
    )
    p.add_argument(
        "--max-window",
        type=int,
        default=512,
        metavar="N",
        help="residues shown without --window (default: 512)",
    )
    p.add_argument("--regression", metavar="PATH", help="a contact_regression.json")
    p.add_argument("--no-grid", action="store_true", help="no attention_grid.png")
    p.add_argument("--no-similarity", action="store_true", help="no aa_similarity.png")
    p.add_argument("--no-contacts", action="store_true", help="no contacts.png")
    p.add_argument("--dpi", type=int, default=120, help="resolution (default: 120)")
    p.add_argument("--html", metavar="PATH", help="write one interactive HTML report here")
    p.add_argument(
        "--html-budget-mb",
        type=float,
        default=20.0,
        metavar="MB",
        help="map data in the HTML report (default: 20; the file adds ~4.7 MB of Plotly)",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        metavar="DIR",
        help="where the PNGs go (default: outputs/visualize/<time>)",
    )
    add_no_progress(p)
    add_model_options(p, "the PNGs in --out-dir")
    p.set_defaults(func=run)


def pick_sequence(args: argparse.Namespace) -> tuple[str, str]:
    """(record id, sequence) from FASTA/--record or --sequence; ("", "") leaves it to the
    structure."""
    if args.sequence:
        if args.fasta:
            raise UserError("give FASTA or --sequence, not both")
        return "sequence", args.sequence.strip().upper()
    if args.fasta:
        from protein_performer.data.inputs import find_record, read_records

        record = find_record(read_records(args.fasta, "error"), args.record, args.fasta)
        return record.id, record.sequence
    if args.record:
        raise UserError("--record picks a record of FASTA: give the FASTA file too")
    if args.structure:
        return "", ""
    raise UserError("visualize needs FASTA (with --record ID), --sequence SEQ or --structure")


def sequence_and_target(args: argparse.Namespace, with_structure: bool) -> tuple[str, str, Any]:
    """(record id, sequence, contact target or None): the FASTA record asked for, or, with a
    structure and no FASTA record, the structure chain's own sequence."""
    record_id, sequence = pick_sequence(args)
    target = None
    if with_structure:
        from protein_performer.contacts.structures import contact_target

        target = contact_target(args.structure, chain=args.chain, sequence=sequence or None)
        if not sequence:
            record_id, sequence = target.id, target.sequence
    if not sequence:
        raise UserError("no sequence to visualize")
    return record_id, sequence, target


def run_html(args: argparse.Namespace) -> int:
    """The interactive report: arrays from ``inference.report_data``, HTML from ``viz.report``."""
    from protein_performer.viz.report import write_report

    out = Path(args.html)
    check_output(out, [args.ckpt, args.fasta, args.structure, args.regression], args.overwrite)
    record_id, sequence, target = sequence_and_target(args, bool(args.structure))
    lm = load_lm(args)
    start = time.perf_counter()
    spec = lm.report_spec(
        sequence, name=record_id or "sequence", target=target,
        regression=args.regression, layers=args.layers, heads=args.heads,
        budget_mb=args.html_budget_mb, first_window=args.window,
        progress=not args.no_progress,
    )  # fmt: skip
    log.info("report: drawing the figures and writing %s", out)
    path = write_report(spec, out)
    seconds = time.perf_counter() - start
    say_wrote(path, f"the HTML report ({path.stat().st_size / 1e6:.1f} MB, built in "
              f"{seconds:.1f} s)")
    if spec.contacts is None:
        print("contacts: not in the report (no --structure given and no contact regression)")
    elif target is None:
        print("contacts: the regression's predictions only (no --structure given to compare)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.html:
        return run_html(args)
    from protein_performer.inference.attention_views import resolve_window
    from protein_performer.viz import plots
    from protein_performer.viz.similarity import SimilarityAccumulator

    out_dir = Path(args.out_dir or f"outputs/visualize/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    want = {
        "grid": not args.no_grid,
        "similarity": not args.no_similarity,
        "contacts": bool(args.structure) and not args.no_contacts,
    }
    inputs = [args.ckpt, args.fasta, args.structure, args.regression]
    for name, wanted in want.items():
        if wanted:
            check_output(out_dir / FILES[name], inputs, args.overwrite)
    record_id, sequence, target = sequence_and_target(args, want["contacts"])
    lm = load_lm(args)
    start, end = resolve_window(len(sequence), args.window, args.max_window)
    name = record_id or "sequence"
    sim = SimilarityAccumulator(sequence, start) if want["similarity"] else None
    views = lm.attention_views(
        sequence,
        layers=args.layers,
        heads=args.heads,
        window=(start, end),
        grid=want["grid"],
        row_sinks=[sim.add] if sim is not None else [],
    )
    files: dict[str, Path] = {}
    if views.grid is not None:
        files["grid"] = plots.attention_grid(
            views.grid,
            views.layers,
            views.heads,
            out_dir / FILES["grid"],
            row_start=start,
            col_start=start,
            title=f"{name}: attention, residues [{start}, {end})",
            dpi=args.dpi,
        )
    if sim is not None:
        files["similarity"], r = plots.similarity_vs_blosum(
            sim.matrix(),
            out_dir / FILES["similarity"],
            title=f"{name} ({len(views.layers)} layers x {len(views.heads)} heads)",
            dpi=args.dpi,
        )
        log.info(
            "amino-acid similarity from attention vs BLOSUM62: Pearson r = %.3f over the 210 "
            "amino-acid pairs (1: attention scores substitutions as BLOSUM62 does, 0: unrelated)",
            r,
        )
    if target is not None:
        view = lm.contact_view(target, args.regression)
        files["contacts"] = plots.contact_comparison(
            view.predicted,
            view.true,
            view.valid,
            out_dir / FILES["contacts"],
            title=f"{target.id} ({target.length} aa): {view.how}",
            quantity=view.quantity,
            dpi=args.dpi,
        )
    if not want["contacts"]:
        why = "--no-contacts" if args.structure else "no --structure given (a PDB/mmCIF file)"
        print(f"contacts: {FILES['contacts']} not drawn: {why}")
    say_wrote(out_dir, f"{len(files)} figure(s): {', '.join(p.name for p in files.values())}")
    return 0
