#!/usr/bin/env python
"""Does a protein LM read its family (homolog) context, and does FAVOR+ read it as well as exact?

Issue 21's study, at CPU scale, through the project's own commands and API:

1. ``protein-performer preprocess`` of the corpus with ``--cluster-split IDENTITY`` (MMseqs2):
   whole 50%-identity clusters go to train / valid / test, and ``--ood-frac`` more clusters to
   a fourth split, ``ood``, so no held-out family has a member in training. Families (what a
   ``data.layout=family`` row holds) are then built inside each split by MMseqs2
   (``data.family_method`` / ``data.family_identity``, cached in the store), here once, before
   any training, so parallel runs never build them twice.
2. Causal LMs trained with ``protein-performer train`` on equal training-process CPU time each
   (``TimeBudget``, clock=cpu, validation excluded; ``--threads`` torch threads, data loaded in
   the process): FAVOR+ softmax, FAVOR+ ReLU and the exact twin, each on single-sequence rows
   (``experiment=small_clm``, rows <= ``--single-len`` tokens) and on family rows
   (``experiment=family_clm``, rows <= ``--family-tokens`` tokens, members cropped to
   ``--single-len``), x ``--seeds``; plus FAVOR+ softmax on family rows with
   ``model.config.positions=member`` (rotary restarting at each member) against the default
   ``sequence`` (positions continuing along the row).
3. Scoring through the API (``protein_performer.load``; ``lm.score(..., strategy="causal",
   context=lm.context(members))``), one fresh process per model:

   - *Family context*: targets are test-split (and ood-split) records whose family (the same
     MMseqs2 families, built in that split) has at least ``--min-family`` members, at most one
     target per family group (a target is never a member of an earlier target's family), at
     most ``--targets`` per split. A target's context is k = 0, 1, 4, 16 other members of its
     own family, the first k of one fixed random order (so the contexts are nested), fewer
     when the family is smaller (the report gives the mean count). Every member and target is
     cropped to its first ``--single-len - 2`` residues, as training crops held-out rows, and
     every model reads all k members (``max_tokens`` = no limit; the trained row length is
     reported: more members than a training row held is extrapolation). Perplexity is
     ``exp(-sum log-likelihood / tokens)`` over the targets' scored tokens (residues and the
     final ``<eos>``), the same targets for every k and model, next to the unigram baseline
     (training residue frequencies on the same tokens).
   - *Variant effect*: BLAT_ECOLX (Stiffler et al. 2015, column ``2500``) scored with
     ``lm.score_variants(wt, mutants, strategy="causal", context=ctx)``, without a context and
     with the wild type's homologs retrieved by ``protein-performer homologs`` from the
     training split; Spearman rho of each.
   - *Length extrapolation*: the single-row models (trained on rows <= ``--single-len``
     tokens) score held-out proteins (test and ood records, plus the records of
     ``long_proteins.fasta`` that are not in the training split, titin among them), cropped to
     4,096 tokens, binned by length (<= 512, 513-1024, 1025-2048, 2049-4096 tokens).

Outputs under ``--out``: ``store/`` (with its ``families/``), ``eval_set.json`` (targets,
contexts, BLAT homologs, long proteins: what every model is scored on), ``runs/<name>/`` (Hydra
run directories with ``time_budget.json`` and ``family_eval.json``), ``logs/``,
``family_context.csv`` (one row per run), ``family_context.json`` (everything) and
``family_context.md`` (the tables and every command).

Examples::

    python scripts/studies/family_context.py --quick          # smoke run: tiny models
    python scripts/studies/family_context.py --jobs 2         # the study (~40 min on 2 cores)
    python scripts/studies/family_context.py --skip-existing  # train / score what is missing
    python scripts/studies/family_context.py --report-only    # tables of the finished runs
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness as h

log = logging.getLogger("family_context")

LONG_PROTEINS = h.SEQUENCES / "long_proteins.fasta"
DMS = h.SEQUENCES.parent / "dms"
BLAT_WT = DMS / "BLAT_ECOLX_wt_offset24.fasta"
BLAT_CSV = DMS / "BLAT_ECOLX_Ranganathan2015.csv"
BLAT_OFFSET = 24
BLAT_LABEL = "2500"
#: Homologs in context (k), the issue's columns.
KS = (0, 1, 4, 16)
SPLITS = ("test", "ood")
#: Length bins (tokens, with <cls> and <eos>) of the extrapolation table.
BINS = ((1, 512), (513, 1024), (1025, 2048), (2049, 4096))
LONG_CROP = 4096
#: A small CPU model (~0.1M parameters: 2 layers, the minimum for copying from context; heads of
#: width 16 as ESM-2 8M, m = 48 = the d log d default): ~30k training tokens per CPU-second with
#: FAVOR+, so a 2-CPU-minute run reads ~3.5M tokens (paper_protein.py's 4-layer dim-128 model
#: reads ~0.6M and barely leaves the unigram perplexity in that time).
MODEL = ["dim=64", "depth=2", "heads=4", "ff_dim=256", "nb_features=48"]
RESULT_FILE = "family_eval.json"
#: Row key -> what ``family_eval.json`` calls the BLAT_ECOLX rho (without, with homologs).
BLAT_KEYS = {"blat_rho": "rho", "blat_rho_context": "rho_context"}
FIELDS = ("name", "rows", "variant", "positions", "seed", "steps", "train_cpu_s", "wall_s",
          *(f"{s}_ppl_k{k}" for s in SPLITS for k in KS), "blat_rho", "blat_rho_context",
          *(f"long_ppl_{lo}_{hi}" for lo, hi in BINS), "command")


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


def plan_runs(args: argparse.Namespace, store: Path, budget: h.Budget,
              eval_set: Path) -> list[h.Run]:
    """Every training run, in launch order (seed-major, so a cut-short study has whole seeds),
    each scored on ``eval_set`` in a fresh process once trained."""
    # A short warmup: exact makes ~4x fewer steps on family rows.
    shared = [*h.store_overrides(args, store, budget),
              *(f"model.config.{kv}" for kv in (h.QUICK_MODEL if args.quick else MODEL)),
              "model.optim.warmup_steps=50", f"data.max_len={args.single_len}",
              f"data.max_tokens={args.max_tokens}", f"trainer.val_check_interval={args.val_every}",
              f"trainer.limit_val_batches={args.val_batches}"]
    # Issue 21's designs read family rows without the position memory (on by default for
    # family rows since 0.6.0); scripts/studies/bench_recall.py measures the memory.
    family = ["experiment=family_clm", f"data.family_max_tokens={args.family_tokens}",
              f"data.family_method={args.family_method}",
              f"data.family_identity={args.family_identity:g}", "model.config.position_memory=0"]
    plan = [(rows, variant, "sequence") for rows in ("single", "family")
            for variant in h.ATTENTION]
    plan.append(("family", "favor-softmax", "member"))
    runs = []
    for seed in args.seeds:
        for rows, variant, positions in plan:
            head = family if rows == "family" else ["experiment=small_clm"]
            overrides = [*head, *shared, *h.ATTENTION[variant], f"seed={seed}"]
            if rows == "family":
                overrides.append(f"model.config.positions={positions}")
            pos = "" if positions == "sequence" else f"-{positions}"
            name = f"{rows}-{variant}{pos}-s{seed}"
            tags = {"rows": rows, "variant": variant, "positions": positions, "seed": seed}
            run = h.Run(name, overrides, args.out.resolve() / "runs" / name, tags)
            spec = {"ckpt": str(run.checkpoint), "eval_set": str(eval_set),
                    "threads": args.threads, "out": str(run.run_dir / RESULT_FILE), "blat": True,
                    "long": rows == "single"}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--score", json.dumps(spec)]
            run.after.append(("score", cmd, run.run_dir / RESULT_FILE))
            runs.append(run)
    return runs


# --------------------------------------------------------------------------------------------
# The evaluation set: targets and contexts, BLAT homologs, long proteins (built once)
# --------------------------------------------------------------------------------------------


def split_families(store: Path, args: argparse.Namespace) -> dict[str, Any]:
    """MMseqs2 families of every split (cached in the store; train and valid are the ones the
    runs read, test and ood give the targets' contexts)."""
    from protein_performer.data.homology import store_families
    from protein_performer.data.store import TokenStore

    st = TokenStore(store)
    out = {}
    for split in ("train", "valid", *SPLITS):
        t0 = time.perf_counter()
        out[split] = store_families(st, split, args.family_method, args.family_identity,
                                    max(1, args.mmseqs_threads))
        log.info("%s families (%.0f s): %s", split, time.perf_counter() - t0,
                 out[split].meta["sizes"])
    return out


def _stable_order(keys: list[int], seed: int, salt: str) -> list[int]:
    """``keys`` in a fixed pseudo-random order (hash of seed, salt and key): the same on every
    machine and Python, whatever the set iteration order."""

    def h(k: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{salt}:{k}".encode(), digest_size=8).digest()

    return sorted(keys, key=h)


def pick_targets(store: Any, families: Any, args: argparse.Namespace,
                 split: str) -> list[dict[str, Any]]:
    """Targets of one split and their nested contexts (see the module docstring)."""
    from protein_performer.data.tokenizer import Alphabet

    alphabet = Alphabet()
    crop = args.single_len - 2
    sizes = families.sizes()
    big = [f for f in range(len(families)) if sizes[f] >= args.min_family]
    taken: set[int] = set()
    targets = []
    for f in _stable_order(big, args.eval_seed, f"target:{split}"):
        members = [int(m) for m in families[f]]
        key = int(families.keys[f])
        if key in taken:
            continue
        others = _stable_order([m for m in members if m != key], args.eval_seed, f"ctx:{key}")
        context = others[: max(KS)]

        def seq(i: int) -> str:
            return alphabet.decode(store.tokens(i)[:crop])

        targets.append({"id": store.id(key), "sequence": seq(key), "family_size": len(members),
                       "context": [[store.id(m), seq(m)] for m in context]})
        taken.update(members)
        if len(targets) == args.targets:
            break
    log.info("%s: %d targets (families with >= %d members: %d)", split, len(targets),
             args.min_family, len(big))
    return targets


def export_split(store: Any, split: str, path: Path) -> set[str]:
    """One split of the store as FASTA (the retrieval database); returns its sequences."""
    from protein_performer.data.tokenizer import Alphabet

    alphabet = Alphabet()
    seqs: set[str] = set()
    with path.open("w") as fh:
        for i in store.indices(split):
            s = alphabet.decode(store.tokens(int(i)))
            seqs.add(s)
            fh.write(f">{store.id(int(i))}\n{s}\n")
    return seqs


def blat_set(args: argparse.Namespace, train_fasta: Path) -> dict[str, Any]:
    """BLAT_ECOLX wild type, mutants, labels, and its homologs from the training split,
    retrieved with ``protein-performer homologs`` (the command is reported)."""
    from protein_performer.data.inputs import read_records

    (wt,) = read_records(BLAT_WT)
    with BLAT_CSV.open(encoding="utf-8-sig", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get(BLAT_LABEL, "").strip()]
    if args.blat_mutants and args.blat_mutants < len(rows):
        keep = set(
            _stable_order(list(range(len(rows))), args.eval_seed, "blat")[: args.blat_mutants])
        rows = [r for i, r in enumerate(rows) if i in keep]
    out = args.out.resolve() / "blat_homologs.fasta"
    cmd = h.cli("homologs", str(BLAT_WT), str(train_fasta), str(out), "--max-seqs", str(max(KS)),
                "--min-seq-id", f"{args.family_identity:g}", "--threads",
                str(max(1, args.mmseqs_threads)), "--overwrite")
    try:
        h.call(cmd, args.threads, args.out.resolve() / "logs" / "homologs.log")
        found = read_records(out)
    except SystemExit as exc:  # a small corpus may hold no beta-lactamase: homologs says so
        if "no homolog of" not in str(exc):
            raise
        found = []
    homologs = [[r.id, r.sequence[: args.single_len - 2]] for r in found]
    log.info("BLAT_ECOLX: %d mutants, %d homologs from the training split", len(rows),
             len(homologs))
    return {"wild_type": wt.sequence, "offset": BLAT_OFFSET,
            "mutants": [r["mutant"] for r in rows], "labels": [float(r[BLAT_LABEL]) for r in rows],
            "homologs": homologs, "command": h.shown(cmd, args.threads)}


def long_set(store: Any, train_seqs: set[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Held-out proteins per length bin, cropped to 4,096 tokens: long_proteins.fasta records
    that are not in the training split first (titin ...), then test/ood records, at most
    ``--long-per-bin`` per bin."""
    from protein_performer.data.inputs import read_records
    from protein_performer.data.tokenizer import Alphabet

    alphabet = Alphabet()
    crop = LONG_CROP - 2
    candidates: list[tuple[int, str, str]] = []  # (priority, id, sequence)
    if LONG_PROTEINS.is_file():
        for r in read_records(LONG_PROTEINS, on_invalid="skip"):
            if r.sequence.upper() not in train_seqs:
                candidates.append((0, r.id, r.sequence.upper()[:crop]))
    held = [int(i) for split in SPLITS for i in store.indices(split)]
    for i in _stable_order(held, args.eval_seed, "long"):
        candidates.append((1, store.id(i), alphabet.decode(store.tokens(i)[:crop])))
    out: list[dict[str, Any]] = []
    counts = dict.fromkeys(BINS, 0)
    for _, rid, seq in sorted(candidates, key=lambda c: c[0]):
        tokens = len(seq) + 2
        b = next(b for b in BINS if b[0] <= tokens <= b[1])
        if counts[b] < args.long_per_bin:
            counts[b] += 1
            out.append({"id": rid, "sequence": seq, "bin": list(b)})
    log.info("long proteins per bin: %s", {f"{lo}-{hi}": n for (lo, hi), n in counts.items()})
    return out


def unigram(store: Any, targets: dict[str, list[dict[str, Any]]],
            max_len: int) -> dict[str, float]:
    """Training-split residue frequencies (with <eos>) on the targets' scored tokens."""
    from protein_performer.data.dataset import InMemorySource, StoreSubset
    from protein_performer.data.tokenizer import Alphabet

    alphabet = Alphabet()
    train = StoreSubset(store, store.indices("train"))
    out = {}
    for split, ts in targets.items():
        held = InMemorySource([t["id"] for t in ts], [alphabet.encode(t["sequence"]) for t in ts])
        out[split] = h.unigram_baseline(train, held, "clm", max_len)["ppl"] if ts else math.nan
    return out


def make_eval_set(store_dir: Path, path: Path, args: argparse.Namespace) -> None:
    """Everything every model is scored on, in one JSON at ``path`` (built once: reused with
    ``--skip-existing``)."""
    from protein_performer.data.store import TokenStore

    if path.is_file() and args.skip_existing:
        return
    families = split_families(store_dir, args)
    store = TokenStore(store_dir)
    targets = {s: pick_targets(store, families[s], args, s) for s in SPLITS}
    train_fasta = args.out.resolve() / "train_split.fasta"
    train_seqs = export_split(store, "train", train_fasta)
    payload = {"targets": targets, "unigram": unigram(store, targets, args.single_len),
               "blat": blat_set(args, train_fasta), "long": long_set(store, train_seqs, args),
               "family_sizes": {s: f.meta["sizes"] for s, f in families.items()},
               "family_tokens": args.family_tokens, "single_len": args.single_len}
    path.write_text(json.dumps(payload) + "\n")


# --------------------------------------------------------------------------------------------
# Scoring one model (child process)
# --------------------------------------------------------------------------------------------


def score_model(spec: dict[str, Any]) -> None:
    """Score one checkpoint on the evaluation set (API only); writes ``family_eval.json``."""
    import protein_performer

    data = json.loads(Path(spec["eval_set"]).read_text())
    lm = protein_performer.load(spec["ckpt"], device="cpu", threads=spec["threads"])
    unlimited = 1 << 30  # every model reads all k members (see the module docstring)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"family": {}, "context_tokens": lm.config.context_tokens}
    for split in SPLITS:
        per_k: dict[str, Any] = {}
        for k in KS:
            ll = n = members = ctx_tokens = 0.0
            per_target = []
            for t in data["targets"][split]:
                ctx = None
                if k:
                    ctx = lm.context([tuple(m) for m in t["context"][:k]], max_tokens=unlimited)
                    members += len(ctx.members)
                    ctx_tokens += ctx.n_tokens
                ((_, s),) = list(lm.iter_score([(t["id"], t["sequence"])], "causal", context=ctx))
                ll += s.log_likelihood
                n += s.n_scored
                per_target.append(s.log_likelihood / s.n_scored)
            count = max(1, len(data["targets"][split]))
            per_k[str(k)] = {"ppl": math.exp(-ll / n) if n else math.nan, "tokens": int(n),
                             "mean_members": members / count,
                             "mean_context_tokens": ctx_tokens / count,
                             "target_mean_ll": per_target}
        out["family"][split] = per_k
    log.info("family context scored in %.0f s", time.perf_counter() - t0)

    if spec["blat"]:
        t0 = time.perf_counter()
        b = data["blat"]
        plain = lm.score_variants(b["wild_type"], b["mutants"], "causal", offset=b["offset"])
        out["blat"] = {"rho": h.spearman(list(plain), b["labels"]), "mutants": len(b["mutants"])}
        if b["homologs"]:
            ctx = lm.context([tuple(m) for m in b["homologs"]], max_tokens=unlimited)
            scores = lm.score_variants(b["wild_type"], b["mutants"], "causal", offset=b["offset"],
                                       context=ctx)
            out["blat"].update(rho_context=h.spearman(list(scores), b["labels"]),
                               homologs=len(ctx.members), context_tokens=ctx.n_tokens)
        log.info("BLAT_ECOLX scored in %.0f s", time.perf_counter() - t0)

    if spec["long"]:
        t0 = time.perf_counter()
        sums: dict[str, list[float]] = {}
        for rec in data["long"]:
            ((_, s),) = list(lm.iter_score([(rec["id"], rec["sequence"])], "causal"))
            acc = sums.setdefault("{}-{}".format(*rec["bin"]), [0.0, 0.0, 0.0])
            acc[0] += s.log_likelihood
            acc[1] += s.n_scored
            acc[2] += 1
        out["long"] = {
            b: {"ppl": math.exp(-ll / n), "tokens": int(n), "records": int(r)}
            for b, (ll, n, r) in sums.items()
        }
        log.info("long proteins scored in %.0f s", time.perf_counter() - t0)
    Path(spec["out"]).write_text(json.dumps(out) + "\n")


def collect(run: h.Run) -> dict[str, Any]:
    """One CSV row (and the details) from ``family_eval.json``."""
    ev = json.loads((run.run_dir / RESULT_FILE).read_text())
    row: dict[str, Any] = {"eval": ev}
    for split in SPLITS:
        for k in KS:
            row[f"{split}_ppl_k{k}"] = ev["family"][split][str(k)]["ppl"]
    blat = ev.get("blat", {})
    for key, name in BLAT_KEYS.items():
        row[key] = blat.get(name, math.nan)
    for lo, hi in BINS:
        row[f"long_ppl_{lo}_{hi}"] = ev.get("long", {}).get(f"{lo}-{hi}", {}).get("ppl", math.nan)
    return row


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(model label, its rows over seeds) per (rows, variant, positions), in run order."""
    keys = dict.fromkeys((r["rows"], r["variant"], r["positions"]) for r in rows)
    return [
        (v + ("" if pos == "sequence" else f" (positions={pos})"),
         h.select(rows, rows=rows_, variant=v, positions=pos))
        for rows_, v, pos in keys
    ]  # fmt: skip


def family_table(rows: list[dict[str, Any]], data: dict[str, Any]) -> str:
    ks = " / ".join(map(str, KS))
    header = ["model", "rows", f"test-family ppl, k = {ks}", f"OOD-cluster ppl, k = {ks}"]
    lines = []
    for label, sel in _groups(rows):
        ppl = [" / ".join(h.cell([r[f"{s}_ppl_k{k}"] for r in sel]) for k in KS) for s in SPLITS]
        ratio = [h.cell([r[f"{s}_ppl_k16"] / r[f"{s}_ppl_k0"] for r in sel], 1, 3) for s in SPLITS]
        steps = h.cell([r["steps"] for r in sel], 1, 0)
        lines.append([label, sel[0]["rows"], *ppl, *ratio, steps, len(sel)])
    uni = data["unigram"]
    every = [f"{uni[s]:.2f} (every k)" for s in SPLITS]
    lines.append(["unigram baseline", "-", *every, "-", "-", "-", "-"])
    return h.markdown_table([*header, "test k16/k0", "OOD k16/k0", "steps", "seeds"], lines, 4)


def counts_line(rows: list[dict[str, Any]], data: dict[str, Any]) -> str:
    """How many targets and context members each column holds (the same for every model)."""
    ev = rows[0]["eval"]["family"]
    parts = []
    for split in SPLITS:
        ts = data["targets"][split]
        sizes = [t["family_size"] for t in ts]
        ks = ", ".join(f"k={k}: {ev[split][str(k)]['mean_members']:.1f} members / "
                       f"{ev[split][str(k)]['mean_context_tokens']:.0f} tokens" for k in KS if k)
        med = statistics.median(sizes) if sizes else 0
        parts.append(
            f"{split}: {len(ts)} targets ({ev[split]['0']['tokens']} scored tokens; family size "
            f"median {med:g}, min {min(sizes, default=0)}); mean context {ks}")
    return "; ".join(parts)


def positions_table(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """FAVOR+ softmax on family rows, positions sequence vs member; and which is better."""
    lines = [f"| positions | {' | '.join(f'{s} k={k}' for s in SPLITS for k in KS)} "
             "| mean log ppl, k>0 |", "|---|" + "---:|" * (len(SPLITS) * len(KS) + 1)]
    score: dict[str, float] = {}
    for positions in ("sequence", "member"):
        sel = h.select(rows, rows="family", variant="favor-softmax", positions=positions)
        if not sel:
            continue
        logs = [math.log(r[f"{s}_ppl_k{k}"]) for r in sel for s in SPLITS for k in KS if k]
        score[positions] = statistics.fmean(logs)
        cells = [h.cell([r[f"{s}_ppl_k{k}"] for r in sel]) for s in SPLITS for k in KS]
        lines.append(f"| {positions} | {' | '.join(cells)} | {score[positions]:.4f} |")
    if len(score) == 2:
        best = min(score, key=score.get)  # type: ignore[arg-type]
        other = "member" if best == "sequence" else "sequence"
        gain = math.exp(score[other] - score[best]) - 1
        verdict = (
            f"Better: **positions={best}** (geometric-mean ppl over test and OOD, k = 1, 4, 16, "
            f"{gain:.1%} lower than {other})."
        )
    else:
        verdict = "Positions: needs both runs."
    return "\n".join(lines), verdict


def blat_table(rows: list[dict[str, Any]], data: dict[str, Any]) -> str:
    n_h = len(data["blat"]["homologs"])
    header = ["model", "rows", "Spearman rho, no context", f"rho, {n_h} homologs in context"]
    lines = [
        [label, sel[0]["rows"], *(h.cell([r[k] for r in sel], 1, 3) for k in BLAT_KEYS)]
        for label, sel in _groups(rows)
    ]
    return h.markdown_table(header, lines, 2)


def long_table(rows: list[dict[str, Any]]) -> str:
    heads = [f"<={hi} tokens" if lo == 1 else f"{lo}-{hi} tokens" for lo, hi in BINS]
    single = h.select(rows, rows="single")
    lines = [
        [label, *(h.cell([r[f"long_ppl_{lo}_{hi}"] for r in sel]) for lo, hi in BINS)]
        for label, sel in _groups(single)
    ]
    if single:
        long = single[0]["eval"].get("long", {})
        n = [long.get(f"{lo}-{hi}", {}) for lo, hi in BINS]
        lines.append(["(scored)", *(f"{c.get('records', 0)} records / "
                                    f"{c.get('tokens', 0)} tokens" for c in n)])  # fmt: skip
    return h.markdown_table(["model", *heads], lines)


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Plain statements of what the numbers say (either way), one per layout."""
    out = []
    for rows_ in ("family", "single"):
        parts = []
        for variant in h.ATTENTION:
            sel = h.select(rows, rows=rows_, variant=variant, positions="sequence")
            if not sel:
                continue
            change = {
                s: statistics.fmean(r[f"{s}_ppl_k16"] / r[f"{s}_ppl_k0"] - 1 for r in sel)
                for s in SPLITS
            }
            parts.append(f"{variant} {change['test']:+.1%} (test) / {change['ood']:+.1%} (OOD)")
        if parts:
            out.append(
                f"- {rows_} rows: perplexity change from 0 to 16 homologs in context: "
                + "; ".join(parts)
                + " (negative = the model reads its context)."
            )
    return out


def report(rows: list[dict[str, Any]], data: dict[str, Any], args: argparse.Namespace) -> str:
    from protein_performer.io.atomic import write_text_atomic

    out = args.out.resolve()
    h.write_csv(out / "family_context.csv", rows, FIELDS)
    write_text_atomic(
        out / "family_context.json",
        json.dumps({"runs": rows, "eval_set": {k: v for k, v in data.items() if k != "long"}})
        + "\n",
    )
    header = (
        f"{h.budget_line(args)}; causal; model "
        f"{' '.join(h.QUICK_MODEL if args.quick else MODEL)}; single rows <= {args.single_len} "
        f"tokens, family rows <= {args.family_tokens} tokens (members cropped to "
        f"{args.single_len}), families: MMseqs2 {args.family_method} at "
        f"{args.family_identity:g} identity inside each split{' (quick)' if args.quick else ''}"
    )
    sizes = data["family_sizes"]
    lines = [
        "## Family context",
        "",
        header + ". Mean ± sample sd over seeds.",
        "",
        family_table(rows, data),
        "",
        counts_line(rows, data) + ".",
        "",
        *findings(rows),
        "",
        "Family sizes (MMseqs2 families inside each split; train = what the family rows "
        "hold): "
        + "; ".join(
            f"{split}: " + ", ".join(f"{k} {v:g}" for k, v in sizes[split].items())
            for split in ("train", *SPLITS)
        )
        + ".",
        "",
        "## Positions (FAVOR+ softmax, family rows)",
        "",
    ]
    ptable, verdict = positions_table(rows)
    lines += [ptable, "", verdict, "", "## Variant effect: BLAT_ECOLX", ""]
    b = data["blat"]
    lines += [f"{len(b['mutants'])} mutants, column {BLAT_LABEL}; homologs: `{b['command']}`.", "",
              blat_table(rows, data), ""]
    if not b["homologs"]:
        lines += [
            "The retrieval found no homolog of BLAT_ECOLX in the training split, so there is no "
            "context to score with (the column reads '-'): the rho with homologs cannot be "
            "measured on this corpus.",
            ""]
    lines += [f"## Length extrapolation (single rows, trained on <= {args.single_len} tokens)", "",
              long_table(rows), "", "## Commands", "", f"    {args.store_command}",
              f"    {b['command']}"]
    lines += [f"    {r['command']}" for r in rows]
    text = "\n".join(lines) + "\n"
    h.write_markdown(out / "family_context.md", "Family context study", text)
    return text


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, h.Budget]:
    p = h.study_parser(
        __doc__, "outputs/family_context", jobs=2, minutes=3.0,
        epilog="; see the module docstring.",
        quick_help="smoke run: tiny models, a 2,000-record corpus, 3 CPU-seconds per run, 1 seed")
    p.add_argument("--mmseqs-threads", type=int, default=2, help="MMseqs2 threads")
    p.add_argument("--identity", type=float, default=0.5, help="MMseqs2 identity of the split")
    p.add_argument("--ood-frac", type=float, default=0.04, help="fraction of clusters in ood")
    p.add_argument("--valid-frac", type=float, default=0.01)
    p.add_argument("--test-frac", type=float, default=0.05)
    p.add_argument(
        "--family-method", default="cluster", choices=("search", "cluster"),
        help="how families are built (default cluster: search of the 25k-record train split "
        "against itself took > 25 min on a loaded 2-core machine)")
    p.add_argument("--family-identity", type=float, default=0.3, help="identity of families")
    p.add_argument("--single-len", type=int, default=512, help="single row / member crop")
    p.add_argument("--family-tokens", type=int, default=2048, help="family row length")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens per training batch")
    p.add_argument("--val-every", type=int, default=200, help="validate every N steps")
    p.add_argument("--val-batches", type=int, default=4, help="validation batches")
    p.add_argument("--targets", type=int, default=40, help="targets per held-out split")
    p.add_argument("--min-family", type=int, default=5, help="family size of a target")
    p.add_argument("--blat-mutants", type=int, default=0, help="BLAT mutants scored (0: all)")
    p.add_argument("--long-per-bin", type=int, default=6, help="proteins per length bin")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of target and context picks")
    p.add_argument("--score", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = {"minutes": (3.0, 0.05), "seeds": (2, 1), "targets": (40, 4), "blat_mutants": (0, 200),
             "long_per_bin": (6, 1), "family_tokens": (2048, 1024), "single_len": (512, 256),
             "max_tokens": (8192, 2048), "val_every": (200, 10), "val_batches": (4, 2),
             "min_family": (5, 2)}
    budget = h.finish_args(args, quick)
    if args.quick:
        args.valid_frac, args.test_frac, args.ood_frac = 0.05, 0.15, 0.1
    return args, budget


def main(argv: list[str] | None = None) -> int:
    args, budget = parse_args(argv)
    h.setup_logging()
    if args.score is not None:
        score_model(json.loads(args.score))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    store = h.preprocess(args, "auto", max(1, args.mmseqs_threads))
    eval_set = args.out.resolve() / "eval_set.json"
    if not args.report_only:
        make_eval_set(store, eval_set, args)
    runs = h.run_all(plan_runs(args, store, budget, eval_set), budget, args, collect)
    print(report([r.result for r in runs], json.loads(eval_set.read_text()), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
