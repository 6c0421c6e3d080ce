"""Training DFlash drafters: the anchor-block attention as drawn, anchors, the loss weights by
position, and on a tiny target a loss that falls and a tau well above an untrained drafter's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import dflash
from specjax.drafters.dflash import DFlashConfig
from specjax.models import attention as attn
from specjax.train import data, evaluate, loop
from specjax.train import dflash as dflash_train

from counting import TINY, counting_target, write_records

PARAMS = counting_target()
SEQ_LEN = 48


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory):
    return write_records(tmp_path_factory.mktemp("records"), TINY, PARAMS)


@pytest.fixture(scope="module")
def records(records_dir):
    return data.Records(records_dir)


def test_anchor_block_attention_matches_the_docstring():
    """A 7-token row, anchors 1 and 4, blocks of 2, as drawn in specjax.train.dflash."""
    drawn = np.array([[1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
                      [1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
                      [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1],
                      [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]], bool)
    cfg = DFlashConfig.for_target(TINY, n_layers=1, block_size=2)
    seg = jnp.ones((1, 7), jnp.int32)
    pos = jnp.arange(7)[None]
    anchors = jnp.asarray([[1, 4]], jnp.int32)
    block_pos = jnp.asarray([[1, 2, 4, 5]], jnp.int32)
    ctx_rule, block_rule = dflash_train.training_rules(cfg, 0, anchors, seg, pos, block_pos, 2)
    got = np.concatenate([np.asarray(attn.dense_mask(ctx_rule, 1, 4, 7))[0],
                          np.asarray(attn.dense_mask(block_rule, 1, 4, 4))[0]], axis=1)
    np.testing.assert_array_equal(got, drawn)
    # A causal layer sees only the earlier keys of its block; a second record's block sees
    # none of the first record's context.
    causal = dflash_train.training_rules(dataclasses.replace(cfg, is_causal=True), 0, anchors,
                                         seg, pos, block_pos, 2)[1]
    np.testing.assert_array_equal(np.asarray(attn.dense_mask(causal, 1, 4, 4))[0],
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
    seg2 = jnp.asarray([[1, 1, 1, 2, 2, 2, 2]], jnp.int32)
    ctx2, _ = dflash_train.training_rules(cfg, 0, anchors, seg2, pos, block_pos, 2)
    np.testing.assert_array_equal(np.asarray(attn.dense_mask(ctx2, 1, 4, 7))[0, 2],
                                  [0, 0, 0, 1, 0, 0, 0])


def test_anchors_are_distinct_sorted_supervised_positions():
    mask = jnp.asarray([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], bool)
    seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2], [1] * 10], jnp.int32)
    anchors, ok = dflash_train.sample_anchors(jax.random.key(0), mask, seg, 4)
    anchors, ok = np.asarray(anchors), np.asarray(ok)
    # Row 0's candidates (own and next token supervised, same record): 2, 3, 6, 7, 8.
    assert ok[0].all() and set(anchors[0]) <= {2, 3, 6, 7, 8}
    assert list(anchors[0]) == sorted(set(anchors[0]))
    # Row 1 has one candidate (1): one valid anchor first, then padding.
    assert ok[1].tolist() == [True, False, False, False] and anchors[1, 0] == 1
    seen = set()
    for seed in range(30):
        a, _ = dflash_train.sample_anchors(jax.random.key(seed), mask, seg, 4)
        seen.add(tuple(np.asarray(a)[0]))
    assert len(seen) == 5  # every 4 of the 5 candidates comes up: the draw is uniform-ish


def test_loss_weights_by_position():
    np.testing.assert_allclose(np.asarray(dflash_train.position_weights(16, 7.0)),
                               np.exp(-np.arange(15) / 7.0), rtol=1e-6)
    ce = jnp.asarray([[np.log(2.0), np.log(4.0), 0.0, 1.0]])
    valid = jnp.asarray([[True, True, True, False]])
    q = 0.5 * np.array([0.5, 0.25, 1.0]) + 0.5  # smoothed exp(-CE)
    survive = np.cumprod(q)
    want = [survive.sum(), survive[1:].sum(), survive[2:].sum(), 0.0]
    np.testing.assert_allclose(np.asarray(dflash_train.dpace_weights(ce, valid))[0], want,
                               rtol=1e-6)


@pytest.mark.parametrize("mask_token, sliding", [(None, False), (60, True)],
                         ids=["learned-mask-full", "token-mask-causal-sliding"])
def test_the_training_pass_predicts_what_the_decoding_loop_drafts(mask_token, sliding):
    """Two records packed in one row, an anchor in each: the training pass's block outputs
    give the logits the loop's drafter computes after a fresh prefill of the record cut
    before the anchor, with the anchor as the root (train == inference: taps, context
    positions, block positions, masks)."""
    from specjax.drafters.base import Prefill
    from specjax.models import target
    from specjax.targets import DecoderTarget

    params = target.init_params(TINY, 3, scale=0.5)
    cfg = DFlashConfig.for_target(TINY, n_layers=2, block_size=5, n_taps=2)
    if sliding:
        cfg = dataclasses.replace(cfg, mask_token_id=mask_token,
                                  layer_types=("sliding_attention", "full_attention"),
                                  sliding_window=5)
    own = dflash.init_params(cfg, 4, scale=0.3)
    records = [[7, 3, 9, 12, 40, 5, 5, 18, 2], [11, 60, 33, 4, 4, 27, 8, 1, 19, 23]]
    anchors = [(0, 6), (1, 4)]  # (record, index in it)
    tokens = sum(records, [])
    batch = {"tokens": jnp.asarray([tokens], jnp.int32),
             "segment_ids": jnp.asarray([[r for r, x in enumerate(records) for _ in x]],
                                        jnp.int32),
             "positions": jnp.asarray([[i for x in records for i in range(len(x))]], jnp.int32)}
    starts = [0, len(records[0])]
    where = jnp.asarray([[starts[r] + i for r, i in anchors]], jnp.int32)
    model = dflash_train.DFlashModule(cfg, own, TINY, params)
    tgt = DecoderTarget(TINY)
    trained = tgt.lm_head(params, dflash_train.block_outputs(model, batch, where)[0])

    drafter = dflash.DFlashDrafter(cfg, tgt)
    dp = dflash.drafter_params(own, params)
    for j, (r, i) in enumerate(anchors):
        seen = jnp.asarray([records[r][:i]], jnp.int32)
        seen_len = jnp.asarray([i], jnp.int32)
        _, taps, _ = target.prefill(params, TINY, seen, seen_len, 32, drafter.taps)
        root = jnp.asarray([records[r][i]], jnp.int32)
        state = drafter.init(dp, Prefill(seen, seen_len, taps, root, 32))
        drafted = np.asarray(drafter.block_logits(dp, state, root))[0]  # [Bk - 1, V]
        np.testing.assert_allclose(np.asarray(trained[j]), drafted, rtol=1e-4,
                                   atol=1e-4 * np.abs(drafted).max())


def test_a_loss_that_scores_the_first_positions_only(records):
    """``scored=1`` scores block position 1 alone: its loss is the mean cross-entropy of the
    position-1 labels under the head over the training pass's outputs, and its agreement the
    share of those labels that are the head's top-1 (the same anchors as the full loss);
    ``scored=Bk-1`` is the full loss."""
    from specjax.targets import DecoderTarget

    cfg = DFlashConfig.for_target(TINY, n_layers=1, block_size=4, n_taps=2)
    model = dflash_train.DFlashModule(cfg, dflash.init_params(cfg, 2, scale=0.3), TINY, PARAMS)
    source = loop.PackedSource(records, seq_len=SEQ_LEN, batch_size=2, seed=0)
    batch = {k: jnp.asarray(v) for k, v in source.next().items()}
    rng = jax.random.key(5)
    full_loss, full = dflash_train.block_loss(model, batch, rng, n_anchors=8)
    one_loss, one = dflash_train.block_loss(model, batch, rng, n_anchors=8, scored=1)
    anchors, ok = dflash_train.sample_anchors(rng, batch["loss_mask"].astype(bool),
                                              batch["segment_ids"], 8)
    logits = DecoderTarget(TINY).lm_head(
        PARAMS, dflash_train.block_outputs(model, batch, anchors)[:, :, 0])  # [B, A, V]
    labels = jnp.take_along_axis(batch["tokens"], anchors + 1, axis=1)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
    hit = jnp.argmax(logits, -1) == labels
    assert int(one["loss_tokens"]) == int(ok.sum()) > 0
    np.testing.assert_allclose(float(one_loss), float(jnp.sum(ce * ok) / ok.sum()), rtol=1e-5)
    np.testing.assert_allclose(float(one["accuracy"]), float(jnp.sum(hit & ok) / ok.sum()))
    np.testing.assert_allclose(float(one["accept_len"]), float(one["accuracy"]))
    assert int(full["loss_tokens"]) > int(one["loss_tokens"])
    assert not np.isclose(float(full_loss), float(one_loss))
    all_loss, everything = dflash_train.block_loss(model, batch, rng, n_anchors=8, scored=3)
    assert float(all_loss) == float(full_loss) and everything == full
    with pytest.raises(ValueError, match="scored must be in 1..3"):
        dflash_train.block_loss(model, batch, rng, n_anchors=8, scored=4)


def test_a_draft_vocabulary_loss_is_the_softmax_over_its_ids(records):
    """With ``vocab_ids`` the loss is the cross-entropy of the labels under the softmax over
    those ids' logits only, a label outside them unscored (and a miss); the whole vocabulary
    as ``vocab_ids`` is the full loss."""
    from specjax.targets import DecoderTarget

    cfg = DFlashConfig.for_target(TINY, n_layers=1, block_size=4, n_taps=2)
    model = dflash_train.DFlashModule(cfg, dflash.init_params(cfg, 2, scale=0.3), TINY, PARAMS)
    source = loop.PackedSource(records, seq_len=SEQ_LEN, batch_size=2, seed=0)
    batch = {k: jnp.asarray(v) for k, v in source.next().items()}
    rng = jax.random.key(5)
    anchors, ok = dflash_train.sample_anchors(rng, batch["loss_mask"].astype(bool),
                                              batch["segment_ids"], 8)
    labels = np.asarray(jnp.take_along_axis(batch["tokens"], anchors + 1, axis=1))
    # Half of the position-1 labels' ids and every other id below 40: some labels unscored.
    seen = np.unique(labels[np.asarray(ok)])
    ids = np.union1d(seen[::2], np.arange(0, 40, 2)).astype(np.int32)
    loss, metrics = dflash_train.block_loss(model, batch, rng, n_anchors=8, scored=1,
                                            vocab_ids=jnp.asarray(ids))
    logits = np.asarray(DecoderTarget(TINY).lm_head(
        PARAMS, dflash_train.block_outputs(model, batch, anchors)[:, :, 0]))[..., ids]
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    known = np.isin(labels, ids) & np.asarray(ok)
    at = np.searchsorted(ids, labels).clip(0, len(ids) - 1)
    ce = -np.take_along_axis(logp, at[..., None], -1)[..., 0]
    hit = (ids[np.argmax(logits, -1)] == labels) & known
    assert 0 < known.sum() < np.asarray(ok).sum()
    assert int(metrics["loss_tokens"]) == int(known.sum())
    np.testing.assert_allclose(float(loss), ce[known].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), hit.sum() / np.asarray(ok).sum())
    full_loss, full = dflash_train.block_loss(model, batch, rng, n_anchors=8)
    every_loss, every = dflash_train.block_loss(model, batch, rng, n_anchors=8,
                                                vocab_ids=jnp.arange(TINY.vocab_size))
    np.testing.assert_allclose(float(every_loss), float(full_loss), rtol=1e-5)
    assert jax.tree.map(float, every) == jax.tree.map(float, full)


def test_a_draft_vocabulary_needs_a_whole_ranking(records, tmp_path):
    source = loop.PackedSource(records, seq_len=SEQ_LEN, batch_size=2, seed=0)
    cfg = loop.TrainConfig(run_dir=str(tmp_path / "run"), steps=1)
    dcfg = DFlashConfig.for_target(TINY, n_layers=1, block_size=4)
    recipe = dflash_train.Recipe(draft_vocab=8)
    with pytest.raises(ValueError, match="pass the training records' token_order"):
        dflash_train.train(TINY, PARAMS, source, cfg, dcfg, recipe=recipe, progress=False)
    with pytest.raises(ValueError, match="does not rank each of the 61 ids exactly once"):
        dflash_train.train(TINY, PARAMS, source, cfg, dcfg, recipe=recipe, progress=False,
                           token_order=np.zeros(TINY.vocab_size, np.int32))
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        dflash_train.Recipe(draft_vocab=0)


def _train(records, tmp_path, steps, name, **kw):
    dev, train_records = evaluate.hold_out(records, 4)
    source = loop.PackedSource(train_records, seq_len=SEQ_LEN, batch_size=4, seed=0)
    cfg = loop.TrainConfig(run_dir=str(tmp_path / name), steps=steps, lr=3e-3, warmup_frac=0.04,
                           save_every=steps, eval_every=steps, log_every=10)
    dcfg = DFlashConfig.for_target(TINY, n_layers=1, block_size=4)
    result, drafter, own = dflash_train.train(
        TINY, PARAMS, source, cfg, dcfg, recipe=dflash_train.Recipe(n_anchors=16, **kw),
        dev_prompts=dev, eval_tokens=16, progress=False)
    return loop.MetricsLog(cfg.run_dir).records(), drafter, own


@pytest.mark.parametrize("dpace", [False, True], ids=["decay", "dpace"])
def test_dflash_training_lowers_the_loss_and_raises_tau(records, tmp_path, dpace):
    rows, drafter, own = _train(records, tmp_path, 120, f"dpace{dpace}", dpace=dpace)
    losses = [r["loss"] for r in rows if "loss" in r]
    taus = [r["eval_tau"] for r in rows if "eval_tau" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert len(taus) == 2 and taus[1] > taus[0] + 0.5, taus
    assert all(r["eval_greedy_equal"] for r in rows if "eval_tau" in r)
    dflash.check_params(drafter.cfg, own)


def test_cli_trains_dflash_and_exports_it(records_dir, tmp_path, monkeypatch, capsys):
    from specjax import cli
    from specjax.io import models, official

    monkeypatch.setattr(models, "load", lambda name: models.LoadedModel(TINY, PARAMS, None))
    run = tmp_path / "run"
    assert cli.main(["train", "dflash", "--target", "tiny", "--data", str(records_dir),
                     "--run-dir", str(run), "--steps", "10", "--batch", "4", "--seq-len",
                     str(SEQ_LEN), "--block-size", "4", "--taps", "2", "--anchors", "8",
                     "--scored", "2", "--eval-every", "10", "--save-every", "10",
                     "--dev-prompts", "4", "--eval-tokens", "8", "--no-progress"]) == 0
    rows = loop.MetricsLog(run).records()
    assert [r["step"] for r in rows if "eval_tau" in r] == [0, 10]
    assert all(r["eval_greedy_equal"] for r in rows if "eval_tau" in r)
    # The reference recipe's optimizer settings are the defaults.
    args = cli.build_parser().parse_args(["train", "dflash", "--data", "d", "--run-dir", "r"])
    assert (args.lr, args.warmup) == (6e-4, 0.04)
    cfg, own = official.load_dflash(run / "drafter", TINY)
    assert (cfg.block_size, cfg.layer.n_layers, cfg.mask_token_id) == (4, 1, None)
    assert "BF16" in (run / "drafter" / "model.safetensors").read_bytes()[:4096].decode("latin1")
    # The export ranks the trained-on records' response tokens (its draft vocabulary); 'data
    # rank' ranks a data directory's into any drafter the same way.
    from specjax.drafters import vocab

    trained_on = evaluate.hold_out(data.Records(records_dir), 4)[1]
    ranking = vocab.frequency_order(data.token_counts(trained_on, TINY.vocab_size))
    np.testing.assert_array_equal(np.asarray(own["token_order"]), ranking)
    official.save_dflash(cfg, {k: v for k, v in own.items() if k != "token_order"},
                         tmp_path / "unranked")
    assert cli.main(["data", "rank", str(records_dir), "--drafter",
                     str(tmp_path / "unranked")]) == 0
    assert f"token_order of {TINY.vocab_size} ids" in capsys.readouterr().out
    _, ranked = official.load_dflash(tmp_path / "unranked", TINY)
    everything = vocab.frequency_order(data.token_counts(data.Records(records_dir),
                                                         TINY.vocab_size))
    np.testing.assert_array_equal(np.asarray(ranked["token_order"]), everything)
    # A warm start (--init) trains from the exported weights: one step at a vanishing learning
    # rate exports them unchanged; an option that contradicts their shape is refused.
    warm = tmp_path / "warm"
    common = ["train", "dflash", "--target", "tiny", "--data", str(records_dir), "--steps", "1",
              "--batch", "4", "--seq-len", str(SEQ_LEN), "--anchors", "8", "--eval-every", "0",
              "--save-every", "1", "--dev-prompts", "4", "--no-progress",
              "--init", str(run / "drafter")]
    assert cli.main(common + ["--run-dir", str(warm), "--lr", "1e-9", "--block-size", "4"]) == 0
    _, again = official.load_dflash(warm / "drafter", TINY)
    jax.tree.map(np.testing.assert_array_equal, again, own)
    # --draft-vocab trains over the ranking's first ids, evaluates drafting from them, and
    # makes them the export's default draft vocabulary.
    small = tmp_path / "small"
    assert cli.main(common + ["--run-dir", str(small), "--draft-vocab", "40", "--eval-every",
                              "1", "--eval-tokens", "8"]) == 0
    evals = [r for r in loop.MetricsLog(small).records() if "eval_tau" in r]
    assert len(evals) == 2 and all(r["eval_greedy_equal"] for r in evals)
    cfg, ranked_own = official.load_dflash(small / "drafter", TINY)
    assert cfg.draft_vocab_size == 40
    np.testing.assert_array_equal(np.asarray(ranked_own["token_order"]), ranking)
    # Warm-started from that export without --draft-vocab, a run trains over the whole
    # vocabulary and exports it as the default.
    whole = common[:-1] + [str(small / "drafter"), "--run-dir", str(tmp_path / "whole")]
    assert cli.main(whole + ["--lr", "1e-9"]) == 0
    assert official.load_dflash(tmp_path / "whole" / "drafter", TINY)[0].draft_vocab_size is None
    capsys.readouterr()
    assert cli.main(common + ["--run-dir", str(tmp_path / "bad"), "--block-size", "8"]) == 2
    assert "--block-size 8 differs from the initial drafter's 4" in capsys.readouterr().err
    # More --layers than the initial drafter's deepens it; the appended layer trains from its
    # first step (its zeroed output projection moves). Fewer are refused.
    deep = tmp_path / "deep"
    assert cli.main(common + ["--run-dir", str(deep), "--lr", "1e-3", "--layers", "2"]) == 0
    assert "deepening the initial drafter from 1 to 2 layers" in capsys.readouterr().err
    cfg, grown = official.load_dflash(deep / "drafter", TINY)
    assert cfg.layer.n_layers == 2 and np.any(np.asarray(grown["layers"][1]["wo"]))
    back = common[:-1] + [str(deep / "drafter"), "--run-dir", str(tmp_path / "fewer")]
    assert cli.main(back + ["--layers", "1"]) == 2
    assert "--layers 1 differs from the initial drafter's 2" in capsys.readouterr().err
