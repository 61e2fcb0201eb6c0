// baro_jax GPU (CUDA only): the one-row GEMM of decode. Every slot holds one row
// (a dense m = 1 call, or a grouped MoE call of one token: one pair per expert), so
// the whole cost is streaming W once. gemm_rows16 ran 12.6 us per GEMM on average
// in a decode step (2.5 TB/s on the largest, 1 TB/s on N = 2048): a block there is
// 32 output columns, so N = 2048 had 64 blocks for 132 SMs, and each block's copy
// ring was shallow for its K. Here:
//   - a block is one warp and owns units of 8 output columns (SwiGLU: 8 gate and
//     the matching 8 up columns), taken round-robin over the persistent grid, so
//     every SM streams, whatever N is;
//   - the warp's ring is deep (about 52 KB, 4 blocks per SM) and keeps streaming
//     across its units: the next unit's first stages are in flight while the
//     current one finishes;
//   - each stage is one bulk copy (cp.async.bulk, the copy engine) per W row of
//     BK elements, completing on the stage's mbarrier, so a few instructions
//     keep ~200 KB per SM in flight.
//
// Order: each output element is one fp32 accumulator fragment of
// mma.sync.m16n8k16 walking K in ascending 16-wide steps, no split-K: gemm.cuh's
// order. The A fragment holds the slot's row in its row 0 and exact zeros in rows
// 1..15 (what load_a gives for a one-row tile whose other rows are zero), the B
// fragments are ldmatrix of the W rows (== load_b_nk). So the row gets the bits
// of the 16-row and 64/128-row tiles; the kernel tests compare them.
//
// Requires (launcher): p.vec, K % 16 == 0, slot_rows == 1.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "dot.cuh"
#include "gemm.cuh"

#if !BARO_HIP
namespace baro_gpu {

constexpr int kRow1BK = 256;                  // k per stage: 16 mma k-steps
constexpr int kRow1RowBytes = kRow1BK * 2 + 16;  // smem W row stride: 528 B, ldmatrix conflict-free
constexpr int kRow1BlocksPerSM = 4;

template <bool SWIGLU>
struct Row1Cfg {
  static constexpr int NT = SWIGLU ? 2 : 1;  // n-tiles (independent accumulators) per unit
  static constexpr int kWRows = NT * 8;      // W rows per unit
  static constexpr int kStageBytes = kWRows * kRow1RowBytes + kRow1BK * 2;  // W rows, then the A row
  static constexpr int kStages = SWIGLU ? 6 : 11;                           // ~52 KB per block
  static constexpr int kBarBytes = (8 * kStages + 127) & ~127;  // mbarriers, then the ring
  static constexpr int kSmemBytes = kBarBytes + kStages * kStageBytes;
  static_assert(kWRows + 1 <= BARO_WARP, "one copy lane per W row plus one for A");
  static_assert(kStageBytes % 16 == 0 && kRow1RowBytes % 16 == 0, "bulk copies land 16-byte aligned");
};

// ---- mbarrier + bulk copy (sm_90) ----
BARO_DEV void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
BARO_DEV void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
BARO_DEV void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
BARO_DEV void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Orders this thread's earlier generic-proxy accesses of shared memory (the ldmatrix
// reads of a stage) before its later async-proxy ones (the bulk copy refilling it).
BARO_DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Units: u = slot * tiles_per_slot + tile, tile = 8 output columns. Block b takes
// units b, b + grid, ... of the slots that exist (*p.n_tiles for grouped calls).
template <bool SWIGLU>
__global__ void __launch_bounds__(BARO_WARP) gemm_row1_kernel(GemmParams p, int64_t row_slots) {
  using Cfg = Row1Cfg<SWIGLU>;
  constexpr int ST = Cfg::kStages;
  extern __shared__ __align__(128) uint8_t row1_smem[];

  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t tps = (out_n + 7) / 8;  // units per slot
  const int64_t slots = p.tiles != nullptr ? static_cast<int64_t>(*p.n_tiles) : row_slots;
  const int64_t units = slots * tps;
  const int64_t first = blockIdx.x, step = gridDim.x;
  if (first >= units) return;
  const int64_t my_units = (units - first + step - 1) / step;
  const int64_t K = p.K;
  const int n_k = static_cast<int>((K + kRow1BK - 1) / kRow1BK);
  const int64_t total = my_units * n_k;  // stages this warp streams

  const uint32_t bar0 = smem_u32(row1_smem);
  const uint32_t stage0 = bar0 + Cfg::kBarBytes;
  if (lane == 0)
    for (int s = 0; s < ST; ++s) mbar_init(bar0 + 8 * s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncwarp();

  // Where unit j's slot row and columns are. Every lane computes the same values.
  struct Unit {
    const uint16_t* a;  // the slot's A row
    const uint16_t* w;  // the group's W
    int64_t c0, row;    // first output column, output row
    int nc;             // valid output columns of the unit (1..8)
  };
  auto unit = [&](int64_t j) {
    Unit r;
    const int64_t u = first + j * step;
    const int64_t slot = u / tps;
    r.c0 = (u - slot * tps) * 8;
    int64_t group = 0, r0 = 0, rc = 0;
    gemm_slot(p, slot, group, r0, rc);  // rc == 1: slot < slots, slot_rows == 1
    const int64_t ar = p.a_rows != nullptr ? static_cast<int64_t>(p.a_rows[r0]) : r0;
    r.a = p.A + ar * p.lda;
    r.w = p.W + group * p.w_group_stride;
    r.row = r0;
    r.nc = out_n - r.c0 < 8 ? static_cast<int>(out_n - r.c0) : 8;
    return r;
  };

  // Stage s of the flat (unit, k-stage) stream into ring slot s % ST: lane i < kWRows
  // copies W row i's BK-wide piece (rows of columns past out_n are not copied: their
  // accumulators are never stored, and a column never mixes into another), lane kWRows
  // the A row's piece. Lane 0 arms the barrier with the byte count first.
  int64_t pj = 0;
  int pkt = 0;
  Unit pu = unit(0);
  auto issue = [&](int64_t s) {
    const int slot = static_cast<int>(s % ST);
    const uint32_t bar = bar0 + 8 * slot;
    const uint32_t dst = stage0 + slot * Cfg::kStageBytes;
    const int64_t k0 = static_cast<int64_t>(pkt) * kRow1BK;
    const uint32_t kb = static_cast<uint32_t>((K - k0 < kRow1BK ? K - k0 : kRow1BK) * 2);
    const int rows = SWIGLU ? 2 * pu.nc : pu.nc;
    if (lane == 0) mbar_expect_tx(bar, kb * static_cast<uint32_t>(rows + 1));
    __syncwarp();
    fence_proxy_async();
    if (lane < Cfg::kWRows) {
      const int col = SWIGLU ? (lane & 7) : lane;
      if (col < pu.nc) {
        const int64_t wrow = (SWIGLU && lane >= 8 ? p.swiglu_I : 0) + pu.c0 + col;
        bulk_copy(dst + lane * kRow1RowBytes, pu.w + wrow * p.ldw + k0, kb, bar);
      }
    } else if (lane == Cfg::kWRows) {
      bulk_copy(dst + Cfg::kWRows * kRow1RowBytes, pu.a + k0, kb, bar);
    }
    if (++pkt == n_k) {
      pkt = 0;
      if (++pj < my_units) pu = unit(pj);
    }
  };

  const int64_t pre = total < ST ? total : ST;
  for (int64_t s = 0; s < pre; ++s) issue(s);

  // B x4 of one n-tile: matrices (n 0-7, k 0-7), (k 8-15), (k 16-23), (k 24-31) = the B
  // fragments of two k-steps; lane l gives row l & 7, 16-byte chunk l >> 3.
  const uint32_t b_lane = static_cast<uint32_t>((lane & 7) * kRow1RowBytes + (lane >> 3) * 16);
  float acc[Cfg::NT][4];
  int64_t cj = 0;
  int ckt = 0;
  Unit cu = unit(0);
  for (int64_t s = 0; s < total; ++s) {
    const int slot = static_cast<int>(s % ST);
    mbar_wait(bar0 + 8 * slot, static_cast<uint32_t>((s / ST) & 1));
    if (ckt == 0) {
#pragma unroll
      for (int b = 0; b < Cfg::NT; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[b][i] = 0.0f;
    }
    const uint32_t base = stage0 + slot * Cfg::kStageBytes;
    const uint16_t* a_s = reinterpret_cast<const uint16_t*>(row1_smem + (base - bar0)) +
                          Cfg::kWRows * kRow1RowBytes / 2;
    const int64_t k0 = static_cast<int64_t>(ckt) * kRow1BK;
    const int steps = static_cast<int>((K - k0 < kRow1BK ? K - k0 : kRow1BK) / 16);  // K % 16 == 0
#pragma unroll
    for (int kk2 = 0; kk2 < kRow1BK / 32; ++kk2) {  // pairs of k-steps
      if (2 * kk2 < steps) {
        FragB fb[Cfg::NT][2];
#pragma unroll
        for (int b = 0; b < Cfg::NT; ++b)
          ldsm_x4(base + b * 8 * kRow1RowBytes + b_lane + kk2 * 64, fb[b][0].r[0], fb[b][0].r[1],
                  fb[b][1].r[0], fb[b][1].r[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (2 * kk2 + h < steps) {
            // load_a's words of a tile whose row 0 is the slot's row and rows 1..15 are zero
            const int k = kk2 * 32 + h * 16 + 2 * t;
            FragA fa;
            fa.r[0] = g == 0 ? lds32(a_s + k) : 0u;
            fa.r[1] = 0u;
            fa.r[2] = g == 0 ? lds32(a_s + k + 8) : 0u;
            fa.r[3] = 0u;
#pragma unroll
            for (int b = 0; b < Cfg::NT; ++b) mma_16816(acc[b], fa, fb[b][h]);
          }
        }
      }
    }
    __syncwarp();  // every lane's reads of this ring slot are done
    if (s + ST < total) issue(s + ST);
    if (++ckt == n_k) {  // unit done: row 0 lives in lanes 0..3 (g == 0), columns 2t, 2t + 1
      ckt = 0;
      if (g == 0) {
        const int c = 2 * t;
        const bool out2 = p.out2 != 0;
        const int64_t orow = cu.row * p.ldc + cu.c0 + c;
        if (SWIGLU)
          store_pair(p.Act + orow, f32_to_bf16(siluf_(acc[0][0]) * acc[1][0]),
                     f32_to_bf16(siluf_(acc[0][1]) * acc[1][1]), c, cu.nc, out2);
        else
          store_pair(p.C + orow, acc[0][0], acc[0][1], c, cu.nc, out2);
      }
      if (++cj < my_units) cu = unit(cj);
    }
  }
}

}  // namespace baro_gpu
#endif  // !BARO_HIP
