"""Tier-mode decode with the expert cache: decode tok/s, hit rate and the per-layer host round trip.

    python benchmarks/tier_cache.py --model tiny --new-tokens 64 --slots default,3,0 --json out.json

Arms: resident decode, then tier decode with each cache size (default: 64 slots per layer, at
most E, fewer when the budget says so; 0: no cache, every layer's experts staged per token).
Per arm: decode tok/s (steps after the first), the cache's hits/misses/evictions and hit rate
over the decode steps, and the time spent waiting for each layer's routing ids on the host
(route_seconds / layer-steps: the mixer's compute plus the device-to-host round trip, the cost
this design adds per layer per token) and issuing the miss copies (copy_seconds). The greedy
tokens of every tier arm must equal resident's (checked: exit 1 otherwise).
--direct adds, for each cache size > 0, direct tier decode (BARO_TIER_DECODE=direct) with the
pools adapting to the routing (BARO_TIER_ADAPT=1, the default) and frozen as set up (0): its hit
rate is what a model's routing makes of each policy.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
from baro_jax.verify.records import provenance, write_json

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint(fib("


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--slots", default="default,3,0", help="comma-separated cache sizes ('default' = sized by the budget)")
    ap.add_argument("--device-budget-gb", type=float, default=None)
    ap.add_argument("--direct", action="store_true", help="also the direct decode path, pools adapting and frozen")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import baro_jax

    res = baro_jax.load(args.model, backend="ordered", progress=False)
    tier = baro_jax.load(args.model, backend="ordered", mode="tier", device_budget_gb=args.device_budget_gb,
                         progress=False)
    ids = res.encode(PROMPT)
    ref = res.generate(ids, args.new_tokens, stop_at_eos=False)
    arms = [{"arm": "resident", "decode_tokens_per_s": ref.decode_tokens_per_s}]
    print(f"resident: decode {ref.decode_tokens_per_s:.1f} tok/s")
    ok = True
    L = tier.cfg.num_layers
    settings = []
    for s in args.slots.split(","):
        settings.append((s, "cache", None))
        if args.direct and s != "0":
            settings += [(s, "direct", "1"), (s, "direct", "0")]
    for s, path, adapt in settings:
        tier.tune(tier_decode=path, tier_adapt=adapt != "0")
        tier.use_expert_cache(None if s == "default" else int(s))
        tier.generate(ids, 3, stop_at_eos=False)  # compile the steps of this arm
        r = tier.generate(ids, args.new_tokens, stop_at_eos=False)
        same = r.generated_ids == ref.generated_ids
        ok &= same
        ec = r.expert_cache
        name = f"tier slots={s}" + ("" if path == "cache" else f" direct adapt={adapt}")
        row = {"arm": name, "decode_tokens_per_s": r.decode_tokens_per_s, "tokens_equal_resident": same,
               "expert_cache": ec}
        steps = len(r.generated_ids) - 1
        if ec.get("hit_rate") is not None:
            row["route_ms_per_layer_step"] = 1e3 * ec["route_seconds"] / (steps * L)
            row["copy_ms_per_layer_step"] = 1e3 * ec["copy_seconds"] / (steps * L)
            print(f"{name} ({ec['slots_per_layer']} slots/layer): decode {r.decode_tokens_per_s:.1f} tok/s, hit rate "
                  f"{ec['hit_rate']:.1%}, ids wait {row['route_ms_per_layer_step']:.3f} ms and copy issue "
                  f"{row['copy_ms_per_layer_step']:.3f} ms per layer-step, tokens {'same' if same else 'DIFF'}")
        else:
            print(f"tier, no cache ({ec['note']}): decode {r.decode_tokens_per_s:.1f} tok/s, "
                  f"tokens {'same' if same else 'DIFF'}")
        arms.append(row)
    write_json(args.json, {"model": args.model, "new_tokens": args.new_tokens, "prompt_tokens": len(ids),
                           "layers": L, "experts": tier.cfg.num_experts, "top_k": tier.cfg.top_k, "arms": arms,
                           "pass": ok, **provenance()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
