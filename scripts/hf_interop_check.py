#!/usr/bin/env python
"""ESM/Hugging Face interop, both ways, measured on random ESM-2-shaped models (no downloads).

1. export: a random PerformerLM in ESM-2 layout with a contact regression -> ``export --format
   hf`` -> ``transformers.EsmForMaskedLM.from_pretrained``: max |delta logits| on a padded batch
   with <mask> tokens, and max |delta p| of the contact maps (transformers' ``predict_contacts``,
   eager attention, vs ours).
2. import: a random ``EsmForMaskedLM`` (with its contact head) -> ``convert-esm --attention
   exact`` -> max |delta p| of ``predict_contacts`` vs transformers'.

Needs transformers (``pip install -e '.[dev]'``). Example::

    python scripts/hf_interop_check.py --dim 320 --depth 6 --heads 20 --length 200
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from protein_performer.contacts.predict import predict_contacts
from protein_performer.data.tokenizer import Alphabet, pad_token_arrays
from protein_performer.interop.export import export_model
from protein_performer.interop.export_hf import export_hf
from protein_performer.interop.identity import model_identity
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.performer import PerformerLM

AMINO = list("ACDEFGHIKLMNPQRSTVWY")


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move norms and biases off their init so a swapped or dropped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def contact_delta(loaded: LoadedModel, hf, seqs: list[str]) -> float:
    """Max |p ours - p transformers| over the contact maps of ``seqs``."""
    out = 0.0
    for seq in seqs:
        ids = torch.as_tensor(loaded.alphabet.encode_with_specials(seq), dtype=torch.long)[None]
        with torch.no_grad():
            theirs = hf.predict_contacts(ids, torch.ones_like(ids))[0].numpy()
        out = max(out, float(np.abs(predict_contacts(loaded, seq).dense - theirs).max()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--length", type=int, default=60, help="residues of the test sequences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="seconds: dim 32, 1 layer, 2 heads")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.depth, args.heads, args.length = 32, 1, 2, 30
    import transformers

    rng = np.random.default_rng(args.seed)
    alphabet = Alphabet()
    seqs = ["".join(rng.choice(AMINO, n)) for n in (args.length, args.length // 2)]
    tmp = Path(tempfile.mkdtemp(prefix="hf_interop_"))
    shape = dict(dim=args.dim, depth=args.depth, heads=args.heads, ff_dim=4 * args.dim)

    torch.manual_seed(args.seed)
    cfg = PerformerConfig(**shape, attention="exact", token_dropout=True)
    model = PerformerLM(cfg).eval()
    _perturb(model, args.seed)
    loaded = LoadedModel(model, cfg, alphabet, Path("random"), torch.device("cpu"), "-")
    n = cfg.depth * cfg.heads
    reg = ContactRegression(
        rng.normal(size=n), -1.0, list(range(1, cfg.depth + 1)), list(range(cfg.heads)),
        **model_identity(loaded),
    )  # fmt: skip
    loaded.contact_regression = reg.to_dict()
    export_hf(loaded, tmp / "hf")
    hf = transformers.EsmForMaskedLM.from_pretrained(tmp / "hf", attn_implementation="eager")
    hf.eval()
    tokens = pad_token_arrays([alphabet.encode_with_specials(s) for s in seqs], alphabet.pad_idx)
    tokens[0, 3] = alphabet.mask_idx
    with torch.no_grad():
        theirs = hf(input_ids=tokens, attention_mask=tokens.ne(alphabet.pad_idx).long()).logits
        delta = (theirs - model(tokens).logits)[tokens.ne(alphabet.pad_idx)].abs().max().item()
    dp = contact_delta(loaded, hf, seqs)
    print(f"export --format hf: max |delta logits| {delta:.3g}, contact maps max |dp| {dp:.3g}")

    torch.manual_seed(args.seed + 1)
    hf_cfg = transformers.EsmConfig(
        vocab_size=33, hidden_size=args.dim, num_hidden_layers=args.depth,
        num_attention_heads=args.heads, intermediate_size=4 * args.dim,
        position_embedding_type="rotary", token_dropout=True, pad_token_id=1, mask_token_id=32,
        layer_norm_eps=1e-5, emb_layer_norm_before=False, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    source = transformers.EsmForMaskedLM(hf_cfg).eval()
    _perturb(source, args.seed + 1)
    source.save_pretrained(tmp / "source")
    export_model(load_model(tmp / "source", "cpu"), tmp / "converted")  # = convert-esm
    converted = load_model(tmp / "converted", "cpu")
    dp = contact_delta(converted, source, seqs)
    print(f"convert-esm (exact): predict_contacts vs transformers max |dp| = {dp:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
