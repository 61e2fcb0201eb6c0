// baro_jax GPU (CUDA only): the one-row GEMM of decode. Every slot holds one row
// (a dense m = 1 call, or a grouped MoE call of one token: one pair per expert), so
// the cost is streaming W once. gemm_rows16 ran 12.6 us per GEMM on average in a
// decode step (2.5 TB/s on the largest, 1 TB/s on N = 2048: 64 blocks of 32 columns
// for 132 SMs). Here:
//   - a block is one warp and owns units of NT n-tiles (8 output columns each;
//     SwiGLU: and the matching NT up tiles), taken round-robin over a persistent
//     grid, so every SM streams whatever N is;
//   - its ring (about 75 KB, 3 blocks per SM) keeps streaming across its units;
//     each stage is one bulk copy (cp.async.bulk, the copy engine) per W row of a
//     kchunk-wide piece, completing on the stage's mbarrier;
//   - a warp runs NT (SwiGLU 2 NT) accumulator chains side by side, and issues a
//     group's shared-memory loads before its mmas: an accumulator advances one
//     k-step per mma latency, so the chains in flight per SM set the speed. The
//     first version (one chain, loads between mmas, 512-byte copies) was slower
//     than gemm_rows16 (16.1 vs 12.6 us per GEMM on the H200).
//
// Order: each output element is one fp32 accumulator fragment of
// mma.sync.m16n8k16 walking K in ascending 16-wide steps, no split-K: gemm.cuh's
// order. The A fragment holds the slot's row in its row 0 and exact zeros in rows
// 1..15 (what load_a gives for a one-row tile whose other rows are zero), the B
// fragments are ldmatrix of the W rows (== load_b_nk). So the row gets the bits
// of the 16-row and 64/128-row tiles; the kernel tests compare them.
//
// SLOT16: the same stream over slots of up to 16 rows (a decode step of 2 to 64 sequences, or a
// grouped MoE call of few rows per expert). gemm_rows16 walks such a slot with a few 4-warp
// blocks, each reading all of K for its 32 columns: 73 us per layer for the projections,
// router and shared expert at 8 rows on the H200, where one row here takes about half. The
// mma is 16 rows wide anyway, so more rows cost A loads, not mmas. A stage then carries the
// slot's rows after the W rows (ring.a_rows of them, the same padded stride), the A fragment
// takes rows g and g + 8 below the slot's row count and exact zeros past it (load_a of a tile
// whose rows past the slot are zero: gemm_rows16's words), and units run column-major, so the
// slots of one column unit stream the same W rows side by side and meet in L2.
//
// ASHARED (BARO_ROW1_ASHARED=1, opt-in until run on a GPU; SLOT16 plain calls of one slot: 2 to
// 16 rows, no tile list, no gathered rows): at 8 rows out_proj's warps copied as many A bytes as W
// bytes (ncu), every unit bringing the slot's rows again. Here a block of `warps` warps (one
// block per SM) holds all of the slot's A, loaded once, and each warp streams its own W ring as
// above. Shared memory: the A pieces' mbarriers and every warp's ring mbarriers (kRow1AsBarBytes),
// then A (rc rows at a stride of 2 K + 16 bytes: rows g spread over the banks as in the stages),
// then the warps' rings (W rows only). Warp 0 issues A's bulk copies in ring.n_ka k pieces, each
// on its own mbarrier, which fires once (phase 0) and is never re-armed: a warp waits on piece c
// before its first unit's k stages of that piece, and A is never overwritten, so no warp waits for
// another after the start (the one block-wide barrier is after the mbarriers' init). The fragment
// code is the SLOT16 code above reading the same bf16 words of the same rows (g, g + 8 below rc,
// zeros past it) from the A region instead of the stage, so every register into every mma, and the
// mma order, are the SLOT16 path's: the same bytes (tests/test_kernels_matmul.py compares them).
//
// SWAP (BARO_ROW1_SWAP=1, opt-in until run on a GPU; every call without the one-token MoE's fused
// route or combine, in units of 2 or 4 n-tiles): the stages as the instance's without it, the
// mma's operands the other way round: W's unit rows are the 16-row A operand (16 output columns an
// mma; SwiGLU: gate tiles and up tiles) and the slot's rows the 8-wide B operand (the step's
// tokens, a second 8 where a slot holds more). At 8 rows the default step spends half of every mma
// on zero rows and ~13 instructions a k-step per 8 columns (ncu, 3280058: one or two warps an SM,
// each instruction on the chain); here a k-step is one ldmatrix of W per 16 columns, half an
// ldmatrix of the tokens and one mma. mma.sync gives the same bits either way round
// (benchmarks/mma_swap_probe.cu, all equal on the H100), so each output element is the default
// instance's: one fp32 accumulator, K ascending in 16-wide steps, the same k-step sums, the same
// SwiGLU expression (tests/test_kernels_matmul.py and test_kernels_moe.py compare them).
//
// Requires (launcher): p.vec, K % 16 == 0, slot_rows == (SLOT16 ? 16 : 1). Reads p.W_tail /
// p.W_last (gemm.cuh) where set: the one-token MoE's shared gate and shared expert.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "dot.cuh"
#include "gemm.cuh"
#include "moe_route.cuh"

#if !BARO_HIP
#include "tensor_map.h"

namespace baro_gpu {

constexpr int kRow1MaxStages = 16;
// The head of shared memory: the mbarriers, then 16 zero bytes (the A fragment rows a slot does
// not have read them), then the ring, 128-byte aligned.
constexpr int kRow1ZeroBytes = 16;
constexpr int kRow1BarBytes = 8 * kRow1MaxStages + 128;  // mbarriers (128 B), zeros, pad
constexpr int kRow1BlocksPerSM = 3;
// ASHARED: warps per block (BARO_ROW1_BPS's range), and the A pieces (one mbarrier each)
constexpr int kRow1AsMaxWarps = 8;
constexpr int kRow1AsPieces = 32;
constexpr int kRow1AsBarBytes = 8 * (kRow1AsPieces + kRow1AsMaxWarps * kRow1MaxStages) + 128;  // + zeros, pad
static_assert(kRow1BarBytes % 128 == 0 && kRow1AsBarBytes % 128 == 0, "the A region and the rings start 128-byte aligned");
// A stage's piece of each W row is kchunk elements; its smem row stride is kchunk * 2 + 16
// bytes (the 16 spread the 8 rows of an ldmatrix phase over distinct banks).
__host__ __device__ constexpr int row1_row_bytes(int kchunk) { return kchunk * 2 + 16; }

// NT: n-tiles (8 output columns each) per unit; a SwiGLU unit also holds the NT matching up
// tiles. Each n-tile is its own fp32 accumulator chain, so a warp runs 2 NT (SwiGLU) or NT
// mma chains side by side.
template <bool SWIGLU, int NT>
struct Row1Cfg {
  static constexpr int kTiles = SWIGLU ? 2 * NT : NT;  // accumulators per lane
  static constexpr int kWRows = 8 * kTiles;             // W rows per unit
  static constexpr int kOutCols = 8 * NT;               // output columns per unit
};

// The one-token MoE's route (Row1Moe::kRoute) in a warp's shared memory, after its ring:
// ids [32], wts [32], inv [32], srow [33], n_tiles, pad, tiles [3 max_tiles].
constexpr int kRow1RouteInts = 132;
constexpr int kRow1RouteBytes = 1536;
__host__ __device__ constexpr int64_t row1_route_max_tiles() { return (kRow1RouteBytes / 4 - kRow1RouteInts) / 3; }

// TMA (BARO_ROW1_TMA; plain calls, no SwiGLU): a stage is 1, 2 or 4 sub-stages of 128 k, each
// filled by two tensor copies, W's unit rows and the slot's A rows, each one box issued by one
// lane; the group of 8 k-steps that reads a sub-stage is the bulk path's group, moved to it. The bulk copies
// take one instruction per row, and the rows' addresses differ by lane while the instruction
// takes uniform operands, so the compiler issues them one lane at a time (~11 instructions a
// row, 40 rows a stage at 8 rows and 4 n-tiles): about as many instructions as the stage's mmas,
// from the same warp, which is all an SM's sub-partition has (cuobjdump -sass, 590c0ed). The box
// is 8 elements wider than the stage: its rows land at row1_row_bytes(128) = 272 bytes apart,
// the ring's padded stride, so the fragment loads are the bulk path's, bank for bank (the 8
// extra elements sit in the pad, which no fragment reads; past K they come back as zeros).
constexpr int kRow1TmaK = 128;
constexpr int kRow1TmaBoxK = kRow1TmaK + 8;
static_assert(kRow1TmaBoxK * 2 == 2 * kRow1TmaK + 16, "a box row is the ring's padded row");
struct Row1Maps {
  CUtensorMap w;  // W [N, K] (row stride ldw): boxes of kRow1TmaBoxK x 8 NT
  CUtensorMap a;  // A [M, K] (row stride lda): boxes of kRow1TmaBoxK x the stage's A rows
};
struct Row1NoMaps {};  // the other instances' last argument: nothing
template <bool TMA>
using Row1MapsOf = typename std::conditional<TMA, Row1Maps, Row1NoMaps>::type;

// Runtime shape of the ring, chosen by the launcher (matmul.cu launch_row1).
struct Row1Ring {
  int kchunk;       // k elements per stage (a multiple of 128)
  int stages;       // ring slots, 2..kRow1MaxStages
  int stage_bytes;  // W rows then the A rows
  int lsu;          // 1: 16-byte cp.async per lane (the load/store path) instead of bulk copies
  int n_k;          // k stages per unit: ceil(K / kchunk), from the launcher
  // ASHARED only (0 otherwise):
  int a_rowb = 0;   // the A region's row stride, 2 K + 16 bytes
  int a_bytes = 0;  // the A region: row1_a_bytes(the call's most rows, K)
  int a_per = 0;    // k stages per A piece
  int n_ka = 0;     // A pieces: ceil(n_k / a_per) <= kRow1AsPieces
  int tma_sub = 0;  // TMA only: bytes of a 128-wide sub-stage (W's unit rows, then A's rows)
  int tma_tx = 0;   // TMA only: the bytes a sub-stage's two boxes bring (rows past the tensor count)
};

// ASHARED: the A region's row stride. 2 K + 16 bytes keeps the 8 rows g of a fragment load on
// distinct banks for every K % 16 == 0 (K / 2 + 4 words per row), as the stages' padding does.
__host__ __device__ constexpr int64_t row1_a_row_bytes(int64_t K) { return K * 2 + 16; }
// The A region: rows rows, then 256 bytes, rounded up to 128. A fragment group loads its 8 k-steps
// whatever the stage holds (the mmas past K are skipped), so the last stage's loads reach up to
// 7 steps (224 bytes) past K: inside the pad, not in a warp's ring that a copy may be filling.
__host__ __device__ constexpr int64_t row1_a_bytes(int rows, int64_t K) {
  return (rows * row1_a_row_bytes(K) + 256 + 127) / 128 * 128;
}

// Stage bytes: the W rows at the padded stride, then room for a_rows A rows: one row unpadded,
// or (SLOT16) as many as any slot of the call holds, at the padded stride.
__host__ __device__ constexpr int row1_stage_bytes(int w_rows, int kchunk, int a_rows) {
  return w_rows * row1_row_bytes(kchunk) + (a_rows == 1 ? 2 * kchunk : a_rows * row1_row_bytes(kchunk));
}

// Where a warp is in its unit list: unit u = hi * n_lo + lo, advanced by the grid stride with
// adds only. One-row slots run slot-major (hi = slot, lo = column unit, n_lo = units per slot);
// SLOT16 column-major (hi = column unit, lo = slot, n_lo = slots). The 64-bit divisions this replaces (u / ups per unit, s % stages and
// s / stages per ring stage) are software routines of ~100 dependent instructions each, and
// the ones before a warp's first copy delayed every GEMM's first byte. 32-bit is enough: the
// launcher keeps slots * ups below 2^31.
struct Row1Cursor {
  uint32_t hi, lo;
  BARO_DEV void advance(uint32_t d_hi, uint32_t d_lo, uint32_t n_lo) {
    hi += d_hi;
    lo += d_lo;
    if (lo >= n_lo) {
      lo -= n_lo;
      ++hi;
    }
  }
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
// The stage's mbarrier counts this lane's arrival once its earlier cp.async copies have landed
// (the barrier is initialised with one arrival per lane).
BARO_DEV void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Orders this thread's earlier generic-proxy accesses of shared memory (the ldmatrix
// reads of a stage) before its later async-proxy ones (the bulk copy refilling it).
BARO_DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Units: u = slot * units_per_slot + i, unit i = output columns [8 NT i, 8 NT (i + 1)).
// Block b takes units b, b + grid, ... of the slots that exist (*p.n_tiles when grouped).
//
// MOE (p.moe.kind, the one-token MoE of moe.cu; launch shapes and stream order unchanged):
//   kRoute (gate/up): before streaming, the warp runs route_one_row on the router logits,
//     the code of moe_route_one_kernel, into its shared memory, and takes its tiles from
//     there: the top-k costs each warp about what the route kernel did, minus a launch and
//     its gap. Block 0 routes into global memory instead, for the down GEMM and combine.
//   kCombine (down): a unit's stores are fenced and counted per output column unit; the
//     warp that counts a unit's last slot computes out for those columns: the slot-order
//     fmaf over the pairs from 0, then + sigmoid(sgl) * the shared row, moe_combine_kernel's
//     expressions (the kernel tests compare the two), so the combine launch goes.
template <bool SWIGLU, int NT, int MOE = Row1Moe::kNone, bool SLOT16 = false, bool ASHARED = false, bool TMA = false,
          bool SWAP = false>
__global__ void __launch_bounds__(ASHARED ? kRow1AsMaxWarps * BARO_WARP : BARO_WARP)
    gemm_row1_kernel(GemmParams p, int64_t row_slots, Row1Ring ring, const __grid_constant__ Row1MapsOf<TMA> maps) {
  using Cfg = Row1Cfg<SWIGLU, NT>;
  constexpr int T = Cfg::kTiles;
  static_assert(MOE == Row1Moe::kNone || (MOE == Row1Moe::kRoute) == SWIGLU, "route on gate/up, combine on down");
  static_assert(MOE == Row1Moe::kNone || !SLOT16, "the fused route and combine are one token's");
  static_assert(!ASHARED || (SLOT16 && MOE == Row1Moe::kNone), "a shared A slot: plain 16-row slots only");
  static_assert(!TMA || (!SWIGLU && MOE == Row1Moe::kNone && !ASHARED), "TMA: plain calls without SwiGLU");
  static_assert(!SWAP || (MOE == Row1Moe::kNone && !ASHARED && !TMA && NT % 2 == 0),
                "SWAP: no fused route or combine, units of whole 16-column tiles");
  constexpr int MW = SWAP ? NT / 2 : 1;       // SWAP: 16-column tiles per unit
  constexpr int WT = SWIGLU ? 2 * MW : MW;    // SWAP: 16-row W tiles per unit (gate, then up)
  static_assert(!SWAP || 2 * WT == T, "SWAP: two token halves of WT accumulators fill acc");
  // SWAP: the first smem row of W tile w (the gate rows are the unit's first 8 NT, the up rows the next)
  auto swap_w_row = [](int w) { return SWIGLU && w >= MW ? 8 * NT + 16 * (w - MW) : 16 * w; };
  extern __shared__ __align__(128) uint8_t row1_smem[];
  grid_dependency_wait();  // p.pdl launches: the previous kernel's results first

  const int lane = static_cast<int>(ASHARED ? threadIdx.x % BARO_WARP : threadIdx.x), g = lane >> 2, t = lane & 3;
  // ASHARED: warp `warp` of a block of wpb; a one-warp block otherwise
  const uint32_t warp = ASHARED ? threadIdx.x / BARO_WARP : 0u, wpb = ASHARED ? blockDim.x / BARO_WARP : 1u;
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t ups = (out_n + Cfg::kOutCols - 1) / Cfg::kOutCols;  // units per slot
  const int32_t* tiles = p.tiles;
  const int32_t* n_tiles = p.n_tiles;
  const int32_t* a_rows = p.a_rows;
  if constexpr (MOE == Row1Moe::kRoute) {
    const Row1Moe& mo = p.moe;
    int32_t* sm = reinterpret_cast<int32_t*>(row1_smem + kRow1BarBytes + ring.stages * ring.stage_bytes);
    const bool pub = blockIdx.x == 0;
    int32_t* r_ids = pub ? mo.ids : sm;
    float* r_wts = pub ? mo.wts : reinterpret_cast<float*>(sm + 32);
    int32_t* r_inv = pub ? mo.inv : sm + 64;
    int32_t* r_srow = pub ? mo.srow : sm + 96;
    int32_t* r_nt = pub ? mo.n_tiles : sm + 129;
    int32_t* r_tiles = pub ? mo.tiles : sm + kRow1RouteInts;
    if (mo.E <= BARO_WARP * kTopkRegPerSmall)
      route_one_row<kTopkRegPerSmall, false>(mo.logits, r_ids, r_wts, mo.E, mo.k, 1, r_srow, r_inv, r_tiles, r_nt,
                                             mo.max_tiles, mo.slots, mo.S, 0, mo.fold_group, mo.host);
    else
      route_one_row<kTopkRegPer, false>(mo.logits, r_ids, r_wts, mo.E, mo.k, 1, r_srow, r_inv, r_tiles, r_nt,
                                        mo.max_tiles, mo.slots, mo.S, 0, mo.fold_group, mo.host);
    if (pub)
      for (int i = lane; i < mo.n_counters; i += BARO_WARP) mo.counters[i] = 0u;
    __syncwarp();  // the lanes' route stores, before any lane reads them
    tiles = r_tiles;
    n_tiles = r_nt;
    a_rows = r_srow;
  }
  // kCombine: lane s < k holds pair s's weight (NaN when its expert has no slot) and sorted row
  float c_w = 0.0f, c_sg = 0.0f;
  int c_inv = 0;
  if constexpr (MOE == Row1Moe::kCombine) {
    const Row1Moe& mo = p.moe;
    if (lane < mo.k) {
      c_w = mo.wts[lane];
      if (mo.slots != nullptr) {
        const int sl = mo.slots[mo.ids[lane]];
        if (sl < 0 || sl >= mo.S) c_w = __int_as_float(0x7fc00000);
      }
      c_inv = mo.inv[lane];
    }
    c_sg = sigmoidf_(*mo.sgl);
  }
  int64_t slots = tiles != nullptr ? static_cast<int64_t>(*n_tiles) : row_slots;
  if (slots > row_slots) slots = row_slots;  // the tile list's capacity (what the grid was sized for)
  const uint32_t units = static_cast<uint32_t>(slots * ups);  // < 2^31 (launcher)
  const uint32_t first = blockIdx.x * wpb + warp, step = gridDim.x * wpb;  // this warp's units
  if constexpr (!ASHARED) {
    if (first >= units) return;
  }  // ASHARED: every warp takes part in the block's setup below first
  const uint32_t n_lo = static_cast<uint32_t>(SLOT16 ? slots : ups);
  const uint32_t my_units = !ASHARED || first < units ? (units - first + step - 1) / step : 0u;
  const int64_t K = p.K;
  const int kchunk = ring.kchunk, ST = ring.stages;
  const int rowb = row1_row_bytes(TMA ? kRow1TmaK : kchunk);
  const int n_k = ring.n_k;
  const int64_t total = static_cast<int64_t>(my_units) * n_k;  // stages this warp streams
  const uint32_t d_hi = step / n_lo, d_lo = step - d_hi * n_lo;  // the grid stride in (hi, lo)
  const Row1Cursor start{first / n_lo, first - (first / n_lo) * n_lo};

  const uint32_t smem0 = smem_u32(row1_smem);
  // this warp's ring mbarriers and ring (ASHARED: after the A pieces' mbarriers; after A)
  const uint32_t bar0 = ASHARED ? smem0 + 8 * (kRow1AsPieces + warp * kRow1MaxStages) : smem0;
  const uint32_t stage0 = ASHARED ? smem0 + kRow1AsBarBytes + ring.a_bytes + warp * ST * ring.stage_bytes
                                  : smem0 + kRow1BarBytes;
  const uint32_t a0 = smem0 + kRow1AsBarBytes;  // ASHARED: the A region
  const uint32_t zero16 = smem0 + (ASHARED ? kRow1AsBarBytes : kRow1BarBytes) - 128;  // 16 zero bytes
  if ((!ASHARED || warp == 0) && lane < kRow1ZeroBytes / 4)
    reinterpret_cast<uint32_t*>(row1_smem + (zero16 - smem0))[lane] = 0u;
  if (lane == 0)
    for (int s = 0; s < ST; ++s) mbar_init(bar0 + 8 * s, ring.lsu ? BARO_WARP : 1);
  if constexpr (ASHARED) {
    if (threadIdx.x == 0)
      for (int c = 0; c < ring.n_ka; ++c) mbar_init(smem0 + 8 * c, 1);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  if constexpr (ASHARED) {
    __syncthreads();  // the A pieces' mbarriers, before any warp waits on them
    // Warp 0 brings the slot's rows (the only slot of the call: units differ in columns only),
    // piece by piece in k order, so the first k stages can start before the rest of A lands.
    // Bulk copies whatever ring.lsu says: A is device memory (W_host calls do not come here).
    if (warp == 0) {
      int64_t group = 0, r0 = 0, rc = 0;
      gemm_slot(p, tiles, n_tiles, 0, group, r0, rc);  // plain: r0 = 0, rc = min(M, 16)
      const uint16_t* a = p.A + r0 * p.lda;
      const int piece = ring.a_per * kchunk;  // k elements per A piece
      auto piece_bytes = [&](int c) {
        const int64_t k0 = static_cast<int64_t>(c) * piece;
        return static_cast<uint32_t>((K - k0 < piece ? K - k0 : piece) * 2);
      };
      if (lane == 0)
        for (int c = 0; c < ring.n_ka; ++c) mbar_expect_tx(smem0 + 8 * c, piece_bytes(c) * static_cast<uint32_t>(rc));
      __syncwarp();  // armed before any copy can complete on them
      const int nrc = static_cast<int>(rc);
      for (int i = lane; i < ring.n_ka * nrc; i += BARO_WARP) {  // piece-major: piece 0 of every row first
        const int c = i / nrc, r = i - c * nrc;
        const int64_t k0 = static_cast<int64_t>(c) * piece;
        bulk_copy(a0 + static_cast<uint32_t>(r * ring.a_rowb + k0 * 2), a + r * p.lda + k0, piece_bytes(c),
                  smem0 + 8 * c);
      }
      // a warp 0 without units (the launcher never makes one) still keeps the block alive
      // until A has landed: no bulk copy may outlive its block's shared memory
      if (my_units == 0)
        for (int c = 0; c < ring.n_ka; ++c) mbar_wait(smem0 + 8 * c, 0);
    }
    if (my_units == 0) return;
  } else {
    __syncwarp();
  }

  // Where unit j's slot row and columns are. Every lane computes the same values.
  struct Unit {
    const uint16_t* a;  // the slot's first A row
    const uint16_t* w;  // the group's W
    int64_t c0, row;    // first output column, first output row
    int64_t cu;         // column unit within the slot
    int nc;             // valid output columns of the unit (1..8 NT)
    int rc;             // rows of the slot (1 unless SLOT16)
  };
  auto unit = [&](const Row1Cursor& at) {
    Unit r;
    const int64_t slot = SLOT16 ? at.lo : at.hi;
    r.cu = SLOT16 ? at.hi : at.lo;
    r.c0 = r.cu * Cfg::kOutCols;
    int64_t group = 0, r0 = 0, rc = 0;
    gemm_slot(p, tiles, n_tiles, slot, group, r0, rc);  // slot < slots: 1 <= rc <= slot_rows
    r.rc = SLOT16 ? static_cast<int>(rc) : 1;
    const int64_t ar = a_rows != nullptr ? static_cast<int64_t>(a_rows[r0]) : r0;
    r.a = p.A + ar * p.lda;
    if (p.W_last != nullptr && group == p.last_group)
      r.w = p.W_last;
    else if (p.W_host != nullptr && group <= kHostGroup0)
      r.w = p.W_host + (kHostGroup0 - group) * p.w_group_stride;
    else
      r.w = p.W + group * p.w_group_stride;
    r.row = r0;
    r.nc = out_n - r.c0 < Cfg::kOutCols ? static_cast<int>(out_n - r.c0) : Cfg::kOutCols;
    return r;
  };

  // Stage s of the flat (unit, k-stage) stream into ring slot s % ST: smem row i < kWRows
  // gets W row i's kchunk-wide piece (rows of columns past out_n are not copied: their
  // accumulators are never stored, and a column never mixes into another), rows kWRows + i
  // the slot's A row i's piece (i < rc; rows past the slot are not read, the fragments zero them).
  uint32_t pj = 0;
  int pkt = 0, pslot = 0;  // the producer's unit, k stage and ring slot
  Row1Cursor pat = start;
  Unit pu = unit(pat);
  auto issue = [&]() {
    const int slot = pslot;
    pslot = pslot + 1 == ST ? 0 : pslot + 1;
    const uint32_t bar = bar0 + 8 * slot;
    const uint32_t dst = stage0 + slot * ring.stage_bytes;
    const int64_t k0 = static_cast<int64_t>(pkt) * kchunk;
    const uint32_t kb = static_cast<uint32_t>((K - k0 < kchunk ? K - k0 : kchunk) * 2);
    const int live = SWIGLU ? 2 * pu.nc : pu.nc;  // W rows copied (the nc gate and nc up rows)
    const int a_in = ASHARED ? 0 : pu.rc;          // A rows the stage carries (ASHARED: none)
    const int rows = Cfg::kWRows + a_in;           // smem rows of the stage
    auto src_row = [&](int r) -> const uint16_t* {  // global start of smem row r's piece, or null
      if (r >= Cfg::kWRows) {
        const int i = r - Cfg::kWRows;
        if (!SLOT16 || i == 0 || a_rows == nullptr) return pu.a + i * p.lda + k0;
        return p.A + static_cast<int64_t>(a_rows[pu.row + i]) * p.lda + k0;
      }
      const int col = SWIGLU ? (r % Cfg::kOutCols) : r;  // output column of the row, from c0
      if (col >= pu.nc) return nullptr;
      const int64_t wrow = (SWIGLU && r >= Cfg::kOutCols ? p.swiglu_I : 0) + pu.c0 + col;
      const uint16_t* w = p.W_tail != nullptr && wrow >= p.n_split ? p.W_tail + (wrow - p.n_split) * p.ldw
                                                                   : pu.w + wrow * p.ldw;
      return w + k0;
    };
    if constexpr (TMA) {  // one lane; per 128-wide sub-stage below K two boxes: W's unit rows, A's rows
      __syncwarp();
      fence_proxy_async();
      if (lane == 0) {
        const int64_t below_k = (K - k0 + kRow1TmaK - 1) / kRow1TmaK;
        const int subs = below_k < kchunk / kRow1TmaK ? static_cast<int>(below_k) : kchunk / kRow1TmaK;
        mbar_expect_tx(bar, static_cast<uint32_t>(subs * ring.tma_tx));
        for (int j = 0; j < subs; ++j) {
          const uint32_t sub = dst + static_cast<uint32_t>(j * ring.tma_sub);
          const int x = static_cast<int>(k0) + j * kRow1TmaK;
          tma_box(sub, &maps.w, x, static_cast<int>(pu.c0), bar);
          tma_box(sub + Cfg::kWRows * rowb, &maps.a, x, static_cast<int>(pu.row), bar);
        }
      }
    } else if (ring.lsu) {  // every lane copies 16-byte chunks of the stage's rows, then arrives
      const int per_row = static_cast<int>(kb / 16);
      for (int c = lane; c < rows * per_row; c += BARO_WARP) {
        const int r = c / per_row, q = c - r * per_row;
        const uint16_t* src = src_row(r);
        if (src != nullptr) cp_async16(dst + r * rowb + 16 * q, src + 8 * q, true);
      }
      cp_async_arrive(bar);
    } else {  // lane 0 arms the barrier with the byte count, then one bulk copy per row
      if (lane == 0) mbar_expect_tx(bar, kb * static_cast<uint32_t>(live + a_in));
      __syncwarp();
      fence_proxy_async();
      for (int r = lane; r < rows; r += BARO_WARP) {
        const uint16_t* src = src_row(r);
        if (src != nullptr) bulk_copy(dst + r * rowb, src, kb, bar);
      }
    }
    if (++pkt == n_k) {
      pkt = 0;
      if (++pj < my_units) {
        pat.advance(d_hi, d_lo, n_lo);
        pu = unit(pat);
      }
    }
  };

  const int64_t pre = total < ST ? total : ST;
  for (int64_t s = 0; s < pre; ++s) issue();

  // B x4 of one n-tile: matrices (n 0-7, k 0-7), (k 8-15), (k 16-23), (k 24-31) = the B
  // fragments of two k-steps; lane l gives row l & 7, 16-byte chunk l >> 3.
  const uint32_t b_lane = static_cast<uint32_t>((lane & 7) * rowb + (lane >> 3) * 16);
  float acc[T][4];
  uint32_t cj = 0;
  int ckt = 0, slot = 0;  // the consumer's k stage and ring slot
  uint32_t phase = 0;     // the slot's mbarrier parity: flips each pass over the ring
  Row1Cursor cat = start;
  Unit cu = unit(cat);
  for (int64_t s = 0; s < total; ++s) {
    mbar_wait(bar0 + 8 * slot, phase);
    if constexpr (ASHARED) {  // the first unit meets every A piece once; later ones find them landed
      if (cj == 0 && ckt % ring.a_per == 0) mbar_wait(smem0 + 8 * (ckt / ring.a_per), 0);
    }
    if (ckt == 0) {
#pragma unroll
      for (int b = 0; b < T; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[b][i] = 0.0f;
    }
    const uint32_t base = stage0 + slot * ring.stage_bytes;
    const int64_t k0 = static_cast<int64_t>(ckt) * kchunk;
    // the slot's rows from k0 on: after the stage's W rows, or (ASHARED) in the A region
    const uint32_t a_s = ASHARED ? a0 + static_cast<uint32_t>(k0 * 2) : base + Cfg::kWRows * rowb;
    const int steps = static_cast<int>((K - k0 < kchunk ? K - k0 : kchunk) / 16);  // K % 16 == 0
    // Groups of 8 k-steps: every load of the group is issued before its first mma, so the
    // shared-memory latency is paid once per group and the T chains run back to back.
    for (int k8 = 0; k8 < steps; k8 += 8) {
      // TMA: the group's 8 k-steps are the whole of sub-stage k8 / 8 (its W rows, then its A rows)
      const uint32_t gbase = TMA ? base + static_cast<uint32_t>((k8 / 8) * ring.tma_sub) : base;
      const int gk = TMA ? 0 : k8;
      const uint32_t ga = TMA ? a_s + static_cast<uint32_t>((k8 / 8) * ring.tma_sub) : a_s;
      if constexpr (SWAP) {
        // W tile w (SwiGLU: gate tiles, then up tiles): the unit's W rows w_row(w) + (lane & 15),
        // chunk lane >> 4 (load_a's words of those rows). Tokens 8 hf + (lane & 7), chunk lane >> 3,
        // two k-steps a load (load_b_nk's words), a token past the slot reading the 16 zero bytes;
        // the second half only where the slot has more than 8 rows (uniform).
        FragA fw[WT][8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int w = 0; w < WT; ++w)
            ldsm_x4(gbase + (swap_w_row(w) + (lane & 15)) * rowb + (lane >> 4) * 16 + (gk + j) * 32, fw[w][j].r[0],
                    fw[w][j].r[1], fw[w][j].r[2], fw[w][j].r[3]);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          if (hf == 1 && cu.rc <= 8) break;
          const int tok = 8 * hf + (lane & 7);
          const bool real = tok < cu.rc;
          const uint32_t t_lane = real ? ga + tok * rowb + (lane >> 3) * 16 + gk * 32 : zero16;
          const uint32_t t_step = real ? 64u : 0u;
          FragB ft[8];
#pragma unroll
          for (int h = 0; h < 4; ++h)
            ldsm_x4(t_lane + h * t_step, ft[2 * h].r[0], ft[2 * h].r[1], ft[2 * h + 1].r[0], ft[2 * h + 1].r[1]);
#pragma unroll
          for (int j2 = 0; j2 < 8; ++j2) {
            if (k8 + j2 < steps) {  // uniform: steps past K are skipped
#pragma unroll
              for (int w = 0; w < WT; ++w) mma_16816(acc[hf * WT + w], fw[w][j2], ft[j2]);
            }
          }
        }
      } else {
        FragB fb[T][8];
#pragma unroll
        for (int h = 0; h < 4; ++h)
#pragma unroll
          for (int b = 0; b < T; ++b)
            ldsm_x4(gbase + b * 8 * rowb + b_lane + (gk + 2 * h) * 32, fb[b][2 * h].r[0], fb[b][2 * h].r[1],
                    fb[b][2 * h + 1].r[0], fb[b][2 * h + 1].r[1]);
        // load_a's words of a tile whose rows are the slot's rows (one, or rc), the rest zero, by
        // ldmatrix x4 (gemm_rows16's A load): lane l gives row l & 15, 16-byte chunk l >> 4 of a
        // k-step; a row the slot does not have gives the 16 zero bytes. Every fragment is then one
        // unpredicated load into its own registers, where per-lane predicated 32-bit loads let the
        // compiler put each step's loads between the mmas, on the accumulator chain's path.
        FragA fa[8];
        {
          // A rows at the W rows' padded stride (ASHARED: the A region's; one row: unpadded, alone)
          const int a_row = lane & 15;
          const bool real = SLOT16 ? a_row < cu.rc : a_row == 0;
          const uint32_t ars = ASHARED ? static_cast<uint32_t>(ring.a_rowb) : static_cast<uint32_t>(rowb);
          const uint32_t a_lane = real ? ga + a_row * ars + (lane >> 4) * 16 + gk * 32 : zero16;
          const uint32_t a_step = real ? 32u : 0u;
#pragma unroll
          for (int j = 0; j < 8; ++j) ldsm_x4(a_lane + j * a_step, fa[j].r[0], fa[j].r[1], fa[j].r[2], fa[j].r[3]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (k8 + j < steps) {  // uniform: steps past K are skipped
#pragma unroll
            for (int b = 0; b < T; ++b) mma_16816(acc[b], fa[j], fb[b][j]);
          }
        }
      }
    }
    __syncwarp();  // every lane's reads of this ring slot are done
    if (s + ST < total) issue();  // stage s + ST, into the slot just read
    if (++slot == ST) {
      slot = 0;
      phase ^= 1u;
    }
    if (++ckt == n_k) {  // unit done: its outputs, by where each instance's accumulators hold them
      ckt = 0;
      if constexpr (SWAP) {  // acc[hf WT + w]: columns 16 m + g (0, 1) and + 8 (2, 3), tokens 8 hf + 2t, + 1
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int m = 0; m < MW; ++m)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int c = 16 * m + g + 8 * hh;
              if (c >= cu.nc) continue;
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int tok = 8 * hf + 2 * t + e;
                if (tok >= cu.rc) continue;
                const int64_t o = (cu.row + tok) * p.ldc + cu.c0 + c;
                const float v = acc[hf * WT + m][2 * hh + e];
                if (SWIGLU)
                  p.Act[o] = f32_to_bf16(siluf_(v) * acc[hf * WT + MW + m][2 * hh + e]);
                else
                  p.C[o] = v;
              }
            }
      } else if constexpr (SLOT16) {  // rows g (acc 0, 1) and g + 8 (acc 2, 3)
        const bool out2 = p.out2 != 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = g + 8 * e;
          if (r >= cu.rc) continue;
#pragma unroll
          for (int b = 0; b < NT; ++b) {
            const int c = 8 * b + 2 * t;
            const int64_t orow = (cu.row + r) * p.ldc + cu.c0 + c;
            if (SWIGLU)
              store_pair(p.Act + orow, f32_to_bf16(siluf_(acc[b][2 * e]) * acc[NT + b][2 * e]),
                         f32_to_bf16(siluf_(acc[b][2 * e + 1]) * acc[NT + b][2 * e + 1]), c, cu.nc, out2);
            else
              store_pair(p.C + orow, acc[b][2 * e], acc[b][2 * e + 1], c, cu.nc, out2);
          }
        }
      } else if (g == 0) {  // one row: row 0 lives in lanes 0..3, columns 2t, 2t + 1
        const bool out2 = p.out2 != 0;
#pragma unroll
        for (int b = 0; b < NT; ++b) {
          const int c = 8 * b + 2 * t;
          const int64_t orow = cu.row * p.ldc + cu.c0 + c;
          if (SWIGLU)
            store_pair(p.Act + orow, f32_to_bf16(siluf_(acc[b][0]) * acc[NT + b][0]),
                       f32_to_bf16(siluf_(acc[b][1]) * acc[NT + b][1]), c, cu.nc, out2);
          else
            store_pair(p.C + orow, acc[b][0], acc[b][1], c, cu.nc, out2);
        }
      }
      if constexpr (MOE == Row1Moe::kCombine) {
        // threadFenceReduction's pattern: every lane fences its stores, one lane counts
        __threadfence();
        __syncwarp();
        uint32_t done = 0;
        if (lane == 0) done = atomicAdd(p.moe.counters + cu.cu, 1u) + 1u;
        done = __shfl_sync(0xffffffffu, done, 0);
        if (done == static_cast<uint32_t>(slots)) {  // this unit's columns are complete in every slot
          __threadfence();
          const int k = p.moe.k;
          const int64_t col = cu.c0 + lane;  // nc <= 8 NT <= 32 columns, one per lane
          const bool live = lane < cu.nc;
          float routed = 0.0f;
          for (int s0 = 0; s0 < k; s0 += 8) {  // 8 slots' values in flight, then their fmas in order
            float wv[8], yv[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
              const int s = s0 + u < k ? s0 + u : 0;
              wv[u] = __shfl_sync(0xffffffffu, c_w, s);
              const int r = __shfl_sync(0xffffffffu, c_inv, s);
              yv[u] = live && s0 + u < k ? __ldcg(p.C + r * p.ldc + col) : 0.0f;  // L2: other SMs wrote them
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)
              if (s0 + u < k) routed = fmaf(wv[u], round_bf16(yv[u]), routed);
          }
          if (live) p.moe.out[col] = routed + c_sg * round_bf16(__ldcg(p.moe.sout + col));
        }
      }
      if (++cj < my_units) {
        cat.advance(d_hi, d_lo, n_lo);
        cu = unit(cat);
      }
    }
  }
}

}  // namespace baro_gpu
#endif  // !BARO_HIP
