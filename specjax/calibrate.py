"""Measured verify costs: how long one target pass over N tree nodes takes on this machine.

``T_verify(N)`` is the ceiling every drafter lives under: a cycle that emits τ tokens pays one
verify pass of N nodes plus the drafting, against τ plain steps. The curve depends on the
hardware, the dtype and XLA's kernels (on XLA:CPU a one-row bfloat16 pass is pathological), so
it is measured, never assumed.

Each point is measured inside one jitted ``fori_loop`` of ``reps`` passes over a cache already
holding ``context`` tokens, each pass fed the previous pass's argmax (so no pass can be hoisted
or skipped), and reported as the median over ``trials`` calls divided by ``reps``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target
from specjax.tree import StaticTree


@dataclasses.dataclass(frozen=True)
class VerifyCosts:
    """Seconds per target pass, by node count.

    Attributes:
      nodes: the node counts N measured, ascending.
      seconds: seconds per pass for each N.
      dtype: the model dtype measured.
      context: committed tokens in the cache during the passes.
    """

    nodes: tuple[int, ...]
    seconds: tuple[float, ...]
    dtype: str
    context: int

    def at(self, n: int) -> float:
        """Seconds for an N-node pass (linear interpolation between measured points)."""
        return float(np.interp(n, self.nodes, self.seconds))

    @property
    def fastest_plain_step(self) -> float:
        """The cheapest way to decode one token: min over passes of 1 or 2 rows (a bf16 plain
        step runs two rows, ``models.target.step_tokens``)."""
        return min(self.at(1), self.at(2)) if 2 in self.nodes else self.at(1)


@functools.partial(jax.jit, static_argnames=("cfg", "tree", "reps"))
def _passes(params, cache, tokens, *, cfg: ModelConfig, tree: StaticTree, reps: int):
    """``reps`` verify passes of ``tree`` over ``cache``; returns the last tokens [B, N]."""
    b, n = tokens.shape
    mask = jnp.broadcast_to(np.asarray(tree.ancestor, bool), (b, n, n))
    positions = cache.lengths[:, None] + np.asarray(tree.depth, np.int32)[None, :]

    def body(_, toks):
        logits, _, _ = target.forward(params, cfg, toks, positions, cache, mask)
        return sampling.argmax(logits)

    return jax.lax.fori_loop(0, reps, body, tokens)


def measure_verify_costs(
    cfg: ModelConfig,
    params: dict,
    nodes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    context: int = 256,
    batch: int = 1,
    reps: int = 8,
    trials: int = 5,
    progress=None,
) -> VerifyCosts:
    """Measures ``T_verify(N)`` for chains of N nodes (the cost depends on N, not the shape).

    Args:
      cfg, params: the target.
      nodes: node counts to measure.
      context: committed tokens already in the cache.
      batch: rows per pass.
      reps: passes per timed call.
      trials: timed calls per point; the median is kept.
      progress: optional callable ``(n, seconds)`` called after each point.
    """
    nodes = tuple(sorted(set(int(n) for n in nodes)))
    capacity = context + max(nodes)
    cache = cache_lib.init_cache(cfg, batch, capacity)
    prompt = jax.random.randint(jax.random.key(0), (batch, context), 0, cfg.vocab_size)
    _, _, cache = target.forward(params, cfg, prompt, jnp.broadcast_to(jnp.arange(context),
                                                                      (batch, context)), cache)
    cache = cache_lib.advance(cache, jnp.full((batch,), context, jnp.int32))
    seconds = []
    for n in nodes:
        tree = StaticTree.chain(n)
        tokens = jnp.zeros((batch, n), jnp.int32)
        exe = _passes.lower(params, cache, tokens, cfg=cfg, tree=tree, reps=reps).compile()
        jax.block_until_ready(exe(params, cache, tokens))
        times = []
        for _ in range(trials):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(params, cache, tokens))
            times.append((time.perf_counter() - t0) / reps)
        seconds.append(float(np.median(times)))
        if progress is not None:
            progress(n, seconds[-1])
    return VerifyCosts(nodes, tuple(seconds), cfg.dtype, context)
