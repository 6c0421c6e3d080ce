"""Fused tree attention over a KV cache: a verify pass's attention in one Pallas kernel.

The queries of a verify pass are the N tree nodes of every row, with the query heads that share
a key/value head folded in (GQA); the keys are the row's committed cache slots (``< length``)
plus the N new nodes under the ancestor-or-self mask. The kernel takes that structure as it is,
lengths and an [N, N] tree, never a dense [N, S] mask:

* the cache is split into ``n_split`` pieces along its slots (flash-decoding), one program per
  (row, piece); each walks its piece ``block_k`` slots at a time with an online softmax and
  stops at the row's length, so short rows cost little;
* the first piece also attends to the N new nodes under the tree mask;
* a combine step merges the pieces' partial softmaxes exactly.

Shapes: C rows (batch x key/value heads, flattened; row ``b * K + j``), Q = G x N queries per
row (query ``g * N + n`` is head g of the group at node n), S cache slots, H head dim.

Backend: Pallas on GPU through the Triton lowering (``compiler_params=
pallas.triton.CompilerParams``). It is the mature path for attention in the pinned jax (0.10)
and in the 0.11 series a GPU machine is likely to have: its block-level ``dot``, masked loads
and dynamic loop bounds lower on every NVIDIA generation from Ampere on, while Mosaic GPU (the
default lowering of ``pallas_call`` for CUDA there) targets Hopper-class warpgroup code and
asks for hand-placed shared memory. Triton wants power-of-two block shapes of at least 16 for
its matrix products: queries and nodes are padded to them here; ``block_k`` and the head dim
must be powers of two, and the cache's slot count a multiple of ``n_split * block_k``.

``tree_attention_reference`` is the definition; ``tree_attention`` checks its inputs and runs
the kernel (``interpret=True`` runs it on any backend through Pallas's interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .attention import reference_attention

_NEG = -1e30  # the masked score: finite, so a row that sees nothing yet stays NaN-free


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def tree_attention_reference(q, k, v, lengths, k_new, v_new, tree):
    """The plain-jnp definition.

    Args:
      q: [C, Q, H] queries, Q = G * N.
      k, v: [C, S, H] the cache.
      lengths: [C] int32 committed slots of each row.
      k_new, v_new: [C, N, H] the new nodes' keys and values.
      tree: [C // K, N, N] bool, ``tree[b, i, j]``: node j is node i or one of its ancestors
        (row c reads ``tree[c // K]``, K = C // tree.shape[0]).
    Returns:
      [C, Q, H] in ``q.dtype``.
    """
    c, nq, _ = q.shape
    s, n = k.shape[1], k_new.shape[1]
    per_b = c // tree.shape[0]
    prefix = jnp.arange(s)[None, None, :] < lengths[:, None, None]  # [C, 1, S]
    anc = jnp.repeat(tree, per_b, axis=0)  # [C, N, N]
    anc = jnp.tile(anc, (1, nq // n, 1))  # query g * N + i reads node i's row
    return reference_attention(q, [(k, v, jnp.broadcast_to(prefix, (c, nq, s))),
                                   (k_new, v_new, anc)])


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *refs, block_k: int,
            s_split: int, scale: float):
    o_ref, m_ref, l_ref = refs[-3:]  # (poisoned inputs aliased to them come first)
    piece = pl.program_id(1)
    length = len_ref[0]
    q = q_ref[0]  # [Qp, H]
    qp = q.shape[0]

    def update(carry, s, visible, v):
        m, l, acc = carry
        s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    def chunk(i, carry):
        start = piece * s_split + i * block_k
        k = k_ref[0, pl.ds(i * block_k, block_k), :]
        v = v_ref[0, pl.ds(i * block_k, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [Qp, block_k]
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (qp, block_k), 1)
        return update(carry, s, slot < length, v)

    init = (jnp.full((qp,), _NEG, jnp.float32), jnp.zeros((qp,), jnp.float32),
            jnp.zeros((qp, q.shape[1]), jnp.float32))
    # Only the chunks that hold committed slots: a short row stops early.
    todo = jnp.clip(pl.cdiv(length - piece * s_split, block_k), 0, s_split // block_k)
    carry = jax.lax.fori_loop(0, todo, chunk, init)
    # The new nodes, under the tree, in the first piece only.
    s = jnp.dot(q, kn_ref[0].T, preferred_element_type=jnp.float32) * scale  # [Qp, Np]
    m, l, acc = update(carry, s, (mask_ref[0] != 0) & (piece == 0), vn_ref[0])
    o_ref[0, 0] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    m_ref[0, 0] = m
    l_ref[0, 0] = l


def _check(q, k, v, lengths, k_new, v_new, tree, block_k, n_split):
    c, nq, h = q.shape
    if k.shape != v.shape or k.shape[0] != c or k.shape[2] != h:
        raise ValueError(f"cache keys {k.shape} / values {v.shape} do not match queries {q.shape}")
    if k_new.shape != v_new.shape or k_new.shape[0] != c or k_new.shape[2] != h:
        raise ValueError(f"new keys {k_new.shape} / values {v_new.shape} do not match queries "
                         f"{q.shape}")
    n = k_new.shape[1]
    if tree.ndim != 3 or tree.shape[1:] != (n, n) or c % tree.shape[0]:
        raise ValueError(f"tree mask {tree.shape} must be [B, {n}, {n}] with B dividing {c} rows")
    if nq % n:
        raise ValueError(f"{nq} queries per row are not a whole number of groups of {n} nodes")
    if lengths.shape != (c,):
        raise ValueError(f"lengths {lengths.shape} must be [{c}]")
    for name, value in (("block_k", block_k), ("head dim", h)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} {value} must be a power of two >= 16 (Triton blocks)")
    if n_split < 1 or k.shape[1] % (n_split * block_k):
        raise ValueError(f"cache slots {k.shape[1]} must be a multiple of n_split * block_k = "
                         f"{n_split} * {block_k}")


@functools.partial(jax.jit, static_argnames=("block_k", "n_split", "interpret", "num_warps",
                                             "poison"))
def tree_attention(q, k, v, lengths, k_new, v_new, tree, *, block_k: int = 64, n_split: int = 1,
                   interpret: bool = False, num_warps: int = 4, poison: bool = False):
    """The kernel (module docstring); arguments and result as in
    :func:`tree_attention_reference`.

    Args:
      block_k: cache slots per inner step (a power of two >= 16).
      n_split: pieces the cache is split into along its slots (flash-decoding).
      interpret: run through Pallas's interpreter (any backend) instead of Triton.
      num_warps: Triton warps per program.
      poison: start the kernel's output buffers as NaN (aliased inputs), so an element the
        kernel fails to write shows in the result (tests).
    Raises:
      ValueError: shapes that do not fit together, or blocks Triton cannot take.
    """
    _check(q, k, v, lengths, k_new, v_new, tree, block_k, n_split)
    c, nq, h = q.shape
    s, n = k.shape[1], k_new.shape[1]
    qp, np_ = _pow2(nq), _pow2(n)
    per_b = c // tree.shape[0]
    q_p = jnp.pad(q, ((0, 0), (0, qp - nq), (0, 0)))
    kn = jnp.pad(k_new, ((0, 0), (0, np_ - n), (0, 0)))
    vn = jnp.pad(v_new, ((0, 0), (0, np_ - n), (0, 0)))
    # [B, N, N] -> per row and query: [C, Qp, Np] int8, padding invisible.
    mask = jnp.tile(jnp.repeat(tree, per_b, axis=0), (1, nq // n, 1)).astype(jnp.int8)
    mask = jnp.pad(mask, ((0, 0), (0, qp - nq), (0, np_ - n)))
    s_split = s // n_split
    kernel = functools.partial(_kernel, block_k=block_k, s_split=s_split, scale=h ** -0.5)
    from jax.experimental.pallas import triton as plt

    shapes = [jax.ShapeDtypeStruct((c, n_split, qp, h), jnp.float32),
              jax.ShapeDtypeStruct((c, n_split, qp), jnp.float32),
              jax.ShapeDtypeStruct((c, n_split, qp), jnp.float32)]
    poisoned = [jnp.full(x.shape, jnp.nan, x.dtype) for x in shapes] if poison else []
    out_spec = [pl.BlockSpec((1, 1, qp, h), lambda r, p: (r, p, 0, 0)),
                pl.BlockSpec((1, 1, qp), lambda r, p: (r, p, 0)),
                pl.BlockSpec((1, 1, qp), lambda r, p: (r, p, 0))]
    o, m, l = pl.pallas_call(
        kernel,
        grid=(c, n_split),
        in_specs=[
            pl.BlockSpec((1,), lambda r, p: (r,)),
            pl.BlockSpec((1, qp, h), lambda r, p: (r, 0, 0)),
            pl.BlockSpec((1, s_split, h), lambda r, p: (r, p, 0)),
            pl.BlockSpec((1, s_split, h), lambda r, p: (r, p, 0)),
            pl.BlockSpec((1, np_, h), lambda r, p: (r, 0, 0)),
            pl.BlockSpec((1, np_, h), lambda r, p: (r, 0, 0)),
            pl.BlockSpec((1, qp, np_), lambda r, p: (r, 0, 0)),
        ] + out_spec[:len(poisoned)],
        out_specs=out_spec,
        out_shape=shapes,
        input_output_aliases={7 + i: i for i in range(len(poisoned))},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(lengths.astype(jnp.int32), q_p, k, v, kn, vn, mask, *poisoned)
    # Combine the pieces: weights exp(m_p - M) * l_p.
    big = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - big) * l  # [C, n_split, Qp]
    out = jnp.sum(w[..., None] * o, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1e-30)[..., None]
    return out[:, :nq].astype(q.dtype)
