"""``protein-performer export CKPT DIR``: a checkpoint as config.json + model.safetensors."""

from __future__ import annotations

import argparse

from protein_performer.cli._common import add_command, add_overwrite, check_output

HELP = "export a checkpoint to config.json + model.safetensors"
DESCRIPTION = """\
Export a trained model to a directory holding config.json (format version, architecture,
vocabulary) and model.safetensors (weights, FAVOR+ random features included, so outputs are
reproduced exactly). The directory loads like a .ckpt in every command, without pickle,
Lightning, the optimizer state or the training config. Written atomically (built under a
temporary name, renamed when complete).
"""

EPILOG = """\
example:
  protein-performer export outputs/demo/<run>/checkpoints/last.ckpt demo_model"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "export", HELP, DESCRIPTION, EPILOG)
    p.add_argument("ckpt", metavar="CKPT", help="a .ckpt file (or an export directory to copy)")
    p.add_argument("out", metavar="DIR", help="output directory (must not exist or be empty)")
    add_overwrite(p, "an existing export in DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.inference.loading import export_model, load_model

    check_output(args.out, [args.ckpt], args.overwrite)
    loaded = load_model(args.ckpt, "cpu")
    out = export_model(loaded, args.out, overwrite=args.overwrite)
    params = loaded.model.num_parameters()
    print(
        f"exported {loaded.config.objective} model ({params:,} parameters, "
        f"{loaded.config.attention} attention) -> {out}"
    )
    return 0
