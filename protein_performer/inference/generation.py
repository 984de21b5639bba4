"""Sampling protein sequences from causal models, one token at a time in RNN mode.

The prompt (``<cls>`` + prompt residues) runs once through the parallel causal forward, which
also returns each layer's state; then every new token costs one :meth:`PerformerLM.step`.
With FAVOR+ the state is a fixed (m x (d+1)) prefix sum per head, so time and memory per token
do not grow with the context (performer-pytorch's ``AutoregressiveWrapper.generate`` re-runs
the whole prefix for every token instead). The exact-attention twin uses a KV cache.

Reproducibility: every record has its own random stream, seeded from ``(seed, index)``, and
draws one uniform number per token from it, so a record's sequence does not depend on the
batch it was generated in (on CPU in fp32: other devices may differ in the last bits of the
logits, and so, rarely, in a draw).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protein_performer.data.tokenizer import STANDARD_AA
from protein_performer.errors import UserError
from protein_performer.interop.record import LoadedModel
from protein_performer.io.progress import beat
from protein_performer.model.performer import PerformerLM

if TYPE_CHECKING:
    from protein_performer.inference.context import FamilyContext


log = logging.getLogger(__name__)

#: "1": decode through one compiled graph per model and batch size
#: (:class:`~protein_performer.model.decode.CompiledStep`) always; "0": ``model.step`` always;
#: unset (or "auto"): the compiled step where it pays (:data:`COMPILE_PAYS_STEPS`), else the
#: same step traced by TorchScript (no compile).
COMPILE_ENV = "PROTEIN_PERFORMER_COMPILE_STEP"
#: Decoding steps of one batch size from which the compiled step is the default: its compile
#: (about 30-45 s for the 8M shape on one CPU thread, 3-5 s from a warm inductor cache) is
#: paid back by the step's time saved over the TorchScript trace (docs/RESULTS.md).
COMPILE_PAYS_STEPS = 12_000

Step = Callable[..., tuple[torch.Tensor, list]]


def decoding_step(model: PerformerLM, steps: int | None = None) -> Step:
    """The step generation calls, built once per model and kind (kept on it).

    ``PROTEIN_PERFORMER_COMPILE_STEP`` unset: :class:`~protein_performer.model.decode.
    CompiledStep`, compiled (once per batch size, on its first token, one log line) when
    ``steps`` (the most tokens this run decodes at this batch size, when the caller knows
    them) reach :data:`COMPILE_PAYS_STEPS`, else the same step traced by ``torch.jit.trace``
    (once per batch size, a twentieth of a second; run without Python, no compile; eagerly
    after one log line where the trace fails). "1": always compiled; "0": ``model.step``.
    A model the traced step cannot run, or a compiler that fails, keeps ``model.step`` and says
    why in one line (a warning when "1" asked for it, else info).

    The traced step's logits are ``model.step``'s to float rounding (it reads transposed
    weights, one more copy of them in memory), so a draw on a knife's edge can differ between
    the kinds; set the variable to pin one."""
    mode = os.environ.get(COMPILE_ENV, "").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise UserError(f"{COMPILE_ENV}={mode!r}: expected 1, 0 or auto")
    if mode == "0":
        return model.step
    compiled = mode == "1" or (steps or 0) >= COMPILE_PAYS_STEPS
    kind = "compiled" if compiled else "traced"
    built = model.__dict__.setdefault("_decoding_steps", {})
    if kind not in built:
        from protein_performer.model.decode import CompiledStep, unsupported

        reason = unsupported(model)
        if reason is not None:
            level = logging.WARNING if mode == "1" else logging.INFO
            log.log(level, "%s: no %s step (%s); decoding eagerly", COMPILE_ENV, kind, reason)
            built[kind] = model.step
        else:
            mode = "compile" if compiled else "trace"
            built[kind] = _EagerFallback(model, CompiledStep(model, mode=mode), kind)
    return built[kind]


class _EagerFallback:
    """A traced step, replaced by ``model.step`` for good when a call raises (no compiler, an
    unsupported op); that token is decoded eagerly, so the run goes on."""

    def __init__(self, model: PerformerLM, traced: Step, kind: str) -> None:
        self.model, self.traced, self.kind = model, traced, kind

    def __call__(self, tokens, positions, states, pad=None, inplace=False):
        if self.traced is not None:
            try:
                return self.traced(tokens, positions, states, pad, inplace)
            except Exception as err:  # torch.compile's failures have no common type
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                log.warning("%s: the %s step failed (%s); decoding eagerly",
                            COMPILE_ENV, self.kind, first)  # fmt: skip
                self.traced = None
        return self.model.step(tokens, positions, states, pad, inplace=inplace)


@dataclass
class Generated:
    """One sampled sequence and how it ended."""

    index: int  # 0-based record number in the run
    seed: int  # the run's seed; the record's stream is seeded from (seed, index)
    sequence: str  # residues, prompt included, no special tokens
    ended: str  # "eos" (the model ended it) or "max_length"
    token_log_probs: np.ndarray  # log p of each sampled token (residues, then <eos> if any)


@dataclass(frozen=True)
class SamplingOptions:
    """What shapes each draw; validated once, before any model work."""

    max_length: int
    min_length: int = 0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def validate(self) -> SamplingOptions:
        if self.max_length < 1:
            raise UserError(f"max_length must be at least 1, got {self.max_length}")
        if not 0 <= self.min_length <= self.max_length:
            raise UserError(
                f"min_length must be in 0..max_length ({self.max_length}), got {self.min_length}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


def record_generator(seed: int, index: int) -> torch.Generator:
    """The random stream of record ``index``: independent of batch size and of other records."""
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


def _choose(
    logits: torch.Tensor,
    allowed: torch.Tensor,
    opts: SamplingOptions,
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One draw per row from ``logits`` (R, V) restricted to ``allowed`` (R, V) bool, in
    float64, row r from ``generators[r]`` (one uniform number each).

    All rows at once (a batch's per-row draws were as costly as a small model's step); every
    op is row-wise, so a row draws what it draws alone, whatever the batch."""
    z = logits.double().masked_fill(~allowed, float("-inf"))
    if opts.temperature == 0:
        return z.argmax(-1).tolist()
    if opts.temperature != 1:  # z / 1 is z: one op less per token
        z = z / opts.temperature
    if opts.top_k is not None:
        cut = opts.top_k < allowed.sum(-1, keepdim=True)  # (R, 1): rows with more to drop
        if bool(cut.any()):
            kth = torch.topk(z, opts.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(cut & (z < kth), float("-inf"))
    p = torch.softmax(z, dim=-1)
    if opts.top_p is not None and opts.top_p < 1:
        order = torch.argsort(p, dim=-1, descending=True, stable=True)
        ranked = p.gather(-1, order)
        before = torch.cumsum(ranked, -1) - ranked  # mass of the better tokens
        # keep the smallest set reaching top_p
        p = p.scatter(-1, order, ranked.masked_fill(before >= opts.top_p, 0.0))
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    cdf = torch.cumsum(p, -1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picks.clamp_max(p.shape[-1] - 1).tolist()


@torch.inference_mode()
def generate_batch(
    loaded: LoadedModel,
    indices: Sequence[int],
    prompts: Sequence[str],
    opts: SamplingOptions,
    seed: int,
    context: FamilyContext | None = None,
    steps: int | None = None,
) -> list[Generated]:
    """Sample one sequence per (index, prompt); see the module docstring for the recursion.

    With a family ``context`` each prompt runs as the next member after it, from its states
    (never written), so the sequences are new members of that family. ``steps``: the most
    tokens the whole run decodes at this batch size (:func:`decoding_step`; None: this
    batch's)."""
    if steps is None:
        steps = opts.max_length
    a = loaded.alphabet
    model = loaded.model
    step = decoding_step(model, steps)
    device = loaded.device
    B = len(indices)
    gens = [record_generator(seed, i) for i in indices]
    residues = torch.zeros(len(a), dtype=torch.bool)  # what may be emitted (CPU: drawn there)
    residues[[a.tok_to_idx[c] for c in STANDARD_AA]] = True
    with_eos = residues.clone()
    with_eos[a.eos_idx] = True

    prompt_ids = [[a.cls_idx, *a.encode(p).astype(np.int64).tolist()] for p in prompts]
    width = max(len(p) for p in prompt_ids)
    tokens = torch.full((B, width), a.pad_idx, dtype=torch.long, device=device)
    for row, ids in enumerate(prompt_ids):
        tokens[row, : len(ids)] = torch.as_tensor(ids, device=device)
    lengths = torch.tensor([len(p) for p in prompt_ids], device=device)
    if context is None:
        logits, states = model.prefill(tokens)  # (B, T, V)
    else:
        logits, states = model.extend(tokens, context.states, context.offset, return_states=True)
    last = logits[torch.arange(B, device=device), lengths - 1].float()  # (B, V)

    seqs = [list(p) for p in prompts]
    lps: list[list[float]] = [[] for _ in range(B)]
    ended = ["" for _ in range(B)]
    positions = lengths.clone() if context is None else lengths + context.offset
    allowed_for: tuple[bool, ...] = ()  # the rows' "may end" flags ``allowed`` was built for
    allowed = pad = torch.empty(0)
    live = -1  # rows not ended when ``pad`` was built
    while True:
        last_cpu = last.cpu()
        log_p = torch.log_softmax(last_cpu, dim=-1)
        next_tok = torch.full((B,), a.eos_idx, dtype=torch.long)
        for row in range(B):
            if not ended[row] and len(seqs[row]) >= opts.max_length:
                ended[row] = "max_length"
        rows = [row for row in range(B) if not ended[row]]
        picks: list[int] = []
        picked: list[float] = []
        if rows:
            may_end = tuple(len(seqs[r]) >= opts.min_length for r in rows)
            if may_end != allowed_for:  # rebuilt only when a row's choices change
                allowed_for = may_end
                allowed = torch.stack([with_eos if e else residues for e in may_end])
            picks = _choose(last_cpu[rows], allowed, opts, [gens[r] for r in rows])
            picked = log_p[rows, picks].tolist()
        for row, tok, lp in zip(rows, picks, picked, strict=True):
            lps[row].append(lp)
            if tok == a.eos_idx:
                ended[row] = "eos"
            else:
                seqs[row].append(a.tokens[tok])
                next_tok[row] = tok
        if all(ended):
            break
        beat(f"{len(lps[rows[0]])} tokens into a batch of {B}")
        if ended.count("") != live:  # a row ended: its state stays as it is from now on
            live = ended.count("")
            pad = torch.tensor([bool(e) for e in ended], device=device)
        # The loop owns its states (a context's are never given to a step): in place.
        last, states = step(next_tok.to(device), positions, states, pad, inplace=True)
        last = last.float()
        positions = positions + 1
    return [
        Generated(i, seed, "".join(s), e, np.asarray(lp, dtype=np.float64))
        for i, s, e, lp in zip(indices, seqs, ended, lps, strict=True)
    ]


def iter_generate(
    loaded: LoadedModel,
    n: int,
    opts: SamplingOptions,
    prompt: str | Sequence[str] = "",
    seed: int = 0,
    batch_size: int = 8,
    context: FamilyContext | Sequence[FamilyContext] | None = None,
) -> Iterator[Generated]:
    """``n`` sequences in index order, ``batch_size`` at a time (memory: one batch), after a
    family ``context`` when given; several contexts (an ensemble's prompts): sequence ``i``
    after context ``i mod len(contexts)``, so the samples spread over the prompts.

    Arguments are checked here, before the first sequence is asked for.
    """
    loaded.config.require_causal(
        "generation",
        loaded.source,
        "; train one with `protein-performer train experiment=demo_clm` (the CPU demo)",
    )
    opts.validate()
    if n < 0:
        raise UserError(f"the number of sequences must be >= 0, got {n}")
    if batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, got {batch_size}")
    if seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed}")
    # One prompt for all stays one string: a list of n copies was a MemoryError for n = 1e15.
    prompts: str | list[str] = prompt if isinstance(prompt, str) else list(prompt)
    if not isinstance(prompts, str) and len(prompts) != n:
        raise UserError(f"got {len(prompts)} prompts for {n} sequences; give one or n")
    for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts):
        try:
            loaded.alphabet.encode(p)
        except ValueError as exc:
            raise UserError(f"prompt {i}: {exc}") from None
        if len(p) > opts.max_length:
            raise UserError(
                f"prompt {i} has {len(p)} residues, more than max_length={opts.max_length}"
            )
    return _batches(loaded, n, opts, prompts, seed, batch_size, context)


def _batches(
    loaded: LoadedModel,
    n: int,
    opts: SamplingOptions,
    prompts: str | list[str],
    seed: int,
    batch_size: int,
    context: FamilyContext | Sequence[FamilyContext] | None = None,
) -> Iterator[Generated]:
    contexts = list(context) if isinstance(context, Sequence) else [context]
    full = n // batch_size  # windows of batch_size rows (a shorter last one is alone)
    for start in range(0, n, batch_size):
        done: list[Generated] = []
        for k, ctx in enumerate(contexts):  # one batch per prompt, the window in index order
            idx = [i for i in range(start, min(n, start + batch_size)) if i % len(contexts) == k]
            if idx:  # the most tokens this batch size decodes in the run, for the compile
                steps = (full if len(idx) == batch_size else 1) * opts.max_length
                batch = [prompts if isinstance(prompts, str) else prompts[i] for i in idx]
                done += generate_batch(loaded, idx, batch, opts, seed, ctx, steps)
        yield from sorted(done, key=lambda g: g.index)
