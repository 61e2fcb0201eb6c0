"""baro_rmsnorm, baro_add_rmsnorm, baro_gated_norm: row independence at the model widths, the
runtime-D kernels, gates read in place, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import (BF16, EPS, J_GATED, J_RMSNORM, assert_close, assert_same_bits, f32,
                                  put, ref_gated_norm, ref_rmsnorm)
from kernel_util import GN_DV, GN_NV, M_LIST, NORM_D, platform, poison


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
