"""Plain generation: one jitted call, row independence, stop tokens, limits, errors."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api, decode
from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target
from specjax.targets import DecoderTarget

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)
PARAMS = target.init_params(TINY, 0, scale=0.5)
PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6, 10, 11], [13]]


def _reference_greedy(prompt, n, cfg=TINY, params=PARAMS):
    """Greedy decoding by re-running an uncached causal forward over the whole sequence each
    step (one fixed width, so one compile; positions past the sequence are ignored)."""
    width = len(prompt) + n
    forward = jax.jit(lambda seq: target.forward(params, cfg, seq, jnp.arange(width)[None],
                                                 cache_lib.init_cache(cfg, 1, width))[0])
    seq = np.zeros((1, width), np.int32)
    seq[0, : len(prompt)] = prompt
    for t in range(len(prompt), width):
        seq[0, t] = int(jnp.argmax(forward(jnp.asarray(seq))[0, t - 1]))
    return seq[0, len(prompt):].tolist()


def test_greedy_equals_uncached_reference():
    got = api.generate_tokens(TINY, PARAMS, [PROMPTS[0]], max_new_tokens=10)
    assert got.tokens[0] == _reference_greedy(PROMPTS[0], 10)


def test_bfloat16_greedy_equals_its_uncached_reference():
    """A bf16 step's one row runs as two inside each product (layers.matmul); the copy must
    not leak."""
    cfg = TINY.replace(dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    got = api.generate_tokens(cfg, params, [PROMPTS[1]], max_new_tokens=10)
    assert got.tokens[0] == _reference_greedy(PROMPTS[1], 10, cfg, params)


def test_rows_do_not_depend_on_batch_padding_or_position():
    batch = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=12)
    reversed_batch = api.generate_tokens(TINY, PARAMS, PROMPTS[::-1], max_new_tokens=12)
    for i, prompt in enumerate(PROMPTS):
        alone = api.generate_tokens(TINY, PARAMS, [prompt], max_new_tokens=12)
        # A wider cache and more padding must not matter either.
        padded = api.generate_tokens(TINY, PARAMS, [prompt], max_new_tokens=12, cache_size=192)
        assert batch.tokens[i] == alone.tokens[0] == padded.tokens[0]
        assert reversed_batch.tokens[len(PROMPTS) - 1 - i] == alone.tokens[0]


def test_sampled_rows_are_seeded_and_independent_of_other_rows():
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9)
    a = api.generate_tokens(TINY, PARAMS, PROMPTS, seed=3, **kw)
    b = api.generate_tokens(TINY, PARAMS, PROMPTS, seed=3, **kw)
    c = api.generate_tokens(TINY, PARAMS, PROMPTS, seed=4, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # Row 0 keeps its randomness when the rows after it change.
    d = api.generate_tokens(TINY, PARAMS, PROMPTS[:1] + [[3, 3]], seed=3, **kw)
    assert d.tokens[0] == a.tokens[0]


def test_mixed_batch_keeps_greedy_rows_greedy():
    greedy = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=10)
    mixed = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=10,
                                temperature=[0.0, 1.5, 0.0], seed=1)
    assert mixed.tokens[0] == greedy.tokens[0]
    assert mixed.tokens[2] == greedy.tokens[2]


def test_stop_token_ends_only_its_row():
    free = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=12)
    stop = free.tokens[1][4]  # a token row 1 emits mid-way
    assert any(stop not in t for t in free.tokens), "the stop token must spare some row"
    got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=12, stop_tokens=[stop])
    for row, tokens in enumerate(free.tokens):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert got.tokens[row] == tokens[:cut]
        assert got.stopped[row] == (stop in tokens)
    assert len(got.tokens[1]) <= 5


def test_max_new_tokens_is_exact():
    for n in (1, 2, 7):
        got = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=n)
        assert [len(t) for t in got.tokens] == [n] * len(PROMPTS)


def test_generation_is_one_while_loop_without_host_callbacks():
    prompt, lengths = api.pad_prompts(PROMPTS)
    sp = api.sampling.SamplingParams.make(3)
    jaxpr = jax.make_jaxpr(lambda *a: decode.generate(
        *a, target=DecoderTarget(TINY), max_new_tokens=8, capacity=64))(PARAMS, prompt, lengths, sp,
                                                      jax.random.key(0))
    text = str(jaxpr)
    assert text.count("while[") == 1
    assert "callback" not in text


def test_one_compile_per_shape_across_prompts():
    api._COMPILED.clear()
    first = api.generate_tokens(TINY, PARAMS, [[1, 2, 3], [4, 5]], max_new_tokens=5)
    second = api.generate_tokens(TINY, PARAMS, [[9, 8, 7, 6], [2]], max_new_tokens=5,
                                 temperature=0.7)
    assert first.compile_s > 0 and second.compile_s == 0
    assert len(api._COMPILED) == 1


def test_arguments_of_another_dtype_compile_anew():
    """The same shapes in another dtype (a drafter's bfloat16 weight copies, say) are another
    executable, not a call of the first one that JAX would refuse."""
    api._COMPILED.clear()
    double = jax.jit(lambda x: 2 * x)
    first, _ = api._compiled(double, (jnp.ones(3, jnp.float32),), {}, {})
    second, compile_s = api._compiled(double, (jnp.ones(3, jnp.bfloat16),), {}, {})
    assert second is not first and compile_s > 0 and len(api._COMPILED) == 2
    assert second(jnp.ones(3, jnp.bfloat16)).dtype == jnp.bfloat16


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_evicted_executables_release_their_code(monkeypatch):
    """At most ``COMPILED_MAX`` recent executables are kept (past it, down to half), and an
    evicted one's machine code is unmapped: a process that compiles configuration after
    configuration (a benchmark sweep) stays flat in memory mappings instead of reaching the
    kernel's limit."""
    monkeypatch.setattr(api, "COMPILED_MAX", 2)
    api._COMPILED.clear()
    counts = []
    for n in range(3, 9):  # six configurations: max_new_tokens is static
        api.generate_tokens(TINY, PARAMS, [[1, 2, 3]], max_new_tokens=n)
        counts.append(_mappings())
        assert len(api._COMPILED) == 2 - n % 2  # 1, 2, then 3 -> 1, 2, ...
    per_executable = counts[1] - counts[0]
    assert per_executable > 50  # each executable maps its code; what eviction must release
    assert counts[-1] - counts[1] < per_executable
    again = api.generate_tokens(TINY, PARAMS, [[4, 5]], max_new_tokens=8)
    assert again.compile_s == 0  # the most recent one is still cached


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_per_row_limits_share_one_executable(speculative):
    """Per-row token limits are traced: rows stop at their own limit, each row's tokens are
    the prefix of an unlimited run's, and requests with other limits reuse the executable
    compiled for ``new_tokens_width``."""
    from specjax.drafters.ngram import NgramDrafter

    kw = dict(new_tokens_width=12, cache_size=64,
              drafter=NgramDrafter(draft_len=3) if speculative else None)
    api._COMPILED.clear()
    full = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=12, **kw)
    cut = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=[3, 12, 1], **kw)
    one = api.generate_tokens(TINY, PARAMS, PROMPTS, max_new_tokens=1, **kw)
    assert full.compile_s > 0 and cut.compile_s == 0 and one.compile_s == 0
    assert len(api._COMPILED) == 1
    assert [len(t) for t in full.tokens] == [12, 12, 12]
    assert cut.tokens == [full.tokens[0][:3], full.tokens[1], full.tokens[2][:1]]
    assert one.tokens == [t[:1] for t in full.tokens]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[1] * 70], max_new_tokens=10, cache_size=64), "needs 80 cache slots"),
    (dict(prompts=[[1], [2]], max_new_tokens=[4, 4, 4]), "3 max_new_tokens for 2 prompts"),
    (dict(prompts=[[1], [2]], max_new_tokens=[4, 0]), "max_new_tokens must be >= 1"),
    (dict(prompts=[[1]], max_new_tokens=8, new_tokens_width=4), "new_tokens_width=4"),
    (dict(prompts=[[1, 2, 99]], max_new_tokens=4), "outside \\[0, 61\\)"),
    (dict(prompts=[[]], max_new_tokens=4), "prompt 0 is empty"),
    (dict(prompts=[[1]], max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(prompts=[[1] * 8000], max_new_tokens=400), "exceeds the model's context"),
])
def test_bad_requests_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        api.generate_tokens(TINY, PARAMS, **kwargs)
