"""Plain-decoding benchmark: specjax vs HF transformers vs llama.cpp, side by side in one process.

Run::

    python -m specjax.bench --max-new-tokens 128 --prompts 3
    python -m specjax.bench --prompt-file ../shared/data/bench/gsm8k/test.jsonl --prompts 10 \\
        --json plain.json
    python -m specjax.bench --engines specjax,hf        # any subset, comma-separated

Engines (an engine whose package is missing is skipped with a printed note):

* ``specjax``: :func:`specjax.api.generate_tokens`, one jitted call per request.
* ``specjax-in-out`` (not run by default): the same without the one-row weight copies of
  :mod:`specjax.io.layout`, to measure what they buy side by side.
* ``hf``: HF transformers ``LlamaForCausalLM.generate`` in float32 (needs ``torch`` and
  ``transformers``, the ``test`` extra), built from the very same params.
* ``llamacpp``: llama.cpp through ``llama-cpp-python`` (the ``llamacpp`` extra; it compiles from
  source for ~10 minutes and is never needed by the tests). It reads an F32 GGUF of the very same
  params that :func:`specjax.engines.llamacpp_gguf` writes once into the specjax cache
  directory.

The engines live in :mod:`specjax.engines`, the roofline in :mod:`specjax.roofline`, prompt
files are read by :func:`specjax.suite.load_prompts`; this module runs the protocol.

Protocol -- what is compared, and why it is fair:

* One process, one model (SmolLM2-135M-Instruct, the dequantized float32 params of
  ``specjax.io.load``), the same chat prompts encoded by the same tokenizer, batch 1, greedy.
  float32 everywhere, llama.cpp's KV cache included (its default is f16).
* No stop tokens: every engine produces exactly ``max_new_tokens`` tokens (EOS is an ordinary
  token), so tokens/s compare equal work. Past an EOS the text is whatever the model continues
  with; it still must agree between engines.
* Per request we time ``first_s`` (prompt in -> first new token out: prefill plus one sampling
  step) and ``total_s`` (prompt in -> all N tokens out). llama.cpp and HF stream, so one run gives
  both; specjax returns only when its single jitted call ends, so ``first_s`` comes from a second
  run with ``max_new_tokens=1`` and the same cache size. Decode throughput is
  ``(N - 1) / (total_s - first_s)``: the N - 1 one-token steps after the prompt.
* Every engine is warmed up first (specjax also compiles ahead of time; compile seconds are
  reported apart and never counted). Then ``repeats`` rounds, each running every prompt on every
  engine in turn, so that load from other processes hits all engines alike; each figure keeps
  the fastest round per prompt (the least disturbed measurement of the same work).
* Threads: torch and llama.cpp get ``--threads`` (default 2); XLA:CPU sizes its own pool to the
  machine's cores. On a machine with more cores than ``--threads`` the comparison is unequal.
  When other jobs share the cores, torch's OpenMP threads suffer far more than XLA's pool
  (measured on a busy 2-core machine: HF at 340 ms/token with 2 threads, 109 with 1), so on a
  shared machine run ``--threads 1`` as well before reading the HF ratio.
* Roofline: a decode step must stream every weight once, so tokens/s <= bandwidth / weight
  bytes. Bandwidth is measured here (a jitted ``jnp.sum`` over 1 GiB of float32, best of 5,
  sampled before the engines and after every round; the best sample counts);
  weight bytes are every layer tensor, the final norm and the LM head (a tied head is the
  embedding table, counted once: the embedding lookup itself reads one row). KV-cache reads and
  activations are not counted, so 100% is not reachable.
* Outputs: specjax's greedy tokens are compared with each other engine's for every prompt; a
  mismatch is reported with its first position (float32 reassociation can flip a near-tie).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from specjax import api
from specjax.engines import (Engine, HFEngine, LlamaCppEngine, SpecjaxEngine, Timing,
                             llamacpp_gguf)
from specjax.io.layout import without_row_weights
from specjax.roofline import bandwidth_probe, decode_weight_bytes
from specjax.suite import PROMPT_FIELDS, load_prompts

MODEL = "smollm2-135m"
ENGINES = ("specjax", "specjax-in-out", "hf", "llamacpp")
DEFAULT_ENGINES = ("specjax", "hf", "llamacpp")
DEFAULT_PROMPTS = (
    "Write a Python function that returns the sum of a list.",
    "Explain why the sky is blue.",
    "Give three tips for writing clear and maintainable code.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle in a few sentences.",
)


# ---------------------------------------------------------------------------------- benchmark


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def run_plain_benchmark(prompts: list[str], max_new_tokens: int = 128,
                        engines: Sequence[str] = DEFAULT_ENGINES, repeats: int = 2,
                        threads: int = 2, log: Callable[[str], None] = print) -> dict:
    """Runs the protocol of the module docstring and returns its results.

    Args:
      prompts: user messages, each formatted with the model's chat template.
      max_new_tokens: N, the exact number of tokens every engine generates per prompt.
      engines: a subset of :data:`ENGINES`; unavailable ones are skipped with a note.
      repeats: timed rounds over all prompts and engines (each figure keeps the best).
      threads: torch and llama.cpp threads.
      log: where progress lines go.
    Returns:
      A JSON-serialisable dict: ``protocol``, ``environment``, ``bandwidth_bytes_s`` (the best
      of ``bandwidth_samples_bytes_s``), ``weight_bytes``, ``roofline_tok_s``; per engine
      ``engines[name]`` with ``decode_tok_s``, ``ms_per_token``, ``prefill_ms``, ``e2e_tok_s``,
      ``roofline_fraction`` and per-prompt ``runs``; ``skipped`` (engine -> reason);
      ``matches`` (engine -> per prompt, the first position where its greedy tokens differ
      from specjax's, None when identical); ``outputs`` (engine -> decoded texts).
    """
    from specjax.io import load
    from specjax.io.models import resolve

    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise ValueError(f"unknown engines {unknown}; choose from {ENGINES}")
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 to time decoding, got {max_new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise ValueError("no prompts given")

    model = load(MODEL)
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    longest = max(len(i) for i in ids)
    cache_size = api.round_up(longest + max_new_tokens, api.CACHE_MULTIPLE)

    # Bandwidth is sampled before the engines and after every round, and the best sample kept:
    # like the engines' times, one sample can be depressed by other processes.
    log("measuring memory bandwidth ...")
    probe = bandwidth_probe()
    bandwidth_samples = [probe()]
    weight_bytes = decode_weight_bytes(cfg, params)

    built: dict[str, Engine] = {}
    skipped: dict[str, str] = {}
    for name in engines:
        try:
            if name == "specjax":
                built[name] = SpecjaxEngine(cfg, params, cache_size)
            elif name == "specjax-in-out":  # without the one-row weights: what they buy
                built[name] = SpecjaxEngine(cfg, without_row_weights(params), cache_size)
            elif name == "hf":
                built[name] = HFEngine(cfg, params, threads)
            else:
                import llama_cpp  # noqa: F401  (fail fast, before writing a 0.5 GB file)

                log("writing / finding the F32 GGUF for llama.cpp ...")
                path = llamacpp_gguf(resolve(MODEL), cfg, params)
                built[name] = LlamaCppEngine(path, n_ctx=cache_size, threads=threads)
        except ImportError as e:
            skipped[name] = f"not importable ({e.name or e}); see the module docstring"
            log(f"note: skipping {name}: {skipped[name]}")

    for name, engine in built.items():
        log(f"warming up {name} ...")
        engine.warmup(ids[0], max_new_tokens)

    timings: dict[str, list[list[Timing]]] = {name: [[] for _ in ids] for name in built}
    for r in range(repeats):
        for i, prompt_ids in enumerate(ids):
            for name, engine in built.items():
                timings[name][i].append(engine.generate(prompt_ids, max_new_tokens))
            line = ", ".join(f"{name} {timings[name][i][-1].total_s:.2f} s" for name in built)
            log(f"round {r + 1}/{repeats}, prompt {i + 1}/{len(ids)} ({len(prompt_ids)} tokens): "
                f"{line}")
        bandwidth_samples.append(probe())
    del probe  # frees the probe's 1 GiB

    bandwidth = max(bandwidth_samples)
    roofline = bandwidth / weight_bytes
    results = {}
    for name, per_prompt in timings.items():
        first = [min(t.first_s for t in runs) for runs in per_prompt]
        total = [min(t.total_s for t in runs) for runs in per_prompt]
        decode_s = sum(total) - sum(first)
        decode_tok_s = len(ids) * (max_new_tokens - 1) / decode_s
        results[name] = {
            "decode_tok_s": decode_tok_s,
            "ms_per_token": 1000 / decode_tok_s,
            "prefill_ms": 1000 * float(np.mean(first)),
            "e2e_tok_s": len(ids) * max_new_tokens / sum(total),
            "roofline_fraction": decode_tok_s / roofline,
            "runs": [{"prompt_tokens": len(p), "first_s": [t.first_s for t in runs],
                      "total_s": [t.total_s for t in runs]}
                     for p, runs in zip(ids, per_prompt)],
        }
        if name == "specjax":
            results[name]["compile_s"] = built[name].compile_s

    matches = {}
    if "specjax" in timings:
        reference = [runs[-1].tokens for runs in timings["specjax"]]
        for name, per_prompt in timings.items():
            if name != "specjax":
                matches[name] = [_first_mismatch(ref, runs[-1].tokens)
                                 for ref, runs in zip(reference, per_prompt)]

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "protocol": {"model": MODEL, "max_new_tokens": max_new_tokens, "batch": 1,
                     "sampling": "greedy", "stop_tokens": "none (exactly max_new_tokens)",
                     "repeats": repeats, "statistic": "fastest round per prompt",
                     "prompts": prompts, "prompt_tokens": [len(i) for i in ids],
                     "cache_size": cache_size},
        "environment": {"cpu_count": os.cpu_count(), "threads": threads,
                        "jax": jax.__version__, "jax_backend": jax.default_backend(),
                        **{d: version(d) for d in ("torch", "transformers",
                                                   "llama-cpp-python")}},
        "bandwidth_bytes_s": bandwidth,
        "bandwidth_samples_bytes_s": bandwidth_samples,
        "weight_bytes": weight_bytes,
        "roofline_tok_s": roofline,
        "engines": results,
        "skipped": skipped,
        "matches": matches,
        "outputs": {name: [tok.decode(runs[-1].tokens) for runs in per_prompt]
                    for name, per_prompt in timings.items()},
    }


def format_table(result: dict) -> str:
    """The results as a fixed-width text table (one row per engine that ran)."""
    engines = result["engines"]
    hf = engines.get("hf", {}).get("decode_tok_s")
    lc = engines.get("llamacpp", {}).get("decode_tok_s")

    def ratio(x, base):
        return f"{x / base:.2f}x" if base else "-"

    head = (f"{'engine':<14} {'decode tok/s':>12} {'ms/token':>9} {'prefill ms':>10} "
            f"{'e2e tok/s':>9} {'vs HF':>7} {'vs llama.cpp':>12} {'% roofline':>10}")
    lines = [head, "-" * len(head)]
    for name, r in engines.items():
        lines.append(f"{name:<14} {r['decode_tok_s']:>12.1f} {r['ms_per_token']:>9.1f} "
                     f"{r['prefill_ms']:>10.1f} {r['e2e_tok_s']:>9.1f} "
                     f"{ratio(r['decode_tok_s'], hf):>7} {ratio(r['decode_tok_s'], lc):>12} "
                     f"{100 * r['roofline_fraction']:>9.1f}%")
    lines.append(f"{'roofline':<14} {result['roofline_tok_s']:>12.1f} "
                 f"{1000 / result['roofline_tok_s']:>9.1f}   "
                 f"({result['bandwidth_bytes_s'] / 1e9:.1f} GB/s measured / "
                 f"{result['weight_bytes'] / 1e6:.1f} MB of weights per token)")
    if any(r["roofline_fraction"] > 1 for r in engines.values()):
        lines.append("note: above 100% means every bandwidth sample was depressed by other "
                     "load, so the roofline is underestimated (samples in the JSON)")
    return "\n".join(lines)


def format_matches(result: dict) -> str:
    """One line per compared engine: greedy tokens identical to specjax's, or where not."""
    lines = []
    for name, per_prompt in result["matches"].items():
        bad = [(i, pos) for i, pos in enumerate(per_prompt) if pos is not None]
        if not bad:
            lines.append(f"{name} vs specjax: greedy tokens identical on all {len(per_prompt)} "
                         "prompts")
        else:
            where = ", ".join(f"prompt {i} from token {pos}" for i, pos in bad)
            lines.append(f"{name} vs specjax: {len(bad)}/{len(per_prompt)} prompts differ "
                         f"({where})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specjax.bench",
        description="Plain greedy decoding of SmolLM2-135M: specjax vs HF transformers vs "
                    "llama.cpp in one process (protocol in the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="exact tokens generated per prompt (no stop tokens)")
    parser.add_argument("--prompts", type=int, default=3, help="number of prompts")
    parser.add_argument("--prompt-file", default=None,
                        help=f"JSONL of prompts (fields tried: {', '.join(PROMPT_FIELDS)}); "
                             "default: built-in chat prompts")
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                        help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (best kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write results here")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    if args.prompt_file:
        prompts = load_prompts(args.prompt_file, args.prompts)
    else:
        if args.prompts > len(DEFAULT_PROMPTS):
            parser.error(f"only {len(DEFAULT_PROMPTS)} built-in prompts; use --prompt-file")
        prompts = list(DEFAULT_PROMPTS[: args.prompts])
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]

    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        parser.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    if args.max_new_tokens < 2:
        parser.error(f"--max-new-tokens must be >= 2 to time decoding, got {args.max_new_tokens}")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")

    command = shlex.join(["python", "-m", "specjax.bench", *argv])
    print(f"command: {command}", flush=True)
    result = run_plain_benchmark(prompts, args.max_new_tokens, engines, args.repeats,
                                 args.threads, log=lambda s: print(s, flush=True))
    result["command"] = command
    env = result["environment"]
    print(f"\n{command}")
    lengths = ", ".join(map(str, result["protocol"]["prompt_tokens"]))
    print(f"SmolLM2-135M float32, batch 1, greedy, exactly {args.max_new_tokens} new tokens per "
          f"prompt, {len(prompts)} prompts ({lengths} tokens), best of {args.repeats} rounds; "
          f"{env['cpu_count']} CPUs, threads "
          f"{env['threads']}; jax {env['jax']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, llama-cpp-python {env['llama-cpp-python']}")
    print(format_table(result))
    for name, reason in result["skipped"].items():
        print(f"{name}: skipped, {reason}")
    if "specjax" in result["engines"]:
        compile_s = result["engines"]["specjax"]["compile_s"]
        print(f"specjax compile (excluded above): {compile_s:.1f} s")
    if result["matches"]:
        print(format_matches(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
