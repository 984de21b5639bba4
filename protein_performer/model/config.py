"""The architecture as one dataclass, so a checkpoint can rebuild its model without Hydra.

Defaults describe ESM-2 8M (``esm2_t6_8M_UR50D``): 6 layers, dim 320, 20 heads, ffn 1280, the
ESM-2 vocabulary. Field names follow what a user tunes, not ESM's constructor arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from protein_performer.data.msa import FAMILY_COORDINATES
from protein_performer.errors import UserError

OBJECTIVES = ("mlm", "clm")
#: The registered attention cores' names (``model.cores.names()``, which validation asks),
#: written out so that the CLI's choices need no torch (tests keep them equal).
ATTENTIONS = ("favor", "exact", "linear")
#: Rotary position schemes: along the whole row, or restarting at each member's <cls>.
POSITIONS = ("sequence", "member")
# The FAVOR+ kernels a config may name: the names of protein_performer.model.favor.FEATURE_MAPS,
# written out so that validation and the CLI's choices need no torch (tests keep them equal).
KERNELS = ("softmax", "softmax_hyp", "trig", "relu", "softmax_opt")
# The linear core's feature maps (protein_performer.model.linear.maps.LINEAR_MAPS).
LINEAR_KERNELS = ("taylor", "hedgehog")


def default_nb_features(head_dim: int) -> int:
    """m = d ln d rounded up to a multiple of 16 (at least 16): Theta(d log d) random features.

    Why: theory asks for m = Theta(d log d), independent of L (docs/FAVOR.md; Choromanski
    et al. 2021); a fixed m = 256 is 16x the width of ESM-2 8M's 16-wide heads and makes the
    feature work dominate at protein lengths. 48 at d=16, 112 at d=32, 272 at d=64.
    """
    return max(16, math.ceil(head_dim * math.log(max(head_dim, 2)) / 16) * 16)


def block_number(layer: int, depth: int, *, lowest: int = 0, what: str = "layer") -> int:
    """ESM layer numbering -> a block number ``lowest..depth``: negative counts from the end
    (-1 = the last block), 0 is the embeddings (where ``lowest`` is 0). The one place the rule
    lives: embeddings, attention maps, contacts and the embeddings file's reader ask it."""
    j = layer + depth + 1 if layer < 0 else layer
    if not lowest <= j <= depth:
        raise UserError(
            f"{what} {layer} is out of range for a {depth}-layer model "
            f"(valid: {lowest}..{depth} or {-(depth + 1 - lowest)}..-1)"
        )
    return j


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The largest rotary base and LayerNorm epsilon a config may give (ESM-2: 10000 and 1e-5;
#: long-context models use bases up to about 1e7).
MAX_ROTARY_BASE = 1e9
MAX_LAYER_NORM_EPS = 0.1
#: The largest causal FAVOR+ chunk accepted (``favor_chunk_size``, or pinned for the tuner:
#: model/favor/tiles.py): a C x C product per head and chunk, so a chunk of 1e9 asked for
#: hundreds of GB.
MAX_CHUNK = 4096


@dataclass
class PerformerConfig:
    """Everything needed to rebuild a ``PerformerLM``; stored verbatim in checkpoints."""

    # Vocabulary size; 33 is ESM-2's alphabet (protein_performer.data.tokenizer.ESM2_TOKENS).
    vocab_size: int = 33
    # Index of <pad>: its embedding row is zero and padded positions are ignored by attention.
    pad_idx: int = 1
    # Index of <cls>, prepended to every sequence (ESM-2's BOS).
    cls_idx: int = 0
    # Index of <eos>, appended to every sequence.
    eos_idx: int = 2
    # Index of <mask>; used by token dropout (its embedding is zeroed when token_dropout is on).
    mask_idx: int = 32
    # Model width (embedding and residual stream size).
    dim: int = 320
    # Number of transformer blocks.
    depth: int = 6
    # Attention heads per block; dim // heads is the head size (must be even for rotary).
    heads: int = 20
    # Hidden size of the feed-forward network (ESM-2 uses 4 * dim).
    ff_dim: int = 1280
    # Dropout on the attention and feed-forward outputs before each residual add (ESM-2: 0).
    dropout: float = 0.0
    # "mlm" (bidirectional, masked LM) or "clm" (causal attention, next-token LM).
    objective: str = "mlm"
    # "favor" (FAVOR+ linear attention), "exact" (softmax via SDPA: baselines, ESM-2 import) or
    # "linear" (linear attention with a deterministic or learned map: kernel taylor or hedgehog).
    attention: str = "favor"
    # The feature map: for favor softmax, softmax_hyp, trig, relu or softmax_opt; for linear
    # taylor (Based's 2nd-order Taylor series of exp) or hedgehog (a learned map per head);
    # ignored for exact.
    kernel: str = "softmax"
    # Number of random features m per head; None = Theta(d log d) of the head size d (see
    # default_nb_features: 48 at ESM-2 8M's d=16, 272 at d=64). Resolved on construction, so a
    # checkpoint stores the number its features were drawn with.
    nb_features: int | None = None
    # Redraw the random features every N optimizer steps during training (0 = never). Read by the
    # training hook; stored here so a checkpoint records how its features were trained.
    feature_redraw_interval: int = 1000
    # Block size of the chunked causal FAVOR+ scan (None = tuned for the machine at first use:
    # model/favor/tiles.py).
    favor_chunk_size: int | None = None
    # Base of the rotary position embedding frequencies (ESM-2: 10000).
    rotary_base: float = 10000.0
    # Rotary positions: "member" (restart at 0 at every <cls>: each member of a family row sees
    # a lone sequence's positions, PoET-style; the better of the two on family rows,
    # docs/RESULTS.md) or "sequence" (0, 1, 2, ... along the whole row). A row with one <cls>
    # (a single protein, ESM-2's layout, a concatenated row) gets the same positions either
    # way. Context scoring continues what training used; configs written before this field
    # existed read as "sequence".
    positions: str = "member"
    # Tokens per training row of family context (the data's family_max_tokens), when known:
    # the default limit of a family context at inference. None: unknown (no limit).
    context_tokens: int | None = None
    # What a position memory keyed the homologs of its training rows by (data.family_coordinates,
    # set by train()): "positions" (member positions) or "aligned" (each member's alignment to
    # the family's first member). A model trained on "aligned" reads homologs without
    # coordinates worse than none, so a context without them is warned about (docs/RESULTS.md,
    # issue 41). Older configs: positions.
    family_coordinates: str = "positions"
    # Hybrid stacks: every N-th layer, counting down from the last, uses exact attention (its
    # KV cache grows with the context); 0 = every layer uses ``attention``.
    exact_every: int = 0
    # Member positions held by the position memory (model/linear/memory.py), mixed into every
    # layer's attention: the family context's homologs read by aligned position, in a state
    # of P x (2 head sizes + 1) per head, P the longest member held (at most this), whatever
    # the number of members. 0 = off. Training configs turn it on only for family rows
    # (data.layout=family): > 0 says the model has a memory, and context_tokens (set by
    # train() from data.family_max_tokens) that it was trained on family rows.
    position_memory: int = 0
    # W: the memory reads positions p - W .. p + W (a learned weight per offset and head).
    memory_window: int = 8
    # Whether the memory also reads a token's own member (its own keys up to t within W), as
    # models before 0.7 did (configs written before this field read as True). False: only the
    # other members (the earlier ones when causal), so a lone sequence reads nothing and gets
    # its core's output alone (its perplexity is FAVOR+'s; docs/RESULTS.md), and the read is
    # one band of products instead of two.
    memory_reads_own: bool = False
    # Linear attention only: the w nearest keys (t-w+1..t causal, within w-1 of t otherwise)
    # attend exactly, summed with the linear term under one normalizer (LoLCATs' sliding
    # window, model/linear/window.py); the state adds a ring of w keys. 0 = off.
    local_window: int = 0
    # LayerNorm epsilon (ESM-2 uses torch's default, 1e-5).
    layer_norm_eps: float = 1e-5
    # ESM-2's token dropout: zero <mask> embeddings and rescale by the observed mask ratio.
    # Must be True to reproduce pretrained ESM-2 outputs; False for models trained here.
    token_dropout: bool = False
    # Recompute each block's activations in backward (less memory, ~30% more compute).
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.nb_features is None and _is_int(self.dim) and _is_int(self.heads) and self.heads:
            self.nb_features = default_nb_features(self.dim // self.heads)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.heads

    @property
    def causal(self) -> bool:
        """Causal attention comes from the objective, not from a second switch."""
        return self.objective == "clm"

    def require_causal(self, what: str, source: object = "this model", then: str = "") -> None:
        """Refuse a masked LM where ``what`` (generation, a family context, decoding) reads
        left-to-right attention, in one wording: ``source`` names the model, ``then`` ends the
        line with why or what to do instead."""
        if not self.causal:
            raise UserError(
                f"{source} is a masked LM (objective mlm): {what} needs a causal model "
                f"(objective clm){then}"
            )

    def validate(self) -> PerformerConfig:
        """Raise ``UserError`` on the first inconsistent field; returns self for chaining."""

        def fail(msg: str) -> None:
            raise UserError(f"invalid model config: {msg}")

        # Types first, from each field's default: a config read from a file may say "0.1" or
        # "no", which must not become 0.1 or True (or a TypeError deep inside a comparison).
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), type(f.default)
            if f.default is None or f.default is dataclasses.MISSING:
                continue  # optional fields: checked one by one below
            if kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and math.isfinite(value)
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, kind)
            if not ok:
                want = {bool: "true or false", float: "a finite number", int: "an integer"}
                fail(f"{f.name} must be {want.get(kind, 'a ' + kind.__name__)}, got {value!r}")
        for name in ("vocab_size", "dim", "depth", "heads", "ff_dim", "nb_features"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(f"{name} must be a positive integer, got {value!r}")
        for name in ("pad_idx", "cls_idx", "eos_idx", "mask_idx"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                fail(f"{name}={value!r} is outside the vocabulary (size {self.vocab_size})")
        if self.dim % self.heads:
            fail(f"dim={self.dim} is not divisible by heads={self.heads}")
        if self.head_dim % 2:
            fail(
                f"head size dim/heads={self.head_dim} must be even for rotary embeddings; "
                "change dim or heads"
            )
        if self.objective not in OBJECTIVES:
            fail(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if not 0 <= self.exact_every <= self.depth:
            fail(f"exact_every must be in 0..depth={self.depth}, got {self.exact_every}")
        if self.position_memory < 0 or self.position_memory > 1 << 20:
            fail(f"position_memory must be in 0..{1 << 20} (0 = off), got {self.position_memory}")
        if not 0 <= self.memory_window <= 256:
            fail(f"memory_window must be in 0..256, got {self.memory_window}")
        if not 0 <= self.local_window <= 4096:
            fail(f"local_window must be in 0..4096 (0 = off), got {self.local_window}")
        if not 0.0 <= self.dropout < 1.0:
            fail(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.feature_redraw_interval, int) or self.feature_redraw_interval < 0:
            fail(
                "feature_redraw_interval must be a non-negative integer (0 = never), "
                f"got {self.feature_redraw_interval!r}"
            )
        chunk = self.favor_chunk_size
        if chunk is not None and not (_is_int(chunk) and 0 < chunk <= MAX_CHUNK):
            fail(f"favor_chunk_size must be an integer in 1..{MAX_CHUNK} or null, got {chunk!r}")
        if self.positions not in POSITIONS:
            fail(f"unknown positions {self.positions!r}; choose one of {', '.join(POSITIONS)}")
        if self.family_coordinates not in FAMILY_COORDINATES:
            fail(f"unknown family_coordinates {self.family_coordinates!r}; choose one of "
                 f"{', '.join(FAMILY_COORDINATES)}")  # fmt: skip
        if self.context_tokens is not None and (
            not _is_int(self.context_tokens) or self.context_tokens <= 0
        ):
            fail(f"context_tokens must be a positive integer or null, got {self.context_tokens!r}")
        # Beyond these the numbers mean nothing: frequencies that underflow to 0 (no positions),
        # a LayerNorm whose epsilon swamps the variance (every output about 0).
        if not 1.0 < self.rotary_base <= MAX_ROTARY_BASE:
            fail(f"rotary_base must be in (1, {MAX_ROTARY_BASE:g}], got {self.rotary_base!r}")
        if not 0.0 < self.layer_norm_eps <= MAX_LAYER_NORM_EPS:
            fail(
                f"layer_norm_eps must be in (0, {MAX_LAYER_NORM_EPS:g}], "
                f"got {self.layer_norm_eps!r}"
            )
        # What each core needs of the rest (its kernel, a wrapper's inner core, positions):
        # asked of the registered cores, the fields above checked first.
        from protein_performer.model.cores import config_problem

        problem = config_problem(self)
        if problem:
            fail(problem)
        return self

    def layer_attention(self, layer: int) -> str:
        """The attention of block ``layer`` (1-based): ``attention``, or exact in a hybrid
        stack's every ``exact_every``-th block from the last."""
        if self.exact_every and (self.depth - layer) % self.exact_every == 0:
            return "exact"
        return self.attention

    def estimated_numel(self) -> int:
        """Parameters and buffers the model will hold, from the config alone (no allocation):
        what a loader checks against the memory there is before building anything."""
        d, f, v, layers = self.dim, self.ff_dim, self.vocab_size, self.depth
        block = 4 * (d * d + d) + 2 * d * f + f + d + 4 * d
        from protein_performer.model.cores import extra_numel

        return v * d + layers * block + extra_numel(self) + (d * d + d) + 4 * d + v

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of builtins (JSON/YAML-safe), the form checkpoints store."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerformerConfig:
        """Build and validate; unknown keys are an error so a typo never falls back to a default.

        Missing keys take their defaults, so checkpoints written before a field existed still load
        (and compute as they did: ``positions`` then reads as "sequence", ``memory_reads_own``
        as True).
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(
                f"unknown model config key(s): {', '.join(unknown)}; "
                f"valid keys are: {', '.join(sorted(known))}"
            )
        old = {"positions": "sequence", "memory_reads_own": True}
        return cls(**{**old, **dict(data)}).validate()
