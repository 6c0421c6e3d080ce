"""The target protocol: what the generation loops ask of the model whose output they preserve.

A target is a frozen, hashable object (a static argument of ``jax.jit``) with pure methods.
:class:`Target` names what every target must have; both plain and speculative generation
(:mod:`specjax.decode`) drive a target through it alone, so a foreign JAX stack that implements
these three functions gets the plain baseline and every training-free drafter::

    prefill(params, prompt[B, P], prompt_len[B], capacity, taps)
        -> (last_logits[B, V], taps[B, P, n, E], cache)
    forward(params, tokens[B, T], positions[B, T], cache, mask[B, T, T] | None, taps)
        -> (logits[B, T, V], taps[B, T, n, E], cache)
    commit(cache, path[B, D + 1], n_keep[B]) -> cache

``cache`` is any pytree. After ``prefill`` it holds each row's prompt; ``forward`` sees the
committed tokens plus, among its T new tokens, those that ``mask`` allows (ancestor-or-self;
None = causal), at ``positions`` (committed length + depth); ``commit`` keeps the first
``n_keep`` nodes of ``path`` as the next committed tokens, in path order, and forgets the rest.
``path[:, 0]`` is always node 0 (the root); plain decoding commits ``path = [[0]]``.

Optional, declared by :class:`FreshPassTarget`, for speed only: ``forward_fresh(...) ->
(logits, taps, fresh)``,
``take_fresh(fresh, path[B, P]) -> fresh`` and ``commit_fresh(cache, fresh, n_keep[B]) ->
cache``, which split ``forward`` then ``commit`` into a pass that only reads the cache, the
accepted path's share of what it computed (in path order), and one write of that share as the
next committed tokens (the first ``n_keep``; the rest is scratch past them). With them the
speculative loop scores only the roots (a one-token pass) in a cycle where no row has a
draft, and writes each cycle's keys and values once.

Drafters that read the target's own weights (EAGLE, DFlash) need :class:`DraftingTarget`:
``embed``, ``lm_head``, ``head_rows`` (to gather it over a reduced vocabulary), ``final_norm``,
the sizes, and the tap id of the final normed state; ``check_drafter`` raises a clear error
when a drafter cannot draft for the target. :class:`DecoderTarget` implements all three
protocols for specjax's own decoders.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target


@runtime_checkable
class Target(Protocol):
    """What every target must provide (module docstring)."""

    vocab_size: int

    def prefill(self, params: Any, prompt: jax.Array, prompt_len: jax.Array, capacity: int,
                taps: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, Any]: ...

    def forward(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Any,
                mask: jax.Array | None, taps: tuple[int, ...] = ()
                ) -> tuple[jax.Array, jax.Array, Any]: ...

    def commit(self, cache: Any, path: jax.Array, n_keep: jax.Array) -> Any: ...


@runtime_checkable
class FreshPassTarget(Target, Protocol):
    """A target with the optional fast paths (module docstring)."""

    def forward_fresh(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Any,
                      mask: jax.Array | None, taps: tuple[int, ...] = ()
                      ) -> tuple[jax.Array, jax.Array, Any]: ...

    def take_fresh(self, fresh: Any, path: jax.Array) -> Any: ...

    def commit_fresh(self, cache: Any, fresh: Any, n_keep: jax.Array) -> Any: ...


@runtime_checkable
class DraftingTarget(Target, Protocol):
    """What drafters that reuse the target's weights and states read from it.

    Attributes:
      n_layers: L, so a drafter can pick its tap layers (EAGLE-3: inputs of 2, L // 2, L - 3).
      d_model: E, the width of the residual stream and of every tap.
      final_normed_tap: the tap id of the final normed state (the LM head's input, EAGLE-1's
        feature); tap ``i`` in ``[0, L]`` is the residual stream after ``i`` layers.
    """

    n_layers: int
    d_model: int
    final_normed_tap: int

    def embed(self, params: Any, tokens: jax.Array) -> jax.Array:
        """Token embeddings [..., E] of ``tokens`` [...]."""
        ...

    def lm_head(self, params: Any, hidden: jax.Array) -> jax.Array:
        """Float32 logits [..., V] of final normed states [..., E]."""
        ...

    def head_rows(self, params: Any, vocab_ids: jax.Array) -> jax.Array:
        """The head's rows [V', E] of the ids ``vocab_ids`` [V'] (``hidden @ rows.T`` are those
        ids' logits)."""
        ...

    def final_norm(self, params: Any, x: jax.Array) -> jax.Array:
        """The final norm of residual states [..., E]."""
        ...

    def check_drafter(self, drafter: Any) -> None:
        """Raises ValueError naming the mismatch when ``drafter`` cannot draft for this target."""
        ...


def fresh_pass(tgt: Target) -> FreshPassTarget | None:
    """``tgt`` when it offers the optional fast paths (:class:`FreshPassTarget`), else None."""
    return tgt if isinstance(tgt, FreshPassTarget) else None


def require_drafting_target(family: str, tgt: Any, vocab_size: int) -> None:
    """Raises ValueError unless ``tgt`` is a :class:`DraftingTarget` with ``vocab_size`` ids:
    the first checks of every drafter that reads its target's weights (``family`` names it in
    the message)."""
    if not isinstance(tgt, DraftingTarget):
        raise ValueError(f"{family} needs a DraftingTarget (embed, lm_head, final_norm, widths; "
                         f"specjax.targets), got {type(tgt).__name__}")
    if vocab_size != tgt.vocab_size:
        raise ValueError(f"the drafter was built for a vocabulary of {vocab_size} ids, the "
                         f"target has {tgt.vocab_size}; drafter and target mismatch")


def check_drafter(tgt: Target, drafter: Any) -> None:
    """Raises ValueError when ``drafter`` cannot draft for ``tgt``.

    Every drafter's own ``check_target(tgt)`` runs; a :class:`DraftingTarget` also checks the
    drafter's tap ids against its layers.
    """
    if isinstance(tgt, DraftingTarget):
        tgt.check_drafter(drafter)
    drafter.check_target(tgt)


@dataclasses.dataclass(frozen=True)
class DecoderTarget:
    """A specjax decoder (:mod:`specjax.models.target`) as a target of every protocol above."""

    cfg: ModelConfig

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def d_model(self) -> int:
        return self.cfg.d_model

    @property
    def final_normed_tap(self) -> int:
        return target.FINAL_NORMED

    def prefill(self, params, prompt, prompt_len, capacity: int, taps: tuple[int, ...] = ()):
        return target.prefill(params, self.cfg, prompt, prompt_len, capacity, taps)

    def forward(self, params, tokens, positions, cache, mask, taps: tuple[int, ...] = ()):
        return target.forward(params, self.cfg, tokens, positions, cache, mask, taps)

    def forward_fresh(self, params, tokens, positions, cache, mask, taps: tuple[int, ...] = ()):
        return target.forward_fresh(params, self.cfg, tokens, positions, cache, mask, taps)

    def take_fresh(self, fresh, path):
        return cache_lib.take(fresh, path)

    def commit_fresh(self, cache, fresh, n_keep):
        return cache_lib.advance(cache_lib.write(cache, fresh), n_keep)

    def commit(self, cache, path, n_keep):
        return cache_lib.commit(cache, path, n_keep)

    def embed(self, params, tokens):
        return target.embed(params, tokens)

    def lm_head(self, params, hidden):
        return target.lm_head(params, self.cfg, hidden)

    def head_rows(self, params, vocab_ids):
        return target.head_rows(params, self.cfg, vocab_ids)

    def final_norm(self, params, x):
        return target.final_norm(params, self.cfg, x)

    def check_drafter(self, drafter) -> None:
        for i in drafter.taps:
            if not (0 <= i <= self.cfg.n_layers or i == target.FINAL_NORMED):
                raise ValueError(
                    f"the drafter taps layer {i}, but the target has layers 0..{self.cfg.n_layers}"
                    f" (and {target.FINAL_NORMED} for the final normed state); drafter and "
                    "target mismatch")
