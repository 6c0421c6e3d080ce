"""GGUF checkpoints (llama.cpp) -> our params, dequantized once and cached on disk.

Reading a GGUF costs seconds even for SmolLM2-135M: the ``gguf`` package parses ~100k
vocabulary strings one by one (~5 s) and dequantizes Q4_1/Q8_0 in numpy (~1.6 s). The first load
therefore writes everything a later load needs -- float32 weights already in our layout, the
config, and the tokenizer -- into one safetensors file in the cache directory:

    $SPECJAX_CACHE_DIR, else $XDG_CACHE_HOME/specjax, else ~/.cache/specjax   (then gguf/)

The file is named after the GGUF's real path and keyed by its size and mtime, so an edited or
replaced GGUF misses the cache. It is written to a temporary file and renamed into place, so an
interrupted write never leaves a partial entry; an entry that fails to load anyway (truncated,
corrupted, wrong format version) is deleted and rebuilt with a warning.

The entry's metadata carries :data:`CACHE_FORMAT`, and the format is part of the key: an entry
written in another params layout is never found, and one that is found anyway is rejected
(format, then shapes) and rebuilt.

:data:`GGUF_TABLE` maps our params to llama.cpp's tensor names, both for loading and for
:func:`write_f32_gguf`. llama.cpp stores HF's torch-layout tensors, except that Q and K rows are
permuted for its interleaved RoPE (pairs ``2i, 2i+1``): :func:`unpermute_qk` restores HF's
``rotate_half`` layout (pairs ``i, i + H/2``), which our model code expects, and
:func:`permute_qk` undoes it, so the table reuses the HF table's transforms around them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Collection, Mapping

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.io import hf
from specjax.io.tokenizer import Tokenizer
from specjax.models import params as params_lib

# Bump when the cached layout or metadata changes. 2: wqkv [D, K, G + 2, H], w_gate_up [D, 2, F].
CACHE_FORMAT = "2"


def cache_dir() -> Path:
    """Root of specjax's on-disk caches (see the module docstring)."""
    if os.environ.get("SPECJAX_CACHE_DIR"):
        return Path(os.environ["SPECJAX_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "specjax"
    return Path.home() / ".cache" / "specjax"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    Within each head of H rows, HF orders rows ``[0, 1, ..., H/2-1 | H/2, ..., H-1]`` (the two
    halves that ``rotate_half`` pairs); GGUF interleaves them as ``[0, H/2, 1, H/2+1, ...]``.

    Args:
      w: [n_heads * H, D_in] GGUF-order rows (torch ``[out, in]`` layout).
      n_heads: heads in ``w`` (query heads for Q, key/value heads for K).

    Returns:
      [n_heads * H, D_in] in HF order.
    """
    d_out, d_in = w.shape
    return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order from HF's: the inverse of :func:`unpermute_qk`.

    Args:
      w: [n_heads * H, D_in] in HF ``rotate_half`` order (torch ``[out, in]`` layout).
      n_heads: heads in ``w``.
    Returns:
      [n_heads * H, D_in], within each head rows ``[0, H/2, 1, H/2 + 1, ...]``.
    """
    d_out, d_in = w.shape
    return w.reshape(n_heads, 2, d_out // n_heads // 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def _fuse_llama_cpp_qkv(tensors, cfg):
    q, k, v = tensors
    return hf.QKV.to_ours((unpermute_qk(q, cfg.n_heads), unpermute_qk(k, cfg.n_kv_heads), v), cfg)


def _split_llama_cpp_qkv(w, cfg):
    q, k, v = hf.QKV.from_ours(w, cfg)
    return permute_qk(q, cfg.n_heads), permute_qk(k, cfg.n_kv_heads), v


_B = "blk.{i}."
GGUF_TABLE = hf.Table("GGUF (llama)", {
    "embed": hf.Row(("token_embd.weight",), hf.COPY),
    "attn_norm": hf.Row((_B + "attn_norm.weight",), hf.COPY),
    "wqkv": hf.Row((_B + "attn_q.weight", _B + "attn_k.weight", _B + "attn_v.weight"),
                   hf.Transform(_fuse_llama_cpp_qkv, _split_llama_cpp_qkv)),
    "wo": hf.Row((_B + "attn_output.weight",), hf.LINEAR),
    "mlp_norm": hf.Row((_B + "ffn_norm.weight",), hf.COPY),
    "w_gate_up": hf.Row((_B + "ffn_gate.weight", _B + "ffn_up.weight"), hf.GATE_UP),
    "w_down": hf.Row((_B + "ffn_down.weight",), hf.LINEAR),
    "final_norm": hf.Row(("output_norm.weight",), hf.COPY),
    "lm_head": hf.Row(("output.weight",), hf.LINEAR),
})


def config_from_gguf(meta: Mapping[str, Any], tensor_names: Collection[str],
                     dtype: str = "float32") -> ModelConfig:
    """A :class:`ModelConfig` from GGUF metadata (``general.architecture == "llama"``).

    ``tensor_names`` decides ``tie_embeddings``: tied when there is no ``output.weight``.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama'")

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing llama.{key}")
        return value

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial RoPE (rope.dimension_count {rope_dim} != head dim {head_dim}) "
                         "is not supported")
    n_kv = get("attention.head_count_kv", n_heads)
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or None
    if vocab is None:
        raise ValueError("GGUF metadata has neither llama.vocab_size nor tokenizer.ggml.tokens")
    return ModelConfig(
        arch="llama",
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        d_ff=int(get("feed_forward_length")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=GGUF_TABLE.rows["lm_head"].names[0] not in tensor_names,
        dtype=dtype,
        max_position_embeddings=int(get("context_length")),
    )


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), i.e. the value the HF config.json holds."""
    return float(str(np.float32(x)))


def _read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata values, tensors by name) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: t for t in reader.tensors}


def _convert(tensors: Mapping[str, Any], cfg: ModelConfig, path: Path) -> dict[str, np.ndarray]:
    """Dequantize to float32 and rearrange into our flat ``"layers.<i>.<key>"`` layout."""
    import gguf

    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama-3.1 "
                         "style) are not supported")

    def read(name, shape):  # torch layout: [out, in]
        if name not in tensors:
            raise ValueError(f"missing tensor {name} in {path}")
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if w.shape != shape:
            raise ValueError(f"{name} in {path} has shape {w.shape}, expected {shape}")
        return w

    return {name: np.ascontiguousarray(w)
            for name, w in hf.params_from_tensors(GGUF_TABLE, cfg, read)}


class _Entry:
    """One GGUF's contents as cached: float32 config, flat float32 weights, tokenizer JSON."""

    def __init__(self, cfg: ModelConfig, flat: dict[str, np.ndarray] | None,
                 tokenizer_json: str, tokenizer_error: str):
        self.cfg, self.flat = cfg, flat
        self.tokenizer_json, self.tokenizer_error = tokenizer_json, tokenizer_error

    def tokenizer(self) -> Tokenizer:
        if self.tokenizer_error:
            raise ValueError(self.tokenizer_error)
        return Tokenizer.from_json(self.tokenizer_json)


def _build(path: Path, with_weights: bool = True) -> _Entry:
    meta, tensors = _read(path)
    cfg = config_from_gguf(meta, tensors)
    flat = _convert(tensors, cfg, path) if with_weights else None
    try:
        tokenizer_json, error = Tokenizer.from_gguf_metadata(meta).to_json(), ""
    except (ValueError, KeyError) as e:  # weights stay loadable without a tokenizer
        tokenizer_json, error = "", f"{path}: cannot rebuild the tokenizer: {e}"
    return _Entry(cfg, flat, tokenizer_json, error)


def cache_path(path: str | Path) -> Path:
    """Where the cache entry of the GGUF at ``path`` (as it is now) lives."""
    real = os.path.realpath(path)
    st = os.stat(real)
    path_key = hashlib.sha256(real.encode()).hexdigest()[:12]
    stat_key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{CACHE_FORMAT}".encode()).hexdigest()
    return cache_dir() / "gguf" / f"{Path(real).stem}-{path_key}-{stat_key[:12]}.safetensors"


def _config_to_json(cfg: ModelConfig) -> str:
    fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "dtype"}
    if cfg.rope_scaling is not None:
        fields["rope_scaling"] = dict(vars(cfg.rope_scaling))
    return json.dumps(fields)


def _config_from_json(text: str) -> ModelConfig:
    from specjax.config import RopeScaling

    fields = json.loads(text)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)


def _read_cache(file: Path, with_weights: bool) -> _Entry:
    from safetensors import safe_open

    with safe_open(file, framework="np") as f:
        meta = f.metadata() or {}
        if meta.get("specjax_cache_format") != CACHE_FORMAT:
            raise ValueError(f"cache format {meta.get('specjax_cache_format')!r}")
        cfg = _config_from_json(meta["config"])
        flat = {name: f.get_tensor(name) for name in f.keys()} if with_weights else None
    if with_weights:
        params_lib.check(params_lib.unflatten(flat, cfg.n_layers), cfg)
    return _Entry(cfg, flat, meta["tokenizer"], meta["tokenizer_error"])


def _write_cache(file: Path, entry: _Entry) -> None:
    """Atomically write ``entry``; replaced entries of the same GGUF path are removed."""
    from safetensors.numpy import save_file

    metadata = {"specjax_cache_format": CACHE_FORMAT, "config": _config_to_json(entry.cfg),
                "tokenizer": entry.tokenizer_json, "tokenizer_error": entry.tokenizer_error}
    tmp = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        save_file(entry.flat, tmp, metadata=metadata)
        os.replace(tmp, file)
        tmp = None
        stale_prefix = file.name.rsplit("-", 1)[0] + "-"
        for old in file.parent.glob(stale_prefix + "*.safetensors"):
            if old != file:
                old.unlink(missing_ok=True)
    except OSError as e:
        warnings.warn(f"could not write the GGUF cache {file}: {e}", stacklevel=3)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _load_entry(path: str | Path, cache: bool, with_weights: bool = True) -> _Entry:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    if not cache:
        return _build(path, with_weights)
    file = cache_path(path)
    if file.exists():
        try:
            return _read_cache(file, with_weights)
        except Exception as e:  # any failure to read back means: rebuild
            warnings.warn(f"discarding unreadable GGUF cache {file} ({type(e).__name__}: {e}); "
                          "rebuilding it", stacklevel=3)
            file.unlink(missing_ok=True)
    entry = _build(path)
    _write_cache(file, entry)
    return entry


def _params(entry: _Entry, dtype: str) -> tuple[ModelConfig, dict]:
    cfg = entry.cfg.replace(dtype=dtype)
    np_dtype = np.dtype(cfg.jnp_dtype)
    flat = {name: jax.device_put(w.astype(np_dtype, copy=False)) for name, w in entry.flat.items()}
    params = params_lib.unflatten(flat, cfg.n_layers)
    params_lib.check(params, cfg)
    return cfg, params


def load_gguf(path: str | Path, dtype: str = "float32", *,
              cache: bool = True) -> tuple[ModelConfig, dict]:
    """Load a llama-architecture GGUF into our params layout.

    Args:
      path: the ``.gguf`` file.
      dtype: ``"float32"`` or ``"bfloat16"``; weights are dequantized to float32, then cast.
      cache: read and write the dequantized-weights cache (see the module docstring).

    Returns:
      ``(cfg, params)``; the embedding is tied (no ``"lm_head"``) when the file has no
      ``output.weight``.
    """
    return _params(_load_entry(path, cache), dtype)


def load_gguf_tokenizer(path: str | Path, *, cache: bool = True) -> Tokenizer:
    """The tokenizer stored in a GGUF's metadata (from the cache when ``cache``)."""
    return _load_entry(path, cache, with_weights=False).tokenizer()


def load_gguf_with_tokenizer(path: str | Path, dtype: str = "float32", *,
                             cache: bool = True) -> tuple[ModelConfig, dict, Tokenizer]:
    """:func:`load_gguf` and :func:`load_gguf_tokenizer` sharing one read of the file."""
    entry = _load_entry(path, cache)
    cfg, params = _params(entry, dtype)
    return cfg, params, entry.tokenizer()


# Metadata not copied from the source: what describes its encoding (file type, quantization,
# alignment), and the architecture, which GGUFWriter writes itself.
_SKIP_KEYS = ("general.architecture", "general.file_type", "general.quantization_version",
              "general.alignment")


def write_f32_gguf(out: str | Path, source: str | Path, cfg: ModelConfig, params: dict) -> None:
    """Write ``params`` as an all-F32 llama GGUF at ``out``; :func:`load_gguf` reads it back
    bit for bit.

    Every metadata value (architecture, hyper-parameters, tokenizer, chat template) is copied
    from the GGUF ``source``, except the file type, which becomes ALL_F32. Tensors go through
    :data:`GGUF_TABLE`: llama.cpp's names, torch ``[out, in]`` matrices, Q/K rows permuted
    (:func:`permute_qk`), no ``output.weight`` when the head is tied.
    """
    import gguf

    if cfg.arch != "llama" or cfg.rope_scaling is not None:
        raise ValueError(f"write_f32_gguf covers Llama without RoPE scaling, got "
                         f"arch={cfg.arch!r}, rope_scaling={cfg.rope_scaling}")
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _SKIP_KEYS:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, tensor in hf.tensors_from_params(GGUF_TABLE, params, cfg):
        writer.add_tensor(name, np.ascontiguousarray(tensor, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
