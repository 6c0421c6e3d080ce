"""Optional extra layouts of a target params pytree.

**One-row weights.** XLA:CPU's matrix-vector product streams a weight stored ``[out, in]``
faster than one stored ``[in, out]`` (specjax's params have the input axis first), while with
two or more rows ``[in, out]`` is the faster one. :func:`with_row_weights` therefore adds a
copy of every layer matrix with its input axis moved last, under the matrix's key plus ``"_t"``
(and of an untied LM head, as ``"lm_head_t"``): ``wqkv_t`` [K, G + 2, H, D], ``w_gate_up_t``
[2, F, D], ``wo_t`` [D, N * H], ``w_down_t`` [D, F], ``lm_head_t`` [V, D]
(:func:`specjax.models.params.abstract` with ``row_weights=True``). The decoder multiplies a
pass of exactly one query row by the copies (:mod:`specjax.models.target`). The copies double
the memory of those matrices.
"""

from __future__ import annotations

import jax.numpy as jnp

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


def without_row_weights(params: dict) -> dict:
    """``params`` without the one-row copies (the inverse of :func:`with_row_weights`)."""
    layers = tuple({k: v for k, v in p.items() if not k.endswith("_t")} for p in params["layers"])
    return {k: v for k, v in params.items() if k != "lm_head_t"} | {"layers": layers}
