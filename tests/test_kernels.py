"""Pallas kernels against their references: values on many shapes (interpret mode on CPU, the
compiled kernel on a GPU), the CUDA lowering of every configuration (run on CPU), clear errors
on blocks the kernels cannot take, and the speculative loop with the kernels switched on."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.config import ModelConfig
from specjax.drafters import dflash
from specjax.kernels import kv_injection as kvi
from specjax.kernels import tree_attention as ta
from specjax.models import target
from specjax.targets import DecoderTarget

ON_GPU = jax.default_backend() == "gpu"


def _tree(b, n, seed):
    """[B, N, N] ancestor-or-self masks of random trees (parents before children)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            out[r, i, i] = True
            if i:
                out[r, i] |= out[r, rng.integers(0, i)]
    return jnp.asarray(out)


def _inputs(b, kv_heads, group, n, s, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    c = b * kv_heads
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    lengths = jnp.asarray(np.repeat(rng.integers(1, s - n, b), kv_heads), jnp.int32)
    return (normal(c, group * n, h), normal(c, s, h), normal(c, s, h), lengths,
            normal(c, n, h), normal(c, n, h), _tree(b, n, seed))


# (batch, kv heads, group, nodes, cache slots, head dim, dtype, n_split)
SHAPES = {
    "n1-gqa4": (2, 2, 4, 1, 128, 16, jnp.float32, 1),
    "n16-gqa1-split2": (3, 1, 1, 16, 256, 32, jnp.float32, 2),
    "n64-gqa8-bf16": (1, 2, 8, 64, 128, 64, jnp.bfloat16, 1),
}
SLOW_SHAPES = {
    "n64-4k-split4": (2, 2, 4, 64, 4096, 128, jnp.float32, 4),
    "n16-4k-gqa8-bf16-split2": (2, 1, 8, 16, 4096, 128, jnp.bfloat16, 2),
}


class TestTreeAttention:
    """The kernel compiled for the GPU (skipped elsewhere); the subclass runs it interpreted."""

    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_GPU:
            pytest.skip("the compiled kernel needs an NVIDIA GPU")

    def _check(self, shape):
        b, kh, g, n, s, h, dtype, n_split = shape
        args = _inputs(b, kh, g, n, s, h, dtype)
        want = ta.tree_attention_reference(*args)
        got = ta.tree_attention(*args, block_k=32, n_split=n_split, interpret=self.INTERPRET,
                                poison=True)
        assert got.dtype == dtype and got.shape == want.shape
        tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)

    @pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
    def test_equals_the_reference(self, shape):
        self._check(shape)

    @pytest.mark.slow
    @pytest.mark.parametrize("shape", SLOW_SHAPES.values(), ids=SLOW_SHAPES.keys())
    def test_equals_the_reference_on_long_caches(self, shape):
        self._check(shape)

    def test_a_row_that_sees_only_its_nodes(self):
        """Length 0 (no committed slot) and a chunk loop that never runs."""
        q, k, v, _, kn, vn, tree = _inputs(2, 1, 2, 4, 64, 16, jnp.float32)
        lengths = jnp.asarray([0, 64], jnp.int32)
        want = ta.tree_attention_reference(q, k, v, lengths, kn, vn, tree)
        got = ta.tree_attention(q, k, v, lengths, kn, vn, tree, block_k=16, n_split=2,
                                interpret=self.INTERPRET, poison=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


class TestTreeAttentionInterpreted(TestTreeAttention):
    INTERPRET = True


@pytest.mark.parametrize("shape", list(SHAPES.values()) + list(SLOW_SHAPES.values()),
                         ids=list(SHAPES) + list(SLOW_SHAPES))
def test_every_configuration_lowers_for_cuda(shape):
    """The Triton lowering runs at lower time, on CPU: GPU-only errors show here."""
    b, kh, g, n, s, h, dtype, n_split = shape
    args = _inputs(b, kh, g, n, s, h, dtype)
    lowered = jax.jit(lambda *a: ta.tree_attention(*a, block_k=64, n_split=n_split)).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_blocks_the_kernel_cannot_take_are_refused_clearly():
    args = _inputs(1, 1, 1, 4, 96, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_k 48 must be a power of two"):
        ta.tree_attention(*args, block_k=48, interpret=True)
    with pytest.raises(ValueError, match="cache slots 96 must be a multiple of n_split"):
        ta.tree_attention(*args, block_k=64, interpret=True)
    q, k, v, lengths, kn, vn, tree = args
    with pytest.raises(ValueError, match="tree mask"):
        ta.tree_attention(q, k, v, lengths, kn, vn, tree[:, :3, :3], block_k=32, interpret=True)


def _kv_inputs(b, t, d, n_layers, kv_heads, group, h, s, dtype, seed=0):
    """Random KV-injection inputs; starts anywhere that fits, one row ending at the last slot."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    angles = rng.integers(0, 4 * s, (b, t))[..., None] * 0.37 ** np.arange(h // 2)
    starts = rng.integers(0, s - t + 1, b)
    starts[-1] = s - t
    return (normal(b, t, d), [normal(d, kv_heads, group + 2, h) * d ** -0.5
                              for _ in range(n_layers)],
            [normal(h) for _ in range(n_layers)], jnp.asarray(np.cos(angles), jnp.float32),
            jnp.asarray(np.sin(angles), jnp.float32),
            [normal(b * kv_heads, s, h) for _ in range(n_layers)],
            [normal(b * kv_heads, s, h) for _ in range(n_layers)], jnp.asarray(starts, jnp.int32))


# (batch, new positions, width, layers, kv heads, group, head dim, cache slots, dtype, block_d)
KV_SHAPES = {
    "t5-2layers-gqa2": (2, 5, 64, 2, 2, 2, 32, 48, jnp.float32, 32),
    "t16-window-of-the-cache": (1, 16, 128, 1, 1, 4, 32, 16, jnp.float32, 64),
    "t20-3layers-bf16": (3, 20, 64, 3, 2, 1, 64, 64, jnp.bfloat16, 16),
}
KV_SLOW_SHAPES = {  # a Qwen3-8B-shaped DFlash drafter: 5 layers of 8 x 128 over width 4096
    "qwen3-8b-t16-bf16": (2, 16, 4096, 5, 8, 4, 128, 1024, jnp.bfloat16, 128),
}


class TestKVInjection:
    """The kernel compiled for the GPU (skipped elsewhere); the subclass runs it interpreted.
    The whole caches are compared, so a slot written that should not be (or not written that
    should) fails."""

    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not ON_GPU:
            pytest.skip("the compiled kernel needs an NVIDIA GPU")

    def _check(self, shape):
        *dims, dtype, block_d = shape
        args = _kv_inputs(*dims, dtype)
        want = kvi.kv_injection_reference(*args, eps=1e-6)
        got = kvi.kv_injection(*args, eps=1e-6, block_d=block_d, interpret=self.INTERPRET)
        tol = 4e-2 if dtype == jnp.bfloat16 else 2e-5
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert g.dtype == dtype and g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       rtol=tol, atol=tol)

    @pytest.mark.parametrize("shape", KV_SHAPES.values(), ids=KV_SHAPES.keys())
    def test_equals_the_reference(self, shape):
        self._check(shape)

    @pytest.mark.slow
    @pytest.mark.parametrize("shape", KV_SLOW_SHAPES.values(), ids=KV_SLOW_SHAPES.keys())
    def test_equals_the_reference_at_real_size(self, shape):
        self._check(shape)


class TestKVInjectionInterpreted(TestKVInjection):
    INTERPRET = True


def test_kv_injection_reference_is_the_drafters_context_kv():
    """The reference writes exactly what the drafter's own layer functions compute."""
    cfg = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                      n_kv_heads=2, head_dim=16, d_ff=48)
    dcfg = dflash.DFlashConfig.for_target(cfg, n_layers=2, block_size=4, n_taps=2)
    own = dflash.init_params(dcfg, 1, scale=0.3)
    rng = np.random.default_rng(3)
    for p in own["layers"]:  # norms other than ones, so that their weight counts
        p["k_norm"] = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)
    ctx = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
    positions = jnp.asarray([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    cos, sin = dflash.layers.rope_tables(dcfg.layer, positions)
    zeros = [jnp.zeros((4, 12, 16), jnp.float32)] * 2
    ks, vs = kvi.kv_injection_reference(ctx, [p["wqkv"] for p in own["layers"]],
                                        [p["k_norm"] for p in own["layers"]], cos, sin, zeros,
                                        zeros, jnp.asarray([3, 0]), eps=dcfg.layer.norm_eps)
    for i, p in enumerate(own["layers"]):
        k, v = dflash.context_kv(dcfg, p, ctx, cos, sin)  # [B * K, T, H]
        np.testing.assert_allclose(ks[i][:2, 3:8], k[:2], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(vs[i][2:, 0:5], v[2:], rtol=1e-6, atol=1e-6)
        assert not np.asarray(ks[i][:2, :3]).any() and not np.asarray(ks[i][2:, 5:]).any()


@pytest.mark.parametrize("shape", list(KV_SHAPES.values()) + list(KV_SLOW_SHAPES.values()),
                         ids=list(KV_SHAPES) + list(KV_SLOW_SHAPES))
def test_every_kv_injection_configuration_lowers_for_cuda(shape):
    *dims, dtype, block_d = shape
    args = _kv_inputs(*dims, dtype)
    lowered = jax.jit(lambda *a: kvi.kv_injection(*a, eps=1e-6, block_d=block_d)).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_kv_injection_inputs_it_cannot_take_are_refused_clearly():
    ctx, w, kn, cos, sin, kc, vc, starts = _kv_inputs(1, 4, 48, 2, 1, 2, 32, 32, jnp.float32)
    with pytest.raises(ValueError, match="context width 48 must be a multiple of block_d = 32"):
        kvi.kv_injection(ctx, w, kn, cos, sin, kc, vc, starts, eps=1e-6, block_d=32)
    with pytest.raises(ValueError, match="block_d 24 must be a power of two"):
        kvi.kv_injection(ctx, w, kn, cos, sin, kc, vc, starts, eps=1e-6, block_d=24)
    with pytest.raises(ValueError, match="one of each per layer"):
        kvi.kv_injection(ctx, w, kn[:1], cos, sin, kc, vc, starts, eps=1e-6, block_d=16)
    with pytest.raises(ValueError, match=r"caches .* must be \[B \* K, S, H\]"):
        kvi.kv_injection(ctx, w, kn, cos, sin, [x[:, :, :16] for x in kc], vc, starts, eps=1e-6,
                         block_d=16)
    with pytest.raises(ValueError, match="shorter than block_t = 64"):
        kvi.kv_injection(ctx, w, kn, cos, sin, kc, vc, starts, eps=1e-6, block_d=16, block_t=64)


def test_speculative_loop_is_identical_with_the_kernels_on(monkeypatch):
    """DDTree verification and the drafter's KV injection through the interpreted kernels: the
    same greedy tokens, and the plain baseline too (its passes fall back to the reference)."""
    calls, injections = [], []
    kernel, injection = ta.tree_attention, kvi.kv_injection

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return kernel(*args, **kw)

    def counted_injection(*args, **kw):
        injections.append(args[0].shape)
        return injection(*args, **kw)

    monkeypatch.setattr(ta, "tree_attention", counted)
    monkeypatch.setattr(kvi, "kv_injection", counted_injection)
    cfg = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                      n_kv_heads=2, head_dim=32, d_ff=48)  # head dim 32: both kernels take it
    params = target.init_params(cfg, 0, scale=0.5)
    prompts = [[5, 9, 3, 5, 9, 3, 5], [7, 1, 2, 8, 4, 4, 6, 10, 11, 7, 1]]
    dcfg = dflash.DFlashConfig.for_target(cfg, n_layers=1, block_size=4, n_taps=2)
    dp = dflash.drafter_params(dflash.init_params(dcfg, 1, scale=0.3), params)
    out = {}
    for impl in ("reference", "pallas-interpret"):
        c = cfg.replace(attention_impl=impl)
        d = dataclasses.replace(dcfg, layer=dcfg.layer.replace(attention_impl=impl))
        drafter = dflash.DFlashDrafter(d, DecoderTarget(c), dflash.DDTree(6))
        out[impl] = api.generate_tokens(c, params, prompts, max_new_tokens=12, drafter=drafter,
                                        drafter_params=dp, cache_size=64).tokens
    assert calls  # the verify passes did run through the kernel (once per layer when traced)
    assert injections  # and the drafter's prefill and commits through the injection kernel
    assert out["pallas-interpret"] == out["reference"]
    assert out["reference"] == api.generate_tokens(cfg, params, prompts, max_new_tokens=12).tokens


def test_the_gpu_script_runs_tiny_on_cpu(capsys):
    """``python -m specjax.kernel_bench`` end to end on tiny shapes, its kernels interpreted:
    every section prints, and the kernels agree with their references."""
    import re

    from specjax import kernel_bench

    assert kernel_bench.main(["--tiny", "--interpret", "--contexts", "64", "--nodes", "16",
                              "--verify-nodes", "4"]) == 0
    out = capsys.readouterr().out
    diffs = [float(x) for x in re.findall(r"max diff (\S+)", out)]
    assert len(diffs) == 3 and max(diffs) < 5e-2, out  # tree attention; injection batch 1, 4
    assert re.search(r"pallas-interpret +context +64: T_step .* N=4: \d+\.\d+x", out), out
