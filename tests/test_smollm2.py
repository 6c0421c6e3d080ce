"""SmolLM2-135M end to end against HF transformers reading the same GGUF file.

The reference is transformers' own GGUF conversion: ``load_gguf_checkpoint`` parses the file,
dequantizes every tensor and undoes llama.cpp's Q/K permutation with its own code, and the
weights go into an eager ``LlamaForCausalLM``. That is exactly what
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` does for a llama GGUF (the
``"llama"`` architecture takes the legacy loader), minus a guard in ``from_pretrained`` that
requires ``accelerate``, which is not one of our test dependencies. Its tokenizer is
``TokenizersBackend.from_pretrained(dir, gguf_file=name)``, transformers' GGUF tokenizer
converter. Nothing on the reference side goes through ``specjax.io``.

Checked: the chat prompt's token ids, the prompt's last-position logits, and a 40-token greedy
continuation, token for token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.io.models import resolve
from specjax.models import cache as cache_lib
from specjax.models import target

pytestmark = pytest.mark.slow

# A prompt whose greedy answer is long: a code block, then an explanation.
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
MAX_NEW_TOKENS = 40
MIN_COMPARED = 32

# Last-position logits of this prompt reach magnitude ~35 (checked below). Both sides compute in
# float32 from identical weights; they differ only in accumulation order (XLA vs oneDNN/MKL
# matmul blocking, fused vs separate q/k/v and gate/up products, softmax and norm reductions).
# Each reordered sum of n terms moves a result by ~sqrt(n) * 6e-8 relative; through 30 residual
# layers that stays far below 1e-4 * |logit|. 2e-3 absolute (~1e-4 relative at |logit| ~ 20-35)
# catches any real error -- a wrong RoPE pairing, norm epsilon or weight permutation moves
# logits by O(1) -- while leaving an order of magnitude for reordering. Measured: ~6e-5.
LOGITS_ATOL = 2e-3


@pytest.fixture(scope="module")
def reference():
    """(torch model, HF tokenizer): transformers' conversion of the SmolLM2 GGUF, float32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM, TokenizersBackend
    from transformers.initialization import no_init_weights
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = resolve("smollm2-135m")
    tokenizer = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
    # `load_gguf_checkpoint` names tensors after a model's state dict. A meta-device skeleton
    # with the file's layer count provides the names without a second (~10 s) parse of the
    # file for its config; the config used below is the one parsed from the file.
    meta, _ = read_gguf_metadata(str(path))
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(num_hidden_layers=int(meta["llama.block_count"])))
    # Naming walks every submodule (~400) and rebuilds the same read-only name table for each,
    # ~15 s here; sharing one table changes no result.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                      torch_dtype=torch.float32)
    with no_init_weights():  # every weight is overwritten below; skip ~3 s of random init
        model = LlamaForCausalLM(LlamaConfig.from_dict(parsed["config"]))
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    # A tied head has no tensor of its own in the file: it is the embedding. (`no_init_weights`
    # also skips the tying that model construction would otherwise do.)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.float().eval(), tokenizer


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return smollm2.tokenizer.encode_chat(MESSAGES)


def test_prompt_tokens_match_transformers(smollm2, reference, prompt_ids):
    _, hf_tok = reference
    tok = smollm2.tokenizer
    text = tok.apply_chat_template(MESSAGES)
    assert text == hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    hf_ids = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert prompt_ids == list(hf_ids["input_ids"])
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert set(tok.eos_ids) == {hf_tok.eos_token_id}


@functools.partial(jax.jit, static_argnames="cfg")
def _last_logits(params, cfg, tokens):
    """Logits [V] after the last of ``tokens`` [1, T], from an empty cache of T slots."""
    t = tokens.shape[1]
    cache = cache_lib.init_cache(cfg, 1, t)
    logits, _, _ = target.forward(params, cfg, tokens, jnp.arange(t)[None], cache)
    return logits[0, -1]


def test_prompt_logits_match_transformers(smollm2, reference, prompt_ids):
    import torch

    model, _ = reference
    ours = np.asarray(_last_logits(smollm2.params, smollm2.cfg, jnp.asarray([prompt_ids])))
    with torch.no_grad():
        theirs = model(torch.tensor([prompt_ids])).logits[0, -1].numpy()
    delta = np.abs(ours - theirs)
    print(f"\nprompt logits: max |ours - HF| = {delta.max():.3e} at token {int(delta.argmax())}; "
          f"max |logit| = {np.abs(theirs).max():.1f}; argmax ours {int(ours.argmax())}, "
          f"HF {int(theirs.argmax())}")
    assert 10 < np.abs(theirs).max() < 100  # the magnitude LOGITS_ATOL was sized for
    assert delta.max() <= LOGITS_ATOL
    assert ours.argmax() == theirs.argmax()


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def test_greedy_continuation_matches_transformers(smollm2, reference, prompt_ids):
    import torch

    model, _ = reference
    tok = smollm2.tokenizer
    eos = set(tok.eos_ids)
    ours = api.generate_tokens(smollm2.cfg, smollm2.params, [prompt_ids],
                               max_new_tokens=MAX_NEW_TOKENS, stop_tokens=tok.eos_ids).tokens[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, eos_token_id=list(eos),
                             pad_token_id=tok.eos_ids[0])
    theirs = out[0, len(prompt_ids):].tolist()
    ours, theirs = _until_eos(ours, eos), _until_eos(theirs, eos)
    print(f"\ngreedy continuation ({len(ours)} tokens): {tok.decode(ours)!r}")
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                      min(len(ours), len(theirs)))
    assert ours == theirs, (f"first difference at new token {first_diff}: "
                            f"ours {ours[first_diff:first_diff + 5]}, "
                            f"HF {theirs[first_diff:first_diff + 5]}")
    assert len([t for t in ours if t not in eos]) >= MIN_COMPARED
