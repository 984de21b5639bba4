"""``protein-performer eval CKPT FASTA|STORE``: perplexity and accuracy per length bin."""

from __future__ import annotations

import argparse
import time

from protein_performer.cli._args import (
    FASTA_OR_STORE_HELP,
    add_ckpt,
    add_command,
    add_model_options,
    add_no_progress,
    add_on_invalid,
    add_seed,
    add_toks_per_batch,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._model import load_lm
from protein_performer.cli._wrote import say_wrote

HELP = "perplexity/accuracy per length bin on a FASTA file or a store split"
DESCRIPTION = """\
Perplexity and accuracy of a checkpoint on a FASTA file (all records) or on a split of a store
from `preprocess`, overall and per length bin (<=256, 257-512, 513-1024, >1024 residues by
default).

MLM checkpoints are measured on masked positions drawn with a fixed seed (the same positions
for every checkpoint: --seed, --mlm-prob; 80% <mask>, 10% random, 10% kept), or with --pll on
exact pseudo-perplexity (every residue masked once; L passes per record, slow). CLM
checkpoints on every next-token prediction, <eos> included.

Writes metrics.json and bins.csv to --out-dir (default outputs/eval/<time>/) and prints the
table.
"""

EPILOG = """\
examples:
  protein-performer eval outputs/demo/<run>/checkpoints/last.ckpt \
      protein_performer/data/demo/train.fasta
  protein-performer eval model_dir stores/uniref50 --split test --max-len 2048 --threads 2
  protein-performer eval model_dir proteins.fasta --pll --out-dir runs/eval_pll
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out_dir",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "eval", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument("data", metavar="FASTA|STORE", help=FASTA_OR_STORE_HELP)
    p.add_argument(
        "--split",
        default="valid",
        help="store split: train, valid, test, ood or all (default: valid; ignored for FASTA)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        metavar="N",
        help="longest model input incl. <cls>/<eos>: longer records keep their first N-2 "
        "residues (default: no cropping; FAVOR+ is linear in length)",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N records")
    p.add_argument(
        "--pll",
        action="store_true",
        help="masked LMs: exact pseudo-perplexity instead of seeded masking (slow)",
    )
    add_seed(p, "seed of the fixed MLM masks (default: 0)")
    p.add_argument(
        "--mlm-prob",
        type=float,
        default=0.15,
        metavar="P",
        help="fraction of residues masked (MLM; default: 0.15)",
    )
    p.add_argument(
        "--bins",
        type=int,
        nargs="+",
        default=[256, 512, 1024],
        metavar="EDGE",
        help="upper edges of the length bins in residues (default: 256 512 1024)",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        metavar="DIR",
        help="where metrics.json and bins.csv go (default: outputs/eval/<time>)",
    )
    add_toks_per_batch(p, help="token budget per forward pass (default: 8192)")
    p.set_defaults(toks_per_batch=8192)
    add_on_invalid(p)
    add_no_progress(p)
    add_model_options(p, "metrics.json and bins.csv in --out-dir")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from protein_performer.jobs.evaluate import evaluate, format_table

    out_dir = Path(args.out_dir or f"outputs/eval/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    for name in ("metrics.json", "bins.csv"):
        check_output(out_dir / name, [args.ckpt, args.data], args.overwrite)
    result = evaluate(
        load_lm(args),
        args.data,
        out_dir,
        split=args.split,
        max_len=args.max_len,
        limit=args.limit,
        toks_per_batch=args.toks_per_batch,
        seed=args.seed,
        mlm_prob=args.mlm_prob,
        pll=args.pll,
        bins=args.bins,
        on_invalid=args.on_invalid,
        progress=not args.no_progress,
    )
    print(format_table(result))
    say_wrote([result["files"]["metrics"], result["files"]["bins"]],
              f"{result['overall']['records']} record(s) in {len(result['bins'])} length bin(s)")
    return 0
