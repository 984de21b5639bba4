"""Deterministic and learned feature maps for the linear core (:mod:`.core`).

Why these two: FAVOR+'s random features estimate exp(q.k) with a variance that a few dozen
features cannot bring down where softmax is peaked, and a peaked attention is what copying from
a homolog needs (issue 30; Zoology, arXiv 2312.04927). Based (arXiv 2402.18668) replaces the
random draw by the 2nd-order Taylor series of exp, exact for small logits; Hedgehog (arXiv
2402.04347) learns a small map per head whose softmax over features gives the "spiky",
monotone weights random or ReLU maps lack. Both are positive kernels, so the normalizer of
linear attention never reaches 0 (Taylor: 1 + s + s^2/2 >= 1/2).

A map is an ``nn.Module`` from unscaled rows (B, H, L, d) to features (B, H, L, M); the
temperature d^-1/4 is applied inside, so phi(q).phi(k) approximates exp(q.k / sqrt(d)).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

#: kernel name -> its map class (``PerformerConfig.kernel`` with ``attention="linear"``).
LINEAR_MAPS: dict[str, type[LinearFeatureMap]] = {}


class LinearFeatureMap(nn.Module):
    """phi for the linear core; subclasses declared with ``name=`` register themselves."""

    name: ClassVar[str]

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            LINEAR_MAPS[name] = cls

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim

    @classmethod
    def feature_dim(cls, head_dim: int) -> int:
        """M, the width of phi, for heads of size d."""
        raise NotImplementedError


class Taylor(LinearFeatureMap, name="taylor"):
    """phi(x) = [1, x, x (x) x / sqrt 2] on x = z d^-1/4, the upper triangle only: phi(q).phi(k)
    = 1 + s + s^2 / 2 with s = q.k / sqrt(d), no random draw, M = 1 + d + d(d+1)/2."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        i, j = torch.triu_indices(head_dim, head_dim)
        scale = torch.where(i == j, 2**-0.5, 1.0)
        self.register_buffer("_i", i, persistent=False)
        self.register_buffer("_j", j, persistent=False)
        self.register_buffer("_scale", scale, persistent=False)

    @classmethod
    def feature_dim(cls, head_dim: int) -> int:
        return 1 + head_dim + head_dim * (head_dim + 1) // 2

    def forward(self, z: Tensor) -> Tensor:
        x = z * self.head_dim**-0.25
        second = x[..., self._i] * x[..., self._j] * self._scale.to(x.dtype)  # (..., L, d(d+1)/2)
        return torch.cat([torch.ones_like(x[..., :1]), x, second], dim=-1)


class Hedgehog(LinearFeatureMap, name="hedgehog"):
    """phi(x) = [softmax(x W_h + b_h), softmax(-(x W_h + b_h))] per head h on x = z d^-1/4,
    M = 2d. W starts as the identity, so the map starts as normalized exp features of the
    rows themselves, and training sharpens it (Hedgehog's learned, spiky map)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__(heads, head_dim)
        eye = torch.eye(head_dim).expand(heads, head_dim, head_dim).clone()
        self.weight = nn.Parameter(eye)  # (H, d, d)
        self.bias = nn.Parameter(torch.zeros(heads, 1, head_dim))  # (H, 1, d)

    @classmethod
    def feature_dim(cls, head_dim: int) -> int:
        return 2 * head_dim

    def forward(self, z: Tensor) -> Tensor:
        x = z * self.head_dim**-0.25
        proj = torch.matmul(x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)  # (B, H, L, d)
        return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], dim=-1)


def build_linear_map(kernel: str, heads: int, head_dim: int) -> LinearFeatureMap:
    """The map registered as ``kernel``; ValueError naming the registered ones."""
    if kernel not in LINEAR_MAPS:
        raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {tuple(LINEAR_MAPS)}")
    return LINEAR_MAPS[kernel](heads, head_dim)


__all__ = ["LINEAR_MAPS", "Hedgehog", "LinearFeatureMap", "Taylor", "build_linear_map"]
