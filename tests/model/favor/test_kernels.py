"""model/favor/kernels.py: the random features are unbiased with the closed-form MSE
(check 1), FAVOR++'s statistic and coefficients, orthogonal features beat IID ones and the
error falls as features grow (checks 2-4 of docs/FAVOR.md), omega's draw, the kernel
registry.

Statistical tests are seeded and compare against the math with tolerances from the sample's
own standard errors (|mean - truth| < 5 SE; empirical MSE vs Lemma 2's closed forms within
5 SE of the MSE estimate). Heavier studies carry @pytest.mark.slow.
"""

from __future__ import annotations

import math

import pytest
import torch

from protein_performer.model.config import KERNELS as CONFIG_KERNELS
from protein_performer.model.exact import exact_attention
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
from tests.model.favor.common import gen, module, qkv


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


def test_omega_rows_orthogonal_within_blocks_and_chi_norms():
    om = draw_omega(40, 16, generator=gen(53)).double()
    block = om[:16] / om[:16].norm(dim=1, keepdim=True)
    assert torch.allclose(block @ block.T, torch.eye(16, dtype=torch.float64), atol=1e-5)
    fixed = draw_omega(40, 16, norm="fixed", generator=gen(54))
    assert torch.allclose(fixed.norm(dim=1), torch.full((40,), 4.0), atol=1e-4)
    # chi norms: E|w|^2 = d, sample of many rows within 5 SE.
    big = draw_omega(4000, 16, generator=gen(55)).double().pow(2).sum(1)
    assert abs(big.mean() - 16) < 5 * big.std() / math.sqrt(4000)


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
