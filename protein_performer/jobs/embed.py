"""``embed``: the embeddings of many proteins (``lm.embed_window``) into one columnar HDF5 file
that scales to UniRef (its layout and reader: :mod:`protein_performer.jobs.embeddings_file`),
and what ``--resume`` keeps of an unfinished run.

Shaped like ESM's ``esm-extract`` without its classic traps: any length goes through the model
in one pass (no truncation at 1022 residues, no windows: FAVOR+ attention is linear in L), and a
run writes ONE file with one array per field, not one group (or one ``.pt`` file) per record.

Runs are written as parts (``OUT.parts/``, one per window of records) and merged at the end
(:mod:`protein_performer.io.sharding`): a killed run resumes with ``--resume`` and loses
at most one window, and ranks of a ``torchrun``/SLURM job each write their own parts.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protein_performer._version import __version__
from protein_performer.data.inputs import InputRecord, input_records, total_in_background
from protein_performer.errors import UserError, shown
from protein_performer.inference.api import ProteinLM, precision_name
from protein_performer.inference.embedding import HIDDEN_KINDS
from protein_performer.interop.identity import model_hashes
from protein_performer.io.atomic import output_file
from protein_performer.io.columns import (
    RECORD_COLUMNS,
    checked_rows,
    merge_columns,
    open_columns,
    read_ids,
)
from protein_performer.jobs.embeddings_file import (
    CONTACTS_DTYPE,
    FORMAT_NAME,
    FORMAT_VERSION,
    SEQ_DIGESTS,
    file_layout,
    open_embeddings,
    sequence_digests,
    write_part,
)

#: What ``embed --include`` takes: the hidden kinds, and contact maps from the model's contact
#: regression (as ``contacts predict`` writes them).
INCLUDE_CHOICES = (*HIDDEN_KINDS, "contacts")


def file_attrs(lm: ProteinLM, layers: Sequence[int], include: Sequence[str]) -> dict[str, Any]:
    """The root attributes: what the embeddings came from and how they were made."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "protein_performer_version": __version__,
        "checkpoint": str(lm.source),
        **model_hashes(lm.model),
        "objective": lm.config.objective,
        "attention": lm.config.attention,
        "dim": lm.config.dim,
        "precision": precision_name(lm.dtype),
        "repr_layers": np.asarray(sorted(layers), dtype=np.int64),
        "include": json.dumps(list(include)),
        "model_config": json.dumps(lm.config.to_dict(), sort_keys=True),
    }


#: Attributes a resumed run must share with what it continues.
_SAME_RUN = ("precision", "repr_layers", "include", "model_sha256", "features_sha256")


def _check_same_run(path: Path, h5: Any, attrs: dict[str, Any]) -> None:  # noqa: ANN401
    for key in _SAME_RUN:
        have, want = h5.attrs.get(key), attrs[key]
        if not np.array_equal(np.asarray(have), np.asarray(want)):
            what = {"model_sha256": "model weights", "features_sha256": "FAVOR+ features"}
            raise UserError(
                f"--resume: {path} was made with other {what.get(key, key)} ({have!r} there, "
                f"{want!r} now); resume with the same checkpoint and options, or start over "
                "with --overwrite"
            )


#: The attribute naming a part's run (:func:`run_id`: model and options).
PART_RUN = "part_run_id"


def run_id(attrs: dict[str, Any]) -> str:
    """The identity of a run's parts: what the vectors depend on (model, features, options)."""
    import hashlib

    keys = (*_SAME_RUN, "contact_regression")
    same = {k: np.asarray(attrs[k]).tolist() for k in keys if k in attrs}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class PartCheck:
    """What ``--resume`` made of the parts it found."""

    kept: list[Path]  # parts whose every record is in the input, with the same sequence
    reused: int = 0  # records in them
    redone: int = 0  # records of dropped parts that the input still holds (computed again)
    dropped: int = 0  # parts of another run or input, or of protein-performer < 0.3
    damaged: int = 0  # parts that do not read (set aside as NAME.damaged)


def check_parts(
    parts: Sequence[Path],
    attrs: dict[str, Any],
    records: Any,  # noqa: ANN401 - an iterable of InputRecord
    set_aside: bool = True,
) -> PartCheck:
    """Keep the parts made by this run (same model and options: :func:`run_id`) whose records
    are all in the input ``records`` with the same sequence; set aside the others.

    Every rank of a sharded run checks the same parts and reaches the same verdict; only one
    (``set_aside``: rank 0) renames, and a part another rank renamed first counts as set aside.

    A part that does not read is renamed ``NAME.damaged`` (not fatal: its records are redone);
    a part of another run, holding a record the input lacks or whose sequence changed, or
    written before parts recorded their sources (protein-performer < 0.3) is renamed
    ``NAME.dropped`` and its records that the input holds are computed again.
    """

    def aside(part: Path, suffix: str) -> None:
        if set_aside:
            with contextlib.suppress(FileNotFoundError):
                part.rename(part.with_name(part.name + suffix))

    want = run_id(attrs)
    check = PartCheck([])
    owner: dict[str, int] = {}  # id -> index into candidates
    digests: dict[str, bytes] = {}
    candidates: list[tuple[Path, list[str]]] = []
    for part in parts:
        try:
            with open_columns(part, "embed parts", "it is set aside") as h5:
                ids = read_ids(h5)
                same_run = h5.attrs.get(PART_RUN) == want and SEQ_DIGESTS in h5
                sha = h5[SEQ_DIGESTS][:] if same_run else None
                n = int(h5.attrs["num_records"])
                whole = len(ids) == n and all(len(h5[c.name]) == n for c in RECORD_COLUMNS)
        except (OSError, KeyError, ValueError, TypeError, UserError):
            whole = False
        if not whole or (sha is not None and sha.shape != (len(ids), 16)):
            aside(part, ".damaged")
            check.damaged += 1
            continue
        if sha is None:
            aside(part, ".dropped")
            check.dropped += 1
            continue
        candidates.append((part, ids))
        for rid, digest in zip(ids, sha, strict=True):
            owner[rid] = len(candidates) - 1
            digests[rid] = digest.tobytes()
    bad: set[int] = set()
    seen: set[str] = set()
    in_bad: list[str] = []
    for rec in records:
        k = owner.get(rec.id)
        if k is None:
            continue
        seen.add(rec.id)
        if sequence_digests([rec.sequence])[0].tobytes() != digests[rec.id]:
            bad.add(k)
    for k, (part, ids) in enumerate(candidates):
        if k in bad or any(rid not in seen for rid in ids):
            aside(part, ".dropped")
            check.dropped += 1
            in_bad += [rid for rid in ids if rid in seen]
        else:
            check.kept.append(part)
            check.reused += len(ids)
    check.redone = len(in_bad)
    return check


# --------------------------------------------------------------------------------------------
# Running embed
# --------------------------------------------------------------------------------------------
@dataclass
class EmbedSummary:
    """What a run did, for the CLI's closing lines and for callers."""

    path: Path
    num_records: int  # records in the file now
    new_records: int  # embedded by this process in this run
    residues: int  # of the new records
    repr_layers: list[int]
    include: list[str]
    skipped: int = 0  # already in the file or its parts (--resume)
    parts: PartCheck | None = None  # what --resume made of the parts it found


def embed_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    repr_layers: Sequence[int] = (-1,),
    include: Sequence[str] = ("mean",),
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> EmbedSummary:
    """Embed every record of ``fasta`` (a FASTA file or a store directory) into ``out``.

    Window by window into parts, then merged (see the module docstring). ``resume`` skips ids
    already in ``out`` or in its finished parts and adds the rest (the input may have grown);
    it refuses when the model or the options differ. Without it, an existing ``out`` or
    leftover parts are refused unless ``overwrite``. Under ``torchrun``/SLURM every rank runs
    this with the same arguments.
    """
    from protein_performer.io.progress import progress as progress_bar
    from protein_performer.io.ranks import detect_ranks, rank_label
    from protein_performer.io.sharding import finished_parts, parts_dir, run_sharded, windows

    path = Path(fasta).expanduser()
    dest = output_file(out)
    layers = lm.resolve_layers(repr_layers)
    include = list(dict.fromkeys(include))
    bad = sorted(set(include) - set(INCLUDE_CHOICES))
    if bad or not include:
        raise UserError(f"--include takes {', '.join(INCLUDE_CHOICES)}; got {list(include)}")
    attrs = file_attrs(lm, layers, include)
    regression = None
    if "contacts" in include:  # the model's own regression, or one line saying how to fit one
        regression = lm.contact_regression(caller="embed", sha256=attrs["model_sha256"])
        attrs["contact_regression"] = json.dumps(regression.to_dict(), sort_keys=True)
        attrs["contacts_dtype"] = CONTACTS_DTYPE
    pdir = parts_dir(dest)
    old_parts = finished_parts(pdir)
    done: set[str] = set()
    checked = None
    part_attrs = {**attrs, PART_RUN: run_id(attrs)}
    if resume:
        if old_parts and os.fspath(fasta) == "-":
            raise UserError(
                "--resume with parts reads the input twice (to check the parts, then to add "
                "what is missing): give the FASTA file, not standard input"
            )
        if dest.exists():
            with open_embeddings(dest) as h5:
                _check_same_run(dest, h5, attrs)
                ids = read_ids(h5)
                if SEQ_DIGESTS not in h5:
                    raise UserError(
                        f"--resume: {dest} records no sequence digests (written by an older "
                        "version), so its vectors cannot be checked against the input; start "
                        "over with --overwrite"
                    )
                sha = checked_rows(h5, SEQ_DIGESTS, len(ids), "u", 2)[:]
            there = {rid: digest.tobytes() for rid, digest in zip(ids, sha, strict=True)}
            for rec in input_records(path, on_invalid) if there else ():
                digest = there.get(rec.id)
                if digest is not None and digest != sequence_digests([rec.sequence])[0].tobytes():
                    raise UserError(
                        f"--resume: {dest} holds {shown(rec.id)} with another sequence than "
                        f"{path} has: the input changed; start over with --overwrite"
                    )
            done.update(there)
        if old_parts:
            first = detect_ranks().rank == 0
            checked = check_parts(old_parts, attrs, input_records(path, on_invalid), first)
            for part in checked.kept:
                with open_embeddings(part) as h5:
                    done.update(read_ids(h5))
    elif not overwrite and (dest.exists() or old_parts):
        what = f"{dest} exists" if dest.exists() else f"{pdir} holds parts of an unfinished run"
        raise UserError(
            f"{what}; pass --resume to add what is missing, or --overwrite to start over"
        )
    pooling = tuple(None if k == "per_tok" else k for k in include if k in HIDDEN_KINDS)
    residues = 0
    bar = progress_bar(None, "res", rank_label("embed"), progress)
    if not done:
        total_in_background(bar, path, "residues")

    def embed_part(part: Path, window: list[InputRecord]) -> None:
        nonlocal residues
        pairs = [(r.id, r.sequence) for r in window]
        results = (
            [res for _, res in lm.embed_window(pairs, layers, pooling, toks_per_batch)]
            if pooling
            else []
        )
        maps = []
        if regression is not None:
            maps = [lm.contact_map(s, regression) for _, s in pairs]
        write_part(part, part_attrs, window, results, maps)
        n = sum(len(r.sequence) for r in window)
        residues += n
        bar.update(n)

    def merge(parts: list[Path]) -> int:
        sources = ([dest] if resume and dest.exists() else []) + parts
        if not sources:
            raise UserError(f"{path}: no valid records to process")
        return merge_columns(dest, file_layout(attrs), attrs, sources)

    todo = (r for r in input_records(path, on_invalid) if r.id not in done)
    with bar:
        new, total = run_sharded(
            dest,
            ".h5",
            windows(todo, toks_per_batch, lambda r: len(r.sequence)),
            embed_part,
            merge,
            fresh=not resume,
            options={"run": part_attrs[PART_RUN], "resume": str(resume)},
        )
    return EmbedSummary(dest, total, new, residues, layers, include, len(done), checked)
