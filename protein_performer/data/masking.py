"""Training targets: BERT-style masking (MLM) and next-token shift (CLM), pure numpy.

Kept free of torch so it runs inside DataLoader workers cheaply and is testable exactly; the
caller owns the random generator, which is how masks become reproducible per
(seed, epoch, index) (fairseq ``mask_tokens_dataset.py``).
"""

from __future__ import annotations

import numpy as np

from protein_performer.data.tokenizer import Alphabet

#: Target value that ``torch.nn.functional.cross_entropy`` ignores.
IGNORE_INDEX = -100


def maskable_positions(tokens: np.ndarray, alphabet: Alphabet) -> np.ndarray:
    """True where a token may be selected: residues only, never ``<cls> <pad> <eos> <mask>``..."""
    return ~np.isin(tokens, np.asarray(alphabet.special_idx))


def mlm_mask(
    tokens: np.ndarray,
    alphabet: Alphabet,
    rng: np.random.Generator,
    mask_prob: float = 0.15,
    mask_frac: float = 0.8,
    random_frac: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """Select ``mask_prob`` of the residues of each row and corrupt them 80/10/10.

    ``tokens``: int array (T,) or (B, T) with specials and padding. The number selected per row is
    ``floor(mask_prob * n + u)``, u ~ U[0, 1) (unbiased rounding: short sequences get the right
    rate on average) and at least 1 when the row has any residue, so every sequence contributes
    to the loss. Of the selected positions, ``mask_frac`` become ``<mask>``, ``random_frac`` a
    random standard amino acid (uniform over the 20), the rest keep their token.

    Returns ``(inputs, targets)``, both int64 with the shape of ``tokens``: targets hold the
    original token at selected positions and ``IGNORE_INDEX`` elsewhere.
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if mask_frac < 0 or random_frac < 0 or mask_frac + random_frac > 1.0:
        raise ValueError(f"need mask_frac + random_frac <= 1, got {mask_frac} + {random_frac}")
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = tokens.reshape(1, -1) if tokens.ndim == 1 else tokens  # (B, T)
    maskable = maskable_positions(rows, alphabet)  # (B, T)
    n = maskable.sum(axis=1)  # (B,)
    count = np.floor(mask_prob * n + rng.random(n.shape)).astype(np.int64)
    count = np.minimum(np.maximum(count, (n > 0).astype(np.int64)), n)  # (B,)

    # Choose `count` maskable positions per row without replacement: rank random keys, with
    # non-maskable positions pushed to the end.
    keys = np.where(maskable, rng.random(rows.shape), 2.0)  # (B, T)
    ranks = np.argsort(np.argsort(keys, axis=1, kind="stable"), axis=1, kind="stable")
    selected = ranks < count[:, None]  # (B, T)

    action = rng.random(rows.shape)  # (B, T): one draw decides mask / random / keep
    to_mask = selected & (action < mask_frac)
    to_random = selected & (action >= mask_frac) & (action < mask_frac + random_frac)
    standard = np.asarray(alphabet.standard_idx, dtype=np.int64)
    random_tokens = standard[rng.integers(0, len(standard), size=rows.shape)]  # (B, T)

    inputs = np.where(to_mask, alphabet.mask_idx, rows)
    inputs = np.where(to_random, random_tokens, inputs)
    targets = np.where(selected, rows, IGNORE_INDEX)
    return inputs.reshape(tokens.shape), targets.reshape(tokens.shape)


def causal_targets(tokens: np.ndarray, pad_idx: int) -> np.ndarray:
    """Next-token targets: ``targets[..., t] = tokens[..., t + 1]``, -100 at the end and on pads.

    With ``<cls> residues <eos>`` rows this trains every residue and ``<eos>``; the last real
    position (``<eos>``) and padding get ``IGNORE_INDEX``.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    targets = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    nxt = tokens[..., 1:]  # (..., T-1)
    valid = (nxt != pad_idx) & (tokens[..., :-1] != pad_idx)
    targets[..., :-1] = np.where(valid, nxt, IGNORE_INDEX)
    return targets
