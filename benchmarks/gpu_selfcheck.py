"""GPU self-check of the baro kernels at the real Qwen3.5-35B-A3B shapes.

Complements tests/test_kernels_*.py (which use small shapes): here head_dim 256,
dk = dv = 128, 256 experts top-8, D = 2048, contexts crossing many 64-blocks,
K not a multiple of 8 (the scalar GEMM load path) and the 64-row GEMM tiles.

For every op: m rows in one call == the same rows in other splits (one row per
call, padded chunks), byte for byte, including carried state; plus a loose
comparison with the float64 references of custom_calls/testing.py. Then timings
of decode-like (m = 1) and prefill-like (m = 512) calls.

Run (on a GPU machine, repo root, libraries built or BARO_LIB_DIR set):
    python benchmarks/gpu_selfcheck.py [--platform gpu|cpu] [--quick] [--no-time]
Exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import custom_calls as cc
import custom_calls.testing as T  # the float64 references and byte helpers the kernel tests use

BF16 = T.BF16
FAILS: list[str] = []


def check_bits(got, want, what):
    try:
        T.assert_same_bits(got, want, what)
        print(f"  ok    {what}")
    except AssertionError as e:
        print(f"  FAIL  {e}")
        FAILS.append(str(e))


def check_close(got, ref, rel, what):
    try:
        T.assert_close(got, ref, rel, what)
        print(f"  ok    {what}")
    except AssertionError as e:
        print(f"  FAIL  {e}")
        FAILS.append(str(e))


def put(dev, *a):
    return T.put(dev, *a)


def chunks_of(m, c):
    return [min(c, m - r) for r in range(0, m, c)]


# ---------------------------------------------------------------------------

def check_matmul(dev, quick):
    print("matmul")
    rng = np.random.default_rng(1)
    for (K, N) in [(2048, 4096), (40, 1000), (512, 1)]:
        ms = [1, 17, 130] if quick else [1, 7, 16, 17, 64, 130, 600]
        w = T.bf16(rng, N, K)
        wd = put(dev, w)
        for m in ms:
            x = T.bf16(rng, m, K)
            full = np.asarray(T.J_MATMUL(put(dev, x), wd))
            rows = sorted({0, m // 2, m - 1})
            for i in rows:
                one = np.asarray(T.J_MATMUL(put(dev, x[i:i + 1]), wd))
                check_bits(one[0], full[i], f"matmul K={K} N={N} m={m}: row {i} alone")
            if m > 1:
                perm = rng.permutation(m)
                check_bits(np.asarray(T.J_MATMUL(put(dev, x[perm]), wd)), full[perm],
                           f"matmul K={K} N={N} m={m}: permuted rows")
            check_close(full, T.ref_matmul(x, w), 1e-5, f"matmul K={K} N={N} m={m} vs float64")


def check_norms(dev, quick):
    print("rmsnorm / gated_norm")
    rng = np.random.default_rng(2)
    D = 2048
    w = T.f32(rng, D, scale=0.2)
    for m in ([1, 37] if quick else [1, 5, 37, 300]):
        x = T.f32(rng, m, D, scale=3.0)
        full = np.asarray(T.J_RMSNORM(*put(dev, x, w), eps=T.EPS))
        one = np.asarray(T.J_RMSNORM(*put(dev, x[m - 1:], w), eps=T.EPS))
        check_bits(one[0], full[m - 1], f"rmsnorm m={m}: last row alone")
        check_close(full, T.ref_rmsnorm(x, w, T.EPS), 2 ** -7, f"rmsnorm m={m} vs float64")
    nv, dv = 32, 128
    gw = T.f32(rng, dv, scale=0.5)
    for m in ([1, 37] if quick else [1, 5, 37, 300]):
        o = T.f32(rng, m, nv, dv)
        z = T.f32(rng, m, nv * dv)
        full = np.asarray(T.J_GATED(*put(dev, o, z, gw), eps=T.EPS))
        one = np.asarray(T.J_GATED(*put(dev, o[:1], z[:1], gw), eps=T.EPS))
        check_bits(one[0], full[0], f"gated_norm m={m}: first row alone")
        check_close(full, T.ref_gated_norm(o, z, gw, T.EPS), 2 ** -7, f"gated_norm m={m} vs float64")


def att_run(dev, qkv, qn, kn, kc, vc, cos_t, sin_t, pos0, chunks, H, pad_to=None, rng=None):
    kc_d, vc_d = put(dev, kc, vc)
    qn_d, kn_d = put(dev, qn, kn)
    outs, r = [], 0
    W = qkv.shape[1]
    R2 = cos_t.shape[1]
    for c in chunks:
        rows = qkv[r:r + c]
        cos, sin = cos_t[pos0 + r: pos0 + r + c], sin_t[pos0 + r: pos0 + r + c]
        if pad_to is not None and c < pad_to:
            e = pad_to - c
            rows = np.concatenate([rows, T.f32(rng, e, W, scale=5.0)])
            cos = np.concatenate([cos, T.f32(rng, e, R2)])
            sin = np.concatenate([sin, T.f32(rng, e, R2)])
        o, kc_d, vc_d = T.J_ATT(put(dev, rows), qn_d, kn_d, *put(dev, cos, sin), kc_d, vc_d,
                                T.i32(pos0 + r), T.i32(c), eps=T.EPS)
        outs.append(np.asarray(o)[:c])
        r += c
    return np.concatenate(outs), np.asarray(kc_d), np.asarray(vc_d)


def check_attention(dev, quick):
    print("attention (H=16, Hkv=2, hd=256, rotary 64)")
    rng = np.random.default_rng(3)
    H, Hkv, hd, R2 = 16, 2, 256, 32
    W = (2 * H + 2 * Hkv) * hd
    # crosses KV blocks (64) and splits (1024 positions) at several offsets
    cases = [(1000, 40)] if quick else [(0, 200), (1000, 150), (2000, 100)]
    for pos0, L in cases:
        S = pos0 + L + 40
        cos_t, sin_t = T.rope_tables(S + 64, R2, theta=1e7)
        qkv = T.f32(rng, L, W, scale=1.5)
        qn, kn = T.f32(rng, hd, scale=0.2), T.f32(rng, hd, scale=0.2)
        kc = np.full((S, Hkv, hd), np.nan, np.float32).astype(BF16)
        vc = kc.copy()
        kc[:pos0] = T.bf16(rng, pos0, Hkv, hd, scale=2.0)
        vc[:pos0] = T.bf16(rng, pos0, Hkv, hd)
        args = (dev, qkv, qn, kn, kc, vc, cos_t, sin_t, pos0)
        o_full, k_full, v_full = att_run(*args, [L], H)
        splits = {"one row per call": [1] * L, "chunks of 48": chunks_of(L, 48),
                  "chunks of 16": chunks_of(L, 16), "chunks of 5": chunks_of(L, 5)}
        for name, ch in splits.items():
            o, k2, v2 = att_run(*args, ch, H)
            check_bits(o, o_full, f"attention pos0={pos0} L={L}: o, {name}")
            check_bits(k2, k_full, f"attention pos0={pos0} L={L}: k_cache, {name}")
            check_bits(v2, v_full, f"attention pos0={pos0} L={L}: v_cache, {name}")
        o, k2, v2 = att_run(*args, chunks_of(L, 64), H, pad_to=64, rng=rng)
        check_bits(o, o_full, f"attention pos0={pos0} L={L}: o, padded chunks of 64")
        check_bits(k2, k_full, f"attention pos0={pos0} L={L}: k_cache, padded chunks of 64")
        o_ref, kc_ref, _ = T.ref_attention(qkv, qn, kn, cos_t[pos0:pos0 + L], sin_t[pos0:pos0 + L],
                                           kc, vc, pos0, L, H, T.EPS)
        check_close(k_full[pos0:pos0 + L], kc_ref[pos0:pos0 + L], 2 ** -7,
                    f"attention pos0={pos0} L={L}: k_cache vs float64")
        check_close(o_full, o_ref, 1e-2, f"attention pos0={pos0} L={L}: o vs float64")


def seq(dev, fn, row_inputs, consts, state, chunks, pad_to=None, rng=None):
    return T.seq_run(dev, fn, row_inputs, consts, state, chunks, pad_to=pad_to, rng=rng,
                     pad_maker=T.garbage_like)


def check_conv(dev, quick):
    print("conv (C=8192)")
    rng = np.random.default_rng(4)
    C, m = 8192, (40 if quick else 100)
    x, w, win = T.bf16(rng, m, C), T.bf16(rng, C, 4, scale=0.5), T.bf16(rng, 3, C)
    y_full, w_full = seq(dev, T.conv_fn, [x], [w], win, [m])
    for name, ch in {"one row per call": [1] * m, "padded chunks of 16": chunks_of(m, 16)}.items():
        y, wn = seq(dev, T.conv_fn, [x], [w], win, ch, pad_to=16 if "padded" in name else None, rng=rng)
        check_bits(y, y_full, f"conv m={m}: y, {name}")
        check_bits(wn, w_full, f"conv m={m}: window, {name}")
    y_ref, w_ref = T.ref_conv(x, w, win, m)
    check_bits(w_full, w_ref, f"conv m={m}: window vs reference")
    check_close(y_full, y_ref, 1e-5, f"conv m={m}: y vs float64")


def check_delta(dev, quick):
    print("delta (nk=16, nv=32, dk=dv=128)")
    rng = np.random.default_rng(5)
    nk, nv, dk, dv = 16, 32, 128, 128
    m = 24 if quick else 64
    C = 2 * nk * dk + nv * dv
    y = T.f32(rng, m, C)
    b, a = T.f32(rng, m, nv, scale=2.0), T.f32(rng, m, nv, scale=2.0)
    A_log, dt_bias = T.f32(rng, nv, scale=0.5), T.f32(rng, nv, scale=0.5)
    state = T.f32(rng, nv, dk, dv, scale=0.3)
    args = ([y, b, a], [A_log, dt_bias], state)
    o_full, s_full = seq(dev, T.delta_fn, *args, [m])
    for name, ch in {"one row per call": [1] * m, "padded chunks of 16": chunks_of(m, 16)}.items():
        o, s = seq(dev, T.delta_fn, *args, ch, pad_to=16 if "padded" in name else None, rng=rng)
        check_bits(o, o_full, f"delta m={m}: o, {name}")
        check_bits(s, s_full, f"delta m={m}: state, {name}")
    o_ref, s_ref = T.ref_delta(y, b, a, A_log, dt_bias, state, m, nk)
    check_close(o_full, o_ref, 1e-4, f"delta m={m}: o vs float64")
    check_close(s_full, s_ref, 1e-4, f"delta m={m}: state vs float64")


def check_moe(dev, quick):
    print("moe (D=2048, E=256, I=Is=512, top-8)")
    rng = np.random.default_rng(6)
    D, E, I, Is, k = 2048, 256, 512, 512, 8
    wts = (T.bf16(rng, E, D, scale=0.05), T.bf16(rng, E, 2 * I, D, scale=0.03),
           T.bf16(rng, E, D, I, scale=0.03), T.bf16(rng, 2 * Is, D, scale=0.03),
           T.bf16(rng, D, Is, scale=0.03), T.bf16(rng, 1, D, scale=0.03))
    wd = put(dev, *wts)
    for m in ([1, 20] if quick else [1, 20, 1100]):
        h = T.bf16(rng, m, D)
        full = np.asarray(T.J_MOE(put(dev, h), *wd, top_k=k))
        rows = range(m) if m <= 20 else [0, 517, m - 1]
        for i in rows:
            one = np.asarray(T.J_MOE(put(dev, h[i:i + 1]), *wd, top_k=k))
            check_bits(one[0], full[i], f"moe m={m}: row {i} alone")
        if m <= 20:
            check_close(full, T.ref_moe(h, *wts, k), 1e-3, f"moe m={m} vs float64")


# ---------------------------------------------------------------------------

def timeit(fn, *args, reps=20, **kw):
    out = fn(*args, **kw)
    jax.block_until_ready(out)
    t_end = time.perf_counter() + 0.3  # let the clocks ramp up
    while time.perf_counter() < t_end:
        jax.block_until_ready(fn(*args, **kw))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args, **kw)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def time_attention(args, reps):
    """Donated caches, carried from call to call (as the engine does)."""
    *head, kc, vc, p, n = args
    t_end = time.perf_counter() + 0.3
    while True:
        o, kc, vc = T.J_ATT_DONATE(*head, kc, vc, p, n, eps=T.EPS)
        jax.block_until_ready(o)
        if time.perf_counter() > t_end:
            break
    t0 = time.perf_counter()
    for _ in range(reps):
        o, kc, vc = T.J_ATT_DONATE(*head, kc, vc, p, n, eps=T.EPS)
    jax.block_until_ready(o)
    return (time.perf_counter() - t0) / reps * 1e3


def timings(dev):
    print("timings (ms per call, jitted, includes dispatch)")
    rng = np.random.default_rng(7)
    D = 2048
    rows = []
    w = put(dev, T.bf16(rng, 4096, D))
    lm = put(dev, T.bf16(rng, 151936, D))
    for m in (1, 512):
        x = put(dev, T.bf16(rng, m, D))
        rows.append((f"matmul {m}x2048 . 4096x2048", timeit(T.J_MATMUL, x, w)))
        rows.append((f"matmul {m}x2048 . 151936x2048 (lm_head)", timeit(T.J_MATMUL, x, lm, reps=5)))
        xf = put(dev, T.f32(rng, m, D))
        rows.append((f"rmsnorm {m}x2048", timeit(T.J_RMSNORM, xf, put(dev, T.f32(rng, D)), eps=T.EPS)))
    H, Hkv, hd, R2 = 16, 2, 256, 32
    Wd = (2 * H + 2 * Hkv) * hd
    for pos0, m in ((4096, 1), (32768, 1), (131000, 1), (0, 512), (8192, 512), (32768, 512)):
        S = pos0 + m + 8
        kc = put(dev, np.zeros((S, Hkv, hd), BF16))
        vc = put(dev, np.zeros((S, Hkv, hd), BF16))
        args = (put(dev, T.f32(rng, m, Wd)), put(dev, T.f32(rng, hd)), put(dev, T.f32(rng, hd)),
                put(dev, T.f32(rng, m, R2)), put(dev, T.f32(rng, m, R2)), kc, vc,
                put(dev, T.i32(pos0)), put(dev, T.i32(m)))
        rows.append((f"attention m={m} at pos {pos0}", time_attention(args, reps=10)))
    nk, nv, dk, dv = 16, 32, 128, 128
    C = 2 * nk * dk + nv * dv
    for m in (1, 512):
        args = (put(dev, T.f32(rng, m, C)), put(dev, T.f32(rng, m, nv)), put(dev, T.f32(rng, m, nv)),
                put(dev, T.f32(rng, nv)), put(dev, T.f32(rng, nv)),
                put(dev, T.f32(rng, nv, dk, dv, scale=0.1)), put(dev, T.i32(m)))
        rows.append((f"delta m={m}", timeit(T.J_DELTA, *args, reps=5)))
        cargs = (put(dev, T.bf16(rng, m, C)), put(dev, T.bf16(rng, C, 4)), put(dev, T.bf16(rng, 3, C)),
                 put(dev, T.i32(m)))
        rows.append((f"conv m={m}", timeit(T.J_CONV, *cargs)))
    E, I, k = 256, 512, 8
    wts = put(dev, T.bf16(rng, E, D, scale=0.05), T.bf16(rng, E, 2 * I, D, scale=0.03),
              T.bf16(rng, E, D, I, scale=0.03), T.bf16(rng, 2 * I, D, scale=0.03),
              T.bf16(rng, D, I, scale=0.03), T.bf16(rng, 1, D, scale=0.03))
    for m in (1, 512, 2048):
        h = put(dev, T.bf16(rng, m, D))
        rows.append((f"moe m={m} (E=256 top-8)", timeit(T.J_MOE, h, *wts, top_k=k, reps=5)))
    for name, ms in rows:
        print(f"  {ms:9.3f}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--platform", default="gpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args()
    dev = jax.devices(args.platform)[0]
    print(f"device: {dev} ({dev.device_kind}); jax {jax.__version__}; libraries {cc.library_paths()}")
    for f in (check_matmul, check_norms, check_attention, check_conv, check_delta, check_moe):
        t0 = time.perf_counter()
        f(dev, args.quick)
        print(f"  ({time.perf_counter() - t0:.1f} s)")
    if not args.no_time:
        timings(dev)
    print(f"\n{len(FAILS)} failed checks" if FAILS else "\nall checks passed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
