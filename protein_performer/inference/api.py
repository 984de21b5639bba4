"""``protein_performer.load(...)`` and the object it returns: the Python entry point.

Notebook users get what fair-esm, Hugging Face and performer-pytorch give them, on our models:
embeddings, (pseudo-)likelihood scores, variant effects, fill-in of ``<mask>`` and generation.
Every CLI inference command is a thin wrapper over the streaming methods here (``iter_embed``,
``iter_score``, ``score_variants``, ``iter_predict``, ``iter_generate``; the file drivers of
:mod:`protein_performer.jobs` sit above), so the numbers a script gets and the numbers a file
holds come from one code path. The methods call the tasks of ``inference/`` (tensor work on the
loaded model), which never call back up here. Sequences go in as plain strings or ``(id,
sequence)`` pairs; batching by token budget, devices, ``torch.inference_mode`` and threads are
handled inside.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protein_performer.data.inputs import Records, as_records
from protein_performer.data.tokenizer import STANDARD_AA, Alphabet
from protein_performer.errors import UserError, shown
from protein_performer.inference.context import (
    FamilyContext,
    Homologs,
    build_context,
    check_reference,
    core_kinds,
    untrained_context_warning,
)
from protein_performer.inference.embedding import (
    HIDDEN_KINDS,
    block_numbers,
    embed_sequences,
    resolve_layers,
)
from protein_performer.inference.ensemble import ContextEnsemble
from protein_performer.inference.generation import Generated, SamplingOptions, iter_generate
from protein_performer.inference.scoring import (
    SEQUENCE_STRATEGIES,
    VARIANT_STRATEGIES,
    SequenceScore,
    check_strategy,
    parse_mutant,
    score_sequences,
    score_variants,
)
from protein_performer.interop.loading import load_model
from protein_performer.interop.record import LoadedModel
from protein_performer.io.sharding import windows
from protein_performer.io.threads import set_threads
from protein_performer.model.config import PerformerConfig
from protein_performer.model.performer import PerformerLM

if TYPE_CHECKING:
    from protein_performer.contacts.fit import ContactBenchmark
    from protein_performer.contacts.map_columns import ContactMap
    from protein_performer.contacts.structures import ContactTarget
    from protein_performer.inference.attention_views import AttentionViews, ContactView
    from protein_performer.model.contact_head import ContactRegression
    from protein_performer.model.task_heads import TaskHead
    from protein_performer.viz.report import ReportSpec

log = logging.getLogger(__name__)

#: ``--precision`` names and the dtypes they stand for.
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: ``iter_embed``'s poolings: "mean", "bos", None (per residue), or several of them at once.
Pooling = str | None | Sequence[str | None]
_SPECIAL = re.compile(r"(<[a-z_0-9]+>)")


def precision_name(dtype: torch.dtype) -> str:
    """The ``--precision`` name of a dtype (what an embeddings file records)."""
    return next(name for name, d in PRECISIONS.items() if d == dtype)


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``None``/``"fp32"`` -> float32, ``"bf16"`` -> bfloat16, ``"fp16"`` -> float16."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in PRECISIONS.values():
            raise UserError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    if name not in PRECISIONS:
        raise UserError(f"unknown precision {dtype!r}; choose fp32, bf16 or fp16")
    return PRECISIONS[name]


def load(
    source: str | os.PathLike[str] | LoadedModel,
    device: str | torch.device = "auto",
    dtype: torch.dtype | str | None = None,
    threads: int | None = None,
    *,
    attention: str | None = None,
    kernel: str | None = None,
    nb_features: int | None = None,
    seed: int = 0,
) -> ProteinLM:
    """Load any model source the CLI accepts (a training ``.ckpt``, an ``export``/``convert-esm``
    directory, a fair-esm ESM-2 ``.pt``, a Hugging Face ESM-2 directory or cached model id) for
    inference on ``device``, with weights in ``dtype`` (fp32 by default).

    ``attention``, ``kernel``, ``nb_features`` and ``seed`` are those of
    ``protein_performer.interop.loading.load_model`` (the one loader this wraps): e.g.
    ``attention="favor"`` runs ESM-2's weights with FAVOR+ features drawn from ``seed``.
    Half precision halves memory on GPUs; FAVOR+ features and the rotary tables are still
    computed in fp32 (the exponentials need its range). ``threads`` sets torch's intra-op
    threads for the process; by default they are chosen as the CLI chooses them, the cores free
    of other processes, at least 1 (``OMP_NUM_THREADS`` wins), and logged in one line: torch's
    own default, a thread per core, oversubscribes a busy machine and spins.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):  # fmt: skip
        raise UserError(f"threads must be a positive integer, got {threads!r}")
    if threads is None:
        log.info("%s", set_threads(None, flag="threads=N"))
    else:
        torch.set_num_threads(threads)
    target = resolve_dtype(dtype)
    loaded = load_model(
        source, device, attention=attention, kernel=kernel, nb_features=nb_features, seed=seed
    )
    if target != torch.float32:
        # Parameters only: the FAVOR+ random features (buffers) stay fp32, as drawn and trained;
        # rounding them to 8 bits of mantissa would change the kernel, not just the arithmetic.
        for p in loaded.model.parameters():
            p.data = p.data.to(target)
    return ProteinLM(loaded)


def _check_finite(values: Sequence[np.ndarray | float], what: str, rid: str | None = None) -> None:
    """NaN never becomes a number: non-finite ``values`` of sequence ``rid`` (None: of the
    whole call) are one error naming ``what`` came out (``"non-finite logits"``) and what to
    try."""
    if all(np.isfinite(v).all() for v in values):
        return
    where = "" if rid is None else f"sequence {shown(rid)}: "
    raise UserError(
        f"{where}the model gave {what}; its weights or precision are broken (try --precision "
        "fp32)"
    )


def _prompts(context: FamilyContext | ContextEnsemble | None) -> list[FamilyContext | None]:
    """The contexts to score with: an ensemble's prompts, else the one context (or None)."""
    if isinstance(context, ContextEnsemble):
        return [p.context for p in context.prompts]
    return [context]


def _prompt_mean(runs: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """An ensemble scores like one context: ``runs`` (one per prompt, each a list of score
    arrays) -> item by item, the mean over the prompts, element by element (one prompt: its
    own arrays' values)."""
    return [np.mean(values, axis=0) for values in zip(*runs, strict=True)]


def _pooling_kinds(pooling: Pooling) -> tuple[list[str], bool]:
    """Pooling argument -> (HDF5 kinds, whether the caller asked for several)."""
    several = not (pooling is None or isinstance(pooling, str))
    names = list(pooling) if several else [pooling]  # type: ignore[arg-type]
    kinds = ["per_tok" if p is None else p for p in names]
    bad = [p for p in kinds if p not in HIDDEN_KINDS]
    if bad or not kinds:
        raise UserError(f"pooling takes 'mean', 'bos' or None (per residue); got {pooling!r}")
    return list(dict.fromkeys(kinds)), several


class ProteinLM:
    """A loaded protein LM with the methods a scientist calls (see ``docs/API.md``)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._context_warned = False  # the no-family-rows warning: once per object

    # ----------------------------------------------------------------------------- metadata
    @property
    def config(self) -> PerformerConfig:
        return self.loaded.config

    @property
    def alphabet(self) -> Alphabet:
        return self.loaded.alphabet

    @property
    def objective(self) -> str:
        """``"mlm"`` (masked) or ``"clm"`` (causal)."""
        return self.loaded.config.objective

    @property
    def model(self) -> PerformerLM:
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def source(self) -> Path:
        """The file or directory the model was read from (a Hugging Face id: its snapshot)."""
        return self.loaded.source

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (FAVOR+ random features stay fp32)."""
        return self.loaded.model.embed_tokens.weight.dtype

    def __repr__(self) -> str:
        c = self.config
        return (
            f"ProteinLM(source={str(self.loaded.source)!r}, objective={c.objective!r}, "
            f"attention={c.attention!r}, depth={c.depth}, dim={c.dim}, device={self.device}, "
            f"dtype={self.dtype})"
        )

    # ----------------------------------------------------------------------------- embeddings
    def resolve_layers(self, layers: Sequence[int]) -> list[int]:
        """ESM layer numbers (0 = embeddings, negative from the end) -> the sorted, unique
        block numbers 0..depth they name (what an embeddings file records)."""
        return resolve_layers(self.loaded, layers)

    def iter_embed(
        self,
        records: Records,
        layers: int | Sequence[int] = (-1,),
        pooling: str | None | Sequence[str | None] = "mean",
        toks_per_batch: int = 4096,
    ) -> Iterator[tuple[str, Any]]:
        """Yield ``(id, embedding)`` in input order, batch by batch (memory: one window).

        The embedding is what :meth:`embed` returns for one sequence; with several poolings
        (a tuple, e.g. ``("mean", None)``), ``{kind: {layer: array}}`` with kinds ``mean``,
        ``bos``, ``per_tok``, layers numbered 0..depth (the CLI's file layout).
        """
        embed = self._window_embedder(layers, pooling, toks_per_batch)  # layers resolved once
        for window in windows(as_records(records), toks_per_batch, lambda r: len(r[1])):
            yield from embed(window)

    def embed_window(
        self, records: Records, layers: int | Sequence[int], pooling: Pooling, toks_per_batch: int
    ) -> list[tuple[str, Any]]:
        """:meth:`iter_embed`'s ``(id, embedding)`` pairs for records held in memory at once,
        not cut into windows again: a file driver's window (``jobs.embed``), cut once there."""
        embed = self._window_embedder(layers, pooling, toks_per_batch)
        return list(embed(list(as_records(records))))

    def _window_embedder(
        self, layers: int | Sequence[int], pooling: Pooling, toks_per_batch: int
    ) -> Callable[[list[tuple[str, str]]], Iterator[tuple[str, Any]]]:
        """Resolve ``layers`` and ``pooling`` once; the function it returns embeds one window
        of checked ``(id, sequence)`` records, in order, shaped as :meth:`iter_embed` says."""
        several_layers = not isinstance(layers, int)
        given = list(layers) if several_layers else [layers]  # type: ignore[list-item]
        blocks = block_numbers(self.loaded, given)
        resolved = sorted(set(blocks))
        kinds, several_kinds = _pooling_kinds(pooling)
        by_given = dict(zip(given, blocks, strict=True))

        def embed(window: list[tuple[str, str]]) -> Iterator[tuple[str, Any]]:
            seqs = [s for _, s in window]
            results = dict(embed_sequences(self.loaded, seqs, resolved, kinds, toks_per_batch))
            for i, (rid, _) in enumerate(window):
                out = results.pop(i)
                arrays = [a for per_layer in out.values() for a in per_layer.values()]
                _check_finite(arrays, "non-finite embeddings", rid)
                if several_kinds:
                    yield rid, out
                    continue
                per_layer = out[kinds[0]]
                if several_layers and len(given) > 1:
                    yield rid, {g: per_layer[j] for g, j in by_given.items()}
                else:
                    yield rid, per_layer[by_given[given[0]]]

        return embed

    def embed(
        self,
        seqs: Records | str,
        layers: int | Sequence[int] = (-1,),
        pooling: str | None = "mean",
        toks_per_batch: int = 4096,
    ) -> np.ndarray | list[np.ndarray] | dict[int, Any]:
        """Embeddings of ``seqs`` (strings or (id, sequence) pairs), float32.

        ``pooling="mean"`` (over residues) or ``"bos"`` (the ``<cls>`` position) -> an array
        (N, dim); ``None`` -> a list of (L_i, dim) arrays, one row per residue. Layers use
        ESM's numbering (0 = embeddings, -1 = last); several layers -> a dict layer -> result.
        """
        if not (pooling is None or isinstance(pooling, str)):
            raise UserError("embed takes one pooling; use iter_embed for several at once")
        rows = [e for _, e in self.iter_embed(seqs, layers, pooling, toks_per_batch)]

        def stack(items: list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
            if pooling is None:
                return items
            return np.stack(items) if items else np.zeros((0, self.config.dim), np.float32)

        if isinstance(layers, int) or len(layers) == 1:
            return stack(rows)
        return {k: stack([r[k] for r in rows]) for k in dict.fromkeys(layers)}

    # ----------------------------------------------------------------------------- raw outputs
    @torch.inference_mode()
    def logits(self, seqs: Records | str, toks_per_batch: int = 4096) -> list[np.ndarray]:
        """The model's logits per sequence, float32 (T_i, V) over ``<cls> residues <eos>`` in
        the vocabulary's order (``lm.alphabet``), as ESM's and Hugging Face's
        ``model(tokens).logits``: row ``i + 1`` is residue ``i``. Unmasked, one pass per
        batch (a masked LM's rows then score each residue while seeing it)."""
        from protein_performer.data.sampler import budget_batches

        records = list(as_records(seqs))
        lengths = [len(s) + 2 for _, s in records]
        out: list[np.ndarray | None] = [None] * len(records)
        for batch in budget_batches(lengths, toks_per_batch):
            tokens = self.alphabet.encode_batch([records[i][1] for i in batch])  # (B, T)
            logits = self.model(tokens.to(self.device)).logits.float().cpu().numpy()  # (B, T, V)
            for row, i in enumerate(batch):
                out[i] = logits[row, : lengths[i]]
        for (rid, _), value in zip(records, out, strict=True):
            _check_finite([value], "non-finite logits", rid)  # type: ignore[list-item]
        return out  # type: ignore[return-value]

    def attention(
        self,
        seq: str,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        window: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Implied attention maps of one sequence, float32 (n_layers, n_heads, W, L) over
        residues (no ``<cls>``/``<eos>``): row ``r`` is how residue ``start + r`` attends to
        each residue, what ``visualize`` and the HTML report draw. FAVOR+ never forms the
        matrix: each row is the attention's output for V = I, so a ``window=(start, end)`` of
        query residues costs O(W x L) memory (default: all L rows). ``layers`` 1..depth
        (negative from the end; default all), ``heads`` 0-based (default all), in sorted
        order."""
        from protein_performer.contacts.attention import attention_maps, resolve_layers

        ((_, text),) = list(as_records([("sequence", seq)]))
        chosen = resolve_layers(self.model, layers)
        rows: dict[int, np.ndarray] = {}

        def sink(layer: int, maps: Any) -> None:  # noqa: ANN401 - a (H', W, L) tensor
            rows[layer] = maps.float().cpu().numpy()

        with torch.inference_mode():
            attention_maps(
                self.model, text, layers=chosen, heads=None if heads is None else list(heads),
                window=None if window is None else (int(window[0]), int(window[1])), sink=sink,
            )  # fmt: skip
        return np.stack([rows[layer] for layer in chosen])

    # ----------------------------------------------------------------------------- context
    def context(
        self,
        homologs: Homologs,
        max_tokens: int | None = None,
        *,
        query: str | None = None,
        max_identity: Sequence[float] | None = None,
        tokens: Sequence[int | None] | None = None,
        orders: int = 0,
        seed: int = 0,
        warn: bool = True,
    ) -> FamilyContext | ContextEnsemble:
        """Read a family once, for ``score``/``score_variants``/``generate(context=...)``.

        With any of ``max_identity`` (drop homologs more identical to ``query`` than each
        value), ``tokens`` (context token budgets) or ``orders`` (N seeded random orders, each
        also reversed), a PoET-style :class:`ContextEnsemble` instead: one prompt per
        combination, scores averaged over them; it scores like one context (``generate``
        spreads its sequences over the prompts in turn). Built from (homologs, query, options,
        seed) alone: the same inputs give the same prompts (``ens.record()``).

        ``homologs``: a list of strings or (id, sequence) pairs, or a path (a ``str`` is
        always one; a FASTA, or an A2M/A3M/Stockholm MSA whose first row is the reference: its
        homologs carry aligned coordinates, read by a position memory;
        ``data.inputs.read_homologs``), in order of relevance;
        read as one row ``<cls> m1 <eos> <cls> m2 <eos> ...`` (one prefill). Members past
        ``max_tokens`` (default: the trained row length if the config records it, else no
        limit) are left out and logged. Causal models only (a masked LM: ``UserError``).
        The result is immutable: score any number of candidates against it. A model whose
        checkpoint records no family-row training gets one warning (per object). ``warn=False``
        leaves the logging of what was read to the caller (the CLI's one line).
        """
        if self.config.causal and not self._context_warned:
            self._context_warned = True
            said = untrained_context_warning(self.loaded)
            if said:
                log.warning(said)
        if max_identity is None and tokens is None and not orders:
            return build_context(self.loaded, homologs, max_tokens, warn=warn)
        from protein_performer.inference.ensemble import build_ensemble

        if tokens is not None and max_tokens is not None:
            raise UserError("give max_tokens or tokens (an ensemble's budgets), not both")
        return build_ensemble(
            self.loaded, homologs, query=query, max_identity=max_identity or (1.0,),
            tokens=tokens or (max_tokens,), orders=orders, seed=seed,
        )  # fmt: skip

    def _check_context(self, context: FamilyContext | ContextEnsemble | None) -> None:
        if context is not None and not isinstance(context, FamilyContext | ContextEnsemble):
            raise UserError(
                f"context must come from lm.context(homologs), got {type(context).__name__}"
            )
        if context is None:
            return
        mine = core_kinds(self.model)
        if context.cores != mine:  # asked of the cores: a memory or a hybrid stack too
            theirs, ours = sorted(set(context.cores)), sorted(set(mine))
            raise UserError(
                f"this context was built by a model with {', '.join(theirs)} attention, this "
                f"model's is {', '.join(ours)}; build it with this model"
            )

    def context_note(
        self, context: FamilyContext, max_tokens: int | None, flag: str = "max_tokens=N"
    ) -> str:
        """What ``context`` read, in one line (``read K of N homologs (T tokens)``, and which
        limit left the others out: ``max_tokens`` or the trained row length; ``flag`` says how
        to read more where the caller is): what ``lm.context(..., warn=False)`` leaves to it."""
        from protein_performer.inference.context import default_max_tokens, limit_note

        limit = max_tokens or default_max_tokens(self.loaded)
        kept, given = len(context.members), len(context.members) + len(context.dropped)
        return limit_note(self.loaded, kept, given, context.n_tokens, limit, flag)

    # ----------------------------------------------------------------------------- scores
    def check_strategy(self, strategy: str, choices: Sequence[str]) -> None:
        """Refuse a strategy outside ``choices`` or one this model's objective cannot
        compute (a masked LM has no left-to-right distribution), before any input is read."""
        check_strategy(self.loaded, strategy, choices)

    def _strategy(self, strategy: str | None, choices: Sequence[str], masked: str) -> str:
        strategy = strategy or ("causal" if self.objective == "clm" else masked)
        self.check_strategy(strategy, choices)
        return strategy

    def iter_score(
        self,
        records: Records,
        strategy: str | None = None,
        toks_per_batch: int = 4096,
        *,
        context: FamilyContext | ContextEnsemble | None = None,
        progress: Any = None,  # noqa: ANN401 - a tqdm-like bar
        pll_rate: float | None = None,
    ) -> Iterator[tuple[str, SequenceScore]]:
        """Yield ``(id, SequenceScore)`` in input order; see :meth:`score` for the strategies.
        ``progress``: a tqdm-like bar to advance by residues scored."""
        strategy = self._strategy(strategy, SEQUENCE_STRATEGIES, "pseudo-ppl")
        self._check_context(context)
        bar = False if progress is None else progress
        prompts = _prompts(context)
        for window in windows(as_records(records), toks_per_batch, lambda r: len(r[1])):
            runs = [
                score_sequences(self.loaded, window, strategy, toks_per_batch, bar, ctx,
                                pll_rate)  # fmt: skip
                for ctx in prompts
            ]
            means = _prompt_mean([[s.terms for s in run] for run in runs])
            for first, terms in zip(runs[0], means, strict=True):
                score = SequenceScore(first.id, first.length, first.n_scored,
                                      float(terms.sum()), terms)  # fmt: skip
                _check_finite([score.log_likelihood], "a non-finite log-likelihood", score.id)
                yield score.id, score

    def score(
        self,
        seqs: Records | str,
        strategy: str | None = None,
        toks_per_batch: int = 4096,
        *,
        context: FamilyContext | ContextEnsemble | None = None,
        per_position: bool = False,
        pll_rate: float | None = None,
        progress: bool = False,
    ) -> np.ndarray | list[np.ndarray]:
        """Mean log-likelihood per scored token, one per sequence (what ``score`` writes).

        ``pseudo-ppl`` (masked models; every residue masked once) scores the L residues;
        ``causal`` (causal models) the residues and the final ``<eos>``. Default: the one that
        fits the model. Perplexity is ``exp(-score)``. With a family ``context``
        (:meth:`context`), each sequence is scored as the next member after it (an ensemble:
        the mean over its prompts). ``per_position=True``: instead, per sequence, the
        log-likelihood of each scored token ((L,) for pseudo-ppl, (L + 1,) for causal: the
        last is ``<eos>``), whose mean is the score. ``pll_rate`` (pseudo-ppl): mask every
        ``round(1/rate)``-th residue together, about ``1/rate`` passes per protein instead of
        L (an estimate; docs/RESULTS.md compares it with the exact value). ``progress``: a bar
        (a line every 30 s in a log) with the ETA.
        """
        from protein_performer.io.progress import progress as progress_bar

        items = list(as_records(seqs))
        bar = progress_bar(sum(len(s) for _, s in items), "res", "score", progress)
        with bar:
            scores = [s for _, s in self.iter_score(items, strategy, toks_per_batch,
                                                    context=context, progress=bar,
                                                    pll_rate=pll_rate)]  # fmt: skip
        if per_position:
            return [s.terms for s in scores]
        return np.array([s.mean_log_likelihood for s in scores], dtype=np.float64)

    def score_variants(
        self,
        wild_type: str,
        mutants: Sequence[str],
        strategy: str | None = None,
        offset: int = 1,
        toks_per_batch: int = 4096,
        progress: bool = False,
        *,
        context: FamilyContext | ContextEnsemble | None = None,
    ) -> np.ndarray:
        """Log-ratio mutant vs wild type per mutant (``"A42G"``, ``"A42G:K45R"``, ``"wt"``).

        Strategies as ESM's variant-prediction example: ``masked-marginals`` (default for
        masked models), ``wt-marginals``, ``pseudo-ppl``; ``causal`` for causal models.
        Positions are numbered so the wild type's first residue is ``offset``. With a family
        ``context`` (causal), mutant and wild type are both scored as the next member after it.
        """
        strategy = self._strategy(strategy, VARIANT_STRATEGIES, "masked-marginals")
        self._check_context(context)
        ((_, wt),) = list(as_records([("wild type", wild_type)]))
        if context is not None:  # an aligned context places its homologs on its reference
            check_reference(_prompts(context)[0], wt)  # type: ignore[arg-type]
        parsed = []
        for i, text in enumerate(mutants):
            try:
                parsed.append(parse_mutant(text, wt, offset, self.alphabet))
            except ValueError as exc:
                raise UserError(f"mutant {i} ({text!r}): {exc}") from None
        runs = [
            [score_variants(self.loaded, wt, parsed, strategy, toks_per_batch, progress,
                            context=ctx)]  # fmt: skip
            for ctx in _prompts(context)
        ]
        values = _prompt_mean(runs)[0].astype(np.float64)
        _check_finite([values], "non-finite variant scores")
        return values

    # ----------------------------------------------------------------------------- task head
    def measure(self, data: str | os.PathLike[str], **settings: Any) -> dict[str, Any]:
        """Loss, perplexity and accuracy on ``data`` (a FASTA file, ``-``, or a store, of which
        ``split`` is read), overall and per length bin: ``inference.evaluate.measure`` with its
        keywords (``split``, ``max_len``, ``limit``, ``pll``, ``bins``, ...); ``eval`` writes
        it."""
        from protein_performer.inference.evaluate import measure

        return measure(self.loaded, data, **settings)

    def task_head(self) -> TaskHead:
        """A fine-tuned model's head, or one ``UserError`` saying how to get a model that
        has one."""
        from protein_performer.inference.prediction import task_head

        return task_head(self.loaded)

    def iter_predict(
        self, records: Records, toks_per_batch: int = 4096
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(id, prediction)`` in input order (memory: one window); see :meth:`predict`."""
        from protein_performer.inference.prediction import predict_sequences

        self.task_head()  # a model without a head fails before reading any input
        for window in windows(as_records(records), toks_per_batch, lambda r: len(r[1])):
            values = predict_sequences(self.loaded, [s for _, s in window], toks_per_batch)
            for (rid, _), value in zip(window, values, strict=True):
                _check_finite([value], "non-finite predictions", rid)
                yield rid, value

    def predict(
        self, seqs: Records | str, toks_per_batch: int = 4096
    ) -> np.ndarray | list[np.ndarray]:
        """A fine-tuned model's head on ``seqs`` (``protein-performer finetune``), float32:
        regression -> (N,) for one target, (N, T) for several; classification -> class
        probabilities (N, C) (classes in ``lm.task_labels`` order); residue classification ->
        a list of (L_i, C) probabilities. Any length, one pass per sequence."""
        head = self.task_head()
        rows = [v for _, v in self.iter_predict(seqs, toks_per_batch)]
        if head.per_residue:
            return rows
        width = head.config.num_outputs
        arr = np.stack(rows) if rows else np.zeros((0, width), np.float32)
        return arr[:, 0] if head.config.task == "regression" and width == 1 else arr

    @property
    def task_labels(self) -> list[str] | None:
        """A fine-tuned model's target names (regression) or classes in index order."""
        head = getattr(self.loaded, "task", None)
        return None if head is None else list(head.config.labels)

    # ----------------------------------------------------------------------------- contacts
    def predict_contacts(
        self, seq: str, regression: str | os.PathLike[str] | None = None
    ) -> np.ndarray:
        """(L, L) contact probabilities of one sequence (residues only, no BOS/EOS), from the
        model's own contact regression (a converted ESM-2's head, or one fitted by
        ``protein-performer contacts``) or the regression file ``regression``. The map is
        L x L; to keep only the top pairs of a very long sequence, call
        ``protein_performer.contacts.predict.predict_contacts`` with a dense limit."""
        ((_, text),) = list(as_records([("sequence", seq)]))
        reg = self.contact_regression(regression)
        return self.contact_map(text, reg, dense_max_length=len(text)).dense

    def contact_regression(
        self,
        path: ContactRegression | str | os.PathLike[str] | None = None,
        *,
        caller: str = "python",
        sha256: str | None = None,
    ) -> ContactRegression:
        """The regression at ``path`` (or the one given, already read), else the model's own
        (a missing one: one line saying how to fit one, in the ``caller``'s words), checked
        against this model once: another attention layout is refused, other weights
        (``sha256`` if the caller hashed them already) are warned about."""
        from protein_performer.contacts.predict import find_regression
        from protein_performer.model.contact_head import ContactRegression

        reg = (
            path
            if isinstance(path, ContactRegression)
            else find_regression(self.loaded, path, caller=caller)
        )
        reg.check_model(self.loaded, sha256)
        return reg

    def contact_map(self, seq: str, regression: ContactRegression, **limits: Any) -> ContactMap:
        """One sequence's :class:`ContactMap` under ``regression`` (from
        :meth:`contact_regression`, so checked once per run, not per sequence); ``limits``:
        ``dense_max_length``, ``top_k_per_length``, ``min_separation`` of
        ``contacts.predict.predict_contacts``."""
        from protein_performer.contacts.predict import predict_contacts

        return predict_contacts(self.loaded, seq, regression, checked=True, **limits)

    def fit_contacts(
        self, targets: Sequence[ContactTarget], out_dir: str | os.PathLike[str], **options: Any
    ) -> ContactBenchmark:
        """``contacts fit``: a contact regression fitted on (or, given ``regression=``, applied
        to) ``targets`` of known structure, scored by precision at L, L/2, L/5 into ``out_dir``
        (``contacts.fit.benchmark`` with its keywords: ``fit_targets``, ``folds``, ``C``,
        ``class_weight``, ``seed``, ``save_beside``)."""
        from protein_performer.contacts.fit import benchmark

        return benchmark(self.loaded, targets, out_dir, **options)

    # ----------------------------------------------------------------------------- views
    def attention_views(self, seq: str, **options: Any) -> AttentionViews:
        """``visualize``'s arrays of one sequence: the attention grid of a window of residues
        and the rows handed to ``row_sinks`` (``inference.attention_views.attention_views``
        with its keywords: ``layers``, ``heads``, ``window``, ``grid``, ``row_sinks``)."""
        from protein_performer.inference.attention_views import attention_views

        return attention_views(self.loaded, seq, **options)

    def contact_view(self, target: ContactTarget, regression: str | None = None) -> ContactView:
        """Predicted against true contacts of a structure's chain: from the regression
        (``regression``, else the model's own), else the attention's unsupervised map."""
        from protein_performer.inference.attention_views import contact_view

        return contact_view(self.loaded, target, regression)

    # ----------------------------------------------------------------------------- report
    def report(
        self,
        seq: str,
        structure: str | os.PathLike[str] | None = None,
        path: str | os.PathLike[str] = "report.html",
        *,
        chain: str | None = None,
        regression: str | os.PathLike[str] | None = None,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        budget_mb: float = 20.0,
        name: str | None = None,
    ) -> Path:
        """Write one self-contained interactive HTML report of ``seq`` (attention of every
        layer x head, their mean, the APC map, a per-residue entropy track, amino-acid
        similarity vs BLOSUM62; with ``structure``, predicted vs true contacts) to ``path``.
        Map data stays under ``budget_mb`` whatever the length (views are binned above it)."""
        from protein_performer.viz.report import write_report

        ((rid, text),) = list(as_records([(name or "sequence", seq)]))
        target = None
        if structure is not None:
            from protein_performer.contacts.structures import contact_target

            target = contact_target(structure, chain=chain, sequence=text)
        spec = self.report_spec(
            text, name=rid, target=target,
            regression=None if regression is None else str(regression),
            layers=layers, heads=heads, budget_mb=budget_mb,
        )  # fmt: skip
        return write_report(spec, path)

    def report_spec(self, seq: str, **options: Any) -> ReportSpec:
        """The arrays of :meth:`report` before they are drawn (``visualize --html`` draws
        them): ``inference.report_data.build_report`` with its keywords (``name``, ``target``,
        ``regression``, ``layers``, ``heads``, ``budget_mb``, ``first_window``,
        ``progress``)."""
        from protein_performer.inference.report_data import build_report

        return build_report(self.loaded, seq, **options)

    # ----------------------------------------------------------------------------- fill-in
    def _tokens_with_masks(self, text: str) -> list[int]:
        a = self.alphabet
        ids = [a.cls_idx]
        for part in _SPECIAL.split(text.strip()):
            if not part:
                continue
            if _SPECIAL.fullmatch(part):
                if part != "<mask>":
                    raise UserError(f"only <mask> may appear in a sequence, got {part}")
                ids.append(a.mask_idx)
                continue
            try:
                ids.extend(a.encode(part.upper()).astype(int).tolist())
            except ValueError as exc:
                raise UserError(f"{text!r}: {exc}") from None
        return [*ids, a.eos_idx]

    @torch.inference_mode()
    def fill_mask(self, seq: str, top_k: int = 5) -> list[list[tuple[str, float]]]:
        """Per ``<mask>`` in ``seq`` (left to right): the ``top_k`` residues, best first, with
        the model's probabilities (softmax over the whole vocabulary; only the 20 standard
        amino acids are candidates). All masks are filled jointly in one pass."""
        if self.objective != "mlm":
            raise UserError(
                "fill_mask needs a masked LM (objective mlm); this is a causal model: use "
                "generate(prompt=...) or score() instead"
            )
        if top_k < 1:
            raise UserError(f"top_k must be a positive integer, got {top_k}")
        a = self.alphabet
        ids = self._tokens_with_masks(seq)
        where = [i for i, t in enumerate(ids) if t == a.mask_idx]
        if not where:
            raise UserError(f"{seq!r} has no <mask> to fill")
        tokens = torch.tensor([ids], device=self.device)
        probs = torch.softmax(self.model(tokens).logits[0, where].float(), dim=-1).cpu()
        cand = torch.tensor([a.tok_to_idx[c] for c in STANDARD_AA])
        out = []
        for row in probs:
            p = row[cand]
            best = torch.argsort(p, descending=True, stable=True)[: min(top_k, len(cand))]
            out.append([(STANDARD_AA[int(j)], float(p[j])) for j in best])
        return out

    # ----------------------------------------------------------------------------- generation
    def iter_generate(
        self,
        n: int = 8,
        max_length: int = 300,
        min_length: int = 0,
        prompt: str | Sequence[str] = "M",
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        batch_size: int = 8,
        *,
        context: FamilyContext | ContextEnsemble | None = None,
    ) -> Iterator[Generated]:
        """Yield :class:`Generated` records (sequence, how it ended, per-token log-probs);
        with an ensemble ``context``, sequence ``i`` follows prompt ``i mod len(prompts)``."""
        self._check_context(context)
        contexts: Any = context
        if isinstance(context, ContextEnsemble):
            contexts = [p.context for p in context.prompts]
        opts = SamplingOptions(max_length, min_length, temperature, top_k, top_p)
        if isinstance(prompt, str):
            prompts: str | list[str] = prompt.strip().upper()
        else:
            prompts = [p.strip().upper() for p in prompt]
        return iter_generate(self.loaded, n, opts, prompts, seed, batch_size, contexts)

    def generate(self, *args: Any, **kwargs: Any) -> list[str]:
        """Sample ``n`` sequences from a causal model in RNN mode (constant cost per token).

        Each starts with ``prompt`` (one string, or one per sequence) and ends at ``<eos>``
        (never before ``min_length`` residues) or at ``max_length`` residues, prompt included.
        Only the 20 standard amino acids are emitted. ``temperature=0`` is greedy; ``top_k``
        and ``top_p`` (nucleus) restrict each draw. The same ``seed`` gives the same sequences
        whatever ``batch_size``: each sequence has its own stream, seeded from (seed, index).
        With a family ``context`` (:meth:`context`) the sequences are new members of that
        family, each generated as the next member after it (``prompt=""`` lets the model
        choose the first residue too); with an ensemble, sequence ``i`` after prompt
        ``i mod len(prompts)``. The arguments are :meth:`iter_generate`'s (its signature is
        this method's, as ``help()`` shows), written once there.
        """
        return [g.sequence for g in self.iter_generate(*args, **kwargs)]

    generate.__signature__ = inspect.signature(iter_generate).replace(  # type: ignore[attr-defined]
        return_annotation="list[str]"
    )
