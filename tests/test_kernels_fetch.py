"""baro_fetch_experts (custom_calls.FetchRing): the copy engine's copies through the ring,
refusals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import bf16, put
from kernel_util import platform, store_put


def test_fetch_experts_copies_through_the_ring(platform):
    """FetchRing.fetch: pool[slot] = store[expert] for each pair, every other slot as it was, over
    more calls than the ring has entries (0, 1 and several pairs), on the device the pools live on
    (the store in pinned host memory on a GPU: copy-engine copies)."""
    rng = np.random.default_rng(1703)
    E, D, I, S = 9, 64, 48, 4
    gu = bf16(rng, E, 2 * I, D)
    dn = bf16(rng, E, D, I)
    host = cc.host_store(store_put(platform, gu), store_put(platform, dn))
    ring = cc.FetchRing(3, entries=3)
    want_gu, want_dn = bf16(rng, S, 2 * I, D), bf16(rng, S, D, I)  # random start: untouched slots keep it
    pg, pd = put(platform, want_gu, want_dn)
    for call in range(8):
        n = (0, 1, 3, 2)[call % 4]
        ee = rng.choice(E, n, replace=False)
        ss = rng.choice(S, n, replace=False)
        pg, pd = ring.fetch(pg, pd, host, ee, ss)
        for e, s_ in zip(ee, ss):
            want_gu[s_], want_dn[s_] = gu[e], dn[e]
        assert np.asarray(pg).tobytes() == want_gu.tobytes(), f"gate_up pool after call {call}"
        assert np.asarray(pd).tobytes() == want_dn.tobytes(), f"down pool after call {call}"
    assert ring.runs == ring.calls == 8


def test_fetch_experts_refuses_bad_calls():
    rng = np.random.default_rng(1704)
    E, D, I, S = 5, 32, 16, 2
    host = cc.host_store(jnp.asarray(bf16(rng, E, 2 * I, D)), jnp.asarray(bf16(rng, E, D, I)))
    ring = cc.FetchRing(2, entries=2)
    pools = lambda: (jnp.zeros((S, 2 * I, D), jnp.bfloat16), jnp.zeros((S, D, I), jnp.bfloat16))  # noqa: E731
    with pytest.raises(ValueError, match=r"baro_fetch_experts: experts must be in \[0, E=5\) and slots in \[0, S=2\)"):
        ring.fetch(*pools(), host, [5], [0])
    with pytest.raises(ValueError, match=r"at most n_max=2"):
        ring.fetch(*pools(), host, [0, 1, 2], [0, 1, 1])
    with pytest.raises(ValueError, match=r"pool_dn must have shape \[2, 32, 16\]"):
        ring.fetch(jnp.zeros((S, 2 * I, D), jnp.bfloat16), jnp.zeros((S, D, 8), jnp.bfloat16), host, [0], [0])
    with pytest.raises(TypeError, match="host must be a HostStore"):
        ring.fetch(*pools(), (0, 0), [0], [0])
    assert ring.calls == ring.runs == 0  # nothing refused reached the handler
    ring.fetch(*pools(), host, [1], [1])
    ring.buf[4 + (ring.calls % ring.R) * ring.width] = 7  # the next run's entry out of step: refused
    with pytest.raises(Exception, match=r"ring entry for run 1 holds run 7"):
        jax.block_until_ready(ring._jit(*pools()))
    with pytest.raises(ValueError, match="n_max >= 1"):
        cc.FetchRing(0)
