"""ESM-2-compatible vocabulary, so ESM-2 weights load into our models index for index.

The order of the 33 tokens is ESM-2's (``esm.data.Alphabet.from_architecture("ESM-1b")``):
four specials, the 20 standard amino acids ordered by frequency, the non-standard letters
``X B U Z O``, the gap/insertion symbols ``. -``, ``<null_1>`` and ``<mask>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from protein_performer.errors import UserError

if TYPE_CHECKING:  # torch is imported lazily: CLI paths that never batch stay fast to start
    import torch

SPECIAL_PREFIX = ("<cls>", "<pad>", "<eos>", "<unk>")
STANDARD_AA = tuple("LAGVSERTIDPKQNFYMHWC")
EXTRA_LETTERS = tuple("XBUZO.-")
SPECIAL_SUFFIX = ("<null_1>", "<mask>")
ESM2_TOKENS: tuple[str, ...] = SPECIAL_PREFIX + STANDARD_AA + EXTRA_LETTERS + SPECIAL_SUFFIX

#: Single-character symbols allowed inside a sequence (after upper-casing).
SEQUENCE_LETTERS: frozenset[str] = frozenset(STANDARD_AA + EXTRA_LETTERS)


class Alphabet:
    """The vocabulary: token <-> index, with special indices as attributes.

    Encoding works on whole sequences through a 256-entry byte lookup table, so tokenizing a
    UniRef-sized corpus costs one ``np.frombuffer`` and one fancy-index per record.
    """

    def __init__(self, tokens: Sequence[str] = ESM2_TOKENS) -> None:
        self.tokens: tuple[str, ...] = tuple(tokens)
        self.tok_to_idx: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}
        self.cls_idx = self.tok_to_idx["<cls>"]
        self.bos_idx = self.cls_idx
        self.pad_idx = self.tok_to_idx["<pad>"]
        self.eos_idx = self.tok_to_idx["<eos>"]
        self.unk_idx = self.tok_to_idx["<unk>"]
        self.mask_idx = self.tok_to_idx["<mask>"]
        self.special_idx: tuple[int, ...] = tuple(
            i for i, t in enumerate(self.tokens) if t.startswith("<")
        )
        self.standard_idx: tuple[int, ...] = tuple(self.tok_to_idx[a] for a in STANDARD_AA)
        # byte -> index; 255 marks a byte that is not a sequence letter.
        lut = np.full(256, 255, dtype=np.uint8)
        for t, i in self.tok_to_idx.items():
            if len(t) == 1:
                lut[ord(t)] = i
        self._lut = lut

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, seq: str) -> np.ndarray:
        """Residue letters -> uint8 token ids, without BOS/EOS.

        Raises ``ValueError`` naming the first bad character: callers that know the file and
        record wrap it into a located error.
        """
        raw = np.frombuffer(seq.encode("latin-1", errors="replace"), dtype=np.uint8)
        ids = self._lut[raw]
        bad = np.flatnonzero(ids == 255)
        if bad.size:
            pos = int(bad[0])
            raise ValueError(
                f"invalid residue {seq[pos]!r} at position {pos + 1} "
                f"(allowed: {''.join(STANDARD_AA + EXTRA_LETTERS)})"
            )
        return ids

    def decode(
        self, ids: Sequence[int] | np.ndarray | torch.Tensor, strip_special: bool = True
    ) -> str:
        """Token ids -> string; specials are dropped unless ``strip_special`` is False."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        for i in ids:
            tok = self.tokens[int(i)]
            if strip_special and len(tok) > 1:
                continue
            out.append(tok)
        return "".join(out)

    def check_residues(self, seq: str, where: str) -> None:
        """Refuse ``seq`` if it holds a letter outside the vocabulary: one UserError, the
        tokenizer's words located at ``where`` (the record a caller reads)."""
        try:
            self.encode(seq)
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None

    def encode_with_specials(self, seq: str) -> np.ndarray:
        """``<cls> residues <eos>`` as int64, the layout every model input uses."""
        body = self.encode(seq).astype(np.int64)
        return np.concatenate(([self.cls_idx], body, [self.eos_idx]))

    def encode_batch(self, seqs: Sequence[str]) -> torch.Tensor:
        """``(B, 2 + max_len)`` int64: ``<cls>`` + residues + ``<eos>``, right-padded with
        ``<pad>``; the one batch encoder (ESM's ``BatchConverter`` without the labels)."""
        return pad_token_arrays([self.encode_with_specials(s) for s in seqs], self.pad_idx)


def pad_token_arrays(arrays: Sequence[np.ndarray], pad_idx: int) -> torch.Tensor:
    """Right-pad 1-D int arrays into a ``(B, max_len)`` int64 tensor."""
    import torch

    width = max((len(a) for a in arrays), default=0)
    out = torch.full((len(arrays), width), pad_idx, dtype=torch.long)
    for row, a in enumerate(arrays):
        out[row, : len(a)] = torch.as_tensor(np.asarray(a, dtype=np.int64))
    return out
