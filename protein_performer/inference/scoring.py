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
``perplexity = exp(-mean_log_likelihood)`` (:class:`SequenceScore`; the ``score`` command's
table: :mod:`protein_performer.jobs.score`).

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
``offset`` (:func:`parse_mutant`; the ``score-variants`` command's table:
:mod:`protein_performer.jobs.score_variants`).

Tensor work on a :class:`~protein_performer.interop.record.LoadedModel` only: ``lm.score``,
``lm.iter_score`` and ``lm.score_variants`` (:mod:`protein_performer.inference.api`) call it.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protein_performer.data.sampler import budget_batches
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.progress import beat
from protein_performer.io.progress import progress as progress_bar

if TYPE_CHECKING:
    from protein_performer.inference.context import FamilyContext

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
        if progress is not None:  # positions scored (a pass of a spaced set scores several)
            progress.update(sum(len(p) for p in chunk))  # type: ignore[attr-defined]
        done = start + len(chunk)
        beat(f"{done}/{len(position_sets)} masked passes over a {len(seq)}-residue sequence")
    return results


def check_pll_rate(rate: float | None) -> None:
    """``None`` (exact) or a fraction in (0, 0.5]: more would mask most of the protein."""
    if rate is not None and (isinstance(rate, bool) or not 0 < float(rate) <= 0.5):
        raise UserError(
            f"pll_rate must be in (0, 0.5] (None: exact pseudo-perplexity), got {rate!r}"
        )


def pll_position_sets(length: int, rate: float | None = None) -> list[list[int]]:
    """The masked passes of a pseudo-log-likelihood over ``length`` residues: one residue each
    (exact, ``rate`` None), or with ``rate`` every ``k = round(1 / rate)``-th residue together
    (offsets 0..k-1), so every residue is scored once in ``min(k, L)`` passes instead of L."""
    if rate is None:
        return [[i] for i in range(length)]
    stride = max(1, min(length, round(1 / float(rate))))
    return [list(range(o, length, stride)) for o in range(stride)]


def pseudo_log_likelihoods(
    loaded: LoadedModel,
    seq: str,
    toks_per_batch: int = 4096,
    progress: object | None = None,
    rate: float | None = None,
) -> np.ndarray:
    """(L,) ``log p(x_i | x without i)``: every residue masked once (exact PLL terms); with
    ``rate``, residue i's term is read from the pass that masks it with its spaced set (the
    other residues of the set masked too: an estimate, cheaper by about L x rate)."""
    ids = loaded.alphabet.encode(seq).astype(np.int64)
    sets = pll_position_sets(len(seq), rate)
    lps = masked_log_probs(loaded, seq, sets, toks_per_batch, progress=progress)
    terms = np.zeros(len(seq), dtype=np.float64)
    for positions, lp in zip(sets, lps, strict=True):
        terms[positions] = lp[np.arange(len(positions)), ids[positions]]
    return terms


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
    #: (n_scored,) per-position log-likelihoods (pseudo-ppl: the L residues; causal: the L
    #: residues and ``<eos>``), summing to ``log_likelihood``.
    terms: np.ndarray | None = None

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
    pll_rate: float | None = None,
) -> list[SequenceScore]:
    """Score ``(id, sequence)`` pairs with ``strategy`` (see the module docstring), after a
    family ``context`` when given (causal only). ``progress``: a bar of its own, or the
    caller's bar, advanced by residues scored as batches finish (its ETA). ``pll_rate``:
    pseudo-ppl's spaced masking (:func:`pll_position_sets`; None: exact)."""
    check_strategy(loaded, strategy, SEQUENCE_STRATEGIES)
    _check_context(strategy, context)
    check_pll_rate(pll_rate)
    if pll_rate is not None and strategy != "pseudo-ppl":
        raise UserError(f"pll_rate is for strategy 'pseudo-ppl', not {strategy!r}")
    seqs = [s for _, s in records]
    own = isinstance(progress, bool)
    given = progress_bar(sum(len(s) for s in seqs), "res", strategy, progress) if own else None
    with given or contextlib.nullcontext(progress) as bar:
        if strategy == "causal":
            terms = causal_log_likelihoods(loaded, seqs, toks_per_batch, bar, context)
        else:
            terms = [
                pseudo_log_likelihoods(loaded, s, toks_per_batch, bar, pll_rate) for s in seqs
            ]
    return [
        SequenceScore(rid, len(s), len(t), float(t.sum()), t)
        for (rid, s), t in zip(records, terms, strict=True)
    ]


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
            positions = sum(len(s) for s in sets)
            with progress_bar(positions, "pos", strategy, progress) as bar:
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


def label_spearman(
    scores: Sequence[float | None], labels: Sequence[str]
) -> tuple[float | None, int]:
    """Spearman rho of ``scores`` vs the labels that read as finite numbers (a table's cells),
    over the rows scored, and how many rows that is."""
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
