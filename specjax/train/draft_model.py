"""Training the draft-model family: a self-speculative :class:`DraftModelDrafter` (the
target's first layers, its final norm and its head) distilled on the target's own responses.

    result, drafter, params = draft_model.train(cfg, params, source, TrainConfig(...), layers=4)

:class:`DraftModel` holds the drafter's params pytree as NNX variables for
:func:`specjax.train.loop.train`; :func:`distill_loss` runs the pure target functions
(``target.encode`` + ``target.score_tokens``) over packed batches; :func:`train` wires in
the real-loop evaluation (:mod:`specjax.train.evaluate`). The drafter that comes out is the
plain pytree drafter of :mod:`specjax.drafters.draft_model`: NNX stays in training.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.io.layout import without_row_weights
from specjax.models import target
from specjax.train import evaluate, loop


class Shared(nnx.Variable):
    """An array the draft model shares with its target and does not train (see
    :class:`DraftModel`)."""


class BesideTarget(nnx.Module):
    """A drafter's own weights as NNX variables beside its frozen target's params.

    The leaves of ``own`` are ``nnx.Param`` and train, except those ``constant(path)`` marks
    (index tables such as EAGLE-3's ``d2t``), which are :class:`Shared` like every array of
    the target; the target's one-row weight copies are dropped.
    """

    def __init__(self, own: dict, target_params: dict, constant=lambda path: False):
        self.own = nnx.data(jax.tree_util.tree_map_with_path(
            lambda path, v: Shared(v) if constant(path) else nnx.Param(v), own))
        self.frozen = nnx.data(jax.tree.map(Shared, without_row_weights(target_params)))

    def own_params(self) -> dict:
        """The drafter's own params pytree (the ``"drafter"`` half of its params)."""
        return jax.tree.map(lambda v: v[...], self.own,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))

    def target_params(self) -> dict:
        """The target's params (without one-row copies)."""
        return jax.tree.map(lambda v: v[...], self.frozen,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))


class DraftModel(nnx.Module):
    """A draft model's params as an NNX module, for training (:func:`train`).

    Layers and the final norm are ``nnx.Param`` and train. The token embedding and the LM head
    are :class:`Shared` and stay frozen: they are the target's own arrays (SmolLM2 ties them:
    one [49152, 576] matrix, more parameters than four of its layers), so freezing them keeps
    the drafter sharing them with the target, keeps the optimizer state to the layers, and
    leaves the embedding space the target's.

    Attributes:
      cfg: the draft model's config (``n_layers`` its own layers).
    """

    def __init__(self, cfg: ModelConfig, params: dict):
        """``params`` in the target layout (:mod:`specjax.models.target`), e.g. from
        :meth:`DraftModelDrafter.from_target_layers`; one-row weight copies are dropped (a
        training pass has many rows, and a copy would drift from the matrix it mirrors)."""
        params = without_row_weights(params)
        if len(params["layers"]) != cfg.n_layers:
            raise ValueError(f"{len(params['layers'])} layers of params for a config of "
                             f"{cfg.n_layers}")
        self.cfg = cfg
        self.layers = nnx.data(tuple({k: nnx.Param(v) for k, v in layer.items()}
                                     for layer in params["layers"]))
        self.final_norm = nnx.Param(params["final_norm"])
        self.embed = Shared(params["embed"])
        self.lm_head = Shared(params["lm_head"]) if "lm_head" in params else None

    def params(self) -> dict:
        """The params pytree in the target layout (what :class:`DraftModelDrafter` takes)."""
        out = {"embed": self.embed[...], "final_norm": self.final_norm[...],
               "layers": tuple({k: v[...] for k, v in layer.items()} for layer in self.layers)}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...]
        return out


def distill_loss(model: DraftModel, batch: dict, rng: jax.Array):
    """Cross-entropy of the target's own next tokens, at response positions.

    Position t is scored on predicting token t + 1 when that token is a response token
    (``loss_mask``) of the same record. The labels are the target's sampled responses (hard
    labels); a KL term against the target's full distribution would need a target pass per
    batch, several times the draft model's cost, and is left out.

    Args:
      model: the draft model.
      batch: packed batch (:func:`specjax.train.data.pack`): ``tokens``, ``segment_ids``,
        ``positions`` [B, T] int32 and ``loss_mask`` [B, T] bool.
      rng: unused; the loss is deterministic.
    Returns:
      ``(loss, {"accuracy": top-1 agreement with the label, "loss_tokens": scored count})``.
    """
    del rng
    cfg, params = model.cfg, model.params()
    tokens, segments = batch["tokens"], batch["segment_ids"]
    # Cache-free and packed: each record attends causally within itself, at its own positions;
    # the head runs a chunk of positions at a time, so [B, T, V] logits never exist at once.
    hidden, _ = target.encode(params, cfg, tokens, batch["positions"], segments)
    logp, top1 = target.score_tokens(params, cfg, hidden[:, :-1], tokens[:, 1:])  # [B, T - 1]
    weight = (batch["loss_mask"][:, 1:] & (segments[:, 1:] == segments[:, :-1])
              ).astype(jnp.float32)  # [B, T - 1]
    n = weight.sum()
    denom = jnp.maximum(n, 1.0)
    accuracy = (top1 * weight).sum() / denom
    return -(logp * weight).sum() / denom, {"accuracy": accuracy, "loss_tokens": n}


def train(target_cfg: ModelConfig, target_params: dict, source: loop.DataSource,
          train_cfg: loop.TrainConfig, *, layers: int, dev_prompts: Sequence[Sequence[int]] = (),
          draft_len: int = 4, eval_tokens: int = 64, stop_tokens: Sequence[int] = (),
          progress: bool = True) -> tuple[loop.TrainResult, DraftModelDrafter, dict]:
    """Trains a self-speculative draft model, the target's first ``layers`` layers, on
    distilled records (:func:`distill_loss`).

    Args:
      target_cfg, target_params: the target (its params are not modified).
      source: packed batches (:func:`specjax.train.data.pack` layout), e.g. a
        ``loop.PackedSource`` over the records that ``evaluate.hold_out`` leaves for training.
      train_cfg: the run's settings.
      layers: the draft model's layers, taken from the target's first ones.
      dev_prompts: token-id prompts never trained on; with ``train_cfg.eval_every`` each
        evaluation runs the real speculative loop on them (``evaluate.tau_eval``).
      draft_len: the drafter's chain length, for evaluation and the returned drafter.
      eval_tokens: new tokens per dev prompt in an evaluation.
      stop_tokens: the target's stop ids, for evaluation.
      progress: show a progress bar.
    Returns:
      ``(result, drafter, drafter_params)``: how the run ended, and the trained drafter ready
      for ``api.generate_tokens``.
    """
    drafter, params = DraftModelDrafter.from_target_layers(target_cfg, target_params, layers,
                                                           draft_len)
    model = DraftModel(drafter.cfg, params)
    eval_fn = None
    if train_cfg.eval_every and dev_prompts:
        eval_fn = evaluate.tau_hook(target_cfg, target_params, dev_prompts, drafter,
                                    DraftModel.params, max_new_tokens=eval_tokens,
                                    stop_tokens=stop_tokens)
    result = loop.train(model, distill_loss, source, train_cfg, eval_fn=eval_fn,
                        progress=progress)
    return result, drafter, model.params()
