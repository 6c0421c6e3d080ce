"""Measured costs: how long one target pass over N tree nodes takes on this machine, how long a
drafter takes per cycle, and the two as a cost table per budget bucket.

``T_verify(N)`` is the ceiling every drafter lives under: a cycle that emits τ tokens pays one
verify pass of N nodes plus the drafting, against τ plain steps. The curve depends on the
hardware, the dtype and XLA's kernels, so it is measured, never assumed.

Each point is measured inside one jitted loop of passes over a cache already holding
``context`` tokens, each pass fed the previous pass's argmax (so no pass can be hoisted or
skipped), called with ``reps`` and with ``2 * reps`` passes: twice the shorter call's time
less the longer's is what a call pays once, the same at every point (in each round, its
median over the round's points, at most half of any call), and a point's cost per pass is
its longer call's time less that, over ``2 * reps``. That once-per-call part is not small on
XLA:CPU: in bfloat16 it hoists a copy of the embedding table out of the loop
(:func:`specjax.models.target.embed`), which a generation pays once but a short timing loop
would spread over its few passes (one-node bfloat16 passes then measured 32-40 ms against
22 ms per token in decoding).

Each of ``trials`` rounds times every point in turn; the smallest point's cost is the median
of its rounds', and every other point is that times the median over rounds of its cost over
the smallest point's in the same round. A machine whose speed wanders by tens of percent from
second to second moves a round's calls together, so those ratios scatter by a few percent
where a point's own times (or the fastest of each point's calls, timed one point after
another) scatter by tens: the curve's shape is what decides which budget pays.

A drafter's cost table is priced from the decoding loop itself (:func:`measure_loop_costs`):
a verify pass and a ``propose`` call timed alone miss what a cycle adds around them (the
bucket switch, the commit, the drafter's own commit, the loop's carry) and what XLA fuses or
copies differently inside one program, so the gate's comparison of a cycle with a plain step
is made in the units the loop pays. The loop prices the largest bucket and the plain step;
the smaller buckets take their differences from the verify curve (:func:`loop_cost_table`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.config import ModelConfig
from specjax.io import gguf
from specjax.kernels import cpu_gemm
from specjax.models import cache as cache_lib
from specjax.models import target
from specjax.tree import StaticTree

# Part of every cost table's key: raised when the measurement changes, so tables cached by an
# earlier version are measured again.
METHOD_VERSION = 8


@dataclasses.dataclass(frozen=True)
class VerifyCosts:
    """Seconds per target pass, by node count.

    Attributes:
      nodes: the node counts N measured, ascending.
      seconds: seconds per pass for each N.
      dtype: the model dtype measured.
      context: committed tokens in the cache during the passes.
    """

    nodes: tuple[int, ...]
    seconds: tuple[float, ...]
    dtype: str
    context: int

    def at(self, n: int) -> float:
        """Seconds for an N-node pass (linear interpolation between measured points)."""
        return float(np.interp(n, self.nodes, self.seconds))

    @property
    def plain_step(self) -> float:
        """Seconds for a plain decoding step (a one-node pass)."""
        return self.at(1)


@functools.partial(jax.jit, static_argnames=("cfg", "tree"))
def _passes(params, cache, tokens, reps, *, cfg: ModelConfig, tree: StaticTree):
    """``reps`` (traced) verify passes of ``tree`` over ``cache``; returns the last tokens
    [B, N]."""
    b, n = tokens.shape
    mask = jnp.broadcast_to(np.asarray(tree.ancestor, bool), (b, n, n))
    positions = cache.lengths[:, None] + np.asarray(tree.depth, np.int32)[None, :]

    def body(_, toks):
        logits, _, _ = target.forward(params, cfg, toks, positions, cache, mask)
        return sampling.argmax(logits)

    return jax.lax.fori_loop(0, reps, body, tokens)


def measure_verify_costs(
    cfg: ModelConfig,
    params: dict,
    nodes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    context: int = 256,
    batch: int = 1,
    reps: int = 8,
    trials: int = 5,
    progress=None,
) -> VerifyCosts:
    """Measures ``T_verify(N)`` for chains of N nodes (the cost depends on N, not the shape).

    Args:
      cfg, params: the target.
      nodes: node counts to measure.
      context: committed tokens already in the cache.
      batch: rows per pass.
      reps: the extra passes of the longer timed call (module docstring).
      trials: rounds, each timing every point's two calls in turn (module docstring).
      progress: optional callable ``(n, seconds)`` called for each point once all are
        measured.
    """
    nodes = tuple(sorted(set(int(n) for n in nodes)))
    capacity = context + max(nodes)
    cache = cache_lib.init_cache(cfg, batch, capacity)
    prompt = jax.random.randint(jax.random.key(0), (batch, context), 0, cfg.vocab_size)
    _, _, cache = target.forward(params, cfg, prompt, jnp.broadcast_to(jnp.arange(context),
                                                                      (batch, context)), cache)
    cache = cache_lib.advance(cache, jnp.full((batch,), context, jnp.int32))

    def timer(n):
        tokens = jnp.zeros((batch, n), jnp.int32)
        exe = _passes.lower(params, cache, tokens, reps, cfg=cfg,
                            tree=StaticTree.chain(n)).compile()

        def timed(passes):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(params, cache, tokens, passes))
            return time.perf_counter() - t0

        timed(reps)
        return timed

    timers = [timer(n) for n in nodes]
    # [round, point] seconds of each call: each round times every point in turn.
    short, long = np.zeros((trials, len(nodes))), np.zeros((trials, len(nodes)))
    for r in range(trials):
        for i, timed in enumerate(timers):
            short[r, i], long[r, i] = timed(reps), timed(2 * reps)
    seconds = pass_costs(short, long, reps)
    for n, sec in zip(nodes, seconds):
        if progress is not None:
            progress(n, sec)
    return VerifyCosts(nodes, seconds, cfg.dtype, context)


def pass_costs(short: np.ndarray, long: np.ndarray, reps: int) -> tuple[float, ...]:
    """Seconds per pass of each point from rounds of timed calls (module docstring).

    Args:
      short, long: [rounds, points] seconds of the calls of ``reps`` and ``2 * reps`` passes,
        each round timing every point in turn.
    Returns:
      One cost per point: the first point's median per-pass time, the others that times their
      median ratio to the first within a round.
    """
    # short = once + reps passes, long = once + 2 reps passes; what a call pays once is the
    # same at every point: each round's is the median over its points, at most half of any
    # of its calls (a slow round is slow in that part too).
    once = np.clip(np.median(2 * short - long, axis=1, keepdims=True), 0.0,
                   0.5 * long.min(axis=1, keepdims=True))
    per_pass = (long - once) / (2 * reps)
    ratios = np.median(per_pass / per_pass[:, :1], axis=0)
    return tuple(float(np.median(per_pass[:, 0]) * q) for q in ratios)


def measure_draft_cost(cfg: ModelConfig, params: dict, drafter, dparams,
                       prompts: Sequence[Sequence[int]], cache_size: int, temperature: float = 0.0,
                       repeats: int = 20, width: int | None = None) -> float:
    """Seconds of one ``propose`` call (jitted alone, weights as arguments) after a prefill of
    ``prompts``: the drafter's cost per cycle, the fastest of ``repeats``.

    Args:
      prompts: B token-id lists (padded to ``width``, default their bucketed longest).
      cache_size: KV slots per row, as a generation would use.
    """
    from specjax import api
    from specjax.drafters.base import Context, Prefill
    from specjax.targets import DecoderTarget

    tokens, lengths = api.pad_prompts(prompts, width=width)
    prompt, plen = jnp.asarray(tokens), jnp.asarray(lengths)
    b = prompt.shape[0]
    tgt = DecoderTarget(cfg)
    sp = sampling.SamplingParams.make(b, temperature, 0, 1.0)

    @jax.jit
    def setup(params, dparams, prompt, plen):
        logits, taps, _ = tgt.prefill(params, prompt, plen, cache_size, drafter.taps)
        first = sampling.argmax(logits)
        state = drafter.init(dparams, Prefill(prompt, plen, taps, first, cache_size))
        seq = jnp.concatenate([prompt, jnp.zeros((b, 1), jnp.int32)], axis=1)
        return state, seq.at[jnp.arange(b), plen].set(first)

    state, seq = setup(params, dparams, prompt, plen)
    propose = jax.jit(lambda dparams, st, seq, key: drafter.propose(
        dparams, st, Context(seq, plen + 1, sp), key)[0])
    key = jax.random.key(0)
    jax.block_until_ready(propose(dparams, state, seq, key))
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(propose(dparams, state, seq, key))
        best = min(best, time.perf_counter() - t0)
    return float(best)


def forced_budget(buckets: Sequence[int], k: int, gated: bool):
    """A :class:`specjax.harness.Budget` over ``buckets`` under which every cycle verifies
    bucket ``k``: that bucket priced at 1 s, the others at 1e9 s. ``gated``: a gated budget
    whose plain step is priced so high that every drafted cycle gains, so the gate never shuts
    on its own (the same compiled loop as any gated budget over these buckets)."""
    from specjax import harness

    cycle = tuple(1.0 if i == k else 1e9 for i in range(len(buckets)))
    return harness.Budget(tuple(buckets), cycle, 1e9 if gated else None, 1e9 if gated else 0.0)


def shut_gate():
    """A draft gate (:class:`specjax.harness.Gate`) held shut: every step of a generation that
    starts from it is a plain step, never a probe."""
    from specjax import harness

    return dataclasses.replace(harness.Gate.start(), advantage=jnp.float32(-1.0),
                               wait=jnp.int32(1 << 30), skip=jnp.int32(harness.GATE_MAX_SKIP))


def measure_loop_costs(cfg: ModelConfig, params: dict, drafter, dparams,
                       buckets: Sequence[int], *, timed: Sequence[int] | None = None,
                       batch: int = 1, context: int = 256, tokens: int = 32, trials: int = 5,
                       gated: bool | None = None, progress=None):
    """Seconds of a drafted cycle at budget buckets and of the plain step that replaces a
    cycle while the draft gate is shut, timed inside the decoding loop itself.

    One loop is compiled with all ``buckets``, gated as the cost-aware generation's will be
    (``gated``), so that the program timed is the one it runs. The budget's costs are traced: a
    bucket is forced by pricing it at 1 s and the others at 1e9 s, with a plain step priced so
    high that the gate never shuts. A generation of ``tokens`` and one of ``2 * tokens`` new
    tokens, run back to back (greedy, no stop tokens, from the same random prompts of
    ``context - tokens`` tokens, so the longer run sits at ``context`` halfway; fewer where
    the model's context ends sooner), give the cost of a cycle as the difference of their
    times over the difference of their cycle counts, free of what a call pays once. Each of
    ``trials`` rounds times every bucket's pair and the plain step's in turn, and a cost is
    the median of its rounds' (on a machine whose speed wanders by tens of percent from call
    to call, a pair of runs seconds apart and the median over rounds scatter less than the
    fastest runs of each length taken from different rounds). A cycle over more nodes never
    costs less than one over fewer; where the medians say otherwise, the costs out of order
    are pooled into their mean (isotonic regression). The plain step is timed the same way
    with the gate held shut (the gate's plain steps and the drafter's catch-up), or for a
    drafter that cannot skip, as plain decoding.

    Args:
      cfg, params: the target.
      drafter, dparams: the drafter at its full size (``n_nodes`` at least the largest bucket).
      buckets: the budgets N (verify nodes, root included) the loop is compiled with.
      timed: the buckets to time (default every bucket but 0, whose cost is a plain step's
        plus the drafting).
      batch, context: rows and committed tokens, as the generation will run.
      tokens, trials: the shorter run's new tokens and the rounds.
      gated: whether the generation's budget will be gated (:attr:`specjax.harness.Budget.
        gated`; :func:`loop_cost_table` knows from the drafting's cost); default: wherever
        the drafter can skip. A drafter that cannot is never timed gated.
      progress: optional callable ``(stage, n, seconds)`` for each measurement once all are
        done (stage ``"cycle"`` with each timed bucket, then ``"step"`` with 0).
    Returns:
      ``(cycle_s, step_s)``: ``{N: seconds per cycle}`` for each timed bucket, and seconds per
      plain step.
    """
    from specjax import api

    buckets = tuple(int(n) for n in buckets)
    timed = tuple(n for n in buckets if n) if timed is None else tuple(int(n) for n in timed)
    report = progress or (lambda *a: None)
    rng = np.random.default_rng(0)
    # Within the model's context, where the table's context is at its limit.
    width = max(min(context - tokens, cfg.max_position_embeddings - 2 * tokens), 1)
    prompts = rng.integers(0, cfg.vocab_size, (batch, width)).tolist()
    common = dict(prompt_width=width, new_tokens_width=2 * tokens,
                  cache_size=api.round_up(width + 2 * tokens + drafter.n_nodes + 1,
                                          api.CACHE_MULTIPLE))
    can_gate = hasattr(drafter, "skip") and (gated is None or gated)

    def drafted_at(k):
        budget = forced_budget(buckets, k, can_gate)

        def run(m):
            r = api.generate_tokens(cfg, params, prompts, max_new_tokens=m, drafter=drafter,
                                    drafter_params=dparams, budget=budget, **common)
            return r.run_s, int(r.stats.cycles.max())
        return run

    if can_gate:
        def plain(m):
            r = api.generate_tokens(cfg, params, prompts, max_new_tokens=m, drafter=drafter,
                                    drafter_params=dparams,
                                    budget=forced_budget(buckets, 0, True), gate=shut_gate(),
                                    **common)
            return r.run_s, m
    else:
        def plain(m):
            return api.generate_tokens(cfg, params, prompts, max_new_tokens=m, **common).run_s, m

    runs = [("cycle", n, drafted_at(buckets.index(n))) for n in timed] + [("step", 0, plain)]
    for _, _, run in runs:
        run(tokens)  # compiles or warms the executable
    # [run] -> seconds per unit of each round, from that round's pair of runs.
    rounds = [[] for _ in runs]
    for _ in range(trials):
        for i, (_, _, run) in enumerate(runs):
            (t1, u1), (t2, u2) = run(tokens), run(2 * tokens)
            # Where timing noise makes the longer run no slower, its mean per unit stands in.
            rounds[i].append((t2 - t1) / (u2 - u1) if t2 > t1 and u2 > u1 else t2 / u2)
    seconds = {n: float(np.median(r)) for (_, n, _), r in zip(runs, rounds)}
    step_s = seconds.pop(0)
    cycle_s = dict(zip(sorted(seconds), monotone([seconds[n] for n in sorted(seconds)])))
    for stage, n, _ in runs:
        report(stage, n, cycle_s[n] if n else step_s)
    return cycle_s, step_s


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in squared error (pool adjacent
    violators: every run of values out of order is replaced by its mean)."""
    blocks = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


def loop_cost_table(cfg: ModelConfig, params: dict, drafter, dparams, buckets: Sequence[int],
                    *, batch: int, context: int, key: dict, progress=None, tokens: int = 32,
                    trials: int = 5, verify_curve=None):
    """A :class:`specjax.harness.CostTable` for ``drafter`` verified at ``buckets``, priced in
    the decoding loop: the level from the loop, the differences between buckets from the
    verify curve.

    The draft cost is one ``propose`` call timed alone (:func:`measure_draft_cost`, what
    deciding to draft at all is about). The largest bucket's cycle and the plain step are
    timed in the loop (:func:`measure_loop_costs`, gated as the budget will be,
    :func:`specjax.harness.drafting_gated` against the verify curve's one-node pass); a
    smaller bucket's cycle is that cycle scaled by ``(T_verify(N) + draft) / (T_verify(N_max)
    + draft)``, the verify passes timed in tight loops of passes, every point in each round
    (:func:`measure_verify_costs`).
    Which bucket pays turns on cycles that differ by a few percent, less than the loop's own
    timings scatter between rounds on a busy machine; the verify curve measures those
    differences, the loop what a cycle costs in all. The verify cost of a bucket is the rest
    of its cycle; bucket 0's is the plain step.

    Args:
      key: the table's full key (:meth:`specjax.harness.CostTable.matches`).
      progress: optional callable ``(stage, n, seconds)`` after each measurement (``"draft"``,
        ``"verify"`` for each node count, then :func:`measure_loop_costs`'s).
      tokens, trials: the loop timing's (:func:`measure_loop_costs`).
      verify_curve: optional callable returning a verify curve (:class:`VerifyCosts`)
        measured at this ``batch`` and ``context`` whose points include every drafted bucket
        (a sweep measures one for all its tables and its time split); default: one measured
        here.
    Raises:
      ValueError: ``verify_curve`` gave a curve at another context or without a bucket.
    """
    from specjax import harness

    report = progress or (lambda *a: None)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch, context)).tolist()
    slots = -(-(context + 2 * drafter.n_nodes + 2) // 64) * 64  # room for a cycle
    draft = measure_draft_cost(cfg, params, drafter, dparams, prompts, slots, width=context)
    report("draft", drafter.n_nodes, draft)
    drafted = [n for n in buckets if n]
    if verify_curve is None:
        curve = measure_verify_costs(cfg, params, drafted, context=context, batch=batch,
                                     progress=lambda n, sec: report("verify", n, sec))
    else:
        curve = verify_curve()
        missing = sorted(set(drafted) - set(curve.nodes))
        if curve.context != context or missing:
            raise ValueError(f"the verify curve given (context {curve.context}, nodes "
                             f"{list(curve.nodes)}) does not price this table's buckets "
                             f"{drafted} at context {context}")
        for n in drafted:
            report("verify", n, curve.at(n))
    largest = drafted[-1]
    gated = harness.drafting_gated(draft, curve.plain_step)  # as the table's budget will be
    cycles, step = measure_loop_costs(cfg, params, drafter, dparams, buckets, timed=(largest,),
                                      batch=batch, context=context, tokens=tokens,
                                      trials=trials, gated=gated, progress=report)
    # More nodes never cost less: a curve out of order is pooled (isotonic) first.
    shape = dict(zip(drafted, monotone([curve.at(n) + draft for n in drafted])))
    scaled = {n: cycles[largest] * shape[n] / shape[largest] for n in drafted}
    # A cycle is never cheaper than its drafting: where noise says so, the drafting is its
    # whole cost but a sliver.
    verify = tuple(step if n == 0 else max(scaled[n] - draft, 1e-3 * scaled[n])
                   for n in buckets)
    return harness.CostTable(tuple(buckets), verify,
                             tuple(0.0 if n == 0 else draft for n in buckets), key)


def loop_table_points(buckets: Sequence[int]) -> int:
    """How many measurements :func:`loop_cost_table` reports through ``progress`` (the
    drafting, the verify curve's points, the largest cycle and the plain step)."""
    return sum(1 for n in buckets if n) + 3


def measure_cost_table(cfg: ModelConfig, params: dict, buckets: Sequence[int], *,
                       batch: int = 1, context: int = 256, key: dict | None = None,
                       progress=None):
    """A :class:`specjax.harness.CostTable` of the verify passes alone, measured on this
    machine (:func:`measure_verify_costs`; no draft cost). A drafter's table, priced in the
    decoding loop, is :func:`drafter_cost_table`'s.

    Args:
      buckets: budgets N (0 = a plain step).
      batch, context: rows per pass and committed tokens, as the generation will run.
      key: what the table is for (model, method, ...); the machine (:func:`machine_key`),
        dtype, batch, context and method version are added.
      progress: optional callable ``(stage, n, seconds)`` after each measurement.
    """
    from specjax import harness

    buckets = tuple(sorted(set(int(n) for n in buckets)))
    full_key = dict(key or {}, **machine_key(), dtype=cfg.dtype, batch=batch, context=context,
                    method_version=METHOD_VERSION)
    report = progress or (lambda *a: None)
    costs = measure_verify_costs(cfg, params, sorted({1, *(n for n in buckets if n)}),
                                 context=context, batch=batch,
                                 progress=lambda n, s: report("verify", n, s))
    return harness.CostTable(buckets, tuple(costs.plain_step if n == 0 else costs.at(n)
                                            for n in buckets), (0.0,) * len(buckets), full_key)


def budget_buckets(n_nodes: int) -> tuple[int, ...]:
    """The buckets a drafter of ``n_nodes`` nodes is verified at under a cost-aware budget:
    a plain step, the powers of two below ``n_nodes`` from 2, and the whole proposal."""
    return (0,) + tuple(n for n in (2, 4, 8, 16, 32, 64) if n < n_nodes) + (n_nodes,)


def cost_context(prompt_tokens: int, max_new_tokens: int) -> int:
    """The context a generation's cost table is measured at: its mid-generation length rounded
    up to a power of two (at least 256), so nearby requests share one table."""
    need = prompt_tokens + max_new_tokens // 2
    return max(256, 1 << (need - 1).bit_length())


def machine_key() -> dict:
    """What a measured cost depends on beyond the model and its options: the device kind, and
    whether the CPU kernel multiplies a pass's few rows (:mod:`specjax.kernels.cpu_gemm`;
    ``SPECJAX_CPU_GEMM=0`` turns it off)."""
    return dict(device=jax.devices()[0].device_kind, cpu_gemm=cpu_gemm.available())


def drafter_table_key(cfg: ModelConfig, drafter, *, batch: int, context: int,
                      key: dict) -> dict:
    """The full key of ``drafter``'s cost table (:func:`drafter_cost_table`): ``key`` (the
    model name, method and drafter shape) with the machine (:func:`machine_key`), dtype,
    batch, context, buckets and method version added. The temperature is not part of it: the
    table is measured greedy and prices sampled cycles too, whose acceptance sampling it leaves
    out."""
    return dict(key, **machine_key(), dtype=cfg.dtype, batch=batch, context=context,
                buckets=list(budget_buckets(drafter.n_nodes)), method_version=METHOD_VERSION)


def drafter_cost_table(cfg: ModelConfig, params: dict, drafter, dparams, *, batch: int,
                       context: int, key: dict, path: Path | None = None, progress=None,
                       reuse: bool = True, replacing=None, verify_curve=None):
    """The cost table of ``drafter`` as it stands (sized once; the loop verifies the first
    ``budget_buckets(drafter.n_nodes)`` of its nodes), read from ``path`` when that file was
    measured for the same key, else measured and written there.

    Args:
      key: what the table is for beyond the machine (model name, method and drafter shape);
        the rest is added (:func:`drafter_table_key`).
      path: the JSON file (default: ``costs/`` under specjax's cache root,
        :func:`specjax.io.gguf.cache_dir`, named by the key's hash).
      progress: optional callable ``(stage, n, seconds)`` after each measurement
        (:func:`loop_cost_table`); with a table read from disk it is never called.
      reuse: False measures even where ``path`` holds a table for the same key.
      replacing: optional callable ``(why)`` before a file at ``path`` that holds no table for
        this key is measured again: ``why`` names the differing key entries (``"batch 1, not
        4"``), or says the file is not a cost table.
      verify_curve: passed to :func:`loop_cost_table` (called only when the table is
        measured).
    Returns:
      ``(table, measured)``: a :class:`specjax.harness.CostTable` and whether it was measured
      now.
    """
    from specjax import harness

    buckets = budget_buckets(drafter.n_nodes)
    full_key = drafter_table_key(cfg, drafter, batch=batch, context=context, key=key)
    path = path or _cache_file(full_key)
    if path.exists() and reuse:
        try:
            table = harness.CostTable.from_json(path.read_text())
        except ValueError as e:
            why = str(e)
        else:
            differ = table.mismatch(full_key)
            if not differ:
                return table, False
            why = "; ".join(f"{k} {have!r}, not {need!r}" for k, (have, need) in differ.items())
        if replacing is not None:
            replacing(why)
    table = loop_cost_table(cfg, params, drafter, dparams, buckets, batch=batch,
                            context=context, key=full_key, progress=progress,
                            verify_curve=verify_curve)
    _write(path, table.to_json())
    return table, True


def _cache_file(full_key: dict) -> Path:
    """The JSON file of a measurement keyed ``full_key``: ``costs/`` under specjax's cache
    root (:func:`specjax.io.gguf.cache_dir`), named by the key's hash."""
    digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:16]
    return gguf.cache_dir() / "costs" / f"{digest}.json"


def _write(path: Path, text: str):
    """Writes ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def cached_verify_costs(cfg: ModelConfig, params: dict, nodes: Sequence[int], *, batch: int,
                        context: int, key: dict, progress=None) -> tuple[VerifyCosts, bool]:
    """:func:`measure_verify_costs`'s curve at ``nodes``, read from the cost cache where one
    was measured for the same key, else measured and kept there (beside the cost tables,
    :func:`drafter_cost_table`).

    Args:
      key: what the curve is for beyond the machine (the model's name); the machine
        (:func:`machine_key`), dtype, batch, context, nodes and method version are added.
      progress: passed to :func:`measure_verify_costs` (never called for a curve read back).
    Returns:
      ``(curve, measured)``: the :class:`VerifyCosts` and whether it was measured now.
    """
    nodes = sorted(set(int(n) for n in nodes))
    full_key = dict(key, measurement="verify curve", **machine_key(), dtype=cfg.dtype,
                    batch=batch, context=context, nodes=nodes, method_version=METHOD_VERSION)
    path = _cache_file(full_key)
    try:
        raw = json.loads(path.read_text())
        if raw["key"] == full_key:
            return VerifyCosts(tuple(raw["nodes"]), tuple(raw["seconds"]), raw["dtype"],
                               raw["context"]), False
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass  # absent, or not a curve: measured again
    curve = measure_verify_costs(cfg, params, nodes, context=context, batch=batch,
                                 progress=progress)
    _write(path, json.dumps(dict(dataclasses.asdict(curve), key=full_key), indent=1))
    return curve, True
