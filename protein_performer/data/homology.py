"""Homology clusters from MMseqs2, for splits that keep close relatives on one side.

Hashing record ids puts a protein in test while its 95%-identical sibling trains, so "held-out"
perplexity partly measures memorisation. ``preprocess --cluster-split IDENTITY`` clusters the
input with ``mmseqs easy-cluster`` first and hashes the cluster instead (``data.split.Groups``).
MMseqs2 is an optional external program, looked up on PATH; it is not a Python dependency.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protein_performer.errors import UserError

#: Alignment coverage of both sequences (MMseqs2's own default, stated so the metadata says it).
COVERAGE = 0.8
INSTALL_HINT = (
    "install MMseqs2 (Debian/Ubuntu: apt-get install mmseqs2; conda: conda install -c bioconda "
    "mmseqs2) or leave out --cluster-split"
)


def find_mmseqs() -> str:
    """Path of the ``mmseqs`` executable, or one ``UserError`` saying how to get it."""
    exe = shutil.which("mmseqs")
    if exe is None:
        raise UserError(
            f"--cluster-split needs MMseqs2, but `mmseqs` is not on PATH: {INSTALL_HINT}"
        )
    return exe


def mmseqs_version(exe: str) -> str:
    proc = subprocess.run([exe, "version"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "unknown"


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
) -> tuple[dict[str, str], dict[str, Any]]:
    """Cluster the FASTA ``inputs`` at ``identity``; returns ``{record id: representative id}``
    and the metadata that says how (tool, version, parameters, cluster count)."""
    if not 0.0 < identity <= 1.0:
        raise UserError(f"--cluster-split IDENTITY must be in (0, 1], got {identity}")
    exe = find_mmseqs()
    paths = [Path(p) for p in inputs]
    with tempfile.TemporaryDirectory(prefix="pp_mmseqs_") as work:
        numbered = Path(work) / "records.fasta"
        ids = _write_numbered(paths, numbered, on_invalid)
        prefix = Path(work) / "clu"
        cmd = cluster_command(exe, [numbered], prefix, Path(work) / "tmp", identity, threads)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise UserError(
                f"mmseqs easy-cluster failed (exit {proc.returncode}) on "
                f"{', '.join(map(os.fspath, paths))}: {' | '.join(tail) or 'no message'}"
            )
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
