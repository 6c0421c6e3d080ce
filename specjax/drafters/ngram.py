"""Prompt-lookup (n-gram) drafting over each row's own history, with static shapes.

The last ``g`` committed tokens of a row (its suffix, root included) are looked up in the
row's earlier history for ``g = max_ngram .. min_ngram``; the tokens that followed a match are
proposed as drafts. With ``branches > 1`` the best match positions (longest n-gram first, then
the most recent) each propose a chain, giving a tree of chains that share the root::

    branches = 2, draft_len = 3          parents = [-1, 0, 1, 2, 0, 4, 5]
           0
         /   \\
        1     4        branch 0: the best match's continuation
        |     |        branch 1: the next best
        2     5
        |     |
        3     6

The proposals are deterministic (no draft distribution), so sampled rows are verified with the
deterministic-proposal rule, which is lossless for them.

**Confidence.** Prompt lookup has no probabilities, so each row learns its own: for every match
length g it counts, over its recent verified cycles, how many drafts of the best branch were
tried and how many accepted (a draft is tried when all before it were accepted), decayed by
``DECAY`` per update. Their ratio, with one tried draft accepted g / (g + 1) times as prior
(a longer match is likelier to continue; the prior also makes a fresh row try its long
matches, so it learns), is the rate r_g at which a draft after a g-token match is accepted
given its parent was; node d of a branch with match length g then has confidence r_g^d, times
(1 - r) of every better branch's first draft for the other branches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Accepted, Context, Proposal
from specjax.tree import StaticTree

DECAY = 0.9  # weight of a row's older verified cycles in its acceptance counts, per update


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramState:
    """Each row's acceptance counts by match length (module docstring).

    Attributes:
      tried: [B, G + 1] float32 decayed counts of verified drafts of the best branch, by its
        match length g (index 0 unused).
      accepted: [B, G + 1] float32 decayed counts of those accepted.
      match: [B, R] int32 match length of each branch of the last proposal (0: none).
    """

    tried: jax.Array
    accepted: jax.Array
    match: jax.Array


def chains_tree(branches: int, draft_len: int) -> StaticTree:
    """A root with ``branches`` chains of ``draft_len`` nodes each, branch by branch."""
    parents = [-1]
    for r in range(branches if draft_len else 0):
        start = 1 + r * draft_len
        parents += [0] + list(range(start, start + draft_len - 1))
    return StaticTree(tuple(parents))


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Drafts continuations of earlier occurrences of the row's suffix.

    Attributes:
      draft_len: drafts per branch (the deepest acceptable run); 0 drafts nothing.
      branches: how many match positions propose a chain each.
      max_ngram: the longest suffix looked up.
      min_ngram: the shortest suffix looked up.
    """

    draft_len: int = 4
    branches: int = 1
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if self.draft_len < 0 or self.branches < 1:
            raise ValueError(f"need draft_len >= 0 and branches >= 1, got {self.draft_len}, "
                             f"{self.branches}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    @classmethod
    def for_budget(cls, n_nodes: int, branches: int = 1, **kw) -> NgramDrafter:
        """The drafter whose proposal has at most ``n_nodes`` nodes (root included); a budget
        of 1 drafts nothing (each cycle is one plain decoding step)."""
        if n_nodes < 1:
            raise ValueError(f"a verify budget needs at least the root, got {n_nodes} nodes")
        if n_nodes > 1 and n_nodes < 1 + branches:
            raise ValueError(f"a budget of {n_nodes} nodes cannot hold {branches} branches")
        return cls(draft_len=(n_nodes - 1) // branches, branches=branches, **kw)

    @property
    def static_tree(self) -> StaticTree:
        return chains_tree(self.branches, self.draft_len)

    @property
    def n_nodes(self) -> int:
        return self.static_tree.n_nodes

    @property
    def max_depth(self) -> int:
        return self.draft_len

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    def check_target(self, target) -> None:
        """Any target works: the drafts come from the row's own tokens."""

    def init(self, params, prefill) -> NgramState:
        b = prefill.prompt.shape[0]
        counts = jnp.zeros((b, self.max_ngram + 1), jnp.float32)
        return NgramState(counts, counts, jnp.zeros((b, self.branches), jnp.int32))

    def rates(self, state: NgramState) -> jax.Array:
        """[B, G + 1] each row's estimated acceptance rate of a draft after a g-token match,
        given its parent was accepted."""
        g = jnp.arange(self.max_ngram + 1, dtype=jnp.float32)
        return (state.accepted + g / (g + 1)) / (state.tried + 1.0)

    def propose(self, params, state: NgramState, ctx: Context, rng):
        """Looks up each row's suffix; rows without a match propose only the root."""
        seq, seq_len = ctx.seq, ctx.seq_len
        b, w = seq.shape
        pos = jnp.arange(w)[None, :]  # [1, W]
        best = jnp.zeros((b, w), jnp.int32)  # longest n-gram matching at start j (0 = none)
        # shifted[i][:, j] = seq[:, j + i]: one static shift per offset, shared by every g.
        shifted = [jnp.pad(seq[:, i:], ((0, 0), (0, i))) for i in range(self.max_ngram)]
        for g in range(self.min_ngram, self.max_ngram + 1):
            suffix_start = seq_len - g  # [B]
            match = (pos + g < seq_len[:, None]) & (suffix_start[:, None] >= 0)
            for i in range(g):
                want = jnp.take_along_axis(seq, jnp.maximum(suffix_start + i, 0)[:, None], axis=1)
                match &= shifted[i] == want
            best = jnp.where(match, g, best)
        # Longest n-gram first, then the most recent occurrence.
        score = jnp.where(best > 0, best * w + pos, -1)  # [B, W]
        top_score, top_j = jax.lax.top_k(score, self.branches)  # [B, R]
        found = top_score >= 0
        cont = top_j + jnp.take_along_axis(best, top_j, axis=1)  # [B, R] continuation start
        offs = jnp.arange(self.draft_len)[None, None, :]
        idx = cont[..., None] + offs  # [B, R, K]
        valid = found[..., None] & (idx < seq_len[:, None, None])
        drafts = jnp.take_along_axis(seq, jnp.minimum(idx, w - 1).reshape(b, -1), axis=1)
        tokens = jnp.concatenate([ctx.root[:, None], drafts], axis=1)
        node_valid = jnp.concatenate([jnp.ones((b, 1), bool), valid.reshape(b, -1)], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.static_tree.parents, jnp.int32),
                                   (b, self.n_nodes))
        match = jnp.where(found, top_score // w, 0).astype(jnp.int32)  # [B, R]
        r = jnp.take_along_axis(self.rates(state), match, axis=1)  # [B, R]
        # A later branch is reached only when every better branch's first draft fails.
        reach = jnp.cumprod(jnp.pad(1 - r, ((0, 0), (1, 0)), constant_values=1.0), axis=1)
        conf = reach[:, :-1, None] * r[..., None] ** (offs + 1)  # [B, R, K]
        confidence = jnp.concatenate([jnp.ones((b, 1)), conf.reshape(b, -1)], axis=1)
        return (Proposal(tokens=tokens, parents=parents, node_valid=node_valid,
                         confidence=jnp.where(node_valid, confidence, 0.0)),
                dataclasses.replace(state, match=match))

    def skip(self, params, state, ctx):
        """Nothing to catch up: the drafts come from the committed sequence itself."""
        return state

    def commit(self, params, state: NgramState, ctx, accepted: Accepted) -> NgramState:
        """Counts the best branch's verified drafts: those tried (up to and including the
        first rejected one) and those accepted."""
        k = self.draft_len
        if k == 0 or accepted.path.shape[1] == 1:  # no drafts, or a plain step: nothing tried
            return state
        verified = jnp.sum(accepted.proposal.node_valid[:, 1:1 + k], axis=1)  # [B]
        on_best = accepted.path[:, 1] == 1  # the accepted path runs through branch 0
        acc = jnp.where(on_best, accepted.n_accepted, 0).astype(jnp.float32)
        tried = jnp.minimum(acc + 1, verified)
        update = (verified > 0) & (accepted.n_committed > 0)
        g = state.match[:, 0]
        hot = (jnp.arange(self.max_ngram + 1)[None, :] == g[:, None]) & update[:, None]
        decay = jnp.where(update[:, None], DECAY, 1.0)
        return dataclasses.replace(
            state, tried=decay * state.tried + jnp.where(hot, tried[:, None], 0.0),
            accepted=decay * state.accepted + jnp.where(hot, acc[:, None], 0.0))
