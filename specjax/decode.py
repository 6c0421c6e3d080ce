"""Generation loops: plain autoregressive decoding as one jitted call per request.

A request is a right-padded batch of prompts ``prompt[B, P]`` with true lengths ``prompt_len[B]``.
One jitted call prefills the target, samples the first new token of each row, then runs a
``lax.while_loop`` of one-token steps until every row has produced ``max_new_tokens`` tokens or
hit a stop token. Nothing leaves the device until the call returns.

Row independence: a row's tokens depend only on its own prompt, sampling parameters and rng
key (``jax.random.fold_in(rng, row)``), never on padding, the batch size or its position in the
batch, up to floating-point reassociation inside batched matrix products.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generation:
    """The result of a generation call.

    Attributes:
      tokens: [B, max_new_tokens] int32 generated tokens; entries past ``n_generated`` are
        ``pad_id``. A stop token that ended a row is included.
      n_generated: [B] int32, generated tokens per row (stop token included).
      stopped: [B] bool, whether the row ended on a stop token (else on ``max_new_tokens``).
    """

    tokens: jax.Array
    n_generated: jax.Array
    stopped: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainState:
    """The ``lax.while_loop`` carry of plain decoding.

    Attributes:
      step: scalar int32, tokens generated so far by rows that are still running.
      last: [B] int32, each row's newest token (its K/V is not in the cache yet).
      out: [B, max_new_tokens] int32 output buffer.
      n_generated: [B] int32.
      done: [B] bool, rows that hit a stop token or the token limit.
      stopped: [B] bool, rows that hit a stop token.
      cache: the target KV cache (``lengths`` = prompt + generated - 1 for running rows).
      rng: the base PRNG key; step ``i`` of row ``b`` uses ``fold_in(fold_in(rng, b), i)``.
    """

    step: jax.Array
    last: jax.Array
    out: jax.Array
    n_generated: jax.Array
    done: jax.Array
    stopped: jax.Array
    cache: cache_lib.KVCache
    rng: jax.Array


def row_keys(rng: jax.Array, batch: int, step: jax.Array) -> jax.Array:
    """Per-row keys [B] for one step: independent of the batch composition."""
    return jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(rng, b), step))(
        jnp.arange(batch))


def sample_rows(keys: jax.Array, logits: jax.Array, sp: sampling.SamplingParams) -> jax.Array:
    """Samples one token per row, each row with its own key: logits [B, V] -> [B] int32.

    Greedy rows are exactly ``argmax``; an all-greedy batch skips the processing entirely (a
    ``lax.cond`` on device, so no host round-trip).
    """
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        logp = sampling.log_probs(logits, sp)
        return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.all(sp.greedy), lambda: argmax, draw)
    return jnp.where(sp.greedy, argmax, drawn)


def is_stop(tokens: jax.Array, stop_tokens: tuple[int, ...]) -> jax.Array:
    """Elementwise: whether each token is in the static ``stop_tokens`` set."""
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, tokens.dtype))


def prefill(params, cfg: ModelConfig, prompt, prompt_len, capacity: int, taps: tuple[int, ...] = ()):
    """Runs the target over right-padded prompts.

    Args:
      prompt: [B, P] int32, right-padded.
      prompt_len: [B] int32 true lengths (>= 1).
      capacity: S, cache slots per row.
      taps: residual layers to return for every prompt position.
    Returns:
      last_logits: [B, V] float32 logits at each row's last prompt token.
      tap_states: [B, P, n_taps, D].
      cache: the cache with ``lengths = prompt_len`` (slots past it hold padding garbage).
    """
    b, p = prompt.shape
    cache = cache_lib.init_cache(cfg, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, tap_states, cache = target.forward_hidden(params, cfg, prompt, positions, cache,
                                                      taps=taps)
    last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    cache = cache_lib.advance(cache, prompt_len)
    return target.lm_head(params, cfg, last), tap_states, cache


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "capacity", "stop_tokens",
                                             "pad_id"))
def generate(
    params: dict,
    prompt: jax.Array,
    prompt_len: jax.Array,
    sp: sampling.SamplingParams,
    rng: jax.Array,
    *,
    cfg: ModelConfig,
    max_new_tokens: int,
    capacity: int,
    stop_tokens: tuple[int, ...] = (),
    pad_id: int = 0,
) -> Generation:
    """Plain autoregressive generation, prefill and decode loop in one jitted call.

    Args:
      params: target params.
      prompt: [B, P] int32 right-padded prompts.
      prompt_len: [B] int32 true prompt lengths.
      sp: per-row sampling parameters (temperature 0 = greedy).
      rng: a PRNG key.
      cfg: the target config (static).
      max_new_tokens: tokens to generate per row at most (static).
      capacity: cache slots per row; must be >= P + max_new_tokens (static; checked by
        :func:`check_capacity`, called by the high-level API).
      stop_tokens: token ids that end a row (static).
      pad_id: filler for the output past each row's end.
    Returns:
      A :class:`Generation`.
    """
    b = prompt.shape[0]
    logits, _, cache = prefill(params, cfg, prompt, prompt_len, capacity)
    first = sample_rows(row_keys(rng, b, jnp.int32(0)), logits, sp)
    first_stop = is_stop(first, stop_tokens)
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    state = PlainState(
        step=jnp.int32(1), last=first, out=out, n_generated=jnp.ones((b,), jnp.int32),
        done=first_stop | (max_new_tokens <= 1), stopped=first_stop, cache=cache, rng=rng)

    def cond(s: PlainState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: PlainState):
        positions = s.cache.lengths[:, None]
        logits, _, cache = target.forward(params, cfg, s.last[:, None], positions, s.cache)
        tok = sample_rows(row_keys(s.rng, b, s.step), logits[:, 0], sp)
        running = ~s.done
        # Finished rows stop advancing their cache so they can never run past capacity.
        cache = cache_lib.advance(cache, running.astype(jnp.int32))
        tok = jnp.where(running, tok, pad_id)
        out = jax.lax.dynamic_update_slice(s.out, tok[:, None], (0, s.step))
        hit = running & is_stop(tok, stop_tokens)
        n_generated = s.n_generated + running
        done = s.done | hit | (n_generated >= max_new_tokens)
        return PlainState(step=s.step + 1, last=jnp.where(running, tok, s.last), out=out,
                          n_generated=n_generated, done=done, stopped=s.stopped | hit,
                          cache=cache, rng=s.rng)

    state = jax.lax.while_loop(cond, body, state)
    return Generation(tokens=state.out, n_generated=state.n_generated, stopped=state.stopped)


def check_capacity(prompt_tokens: int, max_new_tokens: int, capacity: int, extra: int = 0):
    """Raises ValueError when a request cannot fit the cache.

    ``extra`` is the scratch a verify pass needs past the committed tokens (its node budget).
    """
    need = prompt_tokens + max_new_tokens + extra
    if need > capacity:
        raise ValueError(
            f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens}"
            + (f" + {extra} verify slots" if extra else "")
            + f" needs {need} cache slots, but the cache holds {capacity}"
        )
