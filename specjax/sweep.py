"""The benchmark sweep behind ``specjax bench`` and the notebooks: methods x prompt sets x
temperatures x batch sizes x context lengths, one record per cell.

A cell runs every request of one prompt set (its prompts cycled to fill batches of the cell's
size) through one method, twice per request and the faster kept (``repeats``): the whole
generation, and a one-token generation whose time is the time to first token (prefill plus the
first sample, and the drafter's ``init``). The rest of a request's time, divided by its
longest row's tokens past the first, is its time per output token; percentiles run over the
requests.

**Speedup, paired.** Plain decoding runs first in every (set, temperature, batch, context)
group: its record, and the tokens greedy cells are compared with. Every other cell times plain
decoding again on each of its requests, run by run alternating with its own runs (the faster
of each kept), and its ``speedup`` is its tokens per second over that paired plain rate
(``plain_tok_s``). On a shared machine whose speed drifts over a sweep, each ratio then comes
from runs seconds apart rather than minutes. ``speedup_runs`` gives the spread: the speedup of
each repeat alone (its runs over the plain runs beside them, all requests summed).

Executables are shared: prompts are padded to a coarse width (``WIDTH_BUCKET``) and the
one-token runs reuse the whole generation's executable (token limits are traced), so each
method compiles once per width and batch size, and compilation happens before timing.

**A reference precision.** ``run(reference=...)`` takes the same target loaded at another
precision (float32 beside a bfloat16 sweep, say): every cell, plain decoding's included, also
times the reference's plain decoding on each request, run by run beside its own runs (the
faster of each kept), and ``reference_speedup`` is the cell's tokens per second over that
rate. A faster method at a cheaper precision is then compared with the fastest plain decoding
at any precision, measured beside it, not only with plain decoding at its own.

**Gates carried.** A cost-aware method whose budget is gated (:class:`specjax.harness.Gate`)
goes on from the gate its previous request at the same temperature left (the warm-up run
included), through every set of one batch size and context, as a server would: a drafter that
does not pay is probed once per run of plain steps, not again at the start of every request.
Each temperature has its gate, since the gate's calibration of the drafter's confidences
depends on it.

**Time split.** A cycle's time is split by separately jitted measurements of its stages: the
drafter's ``propose`` alone (:func:`specjax.calibrate.measure_draft_cost`), and a verify pass
at the cell's mean verified width (:func:`specjax.calibrate.measure_verify_costs`); what is
left of the cycle (commit, the drafter's commit, bookkeeping) is ``other``. One verify curve
per batch size and context serves the time split and every cost table the sweep measures
(its points cover the tables' buckets); it is kept beside the cost tables and read back by
later sweeps of the same configuration (:func:`specjax.calibrate.cached_verify_costs`). Peak
memory is XLA's figure for the compiled generation call.

Record fields (the latency ones None with ``run(latency=False)``): ``method``,
``cost_aware``, ``set``, ``temperature``, ``batch``, ``context`` (None: the prompts as they
are), ``requests``, ``prompt_tokens`` (mean), ``new_tokens`` (total), ``ttft_ms`` (p50),
``tpot_ms`` ({p50, p95, p99}), ``tok_s``, ``plain_tok_s``, ``speedup``, ``speedup_runs``
(one per repeat; None for plain decoding), ``tau`` (tokens per target pass: a gated
cell's plain steps count as cycles that accepted nothing, :class:`specjax.decode.SpecStats`),
``reference_dtype``, ``reference_tok_s`` and ``reference_speedup`` (None without a reference),
``acceptance`` (P(accepted >= k) for k = 1..D, over the same cycles), ``drafted`` (fraction
of cycles that drafted), ``verified`` (nodes per row and cycle), ``fallbacks``, ``split_ms``
({draft, verify, other} per cycle of the whole batch), ``peak_mb``, ``same_as_plain``
(greedy cells: whether every row's tokens equal plain decoding's; None when sampled),
``divergence_gap`` (greedy cells that part from plain decoding: the largest top-2 logit gap
at a row's first differing token, :func:`specjax.api.divergence`; a near-tie when small,
else None).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from specjax import api, calibrate, metrics, suite

WIDTH_BUCKET = 256  # prompts pad to a multiple of this: few executables, little padding waste


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding configuration of a sweep.

    Attributes:
      name: its label in records and tables (e.g. ``"dflash B=8"``).
      drafter: a static drafter, or None for plain decoding.
      dparams: the drafter's params.
      cost_aware: run under the cost-aware harness (:mod:`specjax.harness`) with a cost table
        measured on this machine (cached, :func:`specjax.calibrate.drafter_cost_table`).
    """

    name: str
    drafter: Any = None
    dparams: Any = None
    cost_aware: bool = False

    def twin(self) -> Method:
        """The same drafter under the cost-aware harness."""
        return dataclasses.replace(self, name=f"{self.name} cost-aware", cost_aware=True)


def methods(model, names: Sequence[str], *, model_name: str, cost_aware: str = "both",
            draft_lens: Sequence[int] = (4,), draft_layers: int = 4,
            tree_nodes: Sequence[int] = (16,), blocks: Sequence[int | None] = (None,),
            eagle_dir=None, dflash_dir=None, draft_vocab: int | str | None = None
            ) -> list[Method]:
    """The :class:`Method` list of ``names`` (plain, ngram, draft-model, eagle3, eagle1,
    dflash, ddtree) for ``model`` (a :class:`specjax.io.models.LoadedModel`): each drafter at
    every size given (its fixed budgets), and its cost-aware twin at the largest (verified
    at a plain step, the powers of two below its size and the whole proposal,
    :func:`specjax.calibrate.budget_buckets`; a smaller fixed size is one of them only when
    it is such a power of two).

    Args:
      model_name: the model's name, for the shipped EAGLE/DFlash drafters.
      cost_aware: ``"fixed"`` (the fixed budgets only), ``"harness"`` (the cost-aware twins
        only) or ``"both"``.
      draft_lens, draft_layers: n-gram and draft-model chain lengths; the draft model's depth.
      tree_nodes: EAGLE dynamic tree and DDTree sizes, root included.
      blocks: DFlash chain blocks (None: the drafter's trained one).
      eagle_dir, dflash_dir: drafter directories (default: the ones shipped for the model).
      draft_vocab: DFlash and DDTree draft from the drafter's ``draft_vocab`` most frequent
        ids; ``"full"`` from all; None from its config's ``draft_vocab_size`` (all if unset).
        EAGLE-1 drafts from that many ids too; from all for None or ``"full"``.
    Raises:
      ValueError: an unknown name, or a drafter that cannot be loaded or does not fit.
    """
    from specjax.drafters import dflash, eagle
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.drafters.ngram import NgramDrafter
    from specjax.io import official
    from specjax.io.models import shipped_drafter
    from specjax.targets import DecoderTarget

    if cost_aware not in ("fixed", "harness", "both"):
        raise ValueError(f"cost_aware must be fixed, harness or both, got {cost_aware!r}")
    cfg, params = model.cfg, model.params
    tgt = DecoderTarget(cfg)

    def sizes(name):
        """[Method] of ``name``, one per size, ascending."""
        if name == "ngram":
            return [Method(f"ngram k={k}", NgramDrafter(draft_len=k)) for k in sorted(draft_lens)]
        if name == "draft-model":
            out = []
            for k in sorted(draft_lens):
                d, dp = DraftModelDrafter.from_target_layers(cfg, params, draft_layers, k)
                out.append(Method(f"draft-model L={draft_layers} k={k}", d, dp))
            return out
        if name in ("eagle3", "eagle1"):
            ecfg, own = official.load_eagle(eagle_dir or shipped_drafter(model_name, name), cfg,
                                            dtype=cfg.dtype)
            vd = eagle.resolve_vocab(ecfg, draft_vocab) if name == "eagle1" else None
            dp = eagle.drafter_params(own, params, target=tgt, vocab=vd)
            tag = "" if vd is None else f" V={vd}"
            return [Method(f"{name} tree N={n}{tag}", eagle.EagleDrafter(
                ecfg, tgt, eagle.DynamicTree(n, min(5, n - 1), 4), vocab=vd), dp)
                for n in sorted(tree_nodes)]
        if name in ("dflash", "ddtree"):
            dcfg, own = official.load_dflash(dflash_dir or shipped_drafter(model_name, "dflash"),
                                             cfg, dtype=cfg.dtype)
            vd = dflash.resolve_vocab(dcfg, draft_vocab)
            dp = dflash.drafter_params(own, params, target=tgt, vocab=vd)
            tag = "" if vd is None else f" V={vd}"
            if name == "ddtree":
                return [Method(f"ddtree N={n}{tag}", dflash.DFlashDrafter(
                    dcfg, tgt, dflash.DDTree(n), vocab=vd), dp)
                    for n in sorted(tree_nodes)]
            drafters = sorted((dflash.DFlashDrafter(dcfg, tgt, block=bk, vocab=vd)
                               for bk in blocks), key=lambda d: d.block_size)
            return [Method(f"dflash B={d.block_size}{tag}", d, dp) for d in drafters]
        raise ValueError(f"unknown method {name!r}; choose from plain, ngram, draft-model, "
                         "eagle3, eagle1, dflash, ddtree")

    out = []
    for name in names:
        if name == "plain":
            out.append(Method("plain"))
            continue
        ms = sizes(name)
        if cost_aware in ("fixed", "both"):
            out += ms
        if cost_aware in ("harness", "both"):
            out.append(ms[-1].twin())
    return out


def _requests(ids: Sequence[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts cycled into batches of ``batch`` rows, every prompt at least once."""
    n = -(-len(ids) // batch) * batch
    rows = [ids[i % len(ids)] for i in range(n)]
    return [rows[i:i + batch] for i in range(0, n, batch)]


def run(model, prompt_sets: Mapping[str, Sequence[str]], method_list: Sequence[Method], *,
        temperatures: Sequence[float] = (0.0,), batches: Sequence[int] = (1,),
        contexts: Sequence[int | None] = (None,), max_new_tokens: int = 128, repeats: int = 2,
        seed: int = 0, model_name: str = "", latency: bool = True, reference=None,
        progress: Callable[[str], None] | None = None,
        stage: Callable[[str], None] | None = None,
        on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Runs the sweep (module docstring) and returns its records, one per cell.

    Args:
      model: a :class:`specjax.io.models.LoadedModel` with a tokenizer (prompts are chat
        turns).
      prompt_sets: {set name: prompts}.
      method_list: the configurations; plain decoding is added first when absent.
      temperatures, batches: the other axes.
      contexts: context lengths in tokens: each prompt behind background text up to that
        length (:func:`specjax.suite.with_context`); None: the prompts as they are.
      max_new_tokens: new tokens per row at most (stop tokens end rows early).
      repeats: timed runs per request, the fastest kept.
      model_name: the model's name in the cost tables' keys (cost-aware methods).
      latency: measure time to first token, time per output token and the time split
        (one-token runs of the same executable, and a draft-cost measurement that compiles
        the drafter's ``propose`` alone); False leaves them None.
      reference: optional :class:`specjax.io.models.LoadedModel`, the same target at another
        precision, whose plain decoding every cell times beside its own runs (module
        docstring).
      progress: optional callable, given a short description after each cell.
      stage: optional callable, given a short description of each measurement that is not a
        cell as it goes (a cost table's steps, the verify curve): a first sweep spends minutes
        on them before its first cell.
      on_record: optional callable, given each record as its cell ends (to keep the records
        of a sweep that stops early).
    """
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    if tok is None:
        raise ValueError("the sweep needs a model with a tokenizer (its prompts are chat turns)")
    if reference is not None and reference.cfg.replace(dtype=cfg.dtype) != cfg:
        raise ValueError("the reference must be the same target at another precision; its "
                         f"config differs beyond the dtype: {reference.cfg} vs {cfg}")
    if not any(m.drafter is None for m in method_list):
        method_list = [Method("plain"), *method_list]
    method_list = sorted(method_list, key=lambda m: m.drafter is not None)  # plain first
    def chat(text):
        return tok.encode_chat([{"role": "user", "content": text}])

    widest = max([m.drafter.n_nodes for m in method_list if m.drafter is not None] + [2])
    report = progress or (lambda s: None)
    announce = stage or (lambda s: None)
    stops = tuple(tok.eos_ids)
    records = []
    nodes = sorted({1, 2, widest} | {n for n in (4, 8, 16, 32, 64) if n < widest})
    # The verify curve's points: the time split's and every cost table's buckets.
    points = sorted(set(nodes) | {n for m in method_list if m.cost_aware
                                  for n in calibrate.budget_buckets(m.drafter.n_nodes) if n})
    for b, ctx_len in itertools.product(batches, contexts):
        sets = {name: ps if ctx_len is None else
                suite.with_context(ps, lambda x: len(chat(x)), ctx_len)
                for name, ps in prompt_sets.items()}
        encoded = {name: [chat(p) for p in ps] for name, ps in sets.items()}
        context = calibrate.cost_context(
            int(np.mean([len(p) for ids in encoded.values() for p in ids])), max_new_tokens)
        # One verify curve per batch size and context, measured on first need: for the cost
        # tables not yet measured and for the time split.
        curves, draft_ms, budgets = [], {}, {}

        def verify_curve(b=b, context=context):
            if not curves:
                announce(f"verify curve at batch {b}, context {context}")
                curves.append(calibrate.cached_verify_costs(
                    cfg, params, points, batch=b, context=context,
                    key=dict(model=model_name or repr(cfg)))[0])
            return curves[0]

        # Each gated method's draft gate per temperature (what a drafter's confidences predict
        # depends on it), carried from request to request as a server would.
        gates = {}
        for m in method_list:
            if m.cost_aware:
                table, _ = calibrate.drafter_cost_table(
                    cfg, params, m.drafter, m.dparams, batch=b, context=context,
                    key=dict(model=model_name or repr(cfg), drafter=repr(m.drafter)),
                    verify_curve=verify_curve,
                    progress=lambda what, n, sec, m=m: announce(
                        f"{m.name} cost table: measured {what} {n}, {1e3 * sec:.1f} ms"))
                budgets[m.name] = table.budget()
        curve = None
        if latency and any(m.drafter is not None for m in method_list):
            curve = verify_curve()
        for set_name, ids in encoded.items():
            reqs = _requests(ids, b)
            width = api.round_up(max(len(p) for p in ids), WIDTH_BUCKET)
            cache = api.round_up(width + max_new_tokens + widest + 1, api.CACHE_MULTIPLE)
            for t in temperatures:
                plain_kw, plain_tokens = None, None
                # What every run of this group shares, plain decoding's and the reference's.
                shared = dict(cache_size=cache, temperature=t, prompt_width=width, seed=seed,
                              stop_tokens=stops, new_tokens_width=max_new_tokens)

                def ref_run(req):
                    """The reference's plain decoding of ``req``."""
                    return api.generate_tokens(reference.cfg, reference.params, req,
                                               max_new_tokens=max_new_tokens, **shared)

                if reference is not None:
                    ref_run(reqs[0])  # compiles before any timing
                for m in method_list:
                    kw = dict(shared, drafter=m.drafter, drafter_params=m.dparams,
                              budget=budgets.get(m.name))

                    def call(req, n, m=m, kw=kw):
                        """``m`` on ``req`` for ``n`` new tokens, going on from its gate."""
                        r = api.generate_tokens(cfg, params, req, max_new_tokens=n,
                                                gate=gates.get((m.name, t)), **kw)
                        if r.gate is not None:
                            gates[m.name, t] = r.gate
                        return r

                    warm = call(reqs[0], max_new_tokens)
                    ttft, tpot, total_s, new_tokens, outs = [], [], 0.0, 0, []
                    hist, cycles, drafted, verified, fallbacks = None, 0, 0, 0, 0
                    passes = 0  # the batch's cycles: the longest-running row took part in all
                    paired_s, paired_tokens = 0.0, 0
                    ref_s, ref_tokens = 0.0, 0
                    # [repeat, (seconds, tokens) of the method, then of plain beside it]
                    by_repeat = np.zeros((repeats, 4))
                    for req in reqs:
                        runs, bases, refs = [], [], []
                        for i in range(repeats):
                            if reference is not None:
                                refs.append(ref_run(req))
                            if m.drafter is not None:
                                bases.append(api.generate_tokens(
                                    cfg, params, req, max_new_tokens=max_new_tokens, **plain_kw))
                                by_repeat[i, 2:] += bases[-1].run_s, bases[-1].n_tokens
                            runs.append(call(req, max_new_tokens))
                            by_repeat[i, :2] += runs[-1].run_s, runs[-1].n_tokens
                        full = min(runs, key=lambda r: r.run_s)
                        if bases:
                            base = min(bases, key=lambda r: r.run_s)
                            paired_s += base.run_s
                            paired_tokens += base.n_tokens
                        if refs:
                            ref = min(refs, key=lambda r: r.run_s)
                            ref_s += ref.run_s
                            ref_tokens += ref.n_tokens
                        if latency:
                            first = min(call(req, 1).run_s for _ in range(repeats))
                            ttft.append(first)
                            longest = max(len(x) for x in full.tokens)
                            tpot.append(max(full.run_s - first, 0.0) / max(longest - 1, 1))
                        total_s += full.run_s
                        new_tokens += full.n_tokens
                        outs.extend(full.tokens)
                        st = full.stats
                        if st is not None:
                            h = np.asarray(st.accept_hist).sum(0)
                            hist = h if hist is None else hist + h
                            cycles += int(st.cycles.sum())
                            passes += int(st.cycles.max())
                            drafted += int(st.drafted.sum())
                            verified += int(st.verified.sum())
                            fallbacks += int(st.fallbacks.sum())
                    rate = new_tokens / total_s
                    if m.drafter is None:
                        plain_kw, plain_tokens = kw, outs
                    plain_rate = rate if m.drafter is None else paired_tokens / paired_s
                    split = None
                    if latency and m.drafter is not None and cycles:
                        if m.name not in draft_ms:  # measured at the first set's width
                            draft_ms[m.name] = 1e3 * calibrate.measure_draft_cost(
                                cfg, params, m.drafter, m.dparams, reqs[0], cache, t,
                                width=width)
                        decode_s = total_s - sum(ttft)
                        d = draft_ms[m.name] * drafted / cycles
                        v = 1e3 * curve.at(verified / cycles)
                        split = dict(draft=d, verify=v,
                                     other=max(1e3 * decode_s / max(passes, 1) - d - v, 0.0))
                    greedy = t == 0
                    gaps = [] if not greedy or m.drafter is None else [
                        part[1] for prompt, got, want in
                        zip([p for r in reqs for p in r], outs, plain_tokens)
                        if (part := api.divergence(cfg, params, prompt, got, want))]
                    record = dict(
                        method=m.name, cost_aware=m.cost_aware, set=set_name, temperature=t,
                        batch=b, context=ctx_len, requests=len(reqs),
                        prompt_tokens=float(np.mean([len(p) for r in reqs for p in r])),
                        new_tokens=new_tokens,
                        ttft_ms=1e3 * float(np.median(ttft)) if latency else None,
                        tpot_ms={f"p{q:g}": 1e3 * v for q, v in
                                 metrics.percentiles(tpot).items()} if latency else None,
                        tok_s=rate, plain_tok_s=plain_rate, speedup=rate / plain_rate,
                        speedup_runs=None if m.drafter is None else [
                            float(tok / sec / (base_tok / base_sec))
                            for sec, tok, base_sec, base_tok in by_repeat],
                        reference_dtype=None if reference is None else reference.cfg.dtype,
                        reference_tok_s=None if reference is None else ref_tokens / ref_s,
                        reference_speedup=(None if reference is None
                                           else rate / (ref_tokens / ref_s)),
                        tau=1.0 if hist is None else metrics.tau(hist),
                        acceptance=[] if hist is None else metrics.acceptance_by_position(hist),
                        drafted=None if not cycles else drafted / cycles,
                        verified=None if not cycles else verified / cycles,
                        fallbacks=fallbacks, split_ms=split,
                        peak_mb=None if warm.peak_bytes is None else warm.peak_bytes / 2 ** 20,
                        same_as_plain=(outs == plain_tokens) if greedy else None,
                        divergence_gap=max(gaps) if gaps else None)
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
                    report(f"{m.name} | {set_name} | T={t:g} | batch {b}"
                           + ("" if ctx_len is None else f" | context {ctx_len}"))
    return records
