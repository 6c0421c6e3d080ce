"""The target decoder (Llama-3, Qwen3, SmolLM2) as pure functions over a params pytree.

Params layout (matrices are ``[in, out]``, the transpose of torch ``Linear.weight``)::

    params = {
      "embed": [V, D],
      "layers": (per layer, a tuple of length L) {
          "attn_norm": [D],
          "wqkv": [D, (N + 2K) * H],   # q heads, then k heads, then v heads (rotate_half layout)
          "wo": [N * H, D],
          "q_norm": [H], "k_norm": [H],  # Qwen3 only
          "mlp_norm": [D],
          "w_gate_up": [D, 2F],        # gate, then up
          "w_down": [F, D],
      },
      "final_norm": [D],
      "lm_head": [D, V],               # absent when cfg.tie_embeddings (embed is used)
    }

Layers are a tuple of per-layer dicts, not stacked arrays under ``lax.scan``: stacked layers ran
5-7x slower for decoding on XLA:CPU, and unrolling only costs compile time. q/k/v and gate/up
are fused into one matrix each, so a decode step issues fewer, larger matrix products.

**One-row weights.** A layer may also carry ``"wqkv_t"``, ``"wo_t"``, ``"w_gate_up_t"`` and
``"w_down_t"`` (and the params an untied ``"lm_head_t"``): the same matrices stored
``[out, in]``. A pass with exactly one query row (``B * T == 1``, a plain decoding step) then
multiplies by those: XLA:CPU's matrix-vector product streams ``[out, in]`` weights faster
than ``[in, out]`` ones, while with two or more rows ``[in, out]`` is faster (measured
side by side, see the README's performance notes). :func:`specjax.io.layout.with_row_weights`
adds them (``specjax.io.load`` does for float32 on CPU); the result differs from the
``[in, out]`` product only by summation order.

**Masks.** Every call writes its T new tokens at slots ``[lengths, lengths + T)`` of each row's
cache. A query sees (a) all committed slots ``< lengths[b]`` and (b) among the new tokens, those
marked in ``mask[b, t, :]``. ``mask=None`` means causal (token t sees new tokens 0..t), which
serves prefill and plain decoding; a tree or block verification passes its ancestor-or-self
matrix, with positions ``lengths + depth``. Row ``t`` of ``mask`` must include ``t`` itself.
:func:`forward_fresh` computes the same pass without writing: the new keys/values are attended
as a separate block and returned, for the caller to write with ``cache.write``.

**Taps.** ``taps=(i, ...)`` returns the residual stream after ``i`` decoder layers, for
``0 <= i <= L``: tap 0 is the token embedding and tap ``i < L`` equals HF
``output_hidden_states[i]``. Tap ``L`` is the final pre-norm state; HF's ``hidden_states[L]`` is
``final_norm`` applied to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models import cache as cache_lib
from specjax.kernels.attention import reference_attention as attention
from specjax.models.layers import apply_rope, rms_norm, rope_tables


def init_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """Random normal(0, ``scale``) weights and unit norms in the documented layout.

    Drawn with NumPy on the host: compiling JAX's threefry for a dozen weight shapes took
    longer than a small test's whole run.
    """
    n, k, h, d, f, v = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff,
                        cfg.vocab_size)
    gen = np.random.default_rng(seed)
    dt = cfg.jnp_dtype

    def normal(shape):
        return jnp.asarray(scale * gen.standard_normal(shape, np.float32), dt)

    layers = []
    for _ in range(cfg.n_layers):
        layer = {
            "attn_norm": jnp.ones((d,), dt),
            "wqkv": normal((d, (n + 2 * k) * h)),
            "wo": normal((n * h, d)),
            "mlp_norm": jnp.ones((d,), dt),
            "w_gate_up": normal((d, 2 * f)),
            "w_down": normal((f, d)),
        }
        if cfg.qk_norm:
            layer["q_norm"] = jnp.ones((h,), dt)
            layer["k_norm"] = jnp.ones((h,), dt)
        layers.append(layer)
    params = {"embed": normal((v, d)), "layers": tuple(layers), "final_norm": jnp.ones((d,), dt)}
    if not cfg.tie_embeddings:
        params["lm_head"] = normal((d, v))
    return params


def step_tokens(cfg: ModelConfig) -> int:
    """The fewest query tokens a pass should carry to decode one token.

    XLA:CPU's one-row bfloat16 matrix-vector products run several times slower than two-row
    ones, so a bfloat16 step feeds its token twice (the copy's key/value lands in a scratch
    slot past the committed length, its logits are dropped); float32 steps use one row.
    """
    return 2 if cfg.dtype == "bfloat16" else 1


def visible_slots(lengths: jax.Array, capacity: int, mask: jax.Array | None, t: int) -> jax.Array:
    """Which cache slots each new query sees.

    Args:
      lengths: [B] committed slots per row.
      capacity: S.
      mask: [B, T, T] bool among the new tokens, or None for causal.
      t: T.
    Returns:
      [B, T, S] bool: committed slots, plus new slots the mask allows.

    For lengths = [2], T = 3, S = 6 and a causal mask::

        slot:      0 1 2 3 4 5
        query 0:   1 1 1 0 0 0
        query 1:   1 1 1 1 0 0
        query 2:   1 1 1 1 1 0
    """
    rel = jnp.arange(capacity)[None, None, :] - lengths[:, None, None]  # [B, 1, S]
    committed = rel < 0
    if mask is None:
        new = (rel >= 0) & (rel <= jnp.arange(t)[None, :, None])
    else:
        idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (lengths.shape[0], t, capacity))
        new = (rel >= 0) & (rel < t) & jnp.take_along_axis(mask, idx, axis=2)
    return committed | new


def _matmul(x: jax.Array, p: dict, key: str) -> jax.Array:
    """x [B, T, in] @ p[key] [in, out], accumulated in float32, returned in ``x.dtype``; a
    single row uses the ``[out, in]`` copy ``p[key + "_t"]`` when there is one."""
    if x.shape[0] * x.shape[1] == 1 and f"{key}_t" in p:
        return jnp.einsum("bti,oi->bto", x, p[f"{key}_t"],
                          preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("bti,io->bto", x, p[key], preferred_element_type=jnp.float32).astype(x.dtype)


def _kv_rows(x: jax.Array) -> jax.Array:
    """[B, T, K, H] -> [B * K, T, H], the cache's row order."""
    b, t, k, h = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * k, t, h)


def _layer(cfg: ModelConfig, p: dict, x, cos, sin, k_buf, v_buf, lengths, visible,
           visible_new=None):
    """One decoder layer over T new tokens.

    With ``visible_new`` None the new keys/values are written into the layer's cache rows and
    attended there (``visible`` covers committed and new slots); returns ``(x, k_buf, v_buf)``.
    Otherwise the cache is only read (``visible``: committed slots), the new keys/values are
    attended as fresh keys (``visible_new`` [B * K, G * T, T]) and returned instead of the
    rows: ``(x, k_new, v_new)``, each [B * K, T, H] in the cache's storage dtype.
    """
    b, t, _ = x.shape
    n, kh, h, g = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_per_kv
    qkv = _matmul(rms_norm(x, p["attn_norm"], cfg.norm_eps), p, "wqkv")
    q = qkv[..., : n * h].reshape(b, t, n, h)
    k = qkv[..., n * h: (n + kh) * h].reshape(b, t, kh, h)
    v = qkv[..., (n + kh) * h:].reshape(b, t, kh, h)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    # Cache rows are (batch, kv head) pairs: [B, T, K, H] -> [B * K, T, H].
    k_new = cache_lib.to_storage(_kv_rows(k), cfg)
    v_new = cache_lib.to_storage(_kv_rows(v), cfg)
    # Queries grouped under their kv head: [B, T, N, H] -> [B * K, G * T, H].
    q = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b * kh, g * t, h)
    if visible_new is None:
        k_buf = cache_lib.write_rows(k_buf, k_new, lengths)
        v_buf = cache_lib.write_rows(v_buf, v_new, lengths)
        fresh, k_out, v_out = None, k_buf, v_buf
    else:
        fresh = (cache_lib.from_storage(k_new, cfg), cache_lib.from_storage(v_new, cfg), visible_new)
        k_out, v_out = k_new, v_new
    out = attention(q, cache_lib.from_storage(k_buf, cfg), cache_lib.from_storage(v_buf, cfg),
                    visible, fresh)
    out = out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)
    x = x + _matmul(out, p, "wo")
    gate_up = _matmul(rms_norm(x, p["mlp_norm"], cfg.norm_eps), p, "w_gate_up")
    gate, up = gate_up[..., : cfg.d_ff], gate_up[..., cfg.d_ff:]
    x = x + _matmul(jax.nn.silu(gate) * up, p, "w_down")
    return x, k_out, v_out


def _per_kv_row(cfg: ModelConfig, m: jax.Array) -> jax.Array:
    """[B, T, X] -> [B * K, G * T, X], one copy shared by all layers, in the attention's row
    order (queries grouped under their kv head)."""
    b, t, x = m.shape
    return jnp.broadcast_to(m[:, None, None], (b, cfg.n_kv_heads, cfg.q_per_kv, t, x)).reshape(
        b * cfg.n_kv_heads, cfg.q_per_kv * t, x)


def _decoder(params, cfg, tokens, positions, cache, mask, taps, fresh):
    """The layers of :func:`forward_hidden` (``fresh=False``) or :func:`forward_fresh`.

    Returns ``(hidden [B, T, D], tap_states [B, T, n_taps, D], ks, vs)``: per layer the updated
    cache rows, or (``fresh``) the new tokens' keys/values [B * K, T, H].
    """
    for i in taps:
        if not 0 <= i <= cfg.n_layers:
            raise ValueError(f"tap layer {i} is outside [0, {cfg.n_layers}]")
    b, t = tokens.shape
    x = params["embed"][tokens]
    cos, sin = rope_tables(cfg, positions)
    if fresh:
        committed = jnp.arange(cache.capacity)[None, None, :] < cache.lengths[:, None, None]
        visible = _per_kv_row(cfg, jnp.broadcast_to(committed, (b, t, cache.capacity)))
        among = jnp.tril(jnp.ones((t, t), bool)) if mask is None else mask
        visible_new = _per_kv_row(cfg, jnp.broadcast_to(among, (b, t, t)))
    else:
        visible = _per_kv_row(cfg, visible_slots(cache.lengths, cache.capacity, mask, t))
        visible_new = None
    collected = {0: x} if 0 in taps else {}
    ks, vs = [], []
    for i, p in enumerate(params["layers"]):
        x, k_out, v_out = _layer(cfg, p, x, cos, sin, cache.k[i], cache.v[i], cache.lengths,
                                 visible, visible_new)
        ks.append(k_out)
        vs.append(v_out)
        if i + 1 in taps:
            collected[i + 1] = x
    tap_states = (jnp.stack([collected[i] for i in taps], axis=2) if taps
                  else jnp.zeros((b, t, 0, cfg.d_model), x.dtype))
    return rms_norm(x, params["final_norm"], cfg.norm_eps), tap_states, tuple(ks), tuple(vs)


def forward_hidden(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: cache_lib.KVCache,
    mask: jax.Array | None = None,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, cache_lib.KVCache]:
    """Runs the decoder over T new tokens per row without the LM head.

    Args:
      params: the params pytree (module docstring).
      cfg: the model config.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE positions (``lengths + depth`` for trees).
      cache: the KV cache; the new tokens are written at ``[lengths, lengths + T)``, and the
        caller guarantees ``lengths + T <= capacity``.
      mask: [B, T, T] bool visibility among the new tokens (ancestor-or-self), None for causal.
      taps: residual-stream layer ids to return (module docstring).
    Returns:
      hidden: [B, T, D] the final normed hidden states.
      tap_states: [B, T, len(taps), D] residual states at ``taps`` (T x 0 x D when none).
      cache: the cache with the new keys/values written, lengths unchanged.
    """
    hidden, tap_states, ks, vs = _decoder(params, cfg, tokens, positions, cache, mask, taps,
                                          fresh=False)
    return hidden, tap_states, cache_lib.KVCache(ks, vs, cache.lengths)


def lm_head(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Float32 logits [..., V] from final hidden states [..., D].

    A tied head multiplies by ``embed`` [V, D]; an untied one by ``lm_head`` [D, V], or by
    its one-row copy ``lm_head_t`` [V, D] for a single row.
    """
    if cfg.tie_embeddings:
        return jnp.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
    if np.prod(hidden.shape[:-1]) == 1 and "lm_head_t" in params:
        return jnp.einsum("...d,vd->...v", hidden, params["lm_head_t"],
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: cache_lib.KVCache,
    mask: jax.Array | None = None,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, cache_lib.KVCache]:
    """The full decoder: ``(logits [B, T, V] float32, taps [B, T, n_taps, D], cache)``.

    Arguments as in :func:`forward_hidden`, which this wraps with :func:`lm_head`.
    """
    hidden, tap_states, cache = forward_hidden(params, cfg, tokens, positions, cache, mask, taps)
    return lm_head(params, cfg, hidden), tap_states, cache


def forward_fresh(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: cache_lib.KVCache,
    mask: jax.Array | None = None,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, cache_lib.Fresh]:
    """:func:`forward` without writing the cache: ``(logits, taps, fresh)``.

    The cache is only read; the new tokens attend to its committed slots and, among
    themselves, as ``mask`` allows. ``cache_lib.write(cache, fresh)`` then stores their keys
    and values where :func:`forward` would have, and the logits equal :func:`forward`'s up to
    summation order. Because nothing is written, the pass can sit inside ``lax.cond`` without
    XLA copying the cache (``decode.speculative_generate`` uses this). Arguments as in
    :func:`forward_hidden`.
    """
    hidden, tap_states, ks, vs = _decoder(params, cfg, tokens, positions, cache, mask, taps,
                                          fresh=True)
    return lm_head(params, cfg, hidden), tap_states, cache_lib.Fresh(ks, vs)


def prefill(params: dict, cfg: ModelConfig, prompt: jax.Array, prompt_len: jax.Array, capacity: int,
            taps: tuple[int, ...] = ()):
    """Runs the target over right-padded prompts.

    Args:
      prompt: [B, P] int32, right-padded.
      prompt_len: [B] int32 true lengths (>= 1).
      capacity: S, cache slots per row.
      taps: residual layers to return for every prompt position.
    Returns:
      last_logits: [B, V] float32 logits at each row's last prompt token.
      tap_states: [B, P, n_taps, D].
      cache: the cache with ``lengths = prompt_len`` (slots past it hold padding garbage).
    """
    b, p = prompt.shape
    cache = cache_lib.init_cache(cfg, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, tap_states, cache = forward_hidden(params, cfg, prompt, positions, cache, taps=taps)
    last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    cache = cache_lib.advance(cache, prompt_len)
    return lm_head(params, cfg, last), tap_states, cache
