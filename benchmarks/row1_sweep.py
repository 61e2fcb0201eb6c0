"""Decode GEMM ring sweep (GPU): time the one-row GEMM (gemm_row1) at the decode shapes of
Qwen3.5-35B-A3B under the launcher's speed knobs (BARO_ROW1_BPS, _KCHUNK, _STAGES, _NT; every
setting gives the same bits, checked here too), and gemm_rows16 (BARO_GEMM_ROW1=off) and the
one-token MoE without its fold (BARO_MOE_FOLD=0) beside. BARO_ROW1_COPY=lsu moves the stages by
16-byte cp.async per lane instead of the copy engine's bulk copies.

Each timing is one jitted graph of 32 one-row calls on 32 different rows (so none is merged),
median of 7 runs, divided by 32 ("us": wall, with a slice and the launch gaps per call), and
the same graphs once under jax.profiler ("kernel_us": our kernels' time per call, the sum over
the call's kernels; the graphs are told apart by the host's wait between them).

    python benchmarks/row1_sweep.py --json row1_sweep_h200.json

--rows M times calls of M rows (a decode step of M sequences: the 16-row stream for 2..16) on the
dense shapes only, and --env-arms adds arms of any knobs: "name:KNOB=V,KNOB=V;name2:KNOB=V".
"""
import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from baro_jax.verify.records import provenance
from decode_profile import graph_times_ns, read_trace  # this script's own directory, first on sys.path

import custom_calls as cc

CALLS = 32
# (name, N, K): GDN in_proj (qkvz + ba), GDN out_proj, attention q/k/v, attention o_proj, router,
# shared gate, shared-expert down
DENSE = [("in_proj", 12352, 2048), ("out_proj", 2048, 4096), ("attn_qkv", 9216, 2048),
         ("o_proj", 2048, 4096), ("router", 256, 2048), ("shared_gate", 1, 2048), ("shared_down", 2048, 512)]
MOE = dict(E=256, D=2048, I=512, Is=512, k=8)

ARMS = [("rows16", {"BARO_GEMM_ROW1": "off"}), ("row1 default", {}), ("no fold", {"BARO_MOE_FOLD": "0"}),
        ("nt1", {"BARO_ROW1_NT": "1"}), ("nt2", {"BARO_ROW1_NT": "2"})]
# The ring's shape (bulk copies; 16-byte cp.async, BARO_ROW1_COPY=lsu, was 2.5x slower in every
# arm at 6d18423: results/row1_sweep_h200.json, so it is no longer swept).
for bps in (2, 3, 4):
    for kc in (512, 2048):
        for st in (2, 4):
            ARMS.append((f"bulk bps{bps} k{kc} s{st}", {"BARO_ROW1_COPY": "bulk", "BARO_ROW1_BPS": str(bps),
                                                      "BARO_ROW1_KCHUNK": str(kc), "BARO_ROW1_STAGES": str(st)}))
# Warps in flight: a warp streams one unit at about the same rate whatever else runs (the 32k
# decode profile and results/row1_sweep_h200.json, 2026-12-01, docs/PERF.md), so more, smaller
# units in one round (the one-token MoE's 9 experts x 512 gate/up outputs are 576 one-n-tile
# units) should move the grouped GEMMs.
for nt in (1, 2):
    for bps in (4, 5, 6):
        ARMS.append((f"nt{nt} bps{bps}", {"BARO_ROW1_NT": str(nt), "BARO_ROW1_BPS": str(bps)}))
KNOBS = ("BARO_GEMM_ROW1", "BARO_ROW1_BPS", "BARO_ROW1_KCHUNK", "BARO_ROW1_STAGES", "BARO_ROW1_NT", "BARO_ROW1_COPY",
         "BARO_MOE_FOLD", "BARO_ROW1_ASHARED", "BARO_ROW1_SWAP", "BARO_ROW1_TMA", "BARO_GEMM_SMALL")


def env_arms(text: str):
    """"name:KNOB=V,KNOB=V;name2:KNOB=V" -> [(name, {KNOB: V})]; only this script's KNOBS."""
    arms = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        name, _, body = part.partition(":")
        env = dict(kv.split("=", 1) for kv in body.split(",") if kv)
        unknown = sorted(set(env) - set(KNOBS))
        if not name or unknown:
            raise SystemExit(f"--env-arms: {part!r}: " + (f"unknown knobs {unknown}" if unknown else "no name"))
        arms.append((name.strip(), env))
    return arms


def bf16(rng, *shape, scale=0.05):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32), jnp.bfloat16)


def timed(fn, *args):
    out = jax.block_until_ready(fn(*args))  # compiles (a fresh jit: the launcher reads the knobs)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / CALLS * 1e6, out


def kernel_us(graphs):
    """Our kernels' time per call in each of the graphs [(fn, args)], one profiler trace:
    the graphs run one after another with a host wait between, so a gap of > 50 us between
    consecutive kernels starts the next graph. None where the split does not come out right."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for fn, args in graphs:
            jax.block_until_ready(fn(*args))
            time.sleep(0.002)
        jax.profiler.stop_trace()
        kernels, _, _ = read_trace(d)
    groups = graph_times_ns(kernels, len(graphs))
    if groups is None:
        return [None] * len(graphs)
    return [round(g / CALLS / 1e3, 2) for g in groups]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--arms", default="", help="comma list of arm names (default: all)")
    ap.add_argument("--rows", type=int, default=1, help="rows per call (default 1; above 1: dense shapes only)")
    ap.add_argument("--env-arms", default="", help='more arms: "name:KNOB=V,KNOB=V;name2:KNOB=V"')
    args = ap.parse_args()
    if not 1 <= args.rows <= 64:
        raise SystemExit(f"--rows {args.rows}: give 1 to 64")
    rng = np.random.default_rng(0)
    dense = {name: (bf16(rng, CALLS, args.rows, K, scale=1.0), bf16(rng, N, K)) for name, N, K in DENSE}
    E, D, I, Is, k = (MOE[x] for x in ("E", "D", "I", "Is", "k"))
    moe_w = (bf16(rng, E, D), bf16(rng, E, 2 * I, D), bf16(rng, E, D, I), bf16(rng, 2 * Is, D),
             bf16(rng, D, Is), bf16(rng, 1, D))
    moe_h = bf16(rng, CALLS, 1, D, scale=1.0)
    arms = [a for a in ARMS if not args.arms or a[0] in args.arms.split(",")] + env_arms(args.env_arms)
    rows, ref = [], {}
    for arm, env in arms:
        for kn in KNOBS:
            os.environ.pop(kn, None)
        os.environ.update(env)
        row = {"arm": arm, "env": env, "us": {}}
        graphs = []
        for name, (xs, w) in dense.items():
            f = jax.jit(lambda xs, w: [cc.matmul(xs[i], w) for i in range(CALLS)])
            graphs.append((f, (xs, w)))
            us, out = timed(f, xs, w)
            row["us"][name] = round(us, 2)
            got = np.asarray(jnp.stack(out)).tobytes()
            row.setdefault("same_bits", True)
            if name in ref and ref[name] != got:
                row["same_bits"] = False
            ref.setdefault(name, got)
        if args.rows == 1:  # the one-token MoE; grouped calls of more rows are another path
            f = jax.jit(lambda hs, *w: [cc.moe(hs[i], *w, top_k=k) for i in range(CALLS)])
            graphs.append((f, (moe_h, *moe_w)))
            us, out = timed(f, moe_h, *moe_w)
            row["us"]["moe"] = round(us, 2)
            got = np.asarray(jnp.stack(out)).tobytes()
            if "moe" in ref and ref["moe"] != got:
                row["same_bits"] = False
            ref.setdefault("moe", got)
        row["us"]["sum"] = round(sum(row["us"].values()), 2)
        try:
            ku = kernel_us(graphs)
        except Exception as e:  # noqa: BLE001  (the wall times stand without the trace)
            ku = [None] * len(graphs)
            row["trace_error"] = f"{type(e).__name__}: {e}"[:200]
        row["kernel_us"] = dict(zip(list(dense) + (["moe"] if args.rows == 1 else []), ku))
        if all(v is not None for v in ku):
            row["kernel_us"]["sum"] = round(sum(ku), 2)
        rows.append(row)
        print(f"{arm:>22}: " + "  ".join(f"{n} {v:7.2f}" for n, v in row["us"].items()) +
              ("" if row["same_bits"] else "  BITS DIFFER"), flush=True)
        print(f"{'kernels':>22}: " + "  ".join(f"{n} {v if v is None else f'{v:7.2f}'}"
                                              for n, v in row["kernel_us"].items()), flush=True)
        best = min(rows, key=lambda r: r["kernel_us"].get("sum") or r["us"]["sum"])
        with open(args.json, "w") as fh:  # after every arm: a cut run keeps the arms done
            json.dump({"summary": {**provenance(), "calls_per_graph": CALLS, "rows": args.rows, "moe": MOE, "shapes": DENSE,
                                   "all_same_bits": all(r["same_bits"] for r in rows), "best": best["arm"]},
                       "rows": rows}, fh, indent=1)
    for kn in KNOBS:
        os.environ.pop(kn, None)
    print(f"best by sum: {best['arm']} {best['us']['sum']} us")


if __name__ == "__main__":
    main()
