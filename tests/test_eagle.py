"""EAGLE drafters: greedy losslessness for every tree policy, EAGLE-2 expansion against a walk of
the reference algorithm, the sampled chain's law, the drafter cache against a fresh prefill,
and clear mismatch errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, decode, sampling
from specjax.config import ModelConfig
from specjax.drafters import eagle
from specjax.drafters.base import Context, Prefill
from specjax.drafters.eagle import DynamicTree, EagleConfig, EagleDrafter, SampledChain
from specjax.io import layout
from specjax.models import target
from specjax.targets import DecoderTarget
from specjax.tree import StaticTree

from laws import PARAMS8, PROMPT8, TINY8, chi_square_p, exact_transformer_law

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
TGT = DecoderTarget(TINY)
ROWS = 50_000  # x 4 calls: 200k samples of the joint law of 3 tokens
PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 1, 2, 8, 4, 4, 6, 10, 11, 7, 1], [13], [2, 2, 2, 2]]


def _eagle3(cfg=TINY, vocab=40, seed=1, scale=0.3, taps=None):
    e3 = EagleConfig.eagle3(cfg, draft_vocab_size=vocab, taps=taps)
    own = eagle.init_params(e3, seed, scale=scale)
    used = np.sort(np.random.default_rng(seed).choice(cfg.vocab_size, vocab, replace=False))
    own["d2t"] = jnp.asarray(used - np.arange(vocab), jnp.int32)
    eagle.check_params(e3, own)
    return e3, own


def _eagle1(seed=2):
    e1 = EagleConfig.eagle1(TINY, fc_bias=True)
    own = eagle.init_params(e1, seed, scale=0.3)
    eagle.check_params(e1, own)
    return e1, own


E3, OWN3 = _eagle3()
E1, OWN1 = _eagle1()
# A ranking for EAGLE-1's draft vocabulary: a random order, so the random drafter's favourite
# drafts often fall outside its first ids.
OWN1_RANKED = dict(OWN1, token_order=jnp.asarray(np.random.default_rng(0).permutation(61),
                                                 jnp.int32))

POLICIES = {
    "chain": StaticTree.chain(5),
    "static-tree": StaticTree.eagle1_default().truncate(16),
    "dynamic-4": DynamicTree(n_nodes=4, depth=2, top_k=3),
    "dynamic-16": DynamicTree(n_nodes=16, depth=3, top_k=4),
    "dynamic-64": DynamicTree(n_nodes=64, depth=4, top_k=4),
    "sampled-chain": SampledChain(3),
}


@pytest.mark.parametrize("version, policy, vocab", [(3, p, None) for p in POLICIES]
                         + [(1, "static-tree", None), (1, "dynamic-16", None),
                            (1, "dynamic-16", 30), (1, "chain", 30)])
def test_greedy_eagle_equals_plain(version, policy, vocab):
    """Batch 4 with mixed lengths and a stop token, and batch 1 for EAGLE-3's chain and
    16-node dynamic tree (the other policies share their batch-1 code paths, and EAGLE-1 every
    code path but the layer's inputs and head; with a draft vocabulary of 30 ids, its head):
    token for token."""
    cfg, own = (E3, OWN3) if version == 3 else (E1, OWN1_RANKED)
    drafter = EagleDrafter(cfg, TGT, POLICIES[policy], vocab)
    dp = eagle.drafter_params(own, PARAMS, target=TGT, vocab=vocab)
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=20)
    stop = plain.tokens[1][8]
    plain_stop = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=20, stop_tokens=[stop])
    cases = [(PROMPTS, plain_stop, [stop])]
    if version == 3 and policy in ("chain", "dynamic-16"):
        cases.append((PROMPTS[:1], plain, []))
    for prompts, want, stops in cases:
        got = api.generate_tokens(TINY, PARAMS, prompts, max_new_tokens=20, stop_tokens=stops,
                                  drafter=drafter, drafter_params=dp)
        assert got.tokens == want.tokens[: len(prompts)], policy
        assert got.stopped == want.stopped[: len(prompts)]
        assert (got.stats.fallbacks == 0).all()


@pytest.mark.parametrize("version, policy", [(3, "dynamic-16"), (3, "chain"), (1, "dynamic-16")])
def test_one_row_copies_draft_as_the_plain_weights_do(version, policy):
    """A target with one-row copies gets a drafter with them (its layer's, its fc's, EAGLE-3's
    head's) unless asked for none: the same drafts (equal acceptance counts on every row)
    and the same output as plain decoding, batch 4 with mixed lengths, and for a chain batch
    1 too (one-row draft calls)."""
    cfg, own = (E3, OWN3) if version == 3 else (E1, OWN1)
    rows = layout.with_row_weights(PARAMS)
    dp = eagle.drafter_params(own, rows)
    want = {"fc_t"} | ({"lm_head_t"} if version == 3 else set())
    assert want <= dp["drafter"].keys() and "wqkv_t" in dp["drafter"]["layer"]
    assert "fc_t" not in eagle.drafter_params(own, PARAMS)["drafter"]
    plain_dp = eagle.drafter_params(own, rows, row_weights=False)
    assert "fc_t" not in plain_dp["drafter"]
    drafter = EagleDrafter(cfg, TGT, POLICIES[policy])
    for prompts in (PROMPTS, PROMPTS[:1]) if policy == "chain" else (PROMPTS,):
        plain = api.generate_tokens(TINY, rows, prompts, max_new_tokens=20)
        got = api.generate_tokens(TINY, rows, prompts, max_new_tokens=20, drafter=drafter,
                                  drafter_params=dp)
        ref = api.generate_tokens(TINY, rows, prompts, max_new_tokens=20, drafter=drafter,
                                  drafter_params=plain_dp)
        assert got.tokens == plain.tokens == ref.tokens
        assert ref.stats.accept_hist[:, 1:].sum() > 0  # drafts were accepted: they compared
        np.testing.assert_array_equal(got.stats.accept_hist, ref.stats.accept_hist)


def test_the_drafter_cache_equals_a_fresh_prefill_of_the_committed_sequence():
    """After a run, the drafter's cached pairs and its newest output equal what ``init`` computes
    from scratch on every row's final sequence: commit fed exactly the committed pairs, with
    the target's features, in order."""
    drafter = EagleDrafter(E3, TGT, DynamicTree(n_nodes=8, depth=3, top_k=3))
    dp = eagle.drafter_params(OWN3, PARAMS)
    tokens, lengths = api.pad_prompts(PROMPTS)
    sp = sampling.SamplingParams.make(len(PROMPTS), 0.0, 0, 1.0)
    out = decode.speculative_generate(
        PARAMS, dp, jnp.asarray(tokens), jnp.asarray(lengths), sp, jax.random.key(0), target=TGT,
        drafter=drafter, max_new_tokens=17, capacity=64, return_dstate=True)
    state = out.dstate
    n_gen = np.asarray(out.n_generated)
    seq_len = np.asarray(lengths) + n_gen
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), seq_len - 1)
    fulls = [p + [int(t) for t in np.asarray(out.tokens)[r, : n_gen[r]]]
             for r, p in enumerate(PROMPTS)]
    seen, seen_len = api.pad_prompts([f[:-1] for f in fulls])
    roots = jnp.asarray([f[-1] for f in fulls], jnp.int32)

    @jax.jit
    def fresh_init(seen, seen_len):
        _, taps, _ = target.prefill(PARAMS, TINY, seen, seen_len, 64, drafter.taps)
        return drafter.init(dp, Prefill(seen, seen_len, taps, roots, 64))

    fresh = fresh_init(jnp.asarray(seen), jnp.asarray(seen_len))

    def close(got, want):  # float32 summation order differs: errors scale with the magnitudes
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())

    k = TINY.n_kv_heads
    for row, n in enumerate(seq_len - 1):
        rows = slice(row * k, (row + 1) * k)
        close(state.cache.k[0][rows, :n], fresh.cache.k[0][rows, :n])
        close(state.cache.v[0][rows, :n], fresh.cache.v[0][rows, :n])
    close(state.last, fresh.last)


# ------------------------------------------------------------------------------------------
# EAGLE-2 expansion and rerank against a plain-Python walk of the reference algorithm.


def _reference_walk(table, root_logp, k, depth, total):
    """The reference's ``topK_genrate`` on a Markov drafter (``table[token]`` = log-probs of the
    next draft id), in plain Python: returns (tokens, parents, visible per level, scores)."""
    order = lambda lp: sorted(range(len(lp)), key=lambda i: -lp[i])  # noqa: E731
    pool = []  # (score, token, parent pool index or -1)
    cur = []  # (pool index, score, token, fed columns of its ancestry, itself included)
    for r, tok in enumerate(order(root_logp)[:k]):
        pool.append((root_logp[tok], tok, -1))
        cur.append((r, root_logp[tok], tok, [r]))
    visible = []
    for level in range(depth):
        visible.append([anc for *_, anc in cur])
        cands = []
        for pidx, score, tok, anc in cur:
            for child in order(table[tok])[:k]:
                pool.append((score + table[tok][child], child, pidx))
                cands.append((len(pool) - 1, score + table[tok][child], child, anc))
        if level + 1 < depth:
            best = sorted(cands, key=lambda c: -c[1])[:k]
            cur = [(pi, s, c, anc + [(level + 1) * k + r]) for r, (pi, s, c, anc) in enumerate(best)]
    sel = sorted(sorted(range(len(pool)), key=lambda i: -pool[i][0])[: total - 1])
    tokens = [pool[i][1] for i in sel]
    parents = [-1] + [0 if pool[i][2] < 0 else sel.index(pool[i][2]) + 1 for i in sel]
    return tokens, parents, visible, [pool[i][0] for i in sel]


@pytest.mark.parametrize("k, depth, total", [(3, 3, 10), (4, 2, 21), (2, 4, 9)])
def test_dynamic_expansion_matches_the_reference_walk(k, depth, total):
    vd = 12
    rng = np.random.default_rng(k * 10 + depth)
    table = np.log(rng.dirichlet(np.full(vd, 0.5), size=vd)).astype(np.float32)  # no ties
    root = np.log(rng.dirichlet(np.full(vd, 0.5))).astype(np.float32)
    seen = []

    def step(level, hidden, ids, visible):
        seen.append(np.asarray(visible[0]))
        return jnp.asarray(table)[ids], hidden

    ids, parents, valid, scores = eagle.expand_dynamic(
        step, jnp.asarray(root)[None], jnp.zeros((1, 4)), DynamicTree(total, depth, k))
    want_tokens, want_parents, want_visible, want_scores = _reference_walk(table, root, k, depth,
                                                                           total)
    assert np.asarray(ids)[0].tolist() == want_tokens
    assert np.asarray(parents)[0].tolist() == want_parents
    np.testing.assert_allclose(np.asarray(scores)[0], want_scores, rtol=1e-5)
    assert np.asarray(valid).all()
    for level, (got, anc) in enumerate(zip(seen, want_visible)):
        want = np.zeros((k, depth * k), bool)
        for r, cols in enumerate(anc):
            want[r, cols] = True
        np.testing.assert_array_equal(got, want, err_msg=f"level {level}")


def test_a_candidate_whose_parent_lost_the_rerank_is_invalid():
    """Log-probabilities of 0 tie a child with its parent; should the child win the rerank
    alone, it must be marked invalid (never accepted) rather than hung under a wrong parent."""
    vd, k = 4, 2
    table = np.full((vd, vd), -30.0, np.float32)
    table[:, 0] = 0.0  # every node's best child has probability 1: score ties its parent's
    root = np.array([-0.1, -0.2, -5.0, -6.0], np.float32)

    def step(level, hidden, ids, visible):
        return jnp.asarray(table)[ids], hidden

    ids, parents, valid, _ = eagle.expand_dynamic(step, jnp.asarray(root)[None],
                                                  jnp.zeros((1, 2)), DynamicTree(3, 2, k))
    par, ok = np.asarray(parents)[0], np.asarray(valid)[0]
    assert (par[1:] < np.arange(1, 3)).all() and (par[1:] >= 0).all()
    # Every valid node's parent chain reaches the root through selected, valid nodes.
    for i in range(1, 3):
        if ok[i] and par[i] > 0:
            assert ok[par[i]]


def test_an_eagle1_draft_vocabulary_scores_its_ids_as_the_full_head_does():
    """EAGLE-1's logits over a draft vocabulary are the target head's at those ids (ascending),
    its drafts are target ids from it, and a sampled chain's q is finite exactly there."""
    vocab = 20
    ids = np.sort(np.asarray(OWN1_RANKED["token_order"])[:vocab])
    dp_full = eagle.drafter_params(OWN1_RANKED, PARAMS)
    dp_small = eagle.drafter_params(OWN1_RANKED, PARAMS, target=TGT, vocab=vocab)
    np.testing.assert_array_equal(np.asarray(dp_small["head"]["ids"]), ids)
    out = jax.random.normal(jax.random.key(1), (3, TINY.d_model))
    full = EagleDrafter(E1, TGT, StaticTree.chain(4))
    small = EagleDrafter(E1, TGT, StaticTree.chain(4), vocab)
    want = np.asarray(full._logits(dp_full, out))[:, ids]
    np.testing.assert_allclose(np.asarray(small._logits(dp_small, out)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    tokens, lengths = api.pad_prompts(PROMPTS)
    _, taps, _ = target.prefill(PARAMS, TINY, jnp.asarray(tokens), jnp.asarray(lengths), 32,
                                E1.taps)
    roots = jnp.asarray([3, 7, 11, 2], jnp.int32)
    seq = np.pad(tokens, ((0, 0), (0, 1)))
    seq[np.arange(len(PROMPTS)), lengths] = np.asarray(roots)
    ctx = Context(jnp.asarray(seq), jnp.asarray(lengths) + 1,
                  sampling.SamplingParams.make(len(PROMPTS), 1.0, 0, 1.0))
    prefill = Prefill(jnp.asarray(tokens), jnp.asarray(lengths), taps, roots, 32)
    for policy in (StaticTree.chain(4), DynamicTree(n_nodes=16, depth=3, top_k=4),
                   SampledChain(3)):
        drafter = EagleDrafter(E1, TGT, policy, vocab)
        state = drafter.init(dp_small, prefill)
        proposal, _ = drafter.propose(dp_small, state, ctx, jax.random.key(0))
        drafted = np.asarray(proposal.tokens)[:, 1:][np.asarray(proposal.node_valid)[:, 1:]]
        assert np.isin(drafted, ids).all()
    q = np.asarray(proposal.draft_logits)[:, :-1]  # the sampled chain's, [B, 3, V]
    assert (np.isfinite(q) == np.isin(np.arange(TINY.vocab_size), ids)).all()
    unrestricted, _ = full.propose(dp_full, full.init(dp_full, prefill), ctx, jax.random.key(0))
    assert not np.isin(np.asarray(unrestricted.tokens)[:, 1:], ids).all()
    with pytest.raises(ValueError, match="build its params with eagle.drafter_params"):
        small.propose(dp_full, state, ctx, jax.random.key(0))
    with pytest.raises(ValueError, match="carries no token_order"):
        eagle.drafter_params(OWN1, PARAMS, target=TGT, vocab=vocab)
    with pytest.raises(ValueError, match="a draft vocabulary of the target's head is for "
                                         "EAGLE-1"):
        EagleDrafter(E3, TGT, vocab=vocab)
    with pytest.raises(ValueError, match="a draft vocabulary of the target's head is for "
                                         "EAGLE-1"):
        eagle.resolve_vocab(E3, 8)
    assert eagle.resolve_vocab(E1, "full") is None and eagle.resolve_vocab(E1, 8) == 8
    with pytest.raises(ValueError, match="a draft vocabulary of 0 ids must be in"):
        EagleDrafter(E1, TGT, vocab=0)
    # A tree that expands more children per node than its head scores ids is refused early.
    with pytest.raises(ValueError, match="up to 4 children of a node from a head of 3 ids"):
        EagleDrafter(E1, TGT, DynamicTree(n_nodes=16, depth=3, top_k=4), 3)
    with pytest.raises(ValueError, match="up to 41 children of a node from a head of 40 ids"):
        EagleDrafter(E3, TGT, DynamicTree(n_nodes=8, depth=1, top_k=41))
    with pytest.raises(ValueError, match="up to 4 children of a node from a head of 3 ids"):
        EagleDrafter(E1, TGT, StaticTree.from_choices([[0], [1], [2], [3]]), 3)


# ------------------------------------------------------------------------------------------
# The sampled chain's real q, end to end, on an 8-token target with an exact law.


@dataclasses.dataclass(frozen=True)
class LyingDrafter(EagleDrafter):
    """Reports a q flattened toward uniform instead of the one its drafts were drawn from."""

    def propose(self, params, state, ctx, rng):
        proposal, state = super().propose(params, state, ctx, rng)
        lie = jnp.where(jnp.isfinite(proposal.draft_logits), 0.25 * proposal.draft_logits,
                        proposal.draft_logits)
        return dataclasses.replace(proposal, draft_logits=lie), state


def _sampled_chain_samples(cls, temperature, top_k, top_p, seeds=4, version=3):
    tgt = DecoderTarget(TINY8)
    if version == 3:
        cfg, own = _eagle3(TINY8, vocab=6, seed=3, scale=1.5, taps=(1, 2, 3))
        vocab = None
    else:  # EAGLE-1 drafting from 5 of the 8 ids
        cfg = EagleConfig.eagle1(TINY8)
        own = dict(eagle.init_params(cfg, 0, scale=1.5),
                   token_order=jnp.asarray([6, 1, 4, 0, 7, 2, 3, 5], jnp.int32))
        vocab = 5
    drafter = cls(cfg, tgt, SampledChain(3), vocab)
    dp = eagle.drafter_params(own, PARAMS8, target=tgt, vocab=vocab)
    sp = sampling.SamplingParams.make(ROWS, temperature, top_k, top_p)
    prompt = jnp.tile(jnp.asarray(PROMPT8, jnp.int32), (ROWS, 1))
    samples, accepted = [], 0
    for seed in range(seeds):
        out = decode.speculative_generate(
            PARAMS8, dp, prompt, jnp.full((ROWS,), 2, jnp.int32), sp, jax.random.key(seed),
            target=tgt, drafter=drafter, max_new_tokens=3, capacity=16)
        samples.append(np.asarray(out.tokens))
        accepted += int(out.stats.accepted.sum())
    return np.concatenate(samples), accepted


@pytest.mark.parametrize("temperature, top_k, top_p, version",
                         [(1.0, 0, 1.0, 3), (0.7, 5, 0.9, 3), (1.0, 0, 1.0, 1)])
def test_sampled_chain_preserves_the_target_law(temperature, top_k, top_p, version):
    """EAGLE-3 with a reduced vocabulary (6 of 8 ids), and EAGLE-1 drafting from 5 of the 8
    ids of its ranking, drafting sampled chains of 3 with their real q sample the exact law of
    plain sampling: chi-square on 200k samples, alpha = 0.001."""
    samples, accepted = _sampled_chain_samples(EagleDrafter, temperature, top_k, top_p,
                                               version=version)
    assert accepted > len(samples) // 20  # the drafts do get accepted
    assert chi_square_p(samples, exact_transformer_law(temperature, top_k, top_p)) > 1e-3


def test_the_sampled_chain_law_test_has_power_against_a_misreported_q():
    samples, _ = _sampled_chain_samples(LyingDrafter, 1.0, 0, 1.0)
    assert chi_square_p(samples, exact_transformer_law(1.0, 0, 1.0)) < 1e-3


# ------------------------------------------------------------------------------------------
# Mismatches and configs.


def test_mismatched_target_is_refused_with_a_clear_error():
    other = TINY.replace(vocab_size=64)
    drafter = EagleDrafter(E3, DecoderTarget(other), StaticTree.chain(3))
    with pytest.raises(ValueError, match="vocabulary of 61 ids, the target has 64"):
        api.generate_tokens(other, target.init_params(other), PROMPTS, max_new_tokens=4,
                            drafter=drafter, drafter_params=eagle.drafter_params(OWN3, PARAMS))
    wide = TINY.replace(d_model=48)
    with pytest.raises(ValueError, match="features of width 32.*hidden size is 48"):
        EagleDrafter(E3, DecoderTarget(wide)).check_target(DecoderTarget(wide))


def test_bad_params_and_configs_name_the_problem():
    bad = dict(OWN3, fc=OWN3["fc"][:, :16])
    with pytest.raises(ValueError, match=r"param fc has shape \(96, 16\), expected \(96, 32\)"):
        eagle.check_params(E3, bad)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        eagle.check_params(E3, dict(OWN3, d2t=OWN3["d2t"] + 30))
    with pytest.raises(ValueError, match="at least 4 layers"):
        EagleConfig.eagle3(TINY.replace(n_layers=3))
    with pytest.raises(ValueError, match=r"n_nodes must be in \[2, 13\]"):
        DynamicTree(n_nodes=14, depth=1, top_k=3)


def test_draft_vocab_takes_the_most_frequent_ids_in_ascending_order():
    counts = np.array([5, 0, 9, 9, 1, 0, 7])
    d2t = eagle.draft_vocab(counts, 4)
    np.testing.assert_array_equal(np.arange(4) + d2t, [0, 2, 3, 6])
    # More ids than the data has seen: unseen ids fill in, smallest first.
    np.testing.assert_array_equal(np.arange(6) + eagle.draft_vocab(counts, 6), [0, 1, 2, 3, 4, 6])
    # The ranking behind it (DFlash carries it whole): by count, ties to the smaller id.
    from specjax.drafters import vocab

    np.testing.assert_array_equal(vocab.frequency_order(counts), [2, 3, 6, 0, 4, 1, 5])
    np.testing.assert_array_equal(vocab.top_ids(vocab.frequency_order(counts), 3), [2, 3, 6])
