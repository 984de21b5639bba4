"""Argument definitions and loading shared by the ``protein-performer`` subcommands.

One definition per argument that several commands take (CKPT, ``--toks-per-batch``,
``--on-invalid``, ``--no-progress``, and :func:`add_model_options`: ``--device``,
``--precision``, ``--threads``, ``--overwrite``), so their spelling, defaults and help read the
same everywhere, plus the load-the-checkpoint step of the inference
commands and the output rule of every writing command (:func:`check_output`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from protein_performer.errors import UserError
from protein_performer.io.processes import Stopped

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM
    from protein_performer.inference.context import FamilyContext
    from protein_performer.inference.ensemble import ContextEnsemble

ON_INVALID_HELP = "invalid FASTA records: stop with an error (default) or skip them"
TOKS_PER_BATCH_HELP = "token budget per pass (default: 4096)"
FASTA_HELP = "input FASTA(.gz); - reads standard input"
FASTA_OR_STORE_HELP = (
    "input FASTA(.gz) (- reads standard input) or a store directory from `preprocess`"
)


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


#: What the running command holds until it returns (output locks, a rank's process group).
_SCOPE: list[contextlib.ExitStack] = []


@contextlib.contextmanager
def command_scope(sigterm: bool = True) -> Iterator[None]:
    """The lifetime of one command (``main`` runs each in one): what :func:`hold` takes is
    released when the command ends, by an error or a stop too. With ``sigterm`` (every command
    but those whose trainer saves on SIGTERM itself), SIGTERM raises :class:`Stopped` in this
    process, so its locks and temporaries go as they do on Ctrl-C (a forked child dies as
    before)."""
    import signal
    import threading

    from protein_performer.io.progress import drop_pending

    owner = os.getpid()

    def stop(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked worker: the default death
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Stopped

    install = sigterm and threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, stop) if install else None
    with contextlib.ExitStack() as stack:
        _SCOPE.append(stack)
        try:
            yield
        finally:
            _SCOPE.remove(stack)
            drop_pending()  # a `threads:` line never printed (--no-progress) stays this one's
            if install:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def hold(cm: contextlib.AbstractContextManager[Any]) -> None:
    """Enter ``cm`` for the rest of the running command (outside :func:`command_scope`, a
    direct call of a command's ``run``: until the process exits)."""
    if not _SCOPE:
        _SCOPE.append(contextlib.ExitStack())  # never closed: the process's exit releases it
    _SCOPE[-1].enter_context(cm)


def join_ranks(args: argparse.Namespace) -> None:
    """Under torchrun/srun, meet the other ranks before any work and check that every rank was
    given the same options (one line naming the first difference); a no-op in one process.

    The process group lives as long as the command, so a rank that fails later (a bad
    checkpoint on one node) makes the others stop instead of waiting for it."""
    from protein_performer.io.sharding import Job, detect_ranks

    ranks = detect_ranks()
    if not ranks.distributed:
        return
    local = {"func", "overrides", "verbose", "no_progress", "threads", "device"}
    options = {k: v for k, v in sorted(vars(args).items()) if k not in local}
    hold(Job(ranks, {k: repr(v) for k, v in options.items()}))


def rank_line(records: int, did: str) -> bool:
    """On a rank other than 0 of a sharded job, say what this rank did (``rank 1: no records``
    on an idle one) and return True: rank 0 alone reports the merged output."""
    from protein_performer.io.sharding import detect_ranks

    rank = detect_ranks().rank
    if rank == 0:
        return False
    print(
        f"rank {rank}: {did} {records} record(s) into parts that rank 0 merges"
        if records
        else f"rank {rank}: no records"
    )
    return True


def _check_stdout() -> None:
    """Refuse ``-`` when standard output is closed (``cmd >&-``: Python then has no
    ``sys.stdout``), before any work, instead of a traceback at the first write."""
    import io

    try:
        if sys.stdout is not None:
            os.fstat(sys.stdout.fileno())
            return
    except io.UnsupportedOperation:  # a stream in memory (a notebook, a test): it writes
        return
    except (OSError, ValueError):  # closed
        pass
    raise UserError(
        "the output is '-' but standard output is closed; give an output file or redirect "
        "standard output"
    )


def check_output(
    out: str | os.PathLike[str] | None,
    inputs: Iterable[str | os.PathLike[str] | None],
    overwrite: bool,
    what: str = "its output",
    *,
    exists_ok: bool = False,
    sidecars: Sequence[str] = (),
) -> None:
    """Claim ``out`` under the output policy (:mod:`protein_performer.io.outputs`) for the rest
    of the command (:func:`hold`), before any work: never an input, a directory holding one or
    a path inside an input directory, locked against a second run, replaced only with
    ``--overwrite``. ``-`` (standard output) is always fine, when standard output is open."""
    if out is not None and os.fspath(out) == "-":
        _check_stdout()
    if out is None or os.fspath(out) == "-":
        return
    from protein_performer.io.outputs import claim_output

    hold(claim_output(out, inputs, overwrite, what, exists_ok=exists_ok, sidecars=sidecars))


def load_lm(args: argparse.Namespace) -> ProteinLM:
    """``protein_performer.load`` of ``args.ckpt`` with the device, precision and threads asked
    (under torchrun/SLURM, ``--device cuda``/``auto`` means this rank's own GPU): every command
    that runs a model loads it here, so each accepts every source the one loader reads."""
    import torch

    from protein_performer.inference.api import load
    from protein_performer.io.progress import announce
    from protein_performer.io.sharding import detect_ranks
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


def add_context(p: argparse.ArgumentParser) -> None:
    """``--context`` / ``--max-context-tokens``: a family read once as context (causal models)."""
    p.add_argument(
        "--context",
        metavar="HOMOLOGS",
        default=None,
        help="FASTA of homologs (e.g. from `protein-performer homologs`; - reads standard input) "
        "or an MSA (A2M/A3M, Stockholm: gaps are not tokens, the first row is the reference) "
        "read once as family context: each sequence is treated as the family's next member "
        "(causal models)",
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
    from protein_performer.inference.context import default_max_tokens, limit_note

    ctx = lm.context(args.context, max_tokens=args.max_context_tokens, warn=False)
    limit = args.max_context_tokens or default_max_tokens(lm.loaded)
    kept, given = len(ctx.members), len(ctx.members) + len(ctx.dropped)
    note = limit_note(lm.loaded, kept, given, ctx.n_tokens, limit, "--max-context-tokens N")
    print(f"context from {args.context}: {note}", file=sys.stderr)
    return ctx


#: Exit status of a command stopped by SIGTERM (128 + 15, as the shell reports it; as train).
SIGTERM_EXIT = 143


@contextlib.contextmanager
def stop_hint(describe: Callable[[], str]) -> Iterator[None]:
    """A command stopped by Ctrl-C or SIGTERM says ``"<how>: " + describe()`` (what it kept and
    how to continue, read at the stop) in one line and exits 130 or 143, as ``train`` does."""
    from protein_performer.io.processes import sigterm_raises

    try:
        with sigterm_raises():
            yield
    except KeyboardInterrupt as exc:
        how = "SIGTERM" if isinstance(exc, Stopped) else "interrupted"
        print(f"{how}: {describe()}", file=sys.stderr)
        raise SystemExit(SIGTERM_EXIT if isinstance(exc, Stopped) else 130) from None


def resume_hint(out: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """:func:`stop_hint` for a command with ``--resume`` that writes parts: how many finished
    parts it kept."""
    from protein_performer.io.atomic import output_file
    from protein_performer.io.sharding import finished_parts, parts_dir

    def kept() -> str:
        pdir = parts_dir(output_file(out))
        return (
            f"{len(finished_parts(pdir))} finished part(s) kept in {pdir}; rerun the same "
            "command with --resume to continue (only the window in flight is redone)"
        )

    return stop_hint(kept)


#: Seeds reach numpy, which takes [0, 2**32): one range for every ``--seed`` flag.
MAX_SEED = 2**32 - 1


def seed_arg(text: str) -> int:
    """``--seed``: an integer in [0, 2**32), refused by argparse (one line) otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {value}")
    return value


def positive_int(text: str) -> int:
    """A count flag (``--limit-rows``) that must be at least 1: 0 or -1 never means "all"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
