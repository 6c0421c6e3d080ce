"""Teacher-forced encode: the cache-free packed forward equals the cached forward, position by
position, and a packed row equals each of its sequences encoded alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target

CFGS = {
    "llama": ModelConfig(arch="llama", vocab_size=97, d_model=48, n_layers=3, n_heads=6,
                         n_kv_heads=2, head_dim=8, d_ff=80, tie_embeddings=True),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=97, d_model=48, n_layers=3, n_heads=4,
                         n_kv_heads=4, head_dim=16, d_ff=64),
}
TAPS = (0, 1, 3, target.FINAL_NORMED)
TOL = 2e-5

encode = jax.jit(target.encode, static_argnums=1, static_argnames="taps")
score = jax.jit(target.score_tokens, static_argnums=1, static_argnames="chunk")


def cached_step_by_step(params, cfg, seq):
    """Per position of ``seq`` [T]: (taps [n, D], log-softmax [V]) from one-token cached steps."""
    cache = cache_lib.init_cache(cfg, 1, len(seq))
    fwd = jax.jit(target.forward, static_argnums=1, static_argnames="taps")
    taps, logp = [], []
    for i, tok in enumerate(seq):
        logits, tap, cache = fwd(params, cfg, jnp.array([[tok]], jnp.int32),
                                 jnp.array([[i]], jnp.int32), cache, taps=TAPS)
        cache = cache_lib.advance(cache, jnp.ones((1,), jnp.int32))
        taps.append(np.asarray(tap[0, 0]))
        logp.append(np.asarray(jax.nn.log_softmax(logits[0, 0])))
    return np.stack(taps), np.stack(logp)


@pytest.mark.parametrize("arch", sorted(CFGS))
def test_encode_matches_cached_decoding_at_every_position(arch):
    cfg = CFGS[arch]
    params = target.init_params(cfg, seed=3, scale=0.2)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, 12)
    ref_taps, ref_logp = cached_step_by_step(params, cfg, seq)
    tokens = jnp.asarray(seq[None], jnp.int32)
    hidden, taps = encode(params, cfg, tokens, jnp.arange(12, dtype=jnp.int32)[None],
                          jnp.ones((1, 12), jnp.int32), taps=TAPS)
    np.testing.assert_allclose(taps[0], ref_taps, atol=TOL, rtol=0)
    # The final normed tap is the hidden state the head reads.
    np.testing.assert_array_equal(taps[0, :, -1], hidden[0])
    nxt = jnp.asarray(np.roll(seq, -1)[None], jnp.int32)
    lp, top1 = score(params, cfg, hidden, nxt, chunk=5)  # 12 positions: 3 chunks, one padded
    want = np.take_along_axis(ref_logp, np.roll(seq, -1)[:, None], axis=1)[:, 0]
    np.testing.assert_allclose(lp[0], want, atol=TOL, rtol=0)
    np.testing.assert_array_equal(top1[0], ref_logp.argmax(-1) == np.roll(seq, -1))
    # The argmax tokens themselves must all score as top-1.
    _, top1 = score(params, cfg, hidden, jnp.asarray(ref_logp.argmax(-1)[None], jnp.int32),
                    chunk=5)
    assert bool(top1.all())


def test_packed_row_equals_each_sequence_alone():
    cfg = CFGS["llama"]
    params = target.init_params(cfg, seed=4, scale=0.2)
    gen = np.random.default_rng(1)
    lens = [5, 7, 3]
    seqs = [gen.integers(0, cfg.vocab_size, n) for n in lens]
    width = sum(lens) + 2  # two padding tokens at the end
    tokens = np.zeros((1, width), np.int32)
    seg = np.zeros((1, width), np.int32)
    pos = np.zeros((1, width), np.int32)
    at = 0
    for i, s in enumerate(seqs):
        tokens[0, at: at + len(s)] = s
        seg[0, at: at + len(s)] = i + 1
        pos[0, at: at + len(s)] = np.arange(len(s))
        at += len(s)
    hidden, taps = encode(params, cfg, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg),
                          taps=TAPS)
    at = 0
    for s in seqs:
        h1, t1 = encode(params, cfg, jnp.asarray(s[None], jnp.int32),
                        jnp.arange(len(s), dtype=jnp.int32)[None],
                        jnp.ones((1, len(s)), jnp.int32), taps=TAPS)
        np.testing.assert_allclose(hidden[0, at: at + len(s)], h1[0], atol=TOL, rtol=0)
        np.testing.assert_allclose(taps[0, at: at + len(s)], t1[0], atol=TOL, rtol=0)
        at += len(s)


def test_reduced_vocabulary_head_gathers_rows_in_order():
    cfg = CFGS["qwen3"]  # untied head
    params = target.init_params(cfg, seed=5)
    hidden = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, cfg.d_model)),
                         jnp.float32)
    ids = jnp.array([5, 0, 96, 17], jnp.int32)
    full = target.lm_head(params, cfg, hidden)
    rows = target.head_rows(params, cfg, ids)  # [4, D]
    np.testing.assert_allclose(hidden @ rows.T, full[..., ids], atol=1e-6, rtol=0)
    tied = CFGS["llama"]
    tp = target.init_params(tied, seed=5)
    np.testing.assert_allclose(hidden @ target.head_rows(tp, tied, ids).T,
                               target.lm_head(tp, tied, hidden)[..., ids], atol=1e-6, rtol=0)


def test_bad_tap_is_a_clear_error():
    cfg = CFGS["llama"]
    params = target.init_params(cfg)
    with pytest.raises(ValueError, match="tap layer 7 is outside"):
        target.encode(params, cfg, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                      jnp.ones((1, 2), jnp.int32), taps=(7,))
