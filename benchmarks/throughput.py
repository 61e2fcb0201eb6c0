"""Aggregate decode throughput of generate_batch at several batch sizes, each sequence checked.

For each B in --batches: B prompts of --prompt-len random tokens, --new-tokens greedy tokens each,
one generate_batch call with B slots (the same call run once before, untimed, so that no graph
compiles in the timed one). Reports
the decode steps' aggregate tokens/s (tokens generated after each sequence's first, over the
time from the first decode step to the end) and the whole call's. --check N compares the first
N sequences of every batch with their runs alone (ids and logprob bytes). JSON with device,
commit and date.

    python benchmarks/throughput.py --model qwen3.5-35b-a3b --batches 1,8,32 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import baro_jax
from baro_jax.verify.records import provenance, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill rows per step (default: 1024)")
    ap.add_argument("--check", type=int, default=2, help="sequences per batch compared with their run alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.prompt_len + args.new_tokens
    eng = baro_jax.load(args.model, max_context=max(ctx, 1024), seed=args.seed, progress=False)
    rng = np.random.default_rng(args.seed)
    rows, ok = [], True
    for B in batches:
        prompts = [[int(t) for t in rng.integers(0, eng.cfg.vocab_size, args.prompt_len)] for _ in range(B)]
        # the same call first: it compiles every graph the timed one runs (the prefill chunk, the
        # one-step decode, the full and the shorter greedy blocks)
        eng.generate_batch(prompts, args.new_tokens, max_batch=B, chunk=args.chunk, stop_at_eos=False)
        t0 = time.perf_counter()
        res = eng.generate_batch(prompts, args.new_tokens, max_batch=B, chunk=args.chunk, stop_at_eos=False)
        wall = time.perf_counter() - t0
        stats = dict(eng.last_batch_stats)
        first = [r.prefill_seconds for r in res]  # each sequence's first token, seconds from the start
        gen = sum(len(r.generated_ids) for r in res)
        dec_time = wall - max(first)
        dec_tokens = sum(len(r.generated_ids) - 1 for r in res)
        checks = []
        for i in range(min(args.check, B)):
            a = eng.generate(prompts[i], args.new_tokens, logprobs=0, stop_at_eos=False)
            same = (a.generated_ids == res[i].generated_ids
                    and [x.tobytes() for x in a.logprobs] == [x.tobytes() for x in res[i].logprobs])
            checks.append(bool(same))
        ok &= all(checks)
        row = {"batch": B, "generated_tokens": gen, "wall_seconds": wall,
               "aggregate_tokens_per_s": gen / wall,
               "decode_tokens_per_s": dec_tokens / dec_time if dec_time > 0 else None,
               "steps": stats["steps"], "pool_length": stats["pool_length"], "chunk": stats["chunk"],
               "equal_alone": checks}
        rows.append(row)
        print(f"[throughput] B={B:3d}: {row['aggregate_tokens_per_s']:8.1f} tok/s whole call, decode "
              f"{row['decode_tokens_per_s'] or 0:8.1f} tok/s, equal alone {checks}", flush=True)
    out = {"summary": {"model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                       "pass": ok, **provenance()}, "rows": rows}
    if args.json:
        write_json(args.json, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
