"""Verify-cost calibration returns one positive time per requested node count."""

from __future__ import annotations

import pytest

from specjax import calibrate
from specjax.config import ModelConfig
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
