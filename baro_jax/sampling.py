"""Token selection: greedy by default; temperature / top-k / top-p with a seed."""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers

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


def greedy_loop(step, state, token, *, block: int, n=None, acc=None, draw=None):
    """Up to `block` greedy steps in one graph: step(i, state, token, acc) -> (logits, state, acc)
    runs one decode step at offset i, its argmax is fed back. Returns (tokens [block], last token,
    state, acc): tokens past n are -1. n None: exactly `block` steps, a loop whose trip count XLA
    knows (the GPU runtime then reads no predicate back per step); a traced n serves a shorter
    last block with the same graph. acc: what the steps accumulate (None: nothing). draw(i,
    logits): the token of step i instead of the argmax (row_draw: a sampled sequence)."""
    def body(i, carry):
        st, tok, toks, a = carry
        logits, st, a = step(i, st, tok, a)
        nxt = greedy(logits) if draw is None else draw(i, logits)
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


def gumbel_noise(key, n: int):
    """n standard Gumbel values from key: uniform u in [tiny, 1) from the top 23 bits of each random
    word (an exact bit pattern, no multiply-add a compiler could fuse one way in one graph and another
    way in the next), then -log(-log(u))."""
    bits = jax.random.bits(key, (n,), jnp.uint32)
    u = jax.lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32) - np.float32(1.0)
    u = jnp.maximum(u, np.float32(np.finfo(np.float32).tiny))
    return -jnp.log(-jnp.log(u))


def _gumbel_max(z, noise):
    """The draw from softmax(z): argmax of z + the token's Gumbel noise (noise[i] belongs to id i,
    whatever the ranks), ties to the lower index."""
    return jnp.argmax(z + noise, axis=-1).astype(jnp.int32)


# The widest top_k drawn from each row's K_DEVICE best logits (sample_rows' k_max); a sequence
# with a wider top_k, or a top_p < 1 over the whole vocabulary, is drawn from its whole row ranked
# (k_max = V): the same rule, a full sort of the row in place of a selection.
K_DEVICE = 64


def ranks_needed(s: Sampling, vocab: int) -> int:
    """How many of a row's best logits its draw looks at: 0 (greedy, or a plain temperature: the
    whole row unranked), min(K_DEVICE, vocab) (a top_k of at most K_DEVICE), or vocab (a wider
    top_k, or top_p < 1 without a top_k). Decided by the sequence alone."""
    k = 0 if s.top_k >= vocab else s.top_k
    if s.greedy or k == 1 or (k == 0 and s.top_p == 1.0):
        return 0
    return min(K_DEVICE, vocab) if k <= K_DEVICE and k else vocab


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int) -> np.ndarray:
    """The raw uint32[2] key of a seed (jax.random.PRNGKey's), made once: every block of a pool
    asks for every sampled sequence's key, and each made anew is a device round trip."""
    key = np.asarray(jax.random.PRNGKey(seed), np.uint32)
    key.setflags(write=False)
    return key


def row_params(s: Sampling, vocab: int):
    """A sequence's row of sample_rows' inputs: (temperature f32, top_k (0: all), top_p f32, key data
    uint32[2] of its seed)."""
    with np.errstate(over="ignore", under="ignore"):
        t32 = np.float32(s.temperature)
    key = _seed_key(s.seed) if s.temperature else np.zeros(2, np.uint32)
    return t32, np.int32(0 if s.top_k >= vocab else s.top_k), np.float32(s.top_p), key


def _level(x):
    """One level of a fixed-order sum over a whole row (k_max = V): kept apart from the next level,
    so that no fused kernel computes a whole row's tree in one thread; the same values either way."""
    return jax.lax.optimization_barrier(x) if x.shape[-1] > 4096 else x


def _pairwise_sum(x):
    """Row sums of x [P, K] in one fixed order (halves added until one column is left; K padded with
    zeros to a power of two): each row's bits depend on its own values only, and zeros past a row's
    last nonzero value leave them unchanged, whatever K is."""
    K = 1 << max(x.shape[-1] - 1, 0).bit_length()
    x = jnp.pad(x, ((0, 0), (0, K - x.shape[-1])))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = _level(x[:, :h] + x[:, h:])
    return x[:, 0]


def _prefix_sums(x):
    """Inclusive prefix sums of x [P, K] along K in one fixed order (log2 K rounds, each adding the
    value d places back): element j's bits depend on x[:, :j+1] alone."""
    d = 1
    while d < x.shape[-1]:
        x = _level(x + jnp.pad(x[:, :-d], ((0, 0), (d, 0))))
        d *= 2
    return x


def rows_top_k(logits, k: int):
    """Each row's k largest logits and their ids, largest first, ties to the lower id: the kernel
    library's custom_calls.topk.top_k (baro_topk_rows where its knob lets it run, else lax.top_k:
    the same bytes), or lax.top_k where the library is not there (the xla backend runs without it);
    k = V: the whole row ranked by a sort (_ranked)."""
    if k == logits.shape[-1]:
        return _ranked(logits)
    try:
        from custom_calls.topk import top_k
    except ImportError:  # custom_calls missing, or its library not built (LibraryLoadError)
        return jax.lax.top_k(logits, k)
    return top_k(logits, k)


def _ranked(logits):
    """lax.top_k(logits, V)'s bytes: each row whole, largest first in the IEEE total order, equal bit
    patterns by lower id, as one stable sort of 32-bit keys (a radix sort where XLA has one) rather
    than a top_k of V, which XLA lowers to a comparison sort."""
    bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
    key = bits ^ jnp.where(bits >> 31, np.uint32(0xFFFFFFFF), np.uint32(0x80000000))  # unsigned = total order
    ids = jnp.argsort(~key, axis=-1, stable=True).astype(jnp.int32)
    return jnp.take_along_axis(logits, ids, axis=-1), ids


def sample_rows(logits, temperature, top_k, top_p, key_data, index, *, k_max: int):
    """Each row's next id, drawn inside a graph: row r from softmax(logits[r] * (1 / temperature[r]))
    with the key fold_in(key_data[r], index[r]) (key_data: PRNGKey(seed)'s), restricted to its
    top_k largest logits (0: all; ranks on the logits, ties to the lower id) and then to the
    smallest prefix of them whose probability reaches top_p. Greedy where the temperature is 0, top_k is 1 or
    the scaled logits leave float32. The scale is written as one reciprocal per row and a product,
    both correctly rounded, because XLA rewrites a division by a broadcast into exactly that: written
    as a division, the scaled logits (and so the overflow case) would differ from the quotient an
    oracle computes by an ulp at the float32 edge. k_max: at least every row's ranks_needed (k_max_for):
    0, min(K_DEVICE, V), or V (a full ranking of each row, for a wider top_k or top_p < 1 without
    one); any wider k_max gives the same bits (zeros past a row's ranks leave the sums unchanged).
    Every step is per row (elementwise, argmax, top_k, the fixed-order sums above), so a row's id
    is the same bits whatever the other rows are and however many there are."""
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    inv_t = (1.0 / temperature)[:, None]
    z = logits * inv_t
    overflow = jnp.any(jnp.isfinite(logits) & ~jnp.isfinite(z), axis=-1)
    keys = jax.vmap(jax.random.fold_in)(key_data, index)
    noise = jax.vmap(lambda k: gumbel_noise(k, V))(keys)
    drawn = _gumbel_max(z, noise)
    if k_max:
        vals, ids = rows_top_k(logits, k_max)  # ties to the lower id
        zs = vals * inv_t
        j = jnp.arange(k_max)[None, :]
        in_k = (top_k[:, None] == 0) | (j < top_k[:, None])
        e = jnp.where(in_k, jnp.exp(zs - zs[:, :1]), 0.0)
        pr = e / _pairwise_sum(e)[:, None]
        before = jnp.pad(_prefix_sums(pr)[:, :-1], ((0, 0), (1, 0)))
        keep = (j == 0) | ((before < top_p[:, None]) & in_k)
        pick = _gumbel_max(jnp.where(keep, zs, -jnp.inf), jnp.take_along_axis(noise, ids, axis=1))
        ranked = (top_k > 0) | (top_p < 1)
        drawn = jnp.where(ranked, jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0], drawn)
    plain = overflow | (temperature == 0) | (top_k == 1)
    return jnp.where(plain, greedy(logits), drawn).astype(jnp.int32)


SAMPLE_ROWS = jax.jit(sample_rows, static_argnames=("k_max",))


def row_draw(samp, k_max):
    """greedy_loop's draw for one sequence drawn in the graph: samp is its row of sample_rows'
    inputs ([1] each, the index that of the block's first token), step i draws token index + i;
    None (greedy) for samp None."""
    if samp is None:
        return None
    t, k, p, key, index = samp
    return lambda i, logits: sample_rows(logits.reshape(1, -1), t, k, p, key, index + i, k_max=k_max)[0]


def block_inputs(s: Sampling, vocab: int, index: int):
    """(samp, k_max) of a block of one sequence's steps whose first token is its index-th: (None,
    None) where it is greedy."""
    if s.greedy:
        return None, None
    row = row_params(s, vocab) + (np.int32(index),)
    # device arrays, as a pool's rows are: numpy ones would key another compiled graph
    return tuple(jnp.asarray(x[None]) for x in row), k_max_for([s], vocab)


def k_max_for(rows, vocab: int) -> int:
    """sample_rows' k_max for rows of these Samplings: the most ranks any of them needs."""
    return max((ranks_needed(s, vocab) for s in rows), default=0)


def draw_row(logits_row, s: Sampling, index: int):
    """One sequence's index-th token from its logits row [V] as a device scalar (not read): greedy,
    or sample_rows on the row alone."""
    if s.greedy:
        return greedy(logits_row)
    samp, k_max = block_inputs(s, logits_row.shape[-1], index)
    return SAMPLE_ROWS(logits_row[None], *samp, k_max=k_max)[0]


class Sampler:
    """Chooses a sequence's tokens one after another: greedy, or sampled, the index-th token with the
    key fold_in(PRNGKey(seed), index): from (seed, index) alone, never from a batch-wide key or the
    batch position, so a sampled sequence draws the same tokens alone and in any batch."""

    def __init__(self, s: Sampling):
        self.s = s.validate()
        self.index = 0

    def __call__(self, logits) -> int:
        i, self.index = self.index, self.index + 1
        return int(draw_row(logits, self.s, i))
