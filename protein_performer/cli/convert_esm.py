"""``protein-performer convert-esm SRC OUT``: pretrained ESM-2 weights as an exported model:
the one loader (``load_model`` with the attention options) followed by ``export_model``."""

from __future__ import annotations

import argparse

from protein_performer.cli._args import add_command, add_overwrite, add_seed
from protein_performer.cli._lifetime import check_output
from protein_performer.cli._wrote import say_wrote

HELP = "import ESM-2 weights (fair-esm .pt or Hugging Face directory)"
DESCRIPTION = """\
Convert pretrained ESM-2 weights into protein-performer's exported model format
(config.json + model.safetensors), usable by embed, score, score-variants and eval.

SRC is a fair-esm checkpoint (.pt, e.g. esm2_t6_8M_UR50D.pt as esm.pretrained loads it), a
Hugging Face EsmForMaskedLM directory (config.json + model.safetensors, e.g. a local copy of
facebook/esm2_t6_8M_UR50D) or a Hugging Face model id (facebook/esm2_t6_8M_UR50D) found in the
local Hugging Face cache (HF_HUB_CACHE, HF_HOME; nothing is downloaded). ESM-1 and ESM-1b
(learned positions) are refused.

ESM-2's contact head (its logistic regression over all layer x head attention maps; for fair-esm
the <name>-contact-regression.pt file beside the .pt) is kept as the model's contact regression
(OUT/contact_regression.json): `contacts predict`, export and init_from fine-tunes carry it.

Every command taking CKPT also reads these sources directly (exact attention); converting
stores the result once, with the attention options below.

--attention exact reproduces ESM-2's outputs (logits and hidden states to float32 round-off).
--attention favor runs the same weights with FAVOR+ linear attention: any length, approximate
outputs; fine-tune briefly to recover (conf/experiment/esm_favor_finetune.yaml). The random
features are drawn from --seed, so the same command gives the same export.
"""

EPILOG = """\
examples:
  protein-performer convert-esm esm2_t6_8M_UR50D.pt esm2_8M_exact
  protein-performer convert-esm facebook/esm2_t6_8M_UR50D esm2_8M_favor --attention favor \\
      --kernel softmax --seed 0
  protein-performer embed esm2_8M_exact proteins.fasta emb.h5
"""


#: The arguments naming what this command writes, each claimed under the output policy
#: (protein_performer.io.outputs); tests/cli/test_cli_outputs.py checks them.
OUTPUTS: tuple[str, ...] = ("out",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from protein_performer.model.config import ATTENTIONS, KERNELS

    p = add_command(subparsers, "convert-esm", HELP, DESCRIPTION, EPILOG)
    p.add_argument(
        "src", metavar="SRC", help="fair-esm .pt, HF EsmForMaskedLM directory or cached HF id"
    )
    p.add_argument("out", metavar="OUT", help="output directory (must not exist or be empty)")
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help="exact (reproduces ESM-2) or favor (linear time, approximate); default: exact "
        "for ESM-2 weights, the stored one for a protein-performer model",
    )
    p.add_argument(
        "--kernel",
        choices=KERNELS,
        default=None,
        help="FAVOR+ feature map (default: softmax, or the stored one); ignored for exact",
    )
    p.add_argument(
        "--nb-features",
        type=int,
        default=None,
        metavar="M",
        help="FAVOR+ random features per head (default: d ln d rounded up to a multiple of 16 "
        "for head size d, 48 for ESM-2's 16-wide heads); ignored for exact",
    )
    add_seed(p, "seed of the FAVOR+ random features (default: 0)")
    add_overwrite(p, "an existing export in OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from protein_performer.interop.export import export_model
    from protein_performer.interop.loading import load_model
    from protein_performer.model.cores import drawn_keys

    check_output(args.out, [args.src], args.overwrite)
    loaded = load_model(
        args.src,
        "cpu",
        attention=args.attention,
        kernel=args.kernel,
        nb_features=args.nb_features,
        seed=args.seed,
    )
    cfg = loaded.config
    what = f"{loaded.kind} ESM-2" if loaded.kind in ("fair-esm", "hf") else f"{loaded.kind} model"
    print(
        f"read {what}: {cfg.depth} layers, dim {cfg.dim}, {cfg.heads} heads, "
        f"token_dropout={cfg.token_dropout}"
    )
    out = export_model(loaded, args.out, overwrite=args.overwrite)
    attn = cfg.attention
    if drawn_keys(loaded.model):  # random features: say which and from what seed
        attn = f"{attn} ({cfg.kernel}, m={cfg.nb_features}, seed {args.seed})"
    head = (
        ", with its contact head"
        if loaded.contact_regression is not None
        else ", no contact head found"
    )
    say_wrote(
        out,
        f"converted {what} ({loaded.model.num_parameters():,} parameters, {attn} "
        f"attention{head})",
    )
    return 0
