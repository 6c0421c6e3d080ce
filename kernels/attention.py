"""Masked grouped-query attention over key/value blocks: the reference every kernel must match.

Shapes: C key/value rows (batch x key/value heads, flattened), Q queries per row (the query
heads sharing that key/value head x the call's tokens), S_i slots of key block i, H head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

FEW_QUERIES = 8  # rows with at most this many queries use the keys-first score layout


def reference_attention(q: jax.Array,
                        blocks: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
                        local: Sequence[tuple[jax.Array, jax.Array, int, bool]] = ()) -> jax.Array:
    """Softmax attention of each row's queries over several key/value blocks at once, in float32.

    Args:
      q: [C, Q, H] queries; row c holds every query that reads key/value row c.
      blocks: a sequence of ``(k [C, S_i, H], v [C, S_i, H], visible [C, Q, S_i])``: the keys
        and values of block i and which of them each query may attend to. One softmax runs
        over the visible keys of all blocks together, so a cache and the pass's own fresh keys
        (or a context and a draft block) need not be concatenated first.
      local: a sequence of ``(k [C, S, H], v [C, S, H], size, causal)``, blocks whose
        visibility is local, scored without an S-wide mask: the Q queries are G = Q / S groups
        of S (query ``g * S + t`` stands at key index t) and query t sees the keys of its own
        span of ``size`` (``s // size == t // size``, S a multiple of ``size``), those up to
        itself only when ``causal``. ``size`` 1 is a diagonal (EAGLE-3's training-time test),
        a larger one DFlash's training blocks: Q x size scores instead of Q x S.
      Every query must see at least one key, so ``blocks`` and ``local`` are not both empty.
    Returns:
      [C, Q, H] attention outputs in ``q.dtype``.
    """
    if not blocks and not local:
        raise ValueError("attention needs at least one key/value block")
    c, nq, h = q.shape
    scale = h ** -0.5
    # With few queries per row (decoding steps), scores laid out [C, S, Q] ran 1.6-3x faster
    # on XLA:CPU than [C, Q, S] for 32 rows of 3 queries over 512-1024 slots, and no slower
    # for one row; with many queries (verify passes, prefill) [C, Q, S] is faster.
    keys_first = nq <= FEW_QUERIES
    axis = 1 if keys_first else 2  # the key axis of the scores

    def qk(k, visible):  # [C, S_i, Q] or [C, Q, S_i] float32 scores, masked
        if keys_first:
            s = jnp.einsum("csh,cqh->csq", k, q, preferred_element_type=jnp.float32)
            return jnp.where(visible.transpose(0, 2, 1), s * scale, -jnp.inf)
        s = jnp.einsum("cqh,csh->cqs", q, k, preferred_element_type=jnp.float32)
        return jnp.where(visible, s * scale, -jnp.inf)

    def spans(x, size):  # [C, S, ...] -> [C, S / size, size, ...]
        return x.reshape(c, x.shape[1] // size, size, *x.shape[2:])

    def local_qk(k, size, causal):  # [C, size, Q] or [C, Q, size] float32 scores, masked
        groups = nq // k.shape[1]
        qs = q.reshape(c, groups, k.shape[1] // size, size, h)
        s = jnp.einsum("cgnih,cnjh->cgnij", qs, spans(k, size),
                       preferred_element_type=jnp.float32) * scale
        if causal:
            s = jnp.where(jnp.tril(jnp.ones((size, size), bool)), s, -jnp.inf)
        s = s.reshape(c, nq, size)
        return s.transpose(0, 2, 1) if keys_first else s

    scores = ([qk(k, visible) for k, _, visible in blocks]
              + [local_qk(k, size, causal) for k, _, size, causal in local])
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=axis) if len(scores) > 1 else scores[0],
                           axis=axis)
    out, start = 0.0, 0
    for k, v, _ in blocks:
        width = k.shape[1]
        part = jax.lax.slice_in_dim(probs, start, start + width, axis=axis).astype(v.dtype)
        out = out + jnp.einsum("csh,csq->cqh" if keys_first else "csh,cqs->cqh", v, part,
                               preferred_element_type=jnp.float32)
        start += width
    for k, v, size, _ in local:
        part = jax.lax.slice_in_dim(probs, start, start + size, axis=axis).astype(v.dtype)
        if keys_first:
            part = part.transpose(0, 2, 1)
        part = part.reshape(c, nq // k.shape[1], k.shape[1] // size, size, size)
        out = out + jnp.einsum("cgnij,cnjh->cgnih", part, spans(v, size),
                               preferred_element_type=jnp.float32).reshape(c, nq, h)
        start += size
    return out.astype(q.dtype)
