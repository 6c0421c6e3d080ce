"""Decoder building blocks shared by the target and every drafter.

RMSNorm, rotary embeddings, the q/k/v projection (with RoPE and the optional per-head q/k
norm), attention over key blocks followed by the output projection, and the SwiGLU MLP. The
target (:mod:`specjax.models.target`) is built from these, and drafters call the same functions
on their own weights, so no drafter carries a copy of the attention code. Attention itself is
:func:`specjax.models.attention.attend`.

Axis legend used by every module in ``specjax.models``:

    B batch          T query tokens of this call      S cache slots
    D model width    N query heads    K key/value heads    G = N // K query heads per kv head
    H head dim       F SwiGLU width   V vocabulary         L layers
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.kernels import cpu_gemm
from specjax.models import attention as attention_lib

# Row counts whose float32 products by a float32 weight stored [out, in] run on the CPU kernel
# (:mod:`specjax.kernels.cpu_gemm`): a verify pass's nodes or a drafted block, times the batch.
# One row stays on XLA's matrix-vector product, which streams float32 weights faster still (by
# bfloat16 weights one row runs on the kernel too, :func:`kernel_takes`); by 64 rows XLA's
# matrix product has caught up (a 64-node pass of SmolLM2-135M cost 5.3-6.2 plain steps either
# way, the README's performance notes).
KERNEL_ROWS = (2, 64)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to ``x.dtype`` before the weight (the HF convention).

    Args:
      x: [..., D] activations.
      weight: [D] scale.
    Returns:
      [..., D] normalized activations in ``x.dtype``.
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [H/2] in float32, with Llama-3 scaling when configured.

    Computed in NumPy float32 the way HF computes them in torch float32, so the angles match
    bit for bit before the cos/sin.
    """
    h = cfg.head_dim
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h)))
    inv_freq = inv_freq.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    old_len = rs.original_max_position_embeddings
    low_freq_wavelen = old_len / rs.low_freq_factor
    high_freq_wavelen = old_len / rs.high_freq_factor
    wavelen = (2 * np.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for ``positions`` [B, T]: each [B, T, H/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` [B, T, heads, H] in the HF ``rotate_half`` layout (halves, not pairs).

    ``cos``/``sin`` are [B, T, H/2]; the rotation runs in float32 and returns ``x.dtype``.
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` accumulated in float32 (a float32 result), where ``x`` has
    its rows on the leading axes and its contracted axis last.

    A single bfloat16 row runs as two (the row and a copy, the copy's result dropped):
    XLA:CPU's one-row bfloat16 matrix-vector product is several times slower than its two-row
    product (184 ms against 31 ms for SmolLM2-135M's whole decoder and head).
    """
    if x.dtype == jnp.bfloat16 and x.ndim >= 2 and np.prod(x.shape[:-1]) == 1:
        two = jnp.broadcast_to(x.reshape(-1), (2, x.shape[-1]))
        y = jnp.einsum(spec, two.reshape(2, *x.shape[1:]), w, preferred_element_type=jnp.float32)
        return y[:1]
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x`` [..., in] times ``w`` [out, in] over its trailing axis: [..., out] float32.

    Float32 products of 2 to 64 rows (:data:`KERNEL_ROWS`), and of 1 to 64 float32 rows by
    bfloat16 weights, run on the CPU kernel (:func:`specjax.kernels.cpu_gemm.gemm_nt`; XLA's
    product on other backends or where the kernel is unavailable); everything else is
    :func:`matmul`. So a row's result is the same bit for bit in any product of 2 to 64 rows
    (1 to 64 by bfloat16 weights), but a one-row product by float32 weights (XLA's) differs
    from it by summation order: a verify pass and a plain step agree to rounding, not bitwise.
    """
    if kernel_takes(x, w):
        rows = int(np.prod(x.shape[:-1]))
        return cpu_gemm.gemm_nt(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
    return matmul(x, w, "...i,oi->...o")


def kernel_takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether :func:`matmul_nt` multiplies ``x`` [..., in] by ``w`` [out, in] on the CPU
    kernel: ``x`` float32, the kernel available, and ``w`` float32 with 2 to 64 rows
    (:data:`KERNEL_ROWS`) or bfloat16 with 1 to 64, whatever the weight (a drafter's bfloat16
    copies, head rows gathered from a bfloat16 target): XLA:CPU would widen the whole bfloat16
    matrix on every call, where the kernel widens each weight as it loads it."""
    lo, hi = KERNEL_ROWS
    lo = 1 if w.dtype == jnp.bfloat16 else lo
    return (lo <= int(np.prod(x.shape[:-1])) <= hi and x.dtype == jnp.float32
            and w.dtype in (jnp.float32, jnp.bfloat16) and cpu_gemm.available())


def head_logits(x: jax.Array, w: jax.Array, w_t: jax.Array | None = None) -> jax.Array:
    """Float32 logits [..., V] of ``x`` [..., D] by an untied head ``w`` [D, V], or by its
    one-row copy ``w_t`` [V, D] where given, for a single row and the rows the CPU kernel
    takes (:func:`kernel_takes`)."""
    if w_t is not None and (np.prod(x.shape[:-1]) == 1 or kernel_takes(x, w_t)):
        return matmul_nt(x, w_t)
    return matmul(x, w, "...d,dv->...v")


def linear(x: jax.Array, p: dict, key: str) -> jax.Array:
    """x [B, T, in] times p[key] [in, *out] over its leading axis, accumulated in float32:
    [B, T, *out] in ``x.dtype`` (:func:`matmul`).

    Where the params carry the copy ``p[key + "_t"]`` [*out, in] (:mod:`specjax.io.layout`),
    a single row multiplies by it (XLA:CPU streams that layout faster in a matrix-vector
    product; by a bfloat16 copy the CPU kernel takes it), and so do the float32 passes of a
    few rows that the kernel takes (:func:`matmul_nt`).
    """
    w_t = p.get(f"{key}_t")
    # As a 2-D [out, in] matrix (merging its leading axes is free): XLA:CPU transposed a copy
    # of the whole weight on every call when it had several out axes.
    w2 = None if w_t is None else w_t.reshape(-1, w_t.shape[-1])
    if w2 is not None and (x.shape[0] * x.shape[1] == 1 or kernel_takes(x, w2)):
        y = matmul_nt(x, w2)
        return y.reshape(*x.shape[:2], *w_t.shape[:-1]).astype(x.dtype)
    return matmul(x, p[key], "bti,i...->bt...").astype(x.dtype)


def project_qkv(p: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """Queries, keys and values of T tokens, RoPE applied (after the q/k norm when configured).

    Args:
      p: a layer's weights: ``wqkv`` [in, K, G + 2, H] (:mod:`specjax.models.params`) and, for
        ``cfg.qk_norm``, ``q_norm`` / ``k_norm`` [H]. ``in`` is usually D; an EAGLE-3 layer
        reads 2D.
      x: [B, T, in] the already normalized layer input.
      cos, sin: [B, T, H/2] rotary tables of the tokens' positions.
    Returns:
      q [B, T, N, H], k [B, T, K, H], v [B, T, K, H] in ``x.dtype``.
    """
    b, t, _ = x.shape
    n, h, g = cfg.n_heads, cfg.head_dim, cfg.q_per_kv
    qkv = linear(x, p, "wqkv")  # [B, T, K, G + 2, H]
    q = qkv[..., :g, :].reshape(b, t, n, h)  # query head k * G + g of kv head k
    k, v = qkv[..., g, :], qkv[..., g + 1, :]  # [B, T, K, H]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def kv_rows(x: jax.Array) -> jax.Array:
    """[B, T, K, H] -> [B * K, T, H], the row layout of caches and key blocks."""
    b, t, k, h = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * k, t, h)


def attention_out(p: dict, cfg: ModelConfig, q: jax.Array,
                  blocks: list[attention_lib.KeyBlock]) -> jax.Array:
    """Attention of ``q`` [B, T, N, H] over key blocks, then the output projection ``wo``.

    Returns [B, T, D], to be added to the residual stream. The implementation is
    ``cfg.attention_impl`` (:func:`specjax.models.attention.attend`).
    """
    b, t, n, h = q.shape
    out = attention_lib.attend(q, blocks, cfg.attention_impl)
    return linear(out.reshape(b, t, n * h), p, "wo")


def mlp(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The SwiGLU block on the residual ``x`` [B, T, D]: ``down(silu(gate) * up)`` of
    ``rms_norm(x, mlp_norm)``; returns [B, T, D], to be added to the residual stream."""
    gate_up = linear(rms_norm(x, p["mlp_norm"], cfg.norm_eps), p, "w_gate_up")  # [B, T, 2, F]
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return linear(jax.nn.silu(gate) * up, p, "w_down")
