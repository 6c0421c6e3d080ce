"""The shared training loop and the draft-model family on a tiny random target.

``specjax train draft-model`` on a learnable toy task (responses that count on by one): the
loss falls, metrics, plot and checkpoints are written, evaluations by the real speculative loop
are logged, SIGTERM saves a checkpoint at the step it arrives and the same command resumes. A
run killed with SIGKILL after a save and restarted ends with an uninterrupted run's parameters,
bit for bit. A packed row scores each record as if it were alone.

Runs that get killed are subprocesses of this very file (``python test_train_loop.py worker
...``) sharing one persistent compilation cache, so only the first pays the compile.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import specjax
from specjax.config import ModelConfig
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.models import target
from specjax.train import data, draft_model, evaluate, loop

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=64, max_position_embeddings=256)
SEQ_LEN, BATCH, STEPS, SAVE_EVERY = 32, 2, 30, 10  # of the worker runs


def write_records(directory: Path, n: int = 24) -> Path:
    """A one-shard distilled data directory: prompts of 3-8 random tokens, responses counting
    on from the prompt's last token for 4-12 tokens."""
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, TINY.vocab_size, gen.integers(3, 9)).tolist() for _ in range(n)]
    responses = [((p[-1] + 1 + np.arange(gen.integers(4, 13))) % TINY.vocab_size).tolist()
                 for p in prompts]
    arrays = data.shard_arrays(prompts, responses, list(range(n)), [False] * n, TINY.vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    data.write_atomic(directory / data.shard_name(0), data.npz_bytes(arrays))
    (directory / data.MANIFEST).write_text(json.dumps(
        {"settings": {"format_version": data.FORMAT_VERSION}, "n_shards": 1}))
    return directory


# ---------------------------------------------------------------------------------- worker


class SlowSource:
    """A data source that takes ``delay`` seconds per batch, so a test can kill the run
    between two checkpoints."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def next(self):
        time.sleep(self.delay)
        return self.inner.next()

    def state(self):
        return self.inner.state()

    def restore(self, state):
        self.inner.restore(state)


def worker(argv: list[str]) -> int:
    """Trains a one-layer draft model on the records in ``--data`` (a checkpoint every
    SAVE_EVERY steps, ``--delay`` seconds per batch) and writes the final params to
    ``--out``."""
    p = argparse.ArgumentParser()
    for name in ("--data", "--run-dir", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args(argv)
    _, train_records = evaluate.hold_out(data.Records(args.data), 2)
    source = SlowSource(loop.PackedSource(train_records, seq_len=SEQ_LEN, batch_size=BATCH,
                                          seed=3), args.delay)
    cfg = loop.TrainConfig(run_dir=args.run_dir, steps=STEPS, lr=1e-2, warmup_steps=3,
                           save_every=SAVE_EVERY, log_every=1, seed=5)
    result, _, params = draft_model.train(TINY, target.init_params(TINY), source, cfg, layers=1,
                                          progress=False)
    np.savez(args.out, *[np.asarray(x) for x in jax.tree.leaves(params)])
    print(json.dumps({"step": result.step, "resumed_from": result.resumed_from}), flush=True)
    return 0


# ------------------------------------------------------------------------------- helpers


def _worker_cmd(tmp: Path, run: str, out: str, delay: float = 0.0):
    return [sys.executable, __file__, "worker", "--data", str(tmp / "data"),
            "--run-dir", str(tmp / run), "--out", str(tmp / out), "--delay", str(delay)]


def _env(tmp: Path) -> dict:
    # The worker imports the specjax this process imported, whatever the installed one is.
    root = str(Path(specjax.__file__).parents[1])
    path = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, PYTHONPATH=path, JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _run_worker(tmp: Path, run: str, out: str, **kw) -> dict:
    proc = subprocess.run(_worker_cmd(tmp, run, out, **kw), env=_env(tmp), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _start_and_wait(tmp: Path, run: str, out: str, ready, **kw) -> subprocess.Popen:
    """Starts a worker and returns once ``ready()`` holds (the worker still running)."""
    proc = subprocess.Popen(_worker_cmd(tmp, run, out, **kw), env=_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"worker ended before it was ready:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("worker never got ready")
        time.sleep(0.01)
    return proc


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / loop.CHECKPOINTS).iterdir() if p.name.isdigit())


def _assert_same_params(a: Path, b: Path):
    with np.load(a) as x, np.load(b) as y:
        assert x.files == y.files
        for k in x.files:
            assert np.array_equal(x[k], y[k]), f"leaf {k} differs"


def _logged_steps(run_dir: Path) -> list[int]:
    try:
        return [r["step"] for r in loop.MetricsLog(run_dir).records() if "loss" in r]
    except ValueError:  # a line being written
        return []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A data directory and the final params of an uninterrupted worker run."""
    tmp = tmp_path_factory.mktemp("train")
    write_records(tmp / "data")
    result = _run_worker(tmp, "reference", "reference.npz")
    assert result == {"step": STEPS, "resumed_from": None}
    return tmp


# --------------------------------------------------------------------------------- tests


def test_train_config_validates():
    with pytest.raises(ValueError, match="steps"):
        loop.TrainConfig(run_dir="r", steps=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        loop.TrainConfig(run_dir="r", steps=10, warmup_steps=11)
    with pytest.raises(ValueError, match="b2"):
        loop.TrainConfig(run_dir="r", steps=10, b2=1.0)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    lr = loop.learning_rate(loop.TrainConfig(run_dir="r", steps=10, lr=1.0, warmup_steps=4,
                                             final_lr_frac=0.1))
    got = [float(lr(count)) for count in range(10)]  # the rates of steps 1..10
    np.testing.assert_allclose(got[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert all(a > b for a, b in zip(got[3:], got[4:]))
    np.testing.assert_allclose(got[-1], 0.1, rtol=1e-6)


def _train_cli(data_dir: Path, run: Path) -> int:
    from specjax import cli

    return cli.main(["train", "draft-model", "--target", "tiny", "--data", str(data_dir),
                     "--layers", "1", "--run-dir", str(run), "--steps", "40", "--batch", "4",
                     "--seq-len", str(SEQ_LEN), "--lr", "1e-2", "--warmup", "0.1",
                     "--save-every", "100", "--log-every", "10", "--eval-every", "40",
                     "--dev-prompts", "2", "--eval-tokens", "12", "--seed", "3",
                     "--no-progress"])


def test_cli_trains_a_draft_model_stops_on_sigterm_and_resumes(tmp_path, monkeypatch, capsys):
    """``specjax train draft-model`` on records whose responses count on by one. SIGTERM,
    sent while the 25th batch is drawn, saves a checkpoint at step 25 (save_every is 100) and
    exits 143; the same command then finishes the run. The loss falls, metrics, plot and
    checkpoints are written, and the evaluations by the real speculative loop on the
    held-out prompts are logged."""
    from specjax.io import models

    params = target.init_params(TINY)
    monkeypatch.setattr(models, "load", lambda name: models.LoadedModel(TINY, params, None))
    calls = []
    draw = loop.PackedSource.next

    def next_or_terminate(self):
        calls.append(1)
        if len(calls) == 25:
            os.kill(os.getpid(), signal.SIGTERM)
        return draw(self)

    monkeypatch.setattr(loop.PackedSource, "next", next_or_terminate)
    data_dir, run = write_records(tmp_path / "data"), tmp_path / "run"
    handler = signal.getsignal(signal.SIGTERM)

    assert _train_cli(data_dir, run) == 128 + signal.SIGTERM, capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is handler  # the loop's handler is gone again
    assert _checkpoint_steps(run) == [25]
    assert _logged_steps(run) == [10, 20, 25]
    saved = loop.checkpoint_manager(run).restore(
        25, args=ocp.args.Composite(data=ocp.args.JsonRestore())).data
    _, train_records = evaluate.hold_out(data.Records(data_dir), 2)
    replay = loop.PackedSource(train_records, seq_len=SEQ_LEN, batch_size=4, seed=3)
    for _ in range(25):
        draw(replay)
    assert saved == replay.state()  # the position after exactly 25 batches

    assert _train_cli(data_dir, run) == 0, capsys.readouterr().err
    records = loop.MetricsLog(run).records()
    train_rows = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_rows] == [10, 20, 25, 30, 40]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.2
    assert train_rows[-1]["accuracy"] > 0.9  # counting is learnt
    assert all(r["tokens_per_s"] > 0 for r in train_rows)
    evals = [r for r in records if "eval_tau" in r]
    assert [r["step"] for r in evals] == [0, 40]
    for r in evals:
        assert r["eval_tau"] >= 1 and r["eval_greedy_equal"] is True
    assert (run / loop.PLOT).stat().st_size > 0
    assert _checkpoint_steps(run) == [25, 40]
    # Training worked on copies: the target's own arrays are untouched.
    np.testing.assert_array_equal(params["layers"][0]["wqkv"],
                                  target.init_params(TINY)["layers"][0]["wqkv"])


def test_train_help_lists_the_families(capsys):
    from specjax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(family in out for family in ("draft-model", "eagle3", "eagle1"))


def test_tau_eval_runs_the_speculative_loop():
    params = target.init_params(TINY)
    drafter, drafter_params = DraftModelDrafter.from_target_layers(TINY, params, 1)
    out = evaluate.tau_eval(TINY, params, [[3, 4, 5, 6], [20, 21, 22]], drafter=drafter,
                            drafter_params=drafter_params, max_new_tokens=12)
    assert set(out) == {"tau", "tokens_per_s", "greedy_equal"}
    assert out["tau"] >= 1 and out["greedy_equal"] is True and out["tokens_per_s"] > 0


def _rows(row_records, seq_len):
    """A batch (the layout of ``data.pack``) with each row packing the records given for it."""
    batch = {k: np.zeros((len(row_records), seq_len), np.int32)
             for k in ("tokens", "segment_ids", "positions")}
    batch["loss_mask"] = np.zeros((len(row_records), seq_len), bool)
    for row, recs in enumerate(row_records):
        col = 0
        for segment, (tokens, mask) in enumerate(recs, start=1):
            span = slice(col, col + len(tokens))
            batch["tokens"][row, span], batch["loss_mask"][row, span] = tokens, mask
            batch["segment_ids"][row, span] = segment
            batch["positions"][row, span] = np.arange(len(tokens))
            col += len(tokens)
    return batch


def test_a_packed_row_scores_each_record_as_if_alone(tmp_path):
    drafter, params = DraftModelDrafter.from_target_layers(
        TINY, target.init_params(TINY, scale=0.3), 1)
    model = draft_model.DraftModel(drafter.cfg, params)
    records = data.Records(write_records(tmp_path / "data"))
    a, b = records[0], records[1]
    loss = jax.jit(lambda batch: draft_model.distill_loss(model, batch, None))
    (l1, m1), (l2, m2) = loss(_rows([[a, b]], SEQ_LEN)), loss(_rows([[a], [b]], SEQ_LEN))
    # A record's first response token is predicted from its prompt, never from another record.
    assert float(m1["loss_tokens"]) == float(m2["loss_tokens"]) == a[1].sum() + b[1].sum()
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)


def test_sigkill_after_a_save_then_resume_equals_uninterrupted(workdir):
    run = workdir / "killed"
    proc = _start_and_wait(workdir, "killed", "killed.npz",
                           lambda: (run / loop.CHECKPOINTS / str(SAVE_EVERY)).is_dir(),
                           delay=0.1)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert max(_checkpoint_steps(run)) < STEPS  # killed before the end
    assert not (workdir / "killed.npz").exists()
    result = _run_worker(workdir, "killed", "killed.npz")
    assert result["step"] == STEPS and result["resumed_from"] in (SAVE_EVERY, 2 * SAVE_EVERY)
    _assert_same_params(workdir / "reference.npz", workdir / "killed.npz")
    assert _logged_steps(run) == list(range(1, STEPS + 1))  # steps redone are logged once


def test_resuming_over_changed_data_is_refused(tmp_path):
    records = data.Records(write_records(tmp_path / "data"))
    source = loop.PackedSource(records, seq_len=SEQ_LEN, batch_size=BATCH)
    source.next()
    state = source.state()
    fewer = loop.PackedSource(evaluate.RecordSubset(records, range(len(records) - 1)),
                              seq_len=SEQ_LEN, batch_size=BATCH)
    with pytest.raises(ValueError, match="records"):
        fewer.restore(state)
    strict = loop.PackedSource(records, seq_len=SEQ_LEN, batch_size=BATCH, lookahead=1)
    with pytest.raises(ValueError, match="windows of 32 records, this source packs from 1"):
        strict.restore(state)
    older = {k: v for k, v in state.items() if k != "lookahead"}  # saved by strict packing
    again = loop.PackedSource(records, seq_len=SEQ_LEN, batch_size=BATCH)
    with pytest.raises(ValueError, match="windows of 1 records"):
        again.restore(older)
    again.restore(state)
    want = source.next()
    got = again.next()
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_hold_out_takes_the_first_prompts_and_trains_on_the_rest(tmp_path):
    records = data.Records(write_records(tmp_path / "data"))
    dev, rest = evaluate.hold_out(records, 3)
    for r in range(3):
        tokens, mask = records[r]
        assert dev[r] == tokens[: int(np.argmax(mask))].tolist()
    assert len(rest) == len(records) - 3
    np.testing.assert_array_equal(rest[0][0], records[3][0])
    with pytest.raises(ValueError, match="hold out"):
        evaluate.hold_out(records, len(records))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(worker(sys.argv[2:]))
