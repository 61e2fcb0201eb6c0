// baro_attention (GPU), kernel 1: k (normed, rotated) and v rounded to bf16 and stored at
// cache rows pos+i for i < n_valid, before the attention kernel reads the cache (same stream).
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "common.cuh"
#include "launch.h"

namespace baro_gpu {

constexpr int kKvWarps = 4;                   // (row, kv head) items per block in kernel 1

// ---- kernel 1: k/v -> cache rows pos+i (i < n_valid), one warp per (i, kv head) ----
// A decode call is 2 warps of dependent latencies, so every load is issued first, unguarded
// by the row checks (row i < m exists), and the element arithmetic runs on registers:
// norm_rope_vals on the same values, and warp_sumsq's fmaf order (ascending d per lane, then
// the butterfly), so the bytes are the same. With loads inside the checks
// and the per-element branches a call took 5.9 us (7.6 under ncu) for 2 KB of stores.
// One warp's (row, kv head) item (attention_rows.cu runs it on each row's view of its slot).
// kPaged: a.k_cache / a.v_cache are the pages of kv (attn_kv_row; a row whose page is unmapped
// writes nothing); the one-sequence kernel is the kPaged = false instantiation, kv unread.
template <bool kPaged = false>
BARO_DEV void attn_kv_write_item(const AttentionArgs& a, int64_t item, const KvPages& kv = KvPages{}) {
  if (item >= a.m * a.Hkv) return;
  const int64_t i = item / a.Hkv;
  const int kh = static_cast<int>(item % a.Hkv);
  const int32_t nv_raw = *a.n_valid;
  const int32_t pos_raw = *a.pos;
  const int hd = a.hd, R2 = a.R2;
  const int64_t W = static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
  const float* xk = a.qkv + i * W + static_cast<int64_t>(2 * a.H + kh) * hd;
  const float* xv = a.qkv + i * W + static_cast<int64_t>(2 * a.H + a.Hkv + kh) * hd;
  const float* cr = a.cos + i * R2;
  const float* sr = a.sin + i * R2;
  constexpr int kPer = kAttnMaxHeadDim / BARO_WARP;
  const int lane = lane_id();
  // element d = lane + 32 t: its own x and w, its rotate-half partner's (d +- R2), cos/sin
  float xd[kPer], wd[kPer], xp[kPer], wp[kPer], cs[kPer], sn[kPer], vv[kPer];
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + BARO_WARP * t;
    const bool live = d < hd, rot = live && d < 2 * R2;
    const int pd = norm_rope_partner(d, R2);
    const int j = d < R2 ? d : d - R2;
    xd[t] = live ? xk[d] : 0.0f;
    wd[t] = live ? a.k_norm[d] : 0.0f;
    xp[t] = live ? xk[pd] : 0.0f;
    wp[t] = live ? a.k_norm[pd] : 0.0f;
    cs[t] = rot ? cr[j] : 0.0f;
    sn[t] = rot ? sr[j] : 0.0f;
    vv[t] = live ? xv[d] : 0.0f;
  }
  const int64_t nvld = nv_raw < 0 ? 0 : (nv_raw > a.m ? a.m : nv_raw);  // clamp_nvalid
  if (i >= nvld) return;
  const int64_t p = static_cast<int64_t>(pos_raw) + i;
  if (p < 0 || p >= a.S) return;
  float ss = 0.0f;
#pragma unroll
  for (int t = 0; t < kPer; ++t)
    if (lane + BARO_WARP * t < hd) ss = fmaf(xd[t], xd[t], ss);
  const float r = inv_rms(warp_sum(ss), static_cast<float>(hd), a.eps);
  uint16_t* kd;
  uint16_t* vd;
  if constexpr (kPaged) {
    const int64_t row = attn_kv_row(kv, p, static_cast<int64_t>(a.Hkv) * hd);
    if (row < 0) return;
    kd = a.k_cache + row + static_cast<int64_t>(kh) * hd;
    vd = a.v_cache + row + static_cast<int64_t>(kh) * hd;
  } else {
    kd = a.k_cache + (p * a.Hkv + kh) * hd;
    vd = a.v_cache + (p * a.Hkv + kh) * hd;
  }
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + BARO_WARP * t;
    if (d >= hd) continue;
    kd[d] = f32_to_bf16(norm_rope_vals(xd[t], wd[t], xp[t], wp[t], cs[t], sn[t], r, R2, d));
    vd[d] = f32_to_bf16(vv[t]);
  }
}

// static: one copy per translation unit that includes this header (attention.cu, attention_rows.cu).
static __global__ void __launch_bounds__(kKvWarps * BARO_WARP) attn_kv_write_kernel(AttentionArgs a) {
  attn_kv_write_item(a, static_cast<int64_t>(blockIdx.x) * kKvWarps + warp_id());
}

}  // namespace baro_gpu
