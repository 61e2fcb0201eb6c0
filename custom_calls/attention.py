"""baro_attention: q/k head norm, partial rotary, KV-cache write, causal
online-softmax attention over 64-blocks aligned to absolute positions, gate."""

from __future__ import annotations

import jax

from . import _check as C
from ._lib import check_gpu_limits, check_runnable, ffi_call_small, small_call
from .scratch import scratch_bytes

OP = "baro_attention"
OP_SMALL = "baro_attention_small"


def small_scratch_bytes(m: int, S: int, H: int, Hkv: int, hd: int) -> int:
    """An upper bound of the GPU split partials of one call of m <= 16 rows: the larger of the
    CUDA and HIP layouts (csrc/common/scratch_layout.h, through the CPU library). The handler
    checks it is enough."""
    return max(scratch_bytes("attention", m=m, S=S, H=H, Hkv=Hkv, hd=hd, hip=hip) for hip in (False, True))


def attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid, eps=1e-6):
    """Gated causal attention for m rows at absolute positions pos .. pos+m-1.

    qkv[m, (2H+2Hkv)*hd] f32 (per q head [query hd | gate hd], then k, then v),
    q_norm[hd] f32, k_norm[hd] f32 (zero-centred weights), cos/sin[m, R/2] f32,
    k_cache/v_cache[S, Hkv, hd] bf16, pos/n_valid int32 scalars, eps (static).
    Returns (o[m, H*hd] bf16, k_cache, v_cache); the caches are updated in place
    (rows pos .. pos+n_valid-1). Needs pos + n_valid <= S (checked at run time
    on CPU).
    """
    C.rank(OP, "qkv", qkv, 2)
    m, W = qkv.shape
    C.array(OP, "qkv", qkv, (m, W), C.F32)
    C.rank(OP, "q_norm", q_norm, 1)
    hd = q_norm.shape[0]
    if hd < 1:
        raise ValueError(f"{OP}: q_norm must be non-empty (its length is head_dim)")
    C.array(OP, "q_norm", q_norm, (hd,), C.F32)
    C.array(OP, "k_norm", k_norm, (hd,), C.F32)
    C.rank(OP, "k_cache", k_cache, 3)
    S, Hkv = k_cache.shape[0], k_cache.shape[1]
    C.array(OP, "k_cache", k_cache, (S, Hkv, hd), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(OP, "v_cache", v_cache, (S, Hkv, hd), C.BF16, dtype_note=C.BF16_NOTE)
    if Hkv < 1 or W % hd or W // hd <= 2 * Hkv or (W // hd - 2 * Hkv) % 2:
        raise ValueError(f"{OP}: qkv must have shape [m, (2*H + 2*Hkv)*hd] with hd={hd}, "
                         f"Hkv={Hkv} (from q_norm, k_cache), got shape {list(qkv.shape)}")
    H = (W // hd - 2 * Hkv) // 2
    if H % Hkv:
        raise ValueError(f"{OP}: number of q heads H={H} (from qkv width {W}) must be a "
                         f"multiple of Hkv={Hkv}")
    C.rank(OP, "cos", cos, 2)
    R2 = cos.shape[1]
    C.array(OP, "cos", cos, (m, R2), C.F32)
    C.array(OP, "sin", sin, (m, R2), C.F32)
    if 2 * R2 > hd:
        raise ValueError(f"{OP}: cos/sin must have shape [m, R/2] with R <= hd={hd}, "
                         f"got shape {list(cos.shape)}")
    pos = C.int_scalar(OP, "pos", pos)
    n_valid = C.int_scalar(OP, "n_valid", n_valid)
    p, n = C.concrete_int(pos), C.concrete_int(n_valid)  # known here: what the CPU handler checks at run time
    if p is not None and p < 0:
        raise ValueError(f"{OP}: pos must be >= 0, got {p}")
    if n is not None and not 0 <= n <= m:
        raise ValueError(f"{OP}: n_valid must be in [0, m={m}], got {n}")
    if p is not None and n is not None and p + n > S:
        raise ValueError(f"{OP}: pos + n_valid = {p} + {n} exceeds the cache length S={S}")
    eps = C.f32_attr(OP, "eps", eps)
    args = (qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid)
    check_gpu_limits(OP, args, [(hd % 16 == 0 and hd <= 256, f"head_dim={hd} (a multiple of 16, at most 256)"),
                                (H <= 65535, f"H={H} q heads (at most 65535)"),
                                (S < 2 ** 31, f"a cache of {S} rows (fewer than 2^31)")])
    cache_t = jax.ShapeDtypeStruct((S, Hkv, hd), C.BF16)
    outs = (jax.ShapeDtypeStruct((m, H * hd), C.BF16), cache_t, cache_t)
    if small_call(m):  # decode: the split partials as a result, so the GPU handler allocates nothing
        check_runnable(OP_SMALL, args)
        return ffi_call_small(OP_SMALL, outs, small_scratch_bytes(m, S, H, Hkv, hd), args, {5: 1, 6: 2}, eps=eps)
    check_runnable(OP, args)
    return tuple(jax.ffi.ffi_call(OP, outs, input_output_aliases={5: 1, 6: 2})(*args, eps=eps))
