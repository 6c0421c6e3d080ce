"""The ``specjax`` command line.

    specjax generate --model smollm2-135m --prompt "What is the capital of France?"

Each subcommand is a thin wrapper over library functions; it parses, calls and prints.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import time
from pathlib import Path


PLAIN_BUCKETS = "0,2,4,8,16,32"  # calibrate --method plain
COMPILE_CACHE_BYTES = 2 << 30  # the compile cache's size; least recently used entries go first


def compile_cache_dir() -> Path:
    """Where the command line keeps compiled executables: ``xla/<host>`` under specjax's cache
    root (:func:`specjax.io.gguf.cache_dir`), ``<host>`` the machine's architecture and a digest
    of its CPU's feature flags, so an executable compiled for one CPU (AVX-512, say) is never
    offered to another that shares the cache directory."""
    from specjax.io.gguf import cache_dir

    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return cache_dir() / "xla" / f"{platform.machine()}-{digest}"


def _use_compile_cache():
    """Points JAX's persistent compilation cache at :func:`compile_cache_dir`, so a command
    that compiled a configuration once (a generation, a benchmark's methods, a calibration)
    loads it on later runs instead of compiling again. Left alone where JAX already has a cache
    directory (``JAX_COMPILATION_CACHE_DIR``) or ``SPECJAX_COMPILE_CACHE=0``, and off where the
    directory cannot be made or written (JAX would warn at every compile).

    Returns:
      the cache directory in use, or None.
    """
    import jax

    if os.environ.get("SPECJAX_COMPILE_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
        return None
    where = compile_cache_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(where, os.W_OK | os.X_OK):
        return None
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
    return where


def _add_drafter_options(group):
    """The options that size and load a drafter (``generate`` and ``calibrate`` share them, so
    a table ``calibrate`` measures is the one ``generate`` reads)."""
    group.add_argument("--draft-len", type=int, default=4,
                       help="drafts per branch per cycle (default: %(default)s)")
    group.add_argument("--branches", type=int, default=1,
                       help="n-gram match chains per cycle, a tree when > 1 (default: "
                            "%(default)s)")
    group.add_argument("--draft-layers", type=int, default=4,
                       help="target layers the self-speculative draft model keeps (default: "
                            "%(default)s)")
    group.add_argument("--drafter", default=None,
                       help="an EAGLE or DFlash drafter directory in the official layout "
                            "(config.json + model.safetensors or pytorch_model.bin; ours or a "
                            "released one); default: the drafter shipped for --model in "
                            "checkpoints/")
    group.add_argument("--tree", choices=("dynamic", "chain", "sampled-chain"),
                       default="dynamic",
                       help="EAGLE drafting: an EAGLE-2 dynamic tree, a top-1 chain of "
                            "--draft-len, or a chain sampled from the drafter (default: "
                            "%(default)s)")
    group.add_argument("--tree-nodes", type=int, default=16,
                       help="dynamic tree or DDTree size, root included (default: %(default)s)")
    group.add_argument("--tree-depth", type=int, default=5,
                       help="dynamic tree draft calls per cycle (default: %(default)s)")
    group.add_argument("--tree-top-k", type=int, default=4,
                       help="dynamic tree children per expanded node (default: %(default)s)")
    group.add_argument("--block", type=int, default=None,
                       help="DFlash: the block drafted per pass, root included (default: the "
                            "drafter's trained block size)")
    group.add_argument("--draft-vocab", type=_draft_vocab, default=None, metavar="VD|full",
                       help="DFlash and EAGLE-1: draft from the VD most frequent ids of the "
                            "drafter's token_order only, a head VD wide instead of the "
                            "target's vocabulary, or from all ids (full) (default: a DFlash "
                            "drafter's draft_vocab_size from its config.json, else full)")
    group.add_argument("--draft-sample", action="store_true",
                       help="DFlash chain at temperature > 0: draw each position from the "
                            "drafter's processed marginal and verify with it as q, instead of "
                            "proposing the argmax")


def _add_generate(sub):
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a reply to each --prompt (a chat turn, unless --raw) with one "
                    "compiled call per request, then print the text and the throughput.",
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="a known model name, an HF checkpoint directory, or a .gguf file "
                        "(default: %(default)s)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat for a batch")
    p.add_argument("--system", default=None,
                   help="system message (default: the model's own chat template default)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights, activations and KV cache dtype (default: %(default)s)")
    p.add_argument("--cache-size", type=int, default=None,
                   help="KV cache slots per row (default: just enough)")
    spec = p.add_argument_group("speculative decoding (lossless: greedy output is unchanged)")
    spec.add_argument("--method", choices=("plain", "ngram", "draft-model", "eagle3", "eagle1",
                                           "dflash", "ddtree"),
                      default="plain",
                      help="plain decoding, prompt-lookup drafting, a draft model made of the "
                           "target's first --draft-layers layers, an EAGLE drafter, a DFlash "
                           "block drafter (a chain) or a DDTree over its block (default: "
                           "%(default)s)")
    _add_drafter_options(spec)
    spec.add_argument("--fixed-budget", action="store_true",
                      help="verify every drafted node each cycle, instead of the cost-aware "
                           "harness (which, by default, verifies only as many nodes as the "
                           "drafter's confidences say pay on this machine, and stops drafting "
                           "while drafting does not pay)")
    spec.add_argument("--cost-table", default=None, metavar="PATH",
                      help="the cost-aware harness's cost table (JSON): read if it matches, "
                           "else measured and written there (default: one measured on first "
                           "use and kept under $SPECJAX_CACHE_DIR or ~/.cache/specjax)")
    p.set_defaults(func=_generate)


def _eagle_weights(args, cfg, params):
    """(EAGLE config, drafter params, draft vocabulary) from --drafter or the shipped drafter
    of --method, and --draft-vocab (EAGLE-1 only)."""
    from specjax.drafters import eagle
    from specjax.io import official
    from specjax.io.models import shipped_drafter
    from specjax.targets import DecoderTarget

    path = Path(args.drafter) if args.drafter else shipped_drafter(args.model, args.method)
    dcfg, own = official.load_eagle(path, cfg, dtype=cfg.dtype)
    if dcfg.version != int(args.method[-1]):
        raise ValueError(f"{path} holds an EAGLE-{dcfg.version} drafter, not {args.method}")
    vocab = eagle.resolve_vocab(dcfg, args.draft_vocab)
    return dcfg, eagle.drafter_params(own, params, target=DecoderTarget(cfg), vocab=vocab), vocab


def _draft_vocab(text: str) -> int | str:
    """``--draft-vocab``: ``full`` or a positive size."""
    if text == "full":
        return text
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected 'full' or a positive size, got {text!r}")
    return size


def _dflash_weights(args, cfg, params):
    """(DFlash config, drafter params, draft vocabulary) from --drafter or the shipped DFlash
    drafter, and --draft-vocab."""
    from specjax.drafters import dflash
    from specjax.io import official
    from specjax.io.models import shipped_drafter
    from specjax.targets import DecoderTarget

    path = Path(args.drafter) if args.drafter else shipped_drafter(args.model, "dflash")
    dcfg, own = official.load_dflash(path, cfg, dtype=cfg.dtype)
    vocab = dflash.resolve_vocab(dcfg, args.draft_vocab)
    return dcfg, dflash.drafter_params(own, params, target=DecoderTarget(cfg),
                                       vocab=vocab), vocab


def _eagle_drafter(args, cfg, params):
    from specjax.drafters import eagle
    from specjax.targets import DecoderTarget
    from specjax.tree import StaticTree

    dcfg, dp, vocab = _eagle_weights(args, cfg, params)
    policy = {"dynamic": lambda: eagle.DynamicTree(args.tree_nodes, args.tree_depth,
                                                   args.tree_top_k),
              "chain": lambda: StaticTree.chain(args.draft_len + 1),
              "sampled-chain": lambda: eagle.SampledChain(args.draft_len)}[args.tree]()
    return eagle.EagleDrafter(dcfg, DecoderTarget(cfg), policy, vocab), dp


def _dflash_drafter(args, cfg, params):
    from specjax.drafters import dflash
    from specjax.targets import DecoderTarget

    dcfg, dp, vocab = _dflash_weights(args, cfg, params)
    if args.method == "ddtree":
        policy = dflash.DDTree(args.tree_nodes)
    else:
        policy = dflash.SampledBlock() if args.draft_sample else dflash.BlockChain()
    return dflash.DFlashDrafter(dcfg, DecoderTarget(cfg), policy, args.block, vocab), dp


def make_drafter(args, cfg, params):
    """The (drafter, drafter params) that ``--method`` names; (None, None) for plain."""
    if args.method == "ngram":
        from specjax.drafters.ngram import NgramDrafter

        return NgramDrafter(draft_len=args.draft_len, branches=args.branches), None
    if args.method == "draft-model":
        from specjax.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_target_layers(cfg, params, args.draft_layers, args.draft_len)
    if args.method in ("eagle3", "eagle1"):
        return _eagle_drafter(args, cfg, params)
    if args.method in ("dflash", "ddtree"):
        return _dflash_drafter(args, cfg, params)
    return None, None


def _calibrate(args) -> int:
    import jax
    from tqdm import tqdm

    from specjax import calibrate, harness
    from specjax.io.models import load

    out = Path(args.out)
    if args.method != "plain":
        if args.buckets is not None:
            print("error: --buckets is for --method plain; a drafter's table has the buckets "
                  "of its size, as 'specjax generate' verifies it (--draft-len, --tree-nodes, "
                  "--block)", file=sys.stderr)
            return 2
        model = load(args.model, dtype=args.dtype)
        drafter, drafter_params = make_drafter(args, model.cfg, model.params)
        table, measured = _drafter_table(args, model, drafter, drafter_params, batch=args.batch,
                                         context=args.context, path=out, reuse=not args.force)
        if not measured:
            print(f"{out} already holds this table (--force to measure again)", file=sys.stderr)
        print(format_cost_table(table))
        return 0
    buckets = sorted({int(n) for n in (args.buckets or PLAIN_BUCKETS).split(",")})
    key = dict(model=args.model, method=args.method)
    if out.exists() and not args.force:
        table = harness.CostTable.from_json(out.read_text())
        now = dict(key, **calibrate.machine_key(), dtype=args.dtype, batch=args.batch,
                   context=args.context, method_version=calibrate.METHOD_VERSION)
        if table.matches(now) and list(table.buckets) == buckets:
            print(f"{out} already holds this table (--force to measure again)", file=sys.stderr)
            print(format_cost_table(table))
            return 0
    model = load(args.model, dtype=args.dtype)
    with tqdm(total=len({1, *(n for n in buckets if n)}), unit="point",
              desc="calibrate plain") as bar:
        def progress(stage, n, seconds):
            bar.set_postfix_str(f"{stage} N={n}: {seconds * 1e3:.1f} ms")
            bar.update()

        table = calibrate.measure_cost_table(model.cfg, model.params, buckets, batch=args.batch,
                                             context=args.context, key=key, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table.to_json())
    print(format_cost_table(table))
    return 0


def format_cost_table(table) -> str:
    """The table as aligned text: one line per bucket, with its expected-token break-even."""
    lines = [f"{'budget':>6s} {'verify ms':>10s} {'draft ms':>9s} {'cycle ms':>9s} "
             f"{'break-even tau':>15s}"]
    step = table.cycle_s[0] if table.buckets[0] == 0 else None
    for n, v, d, c in zip(table.buckets, table.verify_s, table.draft_s, table.cycle_s):
        even = "" if step is None else f"{c / step:.2f}"
        lines.append(f"{'plain' if n == 0 else n:>6} {v * 1e3:10.1f} {d * 1e3:9.1f} "
                     f"{c * 1e3:9.1f} {even:>15s}")
    return "\n".join(lines)


def _add_calibrate(sub):
    p = sub.add_parser(
        "calibrate",
        help="measure verify and draft costs per budget into a JSON table",
        description="Measure, on this machine, what a cycle costs at each budget bucket N "
                    "(0 = a plain step) into a cost table (JSON), reused while machine, model, "
                    "dtype, batch, context and drafter options stay the same. With a drafter "
                    "the largest bucket's cycle and the plain step are timed inside the "
                    "decoding loop and "
                    "the smaller buckets scaled from it by the verify curve (verify = the "
                    "cycle less the drafting); "
                    "with --method plain, the verify passes T_verify(N) alone. The break-even "
                    "tau of a bucket is its cycle time in plain steps: a drafter must average "
                    "more tokens per cycle than that to pay.",
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="a known model name, an HF checkpoint directory, or a .gguf file "
                        "(default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--method", choices=("plain", "ngram", "draft-model", "eagle3", "eagle1",
                                        "dflash", "ddtree"), default="plain",
                   help="the drafter whose costs are measured, built from the drafter options "
                        "below as 'specjax generate' builds it (plain: verify costs only; "
                        "default: %(default)s)")
    p.add_argument("--buckets", default=None,
                   help="--method plain: budgets N, root included; 0 = a plain step (default: "
                        f"{PLAIN_BUCKETS}). A drafter's buckets follow its size: a plain "
                        "step, the powers of two below it from 2, and its whole proposal")
    p.add_argument("--batch", type=int, default=1, help="rows per pass (default: %(default)s)")
    p.add_argument("--context", type=int, default=256,
                   help="committed tokens in the cache; 'specjax generate' reads a table "
                        "measured at its request's mid-generation length rounded up to a "
                        "power of two, at least 256 (default: %(default)s)")
    _add_drafter_options(p.add_argument_group("drafter (as 'specjax generate' takes it)"))
    p.add_argument("--out", required=True,
                   help="the JSON table to write ('specjax generate --cost-table' reads it)")
    p.add_argument("--force", action="store_true", help="measure even if --out already matches")
    p.set_defaults(func=_calibrate)


def _generate(args) -> int:
    from specjax import api
    from specjax.io.models import load

    t0 = time.perf_counter()
    model = load(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    tok = model.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer files; specjax generate needs text I/O",
              file=sys.stderr)
        return 2
    ids = []
    for prompt in args.prompt:
        if args.raw:
            ids.append(tok.encode(prompt))
        else:
            # A chat template spells out its own special tokens (BOS included), so they must
            # not be added again.
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": prompt})
            ids.append(tok.encode_chat(messages))
    drafter, drafter_params = make_drafter(args, model.cfg, model.params)
    budget = None
    if drafter is not None and not args.fixed_budget:
        budget = _cost_aware_budget(args, model, drafter, drafter_params,
                                    max(map(len, ids)), len(ids))
    result = api.generate_tokens(
        model.cfg, model.params, ids, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop_tokens=tok.eos_ids, cache_size=args.cache_size, drafter=drafter,
        drafter_params=drafter_params, budget=budget)
    for i, out in enumerate(result.tokens):
        body = out[:-1] if result.stopped[i] else out
        if len(ids) > 1:
            print(f"--- [{i}]")
        print(tok.decode(body))
    print(f"[{result.n_tokens} tokens in {result.run_s:.2f} s = "
          f"{result.n_tokens / result.run_s:.1f} tok/s (prefill included); "
          f"load {load_s:.1f} s, compile {result.compile_s:.1f} s]", file=sys.stderr)
    if result.stats is not None:
        st = result.stats
        print(f"[{args.method}: {int(st.cycles.sum())} verify cycles, tau = {result.tau:.2f} "
              f"tokens/cycle, {int(st.fallbacks.sum())} fallbacks"
              + ("" if budget is None else
                 f"; cost-aware: drafted in {int(st.drafted.sum())} cycles, "
                 f"{st.verified.sum() / max(int(st.cycles.sum()), 1):.1f} nodes verified per "
                 "cycle") + "]", file=sys.stderr)
    return 0


def _cost_aware_budget(args, model, drafter, drafter_params, prompt_tokens: int, batch: int):
    """The harness's budget for this request: the cost table of ``drafter`` at this batch and
    context (cached, or measured now with a progress bar)."""
    from specjax import calibrate

    table, measured = _drafter_table(
        args, model, drafter, drafter_params, batch=batch,
        context=calibrate.cost_context(prompt_tokens, args.max_new_tokens),
        path=Path(args.cost_table) if args.cost_table else None)
    if measured:
        print(format_cost_table(table), file=sys.stderr)
    return table.budget()


def _drafter_table(args, model, drafter, drafter_params, *, batch: int, context: int,
                   path: Path | None, reuse: bool = True):
    """``(table, measured)``: the cost table of ``drafter`` (built from the drafter options)
    at ``batch`` and ``context``, read from ``path`` (default: specjax's cache) when it was
    measured for the same key, else measured with a progress bar and written there; a table
    at an explicit ``path`` measured for other settings is replaced, with a note saying why.
    ``reuse=False`` measures anyway."""
    from tqdm import tqdm

    from specjax import calibrate

    key = dict(model=args.model, method=args.method, drafter=repr(drafter))
    buckets = calibrate.budget_buckets(drafter.n_nodes)

    def replacing(why):
        print(f"note: {path} holds no cost table for these settings ({why}): measuring it "
              "again there", file=sys.stderr)

    bar = None

    def progress(stage, n, seconds):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=calibrate.loop_table_points(buckets), unit="point",
                       desc="measuring costs (once per machine and setting)", file=sys.stderr)
        bar.set_postfix_str(f"{stage} N={n}: {seconds * 1e3:.1f} ms")
        bar.update()

    table, measured = calibrate.drafter_cost_table(
        model.cfg, model.params, drafter, drafter_params, batch=batch, context=context,
        key=key, path=path, progress=progress, reuse=reuse,
        replacing=None if path is None else replacing)
    if bar is not None:
        bar.close()
    return table, measured


def _task_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        return (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI, e.g. 11-510, got {text!r}") from None


def _add_data(sub):
    p = sub.add_parser("data", help="build drafter training data",
                       description="Build drafter training data.")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    d = data_sub.add_parser(
        "distill", help="the target answers training prompts; its responses become records",
        description="Self-distillation (specjax.train.distill): the target generates its own "
                    "responses to JSONL prompts, written as shards of token-id records to --out. "
                    "Restarting the same command resumes, with the same bytes as an "
                    "uninterrupted run; prompts overlapping an evaluation set are refused.")
    d.add_argument("--input", action="append", required=True, metavar="PATH[:FIELD]",
                   help="a JSONL prompt file, optionally with the field holding each prompt "
                        "(default: 'messages', else 'prompt'); repeat for several")
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument("--model", default="smollm2-135m",
                   help="the target: a known name, an HF directory or a .gguf (default: %(default)s)")
    d.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's dtype (default: %(default)s)")
    d.add_argument("--system", default=None,
                   help="system message (default: the chat template's own default)")
    d.add_argument("--exclude-task-ids", type=_task_range, default=None, metavar="LO-HI",
                   help="drop input lines whose task_id is in LO..HI (MBPP test: 11-510)")
    d.add_argument("--drop-eval-overlap", action="store_true",
                   help="drop prompts that overlap an evaluation set (listed in the manifest) "
                        "instead of refusing the run")
    d.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip longer formatted prompts (default: %(default)s)")
    d.add_argument("--max-prompts", type=int, default=None,
                   help="keep only this many prompts of the shuffled order (default: all)")
    d.add_argument("--max-new-tokens", type=int, default=384,
                   help="response tokens per prompt at most (default: %(default)s)")
    d.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    d.add_argument("--top-k", type=int, default=20, help="(default: %(default)s)")
    d.add_argument("--top-p", type=float, default=0.8, help="(default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    d.add_argument("--batch-size", type=int, default=32,
                   help="rows decoding at once, refilled as answers end (default: %(default)s)")
    d.add_argument("--chunk", type=int, default=32,
                   help="decode steps between refills of the rows (default: %(default)s)")
    d.add_argument("--shard-size", type=int, default=256,
                   help="prompts per shard file (default: %(default)s)")
    d.add_argument("--workers", type=int, default=1,
                   help="processes generating shards side by side, each with single-threaded "
                        "XLA; on XLA:CPU one per core beats one process's threads for a small "
                        "target. Not a setting: the bytes are the same (default: %(default)s)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=_distill)
    f = data_sub.add_parser(
        "fingerprints", help="rebuild the evaluation-set fingerprints",
        description="Hash the evaluation sets under --bench-dir (MT-Bench, GSM8K test, "
                    "HumanEval, MBPP test, MATH-500) into the fingerprint file that "
                    "'data distill' checks prompts against.")
    f.add_argument("--bench-dir", required=True,
                   help="directory with mt_bench/, gsm8k/, humaneval/, mbpp/, math500/")
    f.add_argument("--out", default=None,
                   help="output file (default: the one shipped in the specjax package)")
    f.set_defaults(func=_fingerprints)
    st = data_sub.add_parser(
        "stats", help="sizes of a distilled data directory; optionally time tap extraction",
        description="Records, tokens and disk bytes per token of a distilled data directory. "
                    "With --measure-taps, also time the target's teacher-forced tap extraction "
                    "on packed batches of it, against the disk that storing those taps would "
                    "take (specjax.train.taps).")
    st.add_argument("dir", help="a 'data distill' output directory")
    st.add_argument("--measure-taps", action="store_true",
                    help="load the target named in the manifest and time tap extraction")
    st.add_argument("--taps", default="eagle3,dflash",
                    help="comma-separated tap sets: eagle3, eagle1, dflash (default: %(default)s)")
    st.add_argument("--seq-len", type=int, default=1024, help="packed row length (default: %(default)s)")
    st.add_argument("--batch-size", type=int, default=4, help="packed rows (default: %(default)s)")
    st.add_argument("--batches", type=int, default=3, help="timed batches (default: %(default)s)")
    st.set_defaults(func=_data_stats)
    r = data_sub.add_parser(
        "rank", help="give a DFlash or EAGLE-1 drafter a draft vocabulary ranked on "
                     "distilled data",
        description="Rank the target's ids by how often they occur as response tokens in a "
                    "distilled data directory and write the ranking (token_order) into a DFlash "
                    "or EAGLE-1 drafter directory, whose other tensors stay as they are: it can "
                    "then draft from its --draft-vocab most frequent ids. 'train dflash' writes "
                    "one into every drafter it exports.")
    r.add_argument("dir", help="a 'data distill' output directory for the drafter's target")
    r.add_argument("--drafter", required=True, help="a DFlash or EAGLE-1 drafter directory "
                                                    "(official layout, model.safetensors)")
    r.add_argument("--draft-vocab", type=int, default=None, metavar="VD",
                   help="DFlash: also make VD the drafter's default draft vocabulary "
                        "(config.json's draft_vocab_size)")
    r.set_defaults(func=_data_rank)


def _data_rank(args) -> int:
    from specjax.drafters import vocab
    from specjax.io import official
    from specjax.train import data

    recs = data.Records(args.dir)
    size = official.check_rankable(args.drafter, args.draft_vocab)  # before counting
    counts = data.token_counts(recs, size)
    out = official.set_token_order(args.drafter, vocab.frequency_order(counts),
                                   args.draft_vocab)
    seen = int((counts > 0).sum())
    print(f"{out}: token_order of {size} ids from {int(counts.sum())} response tokens of "
          f"{len(recs)} records ({seen} distinct ids seen; unseen ones rank last, by id)")
    return 0


def _data_stats(args) -> int:
    import json
    from pathlib import Path

    from specjax.train import data, taps

    recs = data.Records(args.dir)
    shard_bytes = sum(p.stat().st_size for p in Path(args.dir).glob("shard-*.npz"))
    resp = recs.n_response_tokens
    print(f"{args.dir}: {len(recs)} records in {recs.n_shards_read} shards, {recs.n_tokens} tokens ({resp} response tokens, "
          f"{int(recs.stopped.sum())} responses ended on a stop token), {shard_bytes / 1e6:.1f} MB "
          f"on disk = {shard_bytes / max(recs.n_tokens, 1):.2f} bytes per token")
    if not args.measure_taps:
        return 0
    from specjax.io.models import load

    manifest = json.loads((Path(args.dir) / data.MANIFEST).read_text())
    model = load(manifest["settings"]["target"], dtype=manifest["settings"]["dtype"])
    print(f"tap extraction, {args.batch_size} x {args.seq_len} packed rows, "
          f"{model.cfg.dtype}, stored taps in bfloat16:")
    print("| tap set | taps | extraction tokens/s | stored taps bytes/token | x the records |")
    print("|---|---|---|---|---|")
    for name in args.taps.split(","):
        ids = taps.tap_set(name, model.cfg.n_layers)
        m = taps.measure(model.cfg, model.params, recs, taps=ids, seq_len=args.seq_len,
                         batch_size=args.batch_size, batches=args.batches)
        ratio = m["tap_bytes_per_token"] / (shard_bytes / max(recs.n_tokens, 1))
        print(f"| {name} | {list(ids)} | {m['tokens_per_s']:.0f} | {m['tap_bytes_per_token']} | "
              f"{ratio:.0f}x |")
    return 0


def _distill(args) -> int:
    from specjax.train import distill

    cfg = distill.DistillConfig(
        inputs=tuple(distill.InputSpec.parse(s) for s in args.input), target=args.model,
        dtype=args.dtype, system=args.system, max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, batch_size=args.batch_size, chunk=args.chunk,
        shard_size=args.shard_size, max_prompts=args.max_prompts,
        exclude_task_ids=args.exclude_task_ids, drop_eval_overlap=args.drop_eval_overlap)
    manifest = distill.distill(cfg, args.out, progress=not args.no_progress,
                               workers=args.workers)
    s = manifest["settings"]
    print(f"{args.out}: {manifest['n_shards']} shards, {s['prompts']} prompts "
          f"({s['skipped_long_prompts']} longer than {s['max_prompt_tokens']} tokens skipped, "
          f"{len(s['dropped_eval_overlap'])} overlapping an evaluation set dropped), "
          f"{sum(x['response_tokens'] for x in manifest['shards'])} response tokens")
    return 0


def _fingerprints(args) -> int:
    from specjax.train import data

    fp = data.EvalFingerprints.build(args.bench_dir)
    out = args.out or data.FINGERPRINT_FILE
    fp.save(out)
    print(f"{out}: {len(fp.full)} texts, {len(fp.shingles)} {fp.shingle_words}-word shingles "
          f"from {', '.join(fp.names)}")
    return 0


def _train_args(p, lr: float = 3e-4):
    """The arguments every ``specjax train`` family shares."""
    p.add_argument("--target", default="smollm2-135m",
                   help="the target: a known name, an HF directory or a .gguf (default: %(default)s)")
    p.add_argument("--data", required=True, help="a 'specjax data distill' output directory")
    p.add_argument("--run-dir", required=True,
                   help="checkpoints, metrics.jsonl and metrics.png go here")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="packed rows per batch (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row (default: %(default)s)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=0.05,
                   help="fraction of the steps that warms up linearly (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="(default: %(default)s)")
    p.add_argument("--save-every", type=int, default=250, help="(default: %(default)s)")
    p.add_argument("--log-every", type=int, default=10, help="(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=250,
                   help="steps between evaluations, 0 for none (default: %(default)s)")
    p.add_argument("--dev-prompts", type=int, default=8,
                   help="records held out for evaluation (default: %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=64,
                   help="new tokens per dev prompt in an evaluation (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="batch order and training randomness (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_train(sub):
    p = sub.add_parser(
        "train", help="train a drafter on distilled records",
        description="Train a drafter on records distilled from its target ('specjax data "
                    "distill'). Restarting the same command resumes from the run directory's "
                    "latest checkpoint exactly; SIGTERM or Ctrl-C saves a checkpoint at the "
                    "current step and exits with 128 + the signal number.")
    families = p.add_subparsers(dest="family", required=True, metavar="FAMILY")
    d = families.add_parser(
        "draft-model", help="a draft model made of the target's first layers, its norm and head",
        description="Distill a self-speculative draft model: the target's first --layers "
                    "layers and its final norm train (cross-entropy on the target's own "
                    "responses), its embedding and head stay shared and frozen. The first "
                    "--dev-prompts records are held out (never trained on) and evaluated every "
                    "--eval-every steps by greedy speculative decoding: tau, tokens/s and "
                    "whether the output equals plain greedy.")
    d.add_argument("--layers", type=int, default=4,
                   help="target layers the draft model keeps (default: %(default)s)")
    d.add_argument("--draft-len", type=int, default=4,
                   help="drafts per cycle in an evaluation (default: %(default)s)")
    _train_args(d)
    d.set_defaults(func=_train_draft_model)
    for version in (3, 1):
        e = families.add_parser(
            f"eagle{version}", help=f"an EAGLE-{version} drafter: one layer over the target's "
            + ("fused low/mid/high features, training-time test" if version == 3 else
               "final features, feature regression"),
            description=(
                "Train EAGLE-3: one decoder layer over the target's residual streams entering "
                "layers 2, L//2 and L-3, its own head over a reduced vocabulary of the "
                "records' most frequent response tokens, trained by the training-time test "
                "(--ttt-steps unrolled draft steps weighted 0.8^s, soft labels from the "
                "target's own distribution)." if version == 3 else
                "Train EAGLE-1: one decoder layer over the target's final normed features, "
                "SmoothL1 on the next feature plus 0.1 x cross-entropy through the target's "
                "head.") + " The target stays frozen and runs teacher-forced every step. The "
                "first --dev-prompts records are held out and decoded every --eval-every steps "
                "by greedy speculative decoding with an EAGLE-2 dynamic tree: tau, tokens/s "
                "and whether the output equals plain greedy.")
        if version == 3:
            e.add_argument("--draft-vocab", type=int, default=None,
                           help="draft vocabulary size (default: 8192, or --init's)")
            e.add_argument("--ttt-steps", type=int, default=7,
                           help="unrolled training-time-test steps (default: %(default)s)")
        e.add_argument("--init", metavar="DRAFTER_DIR", default=None,
                       help="start from this official-layout drafter's weights (a shipped "
                            "one, say) instead of fresh ones; the optimizer starts afresh")
        e.add_argument("--tree-nodes", type=int, default=16,
                       help="dynamic tree size in an evaluation, root included (default: "
                            "%(default)s)")
        e.add_argument("--tree-depth", type=int, default=5,
                       help="draft calls per cycle in an evaluation (default: %(default)s)")
        e.add_argument("--tree-top-k", type=int, default=4,
                       help="children per expanded node in an evaluation (default: %(default)s)")
        _train_args(e, lr=1e-3)
        e.set_defaults(func=_train_eagle, version=version)
    f = families.add_parser(
        "dflash", help="a DFlash block drafter: target features injected into every layer's K/V",
        description="Train DFlash: --layers draft layers over the fused outputs of --taps "
                    "target layers (the reference's default rule), injected into every draft "
                    "layer's keys/values; blocks of --block-size ([anchor, mask...]) at up to "
                    "--anchors random anchors per row, trained in one pass, cross-entropy on "
                    "the target's own responses weighted exp(-(k-1)/gamma) by block position "
                    "(or D-PACE). The target's embedding and head are shared and frozen; the "
                    "target runs teacher-forced every step. The first --dev-prompts records "
                    "are held out and decoded every --eval-every steps by greedy speculative "
                    "decoding with the block chain: tau, tokens/s and whether the output "
                    "equals plain greedy.")
    f.add_argument("--layers", type=int, default=None,
                   help="draft layers (default: 1, or --init's; more than --init's appends "
                        "layers that start out adding nothing)")
    f.add_argument("--block-size", type=int, default=None,
                   help="block size, anchor included (default: 16)")
    f.add_argument("--taps", type=int, default=None,
                   help="target layers fused into the context (default: 5)")
    f.add_argument("--mask-token", default=None,
                   help="a target token id whose frozen embedding fills the masks, or 'learned' "
                        "for a trained mask embedding (default: learned)")
    f.add_argument("--init", metavar="DRAFTER_DIR", default=None,
                   help="start from this official-layout drafter's weights (a shipped one, say) "
                        "instead of fresh ones, in its shape (the four options above may only "
                        "repeat it); the optimizer starts afresh")
    f.add_argument("--anchors", type=int, default=64,
                   help="random anchors per packed row (default: %(default)s)")
    f.add_argument("--gamma", type=float, default=None,
                   help="position decay of the loss (default: 7 / 5 / 4 for block 16 / 10 / 8)")
    f.add_argument("--dpace", action="store_true",
                   help="adaptive D-PACE position weights instead of the decay")
    f.add_argument("--scored", type=int, default=None, metavar="K",
                   help="score block positions 1..K only (the head over the block is most of "
                        "a step; default: all of them)")
    f.add_argument("--draft-vocab", type=int, default=None, metavar="VD",
                   help="train the head's softmax over the VD most frequent ids of the "
                        "trained-on response tokens, the ids the exported drafter then drafts "
                        "from by default (a head VD wide instead of the target's; default: the "
                        "whole vocabulary, as the reference trains)")
    _train_args(f, lr=6e-4)
    f.set_defaults(func=_train_dflash, warmup=0.04)


def _train_draft_model(args) -> int:
    from specjax.train import draft_model

    cfg, model, dev, train_records, source = _train_inputs(args)
    result, _, _ = draft_model.train(
        model.cfg, model.params, source, cfg, layers=args.layers, dev_prompts=dev,
        draft_len=args.draft_len, eval_tokens=args.eval_tokens,
        stop_tokens=model.tokenizer.eos_ids if model.tokenizer else (),
        progress=not args.no_progress)
    return _train_done(args, result)


def _train_eagle(args) -> int:
    from specjax.drafters.eagle import DynamicTree
    from specjax.train import eagle

    cfg, model, dev, train_records, source = _train_inputs(args)
    init = None
    if args.init is not None:
        from specjax.io import official

        init = official.load_eagle(args.init, model.cfg)
    extra = {}
    if args.version == 3:
        vocab = args.draft_vocab
        if vocab is None and init is None:
            vocab = 8192
        extra = dict(draft_vocab_size=None if vocab is None else min(vocab, model.cfg.vocab_size),
                     ttt_steps=args.ttt_steps)
    result, drafter, own = eagle.train(
        model.cfg, model.params, train_records, source, cfg, version=args.version,
        policy=DynamicTree(args.tree_nodes, args.tree_depth, args.tree_top_k), dev_prompts=dev,
        eval_tokens=args.eval_tokens, seed=args.seed, init=init,
        stop_tokens=model.tokenizer.eos_ids if model.tokenizer else (),
        progress=not args.no_progress, **extra)
    if not result.signal:
        from specjax.io import official

        out = official.save_eagle(drafter.cfg, own, Path(args.run_dir) / "drafter",
                                  dtype="bfloat16")
        print(f"{out}: the trained drafter in the official layout (bfloat16); use it with "
              f"'specjax generate --method eagle{args.version} --drafter {out}'", file=sys.stderr)
    return _train_done(args, result)


def _train_dflash(args) -> int:
    from specjax.drafters import dflash as dflash_drafter
    from specjax.drafters import vocab
    from specjax.io import official
    from specjax.train import data, dflash

    cfg, model, dev, records, source = _train_inputs(args)
    mask = None if args.mask_token in (None, "learned") else int(args.mask_token)
    init = None
    if args.init is None:
        def given(value, default):
            return default if value is None else value

        dcfg = dflash_drafter.DFlashConfig.for_target(
            model.cfg, n_layers=given(args.layers, 1), block_size=given(args.block_size, 16),
            mask_token_id=mask, n_taps=given(args.taps, 5))
    else:
        dcfg, init = official.load_dflash(args.init, model.cfg)
        init.pop("token_order", None)  # the export ranks this run's records afresh
        if args.layers is not None and args.layers > dcfg.layer.n_layers:
            print(f"deepening the initial drafter from {dcfg.layer.n_layers} to {args.layers} "
                  "layers (copies of its last, output projections zeroed)", file=sys.stderr)
            dcfg, init = dflash_drafter.deepen(dcfg, init, args.layers)
        for name, given, want, have in (
                ("layers", args.layers, args.layers, dcfg.layer.n_layers),
                ("block-size", args.block_size, args.block_size, dcfg.block_size),
                ("taps", args.taps, args.taps, len(dcfg.target_layer_ids)),
                ("mask-token", args.mask_token, mask, dcfg.mask_token_id)):
            if given is not None and want != have:
                raise ValueError(f"--{name} {given} differs from the initial drafter's "
                                 f"{'learned' if have is None else have}; a warm start keeps "
                                 "its shape (it may only add layers)")
    # The trained-on records' ranking: the export's token_order and any --draft-vocab's ids.
    order = vocab.frequency_order(data.token_counts(records, model.cfg.vocab_size))
    result, drafter, own = dflash.train(
        model.cfg, model.params, source, cfg, dcfg,
        recipe=dflash.Recipe(n_anchors=args.anchors, gamma=args.gamma, dpace=args.dpace,
                             scored=args.scored, draft_vocab=args.draft_vocab),
        dev_prompts=dev, eval_tokens=args.eval_tokens, seed=args.seed, init=init,
        token_order=order, stop_tokens=model.tokenizer.eos_ids if model.tokenizer else (),
        progress=not args.no_progress)
    if not result.signal:
        out = official.save_dflash(drafter.cfg, own, Path(args.run_dir) / "drafter",
                                   dtype="bfloat16")
        print(f"{out}: the trained drafter in the official layout (bfloat16); use it with "
              f"'specjax generate --method dflash --drafter {out}'", file=sys.stderr)
    return _train_done(args, result)


def _train_inputs(args):
    """``(train config, loaded target, dev prompts, training records, packed source)``."""
    from specjax.io.models import load
    from specjax.train import data, evaluate, loop

    model = load(args.target)
    dev, train_records = evaluate.hold_out(data.Records(args.data), args.dev_prompts)
    source = loop.PackedSource(train_records, seq_len=args.seq_len, batch_size=args.batch,
                               seed=args.seed)
    return _train_config(args), model, dev, train_records, source


def _train_config(args):
    from specjax.train import loop

    return loop.TrainConfig(run_dir=args.run_dir, steps=args.steps, lr=args.lr,
                            warmup_frac=args.warmup, weight_decay=args.weight_decay,
                            save_every=args.save_every, eval_every=args.eval_every,
                            log_every=args.log_every, seed=args.seed)


def _train_done(args, result) -> int:
    how = (f"stopped by signal {result.signal}; rerun the same command to resume"
           if result.signal else "done")
    print(f"{args.run_dir}: step {result.step} of {args.steps}, {how}", file=sys.stderr)
    return 128 + result.signal if result.signal else 0


QUICK = dict(methods="plain,ngram,dflash", per_set=1, temperatures="0", batch_sizes="1",
             max_new_tokens=64, repeats=1)


def _add_bench(sub):
    p = sub.add_parser(
        "bench",
        help="benchmark decoding methods on prompt sets (speedup over plain, tau, latency)",
        description="Run decoding methods x prompt sets x temperatures x batch sizes on this "
                    "machine, plain decoding measured beside each: time to first token, time "
                    "per output token p50/p95/p99, tokens/s and speedup, tau and acceptance by "
                    "position, draft/verify/other time per cycle, peak memory. Writes "
                    "records.jsonl, table.md and bench.png to --out and prints the table. "
                    "Prompts: the built-in suite (code, math, chat, long-context "
                    "summarization and retrieval) unless --prompts is given.",
    )
    p.add_argument("--quick", action="store_true",
                   help="the built-in default for a first look: plain, n-gram and the "
                        "shipped DFlash drafter, fixed and cost-aware, one prompt per set, T=0, "
                        "batch 1, 64 new tokens, one timed run per request (about 14 minutes on "
                        "a 2-core CPU the first time, compiles and cost tables included, 6 once "
                        "both are cached)")
    p.add_argument("--model", default="smollm2-135m",
                   help="a known model name, an HF checkpoint directory, or a .gguf file "
                        "(default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--reference-dtype", choices=("float32", "bfloat16"), default=None,
                   help="also time plain decoding of the model at this precision beside every "
                        "cell (a 'vs <dtype> plain' column): whether a method at --dtype beats "
                        "the fastest plain decoding at any precision")
    p.add_argument("--methods", default="plain,ngram,draft-model,eagle3,dflash,ddtree",
                   help="comma-separated: plain, ngram, draft-model, eagle3, eagle1, dflash, "
                        "ddtree (default: %(default)s; EAGLE and DFlash use the shipped "
                        "drafters unless --eagle-drafter/--dflash-drafter)")
    p.add_argument("--harness", choices=("both", "fixed", "harness"), default="both",
                   help="each drafter at its fixed budget, under the cost-aware harness, or "
                        "both (default: %(default)s)")
    p.add_argument("--prompts", action="append", default=None, metavar="FILE",
                   help="a JSONL prompt file in the MT-Bench question format ('turns' and "
                        "'category'); repeatable; replaces the built-in suite")
    p.add_argument("--sets", default=None,
                   help="comma-separated prompt sets (categories) to run (default: all)")
    p.add_argument("--per-set", type=int, default=None,
                   help="prompts per set (category) at most (default: all)")
    p.add_argument("--temperatures", default="0", help="comma-separated (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated (default: %(default)s)")
    p.add_argument("--contexts", default=None,
                   help="context lengths in tokens, comma-separated: each prompt behind "
                        "background text up to that length (0: the prompts as they are; "
                        "default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per request, the fastest kept (default: %(default)s)")
    p.add_argument("--draft-len", default="4",
                   help="n-gram and draft-model chain lengths, comma-separated: one fixed "
                        "budget each, the cost-aware twin at the longest (default: %(default)s)")
    p.add_argument("--draft-layers", type=int, default=4,
                   help="draft-model: target layers kept (default: %(default)s)")
    p.add_argument("--tree-nodes", default="16",
                   help="EAGLE dynamic tree and DDTree sizes, comma-separated (default: "
                        "%(default)s)")
    p.add_argument("--block", default=None,
                   help="DFlash chain blocks, comma-separated (default: the drafter's trained "
                        "one)")
    p.add_argument("--draft-vocab", type=_draft_vocab, default=None, metavar="VD|full",
                   help="DFlash, DDTree and EAGLE-1 draft from the drafter's VD most "
                        "frequent ids, or from all (full) (default: a DFlash drafter's "
                        "draft_vocab_size, else full)")
    p.add_argument("--eagle-drafter", default=None, help="EAGLE drafter directory")
    p.add_argument("--dflash-drafter", default=None, help="DFlash drafter directory")
    p.add_argument("--out", default="bench_out/bench", help="output directory (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from tqdm import tqdm

    from specjax import report, suite, sweep
    from specjax.io.models import load

    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.reference_dtype == args.dtype:
        raise ValueError(f"--reference-dtype {args.reference_dtype} is the sweep's own --dtype; "
                         "its plain decoding is already the speedup's baseline")
    model = load(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer files; specjax bench needs text prompts")
    reference = load(args.model, dtype=args.reference_dtype) if args.reference_dtype else None
    if args.prompts:
        sets = {}
        for f in args.prompts:
            sets |= suite.mt_bench_file(f, args.per_set)
    else:
        sets = suite.builtin(args.per_set)
    if args.sets:
        want = [x.strip() for x in args.sets.split(",")]
        missing = [x for x in want if x not in sets]
        if missing:
            raise ValueError(f"no prompt set {missing[0]!r}; the prompts have {sorted(sets)}")
        sets = {x: sets[x] for x in want}
    methods = []
    for name in args.methods.split(","):
        try:
            methods += sweep.methods(
                model, [name.strip()], model_name=args.model, cost_aware=args.harness,
                draft_lens=_ints(args.draft_len), draft_layers=args.draft_layers,
                tree_nodes=_ints(args.tree_nodes),
                blocks=_ints(args.block) if args.block else (None,),
                eagle_dir=args.eagle_drafter, dflash_dir=args.dflash_drafter,
                draft_vocab=args.draft_vocab)
        except ValueError as e:
            if not args.quick:
                raise
            print(f"skipping {name}: {e}", file=sys.stderr)
    temps = [float(t) for t in args.temperatures.split(",")]
    batches = _ints(args.batch_sizes)
    contexts = [c or None for c in _ints(args.contexts)] if args.contexts else [None]
    n_methods = len(methods) + (not any(m.drafter is None for m in methods))
    cells = n_methods * len(sets) * len(temps) * len(batches) * len(contexts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=cells, unit="cell", desc="bench", disable=args.no_progress,
              file=sys.stderr) as bar, open(out / "records.jsonl", "w") as sink:
        def progress(cell):
            bar.set_postfix_str(cell)
            bar.update()

        records = sweep.run(model, sets, methods, temperatures=temps, batches=batches,
                            contexts=contexts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                            model_name=args.model, reference=reference, progress=progress,
                            stage=bar.set_postfix_str,
                            on_record=lambda r: report.append_jsonl(r, sink))
    table = report.markdown(records)
    (out / "table.md").write_text(table + "\n\n" + report.summary(records) + "\n")
    report.plot(records, out / "bench.png")
    print(f"specjax {' '.join(args.argv)}\n")
    print(table)
    print()
    print(report.summary(records))
    print(f"\n[{len(records)} cells; records.jsonl, table.md and bench.png in {out}]",
          file=sys.stderr)
    return 0


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers."""
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specjax",
        description="Lossless speculative decoding in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_calibrate(sub)
    _add_bench(sub)
    _add_data(sub)
    _add_train(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    _use_compile_cache()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
