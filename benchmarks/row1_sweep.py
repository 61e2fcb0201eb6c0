"""Decode GEMM ring sweep (GPU): time the one-row GEMM (gemm_row1) at the decode shapes of
Qwen3.5-35B-A3B under the launcher's speed knobs (BARO_ROW1_BPS, _KCHUNK, _STAGES, _NT; every
setting gives the same bits, checked here too), and gemm_rows16 (BARO_GEMM_ROW1=off) beside.

Each timing is one jitted graph of 32 one-row calls on 32 different rows (so none is merged),
median of 7 runs, divided by 32: it includes a small slice per call, the same for every arm.

    python benchmarks/row1_sweep.py --json row1_sweep_h200.json
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import provenance

import custom_calls as cc

CALLS = 32
# (name, N, K): GDN in_proj (qkvz + ba), GDN out_proj, attention q/k/v, attention o_proj, router,
# shared gate, shared-expert down
DENSE = [("in_proj", 12352, 2048), ("out_proj", 2048, 4096), ("attn_qkv", 9216, 2048),
         ("o_proj", 2048, 4096), ("router", 256, 2048), ("shared_gate", 1, 2048), ("shared_down", 2048, 512)]
MOE = dict(E=256, D=2048, I=512, Is=512, k=8)

ARMS = [("rows16", {"BARO_GEMM_ROW1": "off"}), ("row1 default", {}),
        ("nt1", {"BARO_ROW1_NT": "1"}), ("nt2", {"BARO_ROW1_NT": "2"})]
for bps in (2, 3, 4):
    for kc in (512, 2048):
        for st in (2, 4):
            ARMS.append((f"bps{bps} k{kc} s{st}", {"BARO_ROW1_BPS": str(bps), "BARO_ROW1_KCHUNK": str(kc),
                                                     "BARO_ROW1_STAGES": str(st)}))
KNOBS = ("BARO_GEMM_ROW1", "BARO_ROW1_BPS", "BARO_ROW1_KCHUNK", "BARO_ROW1_STAGES", "BARO_ROW1_NT")


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--arms", default="", help="comma list of arm names (default: all)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dense = {name: (bf16(rng, CALLS, 1, K, scale=1.0), bf16(rng, N, K)) for name, N, K in DENSE}
    E, D, I, Is, k = (MOE[x] for x in ("E", "D", "I", "Is", "k"))
    moe_w = (bf16(rng, E, D), bf16(rng, E, 2 * I, D), bf16(rng, E, D, I), bf16(rng, 2 * Is, D),
             bf16(rng, D, Is), bf16(rng, 1, D))
    moe_h = bf16(rng, CALLS, 1, D, scale=1.0)
    arms = [a for a in ARMS if not args.arms or a[0] in args.arms.split(",")]
    rows, ref = [], {}
    for arm, env in arms:
        for kn in KNOBS:
            os.environ.pop(kn, None)
        os.environ.update(env)
        row = {"arm": arm, "env": env, "us": {}}
        for name, (xs, w) in dense.items():
            f = jax.jit(lambda xs, w: [cc.matmul(xs[i], w) for i in range(CALLS)])
            us, out = timed(f, xs, w)
            row["us"][name] = round(us, 2)
            got = np.asarray(jnp.stack(out)).tobytes()
            row.setdefault("same_bits", True)
            if name in ref and ref[name] != got:
                row["same_bits"] = False
            ref.setdefault(name, got)
        f = jax.jit(lambda hs, *w: [cc.moe(hs[i], *w, top_k=k) for i in range(CALLS)])
        us, out = timed(f, moe_h, *moe_w)
        row["us"]["moe"] = round(us, 2)
        got = np.asarray(jnp.stack(out)).tobytes()
        if "moe" in ref and ref["moe"] != got:
            row["same_bits"] = False
        ref.setdefault("moe", got)
        row["us"]["sum"] = round(sum(row["us"].values()), 2)
        rows.append(row)
        print(f"{arm:>20}: " + "  ".join(f"{n} {v:7.2f}" for n, v in row["us"].items()) +
              ("" if row["same_bits"] else "  BITS DIFFER"), flush=True)
        best = min(rows, key=lambda r: r["us"]["sum"])
        with open(args.json, "w") as fh:  # after every arm: a cut run keeps the arms done
            json.dump({"summary": {**provenance(), "calls_per_graph": CALLS, "moe": MOE, "shapes": DENSE,
                                   "all_same_bits": all(r["same_bits"] for r in rows), "best": best["arm"]},
                       "rows": rows}, fh, indent=1)
    for kn in KNOBS:
        os.environ.pop(kn, None)
    print(f"best by sum: {best['arm']} {best['us']['sum']} us")


if __name__ == "__main__":
    main()
