#!/usr/bin/env python
"""FAVOR+ swap study: how far are ESM-2's outputs with FAVOR+ instead of softmax attention?

Same weights, only the attention core changes (no fine-tuning): for every kernel and number of
random features m, the FAVOR+ twin's logits are compared with the exact model's at the residue
positions (not <cls>/<eos>/pads) of unmasked sequences from a FASTA file:

- KL(exact || favor) of the per-position token distributions, averaged over positions;
- top-1 agreement: the fraction of positions whose argmax token is the same;
- contact maps (``predict_contacts`` with the model's contact regression, e.g. ESM-2's contact
  head; a random model gets the sum-APC regression, weight 1 on every layer x head):
  mean |delta p| over pairs with |i - j| >= 6, and the overlap of the top-L/5 long-range
  (|i - j| >= 24) contacts of the exact and the FAVOR+ maps, averaged over sequences.

Each (kernel, m) is repeated with several seeds of the random features; the CSV has one row per
seed, the markdown tables the mean and standard deviation over seeds.

The model is a fair-esm .pt, a Hugging Face EsmForMaskedLM directory, or an export/checkpoint
of this project (converted weights). Without --checkpoint a random small ESM-2 is built, as
fair-esm initializes one (N(0, 1) embeddings, PyTorch's default Linear init): the numbers then
only show the estimator's behaviour on unstructured attention and say little about a trained
ESM-2, whose attention is much peakier. Weights cannot be downloaded here; run it with a real
esm2_t6_8M_UR50D.pt (or esm2_t12_35M_UR50D.pt) where you have one.

Examples::

    python scripts/studies/esm_favor_swap.py --help
    python scripts/studies/esm_favor_swap.py --quick
    python scripts/studies/esm_favor_swap.py --checkpoint esm2_t6_8M_UR50D.pt --seeds 3 \\
        --out-dir outputs/esm_favor_swap/esm2_8M
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import harness as h
import numpy as np
import torch
import torch.nn.functional as F

from protein_performer.contacts.predict import predict_contacts
from protein_performer.data.tokenizer import Alphabet
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from protein_performer.model.config import PerformerConfig
from protein_performer.model.contact_head import ContactRegression
from protein_performer.model.performer import PerformerLM

log = logging.getLogger("esm_favor_swap")

KERNELS = ("softmax", "softmax_hyp", "softmax_opt", "relu")
FULL_M = tuple(2**i for i in range(6, 13))  # 64 .. 4096
QUICK_M = (64, 256, 1024)
FIELDS = ("kernel", "m", "seed", "kl", "top1", "contact_dp", "contact_overlap", "seconds")


def random_esm2(dim: int, depth: int, heads: int, seed: int) -> PerformerLM:
    """An exact-attention ESM-2 initialized the way fair-esm's ``ESM2`` is (not BERT's 0.02),
    so attention is not trivially uniform."""
    torch.manual_seed(seed)
    config = PerformerConfig(dim=dim, depth=depth, heads=heads, ff_dim=4 * dim, attention="exact",
                             token_dropout=True)
    model = PerformerLM(config)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    with torch.no_grad():
        torch.nn.init.normal_(model.embed_tokens.weight)
        model.embed_tokens.weight[config.pad_idx].zero_()
    return model.eval()


def batches(seqs: Sequence[str], toks_per_batch: int) -> list[torch.Tensor]:
    """Padded ``<cls> seq <eos>`` batches, longest first, under a padded-token budget."""
    from protein_performer.data.sampler import budget_batches

    groups = budget_batches([len(s) + 2 for s in seqs], toks_per_batch)
    return [Alphabet().encode_batch([seqs[i] for i in group]) for group in groups]


@torch.no_grad()
def compare(exact_logps: list[torch.Tensor], favor: PerformerLM, token_batches: list[torch.Tensor],
            masks: list[torch.Tensor]) -> tuple[float, float]:
    """Mean KL(exact || favor) and top-1 agreement over all residue positions."""
    kl_sum, agree, n = 0.0, 0, 0
    for logp_e, tokens, keep in zip(exact_logps, token_batches, masks, strict=True):
        logp_f = F.log_softmax(favor(tokens).logits.double(), dim=-1)[keep]  # (N, V)
        kl = (logp_e.exp() * (logp_e - logp_f)).sum(-1)  # (N,)
        kl_sum += kl.sum().item()
        agree += (logp_e.argmax(-1) == logp_f.argmax(-1)).sum().item()
        n += keep.sum().item()
    return kl_sum / n, agree / n


def contact_maps(loaded: LoadedModel, seqs: Sequence[str], reg: ContactRegression) -> list:
    """Dense contact probabilities of every sequence under ``reg``."""
    return [
        predict_contacts(loaded, s, reg, dense_max_length=len(s), checked=True).dense for s in seqs
    ]


def contact_change(exact: list[np.ndarray], favor: list[np.ndarray]) -> tuple[float, float]:
    """Mean |delta p| over pairs |i - j| >= 6, and the top-L/5 long-range (|i - j| >= 24)
    overlap, each averaged over sequences."""
    dps, overlaps = [], []
    for pe, pf in zip(exact, favor, strict=True):
        L = len(pe)
        i, j = np.triu_indices(L, 6)
        dps.append(float(np.abs(pe[i, j] - pf[i, j]).mean()) if len(i) else 0.0)
        li, lj = np.triu_indices(L, 24)
        k = max(1, L // 5)
        if len(li) >= k:
            top_e = set(np.argsort(-pe[li, lj], kind="stable")[:k].tolist())
            top_f = set(np.argsort(-pf[li, lj], kind="stable")[:k].tolist())
            overlaps.append(len(top_e & top_f) / k)
    return statistics.fmean(dps), (statistics.fmean(overlaps) if overlaps else math.nan)


def summarize(rows: list[dict], kernels: Sequence[str], ms: Sequence[int]) -> str:
    """Two markdown tables (KL, top-1), kernels as rows and m as columns, mean ± sd over seeds."""

    lines = []
    for key, title, digits in (
        ("kl", "Mean KL(exact || favor) per residue (nats)", 4),
        ("top1", "Top-1 agreement with exact", 3),
        ("contact_dp", "Contact maps: mean |delta p| per pair (|i - j| >= 6)", 4),
        ("contact_overlap", "Contact maps: top-L/5 long-range (|i - j| >= 24) overlap", 3)):
        body = [[kernel, *(h.cell([r[key] for r in h.select(rows, kernel=kernel, m=m)], 1, digits)
                           for m in ms)] for kernel in kernels]  # fmt: skip
        lines += [f"### {title}", "", h.markdown_table(["kernel", *(f"m={m}" for m in ms)], body,
                                                        left=1 + len(ms)), ""]  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument(
        "--checkpoint", type=Path, default=None,
        help="fair-esm .pt, HF EsmForMaskedLM dir, or our export/.ckpt (default: random ESM-2)")
    demo = h.REPO / "protein_performer" / "data" / "demo"
    p.add_argument("--fasta", type=Path, default=demo / "some_proteins.fasta")
    p.add_argument("--max-records", type=int, default=15)
    p.add_argument("--max-len", type=int, default=512, help="crop (incl. <cls>/<eos>)")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--ms", nargs="+", type=int, default=list(FULL_M), help="numbers of features")
    p.add_argument("--seeds", type=int, default=3, help="feature seeds per (kernel, m)")
    p.add_argument("--toks-per-batch", type=int, default=4096)
    p.add_argument(
        "--random-shape", nargs=3, type=int, default=(320, 6, 20),
        metavar=("DIM", "DEPTH", "HEADS"),
        help="shape of the random ESM-2 when no checkpoint is given (default: ESM-2 8M)")
    p.add_argument("--out-dir", type=Path, default=h.REPO / "outputs" / "esm_favor_swap")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quick", action="store_true",
                   help="seconds: tiny random model, 3 short records, m in 64/256/1024, one seed")
    args = p.parse_args(argv)
    if args.quick:
        args.max_records = min(args.max_records, 3)
        args.max_len = min(args.max_len, 128)
        args.ms = [m for m in args.ms if m in QUICK_M] or list(QUICK_M)
        args.seeds = 1
        if args.checkpoint is None:
            args.random_shape = (64, 2, 4)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    h.setup_logging()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.checkpoint is None:
        dim, depth, heads = args.random_shape
        exact = random_esm2(dim, depth, heads, seed=0)
        source = f"random ESM-2 (dim {dim}, depth {depth}, heads {heads}; fair-esm init)"
        log.warning("no --checkpoint: %s; random weights make this study less meaningful", source)
        regression = None
    else:
        loaded = load_model(args.checkpoint, "cpu", attention="exact")
        exact = loaded.model
        source = str(args.checkpoint)
        regression = loaded.contact_regression
    cfg = exact.config
    held = LoadedModel(exact, cfg, Alphabet(), Path(source), torch.device("cpu"), "memory")
    if regression is None:
        n = cfg.depth * cfg.heads
        reg = ContactRegression(np.ones(n), 0.0, list(range(1, cfg.depth + 1)),
                                list(range(cfg.heads)))
        reg_name = "the sum-APC regression (no contact head)"
    else:
        reg = ContactRegression.from_dict(regression, source)
        reg_name = "the model's contact regression"
    from protein_performer.data.inputs import read_records

    records = read_records(args.fasta, on_invalid="skip")[: args.max_records]
    seqs = [r.sequence[: args.max_len - 2] for r in records]
    token_batches = batches(seqs, args.toks_per_batch)
    masks = [~torch.isin(t, torch.tensor(Alphabet().special_idx)) for t in token_batches]
    with torch.no_grad():
        exact_logps = [
            F.log_softmax(exact(t).logits.double(), dim=-1)[k]
            for t, k in zip(token_batches, masks, strict=True)
        ]
    exact_contacts = contact_maps(held, seqs, reg)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    csv_path = args.out_dir / "swap.csv"
    for kernel in args.kernels:
        for m in args.ms:
            for seed in range(args.seeds):
                start = time.perf_counter()
                favor = load_model(held, "cpu", attention="favor", kernel=kernel, nb_features=m,
                                   seed=seed)  # fmt: skip
                kl, top1 = compare(exact_logps, favor.model, token_batches, masks)
                dp, overlap = contact_change(exact_contacts, contact_maps(favor, seqs, reg))
                rows.append({"kernel": kernel, "m": m, "seed": seed, "kl": kl, "top1": top1,
                             "contact_dp": dp, "contact_overlap": overlap,
                             "seconds": round(time.perf_counter() - start, 3)})  # fmt: skip
                if not math.isfinite(kl):
                    log.warning("%s m=%d seed=%d: non-finite KL", kernel, m, seed)
                log.info("%-11s m=%-5d seed=%d KL=%.4g top1=%.3f contacts |dp|=%.4f overlap=%.3f",
                         kernel, m, seed, kl, top1, dp, overlap)  # fmt: skip
    h.write_csv(csv_path, rows, FIELDS)

    n_res = sum(int(k.sum()) for k in masks)
    header = (
        f"## FAVOR+ swap: {source}\n\n{len(seqs)} sequences from {args.fasta.name} (cropped to "
        f"{args.max_len} tokens), {n_res} residue positions, {args.seeds} feature seed(s); no "
        f"fine-tuning; contacts from {reg_name}.\n\n"
    )
    table = header + summarize(rows, args.kernels, args.ms)
    (args.out_dir / "swap.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    log.info("wrote %s and %s", csv_path, args.out_dir / "swap.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
