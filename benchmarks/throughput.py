"""Aggregate decode throughput of generate_batch at several batch sizes, each sequence checked.

For each B in --batches: B prompts of --prompt-len random tokens, --new-tokens greedy tokens each,
one generate_batch call with B slots (the same call run once before, untimed, so that no graph
compiles in the timed one). Reports the decode steps' aggregate tokens/s (tokens generated after
each sequence's first, over the time from the last first token to the end) and the whole call's,
beside the step's byte bound (decode_bound: the weights a step must read, the distinct routed
experts B sequences touch per layer, the delta states read and written, the KV read, at
--bandwidth-tbs). --check N compares the first N sequences of every batch with their runs alone
(ids and logprob bytes). --mixed N:LEN[:B] adds a mixed-load row: N prompts of LEN tokens arrive
behind B sequences (default: the largest batch) and prefill chunk by chunk while those decode; it reports
the aggregate tokens/s and the time between a sequence's tokens as its callback saw them (p50 /
p99 over all sequences' gaps; greedy blocks deliver tokens in bursts, so also each sequence's mean
time per token, p50 / p99 over sequences). --rollouts P:K adds an RL-rollout row: P prompts of
--prompt-len tokens, K samples of each at temperature 1 (sample j at seed --seed + j), in P * K
slots, twice in one process: as generate_batch(prompts, n=K) (each prompt prefilled once, its
state copied to its other samples) and as the P * K sequences on their own (every sample
prefilling its prompt), with the two arms' ids and logprob bytes compared. --samplings 'greedy=0,0,1;topp=0.8,0,0.95' runs several
sampling arms (NAME=TEMPERATURE,TOP_K,TOP_P) on the same prompts with the weights made once, a row
per arm and batch size. Each row also has the bytes the budget counted for its pool
(budget_counted_bytes, without the runtime reserve) beside the device's memory counters
(device_memory; its peak is over the process so far), so the reserve can be set from measurements.
JSON with device, commit and date; --png plots tokens/s and the bound against B.

    python benchmarks/throughput.py --model qwen3.5-35b-a3b --batches 1,8,32,64 --mixed 4:8192:32 \
        --json out.json --png out.png

--mode tier runs the pool in tier mode (routed experts in host memory, one decode step a call, each
layer's MoE through the decode expert cache or staged whole when the rows route to more experts than
it holds, a step of one row on the direct path); each row then records the cache's counts over its timed
call (expert_cache) and the direct path's (direct_path: its one-row steps' routed pairs), and the byte
bound, which counts device memory only, is no bound on it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
import jax

import baro_jax
from baro_jax.budget import device_memory_stats
from baro_jax.verify.records import provenance, write_json


# The copy rate of one H200 as measured on these machines (device-to-device, bytes read and
# written: /work/.library/device/KINDS.md, 2026-11-04), the ceiling the bound divides by.
H200_COPY_TBS = 4.3


def distinct_experts(E: int, k: int, B: int) -> float:
    """Expected distinct routed experts B rows touch in a layer when each row picks k of E
    uniformly (synthetic weights route about so): E * (1 - (1 - k/E)^B)."""
    return E * (1.0 - (1.0 - k / E) ** B)


def decode_bound(eng, B: int, context: int, bandwidth_tbs: float) -> dict:
    """The bytes one decode step of B sequences at `context` positions must move, and the
    tokens/s that caps: every weight but the routed experts once, each distinct routed expert
    once per layer, each sequence's delta state read and written, its KV read."""
    from baro_jax.config import FULL

    cfg = eng.cfg
    leaves = jax.tree_util.tree_leaves(eng.params)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    layers = eng.params["layers"]
    routed = sum(lp["moe"][n].size * lp["moe"][n].dtype.itemsize for lp in layers for n in ("gate_up", "down"))
    E = int(layers[0]["moe"]["gate_up"].shape[0])
    per_expert = routed / (E * len(layers))
    experts = distinct_experts(E, cfg.top_k, B)
    n_full = sum(t == FULL for t in cfg.layer_types)
    n_lin = len(cfg.layer_types) - n_full
    delta = 2 * B * n_lin * cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
    kv = B * n_full * 2 * context * cfg.num_kv_heads * cfg.head_dim * 2
    step = (total - routed) + experts * per_expert * len(layers) + delta + kv
    return {"bytes_per_step": step, "distinct_experts_per_layer": experts,
            "step_ms": step / (bandwidth_tbs * 1e12) * 1e3, "tokens_per_s": B * bandwidth_tbs * 1e12 / step}


def sampling_arms(args) -> list:
    """[(name, (temperature, top_k, top_p))]: --samplings' arms, or the one of --temperature /
    --top-k / --top-p (named "given"). A ValueError names a malformed arm."""
    if args.samplings is None:
        return [("given", (args.temperature, args.top_k, args.top_p))]
    arms = []
    for part in args.samplings.split(";"):
        name, eq, vals = part.partition("=")
        fields = vals.split(",")
        if not (eq and name.strip() and len(fields) == 3):
            raise ValueError(f"--samplings: each arm is NAME=TEMPERATURE,TOP_K,TOP_P, got {part!r}")
        try:
            arms.append((name.strip(), (float(fields[0]), int(fields[1]), float(fields[2]))))
        except ValueError:
            raise ValueError(f"--samplings: arm {part!r}: TEMPERATURE and TOP_P are numbers, TOP_K an integer") from None
    if len({n for n, _ in arms}) < len(arms):
        raise ValueError(f"--samplings: arm names repeat in {args.samplings!r}")
    return arms


def sampling_of(arm, B: int) -> list:
    """Each of B sequences' Sampling for an arm's (temperature, top_k, top_p): greedy at temperature 0,
    sequence i with seed i (distinct draws, each reproducible alone)."""
    t, k, p = arm
    return [baro_jax.Sampling(temperature=t, top_k=k, top_p=p, seed=i).validate() for i in range(B)]


def mixed_row(eng, args, B: int, rng):
    """B sequences of --prompt-len tokens and N of LEN behind them in one generate_batch call of
    B + N slots: the long prompts prefill a chunk per step while the short ones decode. Returns
    (the results, the row)."""
    n, length, _ = args.mixed
    prompts = [[int(t) for t in rng.integers(0, eng.cfg.vocab_size, args.prompt_len)] for _ in range(B)]
    prompts += [[int(t) for t in rng.integers(0, eng.cfg.vocab_size, length)] for _ in range(n)]
    kw = dict(max_batch=B + n, chunk=args.chunk, stop_at_eos=False, prefill_budget=args.prefill_budget)
    eng.generate_batch(prompts, args.new_tokens, **kw)  # compiles
    times: dict = {}

    def on_token(i, _tok):
        times.setdefault(i, []).append(time.perf_counter())

    t0 = time.perf_counter()
    res = eng.generate_batch(prompts, args.new_tokens, on_token=on_token, **kw)
    wall = time.perf_counter() - t0
    gaps = np.concatenate([np.diff(v) for v in times.values() if len(v) > 1]) * 1e3
    short = np.concatenate([np.diff(times[i]) for i in range(B) if len(times.get(i, [])) > 1]) * 1e3
    # a greedy block delivers its tokens together (gaps near 0, then one as long as the block), so
    # the gaps' p50 says little of the pace: each sequence's mean time per token beside them
    pace = np.array([(v[-1] - v[0]) / (len(v) - 1) for v in times.values() if len(v) > 1]) * 1e3
    gen = sum(len(r.generated_ids) for r in res)
    return res, {"decoding": B, "arriving": n, "arriving_len": length, "generated_tokens": gen, "wall_seconds": wall,
            "aggregate_tokens_per_s": gen / wall,
            "gap_ms_p50": float(np.percentile(gaps, 50)), "gap_ms_p99": float(np.percentile(gaps, 99)),
            "decoding_gap_ms_p50": float(np.percentile(short, 50)),
            "decoding_gap_ms_p99": float(np.percentile(short, 99)),
            "ms_per_token_p50": float(np.percentile(pace, 50)), "ms_per_token_p99": float(np.percentile(pace, 99)),
            "steps": dict(eng.last_batch_stats["steps"])}


def rollout_rows(eng, args, rng) -> dict:
    """--rollouts P:K: the shared-prefill arm (n=K) and the separate one, each timed after an untimed
    run of the same call (its graphs compiled); the arms' outputs must be the same bytes."""
    P, K = args.rollouts
    prompts = [[int(t) for t in rng.integers(0, eng.cfg.vocab_size, args.prompt_len)] for _ in range(P)]
    base = baro_jax.Sampling(temperature=1.0, seed=args.seed)
    kw = dict(max_batch=P * K, chunk=args.chunk, stop_at_eos=False, prefill_budget=args.prefill_budget, logprobs=0)
    repeated = [p for p in prompts for _ in range(K)]
    seeds = [dataclasses.replace(base, seed=base.seed + j) for _ in prompts for j in range(K)]
    arms = {"shared": lambda: eng.generate_batch(prompts, args.new_tokens, sampling=base, n=K, **kw),
            "separate": lambda: eng.generate_batch(repeated, args.new_tokens, sampling=seeds, share_prefixes=False,
                                                   **kw)}
    out, outputs = {"prompts": P, "samples": K, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}, []
    for name, call in arms.items():
        call()  # compiles
        t0 = time.perf_counter()
        res = call()
        wall = time.perf_counter() - t0
        gen = sum(len(r.generated_ids) for r in res)
        out[name] = {"wall_seconds": wall, "generated_tokens": gen, "aggregate_tokens_per_s": gen / wall,
                     "first_token_s_max": max(r.prefill_seconds for r in res),
                     "steps": dict(eng.last_batch_stats["steps"])}
        outputs.append([(r.generated_ids, [x.tobytes() for x in r.logprobs]) for r in res])
    out["arms_equal"] = outputs[0] == outputs[1]
    return out


def plot(rows, path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]  # batch sizes the device refused
    if not rows:  # nothing to draw (a log axis of no points raises): the JSON says why
        print(f"[throughput] no batch size ran: no plot at {path}", flush=True)
        return
    arms = list(dict.fromkeys(r.get("sampling", "given") for r in rows))
    bs = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in arms:
        mine = [r for r in rows if r.get("sampling", "given") == arm]
        label = "generate_batch decode (each checked alone)" + ("" if len(arms) == 1 else f": {arm}")
        ax.plot([r["batch"] for r in mine], [r["decode_tokens_per_s"] or float("nan") for r in mine], "o-", label=label)
    bound = {r["batch"]: r["bound"]["tokens_per_s"] for r in rows}
    ax.plot(bs, [bound[b] for b in bs], "k--", label="byte bound (weights, experts, states)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bs)
    ax.set_xticklabels([str(b) for b in bs])
    ax.set_xlabel("sequences decoding at once (B)")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(title, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mode", default="resident", choices=["resident", "tier"],
                    help="where the routed experts live (tier: pinned host memory, staged per layer)")
    ap.add_argument("--device-budget-gb", type=float, default=None)
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="tier mode: the decode expert cache's slots per layer (default: 64, at most E, fewer when "
                         "the budget says so; 0: none)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill rows per step (default: 1024)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="prompt rows prefilled per round, whole chunks (default: one chunk)")
    ap.add_argument("--check", type=int, default=2, help="sequences per batch compared with their run alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every sequence at this temperature (0: greedy), sequence i with seed i")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--samplings", default=None, metavar="NAME=T,K,P;...",
                    help="several sampling arms in one run (the weights made once), each a row per batch size: "
                         "e.g. 'greedy=0,0,1;topp=0.8,0,0.95' (instead of --temperature / --top-k / --top-p)")
    ap.add_argument("--mixed", default=None, metavar="N:LEN[:B]",
                    help="a mixed-load row: N prompts of LEN tokens arriving behind B decoding sequences "
                         "(default B: the largest of --batches)")
    ap.add_argument("--rollouts", default=None, metavar="P:K",
                    help="an RL-rollout row: P prompts, K samples each, shared prefill against separate")
    ap.add_argument("--mixed-rounds", default="on", choices=("on", "off", "on,off", "off,on"),
                    help="the mixed row with a round's prefill chunk and decode step in one pass (on), apart "
                         "(off), or both arms on the same prompts (their outputs compared)")
    ap.add_argument("--bandwidth-tbs", type=float, default=H200_COPY_TBS,
                    help=f"the memory rate the byte bound divides by (default {H200_COPY_TBS}: an H200's copy rate)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    try:  # before the model loads
        samplings = sampling_arms(args)
        for _, arm in samplings:
            sampling_of(arm, 1)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    if args.mixed is not None:
        parts = args.mixed.split(":")
        if not (len(parts) in (2, 3) and all(p.isdigit() and int(p) >= 1 for p in parts)):
            ap.error(f"--mixed takes N:LEN or N:LEN:B, positive integers, got {args.mixed!r}")
        args.mixed = (int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else max(batches))
    if args.rollouts is not None:
        parts = args.rollouts.split(":")
        if not (len(parts) == 2 and all(p.isdigit() and int(p) >= 1 for p in parts)):
            ap.error(f"--rollouts takes P:K, positive integers, got {args.rollouts!r}")
        args.rollouts = (int(parts[0]), int(parts[1]))
    ctx = max(args.prompt_len, args.mixed[1] if args.mixed else 0) + args.new_tokens
    eng = baro_jax.load(args.model, max_context=max(ctx, 1024), seed=args.seed, mode=args.mode,
                        device_budget_gb=args.device_budget_gb,
                        cache_slots=args.cache_slots if args.mode == "tier" else None, progress=False)
    rng = np.random.default_rng(args.seed)
    rows, ok = [], True
    # the same prompts for every arm of a batch size
    prompts_of = {B: [[int(t) for t in rng.integers(0, eng.cfg.vocab_size, args.prompt_len)] for _ in range(B)]
                  for B in batches}
    for (arm_name, arm), B in ((a, B) for a in samplings for B in batches):
        prompts = prompts_of[B]
        sampling = sampling_of(arm, B)
        # the same call first: it compiles every graph the timed one runs (the prefill chunk, the
        # one-step decode, the full and the shorter greedy blocks). B slots the device cannot hold
        # (64 of 1,280 positions beside the 35B-A3B on an 80 GB card) are refused before any work:
        # the row records why and the others still run.
        try:
            eng.generate_batch(prompts, args.new_tokens, max_batch=B, chunk=args.chunk, stop_at_eos=False,
                               prefill_budget=args.prefill_budget, sampling=sampling)
        except MemoryError as e:
            rows.append({"batch": B, "sampling": arm_name, "error": f"MemoryError: {e}"})
            ok = False
            print(f"[throughput] B={B:3d}: refused, {e}", flush=True)
            continue
        cache = eng.runner.cache if args.mode == "tier" else None
        if cache is not None:
            eng.runner.reset_stats()  # the cache's counts and the direct path's
        t0 = time.perf_counter()
        res = eng.generate_batch(prompts, args.new_tokens, max_batch=B, chunk=args.chunk, stop_at_eos=False,
                                 prefill_budget=args.prefill_budget, sampling=sampling)
        wall = time.perf_counter() - t0
        stats = dict(eng.last_batch_stats)
        # the decode steps' layers: experts from the cache (hits, misses copied) or staged whole
        cache_stats = cache.stats() if cache is not None else None
        # steps of one row on the direct path (DirectDecode.rows): their routed pairs' hits and misses
        direct = eng.runner.direct if cache is not None else None
        direct_stats = None if direct is None else direct.stats()  # once: it reads the device's hit counts
        if direct_stats is not None:
            direct_stats = {k: direct_stats[k] for k in ("pool_row_steps", "hits", "misses")}
        first = [r.prefill_seconds for r in res]  # each sequence's first token, seconds from the start
        gen = sum(len(r.generated_ids) for r in res)
        dec_time = wall - max(first)
        dec_tokens = sum(len(r.generated_ids) - 1 for r in res)
        # Decode tok/s is the tokens after the first ones over the time after the last first one:
        # B sequences decoding together only if every sequence had its first token before any
        # finished. Where the pool's pages or the prefill budget let some finish first, they ran in
        # waves and most tokens came before the last first token: no decode rate then (an H100 at
        # B = 32 read 5,412 tok/s, above its byte bound of 1,892, while the whole call ran at 489).
        last = [r.prefill_seconds + (len(r.generated_ids) - 1) / r.decode_tokens_per_s
                if r.decode_tokens_per_s > 0 else r.prefill_seconds for r in res]  # each one's last token
        waves = B > 1 and max(first) >= min(last)
        checks = []
        for i in range(min(args.check, B)):
            a = eng.generate(prompts[i], args.new_tokens, logprobs=0, stop_at_eos=False, sampling=sampling[i])
            same = (a.generated_ids == res[i].generated_ids
                    and [x.tobytes() for x in a.logprobs] == [x.tobytes() for x in res[i].logprobs])
            checks.append(bool(same))
        ok &= all(checks)
        row = {"batch": B, "sampling": arm_name, "generated_tokens": gen, "wall_seconds": wall,
               "aggregate_tokens_per_s": gen / wall,
               "decode_tokens_per_s": dec_tokens / dec_time if dec_time > 0 and not waves else None,
               "slots": stats["slots"], "waves": waves,
               "steps": stats["steps"], "pool_length": stats["pool_length"], "chunk": stats["chunk"],
               "prefill_budget": stats["prefill_budget"],
               "equal_alone": checks,
               "bound": decode_bound(eng, B, args.prompt_len + args.new_tokens // 2, args.bandwidth_tbs),
               # the count the pool was sized by (without the runtime reserve) beside the device's
               # counters, whose peak is since the process started: over this and the earlier rows
               "budget_counted_bytes": stats["budget_counted_bytes"], "device_memory": device_memory_stats()}
        if args.mode == "tier":
            row["expert_cache"] = cache_stats if cache is not None else {"slots_per_layer": 0,
                                                                         "note": eng.runner.cache_note}
            row["direct_path"] = direct_stats
        rows.append(row)
        ec = row.get("expert_cache")
        where = (f"bound {row['bound']['tokens_per_s']:8.1f}" if ec is None else
                 f"expert cache {ec['slots_per_layer']} slots: {ec.get('hits', 0)} hits, {ec.get('misses', 0)} misses, "
                 f"{ec.get('staged_layers', 0)} layers staged whole"
                 + ("" if not row.get("direct_path") else f"; {row['direct_path']['pool_row_steps']} one-row steps on the "
                    f"direct path: {row['direct_path']['hits']} hits, {row['direct_path']['misses']} misses"))
        rate = (f"decode {row['decode_tokens_per_s'] or 0:8.1f} tok/s" if not waves else
                "in waves (a sequence ended before the last one started), no decode rate")
        print(f"[throughput] {arm_name} B={B:3d}: {row['aggregate_tokens_per_s']:8.1f} tok/s whole call, {rate} ({where}), "
              f"equal alone {checks}", flush=True)
    mixed, arms, outputs = None, {}, []
    for arm in (args.mixed_rounds.split(",") if args.mixed else []):
        # the same prompts for every arm; mixed_rounds never changes a bit, so the arms' outputs must match
        eng.tune(mixed_rounds=arm == "on")
        res, row = mixed_row(eng, args, args.mixed[2], np.random.default_rng(args.seed + 1))
        row["mixed_rounds"] = arm
        outputs.append([(r.generated_ids, [x.tobytes() for x in r.logprobs]) for r in res])
        arms[arm] = row
        mixed = mixed or row
        print(f"[throughput] mixed (rounds in one pass: {arm}): {row['arriving']} x {row['arriving_len']} tokens "
              f"arriving while {row['decoding']} decode: {row['aggregate_tokens_per_s']:.1f} tok/s, time between "
              f"the decoding sequences' tokens p50 {row['decoding_gap_ms_p50']:.2f} ms p99 "
              f"{row['decoding_gap_ms_p99']:.2f} ms, mean per token p50 {row['ms_per_token_p50']:.2f} ms p99 "
              f"{row['ms_per_token_p99']:.2f} ms, {row['steps']['mixed']} rounds in one pass", flush=True)
    if len(outputs) > 1:
        same_arms = all(o == outputs[0] for o in outputs[1:])
        print(f"[throughput] mixed arms give the same ids and logprob bytes: {same_arms}", flush=True)
        ok &= same_arms
        mixed["arms_equal"] = same_arms
    rollouts = None
    if args.rollouts is not None:
        rollouts = rollout_rows(eng, args, np.random.default_rng(args.seed + 2))
        sh, sep = rollouts["shared"], rollouts["separate"]
        print(f"[throughput] rollouts {rollouts['prompts']} prompts x {rollouts['samples']} samples: shared prefill "
              f"{sh['aggregate_tokens_per_s']:.1f} tok/s ({sh['wall_seconds']:.2f}s, {sh['steps']['prefill']} chunks, "
              f"{sh['steps']['forks']} copies), separate {sep['aggregate_tokens_per_s']:.1f} tok/s "
              f"({sep['wall_seconds']:.2f}s, {sep['steps']['prefill']} chunks); the same ids and logprob bytes: "
              f"{rollouts['arms_equal']}", flush=True)
        ok &= rollouts["arms_equal"]
    out = {"summary": {"model": args.model, "mode": args.mode, "device_budget_gb": args.device_budget_gb,
                       "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                       "bandwidth_tbs": args.bandwidth_tbs, "pass": ok, **provenance(),
                       "samplings": {n: {"temperature": t, "top_k": k, "top_p": p} for n, (t, k, p) in samplings},
                       "sampling_seed": "sequence index"}, "rows": rows,
           "mixed": mixed, "mixed_arms": arms or None, "rollouts": rollouts}
    if args.json:
        write_json(args.json, out)
    if args.png:
        s = out["summary"]
        plot(rows, args.png, f"{args.model}, {args.prompt_len}-token prompts, {args.new_tokens} new each; "
                             f"{s.get('device')} {str(s.get('commit'))[:7]} {str(s.get('date'))[:10]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
