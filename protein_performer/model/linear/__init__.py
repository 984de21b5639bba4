"""Attention cores beside FAVOR+ and exact softmax, for reading family context (issue 30).

- :mod:`.maps`: deterministic (Taylor, Based) and learned (Hedgehog) feature maps;
- :mod:`.core`: :class:`LinearAttention`, linear attention over such a map (chunked causal
  form with autograd, a constant-size recurrent state);
- :mod:`.memory`: :class:`PositionMemory`, a memory keyed by position within a family member,
  mixed into any core.
"""
