"""The Engine: the API over one model and its runner.

Replay prefill is the decode step (m = 1) once per prompt token; batched prefill runs the
same forward at m = C rows per chunk, the last chunk padded. Where the weights live and how
a forward runs over them is the runner's business (runner.py: resident, tier.py, and
expert_parallel.py); the Engine checks what callers give it, loops over chunks and decode
blocks, samples, and reports. One prompt runs at a time.

One Engine may be shared by threads: its calls run one at a time (a lock). A call cut short
(Ctrl-C, an exception from a callback) leaves it usable, with the same bytes afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from typing import Callable, Sequence

import numpy as np
import jax
import jax.numpy as jnp

from . import batch, checks, variants
from .results import GenerateResult, PrefillResult, check_logprobs
from .scheduler import Sequence
from .config import Config
from .ops import BackendUnavailable, get_ops
from .runner import ResidentRunner, Runner
from .sampling import Sampler, Sampling, block_inputs, draw_row
from .logprobs import row_logprobs
from .settings import PREFILL_MODES, Settings, SettingsError
from .shapes import state_length
from .tier import TierRunner

RUNNERS = {"resident": ResidentRunner, "tier": TierRunner}


def default_backend(dtype: str = "bfloat16") -> str:
    """The product, `ordered`, when its library is built and the dtype is bf16; else `xla`.
    A library that is there but broken is an error, not a quiet fallback."""
    if dtype != "bfloat16":
        return "xla"
    try:
        get_ops("ordered")
        return "ordered"
    except BackendUnavailable as e:
        if getattr(e, "broken", False):
            raise
        return "xla"


def resolve_backend(settings: Settings) -> Settings:
    """settings with backend "auto" made concrete (a variant runs on the ordered backend)."""
    if settings.backend != "auto":
        return settings
    backend = "ordered" if settings.variant else default_backend(settings.dtype)
    return settings.replace(backend=backend)


def _serialised(method):
    """One call at a time per Engine (Engine.exclusive)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.exclusive():
            return method(self, *args, **kwargs)

    return call


class Engine:
    """A loaded model: generate text, prefill prompts, step the decoder, score continuations.

    Build one with baro_jax.load(). Engine(cfg, params, tokenizer, ...) wraps weights already in
    hand; its keywords are settings (settings.py: backend, mode, variant, delta_rule, ...), or
    give a whole `settings=Settings(...)`."""

    def __init__(self, cfg: Config, params, tokenizer, *, name: str = "model", settings: Settings | None = None,
                 runner: Runner | None = None, **setting_values):
        if settings is None:
            settings = Settings.resolve(**setting_values)
        elif setting_values:
            settings = settings.replace(**setting_values)
        settings = resolve_backend(settings)
        self.tokenizer = tokenizer
        self.name = name
        self._lock = threading.RLock()
        if runner is None:
            cfg = dataclasses.replace(cfg, delta_rule=settings.delta_rule)  # part of cfg: a static jit argument
            runner = RUNNERS[settings.mode](cfg, params, self._make_ops(settings), settings)
        runner.settings = settings
        self.runner = runner

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the engine for a stretch of device work of one's own (a server's batch round):
        other calls wait meanwhile. Work that raises (KeyboardInterrupt included) lets the runner
        repair what the cut may have left half-done before the exception goes on."""
        with self._lock:
            try:
                yield self
            except BaseException:
                self.runner.recover()
                raise

    # The settings a loaded engine may change (tune): none of them moves a weight or changes a bit.
    TUNABLE = ("prefill", "chunk", "decode_block", "mixed_rounds", "tier_decode", "tier_fetch", "tier_adapt")

    @property
    def settings(self) -> Settings:
        """The settings this engine runs with (settings.py); change the tunable ones with tune()."""
        return self.runner.settings

    @_serialised
    def tune(self, **changes) -> Settings:
        """Change settings that move no weight and change no bit: prefill, chunk, decode_block,
        mixed_rounds take effect at the next call (a server's pool: at its next round); tier_decode,
        tier_fetch, tier_adapt at the next use_expert_cache(). Returns the new settings."""
        fixed = sorted(set(changes) - set(self.TUNABLE))
        if fixed:
            raise ValueError(f"tune: {', '.join(fixed)} cannot change on a loaded engine (they place weights or "
                             f"choose kernels: give them to load()); tunable: {', '.join(self.TUNABLE)}")
        self.runner.settings = self.runner.settings.replace(**changes)
        return self.runner.settings

    @staticmethod
    def _make_ops(settings: Settings):
        if settings.variant:
            if settings.backend != "ordered":
                raise SettingsError(f"variant {settings.variant!r} is built on the ordered backend, "
                                    f"got backend {settings.backend!r}")
            return variants.get_ops(settings.variant, attn_impl=settings.attn_impl)
        return get_ops(settings.backend)

    def with_runner(self, runner: Runner, settings: Settings | None = None) -> "Engine":
        """An Engine on another runner (same tokenizer and name): expert_parallel.shard uses it."""
        return Engine(runner.cfg, runner.params, self.tokenizer, name=self.name, settings=settings or self.settings,
                      runner=runner)

    def with_variant(self, variant: str | None) -> "Engine":
        """An Engine on the same weights (no second copy) with an order-changing variant's ops
        (None: the ordered backend's), for teacher-forced agreement."""
        s = self.settings.replace(variant=variant or "none", backend="ordered")
        runner = type(self.runner)(self.cfg, self.params, self._make_ops(s), s)
        return Engine(self.cfg, self.params, self.tokenizer, name=self.name, settings=s, runner=runner)

    # --- what the engine is -----------------------------------------------------------
    cfg = property(lambda self: self.runner.cfg)
    params = property(lambda self: self.runner.params)
    ops = property(lambda self: self.runner.ops)
    rope = property(lambda self: self.runner.rope)
    dtype = property(lambda self: self.runner.dtype)
    backend = property(lambda self: self.settings.backend)
    variant = property(lambda self: self.settings.variant)
    mode = property(lambda self: self.runner.placement)
    devices = property(lambda self: self.runner.devices)
    device_budget_gb = property(lambda self: self.settings.device_budget_gb)

    # --- tier mode's decode expert cache ----------------------------------------------
    @_serialised
    def use_expert_cache(self, slots: int | None = None):
        """Tier mode: (re)build the decode expert cache with `slots` per layer (None: 64, fewer
        when the budget says so; 0: none, decode stages every layer's experts)."""
        return self.runner.use_expert_cache(slots)

    def expert_cache_report(self) -> dict | None:
        """The decode expert cache's size and counters since its last reset (None: resident mode)."""
        return self.runner.expert_cache_report()

    def reset_expert_cache_stats(self):
        """Zero the decode expert cache's counters, e.g. before timed steps."""
        self.runner.reset_stats()

    @property
    def cache_slots(self) -> int:
        return self.runner.cache_slots

    def check_device(self, state_len: int, chunk: int = 0):
        """Refuse, before any work, a request whose KV/state and activations at `chunk` cannot fit."""
        self.runner.check_budget(state_len, chunk)

    def pick_chunk(self, n_prompt: int, n_new: int = 0) -> int:
        """The prefill chunk a request of n_prompt tokens uses unless told otherwise."""
        return self.runner.pick_chunk(n_prompt, n_new)

    # --- state -------------------------------------------------------------------------
    def new_state(self, length: int | None = None):
        """A zeroed state with a KV cache of `length` positions (default: max_context)."""
        if length is None:
            return self.runner.new_state(self.cfg.max_context)
        length = checks.as_int("new_state: length", length, lo=1)
        if length > self.cfg.max_context:
            raise ValueError(f"new_state: length {length} is more than this engine's max_context of "
                             f"{self.cfg.max_context} (load(max_context=...), --max-context)")
        return self.runner.new_state(length)

    def check_fits(self, n_prompt: int, n_new: int = 0):
        if n_prompt < 1:
            raise ValueError("the prompt is empty: give at least one token")
        total = n_prompt + n_new
        if total > self.cfg.max_context:
            raise ValueError(
                f"prompt of {n_prompt} tokens plus {n_new} new tokens needs {total} positions, "
                f"more than max_context={self.cfg.max_context} (load(max_context=...), --max-context, "
                "if the model allows)")

    def check_ids(self, ids):
        """ids as a list of ints in [0, vocab): floats, bools, None and out-of-range ids are refused."""
        return checks.token_ids(ids, self.cfg.vocab_size)

    def check_state(self, state, what: str = "state") -> int | None:
        """Refuse a state that is not a live state of this model (wrong model, wrong dtype, or
        already donated to an earlier call); its KV length (None when the model has no attention layer)."""
        return checks.state_length(self.cfg, self.dtype, state, what)

    # --- the two arms ------------------------------------------------------------------
    @_serialised
    def decode_step(self, token: int, state, pos: int):
        """One token at position pos -> (logits [V] fp32, new state).

        The state is donated: its buffers become the returned state, and the state passed in
        is deleted, so always continue with the returned one (passing the old one again is
        refused). token must be an int in [0, vocab), pos an int with pos + 1 <= the state's KV
        length and <= max_context; both are checked here, before anything is dispatched."""
        token = checks.token_id(token, self.cfg.vocab_size, "decode_step: token")
        pos = checks.positions(pos, 1, self.check_state(state, "decode_step"), self.cfg.max_context, "decode_step")
        return self._decode(token, state, pos)

    def _decode(self, token: int, state, pos: int):  # unchecked: the engine's own loops
        return self.runner.forward(state, np.asarray([token], np.int32), np.int32(pos), np.int32(1))

    @_serialised
    def greedy_decode(self, token: int, state, pos: int, n: int):
        """n greedy tokens after `token` at pos: decode token, take the argmax, feed it back,
        n times, in device calls of up to decode_block (BARO_DECODE_BLOCK, 16) steps with no
        host work between steps. Returns (tokens list [n], new state); the state is donated and
        ends at pos + n. Same bits as n decode_step calls with greedy sampling."""
        token = checks.token_id(token, self.cfg.vocab_size, "greedy_decode: token")
        n = checks.as_int("greedy_decode: n", n, lo=0)
        pos = checks.positions(pos, max(n, 1), self.check_state(state, "greedy_decode"), self.cfg.max_context,
                               "greedy_decode")
        out = []
        for toks, state in self._greedy_blocks(token, state, pos, n):
            out.extend(toks)
        return out, state

    def _greedy_blocks(self, token: int, state, pos: int, n: int, sampling: Sampling | None = None, index: int = 0):
        """Yields (tokens of one block, state) until n tokens (unchecked). Blocks run one ahead:
        the next block is queued on the device, from the last token as a device scalar, before
        this block's tokens are read back, so the device never waits on the host between blocks.
        The state yielded is the newest one (after the block in flight; after the last block at
        the end). A caller that stops early abandons at most one block of work. sampling: a
        sampled sequence whose first token here is its index-th; None: greedy."""
        block = self.runner.decode_block
        sampling = sampling or Sampling()
        done = 0
        if block == 1:
            while done < n:
                logits, state = self._decode(token, state, pos + done)
                token = int(draw_row(logits, sampling, index + done))
                done += 1
                yield [token], state
            return
        # later blocks get their token as the last graph's output, committed to where the graph
        # placed it; jit keys its graphs on that too, so the first block's token goes there as
        # well (a host scalar compiled each block graph twice, the second inside the first decode)
        sharding = self.runner.token_sharding
        tok = jnp.int32(token) if sharding is None else jax.device_put(jnp.int32(token), sharding)
        pending = None  # (tokens on the device, how many are real) of the block in flight
        samp, k_max = block_inputs(sampling, self.cfg.vocab_size, index)  # once; each block moves its index on
        while done < n or pending is not None:
            queued = None
            if done < n:
                k = min(block, n - done)
                dev, tok, state = self.runner.greedy_block(state, tok, np.int32(pos + done), k, block, samp, k_max)
                if samp is not None:  # the next block's first token is k further on (as the pool's blocks)
                    samp = samp[:4] + (samp[4] + k,)
                queued = (dev, k)
                done += k
            if pending is not None:
                yield [int(t) for t in np.asarray(pending[0])[:pending[1]]], state
            pending = queued

    @_serialised
    def prefill_chunk(self, ids: Sequence[int], state, pos: int, chunk: int):
        """Up to `chunk` tokens at pos.. in one call, padded to `chunk` rows -> (logits of the last
        id [V] fp32, new state). Donates the state (as decode_step does); ids, pos, chunk and
        the state are checked first."""
        ids = self.check_ids(ids)
        chunk = checks.as_int("prefill_chunk: chunk", chunk, lo=1)
        if not 1 <= len(ids) <= chunk:
            raise ValueError(f"prefill_chunk: {len(ids)} ids for a chunk of {chunk} rows (give 1..chunk ids)")
        L = self.check_state(state, "prefill_chunk")
        pos = checks.positions(pos, len(ids), L, self.cfg.max_context, "prefill_chunk")
        self.check_device(L or 0, chunk)
        return self._chunk(ids, state, pos, chunk)

    def _chunk(self, ids: Sequence[int], state, pos: int, chunk: int, all_logits: bool = False):  # unchecked
        n = len(ids)
        toks = np.zeros((chunk,), np.int32)
        toks[:n] = ids
        # host values straight into the jitted call: jit copies them in its own dispatch, where
        # jnp.asarray / jnp.int32 each dispatch a copy or convert of their own first, ~0.5 ms apiece
        # on a GPU host with the device idle before a prompt's first chunk (docs/PERF.md)
        return self.runner.forward(state, toks, np.int32(pos), np.int32(n), all_logits=all_logits)

    @_serialised
    def prefill(self, ids: Sequence[int], mode: str | None = None, chunk: int | None = None, state=None,
                n_new: int = 0, progress: Callable[[int, int], None] | None = None) -> PrefillResult:
        """Run a prompt from position 0 -> PrefillResult (last logits, state, time).

        mode: "batch" (chunks of `chunk` rows) or "replay" (the decode step per token; the
        identity reference); None: the engine's setting (BARO_PREFILL, default batch). chunk: None
        picks one (pick_chunk). n_new: tokens the caller will decode after it (sizes the state).
        state: a state to reuse for its KV length; it is donated and its contents discarded
        (prefill always starts at position 0: a state that holds tokens is zeroed first).
        progress(done, total): called as chunks finish, and once at the end with done == total."""
        mode = self.settings.prefill if mode is None else mode
        if mode not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; choose batch or replay")
        ids = self.check_ids(ids)
        n_new = checks.as_int("n_new", n_new, lo=0)
        _check_callable("progress", progress)
        self.check_fits(len(ids), n_new)
        chunk = self._chunk_for(len(ids), n_new, chunk)
        if state is None:
            L = state_length(len(ids) + n_new, self.cfg.max_context)
        else:
            L = self.check_state(state, "prefill")
            checks.positions(0, len(ids), L, self.cfg.max_context, "prefill")
        self.check_device(L or 0, chunk if mode == "batch" else 1)  # before any work, either state
        t0 = time.perf_counter()  # the fresh state is part of the prompt's time
        if state is not None:  # the caller's buffers go, a zeroed state of their length comes
            for leaf in jax.tree_util.tree_leaves(state):
                leaf.delete()
        state = self.runner.new_state(L or self.cfg.max_context)
        # progress(done, total) is called once the tokens so far have been computed, so a caller
        # can show true tokens/s. The batched loop waits for chunk k only after chunk k+1 is
        # dispatched, so the device never idles on the host; without progress nothing waits.
        if mode == "replay":
            logits, state = self._replay_span(ids, state, 0, len(ids), progress)
        else:
            pending = None  # (logits, tokens done) of the chunk before the one just dispatched
            for p in range(0, len(ids), chunk):
                logits, state = self._chunk(ids[p:p + chunk], state, p, chunk)
                if progress:
                    if pending is not None:
                        jax.block_until_ready(pending[0])
                        progress(pending[1], len(ids))
                    pending = (logits, min(p + chunk, len(ids)))
        logits = jax.block_until_ready(logits)
        if progress:
            progress(len(ids), len(ids))
        return PrefillResult(logits, state, time.perf_counter() - t0, len(ids))

    def _replay_span(self, ids: Sequence[int], state, start: int, stop: int, progress=None):  # unchecked
        """The decode step once per token of ids[start:stop] on a state holding ids[:start] ->
        (the last step's logits, the state): all but the last token in device calls of the
        runner's replay_block steps (their logits never computed), the rest one step a call.
        progress(done, len(ids)) about every 256 tokens (it waits for the device there)."""
        block, p, told = self.runner.replay_block, start, start
        while block > 1 and stop - 1 - p >= block:
            state = self.runner.replay(state, np.asarray(ids[p:p + block], np.int32), p)
            p += block
            if progress and p - told >= 256:
                jax.block_until_ready(state)
                progress(p, len(ids))
                told = p
        logits = None
        for q in range(p, stop):
            logits, state = self._decode(ids[q], state, q)
            if progress and q + 1 - told >= 256 and q + 1 < len(ids):
                jax.block_until_ready(logits)
                progress(q + 1, len(ids))
                told = q + 1
        return logits, state

    def _chunk_for(self, n_prompt: int, n_new: int, chunk) -> int:
        if chunk is None:
            chunk = self.settings.chunk
        if chunk is None:
            return self.pick_chunk(n_prompt, n_new)
        return checks.as_int("chunk (--chunk)", chunk, lo=1)

    @_serialised
    def prompt_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits of every prompt position [n, V] fp32 from one whole-prompt forward."""
        ids = self.check_ids(ids)
        self.check_fits(len(ids))
        self.check_device(len(ids), len(ids))
        logits, _ = self._chunk(ids, self.runner.new_state(len(ids)), 0, len(ids), all_logits=True)
        return np.asarray(logits)

    @_serialised
    def forced_logits(self, ids: Sequence[int], chunk: int | None = None, state_len: int | None = None,
                      start: int = 0) -> np.ndarray:
        """Teacher forcing through the batched path: logits [n - start, V] fp32 of positions
        start..n-1. The ids run as batched prefill does (chunks of `chunk` rows from position 0,
        default pick_chunk, the last padded, on a state of `state_len` positions, default
        state_length(n), at least n); chunks holding a position >= start return every row's logits."""
        ids = self.check_ids(ids)
        self.check_fits(len(ids))
        chunk = self._chunk_for(len(ids), 0, chunk)
        start = checks.as_int("forced_logits: start", start)
        if not 0 <= start < len(ids):
            raise ValueError(f"forced_logits: start must be in [0, {len(ids)}), got {start}")
        if state_len is None:
            L = state_length(len(ids), self.cfg.max_context)
        else:
            L = checks.as_int("forced_logits: state_len", state_len, lo=1)
            if not len(ids) <= L <= self.cfg.max_context:
                raise ValueError(f"forced_logits: state_len must hold the {len(ids)} ids and be at most "
                                 f"max_context={self.cfg.max_context}, got {L}")
        self.check_device(L, chunk)
        state = self.runner.new_state(L)
        out = []
        for p in range(0, len(ids), chunk):
            part = ids[p:p + chunk]
            scored = p + len(part) > start  # a chunk with nothing scored runs as the plain prefill chunk
            logits, state = self._chunk(part, state, p, chunk, all_logits=scored)
            if scored:
                out.append(np.asarray(logits[max(start - p, 0):len(part)]))
        return np.concatenate(out)

    # --- text in, text out ---------------------------------------------------------------
    def encode(self, prompt) -> list:
        """Text through the tokenizer; a sequence of token ids checked (ints only, no floats)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt is None or isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        return self.check_ids(prompt)

    def sampling_for(self, sampling: Sampling | None = None, *, temperature=None, top_k=None, top_p=None,
                     seed=None) -> Sampling:
        """The Sampling a call asks for: `sampling`, or one made of the shortcuts (not both),
        checked against this model. top_k / top_p filter a sampled distribution, so they need a
        temperature > 0 (with temperature 0 decoding is greedy and they would do nothing)."""
        shortcuts = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).items()
                     if v is not None}
        if sampling is not None and shortcuts:
            raise TypeError(f"give sampling= or the shortcuts ({', '.join(shortcuts)}=), not both")
        if sampling is None:
            sampling = Sampling(**shortcuts)
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a baro_jax.Sampling, got {type(sampling).__name__}")
        sampling.validate()
        if sampling.greedy and (sampling.top_k or sampling.top_p < 1.0):
            raise ValueError("top_k (--top-k) and top_p (--top-p) filter sampling, but temperature is 0 (greedy): "
                             "give a temperature > 0 (--temperature), or leave them out")
        if sampling.top_k > self.cfg.vocab_size:
            raise ValueError(f"top_k (--top-k) {sampling.top_k} is larger than the vocabulary of {self.cfg.vocab_size}")
        return sampling

    @_serialised
    def generate(self, prompt, max_new_tokens: int = 64, *, prefill: str | None = None, chunk: int | None = None,
                 sampling: Sampling | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 on_token: Callable[[int], None] | None = None, stop_at_eos: bool = True, keep_state: bool = False,
                 progress: Callable[[int, int], None] | None = None, logprobs: int | None = None,
                 prompt_logprobs: bool = False) -> GenerateResult:
        """Continue `prompt` (text, or a list of token ids) by up to max_new_tokens tokens.

        Greedy by default; sample with temperature= (and top_k=, top_p=, seed=), or a whole
        sampling=Sampling(...); the i-th sampled token's randomness comes from (seed, i) alone.
        prefill: "batch" or "replay" (None: the engine's setting); chunk: the prefill chunk (None:
        picked per prompt). on_token(id) is called with each token as it is chosen (returning False
        ends the sequence there, finish_reason "stop"); progress(done, total) as the prompt's
        prefill goes. Stops early at an end-of-sequence id (the tokenizer's and
        generation_config.json's; stop_at_eos). logprobs: None (none), 0 (the chosen token's
        log-probability at each position) or k (also the k most likely ids and values);
        prompt_logprobs: each prompt token's log-probability given the ones before it (batched
        prefill). keep_state: return the state after the last token in the result."""
        ids = self.check_ids(self.encode(prompt))
        max_new_tokens = checks.as_int("max_new_tokens (--max-new-tokens)", max_new_tokens, lo=0)
        sampling = self.sampling_for(sampling, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        _check_callable("on_token", on_token)
        _check_callable("progress", progress)
        prefill = self.settings.prefill if prefill is None else prefill
        if prefill not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {prefill!r}; choose batch or replay")
        chunk = self._chunk_for(len(ids), max_new_tokens, chunk) if prefill == "batch" else None
        top_n = check_logprobs(logprobs, self.cfg.vocab_size, allow_none=True)
        if prompt_logprobs and prefill != "batch":
            raise ValueError("prompt_logprobs come from batched prefill: use prefill='batch'")
        sampler = Sampler(sampling)
        prompt_lp = None
        if prompt_logprobs:
            pre, prompt_lp = self._prefill_scored(ids, chunk, max_new_tokens)
        else:
            pre = self.prefill(ids, prefill, chunk, n_new=max_new_tokens, progress=progress)
        logits, state = pre.logits, pre.state
        last_logits = np.asarray(logits)
        out, lps, tops = [], [], []
        eos = self.eos_ids if stop_at_eos else frozenset()
        finish = "length"

        def emit(tok, logits) -> bool:
            """Record tok; whether the sequence goes on."""
            nonlocal finish
            out.append(tok)
            if top_n is not None:
                # the pick and the top on the device, as the pool takes them: a host sort of a
                # 248k-id row costs about 15 ms a token
                rows = batch.LOGPROBS(logits[None], ops=self.ops)
                picked = batch.PICK(rows, jnp.zeros((1,), jnp.int32), jnp.full((1,), tok, jnp.int32))
                if top_n:
                    picked, (vals, best) = jax.device_get((picked, batch.TOP(rows, top_n)))
                    tops.append((best[0].astype(np.int64).tolist(), vals[0].astype(np.float32)))
                lps.append(np.float32(np.asarray(picked)[0]))
            if on_token and on_token(tok) is False:
                finish = "stop"
                return False
            if tok in eos:
                finish = "eos"
                return False
            return True
        self.reset_expert_cache_stats()  # the hit rate of this request's decode steps
        t0 = time.perf_counter()
        t1 = None  # when the first decode call's tokens were in hand: that call may have compiled
        n1 = 0     # tokens in hand at t1
        pos = len(ids)
        # Greedy runs blocks of decode steps on the device unless the caller keeps the state: a
        # block may run past an end-of-sequence token, and a kept state must end there.
        # Logprobs need each step's logits on the host, and a kept state must end at the last token.
        blocks = top_n is None and not (keep_state and eos)
        if blocks and max_new_tokens > 0:
            tok = sampler(logits)
            go = emit(tok, logits)
            if go and max_new_tokens > 1:
                for toks, state in self._greedy_blocks(tok, state, pos, max_new_tokens - 1, sampling, 1):
                    if t1 is None:
                        t1, n1 = time.perf_counter(), len(out) + len(toks)
                    for t in toks:
                        go = emit(t, None)
                        if not go:
                            break
                    if not go:
                        break
        else:
            for i in range(max_new_tokens):
                tok = sampler(logits)
                if i == 1:
                    t1, n1 = time.perf_counter(), 2
                if not emit(tok, logits):
                    break
                if i + 1 < max_new_tokens:
                    logits, state = self._decode(tok, state, pos)
                    pos += 1
        t_end = time.perf_counter()
        # The first token comes from the prefill logits. The rate counts the tokens after the first
        # decode call (one step, or one block of greedy steps), so that call's compilation (a new
        # graph) stays out of it; when there is no later call, it is in.
        if t1 is not None and len(out) > n1:
            n_dec, dt = len(out) - n1, t_end - t1
        else:
            n_dec, dt = max(len(out) - 1, 0), t_end - t0
        return GenerateResult(
            prompt_ids=ids, generated_ids=out, text=self.tokenizer.decode(out),
            prefill_seconds=pre.seconds, prefill_tokens_per_s=pre.tokens_per_s,
            decode_tokens_per_s=(n_dec / dt if dt > 0 and n_dec else 0.0),
            model=self.name, backend=self.backend, prefill_mode=prefill, variant=self.variant,
            expert_cache=self.expert_cache_report(), chunk=chunk, mode=self.mode,
            last_prompt_logits=last_logits, state=state if keep_state else None,
            logprobs=None if top_n is None else lps, top_logprobs=tops if top_n else None,
            prompt_logprobs=prompt_lp, finish_reason=finish)

    def _prefill_scored(self, ids, chunk: int, n_new: int):
        """Batched prefill that keeps every row's logits: (PrefillResult, prompt logprobs with a
        leading None)."""
        L = state_length(len(ids) + n_new, self.cfg.max_context)
        self.check_device(L, chunk)
        state = self.runner.new_state(L)
        t0 = time.perf_counter()
        lp = [None]
        for p in range(0, len(ids), chunk):
            part = ids[p:p + chunk]
            logits, state = self._chunk(part, state, p, chunk, all_logits=True)
            rows = np.asarray(row_logprobs(self.ops, logits))
            lp += [np.float32(rows[i, t]) for i, t in enumerate(ids[p + 1:p + len(part) + 1])]
            last = logits[len(part) - 1]
        last = jax.block_until_ready(last)
        return PrefillResult(last, state, time.perf_counter() - t0, len(ids)), lp

    @property
    def eos_ids(self) -> frozenset:
        """The ids that end a sequence: the tokenizer's end-of-sequence token and
        generation_config.json's eos_token_id (one or a list)."""
        ids = set(getattr(self, "generation_eos", ()) or ())
        eos = getattr(self.tokenizer, "eos_id", None)
        if eos is not None:
            ids.add(eos)
        return frozenset(ids)

    # --- many sequences -----------------------------------------------------------------------
    @_serialised
    def generate_batch(self, prompts, max_new_tokens=64, *, sampling=None, logprobs: int = 0,
                       prompt_logprobs: bool = False, max_batch: int | None = None, chunk: int | None = None,
                       stop=None, stop_token_ids=None, stop_at_eos: bool = True, keep_states: bool = False,
                       on_token: Callable[[int, int], object] | None = None,
                       prefill_budget: int | None = None, n: int = 1,
                       share_prefixes: bool = True) -> list[GenerateResult]:
        """Continue many prompts at once; one GenerateResult per prompt, in input order (n of them
        per prompt with n > 1, side by side: with n = 2 result 2 i + j is prompt i's sample j).

        Each sequence gets exactly the bytes it gets alone (generate(prompt) with the same
        sampling): tokens, logprobs and states do not depend on the other sequences, their
        number, lengths or arrival. prompts: texts or token-id lists. max_new_tokens and sampling:
        one for all, or one per prompt. logprobs: 0 (the chosen token's log-probability) or k
        (also the k most likely). prompt_logprobs: each prompt token's log-probability. max_batch:
        sequence slots (None: as many as the prompts, at most 64 and what the device budget
        holds); chunk: prefill rows per step (None: 256, at most the pool's length);
        prefill_budget: prompt rows prefilled per round, in whole chunks, before the running
        sequences' next step (None: one chunk; more gets many prompts going sooner and makes
        the running ones wait longer in those rounds; the bytes are the same). stop: strings
        that end a sequence; stop_token_ids: ids that do; end-of-sequence ids end it too
        (stop_at_eos). on_token(i, id): each token of prompt i as it is chosen; returning False
        ends that sequence (finish_reason "stop"). keep_states: each result carries its
        sequence's final state (host arrays, the KV cache at the pool's length). n: samples per
        prompt (RL rollouts), one for all or one per prompt; sample j draws with the prompt's
        sampling at seed + j, so it is generate(prompt, sampling with seed + j) alone, bytes; the
        prompt is prefilled once and its state copied to the other samples where they get slots
        while it is prefilled (exact copies: the bytes do not depend on it). share_prefixes: prompts that start with the same prefill
        chunk of tokens (a few-shot header, a system prompt) prefill what they share once, the
        later ones copying the state of the first where they get slots in time (False: each
        prefills its own; the bytes are the same). on_token's i is the result's index."""
        return batch.generate_batch(self, prompts, max_new_tokens, sampling=sampling, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs, max_batch=max_batch, chunk=chunk, stop=stop,
                                stop_token_ids=stop_token_ids, stop_at_eos=stop_at_eos, keep_states=keep_states,
                                on_token=on_token, sequence_type=Sequence, prefill_budget=prefill_budget,
                                n_samples=n, share_prefixes=share_prefixes)

    def score(self, prompt, continuation, *, chunk: int | None = None) -> np.ndarray:
        """The log-probabilities [len(continuation)] float32 of `continuation`'s tokens after
        `prompt`, from one batched prefill: the bytes the sampler's logprobs had when it
        generated that continuation (generate(..., logprobs=0))."""
        p, c = self.encode(prompt), self.encode(continuation)
        if not p:
            raise ValueError("score: the prompt is empty (the first token has no log-probability)")
        if not c:
            raise ValueError("score: the continuation is empty")
        ids = p + c
        lp = self.forced_logprobs(ids, chunk=chunk, start=len(p) - 1)
        return np.asarray([lp[i, t] for i, t in enumerate(c)], np.float32)

    def score_batch(self, prompts, continuations, *, chunk: int | None = None,
                    max_batch: int | None = None, share_prefixes: bool = True) -> list[np.ndarray]:
        """score() of many (prompt, continuation) pairs at once, one float32 array per pair in
        input order, each the bytes score(prompt, continuation) gives alone: every pair runs as a
        sequence of the many-sequence pool (its prompt and continuation prefilled, each position's
        log-probability kept, nothing generated; the pairs of one prompt prefill it once, the
        later ones copying the first one's state after it; share_prefixes=False: each its own,
        the same bytes). prompts and continuations: texts or token-id
        lists, as many of one as of the other; max_batch and chunk as generate_batch's."""
        return batch.score_batch(self, prompts, continuations, chunk=chunk, max_batch=max_batch,
                                 share_prefixes=share_prefixes)

    def forced_logprobs(self, ids, chunk: int | None = None, start: int = 0) -> np.ndarray:
        """log_softmax rows [n - start, V] of forced_logits (the ordered row-wise op)."""
        logits = self.forced_logits(ids, chunk=chunk, start=start)
        return np.asarray(row_logprobs(self.ops, jnp.asarray(logits)))


def _check_callable(name: str, f):
    if f is not None and not callable(f):
        raise TypeError(f"{name} must be a callable (or None), got {type(f).__name__} {f!r:.60}")
