"""Distilled training data (specjax.train.data, specjax.train.distill, ``specjax data``): shard
round trips, loss masks exactly on responses, packing and its resume position, byte-identical
shards after a SIGKILL and restart, refused manifests, and the evaluation-set guard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specjax import cli
from specjax.train import data, distill

BENCH = Path("/work/shared/data/bench")
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama HF directory (written with NumPy, no torch) with a 256-word
    tokenizer whose ChatML tokens give it a chat format; ``<|im_end|>`` (id 2) is its eos."""
    from safetensors.numpy import save_file
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny") / "model"
    path.mkdir()
    v, d, f, n_layers, heads, kv, hd = 256, 32, 64, 2, 4, 2, 8
    (path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=v, hidden_size=d, intermediate_size=f,
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=hd, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True)))
    rng = np.random.default_rng(0)
    w = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                  p + "self_attn.q_proj.weight": (heads * hd, d),
                  p + "self_attn.k_proj.weight": (kv * hd, d),
                  p + "self_attn.v_proj.weight": (kv * hd, d),
                  p + "self_attn.o_proj.weight": (d, heads * hd),
                  p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                  p + "mlp.down_proj.weight": (d, f)})
    save_file({k: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else
                   0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in w.items()},
              str(path / "model.safetensors"))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), v)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path


def _words(n, start=0):
    return " ".join(f"w{6 + (start + i) % 250}" for i in range(n))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """12 prompts, one a conversation; formatted, 6 fit a 32-token width and 6 a 64-token one,
    so a run compiles two executables (with one cache size for 64 new tokens)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": _words(n, i)} for i, n in enumerate((3, 40, 9, 50, 15, 33, 21, 45, 26,
                                                             37, 55))]
    rows.append({"messages": [{"role": "user", "content": _words(5)},
                              {"role": "assistant", "content": _words(4, 9)},
                              {"role": "user", "content": _words(6, 3)}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


DISTILL_ARGS = ["--max-new-tokens", "64", "--batch-size", "2", "--shard-size", "2",
                "--no-progress"]


def _distill(capsys, model, prompts, out, *extra):
    rc = cli.main(["data", "distill", "--model", str(model), "--input", str(prompts), "--out",
                   str(out), *DISTILL_ARGS, *extra])
    return rc, capsys.readouterr()


@pytest.fixture(scope="module")
def reference_run(tiny_model, prompts_file, tmp_path_factory):
    """An uninterrupted run of the CLI (in-process): its output directory."""
    out = tmp_path_factory.mktemp("ref") / "data"
    rc = cli.main(["data", "distill", "--model", str(tiny_model), "--input", str(prompts_file),
                   "--out", str(out), *DISTILL_ARGS])
    assert rc == 0
    return out


# ------------------------------------------------------------------------------ records


def test_shard_round_trip_and_deterministic_bytes(tmp_path):
    prompts, responses = [[5, 6, 7], [8]], [[9, 10, 2], [11, 12]]
    arrays = data.shard_arrays(prompts, responses, [4, 0], [True, False], vocab_size=256)
    assert arrays["tokens"].dtype == np.uint16
    assert arrays["tokens"].tolist() == [5, 6, 7, 9, 10, 2, 8, 11, 12]
    assert arrays["offsets"].tolist() == [0, 6, 9]
    assert arrays["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1]  # the stop token too
    assert data.shard_arrays(prompts, responses, [4, 0], [True, False],
                             vocab_size=128256)["tokens"].dtype == np.int32
    blob = data.npz_bytes(arrays)
    time.sleep(2.1)  # zip timestamps have 2 s resolution: np.savez would differ by now
    assert data.npz_bytes(arrays) == blob
    data.write_atomic(tmp_path / "shard-00000.npz", blob)
    back = data.read_shard(tmp_path / "shard-00000.npz")
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k], a)
        assert back[k].dtype == a.dtype
    assert data.shard_summary(back) == dict(records=2, tokens=9, response_tokens=5, stopped=1)


def test_distilled_records_are_prompt_then_response(reference_run, tiny_model, prompts_file):
    from specjax.io import load

    tok = load(tiny_model).tokenizer
    manifest = json.loads((reference_run / "manifest.json").read_text())
    s = manifest["settings"]
    assert manifest["complete"] and manifest["n_shards"] == 6 and s["prompts"] == 12
    assert (s["target"], s["vocab_size"], s["temperature"], s["top_p"], s["top_k"]) == (
        str(tiny_model), 256, 0.7, 0.8, 20)
    assert s["inputs"][0]["sha256"] == distill.sha256_file(prompts_file)
    assert [x["records"] for x in manifest["shards"]] == [2] * 6
    recs = data.Records(reference_run)
    assert len(recs) == 12 and sorted(recs.prompt_index.tolist()) == list(range(12))
    assert recs.n_tokens == sum(x["tokens"] for x in manifest["shards"]) == recs.lengths.sum()
    assert recs.n_response_tokens == sum(x["response_tokens"] for x in manifest["shards"])
    lines = prompts_file.read_text().splitlines()
    for r in range(len(recs)):
        tokens, mask = recs[r]
        row = json.loads(lines[recs.prompt_index[r]])
        prompt = tok.encode_chat(row.get("messages") or [{"role": "user",
                                                          "content": row["prompt"]}])
        n_resp = len(tokens) - len(prompt)
        assert tokens[:len(prompt)].tolist() == prompt
        assert mask.tolist() == [False] * len(prompt) + [True] * n_resp
        assert 1 <= n_resp <= 64
        stopped = bool(recs.stopped[r])
        assert (int(tokens[-1]) in tok.eos_ids) == stopped
        assert stopped or n_resp == 64  # a row that did not stop ran to max_new_tokens
        assert not any(int(t) in tok.eos_ids for t in tokens[len(prompt):-1])


# ------------------------------------------------------------------------------ packing


class _FakeRecords:
    """Record r is tokens 100r, 100r+1, ... of length lengths[r], the second half masked."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, r):
        n = self.lengths[r]
        return (100 * r + np.arange(n, dtype=np.int32),
                np.arange(n) >= n // 2)


@pytest.mark.parametrize("lookahead", [1, 32])
def test_pack_segments_positions_and_truncation(lookahead):
    recs = _FakeRecords([3, 5, 2, 12, 4, 1, 6])
    batch, pos = next(data.pack(recs, seq_len=8, batch_size=3, seed=0, lookahead=lookahead))
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "tokens": ((3, 8), np.int32), "segment_ids": ((3, 8), np.int32),
        "positions": ((3, 8), np.int32), "loss_mask": ((3, 8), np.bool_)}
    order = data.epoch_order(7, 0, 0)
    seen = []
    for row in range(3):
        seg, toks = batch["segment_ids"][row], batch["tokens"][row]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            assert at.tolist() == list(range(at[0], at[-1] + 1))  # contiguous
            r = int(toks[at[0]]) // 100
            want_tokens, want_mask = recs[r]
            n = min(len(want_tokens), 8)  # the 12-token record is truncated to 8
            assert len(at) == n and batch["positions"][row, at].tolist() == list(range(n))
            assert toks[at].tolist() == want_tokens[:n].tolist()
            assert batch["loss_mask"][row, at].tolist() == want_mask[:n].tolist()
            seen.append(r)
        assert not batch["loss_mask"][row, seg == 0].any()
        assert (batch["tokens"][row, seg == 0] == 0).all()
    if lookahead == 1:  # records placed in the epoch's order, the next one read ahead
        assert seen + [int(order[p]) for p in pos.pending] == order[:pos.index].tolist()
    else:
        assert sorted(seen + [int(order[p]) for p in pos.pending]) == sorted(order[:pos.index])


def test_pack_fills_each_row_from_a_window_of_the_next_records():
    """Lengths 5 6 2 3 8 1 in epoch order, rows of 8, a window of 3: each row takes the first
    record of the window that fits the space left, the window refilling from the order."""
    order = data.epoch_order(6, 0, 0)
    lengths = [0] * 6
    for at, n in enumerate([5, 6, 2, 3, 8, 1]):
        lengths[int(order[at])] = n
    recs = _FakeRecords(lengths)
    stream = data.pack(recs, seq_len=8, batch_size=3, seed=0, lookahead=3)

    def rows(batch):  # order positions of each row's records
        where = {int(r): at for at, r in enumerate(order)}
        return [[where[int(batch["tokens"][row, np.flatnonzero(batch["segment_ids"][row] == s)[0]])
                       // 100] for s in range(1, batch["segment_ids"][row].max() + 1)]
                for row in range(3)]

    batch, pos = next(stream)
    assert rows(batch) == [[0, 2], [1, 5], [3]]
    assert pos == data.PackPosition(epoch=0, index=6, pending=(4,))
    batch, pos = next(stream)
    assert rows(batch) == [[4], [], []] and pos == data.PackPosition(epoch=0, index=6)
    assert next(stream)[1].epoch == 1
    strict = next(data.pack(recs, seq_len=8, batch_size=3, seed=0, lookahead=1))[0]
    assert rows(strict) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="pending order positions must lie before index 2"):
        data.PackPosition(epoch=0, index=2, pending=(3,))
    with pytest.raises(ValueError, match="distinct and ascending"):
        data.PackPosition(epoch=0, index=4, pending=(2, 1))
    assert data.PackPosition.from_dict({"epoch": 1, "index": 4}) == data.PackPosition(1, 4)


@pytest.mark.parametrize("lookahead", [1, 3, 32])
def test_pack_places_every_record_once_per_epoch(lookahead):
    lengths = [int(n) for n in np.random.default_rng(2).integers(1, 30, 40)]
    recs = _FakeRecords(lengths)
    placed = {0: [], 1: []}
    for batch, pos in data.pack(recs, seq_len=24, batch_size=3, seed=1, lookahead=lookahead):
        if pos.epoch > 1:
            break
        for row in range(3):
            seg = batch["segment_ids"][row]
            placed[pos.epoch] += [int(batch["tokens"][row, np.flatnonzero(seg == s)[0]]) // 100
                              for s in range(1, seg.max() + 1)]
    for epoch in (0, 1):
        assert sorted(placed[epoch]) == list(range(40))


def test_pack_resumes_exactly_from_a_saved_position():
    recs = _FakeRecords([int(n) for n in np.random.default_rng(1).integers(1, 20, 50)])
    stream = data.pack(recs, seq_len=32, batch_size=2, seed=3)
    run = [next(stream) for _ in range(12)]  # spans epoch boundaries
    assert {p.epoch for _, p in run} >= {0, 1}
    saved = data.PackPosition.from_dict(json.loads(json.dumps(run[4][1].to_dict())))
    assert saved.pending  # records read ahead and waiting for a row
    resumed = data.pack(recs, seq_len=32, batch_size=2, seed=3, start=saved)
    for (want, want_pos), (got, got_pos) in zip(run[5:], resumed):
        assert got_pos == want_pos
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    other = next(data.pack(recs, seq_len=32, batch_size=2, seed=4))[0]
    assert not np.array_equal(other["tokens"], run[0][0]["tokens"])


# ------------------------------------------------------------------------------ resume


def test_sigkill_then_restart_gives_identical_shards(reference_run, tiny_model, prompts_file,
                                                     tmp_path):
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "specjax.cli", "data", "distill", "--model", str(tiny_model),
           "--input", str(prompts_file), "--out", str(out), *DISTILL_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "shard-00000.npz").exists():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    still_running = proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert still_running and proc.returncode == -signal.SIGKILL
    assert not (out / "shard-00005.npz").exists()  # killed mid-run
    first = (out / "shard-00000.npz").read_bytes()
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert (out / "shard-00000.npz").read_bytes() == first  # kept, not regenerated
    names = sorted(p.name for p in reference_run.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (reference_run / name).read_bytes(), name


def test_worker_processes_write_the_same_shards(reference_run, tiny_model, prompts_file,
                                                tmp_path, capsys):
    """Two worker processes (single-threaded XLA each, every other shard) write the bytes one
    process writes, manifest included; a worker count below 1 is refused."""
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "specjax.cli", "data", "distill", "--model", str(tiny_model),
           "--input", str(prompts_file), "--out", str(out), *DISTILL_ARGS, "--workers", "2"]
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    names = sorted(p.name for p in reference_run.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (reference_run / name).read_bytes(), name
    rc, io = _distill(capsys, tiny_model, prompts_file, tmp_path / "other", "--workers", "0")
    assert rc == 2 and "workers must be >= 1, got 0" in io.err


def test_resume_with_other_settings_is_refused(reference_run, tiny_model, prompts_file, capsys):
    before = (reference_run / "manifest.json").read_bytes()
    rc, io = _distill(capsys, tiny_model, prompts_file, reference_run, "--temperature", "0.9")
    assert rc == 2 and "different settings: temperature = 0.7 there, 0.9 now" in io.err
    rc, io = _distill(capsys, tiny_model, prompts_file, reference_run, "--seed", "1")
    assert rc == 2 and "seed = 0 there, 1 now" in io.err
    assert (reference_run / "manifest.json").read_bytes() == before


# ------------------------------------------------------------------------------ inputs


def test_input_specs_and_bad_lines(tmp_path):
    assert distill.InputSpec.parse("a/b.jsonl") == distill.InputSpec("a/b.jsonl")
    assert distill.InputSpec.parse("a/b.jsonl:question") == distill.InputSpec("a/b.jsonl",
                                                                               "question")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x"}\n\n{"messages": [{"role": "user", "content": "a"}, '
                 '{"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: the conversation ends in a 'assistant'"):
        distill.read_prompts(distill.InputSpec(str(f)), 0)
    f.write_text('{"task_id": 3, "text": "x"}\n{"task_id": 12, "text": "y"}\n')
    prompts, n_lines = distill.read_prompts(distill.InputSpec(str(f), "text"), 10, (11, 510))
    assert n_lines == 2 and [(p.index, p.line, p.messages) for p in prompts] == [
        (10, 1, (("user", "x"),))]
    with pytest.raises(ValueError, match=r"p.jsonl:1: no field 'prompt'"):
        distill.read_prompts(distill.InputSpec(str(f), "prompt"), 0)


def _jsonl_field(path, field, line):
    with open(path) as f:
        for i, row in enumerate(f, 1):
            if i == line:
                return json.loads(row)[field]


@pytest.mark.skipif(not BENCH.exists(), reason="needs the benchmark files")
def test_shipped_fingerprints_match_a_rebuild():
    shipped, rebuilt = data.EvalFingerprints.load(), data.EvalFingerprints.build(BENCH)
    assert shipped.names == rebuilt.names and shipped.shingle_words == rebuilt.shingle_words
    for k in ("full", "full_set", "shingles", "shingle_set"):
        np.testing.assert_array_equal(getattr(shipped, k), getattr(rebuilt, k))
    assert data.FINGERPRINT_FILE.stat().st_size < 2_000_000


@pytest.mark.skipif(not BENCH.exists(), reason="needs the benchmark files")
def test_eval_prompts_are_refused(tiny_model, tmp_path, capsys):
    test_q = _jsonl_field(BENCH / "gsm8k/test.jsonl", "question", 7)
    train_q = _jsonl_field(BENCH / "gsm8k/train.jsonl", "question", 1)
    fp = data.EvalFingerprints.load()
    assert fp.match(test_q) == "GSM8K test" and fp.match(train_q) is None
    # Case and spacing do not hide a copy, and a long enough excerpt is caught.
    assert fp.match("  " + test_q.upper().replace(" ", "\n ")) == "GSM8K test"
    assert fp.match("Solve: " + " ".join(test_q.split()[2:14])) == "GSM8K test"
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps({"question": train_q}) + "\n" + json.dumps({"question": test_q})
                 + "\n")
    rc, io = _distill(capsys, tiny_model, f"{f}:question", tmp_path / "out")
    assert rc == 2 and f"{f}:2: prompt overlaps the evaluation set GSM8K test" in io.err
    assert not (tmp_path / "out").exists()
    from specjax.io import load

    cfg = distill.DistillConfig(inputs=(distill.InputSpec(str(f), "question"),),
                                target=str(tiny_model), drop_eval_overlap=True)
    plan = distill.make_plan(cfg, load(tiny_model).tokenizer, fp)
    assert plan.order == [0] and plan.settings["dropped_eval_overlap"] == [
        f"{f}:2 (GSM8K test)"]


# ------------------------------------------------------------------------------ taps


def test_named_tap_sets_follow_the_reference_rules():
    from specjax.train import taps

    # DFlash's default for 30 layers rounds 7.5 up to 8 and 20.5 down to 20 (half to even).
    assert taps.dflash_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert taps.dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert taps.dflash_layer_ids(30, 1) == [15]
    assert taps.tap_set("eagle3", 30) == (2, 15, 27)
    assert taps.tap_set("dflash", 30) == (2, 9, 15, 21, 28)  # outputs of those layers
    with pytest.raises(ValueError, match="unknown tap set 'medusa'"):
        taps.tap_set("medusa", 30)
    with pytest.raises(ValueError, match="at least 4 layers"):
        taps.tap_set("eagle3", 2)


def test_data_stats_and_tap_extraction(reference_run, capsys):
    rc = cli.main(["data", "stats", str(reference_run), "--measure-taps", "--taps", "eagle1",
                   "--seq-len", "64", "--batch-size", "2", "--batches", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    recs = data.Records(reference_run)
    assert f"{len(recs)} records" in out and f"{recs.n_tokens} tokens" in out
    # The eagle1 tap of the tiny target is one state of 32 floats, stored in bfloat16.
    row = next(line for line in out.splitlines() if line.startswith("| eagle1 "))
    assert f"| {32 * 2} |" in row
    assert float(row.split("|")[3]) > 0
