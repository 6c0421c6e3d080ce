"""Exact laws and a goodness-of-fit test for the tests that check what speculative sampling
samples (the loop, drafters with real q): an 8-token vocabulary small enough to enumerate."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from scipy import stats as sps

from specjax import sampling
from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.models import target

V_SMALL = 8


def chi_square_p(samples: np.ndarray, law: dict) -> float:
    """p-value of a chi-square goodness-of-fit test, pooling cells expected below 5."""
    n = samples.shape[0]
    codes = samples @ (V_SMALL ** np.arange(samples.shape[1])[::-1])
    counts = np.bincount(codes, minlength=V_SMALL ** samples.shape[1])
    expected = np.array([law[s] for s in itertools.product(range(V_SMALL), repeat=samples.shape[1])]) * n
    assert counts[expected == 0].sum() == 0, "a sequence of probability 0 was generated"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    return float(sps.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


# A transformer target small enough for an exact law: the law of its first three tokens after
# PROMPT8 is computed from all 8^2 prefixes.
TINY8 = ModelConfig(arch="llama", vocab_size=V_SMALL, d_model=16, n_layers=3, n_heads=2,
                    n_kv_heads=1, head_dim=8, d_ff=24)
PARAMS8 = target.init_params(TINY8, 3, scale=0.6)
PROMPT8 = [3, 5]


def exact_transformer_law(temperature, top_k, top_p):
    """Law of the first 3 tokens after PROMPT8 under plain sampling of the TINY8 target."""
    prefixes = np.array(list(itertools.product(range(V_SMALL), repeat=2)))  # [64, 2]
    seqs = np.concatenate([np.tile(PROMPT8, (len(prefixes), 1)), prefixes], axis=1)
    logits, _, _ = target.forward(PARAMS8, TINY8, jnp.asarray(seqs),
                                  jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape),
                                  cache_lib.init_cache(TINY8, len(seqs), seqs.shape[1]))
    sp = sampling.SamplingParams.make(len(seqs), temperature, top_k, top_p)
    cond = np.exp(np.asarray(sampling.log_probs(logits, sp), np.float64))  # [64, 4, V]
    cond /= cond.sum(-1, keepdims=True)
    law = {}
    for i, (a, b) in enumerate(prefixes):
        for c in range(V_SMALL):
            law[a, b, c] = cond[i, 1, a] * cond[i, 2, b] * cond[i, 3, c]
    return law
