"""Argument definitions and loading shared by the ``protein-performer`` subcommands.

One definition per argument that several commands take (CKPT, ``--device``,
``--toks-per-batch``, ``--on-invalid``, ``--no-progress``), so their spelling, defaults and
help read the same everywhere, plus the load-the-checkpoint step of the inference commands.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM
    from protein_performer.inference.loading import LoadedModel

ON_INVALID_HELP = "invalid FASTA records: stop with an error (default) or skip them"
TOKS_PER_BATCH_HELP = "token budget per pass (default: 4096)"


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


def add_toks_per_batch(p: argparse.ArgumentParser, help: str = TOKS_PER_BATCH_HELP) -> None:
    p.add_argument("--toks-per-batch", type=int, default=4096, help=help)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")


def add_precision_threads(p: argparse.ArgumentParser) -> None:
    """``--precision`` (weights' dtype) and ``--threads`` (torch intra-op threads)."""
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
        help="CPU threads for torch (default: torch's choice, which OMP_NUM_THREADS sets; on "
        "a busy machine 1 is often fastest)",
    )


def add_on_invalid(p: argparse.ArgumentParser, help: str = ON_INVALID_HELP) -> None:
    p.add_argument("--on-invalid", choices=("error", "skip"), default="error", help=help)


def add_no_progress(p: argparse.ArgumentParser, help: str = "hide the progress bar") -> None:
    p.add_argument("--no-progress", action="store_true", help=help)


def add_fasta_run_options(
    p: argparse.ArgumentParser, toks_help: str = TOKS_PER_BATCH_HELP
) -> None:
    """What a model run over a FASTA file takes: ``--toks-per-batch``, ``--device``,
    ``--precision``, ``--threads``, ``--on-invalid`` and ``--no-progress``, in that order."""
    add_toks_per_batch(p, help=toks_help)
    add_device(p)
    add_precision_threads(p)
    add_on_invalid(p)
    add_no_progress(p)


def load_checkpoint(args: argparse.Namespace) -> LoadedModel:
    """The model named by ``args.ckpt``, on ``args.device``."""
    from protein_performer.inference.loading import load_model

    return load_model(args.ckpt, args.device)


def load_lm(args: argparse.Namespace) -> ProteinLM:
    """``protein_performer.load`` of ``args.ckpt`` with the device, precision and threads asked."""
    from protein_performer.inference.api import load

    return load(args.ckpt, args.device, args.precision, args.threads)


def load_with_strategy(args: argparse.Namespace, masked: str) -> tuple[ProteinLM, str]:
    """The model (``load_lm``) and the scoring strategy: ``args.strategy`` if given, else
    ``causal`` for causal-LM checkpoints and ``masked`` for masked-LM ones."""
    lm = load_lm(args)
    return lm, args.strategy or ("causal" if lm.objective == "clm" else masked)
