"""Continuous batching: many requests through a fixed pool of decoding rows.

One plain generation call (:func:`specjax.decode.generate`) runs until its longest row ends. When
response lengths vary from a few tokens to the limit, as sampled answers do, most rows sit idle
for most of the call: distilling SmolLM2's training set, batches of 64 did 39-65% useful work.
Here a pool of B rows decodes in jitted chunks of up to ``chunk`` steps; between chunks the host
takes out the rows that finished and prefills waiting requests into their slots, so nearly every
row-step produces a token. A host round-trip per chunk (not per token) is the price.

The cache follows what the running rows use: before each chunk it is resized (grown or cut, in
steps of ``CAPACITY_MULTIPLE`` slots) to the most slots any row can reach by the chunk's end, so
the attention of a pool whose long requests have left stops paying for their slots.

Determinism: request i draws its token j with the key ``fold_in(fold_in(key(seed), i), j)``, the
key :func:`specjax.decode.generate` gives row i of one batch holding every request (per-request
seeds and ids let one pool serve several such batches), and a request's prompt is prefilled
alone. Its tokens therefore depend on its prompt, its sampling parameters and its key, not on the
pool size, its slot, its neighbours, the cache's capacity or when it ran, up to floating-point
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
from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.targets import DecoderTarget

PREFILL_BUCKET = 64  # prompt widths round up to this: one prefill executable per bucket
CAPACITY_MULTIPLE = 128  # the pool's cache is resized in steps of this many slots


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
      key: [B] PRNG keys, each row's request key (its token j draws with ``fold_in(key, j)``).
      sp: the rows' sampling parameters ([B] each).
    """

    cache: cache_lib.KVCache
    last: jax.Array
    out: jax.Array
    n_generated: jax.Array
    limit: jax.Array
    done: jax.Array
    stopped: jax.Array
    key: jax.Array
    sp: sampling.SamplingParams


def _keys(key: jax.Array, index: jax.Array) -> jax.Array:
    """[B] keys: token ``index[b]`` of the request whose key is ``key[b]`` (a request key is
    ``fold_in(key(seed), i)``, so this is :func:`decode.row_keys`' key of row i)."""
    return jax.vmap(jax.random.fold_in)(key, index)


def empty_pool(cfg: ModelConfig, rows: int, capacity: int, width: int) -> Pool:
    """A pool of ``rows`` empty (done) rows with ``capacity`` cache slots and ``width`` output
    columns each."""
    def zeros():  # a buffer of its own for each field: the pool is donated
        return jnp.zeros((rows,), jnp.int32)

    return Pool(cache=cache_lib.init_cache(cfg, rows, capacity), last=zeros(),
                out=jnp.zeros((rows, width), jnp.int32), n_generated=zeros(), limit=zeros(),
                done=jnp.ones((rows,), bool), stopped=jnp.zeros((rows,), bool),
                key=jax.random.split(jax.random.key(0), rows),
                sp=sampling.SamplingParams.make(rows))


@functools.partial(jax.jit, static_argnames=("target", "stop_tokens"))
def prefill_one(params, prompt: jax.Array, prompt_len: jax.Array, key: jax.Array,
                sp: sampling.SamplingParams, *, target: DecoderTarget,
                stop_tokens: tuple[int, ...]):
    """Prefills one request alone and samples its first token.

    Args:
      params: target params.
      prompt: [1, P] int32 right-padded prompt; prompt_len: [1] int32 its true length.
      key: the request's key (scalar PRNG key); sp: its sampling parameters ([1] each).
      target: static :class:`DecoderTarget`; stop_tokens: static ids that end a request.
    Returns:
      ``(row, first, hit)``: a one-row cache of P slots, the first token (scalar int32) and
      whether it is a stop token.
    """
    logits, _, row = target.prefill(params, prompt, prompt_len, prompt.shape[1])
    keys = _keys(key[None], jnp.zeros((1,), jnp.int32))
    first = sampling.sample_rows(keys, logits, sp)[0]
    return row, first, decode.is_stop(first, stop_tokens)


@functools.partial(jax.jit, donate_argnames="pool")
def insert(pool: Pool, slot: jax.Array, row: cache_lib.KVCache, first: jax.Array,
           hit: jax.Array, key: jax.Array, limit: jax.Array,
           sp: sampling.SamplingParams) -> Pool:
    """Puts a prefilled request (:func:`prefill_one`) in row ``slot`` of the pool (donated:
    updated in place); the slot's previous request must have been taken out. ``key`` is the
    request's key and ``limit`` its token limit (scalar int32 >= 1); the pool's capacity must
    hold the row's slots."""
    w = pool.out.shape[1]
    put = lambda x, v: x.at[slot].set(v)  # noqa: E731
    return Pool(
        cache=cache_lib.insert_row(pool.cache, row, slot), last=put(pool.last, first),
        out=put(pool.out, jnp.zeros((w,), jnp.int32).at[0].set(first)),
        n_generated=put(pool.n_generated, 1), limit=put(pool.limit, limit),
        done=put(pool.done, hit | (limit <= 1)), stopped=put(pool.stopped, hit),
        key=put(pool.key, key),
        sp=jax.tree.map(lambda a, b: a.at[slot].set(b[0]), pool.sp, sp))


@functools.partial(jax.jit, static_argnames="capacity")
def resize(pool: Pool, *, capacity: int) -> Pool:
    """The pool with ``capacity`` cache slots per row (:func:`specjax.models.cache.resize`:
    running rows need ``capacity`` above their lengths)."""
    return dataclasses.replace(pool, cache=cache_lib.resize(pool.cache, capacity))


def slots_needed(prompt_len: int, n_generated: int, need: int, steps: int) -> int:
    """Cache slots one row can touch by the end of a chunk of ``steps`` decode steps.

    Its committed length is ``prompt_len + n_generated - 1`` (the newest token is not in the
    cache yet); each step writes one slot past the committed ones. ``need`` (at least the
    prompt's prefill width) caps it: the most the request can ever use.
    """
    return min(need, prompt_len + n_generated - 1 + steps)


@functools.partial(jax.jit, static_argnames=("target", "steps", "stop_tokens"),
                   donate_argnames="pool")
def decode_chunk(params, pool: Pool, *, target: DecoderTarget, steps: int,
                 stop_tokens: tuple[int, ...]) -> Pool:
    """Up to ``steps`` plain decoding steps of every running row (fewer when all are done)."""
    b, w = pool.out.shape

    def body(carry):
        i, p = carry
        running = ~p.done
        keys = _keys(p.key, p.n_generated)
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
    seed: int | Sequence[int] = 0,
    request_ids: Sequence[int] | None = None,
    stop_tokens: Sequence[int] = (),
    pool_size: int = 64,
    chunk: int = 32,
    on_finish: Callable[[Finished], None] | None = None,
) -> list[Finished]:
    """Plain generation for many token-id prompts through a pool of ``pool_size`` rows.

    Requests enter the pool in the given order as rows free up. Before each chunk the cache is
    resized to the slots its rows can reach by the chunk's end; attention reads all of it on
    every step, so giving prompts shortest first keeps it small for longest.

    Args:
      cfg, params: the target model.
      prompts: token-id lists, any lengths >= 1.
      max_new_tokens, temperature, top_k, top_p: per request, shared or one each (as
        :func:`specjax.api.generate_tokens`).
      seed: shared or one per request; request i draws its token j with the key
        ``fold_in(fold_in(key(seed_i), id_i), j)``: row ``id_i`` of a plain batch with seed
        ``seed_i``.
      request_ids: ``id_i`` of each request (default: its position, i).
      stop_tokens: ids that end a request.
      pool_size: rows decoding at once (B).
      chunk: decode steps between the host's refills; a row that ends mid-chunk idles until
        the chunk's end.
      on_finish: called with each request's :class:`Finished` as it is taken out.
    Returns:
      The :class:`Finished` of every request, in input order.
    Raises:
      ValueError: bad sampling values, an out-of-vocabulary token, an empty prompt, a request
        longer than the model's context, or per-request seeds or ids not one per prompt.
    """
    n = len(prompts)
    if not n:
        raise ValueError("no prompts given")
    if pool_size < 1 or chunk < 1:
        raise ValueError(f"pool_size and chunk must be >= 1, got {pool_size} and {chunk}")
    limits = api.request_limits(max_new_tokens, n)
    seeds = [int(seed)] * n if np.isscalar(seed) else [int(x) for x in seed]
    ids = list(range(n)) if request_ids is None else [int(x) for x in request_ids]
    if len(seeds) != n or len(ids) != n:
        raise ValueError(f"{len(seeds)} seeds and {len(ids)} request_ids for {n} prompts; "
                         "give one each (or one shared seed and no ids)")
    api.check_tokens(prompts, cfg.vocab_size)
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs a token")
    sp = sampling.SamplingParams.make(n, temperature, top_k, top_p)
    target = DecoderTarget(cfg)
    width = [api.round_up(ln, PREFILL_BUCKET) for ln in lengths]
    # Slots request i may ever use: its prompt's prefill width and every token it may feed.
    need = [max(w, ln + int(lim)) for w, ln, lim in zip(width, lengths, limits)]
    if max(need) > cfg.max_position_embeddings:
        i = int(np.argmax(need))
        raise ValueError(f"prompt {i} plus its max_new_tokens needs {need[i]} positions; the "
                         f"model has {cfg.max_position_embeddings}")
    rows = min(pool_size, n)
    bases = {s: jax.random.key(s) for s in set(seeds)}
    stops = tuple(int(t) for t in stop_tokens)
    waiting = collections.deque(range(n))
    owner: list[int | None] = [None] * rows
    n_gen = np.zeros(rows, np.int64)  # the host's copy after each chunk
    results: list[Finished | None] = [None] * n
    pool = None

    def fill(pool, slot, i):
        tokens, length = api.pad_prompts([prompts[i]], PREFILL_BUCKET)
        row_sp = jax.tree.map(lambda a: a[i:i + 1], sp)
        key = jax.random.fold_in(bases[seeds[i]], ids[i])
        row, first, hit = prefill_one(params, jnp.asarray(tokens), jnp.asarray(length), key,
                                      row_sp, target=target, stop_tokens=stops)
        return insert(pool, jnp.int32(slot), row, first, hit, key, jnp.int32(limits[i]), row_sp)

    while True:
        entering = []
        for slot in range(rows):
            if owner[slot] is None and waiting:
                owner[slot] = waiting.popleft()
                n_gen[slot] = 1
                entering.append(slot)
        if all(i is None for i in owner):
            break
        reach = max(max(width[i] if slot in entering else 0,
                        slots_needed(lengths[i], int(n_gen[slot]), need[i], chunk))
                    for slot, i in enumerate(owner) if i is not None)
        capacity = api.round_up(reach, CAPACITY_MULTIPLE)
        if pool is None:
            pool = empty_pool(cfg, rows, capacity, int(limits.max()))
        elif capacity != pool.cache.capacity:
            pool = resize(pool, capacity=capacity)
        for slot in entering:
            pool = fill(pool, slot, owner[slot])
        pool = decode_chunk(params, pool, target=target, steps=chunk, stop_tokens=stops)
        done, out, n_gen, stopped = jax.device_get(
            (pool.done, pool.out, pool.n_generated, pool.stopped))
        n_gen = np.array(n_gen, np.int64)
        for slot, i in enumerate(owner):
            if i is None or not done[slot]:
                continue
            results[i] = Finished(i, out[slot, :n_gen[slot]].tolist(), bool(stopped[slot]))
            owner[slot] = None
            if on_finish is not None:
                on_finish(results[i])
    return results
