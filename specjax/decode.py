"""Generation loops: plain and speculative decoding, each one jitted call per request.

A request is a right-padded batch of prompts ``prompt[B, P]`` with true lengths
``prompt_len[B]``. One jitted call prefills the target, samples the first new token of each
row, then runs a ``lax.while_loop`` of one-token steps until every row has produced its limit
of new tokens (``max_new_tokens``, or a traced per-row ``limits``) or hit a stop token.
Nothing leaves the device until the call returns.

Row independence: a row's tokens depend only on its own prompt, sampling parameters and rng
key (``jax.random.fold_in(rng, row)``), never on padding, the batch size or its position in the
batch, up to floating-point reassociation inside batched matrix products.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import harness, sampling
from specjax import tree as tree_lib
from specjax import verify as verify_lib
from specjax import targets as targets_lib
from specjax.drafters.base import CATCH_UP, Accepted, Context, Prefill, Proposal, chain_parents


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generation:
    """The result of a generation call.

    Attributes:
      tokens: [B, max_new_tokens] int32 generated tokens; entries past ``n_generated`` are
        ``pad_id``. A stop token that ended a row is included.
      n_generated: [B] int32, generated tokens per row (stop token included).
      stopped: [B] bool, whether the row ended on a stop token (else on ``max_new_tokens``).
    """

    tokens: jax.Array
    n_generated: jax.Array
    stopped: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainState:
    """The ``lax.while_loop`` carry of plain decoding.

    Attributes:
      step: scalar int32, tokens generated so far by rows that are still running.
      last: [B] int32, each row's newest token (its K/V is not in the cache yet).
      out: [B, max_new_tokens] int32 output buffer.
      n_generated: [B] int32.
      done: [B] bool, rows that hit a stop token or the token limit.
      stopped: [B] bool, rows that hit a stop token.
      cache: the target's cache (holding prompt + generated - 1 tokens for running rows).
      rng: the base PRNG key; step ``i`` of row ``b`` uses ``fold_in(fold_in(rng, b), i)``.
    """

    step: jax.Array
    last: jax.Array
    out: jax.Array
    n_generated: jax.Array
    done: jax.Array
    stopped: jax.Array
    cache: object
    rng: jax.Array


def row_keys(rng: jax.Array, batch: int, step: jax.Array) -> jax.Array:
    """Per-row keys [B] for one step: independent of the batch composition."""
    return jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(rng, b), step))(
        jnp.arange(batch))


def is_stop(tokens: jax.Array, stop_tokens: tuple[int, ...]) -> jax.Array:
    """Elementwise: whether each token is in the static ``stop_tokens`` set."""
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, tokens.dtype))


@functools.partial(jax.jit, static_argnames=("target", "max_new_tokens", "capacity",
                                             "stop_tokens", "pad_id"))
def generate(
    params: dict,
    prompt: jax.Array,
    prompt_len: jax.Array,
    sp: sampling.SamplingParams,
    rng: jax.Array,
    *,
    target,
    max_new_tokens: int,
    capacity: int,
    stop_tokens: tuple[int, ...] = (),
    pad_id: int = 0,
    limits: jax.Array | None = None,
) -> Generation:
    """Plain autoregressive generation, prefill and decode loop in one jitted call.

    Args:
      params: target params.
      prompt: [B, P] int32 right-padded prompts.
      prompt_len: [B] int32 true prompt lengths.
      sp: per-row sampling parameters (temperature 0 = greedy).
      rng: a PRNG key.
      target: a static target object (:class:`specjax.targets.Target`), e.g.
        ``DecoderTarget(cfg)``; only its required methods are used.
      max_new_tokens: tokens to generate per row at most (static: the output's width).
      capacity: cache slots per row; must be >= P + max(limits) (static; checked by
        :func:`check_capacity`, called by the high-level API).
      stop_tokens: token ids that end a row (static).
      pad_id: filler for the output past each row's end.
      limits: optional [B] int32 per-row token limits in ``[1, max_new_tokens]`` (traced, so
        requests with different limits share one executable); default ``max_new_tokens``.
    Returns:
      A :class:`Generation`.
    """
    b = prompt.shape[0]
    limits = _limits(limits, b, max_new_tokens)
    logits, _, cache = target.prefill(params, prompt, prompt_len, capacity)
    first = sampling.sample_rows(row_keys(rng, b, jnp.int32(0)), logits, sp)
    first_stop = is_stop(first, stop_tokens)
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    state = PlainState(
        step=jnp.int32(1), last=first, out=out, n_generated=jnp.ones((b,), jnp.int32),
        done=first_stop | (limits <= 1), stopped=first_stop, cache=cache, rng=rng)

    def cond(s: PlainState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: PlainState):
        running = ~s.done
        tok, _, cache = plain_step(target, params, s.cache, s.last,
                                   prompt_len + s.n_generated - 1, row_keys(s.rng, b, s.step),
                                   sp, running)
        tok = jnp.where(running, tok, pad_id)
        out = jax.lax.dynamic_update_slice(s.out, tok[:, None], (0, s.step))
        hit = running & is_stop(tok, stop_tokens)
        n_generated = s.n_generated + running
        done = s.done | hit | (n_generated >= limits)
        return PlainState(step=s.step + 1, last=jnp.where(running, tok, s.last), out=out,
                          n_generated=n_generated, done=done, stopped=s.stopped | hit,
                          cache=cache, rng=s.rng)

    state = jax.lax.while_loop(cond, body, state)
    return Generation(tokens=state.out, n_generated=state.n_generated, stopped=state.stopped)


def plain_step(target, params, cache, last: jax.Array, positions: jax.Array, keys: jax.Array,
               sp: sampling.SamplingParams, running: jax.Array, taps: tuple[int, ...] = ()):
    """One plain decoding step of every row: ``(tokens [B] int32, step_taps, cache)``.

    Feeds ``last`` [B] at ``positions`` [B] (each row's committed length), samples each row's
    next token with its key from ``keys`` [B], and commits the fed token's K/V only for
    ``running`` [B] rows: finished rows stop advancing their cache, so they never run past its
    capacity (their sampled token is meaningless). ``step_taps`` is the fed token's
    [B, 1, len(taps), E] target taps at the layers ``taps`` (what a drafter catches up on).
    """
    logits, step_taps, cache = target.forward(params, last[:, None], positions[:, None], cache,
                                              None, taps)
    tok = sampling.sample_rows(keys, logits[:, 0], sp)
    root_path = jnp.zeros((last.shape[0], 1), jnp.int32)
    return tok, step_taps, target.commit(cache, root_path, running.astype(jnp.int32))


def _limits(limits: jax.Array | None, batch: int, max_new_tokens: int) -> jax.Array:
    """[B] int32 per-row token limits, clipped to ``[1, max_new_tokens]``."""
    if limits is None:
        return jnp.full((batch,), max_new_tokens, jnp.int32)
    return jnp.clip(jnp.broadcast_to(jnp.asarray(limits, jnp.int32), (batch,)), 1, max_new_tokens)


def check_capacity(prompt_tokens: int, max_new_tokens: int, capacity: int, extra: int = 0):
    """Raises ValueError when a request cannot fit the cache.

    ``extra`` is the scratch a pass needs past the committed tokens: a verify pass's node
    budget.
    """
    need = prompt_tokens + max_new_tokens + extra
    if need > capacity:
        raise ValueError(
            f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens}"
            + (f" + {extra} scratch slots" if extra else "")
            + f" needs {need} cache slots, but the cache holds {capacity}"
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecStats:
    """Per-row statistics of a speculative generation.

    A gated budget's plain steps (cycles that did not draft) count as one-node verify passes
    that accepted nothing: ``cycles``, ``verified`` and ``accept_hist[:, 0]`` include them, so
    τ from these counts is tokens per target pass of the whole generation, not the drafter's
    acceptance on the cycles it drafted.

    Attributes:
      cycles: [B] int32 verify passes the row took part in (prefill excluded).
      accepted: [B] int32 accepted drafts over all cycles (bonus tokens excluded).
      accept_hist: [B, D + 1] int32; ``accept_hist[b, a]`` counts cycles that accepted exactly
        ``a`` drafts. Acceptance at depth d = cycles with ``a >= d`` / cycles.
      fallbacks: [B] int32 cycles whose proposal was unusable (non-finite draft scores or
        out-of-range tokens) and ran as plain decoding instead.
      verified: [B] int32 nodes of the verify passes the row took part in (the pass widths,
        root included): ``verified / cycles`` is the mean verify budget.
      drafted: [B] int32 cycles in which the drafter drafted (the others, under a cost-aware
        budget's gate, were plain steps).
    """

    cycles: jax.Array
    accepted: jax.Array
    accept_hist: jax.Array
    fallbacks: jax.Array
    verified: jax.Array
    drafted: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """The ``lax.while_loop`` carry of speculative decoding.

    Attributes:
      seq: [B, W] int32 prompt then generated tokens (W = P + max_new_tokens + D + 1, so a
        cycle's full write always fits).
      seq_len: [B] int32; ``seq[b, seq_len - 1]`` is the root of the next cycle.
      n_generated: [B] int32 generated tokens so far (``seq_len - prompt_len``).
      done: [B] bool rows that hit a stop token or ``max_new_tokens``.
      stopped: [B] bool rows that hit a stop token.
      cache: the target's cache, holding ``seq_len - 1`` committed tokens per row (the root is
        not in it).
      dstate: the drafter's state.
      rng: the base PRNG key; cycle c uses ``fold_in(rng, c)``.
      cycle: scalar int32 cycles run.
      stats: :class:`SpecStats`.
      gate: the cost-aware draft gate (:class:`specjax.harness.Gate`), or None.
      catch: the gate's plain steps' taps not yet handed to the drafter
        (:class:`CatchUp`), for a gated run with a drafter that offers ``catch_up``; else
        None.
    """

    seq: jax.Array
    seq_len: jax.Array
    n_generated: jax.Array
    done: jax.Array
    stopped: jax.Array
    cache: object
    dstate: object
    rng: jax.Array
    cycle: jax.Array
    stats: SpecStats
    gate: object = None
    catch: object = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CatchUp:
    """Plain steps a drafter has not seen yet (:data:`specjax.drafters.base.CATCH_UP`).

    Attributes:
      taps: [B, M, n, E] the target's taps of each step's root, in step order.
      n: [B] int32 steps kept per row (< M between steps: M of them are handed over at once).
    """

    taps: jax.Array
    n: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecGeneration(Generation):
    """A :class:`Generation` plus speculative statistics (``stats``: :class:`SpecStats`),
    when asked for (``return_dstate``) the drafter's final state (else None), and under a gated
    budget the draft gate's final state (:class:`specjax.harness.Gate`, else None)."""

    stats: SpecStats = None
    dstate: object = None
    gate: object = None


def gated(budget, drafter) -> bool:
    """Whether :func:`speculative_generate` runs the draft gate for this budget and drafter:
    a gated budget (``Budget.gated``) and a drafter that offers ``skip``."""
    return budget is not None and budget.gated and hasattr(drafter, "skip")


def _usable(proposal: Proposal, vocab_size: int) -> jax.Array:
    """[B] bool: every valid node's token is in range and the draft scores are not NaN/inf+."""
    valid = proposal.node_valid
    ok = jnp.all(~valid | ((proposal.tokens >= 0) & (proposal.tokens < vocab_size)), axis=1)
    if proposal.draft_logits is not None:
        # -inf is a legal score (a masked token); NaN and +inf are not.
        bad = jnp.isnan(proposal.draft_logits) | (proposal.draft_logits == jnp.inf)
        ok &= ~jnp.any(bad & valid[..., None], axis=(1, 2))
    return ok


def _no_proposal(proposal_shape, root: jax.Array) -> Proposal:
    """A proposal of ``proposal_shape``'s structure holding only the root (a plain step):
    chain parents, every other node invalid, zero draft scores, confidence 1 at the root."""
    b, n = proposal_shape.tokens.shape
    only_root = jnp.broadcast_to(jnp.arange(n)[None, :] == 0, (b, n))
    q, conf = proposal_shape.draft_logits, proposal_shape.confidence
    return Proposal(tokens=jnp.zeros((b, n), jnp.int32).at[:, 0].set(root),
                    parents=chain_parents(b, n), node_valid=only_root,
                    draft_logits=None if q is None else jnp.zeros(q.shape, q.dtype),
                    confidence=None if conf is None else only_root.astype(conf.dtype))


def cycle_keys(rng: jax.Array, cycle: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(draft key, verify key)`` of the cycle after ``cycle`` cycles: two independent keys,
    so nothing a drafter draws is ever drawn again by verification."""
    draft_key, verify_key = jax.random.split(jax.random.fold_in(rng, cycle + 1))
    return draft_key, verify_key


def _first_stop(emitted: jax.Array, count: jax.Array, stop_tokens: tuple[int, ...]):
    """Cuts each row's emitted run at its first stop token.

    Returns ``(count [B], hit [B])``: the kept length (the stop token included) and whether a
    stop token was found inside the run.
    """
    slot = jnp.arange(emitted.shape[1])[None, :]
    is_s = is_stop(emitted, stop_tokens) & (slot < count[:, None])  # [B, D + 1]
    hit = jnp.any(is_s, axis=1)
    first = jnp.argmax(is_s, axis=1).astype(jnp.int32)
    return jnp.where(hit, first + 1, count), hit


@functools.partial(jax.jit, static_argnames=("target", "drafter", "max_new_tokens", "capacity",
                                             "stop_tokens", "pad_id", "return_dstate"))
def speculative_generate(
    params: dict,
    drafter_params,
    prompt: jax.Array,
    prompt_len: jax.Array,
    sp: sampling.SamplingParams,
    rng: jax.Array,
    *,
    target,
    drafter,
    max_new_tokens: int,
    capacity: int,
    stop_tokens: tuple[int, ...] = (),
    pad_id: int = 0,
    return_dstate: bool = False,
    budget=None,
    limits: jax.Array | None = None,
    gate=None,
) -> SpecGeneration:
    """Speculative generation: prefill, then a ``lax.while_loop`` of propose -> verify -> commit.

    Each cycle the drafter proposes a tree of ``drafter.n_nodes`` nodes rooted at every row's
    last token; the target scores all of them in one pass (tree mask, positions ``lengths +
    depth``); :func:`specjax.verify.verify` accepts a path and draws a bonus token; the path's
    K/V is compacted into the cache and the accepted tokens plus the bonus are appended. Rows
    finish independently (stop token inside an accepted run, or ``max_new_tokens``, both
    exact). A row whose proposal is unusable falls back to plain decoding for that cycle, and a
    cycle in which no running row has a draft scores only the roots (for targets that offer
    ``forward_fresh``, see :mod:`specjax.targets`).

    Args:
      params: the target's params.
      drafter_params: the drafter's params pytree (None for training-free drafters).
      prompt: [B, P] int32 right-padded prompts.
      prompt_len: [B] int32.
      sp: per-row sampling parameters; temperature-0 rows are greedy and equal plain greedy.
      rng: a PRNG key.
      target: a static target object (:mod:`specjax.targets`), e.g. ``DecoderTarget(cfg)``.
      drafter: a static drafter object (:mod:`specjax.drafters.base`).
      max_new_tokens: tokens per row at most (static: the output's width).
      capacity: target cache slots; >= P + max(limits) + drafter.n_nodes (static).
      stop_tokens: static ids that end a row.
      pad_id: filler past each row's end.
      return_dstate: also return the drafter's final state (static; it may be large, such as
        a drafter's own cache, so it is dropped by default).
      budget: a :class:`specjax.harness.Budget` for cost-aware speculation (its buckets and
        gate are compiled in, its costs traced): each cycle verifies only the first
        ``buckets[k]`` nodes of the proposal (bucket 0: the roots, a plain step), k chosen
        from the running rows' ``confidence`` (scaled by the gate's calibration where gated;
        a probe of the gate never picks bucket 0) by :func:`specjax.harness.best_bucket` (one
        compiled pass per distinct width, under a ``lax.switch``); None verifies every node.
        Needs a target with ``forward_fresh`` and a drafter that reports confidences. A
        gated budget (``Budget.gated``) also decides after each drafted cycle how many plain
        steps to run before drafting again (:class:`specjax.harness.Gate`), for drafters
        that offer ``skip``: an inner ``lax.while_loop`` of plain decoding steps, each
        writing the cache in place as :func:`generate` does, so a run of them costs what
        plain decoding costs; a drafter that offers ``catch_up`` takes those steps
        ``CATCH_UP`` at a time, the others through ``skip`` and ``commit`` after every step.
      limits: optional [B] int32 per-row token limits in ``[1, max_new_tokens]`` (traced);
        default ``max_new_tokens``.
      gate: the draft gate's state to start from (traced): an earlier generation's
        ``SpecGeneration.gate`` for the same drafter and budget, so that a drafter known not
        to pay is not probed again at the start of every request; default
        ``Gate.start()``. Only where :func:`gated` holds.
    Returns:
      A :class:`SpecGeneration`.
    Raises:
      ValueError: ``budget`` with a target or drafter that cannot take it, or ``gate``
        without a gated budget.
    """
    b, p = prompt.shape
    limits = _limits(limits, b, max_new_tokens)
    n, depth_max = drafter.n_nodes, drafter.max_depth
    logits, prefill_taps, cache = target.prefill(params, prompt, prompt_len, capacity,
                                                 drafter.taps)
    first = sampling.sample_rows(row_keys(rng, b, jnp.int32(0)), logits, sp)
    width = p + max_new_tokens + depth_max + 1
    seq = jnp.full((b, width), pad_id, jnp.int32).at[:, :p].set(prompt)
    seq = jax.vmap(lambda s, t, i: s.at[i].set(t))(seq, first, prompt_len)
    first_stop = is_stop(first, stop_tokens)
    dstate = drafter.init(drafter_params,
                          Prefill(prompt, prompt_len, prefill_taps, first, capacity))
    zeros = jnp.zeros((b,), jnp.int32)
    state = SpecState(
        seq=seq, seq_len=prompt_len + 1, n_generated=jnp.ones((b,), jnp.int32),
        done=first_stop | (limits <= 1), stopped=first_stop, cache=cache,
        dstate=dstate, rng=rng, cycle=jnp.int32(0),
        stats=SpecStats(cycles=zeros, accepted=zeros,
                        accept_hist=jnp.zeros((b, depth_max + 1), jnp.int32), fallbacks=zeros,
                        verified=zeros, drafted=zeros))
    fast = targets_lib.fresh_pass(target)
    if budget is not None:
        if fast is None:
            raise ValueError("cost-aware budgets need a target that offers forward_fresh")
        # Bucket k's pass width: its nodes, at least the root, at most the tree.
        widths = tuple(min(max(w, 1), n) for w in budget.buckets)
        distinct = sorted(set(widths))
    is_gated = gated(budget, drafter)
    if gate is not None and not is_gated:
        raise ValueError("a gate state needs a gated budget and a drafter that offers skip")
    if is_gated:
        state = dataclasses.replace(state, gate=harness.Gate.start() if gate is None else gate)
    catching = is_gated and hasattr(drafter, "catch_up")
    if catching:
        state = dataclasses.replace(state, catch=CatchUp(
            jnp.zeros((b, CATCH_UP) + prefill_taps.shape[2:], prefill_taps.dtype), zeros))

    def cond(s: SpecState):
        return ~jnp.all(s.done)

    def gated_step(s: SpecState):
        """One step of a gated run of plain steps (harness.Gate): the target writes the
        root's key/value and samples the next token as plain decoding does, and the drafter
        catches up as after a cycle that accepted nothing (``skip``, then ``commit`` of the
        one-token path)."""
        ctx = Context(s.seq, s.seq_len, sp)
        draft_key, verify_key = cycle_keys(s.rng, s.cycle)
        running = ~s.done
        tok, t_taps, cache = plain_step(target, params, s.cache, ctx.root, s.seq_len - 1,
                                        row_keys(verify_key, b, jnp.int32(0)), sp, running,
                                        drafter.taps)
        hit = running & is_stop(tok, stop_tokens)
        count = running.astype(jnp.int32)
        seq = jax.vmap(lambda row, t, at: row.at[at].set(t))(
            s.seq, jnp.where(running, tok, pad_id), s.seq_len)
        seq_len, n_generated = s.seq_len + count, s.n_generated + count
        dstate, catch = s.dstate, s.catch
        if catching:
            # Keep the root's taps; the drafter takes CATCH_UP steps at once (catch_up).
            taps = jax.vmap(lambda buf, x, at: buf.at[at].set(x))(catch.taps, t_taps[:, 0],
                                                                   catch.n)
            catch = CatchUp(taps, catch.n + count)
        else:
            shape = jax.eval_shape(drafter.propose, drafter_params, s.dstate, ctx, draft_key)[0]
            dstate = drafter.skip(drafter_params, s.dstate, ctx)
            # A one-node path (Accepted allows any width): drafters catch up on one position.
            dstate = drafter.commit(drafter_params, dstate, Context(seq, seq_len, sp), Accepted(
                _no_proposal(shape, ctx.root), jnp.zeros((b, 1), jnp.int32),
                jnp.zeros((b,), jnp.int32), count, t_taps[:, :1]))
        st = s.stats
        stats = dataclasses.replace(
            st, cycles=st.cycles + count,
            verified=st.verified + count,
            accept_hist=st.accept_hist.at[:, 0].add(count))
        s = SpecState(seq=seq, seq_len=seq_len, n_generated=n_generated,
                      done=s.done | hit | (n_generated >= limits), stopped=s.stopped | hit,
                      cache=cache, dstate=dstate, rng=s.rng, cycle=s.cycle + 1,
                      stats=stats, gate=s.gate.update(jnp.float32(0.0), jnp.any(running)),
                      catch=catch)
        return catch_up(s, jnp.any(catch.n >= CATCH_UP)) if catching else s

    def catch_up(s: SpecState, when: jax.Array) -> SpecState:
        """Hands the kept plain steps to the drafter (``catch_up``) if ``when``. Only what the
        drafter reads and writes passes through the conditional, not the target's cache."""
        def take(dstate, catch):
            dstate = drafter.catch_up(drafter_params, dstate, Context(s.seq, s.seq_len, sp),
                                      catch.taps, catch.n)
            return dstate, CatchUp(catch.taps, jnp.zeros_like(catch.n))

        dstate, catch = jax.lax.cond(when, take, lambda d, c: (d, c), s.dstate, s.catch)
        return dataclasses.replace(s, dstate=dstate, catch=catch)

    def plain_run(s: SpecState) -> SpecState:
        """The run of plain steps the gate asks for (none while its ``wait`` is 0)."""
        s = jax.lax.while_loop(lambda s: (s.gate.wait > 0) & ~jnp.all(s.done), gated_step, s)
        if catching:
            # The next cycle drafts from the whole committed sequence.
            s = catch_up(s, jnp.any(s.catch.n > 0))
        return s

    def body(s: SpecState):
        """One drafted cycle, then (gated) the run of plain steps the gate asks for."""
        s = cycle(s)
        return plain_run(s) if is_gated else s

    def cycle(s: SpecState):
        """One drafted cycle: propose, verify (at the budget's bucket), commit."""
        ctx = Context(s.seq, s.seq_len, sp)
        draft_key, verify_key = cycle_keys(s.rng, s.cycle)
        running = ~s.done
        proposal, dstate = drafter.propose(drafter_params, s.dstate, ctx, draft_key)
        usable = _usable(proposal, target.vocab_size)
        # Unusable rows keep only the root: the cycle is one plain decoding step for them.
        only_root = jnp.arange(n)[None, :] == 0
        node_valid = proposal.node_valid & (usable[:, None] | only_root)
        if budget is not None:
            if proposal.confidence is None:
                raise ValueError(f"{type(drafter).__name__} reports no confidence for "
                                 "cost-aware budgets")
            conf = jnp.where(node_valid & running[:, None], proposal.confidence, 0.0)[:, 1:]
            # [B, n_buckets] expected tokens of each bucket, the gate's calibration applied.
            expected = harness.expected_tokens(conf, budget.buckets,
                                               s.gate.calibration if is_gated else 1.0)
            # A probe verifies a drafted bucket: choosing a plain step, it would observe
            # nothing and fail whatever the drafter's acceptance.
            k = harness.best_bucket(expected, budget, running,
                                    s.gate.probing if is_gated else False)
            keep = jnp.asarray([max(w, 1) for w in budget.buckets], jnp.int32)[k]
            node_valid &= jnp.arange(n)[None, :] < keep
        tokens = jnp.where(node_valid, proposal.tokens, 0).at[:, 0].set(ctx.root)
        draft_logits = proposal.draft_logits
        if draft_logits is not None:
            draft_logits = jnp.where(node_valid[..., None], draft_logits, 0.0)
        if drafter.static_tree is not None:
            # A fixed topology: the mask and depths are NumPy constants computed once.
            anc = jnp.broadcast_to(np.asarray(drafter.static_tree.ancestor, bool), (b, n, n))
            depth = jnp.broadcast_to(np.asarray(drafter.static_tree.depth, np.int32), (b, n))
        else:
            anc = tree_lib.ancestor_mask(proposal.parents)  # [B, N, N]
            depth = jnp.sum(anc, axis=-1, dtype=jnp.int32) - 1
        positions = (s.seq_len - 1)[:, None] + depth  # the root sits at committed length

        def check(t_logits, t_taps, width):
            """Verifies the first ``width`` nodes: the result and the path's taps [B, D + 1,
            n, E] (node indices below ``width``, so valid for the whole proposal)."""
            dl = None if draft_logits is None else draft_logits[:, :width]
            res = verify_lib.verify(t_logits, tokens[:, :width], proposal.parents[:, :width],
                                    node_valid[:, :width], sp, verify_key, max_depth=depth_max,
                                    draft_logits=dl)
            return res, jnp.take_along_axis(t_taps, res.path[:, :, None, None], axis=1)

        def fresh_cycle(width):
            """Scores and verifies the first ``width`` nodes without writing the cache; of the
            fresh K/V only the accepted path's [D + 1] entries leave (the same shape at every
            width), like the logits: a narrow pass pays for nothing wider."""
            t_logits, t_taps, fresh = fast.forward_fresh(
                params, tokens[:, :width], positions[:, :width], s.cache,
                anc[:, :width, :width], drafter.taps)
            res, path_taps = check(t_logits, t_taps, width)
            return res, path_taps, fast.take_fresh(fresh, res.path)

        # The fresh passes only read the cache inside the switch or cond; the path's K/V is
        # written once after it (commit_fresh below), ordered after every read. Written
        # inside, or read and written with no data dependence between them, XLA would copy
        # every layer's cache on every cycle.
        width, fresh = jnp.int32(n), None
        if budget is not None:
            pick = jnp.asarray([distinct.index(w) for w in widths], jnp.int32)[k]
            res, path_taps, fresh = jax.lax.switch(
                pick, [functools.partial(fresh_cycle, w) for w in distinct])
            width = jnp.asarray(widths, jnp.int32)[k]
        elif n > 1 and fast is not None:
            # A cycle in which no running row has a draft (prompt lookup found nothing, say)
            # scores just the roots: a plain step's cost instead of an N-node pass.
            any_draft = jnp.any(running[:, None] & node_valid[:, 1:])
            res, path_taps, fresh = jax.lax.cond(any_draft, lambda: fresh_cycle(n),
                                                 lambda: fresh_cycle(1))
            width = jnp.where(any_draft, n, 1)
        else:
            t_logits, t_taps, cache = target.forward(params, tokens, positions, s.cache, anc,
                                                     drafter.taps)
            res, path_taps = check(t_logits, t_taps, n)
        emitted, count = verify_lib.emitted_tokens(res, tokens)  # [B, D + 1], [B]
        count = jnp.minimum(count, limits - s.n_generated)
        count, hit = _first_stop(emitted, count, stop_tokens)
        count = jnp.where(running, count, 0)
        hit &= running
        n_acc = jnp.where(running, res.n_accepted, 0)
        n_keep = jnp.where(running, n_acc + 1, 0)
        cache = (target.commit(cache, res.path, n_keep) if fresh is None
                 else fast.commit_fresh(s.cache, fresh, n_keep))
        seq = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))(
            s.seq, jnp.where(running[:, None], emitted, pad_id), s.seq_len)
        seq_len = s.seq_len + count
        n_generated = s.n_generated + count
        done = s.done | hit | (n_generated >= limits)
        accepted = Accepted(Proposal(tokens, proposal.parents, node_valid, draft_logits),
                            res.path, n_acc, count, path_taps)
        dstate = drafter.commit(drafter_params, dstate, Context(seq, seq_len, sp), accepted)
        st = s.stats
        stats = SpecStats(
            cycles=st.cycles + running,
            accepted=st.accepted + n_acc,
            accept_hist=st.accept_hist + (running[:, None] & (
                jnp.arange(depth_max + 1)[None, :] == n_acc[:, None])),
            fallbacks=st.fallbacks + (running & ~usable),
            verified=st.verified + jnp.where(running, width, 0),
            drafted=st.drafted + running)
        gate = s.gate
        if is_gated:
            # The batch's means over its running rows (the others expect one token, the root):
            # the drafts the raw confidences predicted for the bucket verified, those accepted,
            # and the expected tokens under the calibration that has seen this cycle's
            # acceptance (harness module docstring).
            rows = jnp.maximum(jnp.sum(running), 1)
            raw = harness.expected_tokens(conf, budget.buckets)[:, k]

            def advantage(calibration):
                """The cycle's advantage in plain steps, its drafts priced at ``calibration``."""
                priced = harness.expected_tokens(conf, budget.buckets, calibration)[:, k]
                return budget.advantage(k, 1.0 + jnp.sum(priced - 1.0) / rows)

            gate = gate.after_drafted(jnp.sum(raw - 1.0) / rows, jnp.sum(n_acc) / rows,
                                      advantage, jnp.any(running))
        return SpecState(seq=seq, seq_len=seq_len, n_generated=n_generated, done=done,
                         stopped=s.stopped | hit, cache=cache, dstate=dstate, rng=s.rng,
                         cycle=s.cycle + 1, stats=stats, gate=gate, catch=s.catch)

    if is_gated:
        # A gate carried from an earlier request may be inside a run of plain steps.
        state = plain_run(state)
    state = jax.lax.while_loop(cond, body, state)
    idx = prompt_len[:, None] + jnp.arange(max_new_tokens)[None, :]
    out = jnp.take_along_axis(state.seq, idx, axis=1)
    out = jnp.where(jnp.arange(max_new_tokens)[None, :] < state.n_generated[:, None], out, pad_id)
    return SpecGeneration(tokens=out, n_generated=state.n_generated, stopped=state.stopped,
                          stats=state.stats, dstate=state.dstate if return_dstate else None,
                          gate=state.gate)
