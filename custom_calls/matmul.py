"""baro_matmul: y[m,N] f32 = x[m,K] bf16 @ w[N,K]^T bf16, row-invariant order."""

from __future__ import annotations

import jax

from . import _check as C
from ._lib import check_runnable

OP = "baro_matmul"


def matmul(x, w):
    """x[m,K] bf16, w[N,K] bf16 -> y[m,N] f32 (fp32 accumulation, fixed order)."""
    C.rank(OP, "x", x, 2)
    m, K = x.shape
    C.array(OP, "x", x, (m, K), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(OP, "w", w, 2)
    C.array(OP, "w", w, (None, K), C.BF16, dtype_note=C.BF16_NOTE)
    N = w.shape[0]
    check_runnable(OP, (x, w))
    return jax.ffi.ffi_call(OP, jax.ShapeDtypeStruct((m, N), C.F32))(x, w)
