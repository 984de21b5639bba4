"""``protein-performer visualize CKPT [FASTA record=ID | sequence=... | structure=...]``."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import (
    add_command,
    add_threads,
    apply_threads,
    positional_overrides,
)

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
    from protein_performer.viz.visualize import run as run_visualize

    apply_threads(args)
    files = run_visualize(positional_overrides(args, ("ckpt", "fasta"), "visualize"))
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
