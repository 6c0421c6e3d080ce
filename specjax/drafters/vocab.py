"""Reduced draft vocabularies: the most frequent target ids, ranked from token counts.

A drafter that scores only the Vd ids its target emits most often pays for a [D, Vd] head
instead of [D, V] at every drafted position, and stays lossless: verification accepts or
rejects whatever it drafts, and a sampled draft's q is its own distribution over those ids (0
elsewhere). EAGLE-3 trains its own head over such a vocabulary (``d2t``); DFlash and EAGLE-1
drafters restrict the target's head to the top of a ranking they carry (``token_order``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def frequency_order(counts: np.ndarray) -> np.ndarray:
    """[V] int32 target ids, the most frequent first: by count, descending, ties (unseen ids
    included) to the smaller id.

    Args:
      counts: [V] how often each target id occurs as a trained-on token.
    """
    counts = np.asarray(counts)
    return np.lexsort((np.arange(counts.shape[0]), -counts)).astype(np.int32)


def top_ids(order: np.ndarray, size: int) -> np.ndarray:
    """[size] int32: the ``size`` first ids of a ranking ``order`` [V], ascending."""
    order = np.asarray(order)
    if not 1 <= size <= order.shape[0]:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {order.shape[0]}]")
    return np.sort(order[:size]).astype(np.int32)


def check_size(size: int, vocab_size: int) -> None:
    """Raises ValueError unless a draft vocabulary of ``size`` ids fits a target vocabulary of
    ``vocab_size``."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {size} ids must be in [1, {vocab_size}]")


def check_order(order: np.ndarray, vocab_size: int) -> None:
    """Raises ValueError unless ``order`` ranks each of the ``vocab_size`` ids exactly once."""
    order = np.asarray(order)
    if order.shape != (vocab_size,):
        raise ValueError(f"token_order has shape {order.shape}; it must rank the target's "
                         f"{vocab_size} ids, shape ({vocab_size},)")
    if not np.array_equal(np.sort(order), np.arange(vocab_size)):
        raise ValueError(f"token_order does not rank each of the {vocab_size} ids exactly once "
                         "(an id repeats or lies outside the vocabulary)")


def gather_head(own: dict, target, target_params, size: int, family: str) -> dict:
    """``{"ids": [size] int32, "rows": [size, E]}``: the ``size`` first ids of a drafter's
    ranking ``own["token_order"]`` (ascending) and their rows of ``target``'s head (a
    :class:`~specjax.targets.DraftingTarget`), gathered once, outside the decoding loop.

    Raises:
      ValueError: no ``target``, or a drafter without a ``token_order``.
    """
    if target is None:
        raise ValueError("a draft vocabulary gathers rows of the target's head: pass target=")
    if "token_order" not in own:
        raise ValueError(f"this {family} drafter carries no token_order (a ranking of the "
                         "target's ids by frequency), so it has no draft vocabulary; give it "
                         "one with 'specjax data rank DATA --drafter DIR'")
    ids = jnp.asarray(top_ids(np.asarray(own["token_order"]), size))
    return {"ids": ids, "rows": target.head_rows(target_params, ids)}


def checked_head(params: dict, size: int | None, family: str) -> dict | None:
    """``params["head"]`` of a drafter that drafts from ``size`` ids (None: the whole head,
    no gathered rows).

    Raises:
      ValueError: params built without the rows of that many ids.
    """
    if size is None:
        return None
    head = params.get("head")
    if head is None or head["ids"].shape != (size,):
        raise ValueError(f"the drafter drafts from {size} ids: build its params with "
                         f"{family}.drafter_params(..., vocab={size})")
    return head
