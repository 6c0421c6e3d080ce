"""Speculative-decoding benchmark: verify-cost curves and drafter speedups, side by side.

Run::

    python -m specjax.spec_bench --max-new-tokens 128 --prompts 3

Two measurements, both in ONE process on SmolLM2-135M (the ratios are what count; absolute
times move with whatever else the machine runs):

1. **Verify cost curve** ``T_verify(N)`` for ``N in --nodes`` in float32 and bfloat16
   (float32 accumulation), each against the fastest plain-decoding step at the same precision
   (``calibrate.VerifyCosts.plain_step``) and
   against the fastest plain step at any precision.
2. **Drafters on a copy-heavy task** at temperature 0: "rewrite this function" prompts built from
   functions of Python's own standard library (present on every machine), or the first turns
   of JSONL prompt files (``--prompt-file``, e.g. MT-Bench's ``question.jsonl:turns``;
   repeated, several named sets, which share every compiled configuration and get a table
   each). With ``--methods eagle3 --drafter DIR`` an EAGLE drafter runs as chains of each
   draft length and as dynamic trees of each ``--tree-nodes`` size; with ``--methods
   dflash,ddtree --dflash DIR`` a DFlash drafter runs as block chains of each ``--blocks``
   size and as DDTrees of each ``--ddtree-nodes`` size (and, with ``--draft-sample`` at a
   temperature above 0, as chains drawn from its marginals); each DFlash and EAGLE-1
   configuration runs once per ``--draft-vocabs`` entry (the whole vocabulary, or the
   drafter's Vd most frequent ids). For plain decoding and each drafter: τ (tokens per
   verify cycle, the mean of the prompts' own τ), decode seconds, speedup over plain
   decoding at the same precision (the lossless comparison), speedup over the fastest plain
   decoding at any precision (what a user feels), efficiency = speedup / τ, acceptance by
   position, and the drafter's own time per cycle (its ``propose`` jitted alone). At
   temperature 0 outputs must match plain decoding token for token; mismatches are printed.
   ``--temperature`` and ``--batch`` set the sampling and the prompts per call.

Timing protocol: every configuration is compiled and warmed up first; then ``--repeats``
rounds run every prompt through every configuration in turn, keeping each configuration's
fastest round. Decode time = end-to-end time minus the time of the same request with
``max_new_tokens=1`` (prefill and the drafter's own prefill), both at the same cache size;
every prompt is padded to one width, so each configuration compiles once.
No stop tokens: every run produces exactly ``--max-new-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import api, calibrate, harness, metrics
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io.layout import without_row_weights

# Standard-library functions of 10-40 lines: real code that any machine has.
_SOURCES = ("textwrap.indent", "colorsys.rgb_to_hls", "statistics.median", "fnmatch.filter",
            "string.capwords", "base64.b85encode")


def copy_prompts(n: int) -> list[str]:
    """``n`` chat prompts asking to rewrite a standard-library function with type hints."""
    import importlib

    out = []
    for name in _SOURCES[:n]:
        module, attr = name.rsplit(".", 1)
        src = inspect.getsource(getattr(importlib.import_module(module), attr))
        out.append("Rewrite the following Python function with type hints added. Keep the "
                   f"code otherwise unchanged.\n\n```python\n{src}```")
    return out


def file_prompts(spec: str, n: int) -> list[str]:
    """The first ``n`` prompts of ``PATH[:field]`` (JSONL, gzipped when the name ends in
    ``.gz``; a list-valued field gives its first element, e.g. a conversation's first turn;
    the default field is ``prompt``)."""
    import gzip
    import json

    path, sep, field = spec.rpartition(":")
    if not sep or not field.isidentifier():
        path, field = spec, "prompt"
    out = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            if len(out) == n:
                break
            value = json.loads(line)[field]
            out.append(value[0] if isinstance(value, list) else value)
    return out


def prompt_sets(files: Sequence[str], templates: Sequence[str], n: int) -> dict[str, list[str]]:
    """Named prompt sets from ``[NAME=]PATH[:field]`` specs (NAME defaults to the file's
    directory name), each prompt wrapped by its template (one for all files or one per file;
    ``{prompt}`` is replaced by the prompt, a literal ``\\n`` by a newline); the copy-heavy
    task when ``files`` is empty."""
    import os

    if not files:
        return {"prompts": copy_prompts(n)}
    if len(templates) not in (0, 1, len(files)):
        raise ValueError(f"{len(templates)} --prompt-template values for {len(files)} "
                         "--prompt-file values: give one for all or one per file")
    templates = list(templates or ["{prompt}"])
    templates = templates * len(files) if len(templates) == 1 else templates
    out = {}
    for spec, template in zip(files, templates):
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.dirname(os.path.abspath(spec))), spec
        template = template.replace("\\n", "\n")
        out[name] = [template.replace("{prompt}", p) for p in file_prompts(path, n)]
    return out


def _decode_seconds(cfg, params, batch, max_new_tokens, cache_size, drafter, dparams,
                    temperature, width, budget=None):
    # One executable for both calls: the token limit is traced below new_tokens_width.
    kw = dict(cache_size=cache_size, drafter=drafter, drafter_params=dparams,
              temperature=temperature, prompt_width=width, budget=budget,
              new_tokens_width=max_new_tokens)
    full = api.generate_tokens(cfg, params, batch, max_new_tokens=max_new_tokens, **kw)
    first = api.generate_tokens(cfg, params, batch, max_new_tokens=1, **kw)
    return max(full.run_s - first.run_s, 1e-9), full


def _dflash_configs(cfg, params, dflash_dir, blocks, ddtree_nodes, methods, draft_sample,
                    draft_vocabs=(None,)):
    from specjax.drafters import dflash
    from specjax.io import official
    from specjax.targets import DecoderTarget

    if dflash_dir is None:
        raise ValueError("--methods dflash/ddtree needs --dflash DIR")
    dcfg, own = official.load_dflash(dflash_dir, cfg)
    tgt = DecoderTarget(cfg)
    out = {}
    for vd in draft_vocabs:
        dp = dflash.drafter_params(own, params, target=tgt, vocab=vd)
        tag = "" if vd is None else f" V={vd}"
        for bk in blocks if "dflash" in methods else ():
            out[f"dflash B={bk}{tag}"] = (
                cfg, params, dflash.DFlashDrafter(dcfg, tgt, block=bk, vocab=vd), dp)
            if draft_sample:
                out[f"dflash B={bk}{tag} sampled"] = (
                    cfg, params, dflash.DFlashDrafter(dcfg, tgt, dflash.SampledBlock(), bk, vd),
                    dp)
        for n in ddtree_nodes if "ddtree" in methods else ():
            out[f"ddtree N={n}{tag}"] = (
                cfg, params, dflash.DFlashDrafter(dcfg, tgt, dflash.DDTree(n), vocab=vd), dp)
    return out


def dflash_layer_costs(model, prompts: Sequence[str], layers: Sequence[int], *, block: int = 16,
                       batches: Sequence[int] = (1, 4), max_new_tokens: int = 64,
                       log=print) -> list[dict]:
    """Draft time per cycle of DFlash drafters of each depth in ``layers`` (random weights of
    the target's shapes, block ``block``) at each batch size, beside the plain step and a
    ``block``-node verify pass: the cost side of choosing the number of draft layers."""
    from specjax.drafters import dflash
    from specjax.targets import DecoderTarget

    cfg, params, tok = model.cfg, model.params, model.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    cache = api.round_up(max(map(len, ids)) + max_new_tokens + block + 1, api.CACHE_MULTIPLE)
    costs = calibrate.measure_verify_costs(cfg, params, (1, block))
    log(f"plain step {costs.plain_step * 1e3:.1f} ms, verify N={block} "
        f"{costs.seconds[-1] * 1e3:.1f} ms")
    rows = []
    for n in layers:
        dcfg = dflash.DFlashConfig.for_target(cfg, n_layers=n, block_size=block)
        dp = dflash.drafter_params(dflash.init_params(dcfg), params)
        drafter = dflash.DFlashDrafter(dcfg, DecoderTarget(cfg))
        for b in batches:
            ms = 1e3 * calibrate.measure_draft_cost(cfg, params, drafter, dp, ids[:b], cache)
            rows.append(dict(layers=n, batch=b, draft_ms=ms))
            log(f"  {n} draft layers, batch {b}: {ms:.1f} ms per cycle")
    return rows


def run_spec_benchmark(model, prompts: Sequence[str] | Mapping[str, Sequence[str]], *,
                       max_new_tokens: int = 128,
                       nodes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 2,
                       draft_lens: Sequence[int] = (4, 8), draft_layers: int = 4,
                       methods: Sequence[str] = ("ngram", "draft-model"),
                       dtypes: Sequence[str] = ("float32", "bfloat16"), drafter_dir=None,
                       tree_nodes: Sequence[int] = (8, 16), dflash_dir=None,
                       blocks: Sequence[int] = (4, 8, 16), ddtree_nodes: Sequence[int] = (8, 16, 32),
                       temperature: float = 0.0, batch: int = 1, draft_sample: bool = False,
                       draft_vocabs: Sequence[int | None] = (None,),
                       cost_aware: Sequence[int] = (), log=print) -> dict:
    """Runs both measurements (module docstring) and returns them as a dict.

    ``prompts`` is one list or named sets of them (``{"gsm8k": [...], "humaneval": [...]}``):
    every set runs through the same compiled configurations (one padded prompt width and cache
    for all) and gets its own table, its speedups measured against plain decoding on the same
    set. Draft time per cycle is measured once per drafter, on the first batch, before the
    timed rounds.

    ``draft_vocabs`` runs every DFlash, DDTree and EAGLE-1 configuration once per draft
    vocabulary (None: the target's whole vocabulary; Vd: the drafter's Vd most frequent ids).

    ``cost_aware`` buckets (e.g. ``(0, 4, 8, 16)``) add a cost-aware twin of every DFlash and
    DDTree configuration (:mod:`specjax.harness`), its budget built from this run's verify
    curve and the drafter's measured draft time."""
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    cfg16 = cfg.replace(dtype="bfloat16")
    # As load(dtype="bfloat16") gives it: no one-row copies.
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), without_row_weights(params))

    log("verify cost curve (ms per pass):")
    curves = {}
    precisions = [(c, p) for c, p in ((cfg, params), (cfg16, params16)) if c.dtype in dtypes]
    for c, p in precisions:
        curves[c.dtype] = calibrate.measure_verify_costs(
            c, p, nodes, progress=lambda n, s, d=c.dtype: log(f"  {d} N={n}: {s * 1e3:.1f}"))
    fastest_any = min(v.plain_step for v in curves.values())

    configs = {"plain f32": (cfg, params, None, None)}
    if "bfloat16" in dtypes:
        configs["plain bf16"] = (cfg16, params16, None, None)
    for k in draft_lens if "ngram" in methods else ():
        configs[f"ngram k={k}"] = (cfg, params, NgramDrafter(draft_len=k), None)
    for k in draft_lens if "draft-model" in methods else ():
        d, dp = DraftModelDrafter.from_target_layers(cfg, params, draft_layers, draft_len=k)
        configs[f"draft-model L={draft_layers} k={k}"] = (cfg, params, d, dp)
    if {"eagle3", "eagle1"} & set(methods):
        from specjax.drafters import eagle
        from specjax.io import official
        from specjax.targets import DecoderTarget
        from specjax.tree import StaticTree

        if drafter_dir is None:
            raise ValueError("--methods eagle3/eagle1 needs --drafter DIR")
        ecfg, own = official.load_eagle(drafter_dir, cfg)
        tgt = DecoderTarget(cfg)
        name = f"eagle{ecfg.version}"
        for vd in draft_vocabs if ecfg.version == 1 else (None,):
            dp = eagle.drafter_params(own, params, target=tgt, vocab=vd)
            tag = "" if vd is None else f" V={vd}"
            for k in draft_lens:
                configs[f"{name} chain k={k}{tag}"] = (
                    cfg, params, eagle.EagleDrafter(ecfg, tgt, StaticTree.chain(k + 1), vd), dp)
            for n in tree_nodes:
                tree = eagle.DynamicTree(n, depth=5, top_k=4)
                configs[f"{name} tree N={n}{tag}"] = (
                    cfg, params, eagle.EagleDrafter(ecfg, tgt, tree, vd), dp)
    if {"dflash", "ddtree"} & set(methods):
        configs |= _dflash_configs(cfg, params, dflash_dir, blocks, ddtree_nodes, methods,
                                   draft_sample and temperature > 0, draft_vocabs)
    if not isinstance(prompts, Mapping):
        prompts = {"prompts": prompts}
    encoded = {name: [tok.encode_chat([{"role": "user", "content": p}]) for p in ps]
               for name, ps in prompts.items()}
    for name, ids in encoded.items():
        if not ids or len(ids) % batch:
            raise ValueError(f"{len(ids)} prompts of {name!r} do not fill batches of {batch}")
    # Every set shares one padded width and cache: each configuration compiles once.
    batches = [(name, ids[i:i + batch]) for name, ids in encoded.items()
               for i in range(0, len(ids), batch)]
    longest = max(len(p) for ids in encoded.values() for p in ids)
    width = api.round_up(longest, api.PROMPT_BUCKET)
    widest = max([d.n_nodes for _, _, d, _ in configs.values() if d is not None] + [2])
    cache_size = api.round_up(max(longest + max_new_tokens + widest + 1, width),
                              api.CACHE_MULTIPLE)
    draft = {name: None if d is None else  # ms per cycle
             1e3 * calibrate.measure_draft_cost(c, p, d, dp, batches[0][1], cache_size,
                                                  temperature, width=width)
             for name, (c, p, d, dp) in configs.items()}
    budgets = {}
    for name in [n for n in configs if n.startswith(("dflash", "ddtree")) and cost_aware]:
        # The table carries the draft time into every bucket and gives the gate its costs.
        c, p, d, dp = configs[name]
        costs = curves[c.dtype]
        buckets = tuple(n for n in sorted(set(cost_aware)) if n <= d.n_nodes)
        twin = f"{name} cost-aware"
        budgets[twin] = harness.CostTable(
            buckets, tuple(costs.plain_step if n == 0 else costs.at(n) for n in buckets),
            tuple(0.0 if n == 0 else draft[name] / 1e3 for n in buckets)).budget()
        configs[twin], draft[twin] = configs[name], draft[name]
    best = {name: [np.inf] * len(batches) for name in configs}
    outputs, taus = {}, {name: [None] * len(batches) for name in configs}
    hists = {name: [0] * len(batches) for name in configs}
    widths = {name: [(0, 0)] * len(batches) for name in configs}  # (nodes verified, cycles)
    with api.keeping(len(configs)):  # one executable per configuration, each kept
        log(f"warming up (compiling {len(configs)} configurations) ...")
        for name, (c, p, d, dp) in configs.items():
            t0 = time.perf_counter()
            _decode_seconds(c, p, batches[0][1], max_new_tokens, cache_size, d, dp, temperature,
                            width, budgets.get(name))
            log(f"  {name}: {time.perf_counter() - t0:.1f} s")
        for r in range(repeats):
            for i, (_, ids) in enumerate(batches):
                for name, (c, p, d, dp) in configs.items():
                    secs, res = _decode_seconds(c, p, ids, max_new_tokens, cache_size, d, dp,
                                                temperature, width, budgets.get(name))
                    best[name][i] = min(best[name][i], secs)
                    outputs[name, i] = res.tokens
                    if r == 0:
                        taus[name][i] = res.tau
                        if res.stats is not None:
                            hists[name][i] = np.asarray(res.stats.accept_hist).sum(0)
                            widths[name][i] = (int(res.stats.verified.sum()),
                                               int(res.stats.cycles.sum()))
            log(f"round {r + 1}/{repeats} done")
    sets = []
    for set_name, ids in encoded.items():
        idx = [i for i, (n, _) in enumerate(batches) if n == set_name]
        plain = sum(best["plain f32"][i] for i in idx)
        fastest_plain = min(sum(best[n][i] for i in idx) for n in configs if n.startswith("plain"))
        rows = []
        for name, (c, p, d, dp) in configs.items():
            secs = sum(best[name][i] for i in idx)
            tau = float(np.mean([taus[name][i] for i in idx]))
            mismatches = [j for j, i in enumerate(idx)
                          if temperature == 0 and c.dtype == "float32"
                          and outputs[name, i] != outputs["plain f32", i]]
            hist = np.asarray(sum(hists[name][i] for i in idx))  # 0 for plain decoding
            accept = metrics.acceptance_by_position(hist) if hist.ndim else []
            rows.append(dict(name=name, decode_s=secs, tau=tau,
                             tok_s=len(ids) * (max_new_tokens - 1) / secs,
                             speedup=plain / secs, speedup_vs_fastest=fastest_plain / secs,
                             efficiency=plain / secs / tau, mismatched_prompts=mismatches,
                             accept_by_position=accept, draft_ms=draft[name],
                             nodes_per_cycle=(sum(widths[name][i][0] for i in idx)
                                              / max(sum(widths[name][i][1] for i in idx), 1)),
                             per_prompt=[dict(tau=taus[name][i],
                                              speedup=best["plain f32"][i] / best[name][i])
                                         for i in idx]))
        sets.append(dict(name=set_name, prompts=len(ids), drafters=rows))
    return dict(curves={d: dict(nodes=v.nodes, seconds=v.seconds,
                                plain_step=v.plain_step) for d, v in curves.items()},
                fastest_plain_step_any=fastest_any, sets=sets,
                max_new_tokens=max_new_tokens, batch=batch, temperature=temperature)


def _set_report(block: dict, result: dict, temperature: float) -> list[str]:
    title = "" if block["name"] == "prompts" else f"{block['name']}: "
    lines = ["", f"{title}{block['prompts']} prompts x {result['max_new_tokens']} new "
             f"tokens, temperature {temperature:g}, batch {result.get('batch', 1)}:",
             f"  {'configuration':26s} {'tok/s':>7s} {'tau':>5s} {'speedup':>8s} "
             f"{'vs fastest':>10s} {'efficiency':>10s} {'draft ms':>8s}  output"]
    for r in block["drafters"]:
        same = ("== plain" if not r["mismatched_prompts"] else
                f"differs {r['mismatched_prompts']}") if temperature == 0 else "(sampled)"
        if r["name"] == "plain bf16":
            same = "(bf16: not compared)"
        ms = "" if r.get("draft_ms") is None else f"{r['draft_ms']:.1f}"
        lines.append(f"  {r['name']:26s} {r['tok_s']:7.1f} {r['tau']:5.2f} {r['speedup']:7.2f}x "
                     f"{r['speedup_vs_fastest']:9.2f}x {r['efficiency']:10.2f} {ms:>8s}  {same}")
    lines += ["", "acceptance by position (cycles that accepted at least k drafts / cycles):"]
    for r in block["drafters"]:
        if r.get("accept_by_position"):
            lines.append(f"  {r['name']:26s} " + " ".join(
                f"{a:.2f}" for a in r["accept_by_position"]))
    lines += ["", "verified nodes per cycle (the mean verify width, root included):",
              "  " + "  ".join(f"{r['name']}: {r['nodes_per_cycle']:.1f}"
                               for r in block["drafters"] if r.get("nodes_per_cycle"))]
    lines += ["", "per prompt (or batch), tau and speedup over plain f32 (the tau above is the "
              "mean of these; the totals above add up times, so the prompt with the fewest "
              "accepted drafts weighs most):"]
    for r in block["drafters"]:
        if not r["name"].startswith("plain"):
            cells = [f"tau {c['tau']:.2f} {c['speedup']:.2f}x" for c in r["per_prompt"]]
            lines.append(f"  {r['name']:26s} " + "  |  ".join(cells))
    return lines


def format_report(result: dict) -> str:
    lines = ["", "T_verify(N), ms per pass [ratio to the fastest plain step at that precision; "
             "ratio to the fastest at any precision]:"]
    fastest_any = result["fastest_plain_step_any"]
    for dtype, c in result["curves"].items():
        cells = [f"N={n}: {s * 1e3:.1f} [{s / c['plain_step']:.2f}x; {s / fastest_any:.2f}x]"
                 for n, s in zip(c["nodes"], c["seconds"])]
        lines.append(f"  {dtype:9s} " + "  ".join(cells))
    temperature = result.get("temperature", 0.0)
    for block in result["sets"]:
        lines += _set_report(block, result, temperature)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.spec_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=3, help=f"at most {len(_SOURCES)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nodes", default="1,2,4,8,16,32,64")
    parser.add_argument("--draft-lens", default="4,8")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--methods", default="ngram,draft-model",
                        help="drafters to run: ngram, draft-model, eagle3, eagle1, dflash, ddtree "
                             "(comma-separated)")
    parser.add_argument("--drafter", default=None,
                        help="the EAGLE drafter directory (official layout) for eagle3/eagle1")
    parser.add_argument("--tree-nodes", default="8,16",
                        help="EAGLE dynamic tree sizes, root included")
    parser.add_argument("--dflash", default=None,
                        help="the DFlash drafter directory (official layout) for dflash/ddtree")
    parser.add_argument("--blocks", default="4,8,16",
                        help="DFlash block sizes drafted per pass, root included")
    parser.add_argument("--ddtree-nodes", default="8,16,32", help="DDTree sizes, root included")
    parser.add_argument("--draft-vocabs", default="full",
                        help="DFlash / DDTree / EAGLE-1 draft vocabularies, comma-separated: "
                             "full (the target's) or a size Vd (the drafter's Vd most frequent "
                             "ids)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    parser.add_argument("--draft-sample", action="store_true",
                        help="at temperature > 0 also run DFlash chains drawn from the marginals")
    parser.add_argument("--cost-aware", default=None,
                        help="budget buckets (e.g. 0,4,8,16; 0 = a plain step): also run each "
                             "DFlash / DDTree configuration with cost-aware budgets")
    parser.add_argument("--json", default=None, help="also write the result dict here")
    parser.add_argument("--dflash-layer-costs", default=None,
                        help="instead of the benchmark: draft time per cycle of random-weight "
                             "DFlash drafters of these depths (comma-separated), batch 1 and 4")
    parser.add_argument("--prompt-file", action="append", default=[],
                        help="JSONL prompts as [NAME=]PATH[:field] instead of the copy-heavy task; "
                             "repeat for several sets, each with its own table")
    parser.add_argument("--prompt-template", action="append", default=[],
                        help="wraps each file prompt: {prompt} is replaced by it, \\n by a newline; "
                             "one for all files or one per --prompt-file, in order (default: "
                             "{prompt})")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="precisions for the verify curve and plain decoding")
    args = parser.parse_args(argv)
    print("$ python -m specjax.spec_bench " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None
                                                           else argv)))
    from specjax.io import load

    prompts = prompt_sets(args.prompt_file, args.prompt_template, args.prompts)
    if args.dflash_layer_costs:
        dflash_layer_costs(load(args.model), [p for ps in prompts.values() for p in ps],
                           [int(n) for n in args.dflash_layer_costs.split(",")])
        return 0
    result = run_spec_benchmark(
        load(args.model), prompts, max_new_tokens=args.max_new_tokens,
        nodes=[int(n) for n in args.nodes.split(",")], repeats=args.repeats,
        draft_lens=[int(k) for k in args.draft_lens.split(",")], draft_layers=args.draft_layers,
        methods=args.methods.split(","), dtypes=args.dtypes.split(","),
        drafter_dir=args.drafter, tree_nodes=[int(n) for n in args.tree_nodes.split(",")],
        dflash_dir=args.dflash, blocks=[int(b) for b in args.blocks.split(",")],
        ddtree_nodes=[int(n) for n in args.ddtree_nodes.split(",")],
        temperature=args.temperature, batch=args.batch, draft_sample=args.draft_sample,
        draft_vocabs=[None if v == "full" else int(v) for v in args.draft_vocabs.split(",")],
        cost_aware=[int(n) for n in args.cost_aware.split(",")] if args.cost_aware else ())
    print(format_report(result))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
