"""Hidden states of sequences as arrays: pooled (mean over residues, the ``<cls>`` position) or
one row per residue, for the layers asked (ESM's numbering).

Tensor work on a :class:`~protein_performer.interop.record.LoadedModel` only: ``lm.embed`` and
``lm.iter_embed`` (:mod:`protein_performer.inference.api`) call it, and the ``embed`` command's
file (:mod:`protein_performer.jobs.embed`) is written from what they return.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from protein_performer.data.sampler import budget_batches
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.progress import beat
from protein_performer.model.config import block_number

#: What the model's hidden states give per record.
HIDDEN_KINDS = ("mean", "per_tok", "bos")


def block_numbers(loaded: LoadedModel, layers: Sequence[int]) -> list[int]:
    """ESM numbering (negative from the end) -> the block number 0..depth of each layer, in
    the order given."""
    depth = loaded.config.depth
    return [block_number(i, depth, what="--repr-layers") for i in layers]


def resolve_layers(loaded: LoadedModel, layers: Sequence[int]) -> list[int]:
    """ESM numbering (negative from the end) -> sorted, unique block numbers 0..depth."""
    return sorted(set(block_numbers(loaded, layers)))


@torch.inference_mode()
def embed_sequences(
    loaded: LoadedModel,
    seqs: Sequence[str],
    layers: Sequence[int],
    include: Sequence[str] = ("mean",),
    toks_per_batch: int = 4096,
) -> Iterator[tuple[int, dict[str, dict[int, np.ndarray]]]]:
    """Yield ``(index, {include: {layer: array}})`` per sequence, in length-batched order.

    ``layers`` are block numbers 0..depth (:func:`resolve_layers`): the caller resolves them
    once for a whole input, not once per window. Each sequence sees exactly what it would see
    alone (padding is masked in attention and excluded from means), so results do not depend
    on the batch it landed in.
    """
    bad = sorted(set(include) - set(HIDDEN_KINDS))
    if bad or not include:
        raise UserError(f"embeddings take {', '.join(HIDDEN_KINDS)}; got {list(include)}")
    if any(not 0 <= n <= loaded.config.depth for n in layers):
        raise ValueError(f"layers {list(layers)} are not block numbers 0..depth (resolve_layers)")
    lengths = [len(s) + 2 for s in seqs]
    done = 0
    for batch in budget_batches(lengths, toks_per_batch):
        tokens = loaded.alphabet.encode_batch([seqs[i] for i in batch])  # (B, T)
        tokens = tokens.to(loaded.device)
        out = loaded.model(tokens, repr_layers=layers)
        done += len(batch)
        beat(f"{done}/{len(seqs)} sequences of this window")
        for row, i in enumerate(batch):
            L = len(seqs[i])
            result: dict[str, dict[int, np.ndarray]] = {k: {} for k in include}
            for layer in layers:
                h = out.hidden_states[layer][row].float()  # (T, D)
                if "per_tok" in include:
                    result["per_tok"][layer] = h[1 : L + 1].cpu().numpy()
                if "mean" in include:
                    result["mean"][layer] = h[1 : L + 1].mean(0).cpu().numpy()
                if "bos" in include:
                    result["bos"][layer] = h[0].cpu().numpy()
            yield i, result
