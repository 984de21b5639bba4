"""``protein-performer benchmark proteingym REFERENCE DMS_DIR OUT_DIR CKPT``: zero-shot
scores of every assay a ProteinGym reference file lists, in the leaderboard's CSV layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from protein_performer.cli._args import (
    add_ckpt,
    add_command,
    add_context_ensemble,
    add_model_options,
    add_no_progress,
    add_toks_per_batch,
    add_variant_strategy,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._model import context_options, load_lm, pick_strategy
from protein_performer.cli._wrote import say_wrote

HELP = "benchmarks in their field's formats (ProteinGym's zero-shot DMS substitutions)"
DESCRIPTION = """\
Benchmarks in the formats their leaderboards use.

  proteingym  score every assay of a ProteinGym reference file zero-shot and write the
              leaderboard's per-assay and summary tables (Spearman, AUC, MCC, NDCG,
              Top_recall)
"""
PG_HELP = "score every assay of a ProteinGym reference file (resumable per assay)"
PG_DESCRIPTION = """\
Score every assay listed in a ProteinGym reference file (columns DMS_id, DMS_filename,
target_seq; UniProt_ID, coarse_selection_type, MSA_Neff_L_category and taxon feed the
averages) from its DMS file in DMS_DIR (mutant numbered from 1 on target_seq, DMS_score,
DMS_score_bin), as variant log-ratios against target_seq, and write into OUT_DIR:

  scores/<DMS_id>.csv   mutant, DMS_score, DMS_score_bin, the model's score (+ .json: the
                        digests of the model, wild type, DMS file and options, and of the
                        .csv itself; an assay already scored with the same ones is read back,
                        so a killed run continues where it stopped)
  <Metric>/DMS_substitutions_<Metric>_DMS_level.csv          one row per assay ("DMS ID")
  <Metric>/Summary_performance_DMS_substitutions_<Metric>.csv   the leaderboard's row

for Spearman (vs DMS_score), AUC (vs DMS_score_bin), MCC (DMS_score_bin vs the score cut at
its median), NDCG (top 10% by score, DMS_score min-max scaled as gains) and Top_recall, as
ProteinGym computes them; Average_<Metric> averages over assays of a protein and selection
type, then proteins, then selection types, as the leaderboard. One line per assay as it ends.
OUT_DIR is never DMS_DIR, inside it or holding an input; each DMS_id must be a plain file name.

--context-dir DIR reads DIR/<DMS_id>.fasta (homologs) or DIR/<DMS_id>.a2m, .a3m, .sto (an MSA
whose first row is the assay's wild type: ProteinGym's MSA files, renamed) as each assay's
context (causal models; the --context-* options build each context as for score-variants
--context).
"""
#: The context files ``--context-dir`` looks for, ``<DMS_id>`` then one of these.
CONTEXT_SUFFIXES = (".fasta", ".a2m", ".a3m", ".sto")
PG_EPILOG = """\
examples:
  protein-performer benchmark proteingym data/proteingym/reference_two_assays.csv \\
      data/proteingym pg_out CKPT
  protein-performer benchmark proteingym DMS_substitutions.csv ProteinGym_substitutions/ \\
      pg_out clm.ckpt --context-dir homologs/ --context-max-identity 1.0,0.9 --context-orders 2
"""


#: The arguments naming what this command writes (per subcommand), each claimed under the
#: output policy (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: dict[str, tuple[str, ...]] = {"proteingym": ("out_dir",)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "benchmark", HELP, DESCRIPTION, "")
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    pg = add_command(sub, "proteingym", PG_HELP, PG_DESCRIPTION, PG_EPILOG)
    pg.add_argument("reference", metavar="REFERENCE", help="ProteinGym reference file (.csv)")
    pg.add_argument("dms_dir", metavar="DMS_DIR", help="folder of the DMS files it names")
    pg.add_argument("out_dir", metavar="OUT_DIR", help="where scores and tables are written")
    add_ckpt(pg)
    add_variant_strategy(pg)
    pg.add_argument(
        "--model-name",
        default=None,
        help="the score column and Model_name (default: protein_performer)",
    )
    pg.add_argument(
        "--context-dir",
        metavar="DIR",
        default=None,
        help="DIR/<DMS_id>.fasta (or .a2m, .a3m, .sto: an MSA, the wild type first): each "
        "assay's homologs, read as family context (causal)",
    )
    add_context_ensemble(pg)
    add_toks_per_batch(pg)
    add_no_progress(pg)
    add_model_options(pg, overwrite="scores of another model or options in OUT_DIR")
    pg.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.errors import UserError
    from protein_performer.jobs.proteingym import check_model_name, read_reference, run_proteingym

    options = context_options(args)
    if args.context_dir is None and options:
        raise UserError("--context-* options need --context-dir DIR")
    name = args.model_name or "protein_performer"
    check_model_name(name)
    inputs = [args.reference, args.dms_dir, args.ckpt, args.context_dir]
    check_output(args.out_dir, inputs, args.overwrite, "benchmark scores", exists_ok=True)
    read_reference(args.reference)  # its ids name files: checked before anything is loaded
    lm = load_lm(args)
    strategy = pick_strategy(lm, args.strategy, "masked-marginals")
    context_for = None
    if args.context_dir is not None:
        folder = Path(args.context_dir).expanduser()

        def context_for(assay):  # noqa: ANN001, ANN202 - an Assay -> (context, record)
            from protein_performer.inference.ensemble import context_record

            names = [f"{assay.dms_id}{ext}" for ext in CONTEXT_SUFFIXES]
            found = [folder / n for n in names if (folder / n).is_file()]
            if len(found) != 1:
                have = "has none of" if not found else "has more than one of"
                raise UserError(f"--context-dir {folder} {have} {', '.join(names)}")
            ctx = lm.context(found[0], query=assay.target_seq, **options)
            return ctx, context_record(ctx)

    summary = run_proteingym(
        lm, args.reference, args.dms_dir, args.out_dir, strategy=strategy, model_name=name,
        context_for=context_for, toks_per_batch=args.toks_per_batch,
        progress=not args.no_progress, overwrite=args.overwrite,
    )  # fmt: skip
    shown = ", ".join(
        f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in summary.averages.items()
    )
    reused = sum(r.reused for r in summary.results)
    say_wrote(
        summary.out_dir,
        f"{len(summary.results)} assay(s) ({reused} reused) with {strategy}: average {shown}",
    )
    return 0
