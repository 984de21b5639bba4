"""Argument definitions and loading shared by the ``protein-performer`` subcommands.

One definition per argument that several commands take (CKPT, ``--device``,
``--toks-per-batch``, ``--on-invalid``, ``--no-progress``, ``--overwrite``), so their spelling,
defaults and help read the same everywhere, plus the load-the-checkpoint step of the inference
commands and the output rule of every writing command (:func:`check_output`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM
    from protein_performer.interop.loading import LoadedModel

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


def add_precision(p: argparse.ArgumentParser) -> None:
    """``--precision``: the weights' dtype."""
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="weights' precision; bf16/fp16 halve memory on GPUs, FAVOR+ features stay fp32 "
        "(default: fp32)",
    )


def add_threads(p: argparse.ArgumentParser) -> None:
    """``--threads``: torch's intra-op CPU threads, set by :func:`apply_threads`."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: torch's choice, which OMP_NUM_THREADS sets; on "
        "a busy machine 1 is often fastest)",
    )


def add_precision_threads(p: argparse.ArgumentParser) -> None:
    add_precision(p)
    add_threads(p)


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's threads from ``--threads`` (commands that do not go through ``load``)."""
    if getattr(args, "threads", None) is None:
        return
    if args.threads < 1:
        raise UserError(f"--threads must be a positive integer, got {args.threads}")
    import torch

    torch.set_num_threads(args.threads)


def positional_overrides(
    args: argparse.Namespace, names: Sequence[str], command: str
) -> list[str]:
    """Hydra overrides with leading positional arguments turned into ``name=value``.

    ``eval CKPT FASTA key=value`` reads like the other inference commands and means
    ``eval ckpt=CKPT data=FASTA key=value``; the ``key=value`` form still works.
    """
    out, given = list(args.overrides), []
    while out and "=" not in out[0] and not out[0].startswith("-"):
        given.append(out.pop(0))
    if len(given) > len(names):
        raise UserError(
            f"{command} takes at most {len(names)} positional argument(s) "
            f"({' '.join(n.upper() for n in names)}), got {len(given)}: {' '.join(given)}"
        )
    for name, value in zip(names, given, strict=False):
        if any(o.split("=", 1)[0] == name for o in out):
            raise UserError(f"{name} given twice: as {value!r} and as {name}=...; give one")
        out.insert(0, f"{name}={value}")  # path keys are taken verbatim, not Hydra-parsed
    return out


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


def add_overwrite(p: argparse.ArgumentParser, what: str = "the output") -> None:
    """``--overwrite``: the one flag that lets a command replace an existing output."""
    p.add_argument(
        "--overwrite", action="store_true", help=f"replace {what} if it exists (never an input)"
    )


def check_output(
    out: str | os.PathLike[str] | None,
    inputs: Iterable[str | os.PathLike[str] | None],
    overwrite: bool,
) -> None:
    """The rule every writing command applies before any work: the output is never one of the
    inputs (the same file, through any link, or a directory holding one), and an existing
    output is replaced only with ``--overwrite``. ``-`` (standard output) is always fine."""
    if out is None or os.fspath(out) == "-":
        return
    path = Path(out).expanduser()
    target = path.resolve()
    for given in inputs:
        if given is None or os.fspath(given) == "-" or not Path(given).expanduser().exists():
            continue
        src = Path(given).expanduser().resolve()
        same = path.exists() and os.path.samefile(path, src)  # hard links too
        if same or target in src.parents:
            raise UserError(
                f"{out} is {'the' if same else 'a directory holding the'} input "
                f"{given}: an output never replaces an input; choose another output path"
            )
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise UserError(
            f"{out} already exists: pass --overwrite to replace it, or choose another output"
        )


def load_checkpoint(args: argparse.Namespace) -> LoadedModel:
    """The model named by ``args.ckpt``, on ``args.device`` (with ``--threads`` applied)."""
    from protein_performer.interop.loading import load_model

    apply_threads(args)

    return load_model(args.ckpt, args.device)


def load_lm(args: argparse.Namespace) -> ProteinLM:
    """``protein_performer.load`` of ``args.ckpt`` with the device, precision and threads asked
    (under torchrun/SLURM, ``--device cuda``/``auto`` means this rank's own GPU)."""
    from protein_performer.inference.api import load
    from protein_performer.io.sharding import detect_ranks

    return load(args.ckpt, detect_ranks().device(args.device), args.precision, args.threads)


def load_with_strategy(args: argparse.Namespace, masked: str) -> tuple[ProteinLM, str]:
    """The model (``load_lm``) and the scoring strategy: ``args.strategy`` if given, else
    ``causal`` for causal-LM checkpoints and ``masked`` for masked-LM ones."""
    lm = load_lm(args)
    return lm, args.strategy or ("causal" if lm.objective == "clm" else masked)
