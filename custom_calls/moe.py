"""baro_moe: router softmax, top-k (ties to lower id), renormalised weights,
SwiGLU experts combined in slot order, plus the sigmoid-gated shared expert."""

from __future__ import annotations

import os

import jax
import numpy as np

from . import _check as C
from .knobs import knob
from ._lib import _xla_platform, check_gpu_limits, check_runnable, ffi_call_small, refuse_unmet, small_call
from .scratch import scratch_bytes

GPU_MAX_EXPERTS = 8192  # csrc/gpu/launch.h kMoeMaxExperts

OP = "baro_moe"
OP_SMALL = "baro_moe_small"
OP_SLOTS_SMALL = "baro_moe_slots_small"


def small_scratch_bytes(m: int, D: int, E: int, I: int, Is: int, k: int) -> int:
    """An upper bound of the GPU scratch of one baro_moe(_slots) call of m rows (a _small twin's): the
    kernels' layout (csrc/common/scratch_layout.h, through the CPU library) with every optional
    piece of any plan counted (the one-token fold's extra row, the unfused gate/up buffer, the
    tail counters), since csrc/gpu/moe.cu moe_plan picks the plan per call. The handler checks
    it is enough."""
    return scratch_bytes("moe", m=m, E=E, k=k, I=I, Is=Is, D=D, fold=True, fused=False, tail=True, stage=False)


def host_small_scratch_bytes(m: int, D: int, E: int, I: int, Is: int, k: int) -> int:
    """small_scratch_bytes for baro_moe_host: with the GPU's staging slots for the misses, one
    [2I, D] and one [D, I] per pair."""
    return scratch_bytes("moe", m=m, E=E, k=k, I=I, Is=Is, D=D, fold=True, fused=False, tail=True, stage=True)


def _check_h_router(op, h, router):
    """h [m, D] and router [E, D] (bf16); returns (m, D, E)."""
    C.rank(op, "h", h, 2)
    m, D = h.shape
    C.array(op, "h", h, (m, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(op, "router", router, 2)
    E = router.shape[0]
    C.array(op, "router", router, (E, D), C.BF16, dtype_note=C.BF16_NOTE)
    check_gpu_limits(op, (h, router), [(E <= GPU_MAX_EXPERTS, f"E={E} experts (at most {GPU_MAX_EXPERTS})")])
    return m, D, E


def _check_experts(op, w_gate_up, w_down, D, gu_name="w_gate_up", dn_name="w_down", lead="E", n=None):
    """Routed experts gate_up [n, 2I, D] (gate rows first) and down [n, D, I] (bf16); n None:
    the gate_up's own leading size. Returns I."""
    C.rank(op, gu_name, w_gate_up, 3)
    n = w_gate_up.shape[0] if n is None else n
    I2 = w_gate_up.shape[1]
    if I2 < 2 or I2 % 2:
        raise ValueError(f"{op}: {gu_name} must have shape [{lead}, 2*I, D] (gate rows first), "
                         f"got shape {list(w_gate_up.shape)}")
    I = I2 // 2
    C.array(op, gu_name, w_gate_up, (n, 2 * I, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(op, dn_name, w_down, (n, D, I), C.BF16, dtype_note=C.BF16_NOTE)
    return I


def _check_shared(op, shared_gate_up, shared_down, shared_gate, D):
    """The shared expert: shared_gate_up [2Is, D] (gate rows first), shared_down [D, Is],
    shared_gate [1, D] (bf16)."""
    C.rank(op, "shared_gate_up", shared_gate_up, 2)
    Is2 = shared_gate_up.shape[0]
    if Is2 < 2 or Is2 % 2:
        raise ValueError(f"{op}: shared_gate_up must have shape [2*Is, D] (gate rows first), "
                         f"got shape {list(shared_gate_up.shape)}")
    Is = Is2 // 2
    C.array(op, "shared_gate_up", shared_gate_up, (2 * Is, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(op, "shared_down", shared_down, (D, Is), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(op, "shared_gate", shared_gate, (1, D), C.BF16, dtype_note=C.BF16_NOTE)


def _check_top_k(op, top_k, E):
    k = C.positive_int(op, "top_k", top_k)
    if k > E:
        raise ValueError(f"{op}: top_k={k} exceeds the number of experts E={E}")
    return k


def _check_moe(op, h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, top_k,
               gu_name="w_gate_up", dn_name="w_down", n_w=None):
    """Checks baro_moe's operands (experts [E, ...], or a pool [S, ...] when n_w is given); returns (m, D, k)."""
    m, D, E = _check_h_router(op, h, router)
    _check_experts(op, w_gate_up, w_down, D, gu_name, dn_name, lead="E" if n_w is None else "S",
                   n=E if n_w is None else None)
    _check_shared(op, shared_gate_up, shared_down, shared_gate, D)
    return m, D, _check_top_k(op, top_k, E)


def moe(h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, top_k):
    """h[m,D] bf16, router[E,D], w_gate_up[E,2I,D], w_down[E,D,I],
    shared_gate_up[2Is,D], shared_down[D,Is], shared_gate[1,D] (all bf16),
    top_k (static int) -> out[m,D] f32."""
    m, D, k = _check_moe(OP, h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, top_k)
    args = (h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate)
    return _moe_call(OP, OP_SMALL, args, router, w_gate_up, shared_down, k)


def _moe_call(op, op_small, args, router, w_gate_up, shared_down, k):
    """out [m, D] f32 of baro_moe or baro_moe_slots (args checked), through the _small twin for
    decode-sized calls."""
    m, D = args[0].shape
    out_t = jax.ShapeDtypeStruct((m, D), C.F32)
    # A decode step of more sequences than SMALL_ROWS would leave the command buffer at every
    # MoE (41 graphs a step at 64 rows on the H200, a9ac1bb); its layout and handler serve any m.
    if small_call(m, knob("BARO_MOE_SMALL_ROWS")):
        check_runnable(op_small, args)
        nbytes = small_scratch_bytes(m, D, router.shape[0], w_gate_up.shape[1] // 2, shared_down.shape[1], k)
        return ffi_call_small(op_small, [out_t], nbytes, args, top_k=np.int32(k))[0]
    check_runnable(op, args)
    return jax.ffi.ffi_call(op, out_t)(*args, top_k=np.int32(k))


OP_SLOTS = "baro_moe_slots"
OP_ROUTE = "baro_moe_route"
OP_HOST_SMALL = "baro_moe_host_small"


class HostStore:
    """The routed experts of one layer where baro_moe_host reads the ones with no pool slot:
    gate_up [E, 2I, D] and down [E, D, I] bf16. Their addresses go into the call as attributes,
    so a compiled graph holds them for as long as it exists, and no check can run when a cached
    graph is called again. Hence the store owns its arrays: it is built from a copy of the two
    arrays given, which nothing outside it can reach, so deleting or donating those arrays
    afterwards frees nothing a graph reads. A jit's cache holds the store (a static argument, or
    a closure's), so the copy lives as long as the graphs built with it. On a GPU the arrays must
    be in pinned host memory (staging.to_store); the handler checks the device can read them.
    Hashable by identity, so it can be a static argument of a jit.

    unsafe_share=True skips the copy (a tier store is most of the host memory): the store then
    shares the given arrays, and the caller must keep them alive, undeleted and undonated, while
    any graph built with the store may run. The tier runner's store does (staging never frees
    its expert arrays). Every use outside a compiled graph checks the arrays are alive."""
    __slots__ = ("_gate_up", "_down", "gate_up_addr", "down_addr", "shared")

    def __init__(self, gate_up, down, *, unsafe_share: bool = False):
        op = "baro_moe_host"
        C.rank(op, "host gate_up", gate_up, 3)
        _check_experts(op, gate_up, down, gate_up.shape[2], "host gate_up", "host down")
        if not isinstance(unsafe_share, bool):
            raise TypeError(f"{op}: unsafe_share must be a bool, got {type(unsafe_share).__name__}")
        own = {}
        for name, x in (("gate_up", gate_up), ("down", down)):
            addr = _address(op, f"host {name}", x)
            if not unsafe_share:
                x = _private_copy(x)
                addr = _address(op, f"host {name}", x)
            own[name] = (x, addr)
        for k, v in (("_gate_up", own["gate_up"][0]), ("_down", own["down"][0]), ("gate_up_addr", own["gate_up"][1]),
                     ("down_addr", own["down"][1]), ("shared", unsafe_share)):
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        raise AttributeError(f"a HostStore is read-only (its addresses are read from the arrays it holds): "
                             f"cannot set {name}")

    def __delattr__(self, name):
        raise AttributeError(f"a HostStore is read-only (its addresses are read from the arrays it holds): "
                             f"cannot delete {name}")

    @property
    def gate_up_shape(self) -> tuple:
        return tuple(self._gate_up.shape)

    @property
    def down_shape(self) -> tuple:
        return tuple(self._down.shape)

    @property
    def device(self):
        return next(iter(self._gate_up.devices()))

    def check_alive(self, op: str) -> None:
        """Raises unless both arrays are alive where the store's addresses say (only a shared
        store's can be freed from outside)."""
        for name, x, addr in (("gate_up", self._gate_up, self.gate_up_addr), ("down", self._down, self.down_addr)):
            if x.is_deleted():
                raise ValueError(f"{op}: the host store's {name} array has been deleted (or donated); build a new "
                                 "store from live arrays")
            if _address(op, f"host {name}", x) != addr:
                raise ValueError(f"{op}: the host store's {name} array moved since the store was built")

    def __repr__(self):
        return (f"HostStore(gate_up {list(self.gate_up_shape)}, down {list(self.down_shape)} on {self.device}"
                f"{', shared' if self.shared else ''})")


def _private_copy(x):
    """A copy of x in the same memory of the same device, whose buffer no other array holds."""
    y = jax.device_put(x, x.sharding, may_alias=False)
    y.block_until_ready()
    return y


def _address(op, name, x) -> int:
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        raise TypeError(f"{op}: {name} must be a concrete jax array (the store is addressed by the "
                        f"compiled call), got {type(x).__name__}")
    if x.is_deleted():
        raise ValueError(f"{op}: {name} has been deleted (or donated)")
    if len(x.addressable_shards) != 1:
        raise ValueError(f"{op}: {name} must live on one device, got {len(x.addressable_shards)} shards")
    dev = next(iter(x.devices()))
    kind = getattr(x.sharding, "memory_kind", None)
    if dev.platform != "cpu" and kind not in (None, "device", "pinned_host"):
        raise ValueError(f"{op}: {name} is in {kind} memory, which the {dev.platform} kernels cannot read; "
                         f"put the store in pinned_host memory (baro_jax.staging.to_store does)")
    return int(x.addressable_data(0).unsafe_buffer_pointer())


def host_store(gate_up, down, *, unsafe_share: bool = False) -> HostStore:
    """A HostStore of one layer's routed experts (see HostStore), checked: bf16 [E, 2I, D] and
    [E, D, I]; its own copy of them unless unsafe_share."""
    return HostStore(gate_up, down, unsafe_share=unsafe_share)


def moe_host(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate, top_k,
             host: HostStore):
    """moe_slots whose routed experts with no slot (slots[e] < 0) are read from the host store
    instead of failing: the same bytes as moe() over the store's experts, whichever are resident.
    Decode-sized calls only (m <= 16; the GPU kernels read the store in the one-token path, m = 1).
    On a GPU a miss costs its expert's bytes over the host link inside the call, with no host
    round trip: tier decode's whole step stays one graph."""
    op = OP_HOST_SMALL
    if not isinstance(host, HostStore):
        raise TypeError(f"baro_moe_host: host must be a HostStore (custom_calls.moe.host_store), got "
                        f"{type(host).__name__}")
    host.check_alive("baro_moe_host")
    m, D, k = _check_slots_call("baro_moe_host", h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up,
                                shared_down, shared_gate, top_k)
    E = router.shape[0]
    if host.gate_up_shape != (E,) + tuple(w_gate_up_pool.shape[1:]) or \
            host.down_shape != (E,) + tuple(w_down_pool.shape[1:]):
        raise ValueError(f"baro_moe_host: the host store must hold all E={E} experts at the pool's shapes: "
                         f"gate_up {list(host.gate_up_shape)} vs pool {list(w_gate_up_pool.shape)}, "
                         f"down {list(host.down_shape)} vs pool {list(w_down_pool.shape)}")
    if not small_call(m):
        raise ValueError(f"baro_moe_host: serves decode-sized calls (m <= 16 rows, BARO_CMDBUF_OPS unset), got m={m}")
    plat = _xla_platform(host.device)
    if plat == "ROCM":  # refused here, not by the handler (see _check_host_gpu)
        raise ValueError("baro_moe_host: reading experts from the host store is CUDA-only so far (ROCm: use "
                         "the cache path, BARO_TIER_DECODE=cache)")
    if plat != "cpu":
        _check_host_gpu(m, D, E, w_gate_up_pool.shape[1] // 2, shared_down.shape[1], k)
    args = (h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate)
    check_runnable(op, args)
    nbytes = host_small_scratch_bytes(m, D, E, w_gate_up_pool.shape[1] // 2, shared_down.shape[1], k)
    return ffi_call_small(op, [jax.ShapeDtypeStruct((m, D), C.F32)], nbytes, args, top_k=np.int32(k),
                          host_gate_up=np.int64(host.gate_up_addr), host_down=np.int64(host.down_addr))[0]


# The GPU kernels read the store in the one-token fold path only (csrc/gpu/moe.cu, moe_plan).
# Its conditions are checked here too because a _small handler's error, returned while XLA
# captures it into a command buffer, crashes the process (jax 0.11.2: a segfault in the
# command buffer's destructor), so nothing that handler would refuse may reach it.
def _check_host_gpu(m, D, E, I, Is, k):
    refuse_unmet("baro_moe_host", [(m == 1, f"m={m} rows (one is read)")] + _host_gpu_limits(D, E, I, Is, k),
                 lead=HOST_GPU_LEAD)


HOST_GPU_LEAD = ("on a GPU the host store is read only in the one-token path (m = 1, the shared expert as wide as a "
                 "routed one, top_k <= 32, the fold and one-row GEMM knobs unset); got")


def _host_gpu_limits(D, E, I, Is, k):
    knobs = [(knob(name) != unmet, f"{name}={os.environ.get(name)}")
             for name, unmet in (("BARO_MOE_FOLD", False), ("BARO_GEMM_ROW1", False), ("BARO_GEMM_SMALL", "simple"))]
    return [(I == Is, f"a shared expert {Is} wide beside routed ones {I} wide"),
            (k <= 32 and E <= 512, f"top_k={k} / E={E} (at most 32 / 512)"),
            (D % 16 == 0 and I % 16 == 0, f"D={D} and I={I} must be multiples of 16")] + knobs


def host_gpu_unmet(D, E, I, Is, k) -> list:
    """What keeps a GPU's MoE from reading a model's experts from the host store (hidden D, E
    experts routed I wide, the shared one Is wide, top_k k; and the knobs): [] when it can."""
    return [what for ok, what in _host_gpu_limits(D, E, I, Is, k) if not ok]


def moe_slots(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate, top_k):
    """baro_moe with the routed experts in a pool of S slots: w_gate_up_pool[S,2I,D],
    w_down_pool[S,D,I] (bf16), slots[E] int32 (expert id -> slot, -1 = not resident).
    The same bytes as moe() when every routed expert's slot holds that expert; a routed
    expert with no slot fails the call (CPU: an error; GPU: NaN rows)."""
    _, _, k = _check_slots_call(OP_SLOTS, h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down,
                                shared_gate, top_k)
    args = (h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate)
    return _moe_call(OP_SLOTS, OP_SLOTS_SMALL, args, router, w_gate_up_pool, shared_down, k)


def _check_slots_call(op, h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate,
                      top_k):
    """baro_moe_slots' operands (and baro_moe_host's): the pools [S >= 1, ...] and slots [E] int32
    beside baro_moe's; returns (m, D, k)."""
    C.rank(op, "w_gate_up_pool", w_gate_up_pool, 3)
    m, D, k = _check_moe(op, h, router, w_gate_up_pool, w_down_pool, shared_gate_up, shared_down,
                         shared_gate, top_k, "w_gate_up_pool", "w_down_pool", n_w="pool")
    if w_gate_up_pool.shape[0] < 1:
        raise ValueError(f"{op}: w_gate_up_pool must hold at least one slot, got shape {list(w_gate_up_pool.shape)}")
    C.array(op, "slots", slots, (router.shape[0],), np.int32)
    return m, D, k


def moe_route(h, router, top_k):
    """h[m,D] bf16, router[E,D] bf16 -> ids[m, top_k] int32: the experts moe() routes each row
    to, in slot order (the same code as moe's routing, so the same ids)."""
    m, D, E = _check_h_router(OP_ROUTE, h, router)
    k = _check_top_k(OP_ROUTE, top_k, E)
    check_runnable(OP_ROUTE, (h, router))
    return jax.ffi.ffi_call(OP_ROUTE, jax.ShapeDtypeStruct((m, k), np.int32))(h, router, top_k=np.int32(k))


OP_PAIRS = "baro_moe_pairs"
OP_COMBINE = "baro_moe_combine"


def moe_pairs(h, router, w_gate_up, w_down, expert_base, top_k):
    """Expert parallel, per shard: h[m,D] bf16, router[E,D] bf16 (all experts), this shard's
    experts w_gate_up[El,2I,D] / w_down[El,D,I] bf16 (experts expert_base .. expert_base+El-1),
    expert_base int32 [1] (may be traced, e.g. from lax.axis_index) -> (y[m,k,D] f32, w[m,k] f32,
    ids[m,k] int32): baro_moe's routing (ids and renormalised weights, slot order) and each
    pair's expert output, computed as baro_moe computes it for the pairs of this shard's
    experts, 0 for the others. moe_combine(h, y, w, ...) of the pairs gathered from every
    shard (each pair from its expert's owner) is baro_moe's result, bytes and all."""
    op = OP_PAIRS
    m, D, E = _check_h_router(op, h, router)
    C.rank(op, "w_gate_up", w_gate_up, 3)
    if not 1 <= w_gate_up.shape[0] <= E:
        raise ValueError(f"{op}: w_gate_up must hold 1..E={E} experts, got shape {list(w_gate_up.shape)}")
    _check_experts(op, w_gate_up, w_down, D, lead="El")
    C.array(op, "expert_base", expert_base, (1,), np.int32)
    El = w_gate_up.shape[0]
    base = C.concrete_int(expert_base)  # a traced one is refused by the CPU handler, NaN on a GPU
    if base is not None and not 0 <= base <= E - El:
        raise ValueError(f"{op}: expert_base must be in [0, E - El] = [0, {E - El}] (E={E} experts, El={El} in "
                         f"this shard), got {base}")
    k = _check_top_k(op, top_k, E)
    args = (h, router, w_gate_up, w_down, expert_base)
    check_runnable(op, args)
    return jax.ffi.ffi_call(op, (jax.ShapeDtypeStruct((m, k, D), C.F32), jax.ShapeDtypeStruct((m, k), C.F32),
                                 jax.ShapeDtypeStruct((m, k), np.int32)))(*args, top_k=np.int32(k))


def moe_combine(h, y, w, shared_gate_up, shared_down, shared_gate):
    """h[m,D] bf16, per-pair expert outputs y[m,k,D] f32 and weights w[m,k] f32 (slot order, as
    moe_pairs gives them), the shared expert's weights (bf16) -> out[m,D] f32: baro_moe's combine
    (routed = fma over slots in order, then + sigmoid(shared_gate . h) * shared expert)."""
    op = OP_COMBINE
    C.rank(op, "h", h, 2)
    m, D = h.shape
    C.array(op, "h", h, (m, D), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(op, "y", y, 3)
    k = y.shape[1]
    if k < 1:
        raise ValueError(f"{op}: y must have shape [m, k, D] with k >= 1, got shape {list(y.shape)}")
    C.array(op, "y", y, (m, k, D), C.F32)
    C.array(op, "w", w, (m, k), C.F32)
    _check_shared(op, shared_gate_up, shared_down, shared_gate, D)
    args = (h, y, w, shared_gate_up, shared_down, shared_gate)
    check_runnable(op, args)
    return jax.ffi.ffi_call(op, jax.ShapeDtypeStruct((m, D), C.F32))(*args)
