"""baro_topk_rows: each row's k largest logits and their ids, a selection whose result is defined by
the row alone (docs/DESIGN.md §10: sampling's top_k inside the decode graph)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _check as C
from ._lib import available_platforms, check_gpu_limits, check_runnable, gpu_platform
from .knobs import knob

OP = "baro_topk_rows"
MAX_K_GPU = 256  # the GPU kernel's candidates live in shared memory


def topk_rows(logits, k: int):
    """logits[m, V] f32 -> (vals [m, k] f32, ids [m, k] int32): each row's k largest, largest first.

    The order is the IEEE total order lax.top_k uses (+NaN above +inf, +0 above -0, -NaN below
    -inf) and equal bit patterns come by lower id, so the result equals jax.lax.top_k's, on every
    platform and whatever the other rows are. The GPU kernel takes k <= 256.
    """
    C.rank(OP, "logits", logits, 2)
    m, V = logits.shape
    if m < 1 or V < 1:
        raise ValueError(f"{OP}: logits must have shape [m, V] with m, V >= 1, got shape {list(logits.shape)}")
    C.array(OP, "logits", logits, (m, V), C.F32)
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"{OP}: k must be an int, got {type(k).__name__} {k!r:.40}")
    if not 1 <= k <= V:
        raise ValueError(f"{OP}: k must be in [1, V={V}], got {k}")
    check_gpu_limits(OP, (logits,), [(m < 2 ** 31, f"m={m} rows (the grid)"),
                                     (k <= MAX_K_GPU, f"k={k} (the GPU kernel takes k <= {MAX_K_GPU})"),
                                     (V < 2 ** 31, f"V={V}")])
    check_runnable(OP, (logits,))
    return jax.ffi.ffi_call(OP, (jax.ShapeDtypeStruct((m, k), C.F32), jax.ShapeDtypeStruct((m, k), jnp.int32)))(
        logits, k=np.int32(k))


def top_k(logits, k: int):
    """jax.lax.top_k(logits, k)'s result, from topk_rows where BARO_TOPK_ROWS lets the kernel run on
    the logits' platform (all, the default: wherever it is built, on GPUs for k <= 256; cpu: the CPU
    only; off: nowhere), else from lax.top_k. The same bytes either way
    (tests/test_kernels_topk.py), so the knob is speed alone; it is read when a graph is traced (a
    process keeps a traced graph's choice)."""
    where, gpu = knob("BARO_TOPK_ROWS"), gpu_platform((logits,))
    if where == "off" or (gpu or "cpu") not in available_platforms() or (gpu and (where != "all" or k > MAX_K_GPU)):
        return jax.lax.top_k(logits, k)
    return topk_rows(logits, k)
