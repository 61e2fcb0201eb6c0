"""What a fixed segmented K order would give the decode-shaped GEMMs, timed before it is built.

Today every output element of a GEMM is one ascending K chain of 16-wide mma steps, so a plain
GEMM of a few rows has at most N / 8 independent chains of K / 16 steps, and the chain-bound
calls of a decode step (out_proj and o_proj at K = 4,096, the router) run far above their bytes
(docs/PERF.md, open levers). A fixed segmented order (each K / S wide segment its own chain from
zero, the S segment sums added in ascending order) is as batch-invariant as today's, but has S
times the chains, each S times shorter. This script times that shape with the library's own GEMM:
segment s of x @ W^T is x[:, s K/S:(s+1) K/S] @ W[:, s K/S:(s+1) K/S]^T, so the S segments of a
call are one GEMM of K / S over the S N rows of W cut into segments (the same weight bytes; the
rows of x are the first segment's, the time is the same for any values), and the S partial rows'
ascending sum, a few kilobytes, is left out. Each arm runs L calls with L distinct weights in
one jitted graph (the weights stream from DRAM as in a decode step), the median of --reps runs
divided by L. The graph's calls pay per-call costs a decode step's do not (8-13 us more a call
than in a B = 8 step on an H100), the same for every S: compare rows, not absolute times. --warm adds, per GEMM, the unsegmented
call with one weight for all L calls (each its own rows): from the second call on the weight comes
from L2 where it fits (50 MB on an H100 / H200), the most a fetch into L2 ahead of the call could
give.

    python benchmarks/k_segments_probe.py --m 1,8,16 --warm --json out.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from baro_jax.verify.records import provenance, write_json


def shapes(cfg):
    """(name, N, K) of the plain decode GEMMs of a layer."""
    return [("gdn_out_proj", cfg.hidden_size, cfg.lin_v_heads * cfg.lin_v_dim),
            ("attn_o_proj", cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            ("router", cfg.num_experts + 1, cfg.hidden_size),
            ("gdn_in_proj", cfg.gdn_in_dim, cfg.hidden_size)]


def time_calls(m: int, N: int, K: int, segments: int, calls: int, reps: int, key, warm: bool = False) -> float:
    """Seconds a call: L GEMMs [m, K/S] x [S N, K/S]^T with distinct weights in one graph (warm:
    one weight for all L calls, each with its own rows, so from the second call on the weight is
    read from L2 where it fits: what a weight fetched into L2 ahead of its call would give)."""
    from custom_calls.matmul import matmul

    k = K // segments
    kx, kw = jax.random.split(key)
    n_w, n_x = (1, calls) if warm else (calls, 1)
    xs = [jax.random.normal(jax.random.fold_in(kx, i), (m, k), jnp.float32).astype(jnp.bfloat16) for i in range(n_x)]
    ws = [(jax.random.normal(jax.random.fold_in(kw, i), (segments * N, k), jnp.float32) * K ** -0.5)
          .astype(jnp.bfloat16) for i in range(n_w)]
    fn = jax.jit(lambda xs, ws: tuple(matmul(xs[i % n_x], ws[i % n_w]) for i in range(calls)))
    jax.block_until_ready(fn(xs, ws))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(xs, ws))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls


def positive_ints(ap, flag: str, text: str) -> list[int]:
    """A comma list of integers >= 1, or the parser's error naming the flag."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag} must be comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        ap.error(f"{flag} needs integers >= 1, got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="a preset whose shapes to use")
    ap.add_argument("--m", default="1,8,16", help="rows of each call (sequences of a decode step)")
    ap.add_argument("--segments", default="1,2,4", help="S values; each must divide K / 16")
    ap.add_argument("--calls", type=int, default=32, help="L: calls in one graph")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm", action="store_true",
                    help="also time S = 1 with one weight for every call (read from L2 after the first, where it fits)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="HBM copy rate for each row's byte bound (TB/s); none: no bound in the rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ms, segs = positive_ints(ap, "--m", args.m), positive_ints(ap, "--segments", args.segments)
    for name in ("calls", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.bandwidth_tbs is not None and not args.bandwidth_tbs > 0:
        ap.error(f"--bandwidth-tbs must be > 0, got {args.bandwidth_tbs}")

    from baro_jax.config import preset

    cfg = preset(args.model)
    rows = []

    def add(row):
        if args.bandwidth_tbs:
            row["byte_bound_us"] = row["weight_mb"] / args.bandwidth_tbs
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    for m in ms:
        for name, N, K in shapes(cfg):
            for S in segs:
                if K % (16 * S):
                    print(f"skip {name} S={S}: K={K} is not a multiple of 16 S", flush=True)
                    continue
                us = time_calls(m, N, K, S, args.calls, args.reps, jax.random.PRNGKey(m * 1000 + S)) * 1e6
                add({"gemm": name, "m": m, "N": N, "K": K, "segments": S, "weights": "distinct", "chains": S * N // 8,
                     "chain_steps": K // S // 16, "us_per_call": us, "weight_mb": 2 * N * K / 1e6})
            if args.warm:
                us = time_calls(m, N, K, 1, args.calls, args.reps, jax.random.PRNGKey(m * 1000), warm=True) * 1e6
                add({"gemm": name, "m": m, "N": N, "K": K, "segments": 1, "weights": "one", "chains": N // 8,
                     "chain_steps": K // 16, "us_per_call": us, "weight_mb": 2 * N * K / 1e6})
    write_json(args.json, {"summary": {"model_shapes": args.model, "calls_per_graph": args.calls, "reps": args.reps,
                                       **provenance()}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
