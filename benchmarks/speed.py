"""Prefill speed: batched-ordered vs replay-ordered vs batched-xla (vs the transformers peer), each checked.

    python benchmarks/speed.py --model qwen3.5-35b-a3b --lengths 1024,8192,32768 --chunk 1024,2048 \\
        --peer --json out.json --png out.png

Arms (compile time excluded: each graph is run once on a throwaway state first; tokens/s is the
median wall time of --repeats runs, each on a fresh state):
- batch-ordered: the product, at every --chunk (the first one is the headline `batch-ordered`;
  all of them are under `by_chunk`). Its identity check is written in its `identity` entry:
  * "full": at lengths <= --replay-max, the last logits bytes equal replay-ordered's (the whole
    prompt through the decode step);
  * "prefix+tail" above --replay-max (full replay costs minutes there):
    prefix: batched prefill of ids[:--check-prefix] at the same chunk and state length vs
    replay of the same ids[:P] (last logits, bytes);
    tail: batched prefill of ids[:n-K] then replay of the last K = --check-tail ids from that
    state vs the batched prefill of all n ids (last logits, bytes). It runs the decode step at
    the real long context against the batched path there.
- replay-ordered: the decode step once per prompt token (the identity reference), timed only
  at lengths <= --replay-max.
- batch-xla: plain jnp prefill at the first chunk. Checked: greedy top-1 of the last logits
  equals the ordered arm's; max |logit diff| is reported.
- peer-hf (--peer): benchmarks/peer_hf.py (transformers + FLA) in a subprocess run FIRST, so
  its weights are freed before ours are made on the same card (or --peer-json: reuse a file it
  wrote). ratio_vs_peer = batch-ordered tok/s / peer tok/s. --peer-lengths runs it at fewer
  lengths than ours (its memory at 128k, say); a length it skips has no peer-hf entry.
Decode tokens/s is measured too (ordered, m = 1 steps after the prompt, headline chunk).

--mode tier: the checks above are short by default (prefix 128, tail 32, no full replay), since
tier mode replays at decode speed (about 11 tok/s on the H200 at full size); the tier identity
gate proper is benchmarks/identity.py --mode tier. A length that fails (out of memory, say) is
recorded in its row with the error, the other lengths still run, and the exit status is
non-zero. Every row has the device's memory counters (`device_memory`: bytes in use and the
peak since the process started, where the backend reports them); tier rows also the budget's
count for the request (`budget_counted_bytes`).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import jax

HERE = os.path.dirname(os.path.abspath(__file__))
from baro_jax.verify.digests import same_bytes as same
from baro_jax.verify.records import provenance, write_json

T0 = time.perf_counter()


def log(msg: str):
    print(f"[speed {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# The identity checks' sizes per mode. Tier mode replays at decode speed (about 11 tok/s on the
# H200 at full size: every layer stages its missed experts), so its checks stay short; the tier
# identity gate proper is benchmarks/identity.py --mode tier.
DEFAULTS = {"resident": {"replay_max": 8192, "check_prefix": 1088, "check_tail": 64},
            "tier": {"replay_max": 0, "check_prefix": 128, "check_tail": 32}}


def prompt_ids(n, vocab, seed=0):
    # Bytes-range ids so the same prompt works for every vocabulary (>= 256).
    return [int(t) for t in np.random.default_rng(seed).integers(0, min(vocab, 256), n)]


def model_context(name: str) -> int | None:
    """The model's own context limit (a preset's or a checkpoint's config), None if unknown."""
    from baro_jax.config import PRESETS, load_config, preset
    from baro_jax.loading import TINY_CHECKPOINT

    name = TINY_CHECKPOINT if name == "tiny" else name
    if name in PRESETS:
        return preset(name).max_context
    if os.path.isdir(name):
        return load_config(name).max_context
    return None


def warm(eng, chunk, state_len):
    """Compile the chunk graph, the decode step and the greedy decode blocks (a full one and a
    shorter last one: two graphs) outside the timed region."""
    st = eng.new_state(state_len)
    lg, st = eng.prefill_chunk([1] * min(chunk, 3), st, 0, chunk)
    lg, st = eng.decode_step(1, st, 3)
    _, st = eng.greedy_decode(1, st, 4, eng.settings.decode_block + 2)
    jax.block_until_ready(st)


def time_decode(eng, logits, state, pos, n):
    """Greedy decode of n tokens after the prompt as generate() runs it (Engine.greedy_decode:
    blocks of steps on the device). Returns (tokens/s, whether its first tokens equal one
    decode_step call per token from a copy of the same state)."""
    import jax.numpy as jnp

    from baro_jax.sampling import greedy

    tok = int(greedy(logits))
    k = min(16, n)
    st = jax.tree_util.tree_map(jnp.copy, state)
    ref, t = [], tok
    for i in range(k):
        lg, st = eng.decode_step(t, st, pos + i)
        t = int(greedy(lg))
        ref.append(t)
    del st, lg
    eng.reset_expert_cache_stats()  # the hit rate of the timed tokens only
    t0 = time.perf_counter()
    toks, state = eng.greedy_decode(tok, state, pos, n)
    jax.block_until_ready(state)
    return n / (time.perf_counter() - t0), toks[:k] == ref


def expert_copy_bound(eng, repeats=3):
    """Tier mode: (bytes of all routed experts, measured host->device GB/s of one layer's experts)."""
    from baro_jax import staging

    layers = eng.params["layers"]
    on_dev = staging.device_sharding(next(iter(eng.params["embed"].devices())))
    total = sum(staging.layer_expert_bytes(lp) for lp in layers)
    one = staging.split_layer(layers[0])[1]
    nbytes = staging.layer_expert_bytes(layers[0])
    ts = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        x = jax.device_put(one, on_dev)
        jax.block_until_ready(x)
        ts.append(time.perf_counter() - t)
        del x
    return total, nbytes / statistics.median(ts[1:]) / 1e9


def replay_from(eng, ids, state, pos0):
    """Decode-step ids[0..] at positions pos0.. from state; last logits (np) and seconds."""
    t0 = time.perf_counter()
    logits = None
    for i, t in enumerate(ids):
        logits, state = eng.decode_step(t, state, pos0 + i)
    logits = np.asarray(jax.block_until_ready(logits))
    return logits, time.perf_counter() - t0




def run_peer(args, lengths) -> tuple[dict | None, dict]:
    """peer_hf.py in a subprocess (before this process touches the device); its JSON and how it ran."""
    path = args.peer_json
    if path and os.path.isfile(path) and not args.peer:
        log(f"peer: reusing {path}")
        with open(path) as f:
            return json.load(f), {"source": "file", "path": path}
    if not args.peer:
        if path:
            log(f"peer: WARNING --peer-json {path} does not exist and --peer is not given: no peer arm")
            return None, {"source": "file", "path": path, "missing": True}
        return None, {}
    if not path:
        base = os.path.splitext(args.json)[0] if args.json else "/tmp/speed"
        path = base + ".peer_hf.json"
    cmd = [sys.executable, os.path.join(HERE, "peer_hf.py"), "--model", args.model,
           "--lengths", ",".join(map(str, lengths)), "--repeats", str(args.peer_repeats),
           "--device", args.peer_device, "--json", path, "--seed", str(args.seed)] + args.peer_arg
    log("peer: " + " ".join(cmd))
    t = time.perf_counter()
    run = {"source": "subprocess", "path": path, "cmd": cmd}
    try:
        r = subprocess.run(cmd, timeout=args.peer_timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        run["rc"] = r.returncode
    except subprocess.TimeoutExpired:
        run["rc"] = None
        run["timed_out_after_s"] = args.peer_timeout
    run["seconds"] = time.perf_counter() - t
    log(f"peer: done in {run['seconds']:.1f}s rc={run.get('rc')}")
    if not os.path.isfile(path):
        return None, run
    with open(path) as f:
        return json.load(f), run


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def summarize(args, chunks, arms, peer, peer_run, timings, final, rows):
    s = {"model": args.model, "chunks": chunks, "arms": arms, "repeats": args.repeats,
         "mode": args.mode, "device_budget_gb": args.device_budget_gb, "devices": args.devices,
         "replay_max": args.replay_max, "check_prefix": args.check_prefix, "check_tail": args.check_tail,
         "identity_method": ("lengths <= replay_max: batch-ordered's last logits bytes == replay-ordered's "
                             "(whole prompt). Longer: prefix = batched prefill of ids[:check_prefix] vs replay "
                             "of ids[:check_prefix], tail = batched prefill of ids[:n-check_tail] then replay "
                             "of the last check_tail ids vs batched prefill of all n ids; last logits bytes, "
                             "same chunk and state length as the timed run."),
         "timings_s": timings, "partial": not final}
    if peer is not None or peer_run:
        ps = (peer or {}).get("summary", {})
        s["peer"] = {k: ps.get(k) for k in (
            "arm", "device", "versions", "fla_used", "fla_import", "gdn_kernels", "gdn_calls_match_layers",
            "hf_class", "attn_implementation", "experts_implementation", "n_params", "build_seconds",
            "weights_memory_gb", "dtype", "error", "partial", "total_seconds")}
        s["peer"]["run"] = {k: v for k, v in peer_run.items() if k != "cmd"}
        s["peer"]["cmd"] = " ".join(peer_run.get("cmd", []))
    if final:
        checks = [r["identity"]["equal"] for row in rows for r in row.get("by_chunk", {}).values()
                  if "identity" in r]
        checks += [r["decode_blocks_equal_steps"] for row in rows for r in row.get("by_chunk", {}).values()
                   if "decode_blocks_equal_steps" in r]
        s["checks_pass"] = all(checks) if checks else None
        s["checks_run"] = len(checks)
        s["failed_lengths"] = [row["prompt_tokens"] for row in rows if row.get("failed")]
        s.update(provenance())
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--chunk", default="1024",
                    help="comma list of prefill chunks; the first is the headline; 'auto' = the engine's own "
                         "pick for each prompt (Engine.pick_chunk: resident default_chunk halved until it fits the "
                         "device, tier the largest that fits the budget)")
    ap.add_argument("--mode", default="resident", choices=["resident", "tier"],
                    help="tier: routed experts in pinned host memory (batch-ordered arm only; decode through "
                         "the expert cache, its hit rate reported)")
    ap.add_argument("--device-budget-gb", type=float, default=None, help="tier mode: the device budget")
    ap.add_argument("--devices", type=int, default=None,
                    help="expert parallel over N devices (baro_jax.load(devices=N)) for the ordered arms")
    ap.add_argument("--replay-max", type=int, default=None,
                    help="time replay (and check against it) only at lengths <= this; above, prefix+tail checks "
                         f"(default {DEFAULTS['resident']['replay_max']}; tier mode "
                         f"{DEFAULTS['tier']['replay_max']}: no full replays)")
    ap.add_argument("--check-prefix", type=int, default=None,
                    help="prefix length P of the long-prompt check (default "
                         f"{DEFAULTS['resident']['check_prefix']}; tier mode {DEFAULTS['tier']['check_prefix']})")
    ap.add_argument("--check-tail", type=int, default=None,
                    help="tail length K of the long-prompt check, 0: off (default "
                         f"{DEFAULTS['resident']['check_tail']}; tier mode {DEFAULTS['tier']['check_tail']})")
    ap.add_argument("--arms", default="batch-ordered,replay-ordered,batch-xla")
    ap.add_argument("--xla-chunk", type=int, default=1024,
                    help="largest chunk of the batch-xla arm (its jnp MoE materialises a dense [rows, E*K] "
                         "operand: chunk 8192 asked for 64 GiB on the H200)")
    ap.add_argument("--repeats", type=int, default=1, help="timed batched prefills per length and chunk (median)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="plot tok/s vs prompt length (benchmarks/plot_speed.py)")
    ap.add_argument("--decode-png", default=None, help="plot decode tok/s vs context (benchmarks/plot_speed.py)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds from start; a length or the xla arm that would start later is skipped (recorded)")
    ap.add_argument("--peer", action="store_true", help="run benchmarks/peer_hf.py first (subprocess)")
    ap.add_argument("--peer-json", default=None,
                    help="where the peer writes its JSON; without --peer, an existing file to reuse")
    ap.add_argument("--peer-repeats", type=int, default=3)
    ap.add_argument("--peer-lengths", default=None,
                    help="prompt lengths of the peer arm, each one of --lengths (default: all of --lengths)")
    ap.add_argument("--peer-device", default="cuda")
    ap.add_argument("--peer-timeout", type=float, default=None, help="seconds; the peer is killed after this")
    ap.add_argument("--peer-arg", action="append", default=[], help="extra argument for peer_hf.py (repeatable)")
    args = ap.parse_args(argv)
    for k, v in DEFAULTS[args.mode].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    lengths = ints(args.lengths)
    peer_lengths = lengths if args.peer_lengths is None else ints(args.peer_lengths)
    if set(peer_lengths) - set(lengths):
        ap.error(f"--peer-lengths {sorted(set(peer_lengths) - set(lengths))} not in --lengths {lengths}")
    chunks = [c if c == "auto" else int(c) for c in (x.strip() for x in args.chunk.split(",")) if c]
    arms = [a for a in args.arms.split(",") if a]
    if args.devices is not None and "batch-xla" in arms:
        ap.error("--devices runs the ordered arms (expert parallel is an ordered-kernel path); drop batch-xla")
    if args.mode == "tier" and set(arms) - {"batch-ordered"}:
        ap.error("--mode tier runs the batch-ordered arm only (--arms batch-ordered)")
    bad = set(arms) - {"batch-ordered", "replay-ordered", "batch-xla"}
    if bad:
        ap.error(f"unknown arm(s) {sorted(bad)}")
    timings = {}

    # The peer first: nothing in this process has touched the device yet.
    peer, peer_run = run_peer(args, peer_lengths)
    if peer_run.get("seconds") is not None:
        timings["peer_subprocess"] = peer_run["seconds"]
    peer_rows = {r["prompt_tokens"]: r["peer-hf"] for r in (peer or {}).get("rows", [])}

    import baro_jax
    from baro_jax.budget import device_memory_stats, tier_parts
    from baro_jax.shapes import state_length

    max_ctx = state_length(max(lengths) + args.decode_tokens, 1 << 30)
    model_ctx = model_context(args.model)
    if model_ctx and max_ctx > model_ctx:  # a power of two past the model's context is refused
        max_ctx = model_ctx
    engines = {}
    t = time.perf_counter()
    if any(a.endswith("ordered") for a in arms):
        engines["ordered"] = baro_jax.load(args.model, backend="ordered", max_context=max_ctx, seed=args.seed,
                                           mode=args.mode, device_budget_gb=args.device_budget_gb,
                                           devices=args.devices)
        jax.block_until_ready(engines["ordered"].params)
    if "batch-xla" in arms:
        base = engines.get("ordered")
        engines["xla"] = (baro_jax.Engine(base.cfg, base.params, base.tokenizer, backend="xla", name=base.name)
                          if base else baro_jax.load(args.model, backend="xla", max_context=max_ctx, seed=args.seed))
        jax.block_until_ready(engines["xla"].params)
    timings["load_weights"] = time.perf_counter() - t
    log(f"weights for {args.model} ready in {timings['load_weights']:.1f}s (synthetic/loaded, on device)")
    vocab = next(iter(engines.values())).cfg.vocab_size
    tier_bound = None
    if args.mode == "tier":
        tier_bound = expert_copy_bound(engines["ordered"])
        timings["expert_bytes"] = tier_bound[0]
        timings["host_to_device_gb_per_s"] = tier_bound[1]
        log(f"tier: {tier_bound[0] / 1e9:.1f} GB of routed experts per pass, host->device "
            f"{tier_bound[1]:.1f} GB/s measured")

    def plot():
        if args.png or args.decode_png:
            try:
                import plot_speed

                if args.png:
                    plot_speed.plot(out, args.png)
                if args.decode_png:
                    plot_speed.plot_decode(out, args.decode_png)
            except Exception as e:  # noqa: BLE001  (a plot must not lose the numbers)
                log(f"plot failed: {type(e).__name__}: {e}")

    results = []
    out = {}
    def late() -> bool:
        return args.deadline_s is not None and time.perf_counter() - T0 > args.deadline_s

    def run_length(n: int) -> dict:
        """One prompt length: every arm, timed and checked; its row."""
        asked = n
        if n + args.decode_tokens > max_ctx:  # decode at the model's full context: the prompt leaves room
            n = max_ctx - args.decode_tokens
            log(f"n={asked}: prompt of {n} tokens, so that {args.decode_tokens} decode tokens end at the "
                f"context of {max_ctx}")
        ids = prompt_ids(n, vocab, args.seed)
        L = state_length(n + args.decode_tokens, max_ctx)
        e0 = next(iter(engines.values()))
        chunks_n = list(dict.fromkeys(e0.pick_chunk(n, args.decode_tokens) if c == "auto" else c for c in chunks))
        row = {"prompt_tokens": n, "state_len": L, "chunks": chunks_n}
        if asked != n:
            row["length_asked"] = asked
        replay_logits = None
        if "replay-ordered" in arms:
            if n > args.replay_max:
                row["replay-ordered"] = {"skipped": f"replay timed only at lengths <= --replay-max {args.replay_max}"}
            else:
                eng = engines["ordered"]
                warm(eng, chunks_n[0], L)
                pre = eng.prefill(ids, "replay", state=eng.new_state(L))
                replay_logits = np.asarray(pre.logits)
                row["replay-ordered"] = {"seconds": pre.seconds, "tokens_per_s": pre.tokens_per_s}
                log(f"n={n:>6} {'replay-ordered':>15}: {pre.tokens_per_s:10.1f} tok/s  {pre.seconds:8.3f}s")
                del pre
        prefix_ref = None  # (P, logits, seconds) of the replayed prefix, shared by the chunks
        by_chunk = {}
        if "batch-ordered" in arms:
            eng = engines["ordered"]
            for ci, c in enumerate(chunks_n):
                tw = time.perf_counter()
                warm(eng, c, L)
                compile_s = time.perf_counter() - tw
                secs, logits, first = [], None, None
                for rep in range(max(1, args.repeats)):
                    pre = eng.prefill(ids, "batch", c, state=eng.new_state(L))
                    secs.append(pre.seconds)
                    logits = np.asarray(pre.logits)
                    first = logits if first is None else first
                    if rep + 1 < args.repeats:
                        del pre
                med = statistics.median(secs)
                r = {"chunk": c, "tokens_per_s": n / med, "seconds": med, "seconds_all": secs,
                     "warm_compile_s": compile_s, "repeat_runs_equal": same(first, logits)}
                checks = []
                if replay_logits is not None:
                    eq = same(logits, replay_logits)
                    r["logits_equal_to_replay-ordered"] = eq
                    checks.append({"kind": "full-replay", "tokens": n, "equal": eq,
                                   "compared": "last logits bytes: batched prefill of all ids vs replay of all ids"})
                else:
                    tc = time.perf_counter()
                    P = min(args.check_prefix, n)
                    if P > 0:
                        if prefix_ref is None:
                            lg, s = replay_from(eng, ids[:P], eng.new_state(L), 0)
                            prefix_ref = (P, lg, s)
                        bp = np.asarray(eng.prefill(ids[:P], "batch", c, state=eng.new_state(L)).logits)
                        checks.append({"kind": "prefix", "tokens": P, "equal": same(bp, prefix_ref[1]),
                                       "replay_seconds": prefix_ref[2],
                                       "compared": f"last logits bytes: batched prefill of ids[:{P}] (chunk {c}, "
                                                   f"state {L}) vs replay of ids[:{P}]"})
                    K = args.check_tail
                    if 0 < K < n:
                        head = eng.prefill(ids[:n - K], "batch", c, state=eng.new_state(L))
                        tl, _ = replay_from(eng, ids[n - K:], head.state, n - K)
                        del head
                        checks.append({"kind": "tail", "tokens": K, "from_position": n - K,
                                       "equal": same(tl, logits),
                                       "compared": f"last logits bytes: batched prefill of ids[:{n - K}] then replay "
                                                   f"of ids[{n - K}:{n}] vs batched prefill of all {n} ids "
                                                   f"(chunk {c}, state {L})"})
                    r["check_seconds"] = time.perf_counter() - tc
                r["identity"] = {"checked": "+".join(k["kind"] for k in checks) or "none",
                                 "equal": bool(checks) and all(k["equal"] for k in checks) and r["repeat_runs_equal"],
                                 "details": checks}
                if ci == 0 and args.decode_tokens:
                    r["decode_tokens_per_s"], r["decode_blocks_equal_steps"] = time_decode(
                        eng, pre.logits, pre.state, n, args.decode_tokens)
                    if eng.cache_slots:
                        r["decode_expert_cache"] = eng.expert_cache_report()
                if tier_bound is not None:  # every pass moves all routed experts over the host link
                    passes = -(-n // c)
                    r["passes"] = passes
                    r["host_link_bound_tokens_per_s"] = n / (passes * tier_bound[0] / (tier_bound[1] * 1e9))
                    r["fraction_of_host_link_bound"] = r["tokens_per_s"] / r["host_link_bound_tokens_per_s"]
                    r["budget_counted_bytes"] = sum(  # beside the row's device_memory peak
                        p.bytes for p in tier_parts(eng.cfg, eng.dtype, L, c, eng.cache_slots))
                del pre
                pr = peer_rows.get(n, {})
                if "tokens_per_s" in pr:
                    r["ratio_vs_peer"] = r["tokens_per_s"] / pr["tokens_per_s"]
                by_chunk[str(c)] = r
                if ci == 0:
                    ref_logits = logits
                log(f"n={n:>6} {'batch-ordered':>15} chunk {c:>5}: {r['tokens_per_s']:10.1f} tok/s  {med:8.3f}s  "
                    f"identity {r['identity']['checked']}={r['identity']['equal']}  compile {compile_s:.1f}s"
                    + (f"  x{r['ratio_vs_peer']:.3f} of peer" if "ratio_vs_peer" in r else "")
                    + (f"  decode {r['decode_tokens_per_s']:.1f} tok/s" if "decode_tokens_per_s" in r else ""))
            row["batch-ordered"] = by_chunk[str(chunks_n[0])]
            row["by_chunk"] = by_chunk
        if "batch-xla" in arms and late():
            row["batch-xla"] = {"skipped": f"past --deadline-s {args.deadline_s}"}
        elif "batch-xla" in arms:
            eng = engines["xla"]
            xc = min(chunks_n[0], args.xla_chunk)
            try:
                tw = time.perf_counter()
                warm(eng, xc, L)
                compile_s = time.perf_counter() - tw
                pre = eng.prefill(ids, "batch", xc, state=eng.new_state(L))
                logits = np.asarray(pre.logits)
                r = {"chunk": xc, "seconds": pre.seconds, "tokens_per_s": pre.tokens_per_s,
                     "warm_compile_s": compile_s}
                if by_chunk:
                    r["top1_equal_to_ordered"] = bool(int(np.argmax(logits)) == int(np.argmax(ref_logits)))
                    r["max_abs_logit_diff_vs_ordered"] = float(np.max(np.abs(logits - ref_logits)))
                del pre
                log(f"n={n:>6} {'batch-xla':>15}: {r['tokens_per_s']:10.1f} tok/s  {r['seconds']:8.3f}s  "
                    + " ".join(f"{k}={v}" for k, v in r.items() if k.startswith(("top1", "max_abs"))))
            except Exception as e:  # the reference arm failing (say, out of memory) must not lose the others
                r = {"chunk": xc, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                log(f"n={n:>6} {'batch-xla':>15}: FAILED {r['error']}")
            row["batch-xla"] = r
        if asked in peer_rows:
            row["peer-hf"] = peer_rows[asked]
        elif (peer is not None or peer_run) and asked in peer_lengths:
            row["peer-hf"] = {"missing": (peer or {}).get("summary", {}).get("error", "no peer row at this length")}
        bo, ro, ph = row.get("batch-ordered", {}), row.get("replay-ordered", {}), row.get("peer-hf", {})
        if "tokens_per_s" in bo and "tokens_per_s" in ro:
            row["batch_over_replay"] = bo["tokens_per_s"] / ro["tokens_per_s"]
        if "tokens_per_s" in bo and "tokens_per_s" in ph:
            row["ratio_vs_peer"] = bo["tokens_per_s"] / ph["tokens_per_s"]
        return row

    for n in lengths:
        tn = time.perf_counter()
        if late():
            log(f"n={n:>6} skipped: past --deadline-s {args.deadline_s}")
            results.append({"prompt_tokens": n, "skipped": f"past --deadline-s {args.deadline_s}",
                            **({"peer-hf": peer_rows[n]} if n in peer_rows else {})})
            continue
        try:
            row = run_length(n)
        except Exception as e:  # noqa: BLE001  (out of memory, say: recorded, the next length runs)
            row = {"prompt_tokens": n, "failed": True, "error": f"{type(e).__name__}: {str(e).strip()[:2000]}",
                   **({"peer-hf": peer_rows[n]} if n in peer_rows else {})}
            log(f"n={n:>6} FAILED {row['error'].splitlines()[0][:300]}")
        gc.collect()  # a failed length's buffers (held by its traceback until here) go before the next
        row["device_memory"] = device_memory_stats()  # the peak is since the process started
        n = row["prompt_tokens"]
        timings[f"length_{n}"] = time.perf_counter() - tn
        log(f"n={n:>6} done in {timings[f'length_{n}']:.1f}s"
            + (f"; batch-ordered / peer = {row['ratio_vs_peer']:.3f}" if "ratio_vs_peer" in row else ""))
        results.append(row)
        out = {"summary": summarize(args, chunks, arms, peer, peer_run, timings, False, results), "rows": results}
        write_json(args.json, out)
        plot()
    timings["total"] = time.perf_counter() - T0
    out = {"summary": summarize(args, chunks, arms, peer, peer_run, timings, True, results), "rows": results}
    failed = out["summary"]["failed_lengths"]
    ok = out["summary"]["checks_pass"] is not False and not failed
    write_json(args.json, out)
    plot()
    print("checks", "PASS" if ok else "FAIL", *([f"(lengths failed: {failed})"] if failed else []), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
