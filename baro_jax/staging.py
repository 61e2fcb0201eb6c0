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
from .config import Config

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
