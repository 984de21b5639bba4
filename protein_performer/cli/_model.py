"""Model loading for the inference commands: the checkpoint with the device, precision and
threads asked (:func:`load_lm`), the strategy a command reports, and the family context
``--context`` names, read once."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM
    from protein_performer.inference.context import FamilyContext
    from protein_performer.inference.ensemble import ContextEnsemble


def load_lm(args: argparse.Namespace) -> ProteinLM:
    """``protein_performer.load`` of ``args.ckpt`` with the device, precision and threads asked
    (under torchrun/SLURM, ``--device cuda``/``auto`` means this rank's own GPU): every command
    that runs a model loads it here, so each accepts every source the one loader reads."""
    import torch

    from protein_performer.inference.api import load
    from protein_performer.io.progress import announce
    from protein_performer.io.ranks import detect_ranks
    from protein_performer.io.threads import set_threads

    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be a positive integer, got {args.threads}")
    # The default is the cores free of other processes (io/threads.py), said in one line
    # when the work starts (with the first progress output; none with --no-progress).
    line = set_threads(args.threads)
    if not getattr(args, "no_progress", False):
        announce(line)
    # The threads are set: load keeps them (its own default would choose again).
    return load(args.ckpt, detect_ranks().device(args.device), args.precision,
                threads=torch.get_num_threads())  # fmt: skip


def pick_strategy(lm: ProteinLM, strategy: str | None, masked: str) -> str:
    """``strategy`` if given, else ``causal`` for causal-LM models and ``masked`` for masked-LM
    ones: the name a command reports, chosen as the API chooses it."""
    return strategy or ("causal" if lm.objective == "clm" else masked)


def context_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ensemble options given (``lm.context``'s keywords); empty for one plain context."""
    options: dict[str, Any] = {}
    if getattr(args, "context_max_identity", None) is not None:
        options["max_identity"] = args.context_max_identity
    if getattr(args, "context_tokens", None) is not None:
        options["tokens"] = args.context_tokens
    if getattr(args, "context_orders", None) is not None:
        options["orders"] = args.context_orders
    if options:
        options["seed"] = args.context_seed
    return options


def load_context(
    lm: ProteinLM, args: argparse.Namespace, query: str | None = None
) -> FamilyContext | ContextEnsemble | None:
    """The family context ``--context`` names (an ensemble with ``--context-*`` lists), read
    once and reported in one line; None without it (``--max-context-tokens`` or ``--context-*``
    alone are refused: they would silently do nothing)."""
    options = context_options(args)
    if args.context is None:
        if args.max_context_tokens is not None or options:
            flag = "--max-context-tokens" if args.max_context_tokens is not None else "--context-*"
            raise UserError(f"{flag} needs --context HOMOLOGS.fasta")
        return None
    stdin = [k for k in ("fasta", "wt", "mutations") if getattr(args, k, None) == "-"]
    if args.context == "-" and stdin:
        raise UserError(
            f"--context - and {stdin[0].upper()} - would both read standard input; give one of "
            "them as a file"
        )
    if options:
        ens: Any = lm.context(args.context, args.max_context_tokens, query=query, **options)
        sizes = ", ".join(f"{p.label}: {p.context.n_tokens}" for p in ens.prompts)
        print(
            f"context: {len(ens.prompts)} prompt(s) from {args.context} (tokens {sizes})",
            file=sys.stderr,
        )
        return ens
    ctx = lm.context(args.context, max_tokens=args.max_context_tokens, warn=False)
    note = lm.context_note(ctx, args.max_context_tokens, "--max-context-tokens N")
    print(f"context from {args.context}: {note}", file=sys.stderr)
    return ctx
