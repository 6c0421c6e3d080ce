"""GPU check of the Pallas kernels at real sizes: correctness, speed against XLA, bandwidth,
and what the tree-attention kernel does to a verify pass.

Run on one NVIDIA GPU (sized for under 8 minutes on an H200; not yet run on one)::

    python -m specjax.kernel_bench

On random weights of a Qwen3-8B-shaped target (36 layers, width 4096, 32 query / 8 key-value
heads of 128, SwiGLU 12288, vocabulary 151936, bfloat16) and a DFlash drafter of that width
(5 layers), it prints:

1. **Tree attention** at contexts ``--contexts`` and trees of ``--nodes`` nodes: the largest
   difference from the reference (computed in float32), the kernel's time and XLA's dense path's
   (the reference, jitted), the speedup, and the achieved memory bandwidth (the committed
   cache's keys and values read once) as a fraction of ``--hbm-gb-s``.
2. **KV injection** of a cycle's 16 positions into all 5 draft layers: the largest difference,
   the fused kernel's time against the unfused XLA sequence (the reference, jitted) and the
   speedup.
3. **T_verify(N) / T_step** for N in ``--verify-nodes`` at each context, with the tree
   kernel switched on (``attention_impl="pallas"``), and with ``--verify-reference`` also off
   (XLA's dense path; twice the compiles of the 36-layer target).

``--tiny`` shrinks every shape so that the whole script runs in seconds (with ``--interpret``:
on CPU, through Pallas's interpreter); that is how the tests run it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import calibrate
from specjax.config import ModelConfig
from specjax.kernels import kv_injection as kvi
from specjax.kernels import tree_attention as ta
from specjax.models import target

QWEN3_8B = ModelConfig(arch="qwen3", vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                       n_kv_heads=8, head_dim=128, d_ff=12288, rope_theta=1e6,
                       max_position_embeddings=40960, dtype="bfloat16")
TINY = ModelConfig(arch="qwen3", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=32, d_ff=96, dtype="bfloat16")


def _max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def tree_attention_rows(cfg: ModelConfig, contexts: Sequence[int], nodes: Sequence[int], *,
                        batch: int, interpret: bool, block_k: int, hbm_gb_s: float,
                        log=print) -> list[dict]:
    """Section 1 (module docstring), one row per (context, nodes)."""
    k_heads, g, h = cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim
    c, dt = batch * k_heads, cfg.jnp_dtype
    rows = []
    for ctx in contexts:
        n_split = max(1, ctx // 1024)
        slots = -(-(ctx + 1) // (n_split * block_k)) * n_split * block_k
        for n in nodes:
            keys = jax.random.split(jax.random.key(ctx + n), 5)
            q = jax.random.normal(keys[0], (c, g * n, h), dt)
            k = jax.random.normal(keys[1], (c, slots, h), dt)
            v = jax.random.normal(keys[2], (c, slots, h), dt)
            kn = jax.random.normal(keys[3], (c, n, h), dt)
            vn = jax.random.normal(keys[4], (c, n, h), dt)
            tree = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch, n, n))
            lengths = jnp.full((c,), ctx, jnp.int32)
            args = (q, k, v, lengths, kn, vn, tree)
            kernel = jax.jit(lambda *a, s=n_split: ta.tree_attention(
                *a, block_k=block_k, n_split=s, interpret=interpret))
            dense = jax.jit(ta.tree_attention_reference)
            want = ta.tree_attention_reference(*(x.astype(jnp.float32) if x.dtype == dt else x
                                                 for x in args))
            err = _max_diff(kernel(*args), want)
            t_kernel = _timed_fresh(kernel, lambda: args)
            t_dense = _timed_fresh(dense, lambda: args)
            read = 2 * c * ctx * h * jnp.dtype(dt).itemsize  # the committed keys and values
            row = dict(context=ctx, nodes=n, max_diff=err, kernel_us=t_kernel * 1e6,
                       xla_us=t_dense * 1e6, speedup=t_dense / t_kernel,
                       hbm_fraction=read / t_kernel / (hbm_gb_s * 1e9))
            rows.append(row)
            log(f"  context {ctx:5d} N={n:3d}: max diff {err:.2e}  kernel {row['kernel_us']:8.1f}"
                f" us  XLA {row['xla_us']:8.1f} us  {row['speedup']:5.2f}x  "
                f"{100 * row['hbm_fraction']:5.1f}% of HBM")
    return rows


def kv_injection_rows(cfg: ModelConfig, n_layers: int, *, batches: Sequence[int], t: int,
                      slots: int, interpret: bool, block_d: int, log=print) -> list[dict]:
    """Section 2 (module docstring), one row per batch size."""
    d, k_heads, g, h = cfg.d_model, cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim
    dt = cfg.jnp_dtype
    rows = []
    for b in batches:
        keys = iter(jax.random.split(jax.random.key(b), 4 + 4 * n_layers))
        ctx = jax.random.normal(next(keys), (b, t, d), dt)
        wqkv = [jax.random.normal(next(keys), (d, k_heads, g + 2, h), dt) * d ** -0.5
                for _ in range(n_layers)]
        norms = [1 + 0.1 * jax.random.normal(next(keys), (h,), dt) for _ in range(n_layers)]
        pos = jnp.broadcast_to(jnp.arange(slots - t, slots - t + t), (b, t))
        angles = pos[..., None] * (1e6 ** (-jnp.arange(h // 2) / (h // 2)))
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        caches = [jax.random.normal(next(keys), (b * k_heads, slots, h), dt)
                  for _ in range(2 * n_layers)]
        starts = jnp.full((b,), slots - t, jnp.int32)
        fused = jax.jit(lambda c, w, n, co, si, kc, vc, s: kvi.kv_injection(
            c, w, n, co, si, kc, vc, s, eps=1e-6, block_d=block_d, interpret=interpret))
        unfused = jax.jit(lambda *a: kvi.kv_injection_reference(*a, eps=1e-6))

        def args():  # fresh caches per call: the kernel donates them
            return (ctx, wqkv, norms, cos, sin, [x + 0 for x in caches[:n_layers]],
                    [x + 0 for x in caches[n_layers:]], starts)

        err = _max_diff(jnp.stack(jax.tree.leaves(fused(*args()))),
                        jnp.stack(jax.tree.leaves(unfused(*args()))))
        t_fused = _timed_fresh(fused, args)
        t_unfused = _timed_fresh(unfused, args)
        row = dict(batch=b, max_diff=err, kernel_us=t_fused * 1e6, xla_us=t_unfused * 1e6,
                   speedup=t_unfused / t_fused)
        rows.append(row)
        log(f"  batch {b}: max diff {err:.2e}  kernel {row['kernel_us']:8.1f} us  XLA unfused "
            f"{row['xla_us']:8.1f} us  {row['speedup']:5.2f}x")
    return rows


def _timed_fresh(fn: Callable, make_args: Callable, reps: int = 20) -> float:
    """Median seconds of ``fn`` on arguments from ``make_args`` (fresh ones where ``fn``
    donates them), their making untimed, after one warm-up call."""
    jax.block_until_ready(fn(*make_args()))
    times = []
    for _ in range(reps):
        args = jax.block_until_ready(make_args())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def verify_rows(cfg: ModelConfig, contexts: Sequence[int], nodes: Sequence[int], *,
                impls: Sequence[str], log=print) -> list[dict]:
    """Section 3 (module docstring), one row per (implementation, context)."""
    params = jax.jit(lambda: target.init_params(cfg, 0))()
    rows = []
    for impl in impls:
        c = cfg.replace(attention_impl=impl)
        for ctx in contexts:
            costs = calibrate.measure_verify_costs(c, params, sorted({1, *nodes}), context=ctx,
                                                   reps=4, trials=3)
            step = costs.at(1)
            row = dict(impl=impl, context=ctx, step_ms=step * 1e3,
                       ratios={n: costs.at(n) / step for n in nodes})
            rows.append(row)
            log(f"  {impl:16s} context {ctx:5d}: T_step {row['step_ms']:7.2f} ms  " + "  ".join(
                f"N={n}: {r:.2f}x" for n, r in row["ratios"].items()))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.kernel_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--nodes", default="16,64", help="tree sizes for the attention kernel")
    parser.add_argument("--verify-nodes", default="16,32,64,128")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hbm-gb-s", type=float, default=4800.0,
                        help="the card's memory bandwidth (H200: 4800 GB/s)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes, for a run in seconds (tests)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels through Pallas's interpreter (any backend)")
    parser.add_argument("--skip-verify", action="store_true", help="skip section 3")
    parser.add_argument("--verify-reference", action="store_true",
                        help="section 3 also with the kernel off (XLA's dense attention)")
    args = parser.parse_args(argv)
    cfg = TINY if args.tiny else QWEN3_8B
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    contexts, nodes = ints(args.contexts), ints(args.nodes)
    block_k = 16 if args.tiny else 64
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; target "
          f"{'tiny' if args.tiny else 'Qwen3-8B'}-shaped, {cfg.dtype}, batch {args.batch}")
    print("1. tree attention (kernel vs XLA's dense path):")
    tree_attention_rows(cfg, contexts, nodes, batch=args.batch, interpret=args.interpret,
                        block_k=block_k, hbm_gb_s=args.hbm_gb_s)
    print("2. KV injection, 16 positions into 5 draft layers (fused vs unfused XLA):")
    kv_injection_rows(cfg, 5, batches=(1, 4), t=16, slots=max(contexts) + 64,
                      interpret=args.interpret, block_d=16 if args.tiny else 128)
    if not args.skip_verify:
        print("3. T_verify(N) / T_step:")
        impls = ["pallas-interpret" if args.interpret else "pallas"]
        verify_rows(cfg, contexts, ints(args.verify_nodes),
                    impls=impls + ["reference"] * args.verify_reference)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
