"""Where a decode step's time goes: device kernels, their gaps, and the host's launches.

    python benchmarks/decode_profile.py --model qwen3.5-35b-a3b --context 1024 --steps 8 --json out.json

Prefills --context random tokens, runs warm-up decode steps (the m = 1 graph compiles there),
times --steps tokens (wall clock, as generate() runs them: greedy blocks on the device, or one
call per token with --per-token), then runs
--steps more under jax.profiler and reads the trace (jax.profiler.ProfileData):
- per step: wall time, device busy time (union of kernel intervals on the GPU planes), and the
  idle rest (launch latency, host work, the logits copy);
- kernels grouped by name: count per step, total and mean time;
- host-side launch events by name (cuLaunchKernel vs graph launches: whether XLA ran the step as
  command buffers, which is what --xla_gpu_enable_command_buffer decides; XLA_FLAGS is recorded).
On CPU the "kernels" are the XLA thunks of the host plane (for a dry run of this script).
With --batch B the step is generate_batch's: B sequence slots of a pool, each prefilled with its
own --context random tokens, then decode steps of all B rows at once (batch.DECODE_BLOCK, greedy
blocks of the runner's decode_block, the chosen token's logprob computed as generate_batch's
default does); per-step numbers are per step of B tokens. --temperature / --top-k / --top-p sample
every row (row i with seed i) inside the block, as a sampled pool does: where the draw's time goes.
With --prefill the "step" is a whole batched prefill of --context random tokens (at --chunk, or the
engine's pick): where a prompt's time goes, kernel by kernel (--warmup prefills first; 1 compiles
every graph it needs).
With --devices N (expert parallel) the main numbers are the first device's (every device runs
the same graph on its shard) and `per_device` gives each GPU plane's busy time, kernel count and
collective time (NCCL kernels and all-gather thunks: what the experts' sharding costs).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

import numpy as np

from baro_jax.verify.records import provenance, write_json


def union_ns(intervals):
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def graph_times_ns(kernels, n_graphs: int, marker: str = "baro_gpu", gap_ns: int = 50_000):
    """Kernel time of each of n_graphs graphs that ran one after another with a host wait
    between: read_trace's kernels whose name holds `marker`, in start order, split where the
    gap between one's end and the next's start is over gap_ns; each group's kernel durations
    summed. None where the split does not give n_graphs groups."""
    ours = sorted((k[1], k[2]) for k in kernels if marker in k[0])
    groups, last = [], None
    for s, e in ours:
        if last is None or s - last > gap_ns:
            groups.append(0)
        groups[-1] += e - s
        last = e
    return groups if len(groups) == n_graphs else None


def read_trace(trace_dir: str):
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise SystemExit(f"decode_profile: the profiler wrote no .xplane.pb under {trace_dir}")
    pd = ProfileData.from_file(files[-1])
    kernels, host, gpu_lines = [], collections.Counter(), collections.Counter()
    names = [p.name for p in pd.planes]  # (the plane objects are views made per access: compare names)
    on_gpu = any(n.startswith("/device:GPU") for n in names)
    for p in pd.planes:
        kernel_plane = p.name.startswith("/device:GPU") or (not on_gpu and p.name == "/host:CPU")
        lines = list(p.lines)
        # A GPU plane has one line per stream plus derived lines (XLA modules / ops) that
        # overlap the kernels: keep the streams.
        streams = [ln for ln in lines if ln.name.startswith("Stream")]
        if p.name.startswith("/device:GPU"):
            for ln in lines:
                gpu_lines[ln.name] += 1
        for line in lines:
            keep = kernel_plane and not line.name.startswith("python") and (
                not p.name.startswith("/device:GPU") or not streams or line.name.startswith("Stream"))
            for e in line.events:
                if keep:
                    if e.duration_ns > 0 and not e.name.startswith("end:") and "Execute" not in e.name:
                        kernels.append((e.name, int(e.start_ns), int(e.start_ns + e.duration_ns), p.name))
                elif p.name.startswith("/host") and ("aunch" in e.name or "Graph" in e.name):
                    host[e.name] += 1
    return kernels, host, names + [f"{n} line: {ln}" for n in names if n.startswith("/device:GPU") for ln in gpu_lines]


def is_collective(name: str) -> bool:
    """NCCL's kernels on a GPU, XLA's all-gather thunk on the host platform."""
    n = name.lower()
    return "nccl" in n or "all-gather" in n or "all_gather" in n or "allgather" in n


def per_device(kernels, n_steps: int) -> dict:
    """Each kernel plane's busy time, kernel count and collective time per step."""
    out = {}
    for plane in sorted({k[3] for k in kernels}):
        ks = [k for k in kernels if k[3] == plane]
        out[plane] = {"busy_ms_per_step": union_ns([(s, e) for _, s, e, _ in ks]) / 1e6 / n_steps,
                      "kernels_per_step": len(ks) / n_steps,
                      "collective_ms_per_step": sum(e - s for nm, s, e, _ in ks if is_collective(nm)) / 1e6 / n_steps,
                      "collectives_per_step": sum(1 for nm, *_ in ks if is_collective(nm)) / n_steps}
    return out


def short(name: str, templates: bool = False) -> str:
    """A kernel's name without its parameter list and (unless templates) its template arguments,
    for grouping. The anonymous namespace's parentheses go first: they cut conv's and delta's names
    to 'void baro_gpu::' in the e8351f8 profile, one group for both. templates keeps the instances
    apart (gemm_wgmma_kernel<128, true, true, 4>: the MoE's gathered gate/up, not a dense GEMM)."""
    name = name.replace("(anonymous namespace)::", "")
    for sep in ("(",) if templates else ("(", "<"):
        if sep in name:
            name = name.split(sep, 1)[0]
    return name.strip()[:120 if templates else 80]


def one_sequence_steps(eng, args, length: int):
    """One sequence prefilled with args.context random tokens: steps(n) runs n decode tokens as
    generate() runs them (greedy blocks on the device), or one decode_step call plus a host argmax
    per token with --per-token, and returns the wall seconds per token, n times."""
    import jax

    ids = [int(x) for x in np.random.default_rng(args.seed).integers(0, eng.cfg.vocab_size, args.context)]
    pre = eng.prefill(ids, state=eng.new_state(length))
    st = {"state": pre.state, "pos": len(ids), "tok": int(np.argmax(np.asarray(pre.logits)))}

    def steps(n):
        t = time.perf_counter()
        if args.per_token:
            for _ in range(n):
                lg, st["state"] = eng.decode_step(st["tok"], st["state"], st["pos"])
                st["tok"] = int(np.argmax(np.asarray(lg)))
                st["pos"] += 1
        else:
            toks, st["state"] = eng.greedy_decode(st["tok"], st["state"], st["pos"], n)
            jax.block_until_ready(st["state"])
            st["tok"], st["pos"] = toks[-1], st["pos"] + n
        return [(time.perf_counter() - t) / n] * n

    return steps


def prefill_steps(eng, args, length: int):
    """steps(n): n batched prefills of the same args.context random tokens at args.chunk (set here
    to the engine's pick when not given), each into a fresh state, the last logits and the state
    waited for; the wall seconds of each."""
    import jax

    ids = [int(x) for x in np.random.default_rng(args.seed).integers(0, eng.cfg.vocab_size, args.context)]
    if args.chunk is None:
        args.chunk = eng.pick_chunk(len(ids))

    def steps(n):
        walls = []
        for _ in range(n):
            t = time.perf_counter()
            pre = eng.prefill(ids, "batch", args.chunk)
            jax.block_until_ready((pre.logits, pre.state))
            walls.append(time.perf_counter() - t)
            del pre
        return walls

    return steps


def batch_steps(eng, args, length: int):
    """generate_batch's decode steps over args.batch slots, each slot prefilled with its own
    args.context random tokens: steps(n) runs n steps of every row (greedy blocks of the runner's
    decode_block) and returns the wall seconds per step, n times."""
    import jax
    import jax.numpy as jnp

    from baro_jax import batch as BT
    from baro_jax import pool as Pool
    from baro_jax.sampling import Sampling, k_max_for, row_params

    r, B = eng.runner, args.batch
    ops = BT.pooled_ops(r.ops)
    chunk = min(1024, args.context)
    from baro_jax.block_manager import BlockManager
    from baro_jax.settings import DEFAULT_KV_PAGE

    page = DEFAULT_KV_PAGE
    per_slot = -(-length // page)
    blocks = BlockManager(B, B * per_slot, page, per_slot * page)
    for slot in range(B):
        blocks.allocate(slot, length)
    table = jnp.asarray(blocks.table)
    pool = Pool.init_pool(eng.cfg, r.dtype, B, B * per_slot, page)
    rng = np.random.default_rng(args.seed)
    toks = np.zeros((B,), np.int32)
    for slot in range(B):
        ids = rng.integers(0, eng.cfg.vocab_size, args.context).astype(np.int32)
        for p in range(0, len(ids), chunk):
            part = np.zeros((chunk,), np.int32)
            n = min(chunk, len(ids) - p)
            part[:n] = ids[p:p + n]
            logits, pool = BT.PREFILL(r.params, pool, table, jnp.int32(slot), jnp.asarray(part), jnp.int32(p),
                                      jnp.int32(n), r.rope, cfg=eng.cfg, ops=ops, all_logits=False)
        toks[slot] = int(np.argmax(np.asarray(logits)))
    state = {"pool": pool, "tok": jnp.asarray(toks), "pos": np.full((B,), args.context, np.int32), "index": 0}
    block = r.decode_block
    sps = [Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=i) for i in range(B)]
    k_max = k_max_for(sps, eng.cfg.vocab_size) if args.temperature else None
    rows = [row_params(sp, eng.cfg.vocab_size) for sp in sps]
    samp = tuple(jnp.asarray(np.stack([row[i] for row in rows])) for i in range(4)) if args.temperature else None
    run = jnp.ones((B,), bool)
    stops = jnp.asarray(np.array([-1], np.int32))

    def steps(n):
        if n % block:
            raise SystemExit(f"decode_profile --batch: --steps and --warmup must be multiples of the decode block "
                             f"{block}, got {n}")
        t = time.perf_counter()
        for _ in range(n // block):
            left = jnp.full((B,), block, jnp.int32)
            draw = None if samp is None else samp + (jnp.full((B,), state["index"], jnp.int32),)
            ids, lp, _, _, state["pool"], _ = BT.DECODE_BLOCK(
                r.params, state["pool"], table, state["tok"], run, jnp.asarray(state["pos"]), left, stops, r.rope,
                None, draw, cfg=eng.cfg, ops=ops, guard=False, top_n=0, block=block, k_max=k_max)
            state["tok"] = ids[-1]
            state["pos"] = state["pos"] + block
            state["index"] += block
        jax.block_until_ready(state["pool"])
        return [(time.perf_counter() - t) / n] * n if n else []  # --warmup 0: no steps

    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens before the decode steps")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed tokens first (default 19: a full greedy block (16) and a shorter one compile "
                         "both graphs); with --prefill, untimed prefills (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=25, help="kernel groups to print")
    ap.add_argument("--templates", action="store_true",
                    help="group kernels by their template instance (a kernel's instances apart), not by name")
    ap.add_argument("--per-token", action="store_true",
                    help="one device call per token (decode_step + host argmax) instead of greedy blocks")
    ap.add_argument("--mode", default="resident", choices=["resident", "tier"],
                    help="tier: routed experts in pinned host memory, decode through the expert cache (or "
                         "BARO_TIER_DECODE=direct); the trace then shows the host-link copies and the MoE's misses")
    ap.add_argument("--device-budget-gb", type=float, default=None, help="tier mode: the device budget")
    ap.add_argument("--tier-paths", default=None,
                    help="tier mode: comma-separated decode paths to profile one after the other in this process "
                         "(cache, cache+dma: its misses by the copy engines, direct; default: BARO_TIER_DECODE's); "
                         "--json may hold {path}; a path may end in @N to time and trace N steps instead of "
                         "--steps (direct@32: two full greedy blocks, direct@8: one shorter block)")
    ap.add_argument("--devices", type=int, default=None,
                    help="expert parallel over N devices (baro_jax.load(devices=N)); per-device busy and collective time")
    ap.add_argument("--batch", type=int, default=None,
                    help="profile generate_batch's decode step over B sequence slots (resident mode)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="--batch: sample every row at this temperature (0: greedy), row i with seed i")
    ap.add_argument("--top-k", type=int, default=0, help="--batch: the sampled rows' top_k (0: none)")
    ap.add_argument("--top-p", type=float, default=1.0, help="--batch: the sampled rows' top_p")
    ap.add_argument("--prefill", action="store_true",
                    help="profile a batched prefill of --context tokens instead of decode steps (resident mode)")
    ap.add_argument("--chunk", type=int, default=None, help="--prefill: the prefill chunk (default: the engine's pick)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.prefill and (args.batch is not None or args.mode != "resident" or args.per_token):
        ap.error("--prefill profiles one sequence's batched prefill: no --batch, --per-token or --mode tier")
    if args.chunk is not None and not args.prefill:
        ap.error("--chunk is --prefill's")
    if args.warmup is None:
        args.warmup = 1 if args.prefill else 19
    if args.warmup < 0 or args.steps < 1 or args.context < 1:
        ap.error("--warmup must be >= 0, --steps and --context >= 1")
    if args.batch is not None and (args.batch < 1 or args.mode != "resident" or args.per_token):
        ap.error("--batch B needs B >= 1, --mode resident and no --per-token")
    sampled = (args.temperature, args.top_k, args.top_p) != (0.0, 0, 1.0)
    if sampled and args.batch is None:
        ap.error("--temperature / --top-k / --top-p sample --batch's rows: give --batch")
    if sampled:
        from baro_jax.sampling import Sampling
        try:
            Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).validate()
        except (TypeError, ValueError) as e:
            ap.error(str(e))
        if not args.temperature:
            ap.error("--top-k / --top-p filter sampling: give --temperature > 0")
    if args.mode == "tier" and args.device_budget_gb is None:
        ap.error("--mode tier needs --device-budget-gb")
    paths = [None] if args.mode != "tier" or not args.tier_paths else args.tier_paths.split(",")
    if len(paths) > 1 and args.json and "{path}" not in args.json:
        ap.error("--json must hold {path} when --tier-paths names more than one path")

    import jax

    import baro_jax
    from baro_jax.shapes import state_length

    path_steps = []
    for path in paths:
        at = (path or "").partition("@")[2]
        if at and (not at.isdigit() or int(at) < 1):
            ap.error(f"--tier-paths: {path!r}: the steps after @ must be a positive integer")
        path_steps.append(int(at) if at else args.steps)
    decode_len = 0 if args.prefill else sum(args.warmup + 2 * n for n in path_steps) + 8  # every arm decodes on
    eng = baro_jax.load(args.model, backend="ordered", max_context=max(args.context + decode_len, 64),
                        mode=args.mode, device_budget_gb=args.device_budget_gb, devices=args.devices)
    length = state_length(args.context + decode_len, eng.cfg.max_context)
    steps = (prefill_steps(eng, args, length) if args.prefill else batch_steps(eng, args, length) if args.batch
             else one_sequence_steps(eng, args, length))
    outs = []
    for path, n_steps in zip(paths, path_steps):
        if path is not None:  # the next tier decode path: a fresh cache, its pools as it sets them up
            decode_path, _, fetch = path.partition("@")[0].partition("+")  # cache+dma: copies by the copy engines
            eng.tune(tier_decode=decode_path, tier_fetch=fetch or "xla")
            eng.use_expert_cache(None)
            print(f"[decode_profile] tier decode path {path}", flush=True)
        steps(args.warmup)
        walls = steps(n_steps)
        wall_ms = float(np.median(walls) * 1e3)
        rows_per_step = args.context if args.prefill else args.batch or 1
        if args.prefill:
            print(f"[decode_profile] {args.model} prefill of {args.context} tokens at chunk {args.chunk}: median "
                  f"{wall_ms:.3f} ms ({rows_per_step * 1e3 / wall_ms:.1f} tok/s) over {n_steps} prefills", flush=True)
        else:
            print(f"[decode_profile] {args.model} context {args.context}, {rows_per_step} row(s) per step: median step "
                  f"{wall_ms:.3f} ms ({rows_per_step * 1e3 / wall_ms:.1f} tok/s) over {n_steps} steps", flush=True)

        cache_report = eng.expert_cache_report() if args.mode == "tier" else None  # over the timed steps and warm-up
        if args.mode == "tier":
            print(f"[decode_profile] tier: {cache_report}", flush=True)
        trace_dir = tempfile.mkdtemp(prefix="baro_trace_")
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            steps(n_steps)
            traced_s = time.perf_counter() - t0
        all_kernels, host, planes = read_trace(trace_dir)
        if not all_kernels:
            raise SystemExit(f"decode_profile: no kernel events in the trace (planes: {planes})")
        n = n_steps
        devices = per_device(all_kernels, n)
        first = min(devices)  # "/device:GPU:0" (or the host plane): the main numbers are one device's
        kernels = [k[:3] for k in all_kernels if k[3] == first]
        busy = union_ns([(s, e) for _, s, e in kernels]) / 1e6 / n
        span = ((max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) / 1e6 / n) if kernels else 0.0
        groups = collections.defaultdict(lambda: [0, 0])
        for name, s, e in kernels:
            g = groups[short(name, args.templates)]
            g[0] += 1
            g[1] += e - s
        rows = sorted(({"kernel": k, "per_step": c / n, "ms_per_step": t / 1e6 / n, "mean_us": t / 1e3 / c}
                       for k, (c, t) in groups.items()), key=lambda r: -r["ms_per_step"])
        # idle gaps between consecutive kernels (device timeline): where the rest goes
        ks = sorted(kernels, key=lambda k: k[1])
        gaps, end, prev = [], None, None
        for name, s0, e0 in ks:
            if end is not None and s0 > end:
                gaps.append((s0 - end, short(prev), short(name)))
            if end is None or e0 > end:
                end, prev = e0, name
        buckets = {"<2us": 0.0, "2-10us": 0.0, "10-100us": 0.0, ">100us": 0.0}
        for gap, _, _ in gaps:
            key = "<2us" if gap < 2e3 else "2-10us" if gap < 1e4 else "10-100us" if gap < 1e5 else ">100us"
            buckets[key] += gap / 1e6 / n
        top_gaps = [{"us": g / 1e3, "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:12]]
        print("[decode_profile] idle ms/step by gap size: " + ", ".join(f"{k} {v:.3f}" for k, v in buckets.items()))
        for tg in top_gaps[:6]:
            print(f"  gap {tg['us']:9.1f} us  after {tg['after']}  before {tg['before']}")
        print(f"[decode_profile] traced: {traced_s * 1e3 / n:.3f} ms/step wall, device busy {busy:.3f} ms/step, "
              f"kernel span {span:.3f} ms/step, {len(kernels) / n:.0f} kernels/step", flush=True)
        for r in rows[:args.top]:
            print(f"  {r['ms_per_step']:8.3f} ms  {r['per_step']:6.1f}x  {r['mean_us']:8.2f} us  {r['kernel']}")
        for k, c in host.most_common(8):
            print(f"  host {c / n:7.1f}/step  {k}")
        if len(devices) > 1 or args.devices:
            for plane, d in devices.items():
                print(f"[decode_profile] {plane}: busy {d['busy_ms_per_step']:.3f} ms/step, "
                      f"{d['kernels_per_step']:.0f} kernels/step, collectives {d['collective_ms_per_step']:.3f} ms/step "
                      f"({d['collectives_per_step']:.0f}/step)", flush=True)
        # one token's kernels in launch order (the middle token of the traced run), so a kernel that
        # runs many times per token (the GEMMs) can be read call by call against the layer's code
        seq = []
        if ks and n >= 1:
            span_all = ks[-1][2] - ks[0][1]
            t_a = ks[0][1] + span_all * (n // 2) / n
            t_b = ks[0][1] + span_all * (n // 2 + 1) / n
            seq = [{"kernel": short(k), "us": (e - s0) / 1e3, "start_us": (s0 - t_a) / 1e3}
                   for k, s0, e in ks if t_a <= s0 < t_b]
        out = {
            "summary": {**provenance(), "model": args.model, "context": args.context, "steps": n,
                        "xla_flags": os.environ.get("XLA_FLAGS", ""), "per_token": args.per_token,
                        "batch": args.batch, "prefill": args.prefill,
                        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
                        "chunk": args.chunk,
                        "median_step_ms": wall_ms, "tok_per_s": rows_per_step * 1e3 / wall_ms,
                        "traced_step_ms": traced_s * 1e3 / n, "device_busy_ms_per_step": busy,
                        "kernel_span_ms_per_step": span, "kernels_per_step": len(kernels) / n,
                        "planes": planes, "mode": args.mode, "device_budget_gb": args.device_budget_gb,
                        "devices": args.devices, "kernels_of_plane": first,
                    "tier_decode_path": path or ((eng.expert_cache_report() or {}).get("decode_path") if args.mode == "tier" else None),
                        "expert_cache": cache_report},
            "kernels": rows,
            "per_device": devices,
            "idle_ms_per_step_by_gap": buckets,
            "largest_gaps": top_gaps,
            "one_token_sequence": seq,
            "host_launch_events_per_step": {k: c / n for k, c in host.most_common()},
        }
        outs.append(out)
        if args.json:
            write_json(args.json.replace("{path}", (path or "resident").replace("+", "_").replace("@", "_")), out)
    return outs[0] if len(outs) == 1 else outs


if __name__ == "__main__":
    main()
