"""The speculative loop: greedy losslessness for every drafter and budget, the sampled law of
the whole loop, a foreign target and drafter, fallbacks, and one compile with one while loop."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from specjax import api, decode, harness, sampling
from specjax.config import ModelConfig
from specjax.drafters.base import FunctionDrafter, Proposal, chain_parents
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models import target
from specjax.models.cache import init_cache
from specjax.targets import DecoderTarget
from specjax.tree import StaticTree

from laws import PARAMS8, PROMPT8, TINY8, V_SMALL, chi_square_p, exact_transformer_law

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
# Mixed lengths; repetition inside the prompts gives the n-gram drafter something to find.
PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 1, 2, 8, 4, 4, 6, 10, 11, 7, 1], [13], [2, 2, 2, 2]]
NEAR_TIE = 1e-4  # a top-2 logit gap below this may flip between a 1-token and an N-token pass


@dataclasses.dataclass(frozen=True)
class OracleTreeDrafter:
    """Drafts a static binary tree around a known greedy continuation (its params, [B, T]).

    Row b, having generated g tokens, has one "good" child rank per depth d: rank 0 at every
    depth when ``g % 3 == 0`` (the spine, the deepest path of a truncated tree), rank 1 at
    depth 1 and rank 0 below when ``g % 3 == 1``, and ``(g + d) % 2`` otherwise; at depths
    where ``(g + d) % 5 == 0`` no child is good. The node reached from the root through good
    ranks only carries the true next token ``ref[b, g + d - 1]``, every other node a wrong
    one. So accepted paths run through first and second children alike and end at varying
    depths: the commit of non-contiguous tree paths, deep acceptance and early rejection are
    all exercised, while the output must stay the plain greedy one. Any tree budget works (a
    BFS prefix of a binary tree).
    """

    static_tree: StaticTree
    idle_every: int = 0  # when > 0, every idle_every-th cycle proposes nothing in any row
    taps: tuple[int, ...] = ()

    @property
    def n_nodes(self):
        return self.static_tree.n_nodes

    @property
    def max_depth(self):
        return self.static_tree.max_depth

    def check_target(self, target):
        """Any target: the drafts come from the known continuation."""

    def init(self, ref, prefill):
        return prefill.prompt_len, jnp.int32(0)  # and the cycle count

    def propose(self, ref, dstate, ctx, rng):
        prompt_len, cycle = dstate
        parents = np.asarray(self.static_tree.parents)
        depth = np.asarray(self.static_tree.depth)
        n, dmax = parents.size, max(self.max_depth, 1)
        rank = np.zeros(n, np.int32)  # a node's rank among its siblings
        ranks = np.full((n, dmax + 1), -1, np.int32)  # ranks[i, d]: rank of i's ancestor at depth d
        for i in range(1, n):
            rank[i] = sum(parents[j] == parents[i] for j in range(1, i))
            ranks[i] = ranks[parents[i]]
            ranks[i, depth[i]] = rank[i]
        b = ctx.seq.shape[0]
        g = (ctx.seq_len - prompt_len)[:, None, None]  # [B, 1, 1] tokens generated so far
        d = np.arange(dmax + 1)[None, None, :]
        kind = g % 3
        good_rank = jnp.where(kind == 0, 0, jnp.where(kind == 1, (d == 1).astype(jnp.int32),
                                                      (g + d) % 2))
        good_rank = jnp.where((g + d) % 5 == 0, -2, good_rank)  # [B, 1, D + 1]
        on_path = (ranks[None] == -1) | (ranks[None] == good_rank)  # [B, N, D + 1]
        good = jnp.all(on_path | (d > depth[None, :, None]), axis=-1)  # [B, N]
        idx = jnp.clip(g[:, :, 0] + depth[None, :] - 1, 0, ref.shape[1] - 1)  # [B, N]
        right = jnp.take_along_axis(ref, idx, axis=1)
        wrong = (right + 1 + rank[None, :]) % TINY.vocab_size
        tokens = jnp.where(good, right, wrong).at[:, 0].set(ctx.root)
        idle = self.idle_every > 0 and (cycle + 1) % max(self.idle_every, 1) == 0
        valid = (jnp.arange(n) == 0) | ~idle
        return Proposal(tokens, jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n)),
                        jnp.broadcast_to(valid, (b, n))), (prompt_len, cycle + 1)

    def commit(self, ref, dstate, ctx, accepted):
        return dstate


def _drafters(budget, ref):
    """(name, drafter, drafter params) for every drafter at a verify budget of N nodes; ``ref``
    [B, T] is the plain greedy continuation the oracle tree drafts around."""
    out = [("ngram-chain", NgramDrafter.for_budget(budget), None),
           ("oracle-tree", OracleTreeDrafter(StaticTree.kary(2, 6).truncate(budget)), ref)]
    if budget >= 4:
        out.append(("ngram-tree", NgramDrafter.for_budget(budget, branches=3), None))
    if budget >= 2:
        draft, dp = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=budget - 1)
        out.append(("draft-model", draft, dp))
    return out


def _ref_array(result):
    """Generated tokens of a plain run as a [B, max_new_tokens] array, padded with 0."""
    width = max(map(len, result.tokens))
    return jnp.asarray([t + [0] * (width - len(t)) for t in result.tokens], jnp.int32)


def _assert_same_or_near_tie(prompt, got, want):
    """``got == want``, or they part at a step where the target's top two logits nearly tie
    (then the rest is incomparable). Returns whether a near-tie divergence occurred."""
    part = api.divergence(TINY, PARAMS, prompt, got, want)
    if part is None:
        return False
    k, gap = part
    assert gap < NEAR_TIE, f"diverged at token {k} with top-2 gap {gap}: {got} vs {want}"
    return True


def test_divergence_gives_the_first_differing_token_and_the_top2_gap_there():
    prompt = PROMPTS[1]
    plain = api.generate_tokens(TINY, PARAMS, [prompt], max_new_tokens=6).tokens[0]
    assert api.divergence(TINY, PARAMS, prompt, plain, plain) is None
    got = plain[:3] + [(plain[3] + 1) % TINY.vocab_size] + plain[4:]
    k, gap = api.divergence(TINY, PARAMS, prompt, got, plain)
    # One pass over the whole sequence: its logits after prompt + plain[:3].
    seq = jnp.array([prompt + plain])
    logits = target.forward(PARAMS, TINY, seq, jnp.arange(seq.shape[1])[None],
                            init_cache(TINY, 1, seq.shape[1]))[0][0, len(prompt) + 2]
    top2 = np.sort(np.asarray(logits))[-2:]
    assert int(np.argmax(logits)) == plain[3]
    assert k == 3 and gap == pytest.approx(top2[1] - top2[0], abs=1e-5) and gap > 0
    # A generation that stops short parts where the shorter one ends.
    assert api.divergence(TINY, PARAMS, prompt, plain[:4], plain)[0] == 4


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_speculative_equals_plain_for_every_drafter(budget):
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=24)
    stop = plain.tokens[1][9]  # ends row 1 (and any row that emits it) mid-run
    plain_stop = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=24, stop_tokens=[stop])
    assert any(stop not in t for t in plain.tokens), "the stop token must spare some row"
    ref = _ref_array(plain)
    for name, drafter, dp in _drafters(budget, ref):
        # Batch 4 (mixed lengths, a stop token) and batch 1 (no stop token).
        cases = [(PROMPTS, plain_stop, [stop], dp), (PROMPTS[:1], plain, [], dp)]
        if name == "oracle-tree":
            cases[1] = (PROMPTS[:1], plain, [], ref[:1])
        for prompts, want, stops, params in cases:
            got = api.generate_tokens(TINY, PARAMS, prompts, max_new_tokens=24, stop_tokens=stops,
                                      drafter=drafter, drafter_params=params)
            for row, prompt in enumerate(prompts):
                _assert_same_or_near_tie(prompt, got.tokens[row], want.tokens[row])
            assert got.stopped == want.stopped[: len(prompts)], name
            assert (got.stats.fallbacks == 0).all(), name
            if name == "oracle-tree" and budget >= 4:
                # The oracle's good paths are accepted, so this case really ran deep,
                # branching acceptance through commit.
                assert got.tau > 1.5, (budget, got.tau)


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


def test_cycles_without_drafts_score_only_the_roots():
    """Every third cycle no row drafts, so the loop scores only the roots (a one-token pass,
    padded back to the tree); the deep cycles around those stay exact."""
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=20)
    ref = _ref_array(plain)
    drafter = OracleTreeDrafter(StaticTree.kary(2, 6).truncate(16), idle_every=3)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=20, drafter=drafter,
                              drafter_params=ref)
    for row, prompt in enumerate(PROMPTS):
        _assert_same_or_near_tie(prompt, got.tokens[row], plain.tokens[row])
    # A third of the cycles accept nothing (the idle ones); the rest accept deep runs.
    assert (got.stats.accept_hist[:, 0] >= got.stats.cycles // 3).all()
    assert got.tau > 1.5


def test_the_loop_updates_the_cache_in_place():
    """No copy of a cache-sized buffer inside the compiled loop: the verify pass (inside a
    lax.cond between a full and a roots-only pass, or a cost-aware budget's lax.switch over
    widths, or alone where a budget has one width) only reads the cache, and the one write
    of the accepted path after it is in place."""
    cfg = TINY.replace(n_layers=3)
    params = jax.eval_shape(lambda: target.init_params(cfg, 0))
    switch, one_width = harness.Budget((0, 2, 5), (1.0, 1.2, 1.5)), harness.Budget((0,), (1.0,))
    for batch, budget in [(1, None), (2, None), (1, switch), (2, one_width)]:
        prompt, lengths = api.pad_prompts([[1, 2, 3, 1, 2], [4]][:batch])
        hlo = jax.jit(lambda *a: decode.speculative_generate(
            *a, target=DecoderTarget(cfg), drafter=NgramDrafter(draft_len=4), max_new_tokens=16,
            capacity=256, budget=budget)).lower(
                params, None, prompt, lengths, sampling.SamplingParams.make(batch),
                jax.random.key(0)).compile().as_text()
        cache_shape = f"f32[{batch * cfg.n_kv_heads},256,{cfg.head_dim}]"
        # Computations other than the entry (loop bodies, cond branches) must not copy caches.
        inner = hlo[:hlo.index("ENTRY")] + hlo[hlo.index("ENTRY"):].split("\n}\n", 1)[1]
        copies = [line for line in inner.splitlines()
                  if re.search(r"\bcopy\(", line) and cache_shape in line.split("copy(")[0]]
        assert copies == [], (batch, budget, copies[:2])


def test_max_new_tokens_and_stop_tokens_cut_accepted_runs():
    drafter = OracleTreeDrafter(StaticTree.kary(2, 6).truncate(16))
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=13)
    ref = _ref_array(plain)
    for n in (1, 5, 13):
        got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=n, drafter=drafter,
                                  drafter_params=ref)
        # Greedy decoding limited to n tokens is the first n of a longer greedy run.
        assert got.tokens == [t[:n] for t in plain.tokens]
        assert n == 1 or got.stats.accepted.sum() > 0
    # A stop token deep inside a run the oracle gets accepted whole.
    stop = plain.tokens[1][7]
    want = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=13, stop_tokens=[stop])
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=13, stop_tokens=[stop],
                              drafter=drafter, drafter_params=ref)
    assert got.tokens == want.tokens and got.stopped == want.stopped
    assert got.stopped[1] and got.stats.cycles[1] < len(got.tokens[1])


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


class _BackendCompiles:
    """Counts XLA backend compilations (JAX's own monitoring event) inside a ``with`` block."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def _listen(self, event, duration_secs, **kwargs):
        self.count += event == self.EVENT


@pytest.mark.parametrize("kind", ["ngram", "draft-model"])
def test_one_compile_and_a_single_while_loop(kind):
    if kind == "ngram":
        drafter, dp = NgramDrafter(draft_len=3), None
    else:
        drafter, dp = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=3)
    api._COMPILED.clear()
    jax.clear_caches()
    with _BackendCompiles() as first:
        api.generate_tokens(TINY, PARAMS, [[1, 2, 3, 1, 2], [4]], max_new_tokens=6,
                            drafter=drafter, drafter_params=dp)
    # Other prompts of the same bucket, other sampling settings: nothing compiles again.
    with _BackendCompiles() as second:
        api.generate_tokens(TINY, PARAMS, [[9, 9, 9], [4, 5, 6, 7]], max_new_tokens=6,
                            drafter=drafter, drafter_params=dp, temperature=0.8, top_k=[0, 3])
    assert first.count >= 1 and second.count == 0, (first.count, second.count)
    prompt, lengths = api.pad_prompts([[1, 2, 3]])
    jaxpr = str(jax.make_jaxpr(lambda *a: decode.speculative_generate(
        *a, target=DecoderTarget(TINY), drafter=drafter, max_new_tokens=6, capacity=64))(
        PARAMS, dp, prompt, lengths, sampling.SamplingParams.make(1), jax.random.key(0)))
    assert jaxpr.count("while[") == 1
    assert "callback" not in jaxpr


# ----------------------------------------------------------------------------------------------
# A foreign stack: target and drafter written here as plain jnp functions.



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
    assert chi_square_p(samples[~is_greedy], law) > 1e-3


def test_the_law_test_has_power_against_a_lying_drafter():
    """A drafter that reports a q other than the one it sampled from breaks losslessness; the
    same test must reject it (seen: p-value ~0)."""
    def lying(q_table, dstate, ctx, rng):
        proposal, dstate = _foreign_chain_propose(q_table, dstate, ctx, rng)
        return dataclasses.replace(proposal, draft_logits=jnp.zeros_like(proposal.draft_logits)), dstate

    law = _exact_law(1.0, 0, 1.0, first=3, n=3)
    samples = np.concatenate([_sample_foreign(FunctionDrafter(lying, 4, 3), Q_TABLE, 1.0, 0,
                                              1.0, ROWS, seed) for seed in range(4)])
    assert chi_square_p(samples, law) < 1e-3


def test_foreign_stack_greedy_equals_argmax_chain():
    got = _sample_foreign(FOREIGN, Q_TABLE, 0.0, 0, 1.0, 3, seed=0)
    assert (got == np.array(_greedy_chain(3, 3))).all()


def test_foreign_target_gets_the_plain_baseline_through_the_protocol():
    from specjax.targets import Target, fresh_pass

    tgt = BigramTarget()
    assert isinstance(tgt, Target) and fresh_pass(tgt) is None
    sp = sampling.SamplingParams.make(2, 0.0)
    out = decode.generate(P_TABLE, jnp.full((2, 2), 3, jnp.int32), jnp.full((2,), 2, jnp.int32),
                          sp, jax.random.key(0), target=tgt, max_new_tokens=5, capacity=16)
    np.testing.assert_array_equal(np.asarray(out.tokens), [_greedy_chain(3, 5)] * 2)


def _recording_init(params, prefill):
    # (first token seen by init, tokens committed so far, cycles with a running row)
    b = prefill.prompt.shape[0]
    return prefill.first, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)


def _recording_commit(params, dstate, ctx, accepted):
    first, committed, ran = dstate
    return first, committed + accepted.n_committed, ran + (accepted.n_committed > 0)


def test_init_sees_the_first_token_and_accepted_counts_committed_tokens():
    drafter = FunctionDrafter(_foreign_chain_propose, n_nodes=4, max_depth=3,
                              init_fn=_recording_init, commit_fn=_recording_commit)
    rows = 6
    sp = sampling.SamplingParams.make(rows, [0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    prompt = jnp.full((rows, 2), 3, jnp.int32)
    # Stop token 5 ends some rows early, so finished rows sit out later cycles.
    out = decode.speculative_generate(
        P_TABLE, Q_TABLE, prompt, jnp.full((rows,), 2, jnp.int32), sp, jax.random.key(3),
        target=BigramTarget(), drafter=drafter, max_new_tokens=9, capacity=32, stop_tokens=(5,),
        return_dstate=True)
    first, committed, ran = out.dstate
    np.testing.assert_array_equal(first, out.tokens[:, 0])
    # Every generated token after the first was committed in some cycle, none twice.
    np.testing.assert_array_equal(committed, out.n_generated - 1)
    # A running row commits at least one token per cycle: cycles counted by the loop's stats
    # are exactly the cycles in which the row reported n_committed > 0.
    np.testing.assert_array_equal(ran, out.stats.cycles)


BINARY = StaticTree.kary(2, 2)  # the root, two children, four grandchildren


def _foreign_tree_propose(q_table, dstate, ctx, rng, *, real_q=True, lie=False):
    """Drafts BINARY over a bigram draft table, level by level.

    With ``real_q`` every node's two children are i.i.d. draws from ``q(. | node)`` and the
    proposal reports those ``q`` (multi-draft rejection sampling); without it the children are
    the two likeliest tokens under ``q`` and the proposal is deterministic. ``lie`` reports a
    uniform ``q`` instead of the one sampled from, which breaks losslessness.
    """
    b = ctx.seq.shape[0]
    parents = np.asarray(BINARY.parents)
    tokens = [ctx.root]
    for i, key in zip(range(1, BINARY.n_nodes), jax.random.split(rng, BINARY.n_nodes - 1)):
        logp = sampling.log_probs(q_table[tokens[parents[i]]], ctx.sp)  # [B, V]
        if real_q:
            tok = jax.vmap(jax.random.categorical)(jax.random.split(key, b), logp)
        else:
            tok = jax.lax.top_k(logp, 2)[1][:, (i - 1) % 2]
        tokens.append(tok.astype(jnp.int32))
    tokens = jnp.stack(tokens, 1)
    logits = None
    if real_q:
        logits = jnp.zeros_like(q_table[tokens]) if lie else q_table[tokens]  # [B, N, V]
    return Proposal(tokens, jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens.shape),
                    jnp.ones(tokens.shape, bool), logits), dstate


def _tree_drafter(**kw):
    return FunctionDrafter(functools.partial(_foreign_tree_propose, **kw), n_nodes=BINARY.n_nodes,
                           max_depth=BINARY.max_depth, static_tree=BINARY)


@pytest.mark.parametrize("real_q", [True, False], ids=["multi-draft-q", "deterministic"])
def test_tree_rules_in_the_loop_preserve_the_target_law(real_q):
    """Both tree rules, through the whole loop (ragged acceptance, commit, the next cycle),
    sample the exact law of plain sampling: chi-square on 200k samples, alpha = 0.001, with
    top-k and top-p on and a greedy row among every five."""
    greedy = np.arange(ROWS) % 5 == 0
    temps = np.where(greedy, 0.0, 0.7)
    law = _exact_law(0.7, 5, 0.9, first=3, n=3)
    drafter = _tree_drafter(real_q=real_q)
    samples = np.concatenate([_sample_foreign(drafter, Q_TABLE, temps, 5, 0.9, ROWS, seed)
                              for seed in range(5)])
    is_greedy = np.tile(greedy, 5)
    assert (samples[is_greedy] == np.array(_greedy_chain(3, 3))).all()
    assert chi_square_p(samples[~is_greedy], law) > 1e-3


def test_the_tree_law_test_has_power_against_a_lying_drafter():
    law = _exact_law(1.0, 0, 1.0, first=3, n=3)
    drafter = _tree_drafter(lie=True)
    samples = np.concatenate([_sample_foreign(drafter, Q_TABLE, 1.0, 0, 1.0, ROWS, seed)
                              for seed in range(4)])
    assert chi_square_p(samples, law) < 1e-3


# ----------------------------------------------------------------------------------------------
# The draft-model drafter's real q, end to end, on the 8-token transformer of tests/laws.py.

# Gated: every bucket costs 20 plain steps, so each row's first cycle is a probe of 4 nodes
# and the tokens it does not cover come from the gate's run of plain steps.
GATED = harness.Budget((0, 4), (20.0, 20.0), step_s=1.0, draft_s=19.0)


@pytest.mark.parametrize("temperature, top_k, top_p, budget", [
    (1.0, 0, 1.0, None), (0.7, 5, 0.9, None), (1.0, 0, 1.0, GATED)],
    ids=["T1", "T0.7-k5-p0.9", "T1-gated"])
def test_draft_model_in_the_loop_preserves_the_target_law(temperature, top_k, top_p, budget):
    """A one-layer self-draft of a three-layer transformer, drafting chains of 3 with its real
    q, samples the exact law of plain sampling: chi-square on 200k samples, alpha = 0.001;
    also under a gate whose runs of plain steps follow a probe."""
    drafter, dp = DraftModelDrafter.from_target_layers(TINY8, PARAMS8, 1, draft_len=3)
    sp = sampling.SamplingParams.make(ROWS, temperature, top_k, top_p)
    prompt = jnp.tile(jnp.asarray(PROMPT8, jnp.int32), (ROWS, 1))
    samples = []
    for seed in range(4):
        out = decode.speculative_generate(
            PARAMS8, dp, prompt, jnp.full((ROWS,), 2, jnp.int32), sp, jax.random.key(seed),
            target=DecoderTarget(TINY8), drafter=drafter, max_new_tokens=3, capacity=16,
            budget=budget)
        samples.append(np.asarray(out.tokens))
        assert int(out.stats.accepted.sum()) > ROWS // 4  # the drafts do get accepted
        if budget is not None:  # one probe per row, then plain steps
            assert (np.asarray(out.stats.drafted) == 1).all()
            assert int((out.stats.cycles > 1).sum()) > ROWS // 4
    assert chi_square_p(np.concatenate(samples), exact_transformer_law(temperature, top_k,
                                                                         top_p)) > 1e-3
