"""DFlash drafting: greedy losslessness of block chains and DDTrees (over the whole vocabulary
and a draft vocabulary), KV injection against a dense formulation, DDTree against a heap walk
of the reference algorithm, the sampled block's law (and its power against a misreported q and
against noise shared with verification), the drafter cache against a fresh prefill, and clear
mismatch errors."""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, decode, sampling
from specjax.config import ModelConfig
from specjax.drafters import dflash
from specjax.drafters.base import Context, Prefill
from specjax.io import layout, official
from specjax.kernels import cpu_gemm
from specjax.drafters.dflash import BlockChain, DDTree, DFlashConfig, DFlashDrafter, SampledBlock
from specjax.models import target
from specjax.targets import DecoderTarget

import dflash_reference
from laws import PARAMS8, PROMPT8, TINY8, chi_square_p, exact_transformer_law

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
TGT = DecoderTarget(TINY)
PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 1, 2, 8, 4, 4, 6, 10, 11, 7, 1], [13], [2, 2, 2, 2]]
ROWS = 50_000  # x 4 calls: 200k samples of the joint law of 3 tokens


def _drafter_cfg(cfg=TINY, **kw):
    kw = {"n_layers": 2, "block_size": 6, "mask_token_id": None, "n_taps": 2} | kw
    return DFlashConfig.for_target(cfg, **kw)


CFG = _drafter_cfg()
OWN = dflash.init_params(CFG, 1, scale=0.3)
CFG_TOKEN = dataclasses.replace(_drafter_cfg(n_layers=1), mask_token_id=60,
                                layer_types=("sliding_attention",), sliding_window=8)
OWN_TOKEN = dflash.init_params(CFG_TOKEN, 2, scale=0.3)
# A ranking that puts the ids the random drafter likes last: a draft vocabulary of its top 20
# then misses many of its favourite drafts.
OWN_RANKED = dict(OWN, token_order=jnp.asarray(np.random.default_rng(0).permutation(61),
                                               jnp.int32))

POLICIES = {"chain": (CFG, OWN, BlockChain(), None, None),
            "chain-block-3": (CFG, OWN, BlockChain(), 3, None),
            "sampled": (CFG, OWN, SampledBlock(), None, None),
            "ddtree-8": (CFG, OWN, DDTree(8), None, None),
            "ddtree-16": (CFG, OWN, DDTree(16), None, None),
            "causal-sliding-token-mask": (CFG_TOKEN, OWN_TOKEN, DDTree(6), None, None),
            "chain-vocab-20": (CFG, OWN_RANKED, BlockChain(), None, 20),
            "ddtree-8-vocab-20": (CFG, OWN_RANKED, DDTree(8), None, 20),
            "sampled-vocab-3": (CFG, OWN_RANKED, SampledBlock(), None, 3)}


def test_default_layer_ids_round_half_to_even_as_the_reference():
    assert dflash.default_layer_ids(30, 5) == (1, 8, 14, 20, 27)
    assert dflash.default_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert dflash.default_layer_ids(30, 1) == (15,)
    assert dflash.default_layer_ids(30, 3) == (1, 14, 27)
    assert dflash.default_layer_ids(5, 3) == (1, 2, 2)  # the rule repeats layers of tiny targets
    assert CFG.taps == (2, 3)  # layer outputs are tap ids one above: layers (1, 2) of 5
    assert [dflash.default_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_dflash_equals_plain(policy):
    """Batch 4 with mixed lengths and a stop token for every policy, and batch 1 for a chain
    and a DDTree (the others share their batch-1 code paths): token for token."""
    cfg, own, pol, block, vocab = POLICIES[policy]
    drafter = DFlashDrafter(cfg, TGT, pol, block, vocab)
    dp = dflash.drafter_params(own, PARAMS, target=TGT, vocab=vocab)
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=20)
    stop = plain.tokens[1][8]
    plain_stop = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=20, stop_tokens=[stop])
    cases = [(PROMPTS, plain_stop, [stop])]
    if policy in ("chain", "ddtree-8", "chain-vocab-20"):
        cases.append((PROMPTS[:1], plain, []))
    for prompts, want, stops in cases:
        got = api.generate_tokens(TINY, PARAMS, prompts, max_new_tokens=20, stop_tokens=stops,
                                  drafter=drafter, drafter_params=dp)
        assert got.tokens == want.tokens[: len(prompts)], policy
        assert got.stopped == want.stopped[: len(prompts)]
        assert (got.stats.fallbacks == 0).all()


@pytest.mark.parametrize("policy,bf16_values", [("chain", False), ("ddtree-16", False),
                                                ("ddtree-16", True)])
def test_one_row_copies_draft_as_the_plain_weights_do(policy, bf16_values):
    """A target with one-row copies gets a drafter with them (fc's and every layer's; bfloat16
    ones for weights that are bfloat16 values, where the CPU kernel runs) unless asked for
    none: the same drafts (equal acceptance counts on every row) and the same output as plain
    decoding, batch 4 with mixed lengths."""
    cfg, own, pol, block, vocab = POLICIES[policy]
    if bf16_values:
        own = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), own)
    rows = layout.with_row_weights(PARAMS)
    dp = dflash.drafter_params(own, rows)
    assert "fc_t" in dp["drafter"] and all("w_down_t" in p for p in dp["drafter"]["layers"])
    half = bf16_values and cpu_gemm.available()
    assert dp["drafter"]["fc_t"].dtype == (jnp.bfloat16 if half else jnp.float32)
    assert "fc_t" not in dflash.drafter_params(own, PARAMS)["drafter"]
    plain_dp = dflash.drafter_params(own, rows, row_weights=False)
    assert "fc_t" not in plain_dp["drafter"]
    drafter = DFlashDrafter(cfg, TGT, pol, block, vocab)
    plain = api.generate_tokens(TINY, rows, PROMPTS, max_new_tokens=20)
    got = api.generate_tokens(TINY, rows, PROMPTS, max_new_tokens=20, drafter=drafter,
                              drafter_params=dp)
    ref = api.generate_tokens(TINY, rows, PROMPTS, max_new_tokens=20, drafter=drafter,
                              drafter_params=plain_dp)
    assert got.tokens == plain.tokens == ref.tokens
    assert ref.stats.accept_hist[:, 1:].sum() > 0  # drafts were accepted: they compared
    np.testing.assert_array_equal(got.stats.accept_hist, ref.stats.accept_hist)


def test_the_drafter_cache_equals_a_fresh_prefill_of_the_committed_sequence():
    """After a run the injected context equals what ``init`` injects from scratch on every
    row's final sequence: commit injected exactly the committed positions, in order."""
    drafter = DFlashDrafter(CFG, TGT, DDTree(8))
    dp = dflash.drafter_params(OWN, PARAMS)
    tokens, lengths = api.pad_prompts(PROMPTS)
    sp = sampling.SamplingParams.make(len(PROMPTS), 0.0, 0, 1.0)
    out = decode.speculative_generate(
        PARAMS, dp, jnp.asarray(tokens), jnp.asarray(lengths), sp, jax.random.key(0), target=TGT,
        drafter=drafter, max_new_tokens=17, capacity=64, return_dstate=True)
    cache = out.dstate.cache
    n_gen = np.asarray(out.n_generated)
    seq_len = np.asarray(lengths) + n_gen
    np.testing.assert_array_equal(np.asarray(cache.lengths), seq_len - 1)
    fulls = [p + [int(t) for t in np.asarray(out.tokens)[r, : n_gen[r]]]
             for r, p in enumerate(PROMPTS)]
    seen, seen_len = api.pad_prompts([f[:-1] for f in fulls])
    roots = jnp.asarray([f[-1] for f in fulls], jnp.int32)

    @jax.jit
    def fresh_init(seen, seen_len):
        _, taps, _ = target.prefill(PARAMS, TINY, seen, seen_len, 64, drafter.taps)
        return drafter.init(dp, Prefill(seen, seen_len, taps, roots, 64))

    fresh = fresh_init(jnp.asarray(seen), jnp.asarray(seen_len)).cache
    k = TINY.n_kv_heads
    for layer in range(CFG.layer.n_layers):
        for row, n in enumerate(seq_len - 1):
            rows = slice(row * k, (row + 1) * k)
            for got, want in ((cache.k, fresh.k), (cache.v, fresh.v)):
                want = np.asarray(want[layer][rows, :n])
                np.testing.assert_allclose(np.asarray(got[layer][rows, :n]), want, rtol=1e-5,
                                           atol=1e-5 * np.abs(want).max())


# ------------------------------------------------------------------------------------------
# KV injection against an independent dense formulation.


@pytest.mark.parametrize("cfg, own", [(CFG, OWN), (CFG_TOKEN, OWN_TOKEN)],
                         ids=["full-learned-mask", "causal-token-mask"])
def test_kv_injection_equals_a_dense_formulation(cfg, own):
    drafter = DFlashDrafter(cfg, TGT, BlockChain())
    dp = dflash.drafter_params(own, PARAMS)
    tokens, lengths = api.pad_prompts(PROMPTS[:2])
    prompt, prompt_len = jnp.asarray(tokens), jnp.asarray(lengths)
    _, taps, _ = target.prefill(PARAMS, TINY, prompt, prompt_len, 32, drafter.taps)
    roots = jnp.asarray([17, 23], jnp.int32)
    state = drafter.init(dp, Prefill(prompt, prompt_len, taps, roots, 32))
    got = np.asarray(drafter.block_logits(dp, state, roots))  # [2, Bk - 1, V]
    emb = dflash.embed_block(cfg, TGT, dp, roots, cfg.block_size)
    lc = cfg.layer
    for row in range(2):
        states = dflash_reference.block_states(
            dict(official.dflash_tensors(cfg, own)), n_layers=lc.n_layers, n_heads=lc.n_heads,
            n_kv_heads=lc.n_kv_heads, head_dim=lc.head_dim, eps=lc.norm_eps,
            theta=lc.rope_theta, taps=np.asarray(taps[row, : int(lengths[row])]),
            block_emb=np.asarray(emb[row]), causal=cfg.causal, window=cfg.window)
        want = np.asarray(TGT.lm_head(PARAMS, jnp.asarray(states, jnp.float32)))
        np.testing.assert_allclose(got[row], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("cfg, own", [(CFG, OWN), (CFG_TOKEN, OWN_TOKEN)],
                         ids=["full-learned-mask", "causal-token-mask"])
def test_a_deepened_drafter_drafts_exactly_as_the_shallow_one(cfg, own):
    """``deepen`` appends copies of the last layer whose output projections are zero: the
    block logits after a prefill are the shallow drafter's; fewer layers are refused."""
    n = cfg.layer.n_layers
    deep_cfg, deep = dflash.deepen(cfg, own, n + 2)
    dflash.check_params(deep_cfg, deep)
    assert deep_cfg.types == cfg.types + (cfg.types[-1],) * 2
    for new in deep["layers"][n:]:
        assert not np.any(np.asarray(new["wo"])) and not np.any(np.asarray(new["w_down"]))
        np.testing.assert_array_equal(new["wqkv"], own["layers"][-1]["wqkv"])
    tokens, lengths = api.pad_prompts(PROMPTS)
    prompt, prompt_len = jnp.asarray(tokens), jnp.asarray(lengths)
    roots = jnp.asarray([17, 23, 5, 40], jnp.int32)

    def block_logits(cfg, own):
        drafter = DFlashDrafter(cfg, TGT, BlockChain())
        dp = dflash.drafter_params(own, PARAMS)
        _, taps, _ = target.prefill(PARAMS, TINY, prompt, prompt_len, 32, drafter.taps)
        state = drafter.init(dp, Prefill(prompt, prompt_len, taps, roots, 32))
        return np.asarray(drafter.block_logits(dp, state, roots))

    want = block_logits(cfg, own)
    np.testing.assert_allclose(block_logits(deep_cfg, deep), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match=f"of {n + 2} layers cannot be deepened to {n}"):
        dflash.deepen(deep_cfg, deep, n)


# ------------------------------------------------------------------------------------------
# DDTree against a heap walk of the reference algorithm.


def test_a_draft_vocabulary_scores_its_ids_as_the_full_head_does():
    """Block logits over a draft vocabulary are the full head's at those ids (in ascending id
    order), and its proposals are target ids from that vocabulary."""
    vocab = 20
    ids = np.sort(np.asarray(OWN_RANKED["token_order"])[:vocab])
    full = DFlashDrafter(CFG, TGT, DDTree(8))
    small = DFlashDrafter(CFG, TGT, DDTree(8), vocab=vocab)
    dp_full = dflash.drafter_params(OWN_RANKED, PARAMS)
    dp_small = dflash.drafter_params(OWN_RANKED, PARAMS, target=TGT, vocab=vocab)
    np.testing.assert_array_equal(np.asarray(dp_small["head"]["ids"]), ids)
    tokens, lengths = api.pad_prompts(PROMPTS)
    _, taps, _ = target.prefill(PARAMS, TINY, jnp.asarray(tokens), jnp.asarray(lengths), 32,
                                full.taps)
    roots = jnp.asarray([3, 7, 11, 2], jnp.int32)
    state = full.init(dp_full, Prefill(jnp.asarray(tokens), jnp.asarray(lengths), taps, roots, 32))
    want = np.asarray(full.block_logits(dp_full, state, roots))[..., ids]
    got = np.asarray(small.block_logits(dp_small, state, roots))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    seq = np.pad(tokens, ((0, 0), (0, 1)))
    seq[np.arange(len(PROMPTS)), lengths] = np.asarray(roots)
    ctx = Context(jnp.asarray(seq), jnp.asarray(lengths) + 1,
                  sampling.SamplingParams.make(len(PROMPTS), 0.0, 0, 1.0))
    proposal, _ = small.propose(dp_small, state, ctx, jax.random.key(0))
    assert np.isin(np.asarray(proposal.tokens)[:, 1:], ids).all()
    unrestricted, _ = full.propose(dp_full, state, ctx, jax.random.key(0))
    assert not np.isin(np.asarray(unrestricted.tokens)[:, 1:], ids).all()


def _reference_ddtree(logp, budget):
    """The reference's best-first heap on per-depth log-probs [Dp, V], in plain Python:
    (tokens, parents) of ``budget`` nodes in emission order."""
    dp, v = logp.shape
    k = min(budget, v)
    order = [sorted(range(v), key=lambda t: -logp[d][t])[:k] for d in range(dp)]
    heap = [(-logp[0][order[0][0]], (0,), 0, 1, 0, logp[0][order[0][0]])]
    tokens, parents = [], [-1]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        tokens.append(order[depth - 1][rank])
        parents.append(parent)
        me = len(tokens)
        if rank + 1 < k:
            w = logw - logp[depth - 1][order[depth - 1][rank]] + logp[depth - 1][order[depth - 1][rank + 1]]
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < dp:
            w = logw + logp[depth][order[depth][0]]
            heapq.heappush(heap, (-w, ranks + (0,), me, depth + 1, 0, w))
    return tokens, parents


@pytest.mark.parametrize("depths, vocab, n_nodes", [(5, 12, 10), (3, 6, 17), (7, 40, 33)])
def test_ddtree_matches_the_reference_heap(depths, vocab, n_nodes):
    rng = np.random.default_rng(depths * 100 + vocab)
    logp = np.log(rng.dirichlet(np.full(vocab, 0.3), size=(2, depths))).astype(np.float32)
    tokens, parents, depth, score = dflash.ddtree(jnp.asarray(logp), n_nodes)
    for row in range(2):
        want_tokens, want_parents = _reference_ddtree(logp[row].astype(np.float64), n_nodes - 1)
        assert np.asarray(tokens[row]).tolist() == want_tokens
        assert np.asarray(parents[row]).tolist() == want_parents
        par = want_parents
        want_depth = [0] * n_nodes
        want_score = [0.0] * n_nodes  # each node's path log-probability
        for i in range(1, n_nodes):
            want_depth[i] = want_depth[par[i]] + 1
            want_score[i] = want_score[par[i]] + logp[row, want_depth[i] - 1, want_tokens[i - 1]]
        assert np.asarray(depth[row]).tolist() == want_depth
        np.testing.assert_allclose(score[row], want_score, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# The sampled block's real q, end to end, on an 8-token target with an exact law.


@dataclasses.dataclass(frozen=True)
class LyingDrafter(DFlashDrafter):
    """Reports a q flattened toward uniform instead of the one its drafts were drawn from."""

    def propose(self, params, state, ctx, rng):
        proposal, state = super().propose(params, state, ctx, rng)
        return dataclasses.replace(proposal, draft_logits=0.25 * proposal.draft_logits), state


@dataclasses.dataclass(frozen=True)
class NoiseSharingDrafter(DFlashDrafter):
    """Draws node i's token with the very uniform verification tests node i with (the loop is
    patched to hand both the same key): the bug of draft noise reused by verification."""

    def propose(self, params, state, ctx, rng):
        proposal, state = super().propose(params, state, ctx, rng)
        b, n = proposal.tokens.shape
        u = jax.random.uniform(rng, (b, n + 1))[:, 1:n]  # verification's u of nodes 1..N-1
        probs = jnp.exp(sampling.log_probs(proposal.draft_logits[:, :-1], ctx.sp))
        drawn = jax.vmap(sampling.inverse_cdf_sample, in_axes=1, out_axes=1)(u, probs)
        return dataclasses.replace(proposal, tokens=proposal.tokens.at[:, 1:].set(drawn)), state


def _sampled_block_samples(cls, temperature, top_k, top_p, seeds=4, vocab=None):
    cfg = DFlashConfig.for_target(TINY8, n_layers=1, block_size=4, target_layer_ids=(0, 1))
    own = dflash.init_params(cfg, 3, scale=1.5)
    own["token_order"] = jnp.asarray([6, 1, 4, 0, 7, 2, 3, 5], jnp.int32)
    tgt = DecoderTarget(TINY8)
    drafter = cls(cfg, tgt, SampledBlock(), vocab=vocab)
    sp = sampling.SamplingParams.make(ROWS, temperature, top_k, top_p)
    prompt = jnp.tile(jnp.asarray(PROMPT8, jnp.int32), (ROWS, 1))
    samples, accepted = [], 0
    for seed in range(seeds):
        out = decode.speculative_generate(
            PARAMS8, dflash.drafter_params(own, PARAMS8, target=tgt, vocab=vocab), prompt,
            jnp.full((ROWS,), 2, jnp.int32),
            sp, jax.random.key(seed), target=tgt, drafter=drafter, max_new_tokens=3, capacity=16)
        samples.append(np.asarray(out.tokens))
        accepted += int(out.stats.accepted.sum())
    return np.concatenate(samples), accepted


@pytest.mark.parametrize("temperature, top_k, top_p, vocab",
                         [(1.0, 0, 1.0, None), (0.7, 5, 0.9, None), (1.0, 0, 1.0, 5)])
def test_sampled_block_preserves_the_target_law(temperature, top_k, top_p, vocab):
    """Per-position draws with their marginals as q sample the exact law of plain sampling,
    over the whole vocabulary or 5 of its 8 ids: chi-square on 200k samples, alpha = 0.001."""
    samples, accepted = _sampled_block_samples(DFlashDrafter, temperature, top_k, top_p,
                                               vocab=vocab)
    assert accepted > len(samples) // 20
    assert chi_square_p(samples, exact_transformer_law(temperature, top_k, top_p)) > 1e-3


def test_the_law_test_has_power_against_a_misreported_q():
    samples, _ = _sampled_block_samples(LyingDrafter, 1.0, 0, 1.0)
    assert chi_square_p(samples, exact_transformer_law(1.0, 0, 1.0)) < 1e-3


def test_the_loop_never_hands_verification_the_draft_noise(monkeypatch):
    """The loop's draft and verify keys differ, and the law test catches a loop that shares
    them with a drafter drawing from the same stream verification reads."""
    draft_key, verify_key = decode.cycle_keys(jax.random.key(0), jnp.int32(3))
    assert not np.array_equal(jax.random.key_data(draft_key), jax.random.key_data(verify_key))
    monkeypatch.setattr(decode, "cycle_keys", lambda rng, cycle: (
        jax.random.fold_in(rng, cycle + 1),) * 2)
    decode.speculative_generate.clear_cache()
    try:
        samples, _ = _sampled_block_samples(NoiseSharingDrafter, 1.0, 0, 1.0, seeds=2)
    finally:
        decode.speculative_generate.clear_cache()
    assert chi_square_p(samples, exact_transformer_law(1.0, 0, 1.0)) < 1e-3


# ------------------------------------------------------------------------------------------
# Mismatches and configs.


def test_mismatched_target_is_refused_with_a_clear_error():
    other = TINY.replace(vocab_size=64)
    drafter = DFlashDrafter(CFG, DecoderTarget(other))
    with pytest.raises(ValueError, match="vocabulary of 61 ids, the target has 64"):
        api.generate_tokens(other, target.init_params(other), PROMPTS, max_new_tokens=4,
                            drafter=drafter, drafter_params=dflash.drafter_params(OWN, PARAMS))
    wide = TINY.replace(d_model=48)
    with pytest.raises(ValueError, match="width is 32, the target's hidden size is 48"):
        DFlashDrafter(CFG, DecoderTarget(wide)).check_target(DecoderTarget(wide))
    shallow = TINY.replace(n_layers=2)
    with pytest.raises(ValueError, match=r"taps target layers \[1, 2\], the target has "
                                         r"layers 0..1"):
        DFlashDrafter(CFG, DecoderTarget(shallow)).check_target(DecoderTarget(shallow))


def test_bad_params_and_configs_name_the_problem():
    with pytest.raises(ValueError, match=r"param fc has shape \(64, 16\), expected \(64, 32\)"):
        dflash.check_params(CFG, dict(OWN, fc=OWN["fc"][:, :16]))
    with pytest.raises(ValueError, match=r"lack \['mask_embedding'\]"):
        dflash.check_params(CFG, {k: v for k, v in OWN.items() if k != "mask_embedding"})
    with pytest.raises(ValueError, match="beyond the target's layers 0..4"):
        DFlashConfig.for_target(TINY, target_layer_ids=(1, 5))
    with pytest.raises(ValueError, match="mask_token_id 61 is outside the target vocabulary"):
        DFlashConfig.for_target(TINY, mask_token_id=61)
    with pytest.raises(ValueError, match="sliding_window >= block_size"):
        dataclasses.replace(CFG_TOKEN, sliding_window=4)
    with pytest.raises(ValueError, match="carries no token_order"):
        dflash.drafter_params(OWN, PARAMS, target=TGT, vocab=20)
    with pytest.raises(ValueError, match="pass target="):
        dflash.drafter_params(OWN_RANKED, PARAMS, vocab=20)
    with pytest.raises(ValueError, match=r"draft vocabulary size 62 must be in \[1, 61\]"):
        dflash.drafter_params(OWN_RANKED, PARAMS, target=TGT, vocab=62)
    with pytest.raises(ValueError, match=r"vocabulary of 0 ids must be in \[1, 61\]"):
        DFlashDrafter(CFG, TGT, vocab=0)
    drafter = DFlashDrafter(CFG, TGT, vocab=20)
    with pytest.raises(ValueError, match=r"build its params with dflash.drafter_params\(\.\.\., "
                                         r"vocab=20\)"):
        api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=4, drafter=drafter,
                            drafter_params=dflash.drafter_params(OWN_RANKED, PARAMS))
    twice = dict(OWN, token_order=jnp.zeros((61,), jnp.int32))
    with pytest.raises(ValueError, match="does not rank each of the 61 ids exactly once"):
        dflash.check_params(CFG, twice)
    with pytest.raises(ValueError, match=r"token_order has shape \(60,\)"):
        dflash.check_params(CFG, dict(OWN, token_order=jnp.arange(60)))
