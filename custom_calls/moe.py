"""baro_moe: router softmax, top-k (ties to lower id), renormalised weights,
SwiGLU experts combined in slot order, plus the sigmoid-gated shared expert."""

from __future__ import annotations

import jax
import numpy as np

from . import _check as C
from ._lib import check_runnable

OP = "baro_moe"


def moe(h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, top_k):
    """h[m,D] bf16, router[E,D], w_gate_up[E,2I,D], w_down[E,D,I],
    shared_gate_up[2Is,D], shared_down[D,Is], shared_gate[1,D] (all bf16),
    top_k (static int) -> out[m,D] f32."""
    C.rank(OP, "h", h, 2)
    m, D = h.shape
    C.array(OP, "h", h, (m, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(OP, "router", router, 2)
    E = router.shape[0]
    C.array(OP, "router", router, (E, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(OP, "w_gate_up", w_gate_up, 3)
    I2 = w_gate_up.shape[1]
    if I2 < 2 or I2 % 2:
        raise ValueError(f"{OP}: w_gate_up must have shape [E, 2*I, D] (gate rows first), "
                         f"got shape {list(w_gate_up.shape)}")
    I = I2 // 2
    C.array(OP, "w_gate_up", w_gate_up, (E, 2 * I, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(OP, "w_down", w_down, (E, D, I), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(OP, "shared_gate_up", shared_gate_up, 2)
    Is2 = shared_gate_up.shape[0]
    if Is2 < 2 or Is2 % 2:
        raise ValueError(f"{OP}: shared_gate_up must have shape [2*Is, D] (gate rows first), "
                         f"got shape {list(shared_gate_up.shape)}")
    Is = Is2 // 2
    C.array(OP, "shared_gate_up", shared_gate_up, (2 * Is, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(OP, "shared_down", shared_down, (D, Is), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(OP, "shared_gate", shared_gate, (1, D), C.BF16, dtype_note=C.BF16_NOTE)
    k = C.positive_int(OP, "top_k", top_k)
    if k > E:
        raise ValueError(f"{OP}: top_k={k} exceeds the number of experts E={E}")
    args = (h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate)
    check_runnable(OP, args)
    return jax.ffi.ffi_call(OP, jax.ShapeDtypeStruct((m, D), C.F32))(*args, top_k=np.int32(k))
