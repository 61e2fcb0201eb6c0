"""Long-context identity: one long prompt, batched prefill (the default chunk and others) vs replay.

    python benchmarks/identity_longctx.py --model qwen3.5-35b-a3b --lengths 65536,131072 \
        --chunks default,4096 --new-tokens 32 --deadline-s 540 --json out.json

Per length: a seeded random prompt; each batched arm runs first (seconds), its state (every
leaf), last logits and --new-tokens greedy tokens (Engine.greedy_decode) are copied to the host;
then replay (the decode step once per prompt token, the reference) runs, unless the measured
decode rate says it would end after --deadline-s: then the length is recorded as skipped with
that estimate (the reason a 10-minute device call cannot hold it). Every comparison is bytes.
Peak device memory (memory_stats) is reported per length. Exit status 1 on any difference.
The run itself is baro_jax.verify.longctx.

A replay longer than one device call (128k tokens at today's decode rate) runs in two:
    --replay-stop N --replay-save DIR    replays the first N tokens, saves the state to DIR, stops
    --replay-resume DIR                  loads it, replays the rest, then compares as above
(one length; the saved file records model, seed, length, state length and commit, and a
resume that does not match them is refused). The machine keeps DIR only while it is warm.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lengths", default="65536")
    ap.add_argument("--chunks", default="default,4096", help="'default' = the engine's pick for the prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="skip a replay that would end after this many seconds from the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay-stop", type=int, default=None,
                    help="replay only the first N tokens, save the state to --replay-save and stop")
    ap.add_argument("--replay-save", default=None, help="directory for --replay-stop's state")
    ap.add_argument("--replay-resume", default=None, help="directory of a --replay-stop run to continue")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.length_list = [int(x) for x in args.lengths.split(",") if x.strip()]
    if (args.replay_stop is None) != (args.replay_save is None):
        ap.error("--replay-stop and --replay-save go together")
    if args.replay_stop is not None and args.replay_resume is not None:
        ap.error("--replay-stop saves a first part, --replay-resume continues one: give one of them")
    split = args.replay_stop is not None or args.replay_resume is not None
    if split and len(args.length_list) != 1:
        ap.error("a replay in two calls takes one --lengths value")
    if args.replay_resume is not None:
        from baro_jax.verify.longctx import replay_file

        n1 = args.length_list[0]
        if not os.path.isfile(replay_file(args.replay_resume, n1)):
            ap.error(f"--replay-resume: no replay_{n1}.npz in {args.replay_resume} (run --replay-stop first)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import baro_jax
    from baro_jax import verify
    from baro_jax.verify import longctx

    t0 = time.perf_counter()

    def log(msg):
        print(f"[longctx {time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    lengths = args.length_list
    need = max(lengths) + args.new_tokens + 1
    eng = baro_jax.load(args.model, backend="ordered", max_context=need)
    log(f"{args.model} loaded (max_context {need})")
    try:
        if args.replay_stop is not None:  # the first part of a two-call replay
            n = lengths[0]
            part = longctx.replay_first_part(eng, n, args.replay_stop, args.new_tokens, seed=args.seed,
                                             model=args.model, save_dir=args.replay_save,
                                             commit=verify.provenance().get("commit"), log=log)
            row = {"prompt_tokens": n, "new_tokens": args.new_tokens, "arms": [], "state_length": part.pop("state_length")}
            summary = {**verify.provenance(), "model": args.model, "lengths": lengths, "pass": None,
                       "replay_part": part}
            verify.write_json(args.json, {"summary": summary, "rows": [row]})
            return 0
        rows = []
        for n in lengths:
            rows.append(longctx.run_length(eng, n, args.chunks.split(","), args.new_tokens, seed=args.seed,
                                           model=args.model, deadline_s=args.deadline_s, started=t0,
                                           resume_dir=args.replay_resume, log=log))
            verify.write_json(args.json, {"summary": {**verify.provenance(), "model": args.model, "pass": None},
                                          "rows": rows})
    except ValueError as e:  # a bad --replay-stop, or a saved part that does not match this run
        raise SystemExit(f"identity_longctx: {e}")
    compared = [a for r in rows for a in r["arms"] if "identical" in a]
    ok = bool(compared) and all(a["identical"] for a in compared)
    summary = {**verify.provenance(), "model": args.model, "lengths": lengths, "chunks": args.chunks,
               "new_tokens": args.new_tokens, "deadline_s": args.deadline_s,
               "arms_compared": len(compared), "pass": ok, "total_seconds": time.perf_counter() - t0}
    verify.write_json(args.json, {"summary": summary, "rows": rows})
    print("PASS" if ok else "FAIL", f"{len(compared)} arms compared", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
