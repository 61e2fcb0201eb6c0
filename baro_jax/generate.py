"""python -m baro_jax.generate: run a model on a prompt and stream the continuation."""
from __future__ import annotations

import argparse
import json
import os
import sys

DEMO_PROMPT = "import os\nimport sys\n\n\ndef main():\n    "


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m baro_jax.generate", description=__doc__)
    p.add_argument("--model", default="tiny", help="checkpoint directory; tiny (the embedded trained demo model); or a synthetic-weight preset: "
                        "qwen3.5-35b-a3b, qwen3-next-80b-a3b, tiny-random")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt text from this file")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill", choices=["batch", "replay"], default=None,
                   help="batch (default): chunked prefill, bit-identical to replay on the ordered backend; "
                        "replay: the decode step per prompt token (env BARO_PREFILL=1|0)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk size (env BARO_PREFILL_C; default 1024, smaller for short prompts)")
    p.add_argument("--backend", choices=["ordered", "xla"], default=None,
                   help="ordered: row-invariant custom calls (default when built); xla: plain jnp")
    p.add_argument("--variant", default=None,
                   help="opt-in order-changing variant on the ordered backend: xla, attn-fast, delta-chunk, or none "
                        "(default; env BARO_VARIANT). Not byte-identical to replay: judged by "
                        "benchmarks/agreement.py")
    p.add_argument("--mode", choices=["resident", "tier"], default=None,
                   help="resident (default): every weight in device memory; tier: routed experts in pinned host "
                        "memory, staged to the device layer by layer (env BARO_TIER=1|0)")
    p.add_argument("--device-budget-gb", type=float, default=None,
                   help="device memory to plan for, in GiB (default: the device's); tier mode refuses a request "
                        "whose non-expert weights + two staged expert layers + KV/state exceed it")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and synthetic weights")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from . import load
    from .engine import default_backend, env_chunk, env_prefill_mode
    from .ops import BackendUnavailable
    from .sampling import Sampling
    from .config import PRESETS
    from .tokenizer import apply_chat_template

    try:
        prefill = args.prefill or env_prefill_mode()
        chunk = args.chunk if args.chunk is not None else env_chunk()
        from . import variants

        variant = variants.check(args.variant) if args.variant is not None else variants.env_variant()
        backend = args.backend or ("ordered" if variant else default_backend(args.dtype))
        eng = load(args.model, backend=backend, dtype=args.dtype, max_context=args.max_context,
                   seed=args.seed, progress=not args.json, mode=args.mode,
                   device_budget_gb=args.device_budget_gb, variant=variant or "none")
        if args.prompt_ids is not None:
            try:
                prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
            except ValueError:
                raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        else:
            if args.prompt_file:
                with open(args.prompt_file) as f:
                    text = f.read()
            else:
                text = args.prompt if args.prompt is not None else DEMO_PROMPT
            if args.chat:
                text = apply_chat_template(eng.tokenizer, text)
            prompt = text
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        if not args.json:
            if args.model == "tiny":
                print("[baro_jax] 'tiny': a 7.8M-parameter Qwen3.5-MoE-architecture demonstration model trained "
                      "on Python source (not a general assistant).", file=sys.stderr)
            elif args.model in PRESETS:
                print(f"[baro_jax] {args.model!r}: real shapes, synthetic random weights: expect noise, not language.",
                      file=sys.stderr)
            if isinstance(prompt, str):
                sys.stdout.write(prompt)
                sys.stdout.flush()
        streamer = None if args.json else _Streamer(eng.tokenizer)
        res = eng.generate(prompt, args.max_new_tokens, prefill=prefill, chunk=chunk, sampling=sampling,
                           on_token=streamer)
    except (ValueError, BackendUnavailable, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        streamer.flush()
        print(f"\n[{res.model} | {res.backend}{'+' + res.variant if res.variant else ''} | {res.mode} | prefill {res.prefill_mode}: {len(res.prompt_ids)} tokens "
              f"in {res.prefill_seconds:.3f}s ({res.prefill_tokens_per_s:.1f} tok/s) | "
              f"decode {res.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


class _Streamer:
    """Prints text as tokens arrive, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, token: int):
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)

    def flush(self):
        text = self.tok.decode(self.ids)
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
