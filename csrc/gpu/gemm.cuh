// baro_jax GPU: the GEMM kernels, C[s, n] = sum_k A[row(s), k] * W[group][n, k]
// (bf16 in, fp32 out), built on dot.cuh's mma_16816 fragment layout.
//
// Order (every kernel here, every tile shape): each output element is ONE fp32
// accumulator fragment of mma.sync.m16n8k16 that walks K in ascending 16-wide
// steps, exact zeros inside the last partial step, steps wholly past K
// skipped, no split-K. The instruction sequence that touches an element is the
// same whatever the tile shape, the row's position in the tile or the other
// rows, so the kernels below give the same bits for every m (docs/DESIGN.md §2).
//
// Two families:
//  - gemm_kernel: the simple synchronous kernel (16x32 decode tiles, 64x64
//    fallback when 16-byte loads are not possible, and the whole HIP path);
//  - gemm_pipe_kernel (CUDA only): 8 warps, 64x128 or 128x128 tiles, BK 64,
//    a 3-stage (or deeper) cp.async ring in XOR-swizzled shared memory, ldmatrix.x4
//    fragment loads (the same 32-bit words load_a / load_b_nk read, so the
//    same registers go into the same mma), optional fused SwiGLU epilogue.
//
// One kernel serves:
//  - plain matmul (tiles == nullptr): row slot b covers rows
//    [b*slot_rows, b*slot_rows + slot_rows);
//  - grouped matmul for MoE (tiles != nullptr): slot b covers rows
//    [row_start, row_start+row_count) of the sorted row space, all of one
//    expert `group`; A rows are gathered through a_rows (nullable).
// Grid: x = row slots, y = N tiles.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dot.cuh"
#include "portability.h"

namespace baro_gpu {

// gemm_row1's share of the one-token MoE (moe.cu, the fold): kind kRoute on the grouped
// gate/up GEMM, kCombine on the grouped down GEMM; kNone everywhere else.
struct Row1Moe {
  enum Kind { kNone = 0, kRoute = 1, kCombine = 2 };
  int kind = kNone;
  // kRoute: every warp runs the one-token top-k and grouping (route_one_row) on the router
  // logits itself, into its shared memory, and reads its tiles from there; block 0 also
  // stores ids / wts / srow / inv / tiles / n_tiles for the down GEMM and zeroes counters.
  float* logits = nullptr;
  int E = 0, k = 0, fold_group = 0, S = 0;
  int32_t *ids = nullptr, *srow = nullptr, *inv = nullptr, *tiles = nullptr, *n_tiles = nullptr;
  float* wts = nullptr;
  int64_t max_tiles = 0;
  const int32_t* slots = nullptr;
  int host = 0;  // the routed experts with no slot are read from GemmParams::W_host (host_group)
  // kCombine: counters[u] counts the slots done of output column unit u (n_counters of
  // them, zero on entry: the kRoute GEMM zeroes them); the warp that completes a unit's
  // last slot writes out[c] = the slot-order sum over the k pairs + sigmoid(sgl) * the
  // shared expert's row (moe_combine_kernel's arithmetic).
  uint32_t* counters = nullptr;
  int n_counters = 0;
  const float* sout = nullptr;
  const float* sgl = nullptr;
  float* out = nullptr;
};

struct GemmParams {
  const uint16_t* A = nullptr;  // rows of length >= K, stride lda
  int64_t lda = 0;
  const int32_t* a_rows = nullptr;  // sorted row s -> A row; nullptr = identity
  const uint16_t* W = nullptr;      // [groups][N][ldw]
  int64_t ldw = 0;
  int64_t w_group_stride = 0;  // elements between groups
  int64_t M = 0, N = 0, K = 0;  // M: rows when tiles == nullptr
  float* C = nullptr;           // [rows][ldc], row s in sorted space (fp32 epilogue)
  int64_t ldc = 0;
  // The wgmma GEMM only (launch_gemm's stored16 says whether it ran): output columns below
  // c16_cols (even) rounded to bf16 into C16 (row stride ldc16) instead of C, for readers that
  // round them to bf16 first, so half the bytes give the same bits: the MoE's pair rows (every
  // column, NUMERICS.md moe step 3) and the GDN projection's conv channels (baro_matmul's
  // bf16_cols: C16 is C's own rows, packed at their start, ldc16 = 2 ldc).
  uint16_t* C16 = nullptr;
  int64_t ldc16 = 0;
  int64_t c16_cols = 0;
  const int32_t* tiles = nullptr;    // [max_tiles][3] = (group, row_start, row_count)
  const int32_t* n_tiles = nullptr;  // device scalar (tiles != nullptr)
  // Grouped calls, for the wgmma GEMM's tensor maps (gemm_wgmma.cu; 0: unknown, it does not run):
  // the groups W holds and, where A is read in place (a_rows == nullptr), the rows of A.
  int64_t w_groups = 0;
  int64_t a_total_rows = 0;
  // Fused SwiGLU (pipelined kernel only): W holds 2*swiglu_I rows (gate rows
  // [0, I), up rows [I, 2I)); act[s][j] = bf16(silu(g[s][j]) * u[s][j]) is
  // written to Act (row stride ldc) instead of C. N must equal 2 * swiglu_I.
  uint16_t* Act = nullptr;
  int64_t swiglu_I = 0;
  // gemm_row1 and gemm_rows16 only (launch_gemm refuses them elsewhere: gemm_split_w_runs),
  // for the MoE's fold (moe.cu): W rows n >= n_split come from W_tail (row n - n_split,
  // stride ldw): the shared gate's row after the router's E; a tile of group last_group
  // (never a real group: negative) reads W_last instead of W + group * w_group_stride: the
  // shared expert.
  const uint16_t* W_tail = nullptr;
  int64_t n_split = 0;
  const uint16_t* W_last = nullptr;
  int64_t last_group = -1;
  // A tile of group g <= kHostGroup0 reads group kHostGroup0 - g of W_host ([.][N][ldw], the
  // same group stride): tier decode's experts with no pool slot (baro_moe_host), in the pinned
  // host store itself (w_host_mapped: read over the host link with 16-byte cp.async, the bulk
  // copies are not relied on for host memory) or staged in the call's device scratch.
  const uint16_t* W_host = nullptr;
  int w_host_mapped = 0;
  Row1Moe moe;  // gemm_row1 only
  int pdl = 0;  // gemm_row1 only: launch_dependent (not the first kernel of its handler)
  // Filled by launch_gemm:
  int slot_rows = 0;  // rows per plain-matmul slot / max rows per grouped tile
  int vec = 0;        // 16-byte global loads allowed
  int out2 = 0;       // 2-element (8-byte fp32 / 4-byte bf16) stores allowed
  // The grid order of the kernels launch_tiled starts (gemm_pipe_kernel, gemm_rows16_kernel;
  // BARO_PIPE_ORDER; the simple gemm_kernel's own grid is always rows): 0, blockIdx.x the row slot and
  // y the column tile (a column tile's slots run together); 1, x the column tile and y the slot,
  // so a slot's column tiles run together: its A rows are read from DRAM once and an expert's
  // weight panels once for its tiles. Which block computes a tile, never how.
  int cols_fast = 0;
};
// The (row slot, column tile) a block of launch_tiled's grid computes (GemmParams::cols_fast).
BARO_DEV unsigned gemm_block_slot(const GemmParams& p) { return p.cols_fast ? blockIdx.y : blockIdx.x; }
BARO_DEV unsigned gemm_block_col(const GemmParams& p) { return p.cols_fast ? blockIdx.x : blockIdx.y; }

// Columns c and c + 1 of an output row (dst points at column c): one 8-byte (fp32) or
// 4-byte (bf16) store when pair stores are allowed and both are inside nc, else each alone.
BARO_DEV void store_pair(float* dst, float v0, float v1, int c, int nc, bool out2) {
  if (out2 && c + 1 < nc) {
    *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
  } else {
    if (c < nc) dst[0] = v0;
    if (c + 1 < nc) dst[1] = v1;
  }
}
BARO_DEV void store_pair(uint16_t* dst, uint16_t v0, uint16_t v1, int c, int nc, bool out2) {
  if (out2 && c + 1 < nc) {
    *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(v0) | (static_cast<uint32_t>(v1) << 16);
  } else {
    if (c < nc) dst[0] = v0;
    if (c + 1 < nc) dst[1] = v1;
  }
}

// ===========================================================================
// Simple synchronous kernel
// ===========================================================================

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

// Which rows / group a slot owns; false when the slot is empty.
// tiles / n_tiles: p's, or a copy of them elsewhere (gemm_row1's route in shared memory).
BARO_DEV bool gemm_slot(const GemmParams& p, const int32_t* tiles, const int32_t* n_tiles, int64_t slot,
                        int64_t& group, int64_t& r0, int64_t& rc) {
  group = 0;
  if (tiles != nullptr) {
    if (slot >= static_cast<int64_t>(*n_tiles)) return false;
    group = tiles[3 * slot + 0];
    r0 = tiles[3 * slot + 1];
    rc = tiles[3 * slot + 2];
  } else {
    r0 = slot * p.slot_rows;
    rc = p.M - r0;
  }
  if (rc > p.slot_rows) rc = p.slot_rows;
  return rc > 0;
}
BARO_DEV bool gemm_slot(const GemmParams& p, int64_t slot, int64_t& group, int64_t& r0, int64_t& rc) {
  return gemm_slot(p, p.tiles, p.n_tiles, slot, group, r0, rc);
}

// A slot may hold more rows than BM (a grouped tile sized for a larger
// config): the block walks them in BM-row sub-tiles. Each row still gets its
// own unchanged mma sequence.
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

  int64_t group = 0, r0s = 0, rcs = 0;
  if (!gemm_slot(p, blockIdx.x, group, r0s, rcs)) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  if (n0 >= p.N) return;
  const int64_t nc64 = p.N - n0;
  const int nc = nc64 < BN ? static_cast<int>(nc64) : BN;
  const uint16_t* W = p.W + group * p.w_group_stride + n0 * p.ldw;
  const bool vec = p.vec != 0;

  const int warp = warp_id();
  const int wm = warp / WN, wn = warp % WN;

  for (int64_t sub = 0; sub < rcs; sub += BM) {
    const int64_t r0 = r0s + sub;
    const int64_t rleft = rcs - sub;
    const int rc = rleft < BM ? static_cast<int>(rleft) : BM;

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
      for (int b = 0; b < NT; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;

    for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
      gemm_load_tile<BM, THREADS, BK>(As, p.A, p.lda, p.a_rows, r0, rc, k0, p.K, vec);
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
}

#if !BARO_HIP
// ===========================================================================
// Pipelined kernel (sm_80+: cp.async, ldmatrix, mma.sync)
// ===========================================================================
//
// Shared memory per stage: A tile [BM][64] then B tile [BN][64] bf16, each row
// 128 bytes = 8 chunks of 16 bytes; chunk c of row r lives at physical chunk
// c ^ (r & 7). An ldmatrix phase reads 8 consecutive rows at one logical
// chunk, which the XOR spreads over 8 distinct 16-byte bank groups, and a
// cp.async warp writes whole rows, so both sides are conflict-free.
//
// Zero padding: a 16-byte chunk past K (K % 8 == 0 here, so a chunk is wholly
// inside or outside), or of a row past the tile edge, is copied with src-size
// 0, which fills it with zeros; the mma sees the same exact zeros the simple
// kernel stores.

constexpr int kPipeBK = 64;
constexpr int kPipeThreads = 256;  // 8 warps
constexpr int kPipeRowBytes = kPipeBK * 2;

BARO_DEV uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

BARO_DEV void cp_async16(uint32_t dst, const void* src, bool full) {
  const int n = full ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
BARO_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
BARO_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

BARO_DEV void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

BARO_DEV uint32_t pipe_swz(int row, int chunk) {
  return static_cast<uint32_t>(row * kPipeRowBytes + ((chunk ^ (row & 7)) << 4));
}

// BM x BN block tile, WM x WN warps (WM * WN == 8), STAGES-deep ring.
// SWIGLU: B tile rows interleave gate and up rows in groups of 8 (n8 tile 2q
// = gate columns, 2q+1 = the matching up columns), so one lane holds g and u
// of the same (row, column) and writes bf16(silu(g) * u) directly.
template <int BM, int BN, int WM, int WN, int STAGES, bool SWIGLU>
struct PipeCfg {
  static_assert(WM * WN * BARO_WARP == kPipeThreads, "8 warps");
  static constexpr int kWarpM = BM / WM, kWarpN = BN / WN;
  static constexpr int MT = kWarpM / 16, NT = kWarpN / 8;
  static_assert(MT * 16 * WM == BM && NT * 8 * WN == BN && NT % 2 == 0, "tile shape");
  static constexpr int kStageBytes = (BM + BN) * kPipeRowBytes;
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  static constexpr int kOutCols = SWIGLU ? BN / 2 : BN;  // output columns per block
  static constexpr int kMinBlocks = BM >= 128 ? 2 : 3;
};

template <int BM, int BN, int WM, int WN, int STAGES, bool SWIGLU>
__global__ void __launch_bounds__(kPipeThreads, (PipeCfg<BM, BN, WM, WN, STAGES, SWIGLU>::kMinBlocks))
    gemm_pipe_kernel(GemmParams p) {
  using Cfg = PipeCfg<BM, BN, WM, WN, STAGES, SWIGLU>;
  constexpr int MT = Cfg::MT, NT = Cfg::NT;
  constexpr int kStage = Cfg::kStageBytes;
  constexpr int kAIters = BM * 8 / kPipeThreads;  // 16-byte chunks per thread per stage
  constexpr int kBIters = BN * 8 / kPipeThreads;
  extern __shared__ __align__(128) uint8_t pipe_smem[];

  int64_t group = 0, r0 = 0, rc64 = 0;
  if (!gemm_slot(p, gemm_block_slot(p), group, r0, rc64)) return;
  const int rc = static_cast<int>(rc64 < BM ? rc64 : BM);  // slot_rows == BM (host)
  const int64_t c0 = static_cast<int64_t>(gemm_block_col(p)) * Cfg::kOutCols;  // first output column
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  if (c0 >= out_n) return;
  const int nc = out_n - c0 < Cfg::kOutCols ? static_cast<int>(out_n - c0) : Cfg::kOutCols;

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const uint32_t smem0 = smem_u32(pipe_smem);
  const int64_t K = p.K;
  const int n_k = static_cast<int>((K + kPipeBK - 1) / kPipeBK);

  // ---- per-thread copy assignments (fixed for the whole K walk) ----
  // chunk q = tid + 256 i: row q / 8, chunk tid % 8 (the same for every i).
  const int ld_chunk = tid & 7;
  const int ld_row = tid >> 3;  // + 32 i
  // A: the global row of each copied row (-1: past the tile, zero-filled);
  // 32-bit indices keep the register budget (rows < 2^31, host-checked).
  int32_t a_idx[kAIters];
#pragma unroll
  for (int i = 0; i < kAIters; ++i) {
    const int r = ld_row + 32 * i;
    const int64_t s = r0 + r;
    a_idx[i] = r < rc ? (p.a_rows != nullptr ? p.a_rows[s] : static_cast<int32_t>(s)) : -1;
  }
  // B: rows of thread i are 32 i apart (plain) or 16 i output columns apart
  // (SwiGLU: 32 smem rows = 2 gate/up pairs of 8), so one base pointer serves.
  int b_rel0;      // first output column / W row of this thread, relative to c0
  int64_t b_row0;  // its W row
  int b_step;      // W rows / output columns between consecutive i
  if (SWIGLU) {
    b_rel0 = (ld_row >> 4) * 8 + (ld_row & 7);
    b_row0 = ((ld_row >> 3) & 1 ? p.swiglu_I : 0) + c0 + b_rel0;
    b_step = 16;
  } else {
    b_rel0 = ld_row;
    b_row0 = c0 + ld_row;
    b_step = 32;
  }
  const uint16_t* b_src = p.W + group * p.w_group_stride + b_row0 * p.ldw + ld_chunk * 8;
  const int64_t b_stride = static_cast<int64_t>(b_step) * p.ldw;
  const uint16_t* a_base = p.A + ld_chunk * 8;
  const uint32_t a_dst = pipe_swz(ld_row, ld_chunk);  // + 32 i rows: same swizzle
  const uint32_t b_dst = BM * kPipeRowBytes + a_dst;

  auto load_stage = [&](int kt, int slot) {
    const int64_t k0 = static_cast<int64_t>(kt) * kPipeBK;
    const bool k_ok = k0 + ld_chunk * 8 < K;
    const uint32_t base = smem0 + slot * kStage;
#pragma unroll
    for (int i = 0; i < kAIters; ++i) {
      const bool ok = a_idx[i] >= 0 && k_ok;
      cp_async16(base + a_dst + i * 32 * kPipeRowBytes,
                 ok ? a_base + static_cast<int64_t>(a_idx[i]) * p.lda + k0 : p.A, ok);
    }
#pragma unroll
    for (int i = 0; i < kBIters; ++i) {
      const bool ok = b_rel0 + i * b_step < nc && k_ok;
      cp_async16(base + b_dst + i * 32 * kPipeRowBytes, ok ? b_src + i * b_stride + k0 : p.W, ok);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_k) load_stage(s, s);
    cp_async_commit();  // always: keeps the group count uniform
  }

  // ldmatrix lane addressing (see dot.cuh for the fragment layout):
  //  A x4: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  //        (rows 8-15, k 8-15) -> lane l gives row l & 15, k chunk l >> 4.
  //  B x4 (two n8 tiles): (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
  //        (n 8-15, k 8-15) -> lane l gives n (l & 7) + 8 (l >> 4), k chunk (l >> 3) & 1.
  // Every row base is a multiple of 8, so the swizzle term is row & 7 = l & 7.
  const int a_row = wm * Cfg::kWarpM + (lane & 15);
  const int a_hi = lane >> 4;
  const int b_row = wn * Cfg::kWarpN + (lane & 7) + ((lane >> 4) << 3);
  const int b_hi = (lane >> 3) & 1;
  const int sw = lane & 7;

  // A group's last tile is often part empty (an 8k prompt gives an expert about 256 rows: half
  // the experts get a third 128-row tile of a few rows). A warp's m fragments wholly past the
  // tile's valid rows are never stored, so it skips their loads and mmas (a warp with none left
  // only copies and waits at the barriers, freeing the SM for the other resident blocks). Every
  // stored element is still its one accumulator over the same k-steps: the same bits.
  const int live = (rc - wm * Cfg::kWarpM + 15) / 16;  // m fragments with a valid row (may be <= 0)
  auto k_walk = [&](auto partial) {
    for (int kt = 0; kt < n_k; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt visible to all; stage kt-1 fully consumed
      {
        const int nt = kt + STAGES - 1;
        if (nt < n_k) load_stage(nt, nt % STAGES);
        cp_async_commit();
      }
      if (decltype(partial)::value && live <= 0) continue;  // uniform per warp
      const uint32_t base = smem0 + (kt % STAGES) * kStage;
      const int64_t k0 = static_cast<int64_t>(kt) * kPipeBK;
      auto k_step = [&](int kk) {
        FragA fa[MT];
        FragB fb[NT];
#pragma unroll
        for (int a = 0; a < MT; ++a) {
          if (decltype(partial)::value && a >= live) continue;
          const int row = a_row + a * 16;
          ldsm_x4(base + row * kPipeRowBytes + (((2 * kk + a_hi) ^ sw) << 4), fa[a].r[0],
                  fa[a].r[1], fa[a].r[2], fa[a].r[3]);
        }
#pragma unroll
        for (int b = 0; b < NT / 2; ++b) {
          const int row = b_row + b * 16;
          ldsm_x4(base + BM * kPipeRowBytes + row * kPipeRowBytes + (((2 * kk + b_hi) ^ sw) << 4),
                  fb[2 * b].r[0], fb[2 * b].r[1], fb[2 * b + 1].r[0], fb[2 * b + 1].r[1]);
        }
#pragma unroll
        for (int a = 0; a < MT; ++a) {
          if (decltype(partial)::value && a >= live) continue;
#pragma unroll
          for (int b = 0; b < NT; ++b) mma_16816(acc[a][b], fa[a], fb[b]);
        }
      };
      if (k0 + kPipeBK <= K) {
        // whole stage inside K: one straight-line block, so the fragment loads
        // of step kk+1 can overlap the mma of step kk
#pragma unroll
        for (int kk = 0; kk < kPipeBK / 16; ++kk) k_step(kk);
      } else {
#pragma unroll
        for (int kk = 0; kk < kPipeBK / 16; ++kk)
          if (k0 + kk * 16 < K) k_step(kk);  // uniform: skip steps wholly past K
      }
    }
  };
  // full warps keep the straight-line walk; the guards only exist in the partial one
  if (live >= MT) k_walk(std::false_type{});
  else k_walk(std::true_type{});
  cp_async_wait<0>();  // no copy may still target smem when the block exits

  // ---- epilogue ----
  const int g = lane >> 2, t = lane & 3;
  const bool out2 = p.out2 != 0;
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * Cfg::kWarpM + a * 16 + g + 8 * h;
      if (r >= rc) continue;
      const int64_t orow = (r0 + r) * p.ldc;
      if (SWIGLU) {
#pragma unroll
        for (int q = 0; q < NT / 2; ++q) {
          const int c = (wn * NT / 2 + q) * 8 + 2 * t;
          const float g0 = acc[a][2 * q][2 * h], g1 = acc[a][2 * q][2 * h + 1];
          const float u0 = acc[a][2 * q + 1][2 * h], u1 = acc[a][2 * q + 1][2 * h + 1];
          store_pair(p.Act + orow + c0 + c, f32_to_bf16(siluf_(g0) * u0), f32_to_bf16(siluf_(g1) * u1), c, nc,
                     out2);
        }
      } else {
#pragma unroll
        for (int b = 0; b < NT; ++b) {
          const int c = wn * Cfg::kWarpN + b * 8 + 2 * t;
          store_pair(p.C + orow + c0 + c, acc[a][b][2 * h], acc[a][b][2 * h + 1], c, nc, out2);
        }
      }
    }
}
#endif  // !BARO_HIP

}  // namespace baro_gpu
