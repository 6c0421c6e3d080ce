"""One attention over structured key blocks, for the target and every drafter.

A call attends the queries of T tokens per row to a list of :class:`KeyBlock` s. Each block
holds keys/values in the cache's row layout and a visibility *rule*: structure (lengths, a tree,
a block size, anchors, segment ids), not a dense mask. One softmax runs over the visible keys of
all blocks together. The rules cover every pattern the speculative loop and drafter training
need:

========================  ================================================================
rule                      query t of row b sees key s iff
========================  ================================================================
:class:`Prefix`           ``s < lengths[b]`` (committed cache slots)
:class:`Causal`           ``s <= t + offset[b]`` (the pass's tokens sit at slots ``offset..``)
:class:`Tree`             ``ancestor[b, t, s - offset[b]]`` (ancestor-or-self among new nodes)
:class:`Full`             always (a DFlash draft block sees all of itself)
:class:`Diagonal`         ``s == t`` (EAGLE-3 training-time test: a later step's own key)
:class:`Window`           ``0 <= q_pos[b, t] - k_pos[b, s] < size`` (sliding window)
:class:`Segments`         ``q_seg[b, t] == k_seg[b, s]`` (packed sequences)
:class:`AnchorPrefix`     ``s < anchors[b, t // block]`` (DFlash training: context before
                          the block's anchor)
:class:`Blocks`           ``t // block == s // block`` (and ``s <= t`` when causal)
:class:`Dense`             ``mask[b, t, s]`` (visibility that is data: EAGLE-2 expansion)
:class:`Union` /          any / all of several rules
:class:`Intersect`
========================  ================================================================

For example a verify pass over a 3-node tree (root 0 with children 1 and 2) after 2 committed
slots, written into the cache at slots 2..4, uses one block with
``Union((Prefix(lengths), Tree(ancestor, offset=lengths)))``::

    slot:     0 1 2 3 4 5
    node 0:   1 1 1 0 0 0
    node 1:   1 1 1 1 0 0
    node 2:   1 1 1 0 1 0

**Implementations.** :func:`attend` dispatches on an implementation name (the
``attention_impl`` field of a model config). ``"reference"`` builds each block's dense mask
from its rule (:meth:`Rule.dense`, the definition of the rule) and calls
``specjax.kernels.attention.reference_attention``. A :class:`Diagonal` or :class:`Blocks`
block of the queries' own T keys is the exception: only each query's own span of keys is
scored (T x span scores instead of a T x T mask), so an unrolled step of EAGLE-3's
training-time test adds T scores and DFlash's training blocks cost their blocks, not a square
over all of them. A fused kernel registers another name in :data:`IMPLEMENTATIONS` and reads
the rules' structure instead. ``"pallas"`` (NVIDIA GPUs) and ``"pallas-interpret"`` (the same
kernel through Pallas's interpreter, any backend) send verify passes, a committed prefix plus
a tree, to ``specjax.kernels.tree_attention`` and every other call to the reference. Rules are
pytrees whose array fields are traced and whose sizes (``size``, ``block``, ``causal``) are
static.

Axis legend as in :mod:`specjax.models.layers`; S is a block's key count, A anchors per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, Union as TypingUnion

import jax
import jax.numpy as jnp

from specjax.kernels.attention import reference_attention


class Rule(Protocol):
    """A visibility rule: which of a block's S keys each of the T queries of a row sees."""

    def dense(self, b: int, t: int, s: int) -> jax.Array:
        """The rule as a bool mask broadcastable to [B, T, S]."""
        ...


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


def _rows(x, b: int) -> jax.Array:
    """A per-row offset (int or [B] array) as a [B, 1, 1] int32 array."""
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b,))[:, None, None]


def _grid(t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Query and key indices as [1, T, 1] and [1, 1, S] int32 arrays."""
    return (jnp.arange(t, dtype=jnp.int32)[None, :, None],
            jnp.arange(s, dtype=jnp.int32)[None, None, :])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Keys ``s < lengths[b]``: the committed slots of a cache.

    Attributes:
      lengths: [B] int32.
    """

    lengths: jax.Array

    def dense(self, b, t, s):
        return _grid(t, s)[1] < _rows(self.lengths, b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Causal:
    """Keys ``s <= t + offset[b]``: query t is the token at slot ``offset + t``.

    With ``offset = lengths`` over a cache the pass has written its tokens into, this alone
    covers the committed prefix and causal visibility among the new tokens (stale slots past
    the new tokens stay hidden).

    Attributes:
      offset: [B] int32 or a Python int (0: keys are the pass's own tokens).
    """

    offset: jax.Array | int = 0

    def dense(self, b, t, s):
        qi, ki = _grid(t, s)
        return ki <= qi + _rows(self.offset, b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """Ancestor-or-self visibility among T new nodes stored at keys ``offset .. offset + T``.

    Attributes:
      ancestor: [B, T, T] bool; ``ancestor[b, i, j]``: node j is node i or one of its
        ancestors (:func:`specjax.tree.ancestor_mask`). Row i must include i.
      offset: [B] int32 or an int, the key index of node 0 (0 for a fresh block).
    """

    ancestor: jax.Array
    offset: jax.Array | int = 0

    def dense(self, b, t, s):
        rel = _grid(t, s)[1] - _rows(self.offset, b)  # [B, 1, S]
        idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (b, t, s))
        return (rel >= 0) & (rel < t) & jnp.take_along_axis(
            jnp.broadcast_to(self.ancestor, (b, t, t)), idx, axis=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Full:
    """Every key is visible (a DFlash draft block attends to all of itself)."""

    def dense(self, b, t, s):
        return jnp.ones((1, 1, 1), bool)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Diagonal:
    """Query t sees key t only.

    EAGLE-3's training-time test: at unrolled step k, query j sees the step-0 keys causally
    (:class:`Causal`) and, in each later step's block, that step's key at the same index j.
    """

    def dense(self, b, t, s):
        qi, ki = _grid(t, s)
        return qi == ki


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Window:
    """Keys at most ``size - 1`` positions before the query, and none after it.

    Attributes:
      q_pos: [B, T] int32 query positions.
      k_pos: [B, S] int32 key positions.
      size: static window length (>= 1); the query's own position is inside it.
    """

    q_pos: jax.Array
    k_pos: jax.Array
    size: int = _static()

    def dense(self, b, t, s):
        delta = self.q_pos[:, :, None] - self.k_pos[:, None, :]  # [B, T, S]
        return (delta >= 0) & (delta < self.size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Keys of the query's own packed sequence.

    Attributes:
      q_seg: [B, T] int32 segment id of every query.
      k_seg: [B, S] int32 segment id of every key.
    """

    q_seg: jax.Array
    k_seg: jax.Array

    def dense(self, b, t, s):
        return self.q_seg[:, :, None] == self.k_seg[:, None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AnchorPrefix:
    """Context keys strictly before the anchor of the query's block (DFlash training).

    The queries are A blocks of ``block`` tokens each; block a starts at context position
    ``anchors[b, a]``, whose own target features are not yet known at inference, so it sees
    the context keys ``s < anchors[b, a]``.

    Attributes:
      anchors: [B, A] int32, with ``A * block == T``.
      block: static block length.
    """

    anchors: jax.Array
    block: int = _static()

    def dense(self, b, t, s):
        per_query = jnp.repeat(self.anchors, self.block, axis=1)  # [B, T]
        return _grid(t, s)[1] < per_query[:, :, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """Each query sees the keys of its own block of ``block`` consecutive tokens.

    Bidirectional inside the block (DFlash's full-attention layers), or causal inside it
    (``causal=True``: DFlash layers with sliding-window attention or ``is_causal``).
    """

    block: int = _static()
    causal: bool = _static(default=False)

    def dense(self, b, t, s):
        qi, ki = _grid(t, s)
        same = (qi // self.block) == (ki // self.block)
        return same & (ki <= qi) if self.causal else same


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
    """An explicit mask, for visibility that is computed rather than structured.

    EAGLE-2 expansion feeds each level's nodes against the keys of every node fed so far; who
    descends from whom is only known once the previous level's top-k has run.

    Attributes:
      mask: [B, T, S] bool (or broadcastable to it).
    """

    mask: jax.Array

    def dense(self, b, t, s):
        return self.mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Union:
    """A key is visible when any of ``rules`` shows it."""

    rules: tuple

    def dense(self, b, t, s):
        out = self.rules[0].dense(b, t, s)
        for r in self.rules[1:]:
            out = out | r.dense(b, t, s)
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Intersect:
    """A key is visible when all of ``rules`` show it."""

    rules: tuple

    def dense(self, b, t, s):
        out = self.rules[0].dense(b, t, s)
        for r in self.rules[1:]:
            out = out & r.dense(b, t, s)
        return out


AnyRule = TypingUnion[Prefix, Causal, Tree, Full, Diagonal, Window, Segments, AnchorPrefix,
                      Blocks, Dense, Union, Intersect]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBlock:
    """Keys and values of S positions per row and the rule that says who sees them.

    Attributes:
      k: [B * K, S, H] keys in the cache's row layout (row ``b * K + j`` = kv head j of row b),
        RoPE already applied.
      v: [B * K, S, H] values.
      rule: the block's visibility rule.
    """

    k: jax.Array
    v: jax.Array
    rule: AnyRule


def dense_mask(rule: AnyRule, b: int, t: int, s: int) -> jax.Array:
    """[B, T, S] bool: the rule's visibility matrix (the definition every kernel matches)."""
    return jnp.broadcast_to(rule.dense(b, t, s), (b, t, s))


def _reference(q: jax.Array, blocks: Sequence[KeyBlock]) -> jax.Array:
    """Dense masks and one joint softmax; see :func:`attend` for the shapes."""
    b, t, n, h = q.shape
    kh = blocks[0].k.shape[0] // b
    g = n // kh
    # Queries grouped under their kv head: [B, T, N, H] -> [B * K, G * T, H].
    rows = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b * kh, g * t, h)
    dense, local = [], []
    for blk in blocks:
        s = blk.k.shape[1]
        if s == t and isinstance(blk.rule, Diagonal):
            local.append((blk.k, blk.v, 1, False))
        elif s == t and isinstance(blk.rule, Blocks) and t % blk.rule.block == 0:
            local.append((blk.k, blk.v, blk.rule.block, blk.rule.causal))
        else:
            m = dense_mask(blk.rule, b, t, s)
            m = jnp.broadcast_to(m[:, None, None], (b, kh, g, t, s)).reshape(b * kh, g * t, s)
            dense.append((blk.k, blk.v, m))
    out = reference_attention(rows, dense, local)
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _verify_pattern(q: jax.Array, blocks: Sequence[KeyBlock]):
    """``(cache k, v, lengths [B], new k, v, ancestor [B, T, T])`` when ``blocks`` are a verify
    pass's (the committed prefix of a cache plus T new nodes under a tree), else None.

    Two layouts: a cache read under ``Prefix`` and the new nodes' own block under ``Tree``
    (offset 0), or one cache block the nodes were written into at ``lengths`` under
    ``Union((Prefix(lengths), Tree(ancestor, offset=lengths)))`` (the nodes are gathered back
    out of it).
    """
    b, t = q.shape[:2]
    if len(blocks) == 2:
        cache, new = blocks
        if (isinstance(cache.rule, Prefix) and isinstance(new.rule, Tree)
                and isinstance(new.rule.offset, int) and new.rule.offset == 0):
            return (cache.k, cache.v, cache.rule.lengths, new.k, new.v,
                    jnp.broadcast_to(new.rule.ancestor, (b, t, t)))
        return None
    (blk,) = blocks
    rule = blk.rule
    if not (isinstance(rule, Union) and len(rule.rules) == 2):
        return None
    prefix, tree = rule.rules
    if not (isinstance(prefix, Prefix) and isinstance(tree, Tree)
            and tree.offset is prefix.lengths):
        return None
    rows = blk.k.shape[0] // b
    start = jnp.repeat(prefix.lengths, rows)  # [B * K]

    def gather(x):  # the T nodes' slots of every row: [B * K, T, H]
        return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, t, axis=0))(x, start)

    return (blk.k, blk.v, prefix.lengths, gather(blk.k), gather(blk.v),
            jnp.broadcast_to(tree.ancestor, (b, t, t)))


def _tree_kernel(q: jax.Array, blocks: Sequence[KeyBlock], interpret: bool) -> jax.Array:
    """The fused tree-attention kernel (``specjax.kernels.tree_attention``) for verify passes
    whose shapes it takes; every other call runs :func:`_reference`."""
    from specjax.kernels import tree_attention as ta

    found = _verify_pattern(q, blocks)
    b, t, n, h = q.shape
    if found is None:
        return _reference(q, blocks)
    k, v, lengths, k_new, v_new, anc = found
    kh = k.shape[0] // b
    g, s = n // kh, k.shape[1]
    block_k = 64
    if h < 16 or h & (h - 1) or s % block_k:
        return _reference(q, blocks)
    # Split long caches into pieces of at least 1024 slots (flash-decoding).
    n_split = max(1, s // 1024)
    while s % (n_split * block_k):
        n_split -= 1
    rows = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b * kh, g * t, h)
    out = ta.tree_attention(rows, k, v, jnp.repeat(lengths, kh), k_new, v_new, anc,
                            block_k=block_k, n_split=n_split, interpret=interpret)
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


IMPLEMENTATIONS: dict[str, Callable[[jax.Array, Sequence[KeyBlock]], jax.Array]] = {
    "reference": _reference,
    # Verify passes through the fused Pallas tree-attention kernel (NVIDIA GPUs); the
    # "-interpret" variant runs the same kernel through Pallas's interpreter on any backend.
    "pallas": lambda q, blocks: _tree_kernel(q, blocks, interpret=False),
    "pallas-interpret": lambda q, blocks: _tree_kernel(q, blocks, interpret=True),
}


def attend(q: jax.Array, blocks: Sequence[KeyBlock], impl: str = "reference") -> jax.Array:
    """Attention of T queries per row over key blocks, one softmax over all visible keys.

    Args:
      q: [B, T, N, H] queries (RoPE applied); query head n reads kv head ``n // (N // K)``.
      blocks: one or more :class:`KeyBlock` s with ``B * K`` rows each. Every query must see
        at least one key in some block.
      impl: a name in :data:`IMPLEMENTATIONS`.
    Returns:
      [B, T, N, H] outputs in ``q.dtype``; the softmax runs in float32.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; "
                         f"known: {sorted(IMPLEMENTATIONS)}")
    if not blocks:
        raise ValueError("attention needs at least one key block")
    b, n = q.shape[0], q.shape[2]
    for blk in blocks:
        if blk.k.shape[0] % b or n % (blk.k.shape[0] // b):
            raise ValueError(f"key block rows {blk.k.shape[0]} do not hold a whole number of "
                             f"kv heads dividing the {n} query heads for batch {b}")
    return IMPLEMENTATIONS[impl](q, blocks)
