"""Draft-tree topologies and their attention masks.

A proposal is a tree of N nodes stored as a parent array. Node 0 is the root: the last
committed token, whose target logits have not been computed yet. Every other node ``i`` has
``0 <= parents[i] < i``, so nodes are in topological order and a prefix of the nodes is again a
tree. ``parents[0] = -1``. A chain is the tree with ``parents[i] = i - 1``.

Two representations share these conventions:

* :class:`StaticTree`: a fixed topology (EAGLE-1, Medusa, chains, full k-ary trees). Its
  ancestor matrix, depths and root-to-leaf paths are computed once in NumPy and stored as
  tuples, so the object is hashable and can be a static argument of ``jax.jit``.
* ``parents[B, N]`` int32 arrays for trees built inside ``jit`` (EAGLE-2/3 dynamic trees,
  cost-aware trees): :func:`ancestor_mask` and :func:`depths` compute the same quantities with
  static shapes.

The ancestor-or-self matrix is the tree-attention mask among the new nodes: query ``i`` may
attend key ``j`` iff ``ancestor[i, j]``. A node's position id is ``lengths[b] + depth``.

Padding: a proposal carries ``node_valid[B, N]``. An invalid node still needs a parent that
satisfies ``0 <= parents[i] < i`` (point it at the root) so its mask row stays well formed;
verification never accepts it, nor anything below it.

Axis legend: B batch, N tree nodes, D depth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _ancestor_np(parents: np.ndarray) -> np.ndarray:
    """``[N]`` parents -> ``[N, N]`` int8 ancestor-or-self matrix; row i = parent's row + i."""
    n = parents.shape[0]
    anc = np.eye(n, dtype=np.int8)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A fixed tree topology with its masks precomputed.

    Construct it with :meth:`chain`, :meth:`kary`, :meth:`from_choices`,
    :meth:`eagle1_default` or directly from a parent tuple. All fields are tuples (hashable);
    ``np.asarray`` turns them into arrays.

    Example, ``StaticTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])``::

              0             ancestor (row i: which nodes node i sees)
             / \\                 0 1 2 3 4 5 6
            1   2            0 [[1,0,0,0,0,0,0],
           / \\   \\           1  [1,1,0,0,0,0,0],
          3   4   5          2  [1,0,1,0,0,0,0],
          |                  3  [1,1,0,1,0,0,0],
          6                  4  [1,1,0,0,1,0,0],
                             5  [1,0,1,0,0,1,0],
                             6  [1,1,0,1,0,0,1]]

        parents = (-1, 0, 0, 1, 1, 2, 3)
        depth   = (0, 1, 1, 2, 2, 2, 3)
        paths   = ((0, 1, 4, -1), (0, 2, 5, -1), (0, 1, 3, 6))   # one per leaf, by leaf index

    Attributes:
      parents: ``[N]``; ``parents[0] = -1`` and ``0 <= parents[i] < i`` otherwise.
      ancestor: ``[N, N]`` 0/1; ``ancestor[i][j] = 1`` iff ``j`` is ``i`` or an ancestor of ``i``.
      depth: ``[N]``; the root has depth 0.
      paths: ``[n_leaves, max_depth + 1]`` root-to-leaf node indices padded with -1, one row per
        leaf (a node without children) in increasing leaf index.
    """

    parents: tuple[int, ...]
    ancestor: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)
    depth: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    paths: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        if not parents or parents[0] != -1:
            raise ValueError(f"parents[0] must be -1 (the root), got parents={parents}")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents[{i}] must be in [0, {i}), got {p}")
        arr = np.asarray(parents)
        anc = _ancestor_np(arr)
        depth = anc.sum(1) - 1
        has_child = np.zeros(len(parents), bool)
        has_child[arr[1:]] = True
        leaves = np.flatnonzero(~has_child)
        paths = np.full((leaves.size, depth.max() + 1), -1, np.int64)
        for row, leaf in enumerate(leaves):
            nodes = np.flatnonzero(anc[leaf])  # ancestors are in index order = depth order
            paths[row, : nodes.size] = nodes
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "ancestor", tuple(map(tuple, anc.tolist())))
        object.__setattr__(self, "depth", tuple(depth.tolist()))
        object.__setattr__(self, "paths", tuple(map(tuple, paths.tolist())))

    @property
    def n_nodes(self) -> int:
        """N, including the root."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """The deepest node's depth: at most this many drafts can be accepted per cycle."""
        return max(self.depth)

    def truncate(self, n_nodes: int) -> StaticTree:
        """The first ``n_nodes`` nodes, a smaller tree for a tighter verification budget.

        Nodes are in topological order, so any prefix is a tree; for trees built level by level
        in order of draft rank (all constructors here) the prefix keeps the most likely nodes.
        """
        if not 1 <= n_nodes <= self.n_nodes:
            raise ValueError(f"n_nodes must be in [1, {self.n_nodes}], got {n_nodes}")
        return StaticTree(self.parents[:n_nodes])

    @classmethod
    def chain(cls, n_nodes: int) -> StaticTree:
        """A chain of ``n_nodes`` nodes: the root and ``n_nodes - 1`` drafts.

        ``chain(4)``::

            0 ─ 1 ─ 2 ─ 3        ancestor = [[1,0,0,0],
                                             [1,1,0,0],
                                             [1,1,1,0],
                                             [1,1,1,1]]
        """
        if n_nodes < 1:
            raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
        return cls(tuple(range(-1, n_nodes - 1)))

    @classmethod
    def kary(cls, k: int, depth: int) -> StaticTree:
        """The full ``k``-ary tree with ``depth`` levels below the root, in BFS order.

        ``kary(2, 2)``, 7 nodes::

                  0                  ancestor =   0 1 2 3 4 5 6
                /   \\                         0 [[1,0,0,0,0,0,0],
               1     2                        1  [1,1,0,0,0,0,0],
              / \\   / \\                       2  [1,0,1,0,0,0,0],
             3   4 5   6                      3  [1,1,0,1,0,0,0],
                                              4  [1,1,0,0,1,0,0],
                                              5  [1,0,1,0,0,1,0],
                                              6  [1,0,1,0,0,0,1]]
        """
        if k < 1 or depth < 0:
            raise ValueError(f"kary needs k >= 1 and depth >= 0, got k={k}, depth={depth}")
        n_nodes = sum(k**d for d in range(depth + 1))
        # In BFS order the children of node j are j*k + 1 ... j*k + k.
        return cls((-1,) + tuple((i - 1) // k for i in range(1, n_nodes)))

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> StaticTree:
        """A tree from EAGLE-1 / Medusa "choices": one path of child ranks per draft node.

        ``[0, 1]`` is the second-ranked child of the first-ranked child of the root. Every
        prefix of a choice must itself be a choice. Nodes are ordered as the official code
        orders them: by depth, then lexicographically, so siblings appear in rank order.

        Args:
          choices: the draft nodes (the root is implicit); duplicates are not allowed.

        Returns:
          The tree with ``len(choices) + 1`` nodes.
        """
        paths = [tuple(int(r) for r in c) for c in choices]
        if len(set(paths)) != len(paths):
            raise ValueError(f"choices contain duplicates: {sorted(paths)}")
        if any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError(f"choices must be non-empty paths of ranks >= 0, got {paths}")
        order = sorted(paths, key=lambda p: (len(p), p))
        index = {(): 0} | {p: i + 1 for i, p in enumerate(order)}
        missing = [p for p in order if p[:-1] not in index]
        if missing:
            raise ValueError(f"choices {missing} lack their parent path")
        return cls((-1,) + tuple(index[p[:-1]] for p in order))

    @classmethod
    def eagle1_default(cls) -> StaticTree:
        """EAGLE-1's default tree ``mc_sim_7b_63``: 25 drafts + root, depth 5.

        Wide near the root (4 first-level candidates) and a single deep spine along the
        top-ranked children, matching where a well-trained drafter's acceptance mass lies.
        """
        return cls.from_choices(MC_SIM_7B_63)


# EAGLE-1's `eagle/model/choices.py::mc_sim_7b_63` (not Medusa's list of the same name).
MC_SIM_7B_63 = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """Ancestor-or-self masks of a batch of trees, by pointer jumping.

    Round r doubles the reach: ``mask[i]`` holds the ancestors of ``i`` up to distance
    ``2**r - 1`` and ``jump[i]`` its ``2**r``-th ancestor (clamped at the root), so
    ``ceil(log2 N)`` rounds of one ``[B, N, N]`` gather suffice.

    Example: ``parents = [-1, 0, 0, 1]`` (node 3 under node 1)::

           0            [[1,0,0,0],
          / \\            [1,1,0,0],
         1   2           [1,0,1,0],
         |               [1,1,0,1]]
         3

    Args:
      parents: ``[B, N]`` int32; ``parents[:, 0]`` is ignored (the root), and negative entries
        elsewhere are read as the root.

    Returns:
      ``[B, N, N]`` bool; ``out[b, i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``.
    """
    n = parents.shape[-1]
    jump = jnp.maximum(parents, 0).at[:, 0].set(0)  # [B, N]; the root is its own parent
    mask = jnp.broadcast_to(jnp.eye(n, dtype=bool), parents.shape + (n,))  # [B, N, N]
    for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
        mask = mask | jnp.take_along_axis(mask, jump[..., None], axis=1)
        jump = jnp.take_along_axis(jump, jump, axis=1)
    return mask


def depths(parents: jax.Array) -> jax.Array:
    """Depth of every node (root 0) of a batch of trees.

    Args:
      parents: ``[B, N]`` int32, as for :func:`ancestor_mask`.

    Returns:
      ``[B, N]`` int32; the number of strict ancestors.
    """
    return jnp.sum(ancestor_mask(parents), axis=-1, dtype=jnp.int32) - 1
