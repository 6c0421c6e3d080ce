"""DFlash: a block-diffusion drafter that fills a whole block in one parallel pass.

The drafter is a small stack of decoder layers with no embedding or head of its own: the block
``[root, mask × (Bk - 1)]`` at positions ``lengths .. lengths + Bk - 1`` is embedded with the
target's frozen embedding (the mask as a token id of the target vocabulary, or a learned
``mask_embedding``), and the target's frozen head scores the final normed outputs; block
position ``k`` predicts the token ``k`` places after the root (no shift).

**KV injection.** The target's residual streams at ``target_layer_ids`` (the *outputs* of
those layers, i.e. tap ids one above them) are concatenated per position and fused once,
``ctx = hidden_norm(fc(taps))``. In every draft layer, ctx goes through that layer's own k/v
projections (and k norm), with RoPE at the positions the taps came from, and its keys/values
are kept in the drafter's cache (:class:`DFlashState`): persistent context in every layer,
never in the residual stream. A block query sees every cached context key of its row and the
block's own keys: all of them (full-attention layers) or the earlier ones (layers that are
causal: ``sliding_attention`` layers, or all layers when ``is_causal``); a sliding-window
layer also hides context more than ``sliding_window - 1`` positions back.

**Cycle.** ``init`` injects the prompt's taps; ``propose`` runs one pass over the block;
``commit`` injects the target's taps of the nodes the cycle committed (the old root and the
accepted drafts, in path order), so the cache always holds one context entry per position the
target has seen. The block's own keys/values are never kept.

**Proposals** (:class:`BlockChain`, :class:`SampledBlock`, :class:`DDTree`):

* a chain of the per-position argmax (the reference's drafting; deterministic);
* a chain of per-position draws from the processed marginals, verified with those marginals
  as the real q (the draws are independent given the context, so position k's marginal is
  exactly the distribution its token was drawn from, whatever was drawn before it);
* DDTree: the ``n_nodes - 1`` most probable prefixes under the product of the block's
  marginals (raw log-softmax, no temperature, as the reference builds it), best-first, as a
  tree (:func:`ddtree`); verified against the target alone.

Params are ``{"drafter": own, "target": the target's params}``::

    own = {"fc": [n_taps * E, D], "hidden_norm": [D], "norm": [D],
           "layers": [{"attn_norm": [D], "wqkv": [D, K, G + 2, H], "q_norm": [H],
                       "k_norm": [H], "wo": [N * H, D], "mlp_norm": [D],
                       "w_gate_up": [D, 2, F], "w_down": [F, D]}, ...],
           "mask_embedding": [D]   (only when the mask is learned, ``mask_token_id`` None),
           "token_order": [V] int32   (optional: target ids, the most frequent in the
                                       training data first; not trained)}

**One-row copies.** :func:`drafter_params` adds the copies of
:func:`specjax.io.layout.with_drafter_row_weights` (``fc_t`` and every layer's ``*_t``) when the
target's params carry theirs, so a drafted block's products run as a verify pass's do: on the
CPU kernel (:func:`specjax.models.layers.matmul_nt`), by bfloat16 copies of a bfloat16
checkpoint's weights (:func:`specjax.io.layout.drafter_own`: the same products at half the
bytes). The KV injection reads the layers' ``wqkv`` as it is.

**Draft vocabulary.** With ``DFlashDrafter(vocab=Vd)`` the head scores only the Vd first ids
of ``token_order`` (:mod:`specjax.drafters.vocab`): :func:`drafter_params` gathers their rows
of the target's head once, ``params["head"] = {"ids": [Vd] int32, "rows": [Vd, E]}``, and a
pass costs a [D, Vd] product per block position instead of [D, V] (on SmolLM2 the full head
is most of a pass). Proposals are drawn from those ids only; a sampled block's q is its
marginal over them (0 elsewhere), so every policy stays lossless.

Axis legend as in :mod:`specjax.models.layers`, plus E target width (= D), Bk block size,
n taps, Kt top-k per depth.
"""

from __future__ import annotations

import dataclasses
import math
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

LAYER_TYPES = ("full_attention", "sliding_attention")


def default_layer_ids(n_target_layers: int, n_ids: int) -> tuple[int, ...]:
    """The reference's default target layers: ``(L // 2,)`` for one, else ``n_ids`` evenly
    spaced from 1 to L - 3 rounded half to even, as Python's ``round`` does (L = 30, 5 ids:
    (1, 8, 14, 20, 27))."""
    if n_target_layers < 4:
        raise ValueError(f"DFlash taps target layers 1 .. L - 3: it needs a target of at least 4 "
                         f"layers, got {n_target_layers}")
    if n_ids == 1:
        return (n_target_layers // 2,)
    return tuple(round(1 + i * (n_target_layers - 4) / (n_ids - 1)) for i in range(n_ids))


def default_gamma(block_size: int) -> float:
    """The loss decay γ of a block size: 7 / 5 / 4 for 16 / 10 / 8 (the paper's), linear
    between them and continued with the nearest segment's slope outside."""
    points = ((8, 4.0), (10, 5.0), (16, 7.0))
    if block_size <= 10:
        (x0, y0), (x1, y1) = points[0], points[1]
    else:
        (x0, y0), (x1, y1) = points[1], points[2]
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's shape.

    Attributes:
      layer: the draft layers' hyper-parameters (``n_layers`` draft layers, ``d_model`` = the
        target's width, ``vocab_size`` = the target's, ``qk_norm`` as Qwen3).
      block_size: Bk, the block the drafter was trained on (the root plus Bk - 1 masks).
      target_layer_ids: the target layers whose outputs are tapped (the reference's
        numbering: layer i's output is tap ``i + 1``).
      target_n_layers: L of the target the drafter was made for.
      mask_token_id: the target id whose embedding fills the masks, or None for a learned
        ``mask_embedding``.
      layer_types: per draft layer, ``"full_attention"`` or ``"sliding_attention"`` (None:
        all full).
      sliding_window: the window of sliding layers (None when there are none).
      is_causal: None: a layer is causal inside the block iff it is a sliding layer; True or
        False: every layer is (or is not).
      draft_vocab_size: the draft vocabulary the drafter is meant to draft from (the Vd first
        ids of its ``token_order``; module docstring), which ``specjax generate`` and ``specjax
        bench`` take by default; None: the whole vocabulary. Metadata: a
        :class:`DFlashDrafter` drafts from the ``vocab`` it is given.
    """

    layer: ModelConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    target_n_layers: int
    mask_token_id: int | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"a DFlash block holds the root and at least one mask, got "
                             f"block_size={self.block_size}")
        if self.layer_types is None:  # frozen: normalise through object.__setattr__
            object.__setattr__(self, "layer_types", ("full_attention",) * self.layer.n_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if not self.target_layer_ids:
            raise ValueError("DFlash needs at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_n_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are beyond the target's layers "
                             f"0..{self.target_n_layers - 1}")
        types = self.types
        if len(types) != self.layer.n_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} per draft layer "
                             f"({self.layer.n_layers}), got {self.layer_types}")
        if "sliding_attention" in types and not (self.sliding_window or 0) >= self.block_size:
            raise ValueError(f"sliding layers need sliding_window >= block_size "
                             f"{self.block_size}, got {self.sliding_window}")
        v = self.layer.vocab_size
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < v:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target "
                             f"vocabulary of {v}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= v:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {v}]")

    @property
    def types(self) -> tuple[str, ...]:
        """Per draft layer, its attention type (``layer_types``, all full when not given)."""
        return self.layer_types

    @property
    def d_model(self) -> int:
        return self.layer.d_model

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def taps(self) -> tuple[int, ...]:
        """Tap ids (tap i = the residual stream after i layers) of ``target_layer_ids``."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def causal(self, i: int) -> bool:
        """Whether draft layer ``i`` is causal inside the block."""
        if self.is_causal is not None:
            return self.is_causal
        return self.types[i] == "sliding_attention"

    def window(self, i: int) -> int | None:
        """Draft layer ``i``'s sliding window, or None."""
        return self.sliding_window if self.types[i] == "sliding_attention" else None

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, *, n_layers: int = 1, block_size: int = 16,
                   mask_token_id: int | None = None, n_taps: int = 5,
                   target_layer_ids: tuple[int, ...] | None = None, d_ff: int | None = None,
                   dtype: str | None = None) -> DFlashConfig:
        """A drafter for ``target_cfg``: its width, heads, RoPE and vocabulary, Qwen3-style q/k
        norms, ``n_layers`` full-attention layers and the default ``n_taps`` target layers."""
        ids = (tuple(target_layer_ids) if target_layer_ids is not None
               else default_layer_ids(target_cfg.n_layers, n_taps))
        layer = target_cfg.replace(n_layers=n_layers, d_ff=d_ff or target_cfg.d_ff,
                                   arch="qwen3", tie_embeddings=False,
                                   dtype=dtype or target_cfg.dtype)
        return cls(layer, block_size, ids, target_cfg.n_layers, mask_token_id)


def init_params(cfg: DFlashConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """Random drafter weights (the ``"drafter"`` half of the params): normal(0, scale)
    matrices, unit norms, and a normal(0, scale) ``mask_embedding`` when the mask is learned."""
    lc = cfg.layer
    d, k, g, h, f = lc.d_model, lc.n_kv_heads, lc.q_per_kv, lc.head_dim, lc.d_ff
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 4 * lc.n_layers))
    dt = lc.jnp_dtype

    def normal(*shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    ones = lambda n: jnp.ones((n,), dt)  # noqa: E731
    own = {"fc": normal(len(cfg.target_layer_ids) * d, d), "hidden_norm": ones(d),
           "norm": ones(d),
           "layers": [{"attn_norm": ones(d), "wqkv": normal(d, k, g + 2, h), "q_norm": ones(h),
                       "k_norm": ones(h), "wo": normal(lc.n_heads * h, d), "mlp_norm": ones(d),
                       "w_gate_up": normal(d, 2, f), "w_down": normal(f, d)}
                      for _ in range(lc.n_layers)]}
    if cfg.mask_token_id is None:
        own["mask_embedding"] = normal(d)
    return own


def deepen(cfg: DFlashConfig, own: dict, n_layers: int) -> tuple[DFlashConfig, dict]:
    """A drafter of ``n_layers`` that drafts exactly as ``own`` does, to train on from there.

    Layers are appended after the last one, each a copy of it (its type too) with its two
    output projections, ``wo`` and ``w_down``, zeroed: a new layer adds nothing to the residual
    stream until training moves them, and from the first step their gradients see the trained
    attention and MLP activations the copy computes (zero-initialised residual branches, as
    in depth up-scaling).

    Raises:
      ValueError: ``n_layers`` below the drafter's layer count.
    """
    have = cfg.layer.n_layers
    if n_layers < have:
        raise ValueError(f"a drafter of {have} layers cannot be deepened to {n_layers}")
    last = own["layers"][-1]
    new = dict(last, wo=jnp.zeros_like(last["wo"]), w_down=jnp.zeros_like(last["w_down"]))
    deeper = dict(own, layers=list(own["layers"]) + [dict(new) for _ in range(n_layers - have)])
    types = cfg.types + (cfg.types[-1],) * (n_layers - have)
    return dataclasses.replace(cfg, layer=cfg.layer.replace(n_layers=n_layers),
                               layer_types=types), deeper


def check_params(cfg: DFlashConfig, own: dict) -> None:
    """Raises ValueError when ``own`` does not fit ``cfg`` (keys and shapes; a ``token_order``
    that does not rank the vocabulary)."""
    weights = {k: v for k, v in own.items() if k != "token_order"}
    check_shapes("DFlash", jax.eval_shape(lambda: init_params(cfg)), weights)
    if "token_order" in own:
        vocab_lib.check_order(np.asarray(own["token_order"]), cfg.vocab_size)


# ----------------------------------------------------------------------------------------
# The drafter's forward pieces, as pure functions of the params.


def context(cfg: DFlashConfig, own: dict, taps: jax.Array) -> jax.Array:
    """``hidden_norm(fc(taps))``: [B, T, n, E] target taps -> [B, T, D] context."""
    b, t = taps.shape[:2]
    x = layers.linear(taps.reshape(b, t, -1).astype(cfg.layer.jnp_dtype), own, "fc")
    return layers.rms_norm(x, own["hidden_norm"], cfg.layer.norm_eps)


def context_kv(cfg: DFlashConfig, p: dict, ctx: jax.Array, cos: jax.Array, sin: jax.Array):
    """One draft layer's keys and values of context ``ctx`` [B, T, D] through its own k/v
    projections, k norm and RoPE (``cos``/``sin`` [B, T, H/2] of the taps' positions):
    ``(k, v)`` as [B * K, T, H] rows."""
    lc = cfg.layer
    g = lc.q_per_kv
    kv = layers.matmul(ctx, p["wqkv"][:, :, g:], "btd,dkjh->btkjh").astype(ctx.dtype)  # [B, T, K, 2, H]
    k = layers.rms_norm(kv[..., 0, :], p["k_norm"], lc.norm_eps)
    return layers.kv_rows(layers.apply_rope(k, cos, sin)), layers.kv_rows(kv[..., 1, :])


def inject(cfg: DFlashConfig, own: dict, cache: cache_lib.KVCache, taps: jax.Array,
           n_new: jax.Array) -> cache_lib.KVCache:
    """KV injection: writes the context K/V of T new positions into every layer's cache.

    One call for all layers: ``specjax.kernels.kv_injection``'s reference, or its fused Pallas
    kernel when the drafter's layers run ``attention_impl="pallas"`` (``"pallas-interpret"``:
    the same kernel through Pallas's interpreter) and their shapes fit it (a head dim of a
    power of two >= 32, a width with a power-of-two factor >= 16, a cache of >= 16 slots). The
    context keys/values are what :func:`context_kv` computes.

    Args:
      cache: the drafter's cache; row b's new positions are ``lengths[b] .. + T``.
      taps: [B, T, n, E] the target's taps of those positions.
      n_new: [B] int32, how many of the T are real (the rest is scratch past the new length).
    Returns:
      The cache with the K/V written and ``lengths`` advanced by ``n_new``.
    """
    from specjax.kernels import kv_injection as kvi

    lc = cfg.layer
    t = taps.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cos, sin = layers.rope_tables(lc, positions)
    stored = lambda bufs: tuple(cache_lib.from_storage(x, lc) for x in bufs)  # noqa: E731
    args = (context(cfg, own, taps), [p["wqkv"] for p in own["layers"]],
            [p["k_norm"] for p in own["layers"]], cos, sin, stored(cache.k), stored(cache.v),
            cache.lengths)
    half, block_d = lc.head_dim // 2, math.gcd(lc.d_model, 128)
    fits = half >= 16 and not half & (half - 1) and block_d >= 16 and cache.k[0].shape[1] >= 16
    if lc.attention_impl in ("pallas", "pallas-interpret") and fits:
        ks, vs = kvi.kv_injection(*args, eps=lc.norm_eps, block_d=block_d,
                                  interpret=lc.attention_impl == "pallas-interpret")
    else:
        ks, vs = kvi.kv_injection_reference(*args, eps=lc.norm_eps)
    to_storage = lambda bufs: tuple(cache_lib.to_storage(x, lc) for x in bufs)  # noqa: E731
    return cache_lib.KVCache(to_storage(ks), to_storage(vs),
                             cache.lengths + n_new.astype(jnp.int32))


def embed_block(cfg: DFlashConfig, target, params: dict, roots: jax.Array,
                block: int) -> jax.Array:
    """[B] roots -> [B, block, D] embeddings of ``[root, mask × (block - 1)]``."""
    b = roots.shape[0]
    dt = cfg.layer.jnp_dtype
    if cfg.mask_token_id is not None:
        tokens = jnp.full((b, block), cfg.mask_token_id, jnp.int32).at[:, 0].set(roots)
        return target.embed(params["target"], tokens).astype(dt)
    root = target.embed(params["target"], roots[:, None]).astype(dt)
    mask = jnp.broadcast_to(params["drafter"]["mask_embedding"].astype(dt),
                            (b, block - 1, cfg.d_model))
    return jnp.concatenate([root, mask], axis=1)


def draft_layers(cfg: DFlashConfig, own: dict, h: jax.Array, positions: jax.Array,
                 context_block, block_rule) -> jax.Array:
    """The draft stack on block embeddings: [B, T, D] -> final normed outputs [B, T, D].

    Args:
      h: embeddings of the block tokens (T = one or more blocks).
      positions: [B, T] their RoPE positions.
      context_block: ``context_block(i) -> KeyBlock`` of layer i's injected context.
      block_rule: ``block_rule(i) -> Rule`` among the T block keys for layer i.
    """
    lc = cfg.layer
    cos, sin = layers.rope_tables(lc, positions)
    for i, p in enumerate(own["layers"]):
        x = layers.rms_norm(h, p["attn_norm"], lc.norm_eps)
        q, k, v = layers.project_qkv(p, lc, x, cos, sin)
        blocks = [context_block(i),
                  attn.KeyBlock(layers.kv_rows(k), layers.kv_rows(v), block_rule(i))]
        h = h + layers.attention_out(p, lc, q, blocks)
        h = h + layers.mlp(p, lc, h)
    return layers.rms_norm(h, own["norm"], lc.norm_eps)


# ----------------------------------------------------------------------------------------
# Proposal policies.


@dataclasses.dataclass(frozen=True)
class BlockChain:
    """The block's per-position argmax as a chain (deterministic)."""


@dataclasses.dataclass(frozen=True)
class SampledBlock:
    """Per-position draws from the processed marginals, with those as the real q."""


@dataclasses.dataclass(frozen=True)
class DDTree:
    """The ``n_nodes - 1`` most probable prefixes of the block's marginals as a tree.

    Attributes:
      n_nodes: N, the tree's size with the root.
    """

    n_nodes: int = 16

    def __post_init__(self):
        if self.n_nodes < 2:
            raise ValueError(f"a DDTree needs at least one node besides the root, got "
                             f"n_nodes={self.n_nodes}")


def ddtree(logp: jax.Array, n_nodes: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """DDTree's best-first construction over per-depth log-probabilities, at static shapes.

    A path's score is the sum of its tokens' log-probabilities at their depths. Starting from
    the best depth-1 token, each step emits the best frontier entry and replaces it by its
    next sibling (same parent and depth, next rank) and its first child (one deeper, rank 0);
    log-probabilities are <= 0, so the emitted set is prefix-closed and comes out in
    descending score order. Equal scores go to the entry that entered the frontier first.

    Args:
      logp: [B, Dp, V] log-probabilities of depths 1..Dp.
      n_nodes: N, the tree's size with the root.
    Returns:
      ``(tokens [B, N - 1], parents [B, N], depth [B, N], score [B, N])``: the nodes in
      emission order, each node's parent (0 = the root; ``parents[:, 0] = -1``), depth (the
      root's is 0) and path score (the root's is 0).
    """
    b, dp, v = logp.shape
    kt = min(n_nodes - 1, v)
    # The barrier keeps XLA from fusing the top-k into the loop's gathers, which recomputed
    # it over the whole vocabulary at every step (~0.27 s per tree for 15 x 49152 on XLA:CPU).
    top_lp, top_ids = jax.lax.optimization_barrier(jax.lax.top_k(logp, kt))  # [B, Dp, Kt]
    n_front = n_nodes + 1

    def one(lp, ids):
        # Frontier slots: score, depth (1-based), rank, parent node; -inf score = empty.
        score = jnp.full((n_front,), -jnp.inf).at[0].set(lp[0, 0])
        depth = jnp.ones((n_front,), jnp.int32)
        rank = jnp.zeros((n_front,), jnp.int32)
        parent = jnp.zeros((n_front,), jnp.int32)
        out = (jnp.zeros((n_nodes - 1,), jnp.int32), jnp.zeros((n_nodes - 1,), jnp.int32),
               jnp.zeros((n_nodes - 1,), jnp.int32), jnp.zeros((n_nodes - 1,), jnp.float32))

        def body(i, carry):  # emits node i + 1
            (score, depth, rank, parent), (tok, par, dep, sc) = carry
            j = jnp.argmax(score)
            d, r, s = depth[j], rank[j], score[j]
            tok, par, dep = tok.at[i].set(ids[d - 1, r]), par.at[i].set(parent[j]), dep.at[i].set(d)
            sc = sc.at[i].set(s)
            # The sibling takes the emitted entry's slot; the child a fresh one (slot i + 1).
            has_sib = r + 1 < kt
            sib_score = s - lp[d - 1, r] + lp[d - 1, jnp.minimum(r + 1, kt - 1)]
            score = score.at[j].set(jnp.where(has_sib, sib_score, -jnp.inf))
            rank = rank.at[j].set(r + 1)
            has_child = d < dp
            score = score.at[i + 1].set(
                jnp.where(has_child, s + lp[jnp.minimum(d, dp - 1), 0], -jnp.inf))
            depth = depth.at[i + 1].set(d + 1)
            rank = rank.at[i + 1].set(0)
            parent = parent.at[i + 1].set(i + 1)
            return (score, depth, rank, parent), (tok, par, dep, sc)

        _, emitted = jax.lax.fori_loop(0, n_nodes - 1, body, ((score, depth, rank, parent), out))
        return emitted

    tok, par, dep, sc = jax.vmap(one)(top_lp, top_ids)
    root = jnp.zeros((b, 1), jnp.int32)
    return (tok, jnp.concatenate([root - 1, par], axis=1),
            jnp.concatenate([root, dep], axis=1),
            jnp.concatenate([root.astype(jnp.float32), sc], axis=1))


# ----------------------------------------------------------------------------------------
# The drafter.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashState:
    """What a DFlash drafter carries between cycles.

    Attributes:
      cache: every draft layer's injected context K/V: ``lengths[b]`` positions, all the
        committed positions of row b but the root's.
    """

    cache: cache_lib.KVCache


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    """A DFlash drafter for the speculative loop (:mod:`specjax.drafters.base`).

    Attributes:
      cfg: the drafter's shape.
      target: the static target (a :class:`~specjax.targets.DraftingTarget`) whose embedding
        and head the drafter reads from ``params["target"]``.
      policy: a :class:`BlockChain`, :class:`SampledBlock` or :class:`DDTree`.
      block: the block drafted per pass (default ``cfg.block_size``, the trained one).
      vocab: Vd, draft from the Vd most frequent ids of the drafter's ``token_order`` only
        (module docstring; the params from :func:`drafter_params` with the same ``vocab``);
        None drafts over the target's whole vocabulary.
    """

    cfg: DFlashConfig
    target: Any
    policy: Any = BlockChain()
    block: int | None = None
    vocab: int | None = None

    def __post_init__(self):
        if not isinstance(self.policy, (BlockChain, SampledBlock, DDTree)):
            raise ValueError(f"unknown DFlash proposal policy {self.policy!r}")
        if self.block is not None and self.block < 2:
            raise ValueError(f"a block holds the root and at least one mask, got {self.block}")
        if self.vocab is not None:
            vocab_lib.check_size(self.vocab, self.cfg.vocab_size)

    @property
    def block_size(self) -> int:
        return self.block or self.cfg.block_size

    @property
    def n_nodes(self) -> int:
        return self.policy.n_nodes if isinstance(self.policy, DDTree) else self.block_size

    @property
    def max_depth(self) -> int:
        if isinstance(self.policy, DDTree):
            return min(self.block_size - 1, self.policy.n_nodes - 1)
        return self.block_size - 1

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.taps

    @property
    def static_tree(self) -> StaticTree | None:
        return None if isinstance(self.policy, DDTree) else StaticTree.chain(self.block_size)

    def check_target(self, target) -> None:
        """Raises ValueError when the drafter's width, vocabulary or layers do not fit
        ``target`` (a :class:`~specjax.targets.DraftingTarget`)."""
        from specjax.targets import require_drafting_target

        cfg = self.cfg
        require_drafting_target("DFlash", target, cfg.vocab_size)
        if cfg.d_model != target.d_model:
            raise ValueError(f"the drafter's width is {cfg.d_model}, the target's hidden size "
                             f"is {target.d_model}; drafter and target mismatch")
        if max(cfg.target_layer_ids) >= target.n_layers:
            raise ValueError(f"the drafter taps target layers {list(cfg.target_layer_ids)}, the"
                             f" target has layers 0..{target.n_layers - 1}; drafter and target "
                             "mismatch")

    # -- the cycle -------------------------------------------------------------------

    def init(self, params, prefill: Prefill) -> DFlashState:
        """Injects the context of every prompt position."""
        b = prefill.prompt.shape[0]
        # A cycle or a catch-up injects up to max(Bk, CATCH_UP) positions past the committed
        # ones: leave room.
        cache = cache_lib.init_cache(self.cfg.layer, b,
                                     prefill.capacity + max(self.max_depth + 1, CATCH_UP))
        return DFlashState(inject(self.cfg, params["drafter"], cache, prefill.taps,
                                  prefill.prompt_len))

    def commit(self, params, state: DFlashState, ctx: Context, accepted: Accepted) -> DFlashState:
        """Injects the context of the cycle's committed positions (the path's nodes, old root
        first, with the target's taps)."""
        return self.catch_up(params, state, ctx, accepted.taps, accepted.n_committed)

    def catch_up(self, params, state: DFlashState, ctx: Context, taps: jax.Array,
                 n_new: jax.Array) -> DFlashState:
        """Injects the context of the ``n_new[b]`` positions after the injected ones, from
        their taps [B, T, n, E] (the first ``n_new[b]`` real)."""
        return DFlashState(inject(self.cfg, params["drafter"], state.cache, taps, n_new))

    def block_logits(self, params, state: DFlashState, roots: jax.Array) -> jax.Array:
        """One pass over ``[root, mask...]``: float32 logits [B, Bk - 1, V] of the tokens 1..Bk-1
        places after each row's root; [B, Bk - 1, Vd] over ``params["head"]["ids"]`` with a
        draft vocabulary."""
        cfg, lc = self.cfg, self.cfg.layer
        cache, bk = state.cache, self.block_size
        b = roots.shape[0]
        positions = cache.lengths[:, None] + jnp.arange(bk, dtype=jnp.int32)[None, :]
        h = embed_block(cfg, self.target, params, roots, bk)

        def context_block(i):
            rule = attn.Prefix(cache.lengths)
            if cfg.window(i) is not None:
                slots = jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32),
                                         (b, cache.capacity))
                rule = attn.Intersect((rule, attn.Window(positions, slots, cfg.window(i))))
            return attn.KeyBlock(cache_lib.from_storage(cache.k[i], lc),
                                 cache_lib.from_storage(cache.v[i], lc), rule)

        def block_rule(i):
            return attn.Causal() if cfg.causal(i) else attn.Full()

        out = draft_layers(cfg, params["drafter"], h, positions, context_block, block_rule)
        head = vocab_lib.checked_head(params, self.vocab, "dflash")
        if head is None:
            return self.target.lm_head(params["target"], out[:, 1:])
        return layers.matmul_nt(out[:, 1:], head["rows"])

    def skip(self, params, state: DFlashState, ctx: Context) -> DFlashState:
        """Nothing to catch up: ``commit`` injects every committed position, drafted or not."""
        return state

    def propose(self, params, state: DFlashState, ctx: Context, rng):
        """One block pass; every proposal carries its nodes' path confidences (the product of
        the block's marginals of each node's tokens along its path)."""
        roots = ctx.root
        b = roots.shape[0]
        logits = self.block_logits(params, state, roots)  # [B, Bk - 1, Vd]
        logp = jax.nn.log_softmax(logits, axis=-1)
        n = self.n_nodes
        ids = None if self.vocab is None else params["head"]["ids"]
        to_target = (lambda i: i) if ids is None else (lambda i: ids[i])  # noqa: E731
        if isinstance(self.policy, DDTree):
            picks, parents, _, score = ddtree(logp, self.policy.n_nodes)
            return Proposal(jnp.concatenate([roots[:, None], to_target(picks)], axis=1), parents,
                            jnp.ones((b, n), bool), confidence=jnp.exp(score)), state
        chain = chain_parents(b, n)
        if isinstance(self.policy, BlockChain):
            picks = sampling.argmax(logits)
            return Proposal(jnp.concatenate([roots[:, None], to_target(picks)], axis=1), chain,
                            jnp.ones((b, n), bool),
                            confidence=chain_confidence(logp, picks)), state
        probs = jnp.exp(sampling.log_probs(logits, ctx.sp))  # [B, Bk - 1, Vd]
        u = jax.random.uniform(rng, (b, n - 1))
        drawn = jax.vmap(sampling.inverse_cdf_sample, in_axes=1, out_axes=1)(u, probs)
        picks = jnp.where(ctx.sp.greedy[:, None], sampling.argmax(logits), drawn)
        if ids is not None:  # q over the target's ids: the marginals there, -inf elsewhere
            logits = jnp.full(logits.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf,
                              jnp.float32).at[..., ids].set(logits)
        q = jnp.concatenate([logits, jnp.zeros((b, 1, logits.shape[-1]), jnp.float32)], axis=1)
        return Proposal(jnp.concatenate([roots[:, None], to_target(picks)], axis=1), chain,
                        jnp.ones((b, n), bool), q, chain_confidence(logp, picks)), state


def chain_confidence(logp: jax.Array, drafts: jax.Array) -> jax.Array:
    """[B, N] probability of each prefix of a block chain under the block's marginals: the
    running product of ``exp(logp[k, drafts[k]])``, 1 for the root.

    Args:
      logp: [B, N - 1, V] log-probabilities of positions 1..N-1 (over a draft vocabulary,
        [B, N - 1, Vd]).
      drafts: [B, N - 1] the chain's tokens after the root (their indices in that vocabulary).
    """
    own = jnp.take_along_axis(logp, drafts[..., None], axis=-1)[..., 0]  # [B, N - 1]
    return jnp.exp(jnp.pad(jnp.cumsum(own, axis=1), ((0, 0), (1, 0))))


def resolve_vocab(cfg: DFlashConfig, given: int | str | None) -> int | None:
    """The draft vocabulary to draft from (a :class:`DFlashDrafter`'s ``vocab``): ``given``
    ids; the whole vocabulary (None) for ``"full"``; ``cfg.draft_vocab_size`` for None."""
    if given is None:
        return cfg.draft_vocab_size
    return None if given == "full" else given


def drafter_params(own: dict, target_params: dict, *, target=None,
                   vocab: int | None = None, row_weights: bool | None = None) -> dict:
    """The params pytree a :class:`DFlashDrafter` takes: its own weights and the target's, and
    with ``vocab`` = Vd the rows of ``target``'s head (a
    :class:`~specjax.targets.DraftingTarget`) of the Vd first ids of ``own["token_order"]``.

    ``row_weights``: the one-row copies of ``own``, as :func:`specjax.io.layout.drafter_own`
    decides them (None, the default: when ``target_params`` carry the target's).

    Raises:
      ValueError: ``vocab`` without a ``target``, or for a drafter without a ``token_order``.
    """
    params = {"drafter": layout.drafter_own(own, target_params, row_weights),
              "target": target_params}
    if vocab is not None:
        params["head"] = vocab_lib.gather_head(own, target, target_params, vocab, "DFlash")
    return params
