"""Training EAGLE drafters on distilled records: EAGLE-3's training-time test, EAGLE-1's
feature regression.

    result, drafter, own = eagle.train(cfg, params, records, source, TrainConfig(...), version=3)

Every step runs the frozen target teacher-forced over the packed batch
(``target.encode``) for its taps and its next-token distribution, then the drafter:

* **EAGLE-3** (:func:`ttt_loss`): ``steps`` unrolled draft steps (7 by default). Step 0 reads
  the fused target features of position j with token j + 1 at RoPE position j, like the
  committed pairs at inference; step s >= 1 reads the drafter's own step s - 1 output at the
  same index j with the teacher-forced token j + 1 + s at position j + s, like a tree node at
  depth s. Queries see the step-0 keys causally and each later step's key at their own index
  (:class:`~specjax.models.attention.Diagonal`), the ancestry a depth-s node has at inference.
  For query j of step 2 over a 3-token row (1 = visible)::

      keys:    step 0     step 1     step 2
               0 1 2      0 1 2      0 1 2
      j = 0    1 0 0      1 0 0      1 0 0
      j = 1    1 1 0      0 1 0      0 1 0
      j = 2    1 1 1      0 0 1      0 0 1

  Step s is scored against the target's distribution over the draft vocabulary at position
  j + 1 + s (soft labels, renormalised over the Vd ids), where the token it predicts,
  j + 2 + s, is a response token of the same record and the target's own top token is in the
  draft vocabulary; the loss is sum_s 0.8^s * CE_s, each CE_s a mean over its scored positions.
* **EAGLE-1** (:func:`regression_loss`): one step on the target's final normed features with
  uniform noise U(-0.1, 0.1) on the inputs; SmoothL1 against the next position's feature plus
  0.1 x the soft cross-entropy of the target's head on the two.

The draft vocabulary of EAGLE-3 (``d2t``) comes from the token counts of the training records'
response tokens (:func:`specjax.train.data.token_counts`,
:func:`specjax.drafters.eagle.draft_vocab`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters import eagle
from specjax.drafters.eagle import EagleConfig, EagleDrafter
from specjax.models import attention as attn
from specjax.models import target
from specjax.targets import DecoderTarget
from specjax.train import data, evaluate, loop
from specjax.train.draft_model import BesideTarget

LABEL_CHUNK = 256  # positions per target-head chunk: [B, chunk, V] logits at a time
INDEX_TABLES = ("d2t", "token_order")  # own params that index, never train


class EagleModule(BesideTarget):
    """An EAGLE drafter's weights as NNX variables, beside its frozen target.

    The drafter's matrices and norms are ``nnx.Param`` and train; the index tables (EAGLE-3's
    ``d2t``, an EAGLE-1 ``token_order``) are :class:`~specjax.train.draft_model.Shared`
    constants of the run, like the target's params.
    """

    def __init__(self, cfg: EagleConfig, own: dict, target_cfg: ModelConfig, target_params: dict):
        eagle.check_params(cfg, own)
        super().__init__(own, target_params,
                         constant=lambda path: getattr(path[-1], "key", None) in INDEX_TABLES)
        self.cfg = cfg
        self.target_cfg = target_cfg


def _shift(x: jax.Array, n: int) -> jax.Array:
    """``x[:, j + n]`` at index j, zero (False) past the end: [B, T, ...] -> [B, T, ...]."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def _target_pass(model: EagleModule, batch: dict):
    """``(final normed states [B, T, E], taps [B, T, n, E])`` of the frozen target."""
    hidden, taps = target.encode(model.target_params(), model.target_cfg, batch["tokens"],
                                 batch["positions"], batch["segment_ids"], model.cfg.taps)
    return jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(taps)


def _chunked(fn, *arrays, chunk: int = LABEL_CHUNK):
    """Maps ``fn`` over chunks of the T axis of [B, T, ...] arrays; concatenates the [B, chunk,
    ...] results back to [B, T, ...]."""
    b, t = arrays[0].shape[:2]
    pad = -t % chunk

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(b, -1, chunk, *x.shape[2:]), 0, 1)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(x) for x in arrays))
    return jax.tree.map(lambda y: jnp.swapaxes(y, 0, 1).reshape(b, -1, *y.shape[3:])[:, :t], out)


def _valid(batch: dict, ahead: int) -> jax.Array:
    """[B, T] bool: token ``j + ahead`` is a response token of the record that holds j."""
    seg = batch["segment_ids"]
    return (_shift(batch["loss_mask"].astype(bool), ahead) & (_shift(seg, ahead) == seg)
            & (jnp.arange(seg.shape[1]) < seg.shape[1] - ahead)[None])


def ttt_logits(model: EagleModule, batch: dict, steps: int,
               taps: jax.Array | None = None) -> list[jax.Array]:
    """The draft logits of the training-time test's unrolled steps (module docstring): step s
    at index j is what the decoding loop's drafter computes for the depth-s node of the path
    ``token[j + 2 .. j + 1 + s]`` after the pairs up to position j, the root token j + 1.

    Args:
      model: the drafter and its frozen target.
      batch: packed batch (:func:`specjax.train.data.pack`): ``tokens``, ``segment_ids`` and
        ``positions`` [B, T] int32.
      steps: unrolled draft steps.
      taps: [B, T, n, E] the target's taps of the batch (default: computed).
    Returns:
      ``steps`` arrays [B, T, Vd] of logits over the draft vocabulary.
    """
    cfg, own, tp = model.cfg, model.own_params(), model.target_params()
    tgt = DecoderTarget(model.target_cfg)
    params = eagle.drafter_params(own, tp)
    tokens, seg = batch["tokens"], batch["segment_ids"]
    if taps is None:
        _, taps = _target_pass(model, batch)
    b, t = tokens.shape
    base_rule = attn.Intersect((attn.Causal(), attn.Segments(seg, seg)))
    h = taps.reshape(b, t, -1)
    blocks, out = [], []
    for s in range(steps):
        x, residual = eagle.layer_inputs(cfg, tgt, params, _shift(tokens, 1 + s), h, s == 0)

        def blocks_of(k_rows, v_rows, s=s):
            blocks.append(attn.KeyBlock(k_rows, v_rows, base_rule if s == 0 else attn.Diagonal()))
            return list(blocks)

        h, _, _ = eagle.decoder_layer(cfg, own, x, residual, batch["positions"] + s, blocks_of)
        out.append(eagle.draft_logits(cfg, tgt, params, h))
    return out


def ttt_loss(model: EagleModule, batch: dict, rng: jax.Array, *, steps: int = 7,
             decay: float = 0.8):
    """EAGLE-3's training-time-test loss (module docstring).

    Args:
      model: the drafter and its frozen target.
      batch: packed batch (:func:`specjax.train.data.pack`): ``tokens``, ``segment_ids``,
        ``positions`` [B, T] int32, ``loss_mask`` [B, T] bool.
      rng: unused; the loss is deterministic.
      steps: unrolled draft steps.
      decay: step s weighs ``decay ** s``.
    Returns:
      ``(loss, {"accuracy": step 0's top-1 agreement with the target's top token,
      "accuracy_last": the last step's, "loss_tokens": positions step 0 scores})``.
    """
    del rng
    cfg, own, tp, tcfg = model.cfg, model.own_params(), model.target_params(), model.target_cfg
    hidden, taps = _target_pass(model, batch)
    used = jnp.arange(cfg.draft_vocab_size) + own["d2t"]  # [Vd] target ids
    in_vocab = jnp.zeros((cfg.target_vocab_size,), bool).at[used].set(True)

    def labels(h):  # [B, chunk, E] -> target probabilities over the draft vocab, usable
        logits = target.lm_head(tp, tcfg, h)  # [B, chunk, V]
        return jax.nn.softmax(logits[..., used], axis=-1), in_vocab[jnp.argmax(logits, -1)]

    p_draft, usable = jax.lax.stop_gradient(_chunked(labels, hidden))  # [B, T, Vd], [B, T]
    total, metrics = 0.0, {}
    for s, logits in enumerate(ttt_logits(model, batch, steps, taps)):
        logq = jax.nn.log_softmax(logits, axis=-1)  # [B, T, Vd]
        p = _shift(p_draft, 1 + s)
        weight = (_valid(batch, 2 + s) & _shift(usable, 1 + s)).astype(jnp.float32)  # [B, T]
        n = jnp.maximum(weight.sum(), 1.0)
        total = total - decay ** s * jnp.sum(weight * jnp.sum(p * logq, axis=-1)) / n
        hit = (jnp.argmax(logq, -1) == jnp.argmax(p, -1)).astype(jnp.float32)
        if s == 0:
            metrics = {"accuracy": (hit * weight).sum() / n, "loss_tokens": weight.sum()}
        if s == steps - 1:
            metrics["accuracy_last"] = (hit * weight).sum() / n
    return total, metrics


def regression_loss(model: EagleModule, batch: dict, rng: jax.Array, *, noise: float = 0.1,
                    cls_weight: float = 0.1):
    """EAGLE-1's loss: SmoothL1 on the next feature + ``cls_weight`` x soft cross-entropy
    through the target's head (module docstring); batch as in :func:`ttt_loss`, ``rng``
    draws the input noise U(-noise, noise).

    Returns:
      ``(loss, {"accuracy": top-1 agreement of the drafted and the true feature's token,
      "regression": the SmoothL1 term, "loss_tokens": scored positions})``.
    """
    cfg, own, tp, tcfg = model.cfg, model.own_params(), model.target_params(), model.target_cfg
    tgt = DecoderTarget(tcfg)
    params = eagle.drafter_params(own, tp)
    tokens, seg = batch["tokens"], batch["segment_ids"]
    feature, _ = _target_pass(model, batch)  # [B, T, E]
    noisy = feature + jax.random.uniform(rng, feature.shape, feature.dtype, -noise, noise)
    x, residual = eagle.layer_inputs(cfg, tgt, params, _shift(tokens, 1), noisy, True)
    rule = attn.Intersect((attn.Causal(), attn.Segments(seg, seg)))
    out, _, _ = eagle.decoder_layer(
        cfg, own, x, residual, batch["positions"],
        lambda k_rows, v_rows: [attn.KeyBlock(k_rows, v_rows, rule)])
    want = _shift(feature, 1)
    weight = _valid(batch, 2).astype(jnp.float32)
    n = jnp.maximum(weight.sum(), 1.0)
    err = jnp.abs(out - want)
    smooth_l1 = jnp.mean(jnp.where(err < 1.0, 0.5 * err ** 2, err - 0.5), axis=-1)  # [B, T]
    reg = jnp.sum(weight * smooth_l1) / n

    def soft_ce(o, w):  # [B, chunk, E] each -> CE [B, chunk], top-1 agreement [B, chunk]
        lo, lw = target.lm_head(tp, tcfg, o), target.lm_head(tp, tcfg, w)
        ce = -jnp.sum(jax.nn.softmax(lw, -1) * jax.nn.log_softmax(lo, -1), axis=-1)
        return ce, (jnp.argmax(lo, -1) == jnp.argmax(lw, -1)).astype(jnp.float32)

    ce, hit = _chunked(soft_ce, out, want)
    cls = jnp.sum(weight * ce) / n
    return reg + cls_weight * cls, {"accuracy": (hit * weight).sum() / n, "regression": reg,
                                    "loss_tokens": weight.sum()}


def train(target_cfg: ModelConfig, target_params: dict, records, source: loop.DataSource,
          train_cfg: loop.TrainConfig, *, version: int = 3, draft_vocab_size: int | None = None,
          policy=eagle.DynamicTree(), ttt_steps: int = 7, dev_prompts: Sequence[Sequence[int]] = (),
          eval_tokens: int = 64, stop_tokens: Sequence[int] = (), seed: int = 0,
          init: tuple[EagleConfig, dict] | None = None,
          progress: bool = True) -> tuple[loop.TrainResult, EagleDrafter, dict]:
    """Trains an EAGLE drafter for a target on distilled records.

    Args:
      target_cfg, target_params: the target (frozen; its params are not modified).
      records: the training records (``token_counts`` builds EAGLE-3's draft vocabulary from
        them); ``source`` must draw its batches from the same records.
      source: packed batches (:func:`specjax.train.data.pack` layout).
      train_cfg: the run's settings.
      version: 3 (:func:`ttt_loss`) or 1 (:func:`regression_loss`).
      draft_vocab_size: EAGLE-3's Vd (default: the whole vocabulary).
      policy: the tree policy of evaluations and of the returned drafter.
      ttt_steps: EAGLE-3's unrolled steps.
      dev_prompts: token-id prompts never trained on, decoded by the real speculative loop at
        every evaluation (``evaluate.tau_eval``).
      eval_tokens, stop_tokens: of the evaluations.
      seed: the drafter's initial weights.
      init: ``(cfg, own)`` of a drafter to start from instead of fresh weights (a warm start,
        e.g. :func:`specjax.io.official.load_eagle` of a shipped drafter, float32): its shape and
        its draft vocabulary are kept (EAGLE-3's ``d2t``, ``draft_vocab_size`` None or equal;
        an EAGLE-1 ``token_order``, carried to the returned params), the optimizer starts
        afresh. A run directory with checkpoints resumes from them instead.
      progress: show a progress bar.
    Returns:
      ``(result, drafter, own)``: how the run ended, the drafter, and its own params (use
      ``eagle.drafter_params(own, target_params)`` with ``api.generate_tokens``).
    Raises:
      ValueError: an unknown version, or an ``init`` drafter of another version or draft
        vocabulary size.
    """
    if version not in (1, 3):
        raise ValueError(f"EAGLE version must be 1 or 3, got {version}")
    if init is not None:
        cfg, own = init
        if cfg.version != version:
            raise ValueError(f"the initial drafter is EAGLE-{cfg.version}, not EAGLE-{version}")
        if version == 3 and draft_vocab_size not in (None, cfg.draft_vocab_size):
            raise ValueError(f"the initial drafter's draft vocabulary has {cfg.draft_vocab_size} "
                             f"ids, not {draft_vocab_size}; a warm start keeps its vocabulary")
    elif version == 3:
        cfg = EagleConfig.eagle3(target_cfg, draft_vocab_size=draft_vocab_size)
        own = eagle.init_params(cfg, seed)
        counts = data.token_counts(records, target_cfg.vocab_size)
        own["d2t"] = jnp.asarray(eagle.draft_vocab(counts, cfg.draft_vocab_size))
    else:
        cfg = EagleConfig.eagle1(target_cfg)
        own = eagle.init_params(cfg, seed)
    if version == 3:
        def loss_fn(model, batch, rng):
            return ttt_loss(model, batch, rng, steps=ttt_steps)
    else:
        loss_fn = regression_loss
    drafter = EagleDrafter(cfg, DecoderTarget(target_cfg), policy)
    model = EagleModule(cfg, own, target_cfg, target_params)
    eval_fn = None
    if train_cfg.eval_every and dev_prompts:
        eval_fn = evaluate.tau_hook(
            target_cfg, target_params, dev_prompts, drafter,
            lambda m: eagle.drafter_params(m.own_params(), target_params),
            max_new_tokens=eval_tokens, stop_tokens=stop_tokens)
    result = loop.train(model, loss_fn, source, train_cfg, eval_fn=eval_fn, progress=progress)
    return result, drafter, model.own_params()
