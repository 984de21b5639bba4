"""``protein-performer eval CKPT FASTA_OR_STORE [key=value ...]``."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import (
    add_command,
    add_threads,
    apply_threads,
    positional_overrides,
)

HELP = "perplexity/accuracy per length bin (CKPT FASTA, plus Hydra key=value overrides)"
DESCRIPTION = """\
Perplexity and accuracy of a checkpoint on a FASTA file or a preprocessed store split, overall
and per length bin (<=256, 257-512, 513-1024, >1024 residues by default). Configured by Hydra
(conf/eval.yaml) with key=value overrides; CKPT and FASTA may come first without a key, like
the other inference commands (`eval CKPT FASTA` = `eval ckpt=CKPT data=FASTA`):

  ckpt=PATH        a .ckpt file or an exported model directory (required)
  data=PATH        a FASTA(.gz) file (all records) or a store directory (required)
  split=valid      store split: train, valid, test or all
  max_len=N        crop longer records to their first N-2 residues (default: no cropping)
  limit=N          only the first N records
  pll=true         masked LM: exact pseudo-perplexity instead of seeded 15% masking (slow)
  seed=0 mlm_prob=0.15 bins=[256,512,1024] toks_per_batch=8192 device=auto out_dir=DIR

MLM checkpoints are measured on masked positions drawn with a fixed seed (the same positions
for every checkpoint); CLM checkpoints on every next-token prediction, <eos> included.
Writes metrics.json and bins.csv to out_dir (default outputs/eval/<timestamp>/).
"""

EPILOG = """\
examples:
  protein-performer eval outputs/demo/<run>/checkpoints/last.ckpt data/demo/train.fasta
  protein-performer eval model_dir stores/uniref50 split=test max_len=2048 --threads 2
  protein-performer eval ckpt=model_dir data=stores/uniref50 split=test
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "eval",
        HELP,
        DESCRIPTION,
        EPILOG,
        usage="%(prog)s [-h] [--threads N] (CKPT FASTA | ckpt=PATH data=PATH) [OVERRIDE ...]",
    )
    add_threads(p)
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from protein_performer.inference.evaluate import format_table
    from protein_performer.inference.evaluate import run as run_eval

    apply_threads(args)
    result = run_eval(positional_overrides(args, ("ckpt", "data"), "eval"))
    print(format_table(result))
    print(f"metrics: {result['files']['metrics']}")
    print(f"bins: {result['files']['bins']}")
    return 0
