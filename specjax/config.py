"""Frozen, validated model configurations.

A :class:`ModelConfig` is hashable so it can be a static argument of ``jax.jit``; every array
shape in the model code is a function of the config (and of the call's static token count) only.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Arch = Literal["llama", "qwen3"]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (HF ``rope_type: "llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``; those shorter than ``original_max_position_embeddings / high_freq_factor``
    are kept; the band between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters (Llama-3, Qwen3, SmolLM2).

    Attributes:
      arch: ``"llama"`` (Llama-2/3, SmolLM2) or ``"qwen3"`` (adds RMSNorm on q and k per head).
      vocab_size: V.
      d_model: D, the residual width.
      n_layers: L.
      n_heads: N query heads.
      n_kv_heads: K key/value heads; ``n_heads % n_kv_heads == 0`` (grouped-query attention).
      head_dim: H.
      d_ff: F, the SwiGLU inner width.
      rope_theta: RoPE base.
      rope_scaling: optional Llama-3 frequency scaling.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the LM head is the transposed token embedding.
      dtype: ``"float32"`` or ``"bfloat16"``: the dtype of weights, activations and the KV cache
        (matmuls accumulate in float32, norms and softmax run in float32 either way).
      max_position_embeddings: the longest context the checkpoint was trained for.
      attention_impl: the attention implementation, a name in
        ``specjax.models.attention.IMPLEMENTATIONS`` (``"reference"``: dense masks in XLA).
    """

    arch: Arch
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    max_position_embeddings: int = 8192
    attention_impl: str = "reference"

    def __post_init__(self):
        if self.arch not in ("llama", "qwen3"):
            raise ValueError(f"unknown architecture {self.arch!r}; expected 'llama' or 'qwen3'")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "d_ff", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        from specjax.models.attention import IMPLEMENTATIONS

        if self.attention_impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention_impl {self.attention_impl!r}; known: "
                             f"{sorted(IMPLEMENTATIONS)}")

    @property
    def qk_norm(self) -> bool:
        """Whether q and k get a per-head RMSNorm before RoPE (Qwen3)."""
        return self.arch == "qwen3"

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def q_per_kv(self) -> int:
        """G, query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
