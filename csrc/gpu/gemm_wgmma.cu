// baro_jax GPU: the Hopper (sm_90a) prefill GEMM, the default there (BARO_GEMM_WGMMA=0: off; matmul.cu's
// launch_gemm): C[m, N] = A[m, K] . W[N, K]^T (bf16 in, fp32 accumulate) for plain dense calls of
// at least 64 rows, with gemm_pipe_kernel's two epilogues (fp32 C, or the fused SwiGLU into bf16
// Act), on wgmma with both operands in shared memory, brought in by TMA.
//
// Why the bits are gemm_pipe_kernel's (and so every other config's, decode's one-row kernel
// included; docs/DESIGN.md §2). The value of an output element is decided by the chain of
// tensor-core steps that touch it: gemm_pipe_kernel zeroes one fp32 accumulator and then adds one
// mma.sync.m16n8k16 per 16-wide K step, ascending, skipping the steps wholly past K, with exact
// zeros in the last partial step. Here each element also has exactly one fp32 accumulator (a
// register of one thread of one consumer warpgroup), zeroed, and the K walk issues, for every
// 64-wide K block in ascending order, its k16 wgmmas in ascending order into that accumulator
// (scale-d 1 always: the first step adds to +0.0 as mma.sync does; steps wholly past K skipped
// the same way, uniformly). A wgmma.m64nNk16 is, per output element, the same k16 step as
// mma.sync.m16n8k16: the tensor core's fixed internal order over those 16 products and the one
// addition into the accumulator; benchmarks/wgmma_probe.cu measured the two byte-equal for bf16
// K walks on the H200, and attention_wgmma.cu relies on the same fact. Only the mapping of
// elements to registers differs (warp w of a warpgroup holds rows 16w..16w+15; within every
// 8-column chunk a thread holds the registers mma_16816 would give it), not any element's chain.
// The operand values are the same bf16 bits: TMA copies A and W unchanged and fills positions
// past K with zeros, as gemm_pipe_kernel's zero-sized cp.async does. Rows past M or N are zeros
// where their box is partly inside and stale shared memory where the box is wholly outside (not
// issued); either way they only reach accumulator rows or columns that are never stored, since
// an element reads only its own row of A and its own row of W.
// There is no split-K and no stream-K: a row's bits never depend on the call's row count or on
// the tile the row lands in, so prefill through this kernel equals decode.
//
// Shape: BM x BN output tiles (BM 128: two consumer warpgroups of 64 rows, or 64: one; BN 128, or
// 256 with BARO_GEMM_WGMMA_BN), one m64n128k16 per consumer warpgroup and 128 W rows per k16 step;
// a producer warp whose lane 0 issues the TMA boxes (64 K-elements = 128 bytes x 64 rows, the
// 128-byte swizzle) into a kStages ring with a full mbarrier (the producer's arrival with the
// stage's byte count, completed by the copies) and an empty mbarrier (one arrival per consumer
// thread once its wgmmas reading the stage are done) per stage. SwiGLU: the W tile's first BN / 2
// rows are gate rows c0.., the last BN / 2 the up rows I + c0.., so gate chunk q (column 8q..)
// and up chunk q + BN / 16 (the same up column) sit in the same thread, which writes
// bf16(silu(g) * u) with gemm_pipe_kernel's expression. A block computes one tile, or with
// BARO_GEMM_WGMMA_PERSIST several on one ring (WgGemmWalk).
//
// Grouped calls (BARO_GEMM_WGMMA_GROUPED): the tiles are the tile list's slots, W's boxes from the
// tile's group, A's rows read in place through A's tensor map: the MoE's down GEMM in prefill
// (=down and =sorted: the sorted pairs' activations) and its gate/up GEMM (=sorted: the pairs'
// rows of h copied into sorted order first, moe.cu). In 128-row W tiles and a row-fast walk both
// lost to mma.sync at 8k; with a slot's column tiles side by side and 256-row W tiles they win at
// 4,096 rows and more (docs/PERF.md 2026-12-06), where auto takes them. A gather of gate/up's rows
// inside this kernel (cp.async by a producer warp, then a warpgroup) lost and was removed.
// Plain calls passed their byte tests on the H200 (0695bc5), the grouped paths on the H100
// (9f5d3b3; the rings of 3 and 4, 2b7c437); docs/PERF.md has their speed.
#include <atomic>
#include <cstdint>

#include "common.cuh"
#include "gemm.cuh"
#include "launch.h"

#if !BARO_HIP && defined(BARO_WGMMA) && BARO_WGMMA
#define BARO_WGMMA_GEMM_BUILT 1
#else
#define BARO_WGMMA_GEMM_BUILT 0
#endif

#if BARO_WGMMA_GEMM_BUILT

#include "wgmma_util.cuh"

namespace baro_gpu {

constexpr int kWgBK = 64;           // K elements per stage (one 128-byte swizzle span)
constexpr int kWgBox = 64;          // rows per TMA box
constexpr int kWgBoxBytes = kWgBox * kWgBK * 2;  // 8 KB

// STAGES: the ring depth, 4 (the default) or 3 (BARO_GEMM_WGMMA_RING=3). A 128-row block's ring of 4
// (128 KB) leaves room for one block per SM, so each block's start (barriers, the first TMA round
// trip) and its stores leave the tensor cores idle; 3 stages (96 KB) fit two blocks per SM that
// cover each other's. The depth decides when a stage is refilled, never which wgmma adds what.
// BN: W rows per tile, 128 or 256 (BARO_GEMM_WGMMA_BN). A 256-row W tile brings 48 KB a stage for
// twice the products of a 128-row one's 32 KB, so a tile reads a third less from L2 per product;
// each consumer warpgroup then issues two m64n128k16 per k16 step, one per 128-column half, each
// into its own accumulators (an element's chain is the same k16 steps in the same order).
template <int BM, int STAGES = 4, int BN = 128>
struct WgGemmCfg {
  static constexpr int kStages = STAGES;
  static constexpr int kBN = BN;
  static constexpr int kHalves = BN / 128;                // m64n128 accumulator sets per warpgroup
  static constexpr int kConsumers = BM / 64;             // consumer warpgroups
  static constexpr int kThreads = kConsumers * 128 + 32;  // + the producer warp (its lane 0 issues)
  // __launch_bounds__: the registers of two blocks where the ring leaves room for two
  static constexpr int kMinBlocks = STAGES <= 3 && BM == 128 && BN == 128 ? 2 : 1;
  static constexpr int kABytes = BM * kWgBK * 2;
  static constexpr int kBBytes = BN * kWgBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;   // a ring stage: A tile, then W tile
  static constexpr int kBarOff = kStages * kStageBytes;  // full, then empty barriers
  static constexpr int kSmemBytes = kBarOff + 16 * kStages + 1024;  // + 1 KB alignment slack
  static_assert(STAGES == 3 || STAGES == 4, "ring depths built: 3 and 4");
  static_assert(BN == 128 || BN == 256, "W tiles of 128 or 256 rows");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "swizzled boxes on 1 KB");
  static_assert(kSmemBytes * kMinBlocks <= 227 * 1024, "shared memory of the blocks on one SM");
};

// a: A's rows; w: W's rows, groups one after the other (row group * N + n of a grouped call)
struct WgGemmMaps {
  CUtensorMap a, w;
};
// The call's output tiles: row_tiles (grouped: the tile list's slots) by col_tiles, numbered with
// the rows (GemmParams::cols_fast: the columns) fastest. A block computes tiles blockIdx.x,
// blockIdx.x + gridDim.x, ..: one where the grid has a block per tile, several where it is
// persistent (BARO_GEMM_WGMMA_PERSIST).
struct WgGemmWalk {
  int64_t row_tiles, col_tiles;
};

// d[16][4] += A[64 x 16] B[16 x 128], both from shared memory, K-major (no transpose).
BARO_DEV void wg_mma_128(float (&d)[16][4], uint64_t adesc, uint64_t bdesc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(adesc), "l"(bdesc), "r"(1));
}

// K-major operand rows row0.. (a multiple of 8) of a swizzled tile of 128-byte rows, at K step kk
// (16 elements = 32 bytes inside the row; the swizzle applies to the address wgmma forms, as it
// did to TMA's). SBO 1024: the next 8 rows; LBO unused (16 elements never cross a row). The same
// form as attention_wgmma.cu's wg_kdesc on its TMA path.
BARO_DEV uint64_t wg_gemm_desc(const uint8_t* tile, int row0, int kk) {
  return wg_desc_sw128(tile + row0 * 128 + kk * 32, 16, 1024);
}

// Tiles: BM-row tiles (grouped: the tile list's slots, gemm_slot's (group, rows) each) by BN-column
// W tiles (SwiGLU: BN / 2 output columns), walked as WgGemmWalk says. Threads: BM / 64 consumer
// warpgroups, then the producer warp. The ring runs on across a block's tiles (the producer fills
// the next tile's stages while the consumers store the last one's); each tile's accumulators
// start at zero and take its K walk alone, so a tile's bits do not depend on the block.
template <int BM, bool SWIGLU, int STAGES, int BN>
__global__ void __launch_bounds__(WgGemmCfg<BM, STAGES, BN>::kThreads, WgGemmCfg<BM, STAGES, BN>::kMinBlocks)
    gemm_wgmma_kernel(GemmParams p, const __grid_constant__ WgGemmMaps maps, const WgGemmWalk walk) {
  using Cfg = WgGemmCfg<BM, STAGES, BN>;
  constexpr int kHalves = Cfg::kHalves;
  constexpr int kWgStages = Cfg::kStages;
  extern __shared__ __align__(1024) uint8_t wg_gemm_smem[];
  // the 128-byte swizzle repeats on 1024 bytes: TMA and wgmma must see the same address bits
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wg_gemm_smem) + 1023) & ~uintptr_t{1023});
  const uint32_t bar0 = wg_smem_addr(smem + Cfg::kBarOff);
  auto full = [&](int s) { return bar0 + 8 * s; };
  auto empty = [&](int s) { return bar0 + 8 * (kWgStages + s); };

  // A grouped tile's rows sit at r0.. of A and C (the sorted pairs), its W rows at group * N..;
  // rows of A past the tile (the next tile's) and W rows past N (the next group's) only reach
  // accumulator rows and columns that are never stored, as TMA's zero fill past the edges does.
  constexpr int kOutCols = SWIGLU ? BN / 2 : BN;
  const int64_t n_items = walk.row_tiles * walk.col_tiles;
  // tile i's W group, first row, rows (at most BM: the launcher's tiles) and first output column;
  // false for a slot of the tile list left empty
  auto tile_of = [&](int64_t i, int64_t& group, int64_t& r0, int& rc, int64_t& c0) {
    const int64_t slot = p.cols_fast ? i / walk.col_tiles : i % walk.row_tiles;
    const int64_t col = p.cols_fast ? i % walk.col_tiles : i / walk.row_tiles;
    c0 = col * kOutCols;
    int64_t rows = 0;
    group = 0;
    if (p.tiles != nullptr) {
      if (!gemm_slot(p, slot, group, r0, rows)) return false;
    } else {
      r0 = slot * BM;
      rows = p.M - r0;
    }
    rc = static_cast<int>(rows < BM ? rows : BM);
    return rc > 0;
  };
  int64_t group = 0, r0 = 0, c0 = 0;
  int rc = 0;
  {
    // A block with no tile leaves before any barrier is met.
    bool any = false;
    for (int64_t i = blockIdx.x; i < n_items && !any; i += gridDim.x) any = tile_of(i, group, r0, rc, c0);
    if (!any) return;
  }
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t K = p.K;
  const int n_k = static_cast<int>((K + kWgBK - 1) / kWgBK);
  const int tid = threadIdx.x;
  constexpr int kConsumerThreads = Cfg::kConsumers * 128;

  if (tid == kConsumerThreads) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.a)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.w)) : "memory");
    for (int s = 0; s < kWgStages; ++s) {
      wg_mbar_init(full(s), 1);                 // the producer's arrival (+ the bytes)
      wg_mbar_init(empty(s), kConsumerThreads);  // every consumer thread, once done with the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // for the TMA unit
  }
  // the barriers initialised before anyone uses them; no block barrier after this
  __syncthreads();

  // the warp index through a shuffle: warp-uniform as far as the compiler can see (as CUTLASS does)
  const int warp_u = __shfl_sync(0xffffffffu, tid / 32, 0);
  if (warp_u >= kConsumerThreads / 32) {
    // ---- producer: lane 0 of the last warp ----
    if (tid != kConsumerThreads) return;
    uint32_t it = 0;  // the ring's position: stage it % kWgStages, its use it / kWgStages
    for (int64_t i = blockIdx.x; i < n_items; i += gridDim.x) {
      if (!tile_of(i, group, r0, rc, c0)) continue;
      // W rows of the tile's BN / 64 boxes: BN consecutive rows, or (SwiGLU) BN / 2 gate rows and
      // the BN / 2 matching up rows. Box b's first row and whether it is issued:
      const int64_t w_base = group * p.N;
      constexpr int kWBoxes = BN / kWgBox;
      auto w_box = [&](int b, int& row) {
        const int64_t col = c0 + kWgBox * (SWIGLU ? b % (kWBoxes / 2) : b);  // its first W column
        row = static_cast<int>(w_base + (SWIGLU && b >= kWBoxes / 2 ? p.swiglu_I : 0) + col);
        return col < out_n;
      };
      // Boxes wholly past M or N are not issued (no copy depends on TMA's handling of a box with
      // no element inside): their shared memory keeps whatever it held, which only ever reaches
      // accumulator rows past M or columns past N, never stored. A box partly inside is zero-filled
      // past the edge, and its whole size counts as landed bytes.
      const int a_boxes = (rc + kWgBox - 1) / kWgBox;
      int w_boxes = 0;
#pragma unroll
      for (int b = 0; b < kWBoxes; ++b) {
        int row;
        w_boxes += w_box(b, row) ? 1 : 0;
      }
      const uint32_t stage_bytes = static_cast<uint32_t>((a_boxes + w_boxes) * kWgBoxBytes);
      for (int kt = 0; kt < n_k; ++kt, ++it) {
        const int s = static_cast<int>(it % kWgStages);
        const uint32_t use = it / kWgStages;
        if (use > 0) wg_mbar_wait(empty(s), (use - 1) & 1);  // the stage's last use done
        uint8_t* st = smem + s * Cfg::kStageBytes;
        const int k0 = kt * kWgBK;
        wg_mbar_expect(full(s), stage_bytes);
#pragma unroll
        for (int b = 0; b < BM / kWgBox; ++b)
          if (b < a_boxes)
            tma_box(wg_smem_addr(st + b * kWgBoxBytes), &maps.a, k0, static_cast<int>(r0) + b * kWgBox, full(s));
#pragma unroll
        for (int b = 0; b < kWBoxes; ++b) {
          int row;
          if (!w_box(b, row)) continue;
          tma_box(wg_smem_addr(st + Cfg::kABytes + b * kWgBoxBytes), &maps.w, k0, row, full(s));
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup cg owns tile rows 64 cg..64 cg+63 ----
  const int cg = warp_u >> 2;
  uint32_t it = 0;  // the producer's count, stage by stage
  for (int64_t i = blockIdx.x; i < n_items; i += gridDim.x) {
    if (!tile_of(i, group, r0, rc, c0)) continue;
    if (64 * cg >= rc) {
      // A warpgroup whose 64 rows are all past the tile's (a grouped tile of an expert's last
      // <= 64 pairs, a plain call's short last tile) would only compute rows that are never stored:
      // it issues no wgmma, so the tensor cores are the live warpgroup's. It still takes part in
      // the ring: waiting for each stage before releasing it keeps its arrivals in that stage's
      // phase. No element's chain changes (the stored rows are the other warpgroup's).
      for (int kt = 0; kt < n_k; ++kt, ++it) {
        const int s = static_cast<int>(it % kWgStages);
        wg_mbar_wait(full(s), (it / kWgStages) & 1);
        wg_mbar_arrive(empty(s));
      }
      continue;
    }
    float acc[kHalves][16][4];  // acc[h]: W tile rows 128 h..128 h + 127
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][j][e] = 0.0f;
    auto hold = [&]() {
#pragma unroll
      for (int h = 0; h < kHalves; ++h) wg_hold(acc[h]);
    };

    for (int kt = 0; kt < n_k; ++kt, ++it) {
      const int s = static_cast<int>(it % kWgStages);
      wg_mbar_wait(full(s), (it / kWgStages) & 1);
      const uint8_t* a_tile = smem + s * Cfg::kStageBytes;
      const uint8_t* b_tile = a_tile + Cfg::kABytes;
      const int64_t k0 = static_cast<int64_t>(kt) * kWgBK;
      wg_fence();  // the accumulator registers, as the previous wgmmas and the zeroing left them
      hold();
      if (k0 + kWgBK <= K) {  // the whole stage inside K: the four steps back to back
#pragma unroll
        for (int kk = 0; kk < kWgBK / 16; ++kk)
#pragma unroll
          for (int h = 0; h < kHalves; ++h)
            wg_mma_128(acc[h], wg_gemm_desc(a_tile, 64 * cg, kk), wg_gemm_desc(b_tile, 128 * h, kk));
      } else {
#pragma unroll
        for (int kk = 0; kk < kWgBK / 16; ++kk)
          if (k0 + 16 * kk < K)  // uniform: skip steps wholly past K (gemm_pipe_kernel's rule)
#pragma unroll
            for (int h = 0; h < kHalves; ++h)
              wg_mma_128(acc[h], wg_gemm_desc(a_tile, 64 * cg, kk), wg_gemm_desc(b_tile, 128 * h, kk));
      }
      wg_commit();
      // the wgmmas of stage kt - 1 are done once at most this stage's group is in flight: release it
      wg_wait<1>();
      hold();
      if (kt > 0) wg_mbar_arrive(empty((it - 1) % kWgStages));
    }
    wg_wait_all();
    hold();
    wg_mbar_arrive(empty((it - 1) % kWgStages));  // the tile's last stage, for the block's next tile

    // ---- epilogue: gemm_pipe_kernel's stores ----
    const int lane = tid & 31, w = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const int64_t nc64 = out_n - c0;
    const int nc = static_cast<int>(nc64 < kOutCols ? nc64 : kOutCols);
    const bool out2 = p.out2 != 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 64 * cg + 16 * w + g + 8 * h;
      if (r >= rc) continue;
      const int64_t orow = (r0 + r) * p.ldc;
      // 8-column chunk f of the W tile is acc[f / 16][f % 16]; SwiGLU: gate chunk q, up chunk q + BN / 16
      if constexpr (SWIGLU) {
#pragma unroll
        for (int q = 0; q < BN / 16; ++q) {
          const int c = 8 * q + 2 * t;
          constexpr int kUp = BN / 16;
          const float* gq = acc[q / 16][q % 16];
          const float* uq = acc[(q + kUp) / 16][(q + kUp) % 16];
          const float g0 = gq[2 * h], g1 = gq[2 * h + 1];
          const float u0 = uq[2 * h], u1 = uq[2 * h + 1];
          store_pair(p.Act + orow + c0 + c, f32_to_bf16(siluf_(g0) * u0), f32_to_bf16(siluf_(g1) * u1), c, nc, out2);
        }
      } else if (p.C16 != nullptr && c0 < p.c16_cols) {  // uniform: bf16 columns (c16_cols even)
        uint16_t* c16 = p.C16 + (r0 + r) * p.ldc16;
#pragma unroll
        for (int f = 0; f < BN / 8; ++f) {
          const int c = 8 * f + 2 * t;
          const float v0 = acc[f / 16][f % 16][2 * h], v1 = acc[f / 16][f % 16][2 * h + 1];
          if (c0 + c < p.c16_cols)
            store_pair(c16 + c0 + c, f32_to_bf16(v0), f32_to_bf16(v1), c, nc, out2);
          else
            store_pair(p.C + orow + c0 + c, v0, v1, c, nc, out2);
        }
      } else {
#pragma unroll
        for (int f = 0; f < BN / 8; ++f) {
          const int c = 8 * f + 2 * t;
          store_pair(p.C + orow + c0 + c, acc[f / 16][f % 16][2 * h], acc[f / 16][f % 16][2 * h + 1], c, nc, out2);
        }
      }
    }
  }
}

// A [rows][K] bf16 operand with row stride ld as a 2-D tensor map, 64 x 64 boxes in the 128-byte
// swizzle, zeros outside; false where the encoder or TMA's alignment is missing.
static bool wg_gemm_encode(CUtensorMap* m, const uint16_t* base, int64_t rows, int64_t K, int64_t ld) {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = tma_encoder();
  if (enc == nullptr || base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || (ld * 2) % 16 != 0 ||
      rows < 1 || K < 1 || ld < K)
    return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};  // bytes per row
  const cuuint32_t box[2] = {kWgBK, kWgBox};
  const cuuint32_t step[2] = {1, 1};
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<uint16_t*>(base), dims, strides, box, step,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int BM, bool SWIGLU, int STAGES, int BN>
static gpuError_t wg_gemm_launch_ring(const GemmParams& p, const WgGemmMaps& maps, int64_t row_tiles,
                                      gpuStream_t stream) {
  using Cfg = WgGemmCfg<BM, STAGES, BN>;
  constexpr int kOutCols = SWIGLU ? BN / 2 : BN;
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t n_tiles = (out_n + kOutCols - 1) / kOutCols;
  static std::atomic<uint64_t> smem_done{0};
  const gpuError_t e = allow_smem(gemm_wgmma_kernel<BM, SWIGLU, STAGES, BN>, Cfg::kSmemBytes, smem_done);
  if (e != gpuSuccess) return e;
  // The walk (BARO_PIPE_ORDER, as launch_tiled's): auto lays a grouped call's column tiles of
  // one slot side by side, so the blocks in flight share their slots' A rows and their experts'
  // weight panels; plain calls keep the row-fast grid unless cols is forced. Which block
  // computes a tile changes, never how.
  namespace k = baro::knobs;
  GemmParams q = p;
  q.cols_fast = gemm_walk_cols(p.tiles != nullptr) ? 1 : 0;
  const WgGemmWalk walk{row_tiles, n_tiles};
  const int64_t n_items = row_tiles * n_tiles;
  // Persistent (BARO_GEMM_WGMMA_PERSIST=1): as many blocks as are resident on the SMs at once
  // (the occupancy query: 64-row tiles fit two or three a SM), each walking every gridDim-th tile,
  // so a block's ring start is paid once and the next tile's stages land while the last one's
  // accumulators are stored. =3: a grid of three blocks, so that the tests walk many tiles per
  // block at every shape. The launcher checked n_items against the 1-D grid's limit.
  int64_t blocks = n_items;
  if (k::is(k::kGemmWgmmaPersist, "3")) {
    blocks = n_items < 3 ? n_items : 3;
  } else if (k::is(k::kGemmWgmmaPersist, "1")) {
    // asked once per instance (the only device the sm_90a image runs on is sm_90)
    static std::atomic<int64_t> resident{0};
    int64_t r = resident.load(std::memory_order_relaxed);
    if (r == 0) {
      int dev = 0, sms = 0, per_sm = 0;
      if (cudaGetDevice(&dev) == cudaSuccess &&
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemm_wgmma_kernel<BM, SWIGLU, STAGES, BN>,
                                                        Cfg::kThreads, Cfg::kSmemBytes) == cudaSuccess) {
        r = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
        resident.store(r, std::memory_order_relaxed);
      } else {
        (void)cudaGetLastError();  // the queries' own error: a block per tile
      }
    }
    if (r > 0 && blocks > r) blocks = r;
  }
  gemm_wgmma_kernel<BM, SWIGLU, STAGES, BN>
      <<<dim3(static_cast<unsigned>(blocks)), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(q, maps, walk);
  return gpuGetLastError();
}

template <int BM, bool SWIGLU, int BN>
static gpuError_t wg_gemm_launch_bn(const GemmParams& p, const WgGemmMaps& maps, int64_t row_tiles,
                                    gpuStream_t stream) {
  return baro::knobs::is(baro::knobs::kGemmWgmmaRing, "3")
             ? wg_gemm_launch_ring<BM, SWIGLU, 3, BN>(p, maps, row_tiles, stream)
             : wg_gemm_launch_ring<BM, SWIGLU, 4, BN>(p, maps, row_tiles, stream);
}

// The W tile's rows (BARO_GEMM_WGMMA_BN): 256 for the calls the setting names (all, grouped or
// plain; auto, the default: calls of at least kWgAutoRows rows or kWgAutoPairs pairs, launch.h)
// whose output is wider than 128 columns (SwiGLU: 64), else 128.
static bool wg_gemm_wide(const GemmParams& p) {
  namespace k = baro::knobs;
  const bool grouped = p.tiles != nullptr;
  const bool big = grouped ? p.a_total_rows >= kWgAutoPairs : p.M >= kWgAutoRows;
  const bool named = k::is(k::kGemmWgmmaBn, "256") || (grouped && k::is(k::kGemmWgmmaBn, "grouped")) ||
                     (!grouped && k::is(k::kGemmWgmmaBn, "plain")) || (big && k::is(k::kGemmWgmmaBn, "auto"));
  const int64_t out_n = p.Act != nullptr ? p.swiglu_I : p.N;
  return named && out_n > (p.Act != nullptr ? 64 : 128);
}

template <int BM, bool SWIGLU>
static gpuError_t wg_gemm_launch(const GemmParams& p, const WgGemmMaps& maps, int64_t row_tiles,
                                 gpuStream_t stream) {
  return wg_gemm_wide(p) ? wg_gemm_launch_bn<BM, SWIGLU, 256>(p, maps, row_tiles, stream)
                         : wg_gemm_launch_bn<BM, SWIGLU, 128>(p, maps, row_tiles, stream);
}

}  // namespace baro_gpu

#endif  // BARO_WGMMA_GEMM_BUILT

namespace baro_gpu {

gpuError_t launch_gemm_wgmma(const GemmParams& p, int bm, int64_t row_slots, gpuStream_t stream, bool* ran) {
  *ran = false;
#if BARO_WGMMA_GEMM_BUILT
  const bool swiglu = p.Act != nullptr;
  const bool grouped = p.tiles != nullptr;
  // A's rows read in place (no gather: grouped calls with p.a_rows run on gemm_pipe_kernel); no
  // split W, no one-token MoE
  if (p.a_rows != nullptr) return gpuSuccess;
  if (p.W_tail != nullptr || p.W_last != nullptr || p.W_host != nullptr || p.moe.kind != Row1Moe::kNone)
    return gpuSuccess;
  constexpr int64_t kI32 = 0x7fffffffLL;  // TMA coordinates are 32-bit
  if (p.N <= 0 || p.K <= 0 || p.N > kI32 || p.K > kI32) return gpuSuccess;
  // A's rows and W's rows as the tensor maps see them: grouped, the tile list's rows of A read in
  // place and every group of W, groups one after the other
  // (w_group_stride == N * ldw)
  int64_t a_rows = p.M, w_rows = p.N, row_tiles = (p.M + bm - 1) / bm;
  if (grouped) {
    if (p.n_tiles == nullptr || p.slot_rows > bm || p.a_total_rows < 1 || p.w_groups < 1 ||
        p.w_group_stride != p.N * p.ldw || p.w_groups > kI32 / p.N)
      return gpuSuccess;
    a_rows = p.a_total_rows;
    w_rows = p.w_groups * p.N;
    row_tiles = row_slots;
  } else if (p.M < 64 || p.w_group_stride != 0) {
    return gpuSuccess;
  }
  if (a_rows > kI32 || row_tiles < 1 || row_tiles > kI32) return gpuSuccess;
  if (swiglu && (p.swiglu_I <= 0 || p.N != 2 * p.swiglu_I)) return gpuSuccess;
  const int64_t out_n = swiglu ? p.swiglu_I : p.N;
  // the 1-D grid's tiles at the narrower W tile (128 rows), the most any width launches
  const int64_t n_tiles = (out_n + (swiglu ? 63 : 127)) / (swiglu ? 64 : 128);
  if (n_tiles * row_tiles > 0x7fffffffLL) return gpuSuccess;
  if (!wg_device_is_sm90()) return gpuSuccess;
  WgGemmMaps maps{};
  if (!wg_gemm_encode(&maps.a, p.A, a_rows, p.K, p.lda) || !wg_gemm_encode(&maps.w, p.W, w_rows, p.K, p.ldw))
    return gpuSuccess;
  *ran = true;
  if (swiglu)
    return bm >= 128 ? wg_gemm_launch<128, true>(p, maps, row_tiles, stream)
                     : wg_gemm_launch<64, true>(p, maps, row_tiles, stream);
  return bm >= 128 ? wg_gemm_launch<128, false>(p, maps, row_tiles, stream)
                   : wg_gemm_launch<64, false>(p, maps, row_tiles, stream);
#else
  (void)p;
  (void)bm;
  (void)row_slots;
  (void)stream;
  return gpuSuccess;
#endif
}

}  // namespace baro_gpu
