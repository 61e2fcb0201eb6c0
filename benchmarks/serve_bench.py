"""The server under load: N concurrent streaming clients, throughput, time to first token and
inter-token latency, and every response checked in bytes against its run alone.

The prompts are --prompt-len random token ids (one per request, the same across levels), each
asking --new-tokens tokens with ignore_eos (fixed lengths), logprobs=0 and its own seed; every
--sampled-every-th request samples (--sample-temperature 0.8, --sample-top-p 0.95, --sample-top-k),
the others are greedy. Before the
server starts, each prompt runs alone through Engine.generate in this process: the reference.
The server then runs in this process (uvicorn on a thread, as `python -m baro_jax.serve` runs it)
and the clients in a child process (asyncio + httpx), so that their JSON parsing does not share
the server's interpreter. Per level of --clients: N clients each send --requests-per-client
requests one after another; reported are output tokens/s over the level's wall time, requests/s,
time to first token (TTFT) and inter-token latency (ITL: the gap between two chunks that carry
tokens, spread over the later chunk's tokens, since a greedy block delivers several at once),
p50 and p99, and how many responses equal their reference (token ids and logprob bytes).

    python benchmarks/serve_bench.py --model qwen3.5-35b-a3b --clients 1,16,64 --json out.json
    python benchmarks/serve_bench.py --clients 1,4 --prompt-len 32 --new-tokens 16   # a dry run on tiny

Exit status 0 when every response equals its reference, 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time

import numpy as np


def _request(i: int, ids: list, args) -> dict:
    body = {"prompt": ids, "max_tokens": args.new_tokens, "ignore_eos": True, "logprobs": 0, "stream": True,
            "seed": args.seed + i, "temperature": 0}
    if args.sampled_every and i % args.sampled_every == args.sampled_every - 1:
        body.update(temperature=args.sample_temperature, top_p=args.sample_top_p)
        if args.sample_top_k:
            body["top_k"] = args.sample_top_k
    return body


# --- the clients (a child process) -------------------------------------------------------------------
async def _one(h, body: dict) -> dict:
    t0 = time.perf_counter()
    ids, lps, chunks, first = [], [], [], None
    async with h.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if "error" in c:
                return {"error": c["error"]["message"]}
            c = c["choices"][0]
            got = c.get("token_ids") or []
            if got:
                now = time.perf_counter()
                first = first if first is not None else now - t0
                chunks.append((now, len(got)))
                ids += got
                lps += c["logprobs"]["token_logprobs"]
    itl = []
    for (a, _), (b, n) in zip(chunks, chunks[1:]):
        itl += [(b - a) / n] * n
    return {"ids": ids, "logprobs": lps, "ttft": first, "itl": itl, "e2e": time.perf_counter() - t0}


async def _level(url: str, bodies: list, clients: int, per_client: int) -> dict:
    import httpx

    async def client(k):
        out = []
        for j in range(per_client):
            i = k * per_client + j
            out.append((i, await _one(h, bodies[i])))
        return out

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as h:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(client(k) for k in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall": wall, "results": [x for part in done for x in part]}


def _client_process(url, bodies, clients, per_client, conn):
    conn.send(asyncio.run(_level(url, bodies, clients, per_client)))
    conn.close()


def run_clients(url, bodies, clients, per_client) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_client_process, args=(url, bodies, clients, per_client, child))
    p.start()
    child.close()
    out = parent.recv()
    p.join()
    return out


# --- the run --------------------------------------------------------------------------------------------
def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--clients", default="1,16,64", help="concurrent clients per level (default: %(default)s)")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sampled-every", type=int, default=2, help="every k-th request samples; 0: all greedy")
    ap.add_argument("--sample-temperature", type=float, default=0.8, help="the sampled requests' temperature")
    ap.add_argument("--sample-top-p", type=float, default=0.95,
                    help="their top_p (below 1 without a top_k: each row ranked whole in the decode graph)")
    ap.add_argument("--sample-top-k", type=int, default=0, help="their top_k (0: none)")
    ap.add_argument("--max-batch", type=int, default=None, help="server slots (default: the most clients)")
    ap.add_argument("--chunk", type=int, default=256, help="the server's prefill chunk (default: %(default)s)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="the server's prompt rows per round (default: the server's)")
    ap.add_argument("--warm-up-threads", type=int, default=None,
                    help="host threads that compile the server's step graphs before the first level (default: "
                         "the host's cores, at most 16; 1: one after another; 0: no warm-up, each level's first "
                         "rounds compile what they meet)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.warm_up_threads is not None and args.warm_up_threads < 0:
        ap.error(f"--warm-up-threads must be >= 0, got {args.warm_up_threads}")
    levels = [int(c) for c in args.clients.split(",")]
    n = max(levels) * args.requests_per_client

    import baro_jax
    from baro_jax.batch import compile_threads
    from baro_jax.serve.server import Server
    from baro_jax.shapes import state_length
    from baro_jax.verify.records import provenance, write_json

    ctx = args.prompt_len + args.new_tokens
    eng = baro_jax.load(args.model, max_context=state_length(ctx, 1 << 30), seed=args.seed, progress=False)
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(0, eng.cfg.vocab_size, args.prompt_len)] for _ in range(n)]
    bodies = [_request(i, p, args) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    refs = [eng.generate(b["prompt"], args.new_tokens, logprobs=0, stop_at_eos=False, seed=b["seed"],
                         temperature=b["temperature"] or None, top_p=b.get("top_p"), top_k=b.get("top_k"))
            for b in bodies]
    print(f"[serve_bench] {n} references alone in {time.perf_counter() - t0:.1f}s", flush=True)

    slots = args.max_batch or max(levels)
    budget = {} if args.prefill_budget is None else {"prefill_budget": args.prefill_budget}
    srv = Server(eng, port=0, max_batch=slots, max_queue=n, chunk=args.chunk, max_logprobs=0, **budget)
    # every row bucket's step graphs compile before the first level (a level would otherwise time
    # the compilations of the buckets it is the first to reach), as `serve --warm-up` does
    graphs, warm_s = (0, 0.0) if args.warm_up_threads == 0 else srv.loop.warm_up(threads=args.warm_up_threads)
    print(f"[serve_bench] warm-up: {graphs} step graphs in {warm_s:.1f}s", flush=True)
    url = srv.start()
    rows, ok = [], True
    try:
        warm = [dict(bodies[0], max_tokens=min(args.new_tokens, 20)), dict(bodies[-1], max_tokens=3, temperature=0.8)]
        run_clients(url, warm, len(warm), 1)  # the small graphs (logprob rows, sampling) compile here
        for clients in levels:
            got = run_clients(url, bodies, clients, args.requests_per_client)
            res = got["results"]
            errors = [r["error"] for _, r in res if "error" in r]
            fine = [(i, r) for i, r in res if "error" not in r]
            equal = sum(r["ids"] == refs[i].generated_ids and
                        np.asarray(r["logprobs"], np.float32).tobytes() == np.asarray(refs[i].logprobs,
                                                                                        np.float32).tobytes()
                        for i, r in fine)
            tokens = sum(len(r["ids"]) for _, r in fine)
            ttft = [r["ttft"] for _, r in fine if r["ttft"] is not None]
            itl = [x for _, r in fine for x in r["itl"]]
            row = {"clients": clients, "requests": len(res), "errors": errors[:5], "error_count": len(errors),
                   "wall_seconds": got["wall"], "output_tokens": tokens,
                   "output_tokens_per_s": tokens / got["wall"], "requests_per_s": len(res) / got["wall"],
                   "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                   "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
                   "e2e_p50_s": _pct([r["e2e"] for _, r in fine], 50), "equal_solo": equal,
                   "health": srv.loop.health()}
            ok &= equal == len(res) and not errors
            rows.append(row)
            print(f"[serve_bench] {clients:3d} clients: {row['output_tokens_per_s']:9.1f} tok/s, TTFT p50 "
                  f"{row['ttft_p50_s'] or 0:.3f}s p99 {row['ttft_p99_s'] or 0:.3f}s, ITL p50 "
                  f"{1000 * (row['itl_p50_s'] or 0):.1f}ms p99 {1000 * (row['itl_p99_s'] or 0):.1f}ms, "
                  f"equal alone {equal}/{len(res)}", flush=True)
            out = {"summary": {"model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                               "warm_up": {"graphs": graphs, "seconds": warm_s,
                                           "threads": compile_threads(args.warm_up_threads)},
                               "requests_per_client": args.requests_per_client, "sampled_every": args.sampled_every,
                               "sampling": {"temperature": args.sample_temperature, "top_p": args.sample_top_p,
                                            "top_k": args.sample_top_k},
                               "slots": srv.loop.slots, "pool_length": srv.loop.length, "chunk": srv.loop.chunk,
                               "prefill_budget": srv.loop.run.prefill_budget,
                               "decode_block": eng.settings.decode_block, "backend": eng.backend, "pass": ok,
                               **provenance()},
                   "rows": rows}
            write_json(args.json, out)  # after each level: a run cut short keeps what it measured
    finally:
        srv.stop(60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
