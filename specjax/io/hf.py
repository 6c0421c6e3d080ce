"""Hugging Face checkpoints: ``config.json`` + safetensors (single file or sharded) <-> our params.

Supported: ``LlamaForCausalLM`` (Llama-2/3.x, SmolLM2; RoPE ``default`` or ``llama3`` scaling)
and ``Qwen3ForCausalLM``. Features these loaders cannot express (attention or MLP biases,
sliding-window attention, other RoPE types, activations other than SiLU, pre-quantized weights)
are rejected with an error that names the config key, never silently dropped.

:data:`HF_TABLE` is the one map between our params and HF's tensors: per leaf, its HF tensor
names and the :class:`Transform` between them (transpose, q/k/v and gate/up fusion). The loader
(:func:`load_hf`), the writer (:func:`save_hf`) and anything else that builds an HF model from
our params (:func:`hf_tensors`) go through it; ``specjax.io.gguf`` builds its own table from
the same transforms.

Weights stream tensor by tensor from memory-mapped files, so the peak host memory is the output
plus one tensor. We parse and write the safetensors format ourselves instead of using
``safetensors.numpy``: numpy has no bfloat16, so that API cannot read or write BF16
checkpoints, which is what real Llama and Qwen3 releases are; ``ml_dtypes.bfloat16`` (shipped
with JAX) can.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np

from specjax.config import ModelConfig, RopeScaling
from specjax.models import params as params_lib

# HF `architectures` entry / `model_type` -> our arch.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3"}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen3": 32768}  # transformers' config defaults
_ARCHITECTURES = {arch: name for name, arch in SUPPORTED_ARCHITECTURES.items()}

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


def rope_settings(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
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
    theta, scaling = rope_settings(config)
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


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg``, in transformers 5's spelling (``rope_parameters``,
    ``dtype``); :func:`config_from_hf` reads it back as ``cfg``."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    config = {
        "architectures": [_ARCHITECTURES[cfg.arch]], "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "dtype": cfg.dtype,
    }
    if cfg.arch == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    return config


# ---------------------------------------------------------------------------------- name table


@dataclasses.dataclass(frozen=True)
class Transform:
    """Between one leaf of our params and its tensors in an external format.

    Attributes:
      to_ours: ``(tensors, cfg) -> leaf``: NumPy arrays in, a NumPy array out.
      from_ours: ``(leaf, cfg) -> tensors``, the inverse. It uses only array methods (``.T``,
        ``.reshape``, ``.swapaxes``, indexing), so it runs on NumPy arrays (returning views where
        it can) and, under ``jax.eval_shape``, on shapes alone: that is how a table's tensor
        shapes are derived from :func:`specjax.models.params.abstract`.
    """

    to_ours: Callable[[Sequence[np.ndarray], ModelConfig], np.ndarray]
    from_ours: Callable[[Any, ModelConfig], tuple]


@dataclasses.dataclass(frozen=True)
class Row:
    """One leaf's entry in a name table: its tensors' names (``{i}`` stands for the layer of a
    per-layer leaf) and the transform between those tensors and the leaf."""

    names: tuple[str, ...]
    transform: Transform


@dataclasses.dataclass(frozen=True)
class Table:
    """A format's name table: our key (``"embed"``, or a per-layer key such as ``"wqkv"``) ->
    :class:`Row`. Which keys a model has comes from :func:`specjax.models.params.abstract`."""

    format: str
    rows: Mapping[str, Row]


def _fuse_qkv(tensors, cfg):
    """torch q [N * H, in], k [K * H, in], v [K * H, in] -> our wqkv [in, K, G + 2, H] (``in``
    is D, or 2D for an EAGLE-3 layer)."""
    q, k, v = tensors
    kh, g, h = cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim
    return np.concatenate([q.T.reshape(-1, kh, g, h), k.T.reshape(-1, kh, 1, h),
                           v.T.reshape(-1, kh, 1, h)], axis=2)


def _split_qkv(w, cfg):
    """our wqkv [in, K, G + 2, H] -> torch q [N * H, in], k [K * H, in], v [K * H, in]."""
    g = cfg.q_per_kv
    return tuple(part.reshape(w.shape[0], -1).T
                 for part in (w[:, :, :g], w[:, :, g], w[:, :, g + 1]))


COPY = Transform(lambda tensors, cfg: tensors[0], lambda x, cfg: (x,))
# torch Linear.weight [out, in] <-> our [in, out].
LINEAR = Transform(lambda tensors, cfg: tensors[0].T, lambda x, cfg: (x.T,))
QKV = Transform(_fuse_qkv, _split_qkv)
# torch gate [F, D], up [F, D] <-> our w_gate_up [D, 2, F].
GATE_UP = Transform(lambda tensors, cfg: np.stack([tensors[0].T, tensors[1].T], axis=1),
                    lambda w, cfg: (w[:, 0].T, w[:, 1].T))

_L = "model.layers.{i}."
HF_TABLE = Table("HF safetensors", {
    "embed": Row(("model.embed_tokens.weight",), COPY),
    "attn_norm": Row((_L + "input_layernorm.weight",), COPY),
    "wqkv": Row(tuple(_L + f"self_attn.{x}_proj.weight" for x in "qkv"), QKV),
    "wo": Row((_L + "self_attn.o_proj.weight",), LINEAR),
    "mlp_norm": Row((_L + "post_attention_layernorm.weight",), COPY),
    "w_gate_up": Row((_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), GATE_UP),
    "w_down": Row((_L + "mlp.down_proj.weight",), LINEAR),
    "q_norm": Row((_L + "self_attn.q_norm.weight",), COPY),
    "k_norm": Row((_L + "self_attn.k_norm.weight",), COPY),
    "final_norm": Row(("model.norm.weight",), COPY),
    "lm_head": Row(("lm_head.weight",), LINEAR),
})


def _rows(table: Table, cfg: ModelConfig):
    """``(our dotted name, row, its tensors' names, spec)`` for every leaf of ``cfg``'s params,
    in the order of :func:`specjax.models.params.abstract`."""
    for name, spec in params_lib.flatten(params_lib.abstract(cfg)).items():
        key = name.rsplit(".", 1)[-1]
        if key not in table.rows:
            raise ValueError(f"{table.format} has no tensor for {name}")
        row = table.rows[key]
        layer = name.split(".")[1] if name.startswith("layers.") else None
        yield name, row, tuple(n.format(i=layer) for n in row.names), spec


@functools.cache
def _shapes(transform: Transform, shape: tuple[int, ...], cfg: ModelConfig):
    """The shapes of the tensors ``transform`` makes of a leaf of ``shape``, from shapes alone."""
    out = jax.eval_shape(lambda x: transform.from_ours(x, cfg),
                         jax.ShapeDtypeStruct(shape, np.float32))
    return tuple(tuple(o.shape) for o in out)


def tensor_shapes(table: Table, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor ``table`` maps ``cfg``'s params to, by tensor name, in the
    order tensors are read and written."""
    return {n: s for _, row, names, spec in _rows(table, cfg)
            for n, s in zip(names, _shapes(row.transform, spec.shape, cfg))}


def params_from_tensors(table: Table, cfg: ModelConfig,
                        read: Callable[[str, tuple[int, ...]], np.ndarray]
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """Our params' leaves, ``(dotted name, array)`` one at a time, built from a format's tensors.

    Args:
      table: the format's name table.
      cfg: the model config; its :func:`~specjax.models.params.abstract` says which leaves.
      read: ``(tensor name, expected shape) -> array``; it raises a ValueError naming the
        tensor when the tensor is missing or has another shape.
    """
    for name, row, names, spec in _rows(table, cfg):
        shapes = _shapes(row.transform, spec.shape, cfg)
        yield name, row.transform.to_ours([read(n, s) for n, s in zip(names, shapes)], cfg)


def tensors_from_params(table: Table, params: dict, cfg: ModelConfig
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """A format's tensors, ``(name, array)`` one at a time, from our params (checked against
    ``cfg`` first; the one-row copies are not exported). Arrays keep the leaves' dtype and are
    NumPy views of them where the transform allows, so they may be read-only."""
    params_lib.check(params, cfg)
    flat = params_lib.flatten(params)
    for name, row, names, _ in _rows(table, cfg):
        yield from zip(names, row.transform.from_ours(np.asarray(flat[name]), cfg))


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


def write_safetensors(path: str | Path, tensors: Sequence[tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``(name, array)`` pairs (any dtype of :class:`SafetensorsFile`, BF16 included) as a
    ``.safetensors`` file: a little-endian u64 header length, a JSON header padded with spaces
    to a multiple of 8 bytes, then the arrays' bytes back to back in C order."""
    names = {np.dtype(t): name for name, t in _ST_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors:
        size = t.size * t.dtype.itemsize
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in tensors:
            f.write(np.ascontiguousarray(t).reshape(-1).view(np.uint8).data)


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
    (head,) = HF_TABLE.rows["lm_head"].names
    if not cfg.tie_embeddings and head not in ckpt:
        cfg = cfg.replace(tie_embeddings=True)
    np_dtype = np.dtype(cfg.jnp_dtype)
    tensors = params_from_tensors(HF_TABLE, cfg,
                                  lambda name, shape: ckpt.get(name, shape).astype(np_dtype))
    # device_put is ~2.5x faster than jnp.asarray for host numpy arrays; putting each leaf as
    # it is built keeps the host peak at one leaf.
    flat = {name: jax.device_put(np.ascontiguousarray(x)) for name, x in tensors}
    params = params_lib.unflatten(flat, cfg.n_layers)
    params_lib.check(params, cfg)
    return cfg, params


def hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """HF's tensors (torch layout, HF names) of our params: ``tensors_from_params`` with
    :data:`HF_TABLE`; a tied head has no ``lm_head.weight``."""
    return tensors_from_params(HF_TABLE, params, cfg)


def save_hf(params: dict, cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write ``params`` as an HF checkpoint directory: ``config.json`` + ``model.safetensors``.

    The result loads with transformers' ``AutoModelForCausalLM.from_pretrained`` and, bit for
    bit, with :func:`load_hf`. Tensors keep ``cfg.dtype``; the one-row copies are not written.

    Returns:
      ``out_dir``, created if needed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    # transformers refuses safetensors files whose metadata does not name their framework.
    write_safetensors(out / "model.safetensors", list(hf_tensors(params, cfg)),
                      metadata={"format": "pt"})
    return out
