"""baro_delta: the delta rule's bytes over splits and padded calls with the carried state, gates
read in place, the GPU blocks, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import (J_DELTA, assert_close, assert_same_bits, delta_fn, f32, garbage_like,
                                  i32, put, ref_delta, seq_run)
from kernel_util import DT_DV, DT_NK, DT_NV, M_LIST, delta_setup, platform, poison, splits_for


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


# One-token calls run their own instances of the kernel on CUDA (BARO_DELTA_ONE: auto, its choice of
# pipe or cols by the call's tile count; cols and heads,
# one-token stage buffers, three blocks per SM, the grid in either order; pipe, a persistent grid
# whose blocks walk the (head, column block) tiles with the next tiles' state in flight) or, with
# the knob off, the 32-token kernel: each must give the rows of a many-token call, and carry the
# state the same, aliased in place (donated) or not. Many heads side by side (a decode step of
# several sequences folded into one row) as well as the model's own. The shapes reach pipe's edges:
# dv = 80 and 36 (a last column block of 16 and 4), dv = 50 and 7 (no 16-byte copies: dv % 4 != 0),
# dk = 16 and 32 (4 lanes per column, one copy pass), odd head counts (39, 3 x 13), and 13
# sequences' 416 heads: 1664 tiles, more than the H200's 132 SMs x 3 blocks, so every block's
# loop wraps its 4-buffer ring, unevenly (4 or 5 tiles a block).
DELTA_ONE_KNOBS = ("auto", "cols", "heads", "pipe", "off")
DELTA_ONE_SHAPES = DELTA_GPU_SHAPES[:2] + [(24, 96, 128, 128), (3, 39, 32, 50), (2, 6, 16, 20),
                                          (1, 3, 16, 7), (13, 39, 64, 96), (208, 416, 128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DELTA_ONE_SHAPES, ids=lambda s: "nk%d-nv%d-dk%d-dv%d" % s)
def test_delta_one_token_instances(platform, shape, monkeypatch):
    nk, nv, dk, dv = shape
    m = 5
    rng = np.random.default_rng(660 + nv + dk + dv)
    y, b, a, A_log, dt_bias, state = delta_model_inputs(rng, m, nk, nv, dk, dv)
    consts = put(platform, A_log, dt_bias)
    o_full, s_full = (np.asarray(r) for r in
                      J_DELTA(*put(platform, y, b, a), *consts, put(platform, state), i32(m)))
    yg, bg, ag = (garbage_like(rng, 1, x) for x in (y, b, a))  # a padded row's inputs
    for knob in DELTA_ONE_KNOBS:
        monkeypatch.setenv("BARO_DELTA_ONE", knob)
        for fn, what in ((J_DELTA, "aliased"), (J_DELTA_DONATE, "donated")):
            st = put(platform, state)
            for i in range(m):
                poison(platform, (1, nv, dv))
                poison(platform, (nv, dk, dv))
                o1, st = fn(*put(platform, y[i:i + 1], b[i:i + 1], a[i:i + 1]), *consts, st, i32(1))
                assert_same_bits(np.asarray(o1)[0], o_full[i],
                                 f"delta {shape} BARO_DELTA_ONE={knob} row {i} ({what})")
            assert_same_bits(np.asarray(st), s_full, f"delta {shape} BARO_DELTA_ONE={knob} state after {m} rows "
                                                     f"({what})")
            poison(platform, (1, nv, dv))
            poison(platform, (nv, dk, dv))
            o0, s0 = fn(*put(platform, yg, bg, ag), *consts, put(platform, state), i32(0))
            assert np.asarray(o0).tobytes() == np.zeros((1, nv, dv), np.float32).tobytes() and \
                np.asarray(s0).tobytes() == state.tobytes(), \
                f"delta {shape} BARO_DELTA_ONE={knob}: a padded one-token row left a trace ({what})"
    monkeypatch.delenv("BARO_DELTA_ONE")


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


# Same-bits knobs of the many-token kernel. BARO_DELTA_KV: a token's kv partials summed over a
# column's lanes by the xor butterfly (default), by seven independent shuffles and the butterfly's
# tree (gather), or by the first level then three shuffles (two): the same value by construction
# (each node of the tree is the butterfly's, a + b == b + a). BARO_DELTA_STAGE: the batch's q, k, v
# chunks staged by a fixed chunk per thread and each q/k row's scale formed on one lane (fixed, the
# default), or by a flat copy index divided per copy and the scale on every lane (index): the same
# copies, the same function of the same sum. Under each, the many-token call equals the default's
# bytes and one-row calls (the one-token instances keep their code), and with the last rows padded
# (n_valid = m - 3) the default's bytes too:
# dk 128 / 64 / 32 (8 lanes a column) and 16 (4 lanes), dv 50 (no 16-byte copies: the index
# staging under either), one, two, odd and several 32-token batches, the model's head counts.
DELTA_KNOB_SHAPES = DELTA_GPU_SHAPES + [(2, 6, 16, 20), (1, 3, 32, 50), (16, 32, 128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DELTA_KNOB_SHAPES, ids=lambda s: "nk%d-nv%d-dk%d-dv%d" % s)
def test_delta_same_bits_knobs(platform, shape, monkeypatch):
    nk, nv, dk, dv = shape
    for m in (2, 37, 75, 130):
        rng = np.random.default_rng(7100 + m + dk + dv + nv)
        y, b, a, A_log, dt_bias, state = delta_model_inputs(rng, m, nk, nv, dk, dv)
        consts = put(platform, A_log, dt_bias)
        for knob in ("BARO_DELTA_KV", "BARO_DELTA_STAGE"):
            monkeypatch.delenv(knob, raising=False)
        poison(platform, (m, nv, dv))
        o_want, s_want = (np.asarray(r) for r in
                          J_DELTA(*put(platform, y, b, a), *consts, put(platform, state), i32(m)))
        st = put(platform, state)
        for i in range(m):  # the decode arm: one row per call
            o1, st = J_DELTA(*put(platform, y[i:i + 1], b[i:i + 1], a[i:i + 1]), *consts, st, i32(1))
            assert_same_bits(np.asarray(o1)[0], o_want[i], f"delta {shape} m={m} row {i} vs one-row call")
        assert_same_bits(np.asarray(st), s_want, f"delta {shape} m={m} state vs one-row calls")
        nvld = max(m - 3, 1)
        poison(platform, (m, nv, dv))
        o_pad, s_pad = (np.asarray(r) for r in
                        J_DELTA(*put(platform, y, b, a), *consts, put(platform, state), i32(nvld)))
        for knob, value in (("BARO_DELTA_KV", "gather"), ("BARO_DELTA_KV", "two"), ("BARO_DELTA_STAGE", "index")):
            monkeypatch.setenv(knob, value)
            poison(platform, (m, nv, dv))
            o, s2 = J_DELTA(*put(platform, y, b, a), *consts, put(platform, state), i32(nvld))
            assert_same_bits(np.asarray(o), o_pad, f"delta {shape} m={m} n_valid={nvld} {knob}={value} o")
            assert_same_bits(np.asarray(s2), s_pad, f"delta {shape} m={m} n_valid={nvld} {knob}={value} state")
            for fn, what in ((J_DELTA, "aliased"), (J_DELTA_DONATE, "donated")):
                poison(platform, (m, nv, dv))
                poison(platform, (nv, dk, dv))
                o, s2 = fn(*put(platform, y, b, a), *consts, put(platform, state), i32(m))
                assert_same_bits(np.asarray(o), o_want, f"delta {shape} m={m} {knob}={value} o ({what})")
                assert_same_bits(np.asarray(s2), s_want, f"delta {shape} m={m} {knob}={value} state ({what})")
            o, s2 = seq_run(platform, delta_fn, [y, b, a], [A_log, dt_bias], state, [m // 2, m - m // 2])
            assert_same_bits(o, o_want, f"delta {shape} m={m} {knob}={value} split o")
            assert_same_bits(s2, s_want, f"delta {shape} m={m} {knob}={value} split state")
            monkeypatch.delenv(knob)


# Rows mode (rows=True): y [P, C] is one token of each of P sequences (each row laid out as a
# one-row y), b and a the projection [P, W] read at b_col / a_col (its other columns NaN),
# A_log / dt_bias [nv], the state [P*nv, dk, dv] their states side by side. Its bytes are those of
# the one-token call on the rows folded into one row of P*nv heads ([q of every row | k of every
# row | v of every row], A_log and dt_bias tiled: model.gdn_rows before rows mode), o and state, for
# n_valid 0 and 1, aliased and donated, on every one-token instance on CUDA (BARO_DELTA_ONE; and
# BARO_DELTA_COLS=16, the 16-column 32-token kernel); and row p's are those of sequence p's own
# one-token call on its state. nk != nv, dv = 36, 50, 20, 7, 80 (last column blocks of 4, 18, 20,
# 7, 16; no 16-byte copies for 50 and 7), dk = 16 .. 128; 17 rows of 39 heads: 1326 pipe tiles.
DELTA_ROWS_SHAPES = [(2, 4, 16, 16), (1, 2, 64, 36), (3, 39, 32, 50), (2, 6, 16, 20), (1, 3, 16, 7),
                     (2, 4, 128, 80)]
DELTA_ROWS_P = [1, 2, 3, 8, 17]
DELTA_ROWS_KNOBS = [("auto", "32"), ("cols", "32"), ("heads", "32"), ("pipe", "32"), ("off", "32"), ("auto", "16")]


def delta_folded(P, nk, nv, dk, b_col, a_col):
    """model.gdn_rows' delta before rows mode: the P rows folded into one row of P*nv heads."""
    qk = nk * dk

    def f(y, proj, A_log, dt_bias, state, n):
        fold = lambda x: x.reshape(1, -1)
        y1 = jnp.concatenate([fold(y[:, :qk]), fold(y[:, qk:2 * qk]), fold(y[:, 2 * qk:])], axis=1)
        o, s = cc.delta(y1, fold(proj[:, b_col:b_col + nv]), fold(proj[:, a_col:a_col + nv]), jnp.tile(A_log, P),
                        jnp.tile(dt_bias, P), state, n)
        return o.reshape(P, nv, -1), s

    return jax.jit(f)


@pytest.mark.parametrize("shape", DELTA_ROWS_SHAPES, ids=lambda s: "nk%d-nv%d-dk%d-dv%d" % s)
@pytest.mark.parametrize("P", DELTA_ROWS_P)
def test_delta_rows_mode(platform, P, shape, monkeypatch):
    nk, nv, dk, dv = shape
    rng = np.random.default_rng(700 + 31 * P + nv + dk + dv)
    y, b, a, A_log, dt_bias, _ = delta_model_inputs(rng, P, nk, nv, dk, dv)
    state = f32(rng, P * nv, dk, dv, scale=0.5)
    b_col, a_col = 3, 3 + nv + 2
    proj = np.full((P, a_col + nv + 5), np.nan, np.float32)
    proj[:, b_col:b_col + nv], proj[:, a_col:a_col + nv] = b, a
    yd, pj, Al, dtb = put(platform, y, proj, A_log, dt_bias)
    folded = delta_folded(P, nk, nv, dk, b_col, a_col)
    rows_fn = lambda *x: cc.delta(*x, b_col=b_col, a_col=a_col, rows=True)
    fns = ((jax.jit(rows_fn), "aliased"), (jax.jit(rows_fn, donate_argnums=(5,)), "donated"))
    for knob in DELTA_ROWS_KNOBS if platform.platform == "gpu" else [None]:
        if knob:
            monkeypatch.setenv("BARO_DELTA_ONE", knob[0])
            monkeypatch.setenv("BARO_DELTA_COLS", knob[1])
        for nvld in (0, 1):
            o_want, s_want = (np.asarray(r) for r in folded(yd, pj, Al, dtb, put(platform, state), i32(nvld)))
            for fn, what in fns:
                poison(platform, (P, nv, dv))
                poison(platform, (P * nv, dk, dv))
                o, s = (np.asarray(r) for r in fn(yd, pj, pj, Al, dtb, put(platform, state), i32(nvld)))
                where = f"delta rows P={P} {shape} knobs {knob} n_valid={nvld} ({what})"
                assert o.shape == (P, nv, dv) and s.shape == (P * nv, dk, dv)
                assert_same_bits(o, o_want, f"{where}: o")
                assert_same_bits(s, s_want, f"{where}: state")
            if nvld == 0:
                assert o.tobytes() == np.zeros_like(o).tobytes() and s.tobytes() == state.tobytes(), \
                    f"delta rows P={P} {shape} knobs {knob}: n_valid=0 left a trace"
        # each row is its sequence alone: the one-token call on its own state
        one = jax.jit(lambda *x: cc.delta(*x, b_col=b_col, a_col=a_col))
        for p in range(P):
            o1, s1 = one(put(platform, y[p:p + 1]), *(put(platform, proj[p:p + 1]),) * 2, Al, dtb,
                         put(platform, state[p * nv:(p + 1) * nv]), i32(1))
            assert_same_bits(np.asarray(o1)[0], o[p], f"delta rows P={P} {shape} knobs {knob} row {p} vs alone: o")
            assert_same_bits(np.asarray(s1), s[p * nv:(p + 1) * nv],
                             f"delta rows P={P} {shape} knobs {knob} row {p} vs alone: state")
    if platform.platform == "cpu":  # ops_xla's rows mode is its own folded call (on CPU only: XLA's own kernels)
        import baro_jax.ops_xla as X
        qk = nk * dk
        fold = lambda x: x.reshape(1, -1)
        y1 = jnp.concatenate([fold(yd[:, :qk]), fold(yd[:, qk:2 * qk]), fold(yd[:, 2 * qk:])], axis=1)
        want = X.delta(y1, fold(pj[:, b_col:b_col + nv]), fold(pj[:, a_col:a_col + nv]), jnp.tile(Al, P),
                       jnp.tile(dtb, P), put(platform, state), i32(1), nk=P * nk, dk=dk)
        got = X.delta(yd, pj, pj, Al, dtb, put(platform, state), i32(1), nk=nk, dk=dk, b_col=b_col, a_col=a_col,
                      rows=True)
        for g, w_, what in zip(got, want, ("o", "state")):
            assert_same_bits(np.asarray(g).reshape(-1), np.asarray(w_).reshape(-1), f"ops_xla delta rows P={P}: {what}")


def test_delta_rows_mode_errors(platform):
    rng = np.random.default_rng(12)
    nk, nv, dk, dv, P = 2, 4, 16, 16, 3
    y, b, a, A_log, dt_bias, _ = delta_model_inputs(rng, P, nk, nv, dk, dv)
    y, b, a, A_log, dt_bias, state = put(platform, y, b, a, A_log, dt_bias, f32(rng, P * nv, dk, dv))
    with pytest.raises(ValueError, match=r"baro_delta: state must have shape \[P\*nv, dk, dv\] = \[12, dk, dv\] with "
                                         r"rows=True \(P=3 rows of y, nv=4 from A_log\), got shape \[4, 16, 16\]"):
        cc.delta(y, b, a, A_log, dt_bias, state[:nv], 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: state must have shape \[P\*nv, dk, dv\] = \[12, dk, dv\]"):
        cc.delta(y, b, a, A_log, dt_bias, state[:-1], 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: y must have shape \[m, 2\*nk\*dk \+ nv\*dv\]"):
        cc.delta(y[:, :-4], b, a, A_log, dt_bias, state, 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: dt_bias must have shape \[4\], got shape \[12\]"):
        cc.delta(y, b, a, A_log, jnp.tile(dt_bias, P), state, 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: b must have shape \[3, W\] with b_col \+ nv <= W "
                                         r"\(b_col=0, nv=4\), got shape \[1, 12\]"):
        cc.delta(y, b.reshape(1, -1), a, A_log, dt_bias, state, 1, rows=True)  # the folded gates
    with pytest.raises(ValueError, match=r"baro_delta: a must have shape \[3, W\] with a_col \+ nv <= W "
                                         r"\(a_col=2, nv=4\), got shape \[3, 4\]"):
        cc.delta(y, b, a, A_log, dt_bias, state, 1, a_col=2, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: rows=True needs y \[P, C\] with P >= 1"):
        cc.delta(y[:0], b[:0], a[:0], A_log, dt_bias, state[:0], 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: A_log must have rank 1, got shape \[4, 1\]"):
        cc.delta(y, b, a, A_log[:, None], dt_bias, state, 1, rows=True)
    with pytest.raises(ValueError, match=r"baro_delta: rows must be a static bool, got str"):
        cc.delta(y, b, a, A_log, dt_bias, state, 1, rows="yes")
