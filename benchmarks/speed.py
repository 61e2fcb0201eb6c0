"""Prefill speed: batched-ordered vs replay-ordered vs batched-xla, each checked while timed.

    python benchmarks/speed.py --model qwen3.5-35b-a3b --lengths 1024,8192 --chunk 1024 --json out.json

Arms (compile time excluded: each graph is run once on a throwaway state first):
- batch-ordered: the product. Checked: its last logits equal replay-ordered's, bytes
  (when replay ran at that length), else equal to a second batched run.
- replay-ordered: the decode step per prompt token (the identity reference).
- batch-xla: plain jnp prefill. Checked: greedy top-1 of the last logits equals the
  ordered arm's and max |logit diff| is reported.
Decode tokens/s is measured too (ordered, m = 1 steps after the prompt).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import provenance, write_json  # noqa: E402


def prompt_ids(n, vocab, seed=0):
    # Bytes-range ids so the same prompt works for every vocabulary (>= 256).
    return [int(t) for t in np.random.default_rng(seed).integers(0, min(vocab, 256), n)]


def warm(eng, chunk, state_len):
    """Compile the chunk graph and the decode step outside the timed region."""
    st = eng.new_state(state_len)
    lg, st = eng.prefill_chunk([1] * min(chunk, 3), st, 0, chunk)
    lg, st = eng.decode_step(1, st, 3)
    jax.block_until_ready(lg)


def time_decode(eng, logits, state, pos, n):
    from baro_jax.sampling import greedy

    t0 = time.perf_counter()
    for i in range(n):
        logits, state = eng.decode_step(int(greedy(logits)), state, pos + i)
    jax.block_until_ready(logits)
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--replay-max", type=int, default=8192, help="skip the replay arm above this length")
    ap.add_argument("--arms", default="batch-ordered,replay-ordered,batch-xla")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import baro_jax
    from baro_jax.engine import state_length

    lengths = [int(x) for x in args.lengths.split(",") if x]
    arms = args.arms.split(",")
    max_ctx = state_length(max(lengths) + args.decode_tokens, 1 << 30)
    engines = {}
    if any(a.endswith("ordered") for a in arms):
        engines["ordered"] = baro_jax.load(args.model, backend="ordered", max_context=max_ctx, seed=args.seed)
    if "batch-xla" in arms:
        base = engines.get("ordered")
        engines["xla"] = (baro_jax.Engine(base.cfg, base.params, base.tokenizer, backend="xla", name=base.name)
                          if base else baro_jax.load(args.model, backend="xla", max_context=max_ctx, seed=args.seed))
    results = []
    for n in lengths:
        ids = prompt_ids(n, next(iter(engines.values())).cfg.vocab_size, args.seed)
        L = state_length(n + args.decode_tokens, max_ctx)
        row = {"prompt_tokens": n, "chunk": args.chunk, "state_len": L}
        ref = None
        for arm in arms:
            mode, backend = arm.split("-")
            if mode == "replay" and n > args.replay_max:
                row[arm] = {"skipped": f"replay above --replay-max {args.replay_max}"}
                continue
            eng = engines[backend]
            warm(eng, args.chunk, L)
            pre = eng.prefill(ids, mode, args.chunk, state=eng.new_state(L))
            logits = np.asarray(pre.logits)
            r = {"seconds": pre.seconds, "tokens_per_s": pre.tokens_per_s}
            if backend == "ordered" and ref is not None:
                r["logits_equal_to_" + ref[0]] = bool(ref[1].tobytes() == logits.tobytes())
            if backend == "ordered" and ref is None:
                ref = (arm, logits)
            if backend == "xla" and ref is not None:
                r["top1_equal_to_ordered"] = bool(int(np.argmax(logits)) == int(np.argmax(ref[1])))
                r["max_abs_logit_diff_vs_ordered"] = float(np.max(np.abs(logits - ref[1])))
            if mode == "batch" and backend == "ordered" and args.decode_tokens:
                r["decode_tokens_per_s"] = time_decode(eng, pre.logits, pre.state, n, args.decode_tokens)
            row[arm] = r
            print(f"n={n:>6} {arm:>15}: {r['tokens_per_s']:10.1f} tok/s  {pre.seconds:8.3f}s  "
                  + " ".join(f"{k}={v}" for k, v in r.items() if k not in ("seconds", "tokens_per_s")), flush=True)
        bo, ro = row.get("batch-ordered", {}), row.get("replay-ordered", {})
        if "tokens_per_s" in bo and "tokens_per_s" in ro:
            row["batch_over_replay"] = bo["tokens_per_s"] / ro["tokens_per_s"]
        results.append(row)
        write_json(args.json, {"summary": {"model": args.model, "partial": True}, "rows": results})
    ok = all(v for row in results for arm in row.values() if isinstance(arm, dict)
             for k, v in arm.items() if k.startswith("logits_equal"))
    write_json(args.json, {"summary": {"model": args.model, "checks_pass": ok, **provenance()}, "rows": results})
    print("checks", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
