"""A server over a loaded Engine: the engine loop, the app and uvicorn, started and stopped together.

Server(engine, ...).serve() blocks (the command line's way: uvicorn takes SIGINT and SIGTERM,
stops accepting, lets running responses finish for up to shutdown_timeout seconds, then cancels
them); start() runs it on a thread and returns the URL (tests, benchmarks, notebooks).
"""
from __future__ import annotations

import socket
import threading
import time

from ..batch import DEFAULT_BATCH_CHUNK
from .app import build_app
from .loop import EngineLoop
from .protocol import Limits

# prefill_budget: four chunks a round. On the H200, 64 clients each sending a 1k prompt at once
# waited 11.9 s (p50) for a first token with one 256-row chunk a round, each round also a decode
# step of the running sequences (serve_h200.json, 6eb5b4e's kernels).
DEFAULTS = dict(max_batch=64, max_queue=256, chunk=DEFAULT_BATCH_CHUNK, prefill_budget=4 * DEFAULT_BATCH_CHUNK,
                max_logprobs=20, max_stop_ids=16, max_body_bytes=16 << 20, shutdown_timeout=30.0)


class Server:
    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 max_batch: int = DEFAULTS["max_batch"], max_queue: int = DEFAULTS["max_queue"],
                 chunk: int = DEFAULTS["chunk"], prefill_budget: int = DEFAULTS["prefill_budget"],
                 max_logprobs: int = DEFAULTS["max_logprobs"],
                 max_stop_ids: int = DEFAULTS["max_stop_ids"], max_body_bytes: int = DEFAULTS["max_body_bytes"],
                 shutdown_timeout: float = DEFAULTS["shutdown_timeout"], log_level: str = "warning"):
        import uvicorn

        self.engine = engine
        self.loop = EngineLoop(engine, max_batch=max_batch, max_queue=max_queue, chunk=chunk,
                               prefill_budget=prefill_budget,
                               max_logprobs=min(max_logprobs, engine.cfg.vocab_size), max_stop_ids=max_stop_ids)
        self.limits = Limits(model=model_name or engine.name, vocab=engine.cfg.vocab_size,
                             max_context=self.loop.length, max_logprobs=min(max_logprobs, engine.cfg.vocab_size),
                             max_stop_ids=max_stop_ids, max_prompts=self.loop.capacity)
        self.app = build_app(engine, self.loop, self.limits, max_body_bytes=max_body_bytes)
        self.host, self.port = host, port
        self.shutdown_timeout = shutdown_timeout
        self.uv = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level, lifespan="off",
                                                timeout_graceful_shutdown=shutdown_timeout, access_log=False))
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve(self, sock: socket.socket | None = None):
        """Run until uvicorn is told to stop (a signal, or stop()); then end the engine loop."""
        self.loop.start()
        try:
            self.uv.run(sockets=[sock] if sock is not None else None)
        finally:
            self.loop.stop(timeout=self.shutdown_timeout)

    def bind(self) -> socket.socket:
        """The listening socket, bound now (port 0: a free one, which self.port then names)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(2048)  # clients may connect (into the backlog) before uvicorn accepts
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        return sock

    def start(self, timeout: float = 60.0) -> str:
        """Serve on a thread; returns the URL once it accepts connections."""
        self._thread = threading.Thread(target=self.serve, args=(self.bind(),), name="baro-serve", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.uv.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout: float | None = None):
        self.uv.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
