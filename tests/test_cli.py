"""The ``specjax`` command line, run in-process: help text, greedy generation on a tiny local HF
checkpoint (plain and speculative print the same text as a torch greedy loop), and clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specjax import cli

PROMPT = "w7 w8 w9 w7 w8 w9 w7 w8"
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]


@pytest.fixture(scope="module")
def cli_model(hf_llama_dir, tmp_path_factory):
    """(path, torch model): the tiny HF Llama plus a 256-token word-level tokenizer.json whose
    ChatML tokens let the default chat-template path run; every model id decodes to a word."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    src, torch_model = hf_llama_dir
    path = tmp_path_factory.mktemp("cli") / "model"
    shutil.copytree(src, path)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), 256)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path, torch_model


@pytest.fixture(autouse=True)
def cost_cache(tmp_path_factory, monkeypatch):
    """The cost-aware harness's measured tables go to one directory per test session."""
    path = tmp_path_factory.getbasetemp() / "cost-cache"
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(path))
    return path / "costs"


def _run(capsys, *argv):
    """(return code, stdout, stderr) of ``specjax <argv>``."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _torch_greedy(model, ids, max_new_tokens, eos_ids):
    """Greedy continuation of ``ids`` by the torch model, without the stop token."""
    import torch

    ids, new = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if t in eos_ids:
                break
            ids.append(t)
            new.append(t)
    return new


def test_generate_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--prompt", "--raw", "--max-new-tokens", "--temperature",
                   "--method", "--draft-len", "--draft-layers"):
        assert option in out
    for method in ("plain", "ngram", "draft-model"):
        assert method in out


def test_greedy_text_same_for_every_method(cli_model, capsys):
    from specjax.io import load

    path, torch_model = cli_model
    tok = load(path).tokenizer
    prompt_ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    want = tok.decode(_torch_greedy(torch_model, prompt_ids, 8, tok.eos_ids))
    texts = {}
    for method in ("plain", "ngram", "draft-model"):
        # A fixed budget: the cost-aware default has its own test below.
        rc, out, err = _run(capsys, "generate", "--model", str(path), "--prompt", PROMPT,
                            "--max-new-tokens", "8", "--method", method, "--draft-layers", "1",
                            *(("--fixed-budget",) if method != "plain" else ()))
        assert rc == 0, err
        assert re.search(r"\d+ tokens in [\d.]+ s = [\d.]+ tok/s", err), err
        if method != "plain":
            assert re.search(rf"\[{method}: \d+ verify cycles, tau = [\d.]+", err), err
        texts[method] = out
    assert want and texts["plain"] == want + "\n"
    assert texts["ngram"] == texts["plain"] and texts["draft-model"] == texts["plain"]


@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_eagle_drafter_from_a_directory_keeps_the_greedy_text(cli_model, tmp_path, capsys, tree):
    """An EAGLE-1 drafter exported in the official layout drives 'generate --method eagle1'
    (the tiny model has too few layers for EAGLE-3's taps), over the whole vocabulary and,
    once ranked, over a draft vocabulary; the text is plain greedy's."""
    from specjax.drafters import eagle
    from specjax.io import load, official

    path, _ = cli_model
    cfg = eagle.EagleConfig.eagle1(load(path).cfg)
    official.save_eagle(cfg, eagle.init_params(cfg, 0, scale=0.2), tmp_path / "drafter")
    argv = ["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "8"]
    rc, plain, _ = _run(capsys, *argv)
    drafting = [*argv, "--method", "eagle1", "--drafter", str(tmp_path / "drafter"), "--tree",
                tree, "--tree-nodes", "6", "--tree-depth", "2", "--tree-top-k", "2",
                "--draft-len", "3", "--fixed-budget"]
    rc, out, err = _run(capsys, *drafting)
    assert rc == 0, err
    assert re.search(r"\[eagle1: \d+ verify cycles, tau = [\d.]+", err), err
    assert out == plain
    half = ["--draft-vocab", str(cfg.target_vocab_size // 2)]
    rc, _, err = _run(capsys, *drafting, *half)
    assert rc != 0 and "carries no token_order" in err
    order = np.random.default_rng(0).permutation(cfg.target_vocab_size)
    official.set_token_order(tmp_path / "drafter", order)
    rc, out, err = _run(capsys, *drafting, *half)
    assert rc == 0 and out == plain, err
    rc, _, err = _run(capsys, *argv, "--method", "eagle3", "--drafter", str(tmp_path / "drafter"))
    assert rc != 0 and "EAGLE-1 drafter, not eagle3" in err


@pytest.mark.parametrize("method,budget", [("dflash", ()), ("ddtree", ("--fixed-budget",))],
                         ids=["dflash-cost-aware", "ddtree-fixed"])
def test_dflash_drafter_from_a_directory_keeps_the_greedy_text(cli_model, tmp_path, capsys,
                                                               method, budget):
    """A DFlash drafter in the official layout drives DFlash (through the default cost-aware
    harness, which gates a drafter that costs something) and DDTree (a fixed budget)."""
    from specjax.drafters import dflash
    from specjax.io import load, official

    path, _ = cli_model
    cfg = dflash.DFlashConfig.for_target(load(path).cfg, n_layers=1, block_size=4,
                                         target_layer_ids=(0, 1))
    official.save_dflash(cfg, dflash.init_params(cfg, 0, scale=0.2), tmp_path / "drafter")
    argv = ["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "8"]
    rc, plain, _ = _run(capsys, *argv)
    rc, out, err = _run(capsys, *argv, "--method", method, "--drafter",
                        str(tmp_path / "drafter"), "--tree-nodes", "6", *budget)
    assert rc == 0, err
    assert re.search(rf"\[{method}: \d+ verify cycles, tau = [\d.]+", err), err
    assert out == plain
    # A draft vocabulary needs the drafter's token ranking; with one it drafts from its top
    # (at a fixed budget: the harness runs any proposal, and each of these drafters would
    # measure a cost table of its own).
    vocab = ["--draft-vocab", "12"]
    rc, _, err = _run(capsys, *argv, "--method", method, "--drafter", str(tmp_path / "drafter"),
                      "--tree-nodes", "6", "--fixed-budget", *vocab)
    assert rc != 0 and "carries no token_order" in err and "specjax data rank" in err
    order = np.random.default_rng(0).permutation(cfg.vocab_size)
    official.set_token_order(tmp_path / "drafter", order, draft_vocab_size=12)
    for choice in (vocab, [], ["--draft-vocab", "full"]):  # 12, the drafter's default, all
        rc, out, err = _run(capsys, *argv, "--method", method, "--drafter",
                            str(tmp_path / "drafter"), "--tree-nodes", "6", "--fixed-budget",
                            *choice)
        assert rc == 0, err
        assert out == plain


def test_draft_vocab_option_resolves_against_the_drafter():
    from specjax.config import ModelConfig
    from specjax.drafters import dflash

    tiny = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=5, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=48)
    cfg = dflash.DFlashConfig.for_target(tiny, n_layers=1, block_size=4)
    ranked = dataclasses.replace(cfg, draft_vocab_size=12)
    parse = cli.build_parser().parse_args
    base = ["generate", "--prompt", "x", "--method", "dflash"]
    assert parse(base).draft_vocab is None
    assert [dflash.resolve_vocab(c, parse(base + extra).draft_vocab)
            for extra in ([], ["--draft-vocab", "full"], ["--draft-vocab", "7"])
            for c in (cfg, ranked)] == [None, 12, None, None, 7, 7]
    for bad in ("0", "all"):
        with pytest.raises(SystemExit):
            parse(base + ["--draft-vocab", bad])


def test_eagle_without_a_shipped_drafter_says_what_to_do(cli_model, capsys):
    path, _ = cli_model
    rc, _, err = _run(capsys, "generate", "--model", str(path), "--prompt", PROMPT,
                      "--method", "eagle1")
    assert rc != 0 and "no eagle1 drafter is shipped" in err and "--drafter" in err


def test_raw_prompt_batch_prints_each_row(cli_model, capsys):
    path, _ = cli_model
    rc, out, err = _run(capsys, "generate", "--model", str(path), "--raw", "--prompt", PROMPT,
                        "--prompt", "w9", "--max-new-tokens", "4", "--method", "ngram",
                        "--fixed-budget")
    assert rc == 0, err
    assert out.startswith("--- [0]\n") and "\n--- [1]\n" in out


def test_generate_is_cost_aware_by_default_and_measures_its_table_once(cli_model, capsys,
                                                                       cost_cache):
    path, _ = cli_model
    argv = ["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "12"]
    rc, plain, _ = _run(capsys, *argv)
    spec = argv + ["--method", "ngram", "--draft-len", "3"]
    before = set(cost_cache.glob("*.json")) if cost_cache.exists() else set()
    rc, out, err = _run(capsys, *spec)
    assert rc == 0 and out == plain, err
    new = set(cost_cache.glob("*.json")) - before
    assert len(new) == 1 and "break-even tau" in err  # measured now, the table printed
    assert re.search(r"cost-aware: drafted in \d+ cycles, [\d.]+ nodes verified per cycle", err)
    rc, again, err = _run(capsys, *spec)
    assert rc == 0 and again == plain and "break-even tau" not in err  # read back
    rc, fixed, err = _run(capsys, *spec, "--fixed-budget")
    assert rc == 0 and fixed == plain and "cost-aware" not in err


def test_commands_keep_their_executables_in_a_compile_cache(cli_model, tmp_path, monkeypatch):
    """Two processes run the same generation: the first writes its executables under the
    compile cache, the second loads every one of them (it writes nothing new) and prints the
    same text."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    env = dict(os.environ, SPECJAX_COMPILE_CACHE="1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    argv = [sys.executable, "-m", "specjax.cli", "generate", "--model", str(cli_model[0]),
            "--prompt", PROMPT, "--max-new-tokens", "6", "--method", "ngram", "--fixed-budget"]
    where = cli.compile_cache_dir()
    assert where.parent == tmp_path / "xla"
    outs, entries = [], []
    for _ in range(2):
        run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        outs.append(run.stdout)
        entries.append(sorted(p.name for p in where.glob("*-cache")))
    assert entries[0] and entries[1] == entries[0]
    assert outs[0] and outs[1] == outs[0]


def test_the_compile_cache_stays_off_where_its_directory_cannot_be_made(tmp_path,
                                                                       monkeypatch):
    import jax

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(blocker))
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "1")
    assert cli._use_compile_cache() is None
    assert not jax.config.jax_compilation_cache_dir


def test_unknown_model_name_is_an_error(capsys):
    rc, out, err = _run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert rc != 0 and out == ""
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err


def test_unknown_method_is_a_usage_error(cli_model, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(cli_model[0]), "--prompt", "hi",
                  "--method", "medusa"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--method" in err and "'medusa'" in err


def test_draft_layers_must_be_fewer_than_the_target_has(cli_model, capsys):
    rc, _, err = _run(capsys, "generate", "--model", str(cli_model[0]), "--prompt", PROMPT,
                      "--method", "draft-model", "--max-new-tokens", "4")  # default 4 > 2 layers
    assert rc == 2 and "draft layers must be in [1, 2), got 4" in err


def test_model_without_tokenizer_is_an_error(hf_qwen3_dir, capsys):
    rc, _, err = _run(capsys, "generate", "--model", str(hf_qwen3_dir[0]), "--prompt", "hi")
    assert rc == 2 and "has no tokenizer files" in err


def test_calibrate_writes_a_cost_table_and_reuses_it(cli_model, tmp_path, capsys):
    """``specjax calibrate``: a drafter's costs per bucket into JSON; a second call with the
    same settings reads it back instead of measuring, and so does ``specjax generate
    --cost-table`` with the same drafter options at that context."""
    from specjax import harness

    path, _ = cli_model
    out = tmp_path / "costs.json"
    drafter = ("--method", "draft-model", "--draft-layers", "1", "--draft-len", "3")
    argv = ("calibrate", "--model", str(path), *drafter, "--context", "256", "--out", str(out))
    rc, text, _ = _run(capsys, *argv)
    assert rc == 0
    table = harness.CostTable.from_json(out.read_text())
    # A plain step and the powers of two up to the drafter's 4 nodes, root included.
    assert table.buckets == (0, 2, 4) and table.draft_s[0] == 0 and min(table.draft_s[1:]) > 0
    assert min(table.verify_s) > 0
    assert table.key["method"] == "draft-model" and table.key["context"] == 256
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["plain", "2", "4"]
    rc, again, err = _run(capsys, *argv)
    assert rc == 0 and "already holds this table" in err and again == text
    written = out.read_text()
    # A short prompt's generation prices its cycles at context 256: the table is read.
    rc, _, err = _run(capsys, "generate", "--model", str(path), "--prompt", PROMPT,
                      "--max-new-tokens", "8", *drafter, "--cost-table", str(out))
    assert rc == 0 and "measuring costs" not in err and "break-even tau" not in err, err
    assert out.read_text() == written
    # Other drafter options: the file is measured again for them, with a note naming why.
    rc, _, err = _run(capsys, "generate", "--model", str(path), "--prompt", PROMPT,
                      "--max-new-tokens", "8", *drafter[:-1], "1", "--cost-table", str(out))
    note = [line for line in err.splitlines() if line.startswith("note:")]
    assert rc == 0 and len(note) == 1, err
    assert f"{out} holds no cost table for these settings (drafter " in note[0]
    assert harness.CostTable.from_json(out.read_text()).buckets == (0, 2)
    rc, _, err = _run(capsys, *argv, "--buckets", "0,2")
    assert rc == 2 and "--buckets is for --method plain" in err
    # Plain: the verify passes alone, at the buckets asked for.
    plain = ("calibrate", "--model", str(path), "--buckets", "0,2", "--context", "32", "--out",
             str(tmp_path / "plain.json"))
    rc, text, _ = _run(capsys, *plain)
    table = harness.CostTable.from_json((tmp_path / "plain.json").read_text())
    assert rc == 0 and table.buckets == (0, 2) and table.draft_s == (0.0, 0.0)
    rc, again, err = _run(capsys, *plain)
    assert rc == 0 and "already holds this table" in err and again == text
    rc, _, err = _run(capsys, *argv[:-2], "--out", str(tmp_path / "bad.json"),
                      "--method", "dflash", "--drafter", str(tmp_path / "none"))
    assert rc == 2 and "error:" in err


def test_bench_quick_writes_records_table_and_plot(cli_model, tmp_path, capsys, monkeypatch):
    """``specjax bench --quick`` on the tiny model (no DFlash drafter is shipped for it, so
    that method is skipped with a note): plain and n-gram, fixed and cost-aware, on the
    long-context retrieval set; the greedy cells reproduce plain decoding. One verify curve
    serves the cost table measured for the run and the time split, and the progress bar says
    what is being measured before the first cell."""
    from specjax import calibrate, report, sweep

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))  # the table measured here
    curves, stages = [], []
    measure, run = calibrate.measure_verify_costs, sweep.run

    def counted(*args, **kwargs):
        curves.append(measure(*args, **kwargs))
        return curves[-1]

    def shown(*args, stage, **kwargs):
        return run(*args, stage=lambda s: (stages.append(s), stage(s)), **kwargs)

    monkeypatch.setattr(calibrate, "measure_verify_costs", counted)
    monkeypatch.setattr(sweep, "run", shown)
    path, _ = cli_model
    out = tmp_path / "bench"
    rc, text, err = _run(capsys, "bench", "--quick", "--model", str(path), "--max-new-tokens",
                         "8", "--sets", "retrieve", "--out", str(out), "--no-progress")
    assert rc == 0, err
    assert "skipping dflash: no dflash drafter is shipped" in err
    records = report.read_jsonl(out / "records.jsonl")
    methods = ["plain", "ngram k=4", "ngram k=4 cost-aware"]
    assert [(r["method"], r["set"]) for r in records] == [
        (m, "retrieve") for m in methods]
    for r in records:
        assert r["same_as_plain"] is True and r["tok_s"] > 0 and r["ttft_ms"] > 0
        assert r["tpot_ms"]["p50"] <= r["tpot_ms"]["p99"]
        if r["method"] == "plain":
            assert r["speedup"] == 1.0 and r["split_ms"] is None
        else:
            assert r["tau"] >= 1.0 and set(r["split_ms"]) == {"draft", "verify", "other"}
    assert text.startswith(f"specjax bench --quick --model {path}")
    kept = [json.loads(f.read_text())["key"] for f in (tmp_path / "cache" / "costs").glob("*.json")]
    assert sorted(k.get("measurement", "cost table") for k in kept) == ["cost table",
                                                                      "verify curve"]
    assert len(curves) == 1 and {2, 4, 5} <= set(curves[0].nodes)  # the table's buckets
    # The drafting timed, then the curve the table shares (measured on its first need).
    table = [re.sub(r"[\d.]+ ms$", "T ms", s) for s in stages[:1] + stages[2:]]
    assert stages[1].startswith("verify curve at batch 1, context ") and table == [
        f"ngram k=4 cost-aware cost table: measured {what} {n}, T ms"
        for what, n in [("draft", 5), ("verify", 2), ("verify", 4), ("verify", 5),
                        ("cycle", 5), ("step", 0)]]
    rc, _, err = _run(capsys, "bench", "--quick", "--model", str(path), "--sets", "poetry")
    assert rc == 2 and "no prompt set 'poetry'" in err
    assert "| set | T | batch | method |" in text and "| mean speedup |" in text
    assert (out / "table.md").read_text().startswith("| set |")
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_reads_mt_bench_prompt_files(cli_model, tmp_path, capsys):
    from specjax import report

    path, _ = cli_model
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"question_id": 1, "category": "writing", "turns": ["w7 w8", "w9"]}\n'
                       '{"question_id": 2, "category": "coding", "turns": ["w9 w9 w7"]}\n'
                       '{"question_id": 3, "category": "writing", "turns": ["w8 w8"]}\n')
    out = tmp_path / "bench"
    rc, _, err = _run(capsys, "bench", "--model", str(path), "--prompts", str(prompts),
                      "--methods", "plain", "--batch-sizes", "2", "--max-new-tokens", "4",
                      "--repeats", "1", "--out", str(out), "--no-progress")
    assert rc == 0, err
    records = report.read_jsonl(out / "records.jsonl")
    assert [(r["set"], r["requests"], r["batch"]) for r in records] == [("writing", 1, 2),
                                                                        ("coding", 1, 2)]
    prompts.write_text('{"category": "x"}\n')
    rc, _, err = _run(capsys, "bench", "--model", str(path), "--prompts", str(prompts),
                      "--out", str(out))
    assert rc == 2 and "needs a non-empty 'turns' list or 'prompt' string" in err


def test_bench_pairs_each_cell_with_plain_runs(cli_model, tmp_path, capsys, monkeypatch):
    """A speculative cell times plain decoding on each of its requests, alternating run by
    run with its own timed runs, and its speedup is over that paired plain rate."""
    from specjax import api, report

    path, _ = cli_model
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"category": "writing", "turns": ["w7 w8 w7 w8"]}\n')
    real, calls = api.generate_tokens, []

    def logged(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(("plain" if kwargs.get("drafter") is None else "ngram",
                      kwargs["max_new_tokens"], result))
        return result

    monkeypatch.setattr(api, "generate_tokens", logged)
    out = tmp_path / "bench"
    rc, _, err = _run(capsys, "bench", "--model", str(path), "--prompts", str(prompts),
                      "--methods", "plain,ngram", "--harness", "fixed", "--max-new-tokens", "6",
                      "--repeats", "2", "--out", str(out), "--no-progress")
    assert rc == 0, err
    plain, ngram = report.read_jsonl(out / "records.jsonl")
    assert plain["speedup"] == 1.0 and plain["plain_tok_s"] == plain["tok_s"]
    # The n-gram cell: a warm-up run, then plain and n-gram alternating (2 repeats), then its
    # one-token runs for the time to first token.
    cell = [(m, n) for m, n, _ in calls[-7:]]
    assert cell == [("ngram", 6), ("plain", 6), ("ngram", 6), ("plain", 6), ("ngram", 6),
                    ("ngram", 1), ("ngram", 1)]
    paired = min((r for m, n, r in calls[-6:-2] if m == "plain"), key=lambda r: r.run_s)
    assert ngram["plain_tok_s"] == pytest.approx(paired.n_tokens / paired.run_s)
    assert ngram["speedup"] == pytest.approx(ngram["tok_s"] / ngram["plain_tok_s"])
    # Each repeat's own speedup: its n-gram run over the plain run beside it.
    pairs = [(calls[-6 + 2 * i][2], calls[-5 + 2 * i][2]) for i in range(2)]
    assert plain["speedup_runs"] is None
    assert ngram["speedup_runs"] == pytest.approx(
        [(g.n_tokens / g.run_s) / (b.n_tokens / b.run_s) for b, g in pairs])


def test_bench_times_a_reference_precision_beside_every_cell(cli_model, tmp_path, capsys,
                                                             monkeypatch):
    """--reference-dtype: every cell, plain decoding's included, also times plain decoding of
    the model at that precision on each request, run by run beside its own runs, and records
    its speedup over that rate."""
    from specjax import api, report

    path, _ = cli_model
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"category": "writing", "turns": ["w7 w8 w7 w8"]}\n')
    real, calls = api.generate_tokens, []

    def logged(cfg, *args, **kwargs):
        result = real(cfg, *args, **kwargs)
        name = cfg.dtype if kwargs.get("drafter") is None else "ngram"
        calls.append((name, kwargs["max_new_tokens"], result))
        return result

    monkeypatch.setattr(api, "generate_tokens", logged)
    out = tmp_path / "bench"
    argv = ["bench", "--model", str(path), "--prompts", str(prompts), "--methods", "plain,ngram",
            "--harness", "fixed", "--max-new-tokens", "5", "--repeats", "1", "--out", str(out),
            "--no-progress"]
    rc, _, err = _run(capsys, *argv, "--reference-dtype", "float32")
    assert rc == 2 and "is the sweep's own --dtype" in err
    rc, table, err = _run(capsys, *argv, "--reference-dtype", "bfloat16")
    assert rc == 0, err
    plain, ngram = report.read_jsonl(out / "records.jsonl")
    # The n-gram cell: its warm-up, then the reference, plain and n-gram runs side by side.
    cell = [(m, n) for m, n, _ in calls[-5:]]
    assert cell == [("ngram", 5), ("bfloat16", 5), ("float32", 5), ("ngram", 5), ("ngram", 1)]
    ref = calls[-4][2]
    assert ngram["reference_dtype"] == "bfloat16"
    assert ngram["reference_tok_s"] == pytest.approx(ref.n_tokens / ref.run_s)
    assert ngram["reference_speedup"] == pytest.approx(ngram["tok_s"] / ngram["reference_tok_s"])
    assert plain["reference_speedup"] == pytest.approx(plain["tok_s"] / plain["reference_tok_s"])
    assert "| vs bfloat16 plain |" in table


def test_bench_keeps_the_cells_measured_before_a_failure(cli_model, tmp_path, capsys,
                                                          monkeypatch):
    """A sweep that stops part way (here the second cell's generation fails) leaves the
    records of the cells it finished in records.jsonl."""
    from specjax import api, report

    path, _ = cli_model
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"category": "writing", "turns": ["w7 w8"]}\n'
                       '{"category": "coding", "turns": ["w9 w9 w7"]}\n')
    real, calls = api.generate_tokens, []

    def fails_in_the_second_cell(*args, **kwargs):
        calls.append(str(args[2]))  # the prompts' token ids
        if len(set(calls)) > 1:  # the second set's prompt
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "generate_tokens", fails_in_the_second_cell)
    out = tmp_path / "bench"
    with pytest.raises(RuntimeError, match="out of memory"):
        cli.main(["bench", "--model", str(path), "--prompts", str(prompts), "--methods",
                  "plain", "--max-new-tokens", "4", "--repeats", "1", "--out", str(out),
                  "--no-progress"])
    records = report.read_jsonl(out / "records.jsonl")
    assert [(r["set"], r["method"]) for r in records] == [("writing", "plain")]
