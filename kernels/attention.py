"""Masked grouped-query attention over a KV cache: the reference every kernel must match.

Shapes: C cache rows (batch x key/value heads, flattened), Q queries per cache row (query heads
sharing that key/value head x new tokens), S cache slots, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                        fresh: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """Softmax attention of each cache row's queries over all of its slots, in float32.

    Args:
      q: [C, Q, H] queries; row c holds every query that reads key/value row c.
      k: [C, S, H] keys of every cache slot.
      v: [C, S, H] values.
      visible: [C, Q, S] bool, which slots each query may attend to (a tree or causal mask
        merged with the committed prefix). Every query must see at least one slot.
      fresh: optional ``(k_new [C, T, H], v_new [C, T, H], visible_new [C, Q, T])``: keys and
        values of the pass's own T tokens that are not in the cache, and which of them each
        query sees. The softmax then runs over the visible slots and fresh keys together.
    Returns:
      [C, Q, H] attention outputs in ``q.dtype``.
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("cqh,csh->cqs", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, -jnp.inf)
    if fresh is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("cqs,csh->cqh", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
    k_new, v_new, visible_new = fresh
    s_new = jnp.einsum("cqh,cth->cqt", q, k_new, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.concatenate(
        [scores, jnp.where(visible_new, s_new, -jnp.inf)], axis=-1), axis=-1)  # [C, Q, S + T]
    slots = k.shape[1]
    out = (jnp.einsum("cqs,csh->cqh", probs[..., :slots].astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("cqt,cth->cqh", probs[..., slots:].astype(v_new.dtype), v_new,
                        preferred_element_type=jnp.float32))
    return out.astype(q.dtype)
