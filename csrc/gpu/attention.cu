// baro_attention (GPU): q/k head RMSNorm, partial rotary, KV-cache write,
// causal online-softmax attention over KV blocks of 64 aligned to absolute
// positions, output gate. Launches on one stream:
//   1. attn_kv_write_kernel: k (normed, rotated) and v rounded to bf16 and
//      stored at cache rows pos+i for i < n_valid;
//   2. the attention kernel. KV positions are cut into splits of 512 (8
//      blocks of 64, aligned to absolute positions); each split is an online
//      softmax over its blocks in order, and a row's result is the in-order
//      merge of its splits (see below). CUDA: attn_fa_kernel
//      (attention_fa.cuh), GQA-aware: a tile's rows are (token, q head of one
//      kv group) pairs, so the G q heads of a kv head share every K/V tile;
//      64-row tiles (prefill) or 16-row tiles (decode). HIP: attn_kernel
//      below, one block = 16 query rows of one q head;
//   3. (m <= 16 only) the combine kernel: the in-order merge of the splits,
//      which kernel 2 then computed in parallel (decode of a long context).
//
// Why a row gets the same bits whatever m is (decode m = 1 vs prefill m = C):
// - its q is computed by the same per-(row, head) warp code;
// - S = QK^T and O += PV use dot.cuh's MMA (row- and tile-invariant), K and
//   V read from the cache (so decode and prefill read the same bf16 values);
// - the block max and sum of a row use a fixed order that depends on the
//   column only (HIP: lane order + butterfly; CUDA: attention_fa.cuh);
// - columns past the row's own position are masked to -inf (p = 0);
// - a KV block (or a whole split) that lies wholly past a row's position
//   (possible when other rows of the tile are later) is skipped for that row
//   by a select, so the row sees exactly the blocks 0 .. pos_i/64 and the
//   splits 0 .. pos_i/512, as in decode;
// - the split boundaries are absolute, and both modes run the same split code
//   and the same merge arithmetic (attn_merge_scale, then L*ea + l*eb,
//   O*ea + o*eb, in split order).
// KV rows past min(last row of the tile, pos + n_valid - 1) are never read
// (zero-filled in shared memory), so unwritten cache rows (maybe NaN) cannot
// leak in through 0 * NaN.
#include <cmath>
#include <cstdint>
#include <string>

#include "contract.h"
#include "common.cuh"
#include "dot.cuh"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {

constexpr int kAttnKB = 64;                   // KV block, aligned to absolute positions
constexpr int kKvWarps = 4;                   // (row, kv head) items per block in kernel 1
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

BARO_DEV int64_t clamp_nvalid(const int32_t* p, int64_t m) {
  int64_t v = *p;
  return v < 0 ? 0 : (v > m ? m : v);
}

// ---- kernel 1: k/v -> cache rows pos+i (i < n_valid), one warp per (i, kv head) ----
// A decode call is 2 warps of dependent latencies, so every load is issued first, unguarded
// by the row checks (row i < m exists), and the element arithmetic runs on registers:
// norm_rope_vals on the same values, and warp_sumsq's fmaf order (ascending d per lane, then
// the butterfly), so the bytes are the same. With loads inside the checks
// and the per-element branches a call took 5.9 us (7.6 under ncu) for 2 KB of stores.
__global__ void __launch_bounds__(kKvWarps * BARO_WARP) attn_kv_write_kernel(AttentionArgs a) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kKvWarps + warp_id();
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
  uint16_t* kd = a.k_cache + (p * a.Hkv + kh) * hd;
  uint16_t* vd = a.v_cache + (p * a.Hkv + kh) * hd;
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + BARO_WARP * t;
    if (d >= hd) continue;
    kd[d] = f32_to_bf16(norm_rope_vals(xd[t], wd[t], xp[t], wp[t], cs[t], sn[t], r, R2, d));
    vd[d] = f32_to_bf16(vv[t]);
  }
}

// (M, L, O) <- merge with a split's (ms, ls, Os): identical in both modes.
BARO_DEV void attn_merge_scale(float M, float ms, float& Mn, float& ea, float& eb) {
  Mn = fmaxf(M, ms);
  ea = expf(M - Mn);  // 0 when M = -inf (nothing merged yet)
  eb = expf(ms - Mn);
}

}  // namespace baro_gpu

#if !BARO_HIP
#include "attention_fa.cuh"  // kernels 2 and 3 on NVIDIA
#endif

namespace baro_gpu {

#if BARO_HIP
// ---- HIP: the portable kernels (one q head per 16-row tile, no tensor cores) ----
constexpr int kAttnRows = 16;                 // query rows per block (one MMA row tile)
constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * BARO_WARP;
constexpr int kAttnSld = kAttnKB + 2;         // fp32 score row stride (floats)
constexpr int kAttnPld = kAttnKB + 8;         // bf16 probability row stride (elements)
constexpr int kAttnMaxNt = kAttnMaxHeadDim / 8 / kAttnWarps;  // PV n-tiles per warp
static_assert(kAttnKB == 8 * 2 * kAttnWarps, "S tile: two 8-column n-tiles per warp");

// Shared-memory layout of attn_kernel (bytes), all pieces 16-byte aligned.
struct AttnSmem {
  int ld;  // bf16 row stride of Q / KV tiles = hd + 8
  size_t q, kv, s, p, stats, total;
};
__host__ __device__ inline AttnSmem attn_smem(int hd) {
  AttnSmem l;
  l.ld = hd + 8;
  l.q = 0;
  l.kv = l.q + sizeof(uint16_t) * kAttnRows * l.ld;
  l.s = l.kv + sizeof(uint16_t) * kAttnKB * l.ld;
  l.p = l.s + sizeof(float) * kAttnRows * kAttnSld;
  l.stats = l.p + sizeof(uint16_t) * kAttnRows * kAttnPld;
  l.total = l.stats + 5 * sizeof(float) * kAttnRows;
  return l;
}

// rows j0..j0+63 of one kv head -> dst[64][ld]; rows > lim are zero.
BARO_DEV void attn_load_kv(uint16_t* __restrict__ dst, const uint16_t* __restrict__ base,
                           int64_t row_stride, int64_t j0, int64_t lim, int hd, int ld) {
  const int chunks = hd / 8;  // 16-byte chunks per row (hd % 16 == 0, host-checked)
  for (int c = threadIdx.x; c < kAttnKB * chunks; c += kAttnThreads) {
    const int r = c / chunks;
    const int kc = (c % chunks) * 8;
    const int64_t j = j0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (j <= lim) v = *reinterpret_cast<const uint4*>(base + j * row_stride + kc);
    *reinterpret_cast<uint4*>(dst + r * ld + kc) = v;
  }
}

// ---- kernel 2: attention ----
// The KV positions are cut into splits of kAttnSplit = 512 positions
// (8 blocks of 64), aligned to absolute positions. A row's result is, by
// definition, the in-order merge (attn_merge) over its splits s = 0 .. pos_i/512
// of the split's own online softmax (m_s, l_s, O_s) started fresh. Two modes
// compute exactly that:
//  - serial (part_o == nullptr): grid (ceil(m/16), H, 1); a block walks its
//    splits in order and merges them in registers (prefill);
//  - parallel (m <= 16): grid (1, H, max_splits); block z computes split z
//    and writes (m_s, l_s, O_s) to scratch; attn_combine_kernel then merges
//    them in order with the same attn_merge arithmetic (decode: the splits of a
//    long context run on many SMs).
// Both run the same split code and the same merge, so a row's bits do not
// depend on the mode, on m, or on the other rows.

__global__ void __launch_bounds__(kAttnThreads)
    attn_kernel(AttentionArgs a, float* __restrict__ part_o, float* __restrict__ part_ml,
                int max_splits) {
  extern __shared__ uint4 attn_smem4[];
  char* smem = reinterpret_cast<char*>(attn_smem4);
  const int hd = a.hd;
  const AttnSmem L = attn_smem(hd);
  const int ld = L.ld;
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + L.q);
  uint16_t* KVs = reinterpret_cast<uint16_t*>(smem + L.kv);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  uint16_t* Ps = reinterpret_cast<uint16_t*>(smem + L.p);
  float* row_m = reinterpret_cast<float*>(smem + L.stats);
  float* row_l = row_m + kAttnRows;
  float* row_alpha = row_l + kAttnRows;
  int* row_lim = reinterpret_cast<int*>(row_alpha + kAttnRows);
  int* row_act = row_lim + kAttnRows;

  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id();
  const bool parallel = part_o != nullptr;
  const int64_t m = a.m;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kAttnRows;
  if (i0 >= m) return;
  const int h = blockIdx.y;
  const int kh = h / (a.H / a.Hkv);
  const int64_t W = static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
  const int64_t pos = *a.pos;
  const int64_t nvld = clamp_nvalid(a.n_valid, m);
  const int rc = static_cast<int>(m - i0 < kAttnRows ? m - i0 : kAttnRows);

  int64_t tile_lim = pos + i0 + rc - 1;  // last row's position
  if (tile_lim > a.S - 1) tile_lim = a.S - 1;
  int64_t load_lim = pos + nvld - 1;  // last cache row written so far
  if (load_lim > tile_lim) load_lim = tile_lim;
  const int64_t n_blocks = tile_lim < 0 ? 0 : tile_lim / kAttnKB + 1;
  const int64_t n_splits = (n_blocks + kAttnSplitBlocks - 1) / kAttnSplitBlocks;
  int64_t s_begin = 0, s_end = n_splits;
  if (parallel) {
    s_begin = blockIdx.z;
    s_end = s_begin + 1;
    if (s_begin >= n_splits) return;  // uniform for the block, before any barrier
  }

  // 1. Q tile (bf16) and per-row limits.
  for (int r = warp; r < kAttnRows; r += kAttnWarps) {
    uint16_t* qrow = Qs + r * ld;
    if (r < rc) {
      const int64_t i = i0 + r;
      const float* xq = a.qkv + i * W + static_cast<int64_t>(h) * 2 * hd;
      const float rr = inv_rms(warp_sumsq(xq, hd), static_cast<float>(hd), a.eps);
      const float* cr = a.cos + i * a.R2;
      const float* sr = a.sin + i * a.R2;
      for (int d = lane; d < hd; d += BARO_WARP)
        qrow[d] = f32_to_bf16(norm_rope_elem(xq, a.q_norm, rr, cr, sr, a.R2, d));
    } else {
      for (int d = lane; d < hd; d += BARO_WARP) qrow[d] = 0;
    }
  }
  if (tid < kAttnRows) {
    int64_t lim = -1;  // padding rows of the tile: never active
    if (tid < rc) {
      lim = pos + i0 + tid;
      if (lim > a.S - 1) lim = a.S - 1;
      if (lim < -1) lim = -1;
    }
    row_lim[tid] = static_cast<int>(lim);
  }

  const int64_t row_stride = static_cast<int64_t>(a.Hkv) * hd;
  const uint16_t* kbase = a.k_cache + static_cast<int64_t>(kh) * hd;
  const uint16_t* vbase = a.v_cache + static_cast<int64_t>(kh) * hd;
  const int n_nt = hd / 8;
  const int g = lane >> 2;

  // running merge (serial mode) for this lane's rows g and g+8
  float Mrun[2] = {-INFINITY, -INFINITY}, Lrun[2] = {0.0f, 0.0f};
  float O[kAttnMaxNt][4];
#pragma unroll
  for (int q = 0; q < kAttnMaxNt; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) O[q][i] = 0.0f;

  for (int64_t sp = s_begin; sp < s_end; ++sp) {
    // ---- one split: fresh online softmax over its KV blocks ----
    float o[kAttnMaxNt][4];
#pragma unroll
    for (int q = 0; q < kAttnMaxNt; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[q][i] = 0.0f;
    if (tid < kAttnRows) {
      row_m[tid] = -INFINITY;
      row_l[tid] = 0.0f;
      row_alpha[tid] = 1.0f;
      row_act[tid] = 0;
    }
    __syncthreads();
    const int64_t b_end = (sp + 1) * kAttnSplitBlocks < n_blocks ? (sp + 1) * kAttnSplitBlocks : n_blocks;
    for (int64_t b = sp * kAttnSplitBlocks; b < b_end; ++b) {
      const int64_t j0 = b * kAttnKB;
      // a. K block
      attn_load_kv(KVs, kbase, row_stride, j0, load_lim, hd, ld);
      __syncthreads();
      // b. scores for columns [16*warp, 16*warp+16): scaled, masked past each row's position
      {
        float sacc[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int i = 0; i < 4; ++i) sacc[u][i] = 0.0f;
        for (int k0 = 0; k0 < hd; k0 += 16) {
          FragA fa;
          load_a(fa, Qs + k0, ld);
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            FragB fb;
            load_b_nk(fb, KVs + ((2 * warp + u) * 8) * ld + k0, ld);
            mma_16816(sacc[u], fa, fb);
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = frag_row(i);
            const int c = (2 * warp + u) * 8 + frag_col(i);
            const float s = sacc[u][i] * a.scale;
            Ss[r * kAttnSld + c] = (j0 + c <= row_lim[r]) ? s : -INFINITY;
          }
      }
      __syncthreads();
      // c. V block into the same buffer; meanwhile the online softmax per row
      attn_load_kv(KVs, vbase, row_stride, j0, load_lim, hd, ld);
      for (int r = warp; r < kAttnRows; r += kAttnWarps) {
        const float s0 = Ss[r * kAttnSld + lane];
        const float s1 = Ss[r * kAttnSld + lane + 32];
        const float m_old = row_m[r];
        const bool active = j0 <= static_cast<int64_t>(row_lim[r]);
        const float bmax = warp_max(fmaxf(s0, s1));
        float p0 = 0.0f, p1 = 0.0f, alpha = 1.0f, m_new = m_old;
        if (active) {
          m_new = fmaxf(m_old, bmax);
          alpha = expf(m_old - m_new);  // 0 on the split's first block (m_old = -inf)
          p0 = expf(s0 - m_new);
          p1 = expf(s1 - m_new);
        }
        const float lb = warp_sum(p0 + p1);
        Ps[r * kAttnPld + lane] = f32_to_bf16(p0);
        Ps[r * kAttnPld + lane + 32] = f32_to_bf16(p1);
        warp_sync();
        if (lane == 0) {
          if (active) {
            row_l[r] = row_l[r] * alpha + lb;
            row_m[r] = m_new;
          }
          row_alpha[r] = alpha;
          row_act[r] = active ? 1 : 0;
        }
      }
      __syncthreads();
      // d. o = o * alpha + P V for this warp's n-tiles (nt = warp + 4q); rows
      //    whose block is inactive keep o unchanged.
      {
        FragA pa[kAttnKB / 16];
#pragma unroll
        for (int kk = 0; kk < kAttnKB / 16; ++kk) load_a(pa[kk], Ps + kk * 16, kAttnPld);
        const float al0 = row_alpha[g], al1 = row_alpha[g + 8];
        const bool ac0 = row_act[g] != 0, ac1 = row_act[g + 8] != 0;
#pragma unroll
        for (int q = 0; q < kAttnMaxNt; ++q) {
          const int nt = warp + kAttnWarps * q;
          if (nt < n_nt) {
            float c[4] = {o[q][0] * al0, o[q][1] * al0, o[q][2] * al1, o[q][3] * al1};
#pragma unroll
            for (int kk = 0; kk < kAttnKB / 16; ++kk) {
              FragB fb;
              load_b_kn(fb, KVs + (kk * 16) * ld + nt * 8, ld);
              mma_16816(c, pa[kk], fb);
            }
            if (ac0) {
              o[q][0] = c[0];
              o[q][1] = c[1];
            }
            if (ac1) {
              o[q][2] = c[2];
              o[q][3] = c[3];
            }
          }
        }
      }
      __syncthreads();
    }
    // ---- split done: row_m / row_l final (written before the last barrier) ----
    if (parallel) {
      const int64_t base = (static_cast<int64_t>(h) * max_splits + sp) * kAttnRows;
#pragma unroll
      for (int q = 0; q < kAttnMaxNt; ++q) {
        const int nt = warp + kAttnWarps * q;
        if (nt < n_nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            part_o[(base + frag_row(i)) * hd + nt * 8 + frag_col(i)] = o[q][i];
        }
      }
      if (tid < kAttnRows) {
        part_ml[(base + tid) * 2 + 0] = row_m[tid];
        part_ml[(base + tid) * 2 + 1] = row_l[tid];
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        if (sp * kAttnSplit <= static_cast<int64_t>(row_lim[r])) {  // split active for row r
          float Mn, ea, eb;
          attn_merge_scale(Mrun[half], row_m[r], Mn, ea, eb);
          Lrun[half] = Lrun[half] * ea + row_l[r] * eb;
#pragma unroll
          for (int q = 0; q < kAttnMaxNt; ++q) {
            O[q][2 * half + 0] = O[q][2 * half + 0] * ea + o[q][2 * half + 0] * eb;
            O[q][2 * half + 1] = O[q][2 * half + 1] * ea + o[q][2 * half + 1] * eb;
          }
          Mrun[half] = Mn;
        }
      }
    }
    __syncthreads();  // row_m / row_l read before the next split resets them
  }
  if (parallel) return;

  // 2. epilogue (serial): o = bf16((O / L) * sigmoid(gate)); rows >= n_valid -> 0.
  const int64_t out_ld = static_cast<int64_t>(a.H) * hd;
#pragma unroll
  for (int q = 0; q < kAttnMaxNt; ++q) {
    const int nt = warp + kAttnWarps * q;
    if (nt < n_nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = frag_row(i);
        if (r < rc) {
          const int64_t row = i0 + r;
          const int d = nt * 8 + frag_col(i);
          uint16_t v = 0;
          if (row < nvld) {
            const float gate = a.qkv[row * W + static_cast<int64_t>(h) * 2 * hd + hd + d];
            v = f32_to_bf16((O[q][i] / Lrun[i >> 1]) * sigmoidf_(gate));
          }
          a.out[row * out_ld + static_cast<int64_t>(h) * hd + d] = v;
        }
      }
    }
  }
}

// ---- kernel 3 (parallel mode): merge the splits in order, gate, write ----
// One warp per (row i < m <= 16, q head h); lane handles d = lane + 32t.
constexpr int kCombineWarps = 4;
constexpr int kCombineMaxPerLane = kAttnMaxHeadDim / BARO_WARP;

__global__ void __launch_bounds__(kCombineWarps * BARO_WARP)
    attn_combine_kernel(AttentionArgs a, const float* __restrict__ part_o,
                        const float* __restrict__ part_ml, int max_splits) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kCombineWarps + warp_id();
  if (item >= a.m * a.H) return;
  const int64_t i = item / a.H;  // row = tile row (m <= 16)
  const int h = static_cast<int>(item % a.H);
  const int hd = a.hd, lane = lane_id();
  const int64_t out_ld = static_cast<int64_t>(a.H) * hd;
  uint16_t* orow = a.out + i * out_ld + static_cast<int64_t>(h) * hd;
  const int64_t nvld = clamp_nvalid(a.n_valid, a.m);
  if (i >= nvld) {
    for (int d = lane; d < hd; d += BARO_WARP) orow[d] = 0;
    return;
  }
  int64_t lim = static_cast<int64_t>(*a.pos) + i;  // same row limit as attn_kernel
  if (lim > a.S - 1) lim = a.S - 1;
  const int64_t n_act = lim < 0 ? 0 : lim / kAttnSplit + 1;  // splits active for this row
  float M = -INFINITY, Lsum = 0.0f;
  float O[kCombineMaxPerLane];
#pragma unroll
  for (int t = 0; t < kCombineMaxPerLane; ++t) O[t] = 0.0f;
  for (int64_t sp = 0; sp < n_act && sp < max_splits; ++sp) {
    const int64_t base = (static_cast<int64_t>(h) * max_splits + sp) * kAttnRows + i;
    const float ms = part_ml[base * 2 + 0];
    const float ls = part_ml[base * 2 + 1];
    float Mn, ea, eb;
    attn_merge_scale(M, ms, Mn, ea, eb);
    Lsum = Lsum * ea + ls * eb;
#pragma unroll
    for (int t = 0; t < kCombineMaxPerLane; ++t) {
      const int d = lane + BARO_WARP * t;
      if (d < hd) O[t] = O[t] * ea + part_o[base * hd + d] * eb;
    }
    M = Mn;
  }
  const float* xr = a.qkv + i * static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
#pragma unroll
  for (int t = 0; t < kCombineMaxPerLane; ++t) {
    const int d = lane + BARO_WARP * t;
    if (d < hd) {
      const float gate = xr[static_cast<int64_t>(h) * 2 * hd + hd + d];
      orow[d] = f32_to_bf16((O[t] / Lsum) * sigmoidf_(gate));
    }
  }
}

#endif  // BARO_HIP

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

const char* attention_unsupported(const AttentionArgs& a) {
  if (a.hd <= 0 || a.hd % 16 != 0 || a.hd > kAttnMaxHeadDim)
    return "the GPU kernel needs head_dim to be a multiple of 16 and <= 256";
  if (a.Hkv <= 0 || a.H <= 0 || a.H % a.Hkv != 0) return "H must be a positive multiple of Hkv";
  if (a.R2 < 0 || 2 * a.R2 > a.hd) return "rotary dims exceed head_dim";
  if (!aligned16(a.k_cache) || !aligned16(a.v_cache))
    return "k_cache / v_cache must be 16-byte aligned";
  if (a.H > 65535) return "too many q heads for the GPU grid";
  return "";
}

#if BARO_HIP
static int64_t attn_max_splits(const AttentionArgs& a) { return (a.S + kAttnSplit - 1) / kAttnSplit; }
#endif

size_t attention_scratch_bytes(const AttentionArgs& a) {
#if !BARO_HIP
  return fa_scratch_bytes(a);
#else
  if (a.m <= 0 || a.m > kAttnRows) return 0;  // serial mode needs no scratch
  const int64_t slots = static_cast<int64_t>(a.H) * attn_max_splits(a) * kAttnRows;
  const size_t o_bytes = ((sizeof(float) * slots * a.hd + 255) / 256) * 256;
  return o_bytes + sizeof(float) * slots * 2;
#endif
}

gpuError_t launch_attention(const AttentionArgs& a, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.m <= 0) return gpuSuccess;
  const char* why = attention_unsupported(a);
  if (why[0] != '\0') return gpuErrorInvalidValue;
  // 1. cache writes (before any block of kernel 2 reads the cache: same stream)
  const int64_t items = a.m * a.Hkv;
  const int64_t blocks1 = (items + kKvWarps - 1) / kKvWarps;
  if (blocks1 > 0x7fffffffLL) return gpuErrorInvalidValue;
  attn_kv_write_kernel<<<static_cast<unsigned>(blocks1), kKvWarps * BARO_WARP, 0, stream>>>(a);
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) return e;
#if !BARO_HIP
  // 2. (and 3.) GQA flash attention, attention_fa.cuh
  return fa_launch(a, scratch, stream);
#else
  const bool parallel = a.m <= kAttnRows;
  if (parallel && scratch == nullptr) return gpuErrorInvalidValue;
  const int64_t max_splits = attn_max_splits(a);
  const int64_t blocks2 = (a.m + kAttnRows - 1) / kAttnRows;
  const int64_t blocks3 = (a.m * a.H + kCombineWarps - 1) / kCombineWarps;
  if (blocks2 > 0x7fffffffLL || max_splits > 65535) return gpuErrorInvalidValue;
  // 2. attention
  const size_t smem = attn_smem(a.hd).total;  // <= 49088 B for hd <= 256
  if (!parallel) {
    dim3 grid(static_cast<unsigned>(blocks2), static_cast<unsigned>(a.H), 1u);
    attn_kernel<<<grid, kAttnThreads, smem, stream>>>(a, nullptr, nullptr, 0);
    return gpuGetLastError();
  }
  const int64_t slots = static_cast<int64_t>(a.H) * max_splits * kAttnRows;
  float* part_o = static_cast<float*>(scratch);
  float* part_ml = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                            ((sizeof(float) * slots * a.hd + 255) / 256) * 256);
  dim3 grid(1u, static_cast<unsigned>(a.H), static_cast<unsigned>(max_splits));
  attn_kernel<<<grid, kAttnThreads, smem, stream>>>(a, part_o, part_ml, static_cast<int>(max_splits));
  e = gpuGetLastError();
  if (e != gpuSuccess) return e;
  // 3. merge the splits of each row in order
  attn_combine_kernel<<<static_cast<unsigned>(blocks3), kCombineWarps * BARO_WARP, 0, stream>>>(
      a, part_o, part_ml, static_cast<int>(max_splits));
  return gpuGetLastError();
#endif
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/attrs/results as BaroAttentionCpu, see BUILD.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

// given == nullptr: the split partials come from XLA's scratch allocator (baro_attention);
// else from the caller's result buffer, checked to be large enough (baro_attention_small,
// which allocates nothing and so may run inside a command buffer).
ffi::Error attention_common(const char* op, gpuStream_t stream, ffi::ScratchAllocator* scratch,
                            ffi::Result<ffi::Buffer<ffi::U8>>* given, ffi::Buffer<ffi::F32> qkv,
                            ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm,
                            ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                            ffi::Buffer<ffi::BF16> k_cache, ffi::Buffer<ffi::BF16> v_cache,
                            ffi::Buffer<ffi::S32> pos_buf, ffi::Buffer<ffi::S32> n_valid_buf,
                            float eps, ffi::ResultBuffer<ffi::BF16> o,
                            ffi::ResultBuffer<ffi::BF16> k_out,
                            ffi::ResultBuffer<ffi::BF16> v_out) {
  baro::AttentionDims dims;
  if (auto err = baro::check_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos_buf, n_valid_buf,
                                       *o, *k_out, *v_out, dims);
      err.failure())
    return err;
  const int64_t m = dims.m, hd = dims.hd, S = dims.S, Hkv = dims.Hkv, H = dims.H, R2 = dims.R2;
  BARO_CHECK(S < (int64_t{1} << 31) && H <= 65535, op,
             "cache length " << S << " or q heads " << H << " too large for the GPU kernel");

  baro_gpu::AttentionArgs a;
  a.qkv = qkv.typed_data();
  a.q_norm = q_norm.typed_data();
  a.k_norm = k_norm.typed_data();
  a.cos = cos.typed_data();
  a.sin = sin.typed_data();
  a.k_cache = k_out->typed_data();
  a.v_cache = v_out->typed_data();
  a.pos = pos_buf.typed_data();
  a.n_valid = n_valid_buf.typed_data();
  a.out = o->typed_data();
  a.m = m;
  a.S = S;
  a.H = static_cast<int>(H);
  a.Hkv = static_cast<int>(Hkv);
  a.hd = static_cast<int>(hd);
  a.R2 = static_cast<int>(R2);
  a.eps = eps;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const char* why = baro_gpu::attention_unsupported(a);
  BARO_CHECK(why[0] == '\0', op, why << " (head_dim=" << hd << ", H=" << H << ", Hkv=" << Hkv << ")");

  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::copy_if_not_aliased_async(k_cache, k_out, stream));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::copy_if_not_aliased_async(v_cache, v_out, stream));
  void* scratch_mem = nullptr;
  if (auto err = baro_gpu::take_scratch(op, baro_gpu::ScratchSource{scratch, given},
                                        baro_gpu::attention_scratch_bytes(a), &scratch_mem);
      err.failure())
    return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_attention(a, scratch_mem, stream));
  return ffi::Error::Success();
}

ffi::Error AttentionGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::F32> qkv,
                            ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos,
                            ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::BF16> k_cache,
                            ffi::Buffer<ffi::BF16> v_cache, ffi::Buffer<ffi::S32> pos_buf,
                            ffi::Buffer<ffi::S32> n_valid_buf, float eps, ffi::ResultBuffer<ffi::BF16> o,
                            ffi::ResultBuffer<ffi::BF16> k_out, ffi::ResultBuffer<ffi::BF16> v_out) {
  return attention_common("baro_attention", stream, &scratch, nullptr, qkv, q_norm, k_norm, cos, sin, k_cache,
                          v_cache, pos_buf, n_valid_buf, eps, o, k_out, v_out);
}

ffi::Error AttentionSmallGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> q_norm,
                                 ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                                 ffi::Buffer<ffi::BF16> k_cache, ffi::Buffer<ffi::BF16> v_cache,
                                 ffi::Buffer<ffi::S32> pos_buf, ffi::Buffer<ffi::S32> n_valid_buf, float eps,
                                 ffi::ResultBuffer<ffi::BF16> o, ffi::ResultBuffer<ffi::BF16> k_out,
                                 ffi::ResultBuffer<ffi::BF16> v_out, ffi::ResultBuffer<ffi::U8> scratch) {
  return attention_common("baro_attention_small", stream, nullptr, &scratch, qkv, q_norm, k_norm, cos, sin,
                          k_cache, v_cache, pos_buf, n_valid_buf, eps, o, k_out, v_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionGpu, AttentionGpuImpl,
                              BARO_BIND_ATTENTION_ARGS(ffi::Ffi::Bind()
                                                           .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                                           .Ctx<ffi::ScratchAllocator>()));  // split partials (m <= 16)

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionSmallGpu, AttentionSmallGpuImpl,
                              BARO_BIND_SCRATCH(BARO_BIND_ATTENTION_ARGS(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>())),  // split partials
                              {ffi::Traits::kCmdBufferCompatible});
