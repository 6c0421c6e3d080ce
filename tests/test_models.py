"""The target decoder: parity with HF transformers, cache invariants, masks and HLO hygiene."""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.io.layout import with_row_weights, with_tied_head, without_row_weights
from specjax.kernels import cpu_gemm
from specjax.models import cache as cache_lib
from specjax.models import target
from specjax.targets import DecoderTarget
from specjax.models.params import check as check_params

TINY = ModelConfig(arch="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                   head_dim=8, d_ff=80, rope_theta=10000.0)
TOL = 1e-4  # float32 parity bound with HF transformers, on logits of magnitude ~1

# Jitted entry points: eager dispatch of every op would dominate these tests' run time.
forward = jax.jit(target.forward, static_argnums=1, static_argnames="taps")
forward_hidden = jax.jit(target.forward_hidden, static_argnums=1, static_argnames="taps")


def _hf_outputs(model, tokens: np.ndarray):
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def _positions(b, t, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


@pytest.fixture(params=["hf_llama_dir", "hf_qwen3_dir"])
def hf_model(request):
    from specjax.io.hf import load_hf

    path, torch_model = request.getfixturevalue(request.param)
    cfg, params = load_hf(path)
    return cfg, params, torch_model


def test_prefill_logits_and_taps_match_hf(hf_model):
    cfg, params, torch_model = hf_model
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    ref_logits, ref_hidden = _hf_outputs(torch_model, tokens)
    taps = tuple(range(cfg.n_layers + 1))
    cache = cache_lib.init_cache(cfg, 2, 16)
    hidden, tap_states, _ = forward_hidden(params, cfg, jnp.asarray(tokens),
                                                  _positions(2, 11), cache, taps=taps)
    logits = target.lm_head(params, cfg, hidden)
    np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)
    for i in range(cfg.n_layers):
        np.testing.assert_allclose(tap_states[:, :, i], ref_hidden[i], atol=TOL, rtol=0)
    # HF's last hidden state is the final norm of our last tap.
    np.testing.assert_allclose(hidden, ref_hidden[cfg.n_layers], atol=TOL, rtol=0)
    from specjax.models.layers import rms_norm
    np.testing.assert_allclose(rms_norm(tap_states[:, :, -1], params["final_norm"], cfg.norm_eps),
                               ref_hidden[cfg.n_layers], atol=TOL, rtol=0)


@pytest.mark.parametrize("row_weights", [False, True], ids=["in-out", "row-weights"])
def test_cached_step_by_step_decoding_matches_hf(hf_model, row_weights):
    cfg, params, torch_model = hf_model
    if row_weights:  # one-token steps multiply by the [out, in] copies
        params = with_row_weights(params)
    # Longer than original_max_position_embeddings / low_freq_factor of the Llama fixture, so
    # the llama3-scaled frequencies matter.
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 80))
    ref_logits, _ = _hf_outputs(torch_model, tokens)
    cache = cache_lib.init_cache(cfg, 1, 96)
    logits, _, cache = forward(params, cfg, jnp.asarray(tokens[:, :8]), _positions(1, 8),
                                      cache)
    cache = cache_lib.advance(cache, jnp.array([8]))
    step = jax.jit(lambda c, tok, pos: target.forward(params, cfg, tok, pos, c))
    outs = [logits]
    for t in range(8, 80):
        logits, _, cache = step(cache, jnp.asarray(tokens[:, t:t + 1]), cache.lengths[:, None])
        cache = cache_lib.advance(cache, jnp.array([1]))
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), ref_logits, atol=TOL, rtol=0)


def test_cached_equals_uncached_bitwise_for_single_tokens():
    params = target.init_params(TINY, 0, scale=0.3)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, TINY.vocab_size)
    full, _, _ = forward(params, TINY, tokens, _positions(3, 9),
                                cache_lib.init_cache(TINY, 3, 12))
    cache = cache_lib.init_cache(TINY, 3, 12)
    got = []
    for t in range(9):
        logits, _, cache = forward(params, TINY, tokens[:, t:t + 1], _positions(3, 1, t),
                                          cache)
        cache = cache_lib.advance(cache, jnp.ones((3,), jnp.int32))
        got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, atol=1e-5, rtol=0)


def test_tree_mask_pass_equals_each_root_to_leaf_path_run_alone():
    """A tree verify pass gives every node the logits its own path would get as a chain.

          0            ancestor-or-self        0 1 2 3 4
         / \\                          node 0  1 0 0 0 0
        1   2                               1  1 1 0 0 0
        |   |                               2  1 0 1 0 0
        3   4                               3  1 1 0 1 0
                                            4  1 0 1 0 1
    """
    params = target.init_params(TINY, 2, scale=0.3)
    prefix = jax.random.randint(jax.random.key(3), (1, 5), 0, TINY.vocab_size)
    nodes = jnp.array([[11, 22, 33, 44, 55]])
    depth = jnp.array([[0, 1, 1, 2, 2]])
    mask = jnp.array([[[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 0, 1, 0, 0],
                       [1, 1, 0, 1, 0],
                       [1, 0, 1, 0, 1]]], bool)
    cache = cache_lib.init_cache(TINY, 1, 16)
    _, _, cache = forward(params, TINY, prefix, _positions(1, 5), cache)
    cache = cache_lib.advance(cache, jnp.array([5]))
    tree_logits, _, _ = forward(params, TINY, nodes, 5 + depth, cache, mask)
    for path in ([0, 1, 3], [0, 2, 4]):
        chain = nodes[:, path]
        chain_logits, _, _ = forward(params, TINY, chain, _positions(1, 3, 5), cache)
        np.testing.assert_allclose(tree_logits[:, path], chain_logits, atol=1e-5, rtol=0)


def test_commit_compacts_accepted_path_like_a_fresh_chain():
    """After committing path [0, 2, 4] of the tree above, the cache equals one that saw that
    chain directly, and continuing from either gives the same logits."""
    params = target.init_params(TINY, 4, scale=0.3)
    prefix = jax.random.randint(jax.random.key(5), (2, 4), 0, TINY.vocab_size)
    nodes = jnp.array([[11, 22, 33, 44, 55]] * 2)
    depth = jnp.array([[0, 1, 1, 2, 2]] * 2)
    mask = jnp.array([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                       [1, 0, 1, 0, 1]]] * 2, bool)
    base = cache_lib.init_cache(TINY, 2, 16)
    _, _, base = forward(params, TINY, prefix, _positions(2, 4), base)
    base = cache_lib.advance(base, jnp.array([4, 4]))
    _, _, tree_cache = forward(params, TINY, nodes, 4 + depth, base, mask)
    # Row 0 keeps the whole path, row 1 only the root and node 2 (ragged acceptance).
    path = jnp.array([[0, 2, 4], [0, 2, 4]])
    committed = cache_lib.commit(tree_cache, path, jnp.array([3, 2]))
    np.testing.assert_array_equal(committed.lengths, [7, 6])
    nxt = jnp.array([[7], [7]])
    got, _, _ = forward(params, TINY, nxt, committed.lengths[:, None], committed)
    for row, keep in ((0, [11, 33, 55]), (1, [11, 33])):
        chain = jnp.concatenate([prefix[row:row + 1], jnp.array([keep]), nxt[row:row + 1]], 1)
        want, _, _ = forward(params, TINY, chain, _positions(1, chain.shape[1]),
                                    cache_lib.init_cache(TINY, 1, 16))
        np.testing.assert_allclose(got[row, 0], want[0, -1], atol=1e-5, rtol=0)


def test_bfloat16_forward_tracks_float32():
    params = target.init_params(TINY, 6, scale=0.3)
    cfg16 = TINY.replace(dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = jax.random.randint(jax.random.key(7), (2, 7), 0, TINY.vocab_size)
    ref, _, _ = forward(params, TINY, tokens, _positions(2, 7), cache_lib.init_cache(TINY, 2, 8))
    got, _, c16 = forward(params16, cfg16, tokens, _positions(2, 7),
                                 cache_lib.init_cache(cfg16, 2, 8))
    assert c16.k[0].dtype == jnp.uint16  # stored as bit patterns (module docstring of cache)
    assert got.dtype == jnp.float32
    # bfloat16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); two layers of rounded
    # activations stay within a few of those steps overall.
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 0.03, rel
    assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(ref, -1))) >= 0.85


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_does_not_copy_the_cache(batch):
    """A while_loop of one-token steps must update every layer's cache in place: no copy of a
    cache-sized buffer inside the loop body (a unit batch axis used to cause one per layer)."""
    cfg = TINY.replace(n_layers=3)
    params = jax.eval_shape(lambda: target.init_params(cfg, 0))
    cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch, 256))

    def loop(params, tok, cache):
        def body(_, carry):
            tok, cache = carry
            logits, _, cache = target.forward(params, cfg, tok[:, None], cache.lengths[:, None], cache)
            return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache_lib.advance(
                cache, jnp.ones_like(cache.lengths))
        return jax.lax.fori_loop(0, 8, body, (tok, cache))

    hlo = jax.jit(loop, donate_argnums=2).lower(
        params, jax.ShapeDtypeStruct((batch,), jnp.int32), cache).compile().as_text()
    body = hlo[hlo.index("body"):] if "body" in hlo else hlo
    cache_shape = f"f32[{batch * cfg.n_kv_heads},256,{cfg.head_dim}]"
    copies = [line for line in body.splitlines()
              if re.search(r"\bcopy\(", line) and cache_shape in line.split("copy(")[0]]
    assert copies == []


def test_taps_validate_layer_ids():
    params = target.init_params(TINY, 0)
    with pytest.raises(ValueError, match="tap layer 3"):
        forward(params, TINY, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                       cache_lib.init_cache(TINY, 1, 4), taps=(3,))


@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "untied-head"])
def test_row_weights_change_passes_only_by_summation_order(tie):
    """One-row passes use the [out, in] copies, and so do float32 passes of 2-64 rows on the
    CPU kernel (close to the [in, out] product, not equal); passes of more rows never touch
    them (bitwise equal); check_params accepts them."""
    cfg = TINY.replace(tie_embeddings=tie)
    params = target.init_params(cfg, 0, scale=0.3)
    rows = with_row_weights(params)
    check_params(rows, cfg)
    assert ("lm_head_t" in rows) == (not tie)
    assert jax.tree.structure(without_row_weights(rows)) == jax.tree.structure(params)
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, cfg.vocab_size)
    cache = cache_lib.init_cache(cfg, 2, 48)
    many = [forward(p, cfg, tokens, _positions(2, 40), cache)[0] for p in (params, rows)]
    np.testing.assert_array_equal(many[0], many[1])  # 80 rows: XLA's [in, out] product
    few = [forward(p, cfg, tokens[:, :5], _positions(2, 5), cache)[0] for p in (params, rows)]
    np.testing.assert_allclose(few[0], few[1], atol=1e-5, rtol=0)
    # Where the kernel runs, the few-row pass must have taken the copies (a bitwise match
    # would mean it fell back to the [in, out] product unnoticed).
    assert not cpu_gemm.available() or not np.array_equal(few[0], few[1])
    one = [forward(p, cfg, tokens[:1, :1], _positions(1, 1), cache_lib.init_cache(cfg, 1, 8))[0]
           for p in (params, rows)]
    np.testing.assert_allclose(one[0], one[1], atol=1e-5, rtol=0)
    first = dict(rows["layers"][0], w_gate_up_t=rows["layers"][0]["w_gate_up"])  # untransposed
    with pytest.raises(ValueError, match="layers.0.w_gate_up_t has shape"):
        check_params(dict(rows, layers=(first,) + rows["layers"][1:]), cfg)


@pytest.mark.parametrize("row_weights", [False, True], ids=["in-out", "row-weights"])
def test_one_row_step_never_copies_a_weight(row_weights):
    """Fused weights have several out axes ([D, K, G + 2, H], [2, F, D], ...): a one-row step
    must multiply by them in place. A product over the trailing axis of a one-row copy with
    several out axes made XLA:CPU transpose a copy of the whole weight on every step (~3x
    slower SmolLM2 decoding)."""
    params = jax.eval_shape(lambda: target.init_params(TINY, 0))
    if row_weights:
        params = jax.eval_shape(with_row_weights, params)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(TINY, 1, 16))
    smallest = min(x.size for x in jax.tree.leaves(params["layers"]) if x.ndim > 1)
    step = jax.jit(lambda p, tok, c: target.forward(p, TINY, tok, c.lengths[:, None], c)[0])
    hlo = step.lower(params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache).compile().as_text()
    copies = []
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\{[\d,]*\} (copy|transpose)\(", line)
        if match and np.prod([int(d) for d in match.group(1).split(",") if d]) >= smallest:
            copies.append(line.strip())
    assert copies == []


def _whole_table_copies(params, cfg) -> list[str]:
    """HLO lines of a compiled loop of 4-row bfloat16 passes that copy, transpose or convert a
    whole [V, D] or [D, V] table."""
    cache = cache_lib.init_cache(cfg, 1, 16)

    def passes(p, tok, c):
        def body(_, t):
            positions = c.lengths[:, None] + jnp.arange(4)[None]
            return jnp.argmax(target.forward(p, cfg, t, positions, c)[0], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, 3, body, tok)

    hlo = jax.jit(passes).lower(params, jnp.zeros((1, 4), jnp.int32), cache).compile().as_text()
    v, d = cfg.vocab_size, cfg.d_model
    table = rf"= (f32|bf16)\[({v},{d}|{d},{v})\]\{{[\d,]*\}} (copy|transpose|convert|fusion)\("
    return [line.strip() for line in hlo.splitlines() if re.search(table, line)]


def test_tied_head_copy_spares_the_table_transpose_of_several_row_passes():
    """A bfloat16 pass of several rows through a tied head made XLA:CPU transpose the whole
    embedding table (inside a speculative cycle, on every cycle); with the tied head's copy
    it multiplies in place, and the bfloat16 embedding gather converts no table to float32.
    The copy changes the logits only by summation order; check_params accepts it on a tied
    model only."""
    cfg = TINY.replace(tie_embeddings=True, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                          target.init_params(cfg.replace(dtype="float32"), 0, scale=0.3))
    tied = with_tied_head(params)
    check_params(tied, cfg)
    assert without_row_weights(tied).keys() == params.keys()
    assert _whole_table_copies(params, cfg) != []  # what the copy is for
    assert _whole_table_copies(tied, cfg) == []
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, cfg.vocab_size)
    cache = cache_lib.init_cache(cfg, 2, 8)
    logits = [forward(p, cfg, tokens, _positions(2, 5), cache)[0] for p in (params, tied)]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-2, rtol=0)
    untied = TINY.replace(dtype="bfloat16")
    with pytest.raises(ValueError, match="tied_head: cfg.tie_embeddings is False"):
        check_params(dict(target.init_params(TINY, 0), tied_head=tied["tied_head"]), untied)


def _dot_rows(jaxpr) -> list[tuple[str, int]]:
    """(lhs dtype, rows of the lhs) of every dot_general in ``jaxpr``, nested ones included:
    rows are the lhs elements over its contracted axis."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs = eqn.invars[0].aval
            contracted = eqn.params["dimension_numbers"][0][0]
            out.append((str(lhs.dtype), lhs.size // np.prod([lhs.shape[a] for a in contracted])))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _dot_rows(sub)
    return out


def test_one_row_bfloat16_step_runs_two_row_products():
    """XLA:CPU's one-row bfloat16 matrix-vector product is several times slower than its
    two-row product, so every product of a one-row bf16 pass (decoder and head) runs two rows;
    the logits equal those of the same token fed as the first of two rows, up to summation
    order (the copy changes nothing that row 0 sees)."""
    cfg = TINY.replace(dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.init_params(TINY, 3, 0.3))
    cache = cache_lib.init_cache(cfg, 1, 8)
    tok = jnp.array([[5]], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, t, c: target.forward(p, cfg, t, c.lengths[:, None], c)[0])(
        params, tok, cache).jaxpr
    rows = [r for dtype, r in _dot_rows(jaxpr) if dtype == "bfloat16"]
    assert len(rows) >= 4 * cfg.n_layers + 1 and min(rows) == 2, rows
    one = forward(params, cfg, tok, _positions(1, 1), cache)[0]
    two = forward(params, cfg, jnp.array([[5, 9]], jnp.int32), _positions(1, 2), cache)[0]
    np.testing.assert_allclose(one[0, 0], two[0, 0], atol=2e-2 * float(jnp.abs(two).max()), rtol=0)


def _assert_reassociated(got, want):
    """float32 results equal up to summation order: within 1e-5 of the array's largest value."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1.0))


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_forward_fresh_then_write_equals_forward(tree):
    """The read-only pass attends to the cache and to its own tokens as a separate block; its
    logits and taps match the writing pass up to summation order (1e-5 of each array's largest
    magnitude: reassociation error scales with the summed terms, not with each element), and
    writing what it returns gives the writing pass's cache."""
    params = target.init_params(TINY, 0, scale=0.3)
    cache = cache_lib.init_cache(TINY, 2, 16)
    prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, TINY.vocab_size)
    _, _, cache = forward(params, TINY, prompt, _positions(2, 5), cache)
    cache = cache_lib.advance(cache, jnp.array([5, 3]))  # ragged committed lengths
    tokens = jax.random.randint(jax.random.key(4), (2, 4), 0, TINY.vocab_size)
    mask = None
    positions = cache.lengths[:, None] + jnp.arange(4)[None]
    if tree:  # root, two children, a grandchild under the second child
        anc = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
        mask = jnp.broadcast_to(anc, (2, 4, 4))
        positions = cache.lengths[:, None] + jnp.array([0, 1, 1, 2])[None]
    want_logits, want_taps, want_cache = forward(params, TINY, tokens, positions, cache, mask,
                                                 taps=(1, 2))
    fresh_fn = jax.jit(target.forward_fresh, static_argnums=1, static_argnames="taps")
    logits, taps, fresh = fresh_fn(params, TINY, tokens, positions, cache, mask, taps=(1, 2))
    _assert_reassociated(logits, want_logits)
    _assert_reassociated(taps, want_taps)
    written = cache_lib.write(cache, fresh)
    for got, want in zip(written.k + written.v, want_cache.k + want_cache.v):
        _assert_reassociated(got, want)
    np.testing.assert_array_equal(written.lengths, cache.lengths)
    # Taking an accepted path of the fresh entries and committing it equals committing the
    # same path of the written pass (row 0 keeps root + node 2 + node 3, row 1 the root).
    tgt = DecoderTarget(TINY)
    path, keep = jnp.array([[0, 2, 3], [0, 1, 0]]), jnp.array([3, 1])
    got = tgt.commit_fresh(cache, tgt.take_fresh(fresh, path), keep)
    want = tgt.commit(want_cache, path, keep)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for g, w in zip(got.k + got.v, want.k + want.v):
        for row, length in enumerate(np.asarray(want.lengths)):
            rows = slice(row * TINY.n_kv_heads, (row + 1) * TINY.n_kv_heads)
            _assert_reassociated(g[rows, :length], w[rows, :length])
