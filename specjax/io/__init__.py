"""Checkpoint and tokenizer I/O: HF safetensors, GGUF, sentencepiece / HF tokenizers.

``specjax.io.load(name_or_path)`` is the entry point; the format-specific loaders are
``load_hf`` and ``load_gguf``; ``save_hf`` and ``gguf.write_f32_gguf`` write our params back out.
Every loader ends with ``specjax.models.params.check``.
"""

from specjax.io.gguf import load_gguf
from specjax.io.hf import config_from_hf, load_hf, save_hf
from specjax.io.models import KNOWN_MODELS, LoadedModel, load
from specjax.io.tokenizer import Tokenizer

__all__ = ["KNOWN_MODELS", "LoadedModel", "Tokenizer", "config_from_hf", "load", "load_gguf",
           "load_hf", "save_hf"]
