#!/usr/bin/env python
"""The README's main job (`make demo`): train the demo model, then report what it produced.

Step 1 trains ``experiment=demo`` (a tiny FAVOR+ masked LM on the bundled 2,000 Swiss-Prot
records, CPU, a few minutes) through the same Hydra entry point as ``protein-performer train``,
so the run directory, checkpoints, metrics CSV and training-curve PNG are exactly what a user's
own run gives. Step 2 embeds and scores the bundled demo proteins with that checkpoint (the
code paths of ``protein-performer embed``/``score``/``export``); step 3 draws its attention maps
and the attention-derived amino-acid similarity next to BLOSUM62 (``protein-performer
visualize``). Every output lands in the training run's directory, and the script prints where.
Extra arguments are Hydra overrides passed to ``protein-performer train experiment=demo``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from protein_performer.data.bundled import bundled_path
from protein_performer.errors import UserError

DEMO_FASTA = bundled_path("data/demo/some_proteins.fasta")

log = logging.getLogger("demo")


def train(overrides: list[str]) -> tuple[Path, Path]:
    """Step 1: train the demo experiment (``overrides``: extra Hydra overrides) and say what it
    left; returns its checkpoint and run directory, where the later steps write."""
    from protein_performer.training.train import run_hydra

    start = time.perf_counter()
    result = run_hydra(["experiment=demo", *overrides], prog="demo.py")
    seconds = time.perf_counter() - start
    checkpoint = result.get("best_checkpoint") or result.get("last_checkpoint")
    if not checkpoint:
        raise UserError(
            "training finished without writing a checkpoint (was debug=fdr given? fast_dev_run "
            "saves nothing)")
    metrics = result["metrics"]
    shown = ("train/loss", "val/loss", "val/ppl", "val/acc")
    numbers = "  ".join(f"{k} {metrics[k]:.3f}" for k in shown
                        if isinstance(metrics.get(k), float))  # fmt: skip
    log.info("trained in %.0f s: %s", seconds, numbers)
    print(f"checkpoint: {Path(checkpoint)}")
    if result.get("curve"):
        print(f"curve: {Path(result['curve'])}")
    print(f"run directory: {Path(result['output_dir'])}")
    return Path(checkpoint), Path(result["output_dir"])


def run_inference_demo(ckpt_path: str | os.PathLike[str], fasta: str | os.PathLike[str],
                       out_dir: str | os.PathLike[str], progress: bool = True) -> dict[str, Path]:
    """Embed (mean + per-residue, last layer) and score every record of ``fasta``.

    Returns the written files: ``embeddings`` (HDF5), ``scores`` (CSV; pseudo-ppl for a masked
    LM, causal log-likelihood for a causal LM), and ``export`` (the model as config.json +
    model.safetensors, what a user would share). On the CPU: the demo model is tiny.
    """
    from protein_performer.inference.api import load
    from protein_performer.interop.export import export_model
    from protein_performer.jobs.embed import embed_fasta
    from protein_performer.jobs.score import score_fasta

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = load(ckpt_path, "cpu")
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
    log.info("embedded %d records (%d residues) and scored them with %s (mean log-likelihood per "
             "token %.3f)", emb.num_records, emb.residues, strategy, scores.mean_log_likelihood)
    return {"embeddings": emb.path, "scores": out / "scores.csv", "export": exported}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python scripts/demo.py trainer.max_steps=100")  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1, metavar="N",
        help="PyTorch CPU threads (default 1: this tiny model gains little from more, and on a "
        "busy 2-core machine 2 threads ran several times slower than 1)")
    args, overrides = parser.parse_known_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        checkpoint, run_dir = train(overrides)
        # Step 2: embed + score the demo proteins with the fresh checkpoint, and export it.
        files = run_inference_demo(checkpoint, DEMO_FASTA, run_dir / "inference")
        for name, path in files.items():
            print(f"{name}: {path}")
        # Step 3: attention grid and amino-acid similarity PNGs for the first demo protein
        # (visualize prints their paths, once).
        from protein_performer.cli.main import main as cli

        argv = ["visualize", str(checkpoint), str(DEMO_FASTA), "--device", "cpu"]
        if cli([*argv, "--out-dir", str(run_dir / "plots"), "--overwrite"]) != 0:
            raise UserError("visualize failed (its error is above)")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
