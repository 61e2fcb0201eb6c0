"""baro_moe and its variants (small ops, pairs/combine, slots, host store, route): row
independence, tile configs and one-token knobs give the same bytes, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import BF16, J_MOE, assert_close, assert_same_bits, bf16, f64, put, ref_moe
from kernel_util import (MO_D, MO_E, MO_K, M_LIST, force_tile, gemm_tiles_for, moe_weights,
                         moe_weights_sized, platform, poison, store_put)

# Against the float64 reference: each expert's output is rounded to bf16 (NUMERICS.md, moe step
# 3), so where the kernel's fp32 value and the reference's lie on either side of a rounding tie
# the two differ by one bf16 ulp of that pair, the bound every bf16 output's test here uses.
# Whether the rounding is applied is checked in bytes (test_moe_combine_rounds_each_expert_to_bf16).
MOE_REL = 2 ** -8


@pytest.mark.parametrize("m", M_LIST)
def test_moe(platform, m):
    rng = np.random.default_rng(700 + m)
    h = bf16(rng, m, MO_D)
    wts = moe_weights(rng)
    wd = put(platform, *wts)
    full = np.asarray(J_MOE(put(platform, h), *wd, top_k=MO_K))
    assert full.dtype == np.float32 and full.shape == (m, MO_D)
    for i in range(m):
        one = np.asarray(J_MOE(put(platform, h[i:i + 1]), *wd, top_k=MO_K))
        assert_same_bits(one[0], full[i], f"moe row {i} of m={m}")
    perm = rng.permutation(m)
    assert_same_bits(np.asarray(J_MOE(put(platform, h[perm]), *wd, top_k=MO_K)), full[perm],
                     "moe permuted rows")
    assert_close(full, ref_moe(h, *wts, MO_K), MOE_REL, "moe vs float64")


# E = 8, top_k = 2: m = 5 -> about 1 pair per expert (16-row grouped tiles),
# m = 64 -> 16 (64-row pipelined tiles), m = 300 / 700 -> 75 / 175 (128-row
# tiles, several per expert at 700, and several 512-pair grouping chunks).
# D = 136 and I = 72 cross a BK of 64 with a half-filled last 16-step, and
# 2I = 144 gives two N tiles of the fused SwiGLU epilogue (64 columns each);
# D = 36 has no 16-byte loads (simple kernel, separate SwiGLU pass). D = 256, I = 80: every K a
# multiple of 16, so the forced "16-stream" tiles run the grouped slots on gemm_row1.cuh's stream
# and 9 rows its plain GEMMs (the shared expert) by default.
@pytest.mark.parametrize("m,D,I", [(5, 136, 72), (64, 136, 72), (300, 136, 72), (700, 136, 72),
                                   (300, 36, 20), (9, 256, 80), (64, 256, 80)])
def test_moe_tiles(platform, m, D, I, monkeypatch):
    E, Is, k = 8, 40, 2
    rng = np.random.default_rng(950 + m + D)
    h = bf16(rng, m, D)
    wts = moe_weights_sized(rng, E, D, I, Is)
    wd = put(platform, *wts)
    poison(platform, (m, D))
    full = np.asarray(J_MOE(put(platform, h), *wd, top_k=k))
    assert np.all(np.isfinite(full)), "moe left elements unwritten"
    rows = range(m) if m <= 64 or platform.platform == "gpu" else sorted(
        set(rng.choice(m, 24, replace=False)) | {0, m - 1})
    for i in rows:
        one = np.asarray(J_MOE(put(platform, h[i:i + 1]), *wd, top_k=k))
        assert_same_bits(one[0], full[i], f"moe m={m} D={D} row {i} vs one-row call")
    perm = rng.permutation(m)
    assert_same_bits(np.asarray(J_MOE(put(platform, h[perm]), *wd, top_k=k)), full[perm],
                     f"moe m={m} D={D} permuted rows")
    for tile in gemm_tiles_for(platform):
        force_tile(monkeypatch, tile)
        poison(platform, (m, D))
        got = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
        assert_same_bits(got, full, f"moe m={m} D={D} forced tile {tile}")
        if tile == "16-simple":  # m = 1 on the simple kernel and the separate SwiGLU pass
            one = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h[m - 1:]), *wd))
            assert_same_bits(one[0], full[m - 1], f"moe D={D} one row on the simple kernel")
    force_tile(monkeypatch, None)
    assert_close(full, ref_moe(h, *wts, k), MOE_REL, f"moe m={m} D={D} vs float64")


# One token through the MoE: every GEMM (router, grouped gate/up with the fused SwiGLU,
# grouped down, shared expert, shared gate N = 1) on gemm_row1 when K % 16 == 0, against
# BARO_GEMM_ROW1=off (gemm_rows16) and the token's row in a batched call. D = 256,
# I = 80, Is = 48: every K a multiple of 16; Is = 40 puts the shared down (K = 40) on the
# fallback. E = 256, top_k = 8 is the model's routing. I == Is: the one-token fold (the
# shared gate as the router's row E, the shared expert as one more grouped row, top-k and
# grouping in one warp) against BARO_MOE_FOLD=0, the separate launches; E = 300 takes the
# one-token route's 16-per-lane registers (E <= 256: 8 per lane). The fold's default (CUDA)
# routes inside the gate/up GEMM and combines inside the down GEMM (3 launches); against
# BARO_MOE_TAIL=0, the route and combine kernels (=combine: the route kernel, the combine inside
# the down GEMM); BARO_PDL=1 launches the fold's later kernels
# as programmatic dependents (sm_90).
KNOBS_ONE_ROW = [{}, {"BARO_GEMM_ROW1": "off"}, {"BARO_MOE_FOLD": "0"}, {"BARO_MOE_TAIL": "0"},
                 {"BARO_MOE_TAIL": "combine"}, {"BARO_PDL": "1"}, {"BARO_PDL": "1", "BARO_MOE_TAIL": "0"},
                 {"BARO_PDL": "1", "BARO_MOE_TAIL": "combine"}]
KNOB_NAMES_ONE_ROW = ("BARO_GEMM_ROW1", "BARO_MOE_FOLD", "BARO_MOE_TAIL", "BARO_PDL", "BARO_MOE_HOST")


def set_knobs(monkeypatch, knobs):
    """Exactly `knobs` of the one-token MoE's knobs set (the others unset)."""
    for kn in KNOB_NAMES_ONE_ROW:
        monkeypatch.delenv(kn, raising=False)
    for kn, v in knobs.items():
        monkeypatch.setenv(kn, v)


@pytest.mark.parametrize("E,D,I,Is,k", [(8, 256, 80, 48, 2), (256, 256, 80, 40, 8), (8, 256, 64, 64, 3),
                                        (256, 256, 80, 80, 8), (300, 256, 80, 80, 8)])
def test_moe_row1(platform, E, D, I, Is, k, monkeypatch):
    rng = np.random.default_rng(1400 + E + Is)
    h = bf16(rng, 9, D)
    wd = put(platform, *moe_weights_sized(rng, E, D, I, Is))
    full = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
    for i in (0, 8):
        for knobs in KNOBS_ONE_ROW:
            set_knobs(monkeypatch, knobs)
            poison(platform, (1, D))  # a fresh jit: the launcher reads the knob when the graph is built
            one = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h[i:i + 1]), *wd))
            assert np.all(np.isfinite(one)), f"moe E={E} one row left elements unwritten ({knobs})"
            assert_same_bits(one[0], full[i], f"moe E={E} D={D} I={I} Is={Is} row {i} one-row call ({knobs})")
    set_knobs(monkeypatch, {})


@pytest.mark.parametrize("E", [512, 600])
def test_moe_many_experts(platform, E):
    """E = 512 is the largest router row kept in registers by the GPU top-k,
    E = 600 takes its in-memory path (CPU: one path); rows stay independent."""
    m, D, I, Is, k = 7, 32, 16, 24, 4
    rng = np.random.default_rng(990 + E)
    h = bf16(rng, m, D)
    wts = moe_weights_sized(rng, E, D, I, Is)
    wd = put(platform, *wts)
    poison(platform, (m, D))
    full = np.asarray(J_MOE(put(platform, h), *wd, top_k=k))
    for i in range(m):
        one = np.asarray(J_MOE(put(platform, h[i:i + 1]), *wd, top_k=k))
        assert_same_bits(one[0], full[i], f"moe E={E} row {i} vs one-row call")
    assert_close(full, ref_moe(h, *wts, k), MOE_REL, f"moe E={E} vs float64")


J_PAIRS = jax.jit(cc.moe_pairs, static_argnames=("top_k",))
J_COMBINE = jax.jit(cc.moe_combine)


def shard_pairs(platform, h, wts, n, k):
    """moe_pairs on n expert shards, each pair's row taken from its owner (selects only)."""
    router, gu, dn = wts[0], wts[1], wts[2]
    E = router.shape[0]
    el = E // n
    outs = []
    for j in range(n):
        poison(platform, (h.shape[0], k, h.shape[1]))
        outs.append(J_PAIRS(*put(platform, h, router, gu[j * el:(j + 1) * el], dn[j * el:(j + 1) * el],
                                 np.array([j * el], np.int32)), top_k=k))
    ids = np.asarray(outs[0][2])
    y = np.asarray(outs[0][0])
    for j in range(1, n):
        y = np.where((ids // el == j)[..., None], np.asarray(outs[j][0]), y)
    return outs, y, np.asarray(outs[0][1]), ids


@pytest.mark.parametrize("m", M_LIST)
def test_moe_pairs_combine_equal_moe(platform, m):
    """Expert parallel's two kernels: for 1, 2 and 4 shards, every shard's routing (ids, weights)
    is the same, a pair's output is exact 0 on the shards that do not own its expert, and the
    combine of the owners' rows is baro_moe's bytes; rows are independent (one-row calls)."""
    rng = np.random.default_rng(760 + m)
    h = bf16(rng, m, MO_D)
    wts = moe_weights(rng)
    full = np.asarray(J_MOE(*put(platform, h, *wts), top_k=MO_K))
    for n in (1, 2, 4):
        outs, y, w, ids = shard_pairs(platform, h, wts, n, MO_K)
        el = MO_E // n
        for j, (yj, wj, idj) in enumerate(outs):
            assert_same_bits(np.asarray(idj), ids, f"moe_pairs ids of shard {j}/{n}")
            assert_same_bits(np.asarray(wj), w, f"moe_pairs weights of shard {j}/{n}")
            other = (ids // el != j)
            assert np.all(np.asarray(yj)[other] == 0.0), f"shard {j}/{n}: a pair of another shard is not 0"
        got = np.asarray(J_COMBINE(*put(platform, h, y, w, *wts[3:])))
        assert_same_bits(got, full, f"moe_combine of {n} shards' pairs vs moe, m={m}")
    _, y1, w1, _ = shard_pairs(platform, h, wts, 2, MO_K)
    for i in range(m):
        _, yi, wi, _ = shard_pairs(platform, h[i:i + 1], wts, 2, MO_K)
        assert_same_bits(yi[0], y1[i], f"moe_pairs row {i} of m={m} vs one-row call")
        assert_same_bits(wi[0], w1[i], f"moe_pairs weights row {i}")


@pytest.mark.parametrize("m", [1, 2, 7, 33])
def test_moe_combine_rounds_each_expert_to_bf16(platform, m):
    """The combine's rounding point in bytes: each pair's y enters the slot-order sum as bf16(y).
    With weights that are powers of two the products are exact and two of them add exactly in
    float64, so fma(w1, bf16(y1), w0 * bf16(y0)) is that float64 sum rounded once; a zero shared
    expert adds sigmoid(0) * 0. Fresh fp32 y (not bf16 values), poisoned output."""
    rng = np.random.default_rng(880 + m)
    y = rng.standard_normal((m, 2, MO_D)).astype(np.float32) * np.float32(3.0)
    w = np.tile(np.array([[0.5, 0.25]], np.float32), (m, 1))
    h = bf16(rng, m, MO_D)
    zero = [np.zeros_like(a) for a in moe_weights(rng)[3:]]
    poison(platform, (m, MO_D))
    got = np.asarray(J_COMBINE(*put(platform, h, y, w, *zero)))
    yb = f64(y.astype(BF16))
    want = (0.5 * yb[:, 0] + 0.25 * yb[:, 1]).astype(np.float32)
    assert_same_bits(got, want, f"moe_combine m={m}: bf16(y) in slot order")
    unrounded = (0.5 * f64(y[:, 0]) + 0.25 * f64(y[:, 1])).astype(np.float32)
    assert np.mean(got != unrounded) > 0.9, "the fp32 pair rows would give these bytes: no rounding"


@pytest.mark.parametrize("m", [1, 5])
def test_moe_combine_rounds_the_shared_expert_to_bf16(platform, m):
    """The shared expert's rounding point in bytes: with every pair weight 0 (routed = +0) and a
    zero shared gate (sigmoid(0) = 0.5 exactly), out = 0.5 * bf16(s), so 2 * out is a bf16 value
    everywhere; s itself, a dot of random weights, almost never is."""
    rng = np.random.default_rng(890 + m)
    y = rng.standard_normal((m, 2, MO_D)).astype(np.float32)
    w = np.zeros((m, 2), np.float32)
    h = bf16(rng, m, MO_D)
    sgu, sdn, sg = moe_weights(rng)[3:]
    poison(platform, (m, MO_D))
    got = np.asarray(J_COMBINE(*put(platform, h, y, w, sgu, sdn, np.zeros_like(sg))))
    twice = got * np.float32(2.0)
    assert np.count_nonzero(twice) > 0.9 * twice.size, "the shared expert gave zeros: nothing to check"
    assert_same_bits(twice, twice.astype(BF16).astype(np.float32), f"moe_combine m={m}: 2 * out is bf16(s)")


def test_moe_pairs_combine_errors(platform):
    rng = np.random.default_rng(9)
    h = bf16(rng, 3, MO_D)
    router, gu, dn, sgu, sdn, sg = moe_weights(rng)
    base = np.array([0], np.int32)
    with pytest.raises(ValueError, match="baro_moe_pairs: expert_base"):
        cc.moe_pairs(*put(platform, h, router, gu, dn), np.int32(0), MO_K)
    with pytest.raises(ValueError, match="baro_moe_pairs: w_down"):
        cc.moe_pairs(*put(platform, h, router, gu, dn[:3], base), MO_K)
    with pytest.raises(ValueError, match="baro_moe_pairs: top_k=9 exceeds"):
        cc.moe_pairs(*put(platform, h, router, gu, dn, base), 9)
    y = np.zeros((3, MO_K, MO_D), np.float32)
    with pytest.raises(ValueError, match="baro_moe_combine: w"):
        cc.moe_combine(*put(platform, h, y, np.zeros((3, MO_K + 1), np.float32), sgu, sdn, sg))
    with pytest.raises(ValueError, match="baro_moe_combine: y"):
        cc.moe_combine(*put(platform, h, y.astype(np.float16), np.zeros((3, MO_K), np.float32), sgu, sdn, sg))


def test_moe_ties_to_lower_id(platform):
    rng = np.random.default_rng(11)
    h = bf16(rng, 6, MO_D)
    router, gu, down, sgu, sdown, sgate = moe_weights(rng)
    # experts 2 and 5 get identical (dominant) router rows: exact ties in p
    router[5] = router[2] = (np.asarray(router[2], np.float32) * 8).astype(BF16)
    h = np.concatenate([h, -h])  # half the rows prefer the tied pair
    wts = (router, gu, down, sgu, sdown, sgate)
    for k in (1, 2, 4):
        got = np.asarray(J_MOE(*put(platform, h, *wts), top_k=k))
        assert_close(got, ref_moe(h, *wts, k), MOE_REL, f"moe with ties, top_k={k}")


def test_moe_errors(platform):
    rng = np.random.default_rng(12)
    h = put(platform, bf16(rng, 3, MO_D))
    wts = list(put(platform, *moe_weights(rng)))
    with pytest.raises(ValueError, match=r"baro_moe: top_k=9 exceeds the number of experts E=8"):
        cc.moe(h, *wts, 9)
    with pytest.raises(ValueError, match=r"baro_moe: w_down must have shape \[8, 32, 16\], got shape \[8, 32, 15\]"):
        cc.moe(h, wts[0], wts[1], wts[2][..., :15], *wts[3:], 2)
    with pytest.raises(ValueError, match=r"baro_moe: h must have dtype bfloat16.*got dtype float32"):
        cc.moe(h.astype(jnp.float32), *wts, 2)
    with pytest.raises(ValueError, match=r"baro_moe: shared_gate must have shape \[1, 32\]"):
        cc.moe(h, *wts[:5], wts[5][0], 2)


J_MOE_SLOTS = jax.jit(cc.moe_slots, static_argnames=("top_k",))
J_ROUTE = jax.jit(cc.moe_route, static_argnames=("top_k",))


def pool_for(gu, down, experts, S, rng):
    """A pool of S slots holding `experts` at random slots (the other slots garbage) and slots[E]."""
    E = gu.shape[0]
    at = rng.choice(S, len(experts), replace=False)
    pgu = bf16(rng, S, *gu.shape[1:], scale=9.0)
    pdn = bf16(rng, S, *down.shape[1:], scale=9.0)
    slots = np.full((E,), -1, np.int32)
    for e, s in zip(experts, at):
        pgu[s], pdn[s], slots[e] = gu[e], down[e], s
    return pgu, pdn, slots


@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_moe_slots_same_bytes(platform, m):
    """Every routed expert resident (at any slot of a pool larger or smaller than E): moe's bytes."""
    rng = np.random.default_rng(1200 + m)
    h = bf16(rng, m, MO_D)
    router, gu, down, sgu, sdown, sgate = moe_weights(rng)
    want = np.asarray(J_MOE(*put(platform, h, router, gu, down, sgu, sdown, sgate), top_k=MO_K))
    ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=MO_K))
    assert ids.shape == (m, MO_K) and ids.dtype == np.int32
    routed = sorted(set(ids.reshape(-1).tolist()))
    for S in sorted({len(routed), MO_E, MO_E + 5}):
        pgu, pdn, slots = pool_for(gu, down, routed if S < MO_E else range(MO_E), S, rng)
        got = np.asarray(J_MOE_SLOTS(*put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate), top_k=MO_K))
        assert_same_bits(got, want, f"moe_slots m={m} S={S}")


# BARO_MOE_SMALL_ROWS: calls of up to that many rows run on the _small twins (the GPU scratch a
# result, so the call may sit inside a command buffer), with the bytes of the ops that take their
# scratch from XLA's allocator; past it, and with BARO_CMDBUF_OPS=0, the plain op runs.
@pytest.mark.parametrize("m", [17, 33, 64, 65])
def test_moe_small_rows_same_bytes(platform, m, monkeypatch):
    from custom_calls.knobs import KNOBS
    default_small = m <= KNOBS["BARO_MOE_SMALL_ROWS"].default
    rng = np.random.default_rng(1250 + m)
    h = bf16(rng, m, MO_D)
    router, gu, down, sgu, sdown, sgate = moe_weights(rng)
    ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=MO_K))
    pgu, pdn, slots = pool_for(gu, down, sorted(set(ids.reshape(-1).tolist())), MO_E + 3, rng)
    calls = {"moe": (lambda *a: cc.moe(*a, top_k=MO_K), (h, router, gu, down, sgu, sdown, sgate)),
             "moe_slots": (lambda *a: cc.moe_slots(*a, top_k=MO_K), (h, router, pgu, pdn, slots, sgu, sdown, sgate))}
    for name, (fn, args) in calls.items():
        got = {}
        for rows, small in ((None, default_small), (str(m), True), (str(m - 1), False)):
            if rows is None:
                monkeypatch.delenv("BARO_MOE_SMALL_ROWS", raising=False)
            else:
                monkeypatch.setenv("BARO_MOE_SMALL_ROWS", rows)
            dev = put(platform, *args)
            f = jax.jit(lambda *a: fn(*a))  # a fresh function: the wrapper reads the knob when traced
            hlo = f.lower(*dev).as_text()
            assert (f"baro_{name}_small" in hlo) == small, f"{name} m={m} BARO_MOE_SMALL_ROWS={rows}: small={small}"
            poison(platform, (m, MO_D))
            got[rows] = np.asarray(f(*dev))
            assert np.all(np.isfinite(got[rows])), f"{name} m={m} BARO_MOE_SMALL_ROWS={rows}: unwritten rows"
        monkeypatch.setenv("BARO_CMDBUF_OPS", "0")
        monkeypatch.setenv("BARO_MOE_SMALL_ROWS", str(m))
        assert f"baro_{name}_small" not in jax.jit(lambda *a: fn(*a)).lower(*put(platform, *args)).as_text()
        monkeypatch.delenv("BARO_CMDBUF_OPS")
        for rows, arr in got.items():
            assert_same_bits(arr, got[None], f"{name} m={m} BARO_MOE_SMALL_ROWS={rows} vs the default")
    monkeypatch.delenv("BARO_MOE_SMALL_ROWS", raising=False)


# BARO_GEMM_WGMMA (csrc/gpu/gemm_wgmma.cu) inside the MoE: its plain GEMMs of 64 rows or more (the
# router, and with BARO_MOE_FOLD=0 the shared expert's fused-SwiGLU gate/up and its down and gate
# GEMMs) and the grouped GEMMs (tiles of 64 rows where the pairs per expert average 8 to 63, of 128
# from 64: m = 300 and 700 here): BARO_GEMM_WGMMA_GROUPED=down the down GEMM (A read in place), =1
# the gate/up GEMM with the fused SwiGLU too (A's rows gathered by the producer warpgroup's cp.async),
# =sorted both with gate/up's A rows copied into sorted order (into the down output's scratch) first;
# the same bytes as the default and as one row per call. require fails the call where a grouped
# GEMM the setting names would fall back, so these bytes are the wgmma kernel's. D x I: the small
# shape (K = D = 32 for gate/up, K = I = 16 for down: one partial stage), 256 x 136 (gate/up K = 256:
# four whole stages; down K past two, a partial third), 512 x 272 at 700 tokens (gate/up K = 512:
# eight stages, so the ring of 4 is refilled; down five, the last partial), and the model's own
# routed experts (D 2048, E 256, top 8, I 512; the gate/up K walk of 32 stages wraps the ring eight
# times) at 1024 tokens (32 pairs per expert: 64-row tiles) and 2048 (64: the 128-row tiles an 8k
# prefill chunk runs), whose weights are drawn on the device (1.5 GB of bf16).
def _device_moe_weights(platform, seed, E, D, I, Is):
    """moe_weights_sized's six arrays drawn by jax.random on the device, scaled by 1 / sqrt(K)."""
    shapes = ((E, D), (E, 2 * I, D), (E, D, I), (2 * Is, D), (D, Is), (1, D))
    keys = jax.random.split(jax.device_put(jax.random.PRNGKey(seed), platform), len(shapes))
    return tuple(jax.jit(lambda k, sh=sh: (jax.random.normal(k, sh, jnp.float32) / float(np.sqrt(sh[-1])))
                         .astype(jnp.bfloat16))(key) for key, sh in zip(keys, shapes))


@pytest.mark.parametrize("m,E,D,I,k", [(64, None, None, None, MO_K), (130, None, None, None, MO_K),
                                       (300, None, None, None, MO_K), (200, 16, 256, 136, MO_K),
                                       (700, 16, 256, 136, MO_K), (700, 16, 512, 272, MO_K),
                                       (1024, 256, 2048, 512, 8),
                                       (2048, 256, 2048, 512, 8)])
def test_moe_gemm_wgmma_same_bytes(platform, m, E, D, I, k, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("BARO_GEMM_WGMMA picks a CUDA kernel")
    cap = str(getattr(platform, "compute_capability", "") or "")
    if cap and cap.replace(".", "") != "90":
        pytest.skip(f"the wgmma GEMM runs on sm_90 only, this GPU is {cap} (elsewhere the knob falls back)")
    rng = np.random.default_rng(1270 + m)
    if E is None:
        D = MO_D
        wd = put(platform, *moe_weights(rng))
    elif D >= 2048:
        wd = _device_moe_weights(platform, 1270 + m, E, D, I, I)
    else:
        wd = put(platform, *moe_weights_sized(rng, E, D, I, I))
    h = bf16(rng, m, D)
    # (BARO_GEMM_WGMMA, BARO_GEMM_WGMMA_GROUPED, BARO_GEMM_WGMMA_RING, BARO_PIPE_ORDER): the mma.sync
    # kernels, the down GEMM alone on wgmma, both grouped GEMMs on wgmma (gate/up's A rows copied
    # into sorted order first), each wgmma setting with the ring of 4 stages and of 3 (two blocks per
    # SM) and in both walks of the grid (auto: a slot's column tiles side by side; rows: a column
    # tile's slots), and the sorted rows on the mma.sync kernels (BARO_GEMM_WGMMA=0:
    # gemm_pipe_kernel reads them in place); then 256-row W tiles (BARO_GEMM_WGMMA_BN: the grouped
    # GEMMs, the grouped down GEMM alone in the row walk, and the plain GEMMs (router; the shared
    # expert when unfolded) with the grouped ones on mma.sync); then the persistent grid
    # (BARO_GEMM_WGMMA_PERSIST=1: the resident blocks walk several tiles each on one ring; =3: three
    # blocks, so every shape walks many tiles a block, empty slots, idle and live warpgroups in turn)
    # with either tile width
    settings = (("0", "0", "4", "auto"), ("require", "down", "4", "auto"), ("require", "sorted", "4", "auto"),
                ("require", "down", "3", "auto"), ("require", "sorted", "3", "auto"), ("0", "sorted", "4", "auto"),
                ("require", "down", "4", "rows"), ("require", "sorted", "3", "rows"),
                ("require", "sorted", "4", "auto", "256"), ("require", "down", "3", "rows", "grouped"),
                ("require", "0", "4", "auto", "256"), ("require", "sorted", "4", "auto", "128", "1"),
                ("require", "sorted", "3", "rows", "256", "3"), ("require", "sorted", "4", "auto", "256", "1"),
                ("require", "down", "4", "auto", "grouped", "3"), ("require", "sorted", "3", "auto", "128", "3"))
    for fold in ("1", "0"):
        monkeypatch.setenv("BARO_MOE_FOLD", fold)
        got = {}
        for setting in settings:
            knob, grouped, ring, order, bn, persist = setting + ("128", "0")[len(setting) - 4:]
            monkeypatch.setenv("BARO_GEMM_WGMMA_PERSIST", persist)
            monkeypatch.setenv("BARO_GEMM_WGMMA", knob)
            monkeypatch.setenv("BARO_GEMM_WGMMA_GROUPED", grouped)
            monkeypatch.setenv("BARO_GEMM_WGMMA_RING", ring)
            monkeypatch.setenv("BARO_PIPE_ORDER", order)
            monkeypatch.setenv("BARO_GEMM_WGMMA_BN", bn)
            poison(platform, (m, D))
            f = jax.jit(lambda *a: cc.moe(*a, top_k=k))  # a fresh jit: the launcher reads the knobs
            key = knob, grouped, ring, order, bn, persist
            got[key] = np.asarray(f(put(platform, h), *wd))
            assert np.all(np.isfinite(got[key])), f"moe m={m} fold={fold} {key}: unwritten rows"
        monkeypatch.delenv("BARO_GEMM_WGMMA_RING", raising=False)
        monkeypatch.delenv("BARO_PIPE_ORDER", raising=False)
        monkeypatch.delenv("BARO_GEMM_WGMMA_BN", raising=False)
        monkeypatch.delenv("BARO_GEMM_WGMMA_PERSIST", raising=False)
        # every wgmma setting above stores the down GEMM's pair rows as bf16 (BARO_MOE_PAIRS16, on by
        # default) and combines them 8 columns a thread (BARO_MOE_COMBINE_WIDE, on by default); off,
        # the same down GEMM stores fp32 and the combine rounds them, or the combine takes 4 columns
        for name, kn, v in (("pairs32", "BARO_MOE_PAIRS16", "0"), ("narrow", "BARO_MOE_COMBINE_WIDE", "0")):
            monkeypatch.setenv(kn, v)
            poison(platform, (m, D))
            got["require", "sorted", "4", "auto", name, "0"] = np.asarray(
                jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
            monkeypatch.delenv(kn, raising=False)
        for key, arr in got.items():
            assert_same_bits(arr, got["0", "0", "4", "auto", "128", "0"],
                             f"moe m={m} fold={fold} BARO_GEMM_WGMMA, GROUPED, RING, ORDER, BN, PERSIST = "
                             f"{key} vs the default")
        monkeypatch.setenv("BARO_GEMM_WGMMA", "0")
        for i in (0, m - 1):
            one = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h[i:i + 1]), *wd))
            assert_same_bits(one[0], got["require", "sorted", "4", "auto", "256", "1"][i],
                             f"moe m={m} fold={fold} row {i}: wgmma vs one-row call")
    monkeypatch.delenv("BARO_GEMM_WGMMA", raising=False)
    monkeypatch.delenv("BARO_GEMM_WGMMA_GROUPED", raising=False)
    monkeypatch.delenv("BARO_MOE_FOLD", raising=False)


# top_k > 32: one warp routes a row, so slot s >= 32's weight is written (and renormalised)
# by lane s % 32; one row of a batch, a row alone and the float64 reference agree.
def test_moe_top_k_past_a_warp(platform):
    rng = np.random.default_rng(1600)
    E, D, I, Is, k = 64, 64, 32, 32, 40
    h = bf16(rng, 7, D)
    w = moe_weights_sized(rng, E, D, I, Is)
    wd = put(platform, *w)
    f = jax.jit(lambda *a: cc.moe(*a, top_k=k))
    poison(platform, (7, D))
    full = np.asarray(f(put(platform, h), *wd))
    assert np.all(np.isfinite(full))
    for i in (0, 3, 6):
        assert_same_bits(np.asarray(f(put(platform, h[i:i + 1]), *wd))[0], full[i], f"moe top_k={k} row {i}")
    assert_close(full, ref_moe(h, *w, k), MOE_REL, f"moe top_k={k} vs float64")


# Many rows with I == Is (CUDA): the shared gate as the router GEMM's column E and the shared
# expert as ceil(m / 16) more tiles of the grouped GEMMs (moe.cu MoePlan::share, gate_tail)
# wherever those run on 16-row slots, against BARO_MOE_FOLD=0 (GEMMs of their own) and each row
# alone (the one-token fold). m = 17..64 run on the _small twin (BARO_MOE_SMALL_ROWS, 64); m = 100
# groups in two chunks with the router on 64-row tiles (share without gate_tail); forced 16-row
# tiles at m = 300 share through the two-chunk grouping. The stream and gemm_rows16 both read
# W_last / W_tail; the simple kernel cannot, so the fold is off there. D = 136: no K % 16, so no
# stream; E = 8 gives several pairs per expert.
SHARE_ARMS = [("default", {}), ("BARO_MOE_FOLD=0", {"BARO_MOE_FOLD": "0"}), ("stream", {"BARO_GEMM_SMALL": "stream"}),
              ("rows16", {"BARO_GEMM_SMALL": "rows16"}), ("simple", {"BARO_GEMM_SMALL": "simple"}),
              ("rows16 light 1 warp", {"BARO_GEMM_SMALL": "rows16", "BARO_ROWS16_RING": "light",
                                       "BARO_ROWS16_WARPS": "1"})]


@pytest.mark.parametrize("m,E,D,I,k,tile", [(2, 256, 256, 80, 8, None), (5, 8, 136, 72, 2, None),
                                            (16, 256, 256, 80, 8, None), (17, 256, 256, 80, 8, None),
                                            (33, 8, 136, 72, 2, None), (64, 256, 256, 80, 8, None),
                                            (100, 256, 256, 80, 8, None), (300, 256, 256, 80, 8, "16")])
def test_moe_shared_folded(platform, m, E, D, I, k, tile, monkeypatch):
    rng = np.random.default_rng(1700 + m + E)
    h = bf16(rng, m, D)
    w = moe_weights_sized(rng, E, D, I, I)
    wd = put(platform, *w)
    got = {}
    for name, knobs in SHARE_ARMS:
        set_knobs(monkeypatch, {})
        force_tile(monkeypatch, tile)
        for kn, v in knobs.items():
            monkeypatch.setenv(kn, v)
        poison(platform, (m, D))  # a fresh jit: the launcher reads the knobs when the graph is built
        got[name] = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
        assert np.all(np.isfinite(got[name])), f"moe m={m} E={E} left elements unwritten ({name})"
    for name, arr in got.items():
        assert_same_bits(arr, got["BARO_MOE_FOLD=0"], f"moe m={m} E={E} D={D}: {name} vs BARO_MOE_FOLD=0")
    set_knobs(monkeypatch, {})
    force_tile(monkeypatch, None)
    for i in sorted({0, m // 2, m - 1}):
        poison(platform, (1, D))
        one = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h[i:i + 1]), *wd))
        assert_same_bits(one[0], got["default"][i], f"moe m={m} E={E} row {i} vs one-row call")
    pgu, pdn, slots = pool_for(w[1], w[2], range(E), E + 3, rng)
    force_tile(monkeypatch, tile)
    poison(platform, (m, D))
    pooled = np.asarray(jax.jit(lambda *a: cc.moe_slots(*a, top_k=k))(
        *put(platform, h, w[0], pgu, pdn, slots, w[3], w[4], w[5])))
    assert_same_bits(pooled, got["default"], f"moe_slots m={m} E={E} (every expert at a pool slot)")
    force_tile(monkeypatch, None)
    assert_close(got["default"], ref_moe(h, *w, k), MOE_REL, f"moe m={m} E={E} vs float64")


# The MoE's plain GEMMs of 2 to 16 rows on the stream's blocks that share one copy of A
# (BARO_ROW1_ASHARED=1; opt-in: its bytes pass on the GPU, its speed does not) against the knob off and each row
# alone, at the model's D = 2048, E = 256, top_k = 8 and shared expert (Is = 512): with the fold
# (BARO_MOE_FOLD=1) the router GEMM carries the shared gate's row from W_tail (K 2048, N 257); I = 64
# != Is keeps the shared expert out of the grouped GEMMs, so its gate/up is a plain SwiGLU GEMM
# (K 2048, N 2 x 512) and its down a plain one (K 512, N 2048); without the fold the router is
# N = 256 and the shared gate a GEMM of one column (one unit, one warp). The grouped expert GEMMs
# stay on their kernels. Under one warp per block and units of 1 and 2 n-tiles too.
ASHARED_MOE_KNOBS = [{}, {"BARO_ROW1_BPS": "1"}, {"BARO_ROW1_NT": "1"}, {"BARO_ROW1_NT": "2"}]
ASHARED_MOE_NAMES = KNOB_NAMES_ONE_ROW + ("BARO_ROW1_ASHARED", "BARO_ROW1_BPS", "BARO_ROW1_NT", "BARO_GEMM_SMALL")


def knob_moe(platform, monkeypatch, names, wd, fold, D, k):
    """call(h, knobs): cc.moe on poisoned outputs with BARO_MOE_FOLD=fold and exactly `knobs` of
    `names` set while its graph is built (a fresh jit: the launchers read the knobs then)."""
    def call(h, knobs):
        for kn in names:
            monkeypatch.delenv(kn, raising=False)
        for kn, v in {"BARO_MOE_FOLD": fold, **knobs}.items():
            monkeypatch.setenv(kn, v)
        poison(platform, (h.shape[0], D))
        out = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
        assert np.all(np.isfinite(out)), f"moe m={h.shape[0]} fold={fold} {knobs}: elements unwritten"
        return out
    return call


# The MoE's plain GEMMs of 1 to 16 rows on the stream's TMA instance (BARO_ROW1_TMA=1; opt-in,
# first run on a GPU pending) against the knob off and each row alone, at the model's shapes as
# above: without the fold the router (N 256) and the shared gate (N 1: one unit whose other 7 W
# rows are past the tensor, zeros) and the shared down (K 512) take it; the router with the
# fold reads its last row from W_tail, and the shared gate/up is SwiGLU: those stay on the bulk
# copies (hence =1, not require), so the check is that mixing the two instances in one call
# changes no byte. The one-token MoE's fused route and combine are not the instance's.
# BARO_ROW1_SWAP: every GEMM on the stream but the one-token MoE's fused ones (so one-row calls run
# under =1, the batches under =require); under BARO_GEMM_SMALL=stream the grouped expert GEMMs take
# it too: SwiGLU gate/up over tiles of gathered rows, the down GEMM over the sorted pairs in place,
# tiles of more than 8 rows (both token halves), the folded shared expert's W_last tile.
# per lever: the mode of its batches, the mode of its one-row calls, its m, its speed knobs, a seed
MOE_STREAM_LEVERS = {"BARO_ROW1_ASHARED": ("require", "require", (2, 3, 8, 13, 16), ASHARED_MOE_KNOBS, 3300),
                     "BARO_ROW1_TMA": ("1", "1", (1, 2, 8, 13), [{}, {"BARO_ROW1_NT": "1"}], 3900),
                     "BARO_ROW1_SWAP": ("require", "1", (2, 5, 8, 13, 16),
                                        [{}, {"BARO_ROW1_NT": "4"}, {"BARO_GEMM_SMALL": "stream"},
                                         {"BARO_GEMM_SMALL": "stream", "BARO_ROW1_NT": "4"}], 4500)}


@pytest.mark.parametrize("lever", list(MOE_STREAM_LEVERS))
@pytest.mark.parametrize("fold", ["1", "0"])
def test_moe_stream_levers(platform, lever, fold, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("the stream's instances are CUDA kernels")
    mode, one_mode, ms, knob_sets, seed = MOE_STREAM_LEVERS[lever]
    E, D, I, Is, k = 256, 2048, 64, 512, 8
    rng = np.random.default_rng(seed + int(fold))
    w = moe_weights_sized(rng, E, D, I, Is)
    names = ASHARED_MOE_NAMES + ("BARO_ROW1_TMA", "BARO_ROW1_SWAP")
    call = knob_moe(platform, monkeypatch, names, put(platform, *w), fold, D, k)
    for m in ms:
        h = bf16(rng, m, D)  # fresh inputs for every m
        want = call(h, {lever: "0"})
        for knobs in knob_sets:
            got = call(h, {lever: mode, **knobs})  # require: an error where a GEMM could not take it
            assert_same_bits(got, want, f"moe m={m} fold={fold} {knobs}: {lever}={mode} vs off")
        for i in range(m if m > 1 else 0):
            one = call(h[i:i + 1], {lever: one_mode})
            assert_same_bits(one[0], want[i], f"moe m={m} fold={fold} row {i}: one-row call vs the batch")
    for kn in names:
        monkeypatch.delenv(kn, raising=False)
    assert_close(want, ref_moe(h, *w, k), MOE_REL, f"moe m={m} fold={fold} vs float64")


# The grouped expert GEMMs of 2 to 64 rows (16-row tiles on gemm_rows16: under 8 pairs per expert)
# on the persistent schedule (BARO_ROWS16_PERSIST; opt-in, first GPU run pending) against the
# knob off, bytes on poisoned outputs, fresh inputs for every m: the model's D 2048, E 256,
# top_k 8, I = Is = 512 (with the fold the shared expert is the grouped GEMMs' last tiles, read
# from W_last; without it a gate/up and a down GEMM of its own) and a small shape whose I = 136
# ends in a column block of one warp's columns and whose down GEMM's K = 136 ends in a partial
# stage; its few items make the schedule split every item into column pieces. require fails the
# call where a grouped call could not take it, so the bytes cannot come from the default path;
# under BARO_ROWS16_WARPS=2 or BARO_ROWS16_RING=deep (other instances) it must fail.
PERSIST_NAMES = KNOB_NAMES_ONE_ROW + ("BARO_ROWS16_PERSIST", "BARO_ROWS16_WARPS", "BARO_ROWS16_RING",
                                      "BARO_GEMM_TILE", "BARO_GEMM_SMALL")


@pytest.mark.parametrize("E,D,I,k", [(256, 2048, 512, 8), (64, 256, 136, 4)])
def test_moe_rows16_persist_same_bytes(platform, E, D, I, k, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("the persistent schedule is a CUDA kernel")
    if "CUDA" not in cc.available_platforms():
        pytest.skip("gemm_rows16 is CUDA only (HIP runs the simple kernel, which never reads the knob)")
    rng = np.random.default_rng(3500 + E)
    w = moe_weights_sized(rng, E, D, I, I)
    wd = put(platform, *w)

    def call(h, knobs, op=cc.moe, args=None):
        for kn in PERSIST_NAMES:
            monkeypatch.delenv(kn, raising=False)
        for kn, v in knobs.items():
            monkeypatch.setenv(kn, v)
        poison(platform, (h.shape[0], D))  # a fresh jit: the launcher reads the knobs when the graph is built
        out = np.asarray(jax.jit(lambda *a: op(*a, top_k=k))(put(platform, h), *(wd if args is None else args)))
        assert np.all(np.isfinite(out)), f"moe m={h.shape[0]} E={E} {knobs}: elements unwritten"
        return out

    for fold in ("1", "0"):
        for m in (2, 5, 8, 16, 33, 64):
            h = bf16(rng, m, D)  # fresh inputs for every m and fold
            want = call(h, {"BARO_MOE_FOLD": fold, "BARO_ROWS16_PERSIST": "0"})
            got = call(h, {"BARO_MOE_FOLD": fold, "BARO_ROWS16_PERSIST": "require"})
            assert_same_bits(got, want, f"moe m={m} E={E} D={D} fold={fold}: BARO_ROWS16_PERSIST vs off")
        for i in (0, m - 1):
            one = call(h[i:i + 1], {"BARO_MOE_FOLD": fold})
            assert_same_bits(one[0], got[i], f"moe m={m} E={E} fold={fold} row {i}: one-row call vs persistent")
    if E <= 64:  # experts at pool slots (groups are slots): the small shape only, the pool is E + 3 experts
        pgu, pdn, slots = pool_for(w[1], w[2], range(E), E + 3, rng)
        pooled = put(platform, w[0], pgu, pdn, slots, w[3], w[4], w[5])
        h = bf16(rng, 8, D)
        got = call(h, {"BARO_ROWS16_PERSIST": "require"}, cc.moe_slots, pooled)
        assert_same_bits(got, call(h, {}), f"moe_slots m=8 E={E}: BARO_ROWS16_PERSIST vs moe")
        for knobs in ({"BARO_ROWS16_WARPS": "2"}, {"BARO_ROWS16_RING": "deep"}):
            with pytest.raises(Exception, match=r"baro_moe\w*: kernel launch failed"):
                call(h, {"BARO_ROWS16_PERSIST": "require", **knobs})
    for kn in PERSIST_NAMES:
        monkeypatch.delenv(kn, raising=False)
    assert_close(got, ref_moe(h, *w, k), MOE_REL, f"moe E={E} vs float64")


# One token through a slot table with I == Is: the fold (top-k and grouping in one warp,
# the shared expert as one more grouped row) reading experts at their pool slots gives the
# bytes of moe, folded or not (BARO_MOE_FOLD=0), with the route and combine inside the
# grouped GEMMs or not (BARO_MOE_TAIL=0).
def test_moe_slots_one_token_fold(platform, monkeypatch):
    rng = np.random.default_rng(1601)
    E, D, I, Is, k = 16, 256, 64, 64, 4
    router, gu, down, sgu, sdown, sgate = moe_weights_sized(rng, E, D, I, Is)
    for row in range(3):
        h = bf16(rng, 1, D)
        want = {}
        for name, knobs in SLOT_FOLD_ARMS:
            set_knobs(monkeypatch, knobs)
            want[name] = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(
                *put(platform, h, router, gu, down, sgu, sdown, sgate)))
        for name in ("fold", "fold, BARO_MOE_TAIL=0", "fold, BARO_MOE_TAIL=combine"):
            assert_same_bits(want[name], want["BARO_MOE_FOLD=0"], f"moe one token row {row}: {name} vs BARO_MOE_FOLD=0")
        ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=k))
        for S in (k, E + 3):
            pgu, pdn, slots = pool_for(gu, down, ids[0].tolist() if S < E else range(E), S, rng)
            for name, knobs in SLOT_FOLD_ARMS:
                set_knobs(monkeypatch, knobs)
                poison(platform, (1, D))
                got = np.asarray(jax.jit(lambda *a: cc.moe_slots(*a, top_k=k))(
                    *put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate)))
                assert_same_bits(got, want["BARO_MOE_FOLD=0"], f"moe_slots one token row {row} S={S} ({name})")
        if platform.platform != "cpu":  # a routed expert without a slot: NaN on every path (CPU refuses)
            pgu, pdn, slots = pool_for(gu, down, range(E), E + 3, rng)
            slots[ids[0, 0]] = -1
            for name, knobs in SLOT_FOLD_ARMS:
                set_knobs(monkeypatch, knobs)
                got = np.asarray(jax.jit(lambda *a: cc.moe_slots(*a, top_k=k))(
                    *put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate)))
                assert np.all(np.isnan(got)), f"moe_slots one token row {row}, expert {ids[0, 0]} unslotted ({name})"
    set_knobs(monkeypatch, {})


# baro_moe_host: the routed experts with no pool slot are read from the host store inside the
# call. None, some or all of a token's experts resident, every launch mode of the one-token
# path: moe's bytes (and on CPU, rows m > 1 too). On a GPU only the one-token path reads the
# store: more rows are refused with a message saying so.
def test_moe_host_reads_misses_from_the_store(platform, monkeypatch):
    rng = np.random.default_rng(1700)
    E, D, I, Is, k = 16, 256, 64, 64, 4
    router, gu, down, sgu, sdown, sgate = moe_weights_sized(rng, E, D, I, Is)
    host = cc.host_store(store_put(platform, gu), store_put(platform, down))
    f = jax.jit(lambda *a: cc.moe_host(*a, top_k=k, host=host))
    for row in range(3):
        h = bf16(rng, 1, D)
        set_knobs(monkeypatch, {"BARO_MOE_FOLD": "0"})
        want = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(*put(platform, h, router, gu, down, sgu, sdown, sgate)))
        ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=k))[0].tolist()
        others = [e for e in range(E) if e not in ids]
        for what, resident, S in (("no routed expert resident", others[:k], k), ("half resident", ids[:k // 2], k),
                                  ("all resident", range(E), E + 3)):
            pgu, pdn, slots = pool_for(gu, down, list(resident), S, rng)
            for name, knobs in HOST_ARMS:
                set_knobs(monkeypatch, knobs)
                poison(platform, (1, D))
                got = np.asarray(f(*put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate)))
                assert_same_bits(got, want, f"moe_host row {row}, {what} ({name})")
    set_knobs(monkeypatch, {})
    h = bf16(rng, 3, D)
    pgu, pdn, slots = pool_for(gu, down, [0, 5], k, rng)
    args = put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate)
    if platform.platform == "cpu":
        want = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(*put(platform, h, router, gu, down, sgu, sdown, sgate)))
        assert_same_bits(np.asarray(f(*args)), want, "moe_host m=3 (CPU)")
    else:  # refused before the call: a _small handler's error inside command-buffer capture crashes XLA
        with pytest.raises(ValueError, match=r"one-token path .*got m=3 rows"):
            np.asarray(f(*args))
        set_knobs(monkeypatch, {"BARO_MOE_FOLD": "0"})
        with pytest.raises(ValueError, match=r"one-token path .*got BARO_MOE_FOLD=0"):
            one = put(platform, bf16(rng, 1, D), router, pgu, pdn, slots, sgu, sdown, sgate)
            np.asarray(jax.jit(lambda *a: cc.moe_host(*a, top_k=k, host=host))(*one))
        set_knobs(monkeypatch, {})


def test_moe_host_gpu_conditions_name_what_is_wrong(monkeypatch):
    """What the GPU's one-token path cannot serve is refused in Python, each reason named."""
    from custom_calls.moe import _check_host_gpu
    _check_host_gpu(1, 2048, 256, 512, 512, 8)
    for args, why in (((2, 2048, 256, 512, 512, 8), "m=2 rows"), ((1, 2048, 256, 512, 256, 8), "shared expert 256 wide"),
                      ((1, 2048, 256, 512, 512, 33), "top_k=33"), ((1, 2040, 256, 512, 512, 8), "D=2040")):
        with pytest.raises(ValueError, match=why):
            _check_host_gpu(*args)
    monkeypatch.setenv("BARO_GEMM_ROW1", "off")
    with pytest.raises(ValueError, match="BARO_GEMM_ROW1=off"):
        _check_host_gpu(1, 2048, 256, 512, 512, 8)


def test_moe_host_refuses_rocm_before_the_call(monkeypatch):
    """On ROCm the store is not read by the kernels: refused in Python, never by the handler."""
    import importlib
    cm = importlib.import_module("custom_calls.moe")  # the module (custom_calls.moe is also the op's name)
    rng = np.random.default_rng(1702)
    E, D, I, Is, k = 16, 64, 32, 32, 4
    router, gu, down, sgu, sdown, sgate = moe_weights_sized(rng, E, D, I, Is)
    pgu, pdn, slots = pool_for(gu, down, [1, 2], k, rng)
    host = cc.host_store(jnp.asarray(gu), jnp.asarray(down))
    monkeypatch.setattr(cm, "_xla_platform", lambda dev: "ROCM")
    with pytest.raises(ValueError, match="host store is CUDA-only"):
        cc.moe_host(bf16(rng, 1, D), router, pgu, pdn, slots, sgu, sdown, sgate, top_k=k, host=host)


def test_moe_host_checks_its_store():
    rng = np.random.default_rng(1701)
    E, D, I, Is, k = 16, 64, 32, 32, 4
    router, gu, down, sgu, sdown, sgate = moe_weights_sized(rng, E, D, I, Is)
    h = bf16(rng, 1, D)
    pgu, pdn, slots = pool_for(gu, down, [1, 2], k, rng)
    with pytest.raises(ValueError, match="host store must hold all E=16 experts"):
        small = cc.host_store(jnp.asarray(gu[:8]), jnp.asarray(down[:8]))
        cc.moe_host(h, router, pgu, pdn, slots, sgu, sdown, sgate, top_k=k, host=small)
    with pytest.raises(TypeError, match="host must be a HostStore"):
        cc.moe_host(h, router, pgu, pdn, slots, sgu, sdown, sgate, top_k=k, host=(0, 0))
    with pytest.raises(TypeError, match="must be a concrete jax array"):
        cc.host_store(np.asarray(gu), np.asarray(down))
    with pytest.raises(ValueError, match=r"host down must have shape"):
        cc.host_store(jnp.asarray(gu), jnp.asarray(down[:, :, :16]))


# baro_moe_host's one-token launch modes, with the misses staged in the call's scratch (the
# default) and read by the GEMMs from the store itself (BARO_MOE_HOST=direct)
HOST_ARMS = [("staged", {}), ("staged, BARO_MOE_TAIL=0", {"BARO_MOE_TAIL": "0"}),
             ("direct", {"BARO_MOE_HOST": "direct"}), ("direct, BARO_MOE_TAIL=0", {"BARO_MOE_HOST": "direct", "BARO_MOE_TAIL": "0"}),
             ("direct, BARO_MOE_TAIL=combine", {"BARO_MOE_HOST": "direct", "BARO_MOE_TAIL": "combine"})]
SLOT_FOLD_ARMS = [("fold", {}), ("fold, BARO_MOE_TAIL=0", {"BARO_MOE_TAIL": "0"}),
                  ("fold, BARO_MOE_TAIL=combine", {"BARO_MOE_TAIL": "combine"}),
                  ("BARO_MOE_FOLD=0", {"BARO_MOE_FOLD": "0"})]


def test_moe_route_is_moes_routing(platform):
    """moe_route's ids: descending probability, ties to the lower id (the float64 reference's order)."""
    rng = np.random.default_rng(13)
    h = bf16(rng, 6, MO_D)
    router = moe_weights(rng)[0]
    router[5] = router[2] = (np.asarray(router[2], np.float32) * 8).astype(BF16)  # exact ties
    h = np.concatenate([h, -h])
    logits = f64(h) @ f64(router).T
    for k in (1, 2, 4):
        ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=k))
        for i in range(h.shape[0]):
            order = sorted(range(MO_E), key=lambda e: (-logits[i, e], e))[:k]
            assert ids[i].tolist() == order, (k, i, ids[i], order)


def test_moe_slots_not_resident(platform):
    """A routed expert without a slot never reads another expert's weights: CPU fails the call, GPU gives NaN."""
    rng = np.random.default_rng(14)
    h = bf16(rng, 3, MO_D)
    router, gu, down, sgu, sdown, sgate = moe_weights(rng)
    ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=MO_K))
    pgu, pdn, slots = pool_for(gu, down, range(MO_E), MO_E, rng)
    slots[ids[1, 0]] = -1
    args = put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate)
    if platform.platform == "cpu":
        with pytest.raises(Exception, match=r"baro_moe_slots: row 1 routes to expert \d+, whose slot is -1"):
            np.asarray(J_MOE_SLOTS(*args, top_k=MO_K))
    else:
        got = np.asarray(J_MOE_SLOTS(*args, top_k=MO_K))
        assert np.all(np.isnan(got[1])), "a row with a missing expert must be NaN"
        one = np.asarray(J_MOE_SLOTS(put(platform, h[1:2]), *args[1:], top_k=MO_K))  # the one-token path
        assert np.all(np.isnan(one)), "a one-token row with a missing expert must be NaN"


def test_moe_slots_errors(platform):
    rng = np.random.default_rng(15)
    h = put(platform, bf16(rng, 3, MO_D))
    router, gu, down, sgu, sdown, sgate = put(platform, *moe_weights(rng))
    slots = put(platform, np.arange(MO_E, dtype=np.int32))
    with pytest.raises(ValueError, match=r"baro_moe_slots: slots must have shape \[8\], got shape \[7\]"):
        cc.moe_slots(h, router, gu, down, slots[:7], sgu, sdown, sgate, 2)
    with pytest.raises(ValueError, match=r"baro_moe_slots: slots must have dtype int32"):
        cc.moe_slots(h, router, gu, down, slots.astype(jnp.float32), sgu, sdown, sgate, 2)
    with pytest.raises(ValueError, match=r"baro_moe_slots: w_down_pool must have shape \[8, 32, 16\]"):
        cc.moe_slots(h, router, gu, down[:5], slots, sgu, sdown, sgate, 2)
    with pytest.raises(ValueError, match=r"baro_moe_route: top_k=9 exceeds the number of experts E=8"):
        cc.moe_route(h, router, 9)


# The top-k of every row and the grouping in one block (BARO_MOE_ROUTE_GROUP; opt-in, first GPU
# run pending) against the two kernels, bytes of the MoE's output on poisoned buffers, fresh inputs
# for every m: 1 (without the fold: the one-token path's routing kernels), 2, 5 and 8 rows (a warp a
# row), 33 and 64 (64 x 8 = 512 pairs, one chunk: warps take two rows), with E = 256 (8 entries a
# lane), 300 (16 a lane: past 256) and 600 (the in-memory row), and with the fold on and off. require
# fails where the pairs are more than one chunk (65 rows: 520 pairs), so the bytes cannot come from
# the two kernels. Then moe_slots (a pool holding the routed experts at shuffled slots, and one of
# more slots than experts) with the knob against moe without it.
@pytest.mark.parametrize("E", [256, 300, 600])
@pytest.mark.parametrize("fold", ["1", "0"])
def test_moe_route_group_same_bytes(platform, E, fold, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("the fused route and grouping is a GPU kernel")
    D, I, Is, k = 256, 64, 64, 8
    rng = np.random.default_rng(4900 + E + int(fold))
    w = moe_weights_sized(rng, E, D, I, Is)
    names = KNOB_NAMES_ONE_ROW + ("BARO_MOE_ROUTE_GROUP",)
    call = knob_moe(platform, monkeypatch, names, put(platform, *w), fold, D, k)
    for m in ((1,) if fold == "0" else ()) + (2, 5, 8, 33, 64):
        h = bf16(rng, m, D)
        want = call(h, {"BARO_MOE_ROUTE_GROUP": "0"})
        got = call(h, {"BARO_MOE_ROUTE_GROUP": "require"})
        assert_same_bits(got, want, f"moe E={E} fold={fold} m={m}: route and grouping in one block vs two kernels")
    assert_close(got, ref_moe(h, *w, k), MOE_REL, f"moe E={E} fold={fold} m=64 vs float64")
    with pytest.raises(Exception, match="kernel launch failed"):
        call(bf16(rng, 65, D), {"BARO_MOE_ROUTE_GROUP": "require"})
    h = bf16(rng, 8, D)
    want = call(h, {"BARO_MOE_ROUTE_GROUP": "0"})
    router, gu, down, sgu, sdown, sgate = w
    ids = np.asarray(J_ROUTE(*put(platform, h, router), top_k=k))
    routed = sorted(set(ids.reshape(-1).tolist()))
    for S in (len(routed), E + 5):
        pgu, pdn, slots = pool_for(gu, down, routed if S < E else range(E), S, rng)
        for kn, v in {"BARO_MOE_FOLD": fold, "BARO_MOE_ROUTE_GROUP": "require"}.items():
            monkeypatch.setenv(kn, v)
        poison(platform, (8, D))
        got = np.asarray(jax.jit(lambda *a: cc.moe_slots(*a, top_k=k))(
            *put(platform, h, router, pgu, pdn, slots, sgu, sdown, sgate)))
        for kn in names:
            monkeypatch.delenv(kn, raising=False)
        assert np.all(np.isfinite(got)), f"moe_slots E={E} fold={fold} S={S}: elements unwritten"
        assert_same_bits(got, want, f"moe_slots E={E} fold={fold} S={S}: route and grouping in one block vs moe")
