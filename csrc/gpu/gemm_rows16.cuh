// baro_jax GPU (CUDA only): the decode-shaped GEMM. A slot holds at most 16
// rows (one m16 tile), so the cost is reading W once: the kernel streams W
// through a deep cp.async ring (Rows16Cfg: 8 stages, SwiGLU 6) in many small blocks (32 weight rows each,
// one 8-column n-tile per warp). The slot's A rows ride in the same ring
// (rows past the slot zero-filled without a read), so no k-step waits on a
// global load: A and B fragments both come from ldmatrix.
//
// Order: each output element is one fp32 accumulator fragment of
// mma.sync.m16n8k16 walking K in ascending 16-wide steps, no split-K, exactly
// gemm.cuh's order; the A fragment words are the same words load_a reads
// (rows past the slot are zero) and the B fragments come from ldmatrix of the
// W rows (== load_b_nk). So a row gets the bits the 64/128-row prefill tiles
// give it: the kernel tests compare the two.
//
// SWIGLU: warp w owns the gate n-tile (W rows c0 + 8w ..) and the matching up
// n-tile (rows I + c0 + 8w ..), so a lane holds g and u of the same output
// and writes bf16(silu(g) * u) (gemm_pipe_kernel's epilogue expression).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "dot.cuh"
#include "gemm.cuh"

#if !BARO_HIP
namespace baro_gpu {

constexpr int kRows16Warps = 4;  // warps per block by default (Rows16Cfg's WARPS)
constexpr int kRows16BK = 128;                // k per stage: 8 mma k-steps
constexpr int kRows16Ld = kRows16BK + 8;      // smem row stride (272 B: ldmatrix conflict-free)
constexpr int kRows16Chunks = kRows16BK / 8;  // 16-byte chunks per W row per stage

// Stages: a decode GEMM has about one block per SM, and a block's K walk costs about
// (K stages / stages in flight) copy latencies, so the ring is deep: 8 x 12 KB (SwiGLU
// 6 x 20 KB), 2 blocks (SwiGLU 1) per SM. Measured on the H200: 12.0 us per GEMM on average
// in a decode step with 4 stages, 12.6 with 8; m = 1 calls now run on gemm_row1.cuh.
// LIGHT halves the ring (4 x 12 KB, SwiGLU 3 x 20 KB) so twice the blocks share an SM: a
// grouped MoE call of many sequences launches tens of blocks per SM, each a short K walk
// (the down GEMM's K = I = 512 is 4 stages), where a block's fill and drain are its cost and
// blocks side by side hide each other's. The ring depth never touches the arithmetic.
// WARPS: warps per block, 8 output columns each. Fewer warps make narrower blocks, more of them:
// a weight of few columns (the router, the shared expert) then still spreads over the SMs. The
// K walk of every column is the same whatever the block's width.
// MT: m16 tiles per slot (plain GEMMs only; 1 elsewhere). A slot of 32 or 64 rows reads its W
// columns once where 16-row slots read them once per slot: at 64 rows out_proj's 4 slots of a
// column block read the same W four times through L2. Each output element's accumulator and
// K walk are unchanged.
template <bool SWIGLU, bool LIGHT = false, int WARPS = kRows16Warps, int MT = 1>
struct Rows16Cfg {
  static constexpr int kWarps = WARPS;
  static constexpr int kARows = 16 * MT;                  // A rows per stage
  static constexpr int kThreads = WARPS * BARO_WARP;
  static constexpr int kStages = LIGHT ? (SWIGLU ? 3 : 4) : (SWIGLU ? 6 : 8);
  static constexpr int NT = SWIGLU ? 2 : 1;               // n-tiles per warp
  static constexpr int kWRows = WARPS * NT * 8;           // W rows per block
  static constexpr int kOutCols = WARPS * 8;              // output columns per block
  static constexpr int kStageElems = (kARows + kWRows) * kRows16Ld;  // A tiles, then W rows
  static constexpr int kSmemBytes = kStages * kStageElems * 2;
  static constexpr int kCopies = kWRows * kRows16Chunks / kThreads;  // W, per thread per stage
  static constexpr int kACopies = kARows * kRows16Chunks / kThreads;  // A, per thread per stage
  static_assert(kWRows * kRows16Chunks % kThreads == 0, "copy split");
  static_assert(kARows * kRows16Chunks % kThreads == 0, "copy split");
  static_assert(MT == 1 || !SWIGLU, "tall slots for plain GEMMs only");
  static_assert(kThreads % kRows16Chunks == 0, "whole W rows per copy step");
};

// Grid (row slots, ceil(out_n / (8 WARPS))). Requires p.vec (K % 8 == 0, 16-byte
// aligned A and W) and slot_rows <= 16 MT.
template <bool SWIGLU, bool LIGHT, int WARPS, int MT = 1>
__global__ void __launch_bounds__(WARPS * BARO_WARP) gemm_rows16_kernel(GemmParams p) {
  using Cfg = Rows16Cfg<SWIGLU, LIGHT, WARPS, MT>;
  constexpr int kARows = Cfg::kARows;
  constexpr int kRows16Warps = Cfg::kWarps;
  constexpr int kRows16Threads = Cfg::kThreads;
  constexpr int NT = Cfg::NT;
  extern __shared__ __align__(16) uint16_t rows16_smem[];  // Cfg::kSmemBytes

  int64_t group = 0, r0 = 0, rc64 = 0;
  if (!gemm_slot(p, blockIdx.x, group, r0, rc64)) return;
  const int rc = static_cast<int>(rc64 < kARows ? rc64 : kARows);
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * Cfg::kOutCols;
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  if (c0 >= out_n) return;
  const int nc = out_n - c0 < Cfg::kOutCols ? static_cast<int>(out_n - c0) : Cfg::kOutCols;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t K = p.K;
  const int n_k = static_cast<int>((K + kRows16BK - 1) / kRows16BK);

  // ---- copies: chunk tid & 15 of stage rows (tid >> 4) + 8 i; A rows 0..16 MT - 1, then W ----
  const int cp_chunk = tid & (kRows16Chunks - 1);
  const int cp_row = tid / kRows16Chunks;
  constexpr int kRowStep = kRows16Threads / kRows16Chunks;  // 8 with 4 warps
  int64_t a_off[Cfg::kACopies];  // -1: a row past the slot (zero-filled)
#pragma unroll
  for (int i = 0; i < Cfg::kACopies; ++i) {
    const int r = cp_row + kRowStep * i;
    a_off[i] = -1;
    if (r < rc) {
      const int64_t s = r0 + r;
      const int64_t ar = p.a_rows != nullptr ? static_cast<int64_t>(p.a_rows[s]) : s;
      a_off[i] = ar * p.lda + cp_chunk * 8;
    }
  }
  // The folded shared expert's tiles read W_last, and plain W rows n >= n_split read W_tail
  // (moe.cu's fold: the shared gate after the router's rows); gemm.cuh's GemmParams.
  const uint16_t* wbase = p.W_last != nullptr && group == p.last_group ? p.W_last : p.W + group * p.w_group_stride;
  const uint16_t* w_src[Cfg::kCopies];
  bool w_ok[Cfg::kCopies];
#pragma unroll
  for (int i = 0; i < Cfg::kCopies; ++i) {
    const int j = cp_row + kRowStep * i;  // W row of the tile
    int rel;                              // its output column, relative to c0
    int64_t wrow;
    if (SWIGLU) {
      rel = j % Cfg::kOutCols;
      wrow = (j >= Cfg::kOutCols ? p.swiglu_I : 0) + c0 + rel;
    } else {
      rel = j;
      wrow = c0 + j;
    }
    w_ok[i] = rel < nc;
    if (!w_ok[i]) wrow = 0;
    w_src[i] = (p.W_tail != nullptr && wrow >= p.n_split ? p.W_tail + (wrow - p.n_split) * p.ldw
                                                          : wbase + wrow * p.ldw) +
               cp_chunk * 8;
  }
  const uint32_t smem0 = smem_u32(rows16_smem);
  auto load_stage = [&](int kt, int slot) {
    const int64_t k0 = static_cast<int64_t>(kt) * kRows16BK;
    const bool k_ok = k0 + cp_chunk * 8 < K;  // K % 8 == 0: a chunk is wholly in or past K
    const uint32_t base = smem0 + 2 * (slot * Cfg::kStageElems + cp_row * kRows16Ld + cp_chunk * 8);
#pragma unroll
    for (int i = 0; i < Cfg::kACopies; ++i) {
      const bool ok = a_off[i] >= 0 && k_ok;
      cp_async16(base + 2 * kRowStep * i * kRows16Ld, ok ? p.A + a_off[i] + k0 : p.A, ok);
    }
#pragma unroll
    for (int i = 0; i < Cfg::kCopies; ++i) {
      const bool ok = w_ok[i] && k_ok;
      cp_async16(base + 2 * (kARows + kRowStep * i) * kRows16Ld, ok ? w_src[i] + k0 : p.W, ok);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][b][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < n_k) load_stage(s, s);
    cp_async_commit();
  }

  // A x4 (== load_a): lane l gives row l & 15, k chunk l >> 4 of one 16-wide step.
  // B x4 of one n-tile: matrices (n 0-7, k 0-7), (k 8-15), (k 16-23), (k 24-31)
  // = the B fragments of two k-steps; lane l gives row l & 7, chunk l >> 3.
  const int a_lrow = lane & 15, a_lchunk = lane >> 4;
  const int b_lrow = lane & 7, b_lchunk = lane >> 3;
  int b_row[NT];
#pragma unroll
  for (int b = 0; b < NT; ++b) b_row[b] = kARows + (b * kRows16Warps + warp) * 8 + b_lrow;

  for (int kt = 0; kt < n_k; ++kt) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();  // stage kt visible; stage kt-1 consumed by every warp
    {
      const int nt = kt + Cfg::kStages - 1;
      if (nt < n_k) load_stage(nt, nt % Cfg::kStages);
      cp_async_commit();
    }
    const uint32_t base = smem0 + 2 * (kt % Cfg::kStages) * Cfg::kStageElems;
    const int64_t k0 = static_cast<int64_t>(kt) * kRows16BK;
#pragma unroll
    for (int kk2 = 0; kk2 < kRows16BK / 32; ++kk2) {  // pairs of k-steps
      if (k0 + kk2 * 32 < K) {
        FragB fb[NT][2];
#pragma unroll
        for (int b = 0; b < NT; ++b)
          ldsm_x4(base + 2 * (b_row[b] * kRows16Ld + kk2 * 32 + b_lchunk * 8), fb[b][0].r[0],
                  fb[b][0].r[1], fb[b][1].r[0], fb[b][1].r[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (k0 + kk2 * 32 + h * 16 < K) {  // uniform: steps wholly past K are skipped
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              FragA fa;  // zeros past K and past the slot come from the copies
              ldsm_x4(base + 2 * ((16 * t + a_lrow) * kRows16Ld + kk2 * 32 + h * 16 + a_lchunk * 8), fa.r[0],
                      fa.r[1], fa.r[2], fa.r[3]);
#pragma unroll
              for (int b = 0; b < NT; ++b) mma_16816(acc[t][b], fa, fb[b][h]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy may still target smem when the block exits

  // ---- epilogue ----
  const int c = warp * 8 + 2 * t;
  const bool out2 = p.out2 != 0;
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 16 * t + g + 8 * e;
      if (r >= rc) continue;
      const int64_t orow = (r0 + r) * p.ldc;
      if (SWIGLU)
        store_pair(p.Act + orow + c0 + c, f32_to_bf16(siluf_(acc[t][0][2 * e]) * acc[t][1][2 * e]),
                   f32_to_bf16(siluf_(acc[t][0][2 * e + 1]) * acc[t][1][2 * e + 1]), c, nc, out2);
      else
        store_pair(p.C + orow + c0 + c, acc[t][0][2 * e], acc[t][0][2 * e + 1], c, nc, out2);
    }
  }
}

}  // namespace baro_gpu
#endif  // !BARO_HIP
