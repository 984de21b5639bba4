"""``protein-performer eval ckpt=PATH data=FASTA_OR_STORE [key=value ...]``."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import add_command

HELP = "perplexity/accuracy per length bin (Hydra overrides: ckpt=... data=...)"
DESCRIPTION = """\
Perplexity and accuracy of a checkpoint on a FASTA file or a preprocessed store split, overall
and per length bin (<=256, 257-512, 513-1024, >1024 residues by default). Configured by Hydra
(conf/eval.yaml) with key=value overrides:

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
  protein-performer eval ckpt=outputs/demo/<run>/checkpoints/last.ckpt data=data/demo/train.fasta
  protein-performer eval ckpt=model_dir data=stores/uniref50 split=test max_len=2048
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "eval",
        HELP,
        DESCRIPTION,
        EPILOG,
        usage="%(prog)s [-h] ckpt=PATH data=PATH [OVERRIDE ...]",
    )
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from protein_performer.inference.evaluate import format_table
    from protein_performer.inference.evaluate import run as run_eval

    result = run_eval(args.overrides)
    print(format_table(result))
    print(f"metrics: {result['files']['metrics']}")
    print(f"bins: {result['files']['bins']}")
    return 0
