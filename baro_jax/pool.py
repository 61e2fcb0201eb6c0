"""The state pool of many sequences: a fixed set of slots, each holding one sequence's state.

Per layer, every slot's state side by side: attention KV [P, S, Hkv, hd] (bf16), the conv window
[K-1, P, C] (bf16) and the delta state [P, nv, dk, dv] (fp32). The layout lets a decode step fold
the slots' conv and delta rows into one row of P times the channels (model.decode_rows) and lets
attention read each row's own slot. A slot's state is exactly the one-sequence state of
model.init_state(cfg, dtype, S): slot_state / put_slot_state move it out and back for a prefill
chunk, which then runs the one-sequence forward on it.
"""
from __future__ import annotations

import jax.numpy as jnp

from .config import FULL, Config

f32 = jnp.float32


def init_pool(cfg: Config, dtype, slots: int, length: int):
    """Zeroed state for `slots` sequences of up to `length` positions each."""
    layers = []
    for t in cfg.layer_types:
        if t == FULL:
            kv = (slots, length, cfg.num_kv_heads, cfg.head_dim)
            layers.append({"k": jnp.zeros(kv, dtype), "v": jnp.zeros(kv, dtype)})
        else:
            layers.append({"conv": jnp.zeros((cfg.conv_kernel - 1, slots, cfg.conv_dim), dtype),
                           "ssm": jnp.zeros((slots, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), f32)})
    return tuple(layers)


def slot_state(pool, slot):
    """Slot `slot`'s state as a one-sequence state (model.init_state's layout)."""
    out = []
    for st in pool:
        if "k" in st:
            out.append({"k": st["k"][slot], "v": st["v"][slot]})
        else:
            out.append({"conv": st["conv"][:, slot], "ssm": st["ssm"][slot]})
    return tuple(out)


def put_slot_state(pool, slot, state):
    """The pool with slot `slot` holding the one-sequence `state`."""
    out = []
    for st, s in zip(pool, state):
        if "k" in st:
            out.append({"k": st["k"].at[slot].set(s["k"]), "v": st["v"].at[slot].set(s["v"])})
        else:
            out.append({"conv": st["conv"].at[:, slot].set(s["conv"]), "ssm": st["ssm"].at[slot].set(s["ssm"])})
    return tuple(out)


def clear_slot(pool, slot):
    """The pool with slot `slot` zeroed: a new sequence starts from the zero state, as alone."""
    out = []
    for st in pool:
        if "k" in st:
            out.append({"k": st["k"].at[slot].set(0), "v": st["v"].at[slot].set(0)})
        else:
            out.append({"conv": st["conv"].at[:, slot].set(0), "ssm": st["ssm"].at[slot].set(0)})
    return tuple(out)


def keep_running(old, new, running):
    """The pool after a decode step: the new state for the running slots, the old one for the
    others (their conv and delta rows ran on whatever they held; a select, never arithmetic)."""
    out = []
    for a, b in zip(old, new):
        if "k" in a:  # attention rows of idle slots write nothing
            out.append(b)
        else:
            out.append({"conv": jnp.where(running[None, :, None], b["conv"], a["conv"]),
                        "ssm": jnp.where(running[:, None, None, None], b["ssm"], a["ssm"])})
    return tuple(out)


def slot_bytes(cfg: Config, dtype, length: int) -> int:
    """Device bytes of one slot of `length` positions."""
    item = jnp.dtype(dtype).itemsize
    n = 0
    for t in cfg.layer_types:
        if t == FULL:
            n += 2 * length * cfg.num_kv_heads * cfg.head_dim * item
        else:
            n += (cfg.conv_kernel - 1) * cfg.conv_dim * item + cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
    return n

