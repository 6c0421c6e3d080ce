"""Calibration: verify costs per node count, and cycle costs priced inside the decoding loop
(the budgets that force a bucket or hold the gate shut, and the measurement built on them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specjax import api, calibrate
from specjax.config import ModelConfig
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.models import target

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)


def test_measure_verify_costs_shape_and_interpolation():
    seen = []
    costs = calibrate.measure_verify_costs(TINY, target.init_params(TINY, 0), nodes=(4, 1, 2),
                                           context=16, reps=2, trials=1,
                                           progress=lambda n, s: seen.append(n))
    assert costs.nodes == (1, 2, 4) and seen == [1, 2, 4]
    assert all(s > 0 for s in costs.seconds)
    assert costs.at(3) == pytest.approx((costs.seconds[1] + costs.seconds[2]) / 2)
    assert costs.plain_step == costs.seconds[0]


def test_pass_costs_take_off_what_a_call_pays_once_and_hold_through_slow_rounds():
    """Three points at 10 / 12 / 15 ms per pass, 40 ms paid once per call, 8 and 16 passes:
    round 1 runs at half speed throughout and round 2 has one call slowed 3x; the per-round
    ratios and medians give the costs back."""
    v, once, reps = np.array([0.010, 0.012, 0.015]), 0.04, 8
    short = np.tile(once + reps * v, (3, 1))
    long = np.tile(once + 2 * reps * v, (3, 1))
    short[1] *= 2.0
    long[1] *= 2.0
    long[2, 1] *= 3.0
    np.testing.assert_allclose(calibrate.pass_costs(short, long, reps), v, rtol=1e-9)
    # Noise that makes what a call pays once negative, or more than half a call, is clipped.
    assert calibrate.pass_costs(np.full((1, 2), 0.1), np.full((1, 2), 0.5), 8) == (
        pytest.approx(0.5 / 16),) * 2
    assert calibrate.pass_costs(np.full((1, 2), 1.0), np.full((1, 2), 0.5), 8) == (
        pytest.approx(0.25 / 16),) * 2


PARAMS = target.init_params(TINY, 0)
DRAFTER = DraftModelDrafter.from_target_layers(TINY, PARAMS, 1, draft_len=7)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_forced_budget_verifies_its_bucket_every_cycle(k):
    """What the loop pricing relies on: under ``forced_budget(buckets, k)`` every drafted cycle
    verifies exactly ``buckets[k]`` nodes, and the gate stays open (every cycle drafts)."""
    buckets = (0, 2, 4, 8)
    r = api.generate_tokens(TINY, PARAMS, [[3, 5, 7, 9]], max_new_tokens=12, drafter=DRAFTER[0],
                            drafter_params=DRAFTER[1],
                            budget=calibrate.forced_budget(buckets, k, True))
    st = r.stats
    assert int(st.cycles[0]) > 1 and int(st.drafted[0]) == int(st.cycles[0])
    assert int(st.verified[0]) == buckets[k] * int(st.cycles[0])


def test_a_shut_gate_runs_plain_steps_only_and_stays_lossless():
    plain = api.generate_tokens(TINY, PARAMS, [[3, 5, 7, 9]], max_new_tokens=12)
    r = api.generate_tokens(TINY, PARAMS, [[3, 5, 7, 9]], max_new_tokens=12, drafter=DRAFTER[0],
                            drafter_params=DRAFTER[1],
                            budget=calibrate.forced_budget((0, 2, 4, 8), 3, True),
                            gate=calibrate.shut_gate())
    assert int(r.stats.drafted[0]) == 0 and r.tokens == plain.tokens


def test_loop_costs_time_the_buckets_asked_for_and_the_plain_step():
    seen = []
    cycles, step = calibrate.measure_loop_costs(
        TINY, PARAMS, *DRAFTER, (0, 2, 4, 8), timed=(2, 8), context=24, tokens=4, trials=1,
        progress=lambda stage, n, s: seen.append((stage, n, s)))
    assert [x[:2] for x in seen] == [("cycle", 2), ("cycle", 8), ("step", 0)]
    assert set(cycles) == {2, 8} and step > 0
    assert cycles[2] <= cycles[8]  # more nodes never priced cheaper
    assert [x[2] for x in seen] == [cycles[2], cycles[8], step]


def test_loop_cost_table_scales_the_largest_cycle_by_the_verify_curve(monkeypatch):
    """The drafting timed alone, the verify curve, the largest bucket's cycle and the plain
    step in the loop: a smaller bucket's cycle is the largest one's times (verify + draft)
    over (the largest's verify + draft); verify is the cycle less the drafting, bucket 0 the
    plain step. Hand-made timings stand in for the clock."""
    monkeypatch.setattr(calibrate, "measure_draft_cost", lambda *a, **k: 0.01)

    def curve(cfg, params, nodes, *, context, batch, progress):
        assert list(nodes) == [2, 8] and (context, batch) == (24, 1)
        costs = calibrate.VerifyCosts((2, 8), (0.02, 0.04), "float32", context)
        for n, sec in zip(costs.nodes, costs.seconds):
            progress(n, sec)
        return costs

    def loop(cfg, params, drafter, dparams, buckets, *, timed, progress, **kw):
        assert buckets == (0, 2, 8) and timed == (8,)
        assert kw["gated"]  # 0.01 s of drafting is far above 5% of a 0.02 s one-node pass
        progress("cycle", 8, 0.1)
        progress("step", 0, 0.03)
        return {8: 0.1}, 0.03

    monkeypatch.setattr(calibrate, "measure_verify_costs", curve)
    monkeypatch.setattr(calibrate, "measure_loop_costs", loop)
    seen = []
    table = calibrate.loop_cost_table(TINY, PARAMS, *DRAFTER, (0, 2, 8), batch=1, context=24,
                                      key={"what": "test"},
                                      progress=lambda stage, n, s: seen.append((stage, n)))
    assert seen == [("draft", 8), ("verify", 2), ("verify", 8), ("cycle", 8), ("step", 0)]
    assert len(seen) == calibrate.loop_table_points(table.buckets)
    # The loop's 8-node cycle (0.1 s) is 2x the curve's 0.04 + 0.01: the 2-node cycle is
    # 2 x (0.02 + 0.01) = 0.06 s.
    assert table.buckets == (0, 2, 8) and table.draft_s == (0.0, 0.01, 0.01)
    assert table.verify_s == pytest.approx((0.03, 0.05, 0.09))
    assert table.key == {"what": "test"}


def test_loop_cost_table_prices_a_given_verify_curve(monkeypatch):
    """A verify curve handed in (a sweep's, one for all its tables) is used, not measured
    again, and its points are reported; one at another context or without a bucket is an
    error."""
    def never(*a, **k):
        raise AssertionError("the verify curve was measured again")

    monkeypatch.setattr(calibrate, "measure_draft_cost", lambda *a, **k: 0.01)
    monkeypatch.setattr(calibrate, "measure_verify_costs", never)
    gates = []
    monkeypatch.setattr(calibrate, "measure_loop_costs",
                        lambda *a, **k: gates.append(k["gated"]) or ({8: 0.1}, 0.03))
    given = calibrate.VerifyCosts((1, 2, 4, 8), (0.01, 0.02, 0.03, 0.04), "float32", 24)
    seen = []
    table = calibrate.loop_cost_table(TINY, PARAMS, *DRAFTER, (0, 2, 8), batch=1, context=24,
                                      key={}, verify_curve=lambda: given,
                                      progress=lambda stage, n, s: seen.append((stage, n, s)))
    assert seen[1:] == [("verify", 2, 0.02), ("verify", 8, 0.04)]
    assert table.verify_s == pytest.approx((0.03, 0.05, 0.09))  # as from a measured curve
    # Drafting under GATE_MIN_DRAFT of the one-node pass (0.01 s): the budget will not be
    # gated, so neither is the loop timed for it.
    monkeypatch.setattr(calibrate, "measure_draft_cost", lambda *a, **k: 1e-5)
    calibrate.loop_cost_table(TINY, PARAMS, *DRAFTER, (0, 2, 8), batch=1, context=24, key={},
                              verify_curve=lambda: given)
    assert gates == [True, False]
    for other in (dataclasses.replace(given, context=32),
                  dataclasses.replace(given, nodes=(1, 2, 4, 16))):
        with pytest.raises(ValueError, match=r"does not price this table's buckets \[2, 8\]"):
            calibrate.loop_cost_table(TINY, PARAMS, *DRAFTER, (0, 2, 8), batch=1, context=24,
                                      key={}, verify_curve=lambda: other)


def test_a_verify_curve_is_kept_and_read_back_for_the_same_key(tmp_path, monkeypatch):
    """Measured once per key (batch, context, nodes, model...) and read back after; a file
    that holds no curve is measured again and replaced."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    measured = []

    def curve(cfg, params, nodes, *, context, batch, progress):
        measured.append((tuple(nodes), batch))
        return calibrate.VerifyCosts(tuple(nodes), tuple(0.01 * n for n in nodes), "float32",
                                     context)

    monkeypatch.setattr(calibrate, "measure_verify_costs", curve)

    def get(nodes=(1, 4, 2), batch=1, key=None):
        return calibrate.cached_verify_costs(TINY, PARAMS, nodes, batch=batch, context=24,
                                             key=key or {"model": "tiny"})

    first, fresh = get()
    assert fresh and first.nodes == (1, 2, 4) and first.seconds == (0.01, 0.02, 0.04)
    (path,) = (tmp_path / "costs").glob("*.json")
    again, fresh = get()
    assert not fresh and again == first
    assert get(batch=2)[1] and get(nodes=(1, 2))[1] and get(key={"model": "other"})[1]
    assert len(measured) == 4
    path.write_text("{not json")
    assert get()[1] and get() == (first, False)


def test_monotone_pools_the_costs_out_of_order():
    assert calibrate.monotone([1.0, 2.0, 5.0]) == [1.0, 2.0, 5.0]
    assert calibrate.monotone([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert calibrate.monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    # A late violation reaches back through the earlier pools: (4 + 5 + 1 + 3) / 4.
    assert calibrate.monotone([4.0, 5.0, 1.0, 3.0]) == pytest.approx([3.25] * 4)
