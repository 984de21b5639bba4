"""``protein-performer predict CKPT FASTA OUT``: a fine-tuned model's head on every record."""

from __future__ import annotations

import argparse

from protein_performer.cli._args import (
    TABLE_OUT_HELP,
    add_ckpt_fasta_out,
    add_command,
    add_fasta_run_options,
    add_model_options,
    fasta_run_kwargs,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._model import load_lm
from protein_performer.cli._wrote import say_wrote

HELP = "predictions of a fine-tuned model's head (regression, classes, per-residue classes)"
DESCRIPTION = """\
Run a fine-tuned checkpoint (`protein-performer finetune`) on every record of a FASTA file and
write one row per record, in input order (CSV, or TSV when OUT ends in .tsv; - = standard
output):
  regression              id, length, one column per target
  classification          id, length, predicted, p_<class> for every class
  residue_classification  id, length, predicted (one label per residue), mean_confidence
Any length in one pass (no cropping). Records are written in windows of parts merged at the
end, so ranks of a torchrun/SLURM job split the records, as for `score`.
"""

EPILOG = """\
examples:
  protein-performer predict outputs/finetune/<run>/checkpoints/last.ckpt seqs.fasta out.csv
  protein-performer predict merged.ckpt long_proteins.fasta out.tsv --device cuda
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "predict", HELP, DESCRIPTION, EPILOG)
    add_ckpt_fasta_out(p, TABLE_OUT_HELP)
    add_fasta_run_options(p)
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.jobs.predict import predict_fasta

    check_output(args.out, [args.ckpt, args.fasta], args.overwrite)
    lm = load_lm(args)
    head = lm.task_head()
    summary = predict_fasta(lm, args.fasta, args.out, **fasta_run_kwargs(args))
    say_wrote(args.out, f"predicted {summary.num_records} record(s) ({head.config.task})")
    return 0
