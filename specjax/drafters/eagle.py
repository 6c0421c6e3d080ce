"""EAGLE-1, EAGLE-2 and EAGLE-3 drafters: one decoder layer over the target's own features.

Both versions draft from *pairs*: pair ``j`` is (a feature of position ``j``, the token at
``j + 1``) at RoPE position ``j``; the layer's output at pair ``j`` stands for the feature of
position ``j + 1`` and its logits predict the token at ``j + 2``. On committed positions the
feature comes from the target; on draft nodes it is the layer's own output for the parent.

* **EAGLE-1** (feature = the target's final normed state, the LM head's input): the layer
  input is ``fc([embed(token) ‖ feature])`` (2E -> D, D = E), the layer has no input norm, and
  the target's own LM head scores the output directly.
* **EAGLE-3** (features = the residual streams entering target layers {2, L // 2, L - 3},
  concatenated): ``fc`` (3E -> D) fuses them once, on target features only; the layer's q/k/v
  read ``[attn_norm(embed(token)) ‖ hidden_norm(h)]`` (2D wide) with ``h`` the residual; the
  drafter's own head over a reduced vocabulary of Vd ids scores ``final_norm(output)``, and
  draft id ``i`` is target id ``i + d2t[i]``.

**Cache and cycle.** The drafter keeps one layer's K/V of the committed pairs
(:class:`EagleState`). ``commit`` feeds the pairs the cycle committed, the old root and each
accepted draft with their *target* features from :class:`~specjax.drafters.base.Accepted`
(paired with the next committed token), so drafted positions are always recomputed from real
features, as the reference implementation does; the K/V of the tree nodes live only inside
``propose``. The output at the newest pair, ``last``, seeds the next tree.

**Tree policies** (:class:`DynamicTree`, :class:`~specjax.tree.StaticTree`,
:class:`SampledChain`), all at static shapes for any batch:

* EAGLE-2's dynamic tree: level 0 is the top-k of ``last``'s logits; each of ``depth`` draft
  calls feeds the k nodes of the current expansion set (visibility: the committed pairs plus
  the nodes' own ancestors), gives each node its top-k children scored by cumulative
  log-probability, and keeps the global top-k of those k * k as the next set. Every candidate
  enters a pool of ``k + depth * k * k`` entries; the ``n_nodes - 1`` best by score, in pool
  order, form the tree (:func:`expand_dynamic`).
* A static tree (EAGLE-1's ``mc_sim_7b_63``, or a chain): node ``i`` takes the ``r``-th most
  likely token of its parent's logits, ``r`` its rank among its siblings; one draft call per
  level feeds that level's inner nodes.
* A sampled chain: each draft is drawn from the drafter's distribution processed with the
  row's own temperature / top-k / top-p, and verification uses that real q.

Params are a pytree ``{"drafter": own weights, "target": the target's params}`` (the
target's arrays are shared, not copied: the drafter reads the embedding, and EAGLE-1 the head,
through the :class:`~specjax.targets.DraftingTarget` protocol)::

    own = {
      "fc": [n_taps * E, D]   (EAGLE-1: [2E, D], plus "fc_bias": [D] when cfg.fc_bias)
      "layer": {"attn_norm": [D], "hidden_norm": [D]   (EAGLE-3 only)
                "wqkv": [in, K, G + 2, H] (in = 2D for EAGLE-3, D for EAGLE-1), "wo": [N * H, D],
                "mlp_norm": [D], "w_gate_up": [D, 2, F], "w_down": [F, D]}
      "final_norm": [D], "lm_head": [D, Vd], "d2t": [Vd] int32   (EAGLE-3 only)
      "token_order": [V] int32   (EAGLE-1, optional: target ids, the most frequent in the
                                  training data first; not trained)
    }

**One-row copies.** :func:`drafter_params` adds the copies of
:func:`specjax.io.layout.with_drafter_row_weights` (``fc_t``, the layer's ``*_t``, EAGLE-3's
``lm_head_t`` [Vd, D]) when the target's params carry theirs, so the draft calls multiply as
the target's passes do: one row by XLA's fastest layout, 2 to 64 float32 rows on the CPU
kernel (:func:`specjax.models.layers.matmul_nt`). The copies of a bfloat16 checkpoint's
weights are bfloat16 where the kernel runs (:func:`specjax.io.layout.drafter_own`), and then
every draft call, one row included, multiplies on the kernel at half the bytes.

**An EAGLE-1 draft vocabulary.** The target's head over every drafted node is most of an
EAGLE-1 draft call on a small target; with ``EagleDrafter(vocab=Vd)`` it scores only the Vd
first ids of ``token_order`` (:mod:`specjax.drafters.vocab`), whose rows of the target's head
:func:`drafter_params` gathers once (``params["head"] = {"ids": [Vd] int32, "rows": [Vd,
E]}``), as a DFlash drafter does. Drafts come from those ids only and a sampled chain's q is
its distribution over them (0 elsewhere), so every policy stays lossless.

Axis legend as in :mod:`specjax.models.layers`, plus E target width, Vd draft vocabulary,
k top-k, M nodes fed in one draft call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.config import ModelConfig
from specjax.drafters import vocab as vocab_lib
from specjax.drafters.base import (CATCH_UP, Accepted, Context, Prefill, Proposal,
                                   chain_parents, check_shapes)
from specjax.io import layout
from specjax.models import attention as attn
from specjax.models import cache as cache_lib
from specjax.models import layers
from specjax.tree import StaticTree


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """An EAGLE drafter's shape.

    Attributes:
      version: 1 or 3.
      layer: the decoder layer's hyper-parameters (``n_layers = 1``; ``vocab_size`` = Vd, the
        head's vocabulary: the target's V for EAGLE-1).
      target_vocab_size: V.
      target_d_model: E.
      taps: the target taps the drafter reads: EAGLE-3 the inputs of layers
        {2, L // 2, L - 3} (tap ``i`` = the residual after ``i`` layers), EAGLE-1 the final
        normed state (``specjax.models.target.FINAL_NORMED``).
      fc_bias: EAGLE-1's ``fc`` has a bias (the Vicuna checkpoints; LLaMA-3 ones have none).
    """

    version: int
    layer: ModelConfig
    target_vocab_size: int
    target_d_model: int
    taps: tuple[int, ...]
    fc_bias: bool = False

    def __post_init__(self):
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {self.version}")
        if self.layer.n_layers != 1:
            raise ValueError(f"an EAGLE drafter has one decoder layer, got {self.layer.n_layers}")
        if not self.taps:
            raise ValueError("an EAGLE drafter needs at least one target tap")
        if self.version == 1:
            if self.layer.d_model != self.target_d_model:
                raise ValueError(f"EAGLE-1 drafts target features: its width "
                                 f"{self.layer.d_model} must be the target's {self.target_d_model}")
            if self.layer.vocab_size != self.target_vocab_size:
                raise ValueError("EAGLE-1 scores with the target's head: vocab_size "
                                 f"{self.layer.vocab_size} != {self.target_vocab_size}")
            if len(self.taps) != 1:
                raise ValueError(f"EAGLE-1 reads one feature, got taps {self.taps}")
        elif self.layer.vocab_size > self.target_vocab_size:
            raise ValueError(f"draft vocabulary {self.layer.vocab_size} exceeds the target's "
                             f"{self.target_vocab_size}")

    @property
    def d_model(self) -> int:
        return self.layer.d_model

    @property
    def draft_vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def feature_width(self) -> int:
        """The width of the target features of one position: ``len(taps) * E``."""
        return len(self.taps) * self.target_d_model

    @classmethod
    def eagle3(cls, target_cfg: ModelConfig, *, draft_vocab_size: int | None = None,
               d_ff: int | None = None, rope_theta: float = 10000.0,
               dtype: str | None = None, taps: tuple[int, ...] | None = None) -> EagleConfig:
        """EAGLE-3 for ``target_cfg``: the target's widths and heads, taps
        :func:`eagle3_taps` (or ``taps``), RoPE base 10000 with no scaling (what the official
        drafters were trained with, whatever the target uses), and ``draft_vocab_size`` ids
        (default: the full vocabulary)."""
        taps = tuple(taps) if taps is not None else eagle3_taps(target_cfg.n_layers)
        layer = target_cfg.replace(
            n_layers=1, vocab_size=draft_vocab_size or target_cfg.vocab_size,
            d_ff=d_ff or target_cfg.d_ff, rope_theta=rope_theta, rope_scaling=None,
            tie_embeddings=False, arch="llama", dtype=dtype or target_cfg.dtype)
        return cls(3, layer, target_cfg.vocab_size, target_cfg.d_model, taps)

    @classmethod
    def eagle1(cls, target_cfg: ModelConfig, *, fc_bias: bool = False,
               dtype: str | None = None) -> EagleConfig:
        """EAGLE-1 for ``target_cfg``: the target's layer shapes and RoPE, its final normed
        state as the feature, its head as the drafter's."""
        from specjax.models.target import FINAL_NORMED

        layer = target_cfg.replace(n_layers=1, tie_embeddings=False, arch="llama",
                                   dtype=dtype or target_cfg.dtype)
        return cls(1, layer, target_cfg.vocab_size, target_cfg.d_model, (FINAL_NORMED,),
                   fc_bias)


def eagle3_taps(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target taps: the inputs of layers 2, L // 2 and L - 3 (low, mid, high), as
    tap ids (tap i = the residual stream after i layers); for L = 30: (2, 15, 27)."""
    if n_layers < 4:
        raise ValueError(f"EAGLE-3 taps the input of layer L - 3 >= 1: it needs a target of at "
                         f"least 4 layers, got {n_layers}")
    return (2, n_layers // 2, n_layers - 3)


def init_params(cfg: EagleConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """Random drafter weights (the ``"drafter"`` half of the params): normal(0, scale)
    matrices, unit norms, zero bias; EAGLE-3's ``d2t`` maps draft ids onto target ids
    ``0 .. Vd - 1`` (replace it with :func:`draft_vocab` of real data before training)."""
    lc = cfg.layer
    d, k, g, h, f = lc.d_model, lc.n_kv_heads, lc.q_per_kv, lc.head_dim, lc.d_ff
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    dt = lc.jnp_dtype

    def normal(*shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    fc_in = cfg.feature_width if cfg.version == 3 else 2 * cfg.target_d_model
    layer = {"wqkv": normal(2 * d if cfg.version == 3 else d, k, g + 2, h),
             "wo": normal(lc.n_heads * h, d), "mlp_norm": jnp.ones((d,), dt),
             "w_gate_up": normal(d, 2, f), "w_down": normal(f, d)}
    own = {"fc": normal(fc_in, d), "layer": layer}
    if cfg.version == 3:
        layer["attn_norm"] = jnp.ones((d,), dt)
        layer["hidden_norm"] = jnp.ones((d,), dt)
        own["final_norm"] = jnp.ones((d,), dt)
        own["lm_head"] = normal(d, cfg.draft_vocab_size)
        own["d2t"] = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)
    elif cfg.fc_bias:
        own["fc_bias"] = jnp.zeros((d,), dt)
    return own


def draft_vocab(counts: np.ndarray, size: int) -> np.ndarray:
    """EAGLE-3's ``d2t`` from token counts: the ``size`` most frequent target ids, ascending.

    Args:
      counts: [V] how often each target id occurs as a trained-on token.
      size: Vd.
    Returns:
      [Vd] int32 offsets, ``target_id = i + d2t[i]``. Ties (unseen ids included) go to the
      smaller id, so a vocabulary larger than the data's still has exactly Vd ids.
    """
    used = vocab_lib.top_ids(vocab_lib.frequency_order(counts), size)
    return (used - np.arange(size)).astype(np.int32)


def check_params(cfg: EagleConfig, own: dict) -> None:
    """Raises ValueError when ``own`` does not fit ``cfg`` (keys, shapes, ``d2t`` range, an
    EAGLE-1 ``token_order`` that does not rank every target id once)."""
    weights = {k: v for k, v in own.items() if k != "token_order"}
    check_shapes(f"EAGLE-{cfg.version}", jax.eval_shape(lambda: init_params(cfg)), weights)
    if "token_order" in own:
        if cfg.version != 1:
            raise ValueError("an EAGLE-3 drafter's draft vocabulary is its d2t; a token_order "
                             "ranks the target's head for EAGLE-1")
        vocab_lib.check_order(np.asarray(own["token_order"]), cfg.target_vocab_size)
    if cfg.version == 3:
        ids = np.arange(cfg.draft_vocab_size) + np.asarray(own["d2t"])
        if ids.min() < 0 or ids.max() >= cfg.target_vocab_size:
            raise ValueError(f"d2t maps draft ids to target ids in [{ids.min()}, {ids.max()}], "
                             f"outside the target vocabulary of {cfg.target_vocab_size}")
        if np.any(np.diff(ids) <= 0):
            raise ValueError("d2t must map draft ids to strictly increasing target ids")


# ----------------------------------------------------------------------------------------
# The draft layer, as pure functions of the params.


def layer_inputs(cfg: EagleConfig, target, params: dict, tokens: jax.Array, hidden: jax.Array,
                  from_target: bool) -> tuple[jax.Array, jax.Array]:
    """``(x [B, T, in], residual [B, T, D])`` of pairs (``hidden`` [B, T, n_taps * E] target
    features when ``from_target``, else [B, T, D] the drafter's own outputs; ``tokens`` [B, T]
    target ids)."""
    own, lc = params["drafter"], cfg.layer
    e = target.embed(params["target"], tokens).astype(lc.jnp_dtype)
    if cfg.version == 3:
        h = layers.linear(hidden.astype(lc.jnp_dtype), own, "fc") if from_target else hidden
        p = own["layer"]
        x = jnp.concatenate([layers.rms_norm(e, p["attn_norm"], lc.norm_eps),
                             layers.rms_norm(h, p["hidden_norm"], lc.norm_eps)], axis=-1)
        return x, h
    x = layers.linear(jnp.concatenate([e, hidden.astype(lc.jnp_dtype)], axis=-1), own, "fc")
    if cfg.fc_bias:
        x = x + own["fc_bias"]
    return x, x


def decoder_layer(cfg: EagleConfig, own: dict, x, residual, positions, blocks_of):
    """The draft layer on pairs: ``(out [B, T, D], k_rows, v_rows [B * K, T, H])``.

    ``blocks_of(k_rows, v_rows)`` returns the key blocks the queries attend to (it decides
    where the pairs' own keys go: into a cache, or a fresh block).
    """
    lc, p = cfg.layer, own["layer"]
    cos, sin = layers.rope_tables(lc, positions)
    q, k, v = layers.project_qkv(p, lc, x, cos, sin)
    k_rows, v_rows = layers.kv_rows(k), layers.kv_rows(v)
    h = residual + layers.attention_out(p, lc, q, blocks_of(k_rows, v_rows))
    return h + layers.mlp(p, lc, h), k_rows, v_rows


def draft_logits(cfg: EagleConfig, target, params: dict, out: jax.Array) -> jax.Array:
    """Float32 logits of the drafter's outputs [..., D]: over Vd draft ids (EAGLE-3, own head
    after the final norm, or its copy ``lm_head_t``: :func:`specjax.models.layers.head_logits`)
    or the target's V (EAGLE-1, the target's head)."""
    if cfg.version == 1:
        return target.lm_head(params["target"], out)
    own = params["drafter"]
    h = layers.rms_norm(out, own["final_norm"], cfg.layer.norm_eps)
    return layers.head_logits(h, own["lm_head"], own.get("lm_head_t"))


# ----------------------------------------------------------------------------------------
# Tree policies.


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree (module docstring; the reference's ``topK_genrate``).

    Attributes:
      n_nodes: N, the verified tree's size with the root (the reference's ``total_token``).
      depth: draft calls per cycle; the deepest draft sits at depth ``depth + 1``.
      top_k: k, children per expanded node and nodes expanded per level.
    """

    n_nodes: int = 60
    depth: int = 7
    top_k: int = 10

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1:
            raise ValueError(f"need depth >= 1 and top_k >= 1, got {self.depth}, {self.top_k}")
        if not 2 <= self.n_nodes <= 1 + self.pool_size:
            raise ValueError(f"n_nodes must be in [2, {1 + self.pool_size}] (the root plus at "
                             f"most the pool of k + depth * k^2 candidates), got {self.n_nodes}")

    @property
    def pool_size(self) -> int:
        return self.top_k + self.depth * self.top_k ** 2


@dataclasses.dataclass(frozen=True)
class SampledChain:
    """A chain of ``length`` drafts drawn from the drafter's processed distribution (real q)."""

    length: int = 4

    def __post_init__(self):
        if self.length < 1:
            raise ValueError(f"chain length must be >= 1, got {self.length}")


def expand_dynamic(step, last_logp: jax.Array, last: jax.Array, tree: DynamicTree):
    """EAGLE-2 expansion and rerank at static shapes.

    Args:
      step: ``step(level, hidden [B, k, D], draft_ids [B, k], visible [B, k, depth * k])
        -> (logp [B, k, Vd], out [B, k, D])``: one draft call on the k nodes of an expansion
        set at depth ``level`` (0-based), where ``visible[b, i, j]`` says whether fed node j
        (numbered in feeding order, k per level) is node i itself or one of its ancestors.
      last_logp: [B, Vd] log-probabilities of the token after the root.
      last: [B, D] the output that ``last_logp`` came from.
      tree: the policy.
    Returns:
      ``(draft_ids [B, N - 1], parents [B, N], valid [B, N], path_logp [B, N - 1])``: the
      selected candidates in pool order (the reference's order), each node's parent index in
      the tree (0 = root), whether the node is usable (False only for a candidate whose
      parent lost the rerank, which log-probability ties alone can cause) and each
      candidate's cumulative log-probability (the score it was ranked by).
    """
    k, depth = tree.top_k, tree.depth
    b = last_logp.shape[0]
    scores, ids = jax.lax.top_k(last_logp, k)  # [B, k]
    pool_scores, pool_ids = [scores], [ids]
    pool_parent = [jnp.full((b, k), -1, jnp.int32)]  # pool index of each entry's parent
    cur_pool = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # pool index of set
    hidden = jnp.broadcast_to(last[:, None], (b, k, last.shape[-1]))
    eye = jnp.eye(k, dtype=bool)
    visible = jnp.zeros((b, k, depth * k), bool).at[:, :, :k].set(eye)
    for level in range(depth):
        logp, out = step(level, hidden, ids, visible)
        child_lp, child_ids = jax.lax.top_k(logp, k)  # [B, k, k]
        child_scores = (scores[:, :, None] + child_lp).reshape(b, k * k)
        pool_scores.append(child_scores)
        pool_ids.append(child_ids.reshape(b, k * k))
        pool_parent.append(jnp.repeat(cur_pool, k, axis=1))
        if level + 1 < depth:
            scores, pick = jax.lax.top_k(child_scores, k)  # [B, k], over the k * k children
            rank = pick // k  # which expanded node each winner descends from
            ids = jnp.take_along_axis(child_ids.reshape(b, k * k), pick, axis=1)
            hidden = jnp.take_along_axis(out, rank[..., None], axis=1)
            cur_pool = k + level * k * k + pick
            visible = jnp.take_along_axis(visible, rank[..., None], axis=1)
            visible = visible.at[:, :, (level + 1) * k:(level + 2) * k].set(eye)
    pool_scores = jnp.concatenate(pool_scores, axis=1)  # [B, pool]
    pool_ids = jnp.concatenate(pool_ids, axis=1)
    pool_parent = jnp.concatenate(pool_parent, axis=1)
    _, sel = jax.lax.top_k(pool_scores, tree.n_nodes - 1)
    sel = jnp.sort(sel, axis=1).astype(jnp.int32)  # [B, N - 1] pool order
    draft_ids = jnp.take_along_axis(pool_ids, sel, axis=1)
    path_logp = jnp.take_along_axis(pool_scores, sel, axis=1)
    parent_pool = jnp.take_along_axis(pool_parent, sel, axis=1)  # [B, N - 1]
    # The parent's rank in the sorted selection, and whether it was selected at all.
    where = jnp.sum(sel[:, None, :] < parent_pool[:, :, None], axis=-1, dtype=jnp.int32)
    found = jnp.any(sel[:, None, :] == parent_pool[:, :, None], axis=-1)
    is_root_child = parent_pool < 0
    parents = jnp.where(is_root_child | ~found, 0, where + 1)
    valid = is_root_child | found
    ones = jnp.ones((b, 1), bool)
    return (draft_ids, jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents], axis=1),
            jnp.concatenate([ones, valid], axis=1), path_logp)


def _static_plan(tree: StaticTree):
    """NumPy bookkeeping of a static tree's drafting: per level, its nodes with their parents
    and sibling ranks, and the inner nodes (those with children) fed at that level."""
    parents = np.asarray(tree.parents)
    depth = np.asarray(tree.depth)
    rank = np.zeros_like(parents)
    for i in range(1, parents.size):
        rank[i] = np.sum(parents[1:i] == parents[i])
    has_child = np.zeros(parents.size, bool)
    has_child[parents[1:]] = True
    fed = [i for i in range(1, parents.size) if has_child[i]]  # feeding order
    col = {node: c for c, node in enumerate(fed)}
    anc = np.asarray(tree.ancestor, bool)
    levels = []
    for lvl in range(1, tree.max_depth + 1):
        nodes = np.flatnonzero(depth == lvl)
        inner = [i for i in nodes if has_child[i]]
        vis = np.zeros((len(inner), max(len(fed), 1)), bool)
        for r, i in enumerate(inner):
            for j in fed:
                vis[r, col[j]] = anc[i, j]
        levels.append((nodes, inner, vis))
    return rank, fed, levels


# ----------------------------------------------------------------------------------------
# The drafter.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
    """What an EAGLE drafter carries between cycles.

    Attributes:
      cache: the draft layer's K/V of the committed pairs; ``lengths[b]`` pairs, i.e. every
        committed position but the root's.
      last: [B, D] the layer's output at the newest pair (it predicts the token after the
        root).
    """

    cache: cache_lib.KVCache
    last: jax.Array


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """An EAGLE drafter for the speculative loop (:mod:`specjax.drafters.base`).

    Attributes:
      cfg: the drafter's shape.
      target: the static target (a :class:`~specjax.targets.DraftingTarget`) whose embedding
        (and, for EAGLE-1, head) the drafter reads from ``params["target"]``.
      policy: a :class:`DynamicTree`, a :class:`~specjax.tree.StaticTree` (a chain is
        ``StaticTree.chain(n)``) or a :class:`SampledChain`.
      vocab: EAGLE-1 only, Vd: draft from the Vd most frequent ids of the drafter's
        ``token_order`` only (module docstring; the params from :func:`drafter_params` with
        the same ``vocab``); None scores the target's whole vocabulary. EAGLE-3 drafts from
        its own head's ids.
    """

    cfg: EagleConfig
    target: Any
    policy: Any = DynamicTree()
    vocab: int | None = None

    def __post_init__(self):
        if not isinstance(self.policy, (DynamicTree, StaticTree, SampledChain)):
            raise ValueError(f"unknown tree policy {self.policy!r}")
        if isinstance(self.policy, StaticTree) and self.policy.n_nodes < 2:
            raise ValueError("a static tree needs at least one draft node")
        if self.vocab is not None:
            resolve_vocab(self.cfg, self.vocab)  # EAGLE-1 only
            vocab_lib.check_size(self.vocab, self.cfg.target_vocab_size)
        # The ids the head scores, of which each expanded node takes its best few.
        scored = self.vocab or (self.cfg.draft_vocab_size if self.cfg.version == 3
                                else self.cfg.target_vocab_size)
        children = (self.policy.top_k if isinstance(self.policy, DynamicTree) else
                    int(_static_plan(self.policy)[0].max()) + 1
                    if isinstance(self.policy, StaticTree) else 1)
        if children > scored:
            raise ValueError(f"the tree takes up to {children} children of a node from a head "
                             f"of {scored} ids; draft from at least {children} ids or use a "
                             "narrower tree")

    # -- static description ------------------------------------------------------------

    @property
    def n_nodes(self) -> int:
        if isinstance(self.policy, SampledChain):
            return self.policy.length + 1
        return self.policy.n_nodes

    @property
    def max_depth(self) -> int:
        if isinstance(self.policy, DynamicTree):
            return self.policy.depth + 1
        if isinstance(self.policy, SampledChain):
            return self.policy.length
        return self.policy.max_depth

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.taps

    @property
    def static_tree(self) -> StaticTree | None:
        if isinstance(self.policy, SampledChain):
            return StaticTree.chain(self.n_nodes)
        return self.policy if isinstance(self.policy, StaticTree) else None

    def check_target(self, target) -> None:
        """Raises ValueError when the drafter's widths, vocabulary or taps do not fit
        ``target`` (a :class:`~specjax.targets.DraftingTarget`)."""
        from specjax.targets import require_drafting_target

        cfg = self.cfg
        require_drafting_target("EAGLE", target, cfg.target_vocab_size)
        if cfg.target_d_model != target.d_model:
            raise ValueError(f"the drafter reads features of width {cfg.target_d_model}, the "
                             f"target's hidden size is {target.d_model}; drafter and target "
                             "mismatch")

    # -- feeding pairs ---------------------------------------------------------------

    def _feed(self, params, state: EagleState, tokens, hidden, n_new) -> EagleState:
        """Appends pairs to the cache: ``tokens`` [B, T] target ids, ``hidden`` [B, T, n * E]
        target features, the first ``n_new[b]`` of them real (the rest scratch)."""
        cache = state.cache
        lc, t = self.cfg.layer, tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        x, residual = layer_inputs(self.cfg, self.target, params, tokens, hidden, True)

        def blocks_of(k_rows, v_rows):
            nonlocal cache
            k_buf = cache_lib.write_rows(cache.k[0], cache_lib.to_storage(k_rows, lc),
                                         cache.lengths)
            v_buf = cache_lib.write_rows(cache.v[0], cache_lib.to_storage(v_rows, lc),
                                         cache.lengths)
            cache = cache_lib.KVCache((k_buf,), (v_buf,), cache.lengths)
            return [attn.KeyBlock(cache_lib.from_storage(k_buf, lc),
                                  cache_lib.from_storage(v_buf, lc), attn.Causal(cache.lengths))]

        out, _, _ = decoder_layer(self.cfg, params["drafter"], x, residual, positions, blocks_of)
        newest = jnp.take_along_axis(out, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
        last = jnp.where((n_new > 0)[:, None], newest, state.last)
        return EagleState(cache_lib.advance(cache, n_new), last)

    def init(self, params, prefill: Prefill) -> EagleState:
        """Feeds the prompt's pairs: position ``j``'s target features with token ``j + 1``
        (the first generated token after the last prompt position)."""
        b, p = prefill.prompt.shape
        lc = self.cfg.layer
        # Pairs, a cycle's commit pass and a catch-up are written past the committed pairs:
        # leave room.
        cache = cache_lib.init_cache(lc, b, prefill.capacity + max(self.max_depth + 1, CATCH_UP))
        state = EagleState(cache, jnp.zeros((b, lc.d_model), lc.jnp_dtype))
        seq = jnp.concatenate([prefill.prompt, jnp.zeros((b, 1), jnp.int32)], axis=1)
        seq = jax.vmap(lambda s, t, i: s.at[i].set(t))(seq, prefill.first, prefill.prompt_len)
        hidden = prefill.taps.reshape(b, p, -1)
        return self._feed(params, state, seq[:, 1:], hidden, prefill.prompt_len)

    def commit(self, params, state: EagleState, ctx: Context, accepted: Accepted) -> EagleState:
        """Feeds the cycle's committed pairs: the path's nodes (old root first) with their
        target features, each paired with the token committed after it."""
        return self.catch_up(params, state, ctx, accepted.taps, accepted.n_committed)

    def catch_up(self, params, state: EagleState, ctx: Context, taps: jax.Array,
                 n_new: jax.Array) -> EagleState:
        """Feeds the pairs of the ``n_new[b]`` positions after the fed ones: their target
        features ``taps`` [B, T, n, E] (the first ``n_new[b]`` real), each paired with the
        token committed after it in ``ctx``."""
        b, t = taps.shape[:2]
        idx = state.cache.lengths[:, None] + 1 + jnp.arange(t, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(ctx.seq, jnp.minimum(idx, ctx.seq.shape[1] - 1), axis=1)
        return self._feed(params, state, tokens, taps.reshape(b, t, -1), n_new)

    # -- drafting ----------------------------------------------------------------------

    def _head(self, params) -> dict | None:
        """``params["head"]`` (the gathered rows of an EAGLE-1 draft vocabulary), or None."""
        return vocab_lib.checked_head(params, self.vocab, "eagle")

    def _logits(self, params, out: jax.Array) -> jax.Array:
        """Float32 logits [..., Vd] of the layer's outputs [..., D] over the draft ids."""
        head = self._head(params)
        if head is None:
            return draft_logits(self.cfg, self.target, params, out)
        return layers.matmul_nt(out, head["rows"])

    def _ids(self, params, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target ids."""
        if self.cfg.version == 3:
            return draft_ids + params["drafter"]["d2t"][draft_ids]
        head = self._head(params)
        return draft_ids if head is None else head["ids"][draft_ids]

    def _full(self, params, logits: jax.Array) -> jax.Array:
        """Draft-vocabulary logits [..., Vd] scattered to the target's [..., V] (-inf
        elsewhere)."""
        cfg = self.cfg
        if logits.shape[-1] == cfg.target_vocab_size:
            return logits
        ids = self._ids(params, jnp.arange(logits.shape[-1]))
        full = jnp.full(logits.shape[:-1] + (cfg.target_vocab_size,), -jnp.inf, logits.dtype)
        return full.at[..., ids].set(logits)

    def _node_step(self, params, state: EagleState, n_fed: int):
        """A draft call on tree nodes, keeping their K/V in a block of ``n_fed`` fresh keys.

        Returns ``step(col, hidden [B, M, D], tokens [B, M] target ids, visible
        [B, M, n_fed], level) -> (logits [B, M, Vd], out [B, M, D])``: nodes at depth
        ``level + 1`` (RoPE position ``lengths + level``) whose keys go to fresh columns
        ``col .. col + M`` and who attend to the committed pairs plus ``visible``.
        """
        cfg, lc, cache = self.cfg, self.cfg.layer, state.cache
        b = cache.lengths.shape[0]
        rows = b * lc.n_kv_heads
        buf = {"k": jnp.zeros((rows, n_fed, lc.head_dim), lc.jnp_dtype),
               "v": jnp.zeros((rows, n_fed, lc.head_dim), lc.jnp_dtype)}
        committed = attn.KeyBlock(cache_lib.from_storage(cache.k[0], lc),
                                  cache_lib.from_storage(cache.v[0], lc), attn.Prefix(cache.lengths))

        def step(col, hidden, tokens, visible, level):
            m = tokens.shape[1]
            x, residual = layer_inputs(cfg, self.target, params, tokens, hidden, False)
            positions = jnp.broadcast_to(cache.lengths[:, None] + level, (b, m))

            def blocks_of(k_rows, v_rows):
                buf["k"] = jax.lax.dynamic_update_slice_in_dim(buf["k"], k_rows, col, axis=1)
                buf["v"] = jax.lax.dynamic_update_slice_in_dim(buf["v"], v_rows, col, axis=1)
                return [committed, attn.KeyBlock(buf["k"], buf["v"], attn.Dense(visible))]

            out, _, _ = decoder_layer(cfg, params["drafter"], x, residual, positions, blocks_of)
            return self._logits(params, out), out

        return step

    def skip(self, params, state: EagleState, ctx: Context) -> EagleState:
        """Nothing to catch up: ``commit`` feeds every committed pair, drafted or not."""
        return state

    def propose(self, params, state: EagleState, ctx: Context, rng):
        """Drafts the policy's proposal; every node carries its path confidence (the product
        of the drafter's probabilities along its path, the dynamic tree's ranking score)."""
        policy = self.policy
        root_logits = self._logits(params, state.last)  # [B, Vd]
        if isinstance(policy, DynamicTree):
            k = policy.top_k
            node_step = self._node_step(params, state, policy.depth * k)

            def step(level, hidden, ids, visible):
                logits, out = node_step(level * k, hidden, self._ids(params, ids), visible,
                                        level)
                return jax.nn.log_softmax(logits, axis=-1), out

            ids, parents, valid, path_logp = expand_dynamic(
                step, jax.nn.log_softmax(root_logits, axis=-1), state.last, policy)
            tokens = jnp.concatenate([ctx.root[:, None], self._ids(params, ids)], axis=1)
            conf = jnp.exp(jnp.pad(path_logp, ((0, 0), (1, 0))))  # the root's log-prob is 0
            return Proposal(tokens, parents, valid, confidence=jnp.where(valid, conf, 0.0)), state
        if isinstance(policy, SampledChain):
            return self._sampled_chain(params, state, ctx, rng, root_logits), state
        return self._static(params, state, ctx, root_logits), state

    def _static(self, params, state, ctx, root_logits) -> Proposal:
        tree = self.policy
        rank, fed, levels = _static_plan(tree)
        n = tree.n_nodes
        b = root_logits.shape[0]
        parents = np.asarray(tree.parents)
        node_step = self._node_step(params, state, max(len(fed), 1))
        need = int(rank.max()) + 1
        # top[i]: [B, need] (log-probabilities, draft ids) of node i's most likely children
        # (node 0: the root).
        top = {0: jax.lax.top_k(jax.nn.log_softmax(root_logits, axis=-1), need)}
        out_of = {0: state.last}
        ids, path_lp = [None] * n, [jnp.zeros((b,))] + [None] * (n - 1)
        col = 0
        for lvl, (nodes, inner, vis) in enumerate(levels):
            for i in nodes:
                lp, top_ids = top[int(parents[i])]
                ids[i] = top_ids[:, rank[i]]
                path_lp[i] = path_lp[int(parents[i])] + lp[:, rank[i]]
            if not inner:
                continue
            hidden = jnp.stack([out_of[int(parents[i])] for i in inner], axis=1)
            node_ids = jnp.stack([ids[i] for i in inner], axis=1)
            visible = jnp.broadcast_to(vis, (b,) + vis.shape)
            logits, out = node_step(col, hidden, self._ids(params, node_ids), visible, lvl)
            col += len(inner)
            node_lp, node_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), need)
            for r, i in enumerate(inner):  # node_lp, node_ids: [B, M, need]
                top[i], out_of[i] = (node_lp[:, r], node_ids[:, r]), out[:, r]
        drafts = self._ids(params, jnp.stack(ids[1:], axis=1))
        tokens = jnp.concatenate([ctx.root[:, None], drafts], axis=1)
        return Proposal(tokens, jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n)),
                        jnp.ones((b, n), bool), confidence=jnp.exp(jnp.stack(path_lp, axis=1)))

    def _sampled_chain(self, params, state, ctx, rng, root_logits) -> Proposal:
        cfg = self.cfg
        length = self.policy.length
        b = root_logits.shape[0]
        node_step = self._node_step(params, state, max(length - 1, 1))
        keys = jax.random.split(rng, length)
        logits, hidden = root_logits, state.last
        drafts, q_logits, lp = [], [], [jnp.zeros((b,))]
        eye = np.eye(max(length - 1, 1), dtype=bool)
        for i in range(length):
            full = self._full(params, logits)  # [B, V], what draft i is drawn from
            tok = sampling.sample_rows(jax.random.split(keys[i], b), full, ctx.sp)
            drafts.append(tok)
            q_logits.append(full)
            own_lp = jnp.take_along_axis(jax.nn.log_softmax(full, axis=-1), tok[:, None], axis=1)
            lp.append(lp[-1] + own_lp[:, 0])
            if i + 1 < length:
                # The chain's fed nodes see all earlier ones: a lower-triangular visibility.
                visible = jnp.broadcast_to(np.tril(eye)[i:i + 1], (b, 1, eye.shape[1]))
                logits, out = node_step(i, hidden[:, None], tok[:, None], visible, i)
                logits, hidden = logits[:, 0], out[:, 0]
        tokens = jnp.concatenate([ctx.root[:, None], jnp.stack(drafts, axis=1)], axis=1)
        v = cfg.target_vocab_size
        dl = jnp.concatenate([jnp.stack(q_logits, axis=1), jnp.zeros((b, 1, v), jnp.float32)],
                             axis=1)
        return Proposal(tokens, chain_parents(b, self.n_nodes), jnp.ones((b, self.n_nodes), bool),
                        dl, jnp.exp(jnp.stack(lp, axis=1)))


def resolve_vocab(cfg: EagleConfig, given: int | str | None) -> int | None:
    """The draft vocabulary to draft from (an :class:`EagleDrafter`'s ``vocab``): ``given``
    ids for EAGLE-1, None (the target's whole head) for None or ``"full"``.

    Raises:
      ValueError: a size for an EAGLE-3 drafter, which drafts from its own head's ids.
    """
    if given is None or given == "full":
        return None
    if cfg.version != 1:
        raise ValueError(f"an EAGLE-3 drafter drafts from its own head's {cfg.draft_vocab_size} "
                         "ids (d2t); a draft vocabulary of the target's head is for EAGLE-1")
    return int(given)


def drafter_params(own: dict, target_params: dict, *, target=None,
                   vocab: int | None = None, row_weights: bool | None = None) -> dict:
    """The params pytree an :class:`EagleDrafter` takes: its own weights and the target's, and
    for an EAGLE-1 drafter with ``vocab`` = Vd the rows of ``target``'s head (a
    :class:`~specjax.targets.DraftingTarget`) of the Vd first ids of ``own["token_order"]``.

    ``row_weights``: the one-row copies of ``own``, as :func:`specjax.io.layout.drafter_own`
    decides them (None, the default: when ``target_params`` carry the target's).

    Raises:
      ValueError: ``vocab`` without a ``target``, or for a drafter without a ``token_order``.
    """
    params = {"drafter": layout.drafter_own(own, target_params, row_weights),
              "target": target_params}
    if vocab is not None:
        params["head"] = vocab_lib.gather_head(own, target, target_params, vocab, "EAGLE-1")
    return params

