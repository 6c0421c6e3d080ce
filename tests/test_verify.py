"""Tests for specjax.verify: greedy goldens, structural invariants, and distribution preservation.

The distribution tests run the whole cycle on a toy language: the target's logits at a node are
a fixed function of the node's token (a [V, V] table: row = previous token), and so are the
draft's. Each trial draws a proposal from the draft, verifies it once and reads the first two
generated tokens; their empirical joint law over 200k trials is compared with the exact target
law by a chi-square test. The same test, run on deliberately wrong rules, must reject them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import SamplingParams, inverse_cdf_sample, log_probs
from specjax.tree import StaticTree
from specjax.verify import VerifyResult, emitted_tokens, verify

jverify = jax.jit(verify, static_argnames="max_depth")
jemitted = jax.jit(emitted_tokens)


def _batch(tree: StaticTree, batch: int) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(tree.parents, jnp.int32), (batch, tree.n_nodes))


# --------------------------------------------------------------------------------------------
# Greedy goldens. Every small test uses this one shape (B=8, N=7, V=8, max_depth=3), so verify
# compiles twice for all of them (with and without draft logits).
#
#          0             parents = (-1, 0, 0, 1, 1, 2, 3)
#         / \
#        1   2
#       / \   \
#      3   4   5
#      |
#      6
GOLDEN_TREE = StaticTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
SMALL_B, SMALL_V, SMALL_DEPTH = 8, 8, 3
T = [7, 2, 5, 3, 1, 6, 4]  # the usual tokens
T_DUP = [7, 2, 2, 3, 1, 6, 4]  # nodes 1 and 2 carry the same token
# Per row: tokens, the target's argmax at each node, node_valid, and the expected
# path, n_accepted and bonus.
GOLDEN_ROWS = [
    # 0 -> 1 (2 == argmax at 0) -> 4 (1 == argmax at 1); bonus = argmax at 4.
    (T, [2, 1, 0, 0, 0, 0, 0], [1] * 7, [0, 1, 4, 0], 2, 0),
    # Same, but node 4 is padding: stop at node 1, bonus = argmax at 1.
    (T, [2, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 1, 1], [0, 1, 0, 0], 1, 1),
    # 0 -> 2 -> 5 (a leaf): bonus = argmax at 5.
    (T, [5, 0, 6, 0, 0, 3, 0], [1] * 7, [0, 2, 5, 0], 2, 3),
    # The full depth-3 path 0 -> 1 -> 3 -> 6.
    (T, [2, 3, 0, 4, 0, 0, 7], [1] * 7, [0, 1, 3, 6], 3, 7),
    # Nothing matches: only the bonus.
    (T, [0, 0, 0, 0, 0, 0, 0], [1] * 7, [0, 0, 0, 0], 0, 0),
    # Node 6 would match but is padding, and so is node 3 above it.
    (T, [2, 3, 0, 4, 0, 0, 7], [1, 1, 1, 0, 1, 1, 0], [0, 1, 0, 0], 1, 3),
    # Both siblings match the root's argmax; only node 2's child matches further: longest wins.
    (T_DUP, [2, 0, 6, 0, 0, 3, 0], [1] * 7, [0, 2, 5, 0], 2, 3),
    # Both siblings match and neither goes further: the lower index wins.
    (T_DUP, [2, 0, 0, 0, 0, 0, 0], [1] * 7, [0, 1, 0, 0], 1, 0),
]


def _golden_inputs():
    tokens, argmax, valid = (jnp.asarray([r[i] for r in GOLDEN_ROWS]) for i in range(3))
    logits = 5.0 * jax.nn.one_hot(argmax, SMALL_V)  # [B, N, V]
    return logits, tokens, _batch(GOLDEN_TREE, SMALL_B), valid.astype(bool)


@pytest.mark.parametrize("with_draft_logits", [False, True])
def test_greedy_goldens(with_draft_logits):
    logits, tokens, parents, valid = _golden_inputs()
    draft = -logits if with_draft_logits else None  # greedy rows ignore the draft
    r = jverify(
        logits, tokens, parents, valid, SamplingParams.make(SMALL_B), jax.random.key(0),
        max_depth=SMALL_DEPTH, draft_logits=draft,
    )
    np.testing.assert_array_equal(r.path, [row[3] for row in GOLDEN_ROWS])
    np.testing.assert_array_equal(r.n_accepted, [row[4] for row in GOLDEN_ROWS])
    np.testing.assert_array_equal(r.bonus, [row[5] for row in GOLDEN_ROWS])
    emitted, count = jemitted(r, tokens)
    np.testing.assert_array_equal(count, [3, 2, 3, 4, 1, 2, 3, 2])
    np.testing.assert_array_equal(emitted[0], [2, 1, 0, 0])  # tokens of nodes 1, 4, then bonus
    np.testing.assert_array_equal(emitted[3], [2, 3, 4, 7])


def _random_trees(rng):
    """``SMALL_B`` random trees of the golden shape, drawn from 3 of the 8 tokens so drafts
    often match, with random padding; depths reach 6 > max_depth."""
    n = GOLDEN_TREE.n_nodes
    parents = np.array(
        [[-1] + [rng.integers(max(0, i - 2), i) for i in range(1, n)] for _ in range(SMALL_B)]
    )
    tokens = rng.integers(0, 3, (SMALL_B, n))
    valid = rng.random((SMALL_B, n)) < 0.85
    valid[:, 0] = True
    return parents, tokens, valid


def test_greedy_equals_plain_greedy_decoding_on_random_trees():
    """Emitted tokens == the target's greedy continuation; n_accepted == the deepest node within
    max_depth whose whole path is valid and matches."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(SMALL_V, SMALL_V))  # target logits given the previous token
    table[:, 3:] = -1e9
    greedy_next = table.argmax(-1)
    accepted = []
    for _ in range(16):
        parents, tokens, valid = _random_trees(rng)
        r = jverify(
            jnp.asarray(table[tokens], jnp.float32), jnp.asarray(tokens), jnp.asarray(parents),
            jnp.asarray(valid), SamplingParams.make(SMALL_B), jax.random.key(0),
            max_depth=SMALL_DEPTH,
        )
        emitted, count = jax.device_get(jemitted(r, jnp.asarray(tokens)))
        n_accepted = np.asarray(r.n_accepted)
        for b in range(SMALL_B):
            depth, good = np.zeros(GOLDEN_TREE.n_nodes, int), np.ones(GOLDEN_TREE.n_nodes, bool)
            for i in range(1, GOLDEN_TREE.n_nodes):
                a = parents[b, i]
                depth[i] = depth[a] + 1
                good[i] = good[a] and valid[b, i] and tokens[b, i] == greedy_next[tokens[b, a]]
            assert n_accepted[b] == depth[good & (depth <= SMALL_DEPTH)].max()
            want, prev = [], tokens[b, 0]
            for _ in range(count[b]):
                prev = greedy_next[prev]
                want.append(prev)
            np.testing.assert_array_equal(emitted[b, : count[b]], want)
        accepted.append(n_accepted)
    assert set(np.concatenate(accepted)) == {0, 1, 2, 3}  # the property was exercised


# --------------------------------------------------------------------------------------------
# Structural invariants for every rule.


@pytest.mark.parametrize("rule", ["greedy", "deterministic", "multidraft"])
def test_paths_are_valid_root_paths(rule):
    rng = np.random.default_rng(1)
    sp = SamplingParams.make(SMALL_B, temperature=0.0 if rule == "greedy" else 1.0)
    lengths = []
    for seed in range(16):
        parents, tokens, valid = _random_trees(rng)
        # Peaked logits shared by target and draft: acceptance is frequent.
        logits = rng.normal(size=(SMALL_B, GOLDEN_TREE.n_nodes, SMALL_V)) * 3
        logits = jnp.asarray(logits, jnp.float32).at[:, :, 3:].set(-1e9)
        r = jverify(
            logits, jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(valid), sp,
            jax.random.key(seed), max_depth=SMALL_DEPTH,
            draft_logits=logits if rule == "multidraft" else None,
        )
        path, n, bonus = jax.device_get((r.path, r.n_accepted, r.bonus))
        assert np.all((0 <= bonus) & (bonus < SMALL_V))
        assert np.all(path[:, 0] == 0) and np.all(n <= SMALL_DEPTH)
        for b in range(SMALL_B):
            for d in range(1, n[b] + 1):
                node = path[b, d]
                assert valid[b, node] and parents[b, node] == path[b, d - 1], (b, path[b])
            assert np.all(path[b, n[b] + 1 :] == 0)
        lengths.append(n)
    assert {0, 1, 2} <= set(np.concatenate(lengths))  # the property was exercised


def test_mixed_batch_rows_match_uniform_batches():
    """A row's result does not depend on the other rows' temperatures."""
    logits, tokens, parents, valid = _golden_inputs()
    temperatures = np.array([0.0, 1.0, 0.0, 0.7, 0.0, 1.0, 0.3, 0.0])
    is_greedy = temperatures == 0
    mixed = SamplingParams.make(SMALL_B, temperature=temperatures, top_k=3)
    all_sampled = SamplingParams.make(
        SMALL_B, temperature=np.where(is_greedy, 0.5, temperatures), top_k=3
    )

    def run(sp):
        return jverify(
            logits, tokens, parents, valid, sp, jax.random.key(3), max_depth=SMALL_DEPTH,
            draft_logits=logits / 2,
        )

    r_mixed, r_greedy, r_sampled = run(mixed), run(SamplingParams.make(SMALL_B)), run(all_sampled)
    for f in ("path", "n_accepted", "bonus"):
        got, greedy, sampled = (np.asarray(getattr(r, f)) for r in (r_mixed, r_greedy, r_sampled))
        np.testing.assert_array_equal(got[is_greedy], greedy[is_greedy])
        np.testing.assert_array_equal(got[~is_greedy], sampled[~is_greedy])


@pytest.mark.parametrize("with_draft_logits", [False, True])
def test_non_finite_logits_give_valid_tokens(with_draft_logits):
    logits, tokens, parents, valid = _golden_inputs()
    logits = logits.at[0].set(jnp.nan).at[1, :, 2].set(jnp.inf).at[2].set(-jnp.inf)
    sp = SamplingParams.make(SMALL_B, temperature=1.0, top_p=0.9)
    r = jverify(
        logits, tokens, parents, valid, sp, jax.random.key(4), max_depth=SMALL_DEPTH,
        draft_logits=logits if with_draft_logits else None,
    )
    assert np.all((0 <= r.bonus) & (r.bonus < SMALL_V))
    assert np.all((0 <= r.n_accepted) & (r.n_accepted <= SMALL_DEPTH))


# --------------------------------------------------------------------------------------------
# Distribution preservation.

VOCAB, ROOT, TOP_K, TOP_P = 8, 3, 5, 0.9
TRIALS = 200_000  # per configuration, in one vectorised call
ALPHA = 1e-3

# The tree for tree rules: node 2 is padding between valid siblings, and node 4 comes after
# node 3 (a child of node 1), so siblings are not contiguous.
#
#          0             parents = (-1, 0, 0, 1, 0, 1)
#        / | \           depth   = ( 0, 1, 1, 2, 1, 2)
#       1 (2) 4
#      / \
#     3   5
TREE = StaticTree((-1, 0, 0, 1, 0, 1))
TREE_VALID = (True, True, False, True, True, True)
CHAIN = StaticTree.chain(3)
TREES = {"tree": (TREE, TREE_VALID), "chain": (CHAIN, (True,) * CHAIN.n_nodes)}


def _tables() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Adversarial (target, draft) logit tables ``[V, V]``, row = previous token."""
    rng = np.random.default_rng(1234)
    base = rng.normal(size=(VOCAB, VOCAB)) * 1.2
    rank = np.argsort(-base, axis=-1)  # [V, V] tokens by target preference
    top2 = np.zeros_like(base, bool)
    top2[np.arange(VOCAB)[:, None], rank[:, :2]] = True
    one_hot = np.full_like(base, -np.inf)
    one_hot[np.arange(VOCAB), rank[:, 2]] = 0.0  # the target's 3rd choice, always drafted
    return {
        "q_equals_p": (base, base),
        "q_far_from_p": (base, -base),
        "q_one_hot": (base, one_hot),  # in a tree, every sibling is a duplicate
        "q_zero_where_p_positive": (base, np.where(top2, -np.inf, base)),
        "p_zero_where_q_positive": (np.where(top2, -np.inf, base), base),
    }


TABLES = _tables()


def _params(n, temperature, top_k, top_p):
    return SamplingParams(
        temperature=jnp.full((n,), temperature, jnp.float32),
        top_k=jnp.full((n,), top_k, jnp.int32),
        top_p=jnp.full((n,), top_p, jnp.float32),
    )


def _propose(u, tree, q_table):
    """``[TRIALS, N]`` tokens: the root, then each node drawn from ``q`` at its parent's token.

    ``u``: ``[TRIALS, N]`` uniforms; ``q_table``: ``[V, V]`` probabilities.
    """
    columns = [jnp.full((TRIALS,), ROOT, jnp.int32)]
    for i in range(1, tree.n_nodes):
        columns.append(inverse_cdf_sample(u[:, i], q_table[columns[tree.parents[i]]]))
    return jnp.stack(columns, 1)


@functools.cache
def _structure() -> dict[str, tuple[jax.Array, jax.Array]]:
    """``(parents, node_valid)``, each ``[TRIALS, N]``, per tree of ``TREES``. They enter
    ``_counts`` as arguments: as constants, XLA would fold the ancestor masks of all trials at
    compile time, which takes longer than running them."""
    return {
        name: (_batch(tree, TRIALS), jnp.broadcast_to(jnp.asarray(valid), (TRIALS, tree.n_nodes)))
        for name, (tree, valid) in TREES.items()
    }


def _walk(target_logits, tokens, parents, node_valid, sp, rng, *, max_depth, draft_logits=None,
          over_accept=False, keep_p_on_reject=False):
    """A plain index-order tree walk with pluggable mistakes, only to show the test's power.

    It is only given processed log-probabilities with neutral parameters (``_p_values`` with
    ``processed=True``), so a softmax stands in for ``log_probs``: that spares compiling a
    sort per walker.

    ``over_accept``: accept whenever ``q(x) >= p(x)``, skipping the ``p/q`` coin.
    ``keep_p_on_reject``: skip the residual; after a rejection keep drawing from ``p``.
    """
    del sp, max_depth  # neutral parameters; every node of the test trees is within reach
    batch, n_nodes, vocab = target_logits.shape
    p_all = jax.nn.softmax(target_logits, axis=-1)
    q_all = None if draft_logits is None else jax.nn.softmax(draft_logits, axis=-1)
    u = jax.random.uniform(rng, (batch, n_nodes + 1))  # one per node, the last for the bonus
    rows = jnp.arange(batch)
    cur, n = jnp.zeros(batch, jnp.int32), jnp.zeros(batch, jnp.int32)
    p = p_all[:, 0]
    accepted = []
    for j in range(1, n_nodes):
        x = tokens[:, j]
        q = jax.nn.one_hot(x, vocab) if q_all is None else q_all[rows, cur]
        p_x, q_x = p[rows, x], q[rows, x]
        tried = node_valid[:, j] & (parents[:, j] == cur)
        accept = tried & ((u[:, j] * q_x < p_x) | (over_accept & (q_x >= p_x)))
        residual = jnp.maximum(p - q, 0.0)
        residual = residual / jnp.maximum(residual.sum(-1, keepdims=True), 1e-30)
        rejected_p = p if keep_p_on_reject else residual
        p = jnp.where(accept[:, None], p_all[:, j], jnp.where(tried[:, None], rejected_p, p))
        cur, n = jnp.where(accept, j, cur), n + accept
        accepted.append(jnp.where(accept, j, 0))
    # Accepted nodes come in depth order, so moving the zeros last leaves the path.
    accepted = jnp.stack(accepted, 1)  # [B, N - 1]
    order = jnp.argsort(accepted == 0, axis=1, stable=True)
    path = jnp.concatenate(
        [jnp.zeros((batch, 1), jnp.int32), jnp.take_along_axis(accepted, order, 1)], axis=1
    )
    return VerifyResult(path, n, inverse_cdf_sample(u[:, n_nodes], p))


# name: (verify function, tree name, whether it is given the draft's q)
_no_residual = functools.partial(_walk, keep_p_on_reject=True)
RULES = {
    "chain": (verify, "chain", True),
    "tree_deterministic": (verify, "tree", False),
    "tree_multidraft": (verify, "tree", True),
    # The test-only walker with the right rule, then with mistakes.
    "walk_tree_multidraft": (_walk, "tree", True),
    "wrong_chain_over_accept": (functools.partial(_walk, over_accept=True), "chain", True),
    "wrong_chain_no_residual": (_no_residual, "chain", True),
    "wrong_tree_deterministic_no_residual": (_no_residual, "tree", False),
}
LOSSLESS = ("chain", "tree_deterministic", "tree_multidraft")
POWER = tuple(name for name in RULES if name not in LOSSLESS)


@functools.partial(jax.jit, static_argnames="rules")
def _counts(key, structure, target_table, draft_table, temperature, top_k, top_p, *, rules):
    """``TRIALS`` trials of each rule in ``rules`` -> ``[len(rules), V * V]`` counts of the
    (first, second) generated token.

    The rules share proposals (each rule's law is tested on its own, so sharing does not
    matter); every node's token is drawn from ``q`` at its parent, and the deterministic rule
    sees the draws as fixed proposals, with duplicates whenever ``q`` is peaked. If a cycle
    emitted only one token, the second is drawn from the target at it: that is the law of the
    next cycle's first token, whatever the rule.
    """
    table_sp = _params(VOCAB, temperature, top_k, top_p)
    q_table = jnp.exp(log_probs(draft_table, table_sp))  # [V, V]
    p_table = jnp.exp(log_probs(target_table, table_sp))
    u_key, *rule_keys = jax.random.split(key, 1 + len(rules))
    # [T, N_tree + N_chain + rules]: one draw for the proposals and each rule's fresh token.
    u = jax.random.uniform(u_key, (TRIALS, TREE.n_nodes + CHAIN.n_nodes + len(rules)))
    tokens = {
        "tree": _propose(u[:, : TREE.n_nodes], TREE, q_table),
        "chain": _propose(u[:, TREE.n_nodes : TREE.n_nodes + CHAIN.n_nodes], CHAIN, q_table),
    }
    sp = _params(TRIALS, temperature, top_k, top_p)
    counts = []
    for i, (rule, verify_key) in enumerate(zip(rules, rule_keys)):
        verify_fn, tree, uses_q = RULES[rule]
        toks = tokens[tree]
        r = verify_fn(
            target_table[toks], toks, *structure[tree], sp, verify_key,
            max_depth=TREES[tree][0].max_depth, draft_logits=draft_table[toks] if uses_q else None,
        )
        emitted, count = emitted_tokens(r, toks)
        fresh = inverse_cdf_sample(u[:, TREE.n_nodes + CHAIN.n_nodes + i], p_table[emitted[:, 0]])
        second = jnp.where(count >= 2, emitted[:, 1], fresh)
        counts.append(jnp.bincount(emitted[:, 0] * VOCAB + second, length=VOCAB * VOCAB))
    return jnp.stack(counts)


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of ``counts`` against ``probs``, pooling cells expected below 5."""
    if counts[probs == 0].sum() > 0:
        return 0.0  # an impossible outcome happened
    expected = counts.sum() * probs[probs > 0]
    observed = counts[probs > 0].astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
        if expected[-1] < 5:  # still too small: merge with the smallest remaining cell
            i = np.argmin(expected[:-1])
            expected[i] += expected[-1]
            observed[i] += observed[-1]
            expected, observed = expected[:-1], observed[:-1]
    stat = np.sum((observed - expected) ** 2 / expected)
    return float(jax.scipy.special.gammaincc((expected.size - 1) / 2, stat / 2))


_table_log_probs = jax.jit(log_probs)


@functools.cache
def _p_values(
    case: str, temperature: float, rules: tuple[str, ...], processed: bool
) -> dict[str, float]:
    """``TRIALS`` trials of each rule on one case -> chi-square p-value per rule.

    The rules under test receive raw logits and the truncating parameters, as in decoding.
    ``processed``: the tables are processed once beforehand and the rules get the resulting
    log-probabilities with neutral parameters (temperature 1, no truncation), which are the
    same ``p`` and ``q``, zeros included. Memoised, so parametrised tests of one case share a run.
    """
    raw_target, raw_draft = (jnp.asarray(t, jnp.float32) for t in TABLES[case])
    table_sp = _params(VOCAB, temperature, TOP_K, TOP_P)
    target_lp = _table_log_probs(raw_target, table_sp)  # [V, V]
    if processed:
        tables, params = (target_lp, _table_log_probs(raw_draft, table_sp)), (1.0, 0, 1.0)
    else:
        tables, params = (raw_target, raw_draft), (temperature, TOP_K, TOP_P)
    counts = _counts(jax.random.key(0), _structure(), *tables, *params, rules=rules)
    counts = np.asarray(counts)  # [rules, V * V]
    p = np.exp(np.asarray(target_lp, np.float64))
    p /= p.sum(-1, keepdims=True)
    joint = (p[ROOT][:, None] * p).reshape(-1)  # P(first = a, second = b) = p(a | root) p(b | a)
    return {rule: _chi_square_p_value(c, joint) for rule, c in zip(rules, counts)}


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("case", sorted(TABLES))
@pytest.mark.parametrize("rule", LOSSLESS)
def test_first_two_tokens_follow_the_target(rule, case, temperature):
    p_value = _p_values(case, temperature, LOSSLESS, processed=False)[rule]
    assert p_value > ALPHA, f"{rule} / {case} / T={temperature}: p = {p_value:.3g}"


@pytest.mark.parametrize("rule", POWER)
def test_chi_square_has_power_against_wrong_rules(rule):
    """The walker with the right rule passes, so the rejections are the mistakes' doing. One-hot
    drafts make every sibling a duplicate, which the deterministic rule must reject."""
    p_value = _p_values("q_one_hot", 1.0, POWER, processed=True)[rule]
    should_pass = not rule.startswith("wrong_")
    assert (p_value > ALPHA) == should_pass, f"{rule}: p = {p_value:.3g}"
