"""Continuous batching: many requests through a fixed pool of decoding rows.

One plain generation call (:func:`specjax.decode.generate`) runs until its longest row ends. When
response lengths vary from a few tokens to the limit, as sampled answers do, most rows sit idle
for most of the call: distilling SmolLM2's training set, batches of 64 did 39-65% useful work.
Here a pool of B rows decodes in jitted chunks of up to ``chunk`` steps; between chunks the host
takes out the rows that finished and prefills waiting requests into their slots, so nearly every
row-step produces a token. A host round-trip per chunk (not per token) is the price.

Determinism: request i draws its token j with the key ``fold_in(fold_in(key(seed), i), j)``, the
key :func:`specjax.decode.generate` gives row i of one batch holding every request, and a
request's prompt is prefilled alone. Its tokens therefore depend on its prompt, its sampling
parameters and the seed, not on the pool size, its slot or when it ran, up to floating-point
reassociation inside the batched decode step (``tests/test_batching.py`` checks equality with
one plain batch). The schedule itself is a function of the requests, so a rerun gives the same
results.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import api, decode, sampling
from specjax import targets as targets_lib
from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.targets import DecoderTarget

PREFILL_BUCKET = 64  # prompt widths round up to this: one prefill executable per bucket
CAPACITY_MULTIPLE = 128  # the pool's cache grows in steps of this many slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pool:
    """The decoding rows and their requests' progress.

    Attributes:
      cache: the target's KV cache, B rows.
      last: [B] int32, each row's newest token (its K/V is not in the cache yet).
      out: [B, W] int32, the tokens of each row's request so far (W = the largest limit).
      n_generated: [B] int32 tokens of the row's request so far; also its next token's index.
      limit: [B] int32 token limit of the row's request.
      done: [B] bool, the row's request ended (stop token or limit), or the row is empty.
      stopped: [B] bool, the request ended on a stop token.
      request: [B] int32 index of the row's request (its sampling keys derive from it).
      sp: the rows' sampling parameters ([B] each).
    """

    cache: cache_lib.KVCache
    last: jax.Array
    out: jax.Array
    n_generated: jax.Array
    limit: jax.Array
    done: jax.Array
    stopped: jax.Array
    request: jax.Array
    sp: sampling.SamplingParams


def _keys(rng: jax.Array, request: jax.Array, index: jax.Array) -> jax.Array:
    """[B] keys: token ``index[b]`` of request ``request[b]`` (as :func:`decode.row_keys`)."""
    return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(rng, r), i))(request,
                                                                                   index)


def empty_pool(cfg: ModelConfig, rows: int, capacity: int, width: int) -> Pool:
    """A pool of ``rows`` empty (done) rows with ``capacity`` cache slots and ``width`` output
    columns each."""
    def zeros():  # a buffer of its own for each field: the pool is donated
        return jnp.zeros((rows,), jnp.int32)

    return Pool(cache=cache_lib.init_cache(cfg, rows, capacity), last=zeros(),
                out=jnp.zeros((rows, width), jnp.int32), n_generated=zeros(), limit=zeros(),
                done=jnp.ones((rows,), bool), stopped=jnp.zeros((rows,), bool), request=zeros(),
                sp=sampling.SamplingParams.make(rows))


@functools.partial(jax.jit, static_argnames=("target", "stop_tokens"))
def prefill_one(params, prompt: jax.Array, prompt_len: jax.Array, request: jax.Array,
                sp: sampling.SamplingParams, rng: jax.Array, *, target: DecoderTarget,
                stop_tokens: tuple[int, ...]):
    """Prefills one request alone and samples its first token.

    Args:
      params: target params.
      prompt: [1, P] int32 right-padded prompt; prompt_len: [1] int32 its true length.
      request: scalar int32 request index (its keys derive from it).
      sp: the request's sampling parameters ([1] each); rng: the base key of the whole run.
      target: static :class:`DecoderTarget`; stop_tokens: static ids that end a request.
    Returns:
      ``(row, first, hit)``: a one-row cache of P slots, the first token (scalar int32) and
      whether it is a stop token.
    """
    logits, _, row = target.prefill(params, prompt, prompt_len, prompt.shape[1])
    keys = _keys(rng, request[None], jnp.zeros((1,), jnp.int32))
    first = sampling.sample_rows(keys, logits, sp)[0]
    return row, first, decode.is_stop(first, stop_tokens)


@functools.partial(jax.jit, donate_argnames="pool")
def insert(pool: Pool, slot: jax.Array, row: cache_lib.KVCache, first: jax.Array,
           hit: jax.Array, request: jax.Array, limit: jax.Array,
           sp: sampling.SamplingParams) -> Pool:
    """Puts a prefilled request (:func:`prefill_one`) in row ``slot`` of the pool (donated:
    updated in place); the slot's previous request must have been taken out. ``limit`` is
    its token limit (scalar int32 >= 1)."""
    w = pool.out.shape[1]
    put = lambda x, v: x.at[slot].set(v)  # noqa: E731
    return Pool(
        cache=cache_lib.insert_row(pool.cache, row, slot), last=put(pool.last, first),
        out=put(pool.out, jnp.zeros((w,), jnp.int32).at[0].set(first)),
        n_generated=put(pool.n_generated, 1), limit=put(pool.limit, limit),
        done=put(pool.done, hit | (limit <= 1)), stopped=put(pool.stopped, hit),
        request=put(pool.request, request),
        sp=jax.tree.map(lambda a, b: a.at[slot].set(b[0]), pool.sp, sp))


@functools.partial(jax.jit, static_argnames="capacity")
def grow(pool: Pool, *, capacity: int) -> Pool:
    """The pool with ``capacity`` cache slots per row (at least its current capacity)."""
    return dataclasses.replace(pool, cache=cache_lib.extend(pool.cache, capacity))


@functools.partial(jax.jit, static_argnames=("target", "steps", "stop_tokens"),
                   donate_argnames="pool")
def decode_chunk(params, pool: Pool, rng: jax.Array, *, target: DecoderTarget, steps: int,
                 stop_tokens: tuple[int, ...]) -> Pool:
    """Up to ``steps`` plain decoding steps of every running row (fewer when all are done)."""
    b, w = pool.out.shape

    def body(carry):
        i, p = carry
        running = ~p.done
        keys = _keys(rng, p.request, p.n_generated)
        tok, _, cache = decode.plain_step(target, params, p.cache, p.last, p.cache.lengths,
                                          keys, p.sp, running)
        col = jnp.where(running, p.n_generated, w)  # past the end: dropped
        out = p.out.at[jnp.arange(b), col].set(tok, mode="drop")
        hit = running & decode.is_stop(tok, stop_tokens)
        n_generated = p.n_generated + running
        return i + 1, dataclasses.replace(
            p, cache=cache, last=jnp.where(running, tok, p.last), out=out,
            n_generated=n_generated, done=p.done | hit | (n_generated >= p.limit),
            stopped=p.stopped | hit)

    _, pool = jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[1].done), body,
                                 (jnp.int32(0), pool))
    return pool


@dataclasses.dataclass(frozen=True)
class Finished:
    """One request's result.

    Attributes:
      index: the request's position in the input.
      tokens: its generated tokens (a stop token that ended it included).
      stopped: whether it ended on a stop token (else on its limit).
    """

    index: int
    tokens: list[int]
    stopped: bool


def generate(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    pool_size: int = 64,
    chunk: int = 32,
    on_finish: Callable[[Finished], None] | None = None,
) -> list[Finished]:
    """Plain generation for many token-id prompts through a pool of ``pool_size`` rows.

    Requests enter the pool in the given order as rows free up. The pool's cache holds the
    longest request let in so far and grows when a longer one enters; attention reads all of
    it on every step, so giving prompts shortest first keeps it small for longest.

    Args:
      cfg, params: the target model.
      prompts: token-id lists, any lengths >= 1.
      max_new_tokens, temperature, top_k, top_p: per request, shared or one each (as
        :func:`specjax.api.generate_tokens`).
      seed: request i's randomness depends only on (seed, i).
      stop_tokens: ids that end a request.
      pool_size: rows decoding at once (B).
      chunk: decode steps between the host's refills; a row that ends mid-chunk idles until
        the chunk's end.
      on_finish: called with each request's :class:`Finished` as it is taken out.
    Returns:
      The :class:`Finished` of every request, in input order.
    Raises:
      ValueError: bad sampling values, an out-of-vocabulary token, an empty prompt, or a
        request longer than the model's context.
    """
    n = len(prompts)
    if not n:
        raise ValueError("no prompts given")
    if pool_size < 1 or chunk < 1:
        raise ValueError(f"pool_size and chunk must be >= 1, got {pool_size} and {chunk}")
    limits = api.request_limits(max_new_tokens, n)
    api.check_tokens(prompts, cfg.vocab_size)
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs a token")
    sp = sampling.SamplingParams.make(n, temperature, top_k, top_p)
    target = DecoderTarget(cfg)
    extra = targets_lib.step_tokens(target) - 1  # a bfloat16 step's scratch row
    # Slots request i needs: its prompt's prefill width and every token it may feed.
    need = [max(api.round_up(ln, PREFILL_BUCKET), ln + int(lim) + extra)
            for ln, lim in zip(lengths, limits)]
    if max(need) > cfg.max_position_embeddings:
        i = int(np.argmax(need))
        raise ValueError(f"prompt {i} plus its max_new_tokens needs {need[i]} positions; the "
                         f"model has {cfg.max_position_embeddings}")
    rows = min(pool_size, n)
    # The cache grows with the longest request let in (attention reads every slot, so a pool
    # of short requests sized for the longest one would pay for it on every step).
    capacity = api.round_up(max(need[:rows]), CAPACITY_MULTIPLE)
    pool = empty_pool(cfg, rows, capacity, int(limits.max()))
    rng = jax.random.key(seed)
    stops = tuple(int(t) for t in stop_tokens)
    waiting = collections.deque(range(n))
    owner: list[int | None] = [None] * rows
    results: list[Finished | None] = [None] * n

    def fill(pool, slot):
        i = waiting.popleft()
        if need[i] > pool.cache.capacity:
            pool = grow(pool, capacity=api.round_up(need[i], CAPACITY_MULTIPLE))
        tokens, length = api.pad_prompts([prompts[i]], PREFILL_BUCKET)
        row_sp = jax.tree.map(lambda a: a[i:i + 1], sp)
        row, first, hit = prefill_one(params, jnp.asarray(tokens), jnp.asarray(length),
                                      jnp.int32(i), row_sp, rng, target=target, stop_tokens=stops)
        owner[slot] = i
        return insert(pool, jnp.int32(slot), row, first, hit, jnp.int32(i),
                      jnp.int32(limits[i]), row_sp)

    for slot in range(rows):
        pool = fill(pool, slot)
    while any(o is not None for o in owner):
        pool = decode_chunk(params, pool, rng, target=target, steps=chunk, stop_tokens=stops)
        done, out, n_gen, stopped = jax.device_get(
            (pool.done, pool.out, pool.n_generated, pool.stopped))
        for slot, i in enumerate(owner):
            if i is None or not done[slot]:
                continue
            results[i] = Finished(i, out[slot, :n_gen[slot]].tolist(), bool(stopped[slot]))
            owner[slot] = None
            if on_finish is not None:
                on_finish(results[i])
            if waiting:
                pool = fill(pool, slot)
    return results
