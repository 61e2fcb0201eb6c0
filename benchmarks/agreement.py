"""Teacher-forced agreement: order-changing variants against the product's greedy replay.

The bar (BAR, below) is written here before anything runs, printed first, and stored in the JSON.

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
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import load_prompts, provenance, write_json  # noqa: E402

BAR = 99.0  # percent of teacher-forced positions whose argmax must equal the reference token
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "agreement.jsonl")


def reference(eng, ids, n_new):
    """The product's replay, then n_new greedy tokens: (tokens, logits [n_new, V] that chose them)."""
    from baro_jax.sampling import greedy

    pre = eng.prefill(ids, "replay", n_new=n_new)
    logits, state = pre.logits, pre.state
    toks, rows = [], []
    for i in range(n_new):
        rows.append(np.asarray(logits))
        toks.append(int(greedy(logits)))
        if i + 1 < n_new:
            logits, state = eng.decode_step(toks[-1], state, len(ids) + i)
    return toks, np.stack(rows)


def teacher_forced(eng, ids, ref_tokens, chunk, state_len):
    """Logits [N, V] at the N scored positions: prompt + ref_tokens[:-1] through eng's batched path."""
    seq = list(ids) + list(ref_tokens[:-1])
    return eng.forced_logits(seq, chunk=chunk, state_len=state_len, start=len(ids) - 1)


def score(logits, ref_tokens, ref_logits) -> dict:
    pred = np.argmax(logits, axis=-1)
    ref = np.asarray(ref_tokens)
    match = pred == ref
    bad = np.flatnonzero(~match)
    d = np.abs(logits.astype(np.float64) - ref_logits.astype(np.float64))
    row = {"matches": int(match.sum()), "positions": int(match.size),
           "agreement": 100.0 * float(match.mean()),
           "mean_abs_logit_diff": float(d.mean()), "max_abs_logit_diff": float(d.max()),
           "logits_identical": logits.tobytes() == ref_logits.tobytes(),
           "first_divergence": int(bad[0]) if bad.size else None}
    if bad.size:  # how close the reference's own top two were there: a near-tie flips easily
        top2 = np.sort(ref_logits[bad[0]])[-2:]
        row["ref_margin_at_first_divergence"] = float(top2[1] - top2[0])
        row["token_at_first_divergence"] = {"reference": int(ref[bad[0]]), "candidate": int(pred[bad[0]])}
    return row


def summarise(rows: list[dict]) -> dict:
    m = sum(r["matches"] for r in rows)
    n = sum(r["positions"] for r in rows)
    total = sum(r["positions"] * r["mean_abs_logit_diff"] for r in rows)
    div = [(i, r["first_divergence"]) for i, r in enumerate(rows) if r["first_divergence"] is not None]
    return {"agreement": 100.0 * m / n if n else float("nan"), "matches": m, "positions": n,
            "mean_abs_logit_diff": total / n if n else float("nan"),
            "max_abs_logit_diff": max((r["max_abs_logit_diff"] for r in rows), default=float("nan")),
            "logits_identical": all(r["logits_identical"] for r in rows),
            "prompts_diverged": len(div),
            "earliest_divergence": min((p for _, p in div), default=None)}


def parse_candidates(text: str) -> list[str]:
    from baro_jax import variants

    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError(f"--candidate needs at least one of {', '.join(variants.VARIANTS)}")
    for c in names:
        if variants.check(c) is None:
            raise ValueError(f"--candidate {c!r} is the product itself, not a variant; "
                             f"choose from {', '.join(variants.VARIANTS)}")
    return names


def report(args, cands, arms, prompts, rows, per_arm, seconds, t_start, partial: bool) -> dict:
    from baro_jax import variants

    ctrl = summarise(per_arm["control"])
    summ = {a: {**summarise(per_arm[a]), "seconds": seconds[a]} for a in cands}
    for a in cands:
        summ[a]["candidate_agreement"] = summ[a]["agreement"]
        summ[a]["passes_bar"] = summ[a]["agreement"] >= BAR
        summ[a]["overridden_ops"] = list(arms[a].ops.overridden)
    harness_ok = ctrl["agreement"] == 100.0 and ctrl["positions"] > 0
    return {
        "bar": BAR,
        "partial": partial,
        "control_agreement": ctrl["agreement"],
        "candidate_agreement": {a: summ[a]["agreement"] for a in cands},
        "passes_bar": {a: summ[a]["passes_bar"] for a in cands},
        "all_pass": (not partial) and harness_ok and all(summ[a]["passes_bar"] for a in cands),
        "harness_ok": harness_ok,
        "control": {**ctrl, "seconds": seconds["control"]},
        "candidates": summ,
        "config": {"model": args.model, "reference": "replay, ordered backend, greedy",
                   "control": "batched path, ordered backend, teacher-forced",
                   "prompts_file": os.path.relpath(args.prompts, os.path.dirname(HERE)),
                   "prompts": len(prompts), "prompts_done": len(rows), "new_tokens": args.new_tokens,
                   "chunk": args.chunk, "mode": args.mode,
                   "attention_impl_for_attn_fast": variants.attention_impl() if "attn-fast" in cands else None,
                   "cudnn_fallbacks": list(variants._FALLBACKS),
                   "delta_chunk_rows": variants.DELTA_CHUNK},
        "wall_seconds": time.time() - t_start,
        "provenance": provenance(),
        "rows": rows,
    }


def prefill_speeds(arms, args) -> dict:
    """Batched prefill tok/s of each arm on one random prompt of --speed-length tokens (the chunk
    the product would pick, the xla variant capped at --xla-chunk); one warm run, then the best of
    two (--chunk sets the teacher-forced chunk, not this one). A failing arm records its error
    instead of ending the run."""
    import numpy as np
    import jax

    from baro_jax.engine import state_length

    n = args.speed_length
    base = arms["control"]
    ids = [int(x) for x in np.random.default_rng(args.seed + n).integers(0, base.cfg.vocab_size, n)]
    L = state_length(n, base.cfg.max_context)
    out = {"prompt_tokens": n, "arms": {}}
    for a, e in arms.items():
        c = e.pick_chunk(n)
        if a == "xla":
            c = min(c, args.xla_chunk)
        try:
            secs = []
            for _ in range(3):
                pre = e.prefill(ids, "batch", c, state=e.new_state(L))
                jax.block_until_ready(pre.logits)
                secs.append(pre.seconds)
                del pre
            best = min(secs[1:])
            out["arms"][a] = {"chunk": c, "tokens_per_s": n / best, "seconds": best}
            print(f"speed {a:>12}: {n / best:10.1f} tok/s at {n} tokens, chunk {c}", flush=True)
        except Exception as ex:  # noqa: BLE001  (an arm that cannot run still leaves the others)
            out["arms"][a] = {"chunk": c, "error": f"{type(ex).__name__}: {str(ex)[:300]}"}
            print(f"speed {a:>12}: failed: {out['arms'][a]['error']}", flush=True)
    ctrl = out["arms"].get("control", {}).get("tokens_per_s")
    for a, r in out["arms"].items():
        if ctrl and "tokens_per_s" in r:
            r["vs_product"] = r["tokens_per_s"] / ctrl
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--candidate", required=True, help="variant(s), comma-separated: xla, attn-fast, delta-chunk")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL of {'text'} or {'ids'} (benchmarks/common.py)")
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
    args = ap.parse_args(argv)
    print(f"agreement bar: {BAR:.1f}% of teacher-forced positions must pick the reference token "
          f"(fixed in benchmarks/agreement.py before the run)", flush=True)

    import baro_jax
    from baro_jax import variants
    from baro_jax.engine import state_length

    try:
        cands = parse_candidates(args.candidate)
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
    arms = {"control": eng}
    arms.update({c: variants.engine_with(eng, c) for c in cands})
    prompts = load_prompts(args.prompts, eng.tokenizer)
    if args.max_len:
        prompts = [p for p in prompts if len(p["ids"]) <= args.max_len]
    if args.limit:
        prompts = prompts[:args.limit]
    if not prompts:
        print(f"error: no prompts left from {args.prompts} (--max-len {args.max_len}, --limit {args.limit})",
              file=sys.stderr)
        return 2
    N = args.new_tokens
    print(f"model={args.model} reference=replay-ordered control=batched-ordered candidates={cands} "
          f"prompts={len(prompts)} new_tokens={N} chunk={args.chunk or 'default'}", flush=True)
    print(f"{'prompt':>10} {'len':>5} {'arm':>12} {'agree%':>7} {'mean|d|':>9} {'max|d|':>9} {'first div':>9}")
    rows = []
    per_arm = {a: [] for a in arms}
    seconds = {a: 0.0 for a in arms}
    t_start = time.time()
    # the speeds first: a run cut short by its time limit keeps them beside the prompts it scored
    speed = prefill_speeds(arms, args) if args.speed_length else None

    def written(partial: bool) -> dict:
        out = report(args, cands, arms, prompts, rows, per_arm, seconds, t_start, partial=partial)
        if speed is not None:
            out["speed"] = speed
        return out

    if speed is not None:  # on disk before the first prompt (an H200 run was cut inside it)
        write_json(args.json, written(partial=True))

    for p in prompts:
        ids = p["ids"]
        t0 = time.perf_counter()
        ref_tokens, ref_logits = reference(eng, ids, N)
        row = {"prompt": p["name"], "len": len(ids), "reference_seconds": time.perf_counter() - t0,
               "reference_tokens": ref_tokens, "arms": {}}
        L = state_length(len(ids) + N, eng.cfg.max_context)
        for a, e in arms.items():
            t0 = time.perf_counter()
            r = score(teacher_forced(e, ids, ref_tokens, args.chunk, L), ref_tokens, ref_logits)
            dt = time.perf_counter() - t0
            seconds[a] += dt
            r["seconds"] = dt
            row["arms"][a] = r
            per_arm[a].append(r)
            fd = "-" if r["first_divergence"] is None else str(r["first_divergence"])
            print(f"{p['name']:>10} {len(ids):>5} {a:>12} {r['agreement']:>7.2f} {r['mean_abs_logit_diff']:>9.2e} "
                  f"{r['max_abs_logit_diff']:>9.2e} {fd:>9}", flush=True)
        rows.append(row)
        # written after every prompt so a run cut short still leaves its evidence
        write_json(args.json, written(partial=True))

    out = written(partial=False)
    write_json(args.json, out)
    ctrl, summ = out["control"], out["candidates"]
    harness_ok = out["harness_ok"]
    print(f"control (batched-ordered, teacher-forced): {ctrl['agreement']:.2f}% "
          f"({ctrl['matches']}/{ctrl['positions']}), logits byte-identical to replay: {ctrl['logits_identical']}")
    if not harness_ok:
        print(f"HARNESS BROKEN: the control reads {ctrl['agreement']:.4f}%, not 100.0: the ordered batched path, "
              f"forced on the reference's own tokens, must pick every reference token. First divergences: "
              f"{[(r['prompt'], r['arms']['control']['first_divergence']) for r in rows if r['arms']['control']['first_divergence'] is not None]}. "
              f"No candidate number can be trusted.", file=sys.stderr)
        return 3
    if not ctrl["logits_identical"]:
        print("WARNING: the control picks every reference token but its logits are not byte-equal to replay's: "
              "the identity contract is broken here (run benchmarks/identity.py)", file=sys.stderr)
    for a in cands:
        s = summ[a]
        print(f"{a:>12}: {s['agreement']:.2f}% ({s['matches']}/{s['positions']}) vs bar {BAR:.1f}% -> "
              f"{'PASS' if s['passes_bar'] else 'BELOW BAR'}; mean |d| {s['mean_abs_logit_diff']:.3e}, "
              f"max |d| {s['max_abs_logit_diff']:.3e}, prompts diverged {s['prompts_diverged']}/{len(prompts)}, "
              f"earliest divergence at position {s['earliest_divergence']}")
    return 0 if out["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
