"""python -m baro_jax.generate: run a model on a prompt and stream the continuation."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

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
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk size (env BARO_PREFILL_C; default 8192, the next power of two for shorter "
                        "prompts; tier mode: the largest that fits the device budget)")
    p.add_argument("--backend", choices=["ordered", "xla"], default=None,
                   help="ordered: row-invariant custom calls (default when built); xla: plain jnp")
    p.add_argument("--variant", default=None,
                   help="opt-in order-changing variant on the ordered backend: xla, attn-fast, delta-chunk, or none "
                        "(default; env BARO_VARIANT). Not byte-identical to replay: judged by "
                        "benchmarks/agreement.py")
    p.add_argument("--delta-rule", choices=["token", "blocked"], default=None,
                   help="token (default): the per-token delta rule; blocked: the chunk-aligned rule of DESIGN §9 "
                        "(opt-in, CPU kernel only so far; identity holds within it, its bits differ from token's) "
                        "(env BARO_DELTA=token|blocked)")
    p.add_argument("--mode", choices=["resident", "tier"], default=None,
                   help="resident (default): every weight in device memory; tier: routed experts in pinned host "
                        "memory, staged to the device layer by layer (env BARO_TIER=1|0)")
    p.add_argument("--device-budget-gb", type=float, default=None,
                   help="device memory to plan for, in GiB (default: the device's); tier mode refuses a request "
                        "whose non-expert weights + two staged expert layers + KV/state exceed it")
    p.add_argument("--devices", type=int, default=None,
                   help="expert parallel over N devices: routed experts sharded, the same tokens as one device")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and synthetic weights")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load a checkpoint even if some weights hold NaN/Inf (refused by default; env BARO_ALLOW_NONFINITE=1)")
    return p.parse_args(argv)


def _run(argv) -> int:
    args = parse_args(argv)
    from . import load
    from .ops import BackendUnavailable
    from .sampling import Sampling
    from .config import PRESETS
    from .settings import Settings
    from .tokenizer import apply_chat_template

    try:
        settings = Settings.resolve(backend=args.backend, dtype=args.dtype, max_context=args.max_context,
                                    mode=args.mode, device_budget_gb=args.device_budget_gb, variant=args.variant,
                                    allow_nonfinite=args.allow_nonfinite or None, delta_rule=args.delta_rule,
                                    devices=args.devices, prefill=args.prefill, chunk=args.chunk)
        prefill, chunk = settings.prefill, settings.chunk
        eng = load(args.model, settings=settings, seed=args.seed, progress=not args.json)
        if args.prompt_ids is not None:
            try:
                prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
            except ValueError:
                raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        else:
            if args.prompt_file:
                try:
                    with open(args.prompt_file, encoding="utf-8") as f:
                        text = f.read()
                except UnicodeDecodeError as e:
                    raise ValueError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
                except OSError as e:
                    raise ValueError(f"--prompt-file {args.prompt_file!r}: cannot read it ({e.strerror or e})") from None
            else:
                text = args.prompt if args.prompt is not None else DEMO_PROMPT
            if args.chat:
                text = apply_chat_template(eng.tokenizer, text)
            prompt = text
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        if not args.json:
            print(f"[baro_jax] running on {_device_name()} | backend {eng.backend}"
                  f"{'+' + eng.variant if getattr(eng, 'variant', None) else ''} | {eng.mode}"
                  f"{_devices_note(eng)} | "
                  f"{_dtype_name(eng.dtype)}", file=sys.stderr)
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
                           on_token=streamer, progress=None if args.json else _Progress())
    except BrokenPipeError:
        raise
    except (ValueError, TypeError, OverflowError, BackendUnavailable, OSError, RuntimeError, MemoryError) as e:
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


PROGRESS_AFTER_S = 3.0  # a prefill shows progress once it has run this long ...
PROGRESS_EVERY_S = 2.0  # ... and then at most this often


class _Progress:
    """Prefill progress on stderr (tokens done, tok/s), only for prefills longer than a few seconds."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.last = None

    def __call__(self, done: int, total: int):
        now = time.perf_counter()
        dt = now - self.t0
        final = done >= total
        if self.last is None and dt < PROGRESS_AFTER_S:
            return
        if not final and self.last is not None and now - self.last < PROGRESS_EVERY_S:
            return
        print(f"{'' if self.last is not None else chr(10)}[baro_jax] prefill {done}/{total} tokens "
              f"({100 * done // total}%), {done / dt if dt > 0 else 0:.1f} tok/s, {dt:.1f}s",
              file=sys.stderr, flush=True)
        self.last = now


def _devices_note(eng) -> str:
    n = getattr(eng, "devices", None)
    return f" | expert parallel over {n} device{'s' if n != 1 else ''}" if n else ""


def _device_name() -> str:
    import jax

    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "") or ""
    return f"{d.platform} ({kind})" if kind and kind != d.platform else d.platform


def _dtype_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


_IDS_ARG = re.compile(r"-\d[\d,\s-]*")


def _join_negative_ids(argv: list) -> list:
    """`--prompt-ids -1,2`: argparse takes '-1,2' for an option; glue it on as --prompt-ids=-1,2
    so the ids are read (and -1 refused as outside the vocabulary)."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "--prompt-ids" and _IDS_ARG.fullmatch(out[i + 1]):
            out[i:i + 2] = [f"--prompt-ids={out[i + 1]}", None]
    return [a for a in out if a is not None]


def main(argv=None) -> int:
    """The CLI. Every failure is one line on stderr and a non-zero exit, never a traceback:
    2 for a bad request, 130 for Ctrl-C, 141 when stdout is closed early (`| head`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for k, a in enumerate(argv):
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            print(f"error: command-line argument {k + 1} ({ascii(a)}) is not valid UTF-8", file=sys.stderr)
            return 2
    try:
        return _run(_join_negative_ids(argv))
    except KeyboardInterrupt:
        print("\nerror: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:  # stdout was closed early: point it at /dev/null so the exit-time flush does not fail again
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        try:
            print("error: output closed early (broken pipe); stopped", file=sys.stderr)
        except OSError:
            pass
        return 141
    except Exception as e:  # a bug: still one line, with what to report
        from .settings import Settings

        try:
            show = Settings.resolve().traceback
        except ValueError:
            show = False
        if show:
            raise
        print(f"error: internal error {type(e).__name__}: {e} (please report it; "
              "BARO_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 1


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
