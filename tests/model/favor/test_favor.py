"""Tests for the FAVOR attention core: the nine checks of docs/FAVOR.md and the API contract.

Statistical tests are seeded and compare against the math with tolerances from the sample's own
standard errors (|mean - truth| < 5 SE; empirical MSE vs Lemma 2's closed forms within 5 SE of
the MSE estimate). Heavier studies carry @pytest.mark.slow.
"""

from __future__ import annotations

import math

import pytest
import torch

from protein_performer.model.config import KERNELS as CONFIG_KERNELS
from protein_performer.model.exact import exact_attention, exact_attention_map
from protein_performer.model.favor import (
    FEATURE_MAPS,
    KERNELS,
    FavorAttention,
    draw_omega,
    favor_attention,
    favor_attention_reference,
    oprf_coefficients,
    oprf_rho,
    random_features,
)
from protein_performer.model.favor import kernels as favor_kernels


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv(B=2, H=2, L=40, d=8, seed=0, scale=1.0, dtype=torch.float64):
    g = gen(seed)
    return tuple(torch.randn(B, H, L, d, generator=g, dtype=dtype) * scale for _ in range(3))


def module(kernel="softmax", causal=False, d=8, m=16, seed=1, **kw) -> FavorAttention:
    attn = FavorAttention(d, m, causal=causal, kernel=kernel, generator=gen(seed), **kw).double()
    if kernel == "softmax_opt" and causal:
        attn.oprf_rho.fill_(0.3)
    return attn.eval()


def per_draw_estimates(x, y, d, m, draws, kernel, seed, orthogonal=False, rho=None):
    """`draws` independent estimates of the kernel at (x, y), each with m omega rows."""
    g = gen(seed)
    est = []
    for _ in range(draws):
        om = draw_omega(m, d, orthogonal=orthogonal, generator=g).double()
        fx = random_features(x[None], om, kernel, rho=rho)[0]
        fy = random_features(y[None], om, kernel, rho=rho)[0]
        est.append(fx @ fy)
    return torch.stack(est)


def batched_estimates(x, y, d, m, draws, kernel, seed, rho=None):
    """Same as per_draw_estimates with IID omega, vectorized: one (draws*m, d) draw."""
    om = torch.randn(draws * m, d, generator=gen(seed), dtype=torch.float64)
    fx = random_features(x[None], om, kernel, rho=rho)[0]
    fy = random_features(y[None], om, kernel, rho=rho)[0]
    width = 2 * m if kernel in ("softmax_hyp", "trig") else m
    prod = fx * fy  # scaled for draws*m rows: rescale each group of m to its own estimate
    if kernel in ("softmax_hyp", "trig"):
        prod = torch.stack([prod[: draws * m], prod[draws * m :]], dim=-1).reshape(-1)
        prod = prod.reshape(draws, m, 2).reshape(draws, width)
    return prod.reshape(draws, width).sum(-1) * draws


def pair(d, norm_x, norm_y, cos, seed):
    """x, y with given norms and cosine (already temperature-scaled)."""
    g = gen(seed)
    a = torch.randn(d, generator=g, dtype=torch.float64)
    a = a / a.norm()
    b = torch.randn(d, generator=g, dtype=torch.float64)
    b = b - (b @ a) * a
    b = b / b.norm()
    return norm_x * a, norm_y * (cos * a + math.sqrt(1 - cos**2) * b)


def check_mean_and_mse(est, truth, mse_closed):
    n = est.numel()
    err = est - truth
    se_mean = est.std() / math.sqrt(n)
    assert abs(est.mean() - truth) < 5 * se_mean, (float(est.mean()), truth, float(se_mean))
    sq = err.pow(2)
    mse, se_mse = sq.mean(), sq.std() / math.sqrt(n)
    assert abs(mse - mse_closed) < 5 * se_mse, (float(mse), mse_closed, float(se_mse))
    return float(mse), float(se_mse)


# --------------------------------------------------------------------------- check 1: kernel


@pytest.mark.parametrize("cos", [0.8, -0.5])
def test_positive_features_unbiased_with_lemma2_mse(cos):
    d, m, draws = 16, 8, 20000
    x, y = pair(d, 0.6, 0.5, cos, seed=3)
    est = batched_estimates(x, y, d, m, draws, "softmax", seed=4)
    sm = math.exp(float(x @ y))
    z2 = float((x + y).pow(2).sum())
    mse_pos = math.exp(z2) * sm**2 * (1 - math.exp(-z2)) / m
    check_mean_and_mse(est, sm, mse_pos)
    assert bool((random_features(x[None], torch.randn(5, d, dtype=torch.float64)) > 0).all())


@pytest.mark.parametrize("cos", [0.8, -0.5])
def test_trig_features_unbiased_with_lemma2_mse(cos):
    d, m, draws = 16, 8, 20000
    x, y = pair(d, 0.6, 0.5, cos, seed=5)
    est = batched_estimates(x, y, d, m, draws, "trig", seed=6)
    sm = math.exp(float(x @ y))
    z2 = float((x + y).pow(2).sum())
    delta2 = float((x - y).pow(2).sum())
    mse_trig = math.exp(z2) * sm**-2 * (1 - math.exp(-delta2)) ** 2 / (2 * m)
    check_mean_and_mse(est, sm, mse_trig)


def test_hyperbolic_unbiased_and_beats_plain_with_twice_the_features():
    d, m, draws = 16, 8, 20000
    x, y = pair(d, 0.7, 0.7, 0.5, seed=7)
    sm = math.exp(float(x @ y))
    hyp = batched_estimates(x, y, d, m, draws, "softmax_hyp", seed=8)
    plain = batched_estimates(x, y, d, 2 * m, draws, "softmax", seed=9)
    z2 = float((x + y).pow(2).sum())
    check_mean_and_mse(plain, sm, math.exp(z2) * sm**2 * (1 - math.exp(-z2)) / (2 * m))
    se = hyp.std() / math.sqrt(draws)
    assert abs(hyp.mean() - sm) < 5 * se
    e_h, e_p = (hyp - sm).pow(2), (plain - sm).pow(2)
    se_diff = math.sqrt(e_h.var() / draws + e_p.var() / draws)
    assert e_h.mean() < e_p.mean() - 3 * se_diff


def test_iid_loop_and_vectorized_estimates_agree_in_distribution():
    """The vectorized estimator used above is the same estimator as drawing omega per trial."""
    d, m = 8, 4
    x, y = pair(d, 0.5, 0.5, 0.3, seed=10)
    loop = per_draw_estimates(x, y, d, m, 3000, "softmax", seed=11)
    vec = batched_estimates(x, y, d, m, 3000, "softmax", seed=12)
    se = math.sqrt(loop.var() / 3000 + vec.var() / 3000)
    assert abs(loop.mean() - vec.mean()) < 5 * se
    assert 0.8 < float(loop.var() / vec.var()) < 1.25


# --------------------------------------------------------------------------- FAVOR++ (OPRF)


def test_oprf_coefficients_minimise_the_averaged_second_moment():
    d = 16
    for rho in (0.0, 0.1, 0.5, 2.0):
        a, b, log_d = (
            float(t) for t in oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d)
        )
        assert a <= 0.0 and abs(b**2 - (1 - 4 * a)) < 1e-12
        assert abs(log_d - d / 4 * math.log(1 - 4 * a)) < 1e-9

        def objective(aa, rho=rho):  # log E[f(x)^2 f(y)^2] averaged over pairs, up to consts
            return (
                d * math.log(1 - 4 * aa)
                - d / 2 * math.log(1 - 8 * aa)
                + 2 * (1 - 4 * aa) / (1 - 8 * aa) * rho * d
            )

        grid = [a + delta for delta in (-1e-3, 1e-3, -0.05, 0.05) if a + delta < 0.12]
        assert all(objective(a) <= objective(g) + 1e-12 for g in grid)
    assert (
        float(oprf_coefficients(torch.tensor(0.0, dtype=torch.float64), d)[0]) == 0.0
    )  # plain FAVOR+ at rho = 0


def test_oprf_rho_matches_pairwise_definition_and_ignores_pads():
    g = gen(13)
    x, y = torch.randn(2, 7, 5, generator=g, dtype=torch.float64).unbind(0)
    pairs = (x[:, None, :] + y[None, :, :]).pow(2).sum(-1).mean() / 5
    assert torch.allclose(oprf_rho(x, y), pairs)
    keep = torch.tensor([True] * 5 + [False] * 2)
    x2 = x.clone()
    x2[5:] = 1e3
    assert torch.allclose(oprf_rho(x2, y, keep, keep), oprf_rho(x[:5], y[:5]))


def oprf_variance(x, y, rho, m):
    d = x.numel()
    a, b, log_d = (float(t) for t in oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d))
    nx, ny, z2 = float(x @ x), float(y @ y), float((x + y) @ (x + y))
    second = math.exp(
        4 * log_d - nx - ny - d / 2 * math.log(1 - 8 * a) + 2 * b**2 * z2 / (1 - 8 * a)
    )
    return (second - math.exp(2 * float(x @ y))) / m


def test_oprf_unbiased_with_closed_form_mse_and_lower_variance_than_positive():
    """OPRF must be unbiased and beat positive features when ||x + y|| is not small.

    At |x| = |y| = 1.2, x orthogonal to y (rho = 0.18) the closed forms give a variance ratio
    of 0.50; larger norms help more but make the positive estimator too heavy-tailed to test.
    """
    d, m, draws = 16, 8, 20000
    x, y = pair(d, 1.2, 1.2, 0.0, seed=14)
    rho = float((x + y).pow(2).sum()) / d  # the single-pair statistic
    sm = math.exp(float(x @ y))
    opt = batched_estimates(x, y, d, m, draws, "softmax_opt", seed=15, rho=rho)
    pos = batched_estimates(x, y, d, m, draws, "softmax", seed=16)
    mse_opt, se_opt = check_mean_and_mse(opt, sm, oprf_variance(x, y, rho, m))
    z2 = float((x + y).pow(2).sum())
    mse_pos, _ = check_mean_and_mse(pos, sm, math.exp(z2) * sm**2 * (1 - math.exp(-z2)) / m)
    assert oprf_variance(x, y, rho, m) < 0.55 * oprf_variance(x, y, 0.0, m)  # closed forms
    assert mse_opt + 5 * se_opt < mse_pos


def test_oprf_beats_positive_at_attention_level_where_the_closed_form_predicts_it():
    """Attention-level FAVOR++ gain, d = 16, m = 64, L = 256, normalized q, k, logit std 0.5.

    Per-head rho = 0.25 (A = -0.098); averaged over query-key pairs the closed forms predict an
    OPRF kernel variance 0.17x the positive one. Paired design: each omega draw is used by both
    kernels, so the SE is that of the 40 per-draw MSE differences (measured margin ~8 SE, asked
    3). At logit std >= 1 the sample comparison flips (see :func:`oprf_coefficients`): the
    positive estimator's mean error is then carried by rare draws that 40 seeds never see.
    """
    d, m = 16, 64
    q, k, v = normalized_qkv(256, d, seed=18, logit_scale=0.5)
    x, y = q[0, 0] * d**-0.25, k[0, 0] * d**-0.25
    rho = float(oprf_rho(x, y))
    z2 = (x[:, None] + y[None]).pow(2).sum(-1)  # (L, L)
    nx, ny = x.pow(2).sum(-1)[:, None], y.pow(2).sum(-1)[None]
    a, b, log_d = (float(t) for t in oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d))
    kern2 = torch.exp(2 * x @ y.T)
    var_pos = torch.exp(2 * z2 - nx - ny) - kern2  # m = 1, Lemma 2 / FAVOR++ closed forms
    second = 4 * log_d - nx - ny - d / 2 * math.log(1 - 8 * a) + 2 * b**2 * z2 / (1 - 8 * a)
    var_opt = torch.exp(second) - kern2
    assert float(var_opt.mean() / var_pos.mean()) < 0.25
    ref = exact_attention(q, k, v)
    diffs = []
    for seed in range(3000, 3040):
        om = draw_omega(m, d, generator=gen(seed)).double()
        e_pos = (favor_attention(q, k, v, om, kernel="softmax") - ref).pow(2).mean()
        e_opt = (favor_attention(q, k, v, om, kernel="softmax_opt") - ref).pow(2).mean()
        diffs.append(float(e_pos - e_opt))
    diff = torch.tensor(diffs, dtype=torch.float64)
    se = float(diff.std()) / math.sqrt(diff.numel())
    assert float(diff.mean()) > 3 * se, (float(diff.mean()), se)


# --------------------------------------------------------------------------- checks 2-4


def attention_mse(q, k, v, ref, m, seeds, orthogonal=True, kernel="softmax"):
    d = q.shape[-1]
    out = []
    for seed in seeds:
        om = draw_omega(m, d, orthogonal=orthogonal, generator=gen(seed)).double()
        out.append(float((favor_attention(q, k, v, om, kernel=kernel) - ref).pow(2).mean()))
    return torch.tensor(out, dtype=torch.float64)


def normalized_qkv(L, d, seed, logit_scale=1.0):
    q, k, v = qkv(1, 1, L, d, seed=seed)
    q = q / q.norm(dim=-1, keepdim=True) * d**0.5 * logit_scale**0.5
    k = k / k.norm(dim=-1, keepdim=True) * d**0.5 * logit_scale**0.5
    return q, k, v


def block_estimates(x, y, d, m, draws, orthogonal, seed):
    """`draws` independent kernel estimates with m omega rows each, from one omega draw.

    draw_omega stacks independent d x d orthogonal blocks, so with m a multiple of d each group
    of m consecutive rows is exactly an m-row ORF draw (or IID rows when orthogonal=False).
    """
    om = draw_omega(draws * m, d, orthogonal=orthogonal, generator=gen(seed)).double()
    fx = random_features(x[None], om, "softmax")[0]  # (draws*m,), scaled by 1/sqrt(draws*m)
    fy = random_features(y[None], om, "softmax")[0]
    return (fx * fy).view(draws, m).sum(-1) * draws  # each group rescaled to 1/m


@pytest.mark.parametrize("m", [16, 32])
def test_orthogonal_features_beat_iid_kernel_level(m):
    """Check 2 at kernel level: m = d and m = 2d, small-norm x, y, 10k draws per method.

    ORF and IID samples are independent, so the SE of the MSE difference is
    sqrt(var(e_orf^2)/n + var(e_iid^2)/n). Expected margin here: ~8 SE (measured with other
    seeds); the test asks for 3.
    """
    d, draws = 16, 10000
    x, y = pair(d, 0.5, 0.5, 0.5, seed=3)
    sm = math.exp(float(x @ y))
    orf = block_estimates(x, y, d, m, draws, True, seed=60 + m)
    iid = block_estimates(x, y, d, m, draws, False, seed=70 + m)
    for est in (orf, iid):  # both unbiased
        assert abs(float(est.mean()) - sm) < 5 * float(est.std()) / math.sqrt(draws)
    e_o, e_i = (orf - sm).pow(2), (iid - sm).pow(2)
    se = math.sqrt(float(e_o.var() + e_i.var()) / draws)
    assert float(e_o.mean()) < float(e_i.mean()) - 3 * se, (float(e_o.mean()), float(e_i.mean()))


def test_orthogonal_features_beat_iid_attention_level():
    """Check 2 at attention level, m >= d (d = 16, m = 16, 32, 64), Fig. 4-style inputs.

    Normalized q, k with logit std 0.25, L = 256, 100 independent omega draws per method; the
    per-draw output MSEs are independent, so the SE of the difference of means is
    sqrt(var_orf/100 + var_iid/100). Measured margins 4-5.5 SE; the test asks for 2.5.
    (At m < d, or with larger logits, the ORF gain is smaller than the heavy-tailed MSE's
    noise at affordable draw counts: that is why the earlier m = 4..16 test was inconclusive.)
    """
    q, k, v = normalized_qkv(256, 16, seed=18, logit_scale=0.25)
    ref = exact_attention(q, k, v)
    for m in (16, 32, 64):
        orf = attention_mse(q, k, v, ref, m, range(1000, 1100), orthogonal=True)
        iid = attention_mse(q, k, v, ref, m, range(2000, 2100), orthogonal=False)
        se = math.sqrt(float(orf.var() / orf.numel() + iid.var() / iid.numel()))
        assert float(orf.mean()) < float(iid.mean()) - 2.5 * se, (m, float(orf.mean()), se)


def test_positive_beats_trig_where_the_kernel_is_small():
    """Fig. 2 regime: x^T y << 0. Kernel level (closed forms and sample) and attention level."""
    d, m, draws = 16, 8, 20000
    x, y = pair(d, 1.0, 1.0, -0.9, seed=19)
    sm = math.exp(float(x @ y))
    z2, delta2 = float((x + y).pow(2).sum()), float((x - y).pow(2).sum())
    mse_pos = math.exp(z2) * sm**2 * (1 - math.exp(-z2)) / m
    mse_trig = math.exp(z2) * sm**-2 * (1 - math.exp(-delta2)) ** 2 / (2 * m)
    assert mse_pos < 0.05 * mse_trig
    pos = batched_estimates(x, y, d, m, draws, "softmax", seed=20)
    trig = batched_estimates(x, y, d, m, draws, "trig", seed=21)
    check_mean_and_mse(pos, sm, mse_pos)
    check_mean_and_mse(trig, sm, mse_trig)
    # Attention with mostly small kernel values (anti-aligned queries and keys).
    q, k, v = normalized_qkv(128, 16, seed=22, logit_scale=2.0)
    k = -k + 0.3 * torch.randn(k.shape, generator=gen(23), dtype=torch.float64)
    ref = exact_attention(q, k, v)
    e_pos = attention_mse(q, k, v, ref, 64, range(400, 408), kernel="softmax")
    e_trig = attention_mse(q, k, v, ref, 32, range(400, 408), kernel="trig")  # 64 features too
    assert e_pos.mean() < e_trig.mean()


def convergence(L, d, ms, seeds):
    q, k, v = normalized_qkv(L, d, seed=24, logit_scale=0.25)
    ref = exact_attention(q, k, v)
    return [float(attention_mse(q, k, v, ref, m, seeds).mean()) for m in ms]


def test_error_falls_as_features_grow():
    errs = convergence(512, 16, [16, 64, 256], range(500, 504))
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.25 * errs[0]  # ~1/16 in theory (MSE ~ 1/m)


@pytest.mark.slow
def test_error_falls_as_features_grow_paper_setup():
    """The paper's Fig. 4 setup: L = 4096, d = 16; MSE should shrink roughly like 1/m."""
    errs = convergence(4096, 16, [16, 32, 64, 128, 256], range(600, 610))
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False))
    assert errs[-1] < 0.25 * errs[0]


# --------------------------------------------------------------------------- check 5: rows


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_rows_sum_to_one_and_attention_map_matches_forward(kernel, causal):
    B, H, L, d = 1, 2, 24, 8
    q, k, v = qkv(B, H, L, d, seed=25)
    attn = module(kernel, causal, d=d, chunk_size=5, block_size=7)
    eye = torch.eye(L, dtype=torch.float64).expand(B, H, L, L)
    implied = attn(q, k, eye)[0]  # (B, H, L, L): row t = attention weights of query t
    assert torch.allclose(implied.sum(-1), torch.ones(B, H, L, dtype=torch.float64), atol=1e-9)
    if causal:
        assert float(implied.triu(1).abs().max()) < 1e-12
    amap = attn.attention_map(q, k, query_slice=slice(3, 17))
    assert amap.shape == (B, H, 14, L)
    assert torch.allclose(amap.sum(-1), torch.ones(B, H, 14, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(amap, implied[:, :, 3:17], atol=1e-9)
    assert torch.allclose(amap @ v, attn(q, k, v)[0][:, :, 3:17], atol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_attention_map_matches_exact_attention(causal):
    q, k, v = qkv(2, 2, 20, 8, seed=26)
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[1, 15:] = True
    amap = exact_attention_map(q, k, causal=causal, key_padding_mask=pad, query_slice=slice(2, 9))
    ref = exact_attention(q, k, v, causal=causal, key_padding_mask=pad)
    assert torch.allclose(amap.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
    assert torch.allclose(amap @ v, ref[:, :, 2:9], atol=1e-10)


# --------------------------------------------------------------------------- check 6: causality


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_appending_future_tokens_leaves_past_outputs_unchanged(kernel, chunk):
    q, k, v = qkv(2, 2, 30, 8, seed=27)
    attn = module(kernel, True, chunk_size=chunk)
    before = attn(q, k, v)[0]
    extra = qkv(2, 2, 11, 8, seed=28, scale=6.0)  # large-norm future keys test the stabilizer
    after = attn(*(torch.cat([a, b], dim=2) for a, b in zip((q, k, v), extra, strict=True)))[0]
    assert torch.allclose(after[:, :, :30], before, rtol=1e-9, atol=1e-12)


def test_future_keys_do_not_move_past_gradients():
    q, k, v = qkv(1, 2, 20, 8, seed=29)
    attn = module("softmax", True, chunk_size=6)
    k2 = k.clone().requires_grad_()
    k_long = torch.cat([k2, 5 * torch.randn(1, 2, 9, 8, dtype=torch.float64)], dim=2)
    q_long = torch.cat([q, torch.randn(1, 2, 9, 8, dtype=torch.float64)], dim=2)
    v_long = torch.cat([v, torch.randn(1, 2, 9, 8, dtype=torch.float64)], dim=2)
    attn(q_long, k_long, v_long)[0][:, :, :20].sum().backward()
    k1 = k.clone().requires_grad_()
    attn(q, k1, v)[0].sum().backward()
    assert torch.allclose(k2.grad, k1.grad, atol=1e-10)


# --------------------------------------------------------------------------- check 7: padding


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(kernel, causal):
    B, H, L, d, extra = 2, 2, 12, 8, 9
    q, k, v = qkv(B, H, L, d, seed=30)
    attn = module(kernel, causal, d=d, chunk_size=5, block_size=8)
    garbage = qkv(B, H, extra, d, seed=31, scale=20.0)  # huge values must not matter
    padded = [torch.cat([a, b], dim=2) for a, b in zip((q, k, v), garbage, strict=True)]
    mask = torch.zeros(B, L + extra, dtype=torch.bool)
    mask[:, L:] = True
    # Sequence 1 is shorter: its own pads in the middle of the unpadded length too.
    mask[1, 8:] = True
    out = attn(*padded, key_padding_mask=mask)[0]
    ref0 = attn(q[:1], k[:1], v[:1])[0]
    ref1 = attn(q[1:, :, :8], k[1:, :, :8], v[1:, :, :8])[0]
    assert torch.allclose(out[:1, :, :L], ref0, atol=1e-10)
    assert torch.allclose(out[1:, :, :8], ref1, atol=1e-10)
    assert torch.isfinite(out).all()
    ex = exact_attention(*padded, causal=causal, key_padding_mask=mask)
    assert torch.allclose(ex[:1, :, :L], exact_attention(q[:1], k[:1], v[:1], causal=causal))


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padding_causal_is_finite_and_invariant(kernel):
    """Rows before the first real key see no key: 0 out, like exact attention (a stabilizer
    once clamped the key row term in place, giving trig's leading pads features)."""
    q, k, v = qkv(1, 1, 10, 8, seed=32)
    attn = module(kernel, True, chunk_size=4)
    pads = qkv(1, 1, 6, 8, seed=33, scale=10.0)
    padded = [torch.cat([b, a], dim=2) for a, b in zip((q, k, v), pads, strict=True)]
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[:, :6] = True
    out = attn(*padded, key_padding_mask=mask)[0]
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, :, 6:], attn(q, k, v)[0], atol=1e-10)
    assert float(out[:, :, :6].abs().max()) == 0.0
    ex = exact_attention(*padded, causal=True, key_padding_mask=mask)
    assert torch.isfinite(ex).all() and float(ex[:, :, :6].abs().max()) == 0.0


# --------------------------------------------------------------------------- check 8: chunks


def dense_reference(q, k, v, omega, kernel, causal, rho=None):
    """phi(Q) phi(K)^T masked and normalized, from the unstabilized public feature map."""
    d = q.shape[-1]
    x, y = q * d**-0.25, k * d**-0.25
    kw = {} if rho is None else {"rho": rho}
    a = random_features(x, omega, kernel, **kw) @ random_features(y, omega, kernel, **kw).mT
    if causal:
        a = a.tril()
    return (a @ v) / a.sum(-1, keepdim=True)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk", [1, 3, 8, 17, 64])
def test_chunked_causal_equals_dense_reference_values_and_grads(kernel, chunk):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 8, seed=34, scale=0.8))
    attn = module(kernel, True, chunk_size=chunk)
    attn.chunk_size = chunk
    rho = 0.3 if kernel == "softmax_opt" else None
    ref = dense_reference(q, k, v, attn.omega, kernel, True, rho)
    out = attn(q, k, v)[0]
    tol = 1e-6 if kernel == "trig" else 1e-9
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
    w = torch.randn(out.shape, generator=gen(35), dtype=torch.float64)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt"])
def test_causal_exp_features_per_segment_equal_dense_reference(kernel):
    """Heads cut into many segments, whose features are computed per segment (fwd and bwd).

    The key stabilizer is a running max that continues across segment boundaries: key norms
    grow along the sequence so it keeps rising. L is not a multiple of the chunk and one sequence
    has pads in the middle. Values and float64 gradients match the dense reference over the real
    keys, and appending large-norm future tokens leaves every past output unchanged.
    """
    B, H, L, d = 2, 2, 45, 8
    q, k, v = qkv(B, H, L, d, seed=60, scale=0.8)
    k = k * torch.linspace(0.3, 2.0, L, dtype=torch.float64)[:, None]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 17:21] = True
    omega = draw_omega(16, d, generator=gen(61), dtype=torch.float64)
    rho = 0.3 if kernel == "softmax_opt" else None
    kw = dict(kernel=kernel, causal=True, oprf_rho=rho, chunk_size=4, segment_size=8)
    out = favor_attention(q, k, v, omega, key_padding_mask=pad, **kw)  # 6 segments per head
    fkw = {} if rho is None else {"rho": rho}
    qf, kf = (random_features(t * d**-0.25, omega, kernel, **fkw) for t in (q, k))
    a = (qf @ kf.mT).tril() * ~pad[:, None, None, :]
    ref = (a @ v) / a.sum(-1, keepdim=True)
    assert torch.allclose(out, ref, rtol=1e-9, atol=1e-9)
    w = torch.randn(out.shape, generator=gen(62), dtype=torch.float64)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(g_out, g_ref, strict=True):
        assert torch.allclose(got, want, rtol=1e-7, atol=1e-7)
    extra = qkv(B, H, 11, d, seed=63, scale=6.0)
    longer = [torch.cat([a.detach(), b], dim=2) for a, b in zip((q, k, v), extra, strict=True)]
    pad_long = torch.cat([pad, torch.zeros(B, 11, dtype=torch.bool)], dim=1)
    after = favor_attention(*longer, omega, key_padding_mask=pad_long, **kw)
    assert torch.allclose(after[:, :, :L], out.detach(), rtol=1e-9, atol=1e-12)


def test_causal_exp_stabilizer_carries_across_segments_at_extreme_logits():
    """An early key whose log-feature is far beyond float32's exp range sets the running max mu.

    Later segments must continue that max (a restarted one would rescale the carried state by
    exp(mu_before - mu) = overflow). float32 output and gradients stay finite and match float64.
    """
    B, H, L, d, m = 1, 2, 40, 16, 32
    omega = draw_omega(m, d, generator=gen(64), dtype=torch.float64)
    rho = 20.0
    b = float(oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d)[1])
    q, k, v = qkv(B, H, L, d, seed=65)
    k[:, :, 3] = b * omega[omega.norm(dim=-1).argmax()] * d**0.25  # maximizes its log-feature
    logf = random_features(k * d**-0.25, omega, "softmax_opt", rho=rho).log()
    assert float(logf[:, :, 3].max() - logf[:, :, 8:].amax(-1).max()) > 100  # the premise
    kw = dict(kernel="softmax_opt", causal=True, oprf_rho=rho, chunk_size=4, segment_size=8)
    outs, grads = [], []
    for dtype in (torch.float32, torch.float64):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = favor_attention(*inputs, omega.to(dtype), **kw)
        grads.append(torch.autograd.grad(out.pow(2).sum(), inputs))
        outs.append(out.double())
    assert torch.isfinite(outs[0]).all() and all(torch.isfinite(g).all() for g in grads[0])
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "relu"])
def test_bidirectional_equals_dense_reference_values_and_grads(kernel):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 8, seed=36, scale=0.8))
    attn = module(kernel, False, block_size=10)
    ref = dense_reference(q, k, v, attn.omega, kernel, False)
    out = attn(q, k, v)[0]
    assert torch.allclose(out, ref, atol=1e-10)
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-8)


def test_softmax_opt_bidirectional_uses_per_head_statistics():
    q, k, v = qkv(1, 2, 30, 8, seed=37)
    attn = module("softmax_opt", False)
    rho = oprf_rho(q * 8**-0.25, k * 8**-0.25)  # (1, 2)
    out = attn(q, k, v)[0]
    for h in range(2):
        ref = dense_reference(
            q[:, h], k[:, h], v[:, h], attn.omega, "softmax_opt", False, rho[0, h]
        )
        assert torch.allclose(out[:, h], ref, atol=1e-10)


def test_softmax_opt_bidirectional_grads_equal_dense_reference():
    """The fused backward treats rho as a constant: equal to the dense map at that fixed rho."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 8, seed=36, scale=0.8))
    attn = module("softmax_opt", False, block_size=10)
    rho = oprf_rho(q.detach() * 8**-0.25, k.detach() * 8**-0.25)[0]  # (H,)
    om = attn.omega
    heads = [
        dense_reference(q[:, h], k[:, h], v[:, h], om, "softmax_opt", False, rho[h])
        for h in range(2)
    ]
    ref = torch.stack(heads, dim=1)
    out = attn(q, k, v)[0]
    assert torch.allclose(out, ref, atol=1e-10)
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_paths_equal_the_reference(kernel, causal, padded, dtype):
    """Every kernel x causal x padding x dtype: the fused path (custom backward, key blocks,
    scan chunks and segments, features recomputed in backward) gives the plain-autograd
    reference's values and gradients. float32 tolerances: a few hundred ulps of the outputs'
    scale (sums of 23 terms, features through exp); trig's signed features cancel, x10."""
    B, H, L, d = 2, 2, 23, 8
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(B, H, L, d, seed=50, scale=1.2))
    om = draw_omega(16, d, generator=gen(51)).to(dtype)
    mask = None
    if padded:
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[1, 15:] = True
        mask[0, 3] = True
    rho = 0.3 if kernel == "softmax_opt" and causal else None
    kw = dict(kernel=kernel, causal=causal, key_padding_mask=mask, oprf_rho=rho)
    out = favor_attention(q, k, v, om, block_size=6, chunk_size=4, segment_size=8, **kw)
    ref = favor_attention_reference(q, k, v, om, **kw)
    w = torch.randn(out.shape, generator=gen(52), dtype=torch.float64).to(dtype)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    if dtype == torch.float64:
        tol = 1e-7 if kernel == "trig" else 1e-10
    else:
        tol = 3e-4 if kernel == "trig" else 3e-5
    assert out.dtype == dtype and torch.allclose(out, ref, rtol=tol, atol=tol)
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bidirectional_head_tiles_equal_the_reference(kernel, monkeypatch):
    """A small L2 cache makes the fused bidirectional path split heads into tiles (and rows into
    blocks): values and gradients still equal the reference's, per-head FAVOR++ included."""
    import protein_performer.model.favor.bidirectional as favor

    # Caches for 64 rows of M=16 float64 features over all threads.
    monkeypatch.setattr(favor, "_l2_bytes", lambda: 2 * 16 * 8 * 64 // torch.get_num_threads())
    B, H, L, d = 2, 3, 100, 8
    q, k, v = (t.requires_grad_() for t in qkv(B, H, L, d, seed=55, scale=1.2))
    om = draw_omega(16, d, generator=gen(56)).double()
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 71:] = True
    kw = dict(kernel=kernel, key_padding_mask=mask)
    assert favor._tile(B * H, L, 16, 2048, q) == (1, 64)  # 6 tiles of 1 head, 2 row blocks
    out = favor_attention(q, k, v, om, **kw)
    ref = favor_attention_reference(q, k, v, om, **kw)
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
    g_out = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=tol * 100, atol=tol * 100)


def test_reference_carries_gradients_to_omega_and_favor_attention_uses_it():
    """omega (or rho) needing gradients takes the reference path, whose values match."""
    q, k, v = qkv(1, 2, 15, 8, seed=53)
    om = draw_omega(16, 8, generator=gen(54)).double()
    for causal in (False, True):
        fused = favor_attention(q, k, v, om, causal=causal)
        omg = om.clone().requires_grad_()
        out = favor_attention(q, k, v, omg, causal=causal)
        assert torch.allclose(out, fused, atol=1e-10)
        (grad,) = torch.autograd.grad(out.pow(2).sum(), omg)
        assert torch.isfinite(grad).all() and float(grad.abs().max()) > 0


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt"])
def test_bidirectional_exp_backward_gradcheck_with_padding(kernel):
    """float64 gradcheck of _BidiExpFavor's backward: pads, several blocks, a fully padded row."""
    g = gen(53)
    q, k, v = (
        (torch.randn(3, 2, 11, 4, generator=g, dtype=torch.float64) * 1.2).requires_grad_()
        for _ in range(3)
    )
    om = draw_omega(6, 4, generator=gen(54)).double()
    mask = torch.zeros(3, 11, dtype=torch.bool)
    mask[0, 7:] = True
    mask[1, [0, 4, 5]] = True
    mask[2, :] = True  # no real key: output 0, gradient 0
    rho = 0.3 if kernel == "softmax_opt" else None

    def fn(a, b, c):
        return favor_attention(
            a, b, c, om, kernel=kernel, key_padding_mask=mask, oprf_rho=rho, block_size=4
        )

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=False)


@pytest.mark.parametrize("chunk,segment", [(1, 3), (4, 8), (5, 100)])
@pytest.mark.parametrize("jumpy", [False, True])
def test_causal_backward_gradcheck(chunk, segment, jumpy):
    """float64 gradcheck of the fused causal backward, segments and chunks of several sizes.

    jumpy: one key's log-feature is far above every earlier one (FAVOR++ at a large statistic),
    so the running stabilizer rises by more than the factorized intra-chunk weights allow and
    the scan takes the exact-decay path (forward and backward).
    """
    d, m, L = 4, 6, 13
    omega = draw_omega(m, d, generator=gen(38), dtype=torch.float64)
    g = gen(39)
    q, k, v = (torch.randn(1, 1, L, d, generator=g, dtype=torch.float64) for _ in range(3))
    rho = 40.0 if jumpy else 0.3
    if jumpy:
        b = float(oprf_coefficients(torch.tensor(rho, dtype=torch.float64), d)[1])
        k[:, :, 6] = b * omega[omega.norm(dim=-1).argmax()] * d**0.25
        logf = random_features(k * d**-0.25, omega, "softmax_opt", rho=rho).log()
        assert float(logf[:, :, 6].max() - logf[:, :, :6].amax(-1).max()) > 60  # the premise

    def fn(a, b, c):
        kw = dict(kernel="softmax_opt", causal=True, oprf_rho=rho)
        return favor_attention(a, b, c, omega, chunk_size=chunk, segment_size=segment, **kw)

    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


# --------------------------------------------------------------------------- RNN mode


def steps(attn, q, k, v, mask, state=None, start=0, inplace=False):
    """Token-by-token forwards from ``state`` (None: the first token is a one-token prefill)
    -> the outputs (B, H, L - start, dv) and the last state."""
    outs = []
    for t in range(start, q.shape[2]):
        sl = slice(t, t + 1)
        o, state = attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, sl], state,
                        keep_state=True, inplace=inplace)  # fmt: skip
        outs.append(o)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_step_equals_parallel_causal(kernel, inplace):
    B, H, L, d = 2, 2, 19, 8
    q, k, v = qkv(B, H, L, d, seed=40)
    attn = module(kernel, True, chunk_size=4)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 12:] = True
    par = attn(q, k, v, key_padding_mask=mask)[0]
    seq, state = steps(attn, q, k, v, mask, inplace=inplace)
    assert state.kv.shape == (B, H, attn.feature_dim, d + 1)
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(seq, par, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("P", [9, 17])
def test_prefill_then_steps_and_extend_equal_parallel(kernel, P):
    """A prompt's state from one forward (a short prompt through the recurrent chunks, a long
    one, P > recurrent_chunk, through the scan and one parallel pass over its keys), then
    token steps or one extend: the parallel forward's outputs and the step-by-step state
    (generation's prefill + decode), padded rows included; extend never writes the state."""
    B, H, L, d = 2, 2, 25, 8
    q, k, v = qkv(B, H, L, d, seed=43)
    attn = module(kernel, True, chunk_size=12)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 6:P] = True  # row 1: a shorter prompt, right-padded up to P
    par = attn(q, k, v, key_padding_mask=mask)[0]
    head, state = attn(q[:, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P], keep_state=True)
    _, stepped = steps(attn, q[:, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P])
    tol = 1e-7 if kernel == "trig" else 1e-10
    assert torch.allclose(head, par[:, :, :P], rtol=tol, atol=tol)
    assert torch.allclose(
        state.kv * torch.exp(state.mu)[..., None, None],
        stepped.kv * torch.exp(stepped.mu)[..., None, None],
        rtol=tol,
        atol=0,
    )
    kv = state.kv.clone()
    rest = (q[:, :, P:], k[:, :, P:], v[:, :, P:], mask[:, P:])
    tail, none = attn(*rest, state)
    assert none is None and torch.equal(state.kv, kv)
    assert torch.allclose(tail, par[:, :, P:], rtol=tol, atol=tol)
    outs, _ = steps(attn, q, k, v, mask, state, start=P)
    assert torch.allclose(outs, par[:, :, P:], rtol=tol, atol=tol)


def test_a_state_needs_a_causal_core():
    attn = module("softmax", False)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        attn(q, q, q, keep_state=True)


# --------------------------------------------------------------------------- check 9: numerics


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_is_finite(causal):
    L = 65536
    g = gen(41)
    q, k, v = (torch.randn(1, 1, L, 8, generator=g).requires_grad_() for _ in range(3))
    attn = FavorAttention(8, 16, causal=causal, generator=gen(42))
    out = attn(q, k, v)[0]
    assert out.shape == (1, 1, L, 8) and torch.isfinite(out).all()
    out.pow(2).mean().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyp", "softmax_opt", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_large_norm_inputs_under_bf16_autocast_are_finite(kernel, causal):
    """Outputs and gradients stay finite far beyond exp's range (causal: the row rescaling).

    In training mode softmax_opt's running rho grows to ~20 after the first call, which scales
    the logits up further (B = sqrt(1 - 4A) ~ 4): the hardest case for the causal backward.
    """
    attn = FavorAttention(16, 32, causal=causal, kernel=kernel, generator=gen(44), chunk_size=64)
    for scale in (30.0, 10.0):  # |x|^2 ~ 3600 and ~ 400: logits far beyond exp's range
        q, k, v = qkv(1, 2, 300, 16, seed=43, scale=scale, dtype=torch.float32)
        q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attn(q, k, v)[0]
        assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
        out.float().sum().backward()
        assert all(torch.isfinite(t.grad.float()).all() for t in (q, k, v)), scale


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast_computes_features_in_float32(causal):
    """With bf16 inputs, the only error left is the final cast (relative 2^-8)."""
    q, k, v = (t.bfloat16() for t in qkv(1, 2, 64, 16, seed=45, scale=1.5, dtype=torch.float32))
    attn = FavorAttention(16, 64, causal=causal, generator=gen(46))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = attn(q, k, v)[0]
    ref = attn(q.float(), k.float(), v.float())[0]
    assert low.dtype == torch.bfloat16
    err = (low.float() - ref).abs()
    assert bool((err <= 2**-8 * ref.abs() + 1e-6).all()), float(err.max())


# --------------------------------------------------------------------------- API and omega


def test_shapes_exact_attention_and_accuracy_at_large_m():
    q, k, v = qkv(2, 3, 50, 16, seed=47, scale=0.5)
    for causal in (False, True):
        ref = exact_attention(q, k, v, causal=causal)
        manual = (
            torch.softmax(
                (q @ k.mT / 4).masked_fill(
                    causal & ~torch.ones(50, 50, dtype=torch.bool).tril(), float("-inf")
                ),
                -1,
            )
            @ v
        )
        assert torch.allclose(ref, manual, atol=1e-10)
        attn = module("softmax_hyp", causal, d=16, m=2048)
        out = attn(q, k, v)[0]
        assert out.shape == (2, 3, 50, 16)
        rel = (out - ref).norm() / ref.norm()
        base = (v.mean(-2, keepdim=True).expand_as(ref) - ref).norm() / ref.norm()
        assert rel < 0.25 * base


def test_redraw_changes_omega_reproducibly_and_lives_in_state_dict():
    attn = FavorAttention(8, 24, generator=gen(48))
    first = attn.omega.clone()
    attn.redraw(gen(49))
    assert not torch.equal(first, attn.omega)
    other = FavorAttention(8, 24, generator=gen(50))
    other.redraw(gen(49))
    assert torch.equal(other.omega, attn.omega)
    sd = attn.state_dict()
    assert "omega" in sd and sd["omega"].shape == (24, 8)
    fresh = FavorAttention(8, 24, generator=gen(51))
    fresh.load_state_dict(sd)
    q, k, v = qkv(1, 1, 10, 8, seed=52, dtype=torch.float32)
    assert torch.equal(fresh(q, k, v)[0], attn(q, k, v)[0])


def test_omega_rows_orthogonal_within_blocks_and_chi_norms():
    om = draw_omega(40, 16, generator=gen(53)).double()
    block = om[:16] / om[:16].norm(dim=1, keepdim=True)
    assert torch.allclose(block @ block.T, torch.eye(16, dtype=torch.float64), atol=1e-5)
    fixed = draw_omega(40, 16, norm="fixed", generator=gen(54))
    assert torch.allclose(fixed.norm(dim=1), torch.full((40,), 4.0), atol=1e-4)
    # chi norms: E|w|^2 = d, sample of many rows within 5 SE.
    big = draw_omega(4000, 16, generator=gen(55)).double().pow(2).sum(1)
    assert abs(big.mean() - 16) < 5 * big.std() / math.sqrt(4000)


def test_causal_softmax_opt_statistic_is_fixed_and_updated_only_in_training():
    attn = FavorAttention(8, 16, causal=True, kernel="softmax_opt", generator=gen(56))
    q, k, v = qkv(1, 1, 12, 8, seed=57, dtype=torch.float32)
    attn.eval()
    attn(q, k, v)
    assert float(attn.oprf_rho) == 0.0
    attn.train()
    attn(q, k, v)
    assert float(attn.oprf_rho) > 0.0
    with pytest.raises(ValueError):
        favor_attention(q, k, v, attn.omega, kernel="softmax_opt", causal=True)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_oprf_rho_updates_once_per_step_under_activation_checkpointing(use_reentrant):
    """The checkpoint replay of the forward (inside backward) must not update rho again."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 12, 8, seed=58, dtype=torch.float32))
    rhos = []
    for ckpt in (False, True):
        attn = FavorAttention(8, 16, causal=True, kernel="softmax_opt", generator=gen(59)).train()

        def block(q, k, v, attn=attn):  # an op after attention makes the replay run through it
            return attn(q, k, v)[0].exp()

        for _ in range(2):  # two training steps
            out = (
                checkpoint(block, q, k, v, use_reentrant=use_reentrant) if ckpt else block(q, k, v)
            )
            out.sum().backward()
        rhos.append(float(attn.oprf_rho))
    assert rhos[0] > 0.0 and rhos[1] == rhos[0]


def test_model_with_gradient_checkpointing_updates_oprf_rho_once_per_step():
    from protein_performer.model.config import PerformerConfig
    from protein_performer.model.performer import PerformerLM

    tokens = torch.randint(4, 24, (2, 12), generator=gen(60))
    rhos = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = PerformerConfig(
            dim=32,
            depth=2,
            heads=4,
            ff_dim=64,
            nb_features=16,
            objective="clm",
            kernel="softmax_opt",
            gradient_checkpointing=ckpt,
        )
        model = PerformerLM(cfg).train()
        model(tokens).logits.logsumexp(-1).sum().backward()
        rhos.append([float(layer.self_attn.favor.oprf_rho) for layer in model.layers])
    assert all(r > 0 for r in rhos[0]) and rhos[1] == rhos[0]


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError):
        FavorAttention(8, 16, kernel="gaussian")


def test_config_names_the_registered_kernels():
    assert set(KERNELS) == set(CONFIG_KERNELS) == set(FEATURE_MAPS)


def test_a_kernel_class_is_picked_up_by_its_name(monkeypatch):
    """Adding a kernel is one class: declared with a name, every path runs it by that name."""
    monkeypatch.setattr(favor_kernels, "FEATURE_MAPS", dict(FEATURE_MAPS))

    class DampedSoftmax(favor_kernels.Softmax, name="test_damped"):
        """Positive features of a halved projection (a test map, not a softmax estimator)."""

        @classmethod
        def projection(cls, omega, t, rho):
            return omega * (t / 2), None

    assert favor_kernels.kernel_class("test_damped") is DampedSoftmax
    assert "test_damped" not in FEATURE_MAPS
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 19, 8, seed=70))
    for causal in (False, True):
        attn = module("test_damped", causal, chunk_size=4, block_size=5)
        assert attn.feature_dim == 16
        out = attn(q, k, v)[0]
        kw = dict(kernel="test_damped", causal=causal)
        ref = favor_attention_reference(q, k, v, attn.omega, **kw)
        plain = favor_attention(q, k, v, attn.omega, kernel="softmax", causal=causal)
        assert torch.allclose(out, ref, atol=1e-10) and not torch.allclose(out, plain)
        g_out = torch.autograd.grad(out.sum(), (q, k, v))
        g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
        for a, b in zip(g_out, g_ref, strict=True):
            assert torch.allclose(a, b, atol=1e-9)
        assert torch.allclose(attn.attention_map(q, k) @ v, out, atol=1e-10)
