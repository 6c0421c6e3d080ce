"""Structural checks of a target params pytree against its :class:`ModelConfig`.

Every loader ends with :func:`check_params`, so a checkpoint that disagrees with its own config
fails at load time with the name of the offending tensor, not deep inside a jitted forward pass
with an einsum shape error.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.io.layout import ROW_WEIGHTS

_QK_NORM_KEYS = ("q_norm", "k_norm")


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor of one decoder layer, by key."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {
        "attn_norm": (d,),
        "wqkv": (d, (n + 2 * k) * h),
        "wo": (n * h, d),
        "mlp_norm": (d,),
        "w_gate_up": (d, 2 * f),
        "w_down": (f, d),
    }
    if cfg.qk_norm:
        shapes["q_norm"] = (h,)
        shapes["k_norm"] = (h,)
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor of the params pytree, by dotted name.

    Names are ``"embed"``, ``"layers.<i>.<key>"``, ``"final_norm"`` and (untied) ``"lm_head"``,
    the same names :func:`check_params` uses in its errors.
    """
    shapes = {"embed": (cfg.vocab_size, cfg.d_model)}
    per_layer = layer_shapes(cfg)
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{key}": shape for key, shape in per_layer.items()})
    shapes["final_norm"] = (cfg.d_model,)
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.d_model, cfg.vocab_size)
    return shapes


def flatten_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``{"embed": a, "layers": ({"wqkv": b, ...}, ...)}`` -> ``{"embed": a, "layers.0.wqkv": b}``.

    Structural problems (``layers`` not a tuple of dicts) raise ValueError.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    flat = {}
    for name, value in params.items():
        if name != "layers":
            flat[name] = value
            continue
        if not isinstance(value, tuple):
            raise ValueError(
                f"params['layers'] must be a tuple of per-layer dicts, got {type(value).__name__}"
            )
        for i, layer in enumerate(value):
            if not isinstance(layer, Mapping):
                raise ValueError(
                    f"params['layers'][{i}] must be a dict, got {type(layer).__name__}")
            flat.update({f"layers.{i}.{key}": leaf for key, leaf in layer.items()})
    return flat


def unflatten_params(flat: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
    """Inverse of :func:`flatten_params` for a model with ``n_layers`` layers."""
    params: dict[str, Any] = {}
    layers: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    for name, value in flat.items():
        if name.startswith("layers."):
            _, index, key = name.split(".", 2)
            if not index.isdigit() or int(index) >= n_layers:
                raise ValueError(f"unexpected tensor {name} for a model with {n_layers} layers")
            layers[int(index)][key] = value
        else:
            params[name] = value
    params["layers"] = tuple(layers)
    return params


def check_params(params: Mapping[str, Any], cfg: ModelConfig) -> None:
    """Raise ValueError unless ``params`` has exactly the tensors, shapes and dtype of ``cfg``.

    Leaves only need ``.shape`` and ``.dtype``, so ``jax.ShapeDtypeStruct`` trees pass too. The
    one-row copies of :func:`specjax.io.layout.with_row_weights` may be present.
    Messages name the tensor, e.g. ``"layers.3.wqkv has shape (64, 100), expected (64, 128)"``.
    """
    if isinstance(params, Mapping) and isinstance(params.get("layers"), tuple):
        if len(params["layers"]) != cfg.n_layers:
            raise ValueError(
                f"params['layers'] has {len(params['layers'])} layers, expected "
                f"cfg.n_layers = {cfg.n_layers}"
            )
    flat = flatten_params(params)
    expected = param_shapes(cfg)
    # Optional one-row copies (layout.with_row_weights): [out, in] of their matrix, checked
    # like the matrix itself when present.
    expected.update({f"{name}_t": shape[::-1] for name, shape in list(expected.items())
                     if f"{name}_t" in flat
                     and name.rsplit(".", 1)[-1] in ROW_WEIGHTS + ("lm_head",)})
    for name, shape in expected.items():
        if name not in flat:
            raise ValueError(f"missing tensor {name} (expected shape {shape})")
    for name in flat:
        if name not in expected:
            why = {
                "lm_head": "cfg.tie_embeddings is True, so the LM head must be absent",
            }.get(name, f"it is not part of a {cfg.arch!r} model")
            if name.rsplit(".", 1)[-1] in _QK_NORM_KEYS and not cfg.qk_norm:
                why = f"arch {cfg.arch!r} has no q/k norm"
            raise ValueError(f"unexpected tensor {name}: {why}")
    want_dtype = np.dtype(cfg.jnp_dtype)
    for name, shape in expected.items():
        leaf = flat[name]
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ValueError(f"{name} is a {type(leaf).__name__}, expected an array")
        got_shape = tuple(leaf.shape)
        if got_shape != shape:
            raise ValueError(f"{name} has shape {got_shape}, expected {shape}")
        got_dtype = np.dtype(leaf.dtype)
        if got_dtype != want_dtype:
            raise ValueError(f"{name} has dtype {got_dtype}, expected {want_dtype} (cfg.dtype)")
