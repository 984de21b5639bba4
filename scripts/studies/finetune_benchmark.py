#!/usr/bin/env python
"""Supervised fitness prediction on the BLAT_ECOLX scan: baselines vs fine-tuning (issue 24).

Label: the ampicillin 2500 column of ``../shared/data/dms/BLAT_ECOLX_Ranganathan2015.csv``
(4,996 single mutants of TEM-1). 5-fold cross-validation twice: folds by *position* (every
mutation at one position lands in one fold, so a test position was never seen in training) and
by *random* split. Methods, each timed in CPU seconds (process time, all folds):

* ``one-hot ridge``: ridge (RidgeCV) on the one-hot mutant sequence, the reviewer's baseline;
* ``frozen ridge (MODEL)``: ridge on the model's mean last-layer embeddings;
* ``lora (MODEL)`` / ``full (MODEL)``: ``protein-performer finetune`` (mode lora / full), one
  run per fold (10% of the training fold as the inner validation split, the best checkpoint
  predicts the test fold through ``pp.load(...).predict``).

``--lrs 1e-3,3e-3,1e-2`` sweeps the learning rate of lora/full: each value is the head's LR,
the adapters' (lora) or backbone's (full) LR keeps the ratio of ``conf/mode/MODE.yaml`` (lora
1:1, full 1:10). Each candidate trains on the training folds minus the inner validation split;
the one with the best Spearman on that inner split (never the test fold) predicts the test
fold. ``--select first-fold`` picks once on fold 0's inner split and reuses that LR for the
other folds (about 2x cheaper than ``each-fold``, the default).

``--residue``: the residue-level check instead of the scan. Per-residue labels from the bundled
structures (``../shared/data/structures``, parsed by ``contacts.structures.read_chain``):
buried (``B``) when a residue's contact number (other residues' Cβ, Cα for Gly, within 10 Å of
its own) is above its chain's median, else exposed (``E``). ``task=residue_classification``
with mode frozen and lora on leave-chains-out folds (chains of one PDB entry stay together);
per-residue accuracy, macro F1 and MCC over the pooled held-out residues, against the
majority class and an amino-acid-identity baseline (each residue type's majority label in
the training chains).

``--model [NAME=]CKPT`` (repeatable) names the pretrained models (NAME labels the rows); without
one (and with ``--quick``) a tiny random model stands in, which only checks that the pipeline
runs. ``--quick`` also subsamples the variants and trains one epoch. The table goes to standard
output (markdown) and, with ``--out``, to a JSON file. An ESM-2 8M-shape model (dim 320, 6
blocks, 20 heads) trained briefly on the demo data is made with
``protein-performer train experiment=demo run_name=esm8m_shape model.config.dim=320
model.config.depth=6 model.config.heads=20 model.config.ff_dim=1280 model.config.nb_features=null
...`` (the exact command is in docs/RESULTS.md).

    python scripts/studies/finetune_benchmark.py --quick
    python scripts/studies/finetune_benchmark.py \
        --model demo=outputs/demo/<run>/checkpoints/last.ckpt \
        --limit 1000 --epochs 6 --batch-size 8 --lrs 1e-3,3e-3,1e-2 --out runs/ft.json
    python scripts/studies/finetune_benchmark.py --residue --model demo=DEMO.ckpt --epochs 30
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import harness as h
import numpy as np

ROOT = h.REPO
DMS = h.SEQUENCES.parent / "dms"
STRUCTURES = h.SEQUENCES.parent / "structures"
AA = "ACDEFGHIKLMNPQRSTVWY"
#: Contact number radius (Å) and the per-residue classes of the residue check.
BURIAL_RADIUS = 10.0
BURIED, EXPOSED = "B", "E"


def load_scan(dms: Path, column: str, limit: int | None,
              seed: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Mutant sequences, labels and mutated positions (NaN labels left out)."""
    from protein_performer.data.fasta import read_fasta

    wt = next(read_fasta(dms / "BLAT_ECOLX_wt_offset24.fasta")).sequence
    seqs, ys, pos = [], [], []
    with open(dms / "BLAT_ECOLX_Ranganathan2015.csv", encoding="utf-8-sig", newline="") as fh:
        for row in csv.DictReader(fh):
            value = row[column].strip()
            if not value or value.lower() == "nan":
                continue
            m = row["mutant"]
            p = int(m[1:-1]) - 24
            assert wt[p] == m[0], m
            seqs.append(wt[:p] + m[-1] + wt[p + 1 :])
            ys.append(float(value))
            pos.append(p)
    idx = np.arange(len(seqs))
    if limit is not None and limit < len(seqs):
        idx = np.sort(np.random.default_rng(seed).choice(len(seqs), limit, replace=False))
    return [seqs[i] for i in idx], np.array(ys)[idx], np.array(pos)[idx]


def folds(kind: str, positions: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    """Test indices of each fold: by position (GroupKFold over positions) or random (KFold)."""
    from sklearn.model_selection import GroupKFold, KFold

    n = len(positions)
    if kind == "position":
        split = GroupKFold(n_splits=k).split(np.zeros(n), groups=positions)
    else:
        split = KFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(n))
    return [test for _, test in split]


def one_hot(seqs: list[str]) -> np.ndarray:
    index = {a: i for i, a in enumerate(AA)}
    out = np.zeros((len(seqs), len(seqs[0]) * len(AA)), np.float32)
    for r, s in enumerate(seqs):
        for p, a in enumerate(s):
            if a in index:
                out[r, p * len(AA) + index[a]] = 1.0
    return out


def ridge_cv(x: np.ndarray, y: np.ndarray, fold_list: list[np.ndarray]) -> np.ndarray:
    """Out-of-fold predictions of RidgeCV (alpha chosen inside each training fold)."""
    from sklearn.linear_model import RidgeCV

    pred = np.zeros_like(y)
    for test in fold_list:
        train = np.setdiff1d(np.arange(len(y)), test)
        model = RidgeCV(alphas=np.logspace(-2, 4, 13)).fit(x[train], y[train])
        pred[test] = model.predict(x[test])
    return pred


def lr_overrides(mode: str, lr: float | None) -> list[str]:
    """Overrides that set head LR ``lr`` and the backbone (or adapter) LR in the mode's default
    ratio to it (``conf/mode/MODE.yaml``)."""
    from omegaconf import OmegaConf

    if lr is None:
        return []
    conf = OmegaConf.load(ROOT / "protein_performer" / "conf" / "mode" / f"{mode}.yaml")
    return [f"mode.head_lr={lr:g}", f"mode.lr={lr * (float(conf.lr) / float(conf.head_lr)):g}"]


def fold_table(path: Path, label: str, rows: list[tuple[str, str]], train: set[int],
               valid: set[int]) -> Path:
    """The labels table of one fold's ``finetune`` run: its train and valid rows of
    (sequence, label), with their split; the test rows stay out."""
    h.write_csv(path, [{"sequence": rows[i][0], label: rows[i][1],
                        "split": "valid" if i in valid else "train"}
                       for i in sorted(train | valid)], ["sequence", label, "split"])  # fmt: skip
    return path


def run_finetune(base: str, table: Path, out: Path, mode: str, args: argparse.Namespace,
                 extra: list[str]) -> str:  # fmt: skip
    """One ``finetune`` run on ``table`` (its split column); returns the best checkpoint."""
    from protein_performer.finetune.train import finetune
    from protein_performer.training.compose import compose_config

    cfg = compose_config(
        [f"base={base}", f"data.train={table}", f"mode={mode}", f"paths.output_dir={out}",
        f"trainer.max_epochs={args.epochs}", "test=false", "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar", "~callbacks.training_curve",
        "trainer.enable_model_summary=false", f"data.max_batch_size={args.batch_size}",
        f"seed={args.seed}", *extra],
        name="finetune", direct_keys=("base", "data.train"))
    result = finetune(cfg)
    return result["best_checkpoint"] or result["last_checkpoint"]


def inner_valid(train: np.ndarray, fold: int, seed: int, groups: np.ndarray | None = None,
                frac: float = 0.1) -> set[int]:  # fmt: skip
    """The inner validation split of a training fold (seeded by fold, so every LR candidate of
    a fold sees the same one): ``frac`` of the records, or whole groups when given."""
    rng = np.random.default_rng([seed, fold])
    if groups is None:
        return set(rng.choice(train, max(1, int(len(train) * frac)), replace=False).tolist())
    names = sorted(set(groups[train].tolist()))
    picked = set(rng.choice(names, max(1, round(len(names) * frac)), replace=False).tolist())
    return {int(i) for i in train if groups[i] in picked}


def swept_cv(
    fit: Callable[[int, set[int], set[int], float | None], Callable[[list[int]], np.ndarray]],
    score: Callable[[np.ndarray, list[int]], float], n: int, fold_list: list[np.ndarray],
    lrs: list[float] | None, select: str, seed: int,
    groups: np.ndarray | None = None) -> tuple[list, list[dict]]:
    """Out-of-fold predictions with the learning rate chosen on each training fold's inner
    validation split. ``fit(fold, train, valid, lr)`` trains and returns a predictor of index
    lists; ``score(pred, idx)`` rates a predictor on the inner split (higher is better).
    Per fold: ``{"lr": the LR used (None: the mode's defaults), "inner": {LR: score}}``."""
    pred: list = [None] * n
    chosen: list[dict] = []
    keep: float | None = None
    for f, test in enumerate(fold_list):
        train = np.setdiff1d(np.arange(n), test)
        valid = inner_valid(train, f, seed, groups)
        fit_idx = {int(i) for i in train} - valid
        candidates: list[float | None] = [None] if not lrs else list(lrs)
        if lrs and select == "first-fold" and f > 0:
            candidates = [keep]
        best: tuple[float, float | None, Callable] | None = None
        inner = {}
        for lr in candidates:
            predictor = fit(f, fit_idx, valid, lr)
            rating = score(predictor(sorted(valid)), sorted(valid))
            inner["default" if lr is None else f"{lr:g}"] = rating
            rating = -np.inf if not np.isfinite(rating) else rating
            if best is None or rating > best[0]:
                best = (rating, lr, predictor)
        assert best is not None
        keep = best[1]
        chosen.append({"lr": keep, "inner": inner})
        for i, v in zip(test.tolist(), best[2](test.tolist()), strict=True):
            pred[i] = v
    return pred, chosen


def finetune_cv(base: str, mode: str, rows: list[tuple[str, str]], label: str, extra: list[str],
                decode: Callable, score: Callable[[list, list[int]], float],
                fold_list: list[np.ndarray], args: argparse.Namespace, work: Path,
                groups: np.ndarray | None = None) -> tuple[list, list[dict]]:  # fmt: skip
    """Out-of-fold predictions of ``finetune`` runs (one per fold and LR candidate) on ``rows``
    of (sequence, ``label``), each model's ``predict`` output turned into predictions by
    ``decode(lm, output)``, and the LR each fold used (see :func:`swept_cv`)."""
    import protein_performer as pp

    def fit(f: int, train: set[int], valid: set[int], lr: float | None):  # noqa: ANN202
        tag = f"{mode}_fold{f}" + ("" if lr is None else f"_lr{lr:g}")
        table = fold_table(work / f"{tag}.csv", label, rows, train, valid)
        lm = pp.load(run_finetune(base, table, work / tag, mode, args,
                                  [*extra, *lr_overrides(mode, lr)]), "cpu")  # fmt: skip
        return lambda idx: decode(lm, lm.predict([rows[i][0] for i in idx]))

    return swept_cv(fit, score, len(rows), fold_list, args.lrs, args.select, args.seed, groups)


def scan_cv(base: str, mode: str, seqs: list[str], y: np.ndarray, args: argparse.Namespace,
            work: Path, kind: str, fold_list: list[np.ndarray]) -> tuple[np.ndarray, list[dict]]:
    """:func:`finetune_cv` of the scan's labels on the ``kind`` folds, picking the LR by
    Spearman."""
    (work / kind).mkdir(parents=True)
    pred, chosen = finetune_cv(
        base, mode, [(s, f"{v:.6f}") for s, v in zip(seqs, y, strict=True)], "label", [],
        lambda lm, out: out, lambda p, idx: h.spearman(np.asarray(p), y[idx]), fold_list, args,
        work / kind)  # fmt: skip
    return np.asarray(pred, dtype=np.float64), chosen


# --------------------------------------------------------------------------------------------
# The residue-level check: buried vs exposed from the bundled structures
# --------------------------------------------------------------------------------------------
def contact_number(cb: np.ndarray, radius: float = BURIAL_RADIUS) -> np.ndarray:
    """Per residue, how many other residues' Cβ (Cα for Gly) lie within ``radius`` Å of its
    own: (N, 3) -> (N,)."""
    dist = np.linalg.norm(cb[:, None, :] - cb[None, :, :], axis=-1)  # (N, N)
    return (dist < radius).sum(1) - 1


def burial_chains(structures: Path) -> list[dict]:
    """The chains of ``structures/chains.csv`` with per-residue labels: ``B`` where the contact
    number is above the chain's median, ``E`` elsewhere (so each chain is about half buried,
    whatever its size). Sequences are the observed residues, as ``chains.fasta`` holds them."""
    from protein_performer.contacts.structures import read_chain

    chains = []
    with open(structures / "chains.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            chain = read_chain(structures / row["file"], row["chain"])
            if chain.sequence != row["sequence"]:
                raise SystemExit(f"error: {row['file']}: observed residues differ from chains.csv")
            cn = contact_number(chain.cb)
            labels = "".join(BURIED if c > np.median(cn) else EXPOSED for c in cn)
            chains.append({"name": chain.name, "group": row["pdb_id"], "sequence": chain.sequence,
                           "labels": labels})  # fmt: skip
    return chains


def residue_metrics(pred: list[str], truth: list[str]) -> dict[str, float]:
    """Accuracy, macro F1 and MCC over every held-out residue (pooled across folds)."""
    from sklearn.metrics import f1_score, matthews_corrcoef

    p = np.array(list("".join(pred)))
    t = np.array(list("".join(truth)))
    return {"acc": float((p == t).mean()),
            "f1": float(f1_score(t, p, average="macro", zero_division=0)),
            "mcc": float(matthews_corrcoef(t, p))}  # fmt: skip


def residue_baselines(chains: list[dict], fold_list: list[np.ndarray]) -> list[dict]:
    """Out-of-fold predictions that read no model: the training chains' majority class, and
    each amino acid's majority label in the training chains (hydrophobic residues are buried)."""
    from collections import Counter

    truth = [c["labels"] for c in chains]
    majority, by_aa = [""] * len(chains), [""] * len(chains)
    for test in fold_list:
        train = np.setdiff1d(np.arange(len(chains)), test)
        overall = Counter("".join(truth[i] for i in train)).most_common(1)[0][0]
        votes: dict[str, Counter] = {}
        for i in train:
            for a, lab in zip(chains[i]["sequence"], truth[i], strict=True):
                votes.setdefault(a, Counter())[lab] += 1
        rule = {a: v.most_common(1)[0][0] for a, v in votes.items()}
        for i in test:
            seq = chains[i]["sequence"]
            majority[i] = overall * len(seq)
            by_aa[i] = "".join(rule.get(a, overall) for a in seq)
    return [{"method": "majority class", **residue_metrics(majority, truth), "cpu_s": 0.0},
            {"method": "amino-acid identity", **residue_metrics(by_aa, truth), "cpu_s": 0.0}]


def residue_cv(base: str, mode: str, chains: list[dict], fold_list: list[np.ndarray],
               args: argparse.Namespace, work: Path) -> tuple[list[str], list[dict]]:
    """Out-of-fold per-residue labels of ``finetune task=residue_classification`` runs; the LR
    (with ``--lrs``) is picked by MCC on held-out training chains."""
    truth = [c["labels"] for c in chains]
    extra = ["task=residue_classification", "data.labels=[burial]",
             f"data.classes=[{BURIED},{EXPOSED}]"]  # fmt: skip

    def decode(lm, probs: list) -> list[str]:  # noqa: ANN001
        return ["".join(lm.task_labels[k] for k in p.argmax(-1)) for p in probs]

    def score(pred: list[str], idx: list[int]) -> float:
        return residue_metrics(pred, [truth[i] for i in idx])["mcc"]

    return finetune_cv(base, mode, [(c["sequence"], c["labels"]) for c in chains], "burial",
                       extra, decode, score, fold_list, args, work,
                       np.array([c["group"] for c in chains]))  # fmt: skip


def residue_check(models: list[tuple[str, str]], args: argparse.Namespace,
                  work: Path) -> list[dict]:  # fmt: skip
    """The residue table: baselines, then frozen and lora per model (``--methods``)."""
    from sklearn.model_selection import GroupKFold

    chains = burial_chains(args.structures)
    groups = [c["group"] for c in chains]
    k = min(args.folds, len(set(groups)))
    fold_list = [test for _, test in GroupKFold(n_splits=k).split(chains, groups=groups)]
    truth = [c["labels"] for c in chains]
    rows = residue_baselines(chains, fold_list)
    for label, base in models:
        for mode in ("frozen", "lora", "full"):
            if mode not in args.methods:
                continue
            sub = work / f"{label}_{mode}"
            sub.mkdir(parents=True, exist_ok=True)
            start = time.process_time()
            pred, chosen = residue_cv(base, mode, chains, fold_list, args, sub)
            rows.append({"method": f"{mode} ({label})", **residue_metrics(pred, truth),
                         "cpu_s": time.process_time() - start, "lrs": chosen})  # fmt: skip
    n_res = sum(len(c["sequence"]) for c in chains)
    buried = sum(c["labels"].count(BURIED) for c in chains) / n_res
    print(f"buried vs exposed (contact number within {BURIAL_RADIUS:g} A above the chain's "
          f"median): {len(chains)} chains, {n_res} residues ({buried:.1%} buried), {k} "
          f"leave-chains-out folds, {args.epochs} epoch(s), batch {args.batch_size}")  # fmt: skip
    print(h.markdown_table(
        ["method", "accuracy", "macro F1", "MCC", "LR (per fold)", "CPU time"],
        ([r["method"], f"{r['acc']:.3f}", f"{r['f1']:.3f}", f"{r['mcc']:.3f}",
          lr_text(r.get("lrs")), f"{r['cpu_s']:.0f} s"] for r in rows), left=6))  # fmt: skip
    return rows


def lr_text(chosen: list[dict] | None) -> str:
    """The LR each fold used, for the table: ``default`` or ``1e-3, 3e-3, ...``."""
    if not chosen:
        return "-"
    if all(c["lr"] is None for c in chosen):
        return "default"
    return ", ".join(f"{c['lr']:g}" for c in chosen)


def tiny_model(work: Path) -> str:
    import torch

    from protein_performer.data.tokenizer import Alphabet
    from protein_performer.interop.export import export_model
    from protein_performer.interop.record import LoadedModel
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    torch.manual_seed(0)
    config = PerformerConfig(dim=32, depth=2, heads=4, ff_dim=64, nb_features=16)
    loaded = LoadedModel(PerformerLM(config).eval(), config, Alphabet(), Path("tiny-random"),
                         torch.device("cpu"), "memory")
    return str(export_model(loaded, work / "tiny_random"))


def parse_models(specs: list[str]) -> list[tuple[str, str]]:
    """``[NAME=]CKPT`` -> (label, path); the label defaults to the checkpoint's file name."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name:
            name, path = Path(spec).name, spec
        out.append((name, path))
    return out


def parse_lrs(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --lrs {text!r}: give numbers separated by commas") from None
    if not lrs or any(not lr > 0 for lr in lrs):
        raise SystemExit(f"error: --lrs {text!r}: learning rates must be positive")
    return lrs


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    p.add_argument(
        "--model", action="append", default=[], metavar="[NAME=]CKPT",
        help="pretrained model(s) to probe and fine-tune (repeatable); NAME labels the rows")
    p.add_argument("--dms", type=Path, default=DMS, help="folder with the BLAT_ECOLX files")
    p.add_argument("--column", default="2500", help="label column (default: 2500)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--limit", type=int, default=None, help="use this many variants (random)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per fine-tuning run")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of onehot,frozen,lora,full (default: all; with "
                   "--residue: frozen,lora)")
    p.add_argument(
        "--lrs", default=None, metavar="LR,LR,...",
        help="head learning rates to sweep for the fine-tuning runs (the backbone's keeps the "
        "mode's default ratio), picked on an inner validation split of the training folds")
    p.add_argument("--select", choices=("each-fold", "first-fold"), default="each-fold",
                   help="with --lrs: pick the LR in every fold, or once on fold 0 (cheaper)")
    p.add_argument(
        "--residue", action="store_true",
        help="the residue-level check (buried vs exposed on the bundled structures) instead "
        "of the BLAT_ECOLX scan")
    p.add_argument("--structures", type=Path, default=STRUCTURES,
                   help="folder with chains.csv + PDB files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true",
                   help="CI size: 250 variants, 1 epoch, a tiny random model unless --model")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.lrs = parse_lrs(args.lrs)
    default_methods = "frozen,lora" if args.residue else "onehot,frozen,lora,full"
    args.methods = [m.strip() for m in (args.methods or default_methods).split(",") if m.strip()]
    logging.basicConfig(level=logging.WARNING)
    quiet = ("pytorch_lightning", "pytorch_lightning.utilities.rank_zero", "lightning_fabric",
             "lightning.pytorch.utilities.rank_zero", "protein_performer")  # fmt: skip
    import pytorch_lightning  # noqa: F401 - it sets its loggers' levels on import
    import torch

    for name in quiet:
        logging.getLogger(name).setLevel(logging.ERROR)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.limit = args.limit or 250
        args.epochs = 1
    needed = args.structures / "chains.csv" if args.residue else (
        args.dms / "BLAT_ECOLX_Ranganathan2015.csv")  # fmt: skip
    if not needed.is_file():
        print(f"error: {needed} does not exist", file=sys.stderr)
        return 2
    methods = args.methods
    with tempfile.TemporaryDirectory(prefix="pp_ft_bench_") as tmp:
        work = Path(tmp)
        models = parse_models(args.model) or [("tiny random", tiny_model(work))]
        if args.residue:
            rows = residue_check(models, args, work)
            if args.out:
                write_json(args, {"residue_rows": rows})
            return 0
        seqs, y, pos = load_scan(args.dms, args.column, args.limit, args.seed)
        fold_sets = {k: folds(k, pos, args.folds, args.seed) for k in ("random", "position")}
        rows = []

        def cv_row(method: str, cpu_s: float, predict: Callable) -> dict:
            """Spearman of ``predict(kind, folds) -> (out-of-fold predictions, the LR per fold
            or None)`` on both fold kinds; ``cpu_s``: what the features cost before."""
            row: dict = {"method": method, "cpu_s": cpu_s}
            for kind, fl in fold_sets.items():
                start = time.process_time()
                pred, chosen = predict(kind, fl)
                row["cpu_s"] += time.process_time() - start
                # Also Spearman within each test fold: the pooled out-of-fold one also rewards
                # (or punishes) how well the folds' models agree on an offset and scale.
                row[kind] = h.spearman(pred, y)
                row[f"{kind}_per_fold"] = [h.spearman(pred[test], y[test]) for test in fl]
                if chosen is not None:
                    row.setdefault("lrs", {})[kind] = chosen
            return row

        def ridge(x: np.ndarray) -> Callable:
            return lambda kind, fl: (ridge_cv(x, y, fl), None)

        if "onehot" in methods:
            rows.append(cv_row("one-hot ridge", 0.0, ridge(one_hot(seqs))))
        for m, (label, base) in enumerate(models):
            if "frozen" in methods:
                import protein_performer as pp

                start = time.process_time()
                emb = pp.load(base, "cpu").embed(seqs)
                rows.append(cv_row(f"frozen ridge ({label})", time.process_time() - start,
                                   ridge(emb)))  # fmt: skip
            for mode in ("lora", "full"):
                if mode in methods:
                    rows.append(cv_row(f"{mode} ({label})", 0.0, partial(
                        scan_cv, base, mode, seqs, y, args, work / f"m{m}_{mode}")))
    print(f"BLAT_ECOLX column {args.column}: {len(seqs)} variants, {args.folds}-fold CV, "
          f"{args.epochs} epoch(s) per fine-tune, torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}")
    table = []
    for r in rows:
        lrs = r.get("lrs") or {}
        chosen = "; ".join(lr_text(lrs.get(k)) for k in ("random", "position")) if lrs else "-"
        means = "; ".join(f"{np.mean(r[f'{k}_per_fold']):.3f}" for k in ("random", "position"))
        table.append([r["method"], f"{r['random']:.3f}", f"{r['position']:.3f}", means, chosen,
                      f"{r['cpu_s']:.0f} s"])
    print(h.markdown_table(["method", "Spearman (random folds)", "Spearman (position folds)",
                            "mean per fold (random; position)",
                            "head LR per fold (random; position)", "CPU time"], table, left=6))
    if args.out:
        write_json(args, {"n": len(seqs), "rows": rows})
    return 0


def write_json(args: argparse.Namespace, payload: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, **payload}
    args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
