"""Optional extra layouts of a target's (and a drafter's) params pytree.

**One-row weights.** XLA:CPU's matrix-vector product streams a weight stored ``[out, in]``
faster than one stored ``[in, out]`` (specjax's params have the input axis first), while with
two or more rows ``[in, out]`` is the faster one. :func:`with_row_weights` therefore adds a
copy of every layer matrix with its input axis moved last, under the matrix's key plus ``"_t"``
(and of an untied LM head, as ``"lm_head_t"``): ``wqkv_t`` [K, G + 2, H, D], ``w_gate_up_t``
[2, F, D], ``wo_t`` [D, N * H], ``w_down_t`` [D, F], ``lm_head_t`` [V, D]
(:func:`specjax.models.params.abstract` with ``row_weights=True``). The decoder multiplies a
pass of exactly one query row by the copies (:mod:`specjax.models.target`). The copies double
the memory of those matrices. A drafter's own matrices get the same copies
(:func:`with_drafter_row_weights`, :func:`drafter_own`) when its target has them, so drafting
multiplies as the target's passes do; bfloat16 copies (half the memory) where the CPU kernel
runs and that changes no weight.

**The tied head's copy.** A tied head multiplies by the embedding table ``embed`` [V, D]: the
one-row layout. For bfloat16 passes of several rows (a verify pass, a drafted block, and a
one-row pass, which runs as two) XLA:CPU's matrix product wants ``[D, V]``, and transposes the
whole table to get it; inside a speculative cycle that transpose is not hoisted out of the
loop, so every cycle paid it (17 ms of an 89 ms EAGLE-3 cycle for SmolLM2-135M in bfloat16,
one profiled run). :func:`with_tied_head` stores the transpose once, as
``"tied_head"`` [D, V]; it doubles the table's memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import cpu_gemm
from specjax.models.params import ROW_WEIGHTS


def with_row_weights(params: dict) -> dict:
    """``params`` plus the one-row copies of its matrices (module docstring).

    The copies are materialised here, once, so that no decoding step pays for a transpose.
    """
    layers = tuple(dict(p, **{f"{k}_t": jnp.moveaxis(p[k], 0, -1) for k in ROW_WEIGHTS})
                   for p in params["layers"])
    out = dict(params, layers=layers)
    if "lm_head" in params:
        out["lm_head_t"] = jnp.moveaxis(params["lm_head"], 0, -1)
    return out


def with_drafter_row_weights(own: dict, dtype=None) -> dict:
    """A drafter's own weights plus their one-row copies (module docstring): each draft
    layer's matrices as :func:`with_row_weights` copies a target layer's (EAGLE's one
    ``"layer"``, DFlash's ``"layers"``), the feature projection ``fc`` [in, D] as ``fc_t``
    [D, in] and a head of its own (EAGLE-3's ``lm_head`` [D, Vd]) as ``lm_head_t`` [Vd, D].
    Drafting then multiplies by the copies as the target does. ``dtype``: the copies' (default
    the weights' own).
    """
    def copy(w):
        return jnp.moveaxis(w, 0, -1).astype(dtype or w.dtype)

    def layer(p):
        return dict(p, **{f"{k}_t": copy(p[k]) for k in ROW_WEIGHTS})

    out = dict(own, **{f"{k}_t": copy(own[k]) for k in ("fc", "lm_head") if k in own})
    if "layer" in own:
        out["layer"] = layer(own["layer"])
    if "layers" in own:
        out["layers"] = [layer(p) for p in own["layers"]]
    return out


def drafter_own(own: dict, target_params: dict, row_weights: bool | None = None) -> dict:
    """A drafter's own weights as its params carry them beside ``target_params``.

    ``row_weights`` adds the one-row copies (:func:`with_drafter_row_weights`); None adds them
    when ``target_params`` carry the target's (:func:`has_row_weights`: a float32 target loaded
    on the CPU does, a trainer's frozen target does not). Where the CPU matrix-product kernel
    runs and every copied weight is a bfloat16 value already (a bfloat16 checkpoint's, loaded
    in float32), the copies are bfloat16: the kernel widens them back exactly, so every product
    is the same and a draft call streams half the bytes.
    """
    if row_weights is None:
        row_weights = has_row_weights(target_params)
    if not row_weights:
        return own
    half = cpu_gemm.available() and all(_is_bfloat16(w) for w in _matrices(own))
    return with_drafter_row_weights(own, jnp.bfloat16 if half else None)


def _matrices(own: dict) -> list:
    """The weights :func:`with_drafter_row_weights` copies."""
    layers = [own["layer"]] if "layer" in own else list(own.get("layers", ()))
    return ([own[k] for k in ("fc", "lm_head") if k in own]
            + [p[k] for p in layers for k in ROW_WEIGHTS])


def _is_bfloat16(w) -> bool:
    """Whether ``w`` holds bfloat16 values only: a bfloat16 array, or a float32 one whose low
    16 bits are all zero (False for a traced array)."""
    if isinstance(w, jax.core.Tracer):
        return False
    if jnp.dtype(w.dtype) == jnp.bfloat16:
        return True
    w = np.asarray(w)
    return w.dtype == np.float32 and not np.any(w.view(np.uint32) & 0xFFFF)


def has_row_weights(params: dict) -> bool:
    """Whether target ``params`` carry the one-row copies (:func:`with_row_weights`)."""
    return bool(params.get("layers")) and all(f"{k}_t" in params["layers"][0]
                                              for k in ROW_WEIGHTS)


def with_tied_head(params: dict) -> dict:
    """Tied ``params`` plus the tied head's copy ``"tied_head"`` [D, V] (module docstring),
    materialised here, once."""
    if "lm_head" in params:
        raise ValueError("params with an untied lm_head have no tied head to copy")
    return dict(params, tied_head=jnp.asarray(params["embed"]).T.copy())


def without_row_weights(params: dict) -> dict:
    """``params`` without any layout copy: the one-row copies (the inverse of
    :func:`with_row_weights`) and the tied head's (of :func:`with_tied_head`)."""
    layers = tuple({k: v for k, v in p.items() if not k.endswith("_t")} for p in params["layers"])
    return ({k: v for k, v in params.items() if k not in ("lm_head_t", "tied_head")}
            | {"layers": layers})
