// baro_attention (GPU): what the kv-write kernel, the CUDA flash kernels
// (attention_fa.cuh) and the portable HIP kernels (attention_portable.cuh) share: the KV
// block and split that are part of the arithmetic, the q/k norm + rotary element, the
// n_valid clamp and the split merge. attention.cu says why a row's bits do not depend on m.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "launch.h"

namespace baro_gpu {

constexpr int kAttnKB = 64;                   // KV block, aligned to absolute positions
// KV blocks per split. A split is the unit of decode parallelism (one block per kv head and
// split) and its blocks run one after another, so a decode call costs one split's time: at 16
// blocks (1024 positions) that was ~39 us at any context (64 blocks on 132 SMs at 32k). At 8 a
// 32k decode fills the card and each split takes half as long; prefill only merges twice as
// often (a few fmas per register per split). The split is part of the arithmetic: prefill and
// decode share it, so changing it changes every GPU attention bit but never the identity.
constexpr int kAttnSplitBlocks = 8;
constexpr int64_t kAttnSplit = kAttnKB * kAttnSplitBlocks;  // 512 positions

// Element d of the head-RMSNormed (fp32, (x*r)*(1+w)) and rotated vector, from its own x and
// w (xd, wd), its rotate-half partner's (xp, wp: element d + R2 for d < R2, d - R2 for
// d < 2 R2) and the pair's cos / sin (c, s at j = d mod R2); computed as written (no fusion).
BARO_DEV float norm_rope_vals(float xd, float wd, float xp, float wp, float c, float s, float r, int R2, int d) {
  const float own = (xd * r) * (1.0f + wd);
  if (d >= 2 * R2) return own;
  const float partner = (xp * r) * (1.0f + wp);
  return d < R2 ? own * c - partner * s : own * c + partner * s;
}
// The same from the head's rows in memory.
BARO_DEV int norm_rope_partner(int d, int R2) { return d < R2 ? d + R2 : (d < 2 * R2 ? d - R2 : d); }
BARO_DEV float norm_rope_elem(const float* __restrict__ x, const float* __restrict__ w, float r,
                              const float* __restrict__ c, const float* __restrict__ s, int R2,
                              int d) {
  const int pd = norm_rope_partner(d, R2), j = d < R2 ? d : d - R2;
  const bool rot = d < 2 * R2;
  return norm_rope_vals(x[d], w[d], x[pd], w[pd], rot ? c[j] : 0.0f, rot ? s[j] : 0.0f, r, R2, d);
}

// Element offset of a paged cache's position j's row (its kv head 0), row = Hkv * hd elements a
// position: its page's row, -1 when the page is unmapped or past num_pages (never read or
// written; a read gives zeros). A page holds whole 64-position blocks, so a block's rows are
// `row` elements apart from its first row's offset, as in a contiguous cache.
BARO_DEV int64_t attn_kv_row(const KvPages& kv, int64_t j, int64_t row) {
  const int32_t pg = kv.table[j / kv.page];
  if (pg < 0 || pg >= kv.num_pages) return -1;
  return (static_cast<int64_t>(pg) * kv.page + j % kv.page) * row;
}

BARO_DEV int64_t clamp_nvalid(const int32_t* p, int64_t m) {
  int64_t v = *p;
  return v < 0 ? 0 : (v > m ? m : v);
}

// (M, L, O) <- merge with a split's (ms, ls, Os): identical in both modes.
BARO_DEV void attn_merge_scale(float M, float ms, float& Mn, float& ea, float& eb) {
  Mn = fmaxf(M, ms);
  ea = expf(M - Mn);  // 0 when M = -inf (nothing merged yet)
  eb = expf(ms - Mn);
}

}  // namespace baro_gpu
