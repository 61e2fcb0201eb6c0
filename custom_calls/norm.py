"""baro_rmsnorm (zero-centred, 1 + w), baro_add_rmsnorm (a residual add, then that norm) and
baro_gated_norm (plain w, silu(z) gate)."""

from __future__ import annotations

import jax

from . import _check as C
from ._lib import check_runnable


def rmsnorm(x, w, eps):
    """x[m,D] f32, w[D] f32 -> bf16((x * rsqrt(mean(x^2) + eps)) * (1 + w)) [m,D]."""
    op = "baro_rmsnorm"
    C.rank(op, "x", x, 2)
    m, D = x.shape
    C.array(op, "x", x, (m, D), C.F32)
    C.array(op, "w", w, (D,), C.F32)
    eps = C.f32_attr(op, "eps", eps)
    check_runnable(op, (x, w))
    return jax.ffi.ffi_call(op, jax.ShapeDtypeStruct((m, D), C.BF16))(x, w, eps=eps)


def add_rmsnorm(x, y, w, eps):
    """x[m,D] f32, y[m,D] f32, w[D] f32 -> (s = x + y [m,D] f32, rmsnorm(s, w) [m,D] bf16): the
    bytes of `x + y` and rmsnorm of it, in one call (a decode step had 40 such adds, each its own
    kernel)."""
    op = "baro_add_rmsnorm"
    C.rank(op, "x", x, 2)
    m, D = x.shape
    C.array(op, "x", x, (m, D), C.F32)
    C.array(op, "y", y, (m, D), C.F32)
    C.array(op, "w", w, (D,), C.F32)
    eps = C.f32_attr(op, "eps", eps)
    check_runnable(op, (x, y, w))
    return tuple(jax.ffi.ffi_call(op, (jax.ShapeDtypeStruct((m, D), C.F32), jax.ShapeDtypeStruct((m, D), C.BF16)))(
        x, y, w, eps=eps))


def gated_norm(o, z, w, eps, z_col=0):
    """o[m,nv,dv] f32, z[m,W] f32 with z_col + nv*dv <= W, w[dv] f32
    -> bf16((o*r) * w * silu(g)) [m,nv*dv], g = z[:, z_col:z_col + nv*dv].

    z may be a wider array holding the gates at column z_col (the model passes the GDN input
    projection whole: a slice would be a copy before the call)."""
    op = "baro_gated_norm"
    C.rank(op, "o", o, 3)
    m, nv, dv = o.shape
    C.array(op, "o", o, (m, nv, dv), C.F32)
    z_col = C.column(op, "z_col", z_col)
    C.columns(op, "z", z, m, z_col, nv * dv, "z_col", "nv*dv", C.F32)
    C.array(op, "w", w, (dv,), C.F32)
    eps = C.f32_attr(op, "eps", eps)
    check_runnable(op, (o, z, w))
    return jax.ffi.ffi_call(op, jax.ShapeDtypeStruct((m, nv * dv), C.BF16))(o, z, w, eps=eps, z_col=z_col)
