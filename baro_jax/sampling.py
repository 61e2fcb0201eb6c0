"""Token selection: greedy by default; temperature / top-k / top-p with a seed."""
from __future__ import annotations

import dataclasses
import math
import numbers
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


SEED_RANGE = (0, 2**63 - 1)  # what jax.random.key takes (a C long); negative seeds are refused too


def check_seed(seed) -> int:
    """The seed as an int, or a ValueError/TypeError naming it (jax overflows past a C long)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__} {seed!r}")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
    return int(seed)


def greedy_loop(step, state, token, *, block: int, n=None, acc=None):
    """Up to `block` greedy steps in one graph: step(i, state, token, acc) -> (logits, state, acc)
    runs one decode step at offset i, its argmax is fed back. Returns (tokens [block], last token,
    state, acc): tokens past n are -1. n None: exactly `block` steps, a loop whose trip count XLA
    knows (the GPU runtime then reads no predicate back per step); a traced n serves a shorter
    last block with the same graph. acc: what the steps accumulate (None: nothing)."""
    def body(i, carry):
        st, tok, toks, a = carry
        logits, st, a = step(i, st, tok, a)
        nxt = greedy(logits)
        return st, nxt, toks.at[i].set(nxt), a

    steps = block if n is None else n
    st, last, toks, acc = jax.lax.fori_loop(0, steps, body, (state, token, jnp.full((block,), -1, jnp.int32), acc))
    return toks, last, st, acc


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "Sampling":
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v}")
        for name in ("top_k", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_seed(self.seed)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@jax.jit
def greedy(logits):
    # argmax breaks ties towards the lower id, so greedy is deterministic.
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("top_k",))
def sample(logits, key, temperature, top_k: int, top_p):
    """One id drawn from softmax(logits / temperature), restricted to the top_k largest logits
    (0: all) and then to the smallest prefix of them whose probability reaches top_p. Ranks are
    taken on the logits themselves, ties to the lower id as in greedy, so a temperature that squashes
    the scaled logits together (1e38) does not reorder them, and top_k=1 or a tiny top_p is greedy.
    A temperature so small that logits / temperature leaves float32 (or rounds to zero) is the
    t -> 0 limit: greedy, not a draw among the ids the division made infinite."""
    if top_k == 1:
        return greedy(logits)
    logits = logits.astype(jnp.float32)
    z = logits / temperature
    overflow = jnp.any(jnp.isfinite(logits) & ~jnp.isfinite(z))
    order = jnp.argsort(-logits, stable=True)  # descending, equal logits in id order
    sz = z[order]
    if top_k:
        sz = jnp.where(jnp.arange(sz.shape[-1]) < top_k, sz, -jnp.inf)
    cum = jnp.cumsum(jax.nn.softmax(sz))
    mass_before = jnp.concatenate([jnp.zeros((1,), cum.dtype), cum[:-1]])
    keep = (jnp.arange(sz.shape[-1]) == 0) | ((mass_before < top_p) & (sz > -jnp.inf))
    drawn = order[jax.random.categorical(key, jnp.where(keep, sz, -jnp.inf))]
    return jnp.where(overflow, greedy(logits), drawn).astype(jnp.int32)


def token_key(seed: int, index: int):
    """The randomness of a sequence's index-th generated token: from (seed, index) alone, never
    from a batch-wide key or the batch position, so a sampled sequence draws the same tokens
    alone and in any batch."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), index)


class Sampler:
    """Chooses a sequence's tokens one after another: greedy, or sampled with the index-th token's
    key token_key(seed, index)."""

    def __init__(self, s: Sampling):
        self.s = s.validate()
        self.index = 0
        with np.errstate(over="ignore", under="ignore"):  # 1e39 -> inf and 1e-50 -> 0: sample's limits
            self.t32 = np.float32(s.temperature)

    def __call__(self, logits) -> int:
        i, self.index = self.index, self.index + 1
        if self.s.greedy:
            return int(greedy(logits))
        return int(sample(logits, token_key(self.s.seed, i), self.t32, self.s.top_k, jnp.float32(self.s.top_p)))
