"""The recurrent form of causal FAVOR+: a state of the keys seen so far, and the outputs of new
tokens after it, as functions of tensors (fla's ``fused_recurrent.py`` role; the parallel
chunked forms are :mod:`.scan` and :mod:`.triton_causal`).

The state is S = sum_j phi(k_j)[v_j | 1]^T exp(-mu), mu the running key stabilizer (the max
log-feature so far; 0 for relu). Every function here moves it by one rule, :func:`absorb`:
rescale S from the old mu to the new one and add the new keys' products, so a whole prompt, a
chunk of tokens and one token reach the same state the token-by-token recursion would.
:class:`~.module.FavorAttention` calls them from its one ``forward``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from protein_performer.model.favor.kernels import _NEG, FeatureMap, running_max, step_max
from protein_performer.model.favor.scan import safe_denominator


class FavorState(NamedTuple):
    """RNN-mode state of causal FAVOR attention.

    kv: (B, H, M, dv+1) sum over seen keys of phi(k_j)[v_j | 1]^T, scaled by exp(-mu);
    mu: (B, H) running key stabilizer (max log-feature so far; 0 for relu).
    """

    kv: Tensor
    mu: Tensor


def empty_state(heads: int, width: int, values: int, stabilized: bool, like: Tensor) -> FavorState:
    """The state before any key, batch 1 (broadcast over any batch): no sum, a stabilizer below
    every key's (0 without one); ``width`` M features, ``values`` dv + 1 columns."""
    mu = like.new_full((1, heads), _NEG if stabilized else 0.0)
    return FavorState(like.new_zeros(1, heads, width, values), mu)


def absorb(kv: Tensor | None, mu: Tensor | None, kf: Tensor, vx: Tensor, new_mu: Tensor) -> Tensor:
    """The sum after keys ``kf`` (..., L, M), relative to ``new_mu`` (...,), with values ``vx``
    = [v | 1] (..., L, C): the old sum ``kv`` (..., M, C) (None: no keys yet) rescaled from
    ``mu`` to ``new_mu`` (a factor <= 1), plus kf^T vx."""
    new = kf.mT @ vx
    if kv is None:
        return new
    return new + kv * torch.exp(mu - new_mu)[..., None, None]


def prompt_state(fmap: FeatureMap, y: Tensor, vv: Tensor, keep: Tensor | None) -> FavorState:
    """The state after a whole prompt in one parallel pass: unscaled keys y (BH, L, d), values
    vv (BH, L, dv), keep (BH, L) False at pads -> kv (BH, M, dv+1), mu (BH,).

    The stabilizer is the keys' largest log-feature (a max is order-free, so one max over all
    keys, not the running one), so this is the state the recursion reaches after the last key."""
    logits = fmap.key_logits(y, keep)
    top = step_max(logits)  # (BH, L): each key's largest log part; None for relu
    mu = y.new_zeros(y.shape[0]) if top is None else top.amax(-1).clamp_min(_NEG)  # (BH,)
    kf = fmap.keys(y, logits, mu[:, None, None], keep)  # (BH, L, M)
    vx = torch.cat([vv, vv.new_ones(*vv.shape[:-1], 1)], dim=-1)  # (BH, L, dv+1)
    return FavorState(absorb(None, None, kf, vx, mu), mu)


def chunked(
    fmap: FeatureMap,
    state: FavorState,
    x: Tensor,
    y: Tensor,
    vv: Tensor,
    keep: Tensor | None,
    chunk: int,
    keep_state: bool,
) -> tuple[Tensor, FavorState | None]:
    """Causal outputs (B, H, L, dv) of tokens x, y, vv (B, H, L, ·) after ``state`` (batch 1
    or B, never written) and, with ``keep_state``, the state after them; keep (B, H, L).

    Chunk by chunk: token t's sums are the state's term qf_t . S exp(mu_S - mu_t) plus the
    chunk's causal terms (qf_t . kf_j) exp(mu_j - mu_t), mu the running key max continued from
    the state's (no future information, every factor <= 1), normalized by the same sums of
    [v | 1]; the chunk is then absorbed into S for the next one.
    """
    B, H, L, _ = x.shape
    kv, mu = state.kv.to(x), state.mu.to(x)  # (B | 1, H, M, dv+1), (B | 1, H)
    outs = []
    for a in range(0, L, chunk):
        sl = slice(a, min(L, a + chunk))
        ys, ks = y[..., sl, :], None if keep is None else keep[..., sl]
        logits = fmap.key_logits(ys, ks)
        mu_t = running_max(logits, mu)  # (B, H, C): the max over the state and keys <= t
        if mu_t is None:  # relu: no stabilizer
            mu_t = mu[..., None].expand(B, H, ys.shape[-2])
        kf = fmap.keys(ys, logits, mu_t[..., None], ks)  # (B, H, C, M), relative to mu_t
        qf, _ = fmap.queries(x[..., sl, :])  # (B, H, C, M)
        vx = torch.cat([vv[..., sl, :], vv.new_ones(B, H, ys.shape[-2], 1)], dim=-1)
        decay = mu_t[..., None, :] - mu_t[..., :, None]  # (B, H, t, j): mu_j - mu_t
        tril = torch.ones_like(decay, dtype=torch.bool).tril_()
        w = (qf @ kf.mT) * decay.masked_fill_(~tril, float("-inf")).exp_()  # (B, H, C, C)
        num = (qf @ kv) * torch.exp(mu[..., None] - mu_t)[..., None]  # (B, H, C, dv+1)
        num = num + w @ vx
        outs.append(num[..., :-1] / safe_denominator(num[..., -1:]))
        if sl.stop < L or keep_state:  # absorb the chunk, relative to its last mu
            last = mu_t[..., -1]  # (B, H)
            kf = kf * torch.exp(mu_t - last[..., None])[..., None]
            kv = absorb(kv, mu, kf, vx, last)
            mu = last
    out = torch.cat(outs, dim=-2)  # (B, H, L, dv)
    if not keep_state:
        return out, None
    return out, FavorState(kv.expand(B, *kv.shape[1:]), mu.expand(B, H))


def _writable(kv: Tensor, B: int, dtype: torch.dtype, device, inplace: bool) -> bool:
    """Whether a step may update ``kv`` in place: the caller gave it up (``inplace``) and it is
    a plain (B, H, M, C) tensor in the compute dtype (not a batch-1 state broadcast over B)."""
    return (
        inplace
        and kv.shape[0] == B
        and kv.dtype == dtype
        and kv.device == device
        and kv.is_contiguous()
    )


def step(
    fmap: FeatureMap,
    state: FavorState,
    x: Tensor,
    y: Tensor,
    vv: Tensor,
    pad: Tensor | None,
    inplace: bool,
    host_checks: bool | None = None,
) -> tuple[Tensor, FavorState]:
    """One token per row after ``state``: x, y, vv (B, H, ·) in the compute dtype, pad (B,) True
    where the token is a pad (its state unchanged) -> out (B, H, dv) and the new state.

    The heads are rows of one map, so a token is a handful of ops. ``inplace``: the caller gives
    ``state`` up (a generator's loop), so its sum is updated in place when it can be
    (:func:`_writable`); otherwise the step writes a new one and ``state`` is left as it was.
    ``host_checks`` (default: on CPU) lets the exp kernels skip a pad mask or a rescale that
    changes nothing, after a look at the values; without them (a compiled graph, a GPU) the
    numbers are the same.
    """
    if host_checks is None:
        host_checks = x.device.type == "cpu"
    if fmap.exp and fmap.Wa.dim() == 2:
        return _exp_step(fmap, state, x, y, vv, pad, inplace, host_checks)
    B, H, _ = x.shape
    keep = None if pad is None else (~pad.bool())[:, None].expand(B, H)
    logits = fmap.key_logits(y, keep)
    top = step_max(logits)  # (B, H); None for relu (no stabilizer)
    old_mu = state.mu.to(x.dtype)
    mu = old_mu if top is None else torch.maximum(top, old_mu)
    kf = fmap.keys(y, logits, mu[..., None], keep)  # (B, H, M)
    vx = F.pad(vv, (0, 1), value=1.0)  # (B, H, dv+1): [v | 1]
    M, C = kf.shape[-1], vx.shape[-1]
    kf3, vx3 = kf.reshape(B * H, M, 1), vx.reshape(B * H, 1, C)
    kv = state.kv
    owned = _writable(kv, B, x.dtype, x.device, inplace)
    if not owned and (kv.dtype != x.dtype or kv.device != x.device):
        kv = kv.to(dtype=x.dtype, device=x.device)
    if top is not None:
        decay = torch.exp(old_mu - mu)[..., None, None]  # (B, H, 1, 1), <= 1
        kv = kv.mul_(decay) if owned else kv * decay
    elif not owned:
        kv = kv.clone()
    kv = kv.expand(B, H, M, C) if kv.shape[0] != B else kv
    if not kv.is_contiguous():
        kv = kv.contiguous()
    kv.view(B * H, M, C).baddbmm_(kf3, vx3)
    qf, _ = fmap.queries(x)  # (B, H, M)
    yq = (qf.reshape(B * H, 1, M) @ kv.view(B * H, M, C)).view(B, H, C)
    return yq[..., :-1] / safe_denominator(yq[..., -1:]), FavorState(kv, mu)


def _exp_step(
    fmap: FeatureMap,
    state: FavorState,
    x: Tensor,
    y: Tensor,
    vv: Tensor,
    pad: Tensor | None,
    inplace: bool,
    host_checks: bool,
) -> tuple[Tensor, FavorState]:
    """:func:`step` for the exp kernels (softmax, softmax_hyp, softmax_opt), written out: the
    same features and stabilizers as the map's methods in about half the ops (the row term
    folded into one add, one clamp as the normalizer's guard: exp features are never
    negative)."""
    B, H, _ = x.shape
    W = fmap.Wa.T  # (d, M)
    pk = torch.matmul(y, W)  # (B, H, M): key logits
    pq = torch.matmul(x, W)
    if fmap.bias is not None:
        pk += fmap.bias
        pq += fmap.bias
    row = torch.linalg.vecdot(y, y)[..., None]  # (B, H, 1): |k|^2
    pk.add_(row, alpha=-0.5 * fmap.t2)
    # On CPU a host check is cheap and saves whole passes; on a GPU it would be a sync.
    if pad is not None and (not host_checks or bool(pad.any())):
        pk.masked_fill_(pad.bool()[:, None, None], float("-inf"))
    old_mu = state.mu.to(x.dtype)
    mu = torch.maximum(pk.amax(-1), old_mu)  # (B, H): never below old_mu >= _NEG
    kf = pk.sub_(mu[..., None]).exp_()  # (B, H, M), pads 0
    # A new running max is rare after the first tokens: rescale the sum only then (a
    # factor exp(0) = 1 changes nothing, so skipping it gives the same numbers).
    rescale = not host_checks or bool((mu != old_mu).any())
    decay = (old_mu - mu).exp_()[..., None, None] if rescale else None  # (B, H, 1, 1)
    kv = state.kv
    if _writable(kv, B, x.dtype, x.device, inplace):
        if decay is not None:
            kv.mul_(decay)
    else:
        if kv.dtype != x.dtype or kv.device != x.device:
            kv = kv.to(dtype=x.dtype, device=x.device)
        kv = kv.clone() if decay is None else kv * decay
        kv = kv.expand(B, *kv.shape[1:]).contiguous()
    M, C = kv.shape[-2:]
    # + kf [v | 1]^T in place, no GEMM: the value columns, then the normalizer's (kf itself)
    kv[..., :-1].addcmul_(kf[..., None], vv[..., None, :])
    kv[..., -1].add_(kf)
    qf = pq.sub_(pq.amax(-1, keepdim=True)).exp_()  # (B, H, M), row max 1
    yq = torch.bmm(qf.view(B * H, 1, M), kv.view(B * H, M, C)).view(B, H, C)
    out = yq[..., :-1] / yq[..., -1:].clamp_min(torch.finfo(torch.float32).tiny)
    return out, FavorState(kv, mu)
