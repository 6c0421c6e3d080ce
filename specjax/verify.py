"""Acceptance rules: which drafted nodes the target keeps, and the bonus token after them.

One target forward over a proposal tree gives ``target_logits[b, i]``, the target's prediction
for the child of node ``i``. :func:`verify` walks the tree from the root and returns the
accepted root-to-node path and one more token (the bonus) drawn from the target at the last
accepted node. The tokens emitted by the cycle are ``tokens[path[1..n_accepted]]`` followed by
``bonus``; the root was emitted by the previous cycle (the bonus becomes the next root).

Three rules, chosen per row and by the proposal kind; all keep the law of the generated text
exactly that of sampling from the processed target (``sampling.log_probs``):

1. **Greedy** (rows with temperature 0, whatever the proposal): the longest root-to-node path
   whose every token equals the target's argmax at its parent (the lowest node index among
   equally long paths); bonus = argmax at its end. Output == plain greedy decoding.

2. **Deterministic proposals** (``draft_logits=None``; EAGLE-2/3's official sampling rule):
   the drafts are treated as fixed, i.e. ``q`` is a point mass on each proposed token. At the
   current node the children are tried in index order; child ``x`` is accepted with
   probability ``p(x)``, where ``p`` is the current residual at the node. On rejection
   ``p(x) := 0`` and ``p`` is renormalised, then the next sibling is tried. If every child is
   rejected the bonus is drawn from the residual. A duplicate of a rejected sibling therefore
   has ``p = 0`` and is rejected too. Lossless for ANY proposal that does not depend on the
   verifier's random numbers: top-k drafts, sampled drafts, n-gram matches alike.

3. **Sampled proposals with real q** (``draft_logits`` given; SpecInfer multi-round
   rejection sampling, of which standard speculative sampling on a chain is the one-child
   case): child ``x`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection
   ``p := normalise(max(0, p - q))`` and the next sibling is tried with the same ``q``. All
   rejected -> bonus from the residual. This needs the i.i.d. assumption below.

   *i.i.d. assumption.* For every node ``a``, given the tokens on the root-to-``a`` path, the
   tokens of ``a``'s valid children are independent draws from
   ``q(. | a) = exp(log_probs(draft_logits[a]))`` (processed with the target's sampling
   parameters): independent of each other, of the tree outside ``a``'s subtree and of the
   verifier's random numbers; and which children exist and are valid (the topology,
   ``node_valid``) is decided before drawing them. Drafts drawn WITHOUT replacement (EAGLE-1
   sampling, distinct top-k) or a topology chosen from the drawn tokens (EAGLE-2's reranking)
   violate it: use rule 2 for those.

Edge cases of ``p`` and ``q`` (rule 3; rule 2 is rule 3 with ``q(x) = 1``): the test is
``u * q(x) < p(x)`` with ``u ~ U[0, 1)``, which is ``u < p/q`` when ``q(x) > 0`` and needs no
division.

* ``p(x) = 0``: never accepted, whatever ``q``.
* ``q(x) = 0`` for a proposed ``x``: a draw from ``q`` cannot produce it, so under the
  assumption the case has probability 0 and any choice keeps the law. We accept iff
  ``p(x) > 0`` (the limit of ``min(1, p/q)`` as ``q(x) -> 0``, which is also right when ``q``
  merely underflowed), so a token the target forbids is never emitted.
* The residual ``max(0, p - q)`` has zero mass only when ``p <= q`` everywhere, i.e. ``p = q``,
  where rejection has probability 0 up to rounding; the residual then stays as it was.
* Non-finite logits: comparisons with NaN are false (no acceptance), and the bonus is drawn
  from a distribution with NaNs replaced by zero mass; tokens are always in ``[0, V)``. The
  caller is expected to detect such rows and fall back.

Nodes with ``node_valid = False`` or depth above ``max_depth`` are never tried, and so their
descendants are never reached.

Axis legend: B batch, N tree nodes, V vocab, D depth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax import tree
from specjax.sampling import SamplingParams, argmax, inverse_cdf_sample, log_probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification, per row.

    Attributes:
      path: ``[B, D + 1]`` int32 node indices from the root (``path[:, 0] = 0``) to the last
        accepted node, padded with 0 after position ``n_accepted``.
      n_accepted: ``[B]`` int32 accepted drafts, the root excluded; a draft at depth ``d`` was
        accepted iff ``n_accepted >= d``, which gives acceptance-by-depth statistics.
      bonus: ``[B]`` int32 the token after the last accepted node, drawn from the target (or
        its residual after rejections) there.
    """

    path: jax.Array
    n_accepted: jax.Array
    bonus: jax.Array


def verify(
    target_logits: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    node_valid: jax.Array,
    sp: SamplingParams,
    rng: jax.Array,
    *,
    max_depth: int,
    draft_logits: jax.Array | None = None,
) -> VerifyResult:
    """Accepts a path of a proposal tree and draws the bonus token.

    Args:
      target_logits: ``[B, N, V]`` the target's logits at each node (its prediction for the
        node's child).
      tokens: ``[B, N]`` int32; ``tokens[:, 0]`` is the root.
      parents: ``[B, N]`` int32; ``parents[:, 0] = -1``, ``0 <= parents[:, i] < i``.
      node_valid: ``[B, N]`` bool; False marks padding nodes, which are never accepted.
      sp: per-row sampling parameters ``[B]``; temperature-0 rows use the greedy rule.
      rng: a PRNG key.
      max_depth: static D, the longest path that can be accepted (e.g. ``N - 1`` for a chain,
        ``StaticTree.max_depth`` for a static tree); deeper nodes are ignored.
      draft_logits: ``[B, N, V]`` the draft's logits at each node, from which that node's
        children were drawn i.i.d. (rule 3); ``None`` treats proposals as deterministic
        (rule 2).

    Returns:
      A :class:`VerifyResult`.
    """
    anc = tree.ancestor_mask(parents)  # [B, N, N]
    depth = jnp.sum(anc, axis=-1, dtype=jnp.int32) - 1  # [B, N]
    tryable = node_valid & (depth <= max_depth)
    greedy = _greedy(target_logits, tokens, parents, tryable, anc, depth, max_depth)

    def sampled():
        return _sequential(
            target_logits, draft_logits, tokens, parents, tryable, depth, sp, rng, max_depth
        )

    # All-greedy batches skip the vocab-sized probability work (no host sync: a device cond).
    return lax.cond(
        jnp.all(sp.greedy), lambda: greedy, lambda: _select_rows(sp.greedy, greedy, sampled())
    )


def emitted_tokens(result: VerifyResult, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The tokens a cycle emits: accepted drafts then the bonus.

    Args:
      result: the verification of ``tokens``.
      tokens: ``[B, N]`` int32, the proposal.

    Returns:
      ``(emitted [B, D + 1] int32, count [B] int32)``: ``emitted[b, :count[b]]`` are the new
      tokens (``count = n_accepted + 1``), the rest is 0.
    """
    drafted = jnp.take_along_axis(tokens, result.path[:, 1:], axis=1)  # [B, D]
    drafted = jnp.pad(drafted, ((0, 0), (0, 1)))  # [B, D + 1]
    slot = jnp.arange(drafted.shape[1])[None, :]
    n = result.n_accepted[:, None]
    emitted = jnp.where(slot < n, drafted, jnp.where(slot == n, result.bonus[:, None], 0))
    return emitted.astype(jnp.int32), result.n_accepted + 1


def _greedy(target_logits, tokens, parents, tryable, anc, depth, max_depth) -> VerifyResult:
    """Rule 1, vectorised over the tree: the deepest node whose whole path matches."""
    top = argmax(target_logits)  # [B, N]
    predicted = jnp.take_along_axis(top, jnp.maximum(parents, 0), axis=1)  # [B, N] at parent
    match = (tokens == predicted) & tryable
    match = match.at[:, 0].set(True)
    good = jnp.all(~anc | match[:, None, :], axis=-1)  # [B, N] every node on its root path matches
    best = jnp.argmax(jnp.where(good, depth, -1), axis=-1)  # [B] first index among the deepest
    n_accepted = jnp.take_along_axis(depth, best[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(top, best[:, None], axis=1)[:, 0]
    return VerifyResult(_path_to(anc, depth, best, max_depth), n_accepted, bonus)


def _path_to(anc, depth, node, max_depth) -> jax.Array:
    """``[B, D + 1]`` the root-to-``node`` path, padded with 0."""
    on_path = jnp.take_along_axis(anc, node[:, None, None], axis=1)[:, 0]  # [B, N]
    levels = jnp.arange(max_depth + 1)[None, :, None]
    at_level = on_path[:, None, :] & (depth[:, None, :] == levels)  # [B, D + 1, N] one-hot or empty
    return jnp.argmax(at_level, axis=-1).astype(jnp.int32)


def _sequential(target_logits, draft_logits, tokens, parents, tryable, depth, sp, rng, max_depth):
    """Rules 2 and 3 in one pass over the nodes in index order.

    Nodes are topologically ordered, so when node ``j`` comes up every node that could be
    on its path has been decided: ``j`` is tried iff its parent is the current accepted node.
    Children of that node are met in index order (siblings need not be contiguous), and once
    a child is accepted its later siblings no longer have the current node as parent. Each
    node is visited once: O(N V) work per row.
    """
    batch, n_nodes, vocab = target_logits.shape
    # One draw: a uniform per node for its acceptance test, the last one for the bonus.
    uniform = jax.random.uniform(rng, (batch, n_nodes + 1))
    u = uniform[:, :n_nodes]  # [B, N]
    rows = jnp.arange(batch)
    levels = jnp.arange(max_depth + 1)[None, :]

    def probs_at(logits, j):  # [B, N, V] -> [B, V] processed distribution at node j
        return jnp.exp(log_probs(lax.dynamic_index_in_dim(logits, j, axis=1, keepdims=False), sp))

    def step(carry, node):
        cur, p, q, n_accepted, path = carry  # p, q: [B, V] residual target and draft at cur
        j, x, parent, ok, d, u_j = node
        tried = ok & (parent == cur)
        p_x = p[rows, x]
        if q is None:  # a deterministic proposal: q is the point mass on x
            q_x, q_node = jnp.ones_like(p_x), jax.nn.one_hot(x, vocab, dtype=p.dtype)
        else:
            q_x, q_node = q[rows, x], q
        accept = tried & (u_j * q_x < p_x)
        residual = jnp.maximum(p - q_node, 0.0)  # [B, V]
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
        p = jnp.where(tried[:, None], residual, p)

        def descend(p, q):  # the accepting rows move to node j
            p = jnp.where(accept[:, None], probs_at(target_logits, j), p)
            if q is not None:
                q = jnp.where(accept[:, None], probs_at(draft_logits, j), q)
            return p, q

        # A node's logits are processed (truncation included) only when some row accepts it:
        # for one row that is at most D + 1 of the N nodes.
        p, q = lax.cond(jnp.any(accept), descend, lambda p, q: (p, q), p, q)
        path = jnp.where(accept[:, None] & (levels == d[:, None]), j, path)
        return (jnp.where(accept, j, cur), p, q, n_accepted + accept, path), None

    def per_node(x):  # [B, N] -> [N - 1, B], the scan's view of nodes 1..N-1
        return jnp.moveaxis(x[:, 1:], 1, 0)

    init = (
        jnp.zeros((batch,), jnp.int32),
        probs_at(target_logits, 0),
        None if draft_logits is None else probs_at(draft_logits, 0),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch, max_depth + 1), jnp.int32),
    )
    xs = (
        jnp.arange(1, n_nodes, dtype=jnp.int32),
        per_node(tokens),
        per_node(parents),
        per_node(tryable),
        per_node(depth),
        per_node(u),
    )
    (_, p, _, n_accepted, path), _ = lax.scan(step, init, xs)
    # NaNs (non-finite logits) count as zero mass, so the bonus stays a valid token id.
    bonus = inverse_cdf_sample(uniform[:, n_nodes], p)
    return VerifyResult(path, n_accepted, bonus)


def _select_rows(take_first: jax.Array, first: VerifyResult, second: VerifyResult) -> VerifyResult:
    """Row-wise choice between two results: ``take_first [B]`` bool."""
    return jax.tree.map(
        lambda a, b: jnp.where(take_first.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), first, second
    )
