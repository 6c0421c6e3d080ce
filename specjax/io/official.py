"""Official EAGLE and DFlash drafter checkpoints: import and export.

The layout of the reference implementation's releases (``yuhuili/EAGLE3-*``,
``yuhuili/EAGLE-*``), which vLLM and SGLang also serve: a directory with ``config.json`` (a
Llama config of one layer; EAGLE-3 adds ``draft_vocab_size`` and, when its width differs from
the target's, ``target_hidden_size``) and ``model.safetensors`` or a torch ``pytorch_model.bin``
(read here without torch). One name table per version (:data:`EAGLE3_TABLE`,
:data:`EAGLE1_TABLE`) serves both directions; matrices are torch ``Linear`` weights
``[out, in]``. EAGLE-3 files hold ``d2t`` (int64 offsets, draft id i is target id
``i + d2t[i]``) and ``t2d`` (a bool mask over the target vocabulary, the same set); neither
version stores the embedding, which the drafter reads from its target. An EAGLE-1 drafter
with a draft vocabulary (:mod:`specjax.drafters.vocab`) adds a ``token_order`` [vocab] int32
tensor, as DFlash ones do (below).

    cfg, own = official.load_eagle("EAGLE3-LLaMA3.1-Instruct-8B", target_cfg)
    official.save_eagle(cfg, own, "out/")   # config.json + model.safetensors

DFlash drafters (``z-lab/*-DFlash-*``) are Qwen3-typed stacks without embedding or head:
``config.json`` carries ``block_size``, ``num_target_layers``, ``layer_types`` and
``dflash_config`` (``target_layer_ids``, ``mask_token_id``); the tensors are ``fc``,
``hidden_norm``, ``norm`` and ``layers.{i}.*`` (:data:`DFLASH_TABLE`). A drafter with a
learned mask embedding writes ``mask_token_id: null`` and a ``mask_embedding`` [hidden] tensor;
one with a draft vocabulary (:mod:`specjax.drafters.vocab`) a ``token_order`` [vocab] int32
tensor, the target's ids by frequency in its training data, and optionally the size it drafts
from by default, ``draft_vocab_size`` in config.json (both specjax's additions).

    cfg, own = official.load_dflash("Qwen3-8B-DFlash-b16", target_cfg)
    official.save_dflash(cfg, own, "out/")
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import ModelConfig
from specjax.drafters import eagle
from specjax.drafters.eagle import EagleConfig
from specjax.io.hf import (COPY, GATE_UP, LINEAR, QKV, Row, SafetensorsFile, Transform,
                           rope_settings, write_safetensors)

_D2T = Transform(lambda tensors, cfg: tensors[0].astype(np.int32),
                 lambda x, cfg: (x.astype(np.int64),))


def _layer_rows(prefix: str) -> dict[str, Row]:
    return {
        "layer.wqkv": Row(tuple(f"{prefix}self_attn.{x}_proj.weight" for x in "qkv"), QKV),
        "layer.wo": Row((f"{prefix}self_attn.o_proj.weight",), LINEAR),
        "layer.mlp_norm": Row((f"{prefix}post_attention_layernorm.weight",), COPY),
        "layer.w_gate_up": Row((f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"),
                               GATE_UP),
        "layer.w_down": Row((f"{prefix}mlp.down_proj.weight",), LINEAR),
    }


# Our dotted key (of the drafter's own params) -> the official tensors.
EAGLE3_TABLE = {
    "fc": Row(("fc.weight",), LINEAR),
    "layer.attn_norm": Row(("midlayer.input_layernorm.weight",), COPY),
    "layer.hidden_norm": Row(("midlayer.hidden_norm.weight",), COPY),
    **_layer_rows("midlayer."),
    "final_norm": Row(("norm.weight",), COPY),
    "lm_head": Row(("lm_head.weight",), LINEAR),
    "d2t": Row(("d2t",), _D2T),
}
EAGLE1_TABLE = {
    "fc": Row(("fc.weight",), LINEAR),
    "fc_bias": Row(("fc.bias",), COPY),
    **_layer_rows("layers.0."),
}


# ----------------------------------------------------------------------------------------
# Reading tensors: safetensors, or a torch zip pickle without torch.


class _TorchStorage:
    def __init__(self, dtype):
        self.dtype = dtype


_TORCH_STORAGES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
    "LongStorage": np.int64, "IntStorage": np.int32, "BoolStorage": np.bool_,
    "ByteStorage": np.uint8, "BFloat16Storage": "bfloat16",
}


def _rebuild_tensor(storage, offset, size, stride, *_):
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], tuple(size),
                                           tuple(s * item for s in stride)).copy()


class _TorchUnpickler(pickle.Unpickler):
    """Unpickles a torch state dict into NumPy arrays, allowing only what state dicts use."""

    def __init__(self, file, archive: zipfile.ZipFile, root: str):
        super().__init__(file)
        self._archive, self._root = archive, root

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _TORCH_STORAGES:
            return _TorchStorage(_TORCH_STORAGES[name])
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain state dict")

    def persistent_load(self, pid):
        _, storage, key, _, _ = pid
        raw = self._archive.read(f"{self._root}/data/{key}")
        if storage.dtype == "bfloat16":
            import ml_dtypes

            return np.frombuffer(raw, ml_dtypes.bfloat16)
        return np.frombuffer(raw, storage.dtype)


def read_torch_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a ``torch.save`` zip file (``pytorch_model.bin``) as NumPy arrays."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not a torch zip checkpoint (legacy torch pickles are not "
                         "supported; re-save it with torch >= 1.6 or as safetensors)") from None
    with archive:
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"corrupt torch checkpoint {path}: no single data.pkl")
        root = pkl[0][: -len("/data.pkl")]
        with archive.open(pkl[0]) as f:
            state = _TorchUnpickler(f, archive, root).load()
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    return dict(state)


def _read_tensors(path: Path) -> tuple[dict[str, Any], str]:
    """``({name: array-like}, file name)`` from ``model.safetensors`` or ``pytorch_model.bin``."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.exists():
        f = SafetensorsFile(st)
        return {k: f.get(k) for k in f.keys()}, st.name
    if pt.exists():
        return read_torch_state_dict(pt), pt.name
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


# ----------------------------------------------------------------------------------------
# Configs.


def _version(tensors) -> int:
    if "midlayer.self_attn.q_proj.weight" in tensors:
        return 3
    if "layers.0.self_attn.q_proj.weight" in tensors:
        return 1
    raise ValueError("not an EAGLE drafter: neither midlayer.* (EAGLE-3) nor layers.0.* "
                     "(EAGLE-1/2) tensors found")


def config_from_official(config: dict, tensors, target_cfg: ModelConfig,
                         dtype: str = "float32") -> EagleConfig:
    """The :class:`EagleConfig` of an official checkpoint drafting for ``target_cfg``.

    Raises:
      ValueError: the drafter was made for another target (vocabulary, width), or its config
        lacks a field.
    """
    version = _version(tensors)
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layer = ModelConfig(
            arch="llama", d_model=d, n_layers=1, n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or d // heads),
            d_ff=int(config["intermediate_size"]),
            vocab_size=int(config.get("draft_vocab_size", config["vocab_size"])
                           if version == 3 else config["vocab_size"]),
            # EAGLE-3 drafters were trained with the default base whatever their target uses.
            rope_theta=float(config.get("rope_theta") or 10000.0),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            dtype=dtype)
        vocab = int(config["vocab_size"])
    except KeyError as e:
        raise ValueError(f"the drafter's config.json lacks {e.args[0]!r}") from None
    if config.get("rope_scaling"):
        raise ValueError(f"rope_scaling {config['rope_scaling']} in a drafter config is not "
                         "supported (the official drafters have none)")
    if vocab != target_cfg.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({vocab}) differs from the target's "
                         f"({target_cfg.vocab_size}); drafter and target mismatch")
    target_d = int(config.get("target_hidden_size", d))
    if target_d != target_cfg.d_model:
        raise ValueError(f"the drafter reads features of width {target_d}, the target's hidden "
                         f"size is {target_cfg.d_model}; drafter and target mismatch")
    if version == 3:
        taps = eagle.eagle3_taps(target_cfg.n_layers)
        fc_in = np.shape(tensors["fc.weight"])[1]
        if fc_in != len(taps) * target_d:
            raise ValueError(f"fc.weight reads {fc_in} features, not {len(taps)} taps x "
                             f"{target_d}; drafter and target mismatch")
        return EagleConfig(3, layer, vocab, target_d, taps)
    from specjax.models.target import FINAL_NORMED

    return EagleConfig(1, layer, vocab, target_d, (FINAL_NORMED,), fc_bias="fc.bias" in tensors)


def config_to_official(cfg: EagleConfig) -> dict:
    """The ``config.json`` of an official-format checkpoint of ``cfg``."""
    lc = cfg.layer
    out = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.version == 3 else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_size": lc.d_model, "intermediate_size": lc.d_ff,
        "num_attention_heads": lc.n_heads, "num_key_value_heads": lc.n_kv_heads,
        "head_dim": lc.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": lc.norm_eps, "rope_theta": lc.rope_theta, "rope_scaling": None,
        "max_position_embeddings": lc.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16" if lc.dtype == "bfloat16" else "float32",
    }
    if cfg.version == 3:
        out["draft_vocab_size"] = cfg.draft_vocab_size
        if cfg.target_d_model != lc.d_model:
            out["target_hidden_size"] = cfg.target_d_model
    else:
        out["bias"] = cfg.fc_bias
    return out


def _table(cfg: EagleConfig) -> dict[str, Row]:
    rows = EAGLE3_TABLE if cfg.version == 3 else EAGLE1_TABLE
    return {k: r for k, r in rows.items() if k != "fc_bias" or cfg.fc_bias}


def _ids(tensor, source: Path) -> np.ndarray:
    """A ``token_order`` tensor as int32 ids; ValueError naming ``source`` unless integers."""
    order = np.asarray(tensor)
    if not np.issubdtype(order.dtype, np.integer):
        raise ValueError(f"token_order in {source} holds {order.dtype}, not ids")
    return order.astype(np.int32)


def load_eagle(path: str | Path, target_cfg: ModelConfig,
               dtype: str = "float32") -> tuple[EagleConfig, dict]:
    """Loads an official-format EAGLE-1/2/3 drafter directory for ``target_cfg``.

    Returns:
      ``(cfg, own)``: the drafter's config and its own params (pass them with the target's to
      :func:`specjax.drafters.eagle.drafter_params`).
    Raises:
      FileNotFoundError: no config or tensor file.
      ValueError: a drafter/target mismatch, a missing or misshapen tensor, an inconsistent
        ``d2t``/``t2d``, a ``token_order`` that does not rank every target id once or that an
        EAGLE-3 drafter carries.
    """
    import jax.numpy as jnp

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}")
    tensors, source = _read_tensors(path)
    cfg = config_from_official(json.loads((path / "config.json").read_text()), tensors,
                               target_cfg, dtype)
    if "embed_tokens.weight" in tensors:
        raise ValueError(f"{path / source} carries its own embed_tokens.weight; drafters with "
                         "an embedding other than their target's are not supported")
    lc = cfg.layer
    own: dict = {"layer": {}}
    for key, row in _table(cfg).items():
        missing = [n for n in row.names if n not in tensors]
        if missing:
            raise ValueError(f"missing tensor {missing[0]} in {path / source}")
        leaf = row.transform.to_ours([np.asarray(tensors[n]) for n in row.names], lc)
        leaf = jnp.asarray(leaf, jnp.int32 if key == "d2t" else lc.jnp_dtype)
        if key.startswith("layer."):
            own["layer"][key[len("layer."):]] = leaf
        else:
            own[key] = leaf
    if "token_order" in tensors:
        own["token_order"] = jnp.asarray(_ids(tensors["token_order"], path / source))
    eagle.check_params(cfg, own)
    if cfg.version == 3 and "t2d" in tensors:
        ids = np.arange(cfg.draft_vocab_size) + np.asarray(own["d2t"])
        t2d = np.asarray(tensors["t2d"], bool)
        if t2d.shape != (cfg.target_vocab_size,) or not np.array_equal(np.flatnonzero(t2d), ids):
            raise ValueError(f"t2d in {path / source} does not mark exactly the ids d2t maps to")
    return cfg, own


def save_eagle(cfg: EagleConfig, own: dict, out_dir: str | Path,
               dtype: str | None = None) -> Path:
    """Writes ``own`` as an official-format checkpoint: ``config.json`` + ``model.safetensors``
    (floats in ``dtype``, default the drafter's; EAGLE-3 with ``d2t`` and ``t2d``; an EAGLE-1
    ``token_order`` as int32, a specjax addition). Returns the directory."""
    import jax
    import jax.numpy as jnp

    eagle.check_params(cfg, own)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, layer=cfg.layer.replace(dtype=dtype))
        own = jax.tree.map(lambda x: x.astype(cfg.layer.jnp_dtype)
                           if jnp.issubdtype(x.dtype, jnp.floating) else x, own)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {"layer." + k: v for k, v in own["layer"].items()} | {
        k: v for k, v in own.items() if k != "layer"}
    tensors = []
    for key, row in _table(cfg).items():
        for name, t in zip(row.names, row.transform.from_ours(np.asarray(flat[key]), cfg.layer)):
            tensors.append((name, np.ascontiguousarray(t)))
    if cfg.version == 3:
        t2d = np.zeros(cfg.target_vocab_size, np.bool_)
        t2d[np.arange(cfg.draft_vocab_size) + np.asarray(own["d2t"])] = True
        tensors.append(("t2d", t2d))
    if "token_order" in own:
        tensors.append(("token_order", np.asarray(own["token_order"], np.int32)))
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config_to_official(cfg), indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------------------
# DFlash.

_DL = "layers.{i}."
# Our dotted key of the drafter's own params ({i}: draft layer) -> the official tensors.
DFLASH_TABLE = {
    "fc": Row(("fc.weight",), LINEAR),
    "hidden_norm": Row(("hidden_norm.weight",), COPY),
    "norm": Row(("norm.weight",), COPY),
    "mask_embedding": Row(("mask_embedding",), COPY),
    "layers.{i}.attn_norm": Row((_DL + "input_layernorm.weight",), COPY),
    "layers.{i}.wqkv": Row(tuple(_DL + f"self_attn.{x}_proj.weight" for x in "qkv"), QKV),
    "layers.{i}.q_norm": Row((_DL + "self_attn.q_norm.weight",), COPY),
    "layers.{i}.k_norm": Row((_DL + "self_attn.k_norm.weight",), COPY),
    "layers.{i}.wo": Row((_DL + "self_attn.o_proj.weight",), LINEAR),
    "layers.{i}.mlp_norm": Row((_DL + "post_attention_layernorm.weight",), COPY),
    "layers.{i}.w_gate_up": Row((_DL + "mlp.gate_proj.weight", _DL + "mlp.up_proj.weight"),
                                GATE_UP),
    "layers.{i}.w_down": Row((_DL + "mlp.down_proj.weight",), LINEAR),
}


def _dflash_rows(cfg):
    """``(path into own, row with the layer filled in)`` of every leaf of ``cfg``'s params."""
    for key, row in DFLASH_TABLE.items():
        if key == "mask_embedding" and cfg.mask_token_id is not None:
            continue
        if "{i}" not in key:
            yield (key,), row
            continue
        for i in range(cfg.layer.n_layers):
            yield (("layers", i, key.rsplit(".", 1)[1]),
                   Row(tuple(n.format(i=i) for n in row.names), row.transform))


def dflash_config_from_official(config: dict, target_cfg: ModelConfig, has_mask_embedding: bool,
                                dtype: str = "float32"):
    """The :class:`~specjax.drafters.dflash.DFlashConfig` of an official DFlash config drafting
    for ``target_cfg``.

    Raises:
      ValueError: the drafter was made for another target (width, vocabulary, layers), it has
        no mask (neither ``mask_token_id`` nor a ``mask_embedding`` tensor), or its config lacks
        a field.
    """
    from specjax.drafters import dflash

    extra = config.get("dflash_config") or {}
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        block = int(config.get("block_size") or extra["block_size"])
        vocab = int(config["vocab_size"])
    except KeyError as e:
        raise ValueError(f"the DFlash config.json lacks {e.args[0]!r}") from None
    if d != target_cfg.d_model:
        raise ValueError(f"the drafter's hidden size {d} differs from the target's "
                         f"{target_cfg.d_model}; drafter and target mismatch")
    if vocab != target_cfg.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({vocab}) differs from the target's "
                         f"({target_cfg.vocab_size}); drafter and target mismatch")
    n_target = int(config.get("num_target_layers", target_cfg.n_layers))
    ids = extra.get("target_layer_ids")
    ids = (tuple(int(i) for i in ids) if ids is not None
           else dflash.default_layer_ids(n_target, n_layers))
    if max(ids) >= target_cfg.n_layers:
        raise ValueError(f"the drafter taps target layers {list(ids)}, the target has layers "
                         f"0..{target_cfg.n_layers - 1}; drafter and target mismatch")
    mask_id = extra.get("mask_token_id", config.get("mask_token_id"))
    if mask_id is None and not has_mask_embedding:
        raise ValueError("the DFlash drafter has no mask token: dflash_config.mask_token_id is "
                         "missing and there is no mask_embedding tensor")
    if config.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (DFlash layers have no biases)")
    theta, scaling = rope_settings(config)
    layer = ModelConfig(
        arch="qwen3", d_model=d, n_layers=n_layers, n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or d // heads),
        d_ff=int(config["intermediate_size"]), vocab_size=vocab, rope_theta=theta,
        rope_scaling=scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)), dtype=dtype)
    types = config.get("layer_types")
    vd = config.get("draft_vocab_size")
    return dflash.DFlashConfig(
        layer, block, ids, n_target, None if mask_id is None else int(mask_id),
        tuple(types) if types else None,
        int(config["sliding_window"]) if types and "sliding_attention" in types else None,
        config.get("is_causal"), None if vd is None else int(vd))


def dflash_config_to_official(cfg) -> dict:
    """The ``config.json`` of an official-format checkpoint of a DFlash config."""
    lc = cfg.layer
    out = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids)},
        "num_target_layers": cfg.target_n_layers, "num_hidden_layers": lc.n_layers,
        "hidden_size": lc.d_model, "intermediate_size": lc.d_ff,
        "num_attention_heads": lc.n_heads, "num_key_value_heads": lc.n_kv_heads,
        "head_dim": lc.head_dim, "hidden_act": "silu", "rms_norm_eps": lc.norm_eps,
        "rope_theta": lc.rope_theta, "rope_scaling": None if lc.rope_scaling is None else {
            "rope_type": "llama3", **dataclasses.asdict(lc.rope_scaling)},
        "max_position_embeddings": lc.max_position_embeddings, "attention_bias": False,
        "layer_types": list(cfg.types), "sliding_window": cfg.sliding_window,
        "tie_word_embeddings": False, "vocab_size": cfg.vocab_size,
        "torch_dtype": "bfloat16" if lc.dtype == "bfloat16" else "float32",
    }
    if cfg.is_causal is not None:
        out["is_causal"] = cfg.is_causal
    if cfg.draft_vocab_size is not None:
        out["draft_vocab_size"] = cfg.draft_vocab_size
    return out


def load_dflash(path: str | Path, target_cfg: ModelConfig, dtype: str = "float32"):
    """Loads an official-format DFlash drafter directory for ``target_cfg``.

    Returns:
      ``(cfg, own)``: the drafter's config and its own params (pass them with the target's to
      :func:`specjax.drafters.dflash.drafter_params`).
    Raises:
      FileNotFoundError: no config or tensor file.
      ValueError: a drafter/target mismatch, no mask, a missing or misshapen tensor.
    """
    import jax.numpy as jnp

    from specjax.drafters import dflash

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}")
    tensors, source = _read_tensors(path)
    if "fc.weight" not in tensors or "layers.0.self_attn.q_proj.weight" not in tensors:
        raise ValueError(f"{path / source} is not a DFlash drafter: no fc.weight and "
                         "layers.0.* tensors")
    cfg = dflash_config_from_official(json.loads((path / "config.json").read_text()),
                                      target_cfg, "mask_embedding" in tensors, dtype)
    fc_in = np.shape(tensors["fc.weight"])[1]
    if fc_in != len(cfg.target_layer_ids) * target_cfg.d_model:
        raise ValueError(f"fc.weight reads {fc_in} features, not {len(cfg.target_layer_ids)} "
                         f"target layers x {target_cfg.d_model}; drafter and target mismatch")
    own: dict = {"layers": [{} for _ in range(cfg.layer.n_layers)]}
    for where, row in _dflash_rows(cfg):
        missing = [n for n in row.names if n not in tensors]
        if missing:
            raise ValueError(f"missing tensor {missing[0]} in {path / source}")
        leaf = jnp.asarray(row.transform.to_ours([np.asarray(tensors[n]) for n in row.names],
                                                 cfg.layer), cfg.layer.jnp_dtype)
        if len(where) == 1:
            own[where[0]] = leaf
        else:
            own["layers"][where[1]][where[2]] = leaf
    if "token_order" in tensors:
        own["token_order"] = jnp.asarray(_ids(tensors["token_order"], path / source))
    elif cfg.draft_vocab_size is not None:
        raise ValueError(f"{path / 'config.json'} sets draft_vocab_size but {path / source} has "
                         "no token_order to take those ids from")
    dflash.check_params(cfg, own)
    return cfg, own


def dflash_tensors(cfg, own: dict) -> list[tuple[str, np.ndarray]]:
    """``(official name, array)`` of every tensor of a DFlash drafter, torch layout (and its
    ``token_order`` as int32, a specjax addition that official loaders do not read)."""
    tensors = []
    for where, row in _dflash_rows(cfg):
        leaf = own[where[0]] if len(where) == 1 else own["layers"][where[1]][where[2]]
        for name, t in zip(row.names, row.transform.from_ours(np.asarray(leaf), cfg.layer)):
            tensors.append((name, np.ascontiguousarray(t)))
    if "token_order" in own:
        tensors.append(("token_order", np.asarray(own["token_order"], np.int32)))
    return tensors


def save_dflash(cfg, own: dict, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Writes a DFlash drafter's ``own`` params as an official-format checkpoint:
    ``config.json`` + ``model.safetensors`` (in ``dtype``, default the drafter's). Returns the
    directory."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import dflash

    dflash.check_params(cfg, own)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, layer=cfg.layer.replace(dtype=dtype))
        weights = {k: v for k, v in own.items() if k != "token_order"}
        own = dict(own, **jax.tree.map(lambda x: x.astype(cfg.layer.jnp_dtype), weights))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", dflash_tensors(cfg, own))
    (out / "config.json").write_text(json.dumps(dflash_config_to_official(cfg), indent=2) + "\n")
    return out


def check_rankable(path: str | Path, draft_vocab_size: int | None = None) -> int:
    """The vocabulary size of the DFlash or EAGLE-1 drafter directory ``path``, after checking
    that :func:`set_token_order` can write a ranking (and ``draft_vocab_size``) into it: a
    caller can check before counting tokens for the ranking.

    Raises:
      FileNotFoundError: no config.json or model.safetensors in ``path``.
      ValueError: neither a DFlash nor an EAGLE-1 drafter, a ``draft_vocab_size`` for an
        EAGLE-1 drafter, or one outside its vocabulary.
    """
    from specjax.drafters import vocab

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}")
    config = json.loads((path / "config.json").read_text())
    st = path / "model.safetensors"
    if not st.exists():
        raise FileNotFoundError(f"no model.safetensors in {path}")
    is_dflash = "block_size" in config or "dflash_config" in config
    if not is_dflash and "layers.0.self_attn.q_proj.weight" not in SafetensorsFile(st).keys():
        raise ValueError(f"{path} is neither a DFlash drafter (its config.json has no "
                         "block_size or dflash_config) nor an EAGLE-1 one (no layers.0.* "
                         "tensors)")
    if not is_dflash and draft_vocab_size is not None:
        raise ValueError("an EAGLE-1 drafter's config.json keeps the official fields; choose "
                         "its draft vocabulary when drafting (--draft-vocab)")
    size = int(config["vocab_size"])
    if draft_vocab_size is not None:
        vocab.check_size(draft_vocab_size, size)
    return size


def set_token_order(path: str | Path, order: np.ndarray,
                    draft_vocab_size: int | None = None) -> Path:
    """Writes a ranking of the target's ids (``token_order`` [V], the most frequent first, see
    :mod:`specjax.drafters.vocab`) into the DFlash or EAGLE-1 drafter directory ``path``,
    replacing any it had; the other tensors are kept byte for byte. ``model.safetensors`` is
    rewritten through a temporary file, so an interrupted write leaves the old one. With
    ``draft_vocab_size`` (DFlash only: an EAGLE-1 config's fields are the official ones),
    config.json's ``draft_vocab_size`` (the drafter's default draft vocabulary) is set too.
    Returns the tensor file's path.

    Raises:
      FileNotFoundError, ValueError: what :func:`check_rankable` raises, or ``order`` does not
        rank the drafter's vocabulary.
    """
    from specjax.drafters import vocab

    path = Path(path)
    vocab.check_order(order, check_rankable(path, draft_vocab_size))
    st = path / "model.safetensors"
    f = SafetensorsFile(st)
    tensors = [(k, np.asarray(f.get(k))) for k in f.keys() if k != "token_order"]
    tmp = st.with_name(st.name + ".tmp")
    write_safetensors(tmp, tensors + [("token_order", np.asarray(order, np.int32))])
    tmp.replace(st)
    if draft_vocab_size is not None:
        config = json.loads((path / "config.json").read_text())
        config["draft_vocab_size"] = int(draft_vocab_size)
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return st
