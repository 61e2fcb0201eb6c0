"""The kernels' float64 numpy references (docs/NUMERICS.md, bf16 rounding points included) and
the helpers that compare their bytes, shared by the kernel tests (tests/test_kernels_*.py) and
the GPU self-check at the model's shapes (benchmarks/gpu_selfcheck.py).
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

import custom_calls as cc


BF16 = ml_dtypes.bfloat16


EPS = 1e-6


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
            out[i] += wk * rbf16(f64(w_down[e]) @ act)  # each expert's output in bf16 (NUMERICS)
        gu = f64(sgu) @ h[i]
        act = rbf16(gu[:Is] * sigmoid(gu[:Is]) * gu[Is:])
        out[i] += sigmoid(f64(sgate)[0] @ h[i]) * rbf16(f64(sdown) @ act)
    return out


J_MATMUL = jax.jit(cc.matmul)
J_RMSNORM = jax.jit(cc.rmsnorm, static_argnames=("eps",))
J_GATED = jax.jit(cc.gated_norm, static_argnames=("eps",))
J_ATT = jax.jit(cc.attention, static_argnames=("eps",))
J_CONV = jax.jit(cc.conv)
J_DELTA = jax.jit(cc.delta)
J_MOE = jax.jit(cc.moe, static_argnames=("top_k",))


def i32(v):
    return np.asarray(v, np.int32)


J_ATT_DONATE = jax.jit(cc.attention, static_argnames=("eps",), donate_argnums=(5, 6))


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


def delta_fn(y, b, a, A_log, dt_bias, state, n_valid):
    return J_DELTA(y, b, a, A_log, dt_bias, state, n_valid)
