"""Device and host memory budgeting: the one place that counts bytes.

Both modes refuse a request before any work when its footprint cannot fit:
resident mode counts every weight, tier mode the non-expert weights, two
staged expert layers and the decode expert cache; both add the KV/state of the
request's context, the activations of one layer at the prefill chunk, and a
runtime reserve for what the count does not see (RUNTIME_RESERVE_*).

Tier mode splits its budget on purpose: the decode expert cache is sized
only after room is kept for a prefill at PREFILL_RESERVE_CHUNK rows with its
KV/state (a prefill pass moves every routed expert over the host link whatever
the chunk, so a small chunk multiplies the passes), and the prefill chunk is
then the largest that fits beside the cache (largest_tier_chunk).
"""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import numpy as np
import jax

from .checks import as_int, budget_gb
from .ops import kernel_scratch_bytes
from .config import DELTA_BLOCK, FULL, Config
from .pool import page_bytes as pool_page_bytes, slot_bytes as pool_slot_bytes
from .settings import DEFAULT_CACHE_SLOTS, DEFAULT_KV_PAGE, allocator_mem_fraction
from .shapes import MIN_CHUNK, state_length
from .weights import param_shapes

ACTIVATION_MARGIN = 1.25  # XLA temporaries beside the XLA-side activation buffers counted below

# Held back from every budget (both modes) for device memory the count below does not see.
# Why: on the H200 run as a 24 GB card (issue 11) a tier request the count put at <= 22 GiB ran
# out of memory under a 23.6 GiB allocator limit, so at least 1.6 GiB went uncounted. It covers
# XLA's own workspace and the executables' constants; allocator fragmentation (a staged 1 GiB
# gate_up needs one contiguous free block); buffers whose release waits on the device (a staged
# layer's experts are freed only once its compute has run, so a third staged layer can be alive:
# 1.5 GiB at full size, less than the 1.76 GiB this keeps at 22 GiB); and a caller's own extra
# arrays (a benchmark's copy of a state for its checks). benchmarks/tier_overlap.py and speed.py
# record the device's peak beside the count, to measure this rather than guess it.
RUNTIME_RESERVE_MIN = 1 << 30
RUNTIME_RESERVE_FRACTION = 0.08

# The prefill the decode expert cache leaves room for: a prompt of this many tokens in one pass
# (clipped to max_context), with the KV/state of that prompt going on to decode. 8192 rows: an 8k
# prompt in one pass of the host link, a 32k one in four to eight, not one pass per 1k tokens.
PREFILL_RESERVE_CHUNK = 8192

class Part(NamedTuple):
    """One counted piece of a footprint: a key for JSON, its bytes, and how a refusal names it."""
    name: str
    bytes: int
    text: str


def itemsize(dtype) -> int:
    return np.dtype(jax.numpy.dtype(dtype)).itemsize


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def round256(n: int) -> int:
    return (n + 255) & ~255


# --- what a model needs -------------------------------------------------------------
@functools.lru_cache(maxsize=64)  # every prefill checks the budget: walk the shape tree once per model
def param_bytes(cfg: Config, dtype) -> int:
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


def moe_scratch_bytes(cfg: Config, m: int, fused: bool = True) -> int:
    """The GPU scratch one baro_moe call of m rows takes from the allocator, as the kernel library
    lays it out (csrc/common/scratch_layout.h, through baro_jax.ops.kernel_scratch_bytes); 0 where
    the library is not built (then no baro_moe runs).

    fused: gate/up runs with the SwiGLU in its epilogue (CUDA's GEMM configs at prefill sizes), so
    there is no fp32 gu buffer; HIP never fuses (gemm_fused_swiglu_ok). It counts the fold's
    pieces (the shared gate's logits, the shared expert's m grouped rows, the tail counters)
    wherever moe_plan may fold: one token when I == Is; m rows when the router GEMM (m <= 64) or
    the grouped GEMMs (under 8 pairs per expert) run on 16-row slots (an upper bound: moe_plan
    has more conditions)."""
    if m <= 0:
        return 0
    E, k, I, Is, D = cfg.num_experts, cfg.top_k, cfg.moe_inter, cfg.shared_inter, cfg.hidden_size
    fold = I == Is if m == 1 else (m <= 64 or m * k < 8 * E)
    n = kernel_scratch_bytes("moe", m=m, E=E, k=k, I=I, Is=Is, D=D, fold=fold, fused=fused, tail=fold, stage=False)
    return 0 if n is None else n


def moe_fuses_swiglu() -> bool:
    """Whether the default device's MoE kernel fuses the SwiGLU into gate/up (CUDA: yes, HIP: no)."""
    try:
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    except Exception:  # noqa: BLE001  (no client to ask: count CUDA's layout)
        version = ""
    return "rocm" not in version


def activation_bytes(cfg: Config, dtype, chunk: int) -> int:
    """Estimated peak of one layer's live activations at m = chunk rows.

    XLA's own buffers (fp32 where NUMERICS says): the residual, the largest of the GDN mixer's,
    the attention's and the MoE's operands, and the logits row, with ACTIVATION_MARGIN for XLA's
    temporaries. Beside them the MoE kernel's GPU scratch (moe_scratch_bytes, exact), which the
    kernel takes from the allocator on top of the layer's XLA buffers."""
    m, a, f = chunk, itemsize(dtype), 4
    D = cfg.hidden_size
    nvdv = cfg.lin_v_heads * cfg.lin_v_dim
    residual = 2 * m * D * f  # x and x + y
    gdn = m * (cfg.gdn_in_dim * f + cfg.conv_dim * (a + f) + nvdv * (2 * f + a) + D * f)
    attn = m * (cfg.attn_qkv_dim * f + cfg.num_heads * cfg.head_dim * a + D * f)
    moe_io = m * D * (a + f)  # the normed input (bf16) and the MoE's output (fp32)
    logits = cfg.vocab_size * f
    xla = int(ACTIVATION_MARGIN * (residual + max(gdn, attn, moe_io) + logits))
    return xla + moe_scratch_bytes(cfg, m, moe_fuses_swiglu())


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


def allocator_share_note(platform: str) -> str:
    """On a GPU the device's memory here is what JAX's allocator holds, a share of the card set by
    XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unset): the refusals say so, since raising it is often the
    whole fix (the 35B-A3B's 64.6 GiB of weights do not fit 75% of an 80 GB card)."""
    if platform not in ("gpu", "cuda", "rocm"):
        return ""
    frac = allocator_mem_fraction()
    held = f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac}" if frac else "JAX's default 0.75 (XLA_PYTHON_CLIENT_MEM_FRACTION unset)"
    return f" (the share of the card JAX holds: {held}; a larger fraction gives more)"


def budget_bytes(device_budget_gb: float | None) -> tuple[int | None, str]:
    """(bytes, what it is): 95% of the device's memory, or the explicit budget where smaller."""
    have = device_memory_bytes()
    dev_limit = None if have is None else int(0.95 * have)
    platform = jax.devices()[0].platform
    dev_what = (f"95% of the {platform} device's {have / 2**30:.1f} GiB" + allocator_share_note(platform)) if have else ""
    if device_budget_gb is not None:
        device_budget_gb = budget_gb(device_budget_gb)  # a finite number > 0, or a clear error
        b = int(device_budget_gb * 2**30)
        if dev_limit is None or b <= dev_limit:
            return b, f"the device budget of {device_budget_gb:g} GiB"
    return dev_limit, dev_what or "unknown device memory"


def runtime_reserve_bytes(limit: int) -> int:
    """What a budget of `limit` bytes holds back for the memory the count does not see."""
    return max(RUNTIME_RESERVE_MIN, int(RUNTIME_RESERVE_FRACTION * limit))


def budget_gb_for(need: int) -> float:
    """The smallest device budget (GiB) that holds `need` counted bytes beside its runtime reserve."""
    limit = max(need + RUNTIME_RESERVE_MIN, math.ceil(need / (1 - RUNTIME_RESERVE_FRACTION)))
    return (limit + 1) / 2**30  # + 1: the budget's GiB -> bytes conversion floors


def device_memory_stats() -> dict | None:
    """The default device's allocator counters (bytes in use, peak since the process started,
    limit) where the backend reports them; None where it does not (the CPU backend)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (a backend without memory stats)
        stats = {}
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_free_block_bytes")
    out = {k: int(stats[k]) for k in keys if k in stats}
    return out or None


# --- the checks ---------------------------------------------------------------------
def _refuse_unless_fits(mode: str, parts: list[Part], limit: int | None, what: str, advice: str = ""):
    """MemoryError naming every part with its size when the parts and the runtime reserve exceed limit."""
    if limit is None:
        return
    reserve = runtime_reserve_bytes(limit)
    need = sum(p.bytes for p in parts) + reserve
    if need > limit:
        listed = " + ".join([p.text for p in parts] + [f"runtime reserve {gib(reserve)}"])
        raise MemoryError(f"{mode} needs {gib(need)} of device memory: {listed}, more than {what}{advice}")


def expert_parallel_bytes(cfg: Config, chunk: int, devices: int) -> int:
    """The expert-parallel MoE's extra live buffers at m = chunk (expert_parallel.py), in units of
    the pair outputs [m, k, D]: this device's own in fp32 (4 bytes) and bf16 (2), the bf16 copies
    gathered from every device (2 N) and the selected one in bf16 and fp32 (2 + 4)."""
    return (2 * devices + 12) * chunk * cfg.top_k * cfg.hidden_size


def resident_parts(cfg: Config, dtype, state_len: int = 0, chunk: int = 0, devices: int = 1) -> list[Part]:
    """What resident mode counts (per device); devices > 1: the routed experts split over them."""
    w = param_bytes(cfg, dtype)
    if devices > 1:
        w -= cfg.num_layers * expert_layer_bytes(cfg, dtype) * (devices - 1) // devices
    parts = [Part("weights", w, f"weights {gib(w)}")]
    if state_len:
        st = state_bytes(cfg, dtype, state_len)
        parts.append(Part("state", st, f"KV/state for {state_len} positions {gib(st)}"))
    if chunk:
        act = activation_bytes(cfg, dtype, chunk)
        if devices > 1:
            act += expert_parallel_bytes(cfg, chunk, devices)
        parts.append(Part("activations", act, f"activations at chunk {chunk} {gib(act)}"))
    return parts


def check_resident(cfg: Config, dtype, device_budget_gb: float | None = None, state_len: int = 0,
                   chunk: int = 0, devices: int = 1) -> int:
    """Refuse up front a resident model (and request) that cannot fit; returns the bytes counted
    per device (without the runtime reserve). devices > 1: the routed experts are split over the
    devices (expert parallel)."""
    parts = resident_parts(cfg, dtype, state_len, chunk, devices)
    w = parts[0].bytes
    limit, what = budget_bytes(device_budget_gb)
    if limit is not None and w > limit:
        raise MemoryError(f"the weights need {w / 2**30:.1f} GiB"
                          + (f" per device over {devices} devices" if devices > 1 else "")
                          + f", more than {what}; use a larger device, more devices (--devices), "
                          "or --mode tier (routed experts in host memory)")
    _refuse_unless_fits("resident mode", parts, limit, what, "; use a smaller --chunk or a shorter context")
    return sum(p.bytes for p in parts)


def tier_parts(cfg: Config, dtype, state_len: int, chunk: int = 0, cache_slots: int = 0) -> list[Part]:
    """What tier mode counts on the device: the non-expert weights, two staged expert layers, the
    decode expert cache's pools (cache_slots per layer), the KV/state of a context of `state_len`
    positions and (when chunk > 0) one layer's activations."""
    exp = expert_layer_bytes(cfg, dtype)
    resident = param_bytes(cfg, dtype) - cfg.num_layers * exp
    parts = [Part("non_expert_weights", resident, f"non-expert weights {gib(resident)}"),
             Part("staged_expert_layers", 2 * exp, f"two staged expert layers 2 x {gib(exp)}")]
    if cache_slots:
        pools = cache_bytes(cfg, dtype, cache_slots)
        parts.append(Part("decode_expert_cache", pools,
                          f"decode expert cache {cfg.num_layers} x {cache_slots} slots {gib(pools)}"))
    st = state_bytes(cfg, dtype, state_len)
    parts.append(Part("state", st, f"KV/state for {state_len} positions {gib(st)}"))
    if chunk:
        act = activation_bytes(cfg, dtype, chunk)
        parts.append(Part("activations", act, f"activations at chunk {chunk} {gib(act)}"))
    return parts


def check_tier(cfg: Config, dtype, device_budget_gb: float | None, state_len: int, chunk: int = 0,
               cache_slots: int = 0) -> int:
    """Refuse up front a tier-mode request whose device footprint (tier_parts and the runtime
    reserve) exceeds the budget, or whose host store exceeds the host's RAM; returns the device
    bytes counted (without the runtime reserve)."""
    parts = tier_parts(cfg, dtype, state_len, chunk, cache_slots)
    limit, what = budget_bytes(device_budget_gb)
    _refuse_unless_fits("tier mode", parts, limit, what)
    need = sum(p.bytes for p in parts)
    # the expert store lives in host RAM (on the CPU backend, so does the "device" part)
    experts = cfg.num_layers * expert_layer_bytes(cfg, dtype)
    host = host_memory_bytes()
    on_cpu = jax.devices()[0].platform == "cpu"
    store = experts + (need if on_cpu else 0)
    if host is not None and store > 0.95 * host:
        raise MemoryError(f"tier mode's host store needs {gib(store)} (routed experts {gib(experts)}"
                          f"{' + the CPU device part' if on_cpu else ''}), more than "
                          f"95% of the host's {gib(host)} of RAM")
    return need


def reserved_prefill(cfg: Config) -> tuple[int, int]:
    """(chunk, KV/state positions) of the prefill the decode cache is sized beside: a prompt of
    PREFILL_RESERVE_CHUNK tokens (at most max_context) in one chunk, on the state the engine
    gives it when it goes on to decode (shapes.state_length of one more position)."""
    chunk = min(PREFILL_RESERVE_CHUNK, cfg.max_context)
    return chunk, state_length(chunk + 1, cfg.max_context)


def check_cache_slots(cfg: Config, slots) -> int:
    """cache_slots as asked: 0 (no cache) or top_k..E per layer (one token routes to top_k
    experts, which must all be resident at once)."""
    slots = as_int("cache_slots (--cache-slots, BARO_CACHE_SLOTS)", slots, lo=0)
    if 0 < slots < cfg.top_k:
        raise ValueError(f"cache_slots (--cache-slots, BARO_CACHE_SLOTS) must be 0 (no cache) or at least "
                         f"top_k={cfg.top_k} (one token's experts are resident at once), got {slots}")
    return slots


def tier_cache_slots(cfg: Config, dtype, device_budget_gb: float | None, want: int | None = None) -> tuple[int, str]:
    """(slots per layer, why) of the decode expert cache: `want` (default 64, at most E), fewer
    when the budget leaves less room beside the non-expert weights, two staged layers, the
    reserved prefill (reserved_prefill: its KV/state and activations) and the runtime reserve;
    0 (no cache) below top_k."""
    if want is not None and want < 1:
        return 0, "turned off (0 slots asked)"
    top = min(DEFAULT_CACHE_SLOTS if want is None else want, cfg.num_experts)
    limit, what = budget_bytes(device_budget_gb)
    if limit is None:
        return top, f"{top} slots (device memory unknown)"
    chunk, L = reserved_prefill(cfg)
    base = sum(p.bytes for p in tier_parts(cfg, dtype, L, chunk)) + runtime_reserve_bytes(limit)
    per = cache_bytes(cfg, dtype, 1)
    fit = max(0, (limit - base) // per)
    beside = (f"beside a prefill at chunk {chunk} with KV/state for {L} positions and the runtime reserve "
              f"{gib(runtime_reserve_bytes(limit))}")
    S = min(top, fit)
    if S < cfg.top_k:
        return 0, f"no room for the cache ({fit} slots per layer fit in {what} {beside}; top_k is {cfg.top_k})"
    return S, (f"{S} slots per layer ({gib(cache_bytes(cfg, dtype, S))}), {beside}"
               f"{' (the budget allows no more)' if S < top else ''}")


def largest_fitting_chunk(check, chunk: int) -> int:
    """The largest power-of-two fraction of `chunk` (at least MIN_CHUNK) for which check(c) raises
    no MemoryError; MIN_CHUNK when none passes (the request's own check then refuses it with the
    numbers). Chunks never change the bits, only the time and the memory."""
    c = chunk
    while c > MIN_CHUNK:
        try:
            check(c)
            return c
        except MemoryError:
            c //= 2
    return max(c, 1)


def largest_tier_chunk(cfg: Config, dtype, device_budget_gb: float | None, state_len: int, n_prompt: int,
                       cache_slots: int = 0) -> int:
    """The largest power-of-two chunk (16 .. the prompt's next power of two) whose tier-mode
    footprint fits beside the cache; 16 when none does (check_tier then refuses the request with
    the numbers)."""
    c = MIN_CHUNK
    while c < n_prompt:
        c *= 2
    return largest_fitting_chunk(lambda ch: check_tier(cfg, dtype, device_budget_gb, state_len, ch, cache_slots), c)


def batch_fixed_bytes(cfg: Config, dtype, length: int, chunk: int, want: int, devices: int = 1,
                      tier_cache_slots: int | None = None, page: int = DEFAULT_KV_PAGE) -> int:
    """What batch_slots counts before the pool's slots and pages, without the runtime reserve."""
    T = -(-length // page)
    if tier_cache_slots is None:
        parts = resident_parts(cfg, dtype, 0, max(chunk, want), devices)
    else:  # the pool's slots are its state: tier_parts' one-sequence state is left out
        parts = [p for p in tier_parts(cfg, dtype, 0, max(chunk, want), tier_cache_slots) if p.name != "state"]
    return sum(p.bytes for p in parts) + 2 * want * cfg.vocab_size * 4 + 2 * state_bytes(cfg, dtype, T * page)


def batch_counted_bytes(cfg: Config, dtype, length: int, chunk: int, slots: int, pages: int, devices: int = 1,
                        tier_cache_slots: int | None = None, page: int = DEFAULT_KV_PAGE) -> int:
    """The device bytes the count gives a pool of `slots` slots and `pages` KV pages (batch_slots'
    terms, without the runtime reserve): what a run's measured peak is held against."""
    return (batch_fixed_bytes(cfg, dtype, length, chunk, slots, devices, tier_cache_slots, page)
            + slots * pool_slot_bytes(cfg, dtype) + pages * pool_page_bytes(cfg, dtype, page))


def batch_slots(cfg: Config, dtype, device_budget_gb: float | None, length: int, chunk: int, want: int,
                devices: int = 1, tier_cache_slots: int | None = None,
                page: int = DEFAULT_KV_PAGE, longest: int = 1) -> tuple[int, int]:
    """(slots, pages) of generate_batch's pool: how many of `want` sequence slots, and how many KV
    pages of `page` positions (at most enough for every slot at `length`) fit beside the weights,
    the larger of a prefill chunk's and a decode step's activations, the decode step's logits and
    logprobs rows, and two contiguous one-sequence states of `length` positions (a prefill chunk
    gathers its slot's state out of the pool and scatters it back). A slot costs its linear
    layers' state; its KV costs only the pages its sequence holds, so short sequences leave pages
    for more slots. Slots come first (each with at least one page), then pages. tier_cache_slots:
    tier mode with its decode expert cache of that many slots per layer (0: none), whose weights
    on the device are tier_parts' (None: resident mode). longest: the pages the longest sequence
    needs; slots are cut so that the pages left hold it (fewer slots rather than a pool that
    could never run it)."""
    T = -(-length // page)
    top = want * T
    limit, _ = budget_bytes(device_budget_gb)
    if limit is None:
        return want, top
    per_page, per_slot = pool_page_bytes(cfg, dtype, page), pool_slot_bytes(cfg, dtype)
    fixed = batch_fixed_bytes(cfg, dtype, length, chunk, want, devices, tier_cache_slots, page)
    room = max(0, limit - fixed - runtime_reserve_bytes(limit))
    slots = int(min(want, room // (per_slot + per_page), max(0, room - longest * per_page) // per_slot))
    pages = int(min(top, (room - slots * per_slot) // per_page)) if slots else 0
    return slots, pages
