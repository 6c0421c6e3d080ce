"""Fused KV injection: a DFlash drafter's context keys/values for every draft layer, in one call.

A DFlash drafter injects the projected target context of T new positions into the keys and
values of each of its L layers. Unfused, that is per layer a k/v projection, the k RMS norm,
RoPE at the positions and a scatter into the cache: 4L XLA ops that each write their result to
memory and read it back. The kernel does all of it per (row, key/value head) program, with the
cache donated through input/output aliasing, so the keys and values go from registers straight
into their cache slots:

* for each layer (a static loop; each layer's weights are their own input, so no stacked copy is
  ever made), the context rows are multiplied by that head's k and v columns ``block_d`` input
  features at a time, accumulating in float32;
* k gets its RMS norm over the head dim and the ``rotate_half`` RoPE, computed on the two halves
  of the head separately (Triton has no slicing of register tensors);
* the rows are written ``block_t`` at a time at slots ``start .. start + T``. A window that would
  run past the cache's end is moved back to end at the last slot and the context rows are read
  shifted to match (the context is padded in front for it), so every load and store stays in
  bounds, also in Pallas's interpreter, whose masked stores clamp like ``dynamic_update_slice``.

The arithmetic follows the reference's casts exactly: projection accumulated in float32 and cast
to the activation dtype; the norm in float32, cast, then times its weight; RoPE in float32, cast.

Shapes: B rows, T new positions, D context width, L layers, K key/value heads, G query heads
per key/value head, H head dim, S cache slots. Each layer's fused projection is the drafter's
``wqkv`` [D, K, G + 2, H] (index G: keys, G + 1: values); caches are [B * K, S, H] with row
``b * K + j`` holding head j of batch row b, in the activation dtype.

Backend: Pallas through the Triton lowering, as :mod:`.tree_attention` (see there for why).
``kv_injection_reference`` is the definition; ``kv_injection`` checks its inputs and runs the
kernel (``interpret=True`` runs it on any backend through Pallas's interpreter).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def kv_injection_reference(ctx, wqkv: Sequence[jax.Array], k_norm: Sequence[jax.Array], cos, sin,
                           k_cache: Sequence[jax.Array], v_cache: Sequence[jax.Array], starts,
                           *, eps: float):
    """The plain-jnp definition.

    Args:
      ctx: [B, T, D] the projected context of T new positions per row.
      wqkv: L arrays [D, K, G + 2, H], each layer's fused q/k/v projection.
      k_norm: L arrays [H], each layer's k RMS-norm weight.
      cos, sin: [B, T, H/2] float32 RoPE tables of the positions.
      k_cache, v_cache: L arrays [B * K, S, H] each.
      starts: [B] int32 first slot written in each row; ``starts + T <= S``.
      eps: the RMS norm's epsilon.
    Returns:
      ``(k_cache, v_cache)``: tuples of L arrays with slots ``starts[b] .. + T`` of every row of
      batch row b written.
    """
    b, t, _ = ctx.shape
    n_kv, g = wqkv[0].shape[1], wqkv[0].shape[2] - 2
    half = wqkv[0].shape[3] // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    row_starts = jnp.repeat(starts, n_kv)
    write = jax.vmap(lambda buf, new, at: jax.lax.dynamic_update_slice(buf, new, (at, 0)))
    ks, vs = [], []
    for w, wn, kc, vc in zip(wqkv, k_norm, k_cache, v_cache):
        kv = jnp.einsum("btd,dkjh->btkjh", ctx, w[:, :, g:],
                        preferred_element_type=jnp.float32).astype(ctx.dtype)  # [B, T, K, 2, H]
        k32 = kv[..., 0, :].astype(jnp.float32)
        k32 = k32 * jax.lax.rsqrt(jnp.mean(k32 * k32, axis=-1, keepdims=True) + eps)
        k32 = (wn * k32.astype(ctx.dtype)).astype(jnp.float32)
        k1, k2 = k32[..., :half], k32[..., half:]
        k = jnp.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], axis=-1).astype(ctx.dtype)
        rows = lambda x: x.transpose(0, 2, 1, 3).reshape(b * n_kv, t, -1)  # noqa: E731
        ks.append(write(kc, rows(k).astype(kc.dtype), row_starts))
        vs.append(write(vc, rows(kv[..., 1, :]).astype(vc.dtype), row_starts))
    return tuple(ks), tuple(vs)


def _kernel(start_ref, ctx_ref, cos_ref, sin_ref, *refs, n_layers: int, n_kv: int, g: int,
            t: int, block_t: int, block_d: int, eps: float):
    w_refs, n_refs = refs[:n_layers], refs[n_layers:2 * n_layers]
    outs = refs[-2 * n_layers:]  # k, v of layer 0, k, v of layer 1, ... (aliased to the caches)
    j = pl.program_id(1)
    start = start_ref[0]
    slots = outs[0].shape[1]
    d, half = ctx_ref.shape[2], cos_ref.shape[2]
    dt = ctx_ref.dtype

    def chunk(ci, _):
        # Window of block_t slots for context rows ci * block_t ..; moved back at the cache end.
        want = start + ci * block_t
        at = jnp.minimum(want, slots - block_t)
        shift = want - at  # in [0, block_t)
        src = block_t + ci * block_t - shift  # context row of window row 0, in the padded input
        row = ci * block_t - shift + jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
        keep = (row >= ci * block_t) & (row < t)  # [block_t, 1]: this chunk's real rows only
        cos = cos_ref[0, pl.ds(src, block_t), :]
        sin = sin_ref[0, pl.ds(src, block_t), :]
        for layer in range(n_layers):
            w_ref = w_refs[layer]

            def step(di, acc, w_ref=w_ref):
                x = ctx_ref[0, pl.ds(src, block_t), pl.ds(di * block_d, block_d)]
                cols = pl.ds(di * block_d, block_d)

                def dot(col, h0, width):
                    return jnp.dot(x, w_ref[cols, j, col, pl.ds(h0, width)],
                                   preferred_element_type=jnp.float32)

                k1, k2, v1, v2 = acc
                return (k1 + dot(g, 0, half), k2 + dot(g, half, half),
                        v1 + dot(g + 1, 0, half), v2 + dot(g + 1, half, half))

            zero = jnp.zeros((block_t, half), jnp.float32)
            k1, k2, v1, v2 = jax.lax.fori_loop(0, d // block_d, step, (zero,) * 4)
            k1, k2 = k1.astype(dt).astype(jnp.float32), k2.astype(dt).astype(jnp.float32)
            inv = jax.lax.rsqrt((jnp.sum(k1 * k1, axis=1, keepdims=True)
                                 + jnp.sum(k2 * k2, axis=1, keepdims=True)) / (2 * half) + eps)
            n1 = n_refs[layer][pl.ds(0, half)][None, :]
            n2 = n_refs[layer][pl.ds(half, half)][None, :]
            k1 = (n1 * (k1 * inv).astype(dt)).astype(jnp.float32)
            k2 = (n2 * (k2 * inv).astype(dt)).astype(jnp.float32)
            k_ref, v_ref = outs[2 * layer], outs[2 * layer + 1]
            window = pl.ds(at, block_t)
            for ref, x, h0 in ((k_ref, k1 * cos - k2 * sin, 0), (k_ref, k2 * cos + k1 * sin, half),
                               (v_ref, v1, 0), (v_ref, v2, half)):
                idx = (0, window, pl.ds(h0, half))
                old = ref[idx]
                ref[idx] = jnp.where(keep, x.astype(dt).astype(ref.dtype), old)
        return 0

    jax.lax.fori_loop(0, pl.cdiv(t, block_t), chunk, 0)


def _check(ctx, wqkv, k_norm, cos, sin, k_cache, v_cache, starts, block_t, block_d):
    b, t, d = ctx.shape
    n = len(wqkv)
    if not n or len(k_norm) != n or len(k_cache) != n or len(v_cache) != n:
        raise ValueError(f"{len(wqkv)} projections, {len(k_norm)} k norms, {len(k_cache)} key and "
                         f"{len(v_cache)} value caches: one of each per layer")
    w0 = wqkv[0]
    if w0.ndim != 4 or w0.shape[0] != d or w0.shape[2] < 3:
        raise ValueError(f"projection {w0.shape} must be [D={d}, K, G + 2, H]")
    n_kv, h = w0.shape[1], w0.shape[3]
    cache = (b * n_kv, k_cache[0].shape[1], h)
    for i in range(n):
        if wqkv[i].shape != w0.shape or k_norm[i].shape != (h,):
            raise ValueError(f"layer {i}: projection {wqkv[i].shape} / k norm {k_norm[i].shape} "
                             f"differ from layer 0's {w0.shape} / ({h},)")
        if k_cache[i].shape != cache or v_cache[i].shape != cache:
            raise ValueError(f"layer {i}: caches {k_cache[i].shape} / {v_cache[i].shape} must be "
                             f"[B * K, S, H] = {cache}")
    if cos.shape != (b, t, h // 2) or sin.shape != cos.shape:
        raise ValueError(f"RoPE tables {cos.shape} / {sin.shape} must be [{b}, {t}, {h // 2}]")
    if starts.shape != (b,):
        raise ValueError(f"starts {starts.shape} must be [{b}]")
    for name, value in (("block_t", block_t), ("block_d", block_d), ("half head dim", h // 2)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} {value} must be a power of two >= 16 (Triton blocks)")
    if d % block_d:
        raise ValueError(f"context width {d} must be a multiple of block_d = {block_d}")
    if cache[1] < block_t:
        raise ValueError(f"cache of {cache[1]} slots is shorter than block_t = {block_t}")


@functools.partial(jax.jit, static_argnames=("eps", "block_t", "block_d", "interpret",
                                             "num_warps"),
                   donate_argnames=("k_cache", "v_cache"))
def kv_injection(ctx, wqkv, k_norm, cos, sin, k_cache, v_cache, starts, *, eps: float,
                 block_t: int = 16, block_d: int = 64, interpret: bool = False,
                 num_warps: int = 4):
    """The kernel (module docstring); arguments and result as in
    :func:`kv_injection_reference`. The caches are donated: their buffers become the result's.

    Args:
      block_t: new positions per window (a power of two >= 16; the cache holds at least one).
      block_d: context features per projection step (a power of two >= 16 dividing D).
      interpret: run through Pallas's interpreter (any backend) instead of Triton.
      num_warps: Triton warps per program.
    Raises:
      ValueError: shapes that do not fit together, or blocks Triton cannot take.
    """
    wqkv, k_norm = tuple(wqkv), tuple(k_norm)
    k_cache, v_cache = tuple(k_cache), tuple(v_cache)
    _check(ctx, wqkv, k_norm, cos, sin, k_cache, v_cache, starts, block_t, block_d)
    b, t, d = ctx.shape
    n_layers, n_kv, g = len(wqkv), wqkv[0].shape[1], wqkv[0].shape[2] - 2
    tp = -(-t // block_t) * block_t
    # block_t rows in front (windows moved back at the cache's end read them), the tail padded.
    pad = lambda x: jnp.pad(x, ((0, 0), (block_t, tp - t), (0, 0)))  # noqa: E731
    ctx_p, cos_p, sin_p = pad(ctx), pad(cos.astype(jnp.float32)), pad(sin.astype(jnp.float32))
    kernel = functools.partial(_kernel, n_layers=n_layers, n_kv=n_kv, g=g, t=t, block_t=block_t,
                               block_d=block_d, eps=eps)
    from jax.experimental.pallas import triton as plt

    whole = lambda x: pl.BlockSpec(x.shape, lambda r, j: (0,) * x.ndim)  # noqa: E731
    rows = lambda x: pl.BlockSpec((1,) + x.shape[1:], lambda r, j: (r, 0, 0))  # noqa: E731
    cache_spec = pl.BlockSpec((1,) + k_cache[0].shape[1:], lambda r, j: (r * n_kv + j, 0, 0))
    caches = [x for pair in zip(k_cache, v_cache) for x in pair]
    first = 4 + 2 * n_layers
    out = pl.pallas_call(
        kernel,
        grid=(b, n_kv),
        in_specs=[pl.BlockSpec((1,), lambda r, j: (r,)), rows(ctx_p), rows(cos_p), rows(sin_p)]
        + [whole(w) for w in wqkv] + [whole(w) for w in k_norm] + [cache_spec] * len(caches),
        out_specs=[cache_spec] * len(caches),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches],
        input_output_aliases={first + i: i for i in range(len(caches))},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(starts.astype(jnp.int32), ctx_p, cos_p, sin_p, *wqkv, *k_norm, *caches)
    return tuple(out[0::2]), tuple(out[1::2])
