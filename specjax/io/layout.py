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

**The tied head's copy.** A tied head multiplies by the embedding table ``embed`` [V, D]: the
one-row layout. For bfloat16 passes of several rows (a verify pass, a drafted block, and a
one-row pass, which runs as two) XLA:CPU's matrix product wants ``[D, V]``, and transposes the
whole table to get it; inside a speculative cycle that transpose is not hoisted out of the
loop, so every cycle paid it (17 ms of an 89 ms EAGLE-3 cycle for SmolLM2-135M in bfloat16,
one profiled run). :func:`with_tied_head` stores the transpose once, as
``"tied_head"`` [D, V]; it doubles the table's memory.
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
