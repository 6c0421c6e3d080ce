"""The target's params pytree, described once.

:func:`abstract` is the one description of a target model's weights: for every leaf of the
params pytree, its shape, dtype and logical axes (a :class:`ParamSpec`). Everything else is
derived from it: random weights (:func:`init`), ``jax.ShapeDtypeStruct`` trees for
``jax.eval_shape`` or an Orbax restore (:func:`shape_dtype_structs`), the check every loader ends
with (:func:`check`), shardings over a device mesh (:func:`partition_specs`), and the order in
which the format tables of ``specjax.io`` read and write tensors.

Layout (axis legend in :mod:`specjax.models.layers`; a matrix has its input axis first, the
transpose of torch's ``Linear.weight``), with each leaf's logical axes::

    params = {
      "embed": [V, D]                    vocab, embed
      "layers": (a tuple of L per-layer dicts) {
          "attn_norm": [D]               embed
          "wqkv": [D, K, G + 2, H]       embed, kv_heads, qkv, head_dim
          "wo": [N * H, D]               q_heads, embed
          "mlp_norm": [D]                embed
          "w_gate_up": [D, 2, F]         embed, gate_up, mlp
          "w_down": [F, D]               mlp, embed
          "q_norm": [H], "k_norm": [H]   head_dim              (Qwen3 only: cfg.qk_norm)
      },
      "final_norm": [D]                  embed
      "lm_head": [D, V]                  embed, vocab          (absent when cfg.tie_embeddings)
    }

``wqkv[:, k]`` holds everything kv head ``k`` needs: along the ``qkv`` axis its ``G`` query
heads (query head ``n = k * G + g`` at slot ``g``, HF's grouped-query convention), then its key
head (slot ``G``), then its value head (slot ``G + 1``); within a head the ``H`` features are in
HF's ``rotate_half`` order. ``w_gate_up[:, 0]`` is the gate, ``w_gate_up[:, 1]`` the up
projection. ``wo``'s rows are head-major (row ``n * H + j``). So every fused matrix splits over
heads or over ``F`` without cutting q, k, v, gate or up apart: sharding ``kv_heads``,
``q_heads`` and ``mlp`` over one mesh axis gives each device whole heads (when the axis size
divides K) and a slice of the MLP. Fusing at all is for speed: a decode step issues fewer,
larger matrix products. Row-major ``[D, K, G + 2, H]`` is a column permutation of a
``[D, (N + 2K) * H]`` matrix and ``[D, 2, F]`` a reshape of ``[D, 2F]``, so the products cost
the same as with plain 2-D fused matrices.

**One-row copies** (:mod:`specjax.io.layout`): a layer may also hold ``"<key>_t"`` for every key
in :data:`ROW_WEIGHTS`, and the params an untied ``"lm_head_t"``: the same array with its input
axis moved last (``wqkv_t`` [K, G + 2, H, D], ``wo_t`` [D, N * H], ``w_gate_up_t`` [2, F, D],
``w_down_t`` [D, F], ``lm_head_t`` [V, D]). ``abstract(cfg, row_weights=True)`` describes them.

**The tied head's copy**: tied params may also hold ``"tied_head"`` [D, V] (embed, vocab), the
embedding table transposed, which passes of several rows multiply by (the untied head's
layout); ``abstract(cfg, tied_head=True)`` describes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.config import ModelConfig

# Logical axis names; the rules of partition_specs map them to mesh axes.
AXES = ("vocab", "embed", "q_heads", "kv_heads", "qkv", "head_dim", "gate_up", "mlp")
ROW_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # layer matrices that get a one-row copy

MeshAxes = str | tuple[str, ...] | None  # what one logical axis maps to: mesh axes, or none


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One leaf of the params pytree, described.

    Attributes:
      shape: the leaf's shape.
      dtype: its dtype (``cfg.jnp_dtype`` for every leaf).
      axes: one logical axis name (from :data:`AXES`) per dimension.
      init: what :func:`init` draws: ``"normal"`` (matrices, the embedding) or ``"ones"``
        (norm scales).
    """

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str, ...]
    init: Literal["normal", "ones"] = "normal"

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"axes {self.axes} do not name the {len(self.shape)} dimensions of "
                             f"shape {self.shape}")
        unknown = [a for a in self.axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown logical axes {unknown}; known: {AXES}")

    def row_copy(self) -> ParamSpec:
        """The spec of this matrix's one-row copy: its input (first) axis moved last."""
        return dataclasses.replace(self, shape=self.shape[1:] + self.shape[:1],
                                   axes=self.axes[1:] + self.axes[:1])


def abstract(cfg: ModelConfig, row_weights: bool = False, tied_head: bool = False) -> dict:
    """The params pytree of ``cfg`` with a :class:`ParamSpec` at every leaf (module docstring).

    Args:
      cfg: the model config.
      row_weights: also describe the one-row copies of :mod:`specjax.io.layout`.
      tied_head: also describe the tied head's copy (a tied ``cfg`` only).
    Returns:
      ``{"embed", "layers": (per-layer dict, ...), "final_norm"[, "lm_head"]}``, the layout of
      the module docstring, keys in its order.
    """
    d, n, k, g, h, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim,
                           cfg.d_ff, cfg.vocab_size)

    def matrix(shape, *axes):
        return ParamSpec(shape, cfg.jnp_dtype, axes)

    def norm(width, axis):
        return ParamSpec((width,), cfg.jnp_dtype, (axis,), init="ones")

    def layer():
        p = {
            "attn_norm": norm(d, "embed"),
            "wqkv": matrix((d, k, g + 2, h), "embed", "kv_heads", "qkv", "head_dim"),
            "wo": matrix((n * h, d), "q_heads", "embed"),
            "mlp_norm": norm(d, "embed"),
            "w_gate_up": matrix((d, 2, f), "embed", "gate_up", "mlp"),
            "w_down": matrix((f, d), "mlp", "embed"),
        }
        if cfg.qk_norm:
            p["q_norm"] = norm(h, "head_dim")
            p["k_norm"] = norm(h, "head_dim")
        if row_weights:
            p.update({f"{key}_t": p[key].row_copy() for key in ROW_WEIGHTS})
        return p

    params = {"embed": matrix((v, d), "vocab", "embed"),
              "layers": tuple(layer() for _ in range(cfg.n_layers)),
              "final_norm": norm(d, "embed")}
    if not cfg.tie_embeddings:
        params["lm_head"] = matrix((d, v), "embed", "vocab")
        if row_weights:
            params["lm_head_t"] = params["lm_head"].row_copy()
    elif tied_head:
        params["tied_head"] = matrix((d, v), "embed", "vocab")
    return params


def init(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """Random weights for ``cfg``: normal(0, ``scale``) matrices and embedding, unit norms.

    Drawn with NumPy on the host, one leaf after another in ``jax.tree`` order of
    :func:`abstract`: compiling JAX's threefry for a dozen weight shapes took longer than a small
    test's whole run.
    """
    gen = np.random.default_rng(seed)

    def draw(spec: ParamSpec) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, spec.dtype)
        return jnp.asarray(scale * gen.standard_normal(spec.shape, np.float32), spec.dtype)

    return jax.tree.map(draw, abstract(cfg))


def _mesh_axes(rules: Mapping[str, MeshAxes], spec: ParamSpec, name: str) -> PartitionSpec:
    """The partition spec of one leaf under ``rules``; a mesh axis may shard one dimension."""
    mesh_axes = tuple(rules.get(axis) for axis in spec.axes)
    used = [a for entry in mesh_axes if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)]
    if len(used) != len(set(used)):
        raise ValueError(f"{name}: rules map its axes {spec.axes} to {mesh_axes}, which uses a "
                         "mesh axis twice")
    return PartitionSpec(*mesh_axes)


def partition_specs(cfg: ModelConfig, rules: Mapping[str, MeshAxes],
                    row_weights: bool = False, tied_head: bool = False) -> dict:
    """``jax.sharding.PartitionSpec`` for every leaf of :func:`abstract`.

    Args:
      cfg: the model config.
      rules: logical axis (:data:`AXES`) -> mesh axis name, tuple of names, or None; axes not
        named are replicated. E.g. ``{"kv_heads": "model", "q_heads": "model", "mlp":
        "model"}`` is tensor parallelism over a ``"model"`` mesh axis whose size divides K, N
        and F. A dimension sharded over mesh axes of total size M must be divisible by M.
      row_weights, tied_head: also cover the one-row copies, the tied head's copy.
    Returns:
      The params pytree with a ``PartitionSpec`` at every leaf, e.g. ``P(None, "model", None,
      None)`` for ``wqkv`` under the rules above.
    Raises:
      ValueError: a rule names an unknown logical axis, or maps two axes of one leaf to the same
        mesh axis.
    """
    unknown = sorted(set(rules) - set(AXES))
    if unknown:
        raise ValueError(f"rules name unknown logical axes {unknown}; known: {AXES}")
    return jax.tree_util.tree_map_with_path(
        lambda path, spec: _mesh_axes(rules, spec, _dotted(path)),
        abstract(cfg, row_weights, tied_head))


def shape_dtype_structs(cfg: ModelConfig, row_weights: bool = False, mesh: Mesh | None = None,
                        rules: Mapping[str, MeshAxes] | None = None,
                        tied_head: bool = False) -> dict:
    """The params pytree as ``jax.ShapeDtypeStruct`` leaves, e.g. for ``jax.eval_shape`` or as
    an Orbax restore target; with ``mesh``, each carries ``NamedSharding(mesh, spec)`` for the
    spec :func:`partition_specs` gives under ``rules``; ``row_weights`` and ``tied_head`` as
    in :func:`abstract`."""
    structs = abstract(cfg, row_weights, tied_head)
    if mesh is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), structs)
    specs = partition_specs(cfg, rules or {}, row_weights, tied_head)
    return jax.tree.map(
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)),
        structs, specs)


def _dotted(path) -> str:
    """A ``jax.tree_util`` key path as the dotted names of :func:`flatten`: ``layers.0.wqkv``."""
    return ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def flatten(params: Mapping[str, Any]) -> dict[str, Any]:
    """``{"embed": a, "layers": ({"wqkv": b, ...}, ...)}`` -> ``{"embed": a, "layers.0.wqkv": b}``.

    Keys keep their order (``embed``, then layer by layer, then the rest for :func:`abstract`).
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


def unflatten(flat: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
    """Inverse of :func:`flatten` for a model with ``n_layers`` layers."""
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


def check(params: Mapping[str, Any], cfg: ModelConfig) -> None:
    """Raise ValueError unless ``params`` has exactly the leaves, shapes and dtype of ``cfg``.

    Leaves only need ``.shape`` and ``.dtype``, so ``jax.ShapeDtypeStruct`` trees pass too. The
    one-row copies may be present, all of them or none, and so may the tied head's copy.
    Messages name the leaf, e.g. ``"layers.3.wqkv has shape (64, 100), expected (64, 2, 4,
    16)"``; every loader ends with this
    check, so a checkpoint that disagrees with its own config fails at load time, not deep inside
    a jitted forward pass with an einsum shape error.
    """
    if isinstance(params, Mapping) and isinstance(params.get("layers"), tuple):
        if len(params["layers"]) != cfg.n_layers:
            raise ValueError(
                f"params['layers'] has {len(params['layers'])} layers, expected "
                f"cfg.n_layers = {cfg.n_layers}"
            )
    flat = flatten(params)
    row_weights = any(name.endswith("_t") for name in flat)
    expected = flatten(abstract(cfg, row_weights, tied_head="tied_head" in flat))
    for name, spec in expected.items():
        if name not in flat:
            raise ValueError(f"missing tensor {name} (expected shape {spec.shape})")
    for name in flat:
        if name not in expected:
            key = name.rsplit(".", 1)[-1]
            if key in ("lm_head", "lm_head_t") and cfg.tie_embeddings:
                why = "cfg.tie_embeddings is True, so the LM head must be absent"
            elif key == "tied_head":
                why = "cfg.tie_embeddings is False: an untied head has no tied copy"
            elif key in ("q_norm", "k_norm") and not cfg.qk_norm:
                why = f"arch {cfg.arch!r} has no q/k norm"
            else:
                why = f"it is not part of a {cfg.arch!r} model"
            raise ValueError(f"unexpected tensor {name}: {why}")
    want_dtype = np.dtype(cfg.jnp_dtype)
    for name, spec in expected.items():
        leaf = flat[name]
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ValueError(f"{name} is a {type(leaf).__name__}, expected an array")
        got_shape = tuple(leaf.shape)
        if got_shape != spec.shape:
            raise ValueError(f"{name} has shape {got_shape}, expected {spec.shape}")
        got_dtype = np.dtype(leaf.dtype)
        if got_dtype != want_dtype:
            raise ValueError(f"{name} has dtype {got_dtype}, expected {want_dtype} (cfg.dtype)")
