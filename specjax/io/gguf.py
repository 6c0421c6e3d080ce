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

Q and K projections are stored permuted for llama.cpp's interleaved RoPE (pairs ``2i, 2i+1``);
:func:`unpermute_qk` restores HF's ``rotate_half`` layout (pairs ``i, i + H/2``), which is the
layout our model code expects.
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
from specjax.io.checks import check_params, unflatten_params
from specjax.io.tokenizer import Tokenizer

CACHE_FORMAT = "1"  # bump when the cached layout or metadata changes


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
        tie_embeddings="output.weight" not in tensor_names,
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
    d, n, k, h, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)

    def get(name, shape):  # torch layout: [out, in]
        if name not in tensors:
            raise ValueError(f"missing tensor {name} in {path}")
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if w.shape != shape:
            raise ValueError(f"{name} in {path} has shape {w.shape}, expected {shape}")
        return w

    flat = {"embed": get("token_embd.weight", (v, d))}
    for i in range(cfg.n_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q = unpermute_qk(get(b + "attn_q.weight", (n * h, d)), n)
        kk = unpermute_qk(get(b + "attn_k.weight", (k * h, d)), k)
        vv = get(b + "attn_v.weight", (k * h, d))
        flat[p + "attn_norm"] = get(b + "attn_norm.weight", (d,))
        flat[p + "wqkv"] = np.concatenate([q.T, kk.T, vv.T], axis=1)
        flat[p + "wo"] = np.ascontiguousarray(get(b + "attn_output.weight", (d, n * h)).T)
        flat[p + "mlp_norm"] = get(b + "ffn_norm.weight", (d,))
        flat[p + "w_gate_up"] = np.concatenate([get(b + "ffn_gate.weight", (f, d)).T,
                                                get(b + "ffn_up.weight", (f, d)).T], axis=1)
        flat[p + "w_down"] = np.ascontiguousarray(get(b + "ffn_down.weight", (d, f)).T)
    flat["final_norm"] = get("output_norm.weight", (d,))
    if not cfg.tie_embeddings:
        flat["lm_head"] = np.ascontiguousarray(get("output.weight", (v, d)).T)
    return {name: np.ascontiguousarray(w) for name, w in flat.items()}


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
        check_params(unflatten_params(flat, cfg.n_layers), cfg)
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
    params = unflatten_params(flat, cfg.n_layers)
    check_params(params, cfg)
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


