"""Structured attention (specjax.models.attention) against a float64 NumPy definition.

Each rule's mask is written here again with explicit loops over (row, query, key), so a slip in
the vectorised rule cannot hide behind the same slip in the test; attention outputs are then
compared with a float64 softmax over those masks, with GQA and ragged lengths.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.models import attention as A
from specjax.tree import ancestor_mask

B, T, K, G, H = 3, 6, 2, 3, 8


def np_attention(q, blocks):
    """float64 reference: q [B, T, N, H]; blocks of (k [B, S, K, H], v, mask [B, T, S])."""
    b, t, n, h = q.shape
    kh = blocks[0][0].shape[2]
    g = n // kh
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        for ti in range(t):
            for ni in range(n):
                j = ni // g
                scores, values = [], []
                for k, v, m in blocks:
                    for si in range(k.shape[1]):
                        if m[bi, ti, si]:
                            scores.append(q[bi, ti, ni] @ k[bi, si, j] / np.sqrt(h))
                            values.append(v[bi, si, j])
                w = np.exp(np.array(scores) - max(scores))
                out[bi, ti, ni] = (w / w.sum()) @ np.array(values)
    return out


def rows(x):
    """[B, S, K, H] -> the cache's row layout [B * K, S, H]."""
    b, s, k, h = x.shape
    return jnp.asarray(x.transpose(0, 2, 1, 3).reshape(b * k, s, h), jnp.float32)


def run(q, blocks_np, rules):
    blocks = [A.KeyBlock(rows(k), rows(v), r) for (k, v), r in zip(blocks_np, rules)]
    return np.asarray(jax.jit(A.attend)(jnp.asarray(q, jnp.float32), blocks), np.float64)


def random_kv(gen, s):
    return gen.standard_normal((B, s, K, H)), gen.standard_normal((B, s, K, H))


def loops(b, t, s, fn):
    return np.array([[[bool(fn(bi, ti, si)) for si in range(s)] for ti in range(t)]
                     for bi in range(b)])


LENGTHS = np.array([0, 3, 7], np.int32)  # ragged, one row with nothing committed
PARENTS = np.array([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 2, 4]], np.int32)


def ancestors_np(parents):
    b, n = parents.shape
    anc = np.zeros((b, n, n), bool)
    for bi in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                anc[bi, i, j] = True
                j = parents[bi, j]
    return anc


def test_hand_drawn_tree_in_the_cache_matches_the_docstring():
    # Root 0 with children 1 and 2, two committed slots, nodes written at slots 2..4.
    anc = np.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
    lengths = jnp.array([2], jnp.int32)
    rule = A.Union((A.Prefix(lengths), A.Tree(jnp.asarray(anc), offset=lengths)))
    np.testing.assert_array_equal(np.asarray(A.dense_mask(rule, 1, 3, 6))[0], [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
    ])


def test_ancestor_mask_helper_agrees_with_the_loop_definition():
    np.testing.assert_array_equal(np.asarray(ancestor_mask(jnp.asarray(PARENTS))),
                                  ancestors_np(PARENTS))


def test_cache_with_a_tree_written_after_ragged_prefixes():
    gen = np.random.default_rng(0)
    s = 16
    q = gen.standard_normal((B, T, K * G, H))
    kv = random_kv(gen, s)
    anc = ancestors_np(PARENTS)
    lengths = jnp.asarray(LENGTHS)
    rule = A.Union((A.Prefix(lengths), A.Tree(jnp.asarray(anc), offset=lengths)))
    m = loops(B, T, s, lambda b, t, si: si < LENGTHS[b]
              or (0 <= si - LENGTHS[b] < T and anc[b, t, si - LENGTHS[b]]))
    np.testing.assert_array_equal(np.asarray(A.dense_mask(rule, B, T, s)), m)
    np.testing.assert_allclose(run(q, [kv], [rule]), np_attention(q, [(*kv, m)]), atol=1e-5)


def test_causal_over_a_written_cache_and_as_a_fresh_block():
    gen = np.random.default_rng(1)
    s = 16
    q = gen.standard_normal((B, T, K * G, H))
    cache, fresh = random_kv(gen, s), random_kv(gen, T)
    lengths = jnp.asarray(LENGTHS)
    m = loops(B, T, s, lambda b, t, si: si <= t + LENGTHS[b])
    np.testing.assert_allclose(run(q, [cache], [A.Causal(lengths)]),
                               np_attention(q, [(*cache, m)]), atol=1e-5)
    # The read-only verify pass: committed slots of the cache, causal among fresh keys.
    m_cache = loops(B, T, s, lambda b, t, si: si < LENGTHS[b])
    m_fresh = loops(B, T, T, lambda b, t, si: si <= t)
    np.testing.assert_allclose(
        run(q, [cache, fresh], [A.Prefix(lengths), A.Causal()]),
        np_attention(q, [(*cache, m_cache), (*fresh, m_fresh)]), atol=1e-5)


def test_fresh_tree_block_beside_the_committed_cache():
    gen = np.random.default_rng(2)
    s = 12
    q = gen.standard_normal((B, T, K * G, H))
    cache, fresh = random_kv(gen, s), random_kv(gen, T)
    anc = ancestors_np(PARENTS)
    m_cache = loops(B, T, s, lambda b, t, si: si < LENGTHS[b])
    np.testing.assert_allclose(
        run(q, [cache, fresh], [A.Prefix(jnp.asarray(LENGTHS)), A.Tree(jnp.asarray(anc))]),
        np_attention(q, [(*cache, m_cache), (*fresh, anc)]), atol=1e-5)


def test_dflash_draft_block_sees_its_context_and_all_of_itself():
    gen = np.random.default_rng(3)
    s = 10
    q = gen.standard_normal((B, T, K * G, H))
    ctx, block = random_kv(gen, s), random_kv(gen, T)
    ctx_len = np.array([1, 5, 10], np.int32)
    m_ctx = loops(B, T, s, lambda b, t, si: si < ctx_len[b])
    m_blk = np.ones((B, T, T), bool)
    np.testing.assert_allclose(
        run(q, [ctx, block], [A.Prefix(jnp.asarray(ctx_len)), A.Full()]),
        np_attention(q, [(*ctx, m_ctx), (*block, m_blk)]), atol=1e-5)


@pytest.mark.parametrize("t", [T, 2])  # G * t queries per row: both score layouts
def test_training_time_test_diagonal_steps(t):
    # Step 2 of EAGLE-3's unrolled training: step-0 keys causal, steps 1 and 2 diagonal.
    gen = np.random.default_rng(4)
    q = gen.standard_normal((B, t, K * G, H))
    step0, step1, step2 = random_kv(gen, t), random_kv(gen, t), random_kv(gen, t)
    causal = loops(B, t, t, lambda b, ti, si: si <= ti)
    diag = loops(B, t, t, lambda b, ti, si: si == ti)
    np.testing.assert_allclose(
        run(q, [step0, step1, step2], [A.Causal(), A.Diagonal(), A.Diagonal()]),
        np_attention(q, [(*step0, causal), (*step1, diag), (*step2, diag)]), atol=1e-5)


@pytest.mark.parametrize("rules", [(A.Diagonal(), A.Diagonal()), (A.Blocks(4),),
                                   (A.Blocks(2, causal=True),)])
def test_local_blocks_build_no_square(rules):
    # Diagonal and Blocks blocks over the queries' own keys are scored span by span: no
    # [.., T, T] mask or score array exists in the computation, only the prefix block's
    # [.., T, S] ones.
    gen = np.random.default_rng(5)
    s, t = 5, 12  # sizes unlike H and every span, so a square's shape is unambiguous
    q = jnp.asarray(gen.standard_normal((B, t, K * G, H)), jnp.float32)
    blocks = [A.KeyBlock(rows(k), rows(v), r) for (k, v), r in
              [(random_kv(gen, s), A.Prefix(jnp.full((B,), s)))]
              + [(random_kv(gen, t), r) for r in rules]]
    jaxpr = jax.make_jaxpr(A.attend)(q, blocks).jaxpr
    shapes = [tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars]
    assert any(sh[-2:] == (G * t, s) for sh in shapes)  # the prefix block's scores
    assert not any(len(sh) >= 2 and sh[-1] == t and sh[-2] in (t, G * t) for sh in shapes), (
        sorted(set(shapes)))


def test_expansion_level_with_an_explicit_mask():
    # An EAGLE-2 expansion level: T nodes of one level see the committed cache and, among the
    # 2T nodes fed so far (earlier levels' and their own), exactly their ancestry.
    gen = np.random.default_rng(9)
    s = 12
    q = gen.standard_normal((B, T, K * G, H))
    cache, fed = random_kv(gen, s), random_kv(gen, 2 * T)
    mask = gen.random((B, T, 2 * T)) < 0.4
    mask[:, np.arange(T), T + np.arange(T)] = True  # every node sees itself
    m_cache = loops(B, T, s, lambda b, t, si: si < LENGTHS[b])
    np.testing.assert_allclose(
        run(q, [cache, fed], [A.Prefix(jnp.asarray(LENGTHS)), A.Dense(jnp.asarray(mask))]),
        np_attention(q, [(*cache, m_cache), (*fed, mask)]), atol=1e-5)


def test_sliding_window_with_ragged_positions():
    gen = np.random.default_rng(5)
    s, size = 14, 4
    q = gen.standard_normal((B, T, K * G, H))
    kv = random_kv(gen, s)
    q_pos = LENGTHS[:, None] + np.arange(T)[None, :]
    k_pos = np.broadcast_to(np.arange(s), (B, s))
    rule = A.Window(jnp.asarray(q_pos), jnp.asarray(k_pos), size)
    m = loops(B, T, s, lambda b, t, si: 0 <= q_pos[b, t] - k_pos[b, si] < size)
    np.testing.assert_allclose(run(q, [kv], [rule]), np_attention(q, [(*kv, m)]), atol=1e-5)


def test_packed_segments_causal():
    gen = np.random.default_rng(6)
    q = gen.standard_normal((B, T, K * G, H))
    kv = random_kv(gen, T)
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1]], np.int32)
    rule = A.Intersect((A.Causal(), A.Segments(jnp.asarray(seg), jnp.asarray(seg))))
    m = loops(B, T, T, lambda b, t, si: si <= t and seg[b, t] == seg[b, si])
    np.testing.assert_allclose(run(q, [kv], [rule]), np_attention(q, [(*kv, m)]), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t, blk, anchors", [
    (T, 3, [[2, 6], [0, 8], [4, 5]]),
    (2, 2, [[2], [0], [5]]),  # G * t queries per row: the keys-first score layout
])
def test_dflash_training_anchor_blocks(causal, t, blk, anchors):
    # Blocks of blk per row over a context of 9 keys: a block sees the context strictly
    # before its anchor (within its own packed sequence) plus its own block.
    gen = np.random.default_rng(7)
    s = 9
    q = gen.standard_normal((B, t, K * G, H))
    ctx, block = random_kv(gen, s), random_kv(gen, t)
    anchors = np.array(anchors, np.int32)
    ctx_seg = np.array([[1] * 5 + [2] * 4, [1] * 9, [1] * 9], np.int32)
    q_seg = np.take_along_axis(ctx_seg, np.repeat(anchors, blk, axis=1), axis=1)
    ctx_rule = A.Intersect((A.AnchorPrefix(jnp.asarray(anchors), blk),
                            A.Segments(jnp.asarray(q_seg), jnp.asarray(ctx_seg))))
    m_ctx = loops(B, t, s, lambda b, ti, si: si < anchors[b, ti // blk]
                  and ctx_seg[b, si] == q_seg[b, ti])
    m_blk = loops(B, t, t, lambda b, ti, si: ti // blk == si // blk and (not causal or si <= ti))
    # Row 1's first block has anchor 0: it sees no context at all, only its own block.
    assert not m_ctx[1, :blk].any()
    np.testing.assert_allclose(
        run(q, [ctx, block], [ctx_rule, A.Blocks(blk, causal)]),
        np_attention(q, [(*ctx, m_ctx), (*block, m_blk)]), atol=1e-5)


def test_multi_query_and_multi_head_extremes():
    gen = np.random.default_rng(8)
    for kh, g in ((1, 4), (4, 1)):
        q = gen.standard_normal((2, 3, kh * g, H))
        k, v = gen.standard_normal((2, 5, kh, H)), gen.standard_normal((2, 5, kh, H))
        lengths = np.array([2, 5], np.int32)
        m = loops(2, 3, 5, lambda b, t, si: si < lengths[b])
        blocks = [A.KeyBlock(rows(k), rows(v), A.Prefix(jnp.asarray(lengths)))]
        np.testing.assert_allclose(np.asarray(A.attend(jnp.asarray(q, jnp.float32), blocks)),
                                   np_attention(q, [(k, v, m)]), atol=1e-5)


def test_unknown_implementation_and_bad_rows_are_clear_errors():
    q = jnp.zeros((2, 1, 4, H))
    blk = A.KeyBlock(jnp.zeros((2 * 2, 3, H)), jnp.zeros((2 * 2, 3, H)), A.Full())
    with pytest.raises(ValueError, match="unknown attention implementation 'pallas-x'"):
        A.attend(q, [blk], impl="pallas-x")
    bad = A.KeyBlock(jnp.zeros((3, 3, H)), jnp.zeros((3, 3, H)), A.Full())
    with pytest.raises(ValueError, match="kv heads"):
        A.attend(q, [bad])
