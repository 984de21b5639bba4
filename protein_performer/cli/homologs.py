"""``protein-performer homologs QUERY.fasta DB OUT.fasta``: retrieve a family context by search.

PoET-style models read a protein's homologs as context; users without a homolog set get one
here, as PoET's users retrieve theirs from UniRef with MMseqs2. The logic is
``data.homology.find_homologs``; this module parses arguments and writes the file.
"""

from __future__ import annotations

import argparse
import os
import sys

from protein_performer.cli._args import add_command, add_on_invalid, add_overwrite
from protein_performer.cli._lifetime import check_output

DESCRIPTION = """\
Search the query sequence(s) against a database with MMseqs2 (`mmseqs easy-search`, which must
be on PATH) and write the hits as FASTA, grouped by query (in the query file's order), each
query's best first (lowest E-value). Each header is the record's own, followed by query=ID and
what MMseqs2 reports of the alignment: fident (identity), evalue, bits, qcov and tcov
(coverage), qstart qend tstart tend (the aligned ranges, 1-based), qlen tlen and cigar (the
alignment); --tsv writes the same as a table. Given back as --context, a hit's residues are
placed on its query's residues by that alignment (a position memory reads them there). A
database record identical to its query is left out unless --keep-identical. The defaults
(identity >= 0.3, coverage >= 0.8 of both sequences) are those of the training families of
data.layout=family, so the retrieved context looks like a training row.
"""
EPILOG = """\
examples:
  protein-performer homologs query.fasta uniprot_sprot.fasta hits.fasta
  protein-performer homologs query.fasta store/ --out hits.fasta --max-seqs 100 --min-seq-id 0.5
  protein-performer homologs queries.fasta uniprot_sprot.fasta hits.fasta --tsv hits.tsv
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out", "out_flag")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from protein_performer.data.homology import HOMOLOG_MAX_SEQS, HOMOLOG_MIN_SEQ_ID

    p = add_command(
        subparsers,
        "homologs",
        help="retrieve a query's homologs from a FASTA file or store with MMseqs2",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument("query", metavar="QUERY", help="query FASTA(.gz): one or more sequences")
    p.add_argument("db", metavar="DB", help="database: a FASTA(.gz) file or a store directory")
    p.add_argument("out", metavar="OUT", nargs="?", help="output FASTA; - for standard output")
    p.add_argument("--out", dest="out_flag", metavar="OUT", help="the same as the positional OUT")
    p.add_argument(
        "--max-seqs",
        type=int,
        default=HOMOLOG_MAX_SEQS,
        metavar="N",
        help=f"write at most N hits per query (default {HOMOLOG_MAX_SEQS})",
    )
    p.add_argument(
        "--min-seq-id",
        type=float,
        default=HOMOLOG_MIN_SEQ_ID,
        metavar="X",
        help=f"minimum sequence identity of a hit, in [0, 1] (default {HOMOLOG_MIN_SEQ_ID})",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="MMseqs2 threads (default: CPUs)"
    )
    p.add_argument(
        "--keep-identical",
        action="store_true",
        help="keep database records identical to their query (left out by default)",
    )
    p.add_argument(
        "--tsv",
        metavar="PATH",
        default=None,
        help="also write the hits as a tab-separated table: query, target, then the header's "
        "fields (one row per hit, in the FASTA's order)",
    )
    p.add_argument(
        "--mmseqs-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop MMseqs2 after this many seconds (default: no limit; a line after 5 s, "
        "then every 30 s, says how long it has run)",
    )
    add_on_invalid(p)
    add_overwrite(p, "OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.data.homology import COVERAGE, find_homologs, write_homologs
    from protein_performer.data.preprocess import default_workers
    from protein_performer.errors import UserError

    if args.out and args.out_flag and args.out != args.out_flag:
        raise UserError(f"two outputs given ({args.out} and --out {args.out_flag}): give one")
    out = args.out or args.out_flag
    if out is None:
        raise UserError("no output given: add OUT.fasta (or --out OUT.fasta, - for stdout)")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be a positive integer, got {args.threads}")
    if args.mmseqs_timeout is not None and not args.mmseqs_timeout > 0:
        raise UserError(f"--mmseqs-timeout must be positive, got {args.mmseqs_timeout}")
    if args.tsv is not None and os.fspath(args.tsv) in ("-", os.fspath(out)):
        raise UserError(f"--tsv {args.tsv}: give a file of its own (not - nor the FASTA)")
    check_output(out, [args.query, args.db], args.overwrite)
    check_output(args.tsv, [args.query, args.db], args.overwrite, "its table")
    hits = find_homologs(
        args.query,
        args.db,
        max_seqs=args.max_seqs,
        min_seq_id=args.min_seq_id,
        threads=args.threads or default_workers(),
        keep_identical=args.keep_identical,
        on_invalid=args.on_invalid,
        timeout=args.mmseqs_timeout,
    )
    if not hits:  # an empty FASTA would only be refused later, by --context
        raise UserError(
            f"no homolog of {args.query} found in {args.db} at --min-seq-id "
            f"{args.min_seq_id:g} (coverage {COVERAGE:g}); nothing written: lower --min-seq-id or "
            "search a larger database"
        )
    write_homologs(hits, out, args.tsv)
    where = "standard output" if out == "-" else out
    queries = len(dict.fromkeys(h.query for h in hits))
    table = f" and {args.tsv}" if args.tsv else ""
    print(f"wrote {len(hits)} homolog(s) of {queries} query(ies) -> {where}{table}",
          file=sys.stderr)  # fmt: skip
    return 0
