"""Long-context identity: one long prompt, batched prefill (the default chunk and others) vs replay.

    python benchmarks/identity_longctx.py --model qwen3.5-35b-a3b --lengths 65536,131072 \
        --chunks default,4096 --new-tokens 32 --deadline-s 540 --json out.json

Per length: a seeded random prompt; each batched arm runs first (seconds), its state (every
leaf), last logits and --new-tokens greedy tokens (Engine.greedy_decode) are copied to the host;
then replay (the decode step once per prompt token, the reference) runs, unless the measured
decode rate says it would end after --deadline-s: then the length is recorded as skipped with
that estimate (the reason a 10-minute device call cannot hold it). Every comparison is bytes.
Peak device memory (memory_stats) is reported per length. Exit status 1 on any difference.

A replay longer than one device call (128k tokens at today's decode rate) runs in two:
    --replay-stop N --replay-save DIR    replays the first N tokens, saves the state to DIR, stops
    --replay-resume DIR                  loads it, replays the rest, then compares as above
(one length; the saved file records model, seed, length, state length and commit, and a
resume that does not match them is refused). The machine keeps DIR only while it is warm.
"""
from __future__ import annotations

import argparse
import json
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


def save_replay(path, state, meta):
    """The state's leaves as raw bytes with their dtypes and shapes, and meta, in one .npz."""
    leaves = host_leaves(state)
    meta = {**meta, "leaves": [{"dtype": str(a.dtype), "shape": list(a.shape)} for a in leaves]}
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
             **{f"leaf{i}": np.frombuffer(a.tobytes(), np.uint8) for i, a in enumerate(leaves)})


def saved_meta(f):
    """The meta dict of an open save_replay file."""
    return json.loads(f["meta"].tobytes().decode())


def replay_range(eng, ids, st, start, stop, n):
    """The decode step once per token of ids[start:stop] on state st (holding ids[:start]);
    returns (the last step's logits, the state)."""
    lg = None
    for p in range(start, stop):
        lg, st = eng.decode_step(ids[p], st, p)
        if (p + 1) % 8192 == 0:
            log(f"n={n} replay {p + 1}/{stop}" + (f" (of {n})" if stop != n else ""))
    return lg, jax.block_until_ready(st)


def load_replay(path, like, expect):
    """The state saved by save_replay, on the devices of `like` (a fresh state of the same
    shape), after checking that its meta matches `expect`; returns (state, meta)."""
    import jax.numpy as jnp

    with np.load(path) as f:
        meta = saved_meta(f)
        for k, v in expect.items():
            if meta.get(k) != v:
                raise SystemExit(f"identity_longctx: {path} was saved with {k}={meta.get(k)!r}, this run has {v!r}")
        ref, treedef = jax.tree_util.tree_flatten(like)
        if len(meta["leaves"]) != len(ref):
            raise SystemExit(f"identity_longctx: {path} holds {len(meta['leaves'])} state leaves, expected {len(ref)}")
        leaves = []
        for i, (info, r) in enumerate(zip(meta["leaves"], ref)):
            a = np.frombuffer(f[f"leaf{i}"].tobytes(), jnp.dtype(info["dtype"])).reshape(info["shape"])
            if a.shape != r.shape or a.dtype != r.dtype:
                raise SystemExit(f"identity_longctx: {path} leaf {i} is {a.dtype}{list(a.shape)}, "
                                 f"expected {r.dtype}{list(r.shape)}")
            leaves.append(jax.device_put(a, r.sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves), meta


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
    ap.add_argument("--replay-stop", type=int, default=None,
                    help="replay only the first N tokens, save the state to --replay-save and stop")
    ap.add_argument("--replay-save", default=None, help="directory for --replay-stop's state")
    ap.add_argument("--replay-resume", default=None, help="directory of a --replay-stop run to continue")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    split = args.replay_stop is not None or args.replay_resume is not None
    if (args.replay_stop is None) != (args.replay_save is None):
        ap.error("--replay-stop and --replay-save go together")
    if args.replay_stop is not None and args.replay_resume is not None:
        ap.error("--replay-stop saves a first part, --replay-resume continues one: give one of them")
    if split and len([x for x in args.lengths.split(",") if x.strip()]) != 1:
        ap.error("a replay in two calls takes one --lengths value")
    if args.replay_resume is not None:
        n1 = int(args.lengths.split(",")[0])
        if not os.path.isfile(os.path.join(args.replay_resume, f"replay_{n1}.npz")):
            ap.error(f"--replay-resume: no replay_{n1}.npz in {args.replay_resume} (run --replay-stop first)")

    import baro_jax
    from baro_jax.engine import PrefillResult, state_length
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
        meta = {"model": args.model, "seed": args.seed, "prompt_tokens": n, "state_length": L}
        if args.replay_stop is not None:  # the first part of a two-call replay
            stop = args.replay_stop
            if not 1 <= stop < n:
                raise SystemExit(f"identity_longctx: --replay-stop must be in 1..{n - 1}, got {stop}")
            t = time.perf_counter()
            _, st = replay_range(eng, ids, eng.new_state(L), 0, stop, n)
            rsecs = time.perf_counter() - t
            os.makedirs(args.replay_save, exist_ok=True)
            path = os.path.join(args.replay_save, f"replay_{n}.npz")
            save_replay(path, st, {**meta, "replayed": stop, "seconds": rsecs, "commit": provenance().get("commit")})
            log(f"n={n} replayed {stop} tokens in {rsecs:.1f}s ({stop / rsecs:.0f} tok/s); state saved to {path}")
            summary = {**provenance(), "model": args.model, "lengths": lengths, "pass": None,
                       "replay_part": {"replayed": stop, "of": n, "seconds": rsecs, "saved": path}}
            write_json(args.json, {"summary": summary, "rows": [row]})
            return 0
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
        if args.replay_resume is not None:  # only the part after the saved state is left to run
            with np.load(os.path.join(args.replay_resume, f"replay_{n}.npz")) as f:
                est = (n - saved_meta(f)["replayed"]) / rate
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
        if args.replay_resume is not None:  # the second part: continue the saved replay
            path = os.path.join(args.replay_resume, f"replay_{n}.npz")
            st, saved = load_replay(path, eng.new_state(L), meta)
            start = saved["replayed"]
            log(f"n={n} resuming the replay at {start} from {path} (first part {saved['seconds']:.0f}s, "
                f"commit {saved.get('commit')})")
            lg, st = replay_range(eng, ids, st, start, n, n)
            ref = PrefillResult(lg, st, time.perf_counter() - t, n)
            prior = saved["seconds"]
            row["replay_parts"] = {"first": {"tokens": start, "seconds": prior, "commit": saved.get("commit")},
                                   "second": {"tokens": n - start}}
        else:
            ref = eng.prefill(ids, "replay", state=eng.new_state(L), progress=progress)
            prior = 0.0
        rsecs = time.perf_counter() - t + prior
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
