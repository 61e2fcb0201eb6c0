"""python -m baro_jax.serve: an OpenAI-compatible HTTP server over the many-sequence engine.

Exit status: 0 stopped by SIGINT or SIGTERM (running responses are let finish for up to
--shutdown-timeout seconds); 2 a bad command line, or a model or pool that cannot be served (one
line on stderr); 130 interrupted while loading; 1 an internal error.
"""
from __future__ import annotations

import signal
import sys

EXIT_BAD_REQUEST = 2
EXIT_INTERRUPTED = 130
DEFAULT_MAX_CONTEXT = 8192  # without --max-context: the model's, at most this (every slot holds that many positions)


class UsageError(Exception):
    pass


def _parser():
    import argparse

    from ..generate import setting_help
    from ..settings import BACKENDS, DTYPES, ENGINE_MODES
    from .server import DEFAULTS

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UsageError(f"{message} (python -m baro_jax.serve --help lists the flags)")

    p = Parser(prog="python -m baro_jax.serve", description=__doc__.split("\n\n")[0], allow_abbrev=False,
               epilog=__doc__.split("\n\n", 1)[1].replace("\n", " ").strip())
    p.add_argument("--model", default="tiny", metavar="DIR|NAME",
                   help="a checkpoint directory, tiny (the embedded demo model) or a preset (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name clients give as `model` (default: the --model argument)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"], metavar="N",
                   help="sequence slots: sequences decoded together; the device budget must hold them at "
                        "--max-context positions each (default: %(default)s)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help=f"positions per sequence, prompt plus new tokens (default: the model's, at most "
                        f"{DEFAULT_MAX_CONTEXT})")
    p.add_argument("--max-queue", type=int, default=DEFAULTS["max_queue"], metavar="N",
                   help="sequences that may wait for a slot; past that a request gets 503 and Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--max-logprobs", type=int, default=DEFAULTS["max_logprobs"], metavar="K",
                   help="the most top logprobs a request may ask; each decode step computes this many "
                        "(default: %(default)s)")
    p.add_argument("--chunk", type=int, default=DEFAULTS["chunk"], metavar="N",
                   help="prefill rows per step, the token budget of a prompt's chunk (default: %(default)s)")
    p.add_argument("--prefill-budget", type=int, default=DEFAULTS["prefill_budget"], metavar="N",
                   help="prompt rows prefilled per round, in whole chunks, before the running sequences' next "
                        "decode step: more gives first tokens sooner when many prompts arrive together, and "
                        "the running ones' next token later (default: %(default)s)")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every step graph of the pool before listening (each decode row bucket, with and "
                        "without a prefill chunk beside it, its blocks greedy and sampled): no request then waits on "
                        "a compilation, at the price of a longer start")
    p.add_argument("--warm-up-threads", type=int, default=None, metavar="N",
                   help="host threads --warm-up compiles the graphs on, side by side (default: the host's cores, "
                        "at most 16)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULTS["max_body_bytes"] / 2**20, metavar="MB",
                   help="the largest request body, in MiB (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULTS["shutdown_timeout"], metavar="S",
                   help="on SIGINT / SIGTERM, seconds running responses may take to finish (default: %(default)s)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS + ("auto",), default=None, help=setting_help("backend"))
    p.add_argument("--dtype", choices=DTYPES, default=None, help=setting_help("dtype"))
    p.add_argument("--mode", choices=ENGINE_MODES, default=None, help=setting_help("mode"))
    p.add_argument("--device-budget-gb", type=float, default=None, metavar="GIB",
                   help=setting_help("device_budget_gb"))
    p.add_argument("--devices", type=int, default=None, metavar="N", help=setting_help("devices"))
    p.add_argument("--allow-nonfinite", action="store_true", default=None, help=setting_help("allow_nonfinite"))
    p.add_argument("--seed", type=int, default=0, metavar="N", help="a preset's synthetic weights (default: 0)")
    return p


def _check(args):
    for name in ("max_batch", "max_logprobs", "chunk", "prefill_budget"):
        if getattr(args, name) < (0 if name == "max_logprobs" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be >= {0 if name == 'max_logprobs' else 1}, "
                             f"got {getattr(args, name)}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not args.max_body_mb > 0:
        raise UsageError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if not args.shutdown_timeout >= 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.warm_up_threads is not None and args.warm_up_threads < 1:
        raise UsageError(f"--warm-up-threads must be >= 1, got {args.warm_up_threads}")
    if args.warm_up_threads is not None and not args.warm_up:
        raise UsageError("--warm-up-threads is for --warm-up: give both, or neither")


def _settings(args):
    from ..generate import model_config
    from ..settings import Settings

    settings = Settings.resolve(backend=args.backend, dtype=args.dtype, max_context=args.max_context, mode=args.mode,
                                device_budget_gb=args.device_budget_gb, devices=args.devices,
                                allow_nonfinite=args.allow_nonfinite)
    if args.max_context is None:
        cfg = model_config(args.model, settings)
        if cfg is not None and cfg.max_context > DEFAULT_MAX_CONTEXT:
            settings = settings.replace(max_context=DEFAULT_MAX_CONTEXT)
    return settings


def _run(argv) -> int:
    args = _parser().parse_args(argv)
    _check(args)
    settings = _settings(args)
    from .. import loading
    from .server import Server

    eng = loading.load(args.model, settings=settings, seed=args.seed, progress=True)
    server = Server(eng, host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                    max_batch=args.max_batch, max_queue=args.max_queue, chunk=args.chunk,
                    prefill_budget=args.prefill_budget,
                    max_logprobs=args.max_logprobs, max_body_bytes=int(args.max_body_mb * 2**20),
                    shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
    if args.warm_up:
        from ..batch import compile_threads

        threads = compile_threads(args.warm_up_threads)
        n, seconds = server.loop.warm_up(on_graph=lambda i, total: _say(f"[baro_jax] warm-up: step graph {i}/{total}"),
                                         threads=threads)
        _say(f"[baro_jax] warm-up: {n} step graphs compiled in {seconds:.1f} s on {threads} "
             f"thread{'s' if threads > 1 else ''}")
    try:
        sock = server.bind()
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    stopped_by = []
    # uvicorn takes SIGINT / SIGTERM while it runs and raises the signal again once it has shut
    # down; these handlers receive it then, so a clean shutdown ends with status 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: stopped_by.append(signal.Signals(s).name))
    run = server.loop.run
    _say(f"[baro_jax] serving {server.limits.model!r} on {server.url} | {server.loop.slots} slots of up to "
         f"{server.loop.length} positions, {run.pages:,} KV pages of {run.blocks.page} ({run.pages * run.blocks.page:,} "
         f"positions in all), queue {server.loop.capacity - server.loop.slots} | backend {eng.backend} | {eng.mode}")
    server.serve(sock)
    _say(f"[baro_jax] server stopped{' (' + stopped_by[0] + ')' if stopped_by else ''}")
    return 0


def _say(line: str):
    print(line, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    from ..config import ConfigError
    from ..settings import Settings, SettingsError
    from ..tokenizer import TokenizerError

    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        _say("\nerror: interrupted (Ctrl-C)")
        return EXIT_INTERRUPTED
    except (UsageError, ConfigError, SettingsError, TokenizerError, ValueError, TypeError, MemoryError,
            OSError) as e:
        _say(f"error: {e}")
        return EXIT_BAD_REQUEST
    except ImportError as e:
        _say(f"error: the server needs the serve extra (pip install \"baro_jax[serve]\"): {e}")
        return EXIT_BAD_REQUEST
    except Exception as e:
        try:
            show = Settings.resolve().traceback
        except ValueError:
            show = False
        if show:
            raise
        _say(f"error: internal error: {type(e).__name__}: {e} (please report it; BARO_TRACEBACK=1 shows the "
             "traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
