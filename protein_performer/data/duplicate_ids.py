"""Repeated ids among ~1e8 records in bounded memory (:class:`DuplicateIdChecker`): the index the
FASTA reader and ``preprocess`` ask whether an id was seen before."""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np


class DuplicateIdChecker:
    """Finds repeated ids among ~1e8 records in about 12 bytes per id.

    Keeps a 64-bit hash of each id with a uint32 tag (the caller's record ordinal) in a few sorted
    numpy runs, merged like an LSM tree so each id is moved O(log n) times and the newest run stays
    small. The hash is vectorised and deterministic (unlike ``hash()``), so a rerun behaves the
    same. Two different ids with the same 64-bit hash would be reported as duplicates: expected
    about once in 10^4 runs over 60 million ids.
    """

    _MERGE_FACTOR = 4
    _LONG_ID = 64  # characters; longer ids are hashed one by one
    _SEED = np.uint64(0x243F6A8885A308D3)
    _M1 = np.uint64(0xBF58476D1CE4E5B9)
    _M2 = np.uint64(0x94D049BB133111EB)

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted uint64 keys, uint32 tags)

    def __len__(self) -> int:
        return sum(len(k) for k, _ in self._runs)

    @classmethod
    def hash_ids(cls, ids: Sequence[str]) -> np.ndarray:
        """uint64 hash per id, a function of the id alone (not of the batch it came in).

        8-byte words of the UCS-4 text are mixed column by column; a row skips the all-zero
        words, which are the padding up to the batch's longest id (ids hold no NUL). Ids
        longer than ``_LONG_ID`` characters, which would make the matrix huge, are hashed one
        by one with blake2b.
        """
        arr = np.array(ids, dtype=str)
        width = arr.dtype.itemsize // 4
        if width > cls._LONG_ID:
            lens = np.fromiter(map(len, ids), np.int64, len(ids))
            h = np.empty(len(ids), dtype=np.uint64)
            for i in np.flatnonzero(lens > cls._LONG_ID).tolist():
                raw = ids[i].encode("utf-8", "surrogatepass")
                h[i] = np.frombuffer(blake2b(raw, digest_size=8).digest(), np.uint64)[0]
            short = np.flatnonzero(lens <= cls._LONG_ID)
            if short.size:
                h[short] = cls.hash_ids([ids[i] for i in short.tolist()])
            return h
        if width % 2:
            width += 1
            arr = arr.astype(f"U{width}")
        cols = arr.view(np.uint64).reshape(len(ids), width // 2)
        h = np.full(len(ids), cls._SEED, dtype=np.uint64)
        s29, s31, s27 = np.uint64(29), np.uint64(31), np.uint64(27)
        for j in range(width // 2):
            col = cols[:, j]
            x = h ^ col
            x *= cls._M1
            x ^= x >> s29
            h = np.where(col != 0, x, h)
        h ^= h >> s31  # splitmix64 finaliser
        h *= cls._M2
        h ^= h >> s27
        return h

    def check(self, ids: Sequence[str], tags: np.ndarray | Sequence[int]) -> np.ndarray:
        """Add ids (in order) and return, per id, the tag of an earlier equal id or -1."""
        if len(ids) == 0:
            return np.empty(0, dtype=np.int64)
        return self.check_hashes(self.hash_ids(ids), tags)

    def check_hashes(self, keys: np.ndarray, tags: np.ndarray | Sequence[int]) -> np.ndarray:
        """:meth:`check` for ids already hashed with :meth:`hash_ids` ((n,) uint64), e.g. by
        the worker processes of a parallel preprocess."""
        keys = np.asarray(keys, dtype=np.uint64)
        if len(keys) == 0:
            return np.empty(0, dtype=np.int64)
        tags = np.asarray(tags, dtype=np.int64)
        if tags.min() < 0 or tags.max() >= 2**32:
            raise ValueError("DuplicateIdChecker tags must fit in uint32")
        order = np.argsort(keys, kind="stable")  # equal ids keep their input order
        skeys, stags = keys[order], tags[order]
        is_first = np.ones(len(skeys), dtype=bool)
        is_first[1:] = skeys[1:] != skeys[:-1]
        run_start = np.maximum.accumulate(np.where(is_first, np.arange(len(skeys)), 0))
        first_tag = np.where(is_first, -1, stags[run_start])
        for rkeys, rtags in self._runs:  # the first of each run may repeat an earlier call's id
            pos = np.minimum(np.searchsorted(rkeys, skeys), len(rkeys) - 1)
            hit = rkeys[pos] == skeys
            if hit.any():
                first_tag = np.where(hit, rtags[pos].astype(np.int64), first_tag)
        new = is_first & (first_tag < 0)
        if new.any():
            self._runs.append((skeys[new], stags[new].astype(np.uint32)))
            self._compact()
        out = np.empty(len(keys), dtype=np.int64)
        out[order] = first_tag
        return out

    def _compact(self) -> None:
        runs = self._runs
        while len(runs) >= 2 and len(runs[-1][0]) * self._MERGE_FACTOR >= len(runs[-2][0]):
            (k2, t2), (k1, t1) = runs.pop(), runs.pop()
            keys = np.concatenate([k1, k2])
            tags = np.concatenate([t1, t2])
            order = np.argsort(keys, kind="stable")  # timsort: one linear merge of two runs
            runs.append((keys[order], tags[order]))
