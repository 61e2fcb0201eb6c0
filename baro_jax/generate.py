"""Run a model on a prompt and stream the continuation: python -m baro_jax (also `baro-jax` and
python -m baro_jax.generate).

Exit status: 0 done; 2 a bad request (one line on stderr naming the flag, file or setting);
74 the result cannot be written (standard output closed or failing); 130 Ctrl-C; 141 standard
output closed early by its reader (`| head`); 1 an internal error (please report it).
"""
from __future__ import annotations

# Only what the Ctrl-C handler needs is imported at the top: main() installs it first, and every
# other import (jax's takes seconds) happens after, so that a Ctrl-C during one is an exit 130.
import contextlib
import os
import signal
import sys

DEMO_PROMPT = "import os\nimport sys\n\n\ndef main():\n    "

EXIT_INTERNAL = 1
EXIT_BAD_REQUEST = 2
EXIT_OUTPUT = 74  # sysexits' EX_IOERR
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

PROGRESS_AFTER_S = 3.0  # a prefill shows progress once it has run this long ...
PROGRESS_EVERY_S = 2.0  # ... and then at most this often


class UsageError(Exception):
    """A bad command line, found before any work: one line, exit 2."""


class OutputError(Exception):
    """Standard output cannot take the result (closed, full, or not writable)."""


class _ParserExit(Exception):
    def __init__(self, status: int):
        self.status = status


# --- the command line ----------------------------------------------------------------------------
def _prog() -> str:
    """The command as the user typed it, for usage lines and messages."""
    here = os.path.dirname(os.path.abspath(__file__))
    arg0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if arg0 == os.path.join(here, "__main__.py"):
        return "python -m baro_jax"
    if arg0 == os.path.join(here, "generate.py"):
        return "python -m baro_jax.generate"
    return "baro-jax"


def setting_help(field: str) -> str:
    """A settings flag's help: its documentation, default and variable, from settings.SPECS."""
    from .settings import SPEC_BY_FIELD, _default_text

    spec = SPEC_BY_FIELD[field]
    env = f"; env {spec.env}" if spec.env else ""
    return f"{spec.doc} (default: {_default_text(spec)}{env})".replace("%", "%%")


def _parser():
    import argparse

    from .settings import BACKENDS, DELTA_RULES, DTYPES, ENGINE_MODES, PREFILL_MODES, VARIANTS

    class Parser(argparse.ArgumentParser):
        # argparse prints a usage block and exits; the CLI's failures are one line and an exit code
        def error(self, message):
            raise UsageError(f"{message} ({self.prog} --help lists the flags)")

        def exit(self, status=0, message=None):
            if message:
                _say(message.rstrip("\n"))
            raise _ParserExit(status)

    setting = setting_help
    p = Parser(prog=_prog(), description=__doc__.split("\n\n")[0], allow_abbrev=False,
               epilog=__doc__.split("\n\n", 1)[1].replace("\n", " ").strip())
    p.add_argument("--model", default="tiny", metavar="DIR|NAME",
                   help="a checkpoint directory; tiny, the embedded trained demo model; or a synthetic-weight preset "
                        "at real shapes: qwen3.5-35b-a3b, qwen3-next-80b-a3b, tiny-random (default: %(default)s)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text (default: a few lines of Python, the demo prompt)")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt text (UTF-8) from this file (default: none)")
    src.add_argument("--prompt-ids", metavar="IDS", help="the prompt as comma-separated token ids, e.g. 1,2,3 (default: none)")
    src.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help="many prompts at once (generate_batch): one JSON object per line, {\"prompt\": TEXT} or "
                          "{\"ids\": [...]}, optionally with max_new_tokens, seed, temperature, top_k, top_p, n; one "
                          "JSON line per prompt (per sample) out, in input order (default: none)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="with --prompts-file: sequences decoding at once (default: as many as the prompts, at most "
                        "64, as the device budget allows)")
    p.add_argument("--n", type=int, default=None, metavar="N",
                   help="with --prompts-file: samples per prompt, sample j drawn with seed + j; the prompt is "
                        "prefilled once for all of them (default: 1)")
    p.add_argument("--prefill-budget", type=int, default=None, metavar="N",
                   help="with --prompts-file: prompt rows prefilled per round, in whole chunks of 256, before the "
                        "running sequences' next step; the bytes are the same (default: one chunk)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the checkpoint's chat template (default: off)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate at most; stops early at the end-of-sequence token (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the k most likely tokens; 0 is off; needs --temperature > 0 "
                        "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the most likely tokens whose probability reaches p; 1 is off; needs "
                        "--temperature > 0 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed for sampling and for a preset's synthetic weights (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the result instead of streaming text (default: off)")
    p.add_argument("--backend", choices=BACKENDS + ("auto",), default=None, help=setting("backend"))
    p.add_argument("--dtype", choices=DTYPES, default=None, help=setting("dtype"))
    p.add_argument("--prefill", choices=PREFILL_MODES, default=None, help=setting("prefill"))
    p.add_argument("--chunk", type=int, default=None, metavar="N", help=setting("chunk"))
    p.add_argument("--variant", choices=VARIANTS + ("none",), default=None, help=setting("variant"))
    p.add_argument("--delta-rule", choices=DELTA_RULES, default=None, help=setting("delta_rule"))
    p.add_argument("--mode", choices=ENGINE_MODES, default=None, help=setting("mode"))
    p.add_argument("--cache-slots", type=int, default=None, metavar="N", help=setting("cache_slots"))
    p.add_argument("--device-budget-gb", type=float, default=None, metavar="GIB", help=setting("device_budget_gb"))
    p.add_argument("--devices", type=int, default=None, metavar="N", help=setting("devices"))
    p.add_argument("--max-context", type=int, default=None, metavar="N", help=setting("max_context"))
    p.add_argument("--allow-nonfinite", action="store_true", default=None, help=setting("allow_nonfinite"))
    return p


def parse_args(argv=None):
    return _parser().parse_args(_join_negative_ids(list(sys.argv[1:] if argv is None else argv)))


def _request(args):
    """Everything the command line asks for, checked before any weight is read: the settings,
    the sampling, the prompt, and the engine's own checks that need only the model's config.
    Returns (settings, sampling, prompt): prompt is text or a list of token ids."""
    from .checks import token_ids
    from .engine import Engine
    from .sampling import Sampling
    from .settings import Settings

    settings = Settings.resolve(backend=args.backend, dtype=args.dtype, max_context=args.max_context,
                                mode=args.mode, device_budget_gb=args.device_budget_gb, variant=args.variant,
                                allow_nonfinite=args.allow_nonfinite, delta_rule=args.delta_rule,
                                devices=args.devices, prefill=args.prefill, chunk=args.chunk,
                                cache_slots=args.cache_slots)
    if args.max_new_tokens < 0:
        raise UsageError(f"max_new_tokens (--max-new-tokens) must be >= 0, got {args.max_new_tokens}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed).validate()
    if args.max_batch is not None and args.prompts_file is None:
        raise UsageError("--max-batch is for --prompts-file (many prompts at once)")
    if args.max_batch is not None and args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.n is not None and args.prompts_file is None:
        raise UsageError("--n is for --prompts-file (many prompts at once)")
    if args.n is not None and args.n < 1:
        raise UsageError(f"--n must be >= 1, got {args.n}")
    if args.prefill_budget is not None and args.prompts_file is None:
        raise UsageError("--prefill-budget is for --prompts-file (many prompts at once)")
    if args.prefill_budget is not None and args.prefill_budget < 1:
        raise UsageError(f"--prefill-budget must be >= 1, got {args.prefill_budget}")
    if args.prompts_file is not None:
        return settings, sampling, _batch_request(args, settings, sampling)
    prompt = _prompt(args)
    cfg = model_config(args.model, settings)
    if cfg is None:  # load() names what is wrong with --model, before any work
        return settings, sampling, prompt
    # the engine's checks, over the config alone: the same rules and words as after loading
    unloaded = _Unloaded(cfg)
    sampling = Engine.sampling_for(unloaded, sampling)
    if isinstance(prompt, list):
        prompt = token_ids(prompt, cfg.vocab_size)
        Engine.check_fits(unloaded, len(prompt), args.max_new_tokens)
    if args.chat:
        text = prompt if isinstance(prompt, str) else None
        if text is None:
            raise UsageError("--chat wraps prompt text in the chat template; give --prompt or --prompt-file, "
                             "not --prompt-ids")
        prompt = _chat(args.model, text)
    return settings, sampling, prompt


PROMPT_LINE_KEYS = ("prompt", "ids", "max_new_tokens", "seed", "temperature", "top_k", "top_p", "n")


def _batch_request(args, settings, sampling) -> list:
    """--prompts-file's lines as [(prompt, max_new_tokens, Sampling, n)], each checked (and against
    the model's config where it is known) before any weight is read; errors name the line."""
    import json

    from .batch import sample_seeds
    from .checks import token_ids
    from .engine import Engine
    from .sampling import Sampling

    lines = _read_text("--prompts-file", args.prompts_file).splitlines()
    cfg = model_config(args.model, settings)
    unloaded = _Unloaded(cfg) if cfg is not None else None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts-file {args.prompts_file!r} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(PROMPT_LINE_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(PROMPT_LINE_KEYS)})")
        if ("prompt" in obj) == ("ids" in obj):
            raise UsageError(f"{where}: give exactly one of \"prompt\" (text) and \"ids\" (token ids)")
        if "prompt" in obj:
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise UsageError(f"{where}: \"prompt\" must be non-empty text")
            if args.chat:
                prompt = _chat(args.model, prompt)
        else:
            prompt = obj["ids"]
            if not isinstance(prompt, list) or not prompt or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise UsageError(f"{where}: \"ids\" must be a non-empty list of integers")
            if args.chat:
                raise UsageError(f"{where}: --chat wraps prompt text in the chat template; \"ids\" are not text")
        news = obj.get("max_new_tokens", args.max_new_tokens)
        if not isinstance(news, int) or isinstance(news, bool) or news < 0:
            raise UsageError(f"{where}: \"max_new_tokens\" must be an integer >= 0, got {news!r}")
        samples = obj.get("n", 1 if args.n is None else args.n)
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
            raise UsageError(f"{where}: \"n\" must be an integer >= 1, got {samples!r}")
        fields = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                  "seed": sampling.seed}
        for key, kind in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int), ("seed", int)):
            if key in obj:
                v = obj[key]
                if not isinstance(v, kind) or isinstance(v, bool):
                    what = "an integer" if kind is int else "a number"
                    raise UsageError(f"{where}: \"{key}\" must be {what}, got {v!r}")
                fields[key] = v
        try:
            sp = Sampling(fields["temperature"], fields["top_k"], fields["top_p"], fields["seed"]).validate()
            sample_seeds(sp, samples, "n")
            if unloaded is not None:
                sp = Engine.sampling_for(unloaded, sp)
                if isinstance(prompt, list):
                    prompt = token_ids(prompt, cfg.vocab_size)
                    Engine.check_fits(unloaded, len(prompt), news)
        except ValueError as e:
            raise UsageError(f"{where}: {e}") from None
        out.append((prompt, news, sp, samples))
    if not out:
        raise UsageError(f"--prompts-file {args.prompts_file!r} holds no prompt (one JSON object per line)")
    return out


class _Unloaded:
    """What Engine's config-only checks (sampling_for, check_fits) read of an engine: its config."""

    def __init__(self, cfg):
        self.cfg = cfg


def model_config(model: str, settings):
    """--model's config (config.json or the preset), None when --model is neither: cheap, no weights."""
    from .config import PRESETS, load_config, preset
    from .loading import TINY_CHECKPOINT

    path = TINY_CHECKPOINT if model == "tiny" else model
    if os.path.isdir(path):
        return load_config(path, settings.max_context)
    if model in PRESETS:
        return preset(model, settings.max_context)
    return None


def _chat(model: str, text: str) -> str:
    """The text in --model's chat template; the tokenizer files are read here, before the weights,
    so that a checkpoint without a usable template is refused before the model loads."""
    from .loading import TINY_CHECKPOINT
    from .tokenizer import ByteTokenizer, apply_chat_template, load_tokenizer

    path = TINY_CHECKPOINT if model == "tiny" else model
    tok = load_tokenizer(path) if os.path.isdir(path) else ByteTokenizer()  # a preset: load()'s tokenizer too
    return apply_chat_template(tok, text)


def _read_text(flag: str, path: str) -> str:
    """The UTF-8 text of a file a flag names; a usage error naming the flag and file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"{flag} {path!r}: cannot read it ({e.strerror or e})") from None


def _prompt(args):
    """The prompt: text (from --prompt, --prompt-file or the demo) or --prompt-ids' ids, unchecked
    against the model."""
    if args.prompt_ids is not None:
        if not args.prompt_ids.strip():
            raise UsageError("--prompt-ids is empty: the prompt needs at least one token")
        parts = args.prompt_ids.split(",")
        # an empty entry ("1,,2", "1,2,") is a typo, not a token to drop silently
        if not all(t.strip() for t in parts):
            raise UsageError(f"--prompt-ids has an empty entry (two commas in a row, or one at an end): "
                             f"{args.prompt_ids!r}")
        try:
            return [int(t, 10) for t in parts]
        except ValueError:
            raise UsageError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if args.prompt_file is not None:
        text = _read_text("--prompt-file", args.prompt_file)
        if not text:
            raise UsageError(f"--prompt-file {args.prompt_file!r} is empty: the prompt needs at least one token")
        return text
    if args.prompt == "":
        raise UsageError("--prompt is empty: the prompt needs at least one token")
    return args.prompt if args.prompt is not None else DEMO_PROMPT


# --- the run -------------------------------------------------------------------------------------
def _run(argv, interrupt) -> int:
    import json

    args = parse_args(argv)
    # The native libraries (jaxlib, numpy, tokenizers, the kernel library) load with these imports;
    # a KeyboardInterrupt raised inside one's initialisation can crash the process (SIGSEGV or an
    # abort, seen under load on a Ctrl-C a fraction of a second after start), so they run to their
    # end and the Ctrl-C is acted on after them.
    with interrupt.deferred():
        from . import loading  # through the module: the tests check that a bad flag never reaches load()
    interrupt.check()
    settings, sampling, prompt = _request(args)
    interrupt.check()
    from .config import PRESETS

    eng = loading.load(args.model, settings=settings, seed=args.seed, progress=not args.json)
    interrupt.check()
    if args.prompts_file is not None:
        return _run_batch(eng, args, prompt, interrupt)
    streamer = None
    if not args.json:
        _say(f"[baro_jax] running on {_device_name()} | {_what_runs(eng)}")
        if args.model == "tiny":
            _say("[baro_jax] 'tiny': a 7.8M-parameter Qwen3.5-MoE-architecture demonstration model trained "
                 "on Python source (not a general assistant).")
        elif args.model in PRESETS:
            _say(f"[baro_jax] {args.model!r}: real shapes, synthetic random weights: expect noise, not language.")
        if isinstance(prompt, str):
            _write_out(prompt)
        streamer = _Streamer(eng.tokenizer)

    def on_token(token):
        interrupt.check()
        if streamer is not None:
            streamer(token)

    # --json passes no progress callback: with one, the batched prefill waits on each chunk, and
    # the JSON's timings are the undisturbed ones
    progress = None if args.json else _Progress(interrupt)
    res = eng.generate(prompt, args.max_new_tokens, sampling=sampling, on_token=on_token, progress=progress)
    interrupt.check()
    if args.json:
        out = res.to_json()
        out.setdefault("delta_rule", eng.cfg.delta_rule)  # GenerateResult does not carry it (yet)
        _write_out(json.dumps(out) + "\n")
    else:
        streamer.flush()
        _say(f"\n[{res.model} | {_what_ran(eng, res)} | prefill {res.prefill_mode}: {len(res.prompt_ids)} tokens "
             f"in {res.prefill_seconds:.3f}s ({res.prefill_tokens_per_s:.1f} tok/s) | "
             f"decode {res.decode_tokens_per_s:.1f} tok/s]")
        hint = _chunk_hint(eng, res)
        if hint:
            _say(hint)
    return 0


def _chunk_hint(eng, res) -> str | None:
    """A line when the engine's own chunk (no --chunk) came out below the prompt's default because the
    device budget is tight: every chunk reads all the weights once, so small chunks make prefill
    slow (an 8k prompt at chunk 256 on an 80 GB H100: a quarter of the speed at 2048, README)."""
    from .shapes import default_chunk

    if eng.settings.chunk is not None or eng.mode != "resident" or res.prefill_mode != "batch" or not res.chunk:
        return None
    want = default_chunk(len(res.prompt_ids))
    if res.chunk >= want:
        return None
    return (f"[baro_jax] prefill ran in chunks of {res.chunk} rows, not {want}: the device budget leaves little room "
            "beside the weights, and every chunk reads all the weights once. More device memory for JAX "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION on a GPU) makes it faster; --chunk sets the chunk.")


def which_samples(ns) -> list[tuple[int, int]]:
    """(prompt, sample) of each result of generate_batch(..., n=ns), in its order."""
    return [(i, j) for i, k in enumerate(ns) for j in range(k)]


def _run_batch(eng, args, requests, interrupt) -> int:
    """--prompts-file: every prompt through one generate_batch call, a JSON line each (input
    order; a prompt's n samples side by side, "index" the prompt's and "sample" the sample's) on
    stdout, progress (sequences done, tokens, tok/s) on stderr."""
    import json
    import time

    prompts, news, samplings, ns = (list(x) for x in zip(*requests))
    total = sum(m * k for m, k in zip(news, ns))
    t0, state = time.perf_counter(), {"tokens": 0, "last": 0.0}
    if not args.json:
        _say(f"[baro_jax] running on {_device_name()} | {_what_runs(eng)} | {len(prompts)} prompts"
             + (f", {len(which_samples(ns))} samples" if max(ns) > 1 else ""))

    def on_token(_index, _token):
        interrupt.check()
        state["tokens"] += 1
        now = time.perf_counter() - t0
        if now - state["last"] >= PROGRESS_EVERY_S:
            state["last"] = now
            _say(f"[baro_jax] {state['tokens']} tokens of at most {total}, {state['tokens'] / now:.1f} tok/s, "
                 f"{now:.1f}s")

    results = eng.generate_batch(prompts, news, sampling=samplings, logprobs=0, max_batch=args.max_batch,
                                 on_token=on_token, prefill_budget=args.prefill_budget, n=ns)
    interrupt.check()
    which = which_samples(ns)
    for (i, j), res in zip(which, results):
        out = res.to_json()
        for key in ("prefill_seconds", "prefill_tokens_per_s", "decode_tokens_per_s", "expert_cache",
                    "top_logprobs", "prompt_logprobs"):
            out.pop(key, None)  # a batch's timings are the batch's (below), not one prompt's
        _write_out(json.dumps({"index": i, "sample": j, **out}) + "\n")
    stats = eng.last_batch_stats
    if not args.json:
        _say(f"[{eng.name} | {_what_runs(eng)} | {len(results)} sequences, {stats['generated_tokens']} tokens in "
             f"{stats['seconds']:.2f}s ({stats['generated_tokens'] / max(stats['seconds'], 1e-9):.1f} tok/s) | "
             f"{stats['slots']} slots]")
    return 0


def _what_runs(eng) -> str:
    """backend[+variant] | placement [| expert parallel] [| delta rule] | dtype: the header's account."""
    parts = [f"backend {eng.backend}{'+' + eng.variant if eng.variant else ''}", eng.mode]
    if eng.devices:
        parts.append(f"expert parallel over {eng.devices} device{'s' if eng.devices != 1 else ''}")
    if eng.cfg.delta_rule != "token":
        parts.append(f"delta rule {eng.cfg.delta_rule}")
    parts.append(_dtype_name(eng.dtype))
    return " | ".join(parts)


def _what_ran(eng, res) -> str:
    """The result line's account of what produced the tokens (the engine's, not the flags')."""
    parts = [f"{res.backend}{'+' + res.variant if res.variant else ''}", res.mode]
    if eng.cfg.delta_rule != "token":
        parts.append(f"delta rule {eng.cfg.delta_rule}")
    cache = res.expert_cache
    if cache is not None:
        path = f", {cache['decode_path']} path" if cache.get("decode_path") else ""
        parts.append(f"expert cache {cache.get('slots_per_layer', 0)} slots/layer{path}")
    return " | ".join(parts)


class _Progress:
    """Prefill progress on stderr (tokens done, tok/s), only for prefills longer than a few seconds;
    also where a Ctrl-C that a library swallowed is noticed during a long prefill."""

    def __init__(self, interrupt):
        import time

        self.clock = time.perf_counter
        self.interrupt = interrupt
        self.t0 = self.clock()
        self.last = None

    def __call__(self, done: int, total: int):
        self.interrupt.check()
        now = self.clock()
        dt = now - self.t0
        final = done >= total
        if self.last is None and dt < PROGRESS_AFTER_S:
            return
        if not final and self.last is not None and now - self.last < PROGRESS_EVERY_S:
            return
        _say(f"{'' if self.last is not None else chr(10)}[baro_jax] prefill {done}/{total} tokens "
             f"({100 * done // total}%), {done / dt if dt > 0 else 0:.1f} tok/s, {dt:.1f}s")
        self.last = now


def _device_name() -> str:
    import jax

    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "") or ""
    return f"{d.platform} ({kind})" if kind and kind != d.platform else d.platform


def _dtype_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def _join_negative_ids(argv: list) -> list:
    """`--prompt-ids -1,2`: argparse takes '-1,2' for an option; glue it on as --prompt-ids=-1,2
    so the ids are read (and -1 refused as outside the vocabulary)."""
    import re

    ids_arg = re.compile(r"-\d[\d,\s-]*")
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "--prompt-ids" and ids_arg.fullmatch(out[i + 1]):
            out[i:i + 2] = [f"--prompt-ids={out[i + 1]}", None]
    return [a for a in out if a is not None]


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
        _write_out(text[self.printed:])
        self.printed = len(text)

    def flush(self):
        text = self.tok.decode(self.ids)
        _write_out(text[self.printed:])


# --- standard streams ----------------------------------------------------------------------------
def _write_out(text: str):
    """Write to stdout now (flushed): a closed pipe stays a BrokenPipeError (exit 141); any other
    failure (a full disk, a descriptor not open for writing) is an OutputError (exit 74)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError, AttributeError) as e:  # ValueError: closed file; AttributeError: None
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise OutputError(f"cannot write the result to standard output ({why})") from None


def _say(line: str):
    """One line for the user on stderr (the _Log in place: never a failure of its own)."""
    err = sys.stderr
    if err is not None:
        err.write(line + "\n")
        err.flush()


class _Log:
    """sys.stderr during a run. The log is best effort: where stderr is closed, not writable or
    failing (`2>&-`, `2</dev/null`, `2>/dev/full`), every line (the CLI's, a library's warnings,
    the weights' progress) goes nowhere, never to stdout and never as an error of the run."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except (OSError, ValueError, AttributeError):
            self._drop()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except (OSError, ValueError, AttributeError):
            self._drop()

    def _drop(self):
        _point_at_devnull(2)
        self.stream = _DEVNULL

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _Devnull:
    def write(self, text):
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


_DEVNULL = _Devnull()


def _point_at_devnull(fd: int):
    """Point descriptor fd at /dev/null: what is written to it is dropped, quietly."""
    try:
        nul = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    if nul != fd:
        try:
            os.dup2(nul, fd)
        except OSError:
            pass
        os.close(nul)


def _writable(fd: int) -> bool:
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:  # closed
        return False
    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


def _check_std_streams() -> bool:
    """Whether stdout can take the result. A standard descriptor that is closed or not open for
    writing (`>&-`, `2>&-`; a shell wrapper may leave its own script there, read-only) is pointed
    at /dev/null first: a file the run opens later must not take the number 1 or 2, where print()
    or the C++ libraries' logs would write into it."""
    try:
        os.fstat(0)
    except OSError:
        _point_at_devnull(0)
    stdout_ok = _writable(1)
    if not stdout_ok:
        _point_at_devnull(1)
    if not _writable(2):
        _point_at_devnull(2)
        sys.stderr = _Log(_DEVNULL)
    return stdout_ok


# --- Ctrl-C --------------------------------------------------------------------------------------
class _Interrupt:
    """Ctrl-C, remembered. Python raises KeyboardInterrupt wherever the interpreter is when SIGINT
    arrives; inside a garbage-collection callback (jax registers one, and imports run the
    collector often), a __del__ or a library's broad except, the exception is dropped and the run
    goes on to exit 0 (issue 28). So the handler also records the interrupt; the CLI checks the
    record after each step and per token, and a second Ctrl-C ends the process at once."""

    def __init__(self):
        self.seen = False
        self.reported = False
        self.previous = None
        self.previous_hook = None
        self.installed = False
        self.deferring = False

    def install(self):
        try:
            previous = signal.getsignal(signal.SIGINT)
            if previous is signal.SIG_IGN:  # started with Ctrl-C ignored (nohup, a background job): keep it so
                return self
            signal.signal(signal.SIGINT, self)
        except ValueError:  # not the main thread (main() called from a thread): signals are not ours
            return self
        self.previous, self.installed = previous, True
        # the dropped KeyboardInterrupt is recorded above; Python would also print it as an
        # "Exception ignored in ..." traceback
        self.previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _unraisable(self, unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.seen:
            return
        self.previous_hook(unraisable)

    def finish(self, process: bool):
        """After main(): in a process of its own the run is over, and a Ctrl-C while the
        interpreter shuts down (jax's exit hooks) ends it at once with 130; called in-process, the
        caller's handler comes back."""
        if not self.installed:
            return
        signal.signal(signal.SIGINT, self._exit_now if process else self.previous)
        if not process:
            sys.unraisablehook = self.previous_hook

    def __call__(self, signum, frame):
        if self.seen:
            self._exit_now()
        self.seen = True
        if not self.deferring:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        """Inside: a first Ctrl-C is only recorded (check() raises it after); a second still ends
        the process at once."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def _exit_now(self, *_):
        if not self.reported:
            try:
                os.write(2, b"\nerror: interrupted (Ctrl-C)\n")
            except OSError:
                pass
        os._exit(EXIT_INTERRUPTED)

    def check(self):
        """Raise the KeyboardInterrupt that a library may have swallowed."""
        if self.seen:
            raise KeyboardInterrupt

    def report(self) -> int:
        self.reported = True
        _say("\nerror: interrupted (Ctrl-C)")
        return EXIT_INTERRUPTED


def main(argv=None) -> int:
    """The CLI. Every failure is one line on stderr and a non-zero exit, never a traceback (the
    module docstring lists the exit codes). argv None: this process's command line."""
    process = argv is None
    interrupt = _Interrupt().install()
    stderr = sys.stderr
    sys.stderr = _Log(stderr)
    try:
        rc = _main(list(sys.argv[1:] if process else argv), interrupt)
    except KeyboardInterrupt:  # a Ctrl-C while an error was being reported
        rc = interrupt.report()
    try:
        if process and rc == EXIT_INTERRUPTED:
            # A run cut short may leave XLA work in flight (a compile, a dispatched step) on its
            # own threads; tearing the interpreter down under them can crash (SIGSEGV seen after
            # a Ctrl-C during the first decode), so an interrupted process ends here.
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            os._exit(EXIT_INTERRUPTED)
        return rc
    finally:
        interrupt.finish(process)
        if not process:  # called in-process: the caller's stderr comes back
            sys.stderr = stderr


def _main(argv: list, interrupt) -> int:
    try:
        if not _check_std_streams():
            _say("error: standard output is closed or not writable (>&-): there is nowhere to write the result")
            return EXIT_OUTPUT
        for k, a in enumerate(argv):
            try:
                a.encode("utf-8")
            except UnicodeEncodeError:
                raise UsageError(f"command-line argument {k + 1} ({ascii(a)}) is not valid UTF-8") from None
        rc = _run(argv, interrupt)
        interrupt.check()
        return rc
    except KeyboardInterrupt:
        return interrupt.report()
    except _ParserExit as e:  # --help, printed into stdout's buffer
        try:
            _write_out("")
        except BrokenPipeError:
            _point_at_devnull(1)
            return EXIT_BROKEN_PIPE
        except OutputError as oe:
            _point_at_devnull(1)
            _say(f"error: {oe}")
            return EXIT_OUTPUT
        return e.status
    except BrokenPipeError:
        # stdout was closed early: point it at /dev/null so the exit-time flush does not fail again
        _point_at_devnull(1)
        if interrupt.seen:
            return interrupt.report()
        _say("error: output closed early (broken pipe); stopped")
        return EXIT_BROKEN_PIPE
    except OutputError as e:
        _point_at_devnull(1)  # what is left in stdout's buffer would fail again at exit
        if interrupt.seen:
            return interrupt.report()
        _say(f"error: {e}")
        return EXIT_OUTPUT
    except Exception as e:
        if interrupt.seen:  # the Ctrl-C came back as another exception (a library or XLA callback wrapped it)
            return interrupt.report()
        return _report_error(e)


def _report_error(e: Exception) -> int:
    from .ops import BackendUnavailable
    from .settings import Settings

    if isinstance(e, (UsageError, ValueError, TypeError, OverflowError, BackendUnavailable, OSError,
                      RuntimeError, MemoryError)):
        _say(f"error: {e}")
        return EXIT_BAD_REQUEST
    try:  # anything else is a bug: still one line, with what to report
        show = Settings.resolve().traceback
    except ValueError:
        show = False
    if show:
        raise e
    _say(f"error: internal error {type(e).__name__}: {e} (please report it; BARO_TRACEBACK=1 shows the traceback)")
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
