#!/usr/bin/env python
"""The README's main job (`make demo`): train the demo model, then report what it produced.

Step 1 trains ``experiment=demo`` (a tiny FAVOR+ masked LM on the bundled 2,000 Swiss-Prot
records, CPU, a few minutes) through the same Hydra entry point as ``protein-performer train``,
so the run directory, checkpoints, metrics CSV and training-curve PNG are exactly what a user's
own run gives. Step 2 embeds and scores the bundled demo proteins with that checkpoint (the
code paths of ``protein-performer embed``/``score``/``export``); step 3 draws its attention maps
and the attention-derived amino-acid similarity next to BLOSUM62 (``protein-performer
visualize``). Every output lands in the training run's directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from protein_performer.errors import UserError

#: The repository checkout this script belongs to.
REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger("demo")


@dataclass
class TrainResult:
    """What step 1 leaves for the steps after it."""

    checkpoint: Path
    curve: Path | None
    output_dir: Path
    metrics: dict[str, float]
    seconds: float


def step_train(overrides: list[str]) -> TrainResult:
    """Train the demo experiment; ``overrides`` are extra Hydra overrides."""
    from protein_performer.training.train import run_hydra

    start = time.perf_counter()
    result = run_hydra(["experiment=demo", *overrides], prog="demo.py")
    seconds = time.perf_counter() - start
    checkpoint = result.get("best_checkpoint") or result.get("last_checkpoint")
    if not checkpoint:
        raise UserError(
            "training finished without writing a checkpoint (was debug=fdr given? fast_dev_run "
            "saves nothing)")
    metrics = {k: v for k, v in result["metrics"].items() if isinstance(v, float)}
    curve = Path(result["curve"]) if result.get("curve") else None
    return TrainResult(Path(checkpoint), curve, Path(result["output_dir"]), metrics, seconds)


def report_train(res: TrainResult) -> None:
    shown = ("train/loss", "val/loss", "val/ppl", "val/acc")
    numbers = "  ".join(f"{k} {res.metrics[k]:.3f}" for k in shown if k in res.metrics)
    log.info("trained in %.0f s: %s", res.seconds, numbers)
    print(f"checkpoint: {res.checkpoint}")
    if res.curve is not None:
        print(f"curve: {res.curve}")
    print(f"run directory: {res.output_dir}")


DEMO_FASTA = REPO / "protein_performer" / "data" / "demo" / "some_proteins.fasta"


def run_inference_demo(ckpt_path: str | os.PathLike[str], fasta: str | os.PathLike[str],
                       out_dir: str | os.PathLike[str], device: str = "cpu",
                       progress: bool = True) -> dict[str, Path]:
    """Embed (mean + per-residue, last layer) and score every record of ``fasta``.

    Returns the written files: ``embeddings`` (HDF5), ``scores`` (CSV; pseudo-ppl for a masked
    LM, causal log-likelihood for a causal LM), and ``export`` (the model as config.json +
    model.safetensors, what a user would share). CPU by default: the demo model is tiny.
    """
    from protein_performer.inference.api import load
    from protein_performer.interop.export import export_model
    from protein_performer.jobs.embed import embed_fasta
    from protein_performer.jobs.score import score_fasta

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
    log.info("embedded %d records (%d residues) and scored them with %s (mean log-likelihood per "
             "token %.3f)",
             emb.num_records, emb.residues, strategy, mean_ll)
    return {"embeddings": emb.path, "scores": out / "scores.csv", "export": exported}


def step_inference(res: TrainResult) -> dict[str, Path]:
    """Embed + score the demo proteins with the fresh checkpoint, and export it."""
    return run_inference_demo(res.checkpoint, DEMO_FASTA, res.output_dir / "inference")


def step_plots(res: TrainResult) -> dict[str, Path]:
    """Attention grid and amino-acid similarity PNGs for the first demo protein (``visualize``
    prints their paths, once)."""
    from protein_performer.cli.main import main

    out = res.output_dir / "plots"
    argv = ["visualize", str(res.checkpoint), str(DEMO_FASTA), "--device", "cpu"]
    if main([*argv, "--out-dir", str(out), "--overwrite"]) != 0:
        raise UserError("visualize failed (its error is above)")
    return {"grid": out / "attention_grid.png", "similarity": out / "aa_similarity.png"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(
            "Train a tiny Performer protein LM on the bundled demo data (CPU, a few minutes), "
            "then embed and score the demo proteins and plot attention maps with its "
            "checkpoint; prints where every output is. Extra arguments are Hydra overrides "
            "passed to `protein-performer train experiment=demo`."
        ),
        epilog="example: python scripts/demo.py trainer.max_steps=100",
    )
    parser.add_argument(
        "--threads", type=int, default=1, metavar="N",
        help="PyTorch CPU threads (default 1: this tiny model gains little from more, and on a "
        "busy 2-core machine 2 threads ran several times slower than 1)")
    args, overrides = parser.parse_known_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        trained = step_train(overrides)
        report_train(trained)
        for name, path in step_inference(trained).items():
            print(f"{name}: {path}")
        step_plots(trained)  # visualize prints where its figures are
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
