"""The target protocol: what the speculative loop asks of the model whose output it preserves.

A target is a frozen, hashable object (a static argument of ``jax.jit``) with pure methods::

    prefill(params, prompt[B, P], prompt_len[B], capacity, taps)
        -> (last_logits[B, V], taps[B, P, n, E], cache)
    forward(params, tokens[B, T], positions[B, T], cache, mask[B, T, T], taps)
        -> (logits[B, T, V], taps[B, T, n, E], cache)
    commit(cache, path[B, D + 1], n_keep[B]) -> cache

``cache`` is any pytree. After ``prefill`` it holds each row's prompt; ``forward`` sees the
committed tokens plus, among its T new tokens, those that ``mask`` allows (ancestor-or-self), at
``positions`` (committed length + depth); ``commit`` keeps the first ``n_keep`` nodes of
``path`` (root first) as the next committed tokens, in path order, and forgets the rest.
:class:`DecoderTarget` implements it for specjax's own decoders; another JAX stack implements
these three functions for its model (a stateless model may ignore ``cache`` altogether).

Optional, for speed only: ``step_tokens`` (default 1), the fewest query tokens a pass should
carry, and the pair ``forward_fresh(...) -> (logits, taps, fresh)`` /
``write_fresh(cache, fresh) -> cache``, which split ``forward`` into a pass that only reads the
cache and the write of what it computed. With them the loop scores only the roots (a pass of
``step_tokens`` tokens) in a cycle where no row has a draft.
"""

from __future__ import annotations

import dataclasses

from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target


@dataclasses.dataclass(frozen=True)
class DecoderTarget:
    """A specjax decoder (:mod:`specjax.models.target`) as a speculative target."""

    cfg: ModelConfig

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def step_tokens(self) -> int:
        """The fewest query tokens a pass should carry (:func:`specjax.models.target.step_tokens`)."""
        return target.step_tokens(self.cfg)

    def prefill(self, params, prompt, prompt_len, capacity: int, taps: tuple[int, ...] = ()):
        return target.prefill(params, self.cfg, prompt, prompt_len, capacity, taps)

    def forward(self, params, tokens, positions, cache, mask, taps: tuple[int, ...] = ()):
        return target.forward(params, self.cfg, tokens, positions, cache, mask, taps)

    def forward_fresh(self, params, tokens, positions, cache, mask, taps: tuple[int, ...] = ()):
        return target.forward_fresh(params, self.cfg, tokens, positions, cache, mask, taps)

    def write_fresh(self, cache, fresh):
        return cache_lib.write(cache, fresh)

    def commit(self, cache, path, n_keep):
        return cache_lib.commit(cache, path, n_keep)
