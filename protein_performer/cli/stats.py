"""``protein-performer stats``: what is in a FASTA file or a preprocessed store.

Lengths are kept as a histogram (one counter per length), so quantiles are exact and memory does
not grow with the number of records; composition is a 256-bin byte count.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protein_performer.cli._args import add_on_invalid

if TYPE_CHECKING:
    from protein_performer.data.store import TokenStore

#: ESM-2 sees at most 1024 tokens including <cls> and <eos>: longer records get cropped.
CROP_LIMIT = 1022
_STANDARD = frozenset("LAGVSERTIDPKQNFYMHWC")
_SPLIT_ORDER = {"train": 0, "valid": 1, "test": 2, "ood": 3}
_CHUNK = 1 << 24  # residues per bincount pass over a store's tokens


#: This command writes no file (its output is standard output).
OUTPUTS: tuple[str, ...] = ()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stats",
        help="record counts, lengths, composition (FASTA files or preprocessed stores)",
        description=(
            "Summarise FASTA(.gz) files or preprocessed store directories: records, residues, "
            f"length min/median/mean/p95/max, records longer than {CROP_LIMIT} aa (cropped by "
            "ESM-2-sized models), amino-acid composition, non-standard letters and, for a "
            "store, the train/valid/test split."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="FASTA(.gz) file or store directory")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of text: a list with one object per PATH",
    )
    add_on_invalid(p, help="for FASTA input: stop at a bad record (default) or skip and count it")
    p.add_argument(
        "--top",
        type=int,
        default=10,
        metavar="K",
        help="letters shown in the text composition line (default 10)",
    )
    p.set_defaults(func=run)


class _Acc:
    """Streaming accumulator: length histogram + byte counts."""

    def __init__(self) -> None:
        self.hist = np.zeros(1024, dtype=np.int64)  # hist[L] = records of length L
        self.letters = np.zeros(256, dtype=np.int64)  # counts per byte value

    def add_lengths(self, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return
        top = int(lengths.max())
        if top >= self.hist.size:
            self.hist = np.concatenate(
                [self.hist, np.zeros(max(top + 1, 2 * self.hist.size) - self.hist.size, np.int64)]
            )
        self.hist += np.bincount(lengths, minlength=self.hist.size)

    def summary(self) -> dict[str, Any]:
        n = int(self.hist.sum())
        sizes = np.arange(self.hist.size, dtype=np.int64)
        residues = int((self.hist * sizes).sum())
        out: dict[str, Any] = {"records": n, "residues": residues}
        if n == 0:
            out["length"] = None
            out[f"over_{CROP_LIMIT}"] = 0
            return out
        cum = np.cumsum(self.hist)

        def kth(k: int) -> int:  # k-th smallest length, 0-based
            return int(np.searchsorted(cum, k, side="right"))

        def quantile(q: float) -> float:  # numpy's default (linear) interpolation, exactly
            h = (n - 1) * q
            lo, hi = int(np.floor(h)), int(np.ceil(h))
            return kth(lo) + (h - lo) * (kth(hi) - kth(lo))

        out["length"] = {
            "min": kth(0),
            "median": quantile(0.5),
            "mean": residues / n,
            "p95": quantile(0.95),
            "max": kth(n - 1),
        }
        out[f"over_{CROP_LIMIT}"] = int(self.hist[CROP_LIMIT + 1 :].sum())
        return out


def _composition(counts: dict[str, int]) -> dict[str, Any]:
    total = sum(counts.values())
    comp = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return {
        "composition": comp,
        "composition_frac": {k: v / total for k, v in comp.items()} if total else {},
        "nonstandard": {k: v for k, v in comp.items() if k not in _STANDARD},
    }


def fasta_stats(path: Path, on_invalid: str = "error") -> dict[str, Any]:
    """Stream one FASTA(.gz) file; raises the reader's UserError on bad input (error mode)."""
    from protein_performer.data.fasta import InvalidReport, read_fasta

    acc = _Acc()
    report = InvalidReport()
    seqs: list[str] = []
    n_res = 0

    def flush() -> None:
        nonlocal seqs, n_res
        if seqs:
            acc.add_lengths(np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs)))
            raw = np.frombuffer("".join(seqs).encode("latin-1", "replace"), dtype=np.uint8)
            acc.letters += np.bincount(raw, minlength=256)
            seqs, n_res = [], 0

    for rec in read_fasta(path, on_invalid=on_invalid, report=report):
        seqs.append(rec.sequence)
        n_res += len(rec.sequence)
        if n_res >= _CHUNK:
            flush()
    flush()
    out: dict[str, Any] = {"path": os.fspath(path), "kind": "fasta", **acc.summary()}
    letters = {chr(b): int(c) for b, c in enumerate(acc.letters) if c}
    out.update(_composition(letters))
    if on_invalid == "skip":
        out["skipped"] = int(report.skipped)
        out["skipped_by_reason"] = dict(sorted(report.by_reason.items()))
    return out


def store_stats(path: Path, store: TokenStore) -> dict[str, Any]:
    """Read a store's memmaps in chunks (constant memory whatever the corpus size); ``path``
    as the user wrote it."""
    from protein_performer.data.store import TOKENS

    acc = _Acc()
    lengths = store.lengths
    for a in range(0, len(lengths), _CHUNK):
        acc.add_lengths(np.asarray(lengths[a : a + _CHUNK]))
    vocab: list[str] = store.meta["vocab"]
    tok_counts = np.zeros(max(256, len(vocab)), dtype=np.int64)
    tokens = store._open()[TOKENS]
    for a in range(0, len(tokens), _CHUNK):
        tok_counts += np.bincount(np.asarray(tokens[a : a + _CHUNK]), minlength=tok_counts.size)
    letters = {vocab[i]: int(c) for i, c in enumerate(tok_counts[: len(vocab)]) if c}
    out: dict[str, Any] = {"path": os.fspath(path), "kind": "store", **acc.summary()}
    out.update(_composition(letters))
    out["splits"] = store.meta.get("splits", {})
    skipped = store.meta.get("invalid", {}).get("skipped")
    if skipped is not None:
        out["skipped"] = skipped
    return out


def collect(path: Path, on_invalid: str = "error") -> dict[str, Any]:
    from protein_performer.data.inputs import open_input

    opened = open_input(path)
    if opened.store is not None:
        return store_stats(path, opened.store)
    return fasta_stats(path, on_invalid)


def format_text(s: dict[str, Any], top: int = 10) -> str:
    lines = [
        f"{s['path']} ({s['kind']})",
        f"  records   {s['records']:,}",
        f"  residues  {s['residues']:,}",
    ]
    if s["length"]:
        ln = s["length"]
        lines.append(
            f"  length    min {ln['min']}  median {ln['median']:g}  mean {ln['mean']:.1f}  "
            f"p95 {ln['p95']:g}  max {ln['max']}"
        )
    lines.append(f"  > {CROP_LIMIT} aa  {s[f'over_{CROP_LIMIT}']:,}")
    if s["composition_frac"]:
        shown = list(s["composition_frac"].items())[:top]
        lines.append("  top aa    " + " ".join(f"{k}:{v:.1%}" for k, v in shown))
    nonstd = s["nonstandard"]
    lines.append(
        "  non-standard  " + (", ".join(f"{k}:{v:,}" for k, v in nonstd.items()) or "none")
    )
    if "splits" in s:
        lines.append(
            "  splits    "
            + "  ".join(
                f"{k} {v['records']:,} ({v['residues']:,} aa)"
                for k, v in sorted(s["splits"].items(), key=lambda kv: _SPLIT_ORDER.get(kv[0], 9))
            )
        )
    if s.get("skipped"):
        lines.append(f"  skipped invalid  {s['skipped']:,}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results = [collect(Path(p), args.on_invalid) for p in args.paths]
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))  # always a list, one per PATH
    else:
        print("\n".join(format_text(s, args.top) for s in results))
    return 0
