"""The state pool of many sequences: a fixed set of slots, each holding one sequence's state,
with its attention KV in pages.

Per attention layer the pool holds KV pages [NP, page, Hkv, hd] (bf16); ONE page table
[P, S / page] int32, shared by every layer, maps slot s's position j to page table[s, j // page],
row j % page (-1: no page). A slot's pages stand for the contiguous one-sequence cache [S, Hkv, hd]
in which the positions of unmapped pages read as zeros. Per linear layer, every slot's state side
by side: the conv window [K-1, P, C] (bf16) and the delta state [P, nv, dk, dv] (fp32). The layout
lets a decode step fold the slots' conv and delta rows into one row of P times the channels
(model.decode_rows) and lets attention read each row's own slot through the table
(ops.attention_rows). A slot's state as the one-sequence state of model.init_state(cfg, dtype, S):
slot_state gathers it out of the pages and put_slot_state scatters it back, for a prefill chunk,
which then runs the one-sequence forward on it. block_manager.py decides which pages a slot holds.
"""
from __future__ import annotations

import jax.numpy as jnp

from .config import FULL, Config

f32 = jnp.float32


def init_pool(cfg: Config, dtype, slots: int, pages: int, page: int):
    """Zeroed state for `slots` sequences whose attention KV lives in `pages` pages of `page`
    positions (the page table is the caller's: block_manager.BlockManager.table)."""
    layers = []
    for t in cfg.layer_types:
        if t == FULL:
            kv = (pages, page, cfg.num_kv_heads, cfg.head_dim)
            layers.append({"k": jnp.zeros(kv, dtype), "v": jnp.zeros(kv, dtype)})
        else:
            layers.append({"conv": jnp.zeros((cfg.conv_kernel - 1, slots, cfg.conv_dim), dtype),
                           "ssm": jnp.zeros((slots, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), f32)})
    return tuple(layers)


def gather_cache(pages, row):
    """The contiguous cache [T * page, Hkv, hd] that a table row [T] maps into pages
    [NP, page, Hkv, hd]: each page in place, zeros for -1 entries."""
    got = pages[jnp.maximum(row, 0)]
    got = jnp.where((row >= 0)[:, None, None, None], got, jnp.zeros((), pages.dtype))
    return got.reshape((-1,) + pages.shape[2:])


def scatter_cache(pages, row, cache):
    """pages with the contiguous cache [T * page, Hkv, hd] put back into the pages a table row [T]
    maps (the positions of -1 entries go nowhere)."""
    NP, page = pages.shape[:2]
    return pages.at[jnp.where(row >= 0, row, NP)].set(cache.reshape((-1, page) + pages.shape[2:]), mode="drop")


def slot_state(pool, table, slot):
    """Slot `slot`'s state as a one-sequence state (model.init_state's layout, S = T * page)."""
    row = table[slot]
    out = []
    for st in pool:
        if "k" in st:
            out.append({"k": gather_cache(st["k"], row), "v": gather_cache(st["v"], row)})
        else:
            out.append({"conv": st["conv"][:, slot], "ssm": st["ssm"][slot]})
    return tuple(out)


def put_slot_state(pool, table, slot, state):
    """The pool with slot `slot` holding the one-sequence `state` (its KV in the slot's pages)."""
    row = table[slot]
    out = []
    for st, s in zip(pool, state):
        if "k" in st:
            out.append({"k": scatter_cache(st["k"], row, s["k"]), "v": scatter_cache(st["v"], row, s["v"])})
        else:
            out.append({"conv": st["conv"].at[:, slot].set(s["conv"]), "ssm": st["ssm"].at[slot].set(s["ssm"])})
    return tuple(out)


def clear_slot(pool, slot, pages):
    """The pool with slot `slot`'s conv and delta state zeroed and the pages listed in `pages`
    ([T] int32, -1 padded: one graph for any count) zeroed: a new sequence starts from the zero
    state, as alone."""
    out = []
    for st in pool:
        if "k" in st:
            NP = st["k"].shape[0]
            at = jnp.where(pages >= 0, pages, NP)
            out.append({"k": st["k"].at[at].set(0, mode="drop"), "v": st["v"].at[at].set(0, mode="drop")})
        else:
            out.append({"conv": st["conv"].at[:, slot].set(0), "ssm": st["ssm"].at[slot].set(0)})
    return tuple(out)


def move_slot(pool, src, dst):
    """The pool with slot src's conv and delta state copied into slot dst (its KV pages move with
    its table row, which is the caller's)."""
    return tuple(st if "k" in st else {"conv": st["conv"].at[:, dst].set(st["conv"][:, src]),
                                       "ssm": st["ssm"].at[dst].set(st["ssm"][src])} for st in pool)


def fork_slot(pool, src, dst, src_pages, dst_pages):
    """The pool with slot dst holding a copy of slot src's state: its conv and delta state, and
    KV page src_pages[i] copied into page dst_pages[i] ([T] int32 each, -1 where there is none:
    one graph for any count). Exact copies: a sequence whose prompt is another's starts from the
    bytes its own prefill would have left (the prefill is a function of the prompt alone)."""
    out = []
    for st in pool:
        if "k" in st:
            NP = st["k"].shape[0]
            at = jnp.where((src_pages >= 0) & (dst_pages >= 0), dst_pages, NP)
            frm = jnp.maximum(src_pages, 0)
            out.append({"k": st["k"].at[at].set(st["k"][frm], mode="drop"),
                        "v": st["v"].at[at].set(st["v"][frm], mode="drop")})
        else:
            out.append({"conv": st["conv"].at[:, dst].set(st["conv"][:, src]),
                        "ssm": st["ssm"].at[dst].set(st["ssm"][src])})
    return tuple(out)


def prefix(pool, k: int):
    """The pool of its first k slots: their conv and delta state, and every KV page (pages are
    the slots' through the table, whose first k rows the caller passes)."""
    if k == _slots_of(pool):
        return pool
    return tuple(st if "k" in st else {"conv": st["conv"][:, :k], "ssm": st["ssm"][:k]} for st in pool)


def put_layer_prefix(st, s):
    """A linear layer's pool state with its first k slots' conv and delta state from s (k = s's slots)."""
    k = s["ssm"].shape[0]
    return {"conv": st["conv"].at[:, :k].set(s["conv"]), "ssm": st["ssm"].at[:k].set(s["ssm"])}


def put_prefix(pool, sub, k: int, put_layer=put_layer_prefix):
    """The pool with its first k slots' state from `sub` (prefix's layout) and sub's KV pages.
    put_layer(st, s) writes a linear layer's (tier mode's eager loop passes it jitted, donating st:
    in place, no second copy of the states); the pool's KV pages are never read."""
    if k == _slots_of(pool):
        return sub
    return tuple(s if "k" in st else put_layer(st, s) for st, s in zip(pool, sub))


def _slots_of(pool) -> int | None:
    return next((st["ssm"].shape[0] for st in pool if "ssm" in st), None)


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


def page_bytes(cfg: Config, dtype, page: int) -> int:
    """Device bytes of one KV page (k and v of every attention layer)."""
    item = jnp.dtype(dtype).itemsize
    return sum(2 * page * cfg.num_kv_heads * cfg.head_dim * item for t in cfg.layer_types if t == FULL)


def slot_bytes(cfg: Config, dtype) -> int:
    """Device bytes of one slot beside its pages: the conv and delta state of the linear layers."""
    item = jnp.dtype(dtype).itemsize
    return sum((cfg.conv_kernel - 1) * cfg.conv_dim * item + cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
               for t in cfg.layer_types if t != FULL)
