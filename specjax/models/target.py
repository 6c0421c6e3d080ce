"""The target decoder (Llama-3, Qwen3, SmolLM2) as pure functions over a params pytree.

Params layout (:mod:`specjax.models.params` describes it, logical axes included; matrices
have their input axis first, the transpose of torch ``Linear.weight``)::

    params = {
      "embed": [V, D],
      "layers": (per layer, a tuple of length L) {
          "attn_norm": [D],
          "wqkv": [D, K, G + 2, H],    # per kv head: its G q heads, its k head, its v head
          "wo": [N * H, D],
          "q_norm": [H], "k_norm": [H],  # Qwen3 only
          "mlp_norm": [D],
          "w_gate_up": [D, 2, F],      # gate, then up
          "w_down": [F, D],
      },
      "final_norm": [D],
      "lm_head": [D, V],               # absent when cfg.tie_embeddings (embed is used)
    }

Layers are a tuple of per-layer dicts, not stacked arrays under ``lax.scan``: stacked layers ran
5-7x slower for decoding on XLA:CPU, and unrolling only costs compile time. q/k/v and gate/up
are fused into one matrix each, so a decode step issues fewer, larger matrix products.

**One-row weights.** A layer may also carry ``"wqkv_t"``, ``"wo_t"``, ``"w_gate_up_t"`` and
``"w_down_t"`` (and the params an untied ``"lm_head_t"``): the same arrays, input axis
moved last. A pass with exactly one query row (``B * T == 1``, a plain decoding step) then
multiplies by those: XLA:CPU's matrix-vector product streams ``[out, in]`` weights faster
than ``[in, out]`` ones, while with two or more rows XLA's product is faster on ``[in, out]``
(measured side by side, see the README's performance notes). Float32 passes of 2 to 64 rows
(a verify pass, a drafted block) multiply by the copies too, on the CPU kernel
(:func:`specjax.models.layers.matmul_nt`), which reads each weight once for all rows.
:func:`specjax.io.layout.with_row_weights` adds them (``specjax.io.load`` does for float32 on
CPU); the result differs from the ``[in, out]`` product only by summation order. Tied params
may likewise hold ``"tied_head"`` [D, V], the embedding table transposed, for passes of
several rows (:func:`lm_head`).

**Masks.** Every call writes its T new tokens at slots ``[lengths, lengths + T)`` of each row's
cache. A query sees (a) all committed slots ``< lengths[b]`` and (b) among the new tokens, those
marked in ``mask[b, t, :]``. ``mask=None`` means causal (token t sees new tokens 0..t), which
serves prefill and plain decoding; a tree or block verification passes its ancestor-or-self
matrix, with positions ``lengths + depth``. Row ``t`` of ``mask`` must include ``t`` itself.
:func:`forward_fresh` computes the same pass without writing: the new keys/values are attended
as a separate block and returned, for the caller to write with ``cache.write``. Both are
visibility rules of :mod:`specjax.models.attention` (``Causal``, ``Prefix``, ``Tree``), never
a dense [T, S] mask handed around; :func:`encode` (packed training sequences) uses ``Causal``
within ``Segments``.

**Taps.** ``taps=(i, ...)`` returns the residual stream after ``i`` decoder layers, for
``0 <= i <= L``: tap 0 is the token embedding and tap ``i < L`` equals HF
``output_hidden_states[i]``. Tap ``L`` is the final pre-norm state; tap :data:`FINAL_NORMED`
(-1) is ``final_norm`` applied to it, HF's ``hidden_states[L]`` (the EAGLE-1 feature).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models import attention as attn
from specjax.models import cache as cache_lib
from specjax.models import layers
from specjax.models import params as params_lib
from specjax.models.layers import rms_norm, rope_tables


def init_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """Random normal(0, ``scale``) weights and unit norms: :func:`specjax.models.params.init`."""
    return params_lib.init(cfg, seed, scale)


def _rules(cache: cache_lib.KVCache, mask: jax.Array | None, fresh: bool):
    """The visibility rules of a pass over T new tokens (module docstring, **Masks**).

    Returns ``(cache_rule, fresh_rule)``. Written into the cache (``fresh=False``), one block:
    causal, or the committed prefix plus the tree at slots ``lengths..``; ``fresh_rule`` is
    None. Read-only (``fresh=True``): the committed prefix of the cache, and causal or tree
    visibility among the pass's own keys.
    """
    lengths = cache.lengths
    if fresh:
        return attn.Prefix(lengths), attn.Causal() if mask is None else attn.Tree(mask)
    if mask is None:
        return attn.Causal(lengths), None
    return attn.Union((attn.Prefix(lengths), attn.Tree(mask, lengths))), None


def _layer(cfg: ModelConfig, p: dict, x, cos, sin, k_buf, v_buf, lengths, rule,
           fresh_rule=None):
    """One decoder layer over T new tokens.

    With ``fresh_rule`` None the new keys/values are written into the layer's cache rows and
    attended there under ``rule``; returns ``(x, k_buf, v_buf)``. Otherwise the cache is only
    read (under ``rule``), the new keys/values are attended as a separate block under
    ``fresh_rule`` and returned instead of the rows: ``(x, k_new, v_new)``, each
    [B * K, T, H] in the cache's storage dtype.
    """
    q, k, v = layers.project_qkv(p, cfg, rms_norm(x, p["attn_norm"], cfg.norm_eps), cos, sin)
    k_new = cache_lib.to_storage(layers.kv_rows(k), cfg)
    v_new = cache_lib.to_storage(layers.kv_rows(v), cfg)
    if fresh_rule is None:
        k_buf = cache_lib.write_rows(k_buf, k_new, lengths)
        v_buf = cache_lib.write_rows(v_buf, v_new, lengths)
        k_out, v_out = k_buf, v_buf
    else:
        k_out, v_out = k_new, v_new
    blocks = [attn.KeyBlock(cache_lib.from_storage(k_buf, cfg), cache_lib.from_storage(v_buf, cfg),
                            rule)]
    if fresh_rule is not None:
        blocks.append(attn.KeyBlock(cache_lib.from_storage(k_new, cfg),
                                    cache_lib.from_storage(v_new, cfg), fresh_rule))
    x = x + layers.attention_out(p, cfg, q, blocks)
    x = x + layers.mlp(p, cfg, x)
    return x, k_out, v_out


FINAL_NORMED = -1  # the tap id of the final normed state (the LM head's input)


def _check_taps(cfg: ModelConfig, taps: tuple[int, ...]):
    for i in taps:
        if not (0 <= i <= cfg.n_layers or i == FINAL_NORMED):
            raise ValueError(f"tap layer {i} is outside [0, {cfg.n_layers}] and is not "
                             f"FINAL_NORMED ({FINAL_NORMED})")


def _stack_taps(collected: dict, taps: tuple[int, ...], hidden: jax.Array) -> jax.Array:
    """[B, T, len(taps), D] from per-layer residual states and the final normed ``hidden``
    (T x 0 x D when no taps were asked for)."""
    b, t, d = hidden.shape
    collected = {**collected, FINAL_NORMED: hidden}
    return (jnp.stack([collected[i] for i in taps], axis=2) if taps
            else jnp.zeros((b, t, 0, d), hidden.dtype))


def _decoder(params, cfg, tokens, positions, cache, mask, taps, fresh):
    """The layers of :func:`forward_hidden` (``fresh=False``) or :func:`forward_fresh`.

    Returns ``(hidden [B, T, D], tap_states [B, T, n_taps, D], ks, vs)``: per layer the updated
    cache rows, or (``fresh``) the new tokens' keys/values [B * K, T, H].
    """
    _check_taps(cfg, taps)
    x = embed(params, tokens)
    cos, sin = rope_tables(cfg, positions)
    rule, fresh_rule = _rules(cache, mask, fresh)
    collected = {0: x} if 0 in taps else {}
    ks, vs = [], []
    for i, p in enumerate(params["layers"]):
        x, k_out, v_out = _layer(cfg, p, x, cos, sin, cache.k[i], cache.v[i], cache.lengths,
                                 rule, fresh_rule)
        ks.append(k_out)
        vs.append(v_out)
        if i + 1 in taps:
            collected[i + 1] = x
    hidden = final_norm(params, cfg, x)
    return hidden, _stack_taps(collected, taps, hidden), tuple(ks), tuple(vs)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D] of ``tokens`` [...] (the residual stream's start, tap 0).

    A bfloat16 table is gathered through its bit pattern (uint16): XLA:CPU runs a bfloat16
    gather in float32 and hoists the conversion of the whole table out of the decoding loop,
    one float32 copy per call and loop (some 60 ms each for SmolLM2-135M)."""
    table = params["embed"]
    if table.dtype != jnp.bfloat16:
        return table[tokens]
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits[tokens], jnp.bfloat16)


def final_norm(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The final RMSNorm of a residual state [..., D] (the input of :func:`lm_head`)."""
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


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

    A tied head multiplies by ``embed`` [V, D], or by its copy ``tied_head`` [D, V] where the
    params hold one (:func:`specjax.io.layout.with_tied_head`), except for a single float32
    row (a single bfloat16 row runs as two, :func:`specjax.models.layers.matmul`) and the
    rows the CPU kernel takes (:func:`specjax.models.layers.kernel_takes`); an untied one by
    ``lm_head`` [D, V], or by its one-row copy ``lm_head_t`` [V, D] for a single row and the
    rows the kernel takes (:func:`specjax.models.layers.head_logits`).
    """
    one_row = np.prod(hidden.shape[:-1]) == 1
    if cfg.tie_embeddings:
        embed = params["embed"]
        if ("tied_head" in params and not (one_row and hidden.dtype != jnp.bfloat16)
                and not layers.kernel_takes(hidden, embed)):
            return layers.matmul(hidden, params["tied_head"], "...d,dv->...v")
        return layers.matmul_nt(hidden, embed)
    return layers.head_logits(hidden, params["lm_head"], params.get("lm_head_t"))


def head_rows(params: dict, cfg: ModelConfig, vocab_ids: jax.Array) -> jax.Array:
    """The LM head's rows [V', D] of the ids ``vocab_ids`` [V'], in their order: the logits of
    those ids are ``hidden @ rows.T`` (a reduced draft vocabulary gathers them once)."""
    return (params["embed"] if cfg.tie_embeddings else params["lm_head"].T)[vocab_ids]


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


def encode(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced, cache-free forward over packed sequences (training data, taps).

    Each row packs several sequences; a token attends causally to the earlier tokens of its
    own segment only, so every sequence gets exactly the states it would get alone. The
    next-token distribution stays bounded in memory: the final normed states are returned, and
    :func:`score_tokens` (or :func:`lm_head` on a slice) recomputes logits from them chunk by
    chunk instead of materialising [B, T, V].

    Args:
      params, cfg: the target.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE positions, restarting at 0 with every segment.
      segment_ids: [B, T] int32; equal ids share a sequence (padding gets its own id, 0).
      taps: residual-stream layer ids to return (module docstring, **Taps**).
    Returns:
      hidden: [B, T, D] final normed states (the input of :func:`lm_head`).
      tap_states: [B, T, len(taps), D].
    """
    _check_taps(cfg, taps)
    x = embed(params, tokens)
    cos, sin = rope_tables(cfg, positions)
    rule = attn.Intersect((attn.Causal(), attn.Segments(segment_ids, segment_ids)))
    collected = {0: x} if 0 in taps else {}
    for i, p in enumerate(params["layers"]):
        q, k, v = layers.project_qkv(p, cfg, rms_norm(x, p["attn_norm"], cfg.norm_eps), cos, sin)
        x = x + layers.attention_out(
            p, cfg, q, [attn.KeyBlock(layers.kv_rows(k), layers.kv_rows(v), rule)])
        x = x + layers.mlp(p, cfg, x)
        if i + 1 in taps:
            collected[i + 1] = x
    hidden = final_norm(params, cfg, x)
    return hidden, _stack_taps(collected, taps, hidden)


def score_tokens(params: dict, cfg: ModelConfig, hidden: jax.Array, targets: jax.Array,
                 chunk: int = 256, rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scores ``targets`` under the LM head, ``chunk`` positions at a time.

    Only [B, chunk, V] logits exist at once (a 2k-token row of a 49k vocabulary would
    otherwise take 400 MB in float32), and gradients flow through ``hidden``.

    Args:
      hidden: [B, T, D] final normed states (:func:`encode`).
      targets: [B, T] int32 token ids to score (usually the next tokens); with ``rows``,
        indices into them.
      chunk: positions per step; T is padded up to a multiple of it.
      rows: [V', D] head rows of a reduced vocabulary (:func:`head_rows`): the distribution
        is the softmax over those V' logits only (default: the whole head).
    Returns:
      log_probs: [B, T] float32, log p(targets).
      top1: [B, T] bool, whether each target's logit is the largest (any of tied maxima).
    """
    b, t, d = hidden.shape
    pad = -t % chunk
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d).transpose(1, 0, 2, 3)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, -1, chunk).transpose(1, 0, 2)
    head = None if rows is None else rows.T  # [D, V']: several rows multiply [in, out] faster

    def one(args):
        hc, yc = args
        logits = (lm_head(params, cfg, hc) if rows is None  # [B, chunk, V or V']
                  else layers.matmul(hc, head, "...d,dv->...v"))
        picked = jnp.take_along_axis(logits, yc[..., None], axis=-1)[..., 0]  # [B, chunk]
        logp = picked - jax.nn.logsumexp(logits, axis=-1)
        return logp, picked >= jnp.max(logits, axis=-1)

    logp, top1 = jax.lax.map(one, (h, y))  # each [T / chunk, B, chunk]
    unchunk = lambda x: x.transpose(1, 0, 2).reshape(b, -1)[:, :t]  # noqa: E731
    return unchunk(logp), unchunk(top1)


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
