"""The ``specjax`` command line.

    specjax generate --model smollm2-135m --prompt "What is the capital of France?"

Each subcommand is a thin wrapper over library functions; it parses, calls and prints.
"""

from __future__ import annotations

import argparse
import sys
import time


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
    spec.add_argument("--method", choices=("plain", "ngram", "draft-model"), default="plain",
                      help="plain decoding, prompt-lookup drafting, or a draft model made of "
                           "the target's first --draft-layers layers (default: %(default)s)")
    spec.add_argument("--draft-len", type=int, default=4, help="drafts per branch per cycle (default: %(default)s)")
    spec.add_argument("--branches", type=int, default=1,
                      help="n-gram match chains per cycle, a tree when > 1 (default: %(default)s)")
    spec.add_argument("--draft-layers", type=int, default=4,
                      help="target layers the self-speculative draft model keeps (default: %(default)s)")
    p.set_defaults(func=_generate)


def make_drafter(args, cfg, params):
    """The (drafter, drafter params) that ``--method`` names; (None, None) for plain."""
    if args.method == "ngram":
        from specjax.drafters.ngram import NgramDrafter

        return NgramDrafter(draft_len=args.draft_len, branches=args.branches), None
    if args.method == "draft-model":
        from specjax.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_target_layers(cfg, params, args.draft_layers, args.draft_len)
    return None, None


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
    result = api.generate_tokens(
        model.cfg, model.params, ids, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop_tokens=tok.eos_ids, cache_size=args.cache_size, drafter=drafter,
        drafter_params=drafter_params)
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
              f"tokens/cycle, {int(st.fallbacks.sum())} fallbacks]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specjax",
        description="Lossless speculative decoding in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
