"""The HTTP front end: Starlette routes over the engine loop.

Each generation request becomes one job per prompt, submitted to the engine loop all at once
(or refused with 503 and Retry-After when the queue is full); the handler then waits on an
asyncio queue that the engine thread feeds. A client that goes away, streaming or not, has its
jobs cancelled, which frees their slots at the next round.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..batch import sample_seeds
from ..tokenizer import NoChatTemplate, TokenizerError, render_chat
from . import protocol, render
from .loop import EngineLoop, Job, Overloaded, ShuttingDown
from .protocol import ApiError, bad

RETRY_AFTER_S = 1


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(render.dumps(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(e: ApiError) -> Response:
    return json_response(e.body(), e.status, e.headers)


class JobStream(StreamingResponse):
    """A stream whose jobs are cancelled however it ends: done, failed, or cut by the client
    (Starlette cancels the body's task then, which may be before the body ever ran)."""

    def __init__(self, body, on_close, **kw):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Api:
    def __init__(self, engine, loop: EngineLoop, limits: protocol.Limits, max_body_bytes: int):
        self.engine, self.loop, self.limits, self.max_body = engine, loop, limits, max_body_bytes
        self.tok = engine.tokenizer

    # --- reading a request ---------------------------------------------------------------------
    async def body(self, request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise self._too_long(int(size))
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > self.max_body:
                raise self._too_long(len(buf))
        if not buf.strip():
            raise bad("the request body is empty: send a JSON object")
        try:
            return json.loads(bytes(buf), parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise bad(f"malformed JSON in the request body: {e.msg} at line {e.lineno} column {e.colno}") from None
        except UnicodeDecodeError as e:
            raise bad(f"the request body is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except ValueError as e:
            raise bad(f"malformed JSON in the request body: {e}") from None

    def _too_long(self, n: int) -> ApiError:
        return ApiError(413, f"the request body of {n} bytes is over this server's limit of {self.max_body} bytes "
                             "(--max-body-mb)", code="request_too_large")

    def encode(self, text: str) -> list:
        return self.tok.encode(text)

    def render_chat(self, messages) -> list:
        try:
            return self.tok.encode(render_chat(self.tok, messages))
        except NoChatTemplate as e:
            raise bad(f"this model has no chat template, so /v1/chat/completions cannot format messages: {e}; "
                      "use /v1/completions with the prompt as text", "messages") from None
        except TokenizerError as e:
            raise bad(str(e), "messages") from None

    # --- endpoints -------------------------------------------------------------------------------
    async def models(self, request):
        return json_response({"object": "list", "data": [
            {"id": self.limits.model, "object": "model", "created": 0, "owned_by": "baro_jax",
             "max_model_len": self.limits.max_context}]})

    async def health(self, request):
        h = self.loop.health()
        ok = h["alive"]
        return json_response({"status": "ok" if ok else "engine loop stopped", "model": self.limits.model, **h},
                             200 if ok else 503)

    async def tokenize(self, request):
        ids = protocol.parse_tokenize(await self.body(request), self.limits, self.encode, self.render_chat)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": self.limits.max_context})

    async def detokenize(self, request):
        ids = protocol.parse_detokenize(await self.body(request), self.limits)
        return json_response({"prompt": self.tok.decode(ids)})

    async def completions(self, request):
        req = protocol.parse_completion(await self.body(request), self.limits, self.encode)
        return await self.generate(request, req)

    async def chat(self, request):
        req = protocol.parse_chat(await self.body(request), self.limits, self.render_chat)
        return await self.generate(request, req)

    # --- generation ------------------------------------------------------------------------------
    async def generate(self, request: Request, req: protocol.GenRequest):
        aio = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(ev):
            aio.call_soon_threadsafe(events.put_nowait, ev)

        eos = frozenset() if req.ignore_eos else self.engine.eos_ids
        echo_lp = req.echo and req.logprobs is not None
        samplings = sample_seeds(req.sampling, req.n, "n")
        jobs = []
        for p in req.prompts:  # choice i * n + j: prompt i's sample j, which copies sample 0's prompt state
            first = None
            for sp in samplings:
                seq = self.loop.new_sequence(prompt_ids=p.ids, max_new_tokens=req.max_tokens, sampling=sp,
                                             stop_ids=req.stop_ids, stop_strings=req.stop, eos_ids=eos,
                                             want_prompt_logprobs=echo_lp, prompt_top_n=req.logprobs if echo_lp else 0,
                                             fork_of=first)
                if first is None:
                    first = seq
                jobs.append(Job(seq, len(jobs), sink))
        try:
            self.loop.submit(jobs)
        except (Overloaded, ShuttingDown) as e:
            raise ApiError(503, str(e), type="server_error", code="overloaded" if isinstance(e, Overloaded) else
                           "shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        run = Run(self, req, jobs, events)
        if req.stream:
            return JobStream(run.stream(), run.close)
        watcher = asyncio.ensure_future(_disconnected(request, events))
        try:
            return await run.collect()
        finally:
            watcher.cancel()
            run.close()


class Run:
    """One request's jobs on their way: the events gathered into choices, as one body or as a
    stream of chunks."""

    def __init__(self, api: Api, req: protocol.GenRequest, jobs: list, events: asyncio.Queue):
        self.api, self.req, self.jobs, self.events = api, req, jobs, events
        self.choices = [render.Choice(i * req.n + j, p.ids, p.text) for i, p in enumerate(req.prompts)
                        for j in range(req.n)]
        self.texts = [render.TextStream(api.tok, req.stop) for _ in self.choices]
        self.r = render.Renderer(api.tok, req.ids_as_tokens, req.logprobs)
        self.open = len(jobs)
        self.kind = "chat.completion" if req.chat else "text_completion"
        self.rid = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def close(self):
        if self.open:
            self.open = 0
            self.api.loop.cancel(self.jobs)

    def prompt_text(self, c: render.Choice) -> str:
        return c.prompt_text if c.prompt_text is not None else self.api.tok.decode(c.prompt_ids)

    def _apply(self, ev) -> tuple:
        """Fold an event into its choice; (kind, choice, new ids, their logprobs, tops)."""
        kind, job = ev[0], ev[1]
        c = self.choices[job.choice]
        if kind == "tokens":
            _, _, ids, lps, tops = ev
            c.ids += ids
            c.logprobs += lps
            if tops:
                c.tops += tops
            return kind, c, ids, lps, tops
        if kind == "prompt":
            c.prompt_logprobs, c.prompt_tops = job.seq.prompt_logprobs, job.seq.prompt_top_logprobs
        elif kind == "done":
            c.finish_reason = ev[2]
            self.open -= 1
        elif kind == "error":
            self.open -= 1
            raise ApiError(ev[3], ev[2], type="server_error" if ev[3] >= 500 else "invalid_request_error")
        return kind, c, None, None, None

    async def collect(self) -> Response:
        while self.open:
            ev = await self.events.get()
            if ev[0] == "disconnect":
                return Response(status_code=499)  # nobody reads it; the jobs are cancelled on the way out
            self._apply(ev)
        out = render.head(self.kind, self.rid, self.created, self.api.limits.model, self.req.seed)
        choices = []
        for c, ts in zip(self.choices, self.texts):
            text = ts.feed(c.ids) + ts.finish(c.finish_reason)
            choices.append(render.chat_choice(c, text, self.r) if self.req.chat else
                           render.completion_choice(c, text, self.r, self.req.echo, self.prompt_text(c)))
        out["choices"] = choices
        out["usage"] = render.usage(self.choices)
        return json_response(out)

    def _chunk(self, choice: dict) -> str:
        out = render.head(self.kind + ".chunk" if self.req.chat else self.kind, self.rid, self.created,
                          self.api.limits.model, self.req.seed)
        out["choices"] = [choice]
        if self.req.include_usage:
            out["usage"] = None
        return render.sse(out)

    async def stream(self):
        try:
            for c in self.choices:
                if self.req.chat:
                    yield self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None, "prompt_token_ids": c.prompt_ids})
                elif self.req.echo and self.req.logprobs is None:
                    yield self._chunk(self._text_chunk(c, self.prompt_text(c), [], [], None, prompt=True))
            while self.open:
                ev = await self.events.get()
                kind, c, ids, lps, tops = self._apply(ev)
                if kind == "prompt" and not self.req.chat:
                    yield self._chunk(self._text_chunk(c, self.prompt_text(c), c.prompt_ids, c.prompt_logprobs,
                                                       c.prompt_tops, prompt=True))
                elif kind == "tokens":
                    text = self.texts[c.index].feed(ids)
                    yield self._chunk(self._piece(c, text, ids, lps, tops, None))
                elif kind == "done":
                    text = self.texts[c.index].finish(c.finish_reason)
                    yield self._chunk(self._piece(c, text, [], [], None, render.FINISH.get(c.finish_reason)))
            if self.req.include_usage:
                out = render.head(self.kind + ".chunk" if self.req.chat else self.kind, self.rid, self.created,
                                  self.api.limits.model, self.req.seed)
                out["choices"] = []
                out["usage"] = render.usage(self.choices)
                yield render.sse(out)
        except ApiError as e:
            yield render.sse(e.body())
        yield render.sse("[DONE]")

    def _offset(self, c: render.Choice) -> int:
        return (len(self.prompt_text(c)) if self.req.echo else 0) + self.texts[c.index].sent

    def _text_chunk(self, c, text, ids, lps, tops, prompt=False) -> dict:
        lp = None
        if self.req.logprobs is not None:
            lp = self.r.completion_logprobs(ids, lps, tops, 0 if prompt else self._offset(c) - len(text))
        out = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}
        out["prompt_token_ids" if prompt else "token_ids"] = c.prompt_ids if prompt else ids
        return out

    def _piece(self, c, text, ids, lps, tops, finish) -> dict:
        if not self.req.chat:
            out = self._text_chunk(c, text, ids, lps, tops)
            out["finish_reason"] = finish
            return out
        lp = self.r.chat_logprobs(ids, lps, tops) if self.req.logprobs is not None and ids else None
        return {"index": c.index, "delta": {"content": text} if text or not finish else {}, "logprobs": lp,
                "finish_reason": finish, "token_ids": ids}


async def _disconnected(request: Request, events: asyncio.Queue):
    """Put ("disconnect",) on the events when the client goes away (the body is read by now, so the
    next message from the server is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            events.put_nowait(("disconnect",))
            return


def _no_constant(name):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def build_app(engine, loop: EngineLoop, limits: protocol.Limits, *, max_body_bytes: int) -> Starlette:
    api = Api(engine, loop, limits, max_body_bytes)

    def route(path, fn, method):
        async def handle(request):
            try:
                return await fn(request)
            except ApiError as e:
                return error_response(e)
            except Exception as e:  # a bug: say so in OpenAI's shape, keep serving
                traceback.print_exc(file=sys.stderr)
                return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        return Route(path, handle, methods=[method])

    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = {404: f"no such endpoint: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, msg, type=kind, headers=dict(exc.headers or {})))

    routes = [route("/v1/models", api.models, "GET"), route("/health", api.health, "GET"),
              route("/v1/completions", api.completions, "POST"), route("/v1/chat/completions", api.chat, "POST"),
              route("/tokenize", api.tokenize, "POST"), route("/detokenize", api.detokenize, "POST")]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.api = api
    return app
