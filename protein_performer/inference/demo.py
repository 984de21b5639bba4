"""The demo's last step: embed and score the demo FASTA with the freshly trained checkpoint.

Kept here (not in ``scripts/demo.py``) so the demo runs exactly the code paths of
``protein-performer embed`` and ``protein-performer score``, and tests can call it directly.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def run_inference_demo(
    ckpt_path: str | os.PathLike[str],
    fasta: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Path]:
    """Embed (mean + per-residue, last layer) and score every record of ``fasta``.

    Returns the written files: ``embeddings`` (HDF5), ``scores`` (CSV; pseudo-ppl for a masked
    LM, causal log-likelihood for a causal LM), and ``export`` (the model as config.json +
    model.safetensors, what a user would share). CPU by default: the demo model is tiny.
    """
    from protein_performer.inference.api import load
    from protein_performer.inference.embedding import embed_fasta
    from protein_performer.inference.scoring import score_fasta
    from protein_performer.model.loading import export_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = load(ckpt_path, device)
    emb = embed_fasta(
        lm,
        fasta,
        out / "embeddings.h5",
        repr_layers=(-1,),
        include=("mean", "per_tok"),
        progress=progress,
        overwrite=True,  # the demo owns its output directory
    )
    strategy = "causal" if lm.objective == "clm" else "pseudo-ppl"
    scores = score_fasta(lm, fasta, out / "scores.csv", strategy=strategy, progress=progress)
    exported = export_model(lm.loaded, out / "model", overwrite=True)
    mean_ll = scores.mean_log_likelihood
    log.info(
        "embedded %d records (%d residues) and scored them with %s (mean log-likelihood per "
        "token %.3f)",
        emb.num_records,
        emb.residues,
        strategy,
        mean_ll,
    )
    return {"embeddings": emb.path, "scores": out / "scores.csv", "export": exported}
