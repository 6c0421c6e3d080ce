"""Training DFlash drafters on distilled records: random anchors, one pass, decayed CE.

    result, drafter, own = dflash.train(target_cfg, params, source, TrainConfig(...), cfg)

Every step runs the frozen target teacher-forced over the packed batch (``target.encode``) for
its taps, fuses them into the context of every position, and trains many blocks per row in
one pass of the drafter:

* **Anchors** (:func:`sample_anchors`): up to A positions per row, drawn uniformly without
  replacement among those whose own token and next token are response tokens of the same
  record, then sorted. Anchor ``a`` opens the block ``[token[a], mask × (Bk - 1)]`` at
  positions ``pos[a] .. pos[a] + Bk - 1``; block position ``k`` is labelled with
  ``token[a + k]`` while those labels stay response tokens of the record (the supervised run
  stops at the first one that is not).
* **Attention** (:func:`training_rules`): a block's queries see the context keys of their
  record strictly before the anchor (whose own features inference does not have yet) and the
  keys of their own block: all of them, or the earlier ones in causal layers. For a 7-token
  row with anchors 1 and 4 and blocks of 2 (1 = visible)::

      keys:      context 0..6     block keys
                 0 1 2 3 4 5 6    a1 m  a4 m
      a1 (q0)    1 0 0 0 0 0 0    1  1  0  0
      m  (q1)    1 0 0 0 0 0 0    1  1  0  0
      a4 (q2)    1 1 1 1 0 0 0    0  0  1  1
      m  (q3)    1 1 1 1 0 0 0    0  0  1  1

* **Loss**: cross-entropy of the labels under the target's frozen head, weighted by block
  position, ``w_k = exp(-(k - 1) / γ)`` (:func:`position_weights`), normalised by the total
  weight of the scored labels; or D-PACE's adaptive weights (:func:`dpace_weights`). The loss
  may score only the first K block positions (``scored``): the head over the block is most of
  a step's cost, and where verification rarely gets past the first few drafts (a small target
  on a CPU) those are the positions worth the steps; the block keeps its size and attention.
  With a draft vocabulary (``vocab_ids``, the ids the drafter will draft from) the softmax
  runs over those ids only, as drafting does, and the head costs Vd / V of the full one's; a
  label outside them is not scored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters import dflash
from specjax.drafters import vocab as vocab_lib
from specjax.drafters.dflash import DFlashConfig, DFlashDrafter
from specjax.models import attention as attn
from specjax.models import layers, target
from specjax.targets import DecoderTarget
from specjax.train import evaluate, loop
from specjax.train.draft_model import BesideTarget


class DFlashModule(BesideTarget):
    """A DFlash drafter's weights as NNX parameters, beside its frozen target."""

    def __init__(self, cfg: DFlashConfig, own: dict, target_cfg: ModelConfig,
                 target_params: dict):
        dflash.check_params(cfg, own)
        super().__init__(own, target_params)
        self.cfg = cfg
        self.target_cfg = target_cfg


def sample_anchors(rng: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array,
                   n_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Up to ``n_anchors`` random anchors per row (module docstring), sorted.

    Args:
      rng: a PRNG key.
      loss_mask: [B, T] bool, response tokens.
      segment_ids: [B, T] int32 record of every token.
      n_anchors: A, static.
    Returns:
      ``(anchors [B, A] int32, valid [B, A] bool)``; rows with fewer candidates than A pad
      with invalid anchors at index 0, after the valid ones.
    """
    b, t = loss_mask.shape
    nxt = jnp.concatenate([loss_mask[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    same = jnp.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1], jnp.zeros((b, 1), bool)],
                           axis=1)
    cand = loss_mask & nxt & same  # [B, T]
    key = jnp.where(cand, jax.random.uniform(rng, (b, t)), 2.0)
    picked = jnp.argsort(key, axis=1)[:, :n_anchors].astype(jnp.int32)  # random candidates first
    ok = jnp.take_along_axis(cand, picked, axis=1)
    anchors = jnp.sort(jnp.where(ok, picked, t), axis=1)
    valid = anchors < t
    return jnp.where(valid, anchors, 0), valid


def training_rules(cfg: DFlashConfig, layer: int, anchors: jax.Array, segment_ids: jax.Array,
                   positions: jax.Array, block_positions: jax.Array, block: int):
    """The visibility rules of draft layer ``layer`` in training (module docstring).

    Args:
      anchors: [B, A] anchor indices into the packed row.
      segment_ids, positions: [B, T] of the packed row (the context keys).
      block_positions: [B, A * Bk] RoPE positions of the block queries.
      block: Bk.
    Returns:
      ``(context rule over the T context keys, rule among the A * Bk block keys)``.
    """
    q_seg = jnp.repeat(jnp.take_along_axis(segment_ids, anchors, axis=1), block, axis=1)
    rules = [attn.AnchorPrefix(anchors, block), attn.Segments(q_seg, segment_ids)]
    if cfg.window(layer) is not None:
        rules.append(attn.Window(block_positions, positions, cfg.window(layer)))
    return attn.Intersect(tuple(rules)), attn.Blocks(block, cfg.causal(layer))


def position_weights(block: int, gamma: float) -> jax.Array:
    """[Bk - 1] float32 loss weights of block positions k = 1..Bk-1: ``exp(-(k - 1) / γ)``."""
    return jnp.exp(-jnp.arange(block - 1, dtype=jnp.float32) / gamma)


def dpace_weights(ce: jax.Array, valid: jax.Array, alpha: float = 0.5) -> jax.Array:
    """D-PACE's adaptive position weights, without gradient.

    With ``q_i = exp(-CE_i)`` smoothed to ``q̃_i = (1 - alpha) q_i + alpha``, position j weighs
    ``sum_{m >= j} prod_{i <= m} q̃_i`` (how many drafts from j on a chain would still get
    accepted), over the block's supervised positions among those scored.

    Args:
      ce: [..., K] cross-entropies of the scored block positions 1..K (K = Bk - 1 unless the
        loss scores fewer).
      valid: [..., K] bool, scored positions: the block's supervised prefix, less labels
        outside a draft vocabulary (a chain stops there, so the positions after one weigh 0).
    """
    q = (1.0 - alpha) * jnp.exp(-jax.lax.stop_gradient(ce)) + alpha
    survive = jnp.cumprod(jnp.where(valid, q, 0.0), axis=-1)
    w = jnp.flip(jnp.cumsum(jnp.flip(survive, -1), axis=-1), -1)
    return jnp.where(valid, w, 0.0)


def block_outputs(model: DFlashModule, batch: dict, anchors: jax.Array) -> jax.Array:
    """The drafter's final normed outputs on the blocks opened at ``anchors``, all in one pass
    with the module docstring's attention: what the decoding loop's
    :meth:`~specjax.drafters.dflash.DFlashDrafter.block_logits` computes (before the head) for
    the same record cut before its anchor.

    Args:
      model: the drafter and its frozen target.
      batch: packed batch (:func:`specjax.train.data.pack`): ``tokens``, ``segment_ids`` and
        ``positions`` [B, T] int32.
      anchors: [B, A] int32 anchor indices into the rows, sorted.
    Returns:
      [B, A, Bk - 1, D] the outputs at block positions 1..Bk-1.
    """
    cfg, own, tp, tcfg = model.cfg, model.own_params(), model.target_params(), model.target_cfg
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    bk = cfg.block_size
    b, a = anchors.shape
    _, taps = target.encode(tp, tcfg, tokens, pos, seg, cfg.taps)
    ctx = dflash.context(cfg, own, jax.lax.stop_gradient(taps))  # [B, T, D]
    offs = jnp.arange(bk, dtype=jnp.int32)
    block_pos = (jnp.take_along_axis(pos, anchors, axis=1)[:, :, None] + offs).reshape(b, a * bk)
    roots = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)  # [B * A]
    h = dflash.embed_block(cfg, DecoderTarget(tcfg), dflash.drafter_params(own, tp), roots, bk)
    h = h.reshape(b, a * bk, cfg.d_model)
    cos, sin = layers.rope_tables(cfg.layer, pos)
    rules = [training_rules(cfg, i, anchors, seg, pos, block_pos, bk)
             for i in range(cfg.layer.n_layers)]

    def context_block(i):
        k, v = dflash.context_kv(cfg, own["layers"][i], ctx, cos, sin)
        return attn.KeyBlock(k, v, rules[i][0])

    out = dflash.draft_layers(cfg, own, h, block_pos, context_block, lambda i: rules[i][1])
    return out.reshape(b, a, bk, cfg.d_model)[:, :, 1:]


def block_loss(model: DFlashModule, batch: dict, rng: jax.Array, *, n_anchors: int = 64,
               gamma: float | None = None, dpace: bool = False, scored: int | None = None,
               vocab_ids: jax.Array | None = None):
    """The DFlash training loss of a packed batch (module docstring).

    Args:
      model: the drafter and its frozen target.
      batch: packed batch (:func:`specjax.train.data.pack`): ``tokens``, ``segment_ids``,
        ``positions`` [B, T] int32, ``loss_mask`` [B, T] bool.
      rng: draws the anchors.
      n_anchors: A, anchors per row.
      gamma: the position decay (default :func:`specjax.drafters.dflash.default_gamma`).
      dpace: weigh positions by :func:`dpace_weights` instead.
      scored: K, score block positions 1..K only (default: all Bk - 1).
      vocab_ids: [Vd] int32 ascending target ids, a draft vocabulary: the head's softmax runs
        over those ids only, and a label outside them is not scored and counts as a miss
        (default: the whole head).
    Returns:
      ``(loss, {"accuracy": top-1 agreement at block position 1, "accept_len": the mean
      number of leading scored block positions whose top-1 is the label (a chain's τ - 1,
      capped at K), "loss_tokens": labels scored})``.
    Raises:
      ValueError: ``scored`` outside 1..Bk-1.
    """
    cfg, tp, tcfg = model.cfg, model.target_params(), model.target_cfg
    tokens, seg = batch["tokens"], batch["segment_ids"]
    mask = batch["loss_mask"].astype(bool)
    bk = cfg.block_size
    k = bk - 1 if scored is None else scored
    if not 1 <= k <= bk - 1:
        raise ValueError(f"scored must be in 1..{bk - 1} (block {bk}), got {scored}")
    b, t = tokens.shape
    anchors, ok = sample_anchors(rng, mask, seg, n_anchors)  # [B, A]
    a = anchors.shape[1]
    out = block_outputs(model, batch, anchors)[:, :, :k]  # [B, A, K, D]
    # Labels token[a + k], supervised while they stay response tokens of the anchor's record.
    idx = anchors[:, :, None] + jnp.arange(1, k + 1, dtype=jnp.int32)  # [B, A, K]
    inside = idx < t
    idx_c = jnp.minimum(idx, t - 1).reshape(b, -1)
    take = lambda x: jnp.take_along_axis(x, idx_c, axis=1).reshape(b, a, k)  # noqa: E731
    anchor_seg = jnp.take_along_axis(seg, anchors, axis=1)[:, :, None]
    sup = inside & take(mask) & (take(seg) == anchor_seg) & ok[:, :, None]
    valid = jnp.cumprod(sup.astype(jnp.int32), axis=-1).astype(bool)
    labels, rows, known = take(tokens), None, True
    if vocab_ids is not None:
        rows = target.head_rows(tp, tcfg, vocab_ids)  # [Vd, D]
        at = jnp.minimum(jnp.searchsorted(vocab_ids, labels), vocab_ids.shape[0] - 1)
        known = vocab_ids[at] == labels  # [B, A, K]
        labels = at
    logp, top1 = target.score_tokens(tp, tcfg, out.reshape(b, -1, cfg.d_model),
                                     labels.reshape(b, -1), rows=rows)
    ce, top1 = -logp.reshape(b, a, k), top1.reshape(b, a, k)
    scorable = valid & known
    if dpace:
        w = dpace_weights(ce, scorable)
    else:
        decay = position_weights(bk, gamma or dflash.default_gamma(bk))[:k]
        w = jnp.where(scorable, decay, 0.0)
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6)
    n_blocks = jnp.maximum(jnp.sum(valid[..., 0]), 1)
    hit = top1 & scorable
    accept_len = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=-1)) / n_blocks
    return loss, {"accuracy": jnp.sum(hit[..., 0]) / n_blocks, "accept_len": accept_len,
                  "loss_tokens": jnp.sum(scorable)}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The DFlash-specific settings of a run.

    Attributes:
      n_anchors: A, anchors per packed row.
      gamma: the position decay (None: :func:`specjax.drafters.dflash.default_gamma`).
      dpace: D-PACE weights instead of the decay.
      scored: K, the loss scores block positions 1..K only (None: all of them).
      draft_vocab: Vd, train the head's softmax over the Vd first ids of the run's
        ``token_order`` (the draft vocabulary the drafter then drafts from by default;
        None: the whole vocabulary).
    """

    n_anchors: int = 64
    gamma: float | None = None
    dpace: bool = False
    scored: int | None = None
    draft_vocab: int | None = None

    def __post_init__(self):
        if self.n_anchors < 1:
            raise ValueError(f"n_anchors must be >= 1, got {self.n_anchors}")
        if self.scored is not None and self.scored < 1:
            raise ValueError(f"scored must be >= 1, got {self.scored}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")


def train(target_cfg: ModelConfig, target_params: dict, source: loop.DataSource,
          train_cfg: loop.TrainConfig, cfg: DFlashConfig, *, recipe: Recipe = Recipe(),
          policy=dflash.BlockChain(), dev_prompts: Sequence[Sequence[int]] = (),
          eval_tokens: int = 64, stop_tokens: Sequence[int] = (), seed: int = 0,
          init: dict | None = None, token_order: np.ndarray | None = None,
          progress: bool = True) -> tuple[loop.TrainResult, DFlashDrafter, dict]:
    """Trains a DFlash drafter of shape ``cfg`` for a target on distilled records.

    Args:
      target_cfg, target_params: the target (frozen; its params are not modified).
      source: packed batches (:func:`specjax.train.data.pack` layout).
      train_cfg: the run's settings.
      cfg: the drafter's shape (:meth:`DFlashConfig.for_target`).
      recipe: anchors and loss weights.
      policy: the proposal policy of evaluations and of the returned drafter.
      dev_prompts: token-id prompts never trained on, decoded by the real speculative loop at
        every evaluation (``evaluate.tau_eval``).
      eval_tokens, stop_tokens: of the evaluations.
      seed: the drafter's initial weights.
      init: own params of shape ``cfg`` to start from instead of fresh weights (a warm start,
        e.g. :func:`specjax.io.official.load_dflash` of a shipped drafter, float32); the optimizer
        starts afresh. A run directory with checkpoints resumes from them instead.
      token_order: [V] int32 the target's ids ranked by frequency in the training records
        (:func:`specjax.drafters.vocab.frequency_order`): the drafter carries it, and with
        ``recipe.draft_vocab`` = Vd the loss, the evaluations and the returned drafter use
        its Vd first ids (``cfg.draft_vocab_size`` becomes ``recipe.draft_vocab``, None
        without one: the whole vocabulary).
      progress: show a progress bar.
    Returns:
      ``(result, drafter, own)``: how the run ended, the drafter, and its own params (with
      ``token_order`` when given).
    Raises:
      ValueError: ``init`` params of another shape than ``cfg``'s; ``recipe.scored`` beyond the
        block's Bk - 1 positions; a ``recipe.draft_vocab`` without a ``token_order`` or beyond
        the vocabulary; a ``token_order`` that does not rank every id once.
    """
    if recipe.scored is not None and recipe.scored > cfg.block_size - 1:
        raise ValueError(f"the loss cannot score {recipe.scored} block positions: a block of "
                         f"{cfg.block_size} drafts {cfg.block_size - 1}")
    tgt = DecoderTarget(target_cfg)
    ids, ranked = None, {}
    if token_order is not None:
        vocab_lib.check_order(np.asarray(token_order), cfg.vocab_size)
        ranked = {"token_order": jnp.asarray(token_order, jnp.int32)}
    if recipe.draft_vocab is not None:
        if token_order is None:
            raise ValueError("a draft vocabulary is the first ids of a ranking: pass the "
                             "training records' token_order")
        ids = jnp.asarray(vocab_lib.top_ids(np.asarray(token_order), recipe.draft_vocab))
    # What the loss ran over is what the drafter drafts from, whatever ``cfg`` carried in.
    cfg = dataclasses.replace(cfg, draft_vocab_size=recipe.draft_vocab)
    drafter = DFlashDrafter(cfg, tgt, policy, vocab=recipe.draft_vocab)
    drafter.check_target(tgt)
    own = dflash.init_params(cfg, seed)
    if init is not None:
        if jax.tree.map(jnp.shape, init) != jax.tree.map(jnp.shape, own):
            raise ValueError("the initial drafter's params do not have the configured "
                             "drafter's shapes")
        own = init
    model = DFlashModule(cfg, own, target_cfg, target_params)

    def loss_fn(model, batch, rng):
        return block_loss(model, batch, rng, n_anchors=recipe.n_anchors, gamma=recipe.gamma,
                          dpace=recipe.dpace, scored=recipe.scored, vocab_ids=ids)

    eval_fn = None
    if train_cfg.eval_every and dev_prompts:
        eval_fn = evaluate.tau_hook(
            target_cfg, target_params, dev_prompts, drafter,
            lambda m: dflash.drafter_params(dict(m.own_params(), **ranked), target_params,
                                            target=tgt, vocab=recipe.draft_vocab),
            max_new_tokens=eval_tokens, stop_tokens=stop_tokens)
    result = loop.train(model, loss_fn, source, train_cfg, eval_fn=eval_fn, progress=progress)
    return result, drafter, dict(model.own_params(), **ranked)
