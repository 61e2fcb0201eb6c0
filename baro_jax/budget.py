"""Device and host memory budgeting: the one place that counts bytes.

Both modes refuse a request before any work when its footprint cannot fit:
resident mode counts every weight, tier mode the non-expert weights plus two
staged expert layers; both add the KV/state of the request's context and the
activations of one layer at the prefill chunk. The activation count is an
estimate of the largest set of buffers alive at once inside one layer (the
MoE's scratch usually), with a margin for XLA's own temporaries.
"""
from __future__ import annotations

import os

import numpy as np
import jax

from .config import DELTA_BLOCK, FULL, Config

ACTIVATION_MARGIN = 1.25  # XLA temporaries beside the buffers counted below


def itemsize(dtype) -> int:
    return np.dtype(jax.numpy.dtype(dtype)).itemsize


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


# --- what a model needs -------------------------------------------------------------
def param_bytes(cfg: Config, dtype) -> int:
    from .weights import param_shapes

    is_leaf = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], bool)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=is_leaf)
    return sum(int(np.prod(shape)) * (4 if is_f32 else itemsize(dtype)) for shape, is_f32 in leaves)


def expert_layer_bytes(cfg: Config, dtype) -> int:
    E, I, D = cfg.num_experts, cfg.moe_inter, cfg.hidden_size
    return (E * 2 * I * D + E * D * I) * itemsize(dtype)


def cache_bytes(cfg: Config, dtype, slots: int) -> int:
    """The decode expert cache's device pools: every layer's `slots` experts (gate_up + down)."""
    return cfg.num_layers * slots * 3 * cfg.moe_inter * cfg.hidden_size * itemsize(dtype)


def state_bytes(cfg: Config, dtype, length: int) -> int:
    n = 0
    for t in cfg.layer_types:
        if t == FULL:
            n += 2 * length * cfg.num_kv_heads * cfg.head_dim * itemsize(dtype)
        else:
            n += (cfg.conv_kernel - 1) * cfg.conv_dim * itemsize(dtype)
            n += cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
            if cfg.delta_rule == "blocked":  # the block's pending rows: k, u and c per slot, fp32
                n += cfg.lin_v_heads * DELTA_BLOCK * (cfg.lin_k_dim + cfg.lin_v_dim + 1) * 4
    return n


def activation_bytes(cfg: Config, dtype, chunk: int) -> int:
    """Estimated peak of one layer's live activations at m = chunk rows (fp32 where NUMERICS says)."""
    m, a, f = chunk, itemsize(dtype), 4
    D, E, I, Is, k = cfg.hidden_size, cfg.num_experts, cfg.moe_inter, cfg.shared_inter, cfg.top_k
    nvdv = cfg.lin_v_heads * cfg.lin_v_dim
    residual = 2 * m * D * f  # x and x + y
    gdn = m * (cfg.gdn_in_dim * f + cfg.conv_dim * (a + f) + nvdv * (2 * f + a) + D * f)
    attn = m * (cfg.attn_qkv_dim * f + cfg.num_heads * cfg.head_dim * a + D * f)
    P = m * k
    moe = m * (E * f + 2 * Is * f + Is * a + 2 * D * f + a * D) + P * (16 + 2 * I * f + I * a + D * f)
    logits = cfg.vocab_size * f
    return int(ACTIVATION_MARGIN * (residual + max(gdn, attn, moe) + logits))


# --- what the machine has -----------------------------------------------------------
def device_memory_bytes() -> int | None:
    """Memory of the default device: its allocator limit on GPUs, physical RAM on the CPU."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # some backends do not report
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if dev.platform == "cpu":
        return host_memory_bytes()
    return None


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def budget_bytes(device_budget_gb: float | None) -> tuple[int | None, str]:
    """(bytes, what it is): 95% of the device's memory, or the explicit budget where smaller."""
    have = device_memory_bytes()
    dev_limit = None if have is None else int(0.95 * have)
    dev_what = f"95% of the {jax.devices()[0].platform} device's {have / 2**30:.1f} GiB" if have else ""
    if device_budget_gb is not None:
        from .checks import budget_gb

        device_budget_gb = budget_gb(device_budget_gb)  # a finite number > 0, or a clear error
        b = int(device_budget_gb * 2**30)
        if dev_limit is None or b <= dev_limit:
            return b, f"the device budget of {device_budget_gb:g} GiB"
    return dev_limit, dev_what or "unknown device memory"


# --- the checks ---------------------------------------------------------------------
def expert_parallel_bytes(cfg: Config, chunk: int, devices: int) -> int:
    """The expert-parallel MoE's extra live buffers at m = chunk (expert_parallel.py): the pair
    outputs [m, k, D] fp32 gathered from every device, the selected copy and this device's own."""
    return (devices + 2) * chunk * cfg.top_k * cfg.hidden_size * 4


def check_resident(cfg: Config, dtype, device_budget_gb: float | None = None, state_len: int = 0,
                   chunk: int = 0, devices: int = 1) -> int:
    """Refuse up front a resident model (and request) that cannot fit; returns the bytes needed
    per device. devices > 1: the routed experts are split over the devices (expert parallel)."""
    w = param_bytes(cfg, dtype)
    if devices > 1:
        w -= cfg.num_layers * expert_layer_bytes(cfg, dtype) * (devices - 1) // devices
    st = state_bytes(cfg, dtype, state_len) if state_len else 0
    act = activation_bytes(cfg, dtype, chunk) if chunk else 0
    if devices > 1 and chunk:
        act += expert_parallel_bytes(cfg, chunk, devices)
    need = w + st + act
    limit, what = budget_bytes(device_budget_gb)
    if limit is not None and w > limit:
        raise MemoryError(f"the weights need {w / 2**30:.1f} GiB"
                          + (f" per device over {devices} devices" if devices > 1 else "")
                          + f", more than {what}; use a larger device, more devices (--devices), "
                          "or --mode tier (routed experts in host memory)")
    if limit is not None and need > limit:
        parts = f"weights {gib(w)}"
        if state_len:
            parts += f" + KV/state for {state_len} positions {gib(st)}"
        if chunk:
            parts += f" + activations at chunk {chunk} {gib(act)}"
        raise MemoryError(f"resident mode needs {gib(need)} of device memory ({parts}), more than {what}; "
                          "use a smaller --chunk or a shorter context")
    return need


def check_tier(cfg: Config, dtype, device_budget_gb: float | None, state_len: int, chunk: int = 0,
               cache_slots: int = 0) -> int:
    """Refuse up front a tier-mode request whose device footprint exceeds the budget.

    Counted: the non-expert weights, two staged expert layers, the decode expert cache's
    pools (cache_slots per layer), the KV/state of a context of `state_len` positions and
    (when chunk > 0) one layer's activations.
    """
    limit, what = budget_bytes(device_budget_gb)
    exp = expert_layer_bytes(cfg, dtype)
    resident = param_bytes(cfg, dtype) - cfg.num_layers * exp
    st = state_bytes(cfg, dtype, state_len)
    act = activation_bytes(cfg, dtype, chunk) if chunk else 0
    pools = cache_bytes(cfg, dtype, cache_slots)
    need = resident + 2 * exp + pools + st + act
    if limit is not None and need > limit:
        raise MemoryError(
            f"tier mode needs {gib(need)} of device memory: non-expert weights {gib(resident)} + "
            f"two staged expert layers 2 x {gib(exp)} + "
            f"{f'decode expert cache {cfg.num_layers} x {cache_slots} slots {gib(pools)} + ' if cache_slots else ''}KV/state for {state_len} positions {gib(st)}"
            f"{f' + activations at chunk {chunk} {gib(act)}' if chunk else ''}, more than {what}")
    # the expert store lives in host RAM (on the CPU backend, so does the "device" part)
    host = host_memory_bytes()
    on_cpu = jax.devices()[0].platform == "cpu"
    store = cfg.num_layers * exp + (need if on_cpu else 0)
    if host is not None and store > 0.95 * host:
        raise MemoryError(f"tier mode's host store needs {gib(store)} (routed experts {gib(cfg.num_layers * exp)}"
                          f"{' + the CPU device part' if on_cpu else ''}), more than "
                          f"95% of the host's {gib(host)} of RAM")
    return need


CACHE_RESERVE = 1024  # context and chunk left for requests when the expert cache is sized


def tier_cache_slots(cfg: Config, dtype, device_budget_gb: float | None, want: int | None = None) -> tuple[int, str]:
    """(slots per layer, why) of the decode expert cache: `want` (default 64, at most E), fewer
    when the budget leaves less room beside the non-expert weights, two staged layers and a
    request of CACHE_RESERVE positions at chunk CACHE_RESERVE; 0 (no cache) below top_k."""
    from .staging import DEFAULT_CACHE_SLOTS

    E, k = cfg.num_experts, cfg.top_k
    top = min(DEFAULT_CACHE_SLOTS if want is None else want, E)
    if want is not None and want < 1:
        return 0, "turned off (0 slots asked)"
    limit, what = budget_bytes(device_budget_gb)
    if limit is None:
        return top, f"{top} slots (device memory unknown)"
    r = min(CACHE_RESERVE, cfg.max_context)
    try:
        base = check_tier(cfg, dtype, device_budget_gb, r, r)
    except MemoryError:
        return 0, f"no room for the cache in {what} beside a {r}-position request at chunk {r}"
    per = cache_bytes(cfg, dtype, 1)
    fit = int((limit - base) // per)
    S = min(top, fit)
    if S < k:
        return 0, f"no room for the cache ({fit} slots per layer fit in {what}, top_k is {k})"
    return S, f"{S} slots per layer ({gib(cache_bytes(cfg, dtype, S))}){' (the budget allows no more)' if S < top else ''}"


def largest_tier_chunk(cfg: Config, dtype, device_budget_gb: float | None, state_len: int, n_prompt: int,
                       cache_slots: int = 0) -> int:
    """The largest power-of-two chunk (16 .. the prompt's next power of two) whose tier-mode
    footprint fits; 16 when none does (check_tier then refuses the request with the numbers)."""
    c = 16
    while c < n_prompt:
        c *= 2
    while c > 16:
        try:
            check_tier(cfg, dtype, device_budget_gb, state_len, c, cache_slots)
            return c
        except MemoryError:
            c //= 2
    return c
