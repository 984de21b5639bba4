"""Perplexity and accuracy of a checkpoint on held-out data, overall and per length bin.

``measure(loaded, data, ...)`` is a plain function of a loaded model and keyword settings (the
``eval`` command's flags), so tests, scripts and notebooks call it directly; the command's files
(``metrics.json``, ``bins.csv``) are :func:`protein_performer.jobs.evaluate.evaluate`'s.

What is measured, by objective:

* MLM, default: the training-time masking (15% selected; 80/10/10) drawn from a fixed seed per
  record (``default_rng([seed, 0, index])``, the dataset's own rule), so two checkpoints are
  compared on the very same masked positions. Loss, perplexity and accuracy over those positions.
* MLM, ``pll=True``: exact pseudo-perplexity, every residue masked once (L passes per record).
* CLM: every next-token prediction, ``<eos>`` included.

Length bins group records by their residue count, because the interesting question for a
Performer is whether quality holds up on long proteins, which a corpus mean hides.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protein_performer.errors import UserError

if TYPE_CHECKING:
    from protein_performer.interop.record import LoadedModel

log = logging.getLogger(__name__)

#: Upper edges of the default length bins: <=256, 257-512, 513-1024, >1024 residues.
DEFAULT_BINS = (256, 512, 1024)


def bin_labels(edges: Sequence[int]) -> list[str]:
    """``[256, 512]`` -> ``["<=256", "257-512", ">512"]``."""
    labels, low = [], 0
    for e in edges:
        labels.append(f"<={e}" if low == 0 else f"{low + 1}-{e}")
        low = e
    labels.append(f">{low}")
    return labels


def _metrics(nll: float, tokens: int, correct: int) -> dict[str, float | None]:
    if tokens == 0:
        return {"loss": None, "ppl": None, "acc": None}
    loss = nll / tokens
    return {"loss": loss, "ppl": math.exp(loss), "acc": correct / tokens}


def _source(
    data: str | os.PathLike[str], split: str, limit: int | None, on_invalid: str, alphabet: Any
) -> tuple[Any, str]:
    """A record source for ``data``: a store split or every record of a FASTA (``-``: stdin)."""
    from protein_performer.data.dataset import InMemorySource, StoreSubset
    from protein_performer.data.inputs import open_input, read_records

    opened = open_input(data)
    store, path = opened.store, opened.path
    if store is not None:
        try:
            indices = store.indices(split)
        except ValueError as exc:
            raise UserError(f"--split {split}: {exc}") from None
        if limit is not None:
            indices = indices[:limit]
        if len(indices) == 0:
            raise UserError(f"{path}: split {split!r} has no records")
        return StoreSubset(store, indices), f"store split {split}"
    records = read_records(data, on_invalid)
    if limit is not None:
        records = records[:limit]
    ids = [r.id for r in records]
    return InMemorySource(ids, [alphabet.encode(r.sequence) for r in records]), "fasta (all)"


def measure(
    loaded: LoadedModel,
    data: str | os.PathLike[str],
    *,
    split: str = "valid",
    max_len: int | None = None,
    limit: int | None = None,
    toks_per_batch: int = 8192,
    seed: int = 0,
    mlm_prob: float = 0.15,
    pll: bool = False,
    bins: Sequence[int] = DEFAULT_BINS,
    on_invalid: str = "error",
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate ``loaded`` on ``data`` (a FASTA file, ``-`` for standard input, or a store
    directory, of which ``split`` is read): the metrics ``overall`` and per length bin
    (``bins``), with the settings that made them.

    ``max_len`` counts ``<cls>``/``<eos>``: longer records keep their first ``max_len - 2``
    residues (None: no cropping). ``seed``/``mlm_prob`` fix the MLM masks, so two checkpoints
    are compared on the same positions; ``pll`` scores exact pseudo-perplexity instead.
    ``bins`` are the length bins' upper edges in residues."""
    from protein_performer.data.dataset import ProteinCollator, ProteinDataset
    from protein_performer.data.masking import IGNORE_INDEX
    from protein_performer.data.sampler import budget_batches
    from protein_performer.inference.scoring import masked_log_probs
    from protein_performer.io.progress import progress as progress_bar

    source, described = _source(data, split, limit, on_invalid, loaded.alphabet)
    objective = loaded.config.objective
    lengths = np.asarray(source.lengths, dtype=np.int64)
    max_len = int(max_len) if max_len is not None else int(lengths.max()) + 2
    edges = sorted(int(e) for e in bins)
    labels = bin_labels(edges)
    bin_of = np.searchsorted(np.asarray(edges), lengths, side="left")  # <= edge -> that bin
    if pll and objective != "mlm":
        log.warning("pseudo-perplexity applies to MLM checkpoints only; scoring all positions")
    pll = pll and objective == "mlm"
    budget = int(toks_per_batch)

    per_record = np.zeros((len(source), 3), dtype=np.float64)  # nll, tokens, correct
    dataset = ProteinDataset(
        source,
        objective,
        max_len=max_len,
        crop="fixed",
        mlm_prob=float(mlm_prob),
        seed=int(seed),
        alphabet=loaded.alphabet,
    )
    collate = ProteinCollator(loaded.alphabet)
    bar = progress_bar(int(np.minimum(lengths, max_len - 2).sum()), "res", "eval", progress)
    with bar, torch.inference_mode():
        if pll:
            for i in range(len(source)):
                ids = source.tokens(i)[: max_len - 2].astype(np.int64)
                seq = loaded.alphabet.decode(ids)
                lps = masked_log_probs(loaded, seq, [[j] for j in range(len(ids))], budget)
                lp = np.stack([x[0] for x in lps])  # (L, V)
                true = lp[np.arange(len(ids)), ids]
                per_record[i] = (-true.sum(), len(ids), (lp.argmax(-1) == ids).sum())
                bar.update(len(ids))
        else:
            model_lengths = dataset.model_lengths()
            for batch_idx in budget_batches(model_lengths, budget):
                batch = collate([dataset[(i, 0)] for i in batch_idx])
                tokens = batch["tokens"].to(loaded.device)
                targets = batch["targets"].to(loaded.device)
                logits = loaded.model(tokens, padding_mask=batch["padding_mask"]).logits
                valid = targets != IGNORE_INDEX  # (B, T)
                nll = torch.nn.functional.cross_entropy(
                    logits.float().transpose(1, 2),  # (B, V, T)
                    targets,
                    ignore_index=IGNORE_INDEX,
                    reduction="none",
                )  # (B, T)
                correct = (logits.argmax(-1) == targets) & valid
                sums = torch.stack(
                    [nll.sum(1), valid.sum(1).to(nll), correct.sum(1).to(nll)], dim=1
                )
                per_record[batch_idx] = sums.double().cpu().numpy()
                bar.update(int(sum(model_lengths[i] - 2 for i in batch_idx)))

    overall = {
        "records": len(source),
        "tokens": int(per_record[:, 1].sum()),
        **_metrics(
            per_record[:, 0].sum(), int(per_record[:, 1].sum()), int(per_record[:, 2].sum())
        ),
    }
    bins = []
    for b, label in enumerate(labels):
        sel = bin_of == b
        sums = per_record[sel].sum(0)
        bins.append(
            {
                "bin": label,
                "records": int(sel.sum()),
                "tokens": int(sums[1]),
                **_metrics(sums[0], int(sums[1]), int(sums[2])),
            }
        )
    method = (
        "exact pseudo-perplexity (every residue masked once)"
        if pll
        else (
            f"masked positions (mlm_prob={mlm_prob}, seed={seed})"
            if objective == "mlm"
            else "all next-token predictions incl. <eos>"
        )
    )
    return {
        "checkpoint": str(loaded.source),
        "data": str(data),
        "source": described,
        "objective": objective,
        "method": method,
        "max_len": max_len,
        "overall": overall,
        "bins": bins,
    }
