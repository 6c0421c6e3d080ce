"""The plain-decoding engines the benchmark (:mod:`specjax.bench`) compares, each timing one
generation of exactly N greedy tokens: specjax, HF transformers and llama.cpp, built from the
very same params (its module docstring gives the protocol)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from specjax import api
from specjax.config import ModelConfig

WARMUP_TOKENS = 8  # HF and llama.cpp compile nothing; a short run warms allocators and threads


@dataclasses.dataclass(frozen=True)
class Timing:
    """One timed generation.

    Attributes:
      tokens: the N generated ids.
      first_s: seconds from the call to the first new token (prefill + one sampling step).
      total_s: seconds from the call to all N tokens.
    """

    tokens: list[int]
    first_s: float
    total_s: float


class Engine(Protocol):
    """A generator under test: ``warmup`` once, then ``generate`` timed requests of exactly
    ``n`` greedy tokens after the prompt ``ids``."""

    name: str

    def warmup(self, ids: list[int], n: int) -> None: ...

    def generate(self, ids: list[int], n: int) -> Timing: ...


# ----------------------------------------------------------------------------------- specjax


class SpecjaxEngine:
    """``api.generate_tokens``; ``first_s`` from a second, one-token run (module docstring).

    Both runs use ``cache_size`` slots, so they differ only in the number of decode steps.
    """

    name = "specjax"

    def __init__(self, cfg: ModelConfig, params: dict, cache_size: int):
        self.cfg, self.params, self.cache_size = cfg, params, cache_size
        self.compile_s = 0.0

    def _run(self, ids, n):
        out = api.generate_tokens(self.cfg, self.params, [ids], max_new_tokens=n,
                                  stop_tokens=(), cache_size=self.cache_size)
        self.compile_s += out.compile_s
        return out

    def warmup(self, ids, n):
        self._run(ids, n)
        self._run(ids, 1)

    def generate(self, ids, n):
        full = self._run(ids, n)
        first = self._run(ids, 1)
        if len(full.tokens[0]) != n:
            raise RuntimeError(f"specjax produced {len(full.tokens[0])} tokens, expected {n}")
        return Timing(full.tokens[0], first.run_s, full.run_s)


# -------------------------------------------------------------------------------- transformers


def hf_llama_from_params(cfg: ModelConfig, params: dict):
    """An eval-mode float32 ``transformers.LlamaForCausalLM`` holding ``params``.

    Config and tensors come from ``specjax.io.hf``'s name table (``config_to_hf``,
    ``hf_tensors``), as for a checkpoint written with ``save_hf``; a tied head stays tied to the
    embedding. The config has no EOS, so ``generate`` never stops early.

    Raises:
      ValueError: a config this conversion does not cover (Qwen3).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    from specjax.io import hf as hf_io

    if cfg.arch != "llama":
        raise ValueError(f"hf_llama_from_params covers Llama, got arch={cfg.arch!r}")
    config = LlamaConfig.from_dict({**hf_io.config_to_hf(cfg), "dtype": "float32",
                                    "bos_token_id": None, "eos_token_id": None,
                                    "pad_token_id": None})
    # Writable, contiguous float32 copies: arrays viewed from JAX buffers are read-only, and a
    # transposed view would make every torch matmul slower.
    sd = {name: torch.from_numpy(np.array(x, np.float32, order="C", copy=True))
          for name, x in hf_io.hf_tensors(params, cfg)}
    with no_init_weights():  # every weight is overwritten below
        model = LlamaForCausalLM(config)
    model.load_state_dict(sd, strict=not cfg.tie_embeddings)
    if cfg.tie_embeddings:
        model.tie_weights()  # no_init_weights also skipped the tying
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            raise RuntimeError("transformers did not tie lm_head to the embedding")
    return model.float().eval()


class HFEngine:
    """``LlamaForCausalLM.generate(do_sample=False)``; times come from a streamer's calls."""

    name = "hf"

    def __init__(self, cfg: ModelConfig, params: dict, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = hf_llama_from_params(cfg, params)

    def _generate(self, ids, n, streamer=None):
        from transformers import GenerationConfig

        # No EOS anywhere (here or in the model's config), so generation runs exactly n steps.
        gen = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                               pad_token_id=0)
        x = self.torch.tensor([ids])
        with self.torch.inference_mode():
            out = self.model.generate(x, attention_mask=self.torch.ones_like(x),
                                      generation_config=gen, streamer=streamer)
        return out[0, len(ids):].tolist()

    def warmup(self, ids, n):
        self._generate(ids, min(n, WARMUP_TOKENS))

    def generate(self, ids, n):
        stamps = []

        class Streamer:  # generate() calls put() with the prompt, then with each new token
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        t0 = time.perf_counter()
        tokens = self._generate(ids, n, Streamer())
        total = time.perf_counter() - t0
        if len(tokens) != n or len(stamps) != n + 1:
            raise RuntimeError(f"transformers produced {len(tokens)} tokens with "
                               f"{len(stamps)} streamer calls, expected {n} and {n + 1}")
        return Timing(tokens, stamps[1] - t0, total)


# ---------------------------------------------------------------------------------- llama.cpp


def llamacpp_gguf(source: Path, cfg: ModelConfig, params: dict) -> Path:
    """The F32 GGUF of ``params`` loaded from ``source``, written on first use.

    It lives beside ``source``'s dequantized-weights cache entry and shares its key, so an
    edited or replaced source GGUF gets a fresh file. Written by
    :func:`specjax.io.gguf.write_f32_gguf` to a temporary name and renamed, so an interrupted
    write leaves nothing behind.
    """
    from specjax.io import gguf as gguf_io

    entry = gguf_io.cache_path(source)
    out = entry.with_name(entry.stem + ".f32.gguf")
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
        try:
            gguf_io.write_f32_gguf(tmp, source, cfg, params)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


class LlamaCppEngine:
    """``llama_cpp.Llama.generate`` with the greedy sampler over exactly N tokens."""

    name = "llamacpp"

    def __init__(self, model_path: Path, n_ctx: int, threads: int):
        import gguf
        from llama_cpp import Llama

        f32 = int(gguf.GGMLQuantizationType.F32)
        self.llm = Llama(str(model_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         type_k=f32, type_v=f32, verbose=False)

    def _stream(self, ids, n, on_token: Callable[[], None] = lambda: None) -> list[int]:
        # reset() first: otherwise generate() reuses the KV cache of a previous identical
        # prompt and skips the prefill we mean to time.
        self.llm.reset()
        tokens = []
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0):
            tokens.append(int(tok))
            on_token()
            if len(tokens) == n:  # generate() never stops by itself, EOS included
                break
        return tokens

    def warmup(self, ids, n):
        self._stream(ids, min(n, WARMUP_TOKENS))

    def generate(self, ids, n):
        stamps = []
        t0 = time.perf_counter()
        tokens = self._stream(ids, n, lambda: stamps.append(time.perf_counter()))
        return Timing(tokens, stamps[0] - t0, stamps[-1] - t0)
