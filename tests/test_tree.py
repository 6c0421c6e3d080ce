"""Tests for specjax.tree: the drawn goldens of the docstrings, and in-jit masks == NumPy masks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import tree
from specjax.tree import StaticTree

ancestor_mask = jax.jit(tree.ancestor_mask)
depths = jax.jit(tree.depths)

# 0 ─ 1 ─ 2 ─ 3
CHAIN4 = [
    [1, 0, 0, 0],
    [1, 1, 0, 0],
    [1, 1, 1, 0],
    [1, 1, 1, 1],
]

#         0
#       /   \
#      1     2
#     / \   / \
#    3   4 5   6
KARY_2_2 = [
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 0, 1, 0, 0, 0, 1],
]

#       0
#      / \
#     1   2
#    / \   \
#   3   4   5
#   |
#   6
IRREGULAR_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
IRREGULAR = [
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 0, 0, 1],
]

GOLDENS = [
    (StaticTree.chain(4), CHAIN4, [0, 1, 2, 3], [[0, 1, 2, 3]]),
    (
        StaticTree.kary(2, 2),
        KARY_2_2,
        [0, 1, 1, 2, 2, 2, 2],
        [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]],
    ),
    (
        StaticTree.from_choices(IRREGULAR_CHOICES),
        IRREGULAR,
        [0, 1, 1, 2, 2, 2, 3],
        [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]],
    ),
]


@pytest.mark.parametrize("static, ancestor, depth, paths", GOLDENS)
def test_static_goldens(static, ancestor, depth, paths):
    np.testing.assert_array_equal(np.asarray(static.ancestor), ancestor)
    np.testing.assert_array_equal(static.depth, depth)
    np.testing.assert_array_equal(np.asarray(static.paths), paths)
    assert static.max_depth == max(depth)


@pytest.mark.parametrize("static, ancestor, depth, paths", GOLDENS)
def test_dynamic_goldens(static, ancestor, depth, paths):
    del paths
    parents = jnp.asarray([static.parents])
    np.testing.assert_array_equal(ancestor_mask(parents)[0], np.asarray(ancestor, bool))
    np.testing.assert_array_equal(depths(parents)[0], depth)


def test_ancestor_mask_docstring_example():
    np.testing.assert_array_equal(
        ancestor_mask(jnp.asarray([[-1, 0, 0, 1]])),
        [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]],
    )


def _numpy_ancestor(parents):
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


@st.composite
def parent_batches(draw, batch=4, n=16):
    """``[batch, n]`` valid parent arrays, from chains to stars."""
    return np.array(
        [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(batch)], np.int32
    )


@settings(max_examples=40, deadline=None)
@given(parent_batches())
def test_dynamic_masks_equal_static_masks(parents):
    anc, d = ancestor_mask(jnp.asarray(parents)), depths(jnp.asarray(parents))
    for b, row in enumerate(parents):
        static = StaticTree(tuple(row))
        np.testing.assert_array_equal(anc[b], _numpy_ancestor(row))
        np.testing.assert_array_equal(anc[b], np.asarray(static.ancestor, bool))
        np.testing.assert_array_equal(d[b], static.depth)


@pytest.mark.parametrize("n", [1, 2, 3, 33])
def test_dynamic_masks_of_the_deepest_tree_of_each_size(n):
    """A chain needs every pointer-jumping round (N not a power of two included)."""
    chain = StaticTree.chain(n)
    anc = ancestor_mask(jnp.asarray([chain.parents]))[0]
    np.testing.assert_array_equal(anc, np.tril(np.ones((n, n), bool)))
    np.testing.assert_array_equal(depths(jnp.asarray([chain.parents]))[0], np.arange(n))


def test_negative_parents_read_as_root():
    np.testing.assert_array_equal(
        ancestor_mask(jnp.asarray([[-1, -1, 1]]))[0], ancestor_mask(jnp.asarray([[-1, 0, 1]]))[0]
    )


def test_kary_is_bfs_ordered():
    t = StaticTree.kary(3, 2)
    assert t.n_nodes == 13
    assert t.parents == (-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3)
    assert StaticTree.kary(4, 0).parents == (-1,)


def test_from_choices_orders_by_depth_then_rank():
    t = StaticTree.from_choices([[1, 0], [0], [0, 1], [1], [0, 0]])  # any input order
    # nodes: 1=[0], 2=[1], 3=[0,0], 4=[0,1], 5=[1,0]
    assert t.parents == (-1, 0, 0, 1, 1, 2)


def test_eagle1_default_tree():
    t = StaticTree.eagle1_default()
    assert (t.n_nodes, t.max_depth, len(t.paths)) == (26, 5, 15)
    assert t.parents[:13] == (-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4)
    np.testing.assert_array_equal(np.bincount(t.depth), [1, 4, 8, 8, 3, 2])


def test_static_tree_is_hashable_and_a_static_argument():
    a, b = StaticTree.kary(2, 2), StaticTree((-1, 0, 0, 1, 1, 2, 2))
    assert a == b and hash(a) == hash(b)
    @functools.partial(jax.jit, static_argnums=1)
    def visible(x, static):
        return jnp.sum(jnp.where(jnp.asarray(static.ancestor, bool), x, 0))

    assert visible(jnp.ones((7, 7)), a) == 17  # sum of (depth + 1) = 1 + 2 * 2 + 4 * 3


def test_truncate_keeps_a_prefix():
    t = StaticTree.eagle1_default().truncate(5)
    assert t.parents == (-1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="n_nodes must be in"):
        t.truncate(6)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: StaticTree((0, 0)), r"parents\[0\] must be -1"),
        (lambda: StaticTree((-1, 1)), r"parents\[1\] must be in \[0, 1\), got 1"),
        (lambda: StaticTree((-1, 0, -1)), r"parents\[2\] must be in \[0, 2\), got -1"),
        (lambda: StaticTree.from_choices([[0], [0, 1], [0, 1]]), "duplicates"),
        (lambda: StaticTree.from_choices([[0], [1, 0]]), r"lack their parent path"),
        (lambda: StaticTree.chain(0), "n_nodes must be >= 1"),
        (lambda: StaticTree.kary(0, 2), "k >= 1"),
    ],
)
def test_invalid_trees_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()
