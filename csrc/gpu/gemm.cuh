// baro_jax GPU: the one GEMM kernel, C[s, n] = sum_k A[row(s), k] * W[group][n, k]
// (bf16 in, fp32 out), built on dot.cuh's mma_16816.
//
// Order: every output element is one fp32 accumulator fragment that walks K
// in ascending 16-wide steps (BK-wide shared-memory stages, zero padding past
// K, no split-K). The tile shape (16 or 64 rows) and the other rows of the
// tile do not change its bits; see dot.cuh.
//
// One kernel serves:
//  - plain matmul (tiles == nullptr): row tile b covers rows [b*BM, b*BM+BM);
//  - grouped matmul for MoE (tiles != nullptr): slot b covers rows
//    [row_start, row_start+row_count) of the sorted row space, all of one
//    expert `group`; A rows are gathered through a_rows (nullable).
// Grid: x = row tile slots, y = N tiles of BN columns.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "dot.cuh"
#include "portability.h"

namespace baro_gpu {

// K per shared-memory stage is a template parameter BK (64 or 256); the smem
// row stride is BK + 8 elements (16-byte multiple, conflict-free fragment loads).
// BK never changes the bits: the MMA sequence per output element is the same.

struct GemmParams {
  const uint16_t* A = nullptr;  // rows of length >= K, stride lda
  int64_t lda = 0;
  const int32_t* a_rows = nullptr;  // sorted row s -> A row; nullptr = identity
  const uint16_t* W = nullptr;      // [groups][N][ldw]
  int64_t ldw = 0;
  int64_t w_group_stride = 0;  // elements between groups
  int64_t M = 0, N = 0, K = 0;  // M: rows when tiles == nullptr
  float* C = nullptr;           // [rows][ldc], row s in sorted space
  int64_t ldc = 0;
  const int32_t* tiles = nullptr;    // [max_tiles][3] = (group, row_start, row_count)
  const int32_t* n_tiles = nullptr;  // device scalar (tiles != nullptr)
  int vec = 0;                       // 16-byte global loads allowed (host-checked)
};

// Loads ROWS x BK bf16 (rows row0.., k0..) into smem s (row stride BK + 8), zero
// outside [0, valid_rows) x [0, K). Row r reads global row gather ? gather[row0+r] : row0+r.
template <int ROWS, int THREADS, int BK>
BARO_DEV void gemm_load_tile(uint16_t* __restrict__ s, const uint16_t* __restrict__ base,
                             int64_t ld, const int32_t* __restrict__ gather, int64_t row0,
                             int valid_rows, int64_t k0, int64_t K, bool vec) {
  constexpr int kLds = BK + 8;
  const int tid = threadIdx.x;
  if (vec) {
    constexpr int kChunks = BK / 8;  // 16-byte chunks per row
    for (int c = tid; c < ROWS * kChunks; c += THREADS) {
      const int r = c / kChunks;
      const int kc = (c % kChunks) * 8;
      const int64_t k = k0 + kc;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < valid_rows && k < K) {  // K % 8 == 0, so k + 8 <= K
        const int64_t grow = gather ? static_cast<int64_t>(gather[row0 + r]) : row0 + r;
        v = *reinterpret_cast<const uint4*>(base + grow * ld + k);
      }
      *reinterpret_cast<uint4*>(s + r * kLds + kc) = v;
    }
  } else {
    for (int c = tid; c < ROWS * BK; c += THREADS) {
      const int r = c / BK;
      const int kk = c % BK;
      const int64_t k = k0 + kk;
      uint16_t v = 0;
      if (r < valid_rows && k < K) {
        const int64_t grow = gather ? static_cast<int64_t>(gather[row0 + r]) : row0 + r;
        v = base[grow * ld + k];
      }
      s[r * kLds + kk] = v;
    }
  }
}

// MT x NT mma tiles per warp, WM x WN warps per block, BK of K per stage.
template <int MT, int NT, int WM, int WN, int BK_>
struct GemmShape {
  static constexpr int BK = BK_;
  static constexpr int kLds = BK_ + 8;
  static constexpr int kWarps = WM * WN;
  static constexpr int kThreads = BARO_WARP * kWarps;
  static constexpr int BM = 16 * MT * WM;
  static constexpr int BN = 8 * NT * WN;
};

template <int MT, int NT, int WM, int WN, int BK>
__global__ void __launch_bounds__(BARO_WARP * WM * WN) gemm_kernel(GemmParams p) {
  using Shape = GemmShape<MT, NT, WM, WN, BK>;
  constexpr int BM = Shape::BM, BN = Shape::BN, THREADS = Shape::kThreads;
  constexpr int kLds = Shape::kLds;
  // uint4 storage guarantees 16-byte alignment of the tiles.
  __shared__ uint4 As4[BM * kLds / 8];
  __shared__ uint4 Bs4[BN * kLds / 8];
  uint16_t* As = reinterpret_cast<uint16_t*>(As4);
  uint16_t* Bs = reinterpret_cast<uint16_t*>(Bs4);

  // ---- which rows / group / columns this block owns ----
  const int64_t slot = blockIdx.x;
  int64_t group = 0, r0 = 0;
  int64_t rc = 0;
  if (p.tiles != nullptr) {
    if (slot >= static_cast<int64_t>(*p.n_tiles)) return;
    group = p.tiles[3 * slot + 0];
    r0 = p.tiles[3 * slot + 1];
    rc = p.tiles[3 * slot + 2];
  } else {
    r0 = slot * BM;
    rc = p.M - r0;
  }
  if (rc <= 0) return;
  if (rc > BM) rc = BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  if (n0 >= p.N) return;
  const int64_t nc64 = p.N - n0;
  const int nc = nc64 < BN ? static_cast<int>(nc64) : BN;
  const uint16_t* W = p.W + group * p.w_group_stride + n0 * p.ldw;
  const bool vec = p.vec != 0;

  const int warp = warp_id();
  const int wm = warp / WN, wn = warp % WN;

  float acc[MT][NT][4];
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;

  for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
    gemm_load_tile<BM, THREADS, BK>(As, p.A, p.lda, p.a_rows, r0, static_cast<int>(rc), k0, p.K, vec);
    gemm_load_tile<BN, THREADS, BK>(Bs, W, p.ldw, nullptr, 0, nc, k0, p.K, vec);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      if (k0 + kk < p.K) {  // uniform: skip all-zero steps past K
        FragA fa[MT];
        FragB fb[NT];
#pragma unroll
        for (int a = 0; a < MT; ++a) load_a(fa[a], As + ((wm * MT + a) * 16) * kLds + kk, kLds);
#pragma unroll
        for (int b = 0; b < NT; ++b) load_b_nk(fb[b], Bs + ((wn * NT + b) * 8) * kLds + kk, kLds);
#pragma unroll
        for (int a = 0; a < MT; ++a)
#pragma unroll
          for (int b = 0; b < NT; ++b) mma_16816(acc[a][b], fa[a], fb[b]);
      }
    }
    __syncthreads();
  }

  // ---- epilogue: fp32 out ----
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = (wm * MT + a) * 16 + frag_row(i);
        const int c = (wn * NT + b) * 8 + frag_col(i);
        if (r < rc && c < nc) p.C[(r0 + r) * p.ldc + n0 + c] = acc[a][b][i];
      }
}

}  // namespace baro_gpu
