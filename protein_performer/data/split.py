"""Deterministic train/valid/test assignment by hashing a key.

Hashing (rather than shuffling) means the split of a record depends only on its key, not on the
order or size of the corpus: re-running, appending files or sharding the input never moves a
record between splits. Keying on the UniRef cluster id keeps every member of a cluster in the same
split, so near-duplicates cannot leak from train into valid/test. ``preprocess --cluster-split``
goes further (:class:`Groups`): it hashes MMseqs2 clusters (``data.homology``) instead, and can
hold whole clusters or taxa out as a fourth, out-of-distribution split (``ood``) that training
never reads.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from protein_performer.errors import UserError

SplitMode = Literal["auto", "id", "cluster"]
SPLIT_MODES: tuple[str, ...] = ("auto", "id", "cluster")

TRAIN, VALID, TEST, OOD = 0, 1, 2, 3
#: Split code -> name; the code is what the store keeps (one uint8 per record). ``ood`` holds
#: the groups held out by ``preprocess --ood-frac/--ood-taxa`` (empty otherwise).
SPLIT_NAMES: tuple[str, ...] = ("train", "valid", "test", "ood")
SPLIT_CODES: dict[str, int] = {name: code for code, name in enumerate(SPLIT_NAMES)}

#: Defaults sized for corpora of thousands of records and up (2% each still gives a usable
#: validation set on the bundled sample); demo sets pass larger fractions such as 0.1.
DEFAULT_VALID_FRAC = 0.02
DEFAULT_TEST_FRAC = 0.02

_SCALE = float(2**64)


def check_fractions(valid_frac: float, test_frac: float) -> None:
    """Reject fractions that would leave no training data or make no sense."""
    for name, f in (("valid_frac", valid_frac), ("test_frac", test_frac)):
        if not 0.0 <= f < 1.0:
            raise UserError(f"{name} must be in [0, 1), got {f}")
    if valid_frac + test_frac >= 1.0:
        raise UserError(
            f"valid_frac + test_frac must be < 1 (got {valid_frac} + {test_frac}): "
            "nothing would be left for training"
        )


_UNIREF_ID = re.compile(r"UniRef(?:50|90|100)_[^\s|]+")  # no "|": those parse as UniProt


def cluster_of_id(ident: str) -> str | None:
    """The cluster id a UniRef record id stands for (``UniRef50_X`` -> itself), else None.

    Mirrors ``headers.parse_header`` (tests keep the two in step) so that chunks of ids can be
    split without parsing a header per record.
    """
    return ident if _UNIREF_ID.fullmatch(ident) else None


def cluster_of(record: Any) -> str | None:
    """The record's UniRef cluster id, or None.

    Only records whose id starts with ``UniRef`` can carry one (``headers.parse_header`` takes it
    from the id), so other headers are never parsed: parsing every header would cost more than
    reading the FASTA does.
    """
    if not record.id.startswith("UniRef"):
        return None
    return getattr(getattr(record, "header", None), "cluster_id", None) or None


def split_key(record: Any, mode: SplitMode = "auto") -> str:
    """The string hashed to choose a record's split.

    ``auto`` uses the UniRef cluster id when the header has one, else the record id;
    ``cluster`` insists on a cluster id (a user asking for it wants to know when it is missing);
    ``id`` always uses the record id. Cluster keys get a prefix so a cluster id can never
    collide with a record id of the same spelling.
    """
    if mode == "id":
        return record.id
    cluster = cluster_of(record)
    if cluster:
        return "cluster:" + cluster
    if mode == "cluster":
        where = f"{getattr(record, 'path', '?')}, record {getattr(record, 'number', '?')}"
        raise UserError(
            f"{where} ({record.id!r}) has no UniRef cluster id, but --split-by cluster was "
            "requested: use --split-by auto (falls back to the record id) or id"
        )
    if mode != "auto":
        raise UserError(f"unknown split mode {mode!r} (choose from {', '.join(SPLIT_MODES)})")
    return record.id


def key_hash(key: str) -> int:
    """64-bit blake2b of the key, as an unsigned integer (stable across runs and platforms)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def _cut(frac: float) -> np.uint64:
    """Smallest 64-bit hash *not* below ``frac``: ``h < frac * 2**64`` iff ``h < cut``."""
    return np.uint64(min(math.ceil(frac * _SCALE), 2**64 - 1))


def assign_split(key: str, valid_frac: float, test_frac: float) -> int:
    """0 train, 1 valid, 2 test for one hash key (:meth:`Splitter.bands`)."""
    return int(_splitter(valid_frac, test_frac).bands([key])[0])


@functools.lru_cache(maxsize=64)
def _splitter(valid_frac: float, test_frac: float) -> Splitter:
    return Splitter(valid_frac, test_frac)


#: ``OX=`` (UniProtKB) or ``TaxID=`` (UniRef) in a header's description.
_TAXID = re.compile(r"(?:^|\s)(?:OX|TaxID)=(\d+)")
_OOD_SALT = "ood:"


def taxid_of(description: str) -> int | None:
    """The NCBI taxon id of a header description (``OX=``/``TaxID=``), else None."""
    m = _TAXID.search(description)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Groups:
    """Homology groups and held-out (OOD) groups for :class:`Splitter`.

    ``clusters`` maps every record id to its MMseqs2 cluster representative; when given (and the
    mode is not ``id``), train/valid/test hash the cluster, so a cluster never straddles splits.
    ``ood_frac`` of the groups (clusters when given, else the usual split key) and every record
    whose ``OX=``/``TaxID=`` is in ``ood_taxa`` go to ``ood``. The OOD draw hashes the group
    with a salt, independent of the train/valid/test bands, so it is as deterministic as they are.
    """

    clusters: Mapping[str, str] | None = None
    ood_frac: float = 0.0
    ood_taxa: frozenset[int] = field(default_factory=frozenset)


class Splitter:
    """Split codes with the cut points precomputed, per record or per chunk of ids.

    Preprocessing uses :meth:`codes` on chunks of ids: one list comprehension of blake2b digests
    and two vectorised comparisons, about a microsecond per record.
    """

    def __init__(
        self,
        valid_frac: float,
        test_frac: float,
        mode: SplitMode = "auto",
        groups: Groups | None = None,
    ) -> None:
        check_fractions(valid_frac, test_frac)
        if mode not in SPLIT_MODES:
            raise UserError(f"unknown split mode {mode!r} (choose from {', '.join(SPLIT_MODES)})")
        self.mode = mode
        self.valid_frac = valid_frac
        self.test_frac = test_frac
        self.groups = groups or Groups()
        if not 0.0 <= self.groups.ood_frac < 1.0:
            raise UserError(f"ood_frac must be in [0, 1), got {self.groups.ood_frac}")
        self._test_cut = _cut(test_frac)
        self._valid_cut = _cut(test_frac + valid_frac)
        self._ood_cut = _cut(self.groups.ood_frac)

    def _cluster_keys(self, ids: Sequence[str]) -> list[str]:
        clusters = self.groups.clusters
        assert clusters is not None
        try:
            return ["mmseqs:" + clusters[i] for i in ids]
        except KeyError as exc:
            raise UserError(
                f"record {exc.args[0]!r} is missing from the MMseqs2 clustering of the input: "
                "cluster the same files that are preprocessed"
            ) from None

    def __call__(self, record: Any) -> int:
        """Split code of one record (same answer as :meth:`codes`)."""
        if self.groups != Groups():
            return int(self.codes([record.id], [getattr(record, "description", "")])[0])
        return int(self.bands([split_key(record, self.mode)])[0])

    def bands(self, keys: Sequence[str]) -> np.ndarray:
        """(n,) uint8 split codes of hash keys: the rule. Test takes the lowest hash band and
        valid the next one, so growing ``valid_frac`` never moves a record out of test."""
        h = _hashes(keys)
        out = np.zeros(len(h), dtype=np.uint8)
        out[h < self._valid_cut] = VALID
        out[h < self._test_cut] = TEST
        return out

    def keys(self, ids: Sequence[str]) -> list[str]:
        """Hash keys for a chunk of record ids, without parsing headers."""
        if self.mode == "id":
            return list(ids)
        if self.groups.clusters is not None:
            return self._cluster_keys(ids)
        keys = list(ids)
        if self.mode == "auto" and "UniRef" not in "\n".join(ids):
            return keys  # one C-level scan instead of a startswith per id
        for i in [i for i, k in enumerate(ids) if k.startswith("UniRef")]:
            cluster = cluster_of_id(ids[i])
            if cluster:
                keys[i] = "cluster:" + cluster
        if self.mode == "cluster":
            bad = next((k for k in keys if not k.startswith("cluster:")), None)
            if bad is not None:
                raise UserError(
                    f"record {bad!r} has no UniRef cluster id, but --split-by cluster was "
                    "requested: use --split-by auto (falls back to the record id) or id"
                )
        return keys

    def codes(self, ids: Sequence[str], descriptions: Sequence[str] | None = None) -> np.ndarray:
        """(n,) uint8 split codes for a chunk of record ids (and their header descriptions,
        needed only when taxa are held out)."""
        keys = self.keys(ids)
        out = self.bands(keys)
        g = self.groups
        if g.ood_frac > 0:
            group = self._cluster_keys(ids) if g.clusters is not None else keys
            out[_hashes([_OOD_SALT + k for k in group]) < self._ood_cut] = OOD
        if g.ood_taxa:
            if descriptions is None:
                raise ValueError("holding out taxa needs the header descriptions")
            taxa = [taxid_of(d) for d in descriptions]
            out[np.fromiter((t in g.ood_taxa for t in taxa), bool, len(taxa))] = OOD
        return out


def _hashes(keys: Sequence[str]) -> np.ndarray:
    """(n,) uint64 blake2b-64 of each key (big-endian, so int order = digest byte order)."""
    blake2b = hashlib.blake2b
    digests = b"".join([blake2b(k.encode("utf-8"), digest_size=8).digest() for k in keys])
    return np.frombuffer(digests, dtype=">u8")
