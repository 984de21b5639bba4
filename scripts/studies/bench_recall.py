"""Does a design read its family context? Recall at equal optimizer steps (issue 30).

Every design trains the same model shape for the same number of optimizer steps on the same
data through the real CLI (``protein-performer train experiment=demo_clm data.layout=family
data.family_method=cluster``), with the exact-softmax twin as the ceiling:

- **planted families**: real proteins of the shared corpus as ancestors, members drawn from
  each ancestor at a given identity (substitutions, optionally indels), trained as family rows;
  then held-out families' members scored with 0, 1, 4, 7 and 16 of their homologs before them in
  the row (the forward of ``homologs + member``, which is what ``lm.context(...)`` continues);
- **MQAR** (multi-query associative recall, Zoology) on the protein alphabet: key-value pairs
  (two-residue keys, one-residue values), then queries of those keys; the accuracy of the value
  after each query, against the number of pairs.

The table reports perplexity per k, the share of the exact twin's log-perplexity drop from k=0
to k=7 (and to k=16) that a design closes, and MQAR accuracy. Timings are
not comparable across designs here (runs share the machine): ``scripts/bench_context.py``
measures per-candidate cost and state size.

    python scripts/studies/bench_recall.py --quick            # two designs, tiny, a few minutes
    python scripts/studies/bench_recall.py --out runs/recall  # the RESULTS table
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
import torch

CORPUS = h.SEQUENCES / "swissprot_opal_train.fasta"
AMINO = "ACDEFGHIKLMNPQRSTVWY"

#: name -> model overrides. Family-row runs have the position memory on by default (data.max_len
#: positions), so every other design turns it off; the memory designs hold 512 (issue 30's runs).
OFF = "model.config.position_memory=0"
DESIGNS: dict[str, list[str]] = {
    "exact": ["model.config.attention=exact", OFF],
    "favor": [OFF],
    "favor-m128-noredraw": [
        "model.config.nb_features=128", "model.config.feature_redraw_interval=0", OFF,
    ],
    "favor-relu": ["model.config.kernel=relu", "model.config.feature_redraw_interval=0", OFF],
    "taylor": ["model.config.attention=linear", "model.config.kernel=taylor", OFF],
    "hedgehog": ["model.config.attention=linear", "model.config.kernel=hedgehog", OFF],
    "taylor+window": [
        "model.config.attention=linear", "model.config.kernel=taylor",
        "model.config.local_window=64", OFF,
    ],
    "exact-every-3": ["model.config.exact_every=3", OFF],
    "favor+memory": ["model.config.position_memory=512"],
    "taylor+memory": [
        "model.config.attention=linear", "model.config.kernel=taylor",
        "model.config.position_memory=512",
    ],
}
KS = (0, 1, 4, 7, 16)


def setting_name(identity: float, indel: float) -> str:
    """A planted-family data set's name (``id70``, ``id70-indel0.03``)."""
    return f"id{round(identity * 100)}" + (f"-indel{indel:g}" if indel else "")


def read_corpus(path: Path, min_len: int, max_len: int, n: int, seed: int) -> list[str]:
    """n real proteins of min_len..max_len standard residues, a seeded sample of the corpus."""
    from Bio import SeqIO

    seqs = [
        str(r.seq) for r in SeqIO.parse(path, "fasta")
        if min_len <= len(r.seq) <= max_len and set(str(r.seq)) <= set(AMINO)
    ]
    random.Random(seed).shuffle(seqs)
    if len(seqs) < n:
        raise SystemExit(f"error: {path} has only {len(seqs)} usable proteins, need {n}")
    return seqs[:n]


def substitute(a: str, identity: float, rng: random.Random) -> str:
    """Residue ``a`` kept with probability ``identity``, else another residue, uniformly."""
    return a if rng.random() < identity else rng.choice(AMINO.replace(a, ""))


def mutate(seq: str, identity: float, indel: float, rng: random.Random) -> str:
    """A member of ``seq``'s family: each position substituted with probability 1 - identity
    (another residue, uniformly), and with ``indel`` probability an insertion or a deletion."""
    out = []
    for a in seq:
        r = rng.random()
        if indel and r < indel / 2:
            continue  # deletion
        if indel and r < indel:
            out.append(rng.choice(AMINO))  # insertion before the residue
        out.append(substitute(a, identity, rng))
    return "".join(out)


def planted(ancestors: list[str], members: int, identity: float, indel: float,
            seed: int) -> list[list[str]]:  # fmt: skip
    rng = random.Random(seed)
    return [[mutate(a, identity, indel, rng) for _ in range(members)]
            for a in ancestors]


def planted_store(families: list[list[str]], out: Path, tag: str) -> Path:
    """``protein-performer preprocess`` of planted families (``out/train.fasta``, each header
    naming its member's family) into ``out/store``, once."""
    store = out / "store"
    if not (store / "meta.json").exists():
        (out / "train.fasta").write_text("".join(
            f">{tag}{f:05d}_m{m} family {tag}{f:05d}\n{seq}\n"
            for f, fam in enumerate(families) for m, seq in enumerate(fam)))
        h.call(h.cli("preprocess", str(out / "train.fasta"), "--out", str(store),
                     "--valid-frac", "0.03", "--test-frac", "0.01", "--overwrite",
                     "--no-progress"), 1, out / "preprocess.log")  # fmt: skip
    return store


def train(store: Path, run: Path, design: list[str], steps: int, extra: list[str],
          experiment: str = "demo_clm") -> Any:  # fmt: skip
    """Train one design (``design``: its model overrides; ``extra``: the data's and
    :func:`run_overrides`) through ``protein-performer train`` for ``steps`` optimizer steps
    (the harness's call and step budget; a finished run is reused); returns its last
    checkpoint, loaded by ``protein_performer.load`` for scoring."""
    import protein_performer as pp

    budget = h.Budget(steps=steps)
    if not budget.met(run):
        cmd = h.cli(
            "train", f"experiment={experiment}", f"data.path={store}", *extra,
            f"trainer.val_check_interval={steps}", "trainer.enable_progress_bar=false",
            "trainer.num_sanity_val_steps=0", "data.num_workers=0",
            "model.optim.warmup_steps=30", f"hydra.run.dir={run}", "logger=csv",
            "overwrite=true", *design, *budget.overrides(),
        )  # fmt: skip
        h.call(cmd, 1, run.parent / f"{run.name}.train.log")
    return pp.load(str(run / "checkpoints" / "last.ckpt"), device="cpu", threads=1)


def family_args(member_len: int, row_tokens: int, method: str) -> list[str]:
    """Family rows (``data.family_method``) of members of at most ``member_len`` tokens."""
    return [
        "data.layout=family", f"data.family_method={method}", "data.family_identity=0.3",
        f"data.family_max_tokens={row_tokens}", f"data.max_len={member_len}",
        f"data.max_tokens={row_tokens}",
    ]


@torch.no_grad()
def family_ppl(lm: Any, families: list[list[str]], ks: tuple[int, ...]) -> dict[int, float]:
    """Perplexity of each family's last member with its first k members before it in the row
    (k = 0: alone). Causal: over the member's residues and its <eos>. Masked: over 15% of its
    residues (the same seeded positions for every k), masked together."""
    model, alphabet = lm.model, lm.alphabet
    causal = model.config.causal
    nll = {k: 0.0 for k in ks}
    count = {k: 0 for k in ks}
    for f, fam in enumerate(families):
        target = fam[-1]
        hidden = np.random.default_rng(f).random(len(target)) < 0.15
        for k in ks:
            ids: list[int] = []
            for seq in [*fam[:k], target]:
                ids += [alphabet.cls_idx, *alphabet.encode(seq).tolist(), alphabet.eos_idx]
            tokens = torch.tensor([ids])
            start = len(ids) - len(target) - 2  # the target's <cls>
            if causal:
                logits = model(tokens).logits[0].double()
                logp = logits[start:-1].log_softmax(-1)
                gold = tokens[0, start + 1:]
            else:
                where = torch.from_numpy(np.flatnonzero(hidden)) + start + 1
                gold = tokens[0, where]
                masked = tokens.clone()
                masked[0, where] = alphabet.mask_idx
                logp = model(masked).logits[0, where].double().log_softmax(-1)
            nll[k] -= float(logp.gather(1, gold[:, None]).sum())
            count[k] += len(gold)
    return {k: math.exp(nll[k] / count[k]) for k in ks}


def mqar_sequences(n: int, pairs: tuple[int, ...], seed: int) -> list[tuple[int, str, list[int]]]:
    """(pairs, sequence, value positions of the queries): pairs of a two-residue key and a
    one-residue value, then every key again in a random order, each followed by its value."""
    rng = random.Random(seed)
    keys = [a + b for a in AMINO for b in AMINO]
    out = []
    for i in range(n):
        p = pairs[i % len(pairs)]
        ks = rng.sample(keys, p)
        vals = [rng.choice(AMINO) for _ in ks]
        seq = "".join(k + v for k, v in zip(ks, vals, strict=True))
        order = rng.sample(range(p), p)
        query_pos = []
        for j in order:
            seq += ks[j]
            query_pos.append(len(seq))  # index of the value in the sequence
            seq += vals[j]
        out.append((p, seq, query_pos))
    return out


@torch.no_grad()
def mqar_accuracy(lm: Any, items: list[tuple[int, str, list[int]]]) -> dict[int, float]:
    """Share of queries whose value is the model's top prediction, per number of pairs."""
    right: dict[int, int] = {}
    total: dict[int, int] = {}
    for p, seq, query_pos in items:
        ids = [lm.alphabet.cls_idx, *lm.alphabet.encode(seq).tolist()]
        logits = lm.model(torch.tensor([ids])).logits[0]
        pred = logits.argmax(-1)  # position t predicts token t+1
        for pos in query_pos:  # residue `pos` of seq is token pos + 1, predicted at pos
            right[p] = right.get(p, 0) + int(pred[pos] == ids[pos + 1])
            total[p] = total.get(p, 0) + 1
    return {p: right[p] / total[p] for p in sorted(total)}


def closed_share(ppl: dict[str, float], exact: dict[str, float], k: str) -> float:
    """The share of the exact twin's log-perplexity drop from k=0 to k that a design closes."""
    drop = math.log(exact["0"]) - math.log(exact[k])
    return (math.log(ppl["0"]) - math.log(ppl[k])) / drop if drop > 0 else float("nan")


def table(results: dict) -> str:
    lines = []
    for setting, rows in results["family"].items():
        exact, body = rows.get("exact"), []
        for design, ppl in rows.items():
            shares = [closed_share(ppl, exact, k) if exact else float("nan") for k in ("7", "16")]
            body.append([design, *(f"{ppl[str(k)]:.2f}" for k in KS),
                         *(f"{share:.0%}" for share in shares)])  # fmt: skip
        header = ["design", *(f"ppl k={k}" for k in KS), "share of exact's drop (k=0 -> 7)",
                  "share (k=0 -> 16)"]
        lines += [f"\n**Planted families, {setting}** ({results['steps']} steps each)\n",
                  h.markdown_table(header, body)]
    if results.get("mqar"):
        pairs = sorted({int(p) for row in results["mqar"].values() for p in row})
        lines += [f"\n**MQAR** ({results['mqar_steps']} steps each): accuracy by pairs\n",
                  h.markdown_table(["design", *(f"{p} pairs" for p in pairs)],
                                   ([design, *(f"{acc[str(p)]:.2f}" for p in pairs)]
                                    for design, acc in results["mqar"].items()))]  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Issue 41: shifted fragments, a planted variant task, real MMseqs2 families
# --------------------------------------------------------------------------------------------
#: Issue 41's designs: the exact twin, FAVOR+, the memory trained on member positions, the
#: memory trained on the family rows' aligned coordinates (``data.family_coordinates``).
ALIGN_DESIGNS: dict[str, list[str]] = {
    "exact": ["model.config.attention=exact", OFF],
    "favor": [OFF],
    "favor+memory": [],
    "favor+memory@aligned": ["data.family_coordinates=aligned"],
}
ALIGN_KS = (0, 1, 4, 7)
#: Site classes of a planted ancestor: (share of sites, identity a member keeps there); the
#: mean identity is 0.4 * 0.95 + 0.6 * 0.5333 = 0.70.
SITE_CLASSES = ((0.4, 0.95), (0.6, 0.5333))
MAX_SHIFT = 40


@dataclass(frozen=True)
class Fragment:
    """A planted member: its residues and where it starts on its ancestor (0-based)."""

    seq: str
    start: int


@dataclass(frozen=True)
class ShiftedFamily:
    """An ancestor, each site's identity, and fragments of it starting up to MAX_SHIFT apart."""

    ancestor: str
    identity: tuple[float, ...]
    members: tuple[Fragment, ...]


def shifted_family(ancestor: str, members: int, rng: random.Random) -> ShiftedFamily:
    """Fragments of length len(ancestor) - MAX_SHIFT starting 0..MAX_SHIFT residues in, each
    site kept with its class's identity (else another residue, uniformly)."""
    identity = tuple(
        SITE_CLASSES[0][1] if rng.random() < SITE_CLASSES[0][0] else SITE_CLASSES[1][1]
        for _ in ancestor
    )
    width = len(ancestor) - MAX_SHIFT
    out = []
    for _ in range(members):
        s = rng.randint(0, MAX_SHIFT)
        seq = "".join(substitute(a, identity[i], rng)
                      for i, a in enumerate(ancestor[s : s + width], start=s))
        out.append(Fragment(seq, s))
    return ShiftedFamily(ancestor, identity, tuple(out))


def placed_on(member: Fragment, reference: Fragment) -> np.ndarray:
    """(L,) the member position (1-based) of the reference residue each residue of ``member``
    shares an ancestor site with, -1 outside the reference: the planted alignment."""
    at = np.arange(len(member.seq)) + member.start - reference.start + 1
    return np.where((at >= 1) & (at <= len(reference.seq)), at, -1).astype(np.int64)


def variants(fam: ShiftedFamily, wt: Fragment, n: int, rng: random.Random
             ) -> tuple[list[str], list[float]]:  # fmt: skip
    """n single and double mutants of ``wt`` ("A42G:K45R") and their planted fitness: the
    log-odds of the mutant residues against the wild type's under each site's distribution
    (the ancestor's residue with the site's identity, the 19 others sharing the rest)."""

    def logp(site: int, aa: str) -> float:
        p = fam.identity[site]
        return math.log(p if aa == fam.ancestor[site] else (1 - p) / 19)

    names, fitness = [], []
    for i in range(n):
        where = sorted(rng.sample(range(len(wt.seq)), 1 + i % 2))
        parts, f = [], 0.0
        for j in where:
            new = rng.choice(AMINO.replace(wt.seq[j], ""))
            parts.append(f"{wt.seq[j]}{j + 1}{new}")
            f += logp(wt.start + j, new) - logp(wt.start + j, wt.seq[j])
        names.append(":".join(parts))
        fitness.append(f)
    return names, fitness


def train_designs(args: argparse.Namespace, store: Path, out: Path, member_len: int,
                  results: dict, evaluate: Callable[[Any], dict]) -> dict:  # fmt: skip
    """Train each of ``--designs`` on the store's family rows (members of at most
    ``member_len`` tokens) and ``evaluate`` its checkpoint; ``out/results.json`` keeps each
    finished design, so a rerun trains and scores only the missing ones."""
    extra = [*family_args(member_len, args.row_tokens, "search"), f"model.config.dim={args.dim}",
             f"model.config.depth={args.depth}", *run_overrides(args)]
    path = out / "results.json"
    if path.exists():
        results = json.loads(path.read_text())
    for design in args.designs.split(","):
        if design in results["designs"]:
            continue
        lm = train(store, out / design, ALIGN_DESIGNS[design], args.steps, extra)
        results["designs"][design] = evaluate(lm)
        print(f"{design}: {json.dumps(results['designs'][design])}", flush=True)
        path.write_text(json.dumps(results, indent=1))
    return results


def run_overrides(args: argparse.Namespace) -> list[str]:
    """What ``--train-seed`` and ``--override`` add to every training run's command line."""
    return [*([] if args.train_seed is None else [f"seed={args.train_seed}"]), *args.override]


def context_ppl(lm, targets: list[str], contexts: list[list]) -> float:  # noqa: ANN001
    """Perplexity over the targets' residues and ``<eos>``, each read after its context (a
    list of ``data.msa.Member``; empty: alone), through ``lm.context`` and ``lm.score``."""
    nll = count = 0.0
    for target, members in zip(targets, contexts, strict=True):
        ctx = lm.context(members, max_tokens=None, warn=False) if members else None
        terms = lm.score([target], strategy="causal", context=ctx, per_position=True)[0]
        nll -= float(np.sum(terms))
        count += len(terms)
    return math.exp(nll / count)


def shifted_eval(lm: Any, fams: list[ShiftedFamily], n_variants: int, seed: int) -> dict:
    """(b) each held-out family's last fragment after its first k, the homologs at member
    positions, placed on the scored fragment (as ``homologs`` places hits on its query) and
    placed on the first homolog (coordinates from the context alone); (c) the same fragment
    as the wild type of planted variants, its homologs placed on it: Spearman rho against the
    planted fitness, per k."""
    from protein_performer.data.msa import Member

    out: dict = {"ppl": {}, "rho": {}}
    for k in ALIGN_KS:
        for place in ("positions", "on-target", "on-first"):
            contexts = [[Member(f"m{f}_{i}", m.seq, None if place == "positions" else placed_on(
                m, fam.members[-1 if place == "on-target" else 0]))
                for i, m in enumerate(fam.members[:k])] for f, fam in enumerate(fams)]
            out["ppl"][f"{place}/k{k}"] = context_ppl(
                lm, [fam.members[-1].seq for fam in fams], contexts)
            if place == "on-first":
                continue
            pred: list[float] = []
            true: list[float] = []
            for f, (fam, members) in enumerate(zip(fams, contexts, strict=True)):
                wt = fam.members[-1]
                names, fitness = variants(fam, wt, n_variants, random.Random(seed * 1000 + f))
                ctx = lm.context(members, max_tokens=None, warn=False) if members else None
                pred += lm.score_variants(wt.seq, names, strategy="causal", context=ctx).tolist()
                true += fitness
            out["rho"][f"{place}/k{k}"] = h.spearman(pred, true)
    return out


def shifted_study(args: argparse.Namespace) -> dict:
    """(b) and (c): planted families of shifted fragments, trained as family rows (MMseqs2
    search families, as ``data.family_method=search`` finds them), scored as above."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ancestors = read_corpus(args.corpus, args.min_len, args.max_len, args.families
                            + args.eval_families, args.seed)  # fmt: skip
    rng = random.Random(args.seed)
    train_fams = [shifted_family(a, args.members, rng) for a in ancestors[: args.families]]
    eval_fams = [shifted_family(a, max(ALIGN_KS) + 1, rng)
                 for a in ancestors[args.families:]]  # fmt: skip
    store = planted_store([[m.seq for m in f.members] for f in train_fams], out, "SHIFT")
    return train_designs(
        args, store, out, args.max_len - MAX_SHIFT + 2, {"steps": args.steps, "designs": {}},
        lambda lm: shifted_eval(lm, eval_fams, args.variants, args.seed),
    )


def homologs(out: Path, names: tuple[str, str, str], queries: Iterable[str], db: Iterable[str],
             *flags: str) -> list[tuple[str, np.ndarray, Any]]:  # fmt: skip
    """``protein-performer homologs`` of the FASTA records ``queries`` against ``db`` (the files
    ``out/NAME`` of ``names``: queries, database, hits; searched once), each hit as (its query,
    its placement on the query by the CIGAR string of its header, its record)."""
    from Bio import SeqIO

    from protein_performer.data.hits import hit_coordinates

    query_fasta, db_fasta, hits_fasta = (out / name for name in names)
    if not hits_fasta.exists():
        query_fasta.write_text("".join(queries))
        db_fasta.write_text("".join(db))
        h.call(h.cli("homologs", str(query_fasta), str(db_fasta), str(hits_fasta), *flags,
                     "--threads", "1"), 1, out / f"{hits_fasta.stem}.log")  # fmt: skip
    return [(*hit_coordinates(r.description, len(r.seq)), r)
            for r in SeqIO.parse(hits_fasta, "fasta")]  # fmt: skip


def real_targets(store: Path, out: Path, n: int, max_residues: int, seed: int
                 ) -> list[tuple[str, str, list]]:  # fmt: skip
    """(id, sequence, hits) of up to n test-split proteins of at most ``max_residues`` with at
    least max(ALIGN_KS) hits in the training split: :func:`homologs` of the test records
    against the training records, each hit a ``data.msa.Member`` placed on its query by
    ``homologs``' own placement."""
    from Bio import SeqIO

    from protein_performer.data.msa import Member
    from protein_performer.data.store import TokenStore

    st = TokenStore(store)

    def record(i: int) -> str:
        return f">{st.id(int(i))}\n{st.sequence(int(i))}\n"

    test = (record(i) for i in st.indices("test") if st.lengths[int(i)] <= max_residues)
    placed = homologs(out, ("q.fasta", "db.fasta", "hits.fasta"), test,
                      map(record, st.indices("train")), "--max-seqs", str(max(ALIGN_KS)))
    queries = {r.id: str(r.seq) for r in SeqIO.parse(out / "q.fasta", "fasta")}
    hits: dict[str, list] = {}
    for query, coords, r in placed:
        hits.setdefault(query, []).append(Member(r.id, str(r.seq), coords))
    found = [(q, queries[q], hs) for q, hs in hits.items() if len(hs) >= max(ALIGN_KS)]
    random.Random(seed).shuffle(found)
    return sorted(found[:n])


def on_best_hit(out: Path, targets: list[tuple[str, str, list]]) -> list[list]:
    """Per target, its hits placed on its best hit (the context alone: no coordinate comes
    from the target): :func:`homologs` of each best hit against all the hits, each target
    keeping its own; the best hit at its own positions, a hit not found unplaced (member
    positions)."""
    found = {(query, r.id): coords for query, coords, r in homologs(
        out, ("best.fasta", "pool.fasta", "on_best.fasta"),
        (f">t{i}\n{hs[0].sequence}\n" for i, (_, _, hs) in enumerate(targets)),
        (f">t{i}h{j}\n{m.sequence}\n" for i, (_, _, hs) in enumerate(targets)
         for j, m in enumerate(hs[1:], 1)), "--max-seqs", "500", "--keep-identical")}  # fmt: skip
    return [[replace(m, coordinates=None if j == 0 else found.get((f"t{i}",
                                                                             f"t{i}h{j}")))
             for j, m in enumerate(hs)] for i, (_, _, hs) in enumerate(targets)]  # fmt: skip


def real_eval(lm: Any, targets: list[tuple[str, str, list]], alone: list[list]) -> dict:
    """(a) each target after its first k hits, best hit farthest (first in the row) or
    nearest (last), at member positions, placed on the target by ``homologs``' CIGAR, or
    placed on the best hit (``alone``: :func:`on_best_hit`, best hit first)."""
    out: dict = {"ppl": {}}
    seqs = [seq for _, seq, _ in targets]
    for k in ALIGN_KS:
        for order in ("best-first", "best-last"):
            for place in ("positions", "on-target"):
                contexts = [[m if place == "on-target" else replace(m, coordinates=None)
                             for m in (hs[:k] if order == "best-first" else hs[:k][::-1])]
                            for _, _, hs in targets]  # fmt: skip
                out["ppl"][f"{place}+{order}/k{k}"] = context_ppl(lm, seqs, contexts)
        out["ppl"][f"on-best-hit+best-first/k{k}"] = context_ppl(lm, seqs, [a[:k] for a in alone])
    return out


def real_study(args: argparse.Namespace) -> dict:
    """(a): the corpus split by 50%-identity clusters, MMseqs2 search families of its training
    split as family rows, test proteins scored after their ``homologs`` hits."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    store = out / "store"
    if not (store / "meta.json").exists():
        h.call(h.cli("preprocess", str(args.corpus), "--out", str(store), "--cluster-split",
                     "0.5", "--valid-frac", "0.01", "--test-frac", "0.1", "--on-invalid",
                     "skip", "--workers", "1", "--no-progress"), 1,
               out / "preprocess.log")  # fmt: skip
    targets = real_targets(store, out, args.eval_families, args.max_len - 2, args.seed)
    results: dict = {"steps": args.steps, "targets": len(targets), "designs": {},
                     "target_residues": sum(len(t[1]) for t in targets)}  # fmt: skip
    log_line = f"{len(targets)} test proteins with >= {max(ALIGN_KS)} hits in training"
    print(log_line, flush=True)
    return train_designs(args, store, out, args.max_len, results,
                         lambda lm: real_eval(lm, targets, on_best_hit(out, targets)))


def align_table(results: dict) -> str:
    """Issue 41's tables: perplexity per k and placement, and (shifted) variant Spearman."""
    lines = [f"({results['steps']} steps each)"]
    designs = results["designs"]
    for metric in ("ppl", "rho"):
        places = sorted({key.split("/")[0] for r in designs.values() for key in r.get(metric, ())})
        if places:
            body = [[design, place, *(f"{r[metric][f'{place}/k{k}']:.3f}" for k in ALIGN_KS)]
                    for design, r in designs.items() for place in places]  # fmt: skip
            lines += ["", h.markdown_table(["design", "homologs",
                                            *(f"{metric} k={k}" for k in ALIGN_KS)], body, 2)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = h.parser(__doc__)
    ap.add_argument("--out", type=Path, default=h.REPO / "runs" / "recall")
    ap.add_argument("--designs", default=",".join(DESIGNS), help="comma-separated, of: "
                    + ", ".join(DESIGNS))
    ap.add_argument("--settings", default="0.7:0,0.7:0.03",
                    help="identity:indel-rate pairs, comma-separated (default 0.7:0,0.7:0.03; "
                    "'' = MQAR alone)")
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    ap.add_argument("--families", type=int, default=300, help="training families")
    ap.add_argument("--members", type=int, default=8, help="members per training family")
    ap.add_argument("--eval-families", type=int, default=40)
    ap.add_argument("--min-len", type=int, default=80)
    ap.add_argument("--max-len", type=int, default=200, help="longest ancestor (residues)")
    ap.add_argument("--objective", choices=("clm", "mlm"), default="clm",
                    help="causal (experiment=demo_clm) or masked (experiment=demo) family rows")
    ap.add_argument("--mqar-steps", type=int, default=400, help="0 = skip MQAR (causal only)")
    ap.add_argument("--mqar-pairs", default="4,8,16,32")
    ap.add_argument("--parallel", type=int, default=2, help="runs at once (1 thread each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--study", choices=("planted", "shifted", "real"), default="planted",
                    help="planted: issue 30's aligned families and MQAR; shifted: issue 41's "
                    "shifted fragments and planted variants; real: MMseqs2 families of the "
                    "corpus scored with their `homologs` hits")
    ap.add_argument("--row-tokens", type=int, default=1400, help="family row budget "
                    "(shifted, real)")
    ap.add_argument("--variants", type=int, default=40, help="mutants per held-out wild type "
                    "(shifted)")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="ancestors' FASTA")
    ap.add_argument("--train-seed", type=int, default=None,
                    help="the training runs' seed (default: the config's, 42); the data "
                    "(--seed) stay the same")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override added to every training run (repeatable), e.g. "
                    "data.family_memory_dropout=0")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2, help="layers (shifted, real)")
    ap.add_argument("--quick", action="store_true",
                    help="exact and favor, one setting, 60 steps, 30 families: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.designs, args.settings, args.steps, args.families = "exact,favor", "0.7:0", 60, 30
        args.eval_families, args.mqar_steps, args.mqar_pairs = 6, 40, "4,8"
    return args


def main(argv: list[str] | None = None) -> int:
    from concurrent.futures import ThreadPoolExecutor

    args = parse_args(argv)
    if args.study in ("shifted", "real"):
        study = shifted_study if args.study == "shifted" else real_study
        text = align_table(study(args))
        (args.out / "table.md").write_text(text + "\n")
        print(text)
        return 0
    designs = args.designs.split(",")
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        raise SystemExit(f"error: unknown design(s) {unknown}; choose from {list(DESIGNS)}")
    settings = [tuple(map(float, s.split(":"))) for s in args.settings.split(",") if s]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    need = args.families + args.eval_families
    ancestors = read_corpus(args.corpus, args.min_len, args.max_len, need, args.seed)
    results: dict = {"steps": args.steps, "mqar_steps": args.mqar_steps, "family": {}, "mqar": {}}
    jobs = []  # (where the result goes, run group, design, data, overrides, steps, evaluate)
    for identity, indel in settings:
        name = setting_name(identity, indel)
        (out / name).mkdir(exist_ok=True)
        train_fams = planted(ancestors[: args.families], args.members, identity, indel, args.seed)
        evals = planted(ancestors[args.families:], max(KS) + 1, identity, indel, args.seed + 1)
        store = planted_store(train_fams, out / name, "PLANT")
        extra = [*family_args(int(args.max_len * 1.2) + 2, 4096, "cluster"), *run_overrides(args)]
        for design in designs:
            jobs.append((results["family"].setdefault(name, {}), name, design,
                         store, extra, args.steps,
                         lambda lm, evals=evals: family_ppl(lm, evals, KS)))  # fmt: skip
    experiment = "demo_clm" if args.objective == "clm" else "demo"
    if args.mqar_steps and args.objective == "clm":
        pairs = tuple(int(p) for p in args.mqar_pairs.split(","))
        mdir = out / "mqar"
        mdir.mkdir(exist_ok=True)
        train_items = mqar_sequences(3000 if not args.quick else 300, pairs, args.seed)
        mqar_items = mqar_sequences(200 if not args.quick else 40, pairs, args.seed + 1)
        fasta = mdir / "train.fasta"
        fasta.write_text("".join(f">MQAR{i:05d}\n{seq}\n"
                                 for i, (_, seq, _) in enumerate(train_items)))  # fmt: skip
        for design in designs:
            jobs.append((results["mqar"], "mqar", design, fasta,
                         ["data.max_len=256", "data.max_tokens=4096", "data.valid_frac=0.02",
                          "data.test_frac=0.02", *run_overrides(args)], args.mqar_steps,
                         lambda lm: mqar_accuracy(lm, mqar_items)))  # fmt: skip

    def run(job):
        where, group, design, data, extra, steps, evaluate = job
        lm = train(data, out / group / design, DESIGNS[design], steps, extra, experiment)
        return where, group, design, {str(k): v for k, v in evaluate(lm).items()}

    with ThreadPoolExecutor(args.parallel) as pool:
        for where, group, design, value in pool.map(run, jobs):
            where[design] = value
            print(f"{group} {design}: {value}", flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
