"""Homology clusters from MMseqs2, for splits that keep close relatives on one side.

Hashing record ids puts a protein in test while its 95%-identical sibling trains, so "held-out"
perplexity partly measures memorisation. ``preprocess --cluster-split IDENTITY`` clusters the
input with ``mmseqs easy-cluster`` first and hashes the cluster instead (``data.split.Groups``).
MMseqs2 is an optional external program, looked up on PATH; it is not a Python dependency.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer.data.hits import HIT_FIELDS, HOMOLOG_FORMAT, Homolog, alignment_coordinates
from protein_performer.data.inputs import open_input
from protein_performer.data.stdin import display_name
from protein_performer.errors import UserError
from protein_performer.io.json_safe import parse_json
from protein_performer.io.processes import run_process, scratch_dir

log = logging.getLogger(__name__)

#: Alignment coverage of both sequences (MMseqs2's own default, stated so the metadata says it).
COVERAGE = 0.8
INSTALL = (
    "install MMseqs2 (Debian/Ubuntu: apt-get install mmseqs2; conda: conda install -c bioconda "
    "mmseqs2)"
)
INSTALL_HINT = f"{INSTALL} or leave out --cluster-split"


def find_mmseqs(needs: str = "--cluster-split", hint: str = INSTALL_HINT) -> str:
    """Path of the ``mmseqs`` executable, or one ``UserError`` naming what ``needs`` it and
    how to get it."""
    exe = shutil.which("mmseqs")
    if exe is None:
        raise UserError(f"{needs} needs MMseqs2, but `mmseqs` is not on PATH: {hint}")
    return exe


def mmseqs_version(exe: str) -> str:
    try:
        return run_process([exe, "version"], "its version").strip() or "unknown"
    except UserError:
        return "unknown"


def cluster_command(
    exe: str, inputs: Sequence[Path], prefix: Path, tmp: Path, identity: float, threads: int
) -> list[str]:
    """The ``mmseqs easy-cluster`` call (:func:`cluster_sequences` records its parameters)."""
    return [
        exe,
        "easy-cluster",
        *map(os.fspath, inputs),
        os.fspath(prefix),
        os.fspath(tmp),
        "--min-seq-id",
        f"{identity:g}",
        "-c",
        f"{COVERAGE:g}",
        "--cov-mode",
        "0",
        "--threads",
        str(max(1, threads)),
        "-v",
        "1",
    ]


def _write_numbered(inputs: Sequence[Path], out: Path, on_invalid: str) -> list[str]:
    """The valid records of ``inputs`` as one FASTA named ``>0``, ``>1``, ...; returns the ids.

    MMseqs2 rewrites UniProt-style ids (``sp|P69905|HBA_HUMAN`` becomes ``P69905``), so it is
    handed ordinals instead and never sees an id to reinterpret. Records are read by this
    package's reader with preprocess's ``on_invalid``, so MMseqs2 clusters what is stored.
    """
    from protein_performer.data.fasta import InvalidReport, read_fasta_blocks

    ids: list[str] = []
    with out.open("w", encoding="ascii") as fh:
        for path in inputs:
            for block in read_fasta_blocks(
                path,
                on_invalid=on_invalid,  # type: ignore[arg-type]
                report=InvalidReport(),
                check_duplicates=False,
            ):
                start = len(ids)
                ids += block.ids
                fh.write("".join(f">{start + k}\n{s}\n" for k, s in enumerate(block.seqs)))
    return ids


def cluster_sequences(
    inputs: Sequence[str | os.PathLike[str]],
    identity: float,
    threads: int = 1,
    on_invalid: str = "error",
    timeout: float | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Cluster the FASTA ``inputs`` at ``identity``; returns ``{record id: representative id}``
    and the metadata that says how (tool, version, parameters, cluster count). MMseqs2 runs
    under :func:`~protein_performer.io.processes.run_process` (stopped with the command,
    ``timeout`` seconds at most)."""
    if not 0.0 < identity <= 1.0:
        raise UserError(f"--cluster-split IDENTITY must be in (0, 1], got {identity}")
    exe = find_mmseqs()
    paths = [Path(p) for p in inputs]
    with scratch_dir("pp_mmseqs_") as work:
        numbered = work / "records.fasta"
        ids = _write_numbered(paths, numbered, on_invalid)
        prefix = work / "clu"
        cmd = cluster_command(exe, [numbered], prefix, work / "tmp", identity, threads)
        run_mmseqs(cmd, ", ".join(map(os.fspath, paths)), timeout)
        clusters: dict[str, str] = {}
        with open(f"{prefix}_cluster.tsv", encoding="utf-8") as fh:
            for line in fh:
                rep, member = line.rstrip("\n").split("\t")
                # A duplicated id keeps its first record's cluster (preprocess refuses or
                # skips the later one).
                clusters.setdefault(ids[int(member)], ids[int(rep)])
    meta = {
        "tool": "mmseqs easy-cluster",
        "version": mmseqs_version(exe),
        "min_seq_id": identity,
        "coverage": COVERAGE,
        "cov_mode": 0,
        "cluster_mode": "set-cover (default)",
        "clusters": len(set(clusters.values())),
        "clustered_records": len(clusters),
    }
    return clusters, meta


# --------------------------------------------------------------------------------------------
# Families for training rows (data.layout=family), built inside one split
# --------------------------------------------------------------------------------------------
#: How families are built: ``search`` (each record's MMseqs2 hits in its split, as PoET builds
#: its sets: one family per record, families overlap) or ``cluster`` (a lower-identity
#: clustering of the split: each record in exactly one family).
FAMILY_METHODS: tuple[str, ...] = ("search", "cluster")
#: Subdirectory of a store that caches its families (``preprocess --overwrite`` drops it with
#: the store, so a cache never outlives the records it indexes).
FAMILY_DIR = "families"
#: Prefilter hits per query for ``search`` (MMseqs2's default): caps a family near 300.
FAMILY_MAX_SEQS = 300
#: What a family search asks MMseqs2 for: the scores that order the hits, and each hit's
#: alignment to its query (the aligned ranges and the CIGAR string), which places the member on
#: the family's first member (``Families.coordinates``, ``data.family_coordinates=aligned``).
_FAMILY_FORMAT = "query,target,fident,evalue,bits,qstart,qend,tstart,tend,cigar"


class Families:
    """Groups of record indices in CSR form: family ``f`` is ``members[offsets[f]:offsets[f+1]]``
    and is named after record ``keys[f]`` (the cluster representative, or the search query).

    Three flat int64 arrays, not a list of lists, so a UniRef-scale family table pickles into
    DataLoader workers and loads from the cache without a Python object per member.

    A family search also keeps each member's alignment to its family's first member (the
    query), flat as well: ``ranges`` (N, 4) int32 ``qstart qend tstart tend`` (1-based,
    inclusive; zeros: none) and the CIGAR strings as bytes ``cigars[cigar_offsets[i]:
    cigar_offsets[i + 1]]``; None where the families have no alignments (``cluster``, or a
    cache written before 0.7).
    """

    def __init__(
        self,
        keys: np.ndarray,
        offsets: np.ndarray,
        members: np.ndarray,
        meta: dict[str, Any] | None = None,
        alignments: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.keys = np.asarray(keys, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.members = np.asarray(members, dtype=np.int64)
        self.meta = dict(meta or {})
        if len(self.offsets) != len(self.keys) + 1 or self.offsets[-1] != len(self.members):
            raise ValueError("families: offsets must be (F + 1,) and end at len(members)")
        if self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0):
            raise ValueError("families: offsets must start at 0 and never decrease")
        self.alignments = None
        if alignments is not None:
            ranges, cigar_offsets, cigars = (np.asarray(a) for a in alignments)
            n = len(self.members)
            if (ranges.shape != (n, 4) or cigar_offsets.shape != (n + 1,) or cigar_offsets[0]
                    or cigar_offsets[-1] != len(cigars) or np.any(np.diff(cigar_offsets) < 0)):
                raise ValueError("families: alignments must be one per member")
            self.alignments = (ranges.astype(np.int32), cigar_offsets.astype(np.int64),
                               cigars.astype(np.uint8))  # fmt: skip

    def coordinates(self, at: int, length: int) -> np.ndarray | None:
        """(length,) int64: the member at ``members[at]`` placed on its family's first member
        by their alignment (:func:`alignment_coordinates`: that member's residue numbers,
        :data:`~protein_performer.data.msa.UNPLACED` outside the aligned range), or None when
        there is no alignment (the caller falls back to member positions)."""
        if self.alignments is None:
            return None
        ranges, cigar_offsets, cigars = self.alignments
        qs, qe, ts, te = (int(v) for v in ranges[at])
        cigar = cigars[cigar_offsets[at] : cigar_offsets[at + 1]].tobytes().decode("ascii")
        if not (qs and ts):
            return None
        return alignment_coordinates(cigar, qs, qe, ts, te, length)

    @classmethod
    def from_lists(
        cls, groups: Sequence[Sequence[int]], keys: Sequence[int] | None = None, **meta: Any
    ) -> Families:
        """Families from lists of member indices (keys default to each list's first member)."""
        sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        if np.any(sizes == 0):
            raise ValueError("a family needs at least one member")
        flat = [int(m) for g in groups for m in g]
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        k = [int(g[0]) for g in groups] if keys is None else list(keys)
        return cls(np.asarray(k, np.int64), offsets, np.asarray(flat, np.int64), meta)

    @staticmethod
    def pack_alignments(
        aligned: Sequence[tuple[int, int, int, int, str] | None],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per member ``(qstart, qend, tstart, tend, cigar)`` or None -> the flat arrays of
        ``alignments``."""
        ranges = np.zeros((len(aligned), 4), np.int32)
        texts = []
        for i, a in enumerate(aligned):
            if a is not None:
                ranges[i] = a[:4]
            texts.append(b"" if a is None else a[4].encode("ascii"))
        lengths = np.fromiter(map(len, texts), np.int64, len(texts))
        cigar_offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        return ranges, cigar_offsets, np.frombuffer(b"".join(texts), np.uint8).copy()

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, f: int) -> np.ndarray:
        return self.members[self.offsets[f] : self.offsets[f + 1]]

    def sizes(self) -> np.ndarray:
        """(F,) members per family."""
        return np.diff(self.offsets)

    def restrict(self, indices: np.ndarray) -> Families:
        """The families over positions in ``indices`` (sorted record indices, e.g. a split
        limited by ``data.limit_records``): members outside it are dropped, then empty
        families; a family whose key was dropped is named after its first remaining member."""
        indices = np.asarray(indices, dtype=np.int64)
        members, inside = _positions(indices, self.members)
        keys, key_in = _positions(indices, self.keys)
        counts = np.bincount(
            np.repeat(np.arange(len(self)), self.sizes())[inside], None, len(self)
        )
        members = members[inside]
        keep = counts > 0
        first = np.concatenate(([0], np.cumsum(counts)))[:-1][keep]
        keys = np.where(key_in[keep], keys[keep], members[first])
        offsets = np.concatenate(([0], np.cumsum(counts[keep]))).astype(np.int64)
        alignments = None
        if self.alignments is not None:  # still on the first member's residues, kept or not
            ranges, cigar_offsets, cigars = self.alignments
            starts, ends = cigar_offsets[:-1][inside], cigar_offsets[1:][inside]
            lengths = ends - starts
            new_offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
            picked = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
            alignments = (ranges[inside], new_offsets, cigars[picked])
        return Families(keys, offsets, members, self.meta, alignments)

    def save(self, path: Path) -> None:
        """Write the arrays and the metadata (JSON) to ``path`` (.npz) atomically."""
        from protein_performer.io.atomic import atomic_file

        with atomic_file(path) as tmp, open(tmp, "wb") as fh:
            extra = {}
            if self.alignments is not None:
                extra = dict(zip(_ALIGNMENT_ARRAYS, self.alignments, strict=True))
            np.savez(
                fh,
                keys=self.keys,
                offsets=self.offsets,
                members=self.members,
                meta=np.array(json.dumps(self.meta, sort_keys=True)),
                **extra,
            )

    @classmethod
    def load(cls, path: Path) -> Families:
        """The families of a cache; a file written before 0.7 has no alignments (None)."""
        with np.load(path, allow_pickle=False) as z:
            have = [name in z.files for name in _ALIGNMENT_ARRAYS]
            if any(have) and not all(have):
                raise ValueError(f"family cache {path} holds part of its alignments")
            alignments = tuple(z[name] for name in _ALIGNMENT_ARRAYS) if all(have) else None
            return cls(z["keys"], z["offsets"], z["members"], parse_json(str(z["meta"]), path),
                       alignments)  # type: ignore[arg-type]  # fmt: skip


#: The arrays of ``Families.alignments`` as a cache names them.
_ALIGNMENT_ARRAYS = ("aln_ranges", "aln_cigar_offsets", "aln_cigars")


def _positions(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Position of each value in the sorted ``indices``, and whether it is there at all."""
    if not len(indices):
        return np.zeros(len(values), np.int64), np.zeros(len(values), bool)
    pos = np.minimum(np.searchsorted(indices, values), len(indices) - 1)
    return pos, indices[pos] == values


def size_summary(sizes: np.ndarray) -> dict[str, Any]:
    """Family-size distribution (what a layout=family run trains on), for logs and metadata."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not len(sizes):
        return {"families": 0}
    q = [round(float(v), 1) for v in np.percentile(sizes, [50, 90, 99])]  # not 112.10000000000014
    return {
        "families": int(len(sizes)),
        "members": int(sizes.sum()),
        "singletons": round(float(np.mean(sizes == 1)), 4),
        "mean": round(float(sizes.mean()), 2),
        "median": q[0],
        "p90": q[1],
        "p99": q[2],
        "max": int(sizes.max()),
    }


def _stage(output: str) -> str:
    """The MMseqs2 step running now, from its log so far (at ``-v 3`` it prints each step as
    ``MODULE PATH ...``: ``createdb``, ``prefilter``, ``align``, ``convertalis``)."""
    stage = "starting"
    for line in output.splitlines():
        words = line.split(maxsplit=2)
        if len(words) > 1 and words[0].isalnum() and words[0].islower() and "/" in words[1]:
            stage = words[0]
    return stage


def run_mmseqs(cmd: list[str], what: str, timeout: float | None = None) -> None:
    """Run MMseqs2 as every child process runs (its group stopped with the command, its
    scratch removed, a line per progress interval naming its step, ``timeout`` seconds)."""
    run_process(
        cmd, what, label=f"mmseqs {cmd[1]}", timeout=timeout,
        timeout_flag="--mmseqs-timeout", stage=_stage,
    )  # fmt: skip


def search_command(
    exe: str,
    query: Path,
    target: Path,
    out: Path,
    tmp: Path,
    identity: float,
    threads: int,
    max_seqs: int = FAMILY_MAX_SEQS,
    coverage: float = COVERAGE,
    fields: str = _FAMILY_FORMAT,
) -> list[str]:
    """The ``mmseqs easy-search`` call (tab-separated ``fields``, by default a family search's:
    ``query target fident evalue bits`` and the alignment)."""
    return [
        exe,
        "easy-search",
        os.fspath(query),
        os.fspath(target),
        os.fspath(out),
        os.fspath(tmp),
        "--min-seq-id",
        f"{identity:g}",
        "-c",
        f"{coverage:g}",
        "--cov-mode",
        "0",
        "--max-seqs",
        str(int(max_seqs)),
        "--format-output",
        fields,
        "--threads",
        str(max(1, threads)),
        "-v",
        "3",  # each step named in the log: what the progress lines report
    ]


def _write_ordinals(seqs: Iterable[str], out: Path) -> int:
    n = 0
    with out.open("w", encoding="ascii") as fh:
        for n, s in enumerate(seqs, 1):
            fh.write(f">{n - 1}\n{s}\n")
    return n


def build_families(
    seqs: Sequence[str],
    method: str = "search",
    identity: float = 0.3,
    threads: int = 1,
) -> Families:
    """Families over ``seqs`` (indices into it), by MMseqs2 ``search`` or ``cluster`` at
    ``identity`` (coverage :data:`COVERAGE` of both sequences, as for the split); the result
    depends only on the sequences and the parameters."""
    if method not in FAMILY_METHODS:
        raise UserError(f"unknown family method {method!r}: choose {' or '.join(FAMILY_METHODS)}")
    if not 0.0 < identity <= 1.0:
        raise UserError(f"family identity must be in (0, 1], got {identity}")
    exe = find_mmseqs("data.layout=family", f"{INSTALL} or use data.layout=single")
    meta: dict[str, Any] = {
        "tool": f"mmseqs easy-{method}",
        "version": mmseqs_version(exe),
        "method": method,
        "min_seq_id": identity,
        "coverage": COVERAGE,
        "cov_mode": 0,
    }
    if not seqs:  # an empty split (a small valid set): no families, described as such
        meta["sizes"] = size_summary(np.empty(0, np.int64))
        return Families(np.empty(0, np.int64), np.zeros(1, np.int64), np.empty(0, np.int64), meta)
    with scratch_dir("pp_families_") as work:
        fasta = work / "records.fasta"
        _write_ordinals(seqs, fasta)
        tmp = work / "tmp"
        if method == "cluster":
            prefix = work / "clu"
            run_mmseqs(cluster_command(exe, [fasta], prefix, tmp, identity, threads), "a split")
            groups: dict[int, list[int]] = {}
            with open(f"{prefix}_cluster.tsv", encoding="ascii") as fh:
                for line in fh:
                    rep, member = map(int, line.split("\t"))
                    groups.setdefault(rep, []).append(member)
            reps = sorted(groups)
            lists = [[r, *sorted(m for m in groups[r] if m != r)] for r in reps]
            families = Families.from_lists(lists, reps)
        else:
            meta["max_seqs"] = FAMILY_MAX_SEQS
            hits_path = work / "hits.tsv"
            cmd = search_command(exe, fasta, fasta, hits_path, tmp, identity, threads)
            run_mmseqs(cmd, "a split")
            hits = _read_alignments(hits_path, _FAMILY_FORMAT)
            lists = []
            aligned: list[tuple[int, int, int, int, str] | None] = []
            for q in range(len(seqs)):
                seen = {q}
                fam = [q]
                n = len(seqs[q])
                aligned.append((1, n, 1, n, f"{n}M"))  # the first member: on itself
                for _, _, t, a in hits.get(q, ()):
                    if t not in seen:
                        seen.add(t)
                        fam.append(t)
                        aligned.append((a["qstart"], a["qend"], a["tstart"], a["tend"],
                                        a["cigar"]))  # fmt: skip
                lists.append(fam)
            families = Families.from_lists(lists)
            families.alignments = Families.pack_alignments(aligned)
            meta["alignments"] = "cigar"
    meta["sizes"] = size_summary(families.sizes())
    families.meta = meta
    return families


def _decoder(vocab: Sequence[str]) -> np.ndarray:
    """Token id -> letter byte lookup table (specials, never stored as residues, map to X)."""
    return np.frombuffer(
        b"".join(t.encode("ascii") if len(t) == 1 else b"X" for t in vocab), dtype=np.uint8
    )


def _store_fingerprint(store: Any, indices: np.ndarray) -> str:
    """Which records of which store a family cache indexes (their ids and lengths)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(indices.astype("<i8").tobytes())
    h.update(np.asarray(store.lengths)[indices].astype("<i4").tobytes())
    for i in indices[:: max(1, len(indices) // 1000)].tolist():
        h.update(store.id(i).encode("utf-8") + b"\n")
    return h.hexdigest()


def family_cache_path(store_dir: Path, split: str, method: str, identity: float) -> Path:
    return Path(store_dir) / FAMILY_DIR / f"{split}.{method}.id{identity:g}.npz"


def store_families(
    store: Any,
    split: str,
    method: str = "search",
    identity: float = 0.3,
    threads: int = 1,
    aligned: bool = False,
) -> Families:
    """Families of one split of a token store, over its global record indices.

    Built from that split's records only, so a training family never holds a valid/test
    record: the split (``preprocess --cluster-split``) kept clusters whole, and families
    are a finer grouping inside one side of it. Cached under ``STORE/families/`` and reused
    while it indexes the same records; a read-only store is searched again each time.
    ``aligned``: the caller reads the members' alignments, so a search cache written before
    0.7 (which has none) is searched again, with a warning saying why.
    """
    indices = np.asarray(store.indices(split), dtype=np.int64)
    path = family_cache_path(store.path, split, method, identity)
    fingerprint = _store_fingerprint(store, indices)
    if path.is_file():
        try:
            cached = Families.load(path)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, UserError) as exc:
            log.warning("ignoring unreadable family cache %s (%s)", path, exc)
        else:
            inside = _positions(indices, cached.members)[1].all()
            inside = inside and _positions(indices, cached.keys)[1].all()
            stale = aligned and method == "search" and cached.alignments is None
            if cached.meta.get("fingerprint") == fingerprint and inside and not stale:
                return cached
            if stale:
                log.warning(
                    "family cache %s was written before 0.7 and holds no alignments, which "
                    "data.family_coordinates=aligned reads: searching the families again",
                    path,
                )
            if not inside:
                log.warning("ignoring family cache %s: it names records outside %s", path, split)
    lut = _decoder(store.meta["vocab"])
    seqs = [lut[store.tokens(int(i))].tobytes().decode("ascii") for i in indices]
    local = build_families(seqs, method, identity, threads)
    families = Families(
        indices[local.keys],
        local.offsets,
        indices[local.members],
        {**local.meta, "split": split, "fingerprint": fingerprint},
        local.alignments,
    )
    try:
        path.parent.mkdir(exist_ok=True)
        families.save(path)
    except OSError as exc:
        log.warning("could not cache families at %s (%s): they are rebuilt next time", path, exc)
    log.info("%s families of %s (%s): %s", method, split, store.path, families.meta["sizes"])
    return families


# --------------------------------------------------------------------------------------------
# Retrieval for users (``protein-performer homologs``)
# --------------------------------------------------------------------------------------------
#: Defaults match the training families, so retrieved context looks like a training row.
HOMOLOG_MIN_SEQ_ID = 0.3
HOMOLOG_MAX_SEQS = 500


def _fasta_records(path: Path, on_invalid: str) -> Iterator[tuple[str, str]]:
    """(header line, sequence) of each valid record of a FASTA(.gz) file, streamed."""
    from protein_performer.data.fasta import InvalidReport, read_fasta_blocks

    for block in read_fasta_blocks(
        path,
        on_invalid=on_invalid,
        report=InvalidReport(),
        check_duplicates=False,  # type: ignore[arg-type]
    ):
        for rid, desc, seq in zip(block.ids, block.descs, block.seqs, strict=True):
            yield (f"{rid} {desc}" if desc else rid), seq


def find_homologs(
    query: str | os.PathLike[str],
    db: str | os.PathLike[str],
    *,
    max_seqs: int = HOMOLOG_MAX_SEQS,
    min_seq_id: float = HOMOLOG_MIN_SEQ_ID,
    threads: int = 1,
    keep_identical: bool = False,
    on_invalid: str = "error",
    timeout: float | None = None,
) -> list[Homolog]:
    """The database records MMseqs2 (``easy-search``) finds for the query FASTA, best first
    (lowest E-value to any query, then highest bit score), at most ``max_seqs``.

    ``db`` is a FASTA(.gz) file or a store from ``preprocess`` (every split: it is the user's
    database, not a training run). A database record identical to a query (the query itself,
    most often) is left out unless ``keep_identical``: as context it would only repeat the
    query. The database is streamed twice (to MMseqs2, then for the hits' records), so its
    size costs disk, not memory. ``timeout``: seconds MMseqs2 may run (None: no limit).
    """
    if max_seqs < 1:
        raise UserError(f"--max-seqs must be at least 1, got {max_seqs}")
    if not 0.0 <= min_seq_id <= 1.0:
        raise UserError(f"--min-seq-id must be in [0, 1], got {min_seq_id}")
    query = open_input(query, store=False, give="the query FASTA").path
    opened = open_input(db)
    db, store = opened.path, opened.store
    named = {p: display_name(p) for p in (query, db)}  # standard input: <stdin>
    exe = find_mmseqs("homologs", INSTALL)
    queries = list(_fasta_records(query, on_invalid))
    if not queries:
        raise UserError(f"{named[query]} holds no valid record: give at least one query sequence")
    with scratch_dir("pp_homologs_") as work:
        q_fasta, t_fasta = work / "query.fasta", work / "db.fasta"
        _write_ordinals((s for _, s in queries), q_fasta)
        if store is not None:
            lut = _decoder(store.meta["vocab"])
            n_db = _write_ordinals(
                (lut[store.tokens(i)].tobytes().decode("ascii") for i in range(len(store))),
                t_fasta,
            )
        else:
            n_db = _write_ordinals((s for _, s in _fasta_records(db, on_invalid)), t_fasta)
        if n_db == 0:
            raise UserError(f"{named[db]} holds no valid record to search")
        out = work / "hits.tsv"
        # The prefilter keeps max_seqs per query: one more, since the query may find itself.
        cmd = search_command(
            exe, q_fasta, t_fasta, out, work / "tmp", min_seq_id, threads, max_seqs + 1,
            fields=HOMOLOG_FORMAT,
        )  # fmt: skip
        run_mmseqs(cmd, f"{named[query]} against {named[db]}", timeout)
        per_query = _read_alignments(out)
    wanted = {row[2] for rows in per_query.values() for row in rows}
    found: dict[int, tuple[str, str]] = {}
    if store is not None:
        lut = _decoder(store.meta["vocab"])
        for t in wanted:
            found[t] = (store.header_line(t), lut[store.tokens(t)].tobytes().decode("ascii"))
    else:
        for t, rec in enumerate(_fasta_records(db, on_invalid)):
            if t in wanted:
                found[t] = rec
    out_hits: list[Homolog] = []
    for q, (qheader, qseq) in enumerate(queries):  # grouped by query, in the query file's order
        qid, kept = qheader.split(maxsplit=1)[0], 0
        for _, _, t, values in per_query.get(q, ()):
            header, seq = found[t]
            if not keep_identical and seq == qseq:
                continue
            out_hits.append(Homolog(header, seq, qid, **values))
            kept += 1
            if kept == max_seqs:
                break
    return out_hits


def _read_alignments(
    path: Path, fields: str = HOMOLOG_FORMAT
) -> dict[int, list[tuple[float, float, int, dict[str, Any]]]]:
    """``{query ordinal: [(evalue, -bits, target ordinal, fields), ...]}`` of a search with
    ``fields``, best first (ties broken by target: never by MMseqs2's threads)."""
    names = fields.split(",")
    ints = {"qstart", "qend", "tstart", "tend", "qlen", "tlen"}
    texts = {"cigar"}
    hits: dict[int, list[tuple[float, float, int, dict[str, Any]]]] = {}
    with path.open(encoding="ascii") as fh:
        for line in fh:
            row = dict(zip(names, line.rstrip("\n").split("\t"), strict=True))
            q, t = int(row.pop("query")), int(row.pop("target"))
            values = {
                k: v if k in texts else int(v) if k in ints else float(v) for k, v in row.items()
            }
            hits.setdefault(q, []).append((values["evalue"], -values["bits"], t, values))
    for v in hits.values():
        v.sort(key=lambda h: h[:3])
    return hits


def write_homologs(
    hits: Sequence[Homolog], out: str | os.PathLike[str], tsv: str | os.PathLike[str] | None = None
) -> None:
    """The hits as FASTA in order (grouped by query, best first), each header its record's own
    followed by ``query=ID`` and the :data:`HIT_FIELDS` as ``key=value`` (atomically; ``-``:
    stdout); with ``tsv``, the same as a table, one row per hit."""
    from protein_performer.io.atomic import text_output

    with text_output(out) as fh:
        for h in hits:
            fh.write(f">{h.header_line()}\n{h.sequence}\n")
    if tsv is not None:
        from protein_performer.io.tables import table_writer

        with text_output(tsv) as fh:
            writer = table_writer(fh, "\t", "\n")
            writer.writerow(["query", "target", *HIT_FIELDS])
            for h in hits:
                writer.writerow([h.query, h.target, *h.fields()])
