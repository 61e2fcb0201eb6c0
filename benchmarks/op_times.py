"""Time every ordered op (and its xla twin) on the full-size Qwen3.5-35B-A3B shapes.

    python benchmarks/op_times.py --m 1,1024 --json out.json

Each op is jitted alone, run once to compile, then timed as the median of
--reps calls (block_until_ready around each). Inputs are fresh random values.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from baro_jax.config import DELTA_BLOCK
from baro_jax.verify.records import provenance, write_json


def cases(cfg, m, S, pos, key):
    bf, f32 = jnp.bfloat16, jnp.float32
    ks = iter(jax.random.split(key, 64))

    def r(shape, dt=bf, scale=1.0):
        return (jax.random.normal(next(ks), shape, f32) * scale).astype(dt)

    D, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_inter, cfg.shared_inter
    hd, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    nv, dk, dv, C = cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, cfg.conv_dim
    R = cfg.rotary_dim
    ang = (pos + jnp.arange(m, dtype=f32))[:, None] * (1e-3 * jnp.arange(R // 2, dtype=f32))[None]
    yield "matmul gdn_in_proj", "matmul", (r((m, D)), r((cfg.gdn_in_dim, D), scale=D ** -0.5)), {}
    yield "matmul gdn_out_proj", "matmul", (r((m, nv * dv)), r((D, nv * dv), scale=(nv * dv) ** -0.5)), {}
    yield "matmul lm_head", "matmul", (r((m, D)), r((cfg.vocab_size, D), scale=D ** -0.5)), {}
    yield "rmsnorm", "rmsnorm", (r((m, D), f32), r((D,), f32, 0.1)), dict(eps=1e-6)
    yield "attention", "attention", (r((m, cfg.attn_qkv_dim), f32), r((hd,), f32, 0.1), r((hd,), f32, 0.1),
                                     jnp.cos(ang), jnp.sin(ang), r((S, Hkv, hd)), r((S, Hkv, hd)),
                                     jnp.int32(pos), jnp.int32(m)), dict(num_heads=H, num_kv_heads=Hkv, eps=1e-6)
    yield "conv", "conv", (r((m, C)), r((C, 4), scale=0.5), r((3, C)), jnp.int32(m)), {}
    # the model's call: conv of the f32 projection whole (baro_conv_proj)
    yield "conv proj", "conv", (r((m, cfg.gdn_in_dim), f32), r((C, 4), scale=0.5), r((3, C)), jnp.int32(m)), {}
    yield "delta", "delta", (r((m, C), f32), r((m, nv), f32), r((m, nv), f32), r((nv,), f32, 0.5),
                             r((nv,), f32, 0.5), r((nv, dk, dv), f32, 0.1), jnp.int32(m)), dict(nk=cfg.lin_k_heads, dk=dk)
    # the opt-in chunk-aligned rule (BARO_DELTA=blocked; BARO_DELTA_BLOCKED_MMA picks its CUDA
    # instance) from a block's first slot: S0 given, no pending rows
    B = DELTA_BLOCK
    yield "delta_blocked", "delta_blocked", (r((m, C), f32), r((m, nv), f32), r((m, nv), f32), r((nv,), f32, 0.5),
                                             r((nv,), f32, 0.5), r((nv, dk, dv), f32, 0.1), jnp.zeros((nv, B, dk), f32),
                                             jnp.zeros((nv, B, dv), f32), jnp.zeros((nv, B), f32),
                                             jnp.int32(pos // B * B), jnp.int32(m)), dict(nk=cfg.lin_k_heads, dk=dk)
    yield "gated_norm", "gated_norm", (r((m, nv, dv), f32), r((m, nv * dv), f32), r((dv,), f32)), dict(eps=1e-6)
    yield "moe", "moe", (r((m, D)), r((E, D), scale=D ** -0.5), r((E, 2 * I, D), scale=D ** -0.5),
                         r((E, D, I), scale=I ** -0.5), r((2 * Is, D), scale=D ** -0.5),
                         r((D, Is), scale=Is ** -0.5), r((1, D), scale=D ** -0.5)), dict(top_k=cfg.top_k)


def time_op(fn, args, reps, rounds=0):
    """The median of reps calls each waited for (dispatch and the host's wait included); with
    rounds: the fastest of that many rounds of reps calls issued back to back and waited for once,
    per call (the device's time: two libraries' kernels compared on the same inputs)."""
    out = fn(*args)
    jax.block_until_ready(out)
    if rounds:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            outs = [fn(*args) for _ in range(reps)]
            jax.block_until_ready(outs)
            best = min(best, (time.perf_counter() - t0) / reps)
        return best
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="a preset whose shapes to use")
    ap.add_argument("--m", default="1,1024")
    ap.add_argument("--context", type=int, default=8192, help="KV cache length; attention queries sit at its middle")
    ap.add_argument("--backends", default="ordered,xla")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=0,
                    help="time rounds of --reps calls back to back, the fastest round per call (0: each call waited for)")
    ap.add_argument("--ops", default="", help="comma list of op names to time (default: all), e.g. delta,moe")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from baro_jax.config import preset
    from baro_jax.ops import get_ops

    cfg = preset(args.model)
    rows = []
    for m in [int(x) for x in args.m.split(",")]:
        pos = args.context // 2
        wanted = {o for o in args.ops.split(",") if o}
        for name, op, a, kw in cases(cfg, m, args.context, pos, jax.random.PRNGKey(m)):
            if wanted and op not in wanted and name not in wanted:
                continue
            row = {"op": name, "m": m}
            for be in args.backends.split(","):
                ops = get_ops(be)
                fn = jax.jit(functools.partial(getattr(ops, op), **kw))
                try:
                    t = time_op(fn, a, args.reps, args.rounds)
                    row[be + "_ms"] = t * 1e3
                except Exception as e:  # report, keep going: one op must not hide the others
                    row[be + "_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    write_json(args.json, {"summary": {"model_shapes": args.model, "context": args.context, **provenance()},
                           "reps": args.reps, "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
