"""Identity gate, many-sequence axis: every sequence of generate_batch must equal its run alone.

N prompts of random token ids, lengths spread log-uniformly from 1 token to --max-len (exactly 1,
every configuration's chunk, chunk + 1 and 3 chunks + 1 among them), max_new_tokens spread over
[--min-new-tokens, --new-tokens], half the sequences sampled (--temperature, --top-p, a distinct
seed each; with --kinds mixed, every third of them plain temperature and every third top_k 20,
both drawn inside the decode graph) and half greedy. Each sequence runs alone once (generate(), batched prefill), and a
few (--replay, spread over lengths up to --replay-max-len) also through the replay path alone;
then every (max_batch, chunk) configuration runs generate_batch over all of them, fewer slots
than sequences meaning that sequences join while others decode. Compared in bytes: generated
ids, logprobs, final state (KV over the positions both hold). One line per configuration, JSON
with device, commit and date, exit status 1 on any difference. The gate itself is
baro_jax.verify.batch_identity.

    python benchmarks/batch_identity.py --model tiny --n 16 --max-len 200 --new-tokens 8 \\
        --json benchmarks/results/batch_identity_tiny_cpu.json
    python benchmarks/batch_identity.py --model qwen3.5-35b-a3b --n 64 --max-len 9000 \\
        --configs n/4:32,n:256,1:64 --json benchmarks/results/batch_identity_h200.json

Tier mode (--mode tier: routed experts in host memory, the pool's steps from Python layer loops)
checks its batches against its own runs alone; --reference-json names a resident run of the same
arguments, whose runs alone each tier run alone must equal in bytes (digests), so every tier batch
sequence equals its resident one:

    python benchmarks/batch_identity.py --model tiny --n 8 --max-len 60 --json resident.json
    python benchmarks/batch_identity.py --model tiny --n 8 --max-len 60 --mode tier --cache-slots 3 \\
        --reference-json resident.json --json tier.json
"""
from __future__ import annotations

import argparse
import sys

DEFAULT_CONFIGS = "n/4:32,n:256,1:64"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, a preset (qwen3.5-35b-a3b, ...) or a checkpoint directory")
    ap.add_argument("--backend", default="ordered", choices=["ordered", "xla"])
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--mode", default="resident", choices=["resident", "tier"],
                    help="where the routed experts live (tier: pinned host memory, staged per layer)")
    ap.add_argument("--device-budget-gb", type=float, default=None)
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="tier mode: the decode expert cache's slots per layer (default: 64, at most E, fewer when "
                         "the budget says so; 0: none, every decode step stages every layer)")
    ap.add_argument("--reference-json", default=None,
                    help="another batch_identity.py JSON of the same arguments (e.g. resident mode's): each "
                         "sequence alone must have its bytes")
    ap.add_argument("--seed", type=int, default=0, help="a preset's weights")
    ap.add_argument("--n", type=int, default=16, help="sequences")
    ap.add_argument("--max-len", type=int, default=200, help="the longest prompt, in tokens")
    ap.add_argument("--shared", type=int, default=0,
                    help="the last K prompts start as an earlier one does (the pool copies its state at the "
                         "tokens they share: verify.batch_identity.share_prefixes)")
    ap.add_argument("--lengths", default=None,
                    help="comma-separated prompt lengths instead of the spread (--n is then their count)")
    ap.add_argument("--new-tokens", type=int, default=16, help="the most new tokens a sequence makes")
    ap.add_argument("--min-new-tokens", type=int, default=1, help="the fewest")
    ap.add_argument("--sampled", default="half", choices=["half", "all", "none"],
                    help="which sequences sample (half: every other one); the rest are greedy")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--kinds", default="mixed", choices=["mixed", "given"],
                    help="mixed: the sampled sequences take, in turn, the given sampling, a plain --temperature and "
                         "top_k 20 with --top-p (with top_p < 1 and no top_k, the first ranks each row whole); given: "
                         "all the given sampling")
    ap.add_argument("--prompt-seed", type=int, default=0,
                    help="draws the lengths, their order, the prompts' ids, the new-token counts and the sampling seeds")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated MAX_BATCH:CHUNK (MAX_BATCH: an integer, n, n/K or auto; CHUNK: an integer "
                         f"or auto); default {DEFAULT_CONFIGS}")
    ap.add_argument("--replay", type=int, default=3,
                    help="sequences also compared with the replay path alone (the decode step per prompt token)")
    ap.add_argument("--replay-max-len", type=int, default=1024,
                    help="the longest prompt the replay sequences are chosen from (replay runs one step per token)")
    ap.add_argument("--replay-indices", default=None, help="comma-separated sequence indices instead of --replay")
    ap.add_argument("--alone-chunk", type=int, default=None,
                    help="the prefill chunk of the runs alone (default: generate()'s own pick per prompt)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.lengths is not None:
        try:
            args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
        if not args.lengths or min(args.lengths) < 1:
            ap.error("--lengths needs at least one length, each >= 1")
        args.n = len(args.lengths)
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if args.max_len < 1:
        ap.error(f"--max-len must be >= 1, got {args.max_len}")
    if not 0 <= args.min_new_tokens <= args.new_tokens:
        ap.error(f"need 0 <= --min-new-tokens <= --new-tokens, got {args.min_new_tokens} and {args.new_tokens}")
    if args.replay_indices is not None:
        try:
            args.replay_indices = [int(x) for x in args.replay_indices.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--replay-indices must be comma-separated integers, got {args.replay_indices!r}")
        bad = [i for i in args.replay_indices if not 0 <= i < args.n]
        if bad:
            ap.error(f"--replay-indices {bad} are outside the {args.n} sequences")
    from baro_jax.verify.batch_identity import parse_configs

    try:
        args.configs = parse_configs(args.configs, args.n)
    except ValueError as e:
        ap.error(f"--configs: {e}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import baro_jax
    from baro_jax import Sampling, verify
    from baro_jax.verify import batch_identity as bi

    chunks = [c for _, c in args.configs if c is not None]
    lengths = args.lengths or bi.length_mix(args.n, args.max_len, chunks, seed=args.prompt_seed)
    news = bi.new_token_mix(args.n, args.min_new_tokens, args.new_tokens, seed=args.prompt_seed)
    need = max(x + m for x, m in zip(lengths, news))
    eng = baro_jax.load(args.model, backend=args.backend, max_context=args.max_context, seed=args.seed,
                        mode=args.mode, device_budget_gb=args.device_budget_gb,
                        cache_slots=args.cache_slots if args.mode == "tier" else None, progress=False)
    if need > eng.cfg.max_context:
        raise SystemExit(f"error: the longest sequence needs {need} positions, more than max_context="
                         f"{eng.cfg.max_context} (--max-context, or a smaller --max-len / --new-tokens)")
    prompts = bi.random_prompts(lengths, eng.cfg.vocab_size, seed=args.prompt_seed)
    if args.shared:
        prompts = bi.share_prefixes(prompts, args.shared, eng.cfg.vocab_size, seed=args.prompt_seed)
        lengths = [len(p) for p in prompts]

    def sampling(i):
        if args.sampled == "none" or (args.sampled == "half" and i % 2 == 0):
            return Sampling()
        kind = (i // 2) % 3 if args.kinds == "mixed" else 0
        top_p, top_k = ((args.top_p, args.top_k), (1.0, 0), (args.top_p, 20))[kind]
        return Sampling(temperature=args.temperature, top_p=top_p, top_k=top_k,
                        seed=args.prompt_seed * 100003 + i)  # distinct per sequence

    sps = [sampling(i) for i in range(args.n)]
    replay = (args.replay_indices if args.replay_indices is not None
              else bi.spread(range(args.n), lengths, args.replay, args.replay_max_len))
    configs_txt = ",".join(f"{'auto' if b is None else b}:{'auto' if c is None else c}" for b, c in args.configs)
    print(f"batch identity: model={args.model} backend={args.backend} mode={args.mode} n={args.n}"
          f" lengths {min(lengths)}..{max(lengths)} "
          f"new tokens {min(news)}..{max(news)} sampled={sum(not s.greedy for s in sps)} configs={configs_txt} "
          f"replay={replay}", flush=True)
    extra = {"model": args.model, "backend": args.backend, "mode": args.mode, "n": args.n, "max_len": args.max_len,
             "new_tokens": [args.min_new_tokens, args.new_tokens], "sampled": args.sampled,
             "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                          "kinds": args.kinds},
             "prompt_seed": args.prompt_seed, "weights_seed": args.seed, "alone_chunk": args.alone_chunk,
             "shared": args.shared,
             "config_list": [[b, c] for b, c in args.configs], "replay_indices": list(replay),
             **verify.provenance()}
    # rewritten after the runs alone and after every configuration, so a run cut short keeps its rows
    rep = bi.run_batch_identity(eng, prompts, news, sps, args.configs, replay=replay, alone_chunk=args.alone_chunk,
                                on_progress=lambda r: verify.write_json(args.json, r.partial_json(**extra)))
    if args.reference_json:
        rep.reference = bi.compare_reference(rep.sequences, args.reference_json)
    if args.mode == "tier":  # over the whole run: the runs alone, then the batches' decode steps
        extra["expert_cache"] = eng.expert_cache_report()
        cache = eng.runner.cache
        if cache is not None:
            print(f"expert cache: {cache.slots} slots per layer; in the runs: {cache.hits} hits, {cache.misses} "
                  f"misses, {cache.staged_layers} layers of decode steps staged whole")
    verify.write_json(args.json, rep.to_json(**extra))
    s = rep.summary()
    print(f"runs alone {s['alone_seconds']:.1f}s, replay alone {s['replay_seconds']:.1f}s "
          f"({s['replay_equal_alone']}/{s['replay_sequences']} equal batched prefill alone)")
    print(f"{'PASS' if rep.ok else 'FAIL'}: {s['rows_equal']}/{s['rows']} sequences x configurations equal alone"
          + (f", {s['replay_rows_equal']}/{s['replay_rows']} equal replay alone" if s["replay_rows"] else "")
          + (f"; runs alone vs {args.reference_json}: {rep.reference['compared'] - len(rep.reference['differing'])}/"
             f"{rep.reference['compared']} equal" if rep.reference else ""))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MemoryError as e:  # a case the device budget cannot hold, refused before any work: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
