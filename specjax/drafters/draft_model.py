"""An independent small draft model (any target-format decoder) proposing a chain with real q.

The drafter keeps its own KV cache of the committed sequence. Each cycle it first feeds the
tokens the target committed since its last call (``pending``: the root, plus the last draft
when the whole chain was accepted, so 1 or 2 tokens), then extends the chain one token at a
time, sampling each draft from its processed distribution ``q`` (the row's own temperature,
top-k and top-p, as for the target; argmax for greedy rows). Verification uses the real ``q``
(``draft_logits``), so sampled rows get standard speculative sampling.

The keys/values the drafter computed for its own drafts are exactly those of the accepted
tokens, so ``commit`` keeps them by moving the cache length; nothing is recomputed.

For a target without a smaller sibling, :meth:`DraftModelDrafter.from_target_layers` makes a
self-speculative draft model: the target's first layers plus its final norm and head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.config import ModelConfig
from specjax.drafters.base import CATCH_UP, Context, Prefill, Proposal, chain_parents
from specjax.models import cache as cache_lib
from specjax.models import target
from specjax.tree import StaticTree

PENDING = 2  # the most tokens committed since the drafter's last call (see module docstring)


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """Chain drafting with a target-format draft model.

    Attributes:
      cfg: the draft model's config; its vocabulary must be the target's.
      draft_len: drafts per cycle (chain length, root excluded).
    """

    cfg: ModelConfig
    draft_len: int = 4

    def __post_init__(self):
        if self.draft_len < 1:
            raise ValueError(f"draft_len must be >= 1, got {self.draft_len}")

    @classmethod
    def from_target_layers(cls, cfg: ModelConfig, params: dict, n_layers: int,
                           draft_len: int = 4) -> tuple[DraftModelDrafter, dict]:
        """A self-speculative draft model: the target's first ``n_layers`` layers, its final
        norm and its head (arrays shared with the target, not copied)."""
        if not 1 <= n_layers < cfg.n_layers:
            raise ValueError(f"draft layers must be in [1, {cfg.n_layers}), got {n_layers}")
        draft_params = dict(params, layers=tuple(params["layers"][:n_layers]))
        return cls(cfg.replace(n_layers=n_layers), draft_len), draft_params

    def check_target(self, target) -> None:
        """Raises ValueError when this draft model cannot draft for ``target``
        (:mod:`specjax.targets`): the vocabularies must be the same."""
        if self.cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft model vocabulary ({self.cfg.vocab_size}) differs from the "
                             f"target's ({target.vocab_size}); drafter and target mismatch")

    @property
    def n_nodes(self) -> int:
        return self.draft_len + 1

    @property
    def max_depth(self) -> int:
        return self.draft_len

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    @property
    def static_tree(self) -> StaticTree:
        return StaticTree.chain(self.n_nodes)

    def init(self, params, prefill: Prefill) -> cache_lib.KVCache:
        """Prefills the draft model on the prompts; the state is its KV cache, whose
        ``lengths`` count the committed tokens it has seen."""
        b, p = prefill.prompt.shape
        # Pending tokens, the chain and a catch-up are written past the committed length:
        # leave room.
        cache = cache_lib.init_cache(self.cfg, b, prefill.capacity + PENDING + CATCH_UP)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, _, cache = target.forward_hidden(params, self.cfg, prefill.prompt, positions, cache)
        return cache_lib.advance(cache, prefill.prompt_len)

    def _feed_pending(self, params, cache: cache_lib.KVCache, ctx: Context):
        """Feeds the tokens committed since the last call; returns the logits [B, V] of the
        token after the root and the cache holding the committed sequence."""
        seen = cache.lengths  # [B]
        n_pending = ctx.seq_len - seen  # [B], 1 or 2
        idx = jnp.minimum(seen[:, None] + jnp.arange(PENDING)[None, :], ctx.seq.shape[1] - 1)
        block = jnp.take_along_axis(ctx.seq, idx, axis=1)  # [B, PENDING]
        logits, _, cache = target.forward(params, self.cfg, block,
                                          seen[:, None] + jnp.arange(PENDING), cache)
        last = jnp.take_along_axis(logits, (n_pending - 1)[:, None, None], axis=1)[:, 0]
        return last, cache_lib.advance(cache, n_pending)

    def skip(self, params, cache: cache_lib.KVCache, ctx: Context) -> cache_lib.KVCache:
        """Feeds the pending tokens without drafting (``commit`` then keeps nothing more)."""
        return self._feed_pending(params, cache, ctx)[1]

    def catch_up(self, params, cache: cache_lib.KVCache, ctx: Context, taps: jax.Array,
                 n_new: jax.Array) -> cache_lib.KVCache:
        """Feeds every pending token but the root in one pass without the head (up to
        ``PENDING - 1 + CATCH_UP`` of them: the cycle's plus the plain steps'); the next
        ``propose`` feeds the root. The target's ``taps`` and ``n_new`` are not needed: the
        tokens are in ``ctx``."""
        width = PENDING - 1 + CATCH_UP
        seen = cache.lengths  # [B]
        idx = jnp.minimum(seen[:, None] + jnp.arange(width)[None, :], ctx.seq.shape[1] - 1)
        block = jnp.take_along_axis(ctx.seq, idx, axis=1)  # [B, width]
        _, _, cache = target.forward_hidden(params, self.cfg, block,
                                            seen[:, None] + jnp.arange(width), cache)
        return cache_lib.advance(cache, jnp.maximum(ctx.seq_len - 1 - seen, 0))

    def propose(self, params, cache: cache_lib.KVCache, ctx: Context, rng):
        """Drafts a chain; each node's confidence is the product of the draft model's own
        (temperature-1) probabilities of the chain's tokens up to it."""
        sp = ctx.sp
        b = ctx.seq.shape[0]
        last, cache = self._feed_pending(params, cache, ctx)
        keys = jax.random.split(rng, self.draft_len)

        def step(carry, key):
            cache, lg, i = carry
            tok = sampling.sample_rows(jax.random.split(key, b), lg, sp)
            nxt, _, cache = target.forward(params, self.cfg, tok[:, None],
                                           (cache.lengths + i)[:, None], _at(cache, i))
            return (_at(cache, -i), nxt[:, 0], i + 1), (tok, lg)

        (cache, _, _), (drafts, q_logits) = jax.lax.scan(step, (cache, last, jnp.int32(0)), keys)
        # drafts: [K, B]; q_logits[i]: [B, V], the distribution draft i was drawn from.
        tokens = jnp.concatenate([ctx.root[:, None], drafts.T], axis=1)
        v = q_logits.shape[-1]
        draft_logits = jnp.concatenate(
            [q_logits.transpose(1, 0, 2), jnp.zeros((b, 1, v), q_logits.dtype)], axis=1)
        own = jnp.take_along_axis(jax.nn.log_softmax(q_logits, axis=-1), drafts[..., None],
                                  axis=-1)[..., 0]  # [K, B]
        confidence = jnp.exp(jnp.pad(jnp.cumsum(own.T, axis=1), ((0, 0), (1, 0))))
        proposal = Proposal(tokens=tokens, parents=chain_parents(b, self.n_nodes),
                            node_valid=jnp.ones((b, self.n_nodes), bool),
                            draft_logits=draft_logits, confidence=confidence)
        return proposal, cache

    def commit(self, params, cache: cache_lib.KVCache, ctx, accepted):
        # The cache holds the pending tokens (committed by propose) and drafts 1..K-1 after
        # them; keep the accepted ones. Draft K was never fed, so it stays pending.
        keep = jnp.minimum(accepted.n_accepted, self.draft_len - 1)
        return cache_lib.advance(cache, keep)


def _at(cache: cache_lib.KVCache, offset) -> cache_lib.KVCache:
    """The cache with ``lengths`` shifted by ``offset``: chain step i writes its token at
    ``committed + i`` while attending to everything before it, committed or drafted."""
    return dataclasses.replace(cache, lengths=cache.lengths + offset)
