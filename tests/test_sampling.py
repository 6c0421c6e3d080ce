"""Tests for specjax.sampling against a NumPy transcription of the Hugging Face warpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.sampling import SamplingParams

# Jitted once per shape: eager dispatch of every op is slower than compiling here.
log_probs = jax.jit(sampling.log_probs)
sample = jax.jit(sampling.sample)


def hf_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row, transcribed from HF's Temperature/TopK/TopP LogitsWarper, in float64.

    Args:
      logits: [V].

    Returns:
      [V] probabilities.
    """
    logits = logits.astype(np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    scores = logits / temperature
    if top_k > 0:
        kth = np.sort(scores)[-min(top_k, scores.size)]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1:
        order = np.argsort(scores, kind="stable")  # ascending, as HF sorts
        sorted_probs = np.exp(scores[order] - scores.max())
        cumulative = np.cumsum(sorted_probs / sorted_probs.sum())
        remove = cumulative <= 1 - top_p
        remove[-1] = False  # min_tokens_to_keep = 1
        scores = scores.copy()
        scores[order[remove]] = -np.inf
    probs = np.exp(scores - scores.max())
    return probs / probs.sum()


# (temperature, top_k, top_p) per row: greedy, plain, each truncation alone, both, extremes.
ROWS = [
    (0.0, 0, 1.0),
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 0, 0.8),
    (0.7, 10, 0.9),
    (1.0, 1, 1.0),
    (1.0, 500, 1.0),  # k > V: off in effect
    (0.5, 0, 1e-4),  # only the most likely token survives
    (0.0, 3, 0.5),  # greedy ignores truncation
    (2.0, 20, 0.3),
]


def _params(rows):
    t, k, p = zip(*rows)
    return SamplingParams.make(len(rows), temperature=t, top_k=k, top_p=p)


def test_log_probs_matches_hf_reference():
    logits = np.asarray(jax.random.normal(jax.random.key(0), (len(ROWS), 3, 64))) * 3
    sp = _params(ROWS)
    got = np.exp(np.asarray(log_probs(jnp.asarray(logits), sp)))  # [B, 3, V]
    for b, (t, k, p) in enumerate(ROWS):
        for n in range(logits.shape[1]):
            want = hf_probs(logits[b, n], t, k, p)
            np.testing.assert_array_equal(got[b, n] > 0, want > 0, err_msg=f"support, row {b}")
            np.testing.assert_allclose(got[b, n], want, atol=1e-6, err_msg=f"row {b} node {n}")


def test_log_probs_without_truncation_is_tempered_softmax():
    logits = jax.random.normal(jax.random.key(1), (2, 5, 100))
    sp = SamplingParams.make(2, temperature=[0.6, 1.0])
    want = jax.nn.log_softmax(logits / jnp.array([0.6, 1.0])[:, None, None], axis=-1)
    np.testing.assert_allclose(log_probs(logits, sp), want, atol=1e-6)


def test_top_k_keeps_every_tie_at_the_boundary():
    logits = jnp.array([[3.0, 1.0, 2.0, 2.0, 0.0]])
    lp = log_probs(logits, SamplingParams.make(1, temperature=1.0, top_k=2))
    np.testing.assert_array_equal(np.isfinite(lp[0]), [True, False, True, True, False])


def test_top_k_treats_signed_zeros_as_ties_and_never_keeps_minus_infinity():
    logits = jnp.array([[-jnp.inf, 0.0, -0.0, 1.0, -jnp.inf, -2.0]])
    lp = log_probs(logits, SamplingParams.make(1, temperature=1.0, top_k=2, top_p=0.99))
    np.testing.assert_array_equal(np.isfinite(lp[0]), [False, True, True, True, False, False])


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.4, [True, False, False, False]),  # 0.5 alone reaches 0.4
        (0.6, [True, True, False, False]),  # 0.5 < 0.6, 0.5 + 0.3 >= 0.6
        (0.85, [True, True, True, False]),
        (1.0, [True, True, True, True]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    lp = log_probs(logits, SamplingParams.make(1, temperature=1.0, top_p=top_p))
    np.testing.assert_array_equal(np.isfinite(lp[0]), kept)


def test_top_p_applies_after_top_k():
    # After top-2 the distribution is (0.625, 0.375): top_p = 0.6 keeps one token, although
    # the un-truncated mass of the first token (0.5) is below 0.6.
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    lp = log_probs(logits, SamplingParams.make(1, temperature=1.0, top_k=2, top_p=0.6))
    np.testing.assert_array_equal(np.isfinite(lp[0]), [True, False, False, False])


def test_greedy_rows_are_exact_argmax_with_ties_and_bfloat16():
    logits = jnp.array([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 1.0, 2.0]], jnp.bfloat16)
    sp = SamplingParams.make(2, temperature=0.0, top_k=2, top_p=0.5)
    np.testing.assert_array_equal(sample(jax.random.key(0), logits, sp), [1, 0])
    lp = log_probs(logits, sp)
    assert lp.dtype == jnp.float32
    inf = np.inf
    np.testing.assert_array_equal(lp, [[-inf, 0, -inf, -inf], [0, -inf, -inf, -inf]])


def test_mixed_batch_greedy_rows_exact_and_sampled_rows_follow_log_probs():
    vocab, draws = 6, 40_000
    logits = jax.random.normal(jax.random.key(2), (4, 2, vocab)) * 2  # a middle axis too
    sp = SamplingParams.make(
        4, temperature=[0.0, 0.8, 0.0, 1.0], top_k=[0, 4, 2, 0], top_p=[1, 1, 1, 0.9]
    )
    keys = jax.random.split(jax.random.key(3), draws)
    tokens = jax.jit(jax.vmap(sampling.sample, in_axes=(0, None, None)))(keys, logits, sp)
    assert tokens.shape == (draws, 4, 2) and tokens.dtype == jnp.int32
    argmax = jnp.argmax(logits, -1)  # [4, 2]
    for row in (0, 2):
        np.testing.assert_array_equal(tokens[:, row], jnp.broadcast_to(argmax[row], (draws, 2)))
    probs = np.exp(np.asarray(log_probs(logits, sp), np.float64))  # [4, 2, V]
    for row in (1, 3):
        for node in (0, 1):
            counts = np.bincount(np.asarray(tokens[:, row, node]), minlength=vocab)
            want = probs[row, node]
            assert np.all(counts[want == 0] == 0), f"row {row} drew a removed token"
            expected = draws * want[want > 0]
            if expected.size == 1:  # top-p left one token, already checked above
                continue
            stat = np.sum((counts[want > 0] - expected) ** 2 / expected)
            p_value = float(jax.scipy.special.gammaincc((expected.size - 1) / 2, stat / 2))
            assert p_value > 1e-3, f"row {row} node {node}: chi2={stat:.1f}, p={p_value:.2g}"


def test_inverse_cdf_sample_never_picks_zero_weight_tokens():
    weights = jnp.array(
        [[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [jnp.nan, 1.0, 0.0, 0.0, 0.0]]
    )
    below_one = np.nextafter(np.float32(1), np.float32(0))
    for u, want in [(0.0, [1, 4, 1]), (0.29, [1, 4, 1]), (0.31, [3, 4, 1]), (below_one, [3, 4, 1])]:
        got = sampling.inverse_cdf_sample(jnp.full((3,), u, jnp.float32), weights)
        np.testing.assert_array_equal(got, want, err_msg=f"u={u}")


def test_changing_parameter_values_does_not_retrace():
    traces = []

    @jax.jit
    def f(logits, sp):
        traces.append(None)
        return sampling.log_probs(logits, sp)

    logits = jnp.zeros((2, 7))
    for t, k, p in [(0.0, 0, 1.0), (1.0, 3, 1.0), (0.5, 0, 0.2)]:
        f(logits, SamplingParams.make(2, temperature=t, top_k=k, top_p=p))
    assert len(traces) == 1


def test_make_broadcasts_scalars_and_keeps_per_row_values():
    sp = SamplingParams.make(3, temperature=[0.0, 0.5, 1.0], top_k=4)
    np.testing.assert_array_equal(sp.temperature, [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(sp.top_k, [4, 4, 4])
    np.testing.assert_array_equal(sp.top_p, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(sp.greedy, [True, False, False])
    dtypes = (sp.temperature.dtype, sp.top_k.dtype, sp.top_p.dtype)
    assert dtypes == (jnp.float32, jnp.int32, jnp.float32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, "temperature.*-0.5"),
        ({"temperature": [0.5, float("nan")]}, "temperature.*nan"),
        ({"top_k": -1}, "top_k.*-1"),
        ({"top_k": 2.5}, "top_k.*integers"),
        ({"top_p": 0.0}, r"top_p.*\(0, 1\].*0.0"),
        ({"top_p": [1.0, 1.5]}, r"top_p.*1.5"),
        ({"temperature": [0.1, 0.2, 0.3]}, "temperature.*2 entries"),
    ],
)
def test_make_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.make(2, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_argmax_equals_jnp_argmax_ties_and_non_finite_values_included(dtype):
    gen = np.random.default_rng(0)
    x = gen.integers(-3, 4, (6, 5, 37)).astype(np.float32)  # small integers: many ties
    if jnp.issubdtype(dtype, jnp.floating):
        x[0, :, 5] = np.inf
        x[1, :, [3, 30]] = np.nan  # the first NaN wins, even over an inf elsewhere
        x[1, :, 9] = np.inf
        x[2] = -np.inf  # all -inf: index 0
        x[3, 0, 7] = -0.0
    x = jnp.asarray(x > 0 if dtype == jnp.bool_ else x, dtype)
    got = sampling.argmax(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


def test_fast_candidate_truncation_equals_the_full_sort_or_declines():
    """The top-64 candidate path gives exactly the full sort's kept set whenever it says it is
    exact, and declines (so the sort runs) when the kept set reaches past its candidates."""
    gen = np.random.default_rng(7)
    v = 300
    fast = jax.jit(sampling._kept_fast)
    full = jax.jit(sampling._kept)
    cases = [  # (top_k, top_p, logit scale): must be exact
        (20, 1.0, 3.0), (20, 0.8, 3.0), (1, 1.0, 1.0), (64, 0.9, 2.0), (0, 0.5, 6.0),
    ]
    for top_k, top_p, scale in cases:
        z = jnp.asarray(gen.standard_normal((4, 2, v)) * scale, jnp.float32)
        tk = jnp.full((4, 1, 1), top_k, jnp.int32)
        tp = jnp.full((4, 1, 1), top_p, jnp.float32)
        kept, exact = fast(z, tk, tp, jnp.zeros((4, 1, 1), bool))
        assert bool(exact), (top_k, top_p)
        np.testing.assert_array_equal(kept, full(z, tk, tp))
    # Ties at the top-k boundary spilling past the candidates, top-k beyond them, and top-p
    # mass that the candidates do not reach: the fast path must decline.
    ties = jnp.zeros((1, v), jnp.float32).at[0, :3].set(1.0)
    declined = [
        (ties, 5, 1.0),
        (jnp.asarray(gen.standard_normal((1, v)), jnp.float32), 100, 1.0),
        (jnp.asarray(gen.standard_normal((1, v)) * 0.01, jnp.float32), 0, 0.9),
    ]
    for z, top_k, top_p in declined:
        tk = jnp.full((1, 1), top_k, jnp.int32)
        tp = jnp.full((1, 1), top_p, jnp.float32)
        assert not bool(fast(z, tk, tp, jnp.zeros((1, 1), bool))[1]), (top_k, top_p)
    # log_probs (which picks the path on device) agrees with the full sort in both regimes.
    for z, top_k, top_p in declined + [(jnp.asarray(gen.standard_normal((1, v)) * 3,
                                                     jnp.float32), 20, 0.8)]:
        sp = SamplingParams.make(1, 0.7, top_k, top_p)
        want = jnp.where(full(z / 0.7, jnp.full((1, 1), top_k), jnp.full((1, 1), top_p)),
                         jax.nn.log_softmax(jnp.where(full(z / 0.7, jnp.full((1, 1), top_k),
                                                           jnp.full((1, 1), top_p)),
                                                      z / 0.7, -jnp.inf)), -jnp.inf)
        np.testing.assert_allclose(sampling.log_probs(z, sp), want, atol=1e-6, rtol=0)
