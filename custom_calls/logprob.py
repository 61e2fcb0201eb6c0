"""baro_log_softmax: row-wise log-softmax in an order fixed by the row length alone, so a row's
log-probabilities are the same bytes whatever else shares the call (docs/DESIGN.md §10)."""

from __future__ import annotations

import jax

from . import _check as C
from ._lib import check_gpu_limits, check_runnable

OP = "baro_log_softmax"


def log_softmax(logits):
    """logits[m, V] f32 -> [m, V] f32: (x - max) - log(sum(exp(x - max))) per row.

    The max and the sum run in one order per row that depends on V only (CPU: j ascending, one
    fp32 chain from +0; CUDA sm_90: a cluster of 8 blocks per row, each reducing one contiguous
    eighth of the row (thread t summing every 256th entry from t, then a fixed tree) and the
    eight sums added in piece order; older GPUs and HIP: one block per row over the whole row),
    so m rows at once give the bytes of one call per row.
    A row of all -inf gives NaN everywhere (its max is -inf and -inf - -inf is NaN), so does a
    row holding +inf or NaN; -inf entries in a row with a finite max give -inf.
    """
    C.rank(OP, "logits", logits, 2)
    m, V = logits.shape
    if m < 1 or V < 1:
        raise ValueError(f"{OP}: logits must have shape [m, V] with m, V >= 1, got shape {list(logits.shape)}")
    C.array(OP, "logits", logits, (m, V), C.F32)
    check_gpu_limits(OP, (logits,), [(m < 2 ** 31, f"m={m} rows (the grid)")])
    check_runnable(OP, (logits,))
    return jax.ffi.ffi_call(OP, jax.ShapeDtypeStruct((m, V), C.F32))(logits)
