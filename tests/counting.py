"""A tiny target that drafters can learn from a few hundred tokens, and distilled records of
its own greedy responses, for the drafter training tests."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax import api
from specjax.config import ModelConfig
from specjax.models import target
from specjax.train import data

TINY = ModelConfig(arch="llama", vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                   head_dim=8, d_ff=64, max_position_embeddings=256)


def counting_target(cfg: ModelConfig = TINY) -> dict:
    """Random layers made weak (x0.01 on their output projections), and a head whose row v + 1
    is the direction of token v's embedding: the target mostly counts on by one, with its
    layers' context mixed into the distribution. A small drafter learns that from a few
    hundred tokens; a random target's greedy walk it could not, at this size."""
    p = target.init_params(cfg, 0, scale=0.5)
    unit = p["embed"] / jnp.linalg.norm(p["embed"], axis=-1, keepdims=True)  # [V, D]
    head = 8.0 * jnp.roll(unit, 1, axis=0).T  # [D, V]: column v + 1 is token v's direction
    return dict(p, lm_head=head, layers=tuple(dict(lp, wo=0.01 * lp["wo"], w_down=0.01 * lp["w_down"])
                                              for lp in p["layers"]))


def write_records(directory: Path, cfg: ModelConfig, params: dict, n: int = 40,
                  max_new_tokens: int = 24) -> Path:
    """A distilled data directory: ``n`` random prompts of 3-8 tokens and the target's own
    greedy responses, in one shard."""
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, cfg.vocab_size, gen.integers(3, 9)).tolist() for _ in range(n)]
    responses = api.generate_tokens(cfg, params, prompts, max_new_tokens=max_new_tokens).tokens
    arrays = data.shard_arrays(prompts, responses, list(range(n)), [False] * n, cfg.vocab_size)
    data.write_atomic(directory / data.shard_name(0), data.npz_bytes(arrays))
    (directory / data.MANIFEST).write_text(json.dumps(
        {"settings": {"format_version": data.FORMAT_VERSION}, "n_shards": 1}))
    return directory
