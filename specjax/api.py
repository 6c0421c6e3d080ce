"""Host-side generation API: token lists in, token lists out, one compiled call per request.

This is the layer a user (or the CLI) calls: it pads prompts to a bucketed width so that prompts
of similar length share one executable, sizes the KV cache, validates the request, compiles
ahead of time (so compile time and decode time are reported apart), runs the single jitted
generation call, and strips padding from the result.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decode, harness, sampling
from specjax.config import ModelConfig
from specjax.models import target
from specjax import targets as targets_lib
from specjax.targets import DecoderTarget

PROMPT_BUCKET = 32
CACHE_MULTIPLE = 64


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_prompts(prompts: Sequence[Sequence[int]], bucket: int = PROMPT_BUCKET,
                pad_id: int = 0, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into one array.

    Returns:
      tokens: [B, P] int32 with P = ``width``, or the longest prompt rounded up to ``bucket``.
      lengths: [B] int32 true lengths.
    Raises:
      ValueError: no prompts, an empty prompt, or a prompt longer than ``width``.
    """
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"prompt {int(lengths.argmin())} is empty; every prompt needs a token")
    if width is not None and width < lengths.max():
        raise ValueError(f"prompt {int(lengths.argmax())} has {int(lengths.max())} tokens, more "
                         f"than the padded width {width}")
    width = round_up(int(lengths.max()), bucket) if width is None else width
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def check_tokens(prompts: Sequence[Sequence[int]], vocab_size: int):
    """Raises ValueError for a token id outside ``[0, vocab_size)``."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Generated tokens per row, plus timings and speculative statistics.

    Attributes:
      tokens: per row, the generated ids (a stop token that ended the row included).
      stopped: per row, whether it ended on a stop token.
      compile_s: seconds spent compiling (0 when the executable was cached).
      run_s: seconds of the generation call itself (prefill + decode).
      stats: for speculative decoding, per-row :class:`specjax.decode.SpecStats` as NumPy
        arrays; None for plain decoding.
      peak_bytes: XLA's peak memory estimate of the compiled call (weights, cache and
        temporaries), or None where the backend gives none.
      gate: under a gated cost-aware budget, the draft gate's state after this request
        (:class:`specjax.harness.Gate`): pass it as ``gate`` to the next request of the same
        drafter and budget; else None.
    """

    tokens: list[list[int]]
    stopped: list[bool]
    compile_s: float
    run_s: float
    stats: decode.SpecStats | None = None
    peak_bytes: int | None = None
    gate: object = None

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle over the batch (accepted drafts + the bonus token)."""
        if self.stats is None:
            return 1.0
        cycles = int(self.stats.cycles.sum())
        return (int(self.stats.accepted.sum()) + cycles) / max(cycles, 1)

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


# The executables of recent requests, least recently used first. Each holds its machine code
# (on XLA:CPU hundreds of memory mappings, against a kernel limit of ~65k per process), so a
# long-running process that compiles many configurations, a benchmark sweep, keeps only these.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
COMPILED_MAX = 16


@contextlib.contextmanager
def keeping(n: int):
    """Room for ``n`` more executables beside the cached ones while inside: a benchmark that
    cycles through ``n`` configurations round after round would otherwise compile each of them
    again every round once the cache overflows ``COMPILED_MAX``."""
    global COMPILED_MAX
    before = COMPILED_MAX
    COMPILED_MAX = max(before, len(_COMPILED) + n)
    try:
        yield
    finally:
        COMPILED_MAX = before


def request_limits(max_new_tokens: int | Sequence[int], n: int) -> np.ndarray:
    """[n] int32 token limits from one shared limit or one per request (each >= 1)."""
    if np.ndim(max_new_tokens) and np.size(max_new_tokens) != n:
        raise ValueError(f"{np.size(max_new_tokens)} max_new_tokens for {n} prompts: "
                         "give one, or one per prompt")
    limits = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (n,))
    if limits.min() < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {int(limits.min())}")
    return limits.astype(np.int32)


def _compiled(fn, args: tuple, traced: dict, statics: dict):
    """An ahead-of-time compiled ``fn`` for these argument structures, shapes and dtypes
    (positional ``args``, keyword ``traced``) and statics, and its compile seconds (0 when
    cached).

    At most ``COMPILED_MAX`` recent executables are kept: past that the least recently used
    ones go, down to half of it, and JAX's own caches are cleared (``jax.clear_caches``), whose
    lowerings hold every executable compiled from them; without that an evicted executable's
    code stays mapped for the life of the process. Evicting half at once keeps the clearing
    (every other jitted function then compiles again) to one per ``COMPILED_MAX // 2``
    new executables."""
    key = (fn, jax.tree.structure((args, traced)),
           tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves((args, traced))),
           tuple(sorted(statics.items(), key=lambda kv: kv[0])))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    exe = fn.lower(*args, **traced, **statics).compile()
    _COMPILED[key] = exe
    if len(_COMPILED) > COMPILED_MAX:
        while len(_COMPILED) > max(COMPILED_MAX // 2, 1):
            _COMPILED.popitem(last=False)
        jax.clear_caches()
    return exe, time.perf_counter() - t0


def generate_tokens(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    cache_size: int | None = None,
    drafter=None,
    drafter_params=None,
    prompt_width: int | None = None,
    budget=None,
    new_tokens_width: int | None = None,
    gate=None,
) -> GenerateResult:
    """Plain or speculative generation for a batch of token-id prompts.

    Args:
      cfg, params: the target model.
      prompts: B token-id lists, any lengths >= 1.
      max_new_tokens: at most this many new tokens per row, shared or one per row.
      temperature, top_k, top_p: sampling controls, shared or one per row (temperature 0 =
        greedy).
      seed: PRNG seed; row b's randomness depends only on (seed, b).
      stop_tokens: ids that end a row.
      cache_size: KV slots per row; default: just enough, rounded up to a multiple of 64.
      drafter: a static drafter (:mod:`specjax.drafters`) for speculative decoding; None for
        plain decoding. Greedy rows give the same tokens either way.
      drafter_params: the drafter's params pytree.
      prompt_width: pad the prompts to this width instead of the longest rounded up to
        ``PROMPT_BUCKET``, so that requests of different lengths share one executable (a
        benchmark compiles each configuration once); at least the longest prompt.
      budget: cost-aware speculation (a :class:`specjax.harness.Budget`, e.g.
        ``CostTable.budget()``): each cycle verifies only as many of the drafter's nodes as
        its confidences say pay; None verifies them all.
      new_tokens_width: compile for this many new tokens per row (at least the largest
        ``max_new_tokens``; default that), so that requests with different token limits share
        one executable: the limits are traced, only this width is static.
      gate: the draft gate's state from an earlier request's ``GenerateResult.gate``, for the
        same drafter and a gated budget: the gate goes on from what drafting earned there (a
        drafter that did not pay is not probed again at once) instead of starting afresh.
    Raises:
      ValueError: a bad sampling value, an out-of-vocabulary prompt token, or a request longer
        than the cache (or the model's context).
    """
    if not prompts:
        raise ValueError("no prompts given")
    limits = request_limits(max_new_tokens, len(prompts))
    max_new_tokens = int(limits.max())
    if new_tokens_width is not None and new_tokens_width < max_new_tokens:
        raise ValueError(f"new_tokens_width={new_tokens_width} is below max_new_tokens="
                         f"{max_new_tokens}")
    check_tokens(prompts, cfg.vocab_size)
    tokens, lengths = pad_prompts(prompts, width=prompt_width)
    need = int(lengths.max()) + max_new_tokens
    if need > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {int(lengths.max())} tokens + max_new_tokens="
                         f"{max_new_tokens} exceeds the model's context of "
                         f"{cfg.max_position_embeddings} positions")
    tgt = DecoderTarget(cfg)
    # Scratch past the committed tokens: a verify pass's nodes.
    extra = 0 if drafter is None else drafter.n_nodes
    # The prefill writes the whole padded width, so the cache must hold it too.
    capacity = cache_size or round_up(max(need + extra, tokens.shape[1]), CACHE_MULTIPLE)
    decode.check_capacity(int(lengths.max()), max_new_tokens, capacity, extra)
    if tokens.shape[1] > capacity:
        raise ValueError(f"padded prompt width {tokens.shape[1]} exceeds the cache of {capacity} "
                         "slots; raise cache_size")
    if drafter is not None:
        targets_lib.check_drafter(tgt, drafter)
    sp = sampling.SamplingParams.make(len(prompts), temperature, top_k, top_p)
    statics = dict(target=tgt, max_new_tokens=new_tokens_width or max_new_tokens,
                   capacity=capacity, stop_tokens=tuple(int(t) for t in stop_tokens))
    prompt, prompt_len, rng = jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed)
    traced = dict(limits=jnp.asarray(limits, jnp.int32))
    if drafter is None:
        if budget is not None:
            raise ValueError("a cost-aware budget needs a drafter")
        fn, args = decode.generate, (params, prompt, prompt_len, sp, rng)
    else:
        fn, args = decode.speculative_generate, (params, drafter_params, prompt, prompt_len, sp, rng)
        statics["drafter"] = drafter
        traced["budget"] = budget
        if decode.gated(budget, drafter):
            # Always a Gate, so that a first request and the ones after share one executable.
            traced["gate"] = harness.Gate.start() if gate is None else gate
    if gate is not None and "gate" not in traced:
        raise ValueError("a gate state needs a drafter with a gated cost-aware budget")
    exe, compile_s = _compiled(fn, args, traced, statics)
    t0 = time.perf_counter()
    out = jax.block_until_ready(exe(*args, **traced))
    run_s = time.perf_counter() - t0
    stats = None if drafter is None else jax.device_get(out.stats)
    gate_out = jax.device_get(out.gate) if "gate" in traced else None
    toks, n, stopped = jax.device_get((out.tokens, out.n_generated, out.stopped))
    memory = exe.memory_analysis()
    peak = getattr(memory, "peak_memory_in_bytes", None) if memory is not None else None
    return GenerateResult(tokens=[toks[i, : n[i]].tolist() for i in range(len(prompts))],
                          stopped=[bool(s) for s in stopped], compile_s=compile_s, run_s=run_s,
                          stats=stats, peak_bytes=peak, gate=gate_out)


def divergence(cfg: ModelConfig, params, prompt: Sequence[int], got: Sequence[int],
               want: Sequence[int]) -> tuple[int, float] | None:
    """Where a greedy generation ``got`` parts from the reference ``want`` (plain greedy
    decoding of ``prompt``), and how close the call was there.

    A verify pass over N tokens and N one-token steps accumulate in different orders, so where
    the target's two best next tokens nearly tie the argmax may flip; a divergence anywhere
    else is a bug. Returns None when the two are equal, else ``(k, gap)``: the first differing
    index and the gap between the two largest float32 logits after ``prompt + want[:k]`` (one
    prefill, :func:`specjax.models.target.prefill`; small means a near-tie).
    """
    if list(got) == list(want):
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    seq = jnp.asarray([list(prompt) + list(want[:k])], jnp.int32)
    n = seq.shape[1]
    last, _, _ = jax.jit(target.prefill, static_argnums=(1, 4))(
        params, cfg, seq, jnp.array([n], jnp.int32), n)
    top2 = jnp.sort(last[0].astype(jnp.float32))[-2:]
    return k, float(top2[1] - top2[0])
