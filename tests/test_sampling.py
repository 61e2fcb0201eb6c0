"""Sampling at the edges of float32: top_k=1 and tiny temperatures are greedy, ranks are taken on the
logits (ties to the lower id), top_k / top_p keep the documented set, a huge temperature is uniform
over it. Fresh random logits every run (the seed is printed on failure), several vocab sizes, ties."""
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from baro_jax.sampling import (K_DEVICE, SAMPLE_ROWS, Sampler, Sampling, draw_row, greedy, k_max_for, ranks_needed,
                               row_params)

F32_MAX = float(np.finfo(np.float32).max)
# fresh each run; BARO_TEST_SEED=<printed seed> replays a failure
SEED = int(os.environ.get("BARO_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 32))


@pytest.fixture
def rng():
    print(f"test_sampling random seed {SEED}")
    return np.random.default_rng(SEED)


def _logits(rng, v, ties: bool):
    """Model-like logits: bf16 values (so ties happen), scaled like real ones; with ties, the max
    value is repeated at random ids."""
    x = (rng.standard_normal(v) * rng.choice([0.5, 4.0, 30.0])).astype(ml_dtypes.bfloat16).astype(np.float32)
    if ties:
        ids = rng.choice(v, size=min(v, rng.integers(2, 6)), replace=False)
        x[ids] = x.max() + rng.choice([0.0, 1.0, 100.0])
    return x


def _f32(t):
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(t)


def _draw(logits, t, k, p, seed):
    """One sequence's draw (its first token) from logits alone, as Engine.generate draws it."""
    return int(draw_row(jnp.asarray(logits), Sampling(temperature=t, top_k=k, top_p=p, seed=seed), 0))


def _draws(logits, t, k, p, seed, n):
    """n draws from the same logits: a sequence's tokens 0..n-1 (each its own key), in one call of
    n rows."""
    v = len(logits)
    s = Sampling(temperature=t, top_k=k, top_p=p, seed=seed)
    args = _rows_inputs([s] * n, v, np.arange(n))
    return np.asarray(SAMPLE_ROWS(jnp.asarray(np.tile(logits, (n, 1))), *args, k_max=k_max_for([s], v)))


def _greedy(x):
    return int(np.argmax(x))  # numpy: first maximum, the lower id


VOCABS = (2, 7, 256, 4099)
TEMPS = (1e-45, 1e-40, 1e-38, 1e-30, 1e-6, 0.3, 1.0, 7.0, 1e10, 1e38, 3.4e38, 1e39)


@pytest.mark.parametrize("v", VOCABS)
def test_top_k_1_is_greedy_whatever_the_temperature_top_p_or_seed(rng, v):
    for trial in range(12):
        x = _logits(rng, v, ties=trial % 2 == 0)
        assert int(greedy(jnp.asarray(x))) == _greedy(x)
        for t in TEMPS:
            p = float(rng.choice([1e-30, 0.1, 0.9, 1.0]))
            assert _draw(x, t, 1, p, int(rng.integers(1 << 31))) == _greedy(x), (t, p)


@pytest.mark.parametrize("v", VOCABS)
@np.errstate(over="ignore", divide="ignore")  # the overflow is the point
def test_overflowing_temperature_is_greedy(rng, v):
    """Where the scaled logits (logits * (1 / temperature), each correctly rounded) leave float32,
    the choice is greedy for every top_k / top_p / seed."""

    def overflows(big, t):
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            return not np.isfinite(np.float32(big) * (np.float32(1) / _f32(t)))

    for trial in range(10):
        x = _logits(rng, v, ties=trial % 2 == 1)
        big = float(np.abs(x).max())
        # the smallest float32 temperature at which every scaled logit is still finite
        edge = np.float32(big / F32_MAX)
        while overflows(big, edge):
            edge = np.nextafter(edge, np.float32(np.inf))
        below = [float(np.nextafter(edge, np.float32(0))), float(edge) / 3, 1e-45, 0.0]
        for t in below:
            if t > 0 and not overflows(big, t):
                continue  # the scaled logits fit (edge rounding): not the overflow case
            for k in (0, 2, v):
                for p in (1.0, 0.5):
                    assert _draw(x, t, k, p, int(rng.integers(1 << 31))) == _greedy(x), (t, k, p)


@pytest.mark.parametrize("v", VOCABS)
def test_tiny_top_p_keeps_exactly_the_argmax(rng, v):
    for trial in range(10):
        x = _logits(rng, v, ties=True)
        for t in (1e-3, 1.0, 50.0, 1e30):
            for p in (1e-45, 1e-30, 1e-9):
                assert _draw(x, t, 0, p, int(rng.integers(1 << 31))) == _greedy(x), (t, p)


def _kept(x, t, k, p, slack=1e-5):
    """The documented kept set, in float64: ids ranked by logit (ties to the lower id), the first k,
    then the smallest prefix whose probability (at temperature t) reaches p. Where the mass before
    an id lies within `slack` of p (tied ids can land exactly on it: five at 0.2 and p = 0.6), the
    sampler's float32 sums may round either way, so two sets come back: the ids kept for certain
    and the ids that may be kept."""
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if k:
        order = order[:k]
    z = np.array([x[i] / t for i in order], np.float64)
    pr = np.exp(z - z.max())
    pr /= pr.sum()
    before = np.concatenate([[0.0], np.cumsum(pr)[:-1]])
    sure = {i for i, b in zip(order, before) if b < p - slack} | {order[0]}
    maybe = {i for i, b in zip(order, before) if b < p + slack}
    return sure, maybe, dict(zip(order, pr))


def test_huge_temperature_ranks_on_the_logits():
    """At t = 3e38 the scaled logits are subnormal or zero (equal after a flush), yet top_k still
    keeps the largest logits, not the lowest ids, and draws are uniform over them."""
    x = np.array([0.0, 0.5, -1.0, 2.0, 1.0, 2.0, -3.0, 1.5], np.float32)
    for t in (3e38, 1e39):
        ids = _draws(x, t, 3, 1.0, SEED, 3000)
        assert set(ids.tolist()) == {3, 5, 7}
        assert all(abs((ids == i).mean() - 1 / 3) < 0.05 for i in (3, 5, 7))
        ids = _draws(x, t, 0, 0.3, SEED, 3000)
        assert set(ids.tolist()) == {3, 5, 7}  # top_p 0.3 of a uniform 8: the first three ranks


def test_sampler_tiny_temperature_is_greedy(rng):
    for v in VOCABS:
        x = _logits(rng, v, ties=True)
        for t in (1e-300, 1e-45, 1e-39):
            for k in (0, 1, min(4, v)):
                s = Sampler(Sampling(temperature=t, top_k=k, top_p=0.9, seed=int(rng.integers(1 << 62))))
                assert [s(jnp.asarray(x)) for _ in range(3)] == [_greedy(x)] * 3, (v, t, k)


def _rows_inputs(samplings, v, index):
    rows = [row_params(s, v) for s in samplings]
    return tuple(np.stack([r[i] for r in rows]) for i in range(4)) + (np.int32(index),)


def _random_sampling(rng, v):
    """Any sampling: greedy, plain temperature, a top_k of at most K_DEVICE or wider, top_p with or
    without a top_k; temperatures from the edges of float32 to ordinary ones."""
    t = float(rng.choice([0.0, 1e-45, 1e-30, 0.3, 1.0, 1.7, 1e30]))
    k = int(rng.choice([0, 0, 1, 2, 5, min(K_DEVICE, v), K_DEVICE + 1, v + 3]))
    p = float(rng.choice([1.0, 1.0, 0.9, 0.5, 1e-9]))
    return Sampling(temperature=t, top_k=k, top_p=p, seed=int(rng.integers(1 << 62)))


@pytest.mark.parametrize("v", VOCABS)
def test_sample_rows_gives_each_row_its_bits_alone(rng, v):
    """sample_rows over P rows == each row drawn alone (draw_row, P = 1, its own k_max), in bytes,
    for P of 1, 2, an odd count and more than K_DEVICE rows; a wider k_max (the whole row ranked)
    changes no row."""
    for P in (1, 2, 7, 70):
        x = np.stack([_logits(rng, v, ties=r % 3 == 0) for r in range(P)])
        sps = [_random_sampling(rng, v) for _ in range(P)]
        index = rng.integers(0, 1 << 20, P)
        args = (jnp.asarray(x),) + _rows_inputs(sps, v, index)
        got = np.asarray(SAMPLE_ROWS(*args, k_max=k_max_for(sps, v)))
        alone = np.array([int(draw_row(jnp.asarray(x[r]), sps[r], int(index[r]))) for r in range(P)], np.int32)
        assert got.tobytes() == alone.tobytes(), (P, got, alone)
        if 0 < k_max_for(sps, v) < v:  # every row ranked whole: zeros past each row's ranks, the same bits
            wide = np.asarray(SAMPLE_ROWS(*args, k_max=v))
            assert wide.tobytes() == got.tobytes(), (P, wide, got)
        for s, g in zip(sps, got):
            assert 0 <= g < v


@pytest.mark.parametrize("v", (7, 256))
def test_sample_rows_draws_stay_in_the_kept_set_and_follow_its_probabilities(rng, v):
    """The graph's draws keep the documented set (ranks on the logits, top_k, then top_p) and follow
    its renormalised probabilities: top_k within K_DEVICE, wider, and top_p with or without a
    top_k (the whole row ranked)."""
    n = 4000
    for trial in range(4):
        x = _logits(rng, v, ties=trial % 2 == 0) / 4
        t = float(rng.choice([0.7, 1.0, 2.0]))
        k = int(rng.choice([0, 3, 5, min(K_DEVICE + 2, v)]))
        p = float(rng.choice([0.6, 0.95, 1.0]))
        sure, maybe, pr = _kept(x, t, k, p)
        s = Sampling(temperature=t, top_k=k, top_p=p, seed=int(rng.integers(1 << 62)))
        args = _rows_inputs([s] * n, v, np.arange(n))
        ids = np.asarray(SAMPLE_ROWS(jnp.asarray(np.tile(x, (n, 1))), *args, k_max=k_max_for([s], v)))
        drawn = set(ids.tolist())
        assert drawn <= maybe, (drawn - maybe, t, k, p)
        keep = maybe if drawn - sure else sure
        mass = sum(pr[i] for i in keep)
        for i in keep:
            q = pr[i] / mass
            assert abs((ids == i).mean() - q) <= 6 * math.sqrt(q * (1 - q) / n) + 1 / n, (i, q, t, k, p)


def test_ranks_each_sampling_needs():
    v = 1000
    assert ranks_needed(Sampling(), v) == 0
    assert ranks_needed(Sampling(temperature=1.0), v) == 0
    assert ranks_needed(Sampling(temperature=1.0, top_k=v), v) == 0  # all of them: plain temperature
    assert ranks_needed(Sampling(temperature=1.0, top_k=1, top_p=0.5), v) == 0  # greedy
    assert ranks_needed(Sampling(temperature=1.0, top_k=K_DEVICE, top_p=0.5), v) == K_DEVICE
    assert ranks_needed(Sampling(temperature=1.0, top_k=K_DEVICE + 1), v) == v
    assert ranks_needed(Sampling(temperature=1.0, top_p=0.9), v) == v
    assert ranks_needed(Sampling(temperature=1.0, top_k=v, top_p=0.9), v) == v
    assert k_max_for([Sampling(temperature=1.0), Sampling()], v) == 0
    assert k_max_for([], v) == 0
    assert k_max_for([Sampling(temperature=1.0, top_k=3)], v) == K_DEVICE
    assert k_max_for([Sampling(temperature=1.0, top_k=3), Sampling(temperature=1.0, top_p=0.9)], v) == v
    assert k_max_for([Sampling(temperature=1.0, top_k=3)], 7) == 7


@pytest.mark.parametrize("v", (300, 4099))
def test_sample_rows_same_bytes_with_either_top_k(rng, v, monkeypatch):
    """BARO_TOPK_ROWS picks baro_topk_rows or lax.top_k for the draw's top_k when the graph is
    traced: the same ids either way, and the setting reaches the graph (the custom call is in it
    only where it runs)."""
    from baro_jax.sampling import sample_rows

    P = 9
    x = np.stack([_logits(rng, v, ties=r % 2 == 0) for r in range(P)])
    sps = [Sampling(temperature=0.8, top_k=int(rng.integers(2, K_DEVICE + 1)), top_p=float(rng.choice([1.0, 0.7])),
                    seed=int(rng.integers(1 << 62))) for _ in range(P)]
    args = (jnp.asarray(x),) + _rows_inputs(sps, v, rng.integers(0, 1 << 20, P))
    got = {}
    for where in ("all", "cpu", "off"):
        monkeypatch.setenv("BARO_TOPK_ROWS", where)
        # a fresh function, so a fresh trace (jit caches traces by function): the knob is read there
        f = jax.jit(lambda *a, k_max: sample_rows(*a, k_max=k_max), static_argnames=("k_max",))
        hlo = f.lower(*args, k_max=k_max_for(sps, v)).as_text()
        assert ("baro_topk_rows" in hlo) == (where != "off"), where  # on the CPU: all and cpu alike
        got[where] = np.asarray(f(*args, k_max=k_max_for(sps, v)))
    assert got["cpu"].tobytes() == got["off"].tobytes() == got["all"].tobytes()


@pytest.mark.parametrize("v", (2, 7, 4099))
def test_whole_row_ranking_is_lax_top_k_of_v(rng, v):
    """rows_top_k(x, V), the whole row ranked by one stable sort of keys, has lax.top_k(x, V)'s
    bytes: ties across the row, +-0, infinities and NaNs of both signs, rows alone and together."""
    from baro_jax.sampling import rows_top_k

    P = 5
    x = np.stack([_logits(rng, v, ties=r % 2 == 0) for r in range(P)])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    for r in range(1, P):
        at = rng.choice(v, size=min(v, int(rng.integers(1, 7))), replace=False)
        x[r, at] = rng.choice(specials, size=len(at))
    want = jax.lax.top_k(jnp.asarray(x), v)
    got = jax.jit(rows_top_k, static_argnums=1)(jnp.asarray(x), v)
    for g, w in zip(got, want):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
    for r in range(P):
        alone = rows_top_k(jnp.asarray(x[r:r + 1]), v)
        assert all(np.asarray(a)[0].tobytes() == np.asarray(g)[r].tobytes() for a, g in zip(alone, got))
