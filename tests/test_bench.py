"""The benchmark reports (tables built from result dicts), the HF engine's model, and how
often the speculative benchmark compiles (the measurements themselves are benchmarks, never
tests)."""

from __future__ import annotations

import pytest

from specjax import api, bench, engines, spec_bench
from specjax.config import ModelConfig
from specjax.io.models import LoadedModel
from specjax.models import target


def test_spec_report_lists_every_prompt_of_every_drafter():
    rows = [dict(name="plain f32", tok_s=90.0, tau=1.0, speedup=1.0, speedup_vs_fastest=1.0,
                 efficiency=1.0, mismatched_prompts=[],
                 per_prompt=[dict(tau=1.0, speedup=1.0)] * 2),
            dict(name="ngram k=8", tok_s=120.0, tau=3.75, speedup=1.33, speedup_vs_fastest=1.33,
                 efficiency=0.36, mismatched_prompts=[1],
                 per_prompt=[dict(tau=6.14, speedup=3.02), dict(tau=1.67, speedup=1.18)])]
    result = dict(curves={"float32": dict(nodes=(1, 16), seconds=(0.0116, 0.0295),
                                          plain_step=0.0116)},
                  fastest_plain_step_any=0.0116, max_new_tokens=128,
                  sets=[dict(name="code", prompts=2, drafters=rows)])
    report = spec_bench.format_report(result)
    assert "N=16: 29.5 [2.54x; 2.54x]" in report
    assert "code: 2 prompts x 128 new tokens" in report
    assert "differs [1]" in report
    per_prompt = [line for line in report.splitlines() if line.strip().startswith("ngram k=8")]
    assert per_prompt[-1].split() == ["ngram", "k=8", "tau", "6.14", "3.02x", "|", "tau", "1.67",
                                      "1.18x"]


class _CharTokenizer:
    def encode_chat(self, messages):
        return [3 + ord(c) % 50 for c in messages[-1]["content"]]


def test_spec_benchmark_compiles_each_configuration_once(monkeypatch):
    """More configurations than the executable cache holds (3 against ``COMPILED_MAX`` 2), two
    prompt sets, two rounds: every executable still compiles once, not again every round, and
    the cache's limit is back afterwards."""
    cfg = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, d_ff=48)
    model = LoadedModel(cfg, target.init_params(cfg, 0), _CharTokenizer())
    monkeypatch.setattr(api, "COMPILED_MAX", 2)
    compiles = []
    compiled = api._compiled

    def counting(fn, args, traced, statics):
        exe, seconds = compiled(fn, args, traced, statics)
        if seconds:
            compiles.append((fn, tuple(sorted(statics.items(), key=lambda kv: kv[0]))))
        return exe, seconds

    monkeypatch.setattr(api, "_compiled", counting)
    result = spec_bench.run_spec_benchmark(
        model, {"a": ["copy copy copy", "abc abc"], "b": ["xyz xyz xyz"]}, max_new_tokens=6,
        nodes=(1, 2), repeats=2, draft_lens=(2, 3), methods=("ngram",),
        dtypes=("float32",), log=lambda *_: None)
    assert [len(s["drafters"]) for s in result["sets"]] == [3, 3]
    assert len(compiles) == len(set(compiles))
    assert sum(dict(st).get("drafter") is not None for _, st in compiles) == 2  # both ngrams
    assert api.COMPILED_MAX == 2


def test_plain_table_fits_every_engine_name():
    run = dict(decode_tok_s=84.0, ms_per_token=11.9, prefill_ms=60.0, e2e_tok_s=81.0,
               roofline_fraction=0.56)
    result = dict(engines={name: run for name in bench.ENGINES}, roofline_tok_s=148.9,
                  bandwidth_bytes_s=80.1e9, weight_bytes=538.1e6)
    lines = bench.format_table(result).splitlines()
    assert len({len(line) for line in lines[2:2 + len(bench.ENGINES)]}) == 1  # aligned columns
    assert all(any(line.startswith(name + " ") for line in lines) for name in bench.ENGINES)


def test_hf_engine_model_computes_our_logits():
    """The HF engine's model is built from our params through the HF name table: its logits are
    ours (float32 parity bound 1e-4, as for loaded checkpoints), tied head and GQA included."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from specjax.config import ModelConfig
    from specjax.models import cache as cache_lib
    from specjax.models import target

    cfg = ModelConfig(arch="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6,
                      n_kv_heads=2, head_dim=8, d_ff=80, tie_embeddings=True)
    params = target.init_params(cfg, 0, scale=0.3)
    model = engines.hf_llama_from_params(cfg, params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ours, _, _ = jax.jit(target.forward, static_argnums=1)(
        params, cfg, jnp.asarray(tokens), jnp.arange(9)[None], cache_lib.init_cache(cfg, 1, 9))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_prompt_file_takes_first_turns_or_a_named_field(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["first a", "second a"], "prompt": "p1"}\n'
                    '{"turns": ["first b"], "prompt": "p2"}\n{"turns": ["first c"], "prompt": "p3"}\n')
    assert spec_bench.file_prompts(f"{path}:turns", 2) == ["first a", "first b"]
    assert spec_bench.file_prompts(str(path), 5) == ["p1", "p2", "p3"]


def test_prompt_sets_are_named_and_templated(tmp_path):
    (tmp_path / "math").mkdir()
    a, b = tmp_path / "math" / "test.jsonl", tmp_path / "q.jsonl"
    a.write_text('{"question": "1+1?"}\n{"question": "2+2?"}\n')
    b.write_text('{"turns": ["hi"]}\n')
    sets = spec_bench.prompt_sets([f"{a}:question", f"chat={b}:turns"],
                                  ["{prompt}\\nThink.", "> {prompt}"], 2)
    assert sets == {"math": ["1+1?\nThink.", "2+2?\nThink."], "chat": ["> hi"]}
    assert spec_bench.prompt_sets([f"{a}:question"], [], 1) == {"math": ["1+1?"]}
    with pytest.raises(ValueError, match="one for all or one per file"):
        spec_bench.prompt_sets([str(a), str(b), str(b)], ["x", "y"], 1)


def test_pad_prompts_to_a_given_width():
    tokens, lengths = api.pad_prompts([[5, 6, 7], [8]], width=40)
    assert tokens.shape == (2, 40) and lengths.tolist() == [3, 1]
    assert tokens[0, :4].tolist() == [5, 6, 7, 0] and tokens[1, :2].tolist() == [8, 0]
    assert api.pad_prompts([[5, 6, 7]])[0].shape == (1, api.PROMPT_BUCKET)
    with pytest.raises(ValueError, match="prompt 0 has 3 tokens, more than the padded width 2"):
        api.pad_prompts([[5, 6, 7], [8]], width=2)
