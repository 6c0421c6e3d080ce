"""The decode roofline: a decode step must stream every weight once, so tokens/s is at most
the measured memory bandwidth over the weight bytes a step reads."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.io.layout import without_row_weights



def bandwidth_probe(gib: float = 1.0, repeats: int = 5) -> Callable[[], float]:
    """A function measuring memory read bandwidth in bytes/s each time it is called.

    Each call times a jitted ``jnp.sum`` over ``gib`` GiB of float32 (far larger than any cache,
    so every byte comes from DRAM) ``repeats`` times and keeps the fastest. The array is
    allocated once and lives as long as the probe, so the benchmark can sample bandwidth
    between its rounds at the price of ``repeats`` sums (~50 ms each at 20 GB/s).
    """
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()  # compile, and fault in every page once

    def measure() -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            total(x).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        return x.nbytes / best

    return measure


def decode_weight_bytes(cfg: ModelConfig, params: dict) -> int:
    """Bytes one decode step must read: every layer tensor, the final norm and the LM head.

    A tied head is the embedding table, counted once; an untied model adds its head and the one
    embedding row the step looks up. A matrix with a one-row copy (``specjax.io.layout``) counts
    once: a step reads one of the two.
    """
    params = without_row_weights(params)
    n = sum(x.nbytes for x in jax.tree.leaves(params["layers"])) + params["final_norm"].nbytes
    if cfg.tie_embeddings:
        return n + params["embed"].nbytes
    return n + params["lm_head"].nbytes + params["embed"][0].nbytes
