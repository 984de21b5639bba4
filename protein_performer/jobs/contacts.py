"""``contacts predict``: the contact maps of every record (``lm.contact_map``) into one columnar
HDF5 file (the layout: :mod:`protein_performer.contacts.map_columns`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from protein_performer.contacts.fit import MIN_SEPARATION
from protein_performer.contacts.map_columns import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    contact_columns,
    contacts_layout,
)
from protein_performer.contacts.predict import DEFAULT_DENSE_MAX_LENGTH, DEFAULT_TOP_K_PER_LENGTH
from protein_performer.data.inputs import input_records, total_in_background
from protein_performer.errors import UserError
from protein_performer.inference.api import ProteinLM
from protein_performer.interop.identity import weights_sha256
from protein_performer.io.columns import (
    header_column,
    merge_columns,
    record_columns,
    write_columns,
)
from protein_performer.io.progress import beat
from protein_performer.model.contact_head import ContactRegression


@dataclass
class ContactsSummary:
    path: Path
    num_records: int
    dense: int
    sparse: int


def predict_contacts_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    regression: ContactRegression | str | os.PathLike[str] | None = None,
    *,
    dtype: str = "float16",
    dense_max_length: int = DEFAULT_DENSE_MAX_LENGTH,
    top_k_per_length: float = DEFAULT_TOP_K_PER_LENGTH,
    min_separation: int = MIN_SEPARATION,
    on_invalid: str = "error",
    progress: bool = True,
    regression_source: str = "",
    toks_per_batch: int = 512,
) -> ContactsSummary:
    """Contact maps of every record (FASTA or store) into one columnar HDF5 file, under
    ``regression`` (a file, one already read, or the model's own when None).

    Written like ``embed``'s file: windows of records (about ``toks_per_batch`` * 32 residues;
    dense maps are L^2 each, hence the small default) become parts, merged at the end, so
    ranks of a ``torchrun``/SLURM job split the records
    (:mod:`protein_performer.io.sharding`).
    """
    from protein_performer.io.progress import progress as progress_bar
    from protein_performer.io.ranks import rank_label
    from protein_performer.io.sharding import run_sharded, windows

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    sha = weights_sha256(lm.model)
    regression = lm.contact_regression(regression, caller="cli", sha256=sha)
    layout = contacts_layout(dtype)
    attrs = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checkpoint": str(lm.source),
        "model_sha256": sha,
        "regression": json.dumps(regression.to_dict(), sort_keys=True),
        "regression_source": regression_source,
        "dtype": dtype,
        "dense_max_length": dense_max_length,
        "top_k_per_length": top_k_per_length,
        "min_separation": min_separation,
    }
    limits = {
        "dense_max_length": dense_max_length,
        "top_k_per_length": top_k_per_length,
        "min_separation": min_separation,
    }
    kinds = {"dense": 0, "sparse": 0}
    bar = progress_bar(None, "res", rank_label("contacts"), progress)
    total_in_background(bar, fasta, "residues")

    def write_part(part: Path, window: list) -> None:
        maps = []
        for n, r in enumerate(window):
            beat(f"{n}/{len(window)} records of this window")
            maps.append(lm.contact_map(r.sequence, regression, **limits))
        kinds["dense"] += sum(m.dense is not None for m in maps)
        kinds["sparse"] += sum(m.dense is None for m in maps)
        ragged = {"header_offsets": header_column(window), **contact_columns(maps, dtype)}
        write_columns(part, layout, attrs, record_columns(window), ragged)
        bar.update(sum(len(r.sequence) for r in window))

    def merge(parts: list[Path]) -> int:
        if not parts:
            raise UserError(f"{fasta}: no valid records to process")
        return merge_columns(Path(out), layout, attrs, parts)

    records = input_records(fasta, on_invalid)
    with bar:
        _, total = run_sharded(
            Path(out).expanduser(),
            ".h5",
            windows(records, toks_per_batch, lambda r: len(r.sequence)),
            write_part,
            merge,
            fresh=True,
        )
    return ContactsSummary(Path(out), total, kinds["dense"], kinds["sparse"])
