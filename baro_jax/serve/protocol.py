"""The requests the server takes: OpenAI's fields read and checked by hand, into plain objects.

Every refusal is an ApiError whose message names the field and what is wrong with it, so that a
client sees `max_tokens must be an integer >= 0, got str '5'` rather than a schema dump. Fields
this server does not know are refused by name (a typo must not pass as a default), and OpenAI
fields it cannot honour are refused as such, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

from ..sampling import SEED_RANGE, Sampling

# Extensions beside OpenAI's fields, as vLLM and SGLang name them where they have one.
EXTENSIONS = ("top_k", "stop_token_ids", "ignore_eos", "return_tokens_as_token_ids")


class ApiError(Exception):
    """A request refused: HTTP status, OpenAI's error type, the message, the field (param)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclasses.dataclass
class Limits:
    """What the server was started with; the bounds a request is checked against."""
    model: str               # the name clients give as `model`
    vocab: int
    max_context: int         # positions per sequence: prompt plus new tokens
    max_logprobs: int        # the most top logprobs a request may ask
    max_stop_ids: int        # stop_token_ids a request may give
    max_prompts: int         # sequences one request may carry (prompts x n: each takes a slot)


@dataclasses.dataclass
class Prompt:
    ids: list
    text: str | None         # the prompt as the client gave it, when it was text


@dataclasses.dataclass
class GenRequest:
    """A checked completions or chat request."""
    chat: bool
    prompts: list            # of Prompt; n choices each
    n: int                   # choices per prompt: choice i * n + j is prompt i's sample j (seed + j)
    max_tokens: int | None   # None: as many as the context leaves (chat's default)
    sampling: Sampling
    seed: int | None         # the seed drawn with (sampled requests; None for greedy)
    stop: tuple
    stop_ids: frozenset
    logprobs: int | None     # None: none; k: the chosen token's and the k most likely
    echo: bool
    stream: bool
    include_usage: bool
    ignore_eos: bool
    ids_as_tokens: bool      # token strings as "token_id:N" (unique, unlike decoded bytes)


def kind_of(v) -> str:
    return "null" if v is None else type(v).__name__


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _get(body: dict, name: str, default, ok, want: str):
    """body[name] when it is there and ok(value); default when absent or null; else a 400 saying
    what was wanted and what came."""
    v = body.get(name)
    if v is None:
        return default
    if not ok(v):
        raise bad(f"{name} must be {want}, got {kind_of(v)} {_show(v)}", name)
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(body: dict, name: str, default=None, *, lo: int | None = None, hi: int | None = None):
    v = _get(body, name, None, _is_int, "an integer")
    if v is None:
        return default
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise bad(f"{name} must be {rng}, got {v}", name)
    return v


def number(body: dict, name: str, default=None):
    v = _get(body, name, None, lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v),
             "a finite number")
    return default if v is None else float(v)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    return _get(body, name, default, lambda v: isinstance(v, bool), "true or false")


def string(body: dict, name: str, default=None):
    return _get(body, name, default, lambda v: isinstance(v, str), "a string")


def token_ids(v, name: str, vocab: int) -> list:
    """A list of token ids in [0, vocab)."""
    if not isinstance(v, list):
        raise bad(f"{name} must be a list of token ids, got {kind_of(v)}", name)
    for i, t in enumerate(v):
        if not _is_int(t):
            raise bad(f"{name}[{i}] must be an integer token id, got {kind_of(t)} {_show(t)}", name)
        if not 0 <= t < vocab:
            raise bad(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})", name)
    return v


def check_fields(body, known: tuple, what: str):
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {kind_of(body)}")
    unknown = sorted(set(body) - set(known))
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        raise bad(f"unknown field{'s' if len(unknown) > 1 else ''} {names} for {what} (this server takes: "
                  f"{', '.join(sorted(known))})", unknown[0])


def check_model(body: dict, limits: Limits):
    m = string(body, "model")
    if m is not None and m != limits.model:
        raise ApiError(404, f"the model {m!r} does not exist; this server serves {limits.model!r}",
                       type="not_found_error", param="model", code="model_not_found")


# OpenAI fields accepted only at their neutral value: the engine has no penalties, no bias, and
# keeps every sample it draws (no best_of).
NEUTRAL = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": None,
           "tools": None, "tool_choice": None, "response_format": None, "parallel_tool_calls": None}


def check_neutral(body: dict, names):
    for name in names:
        v = body.get(name)
        if v is None or v == NEUTRAL[name] or (name == "response_format" and v == {"type": "text"}):
            continue
        raise bad(f"{name} {_show(v)} is not supported by this server (only {_show(NEUTRAL[name])})", name)


COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "n",
          "presence_penalty", "frequency_penalty", "logit_bias") + EXTENSIONS
COMPLETION_FIELDS = COMMON + ("prompt", "logprobs", "echo", "best_of", "suffix")
CHAT_FIELDS = COMMON + ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                        "response_format", "parallel_tool_calls")


def _n(body: dict, prompts: list, limits: Limits) -> int:
    """n: choices per prompt, every one a sequence of its own (a slot), so prompts x n is bounded
    as a prompt list is."""
    n = integer(body, "n", 1, lo=1, hi=limits.max_prompts)
    if len(prompts) * n > limits.max_prompts:
        raise bad(f"{len(prompts)} prompts x n {n} = {len(prompts) * n} sequences; at most {limits.max_prompts} in "
                  "one request", "n")
    return n


def _sampling(body: dict, limits: Limits, n: int = 1):
    """(Sampling, the seed drawn with or None). OpenAI's default temperature is 1. With
    temperature 0 decoding is greedy and top_p / top_k filter nothing, so they are left out (the
    engine refuses them together, the API's clients send them together). Without a seed a sampled
    request draws one, which the response reports, so any answer can be reproduced. Choice j of a
    prompt draws with seed + j, which must stay in the seed range (a drawn seed leaves room)."""
    t = number(body, "temperature", 1.0)
    if t < 0:
        raise bad(f"temperature must be >= 0, got {t}", "temperature")
    top_p = number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = integer(body, "top_k", 0, lo=-1, hi=limits.vocab)
    seed = integer(body, "seed", None, lo=SEED_RANGE[0], hi=SEED_RANGE[1])
    if t == 0.0:
        return Sampling(), None
    if seed is None:
        seed = secrets.randbelow(SEED_RANGE[1] - n + 2)
    if seed + n - 1 > SEED_RANGE[1]:
        raise bad(f"choice j draws with seed + j, and seed {seed} + {n - 1} (n {n}) is past the largest seed "
                  f"{SEED_RANGE[1]}", "seed")
    return Sampling(temperature=t, top_k=max(top_k, 0), top_p=top_p, seed=seed), seed


def _stops(body: dict, limits: Limits):
    v = body.get("stop")
    if v is None:
        stop = ()
    elif isinstance(v, str):
        stop = (v,)
    elif isinstance(v, list) and all(isinstance(s, str) for s in v):
        stop = tuple(v)
    else:
        raise bad(f"stop must be a string or a list of strings, got {kind_of(v)} {_show(v)}", "stop")
    if any(not s for s in stop):
        raise bad("stop strings must not be empty", "stop")
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else token_ids(ids, "stop_token_ids", limits.vocab)
    if len(ids) > limits.max_stop_ids:
        raise bad(f"stop_token_ids has {len(ids)} ids; at most {limits.max_stop_ids}", "stop_token_ids")
    return stop, frozenset(ids)


def _stream(body: dict):
    stream = boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad(f"stream_options must be an object with include_usage, got {_show(opts)}", "stream_options")
    return stream, boolean(opts, "include_usage")


def _max_tokens(body: dict, name: str, default, limits: Limits):
    return integer(body, name, default, lo=0, hi=limits.max_context)


def check_fits(prompts: list, max_tokens: int | None, limits: Limits):
    for i, p in enumerate(prompts):
        which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        if not p.ids:
            raise bad(f"{which} is empty: give at least one token", "prompt")
        n = len(p.ids) + (max_tokens or 0)
        if n > limits.max_context:
            raise bad(f"{which} has {len(p.ids)} tokens; with max_tokens {max_tokens or 0} it needs {n} positions, "
                      f"more than this server's max_context of {limits.max_context} (--max-context)",
                      "max_tokens" if max_tokens and len(p.ids) <= limits.max_context else "prompt")


def parse_completion(body, limits: Limits, encode) -> GenRequest:
    """A /v1/completions body; encode(text) -> ids."""
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    check_model(body, limits)
    check_neutral(body, ("best_of", "presence_penalty", "frequency_penalty", "logit_bias", "suffix"))
    if "prompt" not in body:
        raise bad("prompt is required: a string, a list of token ids, or a list of either", "prompt")
    prompts = _prompts(body["prompt"], limits, encode)
    n = _n(body, prompts, limits)
    max_tokens = _max_tokens(body, "max_tokens", 16, limits)
    check_fits(prompts, max_tokens, limits)
    sampling, seed = _sampling(body, limits, n)
    stop, stop_ids = _stops(body, limits)
    stream, usage = _stream(body)
    return GenRequest(chat=False, prompts=prompts, n=n, max_tokens=max_tokens, sampling=sampling, seed=seed, stop=stop,
                      stop_ids=stop_ids, logprobs=integer(body, "logprobs", None, lo=0, hi=limits.max_logprobs),
                      echo=boolean(body, "echo"), stream=stream, include_usage=usage,
                      ignore_eos=boolean(body, "ignore_eos"),
                      ids_as_tokens=boolean(body, "return_tokens_as_token_ids"))


def _prompts(v, limits: Limits, encode) -> list:
    """prompt: a string, a list of ids, or a non-empty list of strings or of id lists."""
    def one(x, name):
        if isinstance(x, str):
            return Prompt(encode(x), x)
        return Prompt(token_ids(x, name, limits.vocab), None)

    if isinstance(v, str):
        return [one(v, "prompt")]
    if not isinstance(v, list) or not v:
        raise bad(f"prompt must be a string, a list of token ids, or a non-empty list of either; got "
                  f"{kind_of(v) if v != [] else 'an empty list'}", "prompt")
    if all(_is_int(x) for x in v):
        return [one(v, "prompt")]
    if not all(isinstance(x, (str, list)) for x in v):
        bad_one = next(x for x in v if not isinstance(x, (str, list)))
        raise bad(f"prompt must be a string, a list of token ids, or a list of strings or of token-id lists; "
                  f"it holds {kind_of(bad_one)} {_show(bad_one)}", "prompt")
    if len(v) > limits.max_prompts:
        raise bad(f"prompt lists {len(v)} prompts; at most {limits.max_prompts} in one request", "prompt")
    return [one(x, f"prompt[{i}]") for i, x in enumerate(v)]


def messages(v) -> list:
    """Chat messages as the template takes them: role and content strings (text parts joined)."""
    if not isinstance(v, list) or not v:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content, got {kind_of(m)}", "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"messages[{i}] has unknown field {extra[0]!r} (this server takes role, content, name)",
                      "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}].role must be one of system, developer, user, assistant; got {_show(role)}",
                      "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content[{j}] must be a text part {{type: 'text', text: ...}} (this "
                              "server takes text only)", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts, got {kind_of(content)}",
                      "messages")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body, limits: Limits, render) -> GenRequest:
    """A /v1/chat/completions body; render(messages) -> ids through the chat template."""
    check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    check_model(body, limits)
    check_neutral(body, ("presence_penalty", "frequency_penalty", "logit_bias", "tools", "tool_choice",
                         "response_format", "parallel_tool_calls"))
    if "messages" not in body:
        raise bad("messages is required", "messages")
    msgs = messages(body["messages"])
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("give max_tokens or max_completion_tokens, not both", "max_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name, None, limits)
    prompts = [Prompt(render(msgs), None)]
    n = _n(body, prompts, limits)
    check_fits(prompts, max_tokens, limits)
    if max_tokens is None:
        max_tokens = limits.max_context - len(prompts[0].ids)
    sampling, seed = _sampling(body, limits, n)
    stop, stop_ids = _stops(body, limits)
    stream, usage = _stream(body)
    want = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", None, lo=0, hi=limits.max_logprobs)
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return GenRequest(chat=True, prompts=prompts, n=n, max_tokens=max_tokens, sampling=sampling, seed=seed, stop=stop,
                      stop_ids=stop_ids, logprobs=(top or 0) if want else None, echo=False, stream=stream,
                      include_usage=usage, ignore_eos=boolean(body, "ignore_eos"),
                      ids_as_tokens=boolean(body, "return_tokens_as_token_ids"))


def parse_tokenize(body, limits: Limits, encode, render) -> list:
    """/tokenize: {"prompt": text or ids} or {"messages": [...]} (through the chat template)."""
    check_fields(body, ("model", "prompt", "messages"), "/tokenize")
    check_model(body, limits)
    if ("prompt" in body) == ("messages" in body):
        raise bad("give prompt (a string) or messages (a chat), one of them", "prompt")
    if "messages" in body:
        return render(messages(body["messages"]))
    p = body["prompt"]
    if not isinstance(p, str):
        raise bad(f"prompt must be a string, got {kind_of(p)}", "prompt")
    return encode(p)


def parse_detokenize(body, limits: Limits) -> list:
    check_fields(body, ("model", "tokens"), "/detokenize")
    check_model(body, limits)
    if "tokens" not in body:
        raise bad("tokens is required: a list of token ids", "tokens")
    return token_ids(body["tokens"], "tokens", limits.vocab)
