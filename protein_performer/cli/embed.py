"""``protein-performer embed CKPT FASTA OUT``: embeddings of every record into one HDF5 file."""

from __future__ import annotations

import argparse
import sys

from protein_performer.cli._args import (
    add_ckpt_fasta_out,
    add_command,
    add_fasta_run_options,
    add_model_options,
    fasta_run_kwargs,
)
from protein_performer.cli._lifetime import check_output, join_ranks, rank_line, resume_hint
from protein_performer.cli._model import load_lm
from protein_performer.cli._wrote import say_wrote

HELP = "embed a FASTA file or store into one columnar HDF5 file (any length, resumable)"
DESCRIPTION = """\
Embed every record of a FASTA file (or of a store from `preprocess`) with a trained model, like
ESM's esm-extract but with sequences of any length in one pass (no truncation, no windows:
FAVOR+ attention is linear in length) and ONE HDF5 output file per run, one array per field.

CKPT is a Lightning .ckpt from `protein-performer train` or a directory from
`protein-performer export`/`convert-esm`. OUT is the .h5 file to write. Records are embedded
window by window into parts (OUT.parts/), merged into OUT at the end: OUT appears only when
complete, and a killed run continues with --resume, losing at most the window in flight.

--resume skips ids already in OUT or in its parts and adds the rest (the input may have grown);
it refuses when the model (its weights hash) or --repr-layers/--include/--precision differ. A
part is reused only when its every record is in the input with the same sequence (parts record
their sequences' digests); the others are set aside (NAME.dropped, NAME.damaged) and redone.

Several processes wait for each other at most PROTEIN_PERFORMER_INIT_TIMEOUT seconds to start
(default 300) and PROTEIN_PERFORMER_WAIT_TIMEOUT at the end (default 48 h); a rank that fails
stops the others.

Several processes: launch the same command under torchrun or srun; records are split across
ranks by token budget, each rank writes its own parts, rank 0 merges them into one OUT with the
records in input order (as one process would write them).
"""

EPILOG = """\
output layout (h5py; or ids, emb = protein_performer.read_embeddings(OUT, kind="mean")):
  f["ids"]                    (N,)         record ids, input order
  f["lengths"]                (N,)         residues per record
  f["mean/6"], f["bos/6"]     (N, D)       mean over residues / the <cls> position, layer 6
  f["per_tok/6"]              (sum L, D)   residues of all records; record n is
                                           f["per_tok/6"][o[n]:o[n+1]], o = f["per_tok_offsets"]
  f["header_bytes"], f["header_offsets"]   the FASTA header lines, UTF-8, back to back
  f["dense_values"], f["dense_offsets"]     --include contacts: contact probabilities, as
                                           contacts predict writes them (read_embeddings(OUT,
                                           kind="contacts") -> (ids, maps))
  f.attrs                     checkpoint, model_sha256, precision, repr_layers, include, ...
  Layers use ESM numbering (0 = embeddings, depth = final); stored under the resolved number.

examples:
  protein-performer embed last.ckpt proteins.fasta emb.h5
  protein-performer embed model_dir/ titin.fasta emb.h5 --repr-layers 0 -1 --include mean per_tok
  protein-performer embed last.ckpt uniref50_store/ emb.h5 --resume     # after a kill
  torchrun --nproc-per-node 4 -m protein_performer.cli.main embed last.ckpt big.fasta emb.h5
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "embed", HELP, DESCRIPTION, EPILOG)
    add_ckpt_fasta_out(p, "output HDF5 file, e.g. embeddings.h5")
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
        choices=("mean", "per_tok", "bos", "contacts"),
        default=["mean"],
        help="what to save per layer (default: mean); contacts: the (L, L) contact map from the "
        "model's contact regression, as `contacts predict` writes it",
    )
    add_fasta_run_options(
        p, toks_help="token budget per forward pass; longer sequences run alone (default: 4096)"
    )
    add_model_options(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run or add new records to OUT (same model and options)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.jobs.embed import embed_fasta

    join_ranks(args)
    check_output(args.out, [args.ckpt, args.fasta], args.overwrite or args.resume)
    lm = load_lm(args)
    with resume_hint(args.out):
        summary = embed_fasta(
            lm,
            args.fasta,
            args.out,
            repr_layers=args.repr_layers,
            include=args.include,
            resume=args.resume,
            overwrite=args.overwrite,
            **fasta_run_kwargs(args),
        )
    if summary.parts is not None:
        c = summary.parts
        print(
            f"resume: reused {len(c.kept)} part(s) ({c.reused} records), redoing {c.redone} "
            f"record(s) of {c.dropped} part(s) dropped (another run or input, or written before "
            f"0.3), {c.damaged} damaged part(s) set aside",
            file=sys.stderr,
        )
    if rank_line(summary.new_records, "embedded"):
        return 0
    skipped = f", {summary.skipped} already there" if summary.skipped else ""
    say_wrote(
        summary.path,
        f"{summary.num_records} records; embedded {summary.new_records} record(s) "
        f"({summary.residues} residues{skipped}), layers {summary.repr_layers} "
        f"({', '.join(summary.include)})",
    )
    return 0
