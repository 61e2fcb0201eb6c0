// baro_attention on HIP: kernels 2 and 3 with no NVIDIA MMA fragments (one q head per
// 16-row tile). The same split structure and merge as attention_fa.cuh, so each platform
// agrees with itself (docs/DESIGN.md §2). Included by attention.cu on HIP only.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "common.cuh"
#include "dot.cuh"

namespace baro_gpu {

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

}  // namespace baro_gpu
