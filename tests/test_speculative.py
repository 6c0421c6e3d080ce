"""The speculative loop: greedy losslessness for every drafter and budget, the sampled law of
the whole loop, a foreign target and drafter, fallbacks, and one compile with one while loop."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from specjax import api, decode, sampling
from specjax.config import ModelConfig
from specjax.drafters.base import FunctionDrafter, Proposal, chain_parents
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models import cache as cache_lib
from specjax.models import target
from specjax.targets import DecoderTarget

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
# Mixed lengths; repetition inside the prompts gives the n-gram drafter something to find.
PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 1, 2, 8, 4, 4, 6, 10, 11, 7, 1], [13], [2, 2, 2, 2]]
NEAR_TIE = 1e-4  # a top-2 logit gap below this may flip between a 1-token and an N-token pass


def _drafters(budget):
    """(name, drafter, drafter params) for every drafter at a verify budget of N nodes."""
    out = [("ngram-chain", NgramDrafter.for_budget(budget), None)]
    if budget >= 4:
        out.append(("ngram-tree", NgramDrafter.for_budget(budget, branches=3), None))
    if budget >= 2:
        draft, dp = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=budget - 1)
        out.append(("draft-model", draft, dp))
    return out


def _assert_same_or_near_tie(prompt, got, want):
    """``got == want``, or they part at a step where the target's top two logits nearly tie
    (then the rest is incomparable). Returns whether a near-tie divergence occurred."""
    if got == want:
        return False
    k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    seq = jnp.array([prompt + want[:k]])
    logits, _, _ = target.forward(PARAMS, TINY, seq, jnp.arange(seq.shape[1])[None],
                                  cache_lib.init_cache(TINY, 1, seq.shape[1]))
    top2 = jnp.sort(logits[0, -1])[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < NEAR_TIE, f"diverged at token {k} with top-2 gap {gap}: {got} vs {want}"
    return True


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_speculative_equals_plain_for_every_drafter(budget):
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=24)
    stop = plain.tokens[1][9]  # ends row 1 (and any row that emits it) mid-run
    plain_stop = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=24, stop_tokens=[stop])
    for name, drafter, dp in _drafters(budget):
        # Batch 4 (mixed lengths, a stop token) always; batch 1 once per drafter kind, since
        # every configuration costs a compile.
        cases = [(PROMPTS, plain_stop, [stop])] + ([(PROMPTS[:1], plain, [])] if budget == 16 else [])
        for prompts, ref, stops in cases:
            got = api.generate_tokens(TINY, PARAMS, prompts, max_new_tokens=24, stop_tokens=stops,
                                      drafter=drafter, drafter_params=dp)
            for row, prompt in enumerate(prompts):
                _assert_same_or_near_tie(prompt, got.tokens[row], ref.tokens[row])
            assert got.stopped == ref.stopped[: len(prompts)], name
            assert (got.stats.fallbacks == 0).all(), name


def test_drafts_are_actually_accepted():
    """Losslessness alone would pass with a drafter that never helps; these must."""
    drafter, dp = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=4)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=32, drafter=drafter,
                              drafter_params=dp)
    assert got.tau > 1.3, got.tau
    hist = got.stats.accept_hist
    assert (hist.sum(1) == got.stats.cycles).all()
    assert (hist @ np.arange(hist.shape[1]) == got.stats.accepted).all()
    # Greedy decoding of a bigram target falls into a cycle, which prompt lookup then predicts.
    out = decode.speculative_generate(
        P_TABLE, None, jnp.array([[3, 1]]), jnp.array([2]), sampling.SamplingParams.make(1),
        jax.random.key(0), target=BigramTarget(), drafter=NgramDrafter(draft_len=4),
        max_new_tokens=40, capacity=64)
    cycles, accepted = int(out.stats.cycles[0]), int(out.stats.accepted[0])
    assert (accepted + cycles) / cycles > 2.5


def test_max_new_tokens_is_exact_inside_accepted_runs():
    drafter = NgramDrafter(draft_len=6)
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=13)
    for n in (1, 5, 13):
        got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=n, drafter=drafter)
        # Greedy decoding limited to n tokens is the first n of a longer greedy run.
        assert got.tokens == [t[:n] for t in plain.tokens]


def test_mixed_batch_greedy_rows_stay_greedy():
    drafter, dp = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=3)
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=16)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=16, drafter=drafter,
                              drafter_params=dp, temperature=[0.0, 1.0, 0.0, 0.7], top_k=[0, 8, 0, 0],
                              top_p=[1.0, 1.0, 1.0, 0.9], seed=5)
    assert got.tokens[0] == plain.tokens[0]
    assert got.tokens[2] == plain.tokens[2]


def _bad_drafter(kind):
    """A drafter whose proposals are unusable: out-of-range tokens or NaN scores."""
    def propose(params, dstate, ctx, rng):
        b = ctx.seq.shape[0]
        tokens = jnp.concatenate([ctx.root[:, None], jnp.full((b, 3), 5, jnp.int32)], 1)
        logits = jnp.zeros((b, 4, TINY.vocab_size))
        if kind == "token":
            tokens = tokens.at[:, 2].set(TINY.vocab_size + 7)
        else:
            logits = logits.at[:, 1, 3].set(jnp.nan)
        return Proposal(tokens, chain_parents(b, 4), jnp.ones((b, 4), bool), logits), dstate

    return FunctionDrafter(propose, n_nodes=4, max_depth=3)


@pytest.mark.parametrize("kind", ["token", "nan"])
def test_unusable_proposals_fall_back_to_plain_decoding(kind):
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=8)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=8, drafter=_bad_drafter(kind))
    assert got.tokens == plain.tokens
    assert (got.stats.fallbacks == got.stats.cycles).all() and (got.stats.cycles == 7).all()


def test_one_compile_and_a_single_while_loop():
    api._COMPILED.clear()
    drafter = NgramDrafter(draft_len=3)
    a = api.generate_tokens(TINY, PARAMS, [[1, 2, 3, 1, 2], [4]], max_new_tokens=6, drafter=drafter)
    b = api.generate_tokens(TINY, PARAMS, [[9, 9, 9], [4, 5, 6, 7]], max_new_tokens=6,
                            drafter=drafter, temperature=0.8)
    assert a.compile_s > 0 and b.compile_s == 0 and len(api._COMPILED) == 1
    prompt, lengths = api.pad_prompts([[1, 2, 3]])
    jaxpr = str(jax.make_jaxpr(lambda *a: decode.speculative_generate(
        *a, target=DecoderTarget(TINY), drafter=drafter, max_new_tokens=6, capacity=64))(
        PARAMS, None, prompt, lengths, sampling.SamplingParams.make(1), jax.random.key(0)))
    assert jaxpr.count("while[") == 1
    assert "callback" not in jaxpr


# ----------------------------------------------------------------------------------------------
# A foreign stack: target and drafter written here as plain jnp functions.

V_SMALL = 8


@dataclasses.dataclass(frozen=True)
class BigramTarget:
    """A stateless target whose next-token logits depend only on the current token."""

    vocab_size: int = V_SMALL

    def prefill(self, table, prompt, prompt_len, capacity, taps=()):
        last = jnp.take_along_axis(prompt, (prompt_len - 1)[:, None], axis=1)[:, 0]
        return table[last], jnp.zeros(prompt.shape + (0, 1)), ()

    def forward(self, table, tokens, positions, cache, mask, taps=()):
        return table[tokens], jnp.zeros(tokens.shape + (0, 1)), cache

    def commit(self, cache, path, n_keep):
        return cache


def _foreign_chain_propose(q_table, dstate, ctx, rng):
    """Draws a 3-token chain from a bigram draft table, returning the real q at each node."""
    b = ctx.seq.shape[0]
    tokens, logits, tok = [ctx.root], [], ctx.root
    for key in jax.random.split(rng, 3):
        lg = q_table[tok]
        logp = sampling.log_probs(lg, ctx.sp)
        tok = jax.vmap(jax.random.categorical)(jax.random.split(key, b), logp).astype(jnp.int32)
        tok = jnp.where(ctx.sp.greedy, jnp.argmax(lg, -1), tok)
        tokens.append(tok)
        logits.append(lg)
    logits.append(jnp.zeros_like(logits[0]))
    return Proposal(jnp.stack(tokens, 1), chain_parents(b, 4), jnp.ones((b, 4), bool),
                    jnp.stack(logits, 1)), dstate


FOREIGN = FunctionDrafter(_foreign_chain_propose, n_nodes=4, max_depth=3)
P_TABLE = jnp.asarray(np.random.default_rng(0).normal(0, 1.5, (V_SMALL, V_SMALL)), jnp.float32)
# An adversarial draft: far from p, and with zeros where p has mass.
Q_TABLE = jnp.asarray(np.random.default_rng(1).normal(0, 3.0, (V_SMALL, V_SMALL)), jnp.float32
                      ).at[:, :3].set(-jnp.inf)


def _exact_law(temperature, top_k, top_p, first, n):
    """The exact law of the first n generated tokens under plain sampling of the bigram target."""
    sp = sampling.SamplingParams.make(V_SMALL, temperature, top_k, top_p)
    cond = np.exp(np.asarray(sampling.log_probs(P_TABLE, sp), np.float64))  # [V, V]
    cond /= cond.sum(1, keepdims=True)  # p(next | current), exactly normalised in float64
    law = {}
    for seq in itertools.product(range(V_SMALL), repeat=n):
        prob, cur = 1.0, first
        for t in seq:
            prob *= cond[cur, t]
            cur = t
        law[seq] = prob
    return law


def _chi_square_p(samples: np.ndarray, law: dict) -> float:
    """p-value of a chi-square goodness-of-fit test, pooling cells expected below 5."""
    n = samples.shape[0]
    codes = samples @ (V_SMALL ** np.arange(samples.shape[1])[::-1])
    counts = np.bincount(codes, minlength=V_SMALL ** samples.shape[1])
    expected = np.array([law[s] for s in itertools.product(range(V_SMALL), repeat=samples.shape[1])]) * n
    assert counts[expected == 0].sum() == 0, "a sequence of probability 0 was generated"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    return float(sps.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def _sample_foreign(drafter, q_table, temperature, top_k, top_p, rows, seed):
    """First 3 tokens of ``rows`` independent generations after the prompt [3, 3]; the sampling
    controls are scalars or per-row sequences."""
    sp = sampling.SamplingParams.make(rows, temperature, top_k, top_p)
    prompt = jnp.full((rows, 2), 3, jnp.int32)
    out = decode.speculative_generate(
        P_TABLE, q_table, prompt, jnp.full((rows,), 2, jnp.int32), sp, jax.random.key(seed),
        target=BigramTarget(), drafter=drafter, max_new_tokens=3, capacity=16)
    return np.asarray(out.tokens)


def _greedy_chain(first, n):
    cur, out = first, []
    for _ in range(n):
        cur = int(jnp.argmax(P_TABLE[cur]))
        out.append(cur)
    return out


ROWS = 50_000  # x 5 calls, 4 of 5 rows sampled: 200k samples of the joint law of 3 tokens


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_foreign_stack_preserves_the_target_law(temperature, top_k, top_p):
    """The whole loop, driven by a target and a drafter that use no specjax model code, samples
    the exact law of plain sampling (chi-square, 200k samples, alpha = 0.001). Every fifth row
    is greedy: those must give the argmax chain, and must not disturb the sampled rows."""
    greedy = np.arange(ROWS) % 5 == 0
    temps = np.where(greedy, 0.0, temperature)
    law = _exact_law(temperature, top_k, top_p, first=3, n=3)
    samples = np.concatenate([_sample_foreign(FOREIGN, Q_TABLE, temps, top_k, top_p, ROWS, seed)
                              for seed in range(5)])
    is_greedy = np.tile(greedy, 5)
    assert (samples[is_greedy] == np.array(_greedy_chain(3, 3))).all()
    assert (~is_greedy).sum() == 200_000
    assert _chi_square_p(samples[~is_greedy], law) > 1e-3


def test_the_law_test_has_power_against_a_lying_drafter():
    """A drafter that reports a q other than the one it sampled from breaks losslessness; the
    same test must reject it (seen: p-value ~0)."""
    def lying(q_table, dstate, ctx, rng):
        proposal, dstate = _foreign_chain_propose(q_table, dstate, ctx, rng)
        return dataclasses.replace(proposal, draft_logits=jnp.zeros_like(proposal.draft_logits)), dstate

    law = _exact_law(1.0, 0, 1.0, first=3, n=3)
    samples = np.concatenate([_sample_foreign(FunctionDrafter(lying, 4, 3), Q_TABLE, 1.0, 0,
                                              1.0, ROWS, seed) for seed in range(4)])
    assert _chi_square_p(samples, law) < 1e-3


def test_foreign_stack_greedy_equals_argmax_chain():
    got = _sample_foreign(FOREIGN, Q_TABLE, 0.0, 0, 1.0, 3, seed=0)
    assert (got == np.array(_greedy_chain(3, 3))).all()
