"""What the Engine's calls return."""
from __future__ import annotations

import dataclasses

import numpy as np
import jax

from . import checks


@dataclasses.dataclass
class PrefillResult:
    """What Engine.prefill returns: the last prompt position's logits, the state after the prompt
    (ready to decode from position n_tokens), and how long it took."""
    logits: jax.Array  # [V] fp32, last prompt position
    state: tuple
    seconds: float
    n_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclasses.dataclass
class GenerateResult:
    """What Engine.generate returns.

    prompt_ids / generated_ids: the token ids in and out; text: the generated ids decoded.
    prefill_seconds, prefill_tokens_per_s: the prompt's prefill; decode_tokens_per_s: the steady
    decode rate (the steps after the first decode call, which may compile). model, backend,
    variant, mode, prefill_mode, chunk: what produced it. expert_cache: tier mode's decode expert
    cache over this request (None in resident mode). last_prompt_logits: the logits [V] fp32 the
    first token was chosen from; state: the state after the last token (keep_state=True only)."""
    prompt_ids: list
    generated_ids: list
    text: str
    prefill_seconds: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    model: str
    backend: str
    prefill_mode: str
    chunk: int | None
    mode: str = "resident"
    variant: str | None = None
    expert_cache: dict | None = None
    last_prompt_logits: np.ndarray = dataclasses.field(repr=False, default=None)
    state: tuple = dataclasses.field(repr=False, default=None)
    # logprobs: the chosen token's log-probability at each generated position (float32; None when
    # not asked); top_logprobs: per position (ids, values) of the k most likely (logprobs=k);
    # prompt_logprobs: each prompt token's log-probability given the tokens before it (the first
    # is None); finish_reason: "length", "eos" or "stop"
    logprobs: list | None = None
    top_logprobs: list | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None

    def to_json(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids, "generated_ids": self.generated_ids, "text": self.text,
            "prefill_seconds": self.prefill_seconds, "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s, "model": self.model, "backend": self.backend,
            "prefill_mode": self.prefill_mode, "chunk": self.chunk, "mode": self.mode, "variant": self.variant,
            "expert_cache": self.expert_cache, "finish_reason": self.finish_reason,
            "logprobs": None if self.logprobs is None else [float(x) for x in self.logprobs],
            "top_logprobs": None if self.top_logprobs is None else [
                {"ids": ids, "logprobs": [float(x) for x in vals]} for ids, vals in self.top_logprobs],
            "prompt_logprobs": None if self.prompt_logprobs is None else [
                None if x is None else float(x) for x in self.prompt_logprobs],
        }


def check_logprobs(logprobs, vocab: int, allow_none: bool = False):
    if logprobs is None and allow_none:
        return None
    k = checks.as_int("logprobs", logprobs, lo=0)
    if k > vocab:
        raise ValueError(f"logprobs {k} is more than the vocabulary of {vocab}")
    return k
