"""``protein-performer linearize SRC OUT``: a softmax model's linear-attention twin, fitted by
attention transfer (and an optional LoRA fine-tune): ``training.linearize`` does the work."""

from __future__ import annotations

import argparse

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
    p.add_argument("--window", type=int, default=d.window, metavar="W",
                   help=f"exact sliding window in tokens, 0 = none (default: {d.window})")
    p.add_argument("--steps", type=int, default=d.steps,
                   help=f"attention-transfer steps (default: {d.steps})")
    p.add_argument("--lr", type=float, default=d.lr,
                   help=f"attention-transfer learning rate (default: {d.lr})")
    p.add_argument("--lora-steps", type=int, default=d.lora_steps, metavar="N",
                   help="LoRA fine-tune steps after the transfer (default: 0 = none)")
    p.add_argument("--lora-lr", type=float, default=d.lora_lr,
                   help=f"LoRA learning rate (default: {d.lora_lr})")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank,
                   help=f"LoRA rank (default: {d.lora_rank})")
    p.add_argument("--kl-weight", type=float, default=d.kl_weight, metavar="W",
                   help="LoRA loss (1 - W) MLM + W KL(exact teacher || linear) (default: 0)")
    p.add_argument("--max-len", type=int, default=d.max_len,
                   help=f"crop sequences to this many tokens (default: {d.max_len})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help=f"padded tokens per batch (default: {d.max_tokens})")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help=f"steps between resume states (default: {d.save_every})")
    p.add_argument("--seed", type=seed_arg, default=d.seed, help="seed (default: 0)")
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

    options = LinearizeOptions(
        kernel=args.kernel, window=args.window, steps=args.steps, lr=args.lr,
        lora_steps=args.lora_steps, lora_lr=args.lora_lr, lora_rank=args.lora_rank,
        kl_weight=args.kl_weight, max_len=args.max_len, max_tokens=args.max_tokens,
        seed=args.seed, save_every=args.save_every,
    ).check()  # fmt: skip
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
