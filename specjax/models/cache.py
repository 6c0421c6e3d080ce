"""Static-shape KV cache with per-row lengths.

Layout: one ``[B * K, S, H]`` array per layer for keys and one for values, kept in tuples over
layers rather than stacked (stacked caches ran several times slower on XLA:CPU), plus
``lengths[B]``, the number of committed slots of each row. Row ``b * K + j`` holds key/value head
``j`` of batch row ``b``. Heads come before slots (attention over heads-first caches ran ~5x
faster on XLA:CPU than slots-first), and batch and heads are flattened into one axis because a
size-1 batch axis made XLA:CPU copy the whole cache of every layer on every step (the write and
the attention read were fused through the bitcast that drops the unit axis; see
``tests/test_models.py::test_decode_step_does_not_copy_the_cache``).

A forward pass over T new tokens writes their keys/values at slots ``[lengths, lengths + T)`` of
each row but does not move ``lengths``: whoever decides how many of those tokens to keep
(plain decoding keeps all, verification keeps an accepted path) calls :func:`commit` or
:func:`advance`. Slots at or beyond ``lengths`` are stale scratch space, never attended to as
committed context.

bfloat16 caches are stored as ``uint16`` bit patterns: XLA:CPU rewrites a bf16
``dynamic_update_slice`` into a convert of the whole cache to f32 and back, which turned an
in-place write into a full-cache copy per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values plus per-row committed lengths.

    Attributes:
      k: tuple over layers of [B * K, S, H] arrays (``uint16`` bit patterns for bfloat16).
      v: tuple over layers of [B * K, S, H] arrays, like ``k``.
      lengths: [B] int32, committed slots per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        """S, the number of slots per row."""
        return self.k[0].shape[1]


def _storage_dtype(cfg: ModelConfig):
    return jnp.uint16 if cfg.dtype == "bfloat16" else cfg.jnp_dtype


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
    """An empty cache: ``batch`` rows of ``capacity`` slots, all lengths 0."""
    if capacity <= 0:
        raise ValueError(f"cache capacity must be positive, got {capacity}")
    shape = (batch * cfg.n_kv_heads, capacity, cfg.head_dim)
    dt = _storage_dtype(cfg)
    return KVCache(
        k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)),
        v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def to_storage(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Activations in ``cfg.dtype`` -> the cache's storage dtype."""
    if cfg.dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x


def from_storage(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The cache's storage dtype -> ``cfg.dtype`` activations."""
    if cfg.dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Writes ``new`` [B * K, T, H] into ``buf`` [B * K, S, H] at slots [start[b], start[b] + T).

    Args:
      buf: one layer's keys or values.
      new: the new tokens' keys or values, rows in the same order as ``buf``.
      start: [B] first slot of each batch row.

    The caller guarantees ``start + T <= S`` (``dynamic_update_slice`` would otherwise clamp the
    start and overwrite committed slots).
    """
    if start.shape[0] == 1:
        # A single row needs no scatter: one in-place dynamic_update_slice.
        return jax.lax.dynamic_update_slice(buf, new, (0, start[0], 0))
    rows_per_b = buf.shape[0] // start.shape[0]
    row_start = jnp.repeat(start, rows_per_b)  # [B * K]
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, 0)))(buf, new, row_start)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fresh:
    """Keys and values of T new tokens that a pass computed but did not write.

    Attributes:
      k: tuple over layers of [B * K, T, H] arrays in the cache's storage dtype.
      v: like ``k``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def write(cache: KVCache, fresh: Fresh) -> KVCache:
    """Stores ``fresh`` at slots ``[lengths, lengths + T)`` of every row, lengths unchanged."""
    return KVCache(k=tuple(write_rows(b, n, cache.lengths) for b, n in zip(cache.k, fresh.k)),
                   v=tuple(write_rows(b, n, cache.lengths) for b, n in zip(cache.v, fresh.v)),
                   lengths=cache.lengths)


def take(fresh: Fresh, path: jax.Array) -> Fresh:
    """The entries of ``path`` [B, P] (node indices into fresh's T tokens) of every row, in
    path order: a :class:`Fresh` of P tokens."""
    rows_per_b = fresh.k[0].shape[0] // path.shape[0]
    idx = jnp.repeat(path, rows_per_b, axis=0)[:, :, None]  # [B * K, P, 1]
    return Fresh(k=tuple(jnp.take_along_axis(x, idx, axis=1) for x in fresh.k),
                 v=tuple(jnp.take_along_axis(x, idx, axis=1) for x in fresh.v))


def insert_row(cache: KVCache, row: KVCache, b: jax.Array) -> KVCache:
    """Puts a one-row cache into batch row ``b`` (scalar int32) of ``cache``: its S' <= S slots
    go to slots ``[0, S')`` and its length becomes row b's; row b's old entries are dropped."""
    k = row.k[0].shape[0]  # kv heads
    start = (b * k, 0, 0)
    put = lambda dst, src: tuple(  # noqa: E731
        jax.lax.dynamic_update_slice(x, y, start) for x, y in zip(dst, src))
    return KVCache(k=put(cache.k, row.k), v=put(cache.v, row.v),
                   lengths=cache.lengths.at[b].set(row.lengths[0]))


def resize(cache: KVCache, capacity: int) -> KVCache:
    """The cache with ``capacity`` slots per row: new slots are zero, slots past ``capacity``
    are dropped and lengths are clipped to it (a row that must keep its committed slots needs
    ``capacity >= lengths``)."""
    if capacity <= 0:
        raise ValueError(f"cache capacity must be positive, got {capacity}")
    if capacity >= cache.capacity:
        pad = ((0, 0), (0, capacity - cache.capacity), (0, 0))
        fit = lambda x: jnp.pad(x, pad)  # noqa: E731
    else:
        fit = lambda x: x[:, :capacity]  # noqa: E731
    return KVCache(k=tuple(fit(x) for x in cache.k), v=tuple(fit(x) for x in cache.v),
                   lengths=jnp.minimum(cache.lengths, capacity))


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commits the first ``n[b]`` freshly written slots of each row as they are."""
    return dataclasses.replace(cache, lengths=cache.lengths + n.astype(jnp.int32))


def commit(cache: KVCache, path: jax.Array, n_keep: jax.Array) -> KVCache:
    """Keeps an accepted path of freshly written nodes, compacted to contiguous slots.

    After a pass over N nodes written at slots ``[lengths, lengths + N)``, node ``path[b, j]`` is
    moved to slot ``lengths[b] + j`` for every j (all of them are gathered before any is
    written, so overlapping moves are safe) and ``lengths`` grows by ``n_keep``. Entries beyond
    ``n_keep`` land past the new length, where they are harmless scratch. ``path[:, 0]`` is the
    root, node 0, already at slot ``lengths``: it is not moved, so a one-entry path (a plain
    decoding step) is just :func:`advance`.

    Args:
      cache: the cache after the verify pass.
      path: [B, P] int32 node indices (0 = first node written), root (0) first.
      n_keep: [B] int32, how many leading path entries to keep (accepted drafts + root).
    Returns:
      The cache with the path compacted and lengths advanced.
    """
    if path.shape[1] == 1:
        return advance(cache, n_keep)
    rows_per_b = cache.k[0].shape[0] // cache.batch
    slots = jnp.repeat(cache.lengths[:, None] + path[:, 1:], rows_per_b, axis=0)  # [B * K, P - 1]

    def move(buf):
        return write_rows(buf, jnp.take_along_axis(buf, slots[:, :, None], axis=1),
                          cache.lengths + 1)

    return KVCache(
        k=tuple(move(b) for b in cache.k),
        v=tuple(move(b) for b in cache.v),
        lengths=cache.lengths + n_keep.astype(jnp.int32),
    )
