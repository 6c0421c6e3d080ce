"""Training EAGLE drafters on a tiny random target: the training-time-test attention pattern,
EAGLE-3 and EAGLE-1 losses that fall, and a trained drafter whose tau in the real loop rises
well above an untrained one's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import eagle
from specjax.models import attention as attn
from specjax.train import data, evaluate, loop
from specjax.train import eagle as eagle_train

from counting import TINY, counting_target, write_records

PARAMS = counting_target()
SEQ_LEN = 48


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory):
    return write_records(tmp_path_factory.mktemp("records"), TINY, PARAMS)


@pytest.fixture(scope="module")
def records(records_dir):
    return data.Records(records_dir)


def test_training_time_test_attention_matches_the_docstring():
    """Step 2 over a 3-token row, as drawn in specjax.train.eagle's docstring."""
    drawn = np.array([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                      [1, 1, 0, 0, 1, 0, 0, 1, 0],
                      [1, 1, 1, 0, 0, 1, 0, 0, 1]], bool)
    seg = jnp.ones((1, 3), jnp.int32)
    rules = [attn.Intersect((attn.Causal(), attn.Segments(seg, seg))), attn.Diagonal(),
             attn.Diagonal()]
    got = np.concatenate([np.asarray(attn.dense_mask(r, 1, 3, 3))[0] for r in rules], axis=1)
    np.testing.assert_array_equal(got, drawn)


def test_the_training_time_test_predicts_what_the_decoding_loop_drafts():
    """Two records packed in one row: step s of the training-time test at index j gives the
    logits the loop's drafter computes, after a fresh prefill of the record up to j with root
    token j + 1, for the depth-s node of the chain of the record's next tokens (train ==
    inference: pairs, RoPE positions, the diagonal ancestry, the reduced vocabulary)."""
    from specjax.drafters.base import Prefill
    from specjax.models import target
    from specjax.targets import DecoderTarget

    params = target.init_params(TINY, 3, scale=0.5)
    cfg = eagle.EagleConfig.eagle3(TINY, draft_vocab_size=40)
    own = eagle.init_params(cfg, 4, scale=0.3)
    counts = np.random.default_rng(0).integers(0, 100, TINY.vocab_size)
    own["d2t"] = jnp.asarray(eagle.draft_vocab(counts, 40))
    records = [[7, 3, 9, 12, 40, 5, 5, 18, 2], [11, 60, 33, 4, 4, 27, 8, 1, 19, 23]]
    where = [(0, 3), (1, 5)]  # (record, index j in it)
    steps = 3
    batch = {"tokens": jnp.asarray([sum(records, [])], jnp.int32),
             "segment_ids": jnp.asarray([[r for r, x in enumerate(records) for _ in x]],
                                        jnp.int32),
             "positions": jnp.asarray([[i for x in records for i in range(len(x))]], jnp.int32)}
    model = eagle_train.EagleModule(cfg, own, TINY, params)
    trained = [np.asarray(x[0]) for x in eagle_train.ttt_logits(model, batch, steps)]

    tgt = DecoderTarget(TINY)
    drafter = eagle.EagleDrafter(cfg, tgt)
    dp = eagle.drafter_params(own, params)
    starts = [0, len(records[0])]
    for r, j in where:
        rec = records[r]
        seen, seen_len = jnp.asarray([rec[:j + 1]], jnp.int32), jnp.asarray([j + 1], jnp.int32)
        _, taps, _ = target.prefill(params, TINY, seen, seen_len, 32, drafter.taps)
        root = jnp.asarray([rec[j + 1]], jnp.int32)
        state = drafter.init(dp, Prefill(seen, seen_len, taps, root, 32))
        node_step = drafter._node_step(dp, state, steps - 1)
        logits, out = eagle.draft_logits(cfg, tgt, dp, state.last), state.last  # depth 0
        for s in range(steps):
            want = np.asarray(logits)[0]
            np.testing.assert_allclose(trained[s][starts[r] + j], want, rtol=1e-4,
                                       atol=1e-4 * np.abs(want).max(), err_msg=f"step {s}")
            if s + 1 < steps:  # the depth-(s + 1) node: token j + 2 + s, its chain visible
                visible = jnp.asarray(np.tril(np.ones((steps - 1,) * 2, bool))[s][None, None])
                logits, out = node_step(s, out[:, None], jnp.asarray([[rec[j + 2 + s]]]),
                                        visible, s)
                logits, out = logits[:, 0], out[:, 0]


def _train(records, tmp_path, version, steps, **kw):
    dev, train_records = evaluate.hold_out(records, 4)
    source = loop.PackedSource(train_records, seq_len=SEQ_LEN, batch_size=4, seed=0)
    cfg = loop.TrainConfig(run_dir=str(tmp_path / f"v{version}"), steps=steps, lr=3e-3,
                           warmup_frac=0.1, save_every=steps, eval_every=steps, log_every=10)
    result, drafter, own = eagle_train.train(TINY, PARAMS, train_records, source, cfg,
                                             version=version, dev_prompts=dev, eval_tokens=16,
                                             progress=False, **kw)
    rows = loop.MetricsLog(cfg.run_dir).records()
    return rows, drafter, own


def test_eagle3_training_lowers_the_loss_and_raises_tau(records, tmp_path):
    rows, drafter, own = _train(records, tmp_path, 3, 150, draft_vocab_size=48, ttt_steps=3,
                                policy=eagle.DynamicTree(n_nodes=8, depth=3, top_k=3))
    losses = [r["loss"] for r in rows if "loss" in r]
    taus = [r["eval_tau"] for r in rows if "eval_tau" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert len(taus) == 2 and taus[1] > taus[0] + 0.5, taus
    assert all(r["eval_greedy_equal"] for r in rows if "eval_tau" in r)
    # The draft vocabulary holds the most frequent response tokens of the training records.
    counts = data.token_counts(evaluate.hold_out(records, 4)[1], TINY.vocab_size)
    ids = np.arange(48) + np.asarray(own["d2t"])
    assert counts[ids].min() >= np.delete(counts, ids).max()


def test_eagle1_training_lowers_the_loss(records, tmp_path):
    rows, _, _ = _train(records, tmp_path, 1, 60, policy=eagle.DynamicTree(8, 3, 3))
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.7 * losses[0]


def test_eagle1_warm_start_carries_its_token_order(records, tmp_path):
    """An EAGLE-1 drafter with a draft-vocabulary ranking trains from where it was (the
    ranking an index table, not a weight) and returns that ranking unchanged."""
    cfg = eagle.EagleConfig.eagle1(TINY)
    own = eagle.init_params(cfg, 1)
    order = np.random.default_rng(0).permutation(TINY.vocab_size).astype(np.int32)
    own["token_order"] = jnp.asarray(order)
    rows, _, out = _train(records, tmp_path, 1, 3, init=(cfg, own),
                          policy=eagle.DynamicTree(8, 3, 3))
    np.testing.assert_array_equal(np.asarray(out["token_order"]), order)
    assert np.isfinite([r["loss"] for r in rows if "loss" in r]).all()
    assert not np.allclose(np.asarray(out["fc"]), np.asarray(own["fc"]))


def test_cli_trains_eagle3_with_evaluations(records_dir, tmp_path, monkeypatch):
    from specjax import cli
    from specjax.io import models

    monkeypatch.setattr(models, "load", lambda name: models.LoadedModel(TINY, PARAMS, None))
    run = tmp_path / "run"
    assert cli.main(["train", "eagle3", "--target", "tiny", "--data", str(records_dir),
                     "--run-dir", str(run), "--steps", "20", "--batch", "4", "--seq-len",
                     str(SEQ_LEN), "--draft-vocab", "48", "--ttt-steps", "2", "--tree-nodes", "6",
                     "--tree-depth", "2", "--tree-top-k", "2", "--eval-every", "20",
                     "--save-every", "20", "--dev-prompts", "4", "--eval-tokens", "8",
                     "--no-progress"]) == 0
    rows = loop.MetricsLog(run).records()
    assert [r["step"] for r in rows if "eval_tau" in r] == [0, 20]
    assert all(r["eval_greedy_equal"] for r in rows if "eval_tau" in r)
    assert (run / loop.CHECKPOINTS).is_dir() and (run / loop.PLOT).stat().st_size > 0
    # The finished run exported its drafter in the official layout, in bfloat16.
    from specjax.io import official

    cfg, own = official.load_eagle(run / "drafter", TINY)
    assert cfg.version == 3 and cfg.draft_vocab_size == 48
    assert "BF16" in (run / "drafter" / "model.safetensors").read_bytes()[:4096].decode("latin1")


def test_cli_warm_starts_from_an_exported_drafter(records_dir, tmp_path, monkeypatch, capsys):
    """``--init`` starts from a drafter's weights: the first step's loss is the exported
    drafter's (bfloat16 aside), far below a fresh drafter's; a conflicting draft vocabulary
    is refused."""
    from specjax import cli
    from specjax.io import models

    monkeypatch.setattr(models, "load", lambda name: models.LoadedModel(TINY, PARAMS, None))
    common = ["train", "eagle3", "--target", "tiny", "--data", str(records_dir), "--batch", "4",
              "--seq-len", str(SEQ_LEN), "--ttt-steps", "2", "--eval-every", "0",
              "--dev-prompts", "4", "--log-every", "1", "--no-progress"]
    first, warm, fresh = tmp_path / "first", tmp_path / "warm", tmp_path / "fresh"
    assert cli.main(common + ["--run-dir", str(first), "--steps", "30", "--save-every", "30",
                              "--draft-vocab", "48", "--lr", "3e-3"]) == 0
    assert cli.main(common + ["--run-dir", str(warm), "--steps", "1", "--save-every", "1",
                              "--init", str(first / "drafter")]) == 0
    assert cli.main(common + ["--run-dir", str(fresh), "--steps", "1", "--save-every", "1",
                              "--draft-vocab", "48"]) == 0

    def loss_at(run, step):
        return next(r["loss"] for r in loop.MetricsLog(run).records() if r["step"] == step)

    trained, gap = loss_at(first, 30), loss_at(fresh, 1) - loss_at(first, 30)
    assert gap > 0.5
    assert abs(loss_at(warm, 1) - trained) < 0.25 * gap
    capsys.readouterr()
    assert cli.main(common + ["--run-dir", str(tmp_path / "bad"), "--steps", "1",
                              "--init", str(first / "drafter"), "--draft-vocab", "32"]) != 0
    assert "draft vocabulary has 48 ids, not 32" in capsys.readouterr().err
