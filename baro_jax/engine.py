"""The engine: jitted decode step and prefill chunk over one sequence.

Replay prefill is the decode step (m = 1) once per prompt token; batched
prefill runs the same forward at m = C per chunk, the last chunk padded.
"""
from __future__ import annotations

import dataclasses
import os
import time
from functools import partial
from typing import Callable, Sequence

import numpy as np
import jax
import jax.numpy as jnp

from . import model as M
from . import budget, checks, variants
from .config import Config
from .ops import get_ops
from .sampling import Sampler, Sampling, greedy, greedy_loop

PREFILL_MODES = ("batch", "replay")
ENGINE_MODES = ("resident", "tier")  # where the routed experts live: device memory, or host (staging.py)
MAX_PAD_FRACTION = 0.25  # padding rows a long prompt may waste in its last chunk
DEFAULT_CHUNK = 8192  # the largest chunk a request uses unless --chunk says otherwise (H200: 8192 beat 4096 and 2048, benchmarks/results/speed_chunks_h200.json)
MIN_STATE_LEN = 1024
# Trained by benchmarks/train_tiny.py (evidence in benchmarks/results/train_tiny_*).
TINY_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "tiny")


def env_prefill_mode(default: str = "batch") -> str:
    v = os.environ.get("BARO_PREFILL")
    if v is None or v == "":
        return default
    if v not in ("0", "1"):
        raise ValueError(f"BARO_PREFILL must be 0 (replay) or 1 (batch), got {v!r}")
    return "batch" if v == "1" else "replay"


def env_engine_mode(default: str = "resident") -> str:
    """BARO_TIER=1 -> tier, 0 -> resident; unset -> default."""
    v = os.environ.get("BARO_TIER")
    if v is None or v == "":
        return default
    if v not in ("0", "1"):
        raise ValueError(f"BARO_TIER must be 0 (resident) or 1 (tier), got {v!r}")
    return "tier" if v == "1" else "resident"


def env_int(name: str, default, hi: int | None = None):
    """A positive integer from env var `name` (<= hi when given), or `default` when unset or
    empty; anything else is a ValueError naming the variable."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        c = int(v)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {v!r}") from None
    if c < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if hi is not None and c > hi:
        raise ValueError(f"{name} must be in 1..{hi}, got {v!r}")
    return c


def env_chunk(default: int | None = None) -> int | None:
    """BARO_PREFILL_C, or `default` (None: pick per prompt, see default_chunk)."""
    return env_int("BARO_PREFILL_C", default)


@dataclasses.dataclass
class PrefillResult:
    logits: jax.Array  # [V] fp32, last prompt position
    state: tuple
    seconds: float
    n_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclasses.dataclass
class GenerateResult:
    prompt_ids: list
    generated_ids: list
    text: str
    prefill_seconds: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # steady rate: decode steps after the first (which may compile)
    model: str
    backend: str
    prefill_mode: str
    chunk: int | None
    mode: str = "resident"
    variant: str | None = None  # an order-changing variant (baro_jax/variants.py), None: the backend as is
    expert_cache: dict | None = None  # tier mode: the decode expert cache over this request's decode steps
    last_prompt_logits: np.ndarray = dataclasses.field(repr=False, default=None)
    state: tuple = dataclasses.field(repr=False, default=None)

    def to_json(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids, "generated_ids": self.generated_ids, "text": self.text,
            "prefill_seconds": self.prefill_seconds, "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s, "model": self.model, "backend": self.backend,
            "prefill_mode": self.prefill_mode, "chunk": self.chunk, "mode": self.mode, "variant": self.variant,
            "expert_cache": self.expert_cache,
        }


def default_chunk(n_prompt: int) -> int:
    """The prefill chunk a request uses unless told otherwise.

    A prompt of at most DEFAULT_CHUNK tokens runs as one chunk, the smallest
    power of two >= its length. A longer one takes the largest power of two
    <= DEFAULT_CHUNK whose padded last chunk keeps the rows computed within
    MAX_PAD_FRACTION of the prompt (9000 tokens: 5 x 2048, not 2 x 8192).
    The chunk never changes the bits, only the time.
    """
    c = 16
    while c < n_prompt and c < DEFAULT_CHUNK:
        c *= 2
    if n_prompt <= c:
        return c
    while c > 16 and -(-n_prompt // c) * c > (1 + MAX_PAD_FRACTION) * n_prompt:
        c //= 2
    return c


def state_length(n: int, max_context: int) -> int:
    """KV length for a request of n tokens: a power of two >= n, so few shapes compile."""
    L = MIN_STATE_LEN
    while L < n:
        L *= 2
    return min(L, max_context)


# Greedy decode steps per device call (generate, speed.py): one dispatch of the whole
# model costs the host ~2 ms at full size (thousands of leaves), about a fifth of a step.
DECODE_BLOCK = 16


def env_decode_block(default: int = DECODE_BLOCK) -> int:
    """BARO_DECODE_BLOCK: greedy decode steps per device call (1: one call per token)."""
    return env_int("BARO_DECODE_BLOCK", default, hi=4096)


def greedy_steps(params, state, token, pos, n, rope, *, cfg: Config, ops, block: int):
    """Up to `block` greedy decode steps in one device graph: token at pos, then each step's
    argmax fed back, for n steps. Each iteration is forward() on one row, the decode step's
    graph, so the bits are the per-token loop's. Returns (tokens [block], last token, state):
    tokens[i] is the argmax after step i (entries past n are -1), last the final one, a device
    scalar the next block starts from.

    n = None: exactly `block` steps, a loop whose trip count XLA knows, so the GPU runtime runs
    it without reading a predicate back to the host every step (a copy and a host wait per
    token: with a traced n the loop is a while whose condition lives on the device). A traced
    n (1..block) serves the shorter last block of a request, one graph for every length."""
    def step(i, st, tok, acc):
        logits, st = M.forward(params, st, tok[None], pos + i, jnp.int32(1), rope, cfg=cfg, ops=ops)
        return logits, st, acc

    toks, last, st, _ = greedy_loop(step, state, token, block=block, n=n)
    return toks, last, st


# Module-level jits keyed on (cfg, ops): engines of the same model share compiled graphs.
_STEP = jax.jit(M.forward, static_argnames=("cfg", "ops", "all_logits"), donate_argnums=(1,))
_GREEDY = jax.jit(greedy_steps, static_argnames=("cfg", "ops", "block"), donate_argnums=(1,))
_GREEDY_FULL = jax.jit(partial(greedy_steps, n=None), static_argnames=("cfg", "ops", "block"),
                       donate_argnums=(1,))
_ALL_LOGITS = jax.jit(partial(M.forward, all_logits=True), static_argnames=("cfg", "ops"))


class Engine:
    def __init__(self, cfg: Config, params, tokenizer, *, backend: str = "xla", name: str = "model",
                 mode: str = "resident", device_budget_gb: float | None = None, variant: str | None = None,
                 delta_rule: str | None = None, cache_slots: int | None = None):
        if mode not in ENGINE_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose resident or tier")
        cache_slots = check_cache_slots(cache_slots, mode)
        if delta_rule is not None:  # "token" | "blocked" (DESIGN §9): part of cfg, a static jit argument
            from .config import check_delta_rule

            cfg = dataclasses.replace(cfg, delta_rule=check_delta_rule(delta_rule))
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.backend = backend
        self.name = name
        self.mode = mode
        self.device_budget_gb = checks.budget_gb(device_budget_gb)
        self.variant = variants.check(variant)
        if self.variant and backend != "ordered":
            raise ValueError(f"variant {self.variant!r} is built on the ordered backend, got backend {backend!r}")
        self.ops = variants.get_ops(self.variant) if self.variant else get_ops(backend)
        self.dtype = params["embed"].dtype
        self.rope = M.rope_tables(cfg, cfg.max_context)
        self.cache, self.cache_note = None, "resident mode: every expert on the device"
        # where a decode's first greedy block takes its token: where the block graphs put their
        # output token (None: a host scalar, which the resident graphs key the same as their
        # output; tier's direct path and expert parallel place theirs, and set this)
        self.token_sharding = None
        self.direct = None  # tier decode on the direct path (staging.pick_decode_path): staging.DirectDecode
        if mode == "tier":
            from . import staging

            budget.check_tier(cfg, self.dtype, device_budget_gb, min(MIN_STATE_LEN, cfg.max_context))
            self.params = staging.tier_params(params)  # routed experts -> host memory (no-op where already)
            self._step = partial(staging.forward, cfg=cfg, ops=self.ops)
            self._all_logits = partial(staging.forward, cfg=cfg, ops=self.ops, all_logits=True)
            self.use_expert_cache(env_cache_slots() if cache_slots is None else cache_slots)
        else:
            self.params = params
            self._step = partial(_STEP, cfg=cfg, ops=self.ops)
            self._all_logits = partial(_ALL_LOGITS, cfg=cfg, ops=self.ops)

    def use_expert_cache(self, slots: int | None = None):
        """Tier mode: (re)build the decode expert cache with `slots` per layer (None: 64, fewer when
        the budget says so, see budget.tier_cache_slots; 0: none, decode stages every layer's experts)."""
        from . import staging

        if self.mode != "tier":
            raise ValueError("the decode expert cache is for tier mode (mode='tier')")
        path = staging.env_decode_path()  # a bad BARO_TIER_DECODE is refused before anything changes
        path = staging.pick_decode_path(path, self.ops)
        if path == "direct" and staging.has_cache_ops(self.ops) and not staging.has_host_ops(self.ops):
            raise ValueError(f"BARO_TIER_DECODE=direct: the {self.variant or self.backend} ops "
                             "cannot read experts from the host store (use the ordered backend)")
        # the old pools go before the new ones are made (both at once may not fit the device):
        # the step function holds them too
        self.cache = self.direct = self.token_sharding = None
        self._step = partial(staging.forward, cfg=self.cfg, ops=self.ops, cache=None, direct=None)
        if not staging.has_cache_ops(self.ops):
            self.cache_note = f"off: the {self.variant or self.backend} ops have no slot-table MoE"
        else:
            S, self.cache_note = budget.tier_cache_slots(self.cfg, self.dtype, self.device_budget_gb, slots)
            if S:
                self.cache = staging.ExpertCache(self.cfg, self.params["layers"], S)
                if path == "direct":
                    self.direct = staging.DirectDecode(self.params, self.cache)
                    self.token_sharding = self.cache._on_dev  # its graphs' outputs live with the pools
        self._step = partial(staging.forward, cfg=self.cfg, ops=self.ops, cache=self.cache, direct=self.direct)
        return self.cache

    def expert_cache_report(self) -> dict | None:
        """The cache's size and counters since its last reset (None in resident mode)."""
        if self.mode != "tier":
            return None
        if self.cache is None:
            return {"slots_per_layer": 0, "note": self.cache_note}
        if self.direct is not None:  # the pools as they stood, the misses read from the host store
            return {**self.cache.stats(), **self.direct.stats(), "note": self.cache_note}  # direct's counts win
        return {**self.cache.stats(), "decode_path": "cache", "note": self.cache_note}

    def reset_expert_cache_stats(self):
        """Zero the tier decode cache's counters (and the direct path's), e.g. before timed steps."""
        if self.cache is not None:
            self.cache.reset_stats()
        if self.direct is not None:
            self.direct.reset_stats()

    @property
    def cache_slots(self) -> int:
        return self.cache.slots if self.cache is not None else 0

    def check_device(self, state_len: int, chunk: int = 0):
        """Refuse, before any work, a request whose KV/state and activations at `chunk` cannot fit."""
        if self.mode == "tier":
            budget.check_tier(self.cfg, self.dtype, self.device_budget_gb, state_len, chunk, self.cache_slots)
        else:
            budget.check_resident(self.cfg, self.dtype, self.device_budget_gb, state_len, chunk,
                                  getattr(self, "devices", 1))

    def pick_chunk(self, n_prompt: int, n_new: int = 0) -> int:
        """The default prefill chunk. Resident: default_chunk. Tier: every pass moves all routed
        experts over the host link whatever the chunk, so take the largest chunk (up to one for
        the whole prompt) whose activations fit the device budget beside the request's state."""
        if self.mode != "tier":
            return default_chunk(n_prompt)
        L = state_length(n_prompt + n_new, self.cfg.max_context)
        return budget.largest_tier_chunk(self.cfg, self.dtype, self.device_budget_gb, L, n_prompt, self.cache_slots)

    # --- state -------------------------------------------------------------
    def new_state(self, length: int | None = None):
        """A zeroed state with a KV cache of `length` positions (default: max_context)."""
        if length is not None:
            length = checks.as_int("length", length, lo=1, hi=self.cfg.max_context)
        return M.init_state(self.cfg, self.dtype, length or self.cfg.max_context)

    def check_fits(self, n_prompt: int, n_new: int = 0):
        if n_prompt < 1:
            raise ValueError("the prompt is empty: give at least one token")
        total = n_prompt + n_new
        if total > self.cfg.max_context:
            raise ValueError(
                f"prompt of {n_prompt} tokens plus {n_new} new tokens needs {total} positions, "
                f"more than the context of {self.cfg.max_context} (raise --max-context if the model allows)")

    def check_ids(self, ids):
        """ids as a list of ints in [0, vocab): floats, bools, None and out-of-range ids are refused."""
        return checks.token_ids(ids, self.cfg.vocab_size)

    def check_state(self, state, what: str = "state") -> int | None:
        """Refuse a state that is not a live state of this model (wrong model, wrong dtype, or
        already donated to an earlier call); its KV length (None when the model has no attention layer)."""
        return checks.state_length(self.cfg, self.dtype, state, what)

    # --- the two arms ----------------------------------------------------------
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
        toks = jnp.asarray([token], jnp.int32)
        return self._step(self.params, state, toks, jnp.int32(pos), jnp.int32(1), self.rope)

    def greedy_decode(self, token: int, state, pos: int, n: int):
        """n greedy tokens after `token` at pos: decode token, take the argmax, feed it back,
        n times, in device calls of up to BARO_DECODE_BLOCK (16) steps with no host work
        between steps. Returns (tokens list [n], new state); the state is donated and ends
        at pos + n. Same bits as n decode_step calls with greedy sampling."""
        token = checks.token_id(token, self.cfg.vocab_size, "greedy_decode: token")
        n = checks.as_int("n", n, lo=0)
        pos = checks.positions(pos, max(n, 1), self.check_state(state, "greedy_decode"), self.cfg.max_context,
                               "greedy_decode")
        out = []
        for toks, state in self._greedy_blocks(token, state, pos, n):
            out.extend(toks)
        return out, state

    def _greedy_blocks(self, token: int, state, pos: int, n: int):
        """Yields (tokens of one block, state) until n tokens (unchecked). Blocks run one ahead:
        the next block is queued on the device, from the last token as a device scalar, before
        this block's tokens are read back, so the device never waits on the host between blocks.
        The state yielded is the newest one (after the block in flight; after the last block at
        the end). A caller that stops early abandons at most one block of work."""
        if self.mode == "tier" and self.direct is None:  # the cache's steps stage experts from Python per layer
            block = 1
        else:
            block = env_decode_block()
        done = 0
        if block == 1:
            while done < n:
                logits, state = self._decode(token, state, pos + done)
                token = int(greedy(logits))
                done += 1
                yield [token], state
            return
        # later blocks get their token as the last graph's output, committed to where the graph
        # placed it; jit keys its graphs on that too, so a host scalar here compiled each block
        # graph twice, the second inside the first decode longer than a block (tier direct on the
        # H200: 32 tokens at 12 tok/s where the graphs run 27; expert parallel the same)
        tok = jnp.int32(token) if self.token_sharding is None else jax.device_put(jnp.int32(token), self.token_sharding)
        pending = None  # (tokens on the device, how many are real) of the block in flight
        while done < n or pending is not None:
            queued = None
            if done < n:
                k = min(block, n - done)
                if self.direct is not None:  # tier, one graph per block (staging.DirectDecode)
                    dev, tok, state = self.direct.greedy(state, tok, jnp.int32(pos + done), k, self.rope,
                                                         cfg=self.cfg, ops=self.ops, block=block)
                elif k == block:
                    dev, tok, state = _GREEDY_FULL(self.params, state, tok, jnp.int32(pos + done),
                                                   rope=self.rope, cfg=self.cfg, ops=self.ops, block=block)
                else:
                    dev, tok, state = _GREEDY(self.params, state, tok, jnp.int32(pos + done), jnp.int32(k),
                                              self.rope, cfg=self.cfg, ops=self.ops, block=block)
                queued = (dev, k)
                done += k
            if pending is not None:
                yield [int(t) for t in np.asarray(pending[0])[:pending[1]]], state
            pending = queued

    def prefill_chunk(self, ids: Sequence[int], state, pos: int, chunk: int):
        """Up to `chunk` tokens at pos.. in one call, padded to `chunk` rows. Donates the state
        (as decode_step does); ids, pos, chunk and the state are checked first."""
        ids = self.check_ids(ids)
        chunk = checks.as_int("chunk", chunk, lo=1)
        if not 1 <= len(ids) <= chunk:
            raise ValueError(f"prefill_chunk: {len(ids)} ids for a chunk of {chunk} rows (give 1..chunk ids)")
        L = self.check_state(state, "prefill_chunk")
        pos = checks.positions(pos, len(ids), L, self.cfg.max_context, "prefill_chunk")
        self.check_device(L or 0, chunk)
        return self._chunk(ids, state, pos, chunk)

    def _chunk(self, ids: Sequence[int], state, pos: int, chunk: int):  # unchecked: the engine's own loops
        n = len(ids)
        toks = np.zeros((chunk,), np.int32)
        toks[:n] = ids
        return self._step(self.params, state, jnp.asarray(toks), jnp.int32(pos), jnp.int32(n), self.rope)

    def prefill(self, ids: Sequence[int], mode: str = "batch", chunk: int | None = None, state=None,
                n_new: int = 0, progress: Callable[[int, int], None] | None = None) -> PrefillResult:
        if mode not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; choose batch or replay")
        ids = self.check_ids(ids)
        n_new = checks.as_int("n_new", n_new, lo=0)
        self.check_fits(len(ids), n_new)
        chunk = self.pick_chunk(len(ids), n_new) if chunk is None else checks.as_int("chunk (--chunk)", chunk, lo=1)
        if state is None:
            L = state_length(len(ids) + n_new, self.cfg.max_context)
        else:  # a caller's state: donated (see decode_step), and it must hold the whole prompt
            L = self.check_state(state, "prefill")
            checks.positions(0, len(ids), L, self.cfg.max_context, "prefill")
        self.check_device(L or 0, chunk if mode == "batch" else 1)  # before any work, either state
        if state is None:
            state = self.new_state(L)
        t0 = time.perf_counter()
        # progress(done, total) is called once the tokens so far have been computed, so a caller
        # can show true tokens/s. The batched loop waits for chunk k only after chunk k+1 is
        # dispatched, so the device never idles on the host; without progress nothing waits.
        if mode == "replay":
            for p, t in enumerate(ids):
                logits, state = self._decode(t, state, p)
                if progress and (p + 1) % 256 == 0:
                    jax.block_until_ready(logits)
                    progress(p + 1, len(ids))
        else:
            pending = None  # (logits, tokens done) of the chunk before the one just dispatched
            for p in range(0, len(ids), chunk):
                logits, state = self._chunk(ids[p:p + chunk], state, p, chunk)
                if progress:
                    if pending is not None:
                        jax.block_until_ready(pending[0])
                        progress(pending[1], len(ids))
                    pending = (logits, min(p + chunk, len(ids)))
            if progress and pending is not None:
                jax.block_until_ready(pending[0])
                progress(pending[1], len(ids))
        logits = jax.block_until_ready(logits)
        return PrefillResult(logits, state, time.perf_counter() - t0, len(ids))

    def prompt_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits of every prompt position [n, V] fp32 from one whole-prompt forward."""
        ids = self.check_ids(ids)
        self.check_fits(len(ids))
        self.check_device(len(ids), len(ids))
        state = self.new_state(len(ids))
        logits, _ = self._all_logits(self.params, state, jnp.asarray(ids, jnp.int32), jnp.int32(0),
                                     jnp.int32(len(ids)), self.rope)
        return np.asarray(logits)

    def forced_logits(self, ids: Sequence[int], chunk: int | None = None, state_len: int | None = None,
                      start: int = 0) -> np.ndarray:
        """Teacher forcing through the batched path: logits [n - start, V] fp32 of positions
        start..n-1. The ids run as batched prefill does (chunks of `chunk` rows from position 0,
        default default_chunk, the last padded, on a state of `state_len` rows, default
        state_length(n)); chunks holding a position >= start return every row's logits."""
        ids = self.check_ids(ids)
        self.check_fits(len(ids))
        chunk = chunk or default_chunk(len(ids))
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if not 0 <= start < len(ids):
            raise ValueError(f"start must be in [0, {len(ids)}), got {start}")
        L = state_len or state_length(len(ids), self.cfg.max_context)
        self.check_device(L, chunk)
        state = self.new_state(L)
        out = []
        for p in range(0, len(ids), chunk):
            part = ids[p:p + chunk]
            toks = np.zeros((chunk,), np.int32)
            toks[:len(part)] = part
            args = (self.params, state, jnp.asarray(toks), jnp.int32(p), jnp.int32(len(part)), self.rope)
            if p + len(part) <= start:  # nothing scored here: the plain prefill chunk
                _, state = self._step(*args)
                continue
            logits, state = self._all_logits(*args)
            out.append(np.asarray(logits[max(start - p, 0):len(part)]))
        return np.concatenate(out)

    # --- text in, text out -----------------------------------------------------
    def encode(self, prompt) -> list:
        """Text through the tokenizer; a sequence of token ids checked (ints only, no floats)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt is None or isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        return self.check_ids(prompt)

    def generate(self, prompt, max_new_tokens: int = 64, *, prefill: str = "batch", chunk: int | None = None,
                 sampling: Sampling = Sampling(), on_token: Callable[[int], None] | None = None,
                 stop_at_eos: bool = True, keep_state: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        ids = self.check_ids(self.encode(prompt))
        max_new_tokens = checks.as_int("max_new_tokens (--max-new-tokens)", max_new_tokens, lo=0)
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a baro_jax.Sampling, got {type(sampling).__name__}")
        sampler = Sampler(sampling)  # validates it
        if sampling.top_k > self.cfg.vocab_size:
            raise ValueError(f"top_k (--top-k) {sampling.top_k} is larger than the vocabulary of {self.cfg.vocab_size}")
        pre = self.prefill(ids, prefill, chunk, n_new=max_new_tokens, progress=progress)
        logits, state = pre.logits, pre.state
        last_logits = np.asarray(logits)
        out = []
        eos = getattr(self.tokenizer, "eos_id", None) if stop_at_eos else None
        self.reset_expert_cache_stats()  # the hit rate of this request's decode steps
        t0 = time.perf_counter()
        t1 = None  # when the first decode call's tokens were in hand: that call may have compiled
        n1 = 0     # tokens in hand at t1
        pos = len(ids)
        # Greedy runs blocks of decode steps on the device (greedy_decode) unless the caller keeps
        # the state: a block may run past an end-of-sequence token, and a kept state must end there.
        blocks = sampling.greedy and not (keep_state and eos is not None)
        if blocks and max_new_tokens > 0:
            tok = sampler(logits)
            out.append(tok)
            if on_token:
                on_token(tok)
            stop = tok == eos
            if not stop and max_new_tokens > 1:
                for toks, state in self._greedy_blocks(tok, state, pos, max_new_tokens - 1):
                    if t1 is None:
                        t1, n1 = time.perf_counter(), len(out) + len(toks)
                    for t in toks:
                        out.append(t)
                        if on_token:
                            on_token(t)
                        if t == eos:
                            stop = True
                            break
                    if stop:
                        break
        else:
            for i in range(max_new_tokens):
                tok = sampler(logits)
                if i == 1:
                    t1, n1 = time.perf_counter(), 2
                out.append(tok)
                if on_token:
                    on_token(tok)
                if tok == eos:
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
            expert_cache=self.expert_cache_report(),
            chunk=(chunk or self.pick_chunk(len(ids), max_new_tokens)) if prefill == "batch" else None, mode=self.mode,
            last_prompt_logits=last_logits, state=state if keep_state else None)


def check_cache_slots(cache_slots, mode: str) -> int | None:
    """cache_slots as an int >= 0 (None stays None); refused outside tier mode, which alone has the cache."""
    if cache_slots is None:
        return None
    cache_slots = checks.as_int("cache_slots", cache_slots, lo=0)
    if cache_slots and mode != "tier":
        raise ValueError("cache_slots sizes tier mode's decode expert cache; give mode='tier' or leave it out")
    return cache_slots


def env_cache_slots(default: int | None = None) -> int | None:
    """BARO_CACHE_SLOTS: the decode expert cache's slots per layer (0: none); unset -> default (sized by the budget)."""
    v = os.environ.get("BARO_CACHE_SLOTS")
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"BARO_CACHE_SLOTS must be an integer >= 0, got {v!r}") from None
    if n < 0:
        raise ValueError(f"BARO_CACHE_SLOTS must be an integer >= 0, got {v!r}")
    return n


def default_backend(dtype: str = "bfloat16") -> str:
    """The product, `ordered`, when its library is built and the dtype is bf16; else `xla`."""
    from .ops import BackendUnavailable

    if dtype != "bfloat16":
        return "xla"
    try:
        get_ops("ordered")
        return "ordered"
    except BackendUnavailable:
        return "xla"


def _on_devices(eng: Engine, devices: int | None, mesh) -> Engine:
    if devices is None:
        return eng
    from .expert_parallel import shard_engine

    return shard_engine(eng, devices, mesh)


def load(model: str = "tiny", *, backend: str | None = None, dtype: str = "bfloat16", max_context: int | None = None,
         seed: int = 0, progress: bool = True, mode: str | None = None,
         device_budget_gb: float | None = None, variant: str | None = None,
         allow_nonfinite: bool | None = None, delta_rule: str | None = None,
         devices: int | None = None, cache_slots: int | None = None) -> Engine:
    """Load a checkpoint directory or a preset name into an Engine.

    Refused with a message naming the file and field or tensor: a bad config.json, index or
    tokenizer file, a corrupt safetensors header (offsets must tile the file exactly, sized
    dtype x shape), NaN/Inf weights (unless allow_nonfinite; None: env BARO_ALLOW_NONFINITE),
    a max_context beyond the model's.

    variant: an opt-in order-changing variant (xla, attn-fast, delta-chunk; baro_jax/variants.py) on
    the ordered backend: not byte-identical to replay, judged by benchmarks/agreement.py; None: env
    BARO_VARIANT, else none ("none" turns it off whatever the env says).

    delta_rule: "token" (the per-token delta rule, default) or "blocked" (the chunk-aligned rule of
    DESIGN §9: its own bits, identity by construction; opt-in, CPU kernel only so far); None: env
    BARO_DELTA, else token.

    mode: "resident" (every weight in device memory) or "tier" (routed experts in pinned host
    memory, staged per layer; see staging.py); None: env BARO_TIER, else resident.
    device_budget_gb: the device memory to plan for (default: the device's).
    cache_slots: tier mode's decode expert cache, slots per layer (0: none, so it takes no device
    memory: a prefill-only run); None: env BARO_CACHE_SLOTS, else sized by the budget
    (budget.tier_cache_slots).

    devices: expert parallel over this many devices (routed experts sharded along E, everything
    else replicated; expert_parallel.py): the same bytes as one device. 1 runs the same sharded
    code path on one device; None: no mesh."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a checkpoint directory or a preset name (a str), got {type(model).__name__}")
    model = os.fspath(model)
    device_budget_gb = checks.budget_gb(device_budget_gb)
    from .sampling import check_seed

    seed = check_seed(seed)
    mode = mode or env_engine_mode()
    if mode not in ENGINE_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose resident or tier")
    cache_slots = check_cache_slots(cache_slots, mode)  # before any weight is read
    variant = variants.check(variant) if variant is not None else variants.env_variant()
    if variant:
        if backend not in (None, "ordered"):
            raise ValueError(f"variant {variant!r} is built on the ordered backend; drop backend={backend!r} "
                             "(the plain-jnp backend is also the 'xla' variant)")
        backend = "ordered"
    from .config import ConfigError, PRESETS, load_config, preset
    from .tokenizer import ByteTokenizer, load_tokenizer

    backend = backend or default_backend(dtype)
    dt = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}.get(dtype)
    if dt is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose bfloat16 or float32")
    if backend == "ordered" and dt != jnp.bfloat16:
        raise ValueError("the 'ordered' backend runs bfloat16 only; use --dtype bfloat16 or --backend xla")
    get_ops(backend)  # fail early and plainly if the backend is unavailable
    mesh = None
    if devices is not None:  # refused here, before any weight is read or drawn
        from .expert_parallel import check_request, make_mesh

        devices = check_request(devices, mode, backend, variant)
        mesh = make_mesh(devices)
    if model == "tiny":  # the embedded default: a trained checkpoint, loaded like any other
        model = TINY_CHECKPOINT
    from . import staging

    def check(cfg):  # before any weight is read or drawn
        if mode == "tier":
            budget.check_tier(cfg, dt, device_budget_gb, min(MIN_STATE_LEN, cfg.max_context))
        else:
            if devices is not None:
                from .expert_parallel import check_divisible

                check_divisible(cfg.num_experts, devices)
            budget.check_resident(cfg, dt, device_budget_gb, devices=devices or 1)

    from .config import check_delta_rule

    kw = dict(backend=backend, mode=mode, device_budget_gb=device_budget_gb, variant=variant,
              delta_rule=check_delta_rule(delta_rule, "delta_rule (--delta-rule)"), cache_slots=cache_slots)
    if os.path.isdir(model):
        from .weights import load_params

        cfg = load_config(model, max_context)
        check(cfg)
        place = None
        if mode == "tier":  # experts straight to the host store, the rest to the device
            place = lambda t, a: staging.to_store(a) if staging.is_expert_target(t) else jax.device_put(a)  # noqa: E731
        if mesh is not None:  # each tensor straight to its place on the mesh
            from .expert_parallel import place_tensor

            place = lambda t, a: place_tensor(t, a, mesh)  # noqa: E731
        params = load_params(model, cfg, dtype=dt, progress=progress, place=place, allow_nonfinite=allow_nonfinite)
        return _on_devices(Engine(cfg, params, load_tokenizer(model), name=os.path.basename(os.path.normpath(model)),
                                  **kw), devices, mesh)
    name = model
    if name in PRESETS:
        from .synthetic import synthetic_params

        cfg = preset(name, max_context)
        check(cfg)
        place_layer = staging.store_layer_experts if mode == "tier" else None
        if mesh is not None:  # each layer's experts sharded as it is drawn
            from .expert_parallel import place_layer_experts

            place_layer = lambda lp: place_layer_experts(lp, mesh)  # noqa: E731
        params = synthetic_params(cfg, seed=seed, dtype=dt, place_layer=place_layer)
        return _on_devices(Engine(cfg, params, ByteTokenizer(), name=model, **kw), devices, mesh)
    raise ConfigError(f"--model {model!r} is neither a checkpoint directory nor a preset "
                      f"(tiny, {', '.join(PRESETS)})")
