"""``protein-performer linearize SRC OUT``: a softmax model's linear-attention twin, fitted by
attention transfer (and an optional LoRA fine-tune): ``training.linearize`` does the work."""

from __future__ import annotations

import argparse
from typing import Any

from protein_performer.cli._args import add_command, add_overwrite, seed_arg
from protein_performer.cli._lifetime import check_output, stop_hint
from protein_performer.cli._wrote import say_wrote

HELP = "linear-attention twin of a softmax model (attention transfer, then LoRA)"
DESCRIPTION = """\
Turn a softmax-attention protein LM into a linear-attention one that runs in linear time and
constant memory per token, in minutes rather than a full fine-tune.

SRC is any model the loader reads: a fair-esm ESM-2 .pt, a Hugging Face EsmForMaskedLM
directory or cached id, a .ckpt from `train` or an export directory; its exact-attention form
is the teacher. OUT is an export directory (config.json + model.safetensors) with
attention=linear.

Stage 1, attention transfer (Hedgehog / LoLCATs): every weight of SRC is kept and frozen; only
the linear attention's own parameters (the learned hedgehog map per head, the exact window's
scale) are fitted, all layers at once, to reproduce each softmax layer's attention output on
that layer's own queries, keys and values (MSE; the teacher runs once per batch).
Stage 2 (--lora-steps N > 0): LoRA adapters (rank --lora-rank on q/k/v/out projections) are
fine-tuned on masked-LM loss (plus --kl-weight w of KL to the exact teacher), then merged into
the weights, so OUT is a plain model.

--window W keeps the W nearest keys exact (summed with the linear term under one normalizer,
LoLCATs' sliding window); the state of a causal model then adds a ring of W keys per layer.

The fit saves a resume state every --save-every steps beside OUT (OUT.linearize.pt); a run
stopped by Ctrl-C, SIGTERM or a non-finite loss continues with the same command and --resume.
"""

EPILOG = """\
examples:
  protein-performer linearize esm2_t6_8M_UR50D.pt esm2_8M_linear --data train.fasta
  protein-performer linearize outputs/exact/checkpoints/last.ckpt lin --steps 300 \\
      --lora-steps 150 --kl-weight 0.5
  protein-performer score lin proteins.fasta scores.csv
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


#: The flags that set a :class:`LinearizeOptions` field (besides ``--kernel``), in ``--help``
#: order: (field, type, metavar, help); ``{}`` in a help text is the field's default.
_OPTION_FLAGS: tuple[tuple[str, Any, str | None, str], ...] = (
    ("window", int, "W", "exact sliding window in tokens, 0 = none (default: {})"),
    ("steps", int, None, "attention-transfer steps (default: {})"),
    ("lr", float, None, "attention-transfer learning rate (default: {})"),
    ("lora_steps", int, "N", "LoRA fine-tune steps after the transfer (default: {} = none)"),
    ("lora_lr", float, None, "LoRA learning rate (default: {})"),
    ("lora_rank", int, None, "LoRA rank (default: {})"),
    ("kl_weight", float, "W", "LoRA loss (1 - W) MLM + W KL(exact teacher || linear) "
     "(default: 0)"),
    ("max_len", int, None, "crop sequences to this many tokens (default: {})"),
    ("max_tokens", int, None, "padded tokens per batch (default: {})"),
    ("save_every", int, None, "steps between resume states (default: {})"),
    ("seed", seed_arg, None, "seed (default: {})"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from protein_performer.model.config import LINEAR_KERNELS
    from protein_performer.training.linearize_options import LinearizeOptions

    d = LinearizeOptions()
    p = add_command(subparsers, "linearize", HELP, DESCRIPTION, EPILOG)
    p.add_argument("src", metavar="SRC", help="a softmax model: .pt, HF dir or id, .ckpt, export")
    p.add_argument("out", metavar="OUT", help="output export directory")
    p.add_argument(
        "--data",
        default=None,
        metavar="FASTA|STORE",
        help="sequences to fit on: FASTA file or `preprocess` store (default: the bundled "
        "demo set, for a smoke run); the held-out splits are never fitted on",
    )
    p.add_argument("--kernel", choices=LINEAR_KERNELS, default=d.kernel,
                   help=f"linear feature map (default: {d.kernel})")
    for field, kind, metavar, text in _OPTION_FLAGS:
        default = getattr(d, field)
        p.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default,
                       metavar=metavar, help=text.format(default))
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose state OUT.linearize.pt holds")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_overwrite(p, "an existing export in OUT")
    p.set_defaults(func=run)


def _kept(out: str) -> str:
    """What a stopped linearization kept (the stop line of :func:`stop_hint`)."""
    from protein_performer.training.linearize import state_path

    spot = state_path(out)
    kept = f"{spot} keeps the last saved state" if spot.exists() else "no state saved yet"
    return f"{kept}; rerun the same command with --resume to continue"


def run(args: argparse.Namespace) -> int:
    from protein_performer.training.linearize import STATE_SUFFIX, fit_linear
    from protein_performer.training.linearize_options import LinearizeOptions

    fields = ("kernel", *(row[0] for row in _OPTION_FLAGS))
    options = LinearizeOptions(**{f: getattr(args, f) for f in fields}).check()
    check_output(args.out, [args.src, args.data], args.overwrite, sidecars=[STATE_SUFFIX])
    with stop_hint(lambda: _kept(args.out)):
        result = fit_linear(
            args.src, args.out, args.data, options, device=args.device, resume=args.resume,
            overwrite=args.overwrite, show_progress=not args.no_progress,
        )  # fmt: skip
    last = {row["stage"]: row["loss"] for row in result.curve}
    losses = ", ".join(f"{stage} loss {value:.4g}" for stage, value in last.items())
    say_wrote(
        result.out,
        f"linearized {args.src} ({options.kernel}, window {options.window}; "
        f"{result.transfer_steps} transfer + {result.lora_steps} LoRA steps, "
        f"{result.seconds:.0f} s; {losses})",
    )
    return 0
