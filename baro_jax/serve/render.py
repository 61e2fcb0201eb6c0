"""Responses in OpenAI's shapes: completion and chat bodies, their streamed chunks, logprobs.

Floats go out as the float32 values the engine computed, widened to a double (exact), which JSON
writes with repr (exact again): a client that reads a logprob back into a float32 has the
engine's bytes. Beside the text every choice carries token_ids and prompt_token_ids, which RL
clients need and which text cannot give back (a byte-level token may be half a character).
"""
from __future__ import annotations

import dataclasses
import json

from ..batch import cut_at_stop

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n"


class TextStream:
    """A choice's text as its tokens arrive, in pieces safe to send: never half a UTF-8 character,
    never text that may turn out to start a stop string. The window (two offsets) keeps the
    decoding cost per token constant. At the end the whole text is decoded once more, so what was
    sent adds up to exactly what a non-streamed response returns."""

    def __init__(self, tokenizer, stops):
        self.tok, self.stops = tokenizer, stops
        self.ids: list = []
        self.text = ""       # decoded so far (whole characters)
        self.sent = 0        # characters of text handed out
        self._prefix = self._read = 0

    def feed(self, ids) -> str:
        self.ids.extend(ids)
        before = self.tok.decode(self.ids[self._prefix:self._read])
        now = self.tok.decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._take(self._safe_end())

    def finish(self, reason: str) -> str:
        """The rest of the text: the whole decode, cut before a stop string when one ended it."""
        full = self.tok.decode(self.ids)
        self.text = cut_at_stop(full, self.stops) if reason == "stop" else full
        return self._take(len(self.text))

    def _safe_end(self) -> int:
        end = len(self.text)
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                end = min(end, i)
                continue
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):  # a stop string's start at the end
                if self.text.endswith(s[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return end

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out


@dataclasses.dataclass
class Choice:
    """What one choice gathered: the prompt's ids and logprobs, the new ids, logprobs and tops."""
    index: int
    prompt_ids: list
    prompt_text: str | None
    ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    tops: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    prompt_tops: list | None = None
    finish_reason: str | None = None


class Renderer:
    """Token strings and logprob objects for one request."""

    def __init__(self, tokenizer, ids_as_tokens: bool, k: int | None):
        self.tok, self.ids_as_tokens, self.k = tokenizer, ids_as_tokens, k

    def token(self, t: int) -> str:
        return f"token_id:{t}" if self.ids_as_tokens else self.tok.decode([t])

    def _top(self, top):
        if not self.k or top is None:
            return None
        ids, vals = top
        return list(zip(ids[:self.k], (float(v) for v in vals[:self.k])))

    def completion_logprobs(self, ids, lps, tops, offset: int) -> dict:
        """The legacy completions logprobs object; offset: text_offset of the first token. lps and
        tops may hold None (the first prompt token has no logprob)."""
        tokens = [self.token(t) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        top = [self._top(x) for x in tops] if tops is not None else [None] * len(ids)
        return {"tokens": tokens, "token_logprobs": [None if x is None else float(x) for x in lps],
                "top_logprobs": None if not self.k else [None if x is None else dict(
                    (self.token(t), v) for t, v in x) for x in top],
                "text_offset": offsets}

    def chat_logprobs(self, ids, lps, tops) -> dict:
        def entry(t, lp):
            s = self.token(t)
            return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8"))}

        content = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            e = entry(t, lp)
            top = self._top(tops[i] if tops is not None else None)
            e["top_logprobs"] = [entry(a, v) for a, v in top] if top else []
            content.append(e)
        return {"content": content}


def usage(choices) -> dict:
    p = sum(len(c.prompt_ids) for c in choices)
    n = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def head(kind: str, rid: str, created: int, model: str, seed) -> dict:
    out = {"id": rid, "object": kind, "created": created, "model": model}
    if seed is not None:
        out["seed"] = seed
    return out


def completion_choice(c: Choice, text: str, r: Renderer, echo: bool, prompt_text: str) -> dict:
    lp = None
    if r.k is not None:
        ids, lps, tops, offset = c.ids, c.logprobs, c.tops or None, len(prompt_text) if echo else 0
        if echo:
            ids = c.prompt_ids + c.ids
            lps = list(c.prompt_logprobs) + c.logprobs
            tops = (list(c.prompt_tops) + c.tops) if c.prompt_tops else None
            offset = 0
        lp = r.completion_logprobs(ids, lps, tops, offset)
    return {"index": c.index, "text": (prompt_text if echo else "") + text, "logprobs": lp,
            "finish_reason": FINISH.get(c.finish_reason, c.finish_reason),
            "prompt_token_ids": c.prompt_ids, "token_ids": c.ids}


def chat_choice(c: Choice, text: str, r: Renderer) -> dict:
    return {"index": c.index, "message": {"role": "assistant", "content": text},
            "logprobs": r.chat_logprobs(c.ids, c.logprobs, c.tops or None) if r.k is not None else None,
            "finish_reason": FINISH.get(c.finish_reason, c.finish_reason),
            "prompt_token_ids": c.prompt_ids, "token_ids": c.ids}
