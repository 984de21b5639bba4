"""``protein-performer generate CKPT OUT.fasta --num N --max-length L``: sample sequences."""

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
    add_seed,
)
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._model import load_context, load_lm
from protein_performer.cli._wrote import say_wrote
from protein_performer.errors import UserError

HELP = "sample protein sequences from a causal model (RNN mode, constant cost per token)"
DESCRIPTION = """\
Sample sequences from a causal-LM checkpoint (objective clm). The prompt runs once through the
parallel causal forward; then each new residue costs one recurrent step whose time and memory
do not grow with the length (FAVOR+; the exact-attention twin uses a KV cache).

Each sequence starts with --prompt and ends when the model emits <eos> (never before
--min-length residues) or at --max-length residues (both count the prompt). Only the 20
standard amino acids are emitted, never special tokens or X.

Reproducible: sequence i draws from its own random stream seeded from (--seed, i), so the
same seed gives byte-identical output whatever --batch-size (on CPU in fp32).

Each FASTA header carries the index, the seed, the length, how the sequence ended and its
mean log-likelihood per token, the number `protein-performer score` gives for it.

With --context HOMOLOGS the sequences are new members of that family; --context-tokens and
--context-orders make an ensemble of prompts: sequence i follows prompt i mod (their number),
named in its header (context=...), and its score is the mean over the prompts.
"""

EPILOG = """\
examples:
  protein-performer generate clm.ckpt samples.fasta --num 8 --max-length 300
  protein-performer generate clm.ckpt - --num 100 --max-length 500 --min-length 50 \\
      --prompt MKT --temperature 0.8 --top-p 0.95 --seed 1
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "generate", HELP, DESCRIPTION, EPILOG)
    add_ckpt(p)
    p.add_argument("out", metavar="OUT", help="output FASTA; - for standard output")
    p.add_argument("--num", type=int, required=True, metavar="N",
                   help="sequences to sample (at least 1; written as they come)")  # fmt: skip
    p.add_argument(
        "--max-length",
        type=int,
        required=True,
        metavar="L",
        help="at most L residues per sequence, prompt included",
    )
    p.add_argument(
        "--min-length",
        type=int,
        default=0,
        metavar="M",
        help="no <eos> before M residues (default: 0)",
    )
    p.add_argument(
        "--prompt", default="M", metavar="SEQ", help="start of every sequence (default: M)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="softmax temperature; 0 = greedy (default: 1.0)",
    )
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K best")
    p.add_argument(
        "--top-p", type=float, default=None, metavar="P", help="nucleus: smallest set of mass P"
    )
    add_seed(p, "random seed (default: 0)", metavar="S")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="B",
        help="sequences decoded together (memory, not results; default: 8)",
    )
    add_context(p)
    add_context_ensemble(p, identity=False)
    add_no_progress(p)
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.io.atomic import text_output
    from protein_performer.io.progress import progress

    if args.num < 1:  # an empty FASTA and exit 0 looked like a run that worked
        raise UserError(f"--num must be at least 1, got {args.num}")
    check_output(args.out, [args.ckpt, args.context], args.overwrite)
    lm = load_lm(args)
    context = load_context(lm, args)
    labels = [p.label for p in getattr(context, "prompts", ())]  # an ensemble's, in turn
    samples = lm.iter_generate(
        n=args.num,
        max_length=args.max_length,
        min_length=args.min_length,
        prompt=args.prompt,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
        context=context,
    )
    written = 0  # a reader that closes the pipe (| head) ends the loop early
    with (
        text_output(args.out) as fh,
        progress(args.num, "seq", "generate", not args.no_progress) as bar,
    ):
        for g in samples:
            mean_ll = float(lm.score([g.sequence], strategy="causal", context=context)[0])
            after = f" context={labels[g.index % len(labels)]}" if labels else ""
            fh.write(
                f">gen{g.index} index={g.index} seed={g.seed} length={len(g.sequence)} "
                f"ended={g.ended} mean_log_likelihood={mean_ll:.6f}{after}\n{g.sequence}\n"
            )
            bar.update(1)
            written += 1
    where = "standard output" if args.out == "-" else args.out
    if written < args.num:
        print(f"generated {written} of {args.num} sequence(s): {where} was closed after them",
              file=sys.stderr)  # fmt: skip
    else:
        say_wrote(args.out, f"generated {written} sequence(s)")
    return 0
