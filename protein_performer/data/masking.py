"""Training targets: BERT-style masking (MLM) and next-token shift (CLM), pure numpy.

Kept free of torch so it runs inside DataLoader workers cheaply and is testable exactly; the
caller owns the random generator, which is how masks become reproducible per
(seed, epoch, index) (fairseq ``mask_tokens_dataset.py``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from protein_performer.data.tokenizer import Alphabet

#: Target value that ``torch.nn.functional.cross_entropy`` ignores.
IGNORE_INDEX = -100


@lru_cache(maxsize=8)
def _tables(tokens: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(is_special lookup table, standard amino-acid ids) for a vocabulary, built once."""
    alphabet = Alphabet(tokens)
    special = np.zeros(len(alphabet), dtype=bool)
    special[list(alphabet.special_idx)] = True
    return special, np.asarray(alphabet.standard_idx, dtype=np.int64)


def maskable_positions(tokens: np.ndarray, alphabet: Alphabet) -> np.ndarray:
    """True where a token may be selected: residues only, never ``<cls> <pad> <eos> <mask>``..."""
    return ~_tables(alphabet.tokens)[0][tokens]


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
    random standard amino acid (uniform over the 20), the rest keep their token. Rows of a
    (B, T) input are drawn one after another from ``rng``.

    Returns ``(inputs, targets)``, both int64 with the shape of ``tokens``: targets hold the
    original token at selected positions and ``IGNORE_INDEX`` elsewhere.
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if mask_frac < 0 or random_frac < 0 or mask_frac + random_frac > 1.0:
        raise ValueError(f"need mask_frac + random_frac <= 1, got {mask_frac} + {random_frac}")
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1:
        pairs = [
            _mask_row(row, alphabet, rng, mask_prob, mask_frac, random_frac)
            for row in tokens.reshape(-1, tokens.shape[-1])
        ]
        inputs = np.stack([p[0] for p in pairs]).reshape(tokens.shape)
        return inputs, np.stack([p[1] for p in pairs]).reshape(tokens.shape)
    return _mask_row(tokens, alphabet, rng, mask_prob, mask_frac, random_frac)


def _mask_row(
    tokens: np.ndarray,
    alphabet: Alphabet,
    rng: np.random.Generator,
    mask_prob: float,
    mask_frac: float,
    random_frac: float,
) -> tuple[np.ndarray, np.ndarray]:
    """One (T,) row; draws are O(selected), so a 1024-token item costs tens of microseconds."""
    positions = np.flatnonzero(maskable_positions(tokens, alphabet))  # (n,)
    n = len(positions)
    count = int(np.floor(mask_prob * n + rng.random()))
    count = min(max(count, 1 if n else 0), n)
    # The `count` smallest of n uniform keys: a uniform subset without replacement.
    chosen = positions[np.argpartition(rng.random(n), count - 1)[:count]] if count else positions
    action = rng.random(count)  # (k,): one draw decides mask / random / keep

    inputs = tokens.copy()
    to_mask = action < mask_frac
    to_random = (action >= mask_frac) & (action < mask_frac + random_frac)
    # Inside the random band the draw is again uniform: reuse it to pick the amino acid.
    standard = _tables(alphabet.tokens)[1]
    pick = ((action[to_random] - mask_frac) / random_frac * len(standard)).astype(np.int64)
    inputs[chosen[to_mask]] = alphabet.mask_idx
    inputs[chosen[to_random]] = standard[np.minimum(pick, len(standard) - 1)]
    targets = np.full_like(tokens, IGNORE_INDEX)
    targets[chosen] = tokens[chosen]
    return inputs, targets


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
