"""Evaluating a drafter during training by the real speculative loop.

Acceptance is what a drafter is for, so the evaluation runs :func:`specjax.api.generate_tokens`
with the drafter on held-aside dev prompts and reports τ, the mean tokens per verify cycle
(accepted drafts + the bonus token). Greedy decoding makes it cheap to also check that the
speculative output equals plain greedy decoding, a correctness canary for a drafter whose
proposals the loop mishandles.

Dev prompts (:func:`hold_out`) are the prompts of the first records of a distilled data
directory. Distillation shuffles its prompts once before cutting them into shards, so the
first records are a random sample of every input file; they live in shard 0, which is written
first and never changes while a directory grows, so the dev set stays the same across resumes.
The records left over are the training set: a dev prompt is never trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specjax import api
from specjax.config import ModelConfig


class RecordSubset:
    """Some records of a :class:`specjax.train.data.Records`, renumbered from 0 (what
    :func:`specjax.train.data.pack` reads: ``len`` and ``[r] -> (tokens, loss_mask)``)."""

    def __init__(self, records, indices: Sequence[int]):
        self.records, self.indices = records, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, r: int):
        return self.records[int(self.indices[r])]


def prompt_of(tokens: np.ndarray, loss_mask: np.ndarray) -> list[int]:
    """A record's prompt: its tokens before the first response (loss-mask) token."""
    first = int(np.argmax(loss_mask)) if loss_mask.any() else len(tokens)
    return [int(t) for t in tokens[:first]]


def hold_out(records, n: int) -> tuple[list[list[int]], RecordSubset]:
    """Splits records into ``n`` dev prompts and the training records (module docstring).

    Returns:
      ``(dev_prompts, train_records)``: the prompts of records ``0..n-1`` as token-id lists,
      and a view of records ``n..`` for packing.
    Raises:
      ValueError: fewer than ``n + 1`` records, or a dev record without a prompt.
    """
    if not 0 <= n < len(records):
        raise ValueError(f"cannot hold out {n} dev prompts from {len(records)} records and "
                         "still train on some")
    dev = [prompt_of(*records[r]) for r in range(n)]
    for r, p in enumerate(dev):
        if not p:
            raise ValueError(f"record {r} has no prompt tokens to evaluate on")
    return dev, RecordSubset(records, np.arange(n, len(records)))


def plain_greedy(cfg: ModelConfig, params: dict, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int, stop_tokens: Sequence[int] = ()) -> list[list[int]]:
    """Plain greedy continuations of ``prompts``: the reference :func:`tau_eval` compares to."""
    return api.generate_tokens(cfg, params, prompts, max_new_tokens=max_new_tokens,
                               temperature=0.0, stop_tokens=stop_tokens).tokens


def tau_eval(cfg: ModelConfig, params: dict, prompts: Sequence[Sequence[int]], *, drafter,
             drafter_params, max_new_tokens: int = 64, stop_tokens: Sequence[int] = (),
             plain: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Greedy speculative decoding of ``prompts`` (one batch) with ``drafter``.

    Args:
      cfg, params: the target.
      prompts: dev token-id prompts.
      drafter, drafter_params: the drafter under evaluation.
      max_new_tokens: new tokens per prompt at most.
      stop_tokens: ids that end a row.
      plain: :func:`plain_greedy` of the same prompts and settings, when already known
        (computed here otherwise).
    Returns:
      ``{"tau": mean tokens per verify cycle, "tokens_per_s": generated tokens per second of
      the generation call (compile excluded), "greedy_equal": whether every row equals plain
      greedy decoding}``.
    """
    result = api.generate_tokens(cfg, params, prompts, max_new_tokens=max_new_tokens,
                                 temperature=0.0, stop_tokens=stop_tokens, drafter=drafter,
                                 drafter_params=drafter_params)
    if plain is None:
        plain = plain_greedy(cfg, params, prompts, max_new_tokens=max_new_tokens,
                             stop_tokens=stop_tokens)
    return {"tau": result.tau, "tokens_per_s": result.n_tokens / result.run_s,
            "greedy_equal": [list(p) for p in plain] == result.tokens}


def tau_hook(cfg: ModelConfig, params: dict, prompts: Sequence[Sequence[int]], drafter,
             drafter_params_of: Callable[[Any], Any], *, max_new_tokens: int = 64,
             stop_tokens: Sequence[int] = ()) -> Callable[[Any, int], dict[str, Any]]:
    """An ``eval_fn(model, step)`` for :func:`specjax.train.loop.train` that runs
    :func:`tau_eval` with ``drafter_params_of(model)``, the drafter's params built from the
    module's current state. Plain greedy decoding of the prompts runs once, here: the target
    does not change during training."""
    plain = plain_greedy(cfg, params, prompts, max_new_tokens=max_new_tokens,
                         stop_tokens=stop_tokens)

    def hook(model, step: int) -> dict[str, Any]:
        return tau_eval(cfg, params, prompts, drafter=drafter,
                        drafter_params=drafter_params_of(model), max_new_tokens=max_new_tokens,
                        stop_tokens=stop_tokens, plain=plain)

    return hook
