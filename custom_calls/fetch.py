"""baro_fetch_experts: tier decode's miss copies, pool[slot] = store[expert], by the copy engines.

A dynamic-slice of a pinned_host array at a device-side index (what a jit of
`device_put(store[e])` is) runs on the GPU as XLA's async dynamic slicing, a fusion kernel whose
SMs read over the host link; the copy engines need no SMs but need the addresses on the host
(on the H200 the cache path's decode went 86.8 -> 79.5 ms per token with them at 856b132:
benchmarks/results/decode_profile_tier_cache_dma_h200.json). So the (expert, slot) list goes through a host ring (csrc/common/fetch_ring.h): fetch()
writes this call's entry, then runs the op, whose handler reads the entry on the host and issues
one copy per miss on XLA's stream. The op has no command-buffer trait, so every call runs its
handler. Not for use inside a larger jit: the entry is written when fetch() is called.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from . import _check as C
from ._lib import check_runnable
from .moe import HostStore

OP = "baro_fetch_experts"
_HEADER, _ENTRY_HEAD, _MAGIC = 4, 5, 0x62617266657463


class FetchRing:
    """The host ring of baro_fetch_experts' calls: R entries of up to n_max (expert, slot) pairs.
    One ring serves any number of pools and stores, one call at a time in call order."""

    def __init__(self, n_max: int, entries: int = 64):
        if n_max < 1 or entries < 1:
            raise ValueError(f"{OP}: a FetchRing needs n_max >= 1 and entries >= 1, got {n_max}, {entries}")
        self.n_max, self.R = int(n_max), int(entries)
        self.width = _ENTRY_HEAD + 2 * self.n_max
        self._buf = np.zeros(_HEADER + self.R * self.width, np.int64)
        self._buf[1], self._buf[2], self._buf[3] = self.R, self.n_max, _MAGIC
        self._buf[_HEADER::self.width] = -1  # no entry written yet
        self.calls = 0  # entries written and dispatched
        self._jit = jax.jit(self._call, donate_argnums=(0, 1))

    # The ring the handler reads is this object's own buffer: neither it nor its address can be
    # replaced (a ring pointed at other memory would have the handler read it as entries).
    @property
    def buf(self) -> np.ndarray:
        return self._buf

    @property
    def addr(self) -> int:
        return int(self._buf.ctypes.data)

    @property
    def runs(self) -> int:
        """Runs of the op so far (the handler's counter)."""
        return int(self._buf[0])

    def _call(self, pool_gu, pool_dn):
        return tuple(jax.ffi.ffi_call(OP, (jax.ShapeDtypeStruct(pool_gu.shape, pool_gu.dtype),
                                           jax.ShapeDtypeStruct(pool_dn.shape, pool_dn.dtype)),
                                      input_output_aliases={0: 0, 1: 1})(pool_gu, pool_dn, ring=np.int64(self.addr)))

    def fetch(self, pool_gu, pool_dn, host: HostStore, experts, slots):
        """(pool_gu, pool_dn) with pool[slots[j]] = store[experts[j]] for each j: the pools are
        donated and updated in place. At most n_max pairs per call."""
        if not isinstance(host, HostStore):
            raise TypeError(f"{OP}: host must be a HostStore (custom_calls.host_store), got {type(host).__name__}")
        host.check_alive(OP)
        experts = np.asarray(experts, np.int64).reshape(-1)
        slots = np.asarray(slots, np.int64).reshape(-1)
        n = experts.shape[0]
        if slots.shape[0] != n or n > self.n_max:
            raise ValueError(f"{OP}: experts and slots must be as long (at most n_max={self.n_max}), got {n} "
                             f"and {slots.shape[0]}")
        for name, x in (("pool_gu", pool_gu), ("pool_dn", pool_dn)):
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
                raise ValueError(f"{OP}: {name} has been deleted (or donated: fetch returns the pools to use next)")
        C.rank(OP, "pool_gu", pool_gu, 3)
        S = pool_gu.shape[0]
        C.array(OP, "pool_gu", pool_gu, (S,) + host.gate_up_shape[1:], C.BF16, dtype_note=C.BF16_NOTE)
        C.array(OP, "pool_dn", pool_dn, (S,) + host.down_shape[1:], C.BF16, dtype_note=C.BF16_NOTE)
        E = host.gate_up_shape[0]
        if n and (experts.min() < 0 or experts.max() >= E or slots.min() < 0 or slots.max() >= S):
            raise ValueError(f"{OP}: experts must be in [0, E={E}) and slots in [0, S={S}), got "
                             f"experts {experts.tolist()} and slots {slots.tolist()}")
        check_runnable(OP, (pool_gu, pool_dn))
        while self.calls - self.runs >= self.R:  # every entry still to be read: wait for the runs
            time.sleep(0)
        k = self.calls
        at = _HEADER + (k % self.R) * self.width
        entry = self._buf[at:at + self.width]
        entry[1:5] = n, E, host.gate_up_addr, host.down_addr
        entry[_ENTRY_HEAD:_ENTRY_HEAD + 2 * n:2] = experts
        entry[_ENTRY_HEAD + 1:_ENTRY_HEAD + 2 * n:2] = slots
        entry[0] = k  # last: the entry is complete
        try:
            out = self._jit(pool_gu, pool_dn)
        except Exception:
            self.calls = max(self.calls, self.runs)  # back in step with the handler
            raise
        self.calls = k + 1
        return out
