"""Hugging Face checkpoints: ``config.json`` + safetensors (single file or sharded) -> our params.

Supported: ``LlamaForCausalLM`` (Llama-2/3.x, SmolLM2; RoPE ``default`` or ``llama3`` scaling)
and ``Qwen3ForCausalLM``. Features these loaders cannot express (attention or MLP biases,
sliding-window attention, other RoPE types, activations other than SiLU, pre-quantized weights)
are rejected with an error that names the config key, never silently dropped.

Weights stream tensor by tensor from memory-mapped files, so the peak host memory is the output
plus one tensor. We parse the safetensors header ourselves instead of using
``safetensors.numpy``: numpy has no bfloat16, so that API cannot read BF16 checkpoints, which is
what real Llama and Qwen3 releases are; ``ml_dtypes.bfloat16`` (shipped with JAX) can.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np

from specjax.config import ModelConfig, RopeScaling
from specjax.io.checks import check_params

# HF `architectures` entry / `model_type` -> our arch.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3"}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen3": 32768}  # transformers' config defaults

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def _supported() -> str:
    return ", ".join(f"{a} (model_type {t!r})" for a, t in
                     zip(SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES))


def _arch(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    if architectures:
        raise ValueError(f"unknown architecture {architectures[0]!r}; supported: {_supported()}")
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return SUPPORTED_MODEL_TYPES[model_type]
    raise ValueError(f"unknown architecture {model_type!r}; supported: {_supported()}")


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the transformers<5 or the transformers 5 spelling.

    transformers<5 writes ``rope_theta`` at top level and ``rope_scaling: {"rope_type"|"type":
    ...}``; transformers 5 writes ``rope_parameters: {"rope_type", "rope_theta", ...}``, or one
    such dict per layer type. Keys of ``rope_parameters`` win where both are present.
    """
    parameters = config.get("rope_parameters") or {}
    if parameters and all(isinstance(v, Mapping) for v in parameters.values()):
        if set(parameters) != {"full_attention"}:
            raise ValueError(
                f"per-layer-type rope_parameters {sorted(parameters)} are not supported "
                "(only full attention)"
            )
        parameters = parameters["full_attention"]
    rope = {**(config.get("rope_scaling") or {}), **parameters}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: 'default', 'llama3'")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if k not in rope]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    return theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _reject_unsupported(config: Mapping[str, Any], arch: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{key}=true is not supported (the {arch} loader has no biases)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
    # Qwen3 always writes `sliding_window` and gates it with `use_sliding_window`.
    if "use_sliding_window" in config:
        sliding = bool(config["use_sliding_window"])
    else:
        sliding = config.get("sliding_window") is not None
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if sliding or layer_types != {"full_attention"}:
        raise ValueError(
            "sliding-window attention is not supported (use_sliding_window / sliding_window / "
            f"layer_types={sorted(layer_types)})"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"pre-quantized checkpoints ({method}) are not supported")


def config_from_hf(config: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """A :class:`ModelConfig` from the dict of an HF ``config.json``.

    Args:
      config: the parsed ``config.json``.
      dtype: ``"float32"`` or ``"bfloat16"``, the dtype the weights are loaded in (the
        checkpoint's own ``dtype`` / ``torch_dtype`` is ignored).

    Raises:
      ValueError: unknown architecture, a missing required key, or an unsupported feature.
    """
    arch = _arch(config)
    _reject_unsupported(config, arch)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json is missing {missing}")
    n_heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    theta, scaling = _rope(config)
    return ModelConfig(
        arch=arch,
        vocab_size=int(config["vocab_size"]),
        d_model=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        d_ff=int(config["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=dtype,
        max_position_embeddings=int(config.get("max_position_embeddings")
                                    or _DEFAULT_MAX_POSITIONS[arch]),
    )


class SafetensorsFile:
    """Read-only, memory-mapped tensors of one ``.safetensors`` file (any dtype, BF16 included).

    ``get`` returns a view into the map; nothing is read from disk until it is used.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= size - 8:
                raise ValueError(f"corrupt safetensors file {self.path}: bad header length")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise ValueError(f"corrupt safetensors file {self.path}: {e}") from None
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries = header
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = _ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{key} in {self.path} has unsupported dtype {entry['dtype']}")
            want = int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(dtype).itemsize
            if end - begin != want or self._start + end > size:
                raise ValueError(f"corrupt safetensors file {self.path}: bad offsets for {key}")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        entry = self._entries[key]
        begin, end = entry["data_offsets"]
        raw = self._map[self._start + begin:self._start + end]
        return raw.view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


class _Checkpoint:
    """Tensors of an HF checkpoint directory: ``model.safetensors`` or a sharded index."""

    def __init__(self, path: Path):
        self.path = path
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {key: path / name for key, name in weight_map.items()}
            self._source = index.name
            self._files: dict[Path, SafetensorsFile] = {}
        elif single.exists():
            self._files = {single: SafetensorsFile(single)}
            self._where = dict.fromkeys(self._files[single].keys(), single)
            self._source = single.name
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {path}"
            )

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor ``key``, checked to have (torch-layout) ``shape``."""
        if key not in self._where:
            raise ValueError(f"missing tensor {key} in {self.path / self._source}")
        file = self._where[key]
        if file not in self._files:
            if not file.exists():
                raise FileNotFoundError(f"{file} (listed for {key} in {self._source}) not found")
            self._files[file] = SafetensorsFile(file)
        shard = self._files[file]
        if key not in shard:
            raise ValueError(f"missing tensor {key} in {file} (listed in {self._source})")
        if shard.shape(key) != shape:
            raise ValueError(
                f"{key} in {file.name} has shape {shard.shape(key)}, expected {shape} "
                "from config.json"
            )
        return shard.get(key)


def load_hf(path: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Load an HF Llama / Qwen3 checkpoint directory into our params layout.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` + shards.
      dtype: ``"float32"`` or ``"bfloat16"``; every leaf (norms included) is cast to it.

    Returns:
      ``(cfg, params)``; ``cfg.tie_embeddings`` is True when the config says so or the
      checkpoint has no ``lm_head.weight``, and then ``params`` has no ``"lm_head"``.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    cfg = config_from_hf(json.loads(config_file.read_text()), dtype)
    ckpt = _Checkpoint(path)
    if not cfg.tie_embeddings and "lm_head.weight" not in ckpt:
        cfg = cfg.replace(tie_embeddings=True)
    np_dtype = np.dtype(cfg.jnp_dtype)
    d, n, k, h, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)

    def get(key, shape):
        return ckpt.get(key, shape).astype(np_dtype)

    def linear(key, d_out, d_in):  # torch [out, in] -> ours [in, out]
        return get(key, (d_out, d_in)).T

    def put(x):  # device_put is ~2.5x faster than jnp.asarray for host numpy arrays
        return jax.device_put(np.ascontiguousarray(x))

    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": put(get(p + "input_layernorm.weight", (d,))),
            "wqkv": put(np.concatenate([linear(p + "self_attn.q_proj.weight", n * h, d),
                                        linear(p + "self_attn.k_proj.weight", k * h, d),
                                        linear(p + "self_attn.v_proj.weight", k * h, d)], axis=1)),
            "wo": put(linear(p + "self_attn.o_proj.weight", d, n * h)),
            "mlp_norm": put(get(p + "post_attention_layernorm.weight", (d,))),
            "w_gate_up": put(np.concatenate([linear(p + "mlp.gate_proj.weight", f, d),
                                             linear(p + "mlp.up_proj.weight", f, d)], axis=1)),
            "w_down": put(linear(p + "mlp.down_proj.weight", d, f)),
        }
        if cfg.qk_norm:
            layer["q_norm"] = put(get(p + "self_attn.q_norm.weight", (h,)))
            layer["k_norm"] = put(get(p + "self_attn.k_norm.weight", (h,)))
        layers.append(layer)
    params = {
        "embed": put(get("model.embed_tokens.weight", (v, d))),
        "layers": tuple(layers),
        "final_norm": put(get("model.norm.weight", (d,))),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = put(linear("lm_head.weight", v, d))
    check_params(params, cfg)
    return cfg, params
