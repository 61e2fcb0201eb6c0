"""Where a batched prefill's host time goes: Engine.prefill's steps timed one by one on the host.

A prefill's wall is its kernels plus whatever the host does while the device has nothing queued:
the request's checks, the fresh state's dispatch, the first chunk's inputs and its dispatch (later
chunks are dispatched while earlier ones run). This runs Engine.prefill's own calls in its order
(checks, runner.new_state, then per chunk the token/position/count inputs and runner.forward), times
each call's host seconds without waiting in between, then waits for the last logits: the host
phases beside the wall of the whole, the same prompt as `Engine.prefill` itself (timed too), and
an arm with each chunk's inputs made device arrays first (jnp.asarray / jnp.int32), as the
engine did before 2026-12-07.

    python benchmarks/prefill_host.py --model qwen3.5-35b-a3b --length 8192 --chunk 4096 --json out.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def phases(eng, ids, chunk, state_len, jnp_inputs: bool = False):
    """One prefill, Engine.prefill's batched path call by call -> ({phase: host ms}, wall ms, the
    last logits). jnp_inputs: each chunk's tokens, position and row count made device arrays first
    (jnp.asarray, jnp.int32: a dispatch each) instead of handed to the jitted call as numpy, the
    engine's way before 2026-12-07."""
    import jax
    import jax.numpy as jnp

    t = {}
    t0 = time.perf_counter()

    def mark(name, since):
        now = time.perf_counter()
        t[name] = t.get(name, 0.0) + (now - since) * 1e3
        return now

    s = t0
    ids = eng.check_ids(ids)
    s = mark("check_ids", s)
    eng.check_fits(len(ids), 0)
    eng.check_device(state_len, chunk)
    s = mark("check_fits_device", s)
    state = eng.runner.new_state(state_len)
    s = mark("new_state", s)
    logits = None
    for p in range(0, len(ids), chunk):
        if jnp_inputs:
            part = ids[p:p + chunk]
            toks = np.zeros((chunk,), np.int32)
            toks[:len(part)] = part
            logits, state = eng.runner.forward(state, jnp.asarray(toks), jnp.int32(p), jnp.int32(len(part)))
        else:
            logits, state = eng._chunk(ids[p:p + chunk], state, p, chunk)
        s = mark("first_chunk" if p == 0 else "later_chunks", s)
    jax.block_until_ready(logits)
    mark("wait", s)
    wall = (time.perf_counter() - t0) * 1e3
    del state
    return t, wall, logits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=None, help="default: the engine's pick")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax

    import baro_jax
    from baro_jax.runner import state_length
    from baro_jax.verify.records import provenance, write_json

    eng = baro_jax.load(args.model, backend="ordered", max_context=max(args.length + 64, 64), progress=False)
    vocab = eng.cfg.vocab_size
    ids = [int(x) for x in np.random.default_rng(0).integers(0, min(vocab, 256), args.length)]
    chunk = args.chunk or eng.pick_chunk(len(ids))
    L = state_length(len(ids), eng.cfg.max_context)
    phases(eng, ids, chunk, L)  # compiles
    phases(eng, ids, chunk, L, jnp_inputs=True)
    rows, walls, engine_walls, jnp_rows, jnp_walls = [], [], [], [], []
    for _ in range(args.repeats):
        t, w, _ = phases(eng, ids, chunk, L)
        rows.append(t)
        walls.append(w)
        t, w, _ = phases(eng, ids, chunk, L, jnp_inputs=True)
        jnp_rows.append(t)
        jnp_walls.append(w)
        t0 = time.perf_counter()
        pre = eng.prefill(ids, "batch", chunk)
        jax.block_until_ready((pre.logits, pre.state))
        engine_walls.append((time.perf_counter() - t0) * 1e3)
        del pre
    med = {k: float(np.median([r.get(k, 0.0) for r in rows])) for k in rows[0]}
    jnp_med = {k: float(np.median([r.get(k, 0.0) for r in jnp_rows])) for k in jnp_rows[0]}
    host = sum(v for k, v in med.items() if k not in ("wait", "later_chunks"))
    out = {"summary": {"model": args.model, "length": args.length, "chunk": chunk,
                       "repeats": args.repeats, "params_leaves": len(jax.tree_util.tree_leaves(eng.params)),
                       "median_wall_ms": float(np.median(walls)),
                       "median_wall_ms_jnp_inputs": float(np.median(jnp_walls)),
                       "median_engine_prefill_ms": float(np.median(engine_walls)),
                       "host_ms_before_first_kernels": host, **provenance()},
           "median_phase_ms": med, "median_phase_ms_jnp_inputs": jnp_med, "phase_ms": rows,
           "phase_ms_jnp_inputs": jnp_rows}
    for k, v in med.items():
        print(f"[prefill_host] {k:20s} {v:9.3f} ms   (jnp inputs {jnp_med.get(k, 0.0):9.3f} ms)")
    print(f"[prefill_host] {args.model} {args.length} tokens at chunk {chunk}: wall {np.median(walls):.2f} ms, "
          f"with jnp inputs {np.median(jnp_walls):.2f} ms, Engine.prefill {np.median(engine_walls):.2f} ms; host before the first chunk's kernels "
          f"{host:.2f} ms", flush=True)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
