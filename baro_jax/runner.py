"""Runners: where the weights live and how one forward runs over them.

The Engine (engine.py) is the API: checks, prefill loops, sampling, results. It asks a
runner for these things and knows nothing of placement:

- `new_state(length)`: a zeroed per-layer state with a KV cache of `length` positions;
- `forward(state, tokens, pos, n_valid, all_logits=False)`: m rows at positions pos.. (a
  prefill chunk, or a decode step at m = 1) -> (logits, state), the state donated;
- `greedy_block(state, token, pos, n, block, samp=None, k_max=None)`: up to `block` decode steps
  in one device graph, each token the argmax or (samp, sampling.block_inputs) a sampled
  sequence's draw -> (tokens on the device [block], last token, state); `decode_block` says how
  many steps a call may take (1: the runner cannot loop on the device, the engine steps it from
  the host); `replay(state, tokens, pos)` likewise runs `replay_block` of a prompt's own tokens
  (the replay prefill);
- `check_budget(state_len, chunk)`: refuse, before any work, what cannot fit;
- `pick_chunk(n_prompt, n_new)`: the default prefill chunk.

Three placements implement it: ResidentRunner (here: every weight in device memory),
TierRunner (tier.py: routed experts in pinned host memory) and ExpertParallelRunner
(expert_parallel.py: routed experts sharded over a mesh). All run model.py's functions, so
they give the same bytes.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import budget
from . import model as M
from .config import Config
from .sampling import greedy_loop, row_draw
from .settings import Settings
from .shapes import default_chunk, state_length


def greedy_steps(forward_row, state, token, pos, n, *, block: int, acc=None, draw=None):
    """The one greedy block loop: up to `block` decode steps in one graph, each step's argmax fed
    back. forward_row(state, tokens [1], pos, acc) -> (logits, state, acc) is one decode step (the
    same graph as the m = 1 forward, so the bits are the per-token loop's). Returns (tokens
    [block] (-1 past n), last token, state, acc).

    n None: exactly `block` steps, a loop whose trip count XLA knows, so the GPU runtime runs it
    without reading a predicate back to the host every step; a traced n (1..block) serves the
    shorter last block of a request with one graph for every length. draw: greedy_loop's (a
    sampled sequence's tokens drawn in the graph)."""
    def step(i, st, tok, a):
        return forward_row(st, tok[None], pos + i, a)

    return greedy_loop(step, state, token, block=block, n=n, acc=acc, draw=draw)


def _resident_greedy(params, state, token, pos, n, rope, samp=None, *, cfg: Config, ops, block: int, k_max=None):
    def row(st, toks, p, acc):
        logits, st = M.forward(params, st, toks, p, jnp.int32(1), rope, cfg=cfg, ops=ops)
        return logits, st, acc

    toks, last, st, _ = greedy_steps(row, state, token, pos, n, block=block, draw=row_draw(samp, k_max))
    return toks, last, st


def _resident_replay(params, state, tokens, pos, rope, *, cfg: Config, ops):
    """len(tokens) decode steps in one graph, token i at pos + i: the prompt's own tokens fed in
    (replay), not the argmax. Each step is the m = 1 forward, so the state's bits are those of as
    many FORWARD calls; no step's logits leave the loop, so XLA drops the lm_head from it."""
    def body(i, st):
        _, st = M.forward(params, st, jax.lax.dynamic_slice_in_dim(tokens, i, 1), pos + i, jnp.int32(1), rope,
                          cfg=cfg, ops=ops)
        return st

    return jax.lax.fori_loop(0, tokens.shape[0], body, state)


# Module-level jits keyed on (cfg, ops): runners of the same model share compiled graphs.
FORWARD = jax.jit(M.forward, static_argnames=("cfg", "ops", "all_logits"), donate_argnums=(1,))
ALL_LOGITS = jax.jit(partial(M.forward, all_logits=True), static_argnames=("cfg", "ops"))
GREEDY = jax.jit(_resident_greedy, static_argnames=("cfg", "ops", "block", "k_max"), donate_argnums=(1,))
GREEDY_FULL = jax.jit(partial(_resident_greedy, n=None), static_argnames=("cfg", "ops", "block", "k_max"),
                      donate_argnums=(1,))
REPLAY = jax.jit(_resident_replay, static_argnames=("cfg", "ops"), donate_argnums=(1,))


def to_device(*xs) -> tuple:
    """Host arrays and scalars as device arrays in one transfer call (jnp.asarray and jnp.int32
    dispatch a copy or a convert each: host time with the device waiting, docs/PERF.md), for
    inputs that must be device arrays: the pool's, which its warm-up compiled against, and tier
    mode's, which each layer's call would otherwise copy again. Uncommitted, as those were."""
    return tuple(jax.device_put(xs))


# A fresh state in one dispatch: eagerly, its ~80 zeroed buffers were as many host round trips,
# 39 ms before an 8k prompt's first chunk on the H100 host (prefill_profile_8192_6e691b6_h100.json).
ZERO_STATE = jax.jit(M.init_state, static_argnums=(0, 1, 2))


class Runner:
    """What every placement shares: the model, its ops, the rope tables and the settings."""

    placement = "resident"
    devices: int | None = None  # expert parallel: the mesh's size
    # where a decode's first greedy block takes its token: where the block graphs put their
    # output token (None: a host scalar, which jit keys the same as a resident graph's output)
    token_sharding = None

    def __init__(self, cfg: Config, params, ops, settings: Settings):
        self.cfg, self.params, self.ops, self.settings = cfg, params, ops, settings
        self.dtype = params["embed"].dtype
        self.rope = M.rope_tables(cfg, cfg.max_context)

    @property
    def budget_gb(self):
        return self.settings.device_budget_gb

    def new_state(self, length: int):
        return ZERO_STATE(self.cfg, self.dtype, length)

    @property
    def decode_block(self) -> int:
        return self.settings.decode_block

    # placement-specific; the defaults below are resident mode's
    def forward(self, state, tokens, pos, n_valid, all_logits: bool = False):
        if all_logits:
            return ALL_LOGITS(self.params, state, tokens, pos, n_valid, self.rope, cfg=self.cfg, ops=self.ops)
        return FORWARD(self.params, state, tokens, pos, n_valid, self.rope, cfg=self.cfg, ops=self.ops)

    def greedy_block(self, state, token, pos, n: int, block: int, samp=None, k_max=None):
        """n (1..block) decode steps in one graph: each step's argmax fed back, or with samp
        (sampling.block_inputs) the sequence's draw."""
        if n == block:
            return GREEDY_FULL(self.params, state, token, pos, rope=self.rope, samp=samp, cfg=self.cfg, ops=self.ops,
                               block=block, k_max=k_max)
        return GREEDY(self.params, state, token, pos, np.int32(n), self.rope, samp, cfg=self.cfg, ops=self.ops,
                      block=block, k_max=k_max)

    @property
    def replay_block(self) -> int:
        """Prompt tokens one replay call runs on the device (1: the engine runs the decode step
        per token from the host)."""
        return self.decode_block

    def replay(self, state, tokens, pos):
        """replay_block decode steps of the prompt's tokens (int32 [replay_block]) from pos in one
        graph -> the state (donated in). The same bits as one forward call per token."""
        return REPLAY(self.params, state, np.asarray(tokens, np.int32), np.int32(pos), self.rope, cfg=self.cfg,
                      ops=self.ops)

    def check_budget(self, state_len: int, chunk: int = 0):
        budget.check_resident(self.cfg, self.dtype, self.budget_gb, state_len, chunk, self.devices or 1)

    def pick_chunk(self, n_prompt: int, n_new: int = 0) -> int:
        """default_chunk, halved while the request's KV/state and the chunk's activations do not fit
        beside the weights (an 8k prompt of the 35B-A3B on an 80 GB card: 4096, not 8192)."""
        L = state_length(n_prompt + n_new, self.cfg.max_context)
        return budget.largest_fitting_chunk(lambda c: self.check_budget(L, c), default_chunk(n_prompt))

    # the decode expert cache: tier mode's alone
    cache_slots = 0

    def expert_cache_report(self) -> dict | None:
        return None

    def reset_stats(self):
        pass

    def use_expert_cache(self, slots: int | None = None):
        raise ValueError("the decode expert cache is for tier mode (mode='tier', --mode tier)")

    def recover(self):
        """After a call that did not finish (an interrupt, an exception in a callback): leave the
        runner as usable as before it. Resident weights are never donated: nothing to do."""


class ResidentRunner(Runner):
    """Every weight in device memory; the whole forward is one jitted graph."""
