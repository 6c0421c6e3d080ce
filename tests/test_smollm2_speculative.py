"""Speculative greedy decoding of the real SmolLM2-135M equals its plain greedy decoding.

A verify pass over N tokens and N one-token steps accumulate in different orders, so a near-tie
between the top two logits may flip an argmax. Where outputs part, the test requires the
divergence to sit on such a near-tie (measured on the plain run's own sequence, in the run's
dtype) and prints the rate; a divergence anywhere else fails. In bfloat16 the near-ties are
wider, and divergences happen (gaps of 0.02-0.08 measured on the benchmark's prompts).
"""

from __future__ import annotations

import pytest

from specjax import api
from specjax.drafters import dflash, eagle
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io import official
from specjax.io.models import shipped_drafter
from specjax.targets import DecoderTarget

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that checks whether a string is a palindrome.",
]
MAX_NEW = 32
# float32 logits of magnitude ~30 reassociated over 30 layers move by ~1e-4; a flip needs the
# top two to sit closer than that.
NEAR_TIE = 2e-3
# bfloat16 keeps 8 bits of mantissa: one rounding flip in the last hidden state (relative 2^-8)
# moves logits of magnitude ~30 by ~0.1.
NEAR_TIE_BF16 = 0.25


DRAFTERS = ["ngram k=6", "draft-model L=2 k=3", "shipped eagle3, tree N=16",
            "shipped eagle1, tree N=16", "shipped dflash, block chain, all ids",
            "shipped dflash, ddtree N=16, its draft vocabulary"]
BF16_DRAFTERS = ["ngram k=6", "shipped eagle3, tree N=16",
                 "shipped dflash, ddtree N=16, its draft vocabulary"]


def _drafter(model, name):
    """(drafter, drafter params) of ``name`` (one of ``DRAFTERS``) for the real model."""
    tgt = DecoderTarget(model.cfg)
    if name.startswith("ngram"):
        return NgramDrafter(draft_len=6), None
    if name.startswith("draft-model"):
        return DraftModelDrafter.from_target_layers(model.cfg, model.params, 2, draft_len=3)
    if "eagle" in name:
        method = "eagle3" if "eagle3" in name else "eagle1"
        ecfg, own = official.load_eagle(shipped_drafter("smollm2-135m", method), model.cfg,
                                         dtype=model.cfg.dtype)
        return (eagle.EagleDrafter(ecfg, tgt, eagle.DynamicTree(16, 5, 4)),
                eagle.drafter_params(own, model.params))
    dcfg, down = official.load_dflash(shipped_drafter("smollm2-135m", "dflash"), model.cfg,
                                       dtype=model.cfg.dtype)
    assert dcfg.draft_vocab_size is not None  # the shipped drafter names its default
    vocab = dcfg.draft_vocab_size if "draft vocabulary" in name else None
    policy = dflash.DDTree(16) if "ddtree" in name else dflash.BlockChain()
    return (dflash.DFlashDrafter(dcfg, tgt, policy, vocab=vocab),
            dflash.drafter_params(down, model.params, target=tgt, vocab=vocab))


def _plain_run(model):
    """(prompt ids, generation kwargs, plain greedy result) of ``model`` on ``PROMPTS``."""
    tok = model.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    kw = dict(max_new_tokens=MAX_NEW, stop_tokens=tok.eos_ids)
    return ids, kw, api.generate_tokens(model.cfg, model.params, ids, **kw)


def _check(model, plain_run, name, near_tie):
    """Runs drafter ``name`` greedily and requires every divergence from ``plain_run`` to sit
    on a near-tie (top-2 gap below ``near_tie``)."""
    ids, kw, plain = plain_run
    drafter, dp = _drafter(model, name)
    got = api.generate_tokens(model.cfg, model.params, ids, drafter=drafter,
                              drafter_params=dp, **kw)
    if not name.startswith("draft-model"):
        # Prompt lookup must be exercised (the first prompt asks for a copy), and the
        # shipped drafter must draft what the target accepts.
        assert got.stats.accepted.sum() > 0, name
    divergences = 0
    for row, prompt_ids in enumerate(ids):
        part = api.divergence(model.cfg, model.params, prompt_ids, got.tokens[row],
                              plain.tokens[row])
        if part is None:
            continue
        k, gap = part
        assert gap < near_tie, f"{name}, prompt {row}: diverged at {k} with gap {gap}"
        divergences += 1
    print(f"{name} ({model.cfg.dtype}): near-tie divergences in {divergences} of {len(ids)} rows")


@pytest.fixture(scope="module")
def plain_run(smollm2):
    """The float32 plain greedy run, computed once per process."""
    return _plain_run(smollm2)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2):
    """SmolLM2-135M in bfloat16 (skipped with ``smollm2``)."""
    from specjax.io import load

    return load("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="module")
def plain_run_bf16(smollm2_bf16):
    """The bfloat16 plain greedy run, computed once per process."""
    return _plain_run(smollm2_bf16)


@pytest.mark.parametrize("name", DRAFTERS)
def test_speculative_greedy_equals_plain_on_smollm2(smollm2, plain_run, name):
    _check(smollm2, plain_run, name, NEAR_TIE)


@pytest.mark.parametrize("name", BF16_DRAFTERS)
def test_speculative_greedy_equals_plain_on_smollm2_bf16(smollm2_bf16, plain_run_bf16, name):
    _check(smollm2_bf16, plain_run_bf16, name, NEAR_TIE_BF16)
