"""The cost model of cost-aware speculation on hand-made tables and confidences: expected
tokens per bucket, the bucket the arithmetic picks, and the table's JSON form."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import harness

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


def test_cost_table_json_round_trip_and_errors():
    again = harness.CostTable.from_json(TABLE.to_json())
    assert again == TABLE and again.matches(dict(model="m")) and not again.matches(dict(batch=4))
    np.testing.assert_allclose(again.cycle_s, [0.05, 0.11, 0.15, 0.2])
    with pytest.raises(ValueError, match="not a cost table"):
        harness.CostTable.from_json('{"buckets": [0]}')
    with pytest.raises(ValueError, match="one of each per bucket"):
        harness.CostTable((0, 4), (0.05,), (0.0, 0.01))
    with pytest.raises(ValueError, match="distinct, ascending"):
        harness.CostTable((4, 0), (0.1, 0.05), (0.01, 0.0))
