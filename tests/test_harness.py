"""Cost-aware speculation: the cost model on hand-made tables and confidences (expected tokens
per bucket, the bucket the arithmetic picks, the table's JSON form) and the decoding loop that
uses it (lossless at every bucket, the chosen widths, choices that follow the confidences)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, decode, harness, sampling
from specjax.config import ModelConfig
from specjax.drafters import dflash, eagle
from specjax.drafters.base import CATCH_UP, FunctionDrafter, Proposal, chain_parents
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import DECAY, NgramDrafter
from specjax.models import target
from specjax.targets import DecoderTarget

# Plain step 50 ms; verify 100 / 140 / 180 ms at N = 4 / 8 / 16; drafting 10 / 10 / 20 ms.
TABLE = harness.CostTable(buckets=(0, 4, 8, 16), verify_s=(0.05, 0.10, 0.14, 0.18),
                          draft_s=(0.0, 0.01, 0.01, 0.02), key=dict(model="m", batch=1))


def _chain(a, m=15):
    """Path probabilities of a chain whose every position is accepted with probability a."""
    return np.asarray([[a ** i for i in range(1, m + 1)]], np.float32)


def test_expected_tokens_add_the_first_n_minus_1_path_probabilities():
    probs = np.asarray([[0.9, 0.5, 0.25, 0.1], [0.0, 0.0, 0.0, 0.0]], np.float32)
    got = harness.expected_tokens(probs, (0, 1, 2, 4, 8))
    # bucket 0 and 1: the root only; N = 2: one node; N = 4: three; N = 8: all four there are.
    np.testing.assert_allclose(got, [[1, 1, 1.9, 2.65, 2.75], [1, 1, 1, 1, 1]], rtol=1e-6)


@pytest.mark.parametrize("a, want", [
    # E(4) = 1 + .9 + .81 + .729 = 3.439 -> 31.3 tok/s; E(8) = 5.695 -> 38.0; E(16) = 8.147
    # -> 40.7; plain 20: the largest tree.
    (0.9, 16),
    # E(4) = 2.533 -> 23.0 tok/s beats plain (20), E(8) = 3.141 -> 20.9, E(16) = 3.322 -> 16.6.
    (0.7, 4),
    # E(4) = 2.176 -> 19.8 tok/s, below a plain step's 20.
    (0.6, 0),
    (0.2, 0),
])
def test_choose_bucket_picks_the_most_tokens_per_second(a, want):
    assert TABLE.buckets[int(harness.choose_bucket(_chain(a), TABLE))] == want


def test_choose_bucket_sums_the_rows_one_pass_serves():
    """Rows at 0.2 (alone: plain) and 0.9 (alone: 16): plain 2 / 0.05 = 40 tok/s, N = 16:
    (1.25 + 8.147) / 0.2 = 47.0, the best of the four."""
    probs = np.concatenate([_chain(0.2), _chain(0.9)])
    assert TABLE.buckets[int(harness.choose_bucket(probs, TABLE))] == 16
    jitted = jax.jit(lambda p: harness.choose_bucket(p, TABLE))
    assert int(jitted(probs)) == 3


def test_finished_rows_do_not_pull_the_choice_to_a_plain_step():
    """A finished row emits nothing at any bucket. Counted as a token per bucket, two of them
    would pick a plain step (3 / 0.05 = 60 tok/s against (2 + 2.533) / 0.11 = 41.2) where the
    running row alone picks N = 4 (2.533 / 0.11 = 23.0 tok/s against 20)."""
    probs = np.concatenate([_chain(0.7), np.zeros((2, 15), np.float32)])
    tokens = harness.expected_tokens(probs, TABLE.buckets)
    assert TABLE.buckets[int(harness.best_bucket(tokens, TABLE))] == 0
    running = jnp.asarray([True, False, False])
    assert TABLE.buckets[int(harness.best_bucket(tokens, TABLE, running))] == 4


def test_a_probe_chooses_among_the_drafted_buckets():
    """A chain at 0.6 picks a plain step (19.8 against 20 tok/s); a probe takes the best drafted
    bucket, N = 4 (E(8) = 2.458 -> 16.4 tok/s; E(16) = 2.499 -> 12.5)."""
    tokens = harness.expected_tokens(_chain(0.6), TABLE.buckets)
    pick = jax.jit(lambda t, probe: harness.best_bucket(t, TABLE, drafted=probe))
    assert int(pick(tokens, False)) == 0
    assert TABLE.buckets[int(pick(tokens, True))] == 4


def test_cost_table_json_round_trip_and_errors():
    again = harness.CostTable.from_json(TABLE.to_json())
    assert again == TABLE and again.matches(dict(model="m")) and not again.matches(dict(batch=4))
    assert again.mismatch(dict(model="m", batch=4, dtype="float32")) == {
        "batch": (1, 4), "dtype": (None, "float32")}
    np.testing.assert_allclose(again.cycle_s, [0.05, 0.11, 0.15, 0.2])
    # The loop drafts before it chooses: every bucket carries the full draft time (20 ms).
    np.testing.assert_allclose(TABLE.budget().cycle_s, [0.07, 0.12, 0.16, 0.2])
    with pytest.raises(ValueError, match="not a cost table"):
        harness.CostTable.from_json('{"buckets": [0]}')
    with pytest.raises(ValueError, match="one of each per bucket"):
        harness.CostTable((0, 4), (0.05,), (0.0, 0.01))
    with pytest.raises(ValueError, match="distinct, ascending"):
        harness.CostTable((4, 0), (0.1, 0.05), (0.01, 0.0))


# The cost-aware loop on a tiny target with a random DFlash drafter (DDTree of 8 nodes and a
# block chain of 6): whatever bucket the costs force, greedy output equals plain decoding and
# the verify widths are the bucket's.
TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 1, 2, 8, 4, 4, 6, 10, 11, 7, 1], [13], [2, 2, 2, 2]]
DCFG = dflash.DFlashConfig.for_target(TINY, n_layers=1, block_size=6, mask_token_id=None,
                                      n_taps=2)
DPARAMS = dflash.drafter_params(dflash.init_params(DCFG, 1, scale=0.3), PARAMS)


@pytest.mark.parametrize("policy, cycle_s, width", [
    (dflash.DDTree(8), (1e-3, 1.0, 1.0), 1),   # a plain step always wins
    (dflash.DDTree(8), (1.0, 1e-3, 1.0), 4),   # 4 nodes cost nothing
    (dflash.DDTree(8), (1.0, 1.0, 1e-3), 8),   # the whole tree costs nothing
    (dflash.BlockChain(), (1.0, 1e-3, 1.0), 4),
], ids=["ddtree-plain", "ddtree-4", "ddtree-8", "chain-4"])
def test_cost_aware_loop_is_lossless_at_the_chosen_width(policy, cycle_s, width):
    drafter = dflash.DFlashDrafter(DCFG, DecoderTarget(TINY), policy)
    budget = harness.Budget((0, 4, 8), cycle_s)
    plain = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=12)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=12, drafter=drafter,
                              drafter_params=DPARAMS, budget=budget)
    assert got.tokens == plain.tokens
    st = got.stats
    assert (st.verified == width * st.cycles).all(), (st.verified, st.cycles)
    if width == 1:
        assert got.tau == 1.0


def test_choices_follow_the_confidences():
    """One budget whose plain step and 8-node pass rates cross inside the confidences' range:
    the loop uses both (and stays lossless)."""
    drafter = dflash.DFlashDrafter(DCFG, DecoderTarget(TINY), dflash.DDTree(8))
    # With the 8-node pass at 1 + c times a plain step, it wins exactly when the batch's
    # expected extra tokens exceed c: for c between the smallest and largest the loop sees,
    # both buckets occur. Measure that range through the drafter's own confidences.
    seen = []
    orig = dflash.DFlashDrafter.propose

    def spy(self, *args):
        proposal, state = orig(self, *args)
        jax.debug.callback(lambda c: seen.append(float(c.sum(0)[1:].sum() / c.shape[0])),
                           proposal.confidence)
        return proposal, state

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dflash.DFlashDrafter, "propose", spy)
        api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12, drafter=drafter,
                            drafter_params=DPARAMS, budget=harness.Budget((0, 8), (1.0, 1e-3)))
    c = float(np.median(seen))
    got = api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12, drafter=drafter,
                              drafter_params=DPARAMS, budget=harness.Budget((0, 8), (1.0, 1 + c)))
    assert got.tokens == api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12).tokens
    cycles, verified = int(got.stats.cycles[0]), int(got.stats.verified[0])
    assert cycles < verified < 8 * cycles, (cycles, verified, seen)


def _no_confidence(params, dstate, ctx, rng):
    b = ctx.seq.shape[0]
    return Proposal(jnp.repeat(ctx.root[:, None], 4, axis=1), chain_parents(b, 4),
                    jnp.ones((b, 4), bool)), dstate


def test_budgets_need_a_drafter_with_confidences():
    with pytest.raises(ValueError, match="FunctionDrafter reports no confidence"):
        api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=4,
                            drafter=FunctionDrafter(_no_confidence, n_nodes=4, max_depth=3),
                            budget=harness.Budget((0, 4), (1.0, 1.0)))
    with pytest.raises(ValueError, match="needs a drafter"):
        api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=4,
                            budget=harness.Budget((0, 4), (1.0, 1.0)))
    with pytest.raises(ValueError, match="a gate state needs a drafter with a gated"):
        api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=4,
                            drafter=NgramDrafter.for_budget(4),
                            budget=harness.Budget((0, 4), (1.0, 1.0)), gate=harness.Gate.start())


def test_the_gate_backs_off_after_failed_probes_and_resumes_after_a_good_one():
    g = harness.Gate.start()
    ran = jnp.bool_(True)

    def drafted(adv):
        """The gate after a drafted cycle of advantage ``adv``, and its next run of plain
        steps (what a skipped cycle reports is ignored: 9 each)."""
        nonlocal g
        assert bool(g.drafts)
        g = g.update(jnp.float32(adv), ran)
        run = int(g.wait)
        while not bool(g.drafts):
            g = g.update(jnp.float32(9), ran)
        return run

    # The first probe loses a plain step: a run of 1 / GATE_PROBE_SHARE = 50 steps. A probe
    # then wins (+1) and drafting goes on through a small loss (the running mean 0.7 * 1 +
    # 0.3 * -0.1 = 0.67 stays positive) until a big one: 0.7 * 0.67 + 0.3 * -2 = -0.131,
    # a run of ceil(0.131 / 0.02) = 7. A probe that barely loses runs twice the last run (14);
    # the next loses 5 plain steps: 250 steps, then runs stop at GATE_MAX_SKIP.
    assert [drafted(a) for a in [-1, 1, -0.1, -2, -0.01, -5, -0.01]] == [50, 0, 0, 7, 14, 250,
                                                                            256]
    np.testing.assert_allclose(float(g.advantage), -0.01)
    assert drafted(3) == 0 and int(g.skip) == 1 and not bool(g.probing)
    assert float(g.advantage) == 3.0
    # Runs at least double after each failure, up to GATE_MAX_SKIP.
    g = harness.Gate.start()
    assert [drafted(-0.001) for _ in range(10)] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 256]


def test_the_calibration_scales_the_confidences_it_chooses_with():
    g = harness.Gate.start()
    assert float(g.calibration) == 1.0
    g = g.observe(jnp.float32(0.5), jnp.float32(1.5))
    d, prior = harness.CAL_DECAY, harness.CAL_PRIOR
    np.testing.assert_allclose(float(g.calibration), (d * prior + 1.5) / (d * prior + 0.5),
                               rtol=1e-6)
    for _ in range(50):
        g = g.observe(jnp.float32(0.1), jnp.float32(2.0))
    assert float(g.calibration) == harness.CAL_CLIP
    probs = np.asarray([[0.9, 0.5, 0.25]], np.float32)
    np.testing.assert_allclose(harness.expected_tokens(probs, (0, 2, 4), 2.0), [[1, 2, 3.5]])
    # A chain at 0.6: E(4) = 2.176 -> 19.8 tok/s, below plain's 20. Scaled by 1.25 (0.75,
    # 0.45, 0.27, ...): E(4) = 2.47 -> 22.5 tok/s; E(8) = 2.82 -> 18.8; E(16) -> 15.1.
    assert TABLE.buckets[int(harness.choose_bucket(_chain(0.6), TABLE))] == 0
    assert TABLE.buckets[int(harness.choose_bucket(_chain(0.6), TABLE, 1.25))] == 4


def test_the_gate_calibrates_on_every_drafted_cycle(monkeypatch):
    """Without decay, the gate's sums are the accepted drafts of every cycle and the drafts
    the raw confidences predicted for the bucket verified (the first 3 of 7 drafts here)."""
    from specjax import calibrate

    drafter = dflash.DFlashDrafter(DCFG, DecoderTarget(TINY), dflash.DDTree(8))
    seen = []
    orig = dflash.DFlashDrafter.propose

    def spy(self, *args):
        proposal, state = orig(self, *args)
        jax.debug.callback(lambda c, v: seen.append(float(np.where(v, c, 0)[0, 1:4].sum())),
                           proposal.confidence, proposal.node_valid)
        return proposal, state

    monkeypatch.setattr(dflash.DFlashDrafter, "propose", spy)
    monkeypatch.setattr(harness, "CAL_DECAY", 1.0)
    budget = calibrate.forced_budget((0, 4, 8), 1, gated=True)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS[1:2], max_new_tokens=11, drafter=drafter,
                              drafter_params=DPARAMS, budget=budget)
    st, g = got.stats, got.gate
    assert int(st.drafted[0]) == int(st.cycles[0]) == len(seen) > 2
    assert (st.verified == 4 * st.cycles).all()
    np.testing.assert_allclose(float(g.accepted), harness.CAL_PRIOR + int(st.accepted[0]))
    np.testing.assert_allclose(float(g.predicted), harness.CAL_PRIOR + sum(seen), rtol=1e-5)


def test_a_probe_verifies_a_drafted_bucket_however_low_the_calibration():
    """A gate whose calibration a streak of rejections pushed to 1/4 prices the drafts so low
    that a plain step wins every drafted cycle (N = 4 costs 2 plain steps and expects at most
    1 + 3/4 tokens); its probes still verify the 4 nodes, so the calibration meets the
    drafter's acceptance again instead of the probes failing forever on bucket 0."""
    drafter, dp = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=3)
    budget = harness.Budget((0, 4), (1.1, 2.0), step_s=1.0, draft_s=0.1)
    assert budget.gated
    low = dataclasses.replace(harness.Gate.start(), accepted=jnp.float32(1.0),
                              predicted=jnp.float32(4.0))
    got = api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12, drafter=drafter,
                              drafter_params=dp, budget=budget, gate=low)
    st = got.stats
    assert got.tokens == api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12).tokens
    # Each cycle that verified the 4 nodes adds 3 to ``verified`` beyond one per cycle.
    assert int(st.verified[0]) - int(st.cycles[0]) >= 3, (st.verified, st.cycles, st.drafted)


def test_a_probe_is_judged_with_its_own_acceptance_counted():
    """A probe's verdict prices its drafts with the calibration after observing them. From a
    calibration of 1/4 (1 accepted of 4 predicted), a probe of 3 drafts at confidence 1/2,
    all accepted, moves it to (0.95 + 3) / (0.95 * 4 + 1.5) = 0.745: 1 + 3 * 0.373 = 2.12
    tokens for a cycle of 2 plain steps, a gain; priced at 1/4 (1.375 tokens) it would lose
    0.625 steps and shut the gate for 32 steps."""
    budget = harness.Budget((0, 4), (1.1, 2.0), step_s=1.0, draft_s=0.1)
    low = dataclasses.replace(harness.Gate.start(), accepted=jnp.float32(1.0),
                              predicted=jnp.float32(4.0))
    seen = low.after_drafted(jnp.float32(1.5), jnp.float32(3.0),
                             lambda c: budget.advantage(
                                 1, harness.expected_tokens(jnp.full((1, 3), 0.5), (0, 4),
                                                            c)[0, 1]), jnp.bool_(True))
    np.testing.assert_allclose(float(seen.calibration), 3.95 / 5.3, rtol=1e-6)
    np.testing.assert_allclose(float(seen.advantage), 1 + 3 * 0.5 * 3.95 / 5.3 - 2.0,
                               rtol=1e-5)
    assert bool(seen.drafts) and not bool(seen.probing)

    # In the loop: the whole target drafts (every draft accepted) at confidence 1/2.
    class Sure(DraftModelDrafter):
        def propose(self, *args):
            proposal, state = super().propose(*args)
            conf = jnp.where(jnp.arange(proposal.tokens.shape[1]) == 0, 1.0, 0.5)
            return dataclasses.replace(proposal, confidence=jnp.broadcast_to(
                conf, proposal.tokens.shape)), state

    drafter = Sure(TINY, 3)
    got = api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12, drafter=drafter,
                              drafter_params=PARAMS, budget=budget, gate=low)
    st = got.stats
    assert got.tokens == api.generate_tokens(TINY, PARAMS, PROMPTS[:1], max_new_tokens=12).tokens
    assert int(st.accepted[0]) == 3 * int(st.drafted[0])
    assert int(st.drafted[0]) == int(st.cycles[0]) >= 2, (st.drafted, st.cycles)


def test_a_table_gates_only_a_drafter_that_costs_time():
    assert TABLE.budget().gated  # 20 ms of drafting against a 50 ms plain step
    cheap = harness.CostTable((0, 4), (0.05, 0.1), (0.0, 0.001))
    assert not cheap.budget().gated
    assert not harness.CostTable((4, 8), (0.1, 0.14), (0.01, 0.01)).budget().gated


# Every drafter under a cost-aware budget: drafting that never pays (a gated budget whose
# drafting costs 19 plain steps: the loop mostly skips it) and drafting that always pays (the
# whole tree at half a plain step): greedy output equals plain decoding, batch 4 with mixed
# lengths and a stop token (batch 1 and the other policies: tests/test_speculative.py and the
# drafters' own tests, without budgets).
E3 = eagle.EagleConfig.eagle3(TINY, draft_vocab_size=61)
E3_PARAMS = eagle.drafter_params(eagle.init_params(E3, 1, scale=0.3), PARAMS)
TGT = DecoderTarget(TINY)
EVERY_DRAFTER = {
    "ngram": (NgramDrafter.for_budget(8), None),
    "draft-model": DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=7),
    "eagle3-dynamic": (eagle.EagleDrafter(E3, TGT, eagle.DynamicTree(8, 3, 3)), E3_PARAMS),
    "eagle3-sampled": (eagle.EagleDrafter(E3, TGT, eagle.SampledChain(5)), E3_PARAMS),
    "dflash-chain": (dflash.DFlashDrafter(DCFG, TGT, dflash.BlockChain()), DPARAMS),
    "ddtree": (dflash.DFlashDrafter(DCFG, TGT, dflash.DDTree(8)), DPARAMS),
}
NEVER_PAYS = harness.Budget((0, 4, 8), (20.0, 20.0, 20.0), step_s=1.0, draft_s=19.0)
ALWAYS_PAYS = harness.Budget((0, 4, 8), (1.1, 0.6, 0.5), step_s=1.0, draft_s=0.1)


@pytest.mark.parametrize("name", list(EVERY_DRAFTER))
def test_greedy_output_of_the_harness_equals_plain_for_every_drafter(name):
    drafter, dp = EVERY_DRAFTER[name]
    assert NEVER_PAYS.gated and ALWAYS_PAYS.gated
    stop = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=16).tokens[1][9]
    want = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=16, stop_tokens=[stop])
    for budget in (NEVER_PAYS, ALWAYS_PAYS):
        got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=16, stop_tokens=[stop],
                                  drafter=drafter, drafter_params=dp, budget=budget)
        if budget is ALWAYS_PAYS:  # the same buckets and gate: the costs alone are traced
            assert got.compile_s == 0.0
        assert got.tokens == want.tokens, (name, budget)
        assert got.stopped == want.stopped
        st = got.stats
        if budget is NEVER_PAYS:
            # A probe losing ~19 plain steps starts the longest run: one probe per row.
            assert (st.drafted <= 1).all() and st.drafted.sum() >= 1, st.drafted
            assert (st.accepted <= st.drafted * drafter.max_depth).all()
            # The next request goes on from that gate: still inside the run, it never drafts.
            assert int(got.gate.wait) > 16 and bool(got.gate.probing)
            again = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=16,
                                        stop_tokens=[stop], drafter=drafter, drafter_params=dp,
                                        budget=budget, gate=got.gate)
            assert again.compile_s == 0.0  # a fresh gate and a carried one: one executable
            assert again.tokens == want.tokens
            assert again.stats.drafted.sum() == 0, again.stats.drafted
            assert int(again.gate.wait) < int(got.gate.wait)
        else:
            assert (st.drafted == st.cycles).all()


@dataclasses.dataclass(frozen=True)
class _PerStep:
    """A drafter without ``catch_up``: the gate's plain steps feed it one at a time."""

    inner: object

    def __getattr__(self, name):
        if name == "catch_up":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("name", ["draft-model", "eagle3-dynamic", "dflash-chain"])
def test_catch_up_leaves_the_drafter_where_feeding_every_plain_step_does(name):
    """40 tokens under a gate that drafts once per row: runs of plain steps longer than
    CATCH_UP, handed over CATCH_UP at a time, leave the drafter's cache (and EAGLE's newest
    output) as per-step ``skip`` + ``commit`` do, in every row's committed slots; the output is
    plain decoding's either way."""
    drafter, dp = EVERY_DRAFTER[name]
    assert hasattr(drafter, "catch_up") and not hasattr(_PerStep(drafter), "catch_up")
    tokens, lengths = api.pad_prompts(PROMPTS)
    stop = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=40).tokens[1][30]
    sp = sampling.SamplingParams.make(len(PROMPTS), 0.0, 0, 1.0)

    def run(d):
        return decode.speculative_generate(
            PARAMS, dp, jnp.asarray(tokens), jnp.asarray(lengths), sp, jax.random.key(0),
            target=TGT, drafter=d, max_new_tokens=40, capacity=128, stop_tokens=(stop,),
            return_dstate=True, budget=NEVER_PAYS)

    got, want = run(drafter), run(_PerStep(drafter))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(np.asarray(got.stats.drafted).max()) <= 1  # the rest were plain steps
    assert int(np.asarray(got.n_generated).max()) > 2 * CATCH_UP
    committed = np.asarray(lengths) + np.asarray(got.n_generated) - 1  # every token but the last
    caches = [(got.dstate, want.dstate)] if name == "draft-model" else [
        (got.dstate.cache, want.dstate.cache)]
    for g, w in caches:
        assert (np.asarray(g.lengths) >= committed).all() and (
            np.asarray(w.lengths) >= committed).all()
        rows = g.k[0].shape[0] // len(PROMPTS)
        for gb, wb in zip(g.k + g.v, w.k + w.v):
            for r, n in enumerate(committed):
                want_rows = np.asarray(wb[r * rows:(r + 1) * rows, :n], np.float32)
                np.testing.assert_allclose(np.asarray(gb[r * rows:(r + 1) * rows, :n], np.float32),
                                           want_rows, rtol=1e-5,
                                           atol=1e-5 * np.abs(want_rows).max())
    if name.startswith("eagle"):
        last = np.asarray(want.dstate.last)
        np.testing.assert_allclose(np.asarray(got.dstate.last), last, rtol=1e-5,
                                   atol=1e-5 * np.abs(last).max())


def test_prompt_lookup_learns_its_acceptance_rate_per_match_length():
    from specjax.drafters.base import Accepted, Context, Prefill
    from specjax.sampling import SamplingParams

    d = NgramDrafter(draft_len=4)
    seq = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 7, 0, 0, 0, 0]], jnp.int32)
    st = d.init(None, Prefill(seq[:, :8], jnp.asarray([8]), jnp.zeros((1, 8, 0, 1)),
                              jnp.asarray([0]), 16))
    np.testing.assert_allclose(d.rates(st)[0], [0, 1 / 2, 2 / 3, 3 / 4])  # the prior g / (g + 1)
    ctx = Context(seq, jnp.asarray([8]), SamplingParams.make(1, 0.0, 0, 1.0))
    proposal, st = d.propose(None, st, ctx, None)
    # The suffix 5 6 7 matched 3 tokens: drafts 8 9 5 6, confidences (3/4)^d.
    assert proposal.tokens[0].tolist() == [7, 8, 9, 5, 6] and int(st.match[0, 0]) == 3
    np.testing.assert_allclose(proposal.confidence[0], [1, .75, .75 ** 2, .75 ** 3, .75 ** 4],
                               rtol=1e-6)

    def cycle(state, verified, accepted):
        valid = jnp.arange(5)[None, :] <= verified
        path = jnp.asarray([list(range(accepted + 1)) + [0] * (4 - accepted)], jnp.int32)
        return d.commit(None, state, ctx, Accepted(
            Proposal(proposal.tokens, proposal.parents, valid), path, jnp.asarray([accepted]),
            jnp.asarray([accepted + 1]), jnp.zeros((1, 5, 0, 1))))

    # 4 drafts verified, 2 accepted: 3 tried (the third rejected), 2 accepted.
    st2 = cycle(st, 4, 2)
    np.testing.assert_allclose(d.rates(st2)[0, 3], (2 + .75) / (3 + 1), rtol=1e-6)
    np.testing.assert_allclose(d.rates(st2)[0, :3], d.rates(st)[0, :3])  # other lengths kept
    # A plain-step cycle (no draft verified) teaches nothing; the counts decay per update.
    assert (cycle(st2, 0, 0).tried == st2.tried).all()
    st3 = cycle(st2, 2, 2)  # both verified drafts accepted
    np.testing.assert_allclose(st3.tried[0, 3], DECAY * 3 + 2, rtol=1e-6)
    np.testing.assert_allclose(st3.accepted[0, 3], DECAY * 2 + 2, rtol=1e-6)
