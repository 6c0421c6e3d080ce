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
                        paired: Sequence[tuple[jax.Array, jax.Array]] = ()) -> jax.Array:
    """Softmax attention of each row's queries over several key/value blocks at once, in float32.

    Args:
      q: [C, Q, H] queries; row c holds every query that reads key/value row c.
      blocks: a sequence of ``(k [C, S_i, H], v [C, S_i, H], visible [C, Q, S_i])``: the keys
        and values of block i and which of them each query may attend to. One softmax runs
        over the visible keys of all blocks together, so a cache and the pass's own fresh keys
        (or a context and a draft block) need not be concatenated first.
      paired: a sequence of ``(k [C, Q, H], v [C, Q, H])``: one more key per query, seen by
        that query alone (query q of row c sees ``k[c, q]``). A block whose mask is a diagonal
        (EAGLE-3's training-time test) costs Q scores this way instead of Q x S.
      Every query must see at least one key, so ``blocks`` and ``paired`` are not both empty.
    Returns:
      [C, Q, H] attention outputs in ``q.dtype``.
    """
    if not blocks and not paired:
        raise ValueError("attention needs at least one key/value block")
    scale = q.shape[-1] ** -0.5
    # With few queries per row (decoding steps), scores laid out [C, S, Q] ran 1.6-3x faster
    # on XLA:CPU than [C, Q, S] for 32 rows of 3 queries over 512-1024 slots, and no slower
    # for one row; with many queries (verify passes, prefill) [C, Q, S] is faster.
    keys_first = q.shape[1] <= FEW_QUERIES
    axis = 1 if keys_first else 2  # the key axis of the scores

    def qk(k, visible):  # [C, S_i, Q] or [C, Q, S_i] float32 scores, masked
        if keys_first:
            s = jnp.einsum("csh,cqh->csq", k, q, preferred_element_type=jnp.float32)
            return jnp.where(visible.transpose(0, 2, 1), s * scale, -jnp.inf)
        s = jnp.einsum("cqh,csh->cqs", q, k, preferred_element_type=jnp.float32)
        return jnp.where(visible, s * scale, -jnp.inf)

    def own(k):  # [C, 1, Q] or [C, Q, 1] float32 scores of each query's own key
        s = jnp.einsum("cqh,cqh->cq", q, k, preferred_element_type=jnp.float32) * scale
        return jnp.expand_dims(s, axis)

    scores = [qk(k, visible) for k, _, visible in blocks] + [own(k) for k, _ in paired]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=axis) if len(scores) > 1 else scores[0],
                           axis=axis)
    out, start = 0.0, 0
    for k, v, _ in blocks:
        width = k.shape[1]
        part = jax.lax.slice_in_dim(probs, start, start + width, axis=axis).astype(v.dtype)
        out = out + jnp.einsum("csh,csq->cqh" if keys_first else "csh,cqs->cqh", v, part,
                               preferred_element_type=jnp.float32)
        start += width
    for _, v in paired:
        part = jnp.squeeze(jax.lax.slice_in_dim(probs, start, start + 1, axis=axis), axis)
        out = out + part[..., None] * v.astype(jnp.float32)
        start += 1
    return out.astype(q.dtype)
