"""baro_conv / baro_conv_proj: the causal conv's bytes over splits and padded calls with the
carried window, the GPU blocks, the projection read whole, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import (BF16, J_CONV, assert_close, assert_same_bits, bf16, conv_fn, f32,
                                  garbage_like, i32, put, ref_conv, seq_run)
from kernel_util import CPU, CV_C, M_LIST, platform, poison, splits_for


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
# C are NaN and never read. W = C: an f32 x of exactly C columns is the projection too (ops_xla
# rounds it as well).
@pytest.mark.parametrize("C,W", [(4104, 4104 + 60), (4104, 4104 + 61), (44, 44 + 9), (48, 48)])
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


# packed=True: the projection as matmul(bf16_cols=C) returns it (the conv channels bf16 at the start
# of each row) gives the bytes of the fp32 projection's conv, y and window, one token and many,
# rows mode too; C % 8 == 0 with W % 4 == 0 (the vector path) and not (the scalar one).
@pytest.mark.parametrize("C,W", [(1024, 1024 + 136), (40, 40 + 9)])
@pytest.mark.parametrize("m", [1, 2, 9, 70])
def test_conv_reads_the_packed_projection(platform, m, C, W):
    rng = np.random.default_rng(560 + m + W)
    x, wi = bf16(rng, m, 64), bf16(rng, W, 64)
    xd, wid = put(platform, x, wi)
    proj = cc.matmul(xd, wid)
    packed = cc.matmul(xd, wid, bf16_cols=C)
    w, win = put(platform, bf16(rng, C, 4, scale=0.5), bf16(rng, 3, C))
    conv_packed = jax.jit(lambda p, a, b, n: cc.conv(p, a, b, n, packed=True))
    for nvld in sorted({0, 1, m // 2, m}):
        want = [np.asarray(r) for r in J_CONV(proj, w, win, i32(nvld))]
        poison(platform, (m, C))
        got = [np.asarray(r) for r in conv_packed(packed, w, win, i32(nvld))]
        assert_same_bits(got[1], want[1], f"conv packed C={C} W={W} m={m} n_valid={nvld} window")
        assert_same_bits(got[0][:nvld], want[0][:nvld], f"conv packed C={C} W={W} m={m} n_valid={nvld} y")
    # rows mode: each row one token of its own sequence
    wins = put(platform, bf16(rng, 3, m * C))
    rows = jax.jit(lambda p, a, b, n, k: cc.conv(p, a, b, n, rows=True, packed=k), static_argnums=4)
    for nvld in (0, 1):
        want = [np.asarray(r) for r in rows(proj, w, wins, i32(nvld), False)]
        got = [np.asarray(r) for r in rows(packed, w, wins, i32(nvld), True)]
        assert_same_bits(got[1], want[1], f"conv packed rows C={C} W={W} P={m} n_valid={nvld} window")
        assert_same_bits(got[0][:nvld], want[0][:nvld], f"conv packed rows C={C} W={W} P={m} y")


def test_conv_packed_errors(platform):
    rng = np.random.default_rng(10)
    w, win = put(platform, bf16(rng, 8, 4), bf16(rng, 3, 8))
    with pytest.raises(ValueError, match=r"baro_conv: packed=True takes x as the f32 projection matmul packed "
                                         r"\(baro_conv_proj\), got dtype bfloat16"):
        cc.conv(put(platform, bf16(rng, 2, 8)), w, win, 2, packed=True)
    with pytest.raises(ValueError, match=r"baro_conv: packed must be a static bool, got int"):
        cc.conv(put(platform, f32(rng, 2, 12)), w, win, 2, packed=1)
    import baro_jax.ops_xla as X  # its gdn_projection never packs, so its conv takes no packed input
    with pytest.raises(ValueError, match=r"conv: packed=True takes the ordered backend's packed projection"):
        X.conv(put(platform, f32(rng, 2, 12)), w, win, 2, packed=True)


def test_conv_proj_errors(platform):
    rng = np.random.default_rng(9)
    w, win = put(platform, bf16(rng, 8, 4), bf16(rng, 3, 8))
    with pytest.raises(ValueError, match=r"baro_conv_proj: x must have at least C=8 columns \(C from w\), "
                                         r"got shape \[2, 6\]"):
        cc.conv(put(platform, f32(rng, 2, 6)), w, win, 2)
    with pytest.raises(ValueError, match=r"baro_conv_proj: window must have shape \[3, 8\]"):
        cc.conv(put(platform, f32(rng, 2, 12)), w, win[:, :7], 2)


# Rows mode (baro_conv_proj, rows=True): x [P, W] is one token of each of P sequences, the window
# [3, P*C] theirs side by side (sequence p at columns p*C ..). Its bytes are those of the one-token
# call on the P rows folded into one row of P*C channels with w tiled P times (model.gdn_rows before
# rows mode), y and window, for n_valid 0 and 1, aliased and donated; and row p's are those of
# sequence p's own one-token call on its window. C = 48 and 4104 (the GPU's 8-channel path; 4104
# x 17 rows: 35 channel blocks), C = 44 (the one-channel path: C % 8 != 0) and W odd (no 16-byte
# rows); the projection's columns past C are NaN and never read.
CONV_ROWS_P = [1, 2, 3, 8, 17]


def conv_folded(P, C):
    """model.gdn_rows' conv before rows mode: the P rows folded into one row, w tiled."""
    return jax.jit(lambda x, w, win, n: cc.conv(x[:, :C].reshape(1, P * C), jnp.tile(w, (P, 1)), win, n))


@pytest.mark.parametrize("C,W", [(48, 48 + 20), (44, 44 + 9), (4104, 4104 + 60), (4104, 4104 + 61)])
@pytest.mark.parametrize("P", CONV_ROWS_P)
def test_conv_rows_mode(platform, P, C, W):
    rng = np.random.default_rng(560 + 7 * P + W)
    proj = np.full((P, W), np.nan, np.float32)
    proj[:, :C] = f32(rng, P, C, scale=2.0)
    w, win = bf16(rng, C, 4, scale=0.5), bf16(rng, 3, P * C)
    wd, pj = put(platform, w, proj)
    folded = conv_folded(P, C)
    rows = jax.jit(lambda *a: cc.conv(*a, rows=True))
    rows_donate = jax.jit(lambda *a: cc.conv(*a, rows=True), donate_argnums=(2,))
    for nvld in (0, 1):
        y_want, win_want = (np.asarray(r) for r in folded(pj, wd, put(platform, win), i32(nvld)))
        for fn, what in ((rows, "aliased"), (rows_donate, "donated")):
            poison(platform, (P, C))
            y, wn = (np.asarray(r) for r in fn(pj, wd, put(platform, win), i32(nvld)))
            assert y.shape == (P, C) and wn.shape == (3, P * C)
            assert_same_bits(y, y_want.reshape(P, C), f"conv rows P={P} C={C} W={W} n_valid={nvld} y ({what})")
            assert_same_bits(wn, win_want, f"conv rows P={P} C={C} W={W} n_valid={nvld} window ({what})")
        if nvld == 0:
            assert_same_bits(wn, win, f"conv rows P={P} C={C}: n_valid=0 changed the window")
    # each row is its sequence alone: the one-token call on its own window
    one = jax.jit(lambda *a: cc.conv(*a))
    for p in range(P):
        y1, w1 = one(put(platform, proj[p:p + 1]), wd, put(platform, win[:, p * C:(p + 1) * C]), i32(1))
        assert_same_bits(np.asarray(y1)[0], y[p], f"conv rows P={P} C={C} row {p} vs its call alone: y")
        assert_same_bits(np.asarray(w1), wn[:, p * C:(p + 1) * C], f"conv rows P={P} C={C} row {p} vs alone: window")
    if platform.platform == "cpu":  # ops_xla's rows mode is its own folded call (on CPU only: XLA's own kernels)
        import baro_jax.ops_xla as X
        fx = jax.jit(lambda x, w, win, n: X.conv(x[:, :C].reshape(1, P * C), jnp.tile(w, (P, 1)), win, n))
        want = fx(pj, wd, put(platform, win), i32(1))
        got = X.conv(pj, wd, put(platform, win), i32(1), rows=True)
        for g, w_, what in zip(got, want, ("y", "window")):
            assert_same_bits(np.asarray(g).reshape(-1), np.asarray(w_).reshape(-1), f"ops_xla conv rows P={P}: {what}")


def test_conv_rows_mode_errors(platform):
    rng = np.random.default_rng(11)
    P, C, W = 3, 8, 13
    x, w, win = put(platform, f32(rng, P, W), bf16(rng, C, 4), bf16(rng, 3, P * C))
    with pytest.raises(ValueError, match=r"baro_conv_proj: window must have shape \[3, P\*C\] = \[3, 24\] with "
                                         r"rows=True \(P=3 rows of x, C=8 from w\), got shape \[3, 8\]"):
        cc.conv(x, w, win[:, :C], 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_conv_proj: window must have shape \[3, P\*C\] = \[3, 24\] with "
                                         r"rows=True .*got shape \[2, 24\]"):
        cc.conv(x, w, win[:2], 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_conv: rows=True takes x as the f32 projection \[P, W\] "
                                         r"\(baro_conv_proj\), got dtype bfloat16 \(shape \[3, 8\]\)"):
        cc.conv(x[:, :C].astype(jnp.bfloat16), w, win, 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_conv_proj: x must have at least C=8 columns \(C from w\), "
                                         r"got shape \[3, 6\]"):
        cc.conv(x[:, :6], w, win, 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_conv_proj: rows=True needs x \[P, W\] with P >= 1, got shape \[0, 13\]"):
        cc.conv(x[:0], w, win[:, :0], 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_conv: rows must be a static bool, got int"):
        cc.conv(x, w, win, 1, rows=1)
    with pytest.raises(ValueError, match=r"baro_conv: rows must be a static bool, got .*Tracer"):
        jax.jit(cc.conv)(x, w, win, i32(1), True)
