"""Optional extra layouts of a target params pytree.

**One-row weights.** XLA:CPU's matrix-vector product streams a weight stored ``[out, in]``
faster than one stored ``[in, out]`` (the layout of specjax's params), while with two
or more rows ``[in, out]`` is the faster one. :func:`with_row_weights` therefore adds an
``[out, in]`` copy of every layer matrix, under the matrix's key plus ``"_t"`` (and of an
untied LM head, as ``"lm_head_t"``); the decoder multiplies a pass of exactly one query row by
the copies (:mod:`specjax.models.target`). The copies double the memory of those matrices.
"""

from __future__ import annotations

import jax.numpy as jnp

ROW_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # layer matrices that get a one-row copy


def with_row_weights(params: dict) -> dict:
    """``params`` plus the ``[out, in]`` one-row copies of its matrices (module docstring).

    The copies are materialised here, once, so that no decoding step pays for a transpose.
    """
    layers = tuple(dict(p, **{f"{k}_t": jnp.asarray(p[k].T) for k in ROW_WEIGHTS})
                   for p in params["layers"])
    out = dict(params, layers=layers)
    if "lm_head" in params:
        out["lm_head_t"] = jnp.asarray(params["lm_head"].T)
    return out


def without_row_weights(params: dict) -> dict:
    """``params`` without the one-row copies (the inverse of :func:`with_row_weights`)."""
    layers = tuple({k: v for k, v in p.items() if not k.endswith("_t")} for p in params["layers"])
    return {k: v for k, v in params.items() if k != "lm_head_t"} | {"layers": layers}
