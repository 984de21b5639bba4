"""Tests for the Triton causal kernels (protein_performer/model/favor/triton_causal.py).

No GPU here: the kernels run on CPU tensors under Triton's interpreter. Triton reads
``TRITON_INTERPRET=1`` when a function is decorated, its own library included, so the variable
is set before triton is first imported (here, at collection) and again while these tests run;
if something imported triton earlier in this process, the file reruns in a fresh one. Every
kernel family the fused torch path serves, with padding, against the reference (float64) and
the torch path (float32): values and gradients within 1e-4. Shapes stay tiny: the interpreter
runs each program's loop in Python.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from protein_performer.errors import UserError
from protein_performer.model.favor import (
    KERNELS,
    FavorAttention,
    draw_omega,
    favor_attention,
    favor_attention_reference,
)
from protein_performer.model.favor import module as favor_module
from protein_performer.model.favor.kernels import build_feature_map, flatten_heads
from tests.paths import REPO


def _import_triton_interpreted():
    """Import triton, with TRITON_INTERPRET=1 when this is its first import (the variable is
    restored after); whether its library runs under the interpreter."""
    first = "triton" not in sys.modules
    old = os.environ.get("TRITON_INTERPRET")
    if first:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
    finally:
        _restore(old)
    return type(triton.language.standard.cdiv).__name__ == "InterpretedFunction"


def _restore(old: str | None) -> None:
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


INTERPRETED = _import_triton_interpreted()
MODULE = "protein_performer.model.favor.triton_causal"
TOL = 1e-4


@pytest.fixture(scope="module")
def tc():
    """The kernels module, decorated under the interpreter (the variable stays set while the
    module's tests run: the interpreter reads it at launch too)."""
    if not INTERPRETED:
        pytest.skip("triton was imported without the interpreter: see test_in_a_fresh_process")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mod = importlib.import_module(MODULE)
        if type(mod._fwd_kernel).__name__ != "InterpretedFunction":
            mod = importlib.reload(mod)
        yield mod
    finally:
        _restore(old)


def test_in_a_fresh_process():
    """Where triton was imported before this file without the interpreter, the file's tests
    run in a fresh process instead (with the variable set from the start)."""
    if INTERPRETED:
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(B=2, H=1, L=37, d=8, dv=None, seed=0, scale=0.6):
    g = gen(seed)
    q, k = (torch.randn(B, H, L, d, generator=g) * scale for _ in range(2))
    v = torch.randn(B, H, L, dv or d, generator=g)
    return q, k, v


def padding(B: int, L: int) -> torch.Tensor:
    """Leading pads (rows that see no real key), pads in the middle and at the end."""
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :3] = True
    mask[-1, L // 2 : L // 2 + 4] = True
    mask[-1, -2:] = True
    return mask


def run_triton(tc, q, k, v, omega, kernel, mask, **kw):
    """The Triton path on (B, H, L, d) inputs, as favor_attention flattens them."""
    B, H, L, _ = q.shape
    rho = 0.3 if kernel == "softmax_opt" else None
    x, y, vv, keep = flatten_heads(q, k, v, mask)
    fmap = build_feature_map(kernel, omega, True, rho, x, y, keep, 1e-3)
    return tc.causal_favor_triton(x, y, vv, fmap, keep, **kw).reshape(B, H, L, -1)


def values_and_grads(fn, q, k, v, w):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return out.detach(), torch.autograd.grad((out * w.to(out.dtype)).sum(), (q, k, v))


def assert_close(got, want, rows=None):
    err = (got.double() - want.double()).abs()
    if rows is not None:
        err = err * rows[..., None]
    assert float(err.max()) <= TOL, float(err.max())


@pytest.mark.parametrize("kernel", KERNELS)
def test_values_and_grads_equal_the_reference_and_the_torch_path(tc, kernel):
    """L not a multiple of the chunk, two segments per head (the carried states), two feature
    blocks (softmax_hyp's 2m, trig's sin and cos), padding everywhere."""
    B, H, L, d, m = 2, 1, 37, 8, 16
    q, k, v = inputs(B, H, L, d, seed=1)
    omega = draw_omega(m, d, generator=gen(2))
    mask = padding(B, L)
    rho = 0.3 if kernel == "softmax_opt" else None
    w = torch.randn(B, H, L, d, generator=gen(3), dtype=torch.float64)
    kw = dict(kernel=kernel, causal=True, key_padding_mask=mask, oprf_rho=rho)

    def triton(q, k, v):
        return run_triton(tc, q, k, v, omega, kernel, mask, chunk=16, block=16, segments=2)

    def reference(q, k, v):
        return favor_attention_reference(q, k, v, omega.double(), **kw)

    def torch_path(q, k, v):
        return favor_attention(q, k, v, omega, chunk_size=8, **kw)

    out, grads = values_and_grads(triton, q, k, v, w)
    ref, ref_grads = values_and_grads(reference, q.double(), k.double(), v.double(), w)
    assert out.dtype == torch.float32 and float(out[0, :, :3].abs().max()) == 0.0
    assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        assert_close(got, want)
    # the torch path, on the rows from the first real key on (its trig gives the leading pads
    # features, which the rows before the first real key then attend to; the reference not)
    seen = ((~mask).cumsum(-1) > 0)[:, None, :].double()
    cpu, cpu_grads = values_and_grads(torch_path, q, k, v, w)
    assert_close(out, cpu, seen)
    for got, want in zip(grads, cpu_grads, strict=True):
        assert_close(got, want, seen)


@pytest.mark.parametrize(
    ("L", "d", "dv", "chunk", "segments"),
    [(32, 8, 8, 16, None), (5, 12, 5, 16, 1), (50, 8, 8, 16, 3)],
)
def test_shapes_and_segments(tc, L, d, dv, chunk, segments):
    """Whole chunks, one partial chunk, a head dim and a value dim off the tile sizes, more
    segments than fit (each of whole chunks): values and gradients as the reference's."""
    q, k, v = inputs(1, 2, L, d, dv, seed=L)
    omega = draw_omega(16, d, generator=gen(4))
    w = torch.randn(1, 2, L, dv, generator=gen(5), dtype=torch.float64)

    def triton(q, k, v):
        return run_triton(tc, q, k, v, omega, "softmax", None, chunk=chunk, segments=segments)

    def reference(q, k, v):
        return favor_attention_reference(q, k, v, omega.double(), causal=True)

    out, grads = values_and_grads(triton, q, k, v, w)
    ref, ref_grads = values_and_grads(reference, q.double(), k.double(), v.double(), w)
    assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        assert_close(got, want)


def test_stabilizer_at_jumping_logits_is_causal_and_finite(tc):
    """Key norms that rise by far more than exp's range inside one chunk: the running max
    jumps, every factor stays <= 1, outputs match float64, and appending huge future keys
    leaves every past output unchanged (no future information in the stabilizer)."""
    B, H, L, d = 1, 2, 24, 8
    q, k, v = inputs(B, H, L, d, seed=7, scale=0.5)
    k = k * torch.linspace(0.5, 12.0, L)[:, None]
    omega = draw_omega(16, d, generator=gen(8))
    out = run_triton(tc, q, k, v, omega, "softmax", None, chunk=16, segments=2)
    ref = favor_attention_reference(
        q.double(), k.double(), v.double(), omega.double(), causal=True
    )
    assert torch.isfinite(out).all()
    assert_close(out, ref)
    extra = inputs(B, H, 9, d, seed=9, scale=20.0)
    longer = [torch.cat([a, b], dim=2) for a, b in zip((q, k, v), extra, strict=True)]
    after = run_triton(tc, *longer, omega, "softmax", None, chunk=16, segments=2)
    assert float((after[:, :, :L] - out).abs().max()) <= 1e-6


def test_dispatch_takes_the_kernels_only_when_asked_on_cpu(tc, monkeypatch):
    """On CPU tensors the torch path runs unless PROTEIN_PERFORMER_CAUSAL_IMPL=triton; then
    favor_attention takes the kernels for float32 and keeps the torch path for float64."""
    calls = []
    real = tc.causal_favor_triton
    monkeypatch.setattr(
        tc, "causal_favor_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v = inputs(1, 2, 20, 8, seed=10)
    omega = draw_omega(16, 8, generator=gen(11))
    kw = dict(kernel="relu", causal=True)
    base = favor_attention(q, k, v, omega, **kw)
    monkeypatch.setenv(favor_module.CAUSAL_IMPL_ENV, "torch")
    assert torch.equal(favor_attention(q, k, v, omega, **kw), base) and not calls
    monkeypatch.setenv(favor_module.CAUSAL_IMPL_ENV, "triton")
    forced = favor_attention(q, k, v, omega, **kw)
    assert len(calls) == 1 and float((forced - base).abs().max()) <= 1e-5
    favor_attention(q.double(), k.double(), v.double(), omega.double(), **kw)
    assert len(calls) == 1
    monkeypatch.setenv(favor_module.CAUSAL_IMPL_ENV, "cuda")
    with pytest.raises(UserError, match="expected 'auto', 'triton' or 'torch'"):
        favor_attention(q, k, v, omega, **kw)


def test_triton_forced_on_a_cpu_without_the_interpreter_is_one_line(monkeypatch):
    """PROTEIN_PERFORMER_CAUSAL_IMPL=triton on a CPU-only machine was triton's traceback
    (issue 42 #18); the tests' TRITON_INTERPRET=1 is what lets the kernels run on a CPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(favor_module.CAUSAL_IMPL_ENV, "triton")
    q, k, v = inputs(1, 2, 20, 8, seed=10)
    omega = draw_omega(16, 8, generator=gen(11))
    with pytest.raises(UserError, match="need CUDA tensors .* set it to torch"):
        favor_attention(q, k, v, omega, kernel="relu", causal=True)


def test_cpu_paths_never_reach_the_kernels(monkeypatch):
    """On CPU tensors (the default implementation) a causal model's forward and backward,
    prefill and steps never ask for the kernels module, so triton is never imported there."""

    def refuse(required):
        raise AssertionError("the Triton kernels were requested on a CPU path")

    monkeypatch.delenv(favor_module.CAUSAL_IMPL_ENV, raising=False)
    monkeypatch.setattr(favor_module, "_triton_kernels", refuse)
    attn = FavorAttention(8, 16, causal=True, chunk_size=4)
    q = torch.randn(1, 2, 9, 8, requires_grad=True)
    attn(q, q, q)[0].sum().backward()
    with torch.no_grad():
        _, state = attn(q, q, q, keep_state=True)
        attn(q[:, :, :1], q[:, :, :1], q[:, :, :1], state=state)


@pytest.mark.slow  # a fresh interpreter (an `import torch`)
def test_cpu_causal_forward_and_backward_never_import_triton():
    """The same, by what a fresh process holds in sys.modules afterwards."""
    code = (
        "import sys, torch; from protein_performer.model.favor import FavorAttention; "
        "a = FavorAttention(8, 16, causal=True); q = torch.randn(1, 2, 9, 8, requires_grad=True); "
        "a(q, q, q)[0].sum().backward(); a(q[:, :, :1], q[:, :, :1], q, keep_state=True); "
        "print('triton' in sys.modules)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(favor_module.CAUSAL_IMPL_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
