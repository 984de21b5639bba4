"""The Performer protein LM: ESM-2's architecture with a swappable attention core.

With ``attention="exact"`` this is ESM-2 (same module names, same order of operations, same
token-dropout and padding handling), so ESM-2 weights load by renaming alone; with
``attention="favor"`` the same weights run in linear time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from protein_performer.errors import UserError
from protein_performer.model.attention import AttentionState, Positions
from protein_performer.model.config import PerformerConfig, block_number
from protein_performer.model.cores import AttentionCore
from protein_performer.model.heads import LMHead
from protein_performer.model.layers import TransformerLayer
from protein_performer.model.rotary import member_positions

#: ESM-2's training mask rate times its <mask> share (15% selected, 80% of them -> <mask>).
MASK_RATIO_TRAIN = 0.15 * 0.8


@dataclass
class PerformerOutput:
    """What ``PerformerLM.forward`` returns.

    ``hidden_states`` follows ESM's ``representations``: key 0 is the embedding output, key i the
    output of block i, and the last block's entry is taken after the final LayerNorm.
    ``attentions`` maps a block number (1-based, as in ``hidden_states``) to (B, H', T, T), rows
    and columns of padded positions zeroed as ESM-2 does; None when no layer was requested.
    ``state``: one attention state per layer after the tokens (``keep_state``), else None.
    """

    logits: torch.Tensor  # (B, T, V)
    hidden_states: dict[int, torch.Tensor]  # layer -> (B, T, D)
    attentions: dict[int, torch.Tensor] | None = None  # layer -> (B, H', T, T)
    state: list[AttentionState] | None = None


class PerformerLM(nn.Module):
    """Token embedding, rotary pre-LN blocks, final norm, tied LM head."""

    def __init__(self, config: PerformerConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, padding_idx=config.pad_idx)
        layers = range(1, config.depth + 1)
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in layers)
        self.emb_layer_norm_after = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.lm_head = LMHead(
            config.dim, config.vocab_size, self.embed_tokens.weight, eps=config.layer_norm_eps
        )
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT/HF-ESM init (N(0, 0.02), zero biases): with tied weights, N(0, 1) embeddings would
        start the logits at a huge scale."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def _resolve_layers(self, layers: Sequence[int], lowest: int, what: str) -> set[int]:
        """ESM-style indices (negative from the end, -1 = last block) -> block numbers."""
        return {block_number(i, self.config.depth, lowest=lowest, what=what) for i in layers}

    def rotary_positions(self, tokens: torch.Tensor, offset: int | torch.Tensor = 0) -> Positions:
        """The rotary positions of tokens (B, L) whose first token sits at row position
        ``offset`` (an int, or a (B,) tensor: each row's): None for a row of its own in
        "sequence" mode (the fast path, today's numbers), the offset when continuing a row,
        per-token positions (B, L) restarting at every ``<cls>`` in "member" mode (``offset``
        then applies before the first ``<cls>``)."""
        if self.config.positions == "member":
            cls = self.config.cls_idx
            if isinstance(offset, torch.Tensor):
                return member_positions(tokens, cls, offset[:, None])
            if not bool((tokens[:, 1:] == cls).any()):  # one protein a row: the fast path
                first = tokens[:, 0] == cls
                if bool(first.all()) or (offset == 0 and not bool(first.any())):
                    return None
            return member_positions(tokens, cls, offset)
        if isinstance(offset, torch.Tensor):
            return offset
        return offset or None

    def embed(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with ESM-2's token dropout and zeroed padding, (B, T) -> (B, T, D);
        ``padding_mask`` None: no pads (the same numbers as an all-False mask, fewer ops)."""
        x = self.embed_tokens(tokens)
        if self.config.token_dropout:
            is_mask = tokens == self.config.mask_idx  # (B, T)
            if bool(is_mask.any()):
                x = x.masked_fill(is_mask[..., None], 0.0)
                src_lengths = (
                    tokens.shape[-1]
                    if padding_mask is None
                    else (~padding_mask).sum(-1).clamp_min(1)  # an all-pad row: 0, not nan
                )
                mask_ratio_observed = is_mask.sum(-1).to(x.dtype) / src_lengths
                x = x * (1 - MASK_RATIO_TRAIN) / (1 - mask_ratio_observed)[:, None, None]
            else:  # no <mask>: the rule's observed ratio is 0, the same product in fewer ops
                x = x * (1 - MASK_RATIO_TRAIN)
        if padding_mask is None:
            return x
        return x * (1 - padding_mask.unsqueeze(-1).type_as(x))

    def forward(
        self,
        tokens: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        repr_layers: Sequence[int] = (),
        attention_layers: Sequence[int] = (),
        attention_heads: Sequence[int] | None = None,
        state: Sequence[AttentionState] | None = None,
        *,
        offset: int | torch.Tensor = 0,
        keep_state: bool = False,
        inplace: bool = False,
        coordinates: torch.Tensor | None = None,
    ) -> PerformerOutput:
        """``tokens`` (B, T) -> logits (B, T, V) plus the requested hidden states and maps.

        ``padding_mask`` (B, T) True = pad; derived from ``tokens == pad_idx`` when None.
        ``repr_layers`` take 0..depth (0 = embeddings) or negative indices (-1 = last);
        ``attention_layers`` take 1..depth or negative indices; ``attention_heads`` selects heads
        (all when None).

        RNN mode (a causal model, as transformers' ``past_key_values``): ``state`` (per layer,
        batch 1 broadcast over B, or B) continues a row whose tokens so far put ``tokens`` at
        row position ``offset`` (an int, or a (B,) tensor: each row's); ``keep_state`` returns
        the states after the tokens in ``.state``. Prefill is a call from no state with
        ``keep_state``; extend one from a state; a decoding step one of a single token per row
        (padded rows leave their states unchanged). ``state`` is never written unless
        ``inplace``: the caller gives it up and uses only the returned one (a generator's loop),
        so buffers are updated in place (FAVOR+: the sum; exact: the KV cache grown into spare
        room). Equals the causal forward of the whole row, up to float rounding.

        ``coordinates`` (B, T) long: aligned coordinates, the position a position memory keys
        each token by instead of its member position (a family context's homologs placed on
        a reference: ``inference.context``; -1: a token that enters no position); None: the
        member positions. Rotary always uses the member (or row) positions.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, length), got shape {tuple(tokens.shape)}")
        if state is not None or keep_state:
            self.config.require_causal("token-by-token decoding")
        if padding_mask is None:
            padding_mask = tokens.eq(self.config.pad_idx)
        padding_mask = padding_mask.to(device=tokens.device, dtype=torch.bool)
        want_hidden = self._resolve_layers(repr_layers, 0, "repr layer")
        want_attn = self._resolve_layers(attention_layers, 1, "attention layer")
        if attention_heads is not None:
            bad = [h for h in attention_heads if not 0 <= h < self.config.heads]
            if bad:
                raise UserError(
                    f"attention head(s) {bad} out of range for {self.config.heads} heads "
                    f"(valid: 0..{self.config.heads - 1})"
                )

        # As ESM-2: an all-False mask is dropped so the attention core can take its fast path.
        attn_mask = padding_mask if padding_mask.any() else None
        x = self.embed(tokens, attn_mask)  # (B, T, D)
        positions = self.rotary_positions(tokens, offset)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in want_hidden:
            hidden[0] = x
        maps: dict[int, torch.Tensor] = {}
        depth = len(self.layers)
        states = [None] * depth if state is None else list(state)
        new_states: list[AttentionState] = []
        for i, (layer, layer_state) in enumerate(zip(self.layers, states, strict=True), start=1):
            x, weights, layer_state = layer(
                x,
                attn_mask,
                need_weights=i in want_attn,
                heads=attention_heads,
                positions=positions,
                state=layer_state,
                keep_state=keep_state,
                inplace=inplace,
                coordinates=coordinates,
            )
            new_states.append(layer_state)
            if weights is not None:
                maps[i] = weights
            if i in want_hidden and i != depth:
                hidden[i] = x
        x = self.emb_layer_norm_after(x)
        if depth in want_hidden:
            hidden[depth] = x
        logits = self.lm_head(x)

        attentions = None
        if want_attn:
            keep = (~padding_mask).to(logits.dtype)  # (B, T)
            outer = (keep[:, :, None] * keep[:, None, :])[:, None]  # (B, 1, T, T)
            attentions = {i: maps[i] * outer.to(maps[i].dtype) for i in sorted(maps)}
        return PerformerOutput(
            logits=logits,
            hidden_states=hidden,
            attentions=attentions,
            state=new_states if keep_state else None,
        )

    @torch.no_grad()
    def prefill(
        self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[AttentionState]]:
        """Prompts (B, T), right-padded -> logits (B, T, V) and the per-layer states after
        them: :meth:`forward` from no state, keeping it."""
        out = self(tokens, padding_mask, keep_state=True)
        return out.logits, out.state  # type: ignore[return-value]

    @torch.no_grad()
    def extend(
        self,
        tokens: torch.Tensor,
        states: Sequence[AttentionState] | None,
        offset: int = 0,
        padding_mask: torch.Tensor | None = None,
        return_states: bool = False,
        coordinates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[AttentionState] | None]:
        """Tokens (B, L), right-padded, continuing rows from ``states`` that hold ``offset``
        tokens -> logits (B, L, V) and, if ``return_states``, the states after the tokens:
        :meth:`forward` from a state, which it never writes.

        Why: a family context is read once into states; every candidate then costs its own
        tokens alone (FAVOR+: a fixed-size state; exact: its KV cache), one context serving
        any number of candidates. ``coordinates``: see :meth:`forward` (a context's homologs).
        """
        self.config.require_causal("token-by-token decoding")
        out = self(tokens, padding_mask, state=states, offset=offset, keep_state=return_states,
                   coordinates=coordinates)  # fmt: skip
        return out.logits, out.state

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        states: Sequence[AttentionState],
        pad: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, list[AttentionState]]:
        """One new token per row, tokens (B,) at positions (B,) -> logits (B, V), new states:
        :meth:`forward` of one token.

        Constant time and memory per token with FAVOR+. Rows with ``pad`` True (finished
        sequences) leave their states unchanged; their logits are meaningless. ``inplace``:
        the caller gives ``states`` up and uses only the returned ones (a generator's loop).
        """
        mask = None if pad is None else pad[:, None]
        out = self(tokens[:, None], mask, state=states, offset=positions, keep_state=True,
                   inplace=inplace)  # fmt: skip
        return out.logits[:, 0], out.state  # type: ignore[return-value]

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Redraw every FAVOR+ layer's random features, layer by layer from one generator.

        Seeding the generator identically on every rank gives every rank the same features
        without a broadcast. A no-op for exact attention.
        """
        for layer in self.layers:
            layer.self_attn.core.redraw(generator=generator)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameter count, the tied embedding/decoder matrix counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW groups: decay only on matrix weights of Linear layers; norms, biases, the
        (tied) embedding and what a core declares a gate or logit (the position memory's
        offsets and gate, :attr:`AttentionCore.no_decay`) are excluded, since shrinking them
        towards 0 only hurts."""
        no_decay_ids: set[int] = set()
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.Embedding)):
                no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
            if isinstance(module, AttentionCore):
                no_decay_ids.update(id(p) for name, p in module.named_parameters(recurse=False)
                                    if name in module.no_decay)  # fmt: skip
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in no_decay_ids or name.endswith("bias") or p.ndim < 2:
                no_decay.append(p)
            else:
                decay.append(p)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
