"""The drafter protocol: what the speculative loop asks of a drafter, and what it hands over.

A drafter is a frozen, hashable object holding only static configuration (it is a static
argument of ``jax.jit``) whose three methods are pure functions of arrays::

    init(params, prefill: Prefill) -> dstate
    propose(params, dstate, ctx: Context, rng) -> (Proposal, dstate)
    commit(params, dstate, ctx: Context, accepted: Accepted) -> dstate

and optionally ``skip(params, dstate, ctx: Context) -> dstate``, which brings the state up to
the committed sequence without drafting (the cycle is then a plain step, and ``commit`` follows
with nothing accepted): a cost-aware budget's gate uses it to stop drafting while drafting does
not pay (:mod:`specjax.harness`); a drafter without it always drafts. A drafter may also
offer ``catch_up(params, dstate, ctx: Context, taps[B, M, n, E], n_new[B]) -> dstate``
(M = :data:`CATCH_UP`): the gate's plain steps then keep the target's taps of each step's
root and hand up to M of them over at once, instead of calling ``skip`` and ``commit`` after
every step. Row b decoded ``n_new[b]`` roots (the tokens after them are in ``ctx``), and
``catch_up`` must leave the state where ``skip`` and ``commit`` after each of those steps
would have, at the cost of one M-wide pass instead of ``n_new[b]`` one-position passes. Plus
a host-side ``check_target(target)`` that raises ValueError when it cannot draft for a
target (:mod:`specjax.targets`; a drafter that reads the target's weights checks widths and
vocabularies there).

``propose`` returns a state too: a drafter that runs a model keeps the keys/values it computed
while drafting (those of the drafts the target accepts are reused next cycle), and ``commit``
then decides how much of that to keep.

``params`` is the drafter's own pytree (``None`` for training-free drafters); ``dstate`` is any
pytree with static shapes that the loop carries between cycles. Nothing in here depends on
specjax's model code (only on ``SamplingParams``, a pytree of three arrays): any JAX stack can implement the protocol, most simply through
:class:`FunctionDrafter`, which wraps three plain functions.

Axis legend: B batch, N proposal nodes (root included), V vocab, W sequence buffer width,
D max accepted depth, P prompt width, n taps, E model width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from specjax.sampling import SamplingParams

CATCH_UP = 16  # M: plain steps whose taps a drafter's ``catch_up`` takes at once


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """A draft tree per row.

    Attributes:
      tokens: [B, N] int32; ``tokens[:, 0]`` must be the root (``Context.root``).
      parents: [B, N] int32; ``parents[:, 0] = -1`` and ``0 <= parents[:, i] < i``. A chain (or
        a block) has ``parents[i] = i - 1``.
      node_valid: [B, N] bool; padding nodes are False and are never accepted.
      draft_logits: [B, N, V] float32 or None. When given, node ``i``'s children were drawn
        i.i.d. from ``sampling.log_probs(draft_logits[:, i])`` (the real ``q`` of stochastic
        verification); None marks the proposals deterministic (no ``q`` needed).
      confidence: [B, N] float32 or None: the drafter's estimate that node i and all its
        ancestors are accepted (the root's is 1), what a cost-aware budget reads
        (:mod:`specjax.harness`): it keeps the first n nodes, so a drafter that orders its nodes
        best-first gets the best n-node subtree. None: the drafter gives no estimate.
    """

    tokens: jax.Array
    parents: jax.Array
    node_valid: jax.Array
    draft_logits: jax.Array | None = None
    confidence: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefill:
    """What the target's prefill hands to ``init``.

    Attributes:
      prompt: [B, P] int32 right-padded prompts.
      prompt_len: [B] int32.
      taps: [B, P, n, E] target residual states at the drafter's ``taps`` for every prompt
        position (n = 0 when the drafter asked for none).
      first: [B] int32 the first generated token of each row, sampled from the prefill's last
        logits: the root of the first cycle, which the target has not seen yet.
      capacity: static cache capacity the target uses (drafters size their caches from it).
    """

    prompt: jax.Array
    prompt_len: jax.Array
    taps: jax.Array
    first: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """A read-only view of the committed sequence of every row.

    Attributes:
      seq: [B, W] int32, prompt then generated tokens; entries at or past ``seq_len`` are
        stale.
      seq_len: [B] int32; ``seq[b, seq_len[b] - 1]`` is the root (committed, but not yet seen
        by the target).
      sp: the rows' sampling parameters; a drafter with real ``q`` processes its logits with
        them (``sampling.log_probs``), exactly as verification processes the target's.
    """

    seq: jax.Array
    seq_len: jax.Array
    sp: SamplingParams

    @property
    def root(self) -> jax.Array:
        """[B] int32, the last committed token of each row."""
        return jnp.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Accepted:
    """The outcome of a cycle, for ``commit``.

    Attributes:
      proposal: the proposal that was verified.
      path: [B, P] int32 node indices root first, padded with 0: P = D + 1 after a drafted
        cycle, 1 after a plain step of a cost-aware gate's run (:class:`specjax.harness.Gate`),
        so ``commit`` must take any P >= 1.
      n_accepted: [B] int32 accepted drafts (root excluded); rows that did not run this cycle
        (finished, or fallen back to plain decoding) report 0.
      n_committed: [B] int32 tokens appended to the row's sequence this cycle: the accepted
        drafts plus the bonus token, cut at a stop token or ``max_new_tokens``; 0 exactly for
        rows that did not run, so a running row that accepted nothing reports 1. The target
        cache keeps the root and the accepted drafts (``n_accepted + 1`` path nodes) of every
        running row.
      taps: [B, P, n, E] target residual states of the path's nodes (root first).
    """

    proposal: Proposal
    path: jax.Array
    n_accepted: jax.Array
    n_committed: jax.Array
    taps: jax.Array


class Drafter(Protocol):
    """The static half of a drafter; see the module docstring."""

    n_nodes: int  # N, proposal size including the root
    max_depth: int  # D, the deepest node of any proposal
    taps: tuple[int, ...]  # target residual layers ``commit`` and ``init`` need
    static_tree: Any  # a specjax.tree.StaticTree when every proposal has that topology, or None

    def init(self, params: Any, prefill: Prefill) -> Any: ...

    def propose(self, params: Any, dstate: Any, ctx: Context,
                rng: jax.Array) -> tuple[Proposal, Any]: ...

    def commit(self, params: Any, dstate: Any, ctx: Context, accepted: Accepted) -> Any: ...

    def check_target(self, target: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class FunctionDrafter:
    """A drafter made of three plain functions, for stacks that bring their own.

    The functions must be hashable (module-level functions are) because the drafter is a
    static argument of ``jax.jit``; ``init`` and ``commit`` default to a stateless drafter,
    ``check_target`` to accepting any target.
    """

    propose_fn: Callable[[Any, Any, Context, jax.Array], tuple[Proposal, Any]]
    n_nodes: int
    max_depth: int
    init_fn: Callable[[Any, Prefill], Any] | None = None
    commit_fn: Callable[[Any, Any, Context, Accepted], Any] | None = None
    check_fn: Callable[[Any], None] | None = None
    taps: tuple[int, ...] = ()
    static_tree: Any = None

    def check_target(self, target):
        if self.check_fn is not None:
            self.check_fn(target)

    def init(self, params, prefill):
        return () if self.init_fn is None else self.init_fn(params, prefill)

    def propose(self, params, dstate, ctx, rng):
        return self.propose_fn(params, dstate, ctx, rng)

    def commit(self, params, dstate, ctx, accepted):
        return dstate if self.commit_fn is None else self.commit_fn(params, dstate, ctx, accepted)


def chain_parents(batch: int, n: int) -> jax.Array:
    """[B, N] parents of a chain: -1, 0, 1, ..., N - 2."""
    return jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (batch, n))


def leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
    """{dotted key ("layers.0.wqkv"): shape} of every leaf of a params pytree."""
    def name(path):
        return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)

    return {name(p): tuple(jnp.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_shapes(what: str, expected, got) -> None:
    """Raises ValueError naming the first difference between two params pytrees' leaves
    (missing or unexpected keys, then shapes): ``what`` names the params in the message."""
    want, have = leaf_shapes(expected), leaf_shapes(got)
    if set(have) != set(want):
        raise ValueError(f"{what} params lack {sorted(set(want) - set(have))} and have "
                         f"unexpected {sorted(set(have) - set(want))}")
    for key, shape in want.items():
        if have[key] != shape:
            raise ValueError(f"{what} param {key} has shape {have[key]}, expected {shape}; "
                             "drafter and config mismatch")
