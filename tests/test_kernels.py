"""Kernel tests for the ordered custom calls (custom_calls/).

For every op and several m:
  * bytes: m rows in one call == m calls of one row (and other splits, padded
    chunks, permuted rows), including the state that sequential ops carry;
  * values: within a stated tolerance of a float64 numpy reference written
    here from docs/NUMERICS.md (and of baro_jax.ops_xla when it exists);
  * errors: bad shapes/dtypes give clear messages.

Every test takes a `platform` parameter ("cpu", or "gpu" marked `gpu`, which
pytest deselects by default; run `pytest -m gpu` on a GPU machine).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import custom_calls as cc

BF16 = ml_dtypes.bfloat16
M_LIST = [1, 2, 5, 64, 300]
EPS = 1e-6

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    p = request.param
    try:
        devs = jax.devices(p)
    except RuntimeError:
        pytest.skip(f"no {p} device")
    if p == "gpu" and not {"CUDA", "ROCM"} & set(cc.available_platforms()):
        pytest.fail("GPU present but the baro GPU library is not loaded: "
                    f"{cc.load_errors()}")
    return devs[0]


def put(dev, *arrays):
    out = tuple(jax.device_put(a, dev) for a in arrays)
    return out if len(out) > 1 else out[0]


def bits(a):
    """Raw bits of an array (bf16 -> uint16, f32 -> uint32), so NaN compares."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return a.view(np.uint16)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


def assert_same_bits(got, want, what):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        raise AssertionError(f"{what}: {len(bad)} of {g.size} elements differ in bits, "
                             f"first at {tuple(bad[0])}")


def assert_close(got, ref, rel, what):
    """|got - ref| <= rel * (|ref| + max|ref|)  (relative, with a floor at the scale)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    scale = np.max(np.abs(ref)) if ref.size else 0.0
    err = np.abs(got - ref)
    tol = rel * (np.abs(ref) + scale)
    if not np.all(err <= tol):
        i = np.unravel_index(np.argmax(err - tol), err.shape)
        raise AssertionError(f"{what}: max error {err.max():.3g} (scale {scale:.3g}); "
                             f"worst at {i}: got {got[i]!r}, ref {ref[i]!r}")


def bf16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def splits_for(m, rng):
    """Row splits: one row at a time, 1+rest, rest+1, a random split."""
    out = {"rows": [1] * m}
    if m >= 2:
        out["1+rest"] = [1, m - 1]
        out["rest+1"] = [m - 1, 1]
    if m >= 3:
        cuts = np.sort(rng.choice(np.arange(1, m), size=min(4, m - 1), replace=False))
        out["random"] = list(np.diff(np.concatenate([[0], cuts, [m]])).astype(int))
    return out


# ---------------------------------------------------------------------------
# float64 numpy references (docs/NUMERICS.md), bf16 rounding points included
# ---------------------------------------------------------------------------

def f64(a):
    return np.asarray(a).astype(np.float64)


def rbf16(a):
    """Round float64 values to bf16 (via f32, as the kernels do) and back."""
    return np.asarray(a, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def ref_matmul(x, w):
    return f64(x) @ f64(w).T


def ref_rmsnorm(x, w, eps):
    x = f64(x)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * (1.0 + f64(w))


def ref_gated_norm(o, z, w, eps):
    o = f64(o)
    m, nv, dv = o.shape
    r = 1.0 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)
    z = f64(z).reshape(m, nv, dv)
    return (o * r * f64(w) * (z * sigmoid(z))).reshape(m, nv * dv)


def rope_tables(S, R2, theta=1e4):
    inv = theta ** (-np.arange(R2, dtype=np.float64) * 2.0 / (2 * R2))
    ang = np.arange(S, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def ref_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid, H, eps, rows=None):
    qkv = f64(qkv)
    kc, vc = k_cache.copy(), v_cache.copy()
    S, Hkv, hd = kc.shape
    R2 = cos.shape[1]
    m = qkv.shape[0]

    def norm_rope(x, w, i):
        t = ref_rmsnorm(x[None], w, eps)[0]
        c, s = f64(cos[i]), f64(sin[i])
        a, b = t[:R2].copy(), t[R2:2 * R2].copy()
        t[:R2], t[R2:2 * R2] = a * c - b * s, b * c + a * s
        return t

    for i in range(n_valid):
        for g in range(Hkv):
            kx = qkv[i, 2 * H * hd + g * hd: 2 * H * hd + (g + 1) * hd]
            vx = qkv[i, 2 * H * hd + Hkv * hd + g * hd: 2 * H * hd + Hkv * hd + (g + 1) * hd]
            kc[pos + i, g] = rbf16(norm_rope(kx, k_norm, i)).astype(BF16)
            vc[pos + i, g] = vx.astype(np.float32).astype(BF16)
    o = np.zeros((m, H * hd))
    K, V = f64(kc), f64(vc)
    for i in range(n_valid) if rows is None else rows:
        p = pos + i
        for h in range(H):
            g = h // (H // Hkv)
            q = rbf16(norm_rope(qkv[i, 2 * h * hd: 2 * h * hd + hd], q_norm, i))
            s = K[: p + 1, g] @ q / np.sqrt(hd)
            e = np.exp(s - s.max())
            att = (e / e.sum()) @ V[: p + 1, g]
            o[i, h * hd:(h + 1) * hd] = att * sigmoid(qkv[i, 2 * h * hd + hd: 2 * h * hd + 2 * hd])
    return o, kc, vc


def ref_conv(x, w, window, n_valid):
    u = np.concatenate([f64(window), f64(x)], axis=0)
    m = x.shape[0]
    W = f64(w)
    y = np.stack([(u[t:t + 4] * W.T).sum(0) for t in range(m)]) if m else np.zeros((0, x.shape[1]))
    y = y * sigmoid(y)
    new_window = np.concatenate([window, x[:n_valid]], axis=0)[-3:]
    return y, new_window


def ref_delta(y, b, a, A_log, dt_bias, state, n_valid, nk):
    y = f64(y)
    S = f64(state).copy()
    nv, dk, dv = S.shape
    m = y.shape[0]
    o = np.zeros((m, nv, dv))
    for i in range(n_valid):
        q = y[i, : nk * dk].reshape(nk, dk)
        k = y[i, nk * dk: 2 * nk * dk].reshape(nk, dk)
        v = y[i, 2 * nk * dk:].reshape(nv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        beta = sigmoid(f64(b[i]))
        g = -np.exp(f64(A_log)) * softplus(f64(a[i]) + f64(dt_bias))
        for j in range(nv):
            kh = j // (nv // nk)
            S[j] *= np.exp(g[j])
            kv = S[j].T @ k[kh]
            d = (v[j] - kv) * beta[j]
            S[j] += np.outer(k[kh], d)
            o[i, j] = S[j].T @ q[kh]
    return o, S


def ref_moe(h, router, w_gate_up, w_down, sgu, sdown, sgate, top_k):
    h = f64(h)
    logits = h @ f64(router).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    I = w_gate_up.shape[1] // 2
    Is = sgu.shape[0] // 2
    out = np.zeros((h.shape[0], h.shape[1]))
    for i in range(h.shape[0]):
        sel = np.argsort(-p[i], kind="stable")[:top_k]  # ties -> lower id
        wts = p[i, sel] / p[i, sel].sum()
        for e, wk in zip(sel, wts):
            gu = f64(w_gate_up[e]) @ h[i]
            act = rbf16(gu[:I] * sigmoid(gu[:I]) * gu[I:])
            out[i] += wk * (f64(w_down[e]) @ act)
        gu = f64(sgu) @ h[i]
        act = rbf16(gu[:Is] * sigmoid(gu[:Is]) * gu[Is:])
        out[i] += sigmoid(f64(sgate)[0] @ h[i]) * (f64(sdown) @ act)
    return out


# ---------------------------------------------------------------------------
# jitted entry points (the production path); pos / n_valid are traced
# ---------------------------------------------------------------------------

J_MATMUL = jax.jit(cc.matmul)
J_RMSNORM = jax.jit(cc.rmsnorm, static_argnames=("eps",))
J_GATED = jax.jit(cc.gated_norm, static_argnames=("eps",))
J_ATT = jax.jit(cc.attention, static_argnames=("eps",))
J_CONV = jax.jit(cc.conv)
J_DELTA = jax.jit(cc.delta)
J_MOE = jax.jit(cc.moe, static_argnames=("top_k",))


def i32(v):
    return np.asarray(v, np.int32)


# ---------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------

MM_K, MM_N = 96, 40


@pytest.mark.parametrize("m", M_LIST)
def test_matmul(platform, m):
    rng = np.random.default_rng(100 + m)
    x, w = bf16(rng, m, MM_K), bf16(rng, MM_N, MM_K)
    full = np.asarray(J_MATMUL(*put(platform, x, w)))
    for i in range(m):
        one = np.asarray(J_MATMUL(*put(platform, x[i:i + 1], w)))
        assert_same_bits(one[0], full[i], f"matmul row {i} of m={m}")
    perm = rng.permutation(m)
    assert_same_bits(np.asarray(J_MATMUL(*put(platform, x[perm], w))), full[perm],
                     "matmul permuted rows")
    # eager call = jitted call
    assert_same_bits(np.asarray(cc.matmul(*put(platform, x, w))), full, "matmul eager vs jit")
    assert full.dtype == np.float32
    assert_close(full, ref_matmul(x, w), 1e-5, "matmul vs float64")


# GEMM tile configs (csrc/gpu/matmul.cu, env BARO_GEMM_TILE): the simple 16x32
# and 64x64 kernels, the pipelined 64x128 and 128x128 ones. Every config must
# give the bits of the one-row (decode, 16x32) call. Forcing is GPU-only and
# speed-only; on CPU the knob is ignored.
# "16-simple": the 16-row slots on the simple synchronous kernel instead of
# gemm_rows16.cuh (env BARO_GEMM_SMALL=simple), which also runs every m = 1
# call: the decode kernel and its predecessor must agree bit for bit.
GEMM_TILES = ["16", "16-simple", "simple", "64", "128"]


def force_tile(monkeypatch, tile):
    if tile is None:
        monkeypatch.delenv("BARO_GEMM_TILE", raising=False)
        monkeypatch.delenv("BARO_GEMM_SMALL", raising=False)
        return
    monkeypatch.setenv("BARO_GEMM_TILE", tile.split("-")[0])
    if tile.endswith("-simple"):
        monkeypatch.setenv("BARO_GEMM_SMALL", "simple")
    else:
        monkeypatch.delenv("BARO_GEMM_SMALL", raising=False)


def poison(dev, shape, dtype=jnp.float32):
    """Fill and free a NaN buffer of the result's size, so the allocator likely
    hands the same memory to the next result: an element the kernel forgets
    to write then shows up as NaN instead of a lucky leftover."""
    jnp.full(shape, jnp.nan, dtype, device=dev).block_until_ready().delete()


def gemm_tiles_for(platform):
    return GEMM_TILES if platform.platform == "gpu" else []


@pytest.mark.parametrize("m,K", [(2, 200), (17, 2056), (130, 203), (300, 200), (300, 2056)])
def test_matmul_tiles(platform, m, K, monkeypatch):
    """Several row and N tiles of the large configs, K past a whole BK (200,
    2056 = 16*128 + 8: a half-filled last 16-step) and K % 8 != 0 (203: no
    16-byte loads, the simple kernel walks each 128-row slot in sub-tiles)."""
    N = 264  # 2 full 128-column tiles and a partial one
    rng = np.random.default_rng(900 + m + K)
    x, w = bf16(rng, m, K), bf16(rng, N, K)
    wd = put(platform, w)
    poison(platform, (m, N))
    full = np.asarray(J_MATMUL(put(platform, x), wd))
    assert np.all(np.isfinite(full)), "matmul left elements unwritten"
    rows = range(m) if m <= 130 or platform.platform == "gpu" else sorted({0, 1, 63, 64, 127, 128, m - 1})
    for i in rows:
        one = np.asarray(J_MATMUL(put(platform, x[i:i + 1]), wd))
        assert_same_bits(one[0], full[i], f"matmul m={m} K={K} row {i} vs one-row call")
    for tile in gemm_tiles_for(platform):
        force_tile(monkeypatch, tile)
        poison(platform, (m, N))
        got = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x), wd))
        assert_same_bits(got, full, f"matmul m={m} K={K} forced tile {tile}")
        if tile == "16-simple":  # m = 1 on the simple kernel too
            one = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x[m - 1:]), wd))
            assert_same_bits(one[0], full[m - 1], f"matmul K={K} one row on the simple kernel")
    force_tile(monkeypatch, None)
    assert_close(full, ref_matmul(x, w), 1e-5, f"matmul m={m} K={K} vs float64")


# The one-row streaming kernel (gemm_row1.cuh, every m = 1 call with K % 16 == 0 on
# CUDA) against gemm_rows16 (BARO_GEMM_ROW1=off) and against the row inside batched
# calls (16-row and pipelined tiles). N = 1 (one unit), 40 (a partial 8-column unit),
# 4801 (more units than the persistent grid's warps: each warp streams several);
# K = 272 and 1040 end on a partial 256-wide stage; K = 2056 (K % 16 == 8) falls back
# to gemm_rows16.
@pytest.mark.parametrize("N,K", [(1, 2048), (40, 96), (264, 272), (4801, 1040), (40, 2056)])
def test_matmul_row1(platform, N, K, monkeypatch):
    rng = np.random.default_rng(1300 + N + K)
    x, w = bf16(rng, 130, K), bf16(rng, N, K)
    wd = put(platform, w)
    run = jax.jit(lambda a, b: cc.matmul(a, b))
    full = np.asarray(run(put(platform, x), wd))  # pipelined tiles
    few = np.asarray(run(put(platform, x[:3]), wd))  # 16-row tiles
    assert_same_bits(few, full[:3], f"matmul N={N} K={K} 3 rows vs 130")
    for i in (0, 2):
        for knob in (None, "off"):
            if knob is None:
                monkeypatch.delenv("BARO_GEMM_ROW1", raising=False)
            else:
                monkeypatch.setenv("BARO_GEMM_ROW1", knob)
            poison(platform, (1, N))  # a fresh jit: the launcher reads the knob when the graph is built
            one = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x[i:i + 1]), wd))
            assert np.all(np.isfinite(one)), f"matmul N={N} K={K} one row left elements unwritten"
            assert_same_bits(one[0], full[i], f"matmul N={N} K={K} row {i} one-row call (ROW1={knob})")
    monkeypatch.delenv("BARO_GEMM_ROW1", raising=False)
    assert_close(full[:3], ref_matmul(x[:3], w), 1e-5, f"matmul N={N} K={K} vs float64")


def test_matmul_errors(platform):
    rng = np.random.default_rng(1)
    x, w = put(platform, bf16(rng, 3, 8), bf16(rng, 5, 8))
    with pytest.raises(ValueError, match=r"baro_matmul: x must have dtype bfloat16.*got dtype float32"):
        cc.matmul(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match=r"baro_matmul: w must have shape \[\*, 8\], got shape \[5, 7\]"):
        cc.matmul(x, w[:, :7])
    with pytest.raises(ValueError, match=r"baro_matmul: x must have rank 2"):
        cc.matmul(x[None], w)
    with pytest.raises(ValueError, match=r"baro_matmul: w must have dtype bfloat16"):
        jax.jit(cc.matmul)(x, w.astype(jnp.float16))


# ---------------------------------------------------------------------------
# rmsnorm, gated_norm
# ---------------------------------------------------------------------------

NORM_D = 80
GN_NV, GN_DV = 4, 16


@pytest.mark.parametrize("m", M_LIST)
def test_rmsnorm(platform, m):
    rng = np.random.default_rng(200 + m)
    x = f32(rng, m, NORM_D, scale=3.0)
    w = f32(rng, NORM_D, scale=0.2)
    full = np.asarray(J_RMSNORM(*put(platform, x, w), eps=EPS))
    assert full.dtype == BF16
    for i in range(m):
        one = np.asarray(J_RMSNORM(*put(platform, x[i:i + 1], w), eps=EPS))
        assert_same_bits(one[0], full[i], f"rmsnorm row {i} of m={m}")
    perm = rng.permutation(m)
    assert_same_bits(np.asarray(J_RMSNORM(*put(platform, x[perm], w), eps=EPS)), full[perm],
                     "rmsnorm permuted")
    assert_close(full, ref_rmsnorm(x, w, EPS), 2 ** -8, "rmsnorm vs float64")


@pytest.mark.parametrize("m", [1, 37, 70])
@pytest.mark.parametrize("D", [1024, 2048, 2080])
def test_rmsnorm_model_widths(platform, D, m, monkeypatch):
    """The model widths take the GPU's register-resident rows (D = 1024, 2048), and up to 64
    rows the block-per-row kernel; 2080 the runtime-D kernel. Rows are independent, and
    BARO_NORM_GENERIC=1 (every D on the runtime-D kernel) and BARO_NORM_ROW_BLOCK=0 (few rows
    on the warp kernel) give the same bits."""
    rng = np.random.default_rng(250 + D + m)
    x = f32(rng, m, D, scale=3.0)
    w = f32(rng, D, scale=0.2)
    poison(platform, (m, D), jnp.bfloat16)
    full = np.asarray(J_RMSNORM(*put(platform, x, w), eps=EPS))
    for i in sorted({0, 1 % m, 17 % m, m - 1}):
        one = np.asarray(J_RMSNORM(*put(platform, x[i:i + 1], w), eps=EPS))
        assert_same_bits(one[0], full[i], f"rmsnorm D={D} row {i} vs one-row call")
    for knob, value in (("BARO_NORM_GENERIC", "1"), ("BARO_NORM_ROW_BLOCK", "0")):
        monkeypatch.setenv(knob, value)
        poison(platform, (m, D), jnp.bfloat16)
        got = np.asarray(jax.jit(lambda a, b: cc.rmsnorm(a, b, EPS))(*put(platform, x, w)))
        monkeypatch.delenv(knob)
        assert_same_bits(got, full, f"rmsnorm m={m} D={D}: {knob}={value} vs the default kernel")
    assert_close(full, ref_rmsnorm(x, w, EPS), 2 ** -8, f"rmsnorm D={D} vs float64")


# baro_add_rmsnorm: the residual add and the norm after it in one call gives the bytes of XLA's
# fp32 add and baro_rmsnorm of its result (so the model's fused add keeps every bit), at the
# model widths (the GPU's register rows) and a runtime D, for one row and many, and through
# the runtime-D kernel (BARO_NORM_GENERIC=1).
@pytest.mark.parametrize("m,D", [(1, 2048), (2, 2048), (37, 2048), (65, 2048), (5, 1024), (64, 1024),
                                 (3, 2080), (1, 8)])
def test_add_rmsnorm_equals_add_then_rmsnorm(platform, m, D, monkeypatch):
    rng = np.random.default_rng(260 + m + D)
    x = f32(rng, m, D, scale=3.0)
    y = f32(rng, m, D, scale=2.0)
    w = f32(rng, D, scale=0.2)
    add = jax.jit(lambda a, b: a + b)
    want_s = np.asarray(add(*put(platform, x, y)))
    want_h = np.asarray(J_RMSNORM(put(platform, want_s), put(platform, w), eps=EPS))
    for knob, value in (("BARO_NORM_GENERIC", "0"), ("BARO_NORM_GENERIC", "1"), ("BARO_NORM_ROW_BLOCK", "0")):
        monkeypatch.setenv(knob, value)
        poison(platform, (m, D))
        s, h = jax.jit(lambda a, b, c: cc.add_rmsnorm(a, b, c, EPS))(*put(platform, x, y, w))
        monkeypatch.delenv(knob)
        assert_same_bits(np.asarray(s), want_s, f"add_rmsnorm m={m} D={D} sum ({knob}={value})")
        assert_same_bits(np.asarray(h), want_h, f"add_rmsnorm m={m} D={D} norm ({knob}={value})")
    if m > 1:
        s1, h1 = jax.jit(lambda a, b, c: cc.add_rmsnorm(a, b, c, EPS))(*put(platform, x[1:2], y[1:2], w))
        assert_same_bits(np.asarray(h1)[0], want_h[1], f"add_rmsnorm D={D}: row 1 alone vs in a batch")


def test_add_rmsnorm_errors(platform):
    x, w = jnp.zeros((2, 8), jnp.float32), jnp.zeros((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"baro_add_rmsnorm: y must have shape \[2, 8\], got shape \[2, 7\]"):
        cc.add_rmsnorm(x, jnp.zeros((2, 7), jnp.float32), w, EPS)
    with pytest.raises(ValueError, match=r"baro_add_rmsnorm: y must have dtype float32"):
        cc.add_rmsnorm(x, x.astype(jnp.bfloat16), w, EPS)
    with pytest.raises(ValueError, match=r"baro_add_rmsnorm: w must have shape \[8\]"):
        cc.add_rmsnorm(x, x, w[:7], EPS)


@pytest.mark.parametrize("m", M_LIST)
def test_gated_norm(platform, m):
    rng = np.random.default_rng(300 + m)
    o = f32(rng, m, GN_NV, GN_DV, scale=0.5)
    z = f32(rng, m, GN_NV * GN_DV, scale=2.0)
    w = f32(rng, GN_DV, scale=1.0)
    full = np.asarray(J_GATED(*put(platform, o, z, w), eps=EPS))
    assert full.dtype == BF16 and full.shape == (m, GN_NV * GN_DV)
    for i in range(m):
        one = np.asarray(J_GATED(*put(platform, o[i:i + 1], z[i:i + 1], w), eps=EPS))
        assert_same_bits(one[0], full[i], f"gated_norm row {i} of m={m}")
    perm = rng.permutation(m)
    assert_same_bits(np.asarray(J_GATED(*put(platform, o[perm], z[perm], w), eps=EPS)),
                     full[perm], "gated_norm permuted")
    assert_close(full, ref_gated_norm(o, z, w, EPS), 2 ** -7, "gated_norm vs float64")


# The model's gated norm width (dv = 128) takes the GPU's register-row kernel; 48 the runtime-dv
# one. Rows are independent, and BARO_NORM_GENERIC=1 (every width on the runtime-dv kernel)
# gives the same bits.
@pytest.mark.parametrize("dv", [128, 48])
def test_gated_norm_model_width(platform, dv, monkeypatch):
    rng = np.random.default_rng(350 + dv)
    m, nv = 5, 32
    o = f32(rng, m, nv, dv, scale=0.5)
    z = f32(rng, m, nv * dv, scale=2.0)
    w = f32(rng, dv, scale=1.0)
    poison(platform, (m, nv * dv), jnp.bfloat16)
    full = np.asarray(J_GATED(*put(platform, o, z, w), eps=EPS))
    for i in (0, m - 1):
        one = np.asarray(J_GATED(*put(platform, o[i:i + 1], z[i:i + 1], w), eps=EPS))
        assert_same_bits(one[0], full[i], f"gated_norm dv={dv} row {i} vs one-row call")
    monkeypatch.setenv("BARO_NORM_GENERIC", "1")
    got = np.asarray(jax.jit(lambda a, b, c: cc.gated_norm(a, b, c, EPS))(*put(platform, o, z, w)))
    monkeypatch.delenv("BARO_NORM_GENERIC")
    assert_same_bits(got, full, f"gated_norm dv={dv}: runtime-dv kernel vs the register-row kernel")
    assert_close(full, ref_gated_norm(o, z, w, EPS), 2 ** -7, f"gated_norm dv={dv} vs float64")


# z_col: the gates read in place from a wider array (the model passes the GDN projection
# whole, gates at column C) give the bytes of the contiguous gates, for one row and many,
# at the model width and a runtime one; the columns around the gates are never read (NaN).
@pytest.mark.parametrize("m,nv,dv", [(1, 32, 128), (7, 32, 128), (3, 4, 48), (20, 4, 16)])
def test_gated_norm_z_in_place(platform, m, nv, dv):
    rng = np.random.default_rng(370 + m + dv)
    o = f32(rng, m, nv, dv, scale=0.5)
    z = f32(rng, m, nv * dv, scale=2.0)
    w = f32(rng, dv, scale=1.0)
    left, right = 40, 9  # columns before and after the gates
    wide = np.full((m, left + nv * dv + right), np.nan, np.float32)
    wide[:, left:left + nv * dv] = z
    want = np.asarray(J_GATED(*put(platform, o, z, w), eps=EPS))
    poison(platform, (m, nv * dv), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda a, b, c: cc.gated_norm(a, b, c, EPS, z_col=left))(*put(platform, o, wide, w)))
    assert_same_bits(got, want, f"gated_norm m={m} nv={nv} dv={dv}: gates at column {left} of a wider z")
    if platform.platform == "cpu":  # ops_xla slices the same columns (on CPU only: XLA's own kernels)
        import baro_jax.ops_xla as X
        assert_same_bits(np.asarray(X.gated_norm(*put(platform, o, wide, w), EPS, z_col=left)),
                         np.asarray(X.gated_norm(*put(platform, o, z, w), EPS)), "ops_xla gated_norm z_col")


def test_norm_errors(platform):
    rng = np.random.default_rng(2)
    x, w = put(platform, f32(rng, 3, 8), f32(rng, 8))
    with pytest.raises(ValueError, match=r"baro_rmsnorm: w must have shape \[8\], got shape \[7\]"):
        cc.rmsnorm(x, w[:7], EPS)
    with pytest.raises(ValueError, match=r"baro_rmsnorm: x must have dtype float32, got dtype bfloat16"):
        cc.rmsnorm(x.astype(jnp.bfloat16), w, EPS)
    o, z, gw = put(platform, f32(rng, 3, 2, 4), f32(rng, 3, 8), f32(rng, 4))
    with pytest.raises(ValueError, match=r"baro_gated_norm: z must have shape \[3, W\] with z_col \+ nv\*dv <= W "
                                         r"\(z_col=0, nv\*dv=8\), got shape \[3, 6\]"):
        cc.gated_norm(o, z[:, :6], gw, EPS)
    with pytest.raises(ValueError, match=r"\(z_col=3, nv\*dv=8\), got shape \[3, 8\]"):
        cc.gated_norm(o, z, gw, EPS, z_col=3)  # the gates would run past z's last column
    with pytest.raises(ValueError, match=r"baro_gated_norm: z_col must be >= 0, got -1"):
        cc.gated_norm(o, z, gw, EPS, z_col=-1)
    with pytest.raises(ValueError, match=r"baro_gated_norm: z_col must be a static Python int"):
        cc.gated_norm(o, z, gw, EPS, z_col=1.0)
    with pytest.raises(ValueError, match=r"baro_gated_norm: o must have rank 3"):
        cc.gated_norm(z, z, gw, EPS)


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------

AT_H, AT_HKV, AT_HD, AT_R2 = 4, 2, 32, 8
AT_POS = 37
AT_S = 1100  # room for rows that cross the GPU kernels' 512-position KV splits
AT_W = (2 * AT_H + 2 * AT_HKV) * AT_HD
COS, SIN = rope_tables(AT_S + 64, AT_R2)
TABLES = (COS, SIN)


def att_setup(rng, m, pos0, S=AT_S, shape=(AT_H, AT_HKV, AT_HD)):
    H, Hkv, hd = shape
    qkv = f32(rng, m, (2 * H + 2 * Hkv) * hd, scale=1.5)
    qn = f32(rng, hd, scale=0.2)
    kn = f32(rng, hd, scale=0.2)
    # history rows below pos0: random; everything else poisoned with NaN
    kc = np.full((S, Hkv, hd), np.nan, np.float32).astype(BF16)
    vc = kc.copy()
    kc[:pos0] = (rng.standard_normal((pos0, Hkv, hd), dtype=np.float32) * 2.0).astype(BF16)
    vc[:pos0] = rng.standard_normal((pos0, Hkv, hd), dtype=np.float32).astype(BF16)
    return qkv, qn, kn, kc, vc


def att_run(dev, qkv, qn, kn, kc, vc, pos0, chunks, pad_to=None, rng=None, donate=False,
            tables=None):
    """Runs attention over the rows of qkv in the given chunks (row counts),
    carrying the caches; optionally pads every chunk to pad_to rows with garbage."""
    COS, SIN = tables if tables is not None else (TABLES[0], TABLES[1])
    fn = J_ATT_DONATE if donate else J_ATT
    kc_d, vc_d = put(dev, kc, vc)
    qn_d, kn_d = put(dev, qn, kn)
    outs = []
    r = 0
    for c in chunks:
        rows = qkv[r:r + c]
        cos, sin = COS[pos0 + r: pos0 + r + c], SIN[pos0 + r: pos0 + r + c]
        n = c
        if pad_to is not None and c < pad_to:
            extra = pad_to - c
            rows = np.concatenate([rows, f32(rng, extra, qkv.shape[1], scale=5.0)])
            cos = np.concatenate([cos, f32(rng, extra, COS.shape[1])])
            sin = np.concatenate([sin, f32(rng, extra, SIN.shape[1])])
        o, kc_d, vc_d = fn(put(dev, rows), qn_d, kn_d, *put(dev, cos, sin),
                           kc_d, vc_d, i32(pos0 + r), i32(n), eps=EPS)
        outs.append(np.asarray(o)[:c])
        r += c
    return np.concatenate(outs), np.asarray(kc_d), np.asarray(vc_d)


J_ATT_DONATE = jax.jit(cc.attention, static_argnames=("eps",), donate_argnums=(5, 6))


@pytest.mark.parametrize("m,pos0", [(m, AT_POS) for m in M_LIST] + [(5, 0), (64, 0), (64, 1000), (1, 1030)])
def test_attention(platform, m, pos0):
    rng = np.random.default_rng(400 + m + pos0)
    qkv, qn, kn, kc, vc = att_setup(rng, m, pos0)
    o_full, kc_full, vc_full = att_run(platform, qkv, qn, kn, kc, vc, pos0, [m])
    assert o_full.dtype == BF16 and o_full.shape == (m, AT_H * AT_HD)

    # bytes: every split (incl. one row per call) gives the same outputs and caches
    for name, chunks in splits_for(m, rng).items():
        o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, chunks)
        assert_same_bits(o, o_full, f"attention o, split {name}, m={m}")
        assert_same_bits(k2, kc_full, f"attention k_cache, split {name}, m={m}")
        assert_same_bits(v2, vc_full, f"attention v_cache, split {name}, m={m}")
    # padded chunks (n_valid < rows), as a prefill with chunk 7 / one padded call
    for pad_chunk in (7, m + 5):
        chunks = [min(pad_chunk, m - r) for r in range(0, m, pad_chunk)]
        o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, chunks, pad_to=pad_chunk, rng=rng)
        assert_same_bits(o, o_full, f"attention o, padded chunk {pad_chunk}, m={m}")
        assert_same_bits(k2, kc_full, f"attention k_cache, padded chunk {pad_chunk}, m={m}")
        assert_same_bits(v2, vc_full, f"attention v_cache, padded chunk {pad_chunk}, m={m}")
    # donated (truly in-place) caches give the same bytes
    o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, [m], donate=True)
    assert_same_bits(o, o_full, "attention o, donated caches")
    assert_same_bits(k2, kc_full, "attention k_cache, donated caches")

    # untouched cache rows are unchanged (history and the NaN poison)
    for name, c_full, c0 in (("k", kc_full, kc), ("v", vc_full, vc)):
        assert_same_bits(c_full[:pos0], c0[:pos0], f"{name}_cache history rows")
        assert_same_bits(c_full[pos0 + m:], c0[pos0 + m:], f"{name}_cache rows past pos+m")
        assert not np.any(np.isnan(c_full[pos0:pos0 + m].astype(np.float32))), \
            f"{name}_cache rows pos..pos+m not all written"

    # values vs float64 reference
    o_ref, kc_ref, vc_ref = ref_attention(qkv, qn, kn, COS[pos0:pos0 + m], SIN[pos0:pos0 + m],
                                          kc, vc, pos0, m, AT_H, EPS)
    assert_close(kc_full[pos0:pos0 + m], kc_ref[pos0:pos0 + m], 2 ** -7, "k_cache vs float64")
    assert_same_bits(vc_full, vc_ref, "v_cache vs reference (plain bf16 cast)")
    assert_close(o_full, o_ref, 1e-2, "attention o vs float64")


# GQA shapes: the model's (G = 8 q heads per kv head, head_dim 256, rotary 64)
# and smaller ones. The CUDA kernel's tile rows are (token, q head of one kv
# group) pairs: 16-row tiles when m*G <= 16, 64-row tiles otherwise; the KV
# splits run in parallel blocks when m <= 16, serially inside a block when
# m > 16. Each case below reaches a different tile / mode, and the one-row
# calls always take the decode path (a 16-row tile, split-parallel).
AT_GQA = {"g8_hd256": (16, 2, 256, 32), "g4_hd64": (8, 2, 64, 16), "g1_hd64": (2, 2, 64, 8)}
AT_GQA_S = 1400
_GQA_TABLES = {}


def gqa_tables(R2):
    if R2 not in _GQA_TABLES:
        _GQA_TABLES[R2] = rope_tables(AT_GQA_S + 64, R2)
    return _GQA_TABLES[R2]


@pytest.mark.parametrize("cfg", list(AT_GQA))
@pytest.mark.parametrize("m,pos0", [(1, 1030), (2, 37), (5, 1021), (16, 100), (37, 1000), (300, 900)])
def test_attention_gqa(platform, cfg, m, pos0):
    H, Hkv, hd, R2 = AT_GQA[cfg]
    if platform.platform == "cpu" and m * H * hd > 300 * 8 * 64:
        pytest.skip("CPU: the model-size case with 300 one-row calls is slow, and the CPU "
                    "kernel's order is covered by the smaller cases")
    tables = gqa_tables(R2)
    rng = np.random.default_rng(900 + m + pos0 + hd + H)
    qkv, qn, kn, kc, vc = att_setup(rng, m, pos0, S=AT_GQA_S, shape=(H, Hkv, hd))
    run = lambda chunks, **kw: att_run(platform, qkv, qn, kn, kc, vc, pos0, chunks, tables=tables, **kw)
    o_full, kc_full, vc_full = run([m])
    assert o_full.shape == (m, H * hd)
    assert np.all(np.isfinite(o_full.astype(np.float32))), "attention o: non-finite values"

    splits = splits_for(m, rng)
    if m > 3:
        splits.pop("1+rest")  # "rest+1" and "random" already mix large and one-row calls
    for name, chunks in splits.items():
        o, k2, v2 = run(chunks)
        assert_same_bits(o, o_full, f"attention o, split {name}, {cfg}, m={m}")
        assert_same_bits(k2, kc_full, f"attention k_cache, split {name}, {cfg}, m={m}")
        assert_same_bits(v2, vc_full, f"attention v_cache, split {name}, {cfg}, m={m}")
    # one padded call (n_valid = m < rows): padding rows must come back as exact zeros
    pad = m + 5
    rows = np.concatenate([qkv, f32(rng, 5, qkv.shape[1], scale=5.0)])
    cos = np.concatenate([tables[0][pos0:pos0 + m], f32(rng, 5, R2)])
    sin = np.concatenate([tables[1][pos0:pos0 + m], f32(rng, 5, R2)])
    o, k2, v2 = J_ATT(*put(platform, rows, qn, kn, cos, sin, kc, vc), i32(pos0), i32(m), eps=EPS)
    o = np.asarray(o)
    assert o.shape == (pad, H * hd)
    assert_same_bits(o[:m], o_full, f"attention o, padded to {pad}, {cfg}")
    assert_same_bits(o[m:], np.zeros_like(o[m:]), f"attention padding rows, {cfg}")
    assert_same_bits(np.asarray(k2), kc_full, f"attention k_cache, padded to {pad}, {cfg}")
    assert_same_bits(np.asarray(v2), vc_full, f"attention v_cache, padded to {pad}, {cfg}")
    for name, c_full, c0 in (("k", kc_full, kc), ("v", vc_full, vc)):
        assert_same_bits(c_full[:pos0], c0[:pos0], f"{name}_cache history rows")
        assert_same_bits(c_full[pos0 + m:], c0[pos0 + m:], f"{name}_cache rows past pos+m")

    # values vs float64 reference (a few rows: the reference is a Python loop)
    sel = sorted({0, m // 2, m - 1})
    o_ref, _, _ = ref_attention(qkv, qn, kn, tables[0][pos0:pos0 + m], tables[1][pos0:pos0 + m],
                                kc, vc, pos0, m, H, EPS, rows=sel)
    assert_close(o_full[sel], o_ref[sel], 1e-2, f"attention o vs float64, {cfg}")


def test_attention_long_context(platform):
    """Decode at 128k context (256 KV splits in parallel blocks) equals the rows
    of one serial prefill call over the same positions (GPU only: on CPU a 128k
    float64 reference and caches of 2 x 128 MB are too slow for CI)."""
    if platform.platform == "cpu":
        pytest.skip("long context: GPU only")
    H, Hkv, hd, R2 = AT_GQA["g8_hd256"]
    S, m, pos0 = 131072, 24, 131072 - 30
    cos_t, sin_t = rope_tables(S, R2)
    rng = np.random.default_rng(12)
    qkv, qn, kn, kc, vc = att_setup(rng, m, pos0, S=S, shape=(H, Hkv, hd))
    o_full, kc_full, vc_full = att_run(platform, qkv, qn, kn, kc, vc, pos0, [m], tables=(cos_t, sin_t))
    o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, [1] * m, tables=(cos_t, sin_t))
    assert_same_bits(o, o_full, "attention o at 128k, one row per call vs one call")
    assert_same_bits(k2, kc_full, "attention k_cache at 128k")
    assert_same_bits(v2, vc_full, "attention v_cache at 128k")
    # float64 values of the last row
    i = m - 1
    p = pos0 + i
    K, V = f64(kc_full[:p + 1]), f64(vc_full[:p + 1])
    W = qkv.shape[1]
    for h in range(H):
        g = h // (H // Hkv)
        x = f64(qkv[i, 2 * h * hd: 2 * h * hd + hd])
        t = ref_rmsnorm(x[None], qn, EPS)[0]
        c, s_ = f64(cos_t[p]), f64(sin_t[p])
        a, b = t[:R2].copy(), t[R2:2 * R2].copy()
        t[:R2], t[R2:2 * R2] = a * c - b * s_, b * c + a * s_
        sc = K[:, g] @ rbf16(t) / np.sqrt(hd)
        e = np.exp(sc - sc.max())
        att = (e / e.sum()) @ V[:, g]
        ref = att * sigmoid(f64(qkv[i, 2 * h * hd + hd: 2 * h * hd + 2 * hd]))
        assert_close(o_full[i, h * hd:(h + 1) * hd], ref, 1e-2, f"attention o at 128k, head {h}")
    assert W == (2 * H + 2 * Hkv) * hd


def test_attention_no_recompile_and_nvalid0(platform):
    rng = np.random.default_rng(5)
    qkv, qn, kn, kc, vc = att_setup(rng, 3, 10)
    f = jax.jit(cc.attention, static_argnames=("eps",))
    args = put(platform, qkv, qn, kn, COS[10:13], SIN[10:13], kc, vc)
    o1, k1, v1 = f(*args, i32(10), i32(3), eps=EPS)
    n_compiled = f._cache_size()
    f(*args, i32(11), i32(2), eps=EPS)
    assert f._cache_size() == n_compiled, "pos / n_valid changes must not recompile"
    # n_valid = 0 leaves the caches untouched
    _, k0, v0 = f(*args, i32(10), i32(0), eps=EPS)
    assert_same_bits(k0, kc, "k_cache after n_valid=0")
    assert_same_bits(v0, vc, "v_cache after n_valid=0")
    # Python ints are accepted for pos / n_valid (eager)
    o2, _, _ = cc.attention(*args, 10, 3, eps=EPS)
    assert_same_bits(o2, o1, "attention with Python int pos")


def test_attention_errors(platform):
    rng = np.random.default_rng(6)
    qkv, qn, kn, kc, vc = att_setup(rng, 3, 4, S=16)
    cos, sin = COS[:3], SIN[:3]
    a = put(platform, qkv, qn, kn, cos, sin, kc, vc)
    with pytest.raises(ValueError, match=r"baro_attention: qkv must have shape \[m, \(2\*H \+ 2\*Hkv\)\*hd\]"):
        cc.attention(a[0][:, :-AT_HD], *a[1:], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: k_cache must have dtype bfloat16.*got dtype float32"):
        cc.attention(*a[:5], a[5].astype(jnp.float32), a[6], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: v_cache must have shape \[16, 2, 32\], got shape \[16, 2, 16\]"):
        cc.attention(*a[:6], a[6][..., :16], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: sin must have shape \[3, 8\]"):
        cc.attention(*a[:4], a[4][:2], *a[5:], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: qkv must have dtype float32"):
        cc.attention(a[0].astype(jnp.bfloat16), *a[1:], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: pos must be an int32 scalar, got dtype float32"):
        cc.attention(*a, jnp.float32(4), 3)
    with pytest.raises(ValueError, match=r"baro_attention: n_valid must be a scalar"):
        cc.attention(*a, 4, jnp.array([3], jnp.int32))


CPU = jax.devices("cpu")[0]


def test_attention_runtime_checks():
    """Value checks done by the CPU handler (GPU kernels cannot check traced
    values without a sync, so this runs on CPU only)."""
    rng = np.random.default_rng(7)
    qkv, qn, kn, kc, vc = att_setup(rng, 3, 4, S=16)
    a = put(CPU, qkv, qn, kn, COS[:3], SIN[:3], kc, vc)
    with pytest.raises(Exception, match=r"pos \+ n_valid = 14 \+ 3 exceeds the cache length S=16"):
        J_ATT(*a, i32(14), i32(3), eps=EPS)[0].block_until_ready()
    with pytest.raises(Exception, match=r"n_valid must be in \[0, m=3\], got 4"):
        J_ATT(*a, i32(0), i32(4), eps=EPS)[0].block_until_ready()
    with pytest.raises(Exception, match=r"pos must be >= 0, got -1"):
        J_ATT(*a, i32(-1), i32(1), eps=EPS)[0].block_until_ready()


def test_handler_validates_shapes():
    """The C++ handlers validate shapes themselves (bypassing the Python checks)."""
    with jax.default_device(CPU):
        _handler_validates_shapes()


def _handler_validates_shapes():
    x = jnp.zeros((3, 8), jnp.bfloat16)
    w = jnp.zeros((5, 7), jnp.bfloat16)
    call = jax.ffi.ffi_call("baro_matmul", jax.ShapeDtypeStruct((3, 5), jnp.float32))
    with pytest.raises(Exception, match=r"baro_matmul: w must have shape \[N, K\] with K = x.shape\[1\] = 8, got \[5, 7\]"):
        call(x, w).block_until_ready()
    st = jnp.zeros((4, 16, 16), jnp.float32)
    call = jax.ffi.ffi_call("baro_delta", (jax.ShapeDtypeStruct((2, 4, 16), jnp.float32), st))
    y = jnp.zeros((2, 100), jnp.float32)
    cols = dict(b_col=np.int64(0), a_col=np.int64(0))
    with pytest.raises(Exception, match=r"baro_delta: y width 100 must be 2\*nk\*dk \+ nv\*dv"):
        call(y, jnp.zeros((2, 4)), jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros(4), st,
             jnp.int32(2), **cols)[0].block_until_ready()
    # the gate columns, past the Python checks: b's nv = 4 gates from column 3 of a [2, 6] array
    y = jnp.zeros((2, 2 * 1 * 16 + 4 * 16), jnp.float32)
    with pytest.raises(Exception, match=r"baro_delta: b must have shape \[2, W\] with b_col \+ nv <= W "
                                        r"\(b_col=3, nv=4\), got \[2, 6\]"):
        call(y, jnp.zeros((2, 6)), jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros(4), st,
             jnp.int32(2), b_col=np.int64(3), a_col=np.int64(0))[0].block_until_ready()
    call = jax.ffi.ffi_call("baro_gated_norm", jax.ShapeDtypeStruct((2, 8), jnp.bfloat16))
    with pytest.raises(Exception, match=r"baro_gated_norm: z must have shape \[2, W\] with z_col \+ nv\*dv <= W "
                                        r"\(z_col=5, nv\*dv=8\), got shape \[2, 12\]"):
        call(jnp.zeros((2, 2, 4)), jnp.zeros((2, 12)), jnp.zeros(4), eps=np.float32(1e-6),
             z_col=np.int64(5)).block_until_ready()
    call = jax.ffi.ffi_call("baro_conv_proj", (jax.ShapeDtypeStruct((2, 8), jnp.float32),
                                               jax.ShapeDtypeStruct((3, 8), jnp.bfloat16)))
    with pytest.raises(Exception, match=r"baro_conv_proj: x must have at least C=8 columns \(C from w\), "
                                        r"got shape \[2, 6\]"):
        call(jnp.zeros((2, 6)), jnp.zeros((8, 4), jnp.bfloat16), jnp.zeros((3, 8), jnp.bfloat16),
             jnp.int32(2))[0].block_until_ready()


# ---------------------------------------------------------------------------
# conv
# ---------------------------------------------------------------------------

CV_C = 48


def seq_run(dev, fn, row_inputs, consts, state, chunks, pad_to=None, rng=None, pad_maker=None):
    """Generic driver for the carried-state ops: fn(*rows, *consts, state, n_valid)
    -> (out, state). Returns (concatenated outputs of the valid rows, final state)."""
    state = put(dev, state)
    consts = [put(dev, c) for c in consts]
    outs, r = [], 0
    for c in chunks:
        rows = [a[r:r + c] for a in row_inputs]
        if pad_to is not None and c < pad_to:
            rows = [np.concatenate([a, pad_maker(rng, pad_to - c, a)]) for a in rows]
        o, state = fn(*put(dev, *rows) if len(rows) > 1 else (put(dev, rows[0]),),
                      *consts, state, i32(c))
        outs.append(np.asarray(o)[:c])
        r += c
    return np.concatenate(outs), np.asarray(state)


def garbage_like(rng, n, a):
    return (rng.standard_normal((n,) + a.shape[1:]) * 7).astype(np.float32).astype(a.dtype)


def conv_fn(x, w, window, n_valid):
    return J_CONV(x, w, window, n_valid)


@pytest.mark.parametrize("m", M_LIST)
def test_conv(platform, m):
    rng = np.random.default_rng(500 + m)
    x, w, win = bf16(rng, m, CV_C), bf16(rng, CV_C, 4, scale=0.5), bf16(rng, 3, CV_C)
    y_full, win_full = seq_run(platform, conv_fn, [x], [w], win, [m])
    assert y_full.dtype == np.float32 and win_full.dtype == BF16
    for name, chunks in splits_for(m, rng).items():
        y, wn = seq_run(platform, conv_fn, [x], [w], win, chunks)
        assert_same_bits(y, y_full, f"conv y, split {name}, m={m}")
        assert_same_bits(wn, win_full, f"conv window, split {name}, m={m}")
    for pad_chunk in (7, m + 5):
        chunks = [min(pad_chunk, m - r) for r in range(0, m, pad_chunk)]
        y, wn = seq_run(platform, conv_fn, [x], [w], win, chunks, pad_to=pad_chunk, rng=rng,
                        pad_maker=garbage_like)
        assert_same_bits(y, y_full, f"conv y, padded chunk {pad_chunk}, m={m}")
        assert_same_bits(wn, win_full, f"conv window, padded chunk {pad_chunk}, m={m}")
    # n_valid = 0: window unchanged
    _, wn = J_CONV(*put(platform, x, w, win), i32(0))
    assert_same_bits(wn, win, "conv window after n_valid=0")
    y_ref, win_ref = ref_conv(x, w, win, m)
    assert_same_bits(win_full, win_ref, "conv window vs reference")
    assert_close(y_full, y_ref, 1e-5, "conv y vs float64")


def test_conv_errors(platform):
    rng = np.random.default_rng(8)
    x, w, win = put(platform, bf16(rng, 3, 8), bf16(rng, 8, 4), bf16(rng, 3, 8))
    with pytest.raises(ValueError, match=r"baro_conv: w must have shape \[8, 4\], got shape \[8, 3\]"):
        cc.conv(x, w[:, :3], win, 3)
    with pytest.raises(ValueError, match=r"baro_conv: window must have shape \[3, 8\], got shape \[2, 8\]"):
        cc.conv(x, w, win[:2], 3)
    with pytest.raises(ValueError, match=r"baro_conv: x must have dtype bfloat16.*got dtype float16"):
        cc.conv(x.astype(jnp.float16), w, win, 3)  # (float32 x is the projection: baro_conv_proj)


def test_conv_runtime_checks():
    rng = np.random.default_rng(9)
    x, w, win = put(CPU, bf16(rng, 3, 8), bf16(rng, 8, 4), bf16(rng, 3, 8))
    with pytest.raises(Exception, match=r"baro_conv: n_valid must be in \[0, m=3\], got 5"):
        J_CONV(x, w, win, i32(5))[0].block_until_ready()


# The GPU conv kernel: a thread owns 8 channels (16-byte loads; 1 channel when
# C % 8 != 0) and 8 tokens, 256 threads per block; only token block 0 reads
# and rewrites the window. C = 4104 gives three channel blocks (the last holds
# one group), C = 44 the one-channel path; m = 17 and 37 partial token blocks.
CONV_GPU_M = [1, 2, 17, 37, pytest.param(300, marks=pytest.mark.gpu)]
J_CONV_DONATE = jax.jit(cc.conv, donate_argnums=(2,))


@pytest.mark.parametrize("C", [4104, 44])
@pytest.mark.parametrize("m", CONV_GPU_M)
def test_conv_blocks(platform, m, C):
    rng = np.random.default_rng(520 + m + C)
    x, w, win = bf16(rng, m, C), bf16(rng, C, 4, scale=0.5), bf16(rng, 3, C)
    wd = put(platform, w)
    poison(platform, (m, C))
    y_full, win_full = (np.asarray(r) for r in J_CONV(put(platform, x), wd, put(platform, win), i32(m)))
    assert np.all(np.isfinite(y_full)), "conv left elements of y unwritten"
    # decode arm: one row per call, carrying the window
    wn = put(platform, win)
    for i in range(m):
        y1, wn = J_CONV(put(platform, x[i:i + 1]), wd, wn, i32(1))
        assert_same_bits(np.asarray(y1)[0], y_full[i], f"conv C={C} m={m} row {i} vs one-row call")
    assert_same_bits(wn, win_full, f"conv C={C} m={m} window vs one-row calls")
    y_ref, win_ref = ref_conv(x, w, win, m)
    assert_same_bits(win_full, win_ref, "conv window vs reference")
    assert_close(y_full, y_ref, 1e-5, f"conv C={C} m={m} vs float64")
    # padded call (n_valid < m, incl. 0, 1, 2: the new window keeps old rows)
    # and a donated (truly in-place) window: every block reads before the
    # window is replaced
    for nvld in sorted({0, 1, 2, m // 2, m - 1, m} & set(range(m + 1))):
        xp = x.copy()
        xp[nvld:] = garbage_like(rng, m - nvld, x)
        for fn, what in ((J_CONV, "aliased"), (J_CONV_DONATE, "donated")):
            y, wn = fn(put(platform, xp), wd, put(platform, win), i32(nvld))
            _, win_want = ref_conv(x, w, win, nvld)
            assert_same_bits(wn, win_want, f"conv C={C} m={m} n_valid={nvld} window ({what})")
            assert_same_bits(np.asarray(y)[:nvld], y_full[:nvld],
                             f"conv C={C} m={m} n_valid={nvld} y ({what})")


# baro_conv_proj: conv fed the f32 projection whole (x [m, W], W >= C) rounds its first C
# columns to bf16 on load, and gives the bytes of baro_conv on XLA's bf16 convert of the
# slice (what the model ran before), y and window, for one row and many, padded calls, the
# vector path (C % 8 == 0, W % 4 == 0) and the scalar one (C = 44 or W odd); the columns past
# C are NaN and never read.
@pytest.mark.parametrize("C,W", [(4104, 4104 + 60), (4104, 4104 + 61), (44, 44 + 9)])
@pytest.mark.parametrize("m", [1, 2, 9, 37])
def test_conv_reads_the_projection(platform, m, C, W):
    rng = np.random.default_rng(540 + m + W)
    proj = np.full((m, W), np.nan, np.float32)
    proj[:, :C] = f32(rng, m, C, scale=2.0)
    w, win = bf16(rng, C, 4, scale=0.5), bf16(rng, 3, C)
    wd = put(platform, w)
    x = np.asarray(jax.jit(lambda p: p[:, :C].astype(jnp.bfloat16))(put(platform, proj)))  # XLA's convert
    for nvld in sorted({0, 1, m // 2, m}):
        y_want, win_want = (np.asarray(r) for r in J_CONV(put(platform, x), wd, put(platform, win), i32(nvld)))
        poison(platform, (m, C))
        y, wn = (np.asarray(r) for r in J_CONV(put(platform, proj), wd, put(platform, win), i32(nvld)))
        assert_same_bits(wn, win_want, f"conv_proj C={C} W={W} m={m} n_valid={nvld} window")
        assert_same_bits(y[:nvld], y_want[:nvld], f"conv_proj C={C} W={W} m={m} n_valid={nvld} y")
    if platform.platform == "cpu":  # ops_xla takes the same columns (on CPU only: XLA's own kernels)
        import baro_jax.ops_xla as X
        for g, w_, what in zip(X.conv(put(platform, proj), wd, put(platform, win), i32(m)),
                               X.conv(put(platform, x), wd, put(platform, win), i32(m)), ("y", "window")):
            assert_same_bits(np.asarray(g), np.asarray(w_), f"ops_xla conv of the projection: {what}")


def test_conv_proj_errors(platform):
    rng = np.random.default_rng(9)
    w, win = put(platform, bf16(rng, 8, 4), bf16(rng, 3, 8))
    with pytest.raises(ValueError, match=r"baro_conv_proj: x must have at least C=8 columns \(C from w\), "
                                         r"got shape \[2, 6\]"):
        cc.conv(put(platform, f32(rng, 2, 6)), w, win, 2)
    with pytest.raises(ValueError, match=r"baro_conv_proj: window must have shape \[3, 8\]"):
        cc.conv(put(platform, f32(rng, 2, 12)), w, win[:, :7], 2)


# ---------------------------------------------------------------------------
# delta
# ---------------------------------------------------------------------------

DT_NK, DT_NV, DT_DK, DT_DV = 2, 4, 16, 16
DT_C = 2 * DT_NK * DT_DK + DT_NV * DT_DV


def delta_fn(y, b, a, A_log, dt_bias, state, n_valid):
    return J_DELTA(y, b, a, A_log, dt_bias, state, n_valid)


def delta_setup(rng, m):
    y = f32(rng, m, DT_C)
    b = f32(rng, m, DT_NV, scale=2.0)
    a = f32(rng, m, DT_NV, scale=2.0)
    A_log = f32(rng, DT_NV, scale=0.5)
    dt_bias = f32(rng, DT_NV, scale=0.5)
    state = f32(rng, DT_NV, DT_DK, DT_DV, scale=0.3)
    return y, b, a, A_log, dt_bias, state


@pytest.mark.parametrize("m", M_LIST)
def test_delta(platform, m):
    rng = np.random.default_rng(600 + m)
    y, b, a, A_log, dt_bias, state = delta_setup(rng, m)
    args = ([y, b, a], [A_log, dt_bias], state)
    o_full, s_full = seq_run(platform, delta_fn, *args, [m])
    assert o_full.shape == (m, DT_NV, DT_DV) and s_full.dtype == np.float32
    for name, chunks in splits_for(m, rng).items():
        o, s = seq_run(platform, delta_fn, *args, chunks)
        assert_same_bits(o, o_full, f"delta o, split {name}, m={m}")
        assert_same_bits(s, s_full, f"delta state, split {name}, m={m}")
    for pad_chunk in (7, m + 5):
        chunks = [min(pad_chunk, m - r) for r in range(0, m, pad_chunk)]
        o, s = seq_run(platform, delta_fn, *args, chunks, pad_to=pad_chunk, rng=rng,
                       pad_maker=garbage_like)
        assert_same_bits(o, o_full, f"delta o, padded chunk {pad_chunk}, m={m}")
        assert_same_bits(s, s_full, f"delta state, padded chunk {pad_chunk}, m={m}")
    _, s0 = J_DELTA(*put(platform, y, b, a, A_log, dt_bias, state), i32(0))
    assert_same_bits(s0, state, "delta state after n_valid=0")
    o_ref, s_ref = ref_delta(y, b, a, A_log, dt_bias, state, m, DT_NK)
    assert_close(o_full, o_ref, 1e-4, "delta o vs float64")
    assert_close(s_full, s_ref, 1e-4, "delta state vs float64")


def test_delta_errors(platform):
    rng = np.random.default_rng(10)
    y, b, a, A_log, dt_bias, state = put(platform, *delta_setup(rng, 3))
    with pytest.raises(ValueError, match=r"baro_delta: y must have shape \[m, 2\*nk\*dk \+ nv\*dv\]"):
        cc.delta(y[:, :-1], b, a, A_log, dt_bias, state, 3)
    with pytest.raises(ValueError, match=r"baro_delta: A_log must have shape \[4\], got shape \[3\]"):
        cc.delta(y, b, a, A_log[:3], dt_bias, state, 3)
    with pytest.raises(ValueError, match=r"baro_delta: state must have dtype float32, got dtype bfloat16"):
        cc.delta(y, b, a, A_log, dt_bias, state.astype(jnp.bfloat16), 3)
    with pytest.raises(ValueError, match=r"baro_delta: b must have shape \[3, W\] with b_col \+ nv <= W "
                                         r"\(b_col=0, nv=4\), got shape \[2, 4\]"):
        cc.delta(y, b[:2], a, A_log, dt_bias, state, 3)
    with pytest.raises(ValueError, match=r"baro_delta: a must have shape \[3, W\] with a_col \+ nv <= W "
                                         r"\(a_col=1, nv=4\), got shape \[3, 4\]"):
        cc.delta(y, b, a, A_log, dt_bias, state, 3, a_col=1)  # the gates would run past a's last column
    with pytest.raises(ValueError, match=r"baro_delta: b_col must be >= 0, got -2"):
        cc.delta(y, b, a, A_log, dt_bias, state, 3, b_col=-2)


# The GPU delta kernel: blocks of 32 state columns of one value head, 8 lanes
# per column (4 when dk = 16), tokens staged 32 at a time. dv = 80: three
# column blocks, the last half full; dv = 36: no 16-byte loads, a 4-column
# block; m = 75: three token batches, the last partial. Gates, state and
# inputs at the model's magnitudes.
DELTA_GPU_SHAPES = [(2, 4, 128, 80), (1, 2, 64, 36), (2, 2, 32, 48)]
DELTA_GPU_M = [1, 2, 37, 75, pytest.param(300, marks=pytest.mark.gpu)]
J_DELTA_DONATE = jax.jit(cc.delta, donate_argnums=(5,))


# b and a read in place (b_col, a_col): the model passes the GDN projection whole, as both
# b and a; the bytes are those of contiguous gates, for one row, several, more than one
# 32-token batch of the GPU kernel, and the model's head count; the other columns are NaN.
@pytest.mark.parametrize("m,shape", [(1, (2, 4, 16, 16)), (7, (2, 4, 16, 16)), (40, (2, 4, 16, 16)),
                                     (1, (16, 32, 128, 128)), (3, (16, 32, 128, 128))])
def test_delta_gates_in_place(platform, m, shape):
    nk, nv, dk, dv = shape
    rng = np.random.default_rng(660 + m + dk)
    y, b, a, A_log, dt_bias, state = delta_model_inputs(rng, m, nk, nv, dk, dv)
    b_col, a_col = 5, 5 + nv + 3
    proj = np.full((m, a_col + nv + 2), np.nan, np.float32)
    proj[:, b_col:b_col + nv], proj[:, a_col:a_col + nv] = b, a
    consts = put(platform, A_log, dt_bias)
    o_want, s_want = J_DELTA(*put(platform, y, b, a), *consts, put(platform, state), i32(m))
    poison(platform, (m, nv, dv))
    f = jax.jit(lambda *x: cc.delta(*x, b_col=b_col, a_col=a_col))
    pj = put(platform, proj)
    o, s2 = f(put(platform, y), pj, pj, *consts, put(platform, state), i32(m))
    assert_same_bits(np.asarray(o), np.asarray(o_want), f"delta {shape} m={m} o: gates in place")
    assert_same_bits(np.asarray(s2), np.asarray(s_want), f"delta {shape} m={m} state: gates in place")
    if platform.platform == "cpu":  # ops_xla takes the same columns (on CPU only: XLA's own kernels)
        import baro_jax.ops_xla as X
        want = X.delta(*put(platform, y, b, a), *consts, put(platform, state), i32(m), nk=nk, dk=dk)
        got = X.delta(put(platform, y), pj, pj, *consts, put(platform, state), i32(m), nk=nk, dk=dk,
                      b_col=b_col, a_col=a_col)
        for g, w_, what in zip(got, want, ("o", "state")):
            assert_same_bits(np.asarray(g), np.asarray(w_), f"ops_xla delta {what}: gates in place")



def delta_model_inputs(rng, m, nk, nv, dk, dv):
    y = f32(rng, m, 2 * nk * dk + nv * dv)
    b = f32(rng, m, nv)
    a = f32(rng, m, nv)
    A_log = np.log(rng.uniform(1.0, 16.0, nv)).astype(np.float32)      # A ~ U(1, 16)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), nv))           # dt_bias = softplus^-1(dt)
    dt_bias = np.log(np.expm1(dt)).astype(np.float32)
    state = f32(rng, nv, dk, dv, scale=0.5)
    return y, b, a, A_log, dt_bias, state


@pytest.mark.parametrize("shape", DELTA_GPU_SHAPES, ids=lambda s: "nk%d-nv%d-dk%d-dv%d" % s)
@pytest.mark.parametrize("m", DELTA_GPU_M)
def test_delta_blocks(platform, m, shape):
    nk, nv, dk, dv = shape
    rng = np.random.default_rng(640 + m + dk + dv)
    y, b, a, A_log, dt_bias, state = delta_model_inputs(rng, m, nk, nv, dk, dv)
    consts = put(platform, A_log, dt_bias)
    poison(platform, (m, nv, dv))
    o_full, s_full = (np.asarray(r) for r in
                      J_DELTA(*put(platform, y, b, a), *consts, put(platform, state), i32(m)))
    assert np.all(np.isfinite(o_full)) and np.all(np.isfinite(s_full)), "delta left outputs unwritten"
    # decode arm: one row per call, carrying the state
    st, states = put(platform, state), [state]
    for i in range(m):
        o1, st = J_DELTA(*put(platform, y[i:i + 1], b[i:i + 1], a[i:i + 1]), *consts, st, i32(1))
        assert_same_bits(np.asarray(o1)[0], o_full[i], f"delta {shape} m={m} row {i} vs one-row call")
        states.append(np.asarray(st))
    assert_same_bits(states[m], s_full, f"delta {shape} m={m} state vs one-row calls")
    o_ref, s_ref = ref_delta(y, b, a, A_log, dt_bias, state, m, nk)
    assert_close(o_full, o_ref, 1e-4, f"delta {shape} m={m} o vs float64")
    assert_close(s_full, s_ref, 1e-4, f"delta {shape} m={m} state vs float64")
    # padded rows (garbage inputs) leave no trace and give o = 0; a donated
    # (truly in-place) state gives the same bytes
    for nvld in sorted({0, m // 2, m - 1, m} & set(range(m + 1))):
        yp, bp, ap = y.copy(), b.copy(), a.copy()
        for arr in (yp, bp, ap):
            arr[nvld:] = garbage_like(rng, m - nvld, arr)
        for fn, what in ((J_DELTA, "aliased"), (J_DELTA_DONATE, "donated")):
            poison(platform, (m, nv, dv))
            o, s2 = fn(*put(platform, yp, bp, ap), *consts, put(platform, state), i32(nvld))
            o = np.asarray(o)
            assert_same_bits(s2, states[nvld], f"delta {shape} m={m} n_valid={nvld} state ({what})")
            assert_same_bits(o[:nvld], o_full[:nvld], f"delta {shape} m={m} n_valid={nvld} o ({what})")
            assert_same_bits(o[nvld:], np.zeros_like(o[nvld:]), f"delta {shape} padded rows of o")
    # a split that crosses the 32-token batch grid off its boundaries
    if m > 33:
        o, s2 = seq_run(platform, delta_fn, [y, b, a], [A_log, dt_bias], state, [33, m - 33])
        assert_same_bits(o, o_full, f"delta {shape} m={m} split 33+rest o")
        assert_same_bits(s2, s_full, f"delta {shape} m={m} split 33+rest state")


# ---------------------------------------------------------------------------
# moe
# ---------------------------------------------------------------------------

MO_D, MO_E, MO_I, MO_IS, MO_K = 32, 8, 16, 24, 3


def moe_weights(rng):
    return (bf16(rng, MO_E, MO_D, scale=0.5),            # router
            bf16(rng, MO_E, 2 * MO_I, MO_D, scale=0.3),  # w_gate_up
            bf16(rng, MO_E, MO_D, MO_I, scale=0.3),      # w_down
            bf16(rng, 2 * MO_IS, MO_D, scale=0.3),       # shared_gate_up
            bf16(rng, MO_D, MO_IS, scale=0.3),           # shared_down
            bf16(rng, 1, MO_D, scale=0.3))               # shared_gate


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
    assert_close(full, ref_moe(h, *wts, MO_K), 1e-3, "moe vs float64")


def moe_weights_sized(rng, E, D, I, Is):
    return (bf16(rng, E, D, scale=0.5), bf16(rng, E, 2 * I, D, scale=0.3),
            bf16(rng, E, D, I, scale=0.3), bf16(rng, 2 * Is, D, scale=0.3),
            bf16(rng, D, Is, scale=0.3), bf16(rng, 1, D, scale=0.3))


# E = 8, top_k = 2: m = 5 -> about 1 pair per expert (16-row grouped tiles),
# m = 64 -> 16 (64-row pipelined tiles), m = 300 / 700 -> 75 / 175 (128-row
# tiles, several per expert at 700, and several 512-pair grouping chunks).
# D = 136 and I = 72 cross a BK of 64 with a half-filled last 16-step, and
# 2I = 144 gives two N tiles of the fused SwiGLU epilogue (64 columns each);
# D = 36 has no 16-byte loads (simple kernel, separate SwiGLU pass).
@pytest.mark.parametrize("m,D,I", [(5, 136, 72), (64, 136, 72), (300, 136, 72), (700, 136, 72),
                                   (300, 36, 20)])
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
    assert_close(full, ref_moe(h, *wts, k), 1e-3, f"moe m={m} D={D} vs float64")


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


# Calls of <= 16 rows (decode) go through the _small ops (their GPU scratch is a result
# buffer, so the handlers allocate nothing and may run inside XLA's command buffers);
# BARO_CMDBUF_OPS=0 puts them on the allocator ops. Same kernels, so the same bytes.
@pytest.mark.parametrize("m", [1, 2, 16])
def test_small_ops_equal_allocator_ops(platform, m, monkeypatch):
    rng = np.random.default_rng(1500 + m)
    E, D, I, Is, k = 8, 256, 64, 64, 3
    h = bf16(rng, m, D)
    wd = put(platform, *moe_weights_sized(rng, E, D, I, Is))
    outs = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("BARO_CMDBUF_OPS", knob)
        poison(platform, (m, D))  # a fresh jit per setting: the wrapper picks the op when traced
        outs[knob] = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
        hlo = jax.jit(lambda *a: cc.moe(*a, top_k=k)).lower(put(platform, h), *wd).as_text()
        assert ("baro_moe_small" in hlo) == (knob == "1"), f"m={m} BARO_CMDBUF_OPS={knob}: wrong op in the HLO"
    assert np.all(np.isfinite(outs["1"]))
    assert_same_bits(outs["1"], outs["0"], f"moe m={m}: small op vs allocator op")
    # attention: a decode-shaped call at a position past several 512-position splits
    H, Hkv, hd, S = 4, 2, 64, 3000
    qkv = (rng.standard_normal((m, (2 * H + 2 * Hkv) * hd)) * 0.5).astype(np.float32)
    qn, kn = (rng.standard_normal(hd) * 0.1).astype(np.float32), (rng.standard_normal(hd) * 0.1).astype(np.float32)
    cos = rng.standard_normal((m, hd // 4)).astype(np.float32)
    sin = rng.standard_normal((m, hd // 4)).astype(np.float32)
    kc, vc = bf16(rng, S, Hkv, hd), bf16(rng, S, Hkv, hd)
    pos = np.int32(2500)
    got = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("BARO_CMDBUF_OPS", knob)
        f = jax.jit(lambda *a: cc.attention(*a))
        o, k2, v2 = f(*put(platform, qkv, qn, kn, cos, sin, kc, vc), pos, np.int32(m))
        got[knob] = [np.asarray(x) for x in (o, k2, v2)]
    for a, b, what in zip(got["1"], got["0"], ("o", "k_cache", "v_cache")):
        assert_same_bits(a, b, f"attention m={m} {what}: small op vs allocator op")
    monkeypatch.delenv("BARO_CMDBUF_OPS", raising=False)


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
    assert_close(full, ref_moe(h, *wts, k), 1e-3, f"moe E={E} vs float64")


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
        assert_close(got, ref_moe(h, *wts, k), 1e-3, f"moe with ties, top_k={k}")


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


# ---------------------------------------------------------------------------
# against baro_jax.ops_xla (the jnp reference backend)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["matmul", "rmsnorm", "gated_norm", "attention", "conv",
                                "delta", "moe"])
def test_vs_ops_xla(platform, op):
    import baro_jax.ops_xla as X
    rng = np.random.default_rng(800)
    m = 9
    if op == "matmul":
        a = put(platform, bf16(rng, m, MM_K), bf16(rng, MM_N, MM_K))
        assert_close(cc.matmul(*a), X.matmul(*a), 1e-5, "matmul vs ops_xla")
    elif op == "rmsnorm":
        a = put(platform, f32(rng, m, NORM_D), f32(rng, NORM_D, scale=0.2))
        assert_close(cc.rmsnorm(*a, EPS), X.rmsnorm(*a, EPS), 2 ** -7, "rmsnorm vs ops_xla")
    elif op == "gated_norm":
        a = put(platform, f32(rng, m, GN_NV, GN_DV), f32(rng, m, GN_NV * GN_DV), f32(rng, GN_DV))
        assert_close(cc.gated_norm(*a, EPS), X.gated_norm(*a, EPS), 2 ** -6, "gated_norm vs ops_xla")
    elif op == "attention":
        qkv, qn, kn, kc, vc = att_setup(rng, m, AT_POS)
        # ops_xla attends over the whole cache with a mask, so unwritten rows must
        # be finite there (the engine zero-initialises caches); no NaN poison here.
        kc[AT_POS:], vc[AT_POS:] = 0, 0
        a = put(platform, qkv, qn, kn, COS[AT_POS:AT_POS + m], SIN[AT_POS:AT_POS + m], kc, vc)
        got = cc.attention(*a, i32(AT_POS), i32(m), eps=EPS)
        ref = X.attention(*a, i32(AT_POS), i32(m), num_heads=AT_H, num_kv_heads=AT_HKV, eps=EPS)
        assert_close(got[0], ref[0], 2e-2, "attention o vs ops_xla")
        sl = slice(AT_POS, AT_POS + m)
        assert_close(np.asarray(got[1])[sl], np.asarray(ref[1])[sl], 2 ** -7, "k_cache vs ops_xla")
    elif op == "conv":
        a = put(platform, bf16(rng, m, CV_C), bf16(rng, CV_C, 4, scale=0.5), bf16(rng, 3, CV_C))
        got, ref = cc.conv(*a, i32(m)), X.conv(*a, i32(m))
        assert_close(got[0], ref[0], 1e-5, "conv y vs ops_xla")
        assert_same_bits(got[1], ref[1], "conv window vs ops_xla")
    elif op == "delta":
        a = put(platform, *delta_setup(rng, m))
        got, ref = cc.delta(*a, i32(m)), X.delta(*a, i32(m), nk=DT_NK, dk=DT_DK)
        assert_close(got[0], ref[0], 1e-4, "delta o vs ops_xla")
        assert_close(got[1], ref[1], 1e-4, "delta state vs ops_xla")
    elif op == "moe":
        h = put(platform, bf16(rng, m, MO_D))
        w = put(platform, *moe_weights(rng))
        assert_close(cc.moe(h, *w, MO_K), X.moe(h, *w, top_k=MO_K), 1e-3, "moe vs ops_xla")


# The decode tile (m <= 16 rows of one kv group) runs two copies of its warp pair on CUDA, each
# accumulating P V for its half of the pair's head dims from the same S, maxima and sums
# (BARO_ATTN_DUP=1: one copy): the same bytes, for the compiled-in head dim (256) and a run-time
# one (64), inside the first split and past several, with a padded row (n_valid < m); and with
# the split kernel and merge launched as programmatic dependents (BARO_PDL=1).
@pytest.mark.parametrize("hd", [64, 256])
def test_attention_decode_copies_same_bytes(platform, hd, monkeypatch):
    if platform.platform == "cpu":
        pytest.skip("BARO_ATTN_DUP picks between two CUDA launch shapes")
    rng = np.random.default_rng(1700 + hd)
    H, Hkv, S = 4, 2, 3000
    for m, nv in ((1, 1), (2, 2), (3, 2)):
        qkv = (rng.standard_normal((m, (2 * H + 2 * Hkv) * hd)) * 0.5).astype(np.float32)
        qn = (rng.standard_normal(hd) * 0.1).astype(np.float32)
        kn = (rng.standard_normal(hd) * 0.1).astype(np.float32)
        cos = rng.standard_normal((m, hd // 4)).astype(np.float32)
        sin = rng.standard_normal((m, hd // 4)).astype(np.float32)
        kc, vc = bf16(rng, S, Hkv, hd), bf16(rng, S, Hkv, hd)
        for pos in (0, 700, 2500):
            got = {}
            for knob in ("0", "1", "pdl"):  # pdl: two copies, the split kernel and merge as dependent launches
                monkeypatch.setenv("BARO_ATTN_DUP", "0" if knob == "pdl" else knob)
                monkeypatch.setenv("BARO_PDL", "1" if knob == "pdl" else "0")
                poison(platform, (m, H * hd), jnp.bfloat16)
                f = jax.jit(lambda *a: cc.attention(*a))  # a fresh jit: the launcher reads the knob
                o, k2, v2 = f(*put(platform, qkv, qn, kn, cos, sin, kc, vc), np.int32(pos), np.int32(nv))
                got[knob] = [np.asarray(x) for x in (o, k2, v2)]
            assert np.all(np.isfinite(np.asarray(got["0"][0], np.float32))), f"hd={hd} m={m} pos={pos}"
            for other, name in (("1", "two copies vs one"), ("pdl", "BARO_PDL=1 vs plain launches")):
                for a, b, what in zip(got["0"], got[other], ("out", "k_cache", "v_cache")):
                    assert_same_bits(a, b, f"attention hd={hd} m={m} n_valid={nv} pos={pos} {what}: {name}")
    monkeypatch.delenv("BARO_ATTN_DUP", raising=False)
    monkeypatch.delenv("BARO_PDL", raising=False)


# The opt-in Hopper prefill kernel (BARO_ATTN_WGMMA, attention_wgmma.cu: wgmma, sm_90a) must give
# the default prefill kernel's bytes and so the decode path's, row for row: the model's G = 8 at
# head_dim 256 and G = 4 at 128 / 64, positions from 0 to past several 512-position splits, tiles
# with padding rows (m = 5, 300) and a padded call (n_valid < rows). m <= 16 runs the decode tiles
# whatever the knob says; those cases only check that the knob leaves them alone.
AT_WGMMA = {"g8_hd256": (16, 2, 256, 32), "g4_hd128": (8, 2, 128, 32), "g4_hd64": (8, 2, 64, 16)}
AT_WGMMA_S = 2900


@pytest.mark.parametrize("cfg", list(AT_WGMMA))
def test_attention_wgmma_same_bytes(platform, cfg, monkeypatch):
    if platform.platform == "cpu":
        pytest.skip("BARO_ATTN_WGMMA picks a CUDA kernel")
    # skip only on a GPU known not to be sm_90: a missing or differently spelled attribute runs the
    # test, where BARO_ATTN_WGMMA=require turns a fallback into an error instead of a vacuous pass
    cc = str(getattr(platform, "compute_capability", "") or "")
    if cc and cc.replace(".", "") != "90":
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {cc} (elsewhere the knob falls back)")
    H, Hkv, hd, R2 = AT_WGMMA[cfg]
    tables = rope_tables(AT_WGMMA_S + 64, R2)

    def call(knob, rows, cos, sin, kc, vc, pos0, nv):
        monkeypatch.setenv("BARO_ATTN_WGMMA", knob)  # require: an error where it would fall back
        poison(platform, (rows.shape[0], H * hd), jnp.bfloat16)
        f = jax.jit(lambda *a: cc.attention(*a, eps=EPS))  # a fresh jit: the launcher reads the knob
        out = f(*put(platform, rows, qn, kn, cos, sin, kc, vc), i32(pos0), i32(nv))
        return [np.asarray(x) for x in out]

    for m in M_LIST:
        for pos0 in (0, 37, 1000, 2500):
            rng = np.random.default_rng(2100 + m + pos0 + hd)
            qkv, qn, kn, kc, vc = att_setup(rng, m, pos0, S=AT_WGMMA_S, shape=(H, Hkv, hd))
            cos, sin = tables[0][pos0:pos0 + m], tables[1][pos0:pos0 + m]
            what = f"attention {cfg} m={m} pos={pos0}"
            want = call("0", qkv, cos, sin, kc, vc, pos0, m)
            got = call("require" if m > 16 else "1", qkv, cos, sin, kc, vc, pos0, m)
            assert np.all(np.isfinite(got[0].astype(np.float32))), f"{what}: non-finite o"
            for a, b, name in zip(got, want, ("out", "k_cache", "v_cache")):
                assert_same_bits(a, b, f"{what} {name}: BARO_ATTN_WGMMA vs the default")
            monkeypatch.delenv("BARO_ATTN_WGMMA", raising=False)
            one = att_run(platform, qkv, qn, kn, kc, vc, pos0, [1] * m, tables=tables)
            for a, b, name in zip(got, one, ("out", "k_cache", "v_cache")):
                assert_same_bits(a, b, f"{what} {name}: BARO_ATTN_WGMMA vs one row per call")
            if m > 16:  # a padded call: rows >= n_valid are garbage and come back as zeros
                pad = 5
                rows = np.concatenate([qkv, f32(rng, pad, qkv.shape[1], scale=5.0)])
                cos_p = np.concatenate([cos, f32(rng, pad, R2)])
                sin_p = np.concatenate([sin, f32(rng, pad, R2)])
                want = call("0", rows, cos_p, sin_p, kc, vc, pos0, m)
                got = call("require", rows, cos_p, sin_p, kc, vc, pos0, m)
                for a, b, name in zip(got, want, ("out", "k_cache", "v_cache")):
                    assert_same_bits(a, b, f"{what} padded {name}: BARO_ATTN_WGMMA vs the default")
                for a, b, name in zip((got[0][:m], got[1], got[2]), one, ("out", "k_cache", "v_cache")):
                    assert_same_bits(a, b, f"{what} padded {name}: vs one row per call")
                assert_same_bits(got[0][m:], np.zeros_like(got[0][m:]), f"{what} padding rows")
    monkeypatch.delenv("BARO_ATTN_WGMMA", raising=False)


# ---------------------------------------------------------------------------
# moe_slots / moe_route (the tier-mode decode expert cache, staging.ExpertCache)
# ---------------------------------------------------------------------------

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
    assert_close(full, ref_moe(h, *w, k), 1e-3, f"moe top_k={k} vs float64")


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


def store_put(dev, a):
    """a into the host store as tier mode keeps it: pinned host memory on a GPU, else the device."""
    from jax.sharding import SingleDeviceSharding
    if dev.platform == "cpu":
        return jax.device_put(a, dev)
    return jax.device_put(a, SingleDeviceSharding(dev, memory_kind="pinned_host"))


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


def test_gpu_limits_are_refused_before_the_call(monkeypatch):
    """What only the CPU kernels can run is refused in Python when the call goes to a GPU, each
    limit named (a GPU handler's error inside command-buffer capture would crash the process);
    the same shapes still trace for the CPU."""
    import importlib
    lib = importlib.import_module("custom_calls._lib")
    S = jax.ShapeDtypeStruct
    f32, b16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    one = S((), i32)
    hd, H, Hkv, m = 24, 4, 2, 3  # head_dim 24: not a multiple of 16

    def attention():
        return cc.attention(S((m, (2 * H + 2 * Hkv) * hd), f32), S((hd,), f32), S((hd,), f32), S((m, 4), f32),
                            S((m, 4), f32), S((32, Hkv, hd), b16), S((32, Hkv, hd), b16), one, one)

    nv, nk, dk, dv = 4, 2, 24, 16
    y, g = S((m, 2 * nk * dk + nv * dv), f32), S((m, nv), f32)

    def delta():
        return cc.delta(y, g, g, S((nv,), f32), S((nv,), f32), S((nv, dk, dv), f32), one)

    def delta_blocked():
        y2 = S((m, 2 * nk * 32 + nv * 130), f32)
        return cc.delta_blocked(y2, g, g, S((nv,), f32), S((nv,), f32), S((nv, 32, 130), f32), S((nv, 65, 32), f32),
                                S((nv, 65, 130), f32), S((nv, 65), f32), one, one)

    E, D = 9000, 16

    def route():
        return cc.moe_route(S((m, D), b16), S((E, D), b16), 2)

    cases = [(attention, r"baro_attention: the GPU kernel cannot run this call: head_dim=24 \(a multiple of 16"),
             (delta, r"baro_delta: the GPU kernel cannot run this call: dk=24 \(key head dims 16, 32, 64, 128\)"),
             (delta_blocked, r"baro_delta_blocked: .*dv=130 \(value head dims up to 128\); B=65 \(blocks"),
             (route, r"baro_moe_route: the GPU kernel cannot run this call: E=9000 experts \(at most 8192\)")]
    for fn, _ in cases:  # on the CPU they trace (a fresh lambda each time: eval_shape caches traces)
        jax.eval_shape(lambda: fn())
    monkeypatch.setattr(lib, "gpu_platform", lambda args: "CUDA")
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jax.eval_shape(lambda: fn())


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
