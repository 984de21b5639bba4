"""Argument definitions shared by the ``protein-performer`` subcommands: one definition per
argument that several commands take (CKPT, ``--toks-per-batch``, ``--on-invalid``,
``--no-progress``, :func:`add_model_options`: ``--device``, ``--precision``, ``--threads``,
``--overwrite``; the context and variant-strategy options; the number types ``--seed`` and the
counts take), so their spelling, defaults and help read the same everywhere."""

from __future__ import annotations

import argparse
from typing import Any

ON_INVALID_HELP = "invalid FASTA records: stop with an error (default) or skip them"
TOKS_PER_BATCH_HELP = "token budget per pass (default: 4096)"
FASTA_HELP = "input FASTA(.gz); - reads standard input"
FASTA_OR_STORE_HELP = (
    "input FASTA(.gz) (- reads standard input) or a store directory from `preprocess`"
)
TABLE_OUT_HELP = "output table (.csv, or .tsv for tabs; - for standard output)"


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    help: str,
    description: str,
    epilog: str,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """A subcommand whose description and epilog are printed as written (line breaks kept)."""
    return subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def add_ckpt(p: argparse.ArgumentParser) -> None:
    """The positional CKPT: a Lightning checkpoint or an exported model directory."""
    p.add_argument("ckpt", metavar="CKPT", help="a .ckpt file or an exported model directory")


def add_ckpt_fasta_out(
    p: argparse.ArgumentParser, out_help: str, fasta_help: str = FASTA_OR_STORE_HELP
) -> None:
    """The positionals ``CKPT FASTA OUT`` of a model run over records, in esm-extract's order."""
    add_ckpt(p)
    p.add_argument("fasta", metavar="FASTA", help=fasta_help)
    p.add_argument("out", metavar="OUT", help=out_help)


def add_toks_per_batch(p: argparse.ArgumentParser, help: str = TOKS_PER_BATCH_HELP) -> None:
    p.add_argument("--toks-per-batch", type=positive_int, default=4096, help=help)


def add_on_invalid(p: argparse.ArgumentParser, help: str = ON_INVALID_HELP) -> None:
    p.add_argument("--on-invalid", choices=("error", "skip"), default="error", help=help)


def add_no_progress(p: argparse.ArgumentParser, help: str = "hide the progress bar") -> None:
    p.add_argument("--no-progress", action="store_true", help=help)


def add_fasta_run_options(
    p: argparse.ArgumentParser, toks_help: str = TOKS_PER_BATCH_HELP
) -> None:
    """What a model run over a FASTA file takes besides :func:`add_model_options`:
    ``--toks-per-batch``, ``--on-invalid`` and ``--no-progress``, in that order."""
    add_toks_per_batch(p, help=toks_help)
    add_on_invalid(p)
    add_no_progress(p)


def fasta_run_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The job keywords of :func:`add_fasta_run_options`' flags, read from parsed ``args``."""
    return {
        "toks_per_batch": args.toks_per_batch,
        "on_invalid": args.on_invalid,
        "progress": not args.no_progress,
    }


def add_model_options(p: argparse.ArgumentParser, overwrite: str = "OUT") -> None:
    """``--device``, ``--precision``, ``--threads`` and ``--overwrite``: every command that runs
    a model takes these four, registered here only, so they read the same everywhere.
    ``overwrite`` names what ``--overwrite`` replaces."""
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="weights' precision; bf16/fp16 halve memory on GPUs, FAVOR+ features stay fp32 "
        "(default: fp32)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: OMP_NUM_THREADS if set, else the cores this "
        "process may use less the other processes running now, at least 1; said in one line at "
        "the start)",
    )
    add_overwrite(p, overwrite)


def add_overwrite(p: argparse.ArgumentParser, what: str = "the output") -> None:
    """``--overwrite``: the one flag that lets a command replace an existing output."""
    p.add_argument(
        "--overwrite", action="store_true", help=f"replace {what} if it exists (never an input)"
    )


def add_context(p: argparse.ArgumentParser) -> None:
    """``--context`` / ``--max-context-tokens``: a family read once as context (causal models)."""
    p.add_argument(
        "--context",
        metavar="HOMOLOGS",
        default=None,
        help="FASTA of homologs (e.g. from `protein-performer homologs`; - reads standard input) "
        "or an MSA (A2M/A3M, Stockholm: gaps are not tokens, the first row is the reference) "
        "read once as family context: each sequence is treated as the family's next member "
        "(causal models). A position memory keys aligned homologs (an MSA, `homologs` hits) "
        "by their alignment to the reference (the MSA's first row, the `homologs` query), "
        "others by their member positions; each sequence is read at its own member positions",
    )
    p.add_argument(
        "--max-context-tokens",
        type=int,
        default=None,
        metavar="N",
        help="context tokens kept, whole homologs in order (default: the trained row length "
        "when the checkpoint records it, else all; longer is allowed: a FAVOR+ model's cost "
        "per sequence does not grow with it)",
    )


def add_variant_strategy(p: argparse.ArgumentParser) -> None:
    """``--strategy`` of the variant scorers (score-variants, benchmark proteingym)."""
    p.add_argument(
        "--strategy",
        choices=("masked-marginals", "wt-marginals", "pseudo-ppl", "causal"),
        default=None,
        help="default: masked-marginals for masked-LM, causal for causal-LM checkpoints",
    )


def add_context_ensemble(p: argparse.ArgumentParser, identity: bool = True) -> None:
    """``--context-max-identity``, ``--context-tokens``, ``--context-orders``,
    ``--context-seed``: a PoET-style ensemble of prompts from one homolog file (without
    ``--context-max-identity`` where the command has no wild type to compare with)."""
    if identity:
        p.add_argument(
            "--context-max-identity",
            type=_fractions,
            default=None,
            metavar="X,Y,...",
            help="one prompt per value, each without the homologs more identical to the wild "
            "type than it (identity: identical pairs of a local BLOSUM62 alignment over the "
            "shorter length, computed in-package; 1.0 keeps all)",
        )
    p.add_argument(
        "--context-tokens",
        type=_counts,
        default=None,
        metavar="N,M,...",
        help="one prompt per context token budget (whole homologs, in the prompt's order)",
    )
    p.add_argument(
        "--context-orders",
        type=positive_int,
        default=None,
        metavar="N",
        help="N random orders of the homologs (from --context-seed), each also reversed: 2N "
        "prompts per identity and budget (default: the file's order)",
    )
    p.add_argument(
        "--context-seed", type=seed_arg, default=0, help="seed of the random orders (default 0)"
    )


def add_seed(
    p: argparse.ArgumentParser, help: str, default: int = 0, metavar: str | None = None
) -> None:
    """``--seed``: one type (:func:`seed_arg`) for every command; ``help`` says what it seeds."""
    p.add_argument("--seed", type=seed_arg, default=default, metavar=metavar, help=help)


def _number_list(cast: type, example: str, ok: Any, rule: str) -> Any:  # noqa: ANN401
    """An argparse type for comma-separated numbers (``1.0,0.9``), each checked by ``ok``."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(cast(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected e.g. {example}, got {text!r}") from None
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"each must be {rule}, got {text!r}")
        return values

    return parse


_fractions = _number_list(float, "1.0,0.9,0.7", lambda v: 0 < v <= 1, "in (0, 1]")
_counts = _number_list(int, "6144,12288", lambda v: v >= 1, "at least 1")


#: Seeds reach numpy, which takes [0, 2**32): one range for every ``--seed`` flag.
MAX_SEED = 2**32 - 1


def _whole_number(text: str) -> int:
    """An integer flag's value; anything else is refused by argparse in one line."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def seed_arg(text: str) -> int:
    """``--seed``: an integer in [0, 2**32), refused by argparse (one line) otherwise."""
    value = _whole_number(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {value}")
    return value


def positive_int(text: str) -> int:
    """A count flag (``--limit-rows``) that must be at least 1: 0 or -1 never means "all"."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
