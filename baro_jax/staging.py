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

Not built yet: the decode expert cache (a per-layer LRU of 64 expert slots
with a slot table in the MoE kernel). Decode currently stages every layer's
whole expert set per token: correct, and slow (it moves all routed experts
across the host link for every generated token). Overlap has not been
measured on a GPU yet.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import jax
from jax.sharding import SingleDeviceSharding

from . import model as M
from .config import FULL, Config

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


# --- the memory budget ------------------------------------------------------------
def _itemsize(dtype) -> int:
    return np.dtype(jax.numpy.dtype(dtype)).itemsize


def expert_layer_bytes(cfg: Config, dtype) -> int:
    E, I, D = cfg.num_experts, cfg.moe_inter, cfg.hidden_size
    return (E * 2 * I * D + E * D * I) * _itemsize(dtype)


def state_bytes(cfg: Config, dtype, length: int) -> int:
    n = 0
    for t in cfg.layer_types:
        if t == FULL:
            n += 2 * length * cfg.num_kv_heads * cfg.head_dim * _itemsize(dtype)
        else:
            n += (cfg.conv_kernel - 1) * cfg.conv_dim * _itemsize(dtype)
            n += cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
    return n


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def budget_bytes(device_budget_gb: float | None) -> tuple[int | None, str]:
    """(bytes, what it is): 95% of the device's memory, or the explicit budget where smaller."""
    from .engine import device_memory_bytes

    have = device_memory_bytes()
    dev_limit = None if have is None else int(0.95 * have)
    dev_what = f"95% of the {jax.devices()[0].platform} device's {have / 2**30:.1f} GiB" if have else ""
    if device_budget_gb is not None:
        if device_budget_gb <= 0:
            raise ValueError(f"--device-budget-gb must be positive, got {device_budget_gb}")
        b = int(device_budget_gb * 2**30)
        if dev_limit is None or b <= dev_limit:
            return b, f"the device budget of {device_budget_gb:g} GiB"
    return dev_limit, dev_what or "unknown device memory"


def host_memory_bytes() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_budget(cfg: Config, dtype, device_budget_gb: float | None, state_len: int):
    """Refuse up front a tier-mode request whose device footprint exceeds the budget.

    Counted: the non-expert weights, two staged expert layers and the KV/state
    of a context of `state_len` positions (activations and workspace are not).
    """
    from .engine import param_bytes

    limit, what = budget_bytes(device_budget_gb)
    exp = expert_layer_bytes(cfg, dtype)
    resident = param_bytes(cfg, dtype) - cfg.num_layers * exp
    st = state_bytes(cfg, dtype, state_len)
    need = resident + 2 * exp + st
    if limit is not None and need > limit:
        raise MemoryError(
            f"tier mode needs {gib(need)} of device memory: non-expert weights {gib(resident)} + "
            f"two staged expert layers 2 x {gib(exp)} + KV/state for {state_len} positions {gib(st)}, "
            f"more than {what}")
    # the expert store lives in host RAM (on the CPU backend, so does the "device" part)
    host = host_memory_bytes()
    store = cfg.num_layers * exp + (need if jax.devices()[0].platform == "cpu" else 0)
    if host is not None and store > 0.95 * host:
        raise MemoryError(f"tier mode's host store needs {gib(store)} (routed experts {gib(cfg.num_layers * exp)}"
                          f"{' + the CPU device part' if jax.devices()[0].platform == 'cpu' else ''}), more than "
                          f"95% of the host's {gib(host)} of RAM")
    return need


# --- the per-layer forward --------------------------------------------------------
def _layer(x, lp, experts, st, cos, sin, pos, n_valid, *, kind, cfg, ops):
    lp = {**lp, "moe": {**lp["moe"], **experts}}
    return M.layer_forward(x, lp, st, kind, cfg, ops, cos, sin, pos, n_valid)


# Module-level jits keyed on the static (kind, cfg, ops): one compile per layer kind, shared by engines.
_PROLOGUE = jax.jit(M.prologue)
_LAYER = jax.jit(_layer, static_argnames=("kind", "cfg", "ops"), donate_argnums=(0, 3))
_EPILOGUE = jax.jit(M.epilogue, static_argnames=("cfg", "ops", "all_logits"))


def forward(params, state, tokens, pos, n_valid, rope, *, cfg: Config, ops, all_logits: bool = False):
    """model.forward's contract, run layer by layer with routed experts staged from the host store.

    The state's per-layer leaves are donated (as the resident step donates the state).
    """
    on_dev = device_sharding(next(iter(params["embed"].devices())))
    layers = params["layers"]
    n = len(layers)

    def stage(i):  # asynchronous host-to-device copy of layer i's experts
        return jax.device_put(split_layer(layers[i])[1], on_dev)

    x, cos, sin = _PROLOGUE({"embed": params["embed"]}, tokens, pos, rope)
    nxt = stage(0)
    new_state = []
    for i, (lp, st, kind) in enumerate(zip(layers, state, cfg.layer_types)):
        # issue layer i+1's copy before layer i's compute: at most two staged layers alive
        cur, nxt = nxt, (stage(i + 1) if i + 1 < n else None)
        x, st = _LAYER(x, split_layer(lp)[0], cur, st, cos, sin, pos, n_valid, kind=kind, cfg=cfg, ops=ops)
        del cur
        new_state.append(st)
    logits = _EPILOGUE({"final_norm": params["final_norm"], "lm_head": params["lm_head"]}, x, n_valid,
                       cfg=cfg, ops=ops, all_logits=all_logits)
    return logits, tuple(new_state)


def memory_kinds(params) -> dict[str, Any]:
    """{path: memory kind} of every leaf ('numpy' for host numpy arrays): for tests and reports."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        out[name] = leaf.sharding.memory_kind if hasattr(leaf, "sharding") else "numpy"
    return out
