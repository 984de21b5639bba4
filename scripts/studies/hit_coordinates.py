"""How well do a hit's reported alignment and ranges place its residues on the query? (issue 41,
issue 45 #12)

``homologs`` writes each hit's aligned ranges (``qstart qend tstart tend``) and MMseqs2's CIGAR
string; ``--context`` places a hit's residues on its query from the CIGAR, or, in a header
without one, by stretching ``tstart..tend`` onto ``qstart..qend``
(``data.homology.hit_coordinates``). This measures both on real proteins: queries drawn from a
FASTA are searched against it with the parameters of ``homologs``
(``data.homology.search_command``), MMseqs2 also writes each alignment (``qaln taln``), and
every target residue that faces a query residue gets its placement compared with the query
residue it faces. Beside them, what member positions give (a hit's own residue number), the
placement a position memory uses without coordinates. The numbers to read: the share of the
facing residues placed at all (one residue per query residue), and of those, the share exactly
right and within the memory's window W (``memory_window``, 8).

    python scripts/studies/hit_coordinates.py \
        --db ../shared/data/sequences/uniprot_mmseqs_train.fasta
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import harness as h
import numpy as np

from protein_performer.data.fasta import read_fasta
from protein_performer.data.homology import (
    HOMOLOG_FORMAT,
    HOMOLOG_MIN_SEQ_ID,
    find_mmseqs,
    hit_coordinates,
    run_mmseqs,
    search_command,
)

FIELDS = HOMOLOG_FORMAT + ",qaln,taln"  # the alignment itself: the truth compared with


def facing(qstart: int, tstart: int, qaln: str, taln: str, tlen: int) -> np.ndarray:
    """(tlen,) the query residue number (1-based) each target residue faces in the alignment,
    -1 for target residues facing a gap or outside the alignment."""
    out = np.full(tlen, -1, dtype=np.int64)
    q, t = qstart - 1, tstart - 1  # residues consumed before the alignment
    for a, b in zip(qaln, taln, strict=True):
        q += a != "-"
        if b != "-":
            out[t] = q if a != "-" else -1
            t += 1
    return out


def main() -> None:
    p = h.parser(__doc__)
    p.add_argument("--db", required=True, help="FASTA searched (queries are drawn from it)")
    p.add_argument("--queries", type=int, default=200, help="queries drawn (default 200)")
    p.add_argument("--max-seqs", type=int, default=20, help="hits per query (default 20)")
    p.add_argument("--window", type=int, default=8, help="the memory's window W (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    seqs = [r.sequence for r in read_fasta(args.db)]
    rng = np.random.default_rng(args.seed)
    picked = rng.choice(len(seqs), size=min(args.queries, len(seqs)), replace=False)
    exe = find_mmseqs("this study")
    with tempfile.TemporaryDirectory(prefix="hit_coordinates_") as work:
        qpath, dbpath, out = Path(work) / "q.fasta", Path(work) / "db.fasta", Path(work) / "h.tsv"
        qpath.write_text("".join(f">{i}\n{seqs[i]}\n" for i in picked.tolist()))
        dbpath.write_text("".join(f">{i}\n{s}\n" for i, s in enumerate(seqs)))
        cmd = search_command(exe, qpath, dbpath, out, Path(work) / "tmp", HOMOLOG_MIN_SEQ_ID,
                             args.threads, args.max_seqs + 1, fields=FIELDS)  # fmt: skip
        run_mmseqs(cmd, "the study's queries")
        rows = [dict(zip(FIELDS.split(","), ln.rstrip("\n").split("\t"), strict=True))
                for ln in out.read_text().splitlines()]  # fmt: skip
    errors: dict[str, list[np.ndarray]] = {"cigar": [], "stretched_ranges": [],
                                           "member_positions": []}  # fmt: skip
    # -1 where a placement leaves a facing residue out (one residue per query residue)
    with_indel = hits = 0
    for r in rows:
        if r["query"] == r["target"]:
            continue
        tlen = int(r["tlen"])
        truth = facing(int(r["qstart"]), int(r["tstart"]), r["qaln"], r["taln"], tlen)
        ranges = " ".join(f"{k}={r[k]}" for k in ("query", "qstart", "qend", "tstart", "tend"))
        placed = truth >= 0
        for name, header in (("cigar", f"{ranges} cigar={r['cigar']}"),
                             ("stretched_ranges", ranges)):  # fmt: skip
            _, coords = hit_coordinates(header, tlen)  # type: ignore[misc]
            got = coords[placed]
            errors[name].append(np.where(got >= 0, np.abs(got - truth[placed]), -1))
        errors["member_positions"].append(np.abs(np.flatnonzero(placed) + 1 - truth[placed]))
        with_indel += "-" in r["qaln"] or "-" in r["taln"]
        hits += 1
    merged = {k: np.concatenate(v) for k, v in errors.items()}

    def shares(all_err: np.ndarray) -> dict[str, float]:
        err = all_err[all_err >= 0]  # over the residues the placement put somewhere
        return {"placed": round(float(np.mean(all_err >= 0)), 4),
                "exact": round(float(np.mean(err == 0)), 4),
                "within_2": round(float(np.mean(err <= 2)), 4),
                f"within_W{args.window}": round(float(np.mean(err <= args.window)), 4),
                "mean_abs": round(float(err.mean()), 2), "max": int(err.max())}

    print(json.dumps({
        "queries": int(len(picked)), "hits": hits, "hits_with_indels": with_indel,
        "facing_residues": int(len(merged["cigar"])),
        **{k: shares(v) for k, v in merged.items()},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
