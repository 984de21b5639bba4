"""``protein-performer preprocess``: FASTA(.gz) files -> tokenized memory-mapped store."""

from __future__ import annotations

import argparse
import math

from protein_performer.cli._args import (
    add_no_progress,
    add_on_invalid,
    add_overwrite,
    positive_int,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._wrote import say_wrote
from protein_performer.data.split import DEFAULT_TEST_FRAC, DEFAULT_VALID_FRAC, SPLIT_MODES

#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "preprocess",
        help="tokenize FASTA(.gz) into a memory-mapped store with a train/valid/test split",
        description=(
            "Stream FASTA or FASTA.gz files into a tokenized, memory-mapped store (constant "
            "memory, O(1) random access). Each record goes to train/valid/test by hashing its "
            "UniRef cluster id (when the header has one) or its id, so re-runs give "
            "byte-identical output and a cluster never straddles splits."
        ),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="FASTA or FASTA.gz files")
    p.add_argument("--out", required=True, metavar="DIR", help="output store directory")
    add_on_invalid(
        p, help="stop at the first bad record (default) or skip bad records and count them"
    )
    p.add_argument(
        "--valid-frac",
        type=float,
        default=DEFAULT_VALID_FRAC,
        metavar="F",
        help=f"fraction of records (or clusters) for validation (default {DEFAULT_VALID_FRAC})",
    )
    p.add_argument(
        "--test-frac",
        type=float,
        default=DEFAULT_TEST_FRAC,
        metavar="F",
        help=f"fraction for test (default {DEFAULT_TEST_FRAC})",
    )
    p.add_argument(
        "--split-by",
        choices=SPLIT_MODES,
        default="auto",
        help="hash key: auto = UniRef cluster id when present, else record id (default); "
        "id = always the record id; cluster = require a cluster id",
    )
    p.add_argument(
        "--cluster-split",
        type=_identity,
        default=None,
        metavar="IDENTITY",
        help="cluster the input with MMseqs2 (`mmseqs easy-cluster --min-seq-id IDENTITY -c 0.8`; "
        "`mmseqs` must be on PATH, Debian package mmseqs2) and assign whole clusters to "
        "train/valid/test, so no held-out record has a relative at >= IDENTITY in train (e.g. "
        "0.5). With --split-by id the clusters only define the --ood-frac groups",
    )
    p.add_argument(
        "--ood-frac",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out this fraction of the clusters (of the hash keys without --cluster-split) "
        "as a fourth split, ood, that training never reads (default 0)",
    )
    p.add_argument(
        "--ood-taxa",
        type=_taxa,
        default=(),
        metavar="TAXID[,TAXID...]",
        help="also hold out every record whose header's OX= (UniProtKB) or TaxID= (UniRef) is "
        "one of these NCBI taxon ids, as ood",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="worker processes (default: usable CPUs, at most 8). Plain FASTA files are read "
        "in byte ranges in parallel; a gzip file cannot be split, so it is read by one worker "
        "(several files still run in parallel). Inputs under 128 MiB are read in this process. "
        "The output is byte-identical for every N; --workers 1 reads everything in this process",
    )
    add_overwrite(p, "an existing store at DIR")
    add_no_progress(p, help="no progress bar")
    p.set_defaults(func=run)


def _identity(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction such as 0.5, got {text!r}"
        ) from None
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"sequence identity must be in (0, 1], got {x}")
    return x


def _taxa(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated NCBI taxon ids such as 9606,10090, got {text!r}"
        ) from None


def _sig(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits and no exponent: 0.0312, 4.56, 1,234 (a small
    file clustered for seconds is 0.0312 MB/s, not 0.0)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:.1f}"
    return f"{x:,.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def run(args: argparse.Namespace) -> int:
    from protein_performer.data.preprocess import default_workers, preprocess

    check_output(args.out, args.inputs, args.overwrite)
    s = preprocess(
        args.inputs,
        args.out,
        on_invalid=args.on_invalid,
        valid_frac=args.valid_frac,
        test_frac=args.test_frac,
        split_mode=args.split_by,
        cluster_identity=args.cluster_split,
        ood_frac=args.ood_frac,
        ood_taxa=args.ood_taxa,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        workers=args.workers or default_workers(),
    )
    splits = "  ".join(f"{k} {v:,}" for k, v in s.splits.items())
    say_wrote(s.out, f"{s.records:,} records ({splits}), {s.residues:,} residues")
    if s.skipped:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(s.skipped_reasons.items()))
        print(f"skipped {s.skipped:,} invalid records" + (f" ({reasons})" if reasons else ""))
    else:
        print("skipped 0 invalid records")
    print(f"{s.seconds:.1f} s, {_sig(s.input_bytes / 1e6)} MB in, {_sig(s.mb_per_s)} MB/s")
    return 0
