"""Teacher-forced agreement: order-changing variants against the product's greedy replay.

The bar (baro_jax.verify.agreement.BAR) is fixed in the library before anything runs, printed
first, and stored in the JSON.

Per prompt (N = --new-tokens):
- reference: the product's replay (ordered backend: the decode step per prompt token), then N
  greedy tokens; the logits that chose each of them are kept.
- control: the product's batched path (ordered), teacher-forced: prompt + the first N-1
  reference tokens in chunks of --chunk rows (as batched prefill runs them, same state length as
  the reference) with every row's logits; the N scored positions are n-1 .. n+N-2.
- candidate: the same teacher-forced forward with the variant's ops (same weights, no copy).
Agreement: percent of the N scored positions (over all prompts) whose argmax equals the reference
token. The control must read exactly 100.0, or the harness is broken: it says why and exits 3.
(With the ordered backend the control's logits are also byte-equal to the reference's; the
JSON says whether they were.) Also reported per candidate: mean and max |logit - reference
logit| over the scored positions, and the first position where its greedy token would diverge.

    python benchmarks/agreement.py --model tiny --candidate xla,attn-fast,delta-chunk --new-tokens 32 \\
        --chunk 16 --json benchmarks/results/agreement_tiny_cpu.json

Exit status: 0 every candidate reaches the bar; 1 one or more does not; 2 usage error;
3 the control is not 100.0 (harness broken).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "agreement.jsonl")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--candidate", required=True, help="variant(s), comma-separated: xla, attn-fast, delta-chunk")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS,
                    help="JSONL of {'text'} or {'ids'} (baro_jax.verify.prompts)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy reference tokens per prompt (scored positions)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="rows per teacher-forced chunk (default: the engine's default_chunk of the forced length)")
    ap.add_argument("--max-len", type=int, default=0, help="skip prompts longer than this (0 = none)")
    ap.add_argument("--limit", type=int, default=0, help="use the first N prompts (0 = all)")
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--mode", default="resident", choices=["resident", "tier"])
    ap.add_argument("--device-budget-gb", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0, help="seed of synthetic weights (presets)")
    ap.add_argument("--speed-length", type=int, default=0,
                    help="also time a batched prefill of this many random tokens per arm (0: off)")
    ap.add_argument("--xla-chunk", type=int, default=1024,
                    help="largest prefill chunk of the xla variant's speed run (its jnp MoE is dense)")
    ap.add_argument("--json", default=None, help="write results here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from baro_jax import verify
    from baro_jax.verify import agreement as A

    print(f"agreement bar: {A.BAR:.1f}% of teacher-forced positions must pick the reference token "
          f"(fixed in baro_jax/verify/agreement.py before the run)", flush=True)
    import baro_jax

    try:
        cands = A.parse_candidates(args.candidate)
        if args.new_tokens < 1:
            raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")
        if args.chunk is not None and args.chunk < 1:
            raise ValueError(f"--chunk must be >= 1, got {args.chunk}")
        eng = baro_jax.load(args.model, backend="ordered", variant="none", max_context=args.max_context,
                            seed=args.seed, mode=args.mode, device_budget_gb=args.device_budget_gb, progress=False)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.speed_length > eng.cfg.max_context:
        print(f"error: --speed-length {args.speed_length} is longer than the context of {eng.cfg.max_context} "
              f"positions (raise --max-context)", file=sys.stderr)
        return 2
    arms = A.make_arms(eng, cands)
    prompts = verify.select(verify.load_prompts(args.prompts, eng.tokenizer), max_len=args.max_len, limit=args.limit)
    if not prompts:
        print(f"error: no prompts left from {args.prompts} (--max-len {args.max_len}, --limit {args.limit})",
              file=sys.stderr)
        return 2
    print(f"model={args.model} reference=replay-ordered control=batched-ordered candidates={cands} "
          f"prompts={len(prompts)} new_tokens={args.new_tokens} chunk={args.chunk or 'default'}", flush=True)
    harness = A.Agreement(arms, args.new_tokens, args.chunk)
    config = {"model": args.model, "prompts_file": os.path.relpath(args.prompts, os.path.dirname(HERE)),
              "prompts": len(prompts), "mode": args.mode}
    # the speeds first: a run cut short by its time limit keeps them beside the prompts it scored
    speed = A.prefill_speeds(arms, args.speed_length, seed=args.seed, xla_chunk=args.xla_chunk) \
        if args.speed_length else None

    def written(h, partial: bool) -> dict:
        out = h.to_json(partial, config, verify.provenance())
        if speed is not None:
            out["speed"] = speed
        return out

    if speed is not None:  # on disk before the first prompt (an H200 run was cut inside it)
        verify.write_json(args.json, written(harness, partial=True))
    # written after every prompt so a run cut short still leaves its evidence
    A.run_agreement(arms, prompts, args.new_tokens, args.chunk, harness=harness,
                    on_prompt=lambda h: verify.write_json(args.json, written(h, partial=True)))
    out = written(harness, partial=False)
    verify.write_json(args.json, out)
    ctrl, summ = out["control"], out["candidates"]
    print(f"control (batched-ordered, teacher-forced): {ctrl['agreement']:.2f}% "
          f"({ctrl['matches']}/{ctrl['positions']}), logits byte-identical to replay: {ctrl['logits_identical']}")
    if not out["harness_ok"]:
        print(f"HARNESS BROKEN: the control reads {ctrl['agreement']:.4f}%, not 100.0: the ordered batched path, "
              f"forced on the reference's own tokens, must pick every reference token. First divergences: "
              f"{harness.control_divergences()}. No candidate number can be trusted.", file=sys.stderr)
        return 3
    if not ctrl["logits_identical"]:
        print("WARNING: the control picks every reference token but its logits are not byte-equal to replay's: "
              "the identity contract is broken here (run benchmarks/identity.py)", file=sys.stderr)
    for a in cands:
        s = summ[a]
        print(f"{a:>12}: {s['agreement']:.2f}% ({s['matches']}/{s['positions']}) vs bar {out['bar']:.1f}% -> "
              f"{'PASS' if s['passes_bar'] else 'BELOW BAR'}; mean |d| {s['mean_abs_logit_diff']:.3e}, "
              f"max |d| {s['max_abs_logit_diff']:.3e}, prompts diverged {s['prompts_diverged']}/{len(prompts)}, "
              f"earliest divergence at position {s['earliest_divergence']}")
    return 0 if out["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
