"""Long-context identity: one long prompt, batched prefill (the default chunk and others) vs replay.

    python benchmarks/identity_longctx.py --model qwen3.5-35b-a3b --lengths 65536,131072 \
        --chunks default,4096 --new-tokens 32 --deadline-s 540 --json out.json

Per length: a seeded random prompt; each batched arm runs first (seconds), its state (every
leaf), last logits and --new-tokens greedy tokens (Engine.greedy_decode) are copied to the host;
then replay (the decode step once per prompt token, the reference) runs, unless the measured
decode rate says it would end after --deadline-s: then the length is recorded as skipped with
that estimate (the reason a 10-minute device call cannot hold it). Every comparison is bytes.
Peak device memory (memory_stats) is reported per length. Exit status 1 on any difference.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_leaves, provenance, same_bytes as same, write_json  # noqa: E402


def peak_gb():
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU devices may not keep stats
        st = {}
    v = st.get("peak_bytes_in_use")
    return None if v is None else v / 1e9


def log(msg, t0=[time.perf_counter()]):
    print(f"[longctx {time.perf_counter() - t0[0]:7.1f}s] {msg}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lengths", default="65536")
    ap.add_argument("--chunks", default="default,4096", help="'default' = the engine's pick for the prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="skip a replay that would end after this many seconds from the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import baro_jax
    from baro_jax.engine import state_length
    from baro_jax.sampling import greedy

    T0 = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    need = max(lengths) + args.new_tokens + 1
    eng = baro_jax.load(args.model, backend="ordered", max_context=need)
    log(f"{args.model} loaded (max_context {need})")
    rows, ok = [], True

    def greedy_after(pre, n_prompt):
        tok = int(greedy(pre.logits))
        toks, st = eng.greedy_decode(tok, pre.state, n_prompt, args.new_tokens - 1) if args.new_tokens > 1 else ([], pre.state)
        jax.block_until_ready(st)
        return [tok] + toks

    for n in lengths:
        row = {"prompt_tokens": n, "new_tokens": args.new_tokens, "arms": []}
        ids = [int(x) for x in np.random.default_rng(args.seed + n).integers(0, eng.cfg.vocab_size, n)]
        L = state_length(n + args.new_tokens, eng.cfg.max_context)
        row["state_length"] = L
        batched = []
        for c in args.chunks.split(","):
            c = c.strip()
            chunk = eng.pick_chunk(n, args.new_tokens) if c == "default" else int(c)
            t = time.perf_counter()
            pre = eng.prefill(ids, "batch", chunk, state=eng.new_state(L))
            secs = time.perf_counter() - t
            st = host_leaves(pre.state)
            lg = np.asarray(pre.logits)
            toks = greedy_after(pre, n)
            del pre
            batched.append({"chunk": chunk, "requested": c, "seconds": secs, "state": st, "logits": lg, "tokens": toks})
            log(f"n={n} batched chunk {chunk}: {secs:.1f}s ({n / secs:.0f} tok/s incl. compile)")
        # decode rate from a short timed run, to decide whether replay fits the deadline
        probe = eng.prefill(ids[:64], "batch", 64, state=eng.new_state(L))
        t = time.perf_counter()
        _, st = eng.greedy_decode(1, probe.state, 64, 32)
        jax.block_until_ready(st)
        rate = 32 / (time.perf_counter() - t)
        del probe, st
        est = n / rate
        row["replay_rate_estimate_tok_s"] = rate
        left = args.deadline_s - (time.perf_counter() - T0)
        if est > left:
            row["replay"] = {"skipped": True,
                             "reason": f"replay of {n} tokens at ~{rate:.0f} tok/s needs ~{est:.0f}s; "
                                       f"{left:.0f}s left before --deadline-s {args.deadline_s:.0f}"}
            log(f"n={n}: replay skipped ({row['replay']['reason']})")
            row["peak_device_gb"] = peak_gb()
            rows.append(row)
            for b in batched:
                row["arms"].append({k: b[k] for k in ("chunk", "requested", "seconds")})
            continue

        def progress(done, total):
            if done % 8192 == 0:
                log(f"n={n} replay {done}/{total}")

        t = time.perf_counter()
        ref = eng.prefill(ids, "replay", state=eng.new_state(L), progress=progress)
        rsecs = time.perf_counter() - t
        ref_state = host_leaves(ref.state)
        ref_logits = np.asarray(ref.logits)
        ref_tokens = greedy_after(ref, n)
        del ref
        row["replay"] = {"seconds": rsecs, "tokens_per_s": n / rsecs}
        log(f"n={n} replay: {rsecs:.1f}s ({n / rsecs:.0f} tok/s)")
        for b in batched:
            diff = [i for i, (x, y) in enumerate(zip(b["state"], ref_state)) if not same(x, y)]
            arm = {"chunk": b["chunk"], "requested": b["requested"], "seconds": b["seconds"],
                   "state_leaves": len(ref_state), "state_leaves_differing": len(diff),
                   "first_differing_leaf": diff[0] if diff else None,
                   "logits_equal": same(b["logits"], ref_logits), "tokens_equal": b["tokens"] == ref_tokens}
            arm["identical"] = not diff and arm["logits_equal"] and arm["tokens_equal"]
            ok = ok and arm["identical"]
            row["arms"].append(arm)
            log(f"n={n} chunk {b['chunk']}: {'IDENTICAL' if arm['identical'] else 'DIFFERENT'} "
                f"(state leaves differing {len(diff)}/{len(ref_state)}, logits {arm['logits_equal']}, "
                f"tokens {arm['tokens_equal']})")
        row["peak_device_gb"] = peak_gb()
        rows.append(row)
        write_json(args.json, {"summary": {**provenance(), "model": args.model, "pass": None}, "rows": rows})
    compared = [a for r in rows for a in r["arms"] if "identical" in a]
    summary = {**provenance(), "model": args.model, "lengths": lengths, "chunks": args.chunks,
               "new_tokens": args.new_tokens, "deadline_s": args.deadline_s,
               "arms_compared": len(compared), "pass": bool(compared) and ok,
               "total_seconds": time.perf_counter() - T0}
    write_json(args.json, {"summary": summary, "rows": rows})
    print("PASS" if summary["pass"] else "FAIL", f"{len(compared)} arms compared", flush=True)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
