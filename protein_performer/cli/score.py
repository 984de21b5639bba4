"""``protein-performer score CKPT FASTA OUT``: per-sequence (pseudo-)log-likelihood table."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Score every record of a FASTA file with a trained model and write one row per record:
id, length, n_scored, log_likelihood, mean_log_likelihood, perplexity
(CSV, or TSV when OUT ends in .tsv).

strategies (must match how the checkpoint was trained):
  pseudo-ppl  masked-LM checkpoints: exact pseudo-log-likelihood, every residue masked once
              (L forward passes per sequence, batched under --toks-per-batch); n_scored = L
  causal      causal-LM checkpoints: exact log-likelihood of the residues and the final <eos>
              (one linear-time pass); n_scored = L + 1
perplexity = exp(-mean_log_likelihood), mean over the n_scored tokens.
"""

EPILOG = """\
examples:
  protein-performer score mlm.ckpt proteins.fasta scores.csv
  protein-performer score clm.ckpt proteins.fasta scores.tsv --strategy causal --device cuda
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "score",
        help="per-sequence log-likelihood / perplexity (pseudo-ppl or causal)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt", metavar="CKPT", help="a .ckpt file or an exported model directory")
    p.add_argument("fasta", metavar="FASTA", help="input FASTA(.gz)")
    p.add_argument("out", metavar="OUT", help="output table (.csv, or .tsv for tabs)")
    p.add_argument(
        "--strategy",
        choices=("pseudo-ppl", "causal"),
        default=None,
        help="default: pseudo-ppl for masked-LM, causal for causal-LM checkpoints",
    )
    p.add_argument(
        "--toks-per-batch", type=int, default=4096, help="token budget per pass (default: 4096)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument(
        "--on-invalid",
        choices=("error", "skip"),
        default="error",
        help="invalid FASTA records: stop with an error (default) or skip them",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.inference.loading import load_model
    from protein_performer.inference.scoring import score_fasta

    loaded = load_model(args.ckpt, args.device)
    strategy = args.strategy or ("causal" if loaded.config.objective == "clm" else "pseudo-ppl")
    scores = score_fasta(
        loaded,
        args.fasta,
        args.out,
        strategy=strategy,
        toks_per_batch=args.toks_per_batch,
        on_invalid=args.on_invalid,
        progress=not args.no_progress,
    )
    total = sum(s.log_likelihood for s in scores)
    n = sum(s.n_scored for s in scores)
    print(
        f"scored {len(scores)} record(s) with {strategy}: mean log-likelihood per token "
        f"{total / n:.4f} -> {args.out}"
    )
    return 0
