"""The `ordered` backend: the custom calls of custom_calls/, with ops_xla's signatures.

Every reduction runs in a kernel whose summation order does not depend on how
many rows it gets; only glue stays in XLA. bf16 only.
"""
from __future__ import annotations

import jax.numpy as jnp

import custom_calls as cc

_BF16 = jnp.bfloat16


def _bf16_only(dtype):
    if dtype != _BF16:
        raise ValueError(f"the 'ordered' backend computes in bfloat16 only, got {jnp.dtype(dtype).name}")


def matmul(x, w):
    return cc.matmul(x, w)


def gdn_projection(h, w, conv_cols):
    """The GDN input projection f32 [m, N], and whether its first conv_cols columns (the conv's)
    come as bf16 packed at the start of each row (BARO_GDN_PACK16), which conv then takes as
    `packed`: the same bytes out of the conv, half the bytes between the two."""
    bf16_cols = cc.packed_columns(h.shape[0], conv_cols)
    return cc.matmul(h, w, bf16_cols=bf16_cols), bf16_cols > 0


def rmsnorm(x, w, eps, dtype=_BF16):
    _bf16_only(dtype)
    return cc.rmsnorm(x, w, eps)


def add_rmsnorm(x, y, w, eps, dtype=_BF16):
    _bf16_only(dtype)
    return cc.add_rmsnorm(x, y, w, eps)


def gated_norm(o, z, w, eps, dtype=_BF16, z_col=0):
    _bf16_only(dtype)
    return cc.gated_norm(o, z, w, eps, z_col)


def attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid, *, num_heads, num_kv_heads, eps):
    # H and Hkv are implied by the shapes; the kernel checks they agree.
    return cc.attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid, eps=eps)


def conv(x, w, window, n_valid, rows=False, packed=False):
    return cc.conv(x, w, window, n_valid, rows=rows, packed=packed)


def delta(y, b, a, A_log, dt_bias, state, n_valid, *, nk, dk, b_col=0, a_col=0, rows=False):
    return cc.delta(y, b, a, A_log, dt_bias, state, n_valid, b_col, a_col, rows=rows)


def moe(h, router, gate_up, down, shared_gate_up, shared_down, shared_gate, *, top_k):
    return cc.moe(h, router, gate_up, down, shared_gate_up, shared_down, shared_gate, top_k)


def delta_blocked(y, b, a, A_log, dt_bias, state, pending_k, pending_u, pending_c, pos, n_valid, *, nk, dk):
    return cc.delta_blocked(y, b, a, A_log, dt_bias, state, pending_k, pending_u, pending_c, pos, n_valid)


def moe_slots(h, router, gate_up_pool, down_pool, slots, shared_gate_up, shared_down, shared_gate, *, top_k):
    """moe with the routed experts in pools of slots (tier decode's expert cache): moe's bytes."""
    return cc.moe_slots(h, router, gate_up_pool, down_pool, slots, shared_gate_up, shared_down, shared_gate, top_k)


def moe_host(h, router, gate_up_pool, down_pool, slots, shared_gate_up, shared_down, shared_gate, *, top_k, host):
    """moe_slots whose experts with no slot are read from the host store `host` (a
    custom_calls.HostStore) inside the call: moe's bytes, no host round trip."""
    return cc.moe_host(h, router, gate_up_pool, down_pool, slots, shared_gate_up, shared_down, shared_gate, top_k,
                       host)


def moe_route(h, router, *, top_k):
    """The expert ids [m, top_k] moe routes each row to (its own routing code)."""
    return cc.moe_route(h, router, top_k)


def moe_pairs(h, router, gate_up_shard, down_shard, expert_base, *, top_k):
    """Expert parallel, one shard: the MoE's routing (ids, weights) and the per-pair outputs of
    the pairs routed to this shard's experts (0 for the others); see expert_parallel.py."""
    return cc.moe_pairs(h, router, gate_up_shard, down_shard, expert_base, top_k)


def moe_combine(h, y, w, shared_gate_up, shared_down, shared_gate):
    """The MoE's combine of gathered per-pair outputs plus its gated shared expert: moe's bytes."""
    return cc.moe_combine(h, y, w, shared_gate_up, shared_down, shared_gate)


def moe_host_unmet(cfg) -> list:
    """Why moe_host cannot read cfg's experts from the host store on the default device ([]: it
    can; the CPU kernel reads any shape, a GPU's only its one-token path's)."""
    if cc.gpu_platform() is None:
        return []
    from custom_calls.moe import host_gpu_unmet
    return host_gpu_unmet(cfg.hidden_size, cfg.num_experts, cfg.moe_inter, cfg.shared_inter, cfg.top_k)


def gpu_platform():
    """The default device's GPU platform as the kernels name it ("CUDA", "ROCM"), or None on CPU."""
    return cc.gpu_platform()


def host_store(gate_up, down, *, unsafe_share=False):
    """The host store baro_moe_host reads one layer's routed experts from (custom_calls.HostStore):
    its own copy of the arrays, or, with unsafe_share, the arrays themselves (the caller keeps them
    alive while any graph built with it runs)."""
    return cc.host_store(gate_up, down, unsafe_share=unsafe_share)


def fetch_ring(n_max: int):
    """The copy-engine fetch of tier decode's cache misses (custom_calls.FetchRing)."""
    return cc.FetchRing(n_max)


def attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slot, pos, *, num_heads, num_kv_heads,
                   eps):
    """attention for m rows of many sequences: row r is slot[r]'s token at pos[r] over the paged
    KV pools [NP, page, Hkv, hd] through the page table [P, T] (-1: padding row, unmapped page);
    row r's bytes are attention's one-row call on the contiguous cache its slot's pages stand for."""
    return cc.attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slot, pos, eps=eps)


def log_softmax(x):
    """Row-wise log-softmax of fp32 logits [m, V] in a fixed order per row (logprobs)."""
    return cc.log_softmax(x)
