"""Target taps for drafter training: recomputed per batch, and what storing them would cost.

Distilled records (:mod:`specjax.train.data`) hold token ids only. A drafter's training step
gets the target's hidden states (its *taps*) from one teacher-forced pass over the packed batch
(:func:`specjax.models.target.encode`); :func:`measure` times that pass on real batches and
sets it against the disk a stored copy of the same taps would take, which is the trade-off
behind that choice (``specjax data stats DIR --measure-taps`` prints it).

Named tap sets (``TAP_SETS``) for a target of L layers, in tap ids (tap i = the residual stream
after i layers, :mod:`specjax.models.target`):

* ``eagle3``: the inputs of layers 2, L // 2 and L - 3;
* ``eagle1``: the final normed state;
* ``dflash``: the outputs of the five layers DFlash's default rule picks (round half to even,
  as Python's ``round``), i.e. tap ids one above those layer ids.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters import eagle
from specjax.models import target
from specjax.train import data


def dflash_layer_ids(n_layers: int, n_draft: int) -> list[int]:
    """DFlash's default target layers: ``[L // 2]`` for one, else evenly spaced from 1 to
    L - 3 with Python's round-half-to-even (for L = 30, n = 5: [1, 8, 14, 20, 27])."""
    if n_draft == 1:
        return [n_layers // 2]
    return [round(1 + i * (n_layers - 4) / (n_draft - 1)) for i in range(n_draft)]


def tap_set(name: str, n_layers: int) -> tuple[int, ...]:
    """The tap ids of a named set (module docstring) for a target of ``n_layers`` layers."""
    if name in ("eagle3", "dflash") and n_layers < 4:
        raise ValueError(f"tap set {name!r} needs a target of at least 4 layers (its highest "
                         f"tap is layer L - 3), got {n_layers}")
    if name == "eagle3":
        return eagle.eagle3_taps(n_layers)
    if name == "eagle1":
        return (target.FINAL_NORMED,)
    if name == "dflash":
        return tuple(i + 1 for i in dflash_layer_ids(n_layers, 5))
    raise ValueError(f"unknown tap set {name!r}; known: {list(TAP_SETS)}")


TAP_SETS = ("eagle3", "eagle1", "dflash")


def measure(cfg: ModelConfig, params: dict, records, *, taps: tuple[int, ...], seq_len: int,
            batch_size: int, batches: int = 3, store_bytes: int = 2) -> dict:
    """Times tap extraction on packed batches of ``records`` and sizes the stored alternative.

    Args:
      cfg, params: the target.
      records: a :class:`specjax.train.data.Records` (or anything :func:`data.pack` takes).
      taps: tap ids to extract.
      seq_len, batch_size: the packed batch shape.
      batches: timed batches (after one untimed batch that compiles).
      store_bytes: bytes per stored tap element (2 for bfloat16).
    Returns:
      ``{"tokens_per_s": extraction throughput over the batches' real (non-padding) tokens,
      "tap_bytes_per_token": disk per token that storing these taps would take}``.
    """
    fn = jax.jit(lambda p, b: target.encode(p, cfg, b["tokens"], b["positions"],
                                            b["segment_ids"], taps)[1])
    it = data.pack(records, seq_len=seq_len, batch_size=batch_size)
    first, _ = next(it)
    jax.block_until_ready(fn(params, {k: jnp.asarray(v) for k, v in first.items()}))
    n_tokens, seconds = 0, 0.0
    for _ in range(batches):
        batch, _ = next(it)
        arrays = {k: jnp.asarray(v) for k, v in batch.items()}
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, arrays))
        seconds += time.perf_counter() - t0
        n_tokens += int(np.sum(batch["segment_ids"] > 0))
    return {"tokens_per_s": n_tokens / seconds,
            "tap_bytes_per_token": len(taps) * cfg.d_model * store_bytes}
