"""Run metrics on hand-made histograms and latencies."""

from __future__ import annotations

import pytest

from specjax import metrics


def test_tau_and_acceptance_by_position_from_a_histogram():
    # 10 cycles: 4 accepted nothing, 3 accepted one draft, 2 accepted two, 1 accepted three.
    hist = [4, 3, 2, 1]
    # accepted drafts 0*4 + 1*3 + 2*2 + 3*1 = 10 over 10 cycles, plus the bonus token: 2.0.
    assert metrics.tau(hist) == pytest.approx(2.0)
    # >= 1: 6 of 10, >= 2: 3 of 10, >= 3: 1 of 10.
    assert metrics.acceptance_by_position(hist) == pytest.approx([0.6, 0.3, 0.1])


def test_degenerate_histograms():
    assert metrics.tau([0, 0, 0]) == 1.0 and metrics.acceptance_by_position([0, 0]) == []
    assert metrics.tau([5]) == 1.0 and metrics.acceptance_by_position([5]) == []
    assert metrics.acceptance_by_position([0, 0, 7]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="1-D array of counts"):
        metrics.tau([[1, 2]])
    with pytest.raises(ValueError, match="1-D array of counts"):
        metrics.acceptance_by_position([1, -1])


def test_percentiles_interpolate_between_order_statistics():
    ms = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]  # time per output token of 10 requests
    got = metrics.percentiles(ms)
    # rank q/100 * (n - 1): p50 at 4.5 -> 55; p95 at 8.55 -> 95.5; p99 at 8.91 -> 99.1.
    assert got == pytest.approx({50: 55.0, 95: 95.5, 99: 99.1})
    assert metrics.percentiles([7.0], (0, 100)) == {0: 7.0, 100: 7.0}
    with pytest.raises(ValueError, match="no values"):
        metrics.percentiles([])
    with pytest.raises(ValueError, match=r"in \[0, 100\]"):
        metrics.percentiles([1.0], (101,))
