// baro_attention on NVIDIA (sm_80+): one GQA-aware, register-resident
// flash-attention kernel used by both modes (prefill: serial over splits,
// decode: one block per split + attn_fa_combine_kernel). Included by
// attention.cu on CUDA only; the HIP build keeps the portable kernel there.
//
// Rows of a tile are (token, q head of one kv group) pairs, flattened per kv
// head kh as R = token * G + g (q head kh * G + g, G = H / Hkv). A tile is
// kPairs * 16 consecutive R, so every K/V tile in shared memory is used by all
// G q heads that share it (K/V are read once per 64 / G tokens, not once per
// 16 rows of every q head). Prefill tiles have 64 rows (4 warp pairs, 8 warps),
// decode tiles 16 rows (1 pair: the G = 8 heads of one token, padded).
//
// A warp pair owns 16 rows. For each KV block of 64 (aligned to absolute
// positions), warp A (half 0) computes S for columns 0..31 and warp B for
// 32..63, each a full K walk of mma_16816 into one accumulator (ascending
// 16-wide steps, exactly dot.cuh's order; fragments come from ldmatrix and are
// the same registers dot.cuh's load_a / load_b_nk / load_b_kn give). The row
// max is max(max_A, max_B) (exact). The row sum of the fp32 p is a fixed order:
// in-thread over the lane's 8 columns (n-tile 0..3, column 2t then 2t+1),
// quad butterfly xor 1 then 2, then sum_A + sum_B. P (bf16) goes through
// shared memory so both warps get the A fragments of all 64 keys; each warp
// accumulates O for its half of the head dims (o = o * alpha, then the 4
// k-steps of 16 keys ascending). None of this depends on m, on the row's place
// in the tile, on the tile size or on the other rows: a row's bits depend only
// on its own q, its own position and the cache, so decode (16-row tiles) and
// prefill (64-row tiles) agree. The decode tile runs two copies of its pair
// (kDup, fa_block_step): same S and sums, each copy P V for half of its dims,
// so twice the warps stream a block and each does half the P V mmas. The
// split structure is attention.cu's; the scores, maxima and merge scales are in base 2 (s * scale * log2 e, p and
// merge scales from ex2.approx: fa_ex2, fa_merge_scale), shared by both modes.
// Blocks wholly before every row of the tile skip the mask tests
// (fa_block_step<false>), with the same arithmetic.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "common.cuh"
#include "dot.cuh"
#include "launch.h"
#include "scratch_layout.h"

namespace baro_gpu {

constexpr int kFaKB = 64;         // KV block (== kAttnKB)
constexpr int kFaPairRows = 16;   // rows per warp pair (one MMA row tile)
constexpr int kFaBigPairs = 4;    // prefill tile: 64 rows, 8 warps
constexpr int kFaSmallPairs = 1;  // decode tile: 16 rows, 2 warps
constexpr int kFaMaxNt = kAttnMaxHeadDim / 16;  // PV n-tiles per warp (half the head dims)
constexpr int kFaPld = kFaKB + 8;               // bf16 stride of P rows (144 B: ldmatrix conflict-free)

// ---- PTX wrappers (cp.async, ldmatrix, named barriers) ----
BARO_DEV uint32_t fa_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; src_bytes = 0 zero-fills without reading.
BARO_DEV void fa_cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem_addr(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}
BARO_DEV void fa_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N committed groups are still in flight.
template <int N>
BARO_DEV void fa_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// Barrier of the warps of one pair and its kDup copies (ids 1..4; 0 is __syncthreads).
template <int kDup>
BARO_DEV void fa_pair_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(64 * kDup) : "memory");
}
// The head dims a warp accumulates P V for: warp `half` of a pair, copy `dup` of kDup, gets
// the (half * kDup + dup)-th of 2 kDup equal slices (hd % (16 kDup) == 0: whole n-tiles).
template <int kDup>
BARO_DEV int fa_dim_base(int hd, int half, int dup) { return (half * kDup + dup) * (hd / (2 * kDup)); }

BARO_DEV void fa_ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(fa_smem_addr(p))
               : "memory");
}
BARO_DEV void fa_ldsm_x4_t(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(fa_smem_addr(p))
               : "memory");
}
BARO_DEV void fa_ldsm_x2_t(uint32_t& r0, uint32_t& r1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(fa_smem_addr(p))
               : "memory");
}

// A fragment of rows 0..15, k 0..15 at p (row stride ld): == load_a(f, p, ld).
// Lane l addresses row l % 16, column 8 * (l / 16): matrices (rows 0-7, k 0-7),
// (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = regs 0..3.
BARO_DEV void fa_load_a(FragA& f, const uint16_t* p, int ld) {
  const int lane = lane_id();
  fa_ldsm_x4(f.r[0], f.r[1], f.r[2], f.r[3], p + (lane & 15) * ld + ((lane >> 4) << 3));
}
// B fragments of two n-tiles (key rows n0..n0+7 and n0+8..n0+15) at one
// k-step from K rows at p = K + n0*ld + k0: == load_b_nk(f0, p, ld),
// load_b_nk(f1, p + 8*ld, ld). Lane l addresses key row (l % 8) + 8 * (l / 16),
// column 8 * ((l / 8) % 2).
BARO_DEV void fa_load_b_nk2(FragB& f0, FragB& f1, const uint16_t* p, int ld) {
  const int lane = lane_id();
  fa_ldsm_x4(f0.r[0], f0.r[1], f1.r[0], f1.r[1],
             p + ((lane & 7) + ((lane >> 4) << 3)) * ld + (((lane >> 3) & 1) << 3));
}
// B fragments [k][n] of two n-tiles (dims n0..n0+7, n0+8..n0+15) from V rows
// (keys) at p = V + k0*ld + n0: == load_b_kn(f0, p, ld), load_b_kn(f1, p + 8, ld).
// .trans gives lane 4g+t the pair (V[2t][g], V[2t+1][g]) of each 8x8 matrix.
BARO_DEV void fa_load_b_kn2(FragB& f0, FragB& f1, const uint16_t* p, int ld) {
  const int lane = lane_id();
  fa_ldsm_x4_t(f0.r[0], f0.r[1], f1.r[0], f1.r[1], p + (lane & 15) * ld + ((lane >> 4) << 3));
}
BARO_DEV void fa_load_b_kn1(FragB& f, const uint16_t* p, int ld) {
  const int lane = lane_id();
  fa_ldsm_x2_t(f.r[0], f.r[1], p + (lane & 15) * ld);
}

// K/V blocks in flight: the decode tile (one block per kv head and split, a few per GPU)
// keeps two blocks ahead, the 64-row prefill tile one (its shared memory is full).
__host__ __device__ constexpr int fa_stages(int pairs) { return pairs == kFaSmallPairs ? 3 : 2; }

// Shared memory (bytes): Q tile, the K/V ring (fa_stages deep), P per pair, the pair's
// max/sum partials. Row stride hd + 8 bf16 keeps ldmatrix conflict-free.
struct FaSmem {
  int ld;
  size_t q, kv, tile, p, red, total;
};
__host__ __device__ inline FaSmem fa_smem(int hd, int pairs) {
  FaSmem l;
  l.ld = hd + 8;
  l.tile = sizeof(uint16_t) * kFaKB * l.ld;
  l.q = 0;
  l.kv = l.q + sizeof(uint16_t) * kFaPairRows * pairs * l.ld;
  l.p = l.kv + 2 * fa_stages(pairs) * l.tile;  // K0, V0, K1, V1, ...
  l.red = l.p + sizeof(uint16_t) * kFaPairRows * pairs * kFaPld;
  l.total = l.red + sizeof(float) * pairs * 4 * kFaPairRows;  // [pair][max|sum][half][row]
  return l;
}

// Rows j0..j0+63 of one kv head -> dst[64][ld] with cp.async; rows past lim
// are zero-filled and never read from global memory. Row j0 + r is read at
// base + (jb + r) * row_stride: jb = j0 in a contiguous cache, 0 with base at
// the block's first row in its page. With the head dim known at compile time
// each thread copies one fixed 16-byte column of every (kThreads / chunks)-th
// row: one address add per copy.
template <int kThreads, int kHd>
BARO_DEV void fa_issue_tile(uint16_t* __restrict__ dst, const uint16_t* __restrict__ base,
                            int64_t row_stride, int jb, int j0, int lim, int hd, int ld) {
  constexpr int kChunks = kHd / 8;
  if constexpr (kHd > 0 && kThreads % kChunks == 0 && kFaKB % (kThreads / kChunks) == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    const int r0 = threadIdx.x / kChunks;
    const int kc = (threadIdx.x % kChunks) * 8;
    const uint16_t* src = base + static_cast<int64_t>(jb + r0) * row_stride + kc;
    uint16_t* d = dst + r0 * (kHd + 8) + kc;
    const int64_t step = static_cast<int64_t>(kRowStep) * row_stride;
#pragma unroll
    for (int r = 0; r < kFaKB; r += kRowStep) {
      const bool ok = j0 + r0 + r <= lim;
      fa_cp_async16(d + r * (kHd + 8), ok ? src : base, ok ? 16 : 0);
      src += step;
    }
  } else {
    const int chunks = hd >> 3;
    for (int c = threadIdx.x; c < kFaKB * chunks; c += kThreads) {
      const int r = c / chunks;
      const int kc = (c - r * chunks) << 3;
      const int j = j0 + r;
      const bool ok = j <= lim;
      const uint16_t* src = ok ? base + static_cast<int64_t>(jb + r) * row_stride + kc : base;
      fa_cp_async16(dst + r * ld + kc, src, ok ? 16 : 0);
    }
  }
}

// Two fp32 -> packed bf16 (lo in the low half), round to nearest even: one
// cvt.rn.bf16x2.f32. Equal to f32_to_bf16 on every non-NaN input; only used
// for the softmax weights p in [0, 1].
BARO_DEV uint32_t fa_pack_bf16x2(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(hi), "f"(lo));
  return v;
}

// 2^x on the special-function unit: one MUFU.EX2 (ex2.approx.ftz.f32, about
// 2 ulp; 2^-inf = +0). Scores are kept in the base-2 domain (s * scale *
// log2 e), so p = 2^(s - m) is one FADD and one MUFU where expf() costs about
// ten instructions and a branch. The value is the device's own; decode and
// prefill run this same instruction, which is all identity needs.
BARO_DEV float fa_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// attn_merge_scale in the base-2 domain of this kernel's maxima.
BARO_DEV void fa_merge_scale(float M, float ms, float& Mn, float& ea, float& eb) {
  Mn = fmaxf(M, ms);
  ea = fa_ex2(M - Mn);  // 0 when M = -inf (nothing merged yet)
  eb = fa_ex2(ms - Mn);
}

// Steps a-d of one KV block of 64 keys (from j0) for this warp's 16 rows:
// S = Q K^T over this warp's 32 columns, the pair's row max, p = 2^(s - m'),
// the fixed-order row sum, P through shared memory, o = o * alpha + P V over
// this warp's head dims. kMasked = false is only called when every row of the
// tile is real and its limit is >= j0 + 63: then each mask test below is true,
// so the unmasked path is the masked path's arithmetic with the tests removed.
// kDup > 1 (the decode tile): kDup copies of the pair compute the same S, maxima and sums (the
// same instructions on the same operands: the same bits), copy 0 alone publishes them, and each
// copy accumulates P V for its own slice of the head dims: an output element's mma sequence is
// the same whichever warp runs it, and a block step does 1 / kDup of the P V work per warp.
template <bool kMasked, int kHd, int kDup>
BARO_DEV void fa_block_step(const uint16_t* __restrict__ Qp, const uint16_t* __restrict__ Kt,
                            const uint16_t* __restrict__ Vt, uint16_t* __restrict__ Ps,
                            float* __restrict__ red, int ld_rt, int hd_rt, int half, int dup, int pair,
                            int j0, const int (&lim)[2], float sl2, float (&o)[kFaMaxNt][4],
                            float (&ms)[2], float (&ls)[2]) {
  const int hd = kHd > 0 ? kHd : hd_rt;
  const int ld = kHd > 0 ? kHd + 8 : ld_rt;
  const int lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int nnt = hd / (16 * kDup);                  // PV n-tiles of this warp
  const int dbase = fa_dim_base<kDup>(hd, half, dup);  // this warp's head dims
  const int nbase = half * 32;         // this warp's S columns

  // a. S for this warp's 32 columns: 4 n-tiles, K ascending into one accumulator.
  float sacc[4][4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) sacc[u][i] = 0.0f;
#pragma unroll
  for (int k0 = 0; k0 < hd; k0 += 16) {
    FragA fa;
    fa_load_a(fa, Qp + k0, ld);
#pragma unroll
    for (int u2 = 0; u2 < 2; ++u2) {
      FragB f0, f1;
      fa_load_b_nk2(f0, f1, Kt + (nbase + 16 * u2) * ld + k0, ld);
      mma_16816(sacc[2 * u2], fa, f0);
      mma_16816(sacc[2 * u2 + 1], fa, f1);
    }
  }
  // b. scale (base 2), mask past each row's position, row max (exact, any order).
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = i >> 1;
      float s = sacc[u][i] * sl2;
      if (kMasked) {
        const int c = nbase + 8 * u + 2 * t + (i & 1);
        s = (j0 + c <= lim[e]) ? s : -INFINITY;
      }
      sacc[u][i] = s;
      mx[e] = fmaxf(mx[e], s);
    }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], shfl_xor(mx[e], 1));
    mx[e] = fmaxf(mx[e], shfl_xor(mx[e], 2));
    if (t == 0 && dup == 0) red[half * kFaPairRows + g + 8 * e] = mx[e];
  }
  fa_pair_barrier<kDup>(1 + pair);
  // c. p = 2^(s - m'), in-thread sum in a fixed order, quad butterfly, P -> smem.
  float alpha[2], mnew[2], psum[2];
  bool active[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = g + 8 * e;
    const float bmax = fmaxf(red[r], red[kFaPairRows + r]);
    active[e] = kMasked ? j0 <= lim[e] : true;
    mnew[e] = ms[e];
    alpha[e] = 1.0f;
    if (active[e]) {
      mnew[e] = fmaxf(ms[e], bmax);
      alpha[e] = fa_ex2(ms[e] - mnew[e]);  // 0 on the split's first block (ms = -inf)
    }
    psum[e] = 0.0f;
  }
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = i >> 1;
      const float p = active[e] ? fa_ex2(sacc[u][i] - mnew[e]) : 0.0f;
      sacc[u][i] = p;
      psum[e] = psum[e] + p;
    }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    psum[e] = psum[e] + shfl_xor(psum[e], 1);
    psum[e] = psum[e] + shfl_xor(psum[e], 2);
    if (t == 0 && dup == 0) red[2 * kFaPairRows + half * kFaPairRows + g + 8 * e] = psum[e];
  }
  if (dup == 0) {
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nbase + 8 * u + 2 * t;
        *reinterpret_cast<uint32_t*>(Ps + (g + 8 * e) * kFaPld + c) =
            fa_pack_bf16x2(sacc[u][2 * e], sacc[u][2 * e + 1]);
      }
  }
  fa_pair_barrier<kDup>(1 + pair);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (active[e]) {
      const int r = g + 8 * e;
      const float lb = red[2 * kFaPairRows + r] + red[3 * kFaPairRows + r];  // A then B
      ls[e] = ls[e] * alpha[e] + lb;
      ms[e] = mnew[e];
    }
  }
  // d. o = o * alpha + P V over this warp's dims; a row whose block is
  //    inactive keeps o unchanged (select).
  FragA pa[kFaKB / 16];
#pragma unroll
  for (int kk = 0; kk < kFaKB / 16; ++kk) fa_load_a(pa[kk], Ps + kk * 16, kFaPld);
#pragma unroll
  for (int q = 0; q < kFaMaxNt; q += 2) {
    if (q < nnt) {
      const bool two = q + 1 < nnt;
      float c0[4] = {o[q][0] * alpha[0], o[q][1] * alpha[0], o[q][2] * alpha[1],
                     o[q][3] * alpha[1]};
      float c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (two) {
        c1[0] = o[q + 1][0] * alpha[0];
        c1[1] = o[q + 1][1] * alpha[0];
        c1[2] = o[q + 1][2] * alpha[1];
        c1[3] = o[q + 1][3] * alpha[1];
      }
      const uint16_t* vp = Vt + dbase + q * 8;
#pragma unroll
      for (int kk = 0; kk < kFaKB / 16; ++kk) {
        if (two) {
          FragB f0, f1;
          fa_load_b_kn2(f0, f1, vp + (kk * 16) * ld, ld);
          mma_16816(c0, pa[kk], f0);
          mma_16816(c1, pa[kk], f1);
        } else {
          FragB f0;
          fa_load_b_kn1(f0, vp + (kk * 16) * ld, ld);
          mma_16816(c0, pa[kk], f0);
        }
      }
      if (active[0]) {
        o[q][0] = c0[0];
        o[q][1] = c0[1];
      }
      if (active[1]) {
        o[q][2] = c0[2];
        o[q][3] = c0[3];
      }
      if (two) {
        if (active[0]) {
          o[q + 1][0] = c1[0];
          o[q + 1][1] = c1[1];
        }
        if (active[1]) {
          o[q + 1][2] = c1[2];
          o[q + 1][3] = c1[3];
        }
      }
    }
  }
}

// BARO_FA_HELPERS_ONLY: the helpers above without the kernels below, for another translation
// unit that shares them (attention_wgmma.cu); the kernels stay in attention.cu's.
#if !defined(BARO_FA_HELPERS_ONLY)

// Grid (tiles, Hkv, 1) serial / (tiles, Hkv, max_splits) parallel. In parallel
// mode the split partials go to part_o[((kh*max_splits + sp)*rows_pad + R)*hd]
// and part_ml[... * 2] (m, l).
// kHd: the head dim as a compile-time constant (the model's 256: every loop
// unrolls, so the independent PV chains of a warp interleave), or 0 for any
// other head dim read at run time. A given hd always runs one instantiation.
// kDup: copies of each warp pair (fa_block_step), decode tiles only.
// attn_fa_tile: one block's work, tile `tile` of kv head kh (and split sp in parallel mode), so
// that baro_attention_rows (attention_rows.cu) runs this same code on each row's own view of
// its slot; attn_fa_kernel below is the grid of one call.
// kPaged: the cache is the pages of kv (attn_kv_row); a block's rows lie in one page, an
// unmapped page's block is zero-filled as rows past the limit are. The one-sequence kernel is the
// kPaged = false instantiation (kv unread).
template <int kPairs, bool kParallel, int kHd, int kDup, bool kPaged = false>
BARO_DEV void attn_fa_tile(const AttentionArgs& a, float* __restrict__ part_o, float* __restrict__ part_ml,
                           int max_splits, int64_t rows_pad, int64_t tile, int kh, int sp,
                           const KvPages& kv = KvPages{}) {
  constexpr int kRows = kPairs * kFaPairRows;
  static_assert(kDup == 1 || kParallel, "the serial merge keeps one copy of each pair");
  constexpr int kWarps = 2 * kPairs * kDup;
  constexpr int kThreads = kWarps * BARO_WARP;
  extern __shared__ uint4 fa_smem4[];
  char* smem = reinterpret_cast<char*>(fa_smem4);
  const int hd = kHd > 0 ? kHd : a.hd;
  const FaSmem L = fa_smem(hd, kPairs);
  const int ld = L.ld;
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + L.q);
  uint16_t* KV0 = reinterpret_cast<uint16_t*>(smem + L.kv);
  const int tile_el = kFaKB * ld;  // elements per K or V tile

  const int lane = lane_id(), warp = warp_id();
  // kDup == 1 (every prefill tile): dup is the constant 0, so that code is the one-copy kernel's
  const int dup = kDup == 1 ? 0 : warp / (2 * kPairs);
  const int pair = kDup == 1 ? warp >> 1 : (warp >> 1) % kPairs, half = warp & 1;
  const int g = lane >> 2, t = lane & 3;
  uint16_t* Ps = reinterpret_cast<uint16_t*>(smem + L.p) + pair * kFaPairRows * kFaPld;
  float* red = reinterpret_cast<float*>(smem + L.red) + pair * 4 * kFaPairRows;

  const int G = a.H / a.Hkv;
  const int64_t m = a.m;
  const int64_t nrows = m * G;
  const int64_t R0 = tile * kRows;
  if (R0 >= nrows) return;
  const int64_t pos = *a.pos;
  const int64_t nvld = clamp_nvalid(a.n_valid, m);
  const int64_t R_last = (R0 + kRows < nrows ? R0 + kRows : nrows) - 1;

  int64_t tile_lim = pos + R_last / G;  // last row's position
  if (tile_lim > a.S - 1) tile_lim = a.S - 1;
  int64_t load_lim = pos + nvld - 1;  // last cache row written so far
  if (load_lim > tile_lim) load_lim = tile_lim;
  const int n_blocks = tile_lim < 0 ? 0 : static_cast<int>(tile_lim / kFaKB + 1);
  const int n_splits = (n_blocks + kAttnSplitBlocks - 1) / kAttnSplitBlocks;
  int b_begin = 0, b_end = n_blocks;
  if (kParallel) {
    if (sp >= n_splits) return;  // uniform for the block, before any barrier
    b_begin = sp * kAttnSplitBlocks;
    b_end = b_begin + kAttnSplitBlocks < n_blocks ? b_begin + kAttnSplitBlocks : n_blocks;
  }
  const int lim_load = static_cast<int>(load_lim < -1 ? -1 : load_lim);

  const int64_t row_stride = static_cast<int64_t>(a.Hkv) * hd;
  const uint16_t* kbase = a.k_cache + static_cast<int64_t>(kh) * hd;
  const uint16_t* vbase = a.v_cache + static_cast<int64_t>(kh) * hd;
  // K and V blocks starting at row j0 into dst. Paged: from the block's first row in its page,
  // with the load limit below j0 when the page is unmapped (all zero-filled).
  auto issue = [&](uint16_t* dst, int j0) {
    if constexpr (kPaged) {
      const int64_t off = attn_kv_row(kv, j0, row_stride);
      const int lim = off < 0 ? j0 - 1 : lim_load;
      const int64_t at = off < 0 ? 0 : off;
      fa_issue_tile<kThreads, kHd>(dst, kbase + at, row_stride, 0, j0, lim, hd, ld);
      fa_issue_tile<kThreads, kHd>(dst + tile_el, vbase + at, row_stride, 0, j0, lim, hd, ld);
    } else {
      fa_issue_tile<kThreads, kHd>(dst, kbase, row_stride, j0, j0, lim_load, hd, ld);
      fa_issue_tile<kThreads, kHd>(dst + tile_el, vbase, row_stride, j0, j0, lim_load, hd, ld);
    }
  };
  // first K/V block in flight while Q is normed
  constexpr int kStages = fa_stages(kPairs);
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {  // the first blocks in flight while Q is normed
    if (b_begin + st < b_end) issue(KV0 + (2 * st) * tile_el, (b_begin + st) * kFaKB);
    fa_cp_async_commit();  // always: keeps the group count uniform
  }

  // Q tile (bf16): one warp per row, the same per-(token, head) code in every
  // tile shape and mode (norm_rope_elem, as the kv write).
  const int64_t W = static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
  for (int r = warp; r < kRows; r += kWarps) {
    uint16_t* qrow = Qs + r * ld;
    const int64_t R = R0 + r;
    if (R < nrows) {
      const int64_t i = R / G;
      const int h = kh * G + static_cast<int>(R - i * G);
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

  // This lane's rows g and g+8 of the pair: position limit (-1: padding row).
  int lim[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int64_t R = R0 + pair * kFaPairRows + g + 8 * e;
    int64_t l = -1;
    if (R < nrows) {
      l = pos + R / G;
      if (l > a.S - 1) l = a.S - 1;
      if (l < -1) l = -1;
    }
    lim[e] = static_cast<int>(l);
  }

  // Smallest row limit of the tile (-1 when it has padding rows): blocks
  // ending at or before it need no masks.
  int lim_min = -1;
  if (R_last == R0 + kRows - 1) {
    int64_t l = pos + R0 / G;
    if (l > a.S - 1) l = a.S - 1;
    lim_min = static_cast<int>(l < -1 ? -1 : l);
  }
  const float sl2 = a.scale * 1.44269504088896340736f;  // scores in base 2
  const int nnt = hd / (16 * kDup);                  // n-tiles of this warp's head dims
  const int dbase = fa_dim_base<kDup>(hd, half, dup);  // this warp's head dims
  const uint16_t* Qp = Qs + pair * kFaPairRows * ld;

  float o[kFaMaxNt][4];  // this split's O (reset when a split starts: b % kAttnSplitBlocks == 0)
#pragma unroll
  for (int q = 0; q < kFaMaxNt; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[q][i] = 0.0f;
  float ms[2] = {-INFINITY, -INFINITY}, ls[2] = {0.0f, 0.0f};
  // running merge over splits (serial mode only)
  float O[kParallel ? 1 : kFaMaxNt][4];
  float Mrun[2] = {-INFINITY, -INFINITY}, Lrun[2] = {0.0f, 0.0f};
  if constexpr (!kParallel) {
#pragma unroll
    for (int q = 0; q < kFaMaxNt; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) O[q][i] = 0.0f;
  }

  for (int b = b_begin; b < b_end; ++b) {
    const int buf = (b - b_begin) % kStages;
    const uint16_t* Kt = KV0 + (2 * buf) * tile_el;
    const uint16_t* Vt = Kt + tile_el;
    fa_cp_async_wait<kStages - 2>();
    __syncthreads();  // block b visible to all; every warp done with block b-1's buffers
    if (b + kStages - 1 < b_end) issue(KV0 + (2 * ((b - b_begin + kStages - 1) % kStages)) * tile_el,
                                       (b + kStages - 1) * kFaKB);
    fa_cp_async_commit();

    if (b % kAttnSplitBlocks == 0) {  // a split starts: fresh online softmax
#pragma unroll
      for (int q = 0; q < kFaMaxNt; ++q)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[q][i] = 0.0f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        ms[e] = -INFINITY;
        ls[e] = 0.0f;
      }
    }
    const int j0 = b * kFaKB;

    // a-d for this warp's rows. Only blocks that cross a row's position (the
    // diagonal, or any block of a tile with padding rows) need the masks.
    if (j0 + kFaKB - 1 > lim_min)
      fa_block_step<true, kHd, kDup>(Qp, Kt, Vt, Ps, red, ld, hd, half, dup, pair, j0, lim, sl2, o, ms, ls);
    else
      fa_block_step<false, kHd, kDup>(Qp, Kt, Vt, Ps, red, ld, hd, half, dup, pair, j0, lim, sl2, o, ms, ls);

    // e. split done: partials out (parallel) or in-order merge (serial).
    if ((b + 1) % kAttnSplitBlocks == 0 || b + 1 == b_end) {
      const int sp = b / kAttnSplitBlocks;
      if constexpr (kParallel) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t slot = (static_cast<int64_t>(kh) * max_splits + sp) * rows_pad + R0 +
                               pair * kFaPairRows + g + 8 * e;
          float* po = part_o + slot * hd + dbase + 2 * t;
#pragma unroll
          for (int q = 0; q < kFaMaxNt; ++q)
            if (q < nnt)
              *reinterpret_cast<float2*>(po + q * 8) = make_float2(o[q][2 * e], o[q][2 * e + 1]);
          if (half == 0 && dup == 0 && t == 0) {
            part_ml[slot * 2 + 0] = ms[e];
            part_ml[slot * 2 + 1] = ls[e];
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (static_cast<int64_t>(sp) * kAttnSplit <= lim[e]) {  // split active for the row
            float Mn, ea, eb;
            fa_merge_scale(Mrun[e], ms[e], Mn, ea, eb);
            Lrun[e] = Lrun[e] * ea + ls[e] * eb;
#pragma unroll
            for (int q = 0; q < kFaMaxNt; ++q) {
              O[q][2 * e + 0] = O[q][2 * e + 0] * ea + o[q][2 * e + 0] * eb;
              O[q][2 * e + 1] = O[q][2 * e + 1] * ea + o[q][2 * e + 1] * eb;
            }
            Mrun[e] = Mn;
          }
        }
      }
    }
  }

  if constexpr (!kParallel) {
    // epilogue: o = bf16((O / L) * sigmoid(gate)); rows >= n_valid -> 0.
    const int64_t out_ld = static_cast<int64_t>(a.H) * hd;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t R = R0 + pair * kFaPairRows + g + 8 * e;
      if (R < nrows) {
        const int64_t i = R / G;
        const int h = kh * G + static_cast<int>(R - i * G);
        uint16_t* orow = a.out + i * out_ld + static_cast<int64_t>(h) * hd + dbase + 2 * t;
        const float* grow = a.qkv + i * W + static_cast<int64_t>(h) * 2 * hd + hd + dbase + 2 * t;
#pragma unroll
        for (int q = 0; q < kFaMaxNt; ++q) {
          if (q < nnt) {
            uint32_t v = 0;
            if (i < nvld) {
              const uint16_t lo = f32_to_bf16((O[q][2 * e] / Lrun[e]) * sigmoidf_(grow[q * 8]));
              const uint16_t hi = f32_to_bf16((O[q][2 * e + 1] / Lrun[e]) * sigmoidf_(grow[q * 8 + 1]));
              v = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
            }
            *reinterpret_cast<uint32_t*>(orow + q * 8) = v;
          }
        }
      }
    }
  }
}

template <int kPairs, bool kParallel, int kHd, int kDup>
__global__ void __launch_bounds__(kPairs * 2 * kDup * BARO_WARP, 1)
    attn_fa_kernel(AttentionArgs a, float* __restrict__ part_o, float* __restrict__ part_ml,
                   int max_splits, int64_t rows_pad) {
  grid_dependency_wait();  // launch_dependent: the cache write first
  // Serial (prefill) tiles run last-first: the late rows see the most KV
  // blocks, so the long tiles start in the first wave and the short ones fill
  // the tail. Which block runs a tile never changes a row's arithmetic.
  attn_fa_tile<kPairs, kParallel, kHd, kDup>(a, part_o, part_ml, max_splits, rows_pad,
                                             kParallel ? blockIdx.x : gridDim.x - 1 - blockIdx.x,
                                             static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z));
}

// Parallel mode: merge a row's splits in order (the serial kernel's merge
// arithmetic), gate, write. One warp per (token i < m, q head h); lane handles
// d = lane + 32t.
constexpr int kFaCombineWarps = 4;
// Warps per (row, q head), each merging its own slice of the head dims (lane l, slice c: dims
// l + 32 (c + 8t)). Every warp computes the same M and L from the same values in the same
// order, so an element's bits do not depend on which warp merges it. A decode call has only
// m * H = 16 rows, and the merge waits on one group of loads per kFaCombineAhead splits: at
// 512-position splits a 32k row has 64 of them (10.9 us with 4 slices and groups of 16), so 8
// slices (one dim per lane at hd 256) and groups of 32.
constexpr int kFaCombineSlices = 8;
constexpr int kFaCombinePerLane = kAttnMaxHeadDim / BARO_WARP / kFaCombineSlices;
constexpr int kFaCombineAhead = 32;  // splits read before they are merged
static_assert(kAttnMaxHeadDim % (BARO_WARP * kFaCombineSlices) == 0, "whole lanes per slice");

// One warp's (row, q head, slice) item of the merge (attention_rows.cu runs it per row too).
BARO_DEV void attn_fa_combine_item(const AttentionArgs& a, const float* __restrict__ part_o,
                                   const float* __restrict__ part_ml, int max_splits, int64_t rows_pad,
                                   int64_t item) {
  if (item >= a.m * a.H * kFaCombineSlices) return;
  const int slice = static_cast<int>(item % kFaCombineSlices);
  const int64_t i = item / kFaCombineSlices / a.H;
  const int h = static_cast<int>(item / kFaCombineSlices % a.H);
  const int G = a.H / a.Hkv;
  const int kh = h / G;
  const int64_t R = i * G + (h - kh * G);
  const int hd = a.hd, lane = lane_id();
  auto dim = [&](int t) { return lane + BARO_WARP * (slice + kFaCombineSlices * t); };
  const int64_t out_ld = static_cast<int64_t>(a.H) * hd;
  uint16_t* orow = a.out + i * out_ld + static_cast<int64_t>(h) * hd;
  // The scalars and the gate first (row i < m exists): their latencies overlap the partials'.
  const int32_t pos_raw = *a.pos;
  const float* xr = a.qkv + i * static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
  float gate[kFaCombinePerLane];
#pragma unroll
  for (int t = 0; t < kFaCombinePerLane; ++t)
    gate[t] = dim(t) < hd ? xr[static_cast<int64_t>(h) * 2 * hd + hd + dim(t)] : 0.0f;
  const int64_t nvld = clamp_nvalid(a.n_valid, a.m);
  if (i >= nvld) {
#pragma unroll
    for (int t = 0; t < kFaCombinePerLane; ++t)
      if (dim(t) < hd) orow[dim(t)] = 0;
    return;
  }
  int64_t lim = static_cast<int64_t>(pos_raw) + i;  // same row limit as attn_fa_kernel
  if (lim > a.S - 1) lim = a.S - 1;
  const int64_t n_act = lim < 0 ? 0 : lim / kAttnSplit + 1;  // splits active for this row
  float M = -INFINITY, Lsum = 0.0f;
  float O[kFaCombinePerLane];
#pragma unroll
  for (int t = 0; t < kFaCombinePerLane; ++t) O[t] = 0.0f;
  // The merge is sequential over splits; its loads are not: a group of kFaCombineAhead
  // splits is read first, then merged in split order (a 128k row has 256 splits, and one
  // memory latency per split was the whole cost).
  const int64_t n_sp = n_act < max_splits ? n_act : max_splits;
  // split sp's partials: (m, l) at ml0 + sp * rows_pad, O at o0 + sp * o_step (then + dim)
  const int64_t slot0 = static_cast<int64_t>(kh) * max_splits * rows_pad + R;
  const float2* ml0 = reinterpret_cast<const float2*>(part_ml) + slot0;
  const float* o0 = part_o + slot0 * hd;
  const int64_t o_step = rows_pad * hd;
  for (int64_t sp0 = 0; sp0 < n_sp; sp0 += kFaCombineAhead) {
    float ms[kFaCombineAhead], ls[kFaCombineAhead], po[kFaCombineAhead][kFaCombinePerLane];
    const float2* mlp = ml0 + sp0 * rows_pad;
    const float* op = o0 + sp0 * o_step;
#pragma unroll
    for (int u = 0; u < kFaCombineAhead; ++u) {
      if (sp0 + u < n_sp) {
        const float2 ml = mlp[u * rows_pad];
        ms[u] = ml.x;
        ls[u] = ml.y;
#pragma unroll
        for (int t = 0; t < kFaCombinePerLane; ++t)
          po[u][t] = dim(t) < hd ? op[u * o_step + dim(t)] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kFaCombineAhead; ++u) {
      if (sp0 + u < n_sp) {
        float Mn, ea, eb;
        fa_merge_scale(M, ms[u], Mn, ea, eb);
        Lsum = Lsum * ea + ls[u] * eb;
#pragma unroll
        for (int t = 0; t < kFaCombinePerLane; ++t)
          if (dim(t) < hd) O[t] = O[t] * ea + po[u][t] * eb;
        M = Mn;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kFaCombinePerLane; ++t) {
    const int d = dim(t);
    if (d < hd) orow[d] = f32_to_bf16((O[t] / Lsum) * sigmoidf_(gate[t]));
  }
}

// static: each translation unit that includes this header (attention.cu, attention_rows.cu) keeps
// its own copy instead of two definitions of one symbol.
static __global__ void __launch_bounds__(kFaCombineWarps * BARO_WARP)
    attn_fa_combine_kernel(AttentionArgs a, const float* __restrict__ part_o,
                           const float* __restrict__ part_ml, int max_splits, int64_t rows_pad) {
  grid_dependency_wait();  // launch_dependent: the splits' partials first
  attn_fa_combine_item(a, part_o, part_ml, max_splits, rows_pad,
                       static_cast<int64_t>(blockIdx.x) * kFaCombineWarps + warp_id());
}

// Tile geometry of a call (host and device agree on it).
struct FaPlan {
  bool parallel;  // decode-style: one block per split + combine
  int pairs;      // 1 (16-row tiles) or 4 (64-row tiles)
  int64_t tiles, rows_pad, max_splits;
};
inline FaPlan fa_plan(const AttentionArgs& a) {
  FaPlan p;
  const int64_t rows = a.m * (a.H / a.Hkv);
  p.parallel = a.m <= 16;
  p.pairs = rows <= kFaPairRows ? kFaSmallPairs : kFaBigPairs;
  const int64_t tr = static_cast<int64_t>(kFaPairRows) * p.pairs;
  p.tiles = (rows + tr - 1) / tr;
  p.rows_pad = p.tiles * tr;
  p.max_splits = (a.S + kAttnSplit - 1) / kAttnSplit;
  return p;
}

// The split partials (part_o, then part_ml) of a parallel-mode call: scratch_layout.h, whose
// sizes the CPU library exports to custom_calls.
static_assert(baro::scratch::kFaPairRows == kFaPairRows && baro::scratch::kFaSmallPairs == kFaSmallPairs &&
                  baro::scratch::kFaBigPairs == kFaBigPairs && baro::scratch::kAttnSplit == kAttnSplit,
              "scratch_layout.h has fa_plan's tile geometry");
inline size_t fa_scratch_bytes(const AttentionArgs& a) {
  return static_cast<size_t>(baro::scratch::attention_bytes(a.m, a.S, a.H, a.Hkv, a.hd, false));
}

template <int kPairs, bool kParallel, int kHd, int kDup>
gpuError_t fa_launch_one_hd(const AttentionArgs& a, dim3 grid, float* part_o, float* part_ml,
                         int max_splits, int64_t rows_pad, gpuStream_t stream) {
  const size_t smem = fa_smem(a.hd, kPairs).total;  // <= ~179 KB for hd = 256
  gpuError_t e = cudaFuncSetAttribute(attn_fa_kernel<kPairs, kParallel, kHd, kDup>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem));
  if (e != gpuSuccess) return e;
  return launch_dependent(attn_fa_kernel<kPairs, kParallel, kHd, kDup>, grid, dim3(kPairs * 2 * kDup * BARO_WARP),
                          smem, stream, a, part_o, part_ml, max_splits, rows_pad);  // after the cache write
}

// The decode tile (one pair, one block per kv head and split: a few blocks per GPU at short
// context) runs kFaDecodeDup copies of its pair when the head dims split into whole n-tiles;
// BARO_ATTN_DUP=1 keeps one (the kernel tests compare the two).
constexpr int kFaDecodeDup = 2;
inline bool fa_decode_dup(const AttentionArgs& a) {
  return a.hd % (16 * kFaDecodeDup) == 0 && !baro::knobs::on(baro::knobs::kAttnDup);
}

template <int kPairs, bool kParallel>
gpuError_t fa_launch_one(const AttentionArgs& a, dim3 grid, float* part_o, float* part_ml,
                         int max_splits, int64_t rows_pad, gpuStream_t stream) {
  if constexpr (kParallel && kPairs == kFaSmallPairs) {
    if (fa_decode_dup(a)) {
      if (a.hd == kAttnMaxHeadDim)
        return fa_launch_one_hd<kPairs, kParallel, kAttnMaxHeadDim, kFaDecodeDup>(a, grid, part_o, part_ml,
                                                                                   max_splits, rows_pad, stream);
      return fa_launch_one_hd<kPairs, kParallel, 0, kFaDecodeDup>(a, grid, part_o, part_ml, max_splits, rows_pad,
                                                                   stream);
    }
  }
  if (a.hd == kAttnMaxHeadDim)
    return fa_launch_one_hd<kPairs, kParallel, kAttnMaxHeadDim, 1>(a, grid, part_o, part_ml, max_splits,
                                                                    rows_pad, stream);
  return fa_launch_one_hd<kPairs, kParallel, 0, 1>(a, grid, part_o, part_ml, max_splits, rows_pad, stream);
}

// Kernels 2 (and 3) of launch_attention on CUDA; the cache writes are enqueued before.
inline gpuError_t fa_launch(const AttentionArgs& a, void* scratch, gpuStream_t stream) {
  const FaPlan p = fa_plan(a);
  if (p.tiles > 0x7fffffffLL || p.max_splits > 65535) return gpuErrorInvalidValue;
  const unsigned tiles = static_cast<unsigned>(p.tiles);
  // BARO_ATTN_WGMMA=1 (default): the sm_90a prefill kernel (the same bits; K/V by TMA, 1.12x at 32k
  // on the H200) where the build, device and shape have it, else this one; =0: this one always;
  // =require (tests): an error instead of the fallback.
  const bool wg_need = !p.parallel && baro::knobs::is(baro::knobs::kAttnWgmma, "require");
  if (!p.parallel && (wg_need || baro::knobs::is(baro::knobs::kAttnWgmma, "1"))) {
    bool ran = false;
    const gpuError_t e = launch_attention_wgmma(a, scratch, stream, &ran);
    if (ran || e != gpuSuccess) return e;
    if (wg_need) return gpuErrorInvalidValue;
  }
  if (!p.parallel)
    return fa_launch_one<kFaBigPairs, false>(a, dim3(tiles, a.Hkv, 1u), nullptr, nullptr, 0,
                                             p.rows_pad, stream);
  if (scratch == nullptr) return gpuErrorInvalidValue;
  const int64_t slots = static_cast<int64_t>(a.Hkv) * p.max_splits * p.rows_pad;
  float* part_o = static_cast<float*>(scratch);
  float* part_ml = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                            ((sizeof(float) * slots * a.hd + 255) / 256) * 256);
  const dim3 grid(tiles, static_cast<unsigned>(a.Hkv), static_cast<unsigned>(p.max_splits));
  const int ms = static_cast<int>(p.max_splits);
  gpuError_t e = p.pairs == kFaSmallPairs
                     ? fa_launch_one<kFaSmallPairs, true>(a, grid, part_o, part_ml, ms, p.rows_pad, stream)
                     : fa_launch_one<kFaBigPairs, true>(a, grid, part_o, part_ml, ms, p.rows_pad, stream);
  if (e != gpuSuccess) return e;
  const int64_t blocks3 = (a.m * a.H * kFaCombineSlices + kFaCombineWarps - 1) / kFaCombineWarps;
  return launch_dependent(attn_fa_combine_kernel, dim3(static_cast<unsigned>(blocks3)),
                          dim3(kFaCombineWarps * BARO_WARP), 0, stream, a, part_o, part_ml, ms, p.rows_pad);
}

#endif  // !BARO_FA_HELPERS_ONLY

}  // namespace baro_gpu
