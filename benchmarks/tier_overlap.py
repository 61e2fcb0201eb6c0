"""Tier mode: does staging a layer's experts overlap the previous layer's compute?

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=110 \
    python benchmarks/tier_overlap.py --model qwen3.5-35b-a3b --chunks 4096,8192 \
        --device-budget-gb 22 --json out.json

Per chunk size, one prefill chunk pass of a tier engine, three ways:
- copy alone: each layer's routed experts host -> device (jax.device_put, waited for), per layer;
- compute alone: each layer's forward with its experts already on the device (staged and waited
  for first, untimed), per layer, on the real activations of the pass;
- both: the tier forward as it runs (staging.forward: layer i+1's copy issued before layer i's
  compute), the whole pass.
The goal (issue 11): both <= 1.15 x max(sum copy, sum compute). Also reported: the copy
bandwidth (the PCIe bound of a pass: expert bytes / bandwidth), the per-layer max(copy, compute)
sum (the best a two-slot pipeline can do), the memory kind of the store, and the device limits
(XLA_PYTHON_CLIENT_MEM_FRACTION etc.) in force.

Memory: the engine is loaded without the decode expert cache (cache_slots=0: this measures prefill
passes only). Each chunk is first checked against the budget as the engine checks a request
(budget.check_tier at a state of chunk + 8 positions); its row records the budget's count, part by
part, and the runtime reserve beside the device's own counters after the chunk (jax memory_stats:
bytes in use and the peak since the process started, which XLA cannot reset, so run the chunks in
ascending order to read each row's peak as its own; null where the backend does not report them).
A chunk that the budget refuses or that fails while running (out of memory, say) is recorded as
failed with its error, the next chunk still runs, and the exit status is non-zero.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from baro_jax.verify.records import provenance, write_json

STATE_PAD = 8  # KV positions past the chunk: the pass's state is a little longer than its rows


def budget_row(eng, C: int) -> dict:
    """The budget's count for one pass at chunk C (part by part, bytes) and what it holds back."""
    from baro_jax import budget

    parts = budget.tier_parts(eng.cfg, eng.dtype, C + STATE_PAD, C, eng.cache_slots)
    limit, what = budget.budget_bytes(eng.device_budget_gb)
    return {"counted_bytes": sum(p.bytes for p in parts), "parts": {p.name: p.bytes for p in parts},
            "moe_scratch_bytes": budget.moe_scratch_bytes(eng.cfg, C, budget.moe_fuses_swiglu()),
            "runtime_reserve_bytes": budget.runtime_reserve_bytes(limit) if limit is not None else None,
            "limit_bytes": limit, "limit": what}


def measure_chunk(eng, C: int, args) -> dict:
    """Copy alone, compute alone and both, for one pass at chunk C (see the module docstring)."""
    from baro_jax import model as M, staging

    cfg, params = eng.cfg, eng.params
    layers = params["layers"]
    on_dev = staging.device_sharding(next(iter(params["embed"].devices())))
    expert_bytes = [staging.layer_expert_bytes(lp) for lp in layers]
    ids = [int(x) for x in np.random.default_rng(args.seed + C).integers(0, cfg.vocab_size, C)]
    toks = jnp.asarray(np.asarray(ids, np.int32))
    pos, nv = jnp.int32(0), jnp.int32(C)

    def staged_pass():
        st = eng.new_state(C + STATE_PAD)
        jax.block_until_ready(st)
        t = time.perf_counter()
        logits, st = staging.forward(params, st, toks, pos, nv, eng.rope, cfg=cfg, ops=eng.ops)
        jax.block_until_ready((logits, st))
        return time.perf_counter() - t, np.asarray(logits)

    staged_pass()  # compile every layer kind at this chunk
    both, ref_logits = [], None
    for _ in range(args.repeats):
        dt, lg = staged_pass()
        both.append(dt)
        ref_logits = lg if ref_logits is None else ref_logits
    both_s = float(np.median(both))

    # copy alone, per layer
    copy = []
    for lp in layers:
        t = time.perf_counter()
        ex = jax.device_put(staging.split_layer(lp)[1], on_dev)
        jax.block_until_ready(ex)
        copy.append(time.perf_counter() - t)
        del ex
    # compute alone, per layer, on the pass's own activations (experts staged first, untimed)
    st_all = eng.new_state(C + STATE_PAD)
    x, cos, sin = staging._PROLOGUE({"embed": params["embed"]}, toks, pos, eng.rope)
    h = staging._FIRST_NORM(staging.split_layer(layers[0])[0], x, cfg=cfg, ops=eng.ops)
    compute = []
    for lp, st, k, nn in zip(layers, st_all, cfg.layer_types, M.next_norms(params)):
        ex = jax.device_put(staging.split_layer(lp)[1], on_dev)
        jax.block_until_ready((ex, x, h))
        t = time.perf_counter()
        x, h, st = staging._LAYER(x, h, staging.split_layer(lp)[0], ex, st, cos, sin, pos, nv, nn, kind=k,
                                  cfg=cfg, ops=eng.ops)
        jax.block_until_ready((x, h, st))
        compute.append(time.perf_counter() - t)
        del ex, st
    logits = staging._EPILOGUE(staging._head_params(params), h, nv, cfg=cfg, ops=eng.ops)
    same = np.asarray(logits).tobytes() == ref_logits.tobytes()  # the split run is the same computation
    sc, sk = float(sum(copy)), float(sum(compute))
    bound = max(sc, sk)
    row = {"layers": len(layers), "both_seconds": both_s, "both_runs": both,
           "copy_seconds_sum": sc, "compute_seconds_sum": sk,
           "pipeline_floor_seconds": float(sum(max(a, b) for a, b in zip(copy, compute))),
           "both_over_max": both_s / bound if bound > 0 else None,
           "goal": 1.15, "meets_goal": bound > 0 and both_s / bound <= 1.15,
           "copy_gb_per_s": sum(expert_bytes) / sc / 1e9 if sc > 0 else None,
           "expert_gb_per_pass": sum(expert_bytes) / 1e9,
           "prefill_tokens_per_s": C / both_s,
           "per_layer_ms": {"copy": [1e3 * c for c in copy], "compute": [1e3 * c for c in compute]},
           "split_run_logits_equal_staged": same}
    print(f"chunk {C}: both {both_s * 1e3:.1f} ms, copy {sc * 1e3:.1f} ms ({row['copy_gb_per_s']:.1f} GB/s), "
          f"compute {sk * 1e3:.1f} ms -> both / max = {row['both_over_max']:.3f} (goal <= 1.15), "
          f"{row['prefill_tokens_per_s']:.0f} tok/s", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--chunks", default="64")
    ap.add_argument("--device-budget-gb", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of the staged forward (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import baro_jax
    from baro_jax import budget, staging

    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    eng = baro_jax.load(args.model, backend="ordered", mode="tier", device_budget_gb=args.device_budget_gb,
                        max_context=max(chunks) + STATE_PAD, progress=False, cache_slots=0)
    kind = staging.host_memory_kind()
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("XLA_PYTHON_CLIENT_", "XLA_PJRT_"))}
    rows = []

    def summary(final: bool) -> dict:
        ran = [r for r in rows if not r.get("failed")]
        return {**provenance(), "model": args.model, "store_memory_kind": kind, "device_limits": env,
                "device_budget_gb": args.device_budget_gb, "expert_cache": eng.expert_cache_report(),
                "failed_chunks": [r["chunk"] for r in rows if r.get("failed")],
                "checks_pass": all(r["split_run_logits_equal_staged"] for r in ran) if ran else None,
                "partial": not final}

    for C in chunks:
        row = {"chunk": C, "state_len": C + STATE_PAD, "budget": budget_row(eng, C),
               "device_memory_before": budget.device_memory_stats()}
        try:
            eng.check_device(C + STATE_PAD, C)  # what the engine would refuse, refused here too
            row.update(measure_chunk(eng, C, args))
        except Exception as e:  # noqa: BLE001  (out of memory, a refusal: recorded, the next chunk runs)
            row["failed"] = True
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:2000]}"
            print(f"chunk {C}: FAILED {row['error'].splitlines()[0][:300]}", flush=True)
        gc.collect()  # a failed pass's buffers (held by its traceback until here) go before the next chunk
        row["device_memory"] = mem = budget.device_memory_stats()
        if mem and "peak_bytes_in_use" in mem:
            row["peak_minus_counted_bytes"] = mem["peak_bytes_in_use"] - row["budget"]["counted_bytes"]
        rows.append(row)
        write_json(args.json, {"summary": summary(False), "rows": rows})  # a run cut short keeps its rows
    out = {"summary": summary(True), "rows": rows}
    write_json(args.json, out)
    failed = out["summary"]["failed_chunks"]
    return 0 if out["summary"]["checks_pass"] and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
