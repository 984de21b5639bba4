"""``protein-performer embed CKPT FASTA OUT``: embeddings of every record into one HDF5 file."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import (
    add_ckpt,
    add_command,
    add_fasta_run_options,
    add_overwrite,
    check_output,
    load_lm,
)

HELP = "embed a FASTA file into one HDF5 file (any length, one pass)"
DESCRIPTION = """\
Embed every record of a FASTA file with a trained model, like ESM's esm-extract but with
sequences of any length in one pass (no truncation, no windows: FAVOR+ attention is linear in
length) and ONE HDF5 output file per run, keyed by record id.

CKPT is a Lightning .ckpt from `protein-performer train` or a directory from
`protein-performer export`. OUT is the .h5 file to write (replaced atomically: the file appears
only when complete).
"""

EPILOG = """\
output layout (h5py):
  f["records"][KEY]["mean"]["6"]      (D,)   mean over residues (no <cls>/<eos>) of layer 6
  f["records"][KEY]["per_tok"]["6"]   (L, D) one row per residue
  f["records"][KEY]["bos"]["6"]       (D,)   the <cls> position
  f["records"][KEY].attrs             id, header (the original FASTA header), length
  f["index"]                          table KEY, id, header, length in FASTA order
  KEY is the record id with characters outside [A-Za-z0-9._-] replaced by '_'.
  Layers use ESM numbering (0 = embeddings, depth = final); stored under the resolved number.

examples:
  protein-performer embed last.ckpt proteins.fasta emb.h5
  protein-performer embed model_dir/ titin.fasta emb.h5 --repr-layers 0 -1 --include mean per_tok
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "embed", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument(
        "fasta", metavar="FASTA", help="input FASTA(.gz), or a store directory from `preprocess`"
    )
    p.add_argument("out", metavar="OUT", help="output HDF5 file, e.g. embeddings.h5")
    p.add_argument(
        "--repr-layers",
        type=int,
        nargs="+",
        default=[-1],
        metavar="N",
        help="layers to save (0 = embeddings, -1 = last; default: -1)",
    )
    p.add_argument(
        "--include",
        nargs="+",
        choices=("mean", "per_tok", "bos"),
        default=["mean"],
        help="what to save per layer (default: mean)",
    )
    add_fasta_run_options(
        p, toks_help="token budget per forward pass; longer sequences run alone (default: 4096)"
    )
    add_overwrite(p, "OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.inference.embedding import embed_fasta

    check_output(args.out, [args.ckpt, args.fasta], args.overwrite)
    summary = embed_fasta(
        load_lm(args),
        args.fasta,
        args.out,
        repr_layers=args.repr_layers,
        include=args.include,
        toks_per_batch=args.toks_per_batch,
        on_invalid=args.on_invalid,
        progress=not args.no_progress,
    )
    print(
        f"embedded {summary.num_records} record(s), {summary.residues} residues, layers "
        f"{summary.repr_layers} ({', '.join(summary.include)}) -> {summary.path}"
    )
    return 0
