"""The CPU matrix-product kernel (specjax.kernels.cpu_gemm) against its reference: values within
float32's error bound on shapes with every kind of remainder, each row independent of the rows
beside it (bitwise), gradients, which products the model layers send to it, and the switch."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.drafters import eagle
from specjax.io import layout
from specjax.kernels import cpu_gemm
from specjax.models import layers, target
from specjax.targets import DecoderTarget

# Where the kernel can run it must: a silent fallback would leave it untested.
CAN_BUILD = (jax.default_backend() == "cpu" and platform.system() == "Linux"
             and platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_gemm._cpu_flags()
             and shutil.which(cpu_gemm.compiler()[0]) is not None
             and os.environ.get("SPECJAX_CPU_GEMM", "1") != "0")
needs_kernel = pytest.mark.skipif(not CAN_BUILD,
                                  reason="no x86-64 CPU backend with AVX2/FMA and a compiler")


def _operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((n, k)).astype(np.float32))


def test_the_kernel_is_built_where_it_can_run():
    assert cpu_gemm.available() == CAN_BUILD


# Rows: one, a partial row tile, several tiles plus each remainder; K: multiples of 8 and not;
# N: partial column tiles, partial and several work chunks of 48 rows.
SHAPES = [(1, 8, 4), (2, 13, 5), (3, 576, 49), (4, 7, 97), (5, 64, 48), (16, 1536, 100),
          (37, 40, 3), (64, 576, 960), (70, 9, 130)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_values_within_the_float32_error_bound(m, k, n):
    """|y - x w^T| <= K u (|x| |w|^T), u = 2^-24 per operation: the bound of any float32 sum of
    K products, whatever its order."""
    x, w = _operands(m, k, n)
    y = np.asarray(jax.jit(cpu_gemm.gemm_nt)(x, w), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = k * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert y.shape == (m, n)
    assert np.all(np.abs(y - exact) <= bound)


@needs_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bfloat16_weights_give_the_float32_product_of_the_widened_weights(m, k, n):
    """Bfloat16 weights are widened exactly as they are loaded (in registers for up to one row
    tile of x, through a widened copy of each row group beyond): the product equals the
    float32 kernel's on the widened weights bit for bit."""
    x, w = _operands(m, k, n, seed=4)
    w16 = jnp.asarray(w).astype(jnp.bfloat16)
    f = jax.jit(cpu_gemm.gemm_nt)
    np.testing.assert_array_equal(f(x, w16), f(x, w16.astype(jnp.float32)))


@needs_kernel
def test_each_row_is_independent_of_the_rows_beside_it():
    """Row i of an M-row product equals the one-row product of row i, and the same row placed
    anywhere in products of other sizes, bit for bit (the kernel fixes every element's order)."""
    x, w = _operands(23, 200, 101, seed=1)
    f = jax.jit(cpu_gemm.gemm_nt)
    full = np.asarray(f(x, w))
    for i in (0, 5, 22):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], full[i])
        moved = np.concatenate([x[i:i + 1], x[:2]])  # row i first in a 3-row product
        np.testing.assert_array_equal(np.asarray(f(moved, w))[0], full[i])


@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_gradients_are_the_references(wdtype):
    x, w = _operands(6, 24, 10, seed=2)
    w = jnp.asarray(w).astype(wdtype)
    loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w)))  # noqa: E731
    got = jax.grad(loss(cpu_gemm.gemm_nt), argnums=(0, 1))(x, w)
    want = jax.grad(loss(cpu_gemm.gemm_nt_reference), argnums=(0, 1))(x, w)
    assert got[1].dtype == wdtype
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=1e-2 if wdtype == jnp.bfloat16 else 1e-4, atol=1e-4)


def test_runs_under_vmap_and_inside_a_while_loop():
    x, w = _operands(4, 16, 9, seed=3)

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda _, h: jnp.tanh(cpu_gemm.gemm_nt(h, w) @ w), x)

    ref = jax.lax.fori_loop(0, 3, lambda _, h: jnp.tanh(cpu_gemm.gemm_nt_reference(h, w) @ w), x)
    np.testing.assert_allclose(jax.jit(loop)(x), ref, rtol=1e-5, atol=1e-5)
    batched = jax.vmap(cpu_gemm.gemm_nt, in_axes=(0, None))(np.stack([x, 2 * x]), w)
    np.testing.assert_allclose(batched[1], 2 * np.asarray(batched[0]), rtol=1e-6, atol=1e-5)


def test_bad_operands_are_refused_clearly():
    x, w = _operands(2, 8, 3)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        cpu_gemm.gemm_nt(x, w[:, :7])
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.gemm_nt(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match="got float32 and float16"):
        cpu_gemm.gemm_nt(x, w.astype(jnp.float16))


def _kernel_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(cpu_gemm.TARGET)


F32, BF16 = jnp.float32, jnp.bfloat16


@needs_kernel
@pytest.mark.parametrize("rows,dtype,wdtype,calls", [
    (1, F32, F32, 0), (2, F32, F32, 1), (64, F32, F32, 1), (65, F32, F32, 0), (4, BF16, BF16, 0),
    (1, F32, BF16, 1), (64, F32, BF16, 1), (65, F32, BF16, 0)])
def test_matmul_nt_sends_float32_rows_to_the_kernel(rows, dtype, wdtype, calls):
    """2 to 64 float32 rows by float32 weights, 1 to 64 by bfloat16 weights."""
    x = jnp.ones((rows, 8), dtype)
    w = jnp.ones((5, 8), wdtype)
    assert _kernel_calls(layers.matmul_nt, x, w) == calls
    np.testing.assert_allclose(layers.matmul_nt(x, w), jnp.full((rows, 5), 8.0))


@needs_kernel
@pytest.mark.parametrize("n_rows,bf16_values,calls", [(4, False, 2), (1, False, 0), (4, True, 2),
                                                      (1, True, 2)])
def test_a_drafters_one_row_copies_send_its_products_to_the_kernel(n_rows, bf16_values, calls):
    """EAGLE-3's feature projection and own head over drafted rows, with the copies
    :func:`eagle.drafter_params` adds for a target that has them: 2 to 64 rows on the kernel;
    where every weight is a bfloat16 value (a bfloat16 checkpoint's) the copies are bfloat16
    and one row goes to the kernel too; the same values as without copies (XLA) to float32
    rounding. Traced weights (values unknown) get float32 copies."""
    cfg = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                      n_kv_heads=2, head_dim=8, d_ff=48)
    e3 = eagle.EagleConfig.eagle3(cfg, draft_vocab_size=40)
    own = eagle.init_params(e3, 1, scale=0.3)
    if bf16_values:
        own = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype)
                           if a.dtype == jnp.float32 else a, own)
    rows = layout.with_row_weights(target.init_params(cfg, 0, scale=0.5))
    tgt = DecoderTarget(cfg)
    tokens = jnp.arange(n_rows, dtype=jnp.int32).reshape(1, n_rows)
    hidden = jax.random.normal(jax.random.key(0), (1, n_rows, e3.feature_width))

    def draft(dp):
        x, h = eagle.layer_inputs(e3, tgt, dp, tokens, hidden, from_target=True)
        return x, eagle.draft_logits(e3, tgt, dp, h)

    copies, plain = (eagle.drafter_params(own, rows, row_weights=r) for r in (True, False))
    assert copies["drafter"]["fc_t"].dtype == (jnp.bfloat16 if bf16_values else jnp.float32)
    assert copies["drafter"]["layer"]["w_down_t"].dtype == copies["drafter"]["fc_t"].dtype
    assert _kernel_calls(draft, copies) == calls
    assert _kernel_calls(draft, plain) == 0
    for got, want in zip(draft(copies), draft(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    traced = jax.jit(lambda own: layout.drafter_own(own, rows)["fc_t"].dtype == jnp.float32)
    assert traced(own)


def test_the_switch_turns_the_kernel_off():
    code = ("from specjax.kernels import cpu_gemm; import jax.numpy as jnp; "
            "import jax; x = jnp.ones((3, 8)); "
            "print(cpu_gemm.available(), cpu_gemm.TARGET in "
            "jax.jit(cpu_gemm.gemm_nt).lower(x, x).as_text())")
    env = dict(os.environ, SPECJAX_CPU_GEMM="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]
