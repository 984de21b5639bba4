"""Sequence likelihoods and variant-effect scores from a checkpoint.

Sequence scores (``protein-performer score``):

* ``pseudo-ppl`` (masked-LM checkpoints): the exact pseudo-log-likelihood
  ``PLL = sum_i log p(x_i | x without i)``: every residue is masked once, the masked copies of a
  sequence are batched under the token budget. Residue ``i`` (0-based) of the sequence is token
  ``i + 1`` because of the leading ``<cls>``: the off-by-one of ESM's published example.
* ``causal`` (causal-LM checkpoints): the exact log-likelihood ``sum_t log p(x_t | x_<t)`` of the
  residues *and* the final ``<eos>`` (ESM/ProGen convention: ``<eos>`` says the protein ends
  there, which is part of what the model claims about the sequence). ``n_scored`` is therefore
  ``L + 1`` for causal and ``L`` for pseudo-ppl, and the per-token mean and perplexity divide by
  ``n_scored``.

Per sequence: ``id, length, n_scored, log_likelihood, mean_log_likelihood, perplexity`` with
``perplexity = exp(-mean_log_likelihood)``; CSV, or TSV when the output ends in ``.tsv``/``.tab``.

Variant scores (``protein-performer score-variants``), strategies named as in ESM's
variant-prediction example plus ``causal``, all as log-ratios mutant vs wild type:

* ``masked-marginals``: mask all mutated positions of a variant together in the wild type,
  score ``sum log p(mt) - log p(wt)`` at those positions (one pass per distinct position set,
  so a single-mutant scan costs at most L passes);
* ``wt-marginals``: the same sum read from one unmasked pass over the wild type;
* ``pseudo-ppl``: ``PLL(mutant) - PLL(wt)`` (L passes per distinct mutant: slow, exact);
* ``causal``: ``LL(mutant) - LL(wt)`` (one pass per mutant).

Mutations are ``A42G`` (wild-type letter, position, mutant letter), joined by ``:`` for multiple
mutants (``A42G:K45R``); positions are numbered so the first residue of the wild type is
``offset``. A row whose mutation does not fit the wild type (wrong letter, position outside,
unparseable) gets an empty score and is listed by its CSV line number, never a crash.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protein_performer.data.inputs import (
    InputRecord,
    input_records,
    read_records,
    total_in_background,
)
from protein_performer.data.sampler import budget_batches
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.atomic import text_output
from protein_performer.io.progress import beat
from protein_performer.io.progress import progress as progress_bar
from protein_performer.io.tables import ShardedTable, delimiter

if TYPE_CHECKING:
    from protein_performer.inference.api import ProteinLM
    from protein_performer.inference.context import FamilyContext
    from protein_performer.inference.ensemble import ContextEnsemble

log = logging.getLogger(__name__)

SEQUENCE_STRATEGIES = ("pseudo-ppl", "causal")
VARIANT_STRATEGIES = ("masked-marginals", "wt-marginals", "pseudo-ppl", "causal")
#: Which training objective each strategy needs.
STRATEGY_OBJECTIVE = {
    "masked-marginals": "mlm",
    "wt-marginals": "mlm",
    "pseudo-ppl": "mlm",
    "causal": "clm",
}
SCORE_COLUMNS = ("id", "length", "n_scored", "log_likelihood", "mean_log_likelihood", "perplexity")
_MUTATION = re.compile(r"^([A-Za-z])(-?\d+)([A-Za-z])$")
_WILD_TYPE_NAMES = frozenset({"wt", "_wt", "wildtype", "wild-type"})
#: The columns of a ProteinGym substitution file (``DMS_score_bin`` too, unused here).
PROTEINGYM_COLUMNS = frozenset({"mutant", "DMS_score"})
_SHOW_ROWS = 20  # rows named in the warning summary before "and N more"


def check_strategy(loaded: LoadedModel, strategy: str, choices: Sequence[str]) -> None:
    """A strategy that does not fit the checkpoint's objective is a user error, not NaNs.

    A masked LM has no left-to-right distribution and a causal LM was never trained to fill a
    ``<mask>``: either combination would return numbers that mean nothing.
    """
    if strategy not in choices:
        raise UserError(f"unknown strategy {strategy!r}; choose one of {', '.join(choices)}")
    need = STRATEGY_OBJECTIVE[strategy]
    have = loaded.config.objective
    if need != have:
        fitting = [s for s in choices if STRATEGY_OBJECTIVE[s] == have]
        kind = {"mlm": "masked-LM (mlm)", "clm": "causal-LM (clm)"}
        raise UserError(
            f"strategy {strategy!r} needs a {kind[need]} checkpoint, but {loaded.source} is a "
            f"{kind[have]} model; use --strategy {' or '.join(fitting)}"
        )


def _check_context(strategy: str, context: FamilyContext | None) -> None:
    """Only the causal strategy reads a family context (it continues the context's state)."""
    if context is not None and strategy != "causal":
        raise UserError(
            f"strategy {strategy!r} cannot use a family context: only 'causal' (a causal model "
            "continuing the context) can"
        )


# --------------------------------------------------------------------------------------------
# Core computations (tensors in, numpy out)
# --------------------------------------------------------------------------------------------
@torch.inference_mode()
def masked_log_probs(
    loaded: LoadedModel,
    seq: str,
    position_sets: Sequence[Sequence[int]],
    toks_per_batch: int = 4096,
    progress: object | None = None,
) -> list[np.ndarray]:
    """For each set of 0-based residue positions, mask them together and return the
    log-probabilities (len(set), V) at those positions, in the set's order.

    Rows are copies of ``<cls> seq <eos>``, so residue ``i`` is token ``i + 1``. As many copies
    as the token budget allows run in one forward pass.
    """
    a = loaded.alphabet
    base = loaded.alphabet.encode_batch([seq]).to(loaded.device)  # (1, T)
    T = base.shape[1]
    per_batch = max(1, toks_per_batch // T)
    results: list[np.ndarray] = []
    for start in range(0, len(position_sets), per_batch):
        chunk = position_sets[start : start + per_batch]
        tokens = base.repeat(len(chunk), 1)  # (n, T)
        rows = torch.cat(
            [torch.full((len(p),), r, dtype=torch.long) for r, p in enumerate(chunk)]
        ).to(tokens.device)
        cols = torch.cat([torch.as_tensor(list(p), dtype=torch.long) + 1 for p in chunk]).to(
            tokens.device
        )
        tokens[rows, cols] = a.mask_idx
        logits = loaded.model(tokens).logits  # (n, T, V)
        lp = torch.log_softmax(logits[rows, cols].float(), dim=-1).cpu().numpy()  # (k, V)
        offset = 0
        for p in chunk:
            results.append(lp[offset : offset + len(p)])
            offset += len(p)
        if progress is not None:
            progress.update(len(chunk))  # type: ignore[attr-defined]
        done = start + len(chunk)
        beat(f"{done}/{len(position_sets)} masked passes over a {len(seq)}-residue sequence")
    return results


def pseudo_log_likelihoods(
    loaded: LoadedModel, seq: str, toks_per_batch: int = 4096, progress: object | None = None
) -> np.ndarray:
    """(L,) ``log p(x_i | x without i)``: every residue masked once (exact PLL terms)."""
    ids = loaded.alphabet.encode(seq).astype(np.int64)
    lps = masked_log_probs(
        loaded, seq, [[i] for i in range(len(seq))], toks_per_batch, progress=progress
    )
    return np.array([lp[0, t] for lp, t in zip(lps, ids, strict=True)], dtype=np.float64)


@torch.inference_mode()
def causal_log_likelihoods(
    loaded: LoadedModel,
    seqs: Sequence[str],
    toks_per_batch: int = 4096,
    progress: object | None = None,
    context: FamilyContext | None = None,
) -> list[np.ndarray]:
    """Per sequence, (L + 1,) ``log p(token_t | tokens_<t)`` for the residues and ``<eos>``;
    with a family ``context``, each sequence as the next member after it (the same terms,
    conditioned; the budget counts the context tokens each candidate attends).

    One parallel forward per batch: causal FAVOR+ runs as a chunked prefix scan that is linear
    in L, so scoring a whole sequence this way is faster than stepping the RNN-mode state token
    by token (same recursion, but matrix products over chunks instead of L small steps; the
    RNN mode pays off only for generation, where tokens arrive one at a time).
    """
    results: list[np.ndarray | None] = [None] * len(seqs)
    extra = 0 if context is None else context.attended_tokens
    for batch in budget_batches([len(s) + 2 + extra for s in seqs], toks_per_batch):
        tokens = loaded.alphabet.encode_batch([seqs[i] for i in batch])  # (B, T)
        tokens = tokens.to(loaded.device)
        if context is None:
            logits = loaded.model(tokens).logits  # (B, T, V)
        else:
            logits, _ = loaded.model.extend(tokens, context.states, context.offset)
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # predicts tokens 1..T-1
        picked = lp.gather(-1, tokens[:, 1:, None])[..., 0].cpu().numpy()  # (B, T-1)
        for row, i in enumerate(batch):
            results[i] = picked[row, : len(seqs[i]) + 1].astype(np.float64)
        if progress is not None:
            progress.update(sum(len(seqs[i]) for i in batch))  # type: ignore[attr-defined]
        done = sum(r is not None for r in results)
        beat(f"{done}/{len(seqs)} sequences of this window")
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Sequence scoring
# --------------------------------------------------------------------------------------------
@dataclass
class SequenceScore:
    id: str
    length: int
    n_scored: int
    log_likelihood: float

    @property
    def mean_log_likelihood(self) -> float:
        return self.log_likelihood / self.n_scored

    @property
    def perplexity(self) -> float:
        return math.exp(-self.mean_log_likelihood)

    def row(self) -> list[str]:
        return [
            self.id,
            str(self.length),
            str(self.n_scored),
            f"{self.log_likelihood:.6f}",
            f"{self.mean_log_likelihood:.6f}",
            f"{self.perplexity:.6f}",
        ]


def score_sequences(
    loaded: LoadedModel,
    records: Sequence[tuple[str, str]],
    strategy: str = "pseudo-ppl",
    toks_per_batch: int = 4096,
    progress: bool | Any = False,  # noqa: ANN401 - or a caller's bar to advance
    context: FamilyContext | None = None,
) -> list[SequenceScore]:
    """Score ``(id, sequence)`` pairs with ``strategy`` (see the module docstring), after a
    family ``context`` when given (causal only). ``progress``: a bar of its own, or the
    caller's bar, advanced by residues (pseudo-ppl: masked passes) as batches finish."""
    check_strategy(loaded, strategy, SEQUENCE_STRATEGIES)
    _check_context(strategy, context)
    seqs = [s for _, s in records]
    own = isinstance(progress, bool)
    given = progress_bar(sum(len(s) for s in seqs), "res", strategy, progress) if own else None
    with given or contextlib.nullcontext(progress) as bar:
        if strategy == "causal":
            terms = causal_log_likelihoods(loaded, seqs, toks_per_batch, bar, context)
        else:
            terms = [pseudo_log_likelihoods(loaded, s, toks_per_batch, bar) for s in seqs]
    return [
        SequenceScore(rid, len(s), len(t), float(t.sum()))
        for (rid, s), t in zip(records, terms, strict=True)
    ]


@dataclass
class ScoreSummary:
    """What ``score_fasta`` wrote (rank 0: the whole file; other ranks: their own parts)."""

    num_records: int
    log_likelihood: float
    n_scored: int

    @property
    def mean_log_likelihood(self) -> float:
        return self.log_likelihood / self.n_scored if self.n_scored else float("nan")


def score_fasta(
    lm: ProteinLM,
    fasta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    strategy: str = "pseudo-ppl",
    toks_per_batch: int = 4096,
    on_invalid: str = "error",
    progress: bool = True,
    context: FamilyContext | None = None,
) -> ScoreSummary:
    """Score every record of ``fasta`` (a FASTA file or a store directory; ``lm.iter_score``)
    into ``out`` (CSV/TSV, or standard output for ``-``), one row per record in input order.

    Window by window into parts, merged at the end, so ranks of a ``torchrun``/SLURM job split
    the records (:mod:`protein_performer.io.sharding`); standard output takes one process.
    """
    from protein_performer.io.sharding import rank_label, windows

    check_strategy(lm.loaded, strategy, SEQUENCE_STRATEGIES)
    path = Path(fasta).expanduser()
    table = ShardedTable(out, SCORE_COLUMNS)
    mine = ScoreSummary(0, 0.0, 0)
    merged = ScoreSummary(0, 0.0, 0)

    def rows(window: list[InputRecord]) -> Iterator[list[str]]:
        pairs = [(r.id, r.sequence) for r in window]
        for _, score in lm.iter_score(
            pairs, strategy, toks_per_batch, context=context, progress=bar
        ):
            mine.num_records += 1
            mine.log_likelihood += score.log_likelihood
            mine.n_scored += score.n_scored
            yield score.row()

    def add(row: list[str]) -> None:
        merged.num_records += 1
        merged.n_scored += int(row[2])
        merged.log_likelihood += float(row[3])

    records = input_records(path, on_invalid)
    batches = windows(records, toks_per_batch, lambda r: len(r.sequence))
    # Residues (pseudo-ppl: one masked pass each) advance inside a window, batch by batch.
    unit = "pass" if strategy == "pseudo-ppl" else "res"
    bar = progress_bar(None, unit, rank_label(strategy), progress)
    total_in_background(bar, path, "residues")
    with bar:
        table.write(batches, rows, path, add)
    return merged if merged.num_records else mine


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    wt: str
    position: int  # as written (numbered from ``offset``)
    mt: str
    index: int  # 0-based residue index into the wild type


def parse_mutant(
    text: str, wt_seq: str, offset: int = 1, alphabet: object = None
) -> list[Mutation]:
    """``"A42G:K45R"`` -> mutations checked against the wild type; ``ValueError`` says why not.

    ``wt``/``_wt`` (any case) is the wild type itself: no mutations, score 0.
    """
    from protein_performer.data.tokenizer import Alphabet

    alphabet = alphabet or Alphabet()
    text = text.strip()
    if not text:
        raise ValueError("empty mutation")
    if text.lower() in _WILD_TYPE_NAMES:
        return []
    muts: list[Mutation] = []
    seen: set[int] = set()
    for part in re.split(r"[:;,\s]+", text):
        if not part:
            continue
        m = _MUTATION.match(part)
        if not m:
            raise ValueError(f"cannot parse {part!r} (expected e.g. A42G; join several with ':')")
        wt, pos, mt = m.group(1).upper(), int(m.group(2)), m.group(3).upper()
        index = pos - offset
        if not 0 <= index < len(wt_seq):
            raise ValueError(
                f"{part}: position {pos} is outside the wild type (positions {offset}.."
                f"{offset + len(wt_seq) - 1} with offset {offset})"
            )
        if wt_seq[index] != wt:
            raise ValueError(
                f"{part}: wild-type letter {wt} does not match the sequence, which has "
                f"{wt_seq[index]} at position {pos} (offset {offset})"
            )
        if mt not in alphabet.tok_to_idx:  # type: ignore[attr-defined]
            raise ValueError(f"{part}: mutant letter {mt} is not in the vocabulary")
        if index in seen:
            raise ValueError(f"{part}: position {pos} is mutated twice in {text!r}")
        seen.add(index)
        muts.append(Mutation(wt, pos, mt, index))
    if not muts:
        raise ValueError("empty mutation")
    return muts


def _apply(seq: str, muts: Sequence[Mutation]) -> str:
    chars = list(seq)
    for m in muts:
        chars[m.index] = m.mt
    return "".join(chars)


def score_variants(
    loaded: LoadedModel,
    wt_seq: str,
    variants: Sequence[Sequence[Mutation]],
    strategy: str = "masked-marginals",
    toks_per_batch: int = 4096,
    progress: bool = False,
    context: FamilyContext | None = None,
) -> list[float]:
    """One log-ratio score (mutant vs wild type) per parsed variant, by ``strategy``; with a
    family ``context`` (causal only), both scored as the next member after it."""
    check_strategy(loaded, strategy, VARIANT_STRATEGIES)
    _check_context(strategy, context)
    tok = loaded.alphabet.tok_to_idx
    if strategy in ("masked-marginals", "wt-marginals"):
        if strategy == "wt-marginals":
            with torch.inference_mode():
                tokens = loaded.alphabet.encode_batch([wt_seq]).to(loaded.device)  # (1, T)
                logits = loaded.model(tokens).logits[0]  # (T, V)
                lp = torch.log_softmax(logits.float(), -1)[1 : len(wt_seq) + 1].cpu().numpy()

            def table(v: Sequence[Mutation]) -> np.ndarray:
                return lp[[m.index for m in v]]

        else:
            sets = sorted({tuple(sorted(m.index for m in v)) for v in variants if v})
            with progress_bar(len(sets), "pass", strategy, progress) as bar:
                lps = masked_log_probs(loaded, wt_seq, sets, toks_per_batch, progress=bar)
            by_set = dict(zip(sets, lps, strict=True))

            def table(v: Sequence[Mutation]) -> np.ndarray:
                key = tuple(sorted(m.index for m in v))
                rows = by_set[key]
                return rows[[key.index(m.index) for m in v]]

        scores = []
        for v in variants:
            if not v:
                scores.append(0.0)
                continue
            t = table(v)
            scores.append(float(sum(t[j, tok[m.mt]] - t[j, tok[m.wt]] for j, m in enumerate(v))))
        return scores

    # Whole-sequence strategies: score each distinct sequence once.
    seqs = [_apply(wt_seq, v) for v in variants]
    unique = list(dict.fromkeys([wt_seq, *seqs]))
    total = len(unique) * len(wt_seq)
    with progress_bar(total, "res", strategy, progress) as bar:
        if strategy == "causal":
            lls = [
                float(t.sum())
                for t in causal_log_likelihoods(loaded, unique, toks_per_batch, bar, context)
            ]
        else:
            lls = [
                float(pseudo_log_likelihoods(loaded, s, toks_per_batch, bar).sum()) for s in unique
            ]
    ll = dict(zip(unique, lls, strict=True))
    return [ll[s] - ll[wt_seq] for s in seqs]


@dataclass
class VariantSummary:
    """What ``score_variants_file`` did: counts, skipped rows, and the correlation if asked."""

    out: Path
    rows: int
    scored: int
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (line, mutant, reason)
    spearman: float | None = None
    spearman_n: int = 0
    label_col: str | None = None
    detected: str | None = None  # the line saying which columns were taken by default

    def skipped_summary(self) -> str:
        """One warning naming the CSV lines (1-based, the header is line 1) left unscored."""
        shown = "; ".join(
            f"line {line} ({mut!r}: {why})" for line, mut, why in self.skipped[:_SHOW_ROWS]
        )
        more = len(self.skipped) - _SHOW_ROWS
        tail = f"; and {more} more" if more > 0 else ""
        return (
            f"{len(self.skipped)} of {self.rows} row(s) not scored (empty score; CSV line "
            f"numbers, header = line 1): {shown}{tail}"
        )


def wild_type(path: str | os.PathLike[str]) -> tuple[str, str]:
    records = read_records(path)
    if len(records) != 1:
        raise UserError(
            f"{path}: WT needs exactly one record (the wild type), found {len(records)}"
        )
    return records[0].id, records[0].sequence


def _spearman(scores: Sequence[float | None], labels: Sequence[str]) -> tuple[float | None, int]:
    xs, ys = [], []
    for s, lab in zip(scores, labels, strict=True):
        try:
            y = float(lab)
        except ValueError:
            continue
        if s is not None and math.isfinite(y):
            xs.append(s)
            ys.append(y)
    from protein_performer.inference.dms_metrics import spearman

    return spearman(xs, ys), len(xs)


def matching_offset(texts: Sequence[str], wt_seq: str) -> tuple[int, int, int] | None:
    """The ``offset`` under which most single mutations of ``texts`` name the wild type's
    letter at their position: ``(offset, rows matching, rows parsed)``, or None when no
    mutation parses. Every offset that puts a position on the sequence is tried."""
    from collections import Counter

    where: dict[str, np.ndarray] = {}
    seq = np.frombuffer(wt_seq.encode(), dtype=np.uint8)
    votes: Counter[int] = Counter()
    parsed = 0
    for text in texts:
        offsets: set[int] | None = None
        for part in re.split(r"[:;,\s]+", text.strip()):
            m = _MUTATION.match(part)
            if not part or not m:
                continue
            wt, pos = m.group(1).upper(), int(m.group(2))
            if wt not in where:
                where[wt] = np.flatnonzero(seq == ord(wt))
            fits = set((pos - where[wt]).tolist())
            offsets = fits if offsets is None else offsets & fits
        if offsets is not None:
            parsed += 1
            votes.update(offsets)
    if not votes:
        return None
    best, count = min(votes.items(), key=lambda kv: (-kv[1], abs(kv[0] - 1), kv[0]))
    return best, count, parsed


def offset_hint(texts: Sequence[str], wt_seq: str, offset: int, matched: int) -> str | None:
    """``"with --offset 24 ... match"`` when another offset fits more of ``texts`` than the
    ``matched`` rows ``offset`` fits (mutation numbering often starts before the sequence
    given), else None."""
    found = matching_offset(texts, wt_seq)
    if found is None or found[0] == offset or found[1] <= matched:
        return None
    best, count, parsed = found
    return (
        f"with --offset {best} the wild-type letters of {count} of {parsed} parsed row(s) "
        f"match ({matched} with --offset {offset}): pass --offset {best}, the number of the "
        "sequence's first residue in the mutation names"
    )


def score_variants_file(
    lm: ProteinLM,
    wt_fasta: str | os.PathLike[str],
    mutations: str | os.PathLike[str],
    out: str | os.PathLike[str],
    strategy: str = "masked-marginals",
    offset: int = 1,
    mutation_col: str = "mutant",
    label_col: str | None = None,
    score_col: str | None = None,
    toks_per_batch: int = 4096,
    limit_rows: int | None = None,
    progress: bool = True,
    context: FamilyContext | ContextEnsemble | None = None,
    per_prompt: bool = False,
) -> VariantSummary:
    """Score every row of a DMS table; write all input columns plus the score (atomically).

    With a context, what built it goes to ``OUT.context.json`` (:func:`context_record`); with
    an ensemble and ``per_prompt``, one more column per prompt (``SCORE:LABEL``) beside the
    mean.

    The input is read as UTF-8 with an optional byte-order mark (spreadsheet exports);
    delimiter by extension (``.tsv``/``.tab`` -> tab, else comma), same for the output.
    """
    if limit_rows is not None and (
        not isinstance(limit_rows, int) or isinstance(limit_rows, bool) or limit_rows < 1
    ):  # 0 or -1 read as "one row" before: never a silent partial score
        raise UserError(f"limit_rows={limit_rows!r}: give a whole number >= 1, or None for all")
    check_strategy(lm.loaded, strategy, VARIANT_STRATEGIES)
    _, wt_seq = wild_type(wt_fasta)
    path = Path(mutations).expanduser()
    if not path.is_file():
        raise UserError(f"{path} does not exist or is not a file; give the mutations CSV")
    score_col = score_col or strategy
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh, delimiter=delimiter(path))
            header = next(reader, None)
            if header is None:
                raise UserError(f"{path} is empty: expected a header row with {mutation_col!r}")
            rows: list[tuple[int, list[str]]] = []
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                rows.append((reader.line_num, row))
                if limit_rows is not None and len(rows) >= limit_rows:
                    break
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc}); save the table as UTF-8 CSV") from None
    except csv.Error as exc:
        raise UserError(f"{path}: malformed CSV ({exc})") from None
    detected = None
    if label_col is None and set(header) >= PROTEINGYM_COLUMNS and mutation_col == "mutant":
        label_col = "DMS_score"  # a ProteinGym DMS file, read as it is
        detected = (
            f"{path.name}: ProteinGym DMS columns found: mutations from 'mutant', Spearman vs "
            "'DMS_score' (--label-col and --mutation-col choose others)"
        )
    ragged = [(line, len(row)) for line, row in rows if len(row) != len(header)]
    if ragged:  # a cell too many or too few shifts every later column: never guess
        shown = ", ".join(f"line {line} has {n}" for line, n in ragged[:10])
        more = f" (+{len(ragged) - 10} more)" if len(ragged) > 10 else ""
        raise UserError(
            f"{path}: {len(ragged)} malformed row(s) whose number of cells differs from the "
            f"header's {len(header)}: {shown}{more}; fix or remove them (a delimiter inside a "
            "cell needs quotes)"
        )

    def column(name: str, flag: str) -> int:
        if name not in header:
            raise UserError(
                f"{path}: no column {name!r} ({flag}); columns are: "
                + ", ".join(repr(h) for h in header)
            )
        return header.index(name)

    mut_i = column(mutation_col, "--mutation-col")
    label_i = column(label_col, "--label-col") if label_col is not None else None
    if score_col in header:
        raise UserError(
            f"{path} already has a column {score_col!r}; choose another name with --score-col"
        )

    parsed: list[str | None] = []
    skipped: list[tuple[int, str, str]] = []
    for line, row in rows:
        text = row[mut_i] if mut_i < len(row) else ""
        try:
            parse_mutant(text, wt_seq, offset, lm.alphabet)
            parsed.append(text)
        except ValueError as exc:
            parsed.append(None)
            skipped.append((line, text, str(exc)))
    valid = [v for v in parsed if v is not None]
    if not rows:
        raise UserError(f"{path} has no rows to score (only its header)")
    hint = None
    if skipped:
        hint = offset_hint([text for _, text, _ in skipped] + valid, wt_seq, offset, len(valid))
    if not valid:
        raise UserError(
            f"{path}: none of its {len(rows)} row(s) fits the wild type with --offset {offset}; "
            + (hint or "check the wild type and the mutation column (e.g. A42G)")
        )
    from protein_performer.inference.ensemble import ContextEnsemble, context_record

    prompts = list(context.prompts) if isinstance(context, ContextEnsemble) and per_prompt else []
    if per_prompt and not prompts:
        raise UserError("per_prompt needs a context ensemble (--context with --context-* lists)")
    each = [
        lm.score_variants(
            wt_seq, valid, strategy, offset, toks_per_batch, progress, context=p.context
        )
        for p in prompts
    ]
    values = (
        np.mean(each, axis=0)
        if each
        else lm.score_variants(
            wt_seq, valid, strategy, offset, toks_per_batch, progress, context=context
        )
    )
    columns = [values, *each]
    names = [score_col, *(f"{score_col}:{p.label}" for p in prompts)]
    clash = [n for n in names[1:] if n in header]
    if clash:
        raise UserError(f"{path} already has a column {clash[0]!r}; choose another --score-col")

    def spread(column: np.ndarray) -> list[float | None]:
        it = iter(column.tolist())
        return [None if v is None else next(it) for v in parsed]

    table = [spread(c) for c in columns]
    scores = table[0]

    width = len(header)
    with text_output(out) as fh:
        writer = csv.writer(fh, delimiter=delimiter(out))
        writer.writerow([*header, *names])
        for n, (_, row) in enumerate(rows):
            cells = row + [""] * (width - len(row))
            writer.writerow([*cells, *("" if c[n] is None else f"{c[n]:.6f}" for c in table)])
    if context is not None and str(out) != "-":
        from protein_performer.io.atomic import write_text_atomic

        record = json.dumps(context_record(context), sort_keys=True, indent=1) + "\n"
        write_text_atomic(Path(f"{out}.context.json"), record)

    summary = VariantSummary(
        Path(out), len(rows), len(valid), skipped, label_col=label_col, detected=detected
    )
    if label_i is not None:
        labels = [row[label_i] if label_i < len(row) else "" for _, row in rows]
        summary.spearman, summary.spearman_n = _spearman(scores, labels)
    if skipped:
        log.warning("%s", summary.skipped_summary())
    if hint:
        log.warning("%s", hint)
    return summary
