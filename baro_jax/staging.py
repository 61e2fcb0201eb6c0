"""Tier mode: routed experts in host memory, everything else on the device.

The routed expert tensors of every layer (`layers[i]["moe"]["gate_up"]` and
`["down"]`, the bulk of a MoE model's weights) live in the device's
`pinned_host` memory; the rest of the params stay resident. A forward runs
from a Python loop over the layers, calling the SAME functions as the resident
whole-model forward (`model.prologue`, `model.layer_forward`,
`model.epilogue`), each jitted on its own; a layer's graph is shared by every
layer of its kind. Only where the weights live changes, so tier mode gives the
same bytes as resident mode.

Staging: before layer L computes, layer L+1's experts are `jax.device_put`
into device memory (the other of two slots: at most two staged layers are
alive). Dispatch is asynchronous, so the copy can overlap layer L's compute;
the loop never waits on the host (no block_until_ready, no np.asarray).

Decode (m = 1: decode steps and replay prefill) uses the expert cache
instead (ExpertCache): per layer a device pool of S expert slots and a host
LRU over (layer, expert). Per layer and token: the mixer and the routing
(`ops.moe_route`, the MoE kernel's own routing code, so the same ids) run in
one jitted call; the ids come to the host (one device-to-host round trip per
layer per token: the price of this design, measured in `route_seconds`); the
misses are copied from the host store into LRU-evicted slots (one jitted
dynamic-slice + device_put + dynamic_update_slice call, pools donated); then
`ops.moe_slots` runs the MoE through the slot table (expert -> slot). Same
bytes as resident decode. A backend without moe_slots (xla, variants) stages
every layer's experts per token instead (correct, slow). On the H200 the copy
overlaps the compute (benchmarks/tier_overlap.py: both / max(copy, compute) =
0.96 at chunk 4096, 0.99 at 8192, benchmarks/results/tier_overlap_h200.json).

A decode step of many sequences (batch.py's pool) runs one row per slot from a Python loop too
(decode_rows): per layer the rows' mixer and routing, then the MoE over every row with the union
of their experts made resident in the cache, or the layer staged whole when the union is larger.

The TierRunner (tier.py) drives all of this behind the runner interface.
"""
from __future__ import annotations

import collections
import functools
import sys
import time
from typing import Any

import numpy as np
import jax
from jax.sharding import SingleDeviceSharding

from . import model as M
from . import pool as Pool
from .config import Config
from .runner import greedy_steps
from .sampling import row_draw
from .settings import TIER_DECODE_PATHS, TIER_FETCH_PATHS

EXPERT_KEYS = ("gate_up", "down")
HOST_KINDS = ("pinned_host", "unpinned_host")
_warned: set = set()


# --- where the experts live -------------------------------------------------------
def host_memory_kind(dev=None) -> str | None:
    """The host memory kind experts are stored in: pinned_host, else unpinned_host, else None (numpy)."""
    dev = dev or jax.devices()[0]
    try:
        kinds = {m.kind for m in dev.addressable_memories()}
    except Exception:  # a backend without memory kinds
        kinds = set()
    for k in HOST_KINDS:
        if k in kinds:
            if k != "pinned_host" and ("kind", dev.platform) not in _warned:
                _warned.add(("kind", dev.platform))
                print(f"[baro_jax] tier mode: the {dev.platform} backend has no pinned_host memory; "
                      f"experts are stored in {k} memory (copies may not overlap compute)", file=sys.stderr)
            return k
    if ("kind", dev.platform) not in _warned:
        _warned.add(("kind", dev.platform))
        print(f"[baro_jax] tier mode: the {dev.platform} backend has no host memory kinds; experts are "
              "stored as host numpy arrays (copies are synchronous)", file=sys.stderr)
    return None


def device_sharding(dev=None):
    dev = dev or jax.devices()[0]
    return SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)


def to_store(x, dev=None):
    """One expert tensor into the host store."""
    dev = dev or jax.devices()[0]
    kind = host_memory_kind(dev)
    if kind is None:
        return np.asarray(x)
    return jax.device_put(x, SingleDeviceSharding(dev, memory_kind=kind))


def is_expert_target(target: tuple) -> bool:
    """A params path (as weights.py names targets) of a routed expert tensor."""
    return len(target) == 4 and target[0] == "layers" and target[2] == "moe" and target[3] in EXPERT_KEYS


def store_layer_experts(layer: dict, dev=None) -> dict:
    """The layer with its routed experts moved to the host store (other leaves untouched)."""
    moe = dict(layer["moe"])
    for k in EXPERT_KEYS:
        moe[k] = to_store(moe[k], dev)
    return {**layer, "moe": moe}


def tier_params(params, dev=None) -> dict:
    """The params tree with every layer's routed experts in the host store."""
    return {**params, "layers": tuple(store_layer_experts(lp, dev) for lp in params["layers"])}


def split_layer(layer: dict):
    """(resident part, experts) of one layer's params."""
    moe = layer["moe"]
    return ({**layer, "moe": {k: v for k, v in moe.items() if k not in EXPERT_KEYS}},
            {k: moe[k] for k in EXPERT_KEYS})


def layer_expert_bytes(layer: dict) -> int:
    """Bytes of one layer's routed experts: what staging moves per layer and chunk pass."""
    return sum(int(a.size) * a.dtype.itemsize for a in split_layer(layer)[1].values())


# --- the per-layer forward --------------------------------------------------------
def _layer(x, h, lp, experts, st, cos, sin, pos, n_valid, next_norm, *, kind, cfg, ops):
    lp = {**lp, "moe": {**lp["moe"], **experts}}
    return M.layer_forward(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid, next_norm)


# Module-level jits keyed on the static (kind, cfg, ops): one compile per layer kind, shared by engines.
_PROLOGUE = jax.jit(M.prologue)
_FIRST_NORM = jax.jit(M.first_norm, static_argnames=("cfg", "ops"))
_LAYER = jax.jit(_layer, static_argnames=("kind", "cfg", "ops"), donate_argnums=(0, 1, 4))
_EPILOGUE = jax.jit(M.epilogue, static_argnames=("cfg", "ops", "all_logits"))


def _stager(params):
    """stage(i): an asynchronous host-to-device copy of layer i's routed experts, onto the device
    the resident weights live on."""
    on_dev = device_sharding(next(iter(params["embed"].devices())))
    return lambda i: jax.device_put(split_layer(params["layers"][i])[1], on_dev)


def _head_params(params):
    return {"lm_head": params["lm_head"]}


def forward(params, state, tokens, pos, n_valid, rope, *, cfg: Config, ops, all_logits: bool = False,
            cache: "ExpertCache | None" = None, direct: "DirectDecode | None" = None):
    """model.forward's contract, run layer by layer with routed experts staged from the host store.

    The state's per-layer leaves are donated (as the resident step donates the state). With a
    cache, a one-row call (decode) takes its experts from the cache instead (cached_forward);
    with `direct`, from the cache's pools and the host store in one graph (DirectDecode).
    """
    if direct is not None and tokens.shape[0] == 1 and not all_logits:
        return direct(state, tokens, pos, n_valid, rope, cfg=cfg, ops=ops)
    if cache is not None and tokens.shape[0] == 1 and not all_logits:
        return cached_forward(params, state, tokens, pos, n_valid, rope, cfg=cfg, ops=ops, cache=cache)
    layers = params["layers"]
    n = len(layers)
    stage = _stager(params)

    x, cos, sin = _PROLOGUE({"embed": params["embed"]}, tokens, pos, rope)
    h = _FIRST_NORM(split_layer(layers[0])[0], x, cfg=cfg, ops=ops)
    nxt = stage(0)
    new_state = []
    for i, (lp, st, kind, nn) in enumerate(zip(layers, state, cfg.layer_types, M.next_norms(params))):
        # issue layer i+1's copy before layer i's compute: at most two staged layers alive
        cur, nxt = nxt, (stage(i + 1) if i + 1 < n else None)
        x, h, st = _LAYER(x, h, split_layer(lp)[0], cur, st, cos, sin, pos, n_valid, nn, kind=kind, cfg=cfg,
                          ops=ops)
        del cur
        new_state.append(st)
    logits = _EPILOGUE(_head_params(params), h, n_valid, cfg=cfg, ops=ops, all_logits=all_logits)
    return logits, tuple(new_state)


# --- the decode expert cache --------------------------------------------------------


def has_cache_ops(ops) -> bool:
    """Whether a backend can run the MoE through a slot table (the ordered kernels can)."""
    return hasattr(ops, "moe_slots") and hasattr(ops, "moe_route")


def _fetch(pool_gu, pool_dn, store_gu, store_dn, experts, slots, *, dev):
    """pool[slots[j]] = store[experts[j]] for each j (the host-to-device copies of the misses).
    A repeated (expert, slot) pair pads the list to a fixed length: the same copy twice.
    dev: the device memory sharding (static)."""
    for j in range(experts.shape[0]):
        gu = jax.device_put(jax.lax.dynamic_index_in_dim(store_gu, experts[j], keepdims=True), dev)
        dn = jax.device_put(jax.lax.dynamic_index_in_dim(store_dn, experts[j], keepdims=True), dev)
        pool_gu = jax.lax.dynamic_update_slice_in_dim(pool_gu, gu, slots[j], 0)
        pool_dn = jax.lax.dynamic_update_slice_in_dim(pool_dn, dn, slots[j], 0)
    return pool_gu, pool_dn


_FETCH = jax.jit(_fetch, donate_argnums=(0, 1), static_argnames=("dev",))


EXACT_FETCH_MAX = 16  # up to this many misses a call copies exactly its misses


def fetch_length(n_misses: int) -> int:
    """Copies one _FETCH call makes for n misses: n itself up to EXACT_FETCH_MAX (a decode
    token's misses are at most top_k, 8 or 10: at most 16 small graphs, each compiled once), then
    the next power of two, so a long replay row set compiles a few graphs and copies at most
    twice what it needs. A padded copy moves its expert over the host link again: at the
    synthetic weights' 5.76 misses per layer (of 8, binomial) the power of two copied ~7.35
    experts per layer, ~28% more bytes than the misses (padding to top_k, before it, ~4x at
    a real model's ~77% hits)."""
    if n_misses <= EXACT_FETCH_MAX:
        return max(n_misses, 1)
    p = 1
    while p < n_misses:
        p *= 2
    return p


def _mixer_route(x, h, lp, st, cos, sin, pos, n_valid, *, kind, cfg, ops):
    x, h2, st = M.layer_mixer(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid)
    return x, h2, ops.moe_route(h2, lp["moe"]["router"], top_k=cfg.top_k), st


def _cached_moe(x, h2, moe, pool_gu, pool_dn, slots, next_norm, *, cfg, ops):
    """layer_forward's MoE half with the experts from the pools: (x + moe(h2), next_norm of it)."""
    y = ops.moe_slots(h2, moe["router"], pool_gu, pool_dn, slots, moe["shared_gate_up"], moe["shared_down"],
                      moe["shared_gate"], top_k=cfg.top_k)
    return ops.add_rmsnorm(x, y, next_norm, cfg.rms_eps, moe["router"].dtype)


_MIXER_ROUTE = jax.jit(_mixer_route, static_argnames=("kind", "cfg", "ops"), donate_argnums=(0, 1, 3))
_CACHED_MOE = jax.jit(_cached_moe, static_argnames=("cfg", "ops"), donate_argnums=(0,))


class ExpertCache:
    """Per layer, a device pool of `slots` expert slots; on the host, an LRU over (layer, expert).

    ensure(layer, ids) makes every expert in ids resident (copying the misses from the host
    store into free or least-recently-used slots, never evicting an expert ids needs) and
    returns the layer's slot table, int32 [E]: expert -> slot, -1 = not resident.
    Counters: hits / misses (one per routed (token, expert) of a call, an expert routed
    twice by one call counted once), evictions, and the seconds spent waiting for the ids
    (route_seconds, the per-layer device-to-host round trip) and issuing the copies
    (copy_seconds); staged_layers: layers a decode step of many rows (decode_rows) staged whole
    because its rows routed to more experts than the slots."""

    def __init__(self, cfg: Config, layers, slots: int, dev=None, fetch_path: str = "xla", ops=None):
        if fetch_path not in TIER_FETCH_PATHS:
            raise ValueError(f"fetch_path must be one of {', '.join(TIER_FETCH_PATHS)}, got {fetch_path!r}")
        E = cfg.num_experts
        if not cfg.top_k <= slots <= E:
            raise ValueError(f"the decode expert cache needs top_k={cfg.top_k} <= slots <= E={E}, got {slots}")
        dev = dev or jax.devices()[0]
        self.cfg, self.slots, self._layers = cfg, slots, layers
        self._on_dev = on_dev = device_sharding(dev)
        self.pools = []
        for lp in layers:
            gu, dn = lp["moe"]["gate_up"], lp["moe"]["down"]
            self.pools.append([jax.device_put(np.zeros((slots,) + tuple(gu.shape[1:]), gu.dtype), on_dev),
                               jax.device_put(np.zeros((slots,) + tuple(dn.shape[1:]), dn.dtype), on_dev)])
        self.slot_of = [np.full((E,), -1, np.int32) for _ in layers]
        self.lru = [collections.OrderedDict() for _ in layers]  # expert -> slot, least recent first
        self.free = [list(range(slots - 1, -1, -1)) for _ in layers]  # pop() gives slot 0 first
        self.hits = self.misses = self.evictions = 0
        self.staged_layers = 0  # layers a decode step of many rows staged whole (decode_rows)
        self.route_seconds = self.copy_seconds = 0.0
        self.events = []  # (layer, expert, slot, evicted expert or -1) per miss: for tests
        self.keep_events = False
        self.fetch_path = fetch_path
        self.fetch_max = min(cfg.top_k, EXACT_FETCH_MAX, slots)  # pairs per copy call (compiled up front)
        # set while the tables and the pools may disagree (a copy in flight): a call interrupted
        # there leaves the cache broken, and intact() says so (TierRunner.recover rebuilds it)
        self._changing = False
        self._ring = self._hosts = None
        if self.fetch_path == "dma":
            self._hosts = host_stores(layers, ops)
            self._ring = ops.fetch_ring(max(self.fetch_max, EXACT_FETCH_MAX))
        else:
            self._warm_fetches(self.fetch_max)

    def intact(self) -> bool:
        """Whether the slot tables describe the pools: no update was cut short and no pool buffer
        was lost to a donation whose result never came back (an interrupt between the two)."""
        return not self._changing and not any(a.is_deleted() for pool in self.pools for a in pool)

    def _warm_fetches(self, n_max: int):
        """Compile the copy graph of every miss count a decode token can have (1 .. top_k) now,
        so no compilation lands inside a timed decode (a count first seen at step 20 compiled
        there). The pools hold no expert yet, so the warm copies (expert 0 into slot 0 of layer
        0) overwrite nothing a table points at; layers share the graphs (same shapes)."""
        if not self.pools:
            return
        moe, pool = self._layers[0]["moe"], self.pools[0]
        for n in range(1, n_max + 1):
            zeros = np.zeros(fetch_length(n), np.int32)
            pool[0], pool[1] = _FETCH(pool[0], pool[1], moe["gate_up"], moe["down"], zeros, zeros, dev=self._on_dev)

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

    def stats(self) -> dict:
        return {"slots_per_layer": self.slots, "layers": len(self.pools), "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions, "hit_rate": self.hit_rate,
                "staged_layers": self.staged_layers, "route_seconds": self.route_seconds,
                "copy_seconds": self.copy_seconds}

    def reset_stats(self):
        self.hits = self.misses = self.evictions = self.staged_layers = 0
        self.route_seconds = self.copy_seconds = 0.0
        self.events = []

    def ensure(self, layer: int, ids) -> np.ndarray:
        lru, slot_of, free = self.lru[layer], self.slot_of[layer], self.free[layer]
        need = list(dict.fromkeys(int(e) for e in np.asarray(ids).reshape(-1)))
        if len(need) > self.slots:
            raise ValueError(f"one call routes to {len(need)} experts of layer {layer}, more than the "
                             f"cache's {self.slots} slots")
        todo_e, todo_s = [], []
        self._changing = True  # until the copies are issued and the pools are back (intact)
        for e in need:  # hits first refresh their place, so no needed expert is evicted below
            if e in lru:
                lru.move_to_end(e)
                self.hits += 1
        for e in need:
            if e in lru:
                continue
            self.misses += 1
            if free:
                s, old = free.pop(), -1
            else:
                old, s = lru.popitem(last=False)  # least recently used; not in need (see above)
                slot_of[old] = -1
                self.evictions += 1
            lru[e] = s
            slot_of[e] = s
            todo_e.append(e)
            todo_s.append(s)
            if self.keep_events:
                self.events.append((layer, e, s, old))
        if todo_e:
            t0 = time.perf_counter()
            self._copy(layer, todo_e, todo_s)
            self.copy_seconds += time.perf_counter() - t0
        self._changing = False
        return slot_of.copy()

    def _copy(self, layer: int, experts: list, slots: list):
        """pool[slots[j]] = store[experts[j]] for layer's pools: by the copy engines (FetchRing) in
        calls of at most its n_max pairs, or in one _FETCH call padded to fetch_length with the
        first copy again (the same copy twice)."""
        pool = self.pools[layer]
        if self._ring is not None:
            n = self._ring.n_max
            for at in range(0, len(slots), n):
                pool[0], pool[1] = self._ring.fetch(pool[0], pool[1], self._hosts[layer], experts[at:at + n],
                                                    slots[at:at + n])
            return
        pad = fetch_length(len(experts))
        ee = np.asarray(experts + experts[:1] * (pad - len(experts)), np.int32)
        ss = np.asarray(slots + slots[:1] * (pad - len(slots)), np.int32)
        moe = self._layers[layer]["moe"]
        pool[0], pool[1] = _FETCH(pool[0], pool[1], moe["gate_up"], moe["down"], ee, ss, dev=self._on_dev)

    def replace(self, layer: int, old, new):
        """Put experts new[j] into the slots of residents old[j] (copied from the store, _copy):
        direct tier decode's adaptation. The LRU order keeps the newcomers
        as the most recent."""
        lru, slot_of = self.lru[layer], self.slot_of[layer]
        slots = []
        self._changing = True
        for o, n in zip(old, new):
            s = int(slot_of[o])
            if s < 0 or slot_of[n] >= 0:
                raise ValueError(f"replace: expert {o} must be resident and {n} not (layer {layer})")
            del lru[o]
            slot_of[o] = -1
            lru[n] = s
            slot_of[n] = s
            slots.append(s)
        if slots:
            self._copy(layer, [int(n) for n in new], slots)
        self._changing = False


def cached_forward(params, state, tokens, pos, n_valid, rope, *, cfg: Config, ops, cache: ExpertCache):
    """A one-row forward (decode) with the routed experts from the expert cache: per layer the
    mixer and the routing, the ids to the host, the misses copied, the MoE through the slots."""
    layers = params["layers"]
    x, cos, sin = _PROLOGUE({"embed": params["embed"]}, tokens, pos, rope)
    h = _FIRST_NORM(split_layer(layers[0])[0], x, cfg=cfg, ops=ops)
    new_state = []
    for i, (lp, st, kind, nn) in enumerate(zip(layers, state, cfg.layer_types, M.next_norms(params))):
        res = split_layer(lp)[0]
        x, h2, ids, st = _MIXER_ROUTE(x, h, res, st, cos, sin, pos, n_valid, kind=kind, cfg=cfg, ops=ops)
        t0 = time.perf_counter()
        ids = np.asarray(ids)  # waits for this layer's mixer: the per-layer host round trip
        cache.route_seconds += time.perf_counter() - t0
        slots = cache.ensure(i, ids)
        gu, dn = cache.pools[i]
        x, h = _CACHED_MOE(x, h2, res["moe"], gu, dn, slots, nn, cfg=cfg, ops=ops)
        new_state.append(st)
    logits = _EPILOGUE(_head_params(params), h, n_valid, cfg=cfg, ops=ops, all_logits=False)
    return logits, tuple(new_state)


# --- many sequences: one decode row per pool slot (batch.py's decode step) ----------------------
def _rows_mixer(x, h, lp, st, page_table, cos, sin, slots, pos, running, *, kind, cfg, ops, guard: bool,
                route: bool):
    """model.rows_mixer on one layer's pool (its KV pages through page_table); guard: idle slots keep their
    conv and delta state (the batch decode step's keep_running, per layer so that the pool's layers can
    be donated one by one); route: also the MoE's expert ids of every row (ops.moe_route). An idle row's
    MoE input is zeroed: its output is discarded, and a zero row routes to the same few experts every
    step, where its own would add up to top_k experts to the union the cache must hold (the MoE treats
    rows apart, so a running row's bytes do not change)."""
    x, h2, new = M.rows_mixer(x, h, lp, st, page_table, kind, cfg, ops, cos, sin, slots, pos)
    if guard:
        new = Pool.keep_running((st,), (new,), running)[0]
    if route:
        h2 = jax.numpy.where(running[:, None], h2, jax.numpy.zeros_like(h2))
    return x, h2, (ops.moe_route(h2, lp["moe"]["router"], top_k=cfg.top_k) if route else None), new


def _staged_moe(x, h2, moe, experts, next_norm, *, cfg, ops):
    return M.layer_moe(x, h2, {**moe, **experts}, next_norm, cfg, ops)


_ROWS_PROLOGUE = jax.jit(M.rows_prologue)
_ROWS_MIXER = jax.jit(_rows_mixer, static_argnames=("kind", "cfg", "ops", "guard", "route"), donate_argnums=(0, 1, 3))
_STAGED_MOE = jax.jit(_staged_moe, static_argnames=("cfg", "ops"), donate_argnums=(0,))
_ROWS_HEAD = jax.jit(M.rows_head, static_argnames=("ops",))


def decode_rows(params, pool, page_table, tokens, slots, running, pos, rope, *, cfg: Config, ops, guard: bool,
                cache: "ExpertCache | None" = None, direct: "DirectDecode | None" = None):
    """model.decode_rows' contract layer by layer (the pool's layers donated; page_table its page
    table), idle slots' conv and
    delta state kept when guard. A layer's MoE runs all P rows at once, so it needs every expert
    any row routes to: with a cache, the union of the rows' ids is made resident (ensure: LRU
    copies of the misses) and the MoE reads the slot table; a union larger than the cache's slots
    stages the layer's whole experts, as prefill does (counted in cache.staged_layers). Without a
    cache every layer is staged, the next layer's copy issued before this one computes. The same
    MoE bytes either way (moe_slots is moe on the same weights). With `direct`, its slot tables
    follow the layers whose pools changed. Returns (logits [P, V] fp32, new pool)."""
    layers = params["layers"]
    n = len(layers)
    stage = _stager(params)

    if direct is not None and direct._last is not None:
        # the cache's copies below donate its pools, which a direct graph may still be reading
        jax.block_until_ready(direct._last)
    x, cos, sin = _ROWS_PROLOGUE({"embed": params["embed"]}, tokens, pos, rope)
    h = _FIRST_NORM(split_layer(layers[0])[0], x, cfg=cfg, ops=ops)
    nxt = stage(0) if cache is None else None
    changed, new_pool = set(), []
    for i, (lp, st, kind, nn) in enumerate(zip(layers, pool, cfg.layer_types, M.next_norms(params))):
        res = split_layer(lp)[0]
        x, h2, ids, st = _ROWS_MIXER(x, h, res, st, page_table, cos, sin, slots, pos, running, kind=kind, cfg=cfg,
                                     ops=ops, guard=guard, route=cache is not None)
        new_pool.append(st)
        if cache is None:
            cur, nxt = nxt, (stage(i + 1) if i + 1 < n else None)
            x, h = _STAGED_MOE(x, h2, res["moe"], cur, nn, cfg=cfg, ops=ops)
            del cur
            continue
        t0 = time.perf_counter()
        ids = np.asarray(ids)  # waits for this layer's mixer: the per-layer host round trip
        cache.route_seconds += time.perf_counter() - t0
        if len(np.unique(ids)) > cache.slots:
            cache.staged_layers += 1
            x, h = _STAGED_MOE(x, h2, res["moe"], stage(i), nn, cfg=cfg, ops=ops)
            continue
        misses = cache.misses
        table = cache.ensure(i, ids)
        if cache.misses != misses:
            changed.add(i)
        gu, dn = cache.pools[i]
        x, h = _CACHED_MOE(x, h2, res["moe"], gu, dn, table, nn, cfg=cfg, ops=ops)
    if direct is not None and changed:
        direct.refresh(changed)
    return _ROWS_HEAD(_head_params(params), h, ops=ops), tuple(new_pool)


# --- a prefill chunk and the decode rows in one pass (batch.py's mixed round) ------------------
def _mixed_mixer(x, h, lp, st, sub, page_table, chunk, rows, running, *, kind, cfg, ops, guard: bool):
    """model.mixed_mixer on one layer, idle slots' conv and delta state kept when guard."""
    x, h2, st, new = M.mixed_mixer(x, h, lp, st, sub, page_table, chunk, rows, kind, cfg, ops)
    if guard:
        new = Pool.keep_running((sub,), (new,), running)[0]
    return x, h2, st, new


_MIXED_PROLOGUE = jax.jit(M.mixed_prologue)
_MIXED_MIXER = jax.jit(_mixed_mixer, static_argnames=("kind", "cfg", "ops", "guard"), donate_argnums=(0, 1, 3, 4))
_MIXED_HEAD = jax.jit(M.mixed_head, static_argnames=("C", "ops", "all_logits"))


def mixed_forward(params, state, tokens, pos, n_valid, pool, page_table, row_tokens, slots, running, row_pos, rope, *,
                  cfg: Config, ops, guard: bool, all_logits: bool = False):
    """model.mixed_forward's contract layer by layer, each layer's routed experts staged whole
    (the chunk needs them anyway, so the decode rows' MoE reads the same staged copy: one pass
    over the host link for both); state's and pool's layers donated, idle slots' conv and delta
    state kept when guard. Returns (chunk logits, rows' logits [P, V], new state, new pool)."""
    layers = params["layers"]
    n = len(layers)
    stage = _stager(params)

    x, chunk, rows = _MIXED_PROLOGUE({"embed": params["embed"]}, tokens, pos, n_valid, row_tokens, slots, row_pos, rope)
    h = _FIRST_NORM(split_layer(layers[0])[0], x, cfg=cfg, ops=ops)
    nxt = stage(0)
    new_state, new_pool = [], []
    for i, (lp, st, sub, kind, nn) in enumerate(zip(layers, state, pool, cfg.layer_types, M.next_norms(params))):
        res = split_layer(lp)[0]
        x, h2, st, sub = _MIXED_MIXER(x, h, res, st, sub, page_table, chunk, rows, running, kind=kind, cfg=cfg,
                                      ops=ops, guard=guard)
        cur, nxt = nxt, (stage(i + 1) if i + 1 < n else None)
        x, h = _STAGED_MOE(x, h2, res["moe"], cur, nn, cfg=cfg, ops=ops)
        del cur
        new_state.append(st)
        new_pool.append(sub)
    head = _MIXED_HEAD(_head_params(params), h, C=tokens.shape[0], n_valid=n_valid, ops=ops, all_logits=all_logits)
    return head + (tuple(new_state), tuple(new_pool))


# --- direct tier decode: misses read from the host store inside the MoE call ------------------
def pick_decode_path(path: str, ops, cfg=None) -> str:
    """The tier decode path (settings.tier_decode): "cache" (per layer the ids to the host, LRU
    copies, then the MoE), "direct" (one graph per token block; an expert with no pool slot is
    read from the host store by the MoE kernels themselves) or "auto": direct where the ops can
    read the host store (the ordered kernels) and the device is not ROCm (whose MoE cannot yet)
    and the GPU's kernel takes cfg's MoE shapes (a shared expert as wide as a routed one, ...),
    else the cache. "direct" asked where it cannot run is refused, naming why. Direct is the faster wherever it runs: on the H200 its graphs run a token in
    37 ms against the cache path's ~80 (benchmarks/results/decode_profile_tier_direct_h200.json,
    decode_profile_tier_cache_h200.json); both give resident decode's bytes."""
    if path not in TIER_DECODE_PATHS:
        raise ValueError(f"tier decode path must be one of {', '.join(TIER_DECODE_PATHS)}, got {path!r}")
    unmet = ops.moe_host_unmet(cfg) if cfg is not None and hasattr(ops, "moe_host_unmet") else []
    if path == "direct" and unmet:
        raise ValueError("tier_decode direct (BARO_TIER_DECODE=direct): this device's MoE cannot read this model's "
                         "experts from the host store: " + "; ".join(unmet) + " (use tier_decode cache or auto)")
    if path != "auto":
        return path
    if not has_host_ops(ops) or unmet:
        return "cache"
    return "cache" if ops.gpu_platform() == "ROCM" else "direct"  # the default device's platform


def has_host_ops(ops) -> bool:
    """Whether a backend's MoE can read experts from the host store (the ordered kernels can)."""
    return hasattr(ops, "moe_host")


def host_stores(layers, ops) -> tuple:
    """One host store (ops.host_store) per layer over its routed experts: the addresses
    baro_moe_host reads the misses from. The stores share the layers' arrays (no second copy of
    most of the host memory): the tier runner never deletes or donates them."""
    out = []
    for lp in layers:
        gu, dn = (lp["moe"][k] for k in EXPERT_KEYS)
        if isinstance(gu, np.ndarray):  # no host memory kind (CPU without one): the same bytes as an array
            gu, dn = jax.device_put(gu), jax.device_put(dn)
        out.append(ops.host_store(gu, dn, unsafe_share=True))
    return tuple(out)


def _direct_forward(params, state, tokens, pos, n_valid, rope, pools, tables, *, cfg: Config, ops, hosts):
    """model.forward for one row, the routed experts from the pools where tables[i] gives a slot
    and from the host store hosts[i] where it gives none (ops.moe_host): one graph, no host work
    between layers. params holds no routed expert (split_layer's resident parts). Returns
    (logits, state, (hits, counts)): hits counts the routed (layer, expert) pairs that were
    resident and counts [layers, E] how often each expert was routed, from the MoE's own routing
    (ops.moe_route, the same ids), so the hit rate and the pools' adaptation cost no host work."""
    x, cos, sin = M.prologue(params, tokens, pos, rope)
    h = M.first_norm(params["layers"][0], x, cfg, ops)

    def mixer(x, h, lp, st, kind):
        return M.layer_mixer(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid)

    h, new_state, acc = _direct_layers(x, h, params, state, mixer, pools, tables, hosts, cfg=cfg, ops=ops)
    return M.epilogue(params, h, n_valid, cfg=cfg, ops=ops), new_state, acc


def _direct_layers(x, h, params, states, mixer, pools, tables, hosts, *, cfg: Config, ops):
    """The direct path's layer loop: mixer(x, h, lp, st, kind) -> (x, h2, st), then _host_moe.
    Returns (h, the new states, (hits, counts [layers, E]))."""
    hits = jax.numpy.int32(0)
    counts = []
    new = []
    for i, (lp, st, kind, nn) in enumerate(zip(params["layers"], states, cfg.layer_types, M.next_norms(params))):
        x, h2, st = mixer(x, h, lp, st, kind)
        x, h, layer_hits, layer_counts = _host_moe(x, h2, lp["moe"], pools[i], tables[i], hosts[i], nn, cfg=cfg, ops=ops)
        hits = hits + layer_hits
        counts.append(layer_counts)
        new.append(st)
    return h, tuple(new), (hits, jax.numpy.stack(counts))


def _host_moe(x, h2, m, pool, table, host, next_norm, *, cfg: Config, ops):
    """One layer's MoE on the direct path (ops.moe_host: the pool's experts where the table gives a
    slot, the host store's otherwise) and the next norm; with the layer's hits (routed experts that
    were resident) and routing counts [E], from the MoE's own routing (ops.moe_route)."""
    y = ops.moe_host(h2, m["router"], pool[0], pool[1], table, m["shared_gate_up"], m["shared_down"],
                     m["shared_gate"], top_k=cfg.top_k, host=host)
    ids = ops.moe_route(h2, m["router"], top_k=cfg.top_k)
    hits = jax.numpy.sum(table[ids] >= 0, dtype=jax.numpy.int32)
    counts = jax.numpy.zeros((cfg.num_experts,), jax.numpy.int32).at[ids.reshape(-1)].add(1)
    x, h = ops.add_rmsnorm(x, y, next_norm, cfg.rms_eps, m["router"].dtype)
    return x, h, hits, counts


def _direct_rows(params, pool, page_table, tokens, slots, running, pos, rope, pools, tables, *, cfg: Config, ops,
                 hosts, guard: bool):
    """decode_rows' contract in one graph on the direct path: each layer's mixer over the pool
    (_rows_mixer), its MoE by _host_moe, so no per-layer host round trip and no copies. For a pool
    step of one row (a GPU's host-store MoE takes one token). Returns (logits, new pool,
    (hits, counts))."""
    x, cos, sin = M.rows_prologue(params, tokens, pos, rope)
    h = M.first_norm(params["layers"][0], x, cfg, ops)

    def mixer(x, h, lp, st, kind):  # route=True zeroes an idle row's MoE input, as the cache path does
        x, h2, _, st = _rows_mixer(x, h, lp, st, page_table, cos, sin, slots, pos, running, kind=kind, cfg=cfg,
                                   ops=ops, guard=guard, route=True)
        return x, h2, st

    h, new_pool, acc = _direct_layers(x, h, params, pool, mixer, pools, tables, hosts, cfg=cfg, ops=ops)
    return M.rows_head(params, h, ops=ops), new_pool, acc


_DIRECT_ROWS = jax.jit(_direct_rows, static_argnames=("cfg", "ops", "hosts", "guard"), donate_argnums=(1,))


_DIRECT = jax.jit(_direct_forward, static_argnames=("cfg", "ops", "hosts"), donate_argnums=(1,))


def _direct_greedy(params, state, token, pos, n, rope, pools, tables, samp=None, *, cfg: Config, ops, hosts,
                   block: int, k_max=None):
    """runner.greedy_steps (the one block loop) over _direct_forward's rows, summing their hits
    and routing counts. Returns (tokens [block], last, state, (hits, counts))."""
    def row(st, toks, p, acc):
        logits, st, (h, c) = _direct_forward(params, st, toks, p, jax.numpy.int32(1), rope, pools, tables,
                                             cfg=cfg, ops=ops, hosts=hosts)
        return logits, st, (acc[0] + h, acc[1] + c)

    zero = (jax.numpy.int32(0), jax.numpy.zeros((len(pools), cfg.num_experts), jax.numpy.int32))
    return greedy_steps(row, state, token, pos, n, block=block, acc=zero, draw=row_draw(samp, k_max))


_DIRECT_GREEDY = jax.jit(_direct_greedy, static_argnames=("cfg", "ops", "hosts", "block", "k_max"), donate_argnums=(1,))
_DIRECT_GREEDY_FULL = jax.jit(functools.partial(_direct_greedy, n=None),
                              static_argnames=("cfg", "ops", "hosts", "block", "k_max"), donate_argnums=(1,))


ADAPT_EVERY = 16  # tokens between two adaptations (one greedy block; per-token calls wait for 16)
ADAPT_DECAY = 0.75  # a score's decay per ADAPT_EVERY tokens: it halves in about 40 tokens
ADAPT_MAX_SWAPS = 4  # per layer per adaptation: bounds the copies between two calls
# A candidate replaces a resident when it scores over the resident's score by ADAPT_Z x the square
# root of the layer's mean score (counts are Poisson-like: their spread grows as the root of
# their mean), so chance alone rarely swaps. Simulated over 300 blocks of 16 tokens (256 experts,
# top-8, 51 slots): under uniform routing (the synthetic weights) 0.19 swaps per layer per block
# and no change in hits (20%); under Zipf(1) routing hits 30% -> 67%, Zipf(0.6) 19% -> 45%. A
# margin of max(2x, x + 2) got the same hits but swapped 4 per layer per block under uniform
# routing (1 GB of copies per 16 tokens at full size), one of 3 x the mean held E = 16 back.
ADAPT_Z = 4.0
# The root is taken of at least 1 count: at the first adaptation after a cold start the layer's
# mean is 0.5 (16 tokens x 8 / 256), where the Poisson tail is far heavier than the root says:
# 4 x sqrt(0.5) let ~3 candidates per layer past (133 swaps over 40 layers on the H200 trace,
# ~0.8 GB of copies for nothing under uniform routing); with the floor it is ~0.4. The steady
# state's mean (~2 under decay 0.75) is above the floor, so the simulation above is unchanged.
ADAPT_MIN_MEAN = 1.0


def adapt_margin(scores) -> float:
    """How far over a resident's score a candidate's must be to replace it (see ADAPT_Z)."""
    return ADAPT_Z * float(np.sqrt(max(float(np.mean(scores)), ADAPT_MIN_MEAN)))


class DirectDecode:
    """Tier decode in one graph per token: the cache's pools as they stand during a call (no LRU
    traffic inside it), every other routed expert read from the host store by the MoE kernels.
    The same bytes as resident decode (the same weights in the same order, whichever are
    resident); what it saves is the per-layer round trip of the ids (route_seconds) and the copy
    dispatch (copy_seconds). Its hits (routed experts that were resident) and per-expert routing
    counts are made on the device; between calls the pools follow the counts (adapt), so a
    model whose routing favours some experts, as real ones do, gets them resident."""

    def __init__(self, params, cache: ExpertCache, ops, adaptive: bool = True):
        self.cache = cache
        layers = params["layers"]
        self.hosts = cache._hosts if cache._hosts is not None else host_stores(layers, ops)  # dma: the cache's
        self.params = {**{k: v for k, v in params.items() if k != "layers"},
                       "layers": tuple(split_layer(lp)[0] for lp in layers)}
        # An empty pool would send every routed expert over the host link: fill each layer's
        # empty pool with its first `slots` experts once (with no routing statistics yet, any
        # choice is as good under uniform routing: slots / E of the routed experts resident).
        for i, table in enumerate(cache.slot_of):
            if not (table >= 0).any():
                cache.ensure(i, np.arange(cache.slots))
        cache.reset_stats()
        self.adaptive = bool(adaptive)  # settings.tier_adapt
        self.score = np.zeros((len(cache.pools), cache.cfg.num_experts), np.float64)
        self._counts = []  # (device [layers, E] routing counts, tokens) of calls not yet folded into score
        self._since = 0  # tokens folded in since the last adaptation
        self._last = None  # an output of the newest call (ready when it has finished)
        self.swaps = 0
        self.refresh()
        self.reset_stats()

    def reset_stats(self):
        self._hits = []  # device int32 scalars, one per call
        self.pairs = 0   # routed (token, layer, expert) pairs since the reset
        self.swaps = 0   # experts brought into the pools by adapt() since the reset
        self.row_steps = 0  # pool steps of one row taken here (rows()) since the reset

    def refresh(self, layers=None):
        """Take the cache's current slot tables (after an LRU step elsewhere changed them): all,
        or those of `layers`."""
        dev = self.cache._on_dev
        old = getattr(self, "tables", None)
        self.tables = tuple(jax.device_put(np.asarray(t, np.int32), dev)
                            if old is None or layers is None or i in layers else old[i]
                            for i, t in enumerate(self.cache.slot_of))

    def stats(self) -> dict:
        """The cache's size with this path's counts: hits / misses over routed (token, layer,
        expert) pairs since the last reset (an expert routed twice by one token counts twice)."""
        hits = int(sum(int(h) for h in self._hits))
        self._hits = [hits]
        return {"decode_path": "direct", "resident_share": self.cache.slots / self.cache.cfg.num_experts,
                "hits": hits, "misses": self.pairs - hits, "hit_rate": hits / self.pairs if self.pairs else None,
                "route_seconds": 0.0, "copy_seconds": 0.0, "adaptive": self.adaptive, "pool_swaps": self.swaps,
                "pool_row_steps": self.row_steps}

    def adapt(self, keep_last: bool = True):
        """Fold the routing counts of finished calls into each layer's decayed score and, once
        ADAPT_EVERY tokens are in, swap up to ADAPT_MAX_SWAPS residents per layer for experts
        scoring over theirs by adapt_margin (copied from the store into the freed slots, one copy
        call per layer). keep_last: the newest call may still be running, so its counts wait
        (reading them would stall the one-call-ahead pipeline)."""
        ready = self._counts[:-1] if keep_last else self._counts
        if not ready:
            return
        self._counts = self._counts[len(ready):]
        for c, n in ready:
            self.score = self.score * ADAPT_DECAY ** (n / ADAPT_EVERY) + np.asarray(c)
            self._since += n
        if not self.adaptive or self._since < ADAPT_EVERY:
            return
        self._since = 0
        changed = []
        for layer, table in enumerate(self.cache.slot_of):
            sc = self.score[layer]
            resident = np.flatnonzero(table >= 0)
            others = np.flatnonzero(table < 0)
            if not len(resident) or not len(others):
                continue
            cold = resident[np.argsort(sc[resident], kind="stable")]
            hot = others[np.argsort(-sc[others], kind="stable")]
            margin = adapt_margin(sc)
            swap_out, swap_in = [], []
            for out, inn in zip(cold, hot):
                if len(swap_in) == ADAPT_MAX_SWAPS or sc[inn] <= sc[out] + margin:
                    break
                swap_out.append(int(out))
                swap_in.append(int(inn))
            if swap_in:
                if not changed and self._last is not None:
                    # the newest call may still be reading the pools, and the copy below writes
                    # them in place (a donated buffer): wait for it first (a donation does not
                    # wait for readers in flight on every backend: on CPU it raced)
                    jax.block_until_ready(self._last)
                self.cache.replace(layer, swap_out, swap_in)
                self.swaps += len(swap_in)
                changed.append(layer)
        if changed:
            self.refresh(set(changed))

    def _routed(self, steps: int) -> int:
        return steps * len(self.cache.pools) * self.cache.cfg.top_k

    def _pools(self):
        """Fold finished calls' counts in (adapt), then the pools as a call's graph takes them."""
        self.adapt()
        return tuple(tuple(p) for p in self.cache.pools)

    def _record(self, hits, counts, steps: int):
        """A call's device-side hits and routing counts over `steps` tokens (read later, not here)."""
        self._hits.append(hits)
        self._counts.append((counts, steps))
        self._last = counts
        self.pairs += self._routed(steps)

    def __call__(self, state, tokens, pos, n_valid, rope, *, cfg: Config, ops):
        logits, state, (hits, counts) = _DIRECT(self.params, state, tokens, pos, n_valid, rope, self._pools(),
                                                self.tables, cfg=cfg, ops=ops, hosts=self.hosts)
        self._record(hits, counts, 1)
        return logits, state

    def rows(self, pool, page_table, tokens, slots, running, pos, rope, *, cfg: Config, ops, guard: bool):
        """decode_rows' contract for a pool step of one row (TierRunner.decode_rows), one graph."""
        logits, pool, (hits, counts) = _DIRECT_ROWS(self.params, pool, page_table, tokens, slots, running, pos, rope,
                                                    self._pools(), self.tables, cfg=cfg, ops=ops, hosts=self.hosts,
                                                    guard=guard)
        self._record(hits, counts, 1)
        self.row_steps += 1
        return logits, pool

    def greedy(self, state, token, pos, n: int, rope, *, cfg: Config, ops, block: int, samp=None, k_max=None):
        """engine.greedy_steps' contract for n (1..block, a Python int) steps, one graph per block:
        n == block runs the known-trip-count loop; samp / k_max: a sampled sequence's draw."""
        pools = self._pools()
        if n == block:
            out = _DIRECT_GREEDY_FULL(self.params, state, token, pos, rope=rope, pools=pools, tables=self.tables,
                                      samp=samp, cfg=cfg, ops=ops, hosts=self.hosts, block=block, k_max=k_max)
        else:
            out = _DIRECT_GREEDY(self.params, state, token, pos, jax.numpy.int32(n), rope, pools, self.tables, samp,
                                 cfg=cfg, ops=ops, hosts=self.hosts, block=block, k_max=k_max)
        toks, last, state, (hits, counts) = out
        self._record(hits, counts, n)
        return toks, last, state


def memory_kinds(params) -> dict[str, Any]:
    """{path: memory kind} of every leaf ('numpy' for host numpy arrays): for tests and reports."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        out[name] = leaf.sharding.memory_kind if hasattr(leaf, "sharding") else "numpy"
    return out
