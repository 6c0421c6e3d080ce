"""Masked grouped-query attention over key/value blocks: the reference every kernel must match.

Shapes: C key/value rows (batch x key/value heads, flattened), Q queries per row (the query
heads sharing that key/value head x the call's tokens), S_i slots of key block i, H head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def reference_attention(q: jax.Array,
                        blocks: Sequence[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Softmax attention of each row's queries over several key/value blocks at once, in float32.

    Args:
      q: [C, Q, H] queries; row c holds every query that reads key/value row c.
      blocks: a non-empty sequence of ``(k [C, S_i, H], v [C, S_i, H], visible [C, Q, S_i])``:
        the keys and values of block i and which of them each query may attend to. One
        softmax runs over the visible keys of all blocks together, so a cache and the pass's
        own fresh keys (or a context and a draft block) need not be concatenated first. Every
        query must see at least one key.
    Returns:
      [C, Q, H] attention outputs in ``q.dtype``.
    """
    if not blocks:
        raise ValueError("attention needs at least one key/value block")
    scale = q.shape[-1] ** -0.5
    scores = [jnp.where(visible, jnp.einsum("cqh,csh->cqs", q, k,
                                            preferred_element_type=jnp.float32) * scale, -jnp.inf)
              for k, _, visible in blocks]
    if len(blocks) == 1:
        k, v, _ = blocks[0]
        probs = jax.nn.softmax(scores[0], axis=-1).astype(v.dtype)
        return jnp.einsum("cqs,csh->cqh", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [C, Q, sum S_i]
    out, start = 0.0, 0
    for k, v, _ in blocks:
        width = k.shape[1]
        out = out + jnp.einsum("cqs,csh->cqh", probs[..., start: start + width].astype(v.dtype), v,
                               preferred_element_type=jnp.float32)
        start += width
    return out.astype(q.dtype)
