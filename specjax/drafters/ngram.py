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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Context, Proposal
from specjax.tree import StaticTree


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

    def init(self, params, prefill):
        return ()

    def propose(self, params, dstate, ctx: Context, rng) -> tuple[Proposal, tuple]:
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
        return Proposal(tokens=tokens, parents=parents, node_valid=node_valid), dstate

    def commit(self, params, dstate, ctx, accepted):
        return dstate
