"""``protein-performer score-variants CKPT WT.fasta MUTATIONS.csv OUT.csv``: DMS tables."""

from __future__ import annotations

import argparse
import sys

from protein_performer.cli._args import (
    add_ckpt,
    add_command,
    add_context,
    add_context_ensemble,
    add_model_options,
    add_no_progress,
    add_toks_per_batch,
    add_variant_strategy,
    positive_int,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._model import context_options, load_context, load_lm, pick_strategy
from protein_performer.cli._wrote import say_wrote

HELP = "variant-effect scores for a mutation table (DMS), with Spearman vs labels"
DESCRIPTION = """\
Score mutations (e.g. a deep mutational scan) against a wild-type sequence. Every input column
is kept and a score column is added (log-ratio mutant vs wild type; higher = fitter).

strategies:
  masked-marginals  (masked LM) mask the mutated positions together, sum log p(mt) - log p(wt)
  wt-marginals      (masked LM) the same sum from one unmasked pass over the wild type
  pseudo-ppl        (masked LM) PLL(mutant) - PLL(wt); exact but L passes per mutant: slow
  causal            (causal LM) LL(mutant) - LL(wt), one pass per mutant

Mutations look like A42G; multi-mutants join them with ':' (A42G:K45R); 'WT' scores 0.
A ProteinGym DMS file (columns mutant, DMS_score, DMS_score_bin) is read as it is: without
--label-col, Spearman is computed against DMS_score, and one line says so.
Positions are numbered so the first residue of the WT sequence is --offset. A row whose
wild-type letter or position does not match gets an empty score and is listed in a warning by
its CSV line number (the header is line 1); nothing is skipped silently.
"""

EPILOG = """\
examples:
  protein-performer score-variants mlm.ckpt BLAT_ECOLX_wt_offset24.fasta \\
      BLAT_ECOLX_Ranganathan2015.csv scored.csv --offset 24 --label-col 2500
  protein-performer score-variants clm.ckpt wt.fasta dms.tsv out.tsv --strategy causal
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "score-variants", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument(
        "wt", metavar="WT", help="wild type: a FASTA file with one record; - reads standard input"
    )
    p.add_argument("mutations", metavar="MUTATIONS", help="table of mutations (.csv or .tsv)")
    p.add_argument("out", metavar="OUT", help="output table (.csv or .tsv; - for stdout)")
    add_variant_strategy(p)
    p.add_argument(
        "--offset",
        type=int,
        default=1,
        help="number of the first wild-type residue in the mutation names (default: 1)",
    )
    p.add_argument(
        "--mutation-col", default="mutant", help="column with the mutations (default: mutant)"
    )
    p.add_argument(
        "--label-col", default=None, help="column of measured fitness: print Spearman rho"
    )
    p.add_argument(
        "--score-col", default=None, help="name of the added column (default: strategy)"
    )
    add_toks_per_batch(p)
    p.add_argument(
        "--limit-rows", type=positive_int, default=None, help="score only the first N rows"
    )
    add_context(p)
    add_context_ensemble(p)
    p.add_argument(
        "--per-prompt",
        action="store_true",
        help="with a context ensemble, also one column per prompt (SCORE:LABEL) beside the mean",
    )
    add_no_progress(p)
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.errors import UserError
    from protein_performer.io.outputs import sidecar
    from protein_performer.jobs.score_variants import (
        CONTEXT_SIDECAR,
        score_variants_file,
        wild_type,
    )

    inputs = [args.ckpt, args.wt, args.mutations, args.context]
    check_output(args.out, inputs, args.overwrite)
    if args.out != "-":  # the context record beside OUT: an output too (removed without one)
        record = sidecar(args.out, CONTEXT_SIDECAR)
        check_output(record, inputs, args.overwrite, "the context record of OUT")
    if args.per_prompt and args.context is None:
        raise UserError("--per-prompt needs --context HOMOLOGS.fasta and --context-* lists")
    lm = load_lm(args)
    query = wild_type(args.wt)[1] if context_options(args) else None  # for the identity filter
    context = load_context(lm, args, query=query)
    strategy = pick_strategy(lm, args.strategy, "masked-marginals")
    summary = score_variants_file(
        lm,
        args.wt,
        args.mutations,
        args.out,
        strategy=strategy,
        offset=args.offset,
        mutation_col=args.mutation_col,
        label_col=args.label_col,
        score_col=args.score_col,
        toks_per_batch=args.toks_per_batch,
        limit_rows=args.limit_rows,
        progress=not args.no_progress,
        context=context,
        per_prompt=args.per_prompt,
    )
    say = sys.stderr if args.out == "-" else sys.stdout  # stdout may be the table itself
    if summary.detected:
        print(summary.detected, file=say)
    label = summary.label_col
    say_wrote(
        "-" if args.out == "-" else summary.out,
        f"scored {summary.scored} of {summary.rows} row(s) with {strategy}"
        + (f" ({len(summary.skipped)} not scored, see the warning)" if summary.skipped else ""),
    )
    if label is not None:
        if summary.spearman is None:
            print(
                f"Spearman rho vs {label!r}: not defined "
                f"({summary.spearman_n} scored row(s) with a numeric label)",
                file=say,
            )
        else:
            print(
                f"Spearman rho vs {label!r}: {summary.spearman:.4f} "
                f"(n = {summary.spearman_n})",
                file=say,
            )
    return 0
