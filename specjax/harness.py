"""The cost model of cost-aware speculation: calibrated cycle costs per budget bucket, the
expected tokens a budget buys, the bucket that buys the most tokens per second, and the gate
that stops drafting while drafting does not pay.

A speculative cycle of budget N (tree nodes verified, root included) costs one verify pass
``T_verify(N)`` plus the drafter's own time ``T_draft(N)``, and emits ``1 + E[accepted]``
tokens. Budget 0 is a plain step: one token for ``T_step``, no drafting. Given an estimate of
how likely each drafted node is to be accepted, the best bucket is

    argmax_k  tokens(N_k) / (T_verify(N_k) + T_draft(N_k)).

**Acceptance estimates.** The drafter reports ``path_probs`` [B, M]: for its M best nodes
(root excluded) in best-first order, the probability that the node and all its ancestors are
accepted (a chain: the running product of per-position acceptance probabilities; a tree
drafted best-first: each node's path confidence). The expected accepted count of a budget N
(its first N - 1 nodes) is the sum of those probabilities, since the accepted length is the
sum of the indicator "this node's path is accepted" over nodes; best-first order makes the
first N - 1 nodes the best such set. One verify pass serves the whole batch, so the bucket
is chosen per batch from the running rows' summed expected tokens.

**Calibration.** A drafter's confidences are its own estimates: a small drafter trained on
little data is under- or overconfident by tens of percent, differently by prompt, and at T > 0
a draft's confidence is not the probability verification accepts it with. Where the loop gates
(below), it keeps decayed sums (weight ``CAL_DECAY`` per drafted cycle) of the accepted drafts
and of the drafts the raw confidences predicted for the bucket verified, and scales every
path probability by their ratio (``Gate.calibration``, from ``CAL_PRIOR`` drafts of each and
clipped to ``[1 / CAL_CLIP, CAL_CLIP]``; each scaled probability at most 1) before choosing.

**Whether to draft at all.** In the loop the bucket is chosen after drafting, so a cycle's
draft time is paid whatever the choice: every bucket carries it, and a cycle that picks bucket 0
costs a plain step plus the drafting. Where drafting costs something (``Budget.gated``), a gate
decides before each cycle whether to draft, from what drafting has earned so far: the advantage
of a drafted cycle, in plain steps, is

    a = (expected tokens of bucket k, the batch's mean) - cycle_s[k] / step_s,

from the calibrated confidences (a cycle's accepted count is 0 or a few, so at batch 1 its
advantage swings by a plain step or more from cycle to cycle around a mean a small fraction of
that: a gate fed the realized counts closes on a streak of rejections where drafting pays; the
realized counts enter through the calibration, over many cycles, the cycle's own among them).
Its running mean (an exponential average, weight ``GATE_ALPHA``) is kept, and while it is not
positive the loop runs plain steps without drafting (an inner loop of plain decoding steps that
write the cache in place, as fast as plain decoding's; the drafter catches up through its
``catch_up``, the target's taps of up to ``CATCH_UP`` steps at once, or else through ``skip``
and ``commit`` after every step). A run of plain steps ends in a probe, one drafted cycle whose
advantage replaces the average; a successful probe resumes drafting. Every drafted cycle's
advantage, a probe's included, is priced with the calibration after that cycle's own acceptance
is observed (:meth:`Gate.after_drafted`): what a probe accepted counts toward its own verdict,
though after a long streak of rejections one accepted probe moves the decayed sums only part of
the way. A probe verifies the best drafted bucket (never bucket 0, which would observe nothing
and always fail), so a calibration that a streak of rejections pushed low meets the drafter's
acceptance again. A failure that loses ``-a`` plain steps starts a run long enough that the loss
is at most ``GATE_PROBE_SHARE`` of it (``-a / GATE_PROBE_SHARE`` steps) and at least twice the
previous run, up to ``GATE_MAX_SKIP`` steps: a drafter that never pays costs its probes' losses
over runs of up to ``GATE_MAX_SKIP`` steps (a few percent when a probe loses a few plain steps,
more when it loses more than ``GATE_PROBE_SHARE * GATE_MAX_SKIP``), and one that nearly breaks
even is probed often. The gate's state (calibration included) is returned with the generation
and may start the next request (``gate=``), which then finishes the run of plain steps it is in
before drafting again. A drafter whose draft time is negligible (under ``GATE_MIN_DRAFT`` of a
plain step: prompt lookup) is never gated, so a match is never missed.

Costs are measured (``specjax calibrate``) into a :class:`CostTable` JSON, reused while the
machine, model, dtype, batch, context, drafter and measuring method stay the same; its
:meth:`CostTable.budget` is what ``decode.speculative_generate(budget=...)`` takes. The loop
compiles once per bucket set and gate; the costs are traced, so another cost table reuses the
compiled loop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds of one cycle per budget bucket, on one machine for one model.

    Attributes:
      buckets: budgets N (verify nodes, root included), ascending; 0 = a plain step.
      verify_s: seconds of the verify pass of each bucket (bucket 0: the plain step).
      draft_s: seconds of drafting at each bucket (0 for bucket 0).
      key: what the costs were measured for (device kind, model, dtype, batch, context,
        method version; with a drafter its method, shape and buckets); a table is reused only
        where it matches.
    """

    buckets: tuple[int, ...]
    verify_s: tuple[float, ...]
    draft_s: tuple[float, ...]
    key: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = len(self.buckets)
        if not n or len(self.verify_s) != n or len(self.draft_s) != n:
            raise ValueError(f"{len(self.buckets)} buckets, {len(self.verify_s)} verify costs and "
                             f"{len(self.draft_s)} draft costs: one of each per bucket")
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 0:
            raise ValueError(f"buckets {list(self.buckets)} must be distinct, ascending, >= 0")
        if min(self.verify_s) <= 0 or min(self.draft_s) < 0:
            raise ValueError("verify costs must be positive and draft costs non-negative")

    @property
    def cycle_s(self) -> np.ndarray:
        """[n_buckets] seconds of a whole cycle of each bucket."""
        return np.asarray(self.verify_s) + np.asarray(self.draft_s)

    def budget(self) -> Budget:
        """What the decoding loop compiles in: the buckets and their cycle costs as the loop
        pays them. The loop's drafter drafts its whole proposal before the bucket is chosen,
        so every bucket (a plain step's included) carries the largest bucket's draft time; a
        table with a plain-step bucket also gives the gate its step and draft times."""
        sunk = float(self.draft_s[-1])
        step = float(self.verify_s[0]) if self.buckets[0] == 0 else None
        return Budget(self.buckets, tuple(float(v) + sunk for v in self.verify_s), step, sunk)

    def matches(self, key: dict) -> bool:
        """Whether this table was measured for ``key`` (every entry equal)."""
        return not self.mismatch(key)

    def mismatch(self, key: dict) -> dict:
        """``{entry: (this table's value, key's value)}`` for each entry of ``key`` that this
        table was measured otherwise for (absent entries: None)."""
        return {k: (self.key.get(k), v) for k, v in key.items() if self.key.get(k) != v}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        try:
            raw = json.loads(text)
            return cls(tuple(raw["buckets"]), tuple(raw["verify_s"]), tuple(raw["draft_s"]),
                       dict(raw.get("key", {})))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"not a cost table ({type(e).__name__}: {e})") from None


@dataclasses.dataclass(frozen=True)
class Budget:
    """Cost-aware budgets as the decoding loop takes them: each cycle it verifies the first
    ``buckets[k]`` nodes of the proposal (bucket 0: the root alone, a plain step) for the k
    that :func:`best_bucket` picks from the running rows' expected tokens (the proposal's
    confidences, scaled by the gate's calibration).

    A pytree: the buckets and ``gated`` are its structure (what the loop compiles in), the
    costs its leaves (traced), so budgets that differ only in their costs share one compiled
    loop.

    Attributes:
      buckets: budgets N, ascending (0 = a plain step).
      cycle_s: seconds of a cycle of each bucket (verify plus draft).
      step_s: seconds of a plain step without drafting; None: no gate (every cycle drafts).
      draft_s: seconds of drafting, what a gated plain step saves.
      gated: whether the loop decides before each cycle whether to draft (module docstring):
        there is a plain step to compare with and drafting costs more than ``GATE_MIN_DRAFT``
        of it. Set from the costs when the budget is made.
    """

    buckets: tuple[int, ...]
    cycle_s: tuple[float, ...]
    step_s: float | None = None
    draft_s: float = 0.0
    gated: bool = dataclasses.field(init=False)

    def __post_init__(self):
        if len(self.buckets) != len(self.cycle_s) or not self.buckets:
            raise ValueError(f"{len(self.buckets)} buckets and {len(self.cycle_s)} cycle costs: "
                             "one per bucket")
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 0:
            raise ValueError(f"buckets {list(self.buckets)} must be distinct, ascending, >= 0")
        if min(self.cycle_s) <= 0 or (self.step_s is not None and self.step_s <= 0):
            raise ValueError("cycle costs must be positive")
        object.__setattr__(self, "gated", bool(
            self.step_s is not None and drafting_gated(self.draft_s, self.step_s)))

    def advantage(self, k: jax.Array, tokens: jax.Array) -> jax.Array:
        """Plain steps a drafted cycle of bucket ``k`` gains: ``tokens - cycle_s[k] /
        step_s`` (``tokens``: the cycle's expected tokens, the batch's mean)."""
        return tokens - jnp.asarray(self.cycle_s, jnp.float32)[k] / self.step_s


def _budget_leaves(b: Budget):
    return (b.cycle_s, b.step_s, b.draft_s), (b.buckets, b.gated)


def _budget_from_leaves(structure, leaves) -> Budget:
    # Not through __init__: inside a trace the leaves are tracers, which the checks (already
    # passed when the budget was made) and ``gated`` (part of the structure) cannot read.
    b = object.__new__(Budget)
    for name, value in zip(("buckets", "gated", "cycle_s", "step_s", "draft_s"),
                           (*structure, *leaves)):
        object.__setattr__(b, name, value)
    return b


jax.tree_util.register_pytree_node(Budget, _budget_leaves, _budget_from_leaves)

GATE_ALPHA = 0.3  # weight of the newest drafted cycle in the running advantage
GATE_PROBE_SHARE = 0.02  # a failed probe's loss at most this share of the plain run after it
GATE_MAX_SKIP = 256  # the longest run of plain steps between probes
GATE_MIN_DRAFT = 0.05  # draft time, as a fraction of a plain step, below which no gate
CAL_DECAY = 0.95  # weight of the older drafted cycles in the calibration's sums, per cycle
CAL_PRIOR = 4.0  # drafts accepted and predicted before the first cycle (calibration 1)
CAL_CLIP = 4.0  # the calibration stays within [1 / CAL_CLIP, CAL_CLIP]


def drafting_gated(draft_s: float, step_s: float) -> bool:
    """Whether a budget gates drafting that costs ``draft_s`` seconds against a plain step of
    ``step_s`` (module docstring): where it costs more than ``GATE_MIN_DRAFT`` of the step."""
    return draft_s > GATE_MIN_DRAFT * step_s


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gate:
    """The draft gate's carry in the decoding loop (scalars; module docstring).

    Attributes:
      advantage: float32, running advantage of drafted cycles, in plain steps.
      wait: int32, plain steps left before the next probe (0: draft this cycle).
      skip: int32, the shortest next run of plain steps after a failure (twice the last run
        after a failure, 1 after a drafted cycle that paid).
      probing: bool, whether the next drafted cycle is a probe (its advantage replaces the
        running one).
      accepted: float32, decayed sum of the drafted cycles' accepted drafts (the batch's
        mean), ``CAL_PRIOR`` at the start.
      predicted: float32, the same sum of the drafts their raw confidences predicted.
    """

    advantage: jax.Array
    wait: jax.Array
    skip: jax.Array
    probing: jax.Array
    accepted: jax.Array
    predicted: jax.Array

    @classmethod
    def start(cls) -> Gate:
        """The gate before the first cycle: drafting, the first cycle a probe, calibration 1."""
        return cls(jnp.float32(0.0), jnp.int32(0), jnp.int32(1), jnp.bool_(True),
                   jnp.float32(CAL_PRIOR), jnp.float32(CAL_PRIOR))

    @property
    def calibration(self) -> jax.Array:
        """float32 scalar: what the path probabilities are scaled by (module docstring)."""
        return jnp.clip(self.accepted / self.predicted, 1 / CAL_CLIP, CAL_CLIP)

    def observe(self, predicted: jax.Array, accepted: jax.Array) -> Gate:
        """The gate after a drafted cycle whose raw confidences predicted ``predicted``
        accepted drafts where ``accepted`` were (both the batch's means): the calibration's
        sums, decayed by ``CAL_DECAY``."""
        return dataclasses.replace(self, accepted=CAL_DECAY * self.accepted + accepted,
                                   predicted=CAL_DECAY * self.predicted + predicted)

    def after_drafted(self, predicted: jax.Array, accepted: jax.Array, advantage,
                      ran: jax.Array) -> Gate:
        """The gate after a drafted cycle: the calibration observes ``predicted`` and
        ``accepted`` (:meth:`observe`), then the cycle's verdict (:meth:`update`) takes
        ``advantage(calibration)``, its advantage priced with that updated calibration. A
        probe after a streak of rejections is then judged with its own acceptance counted,
        not by the streak's calibration alone.

        Args:
          predicted, accepted: the batch's means (:meth:`observe`).
          advantage: callable from a float32 scalar calibration to the cycle's advantage in
            plain steps (:meth:`Budget.advantage` of its calibrated expected tokens).
          ran: scalar bool, whether any row was running.
        """
        seen = self.observe(predicted, accepted)
        return seen.update(advantage(seen.calibration), ran)

    @property
    def drafts(self) -> jax.Array:
        """Scalar bool: whether this cycle drafts."""
        return self.wait == 0

    def update(self, advantage: jax.Array, ran: jax.Array) -> Gate:
        """The gate after a cycle: ``advantage`` is the cycle's (used only if it drafted),
        ``ran`` whether any row was running."""
        drafted = self.drafts & ran
        mean = jnp.where(self.probing, advantage,
                         (1 - GATE_ALPHA) * self.advantage + GATE_ALPHA * advantage)
        mean = jnp.where(drafted, mean, self.advantage)
        fail = drafted & (mean <= 0)
        amortize = jnp.ceil(-mean / GATE_PROBE_SHARE).astype(jnp.int32)
        run = jnp.clip(jnp.maximum(self.skip, amortize), 1, GATE_MAX_SKIP)
        return dataclasses.replace(
            self, advantage=mean,
            wait=jnp.where(fail, run, jnp.maximum(self.wait - (~self.drafts), 0)),
            skip=jnp.where(fail, jnp.minimum(2 * run, GATE_MAX_SKIP),
                           jnp.where(drafted, 1, self.skip)),
            probing=jnp.where(drafted, fail, self.probing | fail))


def expected_tokens(path_probs: jax.Array, buckets: Sequence[int],
                    scale: jax.Array | float = 1.0) -> jax.Array:
    """Tokens a cycle of each bucket emits in expectation (module docstring).

    Args:
      path_probs: [B, M] float, the acceptance probabilities of the drafter's M best nodes in
        best-first order (root excluded); a bucket larger than M + 1 counts M.
      buckets: budgets N (0 = a plain step).
      scale: the calibration each probability is multiplied by (then clipped to 1).
    Returns:
      [B, n_buckets] float32: 1 for bucket 0, else 1 + the sum of the first N - 1 probabilities.
    """
    p = jnp.clip(path_probs.astype(jnp.float32) * scale, 0.0, 1.0)
    csum = jnp.concatenate([jnp.zeros_like(p[:, :1]), jnp.cumsum(p, axis=1)], axis=1)
    take = np.clip(np.maximum(np.asarray(buckets) - 1, 0), 0, p.shape[1])
    return 1.0 + csum[:, take]


def best_bucket(tokens: jax.Array, table: CostTable | Budget,
                running: jax.Array | None = None,
                drafted: jax.Array | bool = False) -> jax.Array:
    """The index (into ``table.buckets``) of the bucket with the most expected tokens per
    second for the whole batch: a scalar int32, traceable (usable inside the decoding loop);
    ties go to the smaller bucket.

    Args:
      tokens: [B, n_buckets] expected tokens per row and bucket (:func:`expected_tokens`).
      table: the buckets and their cycle costs.
      running: [B] bool, the rows still generating (None: all). A finished row emits nothing
        whatever the bucket; counted, its one token would favour the cheapest bucket.
      drafted: scalar bool: choose among the drafted buckets only (N > 0; a probe of the draft
        gate, whose drafting is paid and whose acceptance is what it is there to observe).
    """
    if running is not None:
        tokens = jnp.where(running[:, None], tokens, 0.0)
    rate = tokens.sum(0) / jnp.asarray(table.cycle_s, jnp.float32)
    plain = np.asarray(table.buckets) == 0
    rate = jnp.where(jnp.asarray(drafted) & plain, -jnp.inf, rate)
    return jnp.argmax(rate).astype(jnp.int32)


def choose_bucket(path_probs: jax.Array, table: CostTable | Budget,
                  scale: jax.Array | float = 1.0) -> jax.Array:
    """:func:`best_bucket` for path probabilities ``path_probs`` [B, M] scaled by ``scale``."""
    return best_bucket(expected_tokens(path_probs, table.buckets, scale), table)
