"""Decoder building blocks: RMSNorm and rotary embeddings (attention lives in specjax.kernels).

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
