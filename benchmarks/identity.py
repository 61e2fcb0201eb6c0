"""Identity gate: batched prefill must equal replay (decode step per token), byte for byte.

For every prompt and chunk size it compares, after the prompt: every layer's
state (KV rows, conv window, delta state), the last-position logits, and the
greedy tokens generated afterwards. Prints a per-prompt table, writes JSON,
exits non-zero on any difference. The gate itself is baro_jax.verify.identity.

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
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "identity.jsonl")


def parse_args(argv=None):
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
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import baro_jax
    from baro_jax import verify

    chunks = [int(c) for c in args.chunks.split(",") if c]
    eng = baro_jax.load(args.model, backend=args.backend, max_context=args.max_context, seed=args.seed,
                        mode=args.mode, device_budget_gb=args.device_budget_gb, variant=args.variant,
                        delta_rule=args.delta_rule, devices=args.devices,
                        cache_slots=args.cache_slots if args.mode == "tier" else None)
    prompts = verify.select(verify.load_prompts(args.prompts, eng.tokenizer), max_len=args.max_len)
    reference = verify.read_reference(args.reference_json) if args.reference_json else None
    print(f"identity gate: model={args.model} backend={args.backend} variant={eng.variant} "
          f"delta_rule={eng.cfg.delta_rule} mode={args.mode} chunks={chunks} "
          f"prompts={len(prompts)} new_tokens={args.new_tokens}", flush=True)
    # written after every prompt so a run cut short still leaves its evidence
    report = verify.run_identity_gate(eng, prompts, chunks, new_tokens=args.new_tokens, reference=reference,
                                      reference_file=args.reference_json,
                                      on_prompt=lambda rep: verify.write_json(args.json, rep.partial_json()))
    extra = {"model": args.model, "backend": args.backend, "devices": args.devices,
             "prompts_file": os.path.relpath(args.prompts, os.path.dirname(HERE)), **verify.provenance()}
    if report.reference is not None:
        ref = report.reference
        print(f"reference {args.reference_json}: {ref['prompts_compared'] - ref['prompts_differing']}/"
              f"{ref['prompts_compared']} prompts' replay bytes equal")
        if ref["prompts_compared"] == 0:
            print("no prompt of this run is in the reference: nothing compared")
    if args.mode == "tier":  # over every one-row step of the run (replay prefill and decode)
        ec = extra["expert_cache"] = eng.expert_cache_report()
        print(f"expert cache: {ec['slots_per_layer']} slots per layer"
              + (f", hit rate {ec['hit_rate']:.1%} ({ec['hits']} hits, {ec['misses']} misses, "
                 f"{ec['evictions']} evictions)" if ec.get("hit_rate") is not None else f" ({ec['note']})"))
    verify.write_json(args.json, report.to_json(**extra))
    n = len(report.rows)
    print(f"{'PASS' if report.ok else 'FAIL'}: {n - report.arm_failures}/{n} cases identical")
    return 0 if report.ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MemoryError as e:  # a case the device budget cannot hold, refused before any work: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
