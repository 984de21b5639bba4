"""``protein-performer score CKPT FASTA OUT``: per-sequence (pseudo-)log-likelihood table."""

from __future__ import annotations

import argparse

from protein_performer.cli._args import (
    TABLE_OUT_HELP,
    add_ckpt_fasta_out,
    add_command,
    add_context,
    add_context_ensemble,
    add_fasta_run_options,
    add_model_options,
    fasta_run_kwargs,
)
from protein_performer.cli._lifetime import check_output, join_ranks, rank_line
from protein_performer.cli._model import load_context, load_lm, pick_strategy
from protein_performer.cli._wrote import say_wrote

HELP = "per-sequence log-likelihood / perplexity (pseudo-ppl or causal)"
DESCRIPTION = """\
Score every record of a FASTA file with a trained model and write one row per record:
id, length, n_scored, log_likelihood, mean_log_likelihood, perplexity
(CSV, or TSV when OUT ends in .tsv; OUT = - writes CSV to standard output).

strategies (must match how the checkpoint was trained):
  pseudo-ppl  masked-LM checkpoints: exact pseudo-log-likelihood, every residue masked once
              (L forward passes per sequence, batched under --toks-per-batch); n_scored = L.
              --pll-rate R: an estimate in about 1/R passes per sequence instead of L (every
              round(1/R)-th residue masked together; R = 0.1: 10 passes)
  causal      causal-LM checkpoints: exact log-likelihood of the residues and the final <eos>
              (one linear-time pass); n_scored = L + 1
perplexity = exp(-mean_log_likelihood), mean over the n_scored tokens.
"""

EPILOG = """\
examples:
  protein-performer score mlm.ckpt proteins.fasta scores.csv
  protein-performer score clm.ckpt proteins.fasta scores.tsv --strategy causal --device cuda
  protein-performer score clm.ckpt candidates.fasta scores.csv --context homologs.fasta
  protein-performer score mlm.ckpt proteins.fasta scores.csv --pll-rate 0.1
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "score", HELP, DESCRIPTION, EPILOG)
    add_ckpt_fasta_out(p, TABLE_OUT_HELP)
    p.add_argument(
        "--strategy",
        choices=("pseudo-ppl", "causal"),
        default=None,
        help="default: pseudo-ppl for masked-LM, causal for causal-LM checkpoints",
    )
    p.add_argument(
        "--pll-rate",
        type=float,
        default=None,
        metavar="R",
        help="pseudo-ppl estimate: mask every round(1/R)-th residue together, about 1/R passes "
        "per sequence instead of L (0 < R <= 0.5; default: exact, one residue per pass)",
    )
    add_context(p)
    add_context_ensemble(p, identity=False)
    add_fasta_run_options(p)
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.jobs.score import score_fasta

    join_ranks(args)
    check_output(args.out, [args.ckpt, args.fasta, args.context], args.overwrite)
    lm = load_lm(args)
    context = load_context(lm, args)
    strategy = pick_strategy(lm, args.strategy, "pseudo-ppl")
    summary = score_fasta(
        lm,
        args.fasta,
        args.out,
        strategy=strategy,
        context=context,
        pll_rate=args.pll_rate,
        **fasta_run_kwargs(args),
    )
    if rank_line(summary.num_records, "scored"):
        return 0
    say_wrote(
        args.out,
        f"scored {summary.num_records} record(s) with {strategy}"
        + (f" (--pll-rate {args.pll_rate} estimate)" if args.pll_rate else "")
        + ", mean log-likelihood per "
        f"token {summary.mean_log_likelihood:.4f}",
    )
    return 0
