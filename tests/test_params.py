"""The params description: init, structs, checks and shardings all follow ``abstract``; a
forward pass with params sharded over a (data, model) mesh of 8 CPU devices equals the
unsharded one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax.config import ModelConfig
from specjax.io.layout import with_row_weights
from specjax.models import params as params_lib

LLAMA = ModelConfig(arch="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                    head_dim=8, d_ff=80)
QWEN3 = LLAMA.replace(arch="qwen3", head_dim=16, tie_embeddings=True, dtype="bfloat16")
TP = {"kv_heads": "model", "q_heads": "model", "mlp": "model", "vocab": None}


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)


@pytest.mark.parametrize("cfg", [LLAMA, QWEN3], ids=["llama", "qwen3-tied-bf16"])
def test_init_and_structs_follow_abstract(cfg):
    params = params_lib.init(cfg, 0)
    structs = params_lib.shape_dtype_structs(cfg)
    assert _shapes(params) == _shapes(structs) == _shapes(jax.eval_shape(
        lambda: params_lib.init(cfg, 0)))
    layer = params["layers"][0]
    g = cfg.q_per_kv
    assert layer["wqkv"].shape == (cfg.d_model, cfg.n_kv_heads, g + 2, cfg.head_dim)
    assert layer["w_gate_up"].shape == (cfg.d_model, 2, cfg.d_ff)
    assert ("q_norm" in layer) == cfg.qk_norm and ("lm_head" in params) != cfg.tie_embeddings
    np.testing.assert_array_equal(layer["attn_norm"], np.ones(cfg.d_model))
    assert 0.015 < float(jnp.std(layer["wqkv"].astype(jnp.float32))) < 0.025  # scale 0.02
    params_lib.check(params, cfg)
    params_lib.check(structs, cfg)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_row_weights_are_described_as_the_input_axis_moved_last(tie):
    cfg = LLAMA.replace(tie_embeddings=tie)
    rows = with_row_weights(params_lib.init(cfg, 0))
    assert _shapes(rows) == _shapes(params_lib.shape_dtype_structs(cfg, row_weights=True))
    layer = params_lib.abstract(cfg, row_weights=True)["layers"][0]
    assert layer["wqkv_t"].shape == (2, 5, 8, 48)
    assert layer["wqkv_t"].axes == ("kv_heads", "qkv", "head_dim", "embed")
    assert layer["w_gate_up_t"].shape == (2, 80, 48)
    np.testing.assert_array_equal(rows["layers"][0]["wqkv_t"][1, 3, 5],
                                  rows["layers"][0]["wqkv"][:, 1, 3, 5])
    params_lib.check(rows, cfg)


def test_check_wants_all_row_weights_or_none():
    rows = with_row_weights(params_lib.init(LLAMA, 0))
    partial = dict(rows, layers=({k: v for k, v in rows["layers"][0].items() if k != "wo_t"},
                                 rows["layers"][1]))
    with pytest.raises(ValueError, match=r"missing tensor layers\.0\.wo_t \(expected shape "
                                         r"\(48, 48\)\)"):
        params_lib.check(partial, LLAMA)


def test_partition_specs_map_logical_axes_to_mesh_axes():
    specs = params_lib.partition_specs(QWEN3, TP, row_weights=True)
    layer = specs["layers"][1]
    assert layer == {
        "attn_norm": P(None), "mlp_norm": P(None), "q_norm": P(None), "k_norm": P(None),
        "wqkv": P(None, "model", None, None), "wqkv_t": P("model", None, None, None),
        "wo": P("model", None), "wo_t": P(None, "model"),
        "w_gate_up": P(None, None, "model"), "w_gate_up_t": P(None, "model", None),
        "w_down": P("model", None), "w_down_t": P(None, "model"),
    }
    assert specs["embed"] == P(None, None) and "lm_head" not in specs
    data_vocab = params_lib.partition_specs(LLAMA, {"vocab": ("data", "model")})
    assert data_vocab["lm_head"] == P(None, ("data", "model"))


def test_partition_specs_reject_bad_rules():
    with pytest.raises(ValueError, match=r"unknown logical axes \['heads'\]"):
        params_lib.partition_specs(LLAMA, {"heads": "model"})
    with pytest.raises(ValueError, match=r"layers\.0\.wo: rules map its axes \('q_heads', "
                                         r"'embed'\) to \('model', 'model'\)"):
        params_lib.partition_specs(LLAMA, {"q_heads": "model", "embed": "model"})


# A forward pass under a (data=2, model=4) mesh. XLA_FLAGS must be set before jax is imported,
# so this runs in a fresh interpreter. Auto axes: with make_mesh's default Explicit axes, jit
# would demand explicit resharding of every intermediate.
SHARDED_FORWARD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from specjax.config import ModelConfig
    from specjax.io.layout import with_row_weights
    from specjax.models import cache as cache_lib, params as params_lib, target

    assert jax.device_count() == 8, jax.devices()
    cfg = ModelConfig(arch="qwen3", vocab_size=96, d_model=32, n_layers=2, n_heads=8,
                      n_kv_heads=4, head_dim=16, d_ff=64)
    rules = {"kv_heads": "model", "q_heads": "model", "mlp": "model", "vocab": None}
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = with_row_weights(params_lib.init(cfg, 0, scale=0.3))
    specs = params_lib.partition_specs(cfg, rules, row_weights=True)
    sharded = jax.tree.map(lambda x, p: jax.device_put(x, NamedSharding(mesh, p)), params, specs)
    # Each device holds one of the 4 kv heads with its 2 query heads, and F / 4 of the MLP.
    assert sharded["layers"][0]["wqkv"].addressable_shards[0].data.shape == (32, 1, 4, 16)
    assert sharded["layers"][0]["w_gate_up"].addressable_shards[0].data.shape == (32, 2, 16)
    structs = params_lib.shape_dtype_structs(cfg, row_weights=True, mesh=mesh, rules=rules)
    assert jax.tree.map(lambda s: s.sharding, structs) == jax.tree.map(lambda x: x.sharding,
                                                                       sharded)

    @jax.jit
    def run(params, tokens):
        # Prefill two rows, then a one-row decoding step of row 0 (the one-row weights' path).
        b, t = tokens.shape
        cache = cache_lib.init_cache(cfg, b, 16)
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        logits, _, cache = target.forward(params, cfg, tokens, positions, cache)
        cache = cache_lib.advance(cache, jnp.full((b,), t))
        row0 = cache_lib.KVCache(tuple(k[:cfg.n_kv_heads] for k in cache.k),
                                 tuple(v[:cfg.n_kv_heads] for v in cache.v), cache.lengths[:1])
        step, _, _ = target.forward(params, cfg, tokens[:1, :1], jnp.full((1, 1), t), row0)
        return logits, step

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)))
    want = run(params, tokens)
    got = run(sharded, jax.device_put(tokens, NamedSharding(mesh, P("data", None))))
    assert got[0].sharding.num_devices == 8
    for g, w in zip(got, want):
        # Sharded contractions sum in another order (partial sums over devices).
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
    print("sharded == unsharded")
""")


def test_sharded_forward_equals_unsharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SHARDED_FORWARD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "sharded == unsharded" in out.stdout
