"""baro_matmul: y[m,N] f32 = x[m,K] bf16 @ w[N,K]^T bf16, row-invariant order."""

from __future__ import annotations

import jax
import numpy as np

from . import _check as C
from ._lib import check_runnable
from .knobs import knob

OP = "baro_matmul"
# BARO_GDN_PACK16=auto packs calls of at least this many rows: the wgmma GEMM's plain calls, which
# store the packed columns in their epilogue (other kernels store fp32 and pack in a pass after)
PACK16_AUTO_ROWS = 64


def matmul(x, w, bf16_cols=0):
    """x[m,K] bf16, w[N,K] bf16 -> y[m,N] f32 (fp32 accumulation, fixed order).

    bf16_cols (a static even int in [0, N]): y's first bf16_cols columns come rounded to bf16 and
    packed two to a float32 word at the start of each row: viewed as uint16 [m, 2N], row i's
    column c < bf16_cols is element [i, c]; float32 columns [bf16_cols / 2, bf16_cols) hold nothing
    else; columns from bf16_cols on are float32 as usual. For the GDN projection, whose conv
    channels the conv reads as bf16 (conv(..., packed=True)): half the bytes written and read."""
    C.rank(OP, "x", x, 2)
    m, K = x.shape
    C.array(OP, "x", x, (m, K), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(OP, "w", w, 2)
    C.array(OP, "w", w, (None, K), C.BF16, dtype_note=C.BF16_NOTE)
    N = w.shape[0]
    if isinstance(bf16_cols, (bool, np.bool_)) or not isinstance(bf16_cols, (int, np.integer)):
        raise ValueError(f"{OP}: bf16_cols must be a static Python int, got {type(bf16_cols).__name__}")
    if not (0 <= bf16_cols <= N and bf16_cols % 2 == 0):
        raise ValueError(f"{OP}: bf16_cols must be even and in [0, N={N}], got {bf16_cols}")
    check_runnable(OP, (x, w))
    return jax.ffi.ffi_call(OP, jax.ShapeDtypeStruct((m, N), C.F32))(x, w, bf16_cols=np.int64(bf16_cols))


def packed_columns(m: int, conv_cols: int) -> int:
    """bf16_cols for a GDN projection of m rows whose first conv_cols columns feed the conv, as
    BARO_GDN_PACK16 says (0: none packed)."""
    mode = knob("BARO_GDN_PACK16")
    packs = mode == "all" or (mode == "auto" and m >= PACK16_AUTO_ROWS)
    return conv_cols if packs and conv_cols % 2 == 0 else 0
