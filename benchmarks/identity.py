"""Identity gate: batched prefill must equal replay (decode step per token), byte for byte.

For every prompt and chunk size it compares, after the prompt: every layer's
state (KV rows, conv window, delta state), the last-position logits, and the
greedy tokens generated afterwards. Prints a per-prompt table, writes JSON,
exits non-zero on any difference.

    python benchmarks/identity.py --model tiny --chunks 16,37,64 --json out.json
    python benchmarks/identity.py --model tiny --mode tier   # routed experts in pinned host memory
    python benchmarks/identity.py --model tiny --mode tier --reference-json resident.json

Every row carries `replay_digest`, a sha256 of the replay arm's state bytes, last logits and
tokens. --reference-json compares them with another run's rows of the same prompt (e.g. tier
mode under a small device limit against resident mode, which cannot load in the same
process): a differing digest is a failure, like a differing arm.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_leaves, load_prompts, provenance, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "identity.jsonl")




def state_names(cfg):
    names = []
    for i, t in enumerate(cfg.layer_types):
        keys = ["k", "v"] if t == "full_attention" else ["conv", "ssm"]
        if t != "full_attention" and getattr(cfg, "delta_rule", "token") == "blocked":
            keys += ["blk_k", "blk_u", "blk_c"]  # the pending rows of the delta block (docs/DESIGN.md §9)
        names += [f"L{i}.{k}" for k in sorted(keys)]  # tree_leaves orders dict keys sorted
    return names


def first_diff(a_list, b_list, names):
    for a, b, n in zip(a_list, b_list, names):
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            return n
    return None


def greedy_tokens(eng, logits, state, pos, n):
    from baro_jax.sampling import greedy

    out = []
    for i in range(n):
        t = int(greedy(logits))
        out.append(t)
        if i + 1 < n:
            logits, state = eng.decode_step(t, state, pos + i)
    return out


def digest(arm) -> str:
    h = hashlib.sha256()
    for a in arm["state"]:
        h.update(a.tobytes())
    h.update(arm["logits"].tobytes())
    h.update(np.asarray(arm["tokens"], np.int64).tobytes())
    return h.hexdigest()


def run_arm(eng, ids, mode, chunk, new_tokens):
    pre = eng.prefill(ids, mode, chunk, n_new=new_tokens)
    logits = np.asarray(pre.logits)
    st = host_leaves(pre.state)
    toks = greedy_tokens(eng, pre.logits, pre.state, len(ids), new_tokens)
    return {"logits": logits, "state": st, "tokens": toks, "seconds": pre.seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="ordered", choices=["ordered", "xla"])
    ap.add_argument("--variant", default="none",
                    help="an opt-in order-changing variant (xla, attn-fast, delta-chunk): expected to FAIL this gate")
    ap.add_argument("--delta-rule", default=None, choices=["token", "blocked"],
                    help="the delta rule: token (per-token, default) or blocked (chunk-aligned, docs/DESIGN.md §9); "
                         "default: env BARO_DELTA, else token")
    ap.add_argument("--mode", default="resident", choices=["resident", "tier"],
                    help="where the routed experts live (tier: pinned host memory, staged per layer); "
                         "the gate compares batched vs replay within the mode")
    ap.add_argument("--device-budget-gb", type=float, default=None)
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="tier mode: the decode expert cache's slots per layer (default: 64, at most E, fewer when "
                         "the budget says so; 0: none)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--chunks", default="16,37,64", help="comma-separated chunk sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=0, help="skip prompts longer than this (0 = none)")
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=None,
                    help="expert parallel over N devices (baro_jax.load(devices=N)); with --reference-json a "
                         "one-device run's JSON, N devices are checked against one device too")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--reference-json", default=None,
                    help="another identity.py JSON: its rows' replay_digest must equal this run's, per prompt")
    args = ap.parse_args(argv)

    import baro_jax

    chunks = [int(c) for c in args.chunks.split(",") if c]
    eng = baro_jax.load(args.model, backend=args.backend, max_context=args.max_context, seed=args.seed,
                        mode=args.mode, device_budget_gb=args.device_budget_gb, variant=args.variant,
                        delta_rule=args.delta_rule, devices=args.devices)
    if args.mode == "tier" and args.cache_slots is not None:
        eng.use_expert_cache(args.cache_slots)
    prompts = load_prompts(args.prompts, eng.tokenizer)
    if args.max_len:
        prompts = [p for p in prompts if len(p["ids"]) <= args.max_len]
    names = state_names(eng.cfg)
    rows, failures = [], 0
    reference = {}
    if args.reference_json:
        with open(args.reference_json) as f:
            for r in json.load(f)["rows"]:
                if r.get("replay_digest"):
                    reference[(r["prompt"], r["len"])] = r["replay_digest"]
    ref_checked = ref_failed = 0
    print(f"identity gate: model={args.model} backend={args.backend} variant={eng.variant} "
          f"delta_rule={eng.cfg.delta_rule} mode={args.mode} chunks={chunks} "
          f"prompts={len(prompts)} new_tokens={args.new_tokens}")
    print(f"{'prompt':>8} {'len':>6} {'chunk':>6} {'state':>8} {'logits':>7} {'tokens':>7}  first diff")
    t_start = time.time()
    for p in prompts:
        ids = p["ids"]
        ref = run_arm(eng, ids, "replay", None, args.new_tokens)
        ref_digest = digest(ref)
        matches_ref = None
        if (p["name"], len(ids)) in reference:
            matches_ref = reference[(p["name"], len(ids))] == ref_digest
            ref_checked += 1
            ref_failed += not matches_ref
            failures += not matches_ref
            if not matches_ref:
                print(f"{p['name']:>8} {len(ids):>6}  replay differs from --reference-json's", flush=True)
        for c in chunks:
            got = run_arm(eng, ids, "batch", c, args.new_tokens)
            d = first_diff(ref["state"], got["state"], names)
            same_logits = ref["logits"].tobytes() == got["logits"].tobytes()
            same_tokens = ref["tokens"] == got["tokens"]
            ok = d is None and same_logits and same_tokens
            failures += not ok
            row = {"prompt": p["name"], "len": len(ids), "chunk": c, "boundaries_crossed": (len(ids) - 1) // c,
                   "state_equal": d is None, "first_state_diff": d, "logits_equal": same_logits,
                   "tokens_equal": same_tokens, "replay_seconds": ref["seconds"], "batch_seconds": got["seconds"],
                   "replay_digest": ref_digest, "replay_matches_reference": matches_ref}
            if not same_logits:
                row["max_abs_logit_diff"] = float(np.max(np.abs(ref["logits"] - got["logits"])))
            rows.append(row)
            print(f"{p['name']:>8} {len(ids):>6} {c:>6} {'same' if d is None else 'DIFF':>8} "
                  f"{'same' if same_logits else 'DIFF':>7} {'same' if same_tokens else 'DIFF':>7}  {d or ''}",
                  flush=True)
        # written after every prompt so a run cut short still leaves its evidence
        write_json(args.json, {"summary": {"pass": None, "partial": True, "cases": len(rows)}, "rows": rows})
    summary = {"pass": failures == 0, "failures": failures, "cases": len(rows), "model": args.model,
               "backend": args.backend, "devices": args.devices, "variant": eng.variant, "delta_rule": eng.cfg.delta_rule, "mode": args.mode, "chunks": chunks, "new_tokens": args.new_tokens,
               "prompts_file": os.path.relpath(args.prompts, os.path.dirname(HERE)),
               "wall_seconds": time.time() - t_start, **provenance()}
    if args.reference_json:
        summary["reference"] = {"file": args.reference_json, "prompts_compared": ref_checked,
                                "prompts_differing": ref_failed}
        print(f"reference {args.reference_json}: {ref_checked - ref_failed}/{ref_checked} prompts' replay bytes equal")
        if ref_checked == 0:
            print("no prompt of this run is in the reference: nothing compared")
            failures += 1
    if args.mode == "tier":  # over every one-row step of the run (replay prefill and decode)
        summary["expert_cache"] = eng.expert_cache_report()
        ec = summary["expert_cache"]
        print(f"expert cache: {ec['slots_per_layer']} slots per layer"
              + (f", hit rate {ec['hit_rate']:.1%} ({ec['hits']} hits, {ec['misses']} misses, "
                 f"{ec['evictions']} evictions)" if ec.get("hit_rate") is not None else f" ({ec['note']})"))
    write_json(args.json, {"summary": summary, "rows": rows})
    print(f"{'PASS' if failures == 0 else 'FAIL'}: {len(rows) - failures}/{len(rows)} cases identical")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
