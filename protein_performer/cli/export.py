"""``protein-performer export CKPT DIR``: a checkpoint as config.json + model.safetensors, in
protein-performer's format or as a Hugging Face ``EsmForMaskedLM``."""

from __future__ import annotations

import argparse

from protein_performer.cli._args import add_command, add_overwrite
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._wrote import say_wrote

HELP = "export a checkpoint to config.json + model.safetensors (native or Hugging Face)"
DESCRIPTION = """\
Export a trained model to a directory holding config.json (format version, architecture,
vocabulary) and model.safetensors (weights, FAVOR+ random features included, so outputs are
reproduced exactly), plus contact_regression.json when the model has one. The directory loads
like a .ckpt in every command, without pickle, Lightning, the optimizer state or the training
config. Written atomically (built under a temporary name, renamed when complete).

--format hf writes a Hugging Face EsmForMaskedLM directory instead (config.json with
model_type esm, model.safetensors, vocab.txt and tokenizer files; the contact regression as
ESM's contact head), which transformers.EsmForMaskedLM.from_pretrained(DIR) and
AutoTokenizer.from_pretrained(DIR) load with the same logits. Causal models cannot be exported
this way (HF's ESM is bidirectional). transformers has no FAVOR+: a FAVOR+ model needs
--as-exact, which exports the same weights for exact softmax attention, the function FAVOR+
approximates (outputs then differ by the FAVOR+ approximation error; the ReLU kernel
approximates no softmax and is refused).
"""

EPILOG = """\
examples:
  protein-performer export outputs/demo/<run>/checkpoints/last.ckpt demo_model
  protein-performer export esm2_8M_exact esm2_8M_hf --format hf
  protein-performer export outputs/esm_favor_finetune/<run>/checkpoints/last.ckpt hf_dir \\
      --format hf --as-exact"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "export", HELP, DESCRIPTION, EPILOG)
    p.add_argument("ckpt", metavar="CKPT", help="a .ckpt file (or an export directory to copy)")
    p.add_argument("out", metavar="DIR", help="output directory (must not exist or be empty)")
    add_overwrite(p, "an existing export in DIR")
    p.add_argument(
        "--format",
        choices=("native", "hf"),
        default="native",
        help="native (protein-performer, default) or hf (transformers EsmForMaskedLM)",
    )
    p.add_argument(
        "--as-exact",
        action="store_true",
        help="--format hf of a FAVOR+ model: the same weights for exact softmax attention",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a fine-tuned checkpoint (`finetune`): fold its LoRA adapters into the base weights "
        "and write OUT as one .ckpt that pp.load and `predict` open (same predictions)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.errors import UserError
    from protein_performer.interop.export import export_model
    from protein_performer.interop.loading import load_model

    if args.as_exact and args.format != "hf":
        raise UserError("--as-exact is for --format hf (the native format keeps FAVOR+)")
    check_output(args.out, [args.ckpt], args.overwrite)
    loaded = load_model(args.ckpt, "cpu")
    if args.merge or loaded.task is not None:
        return _export_finetuned(loaded, args)
    attention = loaded.config.attention
    if args.format == "hf":
        from protein_performer.interop.export_hf import export_hf

        out = export_hf(loaded, args.out, as_exact=args.as_exact, overwrite=args.overwrite)
        attention = "exact"
    else:
        out = export_model(loaded, args.out, overwrite=args.overwrite)
    params = loaded.model.num_parameters()
    head = "with" if loaded.contact_regression is not None else "no"
    say_wrote(
        out,
        f"exported {loaded.config.objective} model as {args.format} ({params:,} parameters, "
        f"{attention} attention, {head} contact regression)",
    )
    return 0


def _export_finetuned(loaded, args: argparse.Namespace) -> int:  # noqa: ANN001
    """``--merge``: a fine-tuned model (head included) as one merged ``.ckpt``."""
    from protein_performer.errors import UserError
    from protein_performer.interop.finetuned import merge_lora, save_finetuned
    from protein_performer.io.atomic import output_file

    if loaded.task is None:
        raise UserError(f"{args.ckpt} is not a fine-tuned model: --merge is for `finetune` output")
    if not args.merge:
        raise UserError(
            f"{args.ckpt} is a fine-tuned model: pass --merge to write it (LoRA folded into the "
            "base) as one .ckpt, e.g. `protein-performer export FT.ckpt merged.ckpt --merge`"
        )
    if args.format != "native":
        raise UserError("--merge writes the native .ckpt; --format hf has no task head")
    had = loaded.lora is not None
    out = save_finetuned(merge_lora(loaded), output_file(args.out))  # a file, not a directory
    say_wrote(
        out,
        f"exported fine-tuned {loaded.task.config.task} model "
        f"({'LoRA merged into the base' if had else 'no LoRA to merge'})",
    )
    return 0
