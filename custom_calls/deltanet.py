"""Gated DeltaNet kernels: baro_conv (causal depthwise conv, window 4, SiLU)
baro_delta (gated delta rule with fp32 state) and baro_delta_blocked (the same rule in
its chunk-aligned form, docs/DESIGN.md §9; its CUDA kernel passes its 79 GPU tests on the H200:
benchmarks/results/gpu_delta_blocked_tests_h200.txt)."""

from __future__ import annotations

import jax
import numpy as np

from . import _check as C
from ._lib import check_gpu_limits, check_runnable

CONV_K = 4
GPU_DK = (16, 32, 64, 128)  # the key head dims the GPU delta kernels are built for


def _rows_flag(op, rows):
    """The static `rows` switch of conv and delta: a bool, passed to the handlers as 0 / 1."""
    if not isinstance(rows, (bool, np.bool_)):
        raise ValueError(f"{op}: rows must be a static bool, got {type(rows).__name__}")
    return np.int64(bool(rows))


def conv(x, w, window, n_valid, rows=False, packed=False):
    """x[m,C] bf16, w[C,4] bf16, window[3,C] bf16 (oldest first), n_valid int32
    -> (y[m,C] f32 = silu(causal conv), new window[3,C] bf16, updated in place).

    x may instead be f32 [m, W] with W >= C (C from w): the GDN input projection whole, whose
    first C columns rounded to bf16 are the conv input (baro_conv_proj: the slice and the
    convert XLA would run before baro_conv, done on load). packed=True: x is matmul's output with
    bf16_cols >= C, its first C columns already bf16, packed at the start of each row; the same
    bytes as the unpacked projection gives.

    rows=True (baro_conv_proj only): x f32 [P, W] is one token of each of P sequences, window
    [3, P*C] their windows side by side (sequence p's at columns p*C ..), n_valid 0 or 1 ->
    (y [P, C], window [3, P*C]): the bytes of the one-token call on the P rows folded into one
    row of P*C channels with w tiled P times, without the fold."""
    op = "baro_conv"
    rows_attr = _rows_flag(op, rows)
    if not isinstance(packed, (bool, np.bool_)):
        raise ValueError(f"{op}: packed must be a static bool, got {type(packed).__name__}")
    C.rank(op, "x", x, 2)
    if packed and np.dtype(x.dtype) != np.float32:
        raise ValueError(f"{op}: packed=True takes x as the f32 projection matmul packed (baro_conv_proj), "
                         f"got dtype {np.dtype(x.dtype).name} (shape {list(x.shape)})")
    if np.dtype(x.dtype) == np.float32:
        op = "baro_conv_proj"
        m, W = x.shape
        C.rank(op, "w", w, 2)
        Cc = w.shape[0]
        if Cc > W:
            raise ValueError(f"{op}: x must have at least C={Cc} columns (C from w), got shape {list(x.shape)}")
    else:
        if rows:
            raise ValueError(f"{op}: rows=True takes x as the f32 projection [P, W] (baro_conv_proj), "
                             f"got dtype {np.dtype(x.dtype).name} (shape {list(x.shape)})")
        m, Cc = x.shape
        C.array(op, "x", x, (m, Cc), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(op, "w", w, (Cc, CONV_K), C.BF16, dtype_note=C.BF16_NOTE)
    P = m if rows else 1
    if rows and P < 1:
        raise ValueError(f"{op}: rows=True needs x [P, W] with P >= 1, got shape {list(x.shape)}")
    if rows and tuple(np.shape(window)) != (CONV_K - 1, P * Cc):
        raise ValueError(f"{op}: window must have shape [3, P*C] = [3, {P * Cc}] with rows=True (P={P} rows "
                         f"of x, C={Cc} from w), got shape {list(np.shape(window))}")
    C.array(op, "window", window, (CONV_K - 1, P * Cc), C.BF16, dtype_note=C.BF16_NOTE)
    n_valid = C.int_scalar(op, "n_valid", n_valid)
    args = (x, w, window, n_valid)
    check_gpu_limits(op, args, [(P * Cc <= 65535 * 256, f"C={P * Cc} channels (at most {65535 * 256})")])
    check_runnable(op, args)
    call = jax.ffi.ffi_call(
        op,
        (jax.ShapeDtypeStruct((m, Cc), C.F32),
         jax.ShapeDtypeStruct((CONV_K - 1, P * Cc), C.BF16)),
        input_output_aliases={2: 1},
    )
    if op == "baro_conv_proj":
        return tuple(call(*args, rows=rows_attr, packed=np.int64(bool(packed))))
    return tuple(call(*args, rows=rows_attr))


def _check_delta_operands(op, y, b, a, A_log, dt_bias, state, b_col=None, a_col=None, rows=False):
    """The operands baro_delta and baro_delta_blocked share; returns (m, nv, dk, dv).
    b_col / a_col None: b and a are exactly [m, nv]; an int: [m, W], the gates at that column.
    rows: y's m rows are one token of m sequences, nv from A_log, state [m*nv, dk, dv]."""
    C.rank(op, "y", y, 2)
    m, Cc = y.shape
    C.array(op, "y", y, (m, Cc), C.F32)
    C.rank(op, "state", state, 3)
    if rows:
        C.rank(op, "A_log", A_log, 1)
        nv = A_log.shape[0]
        if m < 1 or nv < 1:
            raise ValueError(f"{op}: rows=True needs y [P, C] with P >= 1 and A_log [nv] with nv >= 1, "
                             f"got y {list(y.shape)} and A_log {list(A_log.shape)}")
        if state.shape[0] != m * nv:
            raise ValueError(f"{op}: state must have shape [P*nv, dk, dv] = [{m * nv}, dk, dv] with rows=True "
                             f"(P={m} rows of y, nv={nv} from A_log), got shape {list(state.shape)}")
        dk, dv = state.shape[1:]
        C.array(op, "state", state, (m * nv, dk, dv), C.F32)
    else:
        nv, dk, dv = state.shape
        C.array(op, "state", state, (nv, dk, dv), C.F32)
    if min(nv, dk, dv) < 1 or Cc <= nv * dv or (Cc - nv * dv) % (2 * dk):
        raise ValueError(f"{op}: y must have shape [m, 2*nk*dk + nv*dv] with nv={nv}, "
                         f"dk={dk}, dv={dv} (from state), got shape {list(y.shape)}")
    nk = (Cc - nv * dv) // (2 * dk)
    if nv % nk:
        raise ValueError(f"{op}: nv={nv} value heads must be a multiple of nk={nk} key heads "
                         f"(nk from y width {Cc})")
    for name, g, col in (("b", b, b_col), ("a", a, a_col)):
        if col is None:
            C.array(op, name, g, (m, nv), C.F32)
        else:
            C.columns(op, name, g, m, col, nv, f"{name}_col", "nv", C.F32)
    C.array(op, "A_log", A_log, (nv,), C.F32)
    C.array(op, "dt_bias", dt_bias, (nv,), C.F32)
    return m, nv, dk, dv


def delta(y, b, a, A_log, dt_bias, state, n_valid, b_col=0, a_col=0, rows=False):
    """y[m, 2*nk*dk + nv*dv] f32 (q, k, v), b/a f32 with row i's nv gates at columns
    b_col.. / a_col.. (b/a may be wider than [m, nv]: the model passes the GDN projection whole,
    as a slice would be copied before the call), A_log/dt_bias[nv] f32, state[nv,dk,dv] f32,
    n_valid int32 -> (o[m,nv,dv] f32, state updated in place).

    rows=True: y [P, 2*nk*dk + nv*dv] is one token of each of P sequences (each row laid out as
    a one-row y), b/a [P, W], state [P*nv, dk, dv] their states side by side (nv from A_log),
    n_valid 0 or 1 -> (o [P, nv, dv], state): the bytes of the one-token call on the P rows
    folded into one row of P*nv heads with A_log and dt_bias tiled, without the fold."""
    op = "baro_delta"
    rows_attr = _rows_flag(op, rows)
    b_col, a_col = C.column(op, "b_col", b_col), C.column(op, "a_col", a_col)
    m, nv, dk, dv = _check_delta_operands(op, y, b, a, A_log, dt_bias, state, b_col, a_col, rows=bool(rows))
    P = m if rows else 1
    n_valid = C.int_scalar(op, "n_valid", n_valid)
    args = (y, b, a, A_log, dt_bias, state, n_valid)
    check_gpu_limits(op, args, [(dk in GPU_DK, f"dk={dk} (key head dims {', '.join(map(str, GPU_DK))})"),
                                (dv <= 65535 * 32, f"dv={dv} (at most {65535 * 32})"),
                                (P * nv < 2 ** 31, f"P*nv={P * nv} value heads (fewer than 2^31)")])
    check_runnable(op, args)
    return tuple(jax.ffi.ffi_call(
        op,
        (jax.ShapeDtypeStruct((m, nv, dv), C.F32),
         jax.ShapeDtypeStruct((P * nv, dk, dv), C.F32)),
        input_output_aliases={5: 1},
    )(*args, b_col=b_col, a_col=a_col, rows=rows_attr))


def delta_blocked(y, b, a, A_log, dt_bias, state, pending_k, pending_u, pending_c, pos, n_valid):
    """The chunk-aligned delta rule (docs/DESIGN.md §9, docs/NUMERICS.md "delta_blocked").

    y, b, a, A_log, dt_bias as `delta`; state[nv,dk,dv] f32 = S0, the state at the start of
    the block holding position pos; pending_k[nv,B,dk], pending_u[nv,B,dv], pending_c[nv,B]
    f32: the block's rows before pos (slots 0 .. pos%B - 1; B from their shape); pos, n_valid
    int32 -> (o[m,nv,dv] f32, state, pending_k, pending_u, pending_c), all updated in place."""
    op = "baro_delta_blocked"
    m, nv, dk, dv = _check_delta_operands(op, y, b, a, A_log, dt_bias, state)
    C.rank(op, "pending_k", pending_k, 3)
    B = pending_k.shape[1]
    if B < 1:
        raise ValueError(f"{op}: pending_k must have shape [nv, B, dk] with B >= 1, got {list(pending_k.shape)}")
    C.array(op, "pending_k", pending_k, (nv, B, dk), C.F32)
    C.array(op, "pending_u", pending_u, (nv, B, dv), C.F32)
    C.array(op, "pending_c", pending_c, (nv, B), C.F32)
    pos = C.int_scalar(op, "pos", pos)
    n_valid = C.int_scalar(op, "n_valid", n_valid)
    args = (y, b, a, A_log, dt_bias, state, pending_k, pending_u, pending_c, pos, n_valid)
    check_gpu_limits(op, args, [(dk in GPU_DK, f"dk={dk} (key head dims {', '.join(map(str, GPU_DK))})"),
                                (dv <= 128, f"dv={dv} (value head dims up to 128)"),
                                (B <= 64, f"B={B} (blocks of at most 64 rows)")])
    check_runnable(op, args)
    return tuple(jax.ffi.ffi_call(
        op,
        (jax.ShapeDtypeStruct((m, nv, dv), C.F32),
         jax.ShapeDtypeStruct((nv, dk, dv), C.F32),
         jax.ShapeDtypeStruct((nv, B, dk), C.F32),
         jax.ShapeDtypeStruct((nv, B, dv), C.F32),
         jax.ShapeDtypeStruct((nv, B), C.F32)),
        input_output_aliases={5: 1, 6: 2, 7: 3, 8: 4},
    )(*args))
