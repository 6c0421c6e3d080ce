"""The benchmark's pieces that need no model run: the built-in suite and its context-length
padding, MT-Bench-format files, the method list, and the markdown / JSONL / PNG outputs on
hand-made records."""

from __future__ import annotations

import pytest

from specjax import report, suite, sweep
from specjax.config import ModelConfig
from specjax.io.models import LoadedModel
from specjax.models import target


def _words(text):
    return len(text.split())


def test_the_builtin_suite_covers_code_math_chat_and_long_context():
    sets = suite.builtin()
    assert list(sets) == ["code", "math", "chat", "summarize", "retrieve"]
    assert all(len(ps) == 2 for ps in sets.values())
    assert suite.builtin(1) == {k: v[:1] for k, v in sets.items()}
    assert min(_words(p) for p in sets["summarize"] + sets["retrieve"]) > 250  # long contexts
    with pytest.raises(ValueError, match="per_category must be >= 1"):
        suite.builtin(0)


def test_with_context_pads_each_prompt_to_the_length_asked():
    prompts = ["What is two plus two?", " ".join(["w"] * 500)]
    got = suite.with_context(prompts, _words, 300)
    assert got[0].endswith(prompts[0]) and got[0].startswith("Background material")
    longest_paragraph = max(_words(p) for text in suite.SUITE.values() for p in text) + 60
    assert 300 <= _words(got[0]) < 300 + longest_paragraph
    assert got[1] == prompts[1]  # already longer
    # Paragraphs are used once before any repeats: nothing repeats below the texts' length.
    body = got[0].split("\n\n")[1:-1]
    assert len(body) == len(set(body))


def test_mt_bench_files_group_first_turns_by_category(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"category": "math", "turns": ["a", "b"]}\n\n'
                    '{"prompt": "c"}\n{"category": "math", "turns": ["d"]}\n')
    assert suite.mt_bench_file(path) == {"math": ["a", "d"], "default": ["c"]}
    assert suite.mt_bench_file(path, 1) == {"math": ["a"], "default": ["c"]}
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="q.jsonl:1: not JSON"):
        suite.mt_bench_file(path)
    path.write_text("")
    with pytest.raises(ValueError, match="holds no prompts"):
        suite.mt_bench_file(path)


TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=48)


def test_methods_give_every_fixed_size_and_one_cost_aware_twin_at_the_largest():
    model = LoadedModel(TINY, target.init_params(TINY, 0), None)
    got = sweep.methods(model, ["plain", "ngram", "draft-model"], model_name="tiny",
                        draft_lens=(8, 2), draft_layers=1)
    assert [(m.name, m.cost_aware) for m in got] == [
        ("plain", False), ("ngram k=2", False), ("ngram k=8", False),
        ("ngram k=8 cost-aware", True), ("draft-model L=1 k=2", False),
        ("draft-model L=1 k=8", False), ("draft-model L=1 k=8 cost-aware", True)]
    assert got[3].drafter is got[2].drafter
    only = sweep.methods(model, ["ngram"], model_name="tiny", cost_aware="harness")
    assert [m.name for m in only] == ["ngram k=4 cost-aware"]
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        sweep.methods(model, ["medusa"], model_name="tiny")
    with pytest.raises(ValueError, match="no dflash drafter is shipped for 'tiny'"):
        sweep.methods(model, ["ddtree"], model_name="tiny")


def _record(**kw):
    r = dict(method="plain", cost_aware=False, set="code", temperature=0.0, batch=1,
             context=None, requests=2, prompt_tokens=40.0, new_tokens=100, ttft_ms=31.0,
             tpot_ms={"p50": 40.0, "p95": 44.0, "p99": 45.0}, tok_s=25.0, speedup=1.0, tau=1.0,
             acceptance=[], drafted=None, verified=None, fallbacks=0, split_ms=None,
             peak_mb=600.0, same_as_plain=True, divergence_gap=None)
    return r | kw


RECORDS = [_record(), _record(method="ngram k=4", tok_s=30.0, speedup=1.2, tau=1.9,
                              speedup_runs=[1.25, 1.08],
                              acceptance=[0.5, 0.3, 0.1, 0.0], drafted=1.0, verified=5.0,
                              split_ms=dict(draft=0.2, verify=50.0, other=3.0)),
           _record(set="chat", tok_s=24.0), _record(set="chat", method="ngram k=4", tok_s=12.0,
                                                    speedup=0.5, same_as_plain=False,
                                                    divergence_gap=0.0521)]


def test_markdown_rows_and_the_summary_say_what_the_records_hold(tmp_path):
    lines = report.markdown(RECORDS).splitlines()
    assert lines[0].startswith("| set | T | batch | method | tok/s | speedup | τ |")
    assert len(lines) == 2 + len(RECORDS)
    assert lines[3] == ("| code | 0 | 1 | ngram k=4 | 30.0 | 1.20x (1.08-1.25) | 1.90 | 31 | "
                        "40.0 / 44.0 / 45.0 | 100% | 5.0 | 0.2 / 50.0 / 3.0 | 600 | yes |")
    assert "| 12.0 | 0.50x | 1.00 |" in lines[5]  # no repeats recorded: no range
    assert lines[5].endswith("| NO (gap 0.052) |")
    summary = report.summary(RECORDS).splitlines()
    assert summary[3] == "| ngram k=4 | 0.85x | 0.50x (chat, T=0, batch 1) | 1.45 |"
    with_ctx = report.markdown([_record(context=1024)]).splitlines()
    assert "| context |" in with_ctx[0] and "| 1024 |" in with_ctx[2]
    # Beside a reference precision: its column and its mean per method.
    refd = [dict(r, reference_dtype="float32", reference_tok_s=20.0,
                 reference_speedup=r["tok_s"] / 20.0) for r in RECORDS]
    lines = report.markdown(refd).splitlines()
    assert "| speedup | vs float32 plain | τ |" in lines[0]
    assert "| 1.20x (1.08-1.25) | 1.50x | 1.90 |" in lines[3]
    summary = report.summary(refd).splitlines()
    assert summary[0].endswith("| mean τ | mean vs float32 plain |")
    assert summary[3].endswith("| 1.45 | 1.05x |")  # ngram k=4: 30 and 12 tok/s over 20
    # Records of two sweeps, one without a reference: each mean over the cells that have one,
    # "-" for a method with none.
    other = _record(method="ngram k=8", set="chat", tok_s=20.0, speedup=0.8)
    mixed = report.summary(refd[:2] + RECORDS[2:] + [other]).splitlines()
    assert mixed[0].endswith("| mean vs float32 plain |")
    assert mixed[2].endswith("| 1.25x |")  # plain: the code cell's 25 tok/s over 20
    assert mixed[3].endswith("| 1.50x |") and mixed[4].endswith("| - |")
    report.write_jsonl(RECORDS, tmp_path / "r.jsonl")
    assert report.read_jsonl(tmp_path / "r.jsonl") == RECORDS
    report.plot(RECORDS, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
