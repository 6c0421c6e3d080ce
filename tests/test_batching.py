"""Continuous batching (specjax.batching) against one plain batch holding every request."""

from __future__ import annotations

import numpy as np
import pytest

from specjax import api, batching
from specjax.config import ModelConfig
from specjax.models import target

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
RNG = np.random.default_rng(0)
# Eight requests of mixed lengths and limits: a pool of 3 rows starts with 128 cache slots,
# refills five times (short requests land in slots that held longer ones), grows to 256 slots
# while requests are running when the 140-token prompt enters and shrinks back after it leaves.
PROMPTS = [RNG.integers(0, TINY.vocab_size, n).tolist() for n in (3, 9, 1, 140, 5, 2, 12, 4)]
LIMITS = [10, 3, 14, 3, 8, 12, 5, 1]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_pool_gives_one_plain_batch_tokens(temperature):
    """Request i draws with plain decoding's row-i keys, so a pool of 3 rows refilled between
    chunks of 4 steps gives one 8-row plain batch's tokens, stop flags included."""
    kw = dict(max_new_tokens=LIMITS, temperature=temperature, top_k=20, top_p=0.9, seed=7)
    free = api.generate_tokens(TINY, PARAMS, PROMPTS, **kw)
    # A stop token the plain run emits mid-way, so some requests end on it and others on a limit.
    stop = free.tokens[0][4]
    want = api.generate_tokens(TINY, PARAMS, PROMPTS, stop_tokens=[stop], **kw)
    seen = []
    got = batching.generate(TINY, PARAMS, PROMPTS, stop_tokens=[stop], pool_size=3, chunk=4,
                            on_finish=lambda f: seen.append(f.index), **kw)
    assert [f.index for f in got] == list(range(len(PROMPTS)))
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert [f.tokens for f in got] == want.tokens
    assert [f.stopped for f in got] == want.stopped
    assert any(want.stopped) and not all(want.stopped)


def test_the_cache_follows_the_rows_usage(monkeypatch):
    """The cache is resized to what the running rows can reach: up for the 140-token prompt
    (a 192-slot prefill), back down once it has left, and never below a running row's needs
    (the tokens above would differ: a write past the capacity lands on the last slot)."""
    seen = []

    def recording(pool, *, capacity):
        seen.append(capacity)
        return resize(pool, capacity=capacity)

    resize = batching.resize
    monkeypatch.setattr(batching, "resize", recording)
    batching.generate(TINY, PARAMS, PROMPTS, max_new_tokens=LIMITS, pool_size=3, chunk=4)
    assert seen == [256, 128]


def test_a_chunk_that_crosses_a_capacity_step():
    """A 125-token prompt's first chunk of 4 steps writes slots 125-128: the pool must start
    with 256 slots, not 128 (a write past the capacity would overwrite slot 127)."""
    prompts = [RNG.integers(0, TINY.vocab_size, 125).tolist(), [3, 4]]
    kw = dict(max_new_tokens=[12, 30], temperature=1.0, seed=11)
    want = api.generate_tokens(TINY, PARAMS, prompts, **kw).tokens
    got = batching.generate(TINY, PARAMS, prompts, pool_size=2, chunk=4, **kw)
    assert [f.tokens for f in got] == want


@pytest.mark.parametrize("prompt_len, n_generated, need, want", [
    (10, 1, 400, 10 + 4),  # a new row: its prompt, then up to 4 written slots
    (10, 30, 400, 10 + 29 + 4),
    (10, 390, 400, 400),  # near its limit: capped by what it may ever use
])
def test_slots_needed(prompt_len, n_generated, need, want):
    assert batching.slots_needed(prompt_len, n_generated, need, steps=4) == want


def test_per_request_seeds_and_ids_serve_several_batches_in_one_pool():
    """Requests with (seed, id) keys draw what row id of a plain batch with that seed draws, so
    one pool can run two batches with their own seeds side by side."""
    kw = dict(temperature=1.0, top_k=20)
    want = [api.generate_tokens(TINY, PARAMS, PROMPTS[j:j + 4], max_new_tokens=LIMITS[j:j + 4],
                                seed=s, **kw).tokens for j, s in ((0, 5), (4, 9))]
    got = batching.generate(TINY, PARAMS, PROMPTS, max_new_tokens=LIMITS, seed=[5] * 4 + [9] * 4,
                            request_ids=[0, 1, 2, 3] * 2, pool_size=3, chunk=4, **kw)
    assert [f.tokens for f in got] == want[0] + want[1]


def test_pool_size_and_chunk_do_not_change_the_tokens():
    kw = dict(max_new_tokens=LIMITS, temperature=1.0, seed=3)
    one = batching.generate(TINY, PARAMS, PROMPTS, pool_size=1, chunk=16, **kw)
    many = batching.generate(TINY, PARAMS, PROMPTS, pool_size=5, chunk=1, **kw)
    assert [f.tokens for f in one] == [f.tokens for f in many]


@pytest.mark.parametrize("prompts, kw, match", [
    ([], {}, "no prompts"),
    ([[1], []], {}, "prompt 1 is empty"),
    ([[1, 99]], {}, "token ids outside"),
    ([[1]], dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ([[1], [2]], dict(max_new_tokens=[4, 4, 4]), "3 max_new_tokens for 2 prompts"),
    ([[1] * 10], dict(max_new_tokens=TINY.max_position_embeddings), "positions"),
    ([[1]], dict(pool_size=0), "pool_size"),
    ([[1], [2]], dict(seed=[1, 2, 3]), "3 seeds and 2 request_ids for 2 prompts"),
    ([[1], [2]], dict(request_ids=[0]), "2 seeds and 1 request_ids for 2 prompts"),
])
def test_bad_requests_are_refused(prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        batching.generate(TINY, PARAMS, prompts, **kw)
