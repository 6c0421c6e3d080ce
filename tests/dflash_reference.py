"""An independent dense formulation of DFlash's block pass, on tensors in the official (torch)
layout: the injected context and the block concatenated, each layer's keys/values of both
through its own k/v projections, one explicit mask, plain softmax attention, float64 NumPy."""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, H], rotate-half layout
    h = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def block_states(sd, *, n_layers, n_heads, n_kv_heads, head_dim, eps, theta, taps, block_emb,
                 causal=lambda i: False, window=lambda i: None):
    """Final normed states [Bk - 1, D] of block positions 1..Bk-1 for one row.

    Args:
      sd: {official tensor name: array} (``fc.weight`` [D, n * E], ``layers.{i}.*``, ...).
      taps: [T, n, E] the target taps of context positions 0..T-1.
      block_emb: [Bk, D] embeddings of ``[root, mask...]`` at positions T..T+Bk-1.
      causal, window: per layer, causal inside the block / the sliding window or None.
    """
    f = lambda name: np.asarray(sd[name], np.float64)  # noqa: E731
    start, bk = taps.shape[0], block_emb.shape[0]
    ctx = _rms(np.asarray(taps, np.float64).reshape(start, -1) @ f("fc.weight").T,
               f("hidden_norm.weight"), eps)
    x = np.asarray(block_emb, np.float64)
    pos_blk = start + np.arange(bk)
    pos_all = np.concatenate([np.arange(start), pos_blk])
    g = n_heads // n_kv_heads
    for i in range(n_layers):
        p = f"layers.{i}."
        mask = np.concatenate([np.ones((bk, start), bool),
                               np.tril(np.ones((bk, bk), bool)) if causal(i)
                               else np.ones((bk, bk), bool)], axis=1)
        if window(i) is not None:
            mask &= pos_blk[:, None] - pos_all[None, :] < window(i)
        xn = _rms(x, f(p + "input_layernorm.weight"), eps)
        both = np.concatenate([ctx, xn], axis=0)  # the context goes through k/v only
        q = (xn @ f(p + "self_attn.q_proj.weight").T).reshape(bk, n_heads, head_dim)
        k = (both @ f(p + "self_attn.k_proj.weight").T).reshape(-1, n_kv_heads, head_dim)
        v = (both @ f(p + "self_attn.v_proj.weight").T).reshape(-1, n_kv_heads, head_dim)
        q = _rope(_rms(q, f(p + "self_attn.q_norm.weight"), eps), pos_blk, theta)
        k = _rope(_rms(k, f(p + "self_attn.k_norm.weight"), eps), pos_all, theta)
        out = np.zeros((bk, n_heads, head_dim))
        for head in range(n_heads):
            s = q[:, head] @ k[:, head // g].T / np.sqrt(head_dim)
            s = np.where(mask, s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (a / a.sum(-1, keepdims=True)) @ v[:, head // g]
        x = x + out.reshape(bk, -1) @ f(p + "self_attn.o_proj.weight").T
        m = _rms(x, f(p + "post_attention_layernorm.weight"), eps)
        gate, up = m @ f(p + "mlp.gate_proj.weight").T, m @ f(p + "mlp.up_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f(p + "mlp.down_proj.weight").T
    return _rms(x, f("norm.weight"), eps)[1:]
