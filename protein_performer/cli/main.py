"""The one console script, ``protein-performer``, with one subcommand per job.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` (which registers the
parser and sets ``func``) so ``--help`` stays cheap: heavy imports happen inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from protein_performer._version import __version__
from protein_performer.errors import UserError

#: Subcommand modules under ``protein_performer.cli``, in the order ``--help`` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "preprocess",
    "stats",
    "homologs",
    "train",
    "finetune",
    "eval",
    "embed",
    "score",
    "score_variants",
    "benchmark",
    "generate",
    "predict",
    "export",
    "convert_esm",
    "linearize",
    "contacts",
    "visualize",
)

log = logging.getLogger("protein_performer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="protein-performer",
        description="Performer (FAVOR+) protein language models for long sequences.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"protein_performer.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; user errors become one ``error:`` line and exit status 2."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from protein_performer.cli._lifetime import SIGTERM_EXIT, command_scope
    from protein_performer.io.processes import Stopped

    sigterm = not getattr(args, "own_sigterm", False)  # train/finetune: the trainer saves first
    try:
        # Output locks, temporaries and a rank's process group end with the command, a SIGTERM
        # included.
        with command_scope(sigterm):
            return int(args.func(args) or 0)
    except UserError as exc:
        if not getattr(exc, "quiet", False):  # a data-parallel rank other than 0 stays silent
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except Stopped:
        print("stopped by SIGTERM", file=sys.stderr)
        return SIGTERM_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `... | head` closed the pipe: the reader has what it wanted. Point stdout at devnull so
        # the interpreter's final flush does not raise a second time, and end quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # a full disk outside the atomic writers: still one line
        from protein_performer.io.atomic import disk_full_error, is_disk_full

        if not is_disk_full(exc):
            raise
        where = getattr(exc, "filename", None) or getattr(exc, "filename2", None)
        said = disk_full_error(where) if where else "no space left on device; free space"
        print(f"error: {said}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
