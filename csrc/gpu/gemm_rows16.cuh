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

// ---- the pieces of the persistent kernel's K walks ----
// They are gemm_rows16_kernel's own steps, with a column window for the tail's pieces: the same
// copies, the same mma chain in ascending K, the same stores. gemm_rows16_kernel (below) keeps its
// inline copy: refactored onto these, its instances compiled to other register counts (63 -> 64
// for the MoE's gate/up), and the default path stays the code that was measured.

// Copy assignment: thread tid copies chunk tid % kRows16Chunks of stage rows
// tid / kRows16Chunks + kRowStep i (A rows 0..16 MT - 1, then the W rows).
template <typename Cfg>
struct Rows16Copy {
  static constexpr int kRowStep = Cfg::kThreads / kRows16Chunks;  // 8 with 4 warps
  int cp_chunk, cp_row;
  int64_t a_off[Cfg::kACopies];        // -1: a row past the slot (zero-filled without a read)
  const uint16_t* w_src[Cfg::kCopies];
  bool w_ok[Cfg::kCopies];             // false: a column outside the block's window (zero-filled)
};

// The W copies of output columns [lo, hi) relative to c0 (SwiGLU: their gate and up rows); the
// other rows of the block are zero-filled without a read. The folded shared expert's tiles read
// W_last, and plain W rows n >= n_split read W_tail (moe.cu's fold: the shared gate after the
// router's rows); gemm.cuh's GemmParams.
template <typename Cfg, bool SWIGLU>
BARO_DEV void rows16_w_sources(Rows16Copy<Cfg>& cp, const GemmParams& p, int64_t group, int64_t c0, int lo,
                               int hi) {
  const uint16_t* wbase = p.W_last != nullptr && group == p.last_group ? p.W_last : p.W + group * p.w_group_stride;
#pragma unroll
  for (int i = 0; i < Cfg::kCopies; ++i) {
    const int j = cp.cp_row + Rows16Copy<Cfg>::kRowStep * i;  // W row of the tile
    int rel;                                                 // its output column, relative to c0
    int64_t wrow;
    if (SWIGLU) {
      rel = j % Cfg::kOutCols;
      wrow = (j >= Cfg::kOutCols ? p.swiglu_I : 0) + c0 + rel;
    } else {
      rel = j;
      wrow = c0 + j;
    }
    cp.w_ok[i] = rel >= lo && rel < hi;
    if (!cp.w_ok[i]) wrow = 0;
    cp.w_src[i] = (p.W_tail != nullptr && wrow >= p.n_split ? p.W_tail + (wrow - p.n_split) * p.ldw
                                                             : wbase + wrow * p.ldw) +
                  cp.cp_chunk * 8;
  }
}

// Stage kt of the K walk (A rows, then W rows) into ring slot `slot`.
template <typename Cfg>
BARO_DEV void rows16_load_stage(const Rows16Copy<Cfg>& cp, const GemmParams& p, uint32_t smem0, int kt, int slot) {
  constexpr int kRowStep = Rows16Copy<Cfg>::kRowStep;
  const int64_t k0 = static_cast<int64_t>(kt) * kRows16BK;
  const bool k_ok = k0 + cp.cp_chunk * 8 < p.K;  // K % 8 == 0: a chunk is wholly in or past K
  const uint32_t base = smem0 + 2 * (slot * Cfg::kStageElems + cp.cp_row * kRows16Ld + cp.cp_chunk * 8);
#pragma unroll
  for (int i = 0; i < Cfg::kACopies; ++i) {
    const bool ok = cp.a_off[i] >= 0 && k_ok;
    cp_async16(base + 2 * kRowStep * i * kRows16Ld, ok ? p.A + cp.a_off[i] + k0 : p.A, ok);
  }
#pragma unroll
  for (int i = 0; i < Cfg::kCopies; ++i) {
    const bool ok = cp.w_ok[i] && k_ok;
    cp_async16(base + 2 * (Cfg::kARows + kRowStep * i) * kRows16Ld, ok ? cp.w_src[i] + k0 : p.W, ok);
  }
}

// One stage's mma steps (k0: the stage's first k) into acc, in ascending k.
// A x4 (== load_a): lane l gives row l & 15, k chunk l >> 4 of one 16-wide step.
// B x4 of one n-tile: matrices (n 0-7, k 0-7), (k 8-15), (k 16-23), (k 24-31)
// = the B fragments of two k-steps; lane l gives row l & 7, chunk l >> 3.
template <typename Cfg, int MT>
BARO_DEV void rows16_mma_stage(uint32_t base, int64_t k0, int64_t K, const int (&b_row)[Cfg::NT], int lane,
                               float (&acc)[MT][Cfg::NT][4]) {
  constexpr int NT = Cfg::NT;
  const int a_lrow = lane & 15, a_lchunk = lane >> 4, b_lchunk = lane >> 3;
#pragma unroll
  for (int kk2 = 0; kk2 < kRows16BK / 32; ++kk2) {  // pairs of k-steps
    if (k0 + kk2 * 32 < K) {
      FragB fb[NT][2];
#pragma unroll
      for (int b = 0; b < NT; ++b)
        ldsm_x4(base + 2 * (b_row[b] * kRows16Ld + kk2 * 32 + b_lchunk * 8), fb[b][0].r[0], fb[b][0].r[1],
                fb[b][1].r[0], fb[b][1].r[1]);
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

// The epilogue of warp `warp`'s columns (c0 + 8 warp ..) for slot rows [r0, r0 + rc).
template <typename Cfg, bool SWIGLU, int MT>
BARO_DEV void rows16_store(const GemmParams& p, const float (&acc)[MT][Cfg::NT][4], int64_t r0, int rc, int64_t c0,
                           int nc, int lane, int warp) {
  const int g = lane >> 2, t4 = lane & 3;
  const int c = warp * 8 + 2 * t4;
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
  if (!gemm_slot(p, gemm_block_slot(p), group, r0, rc64)) return;
  const int rc = static_cast<int>(rc64 < kARows ? rc64 : kARows);
  const int64_t c0 = static_cast<int64_t>(gemm_block_col(p)) * Cfg::kOutCols;
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

// ---- the persistent schedule of a grouped call (BARO_ROWS16_PERSIST; matmul.cu launches it) ----
// Why: a decode step of 8 sequences gives the MoE's gate/up GEMM about 58 tiles x 16 column
// blocks = 928 blocks of one K walk each (2.3 waves of the light ring's 3 blocks per SM), and ncu
// saw the SMs active only 81% of the call (H200, 2026-12-03): each block streams 256 KB, so the
// last blocks to start leave most SMs idle for most of a block's life.
// What: G = SMs x (blocks of this kernel an SM holds) blocks, all resident at once. The call's
// U = T x C items (T tiles from *n_tiles, C column blocks; item i is tile i % T of column block
// i / T, the default grid's order, so the items running at one time are a column block's tiles
// side by side and an expert's tiles meet in L2) are dealt round-robin: block b takes items
// b, b + G, .. for R = U / G full rounds. The rem = U - R G items left would be a thin last
// wave; each is split into s column pieces of WARPS / s warps (s the largest power of two up to
// WARPS with rem s <= G), one piece per block, so the tail is spread over up to G blocks, each
// reading 1/s of a block's W bytes. A block streams all its items' stages through one ring
// without draining between them (the next item's first stages land while the last ones of the
// current item are multiplied), its tile and A row reads made an item early.
// Bits: every output element is still one warp's fp32 fragment of the same mma chain over the
// same A and W fragments in ascending K (rows16_mma_stage, its accumulator zeroed at the item's
// first stage), stored by the same expression (rows16_store); only which block computes it, and
// when, changes. A warp outside its piece's window multiplies nothing and stores nothing.
// Requires a grouped call (p.tiles), p.vec, 16-row tiles.
template <bool SWIGLU, int WARPS>
__global__ void __launch_bounds__(WARPS * BARO_WARP) gemm_rows16_persist_kernel(GemmParams p) {
  using Cfg = Rows16Cfg<SWIGLU, true, WARPS, 1>;
  constexpr int NT = Cfg::NT, kS = Cfg::kStages;
  extern __shared__ __align__(16) uint16_t rows16_smem[];  // Cfg::kSmemBytes

  const int64_t T = *p.n_tiles;  // tiles of this call (the grid was sized for the most)
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t C = (out_n + Cfg::kOutCols - 1) / Cfg::kOutCols;
  const int64_t U = T > 0 ? T * C : 0, G = gridDim.x, b = blockIdx.x;
  const int64_t R = U / G, rem = U - R * G;
  int s = 1;  // column pieces per tail item
  for (int q = WARPS; q > 1; q /= 2)
    if (rem * q <= G) {
      s = q;
      break;
    }
  const int64_t n_items = R + (b < rem * s ? 1 : 0);
  if (n_items == 0) return;
  const int n_k = static_cast<int>((p.K + kRows16BK - 1) / kRows16BK);

  // item q of this block: its index i (tile i % T of column block i / T), window of warps [w_lo, w_hi)
  auto item_of = [&](int64_t q, int64_t& i, int& w_lo, int& w_hi) {
    if (q < R) {
      i = q * G + b;
      w_lo = 0;
      w_hi = WARPS;
    } else {
      i = R * G + b / s;
      const int width = WARPS / s;
      w_lo = static_cast<int>(b % s) * width;
      w_hi = w_lo + width;
    }
  };
  // item q's tile from the tile list; past this block's items (the loader's look-ahead) none, and
  // nothing read. (A tile always holds rows; were one empty, rc 0 would store nothing.)
  struct Tile {
    int64_t group = 0, r0 = 0;
    int rc = 0;
  };
  auto tile_of = [&](int64_t q, Tile& tl) {
    tl.rc = 0;
    if (q >= n_items) return;
    int64_t i, rc64 = 0;
    int w_lo, w_hi;
    item_of(q, i, w_lo, w_hi);
    if (!gemm_slot(p, i % T, tl.group, tl.r0, rc64)) rc64 = 0;
    tl.rc = static_cast<int>(rc64 < Cfg::kARows ? rc64 : Cfg::kARows);
  };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t smem0 = smem_u32(rows16_smem);
  Rows16Copy<Cfg> cp;
  cp.cp_chunk = tid & (kRows16Chunks - 1);
  cp.cp_row = tid / kRows16Chunks;

  // The loader: the next stage to copy is stage lkt of item lq. The reads behind an item's copy
  // sources (its tile, then its rows' A row ids through a_rows) are made an item early, so that
  // starting an item issues its copies without waiting on them while the ring still holds the
  // previous item's stages: at item lq's start, l_tile is its tile and a_next its copies' A rows
  // (-1: past the tile), read when item lq - 1 started; l_tile_next is item lq + 1's tile.
  int64_t lq = 0;
  int lkt = 0;
  Tile l_tile, l_tile_next;
  int32_t a_next[Cfg::kACopies];
  auto a_rows_of = [&](const Tile& tl) {
#pragma unroll
    for (int i = 0; i < Cfg::kACopies; ++i) {
      const int r = cp.cp_row + Rows16Copy<Cfg>::kRowStep * i;
      a_next[i] = -1;
      if (r < tl.rc) a_next[i] = p.a_rows != nullptr ? p.a_rows[tl.r0 + r] : static_cast<int32_t>(tl.r0 + r);
    }
  };
  tile_of(0, l_tile);
  a_rows_of(l_tile);
  tile_of(1, l_tile_next);
  auto load_next = [&](int slot) {
    if (lq >= n_items) return;
    if (lkt == 0) {  // a new item: its copies' sources, then the look-ahead's reads
      int64_t i;
      int w_lo, w_hi;
      item_of(lq, i, w_lo, w_hi);
      const int64_t c0 = (i / T) * Cfg::kOutCols;
      const int nc = out_n - c0 < Cfg::kOutCols ? static_cast<int>(out_n - c0) : Cfg::kOutCols;
#pragma unroll
      for (int a = 0; a < Cfg::kACopies; ++a)
        cp.a_off[a] = a_next[a] >= 0 ? static_cast<int64_t>(a_next[a]) * p.lda + cp.cp_chunk * 8 : -1;
      rows16_w_sources<Cfg, SWIGLU>(cp, p, l_tile.group, c0, 8 * w_lo, 8 * w_hi < nc ? 8 * w_hi : nc);
      l_tile = l_tile_next;
      a_rows_of(l_tile);
      tile_of(lq + 2, l_tile_next);
    }
    rows16_load_stage(cp, p, smem0, lkt, slot);
    if (++lkt == n_k) lkt = 0, ++lq;
  };

#pragma unroll
  for (int st = 0; st < kS - 1; ++st) {
    load_next(st);
    cp_async_commit();  // always: keeps the group count uniform
  }

  int b_row[NT];
#pragma unroll
  for (int bb = 0; bb < NT; ++bb) b_row[bb] = Cfg::kARows + (bb * WARPS + warp) * 8 + (lane & 7);

  float acc[1][NT][4];
  int64_t r0 = 0, c0 = 0;  // the item being multiplied (the consumer)
  int rc = 0, nc = 0;
  bool mine = false;  // this warp's columns are in the item's window
  const int64_t total = n_items * n_k;
  int kt = 0;
  for (int64_t gs = 0; gs < total; ++gs) {
    cp_async_wait<kS - 2>();
    __syncthreads();  // stage gs visible; stage gs-1 consumed by every warp
    load_next(static_cast<int>((gs + kS - 1) % kS));
    cp_async_commit();
    if (kt == 0) {  // the item's epilogue needs its tile only after its K walk: no wait here
      int64_t it;
      int w_lo, w_hi;
      item_of(gs / n_k, it, w_lo, w_hi);
      Tile tl;
      tile_of(gs / n_k, tl);
      r0 = tl.r0;
      rc = tl.rc;
      c0 = (it / T) * Cfg::kOutCols;
      nc = out_n - c0 < Cfg::kOutCols ? static_cast<int>(out_n - c0) : Cfg::kOutCols;
      mine = warp >= w_lo && warp < w_hi;
#pragma unroll
      for (int bb = 0; bb < NT; ++bb)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][bb][i] = 0.0f;
    }
    if (mine)  // warp-uniform
      rows16_mma_stage<Cfg, 1>(smem0 + 2 * static_cast<uint32_t>(gs % kS) * Cfg::kStageElems,
                               static_cast<int64_t>(kt) * kRows16BK, p.K, b_row, lane, acc);
    if (++kt == n_k) {
      kt = 0;
      if (mine) rows16_store<Cfg, SWIGLU, 1>(p, acc, r0, rc, c0, nc, lane, warp);
    }
  }
  cp_async_wait<0>();  // no copy may still target smem when the block exits
}

}  // namespace baro_gpu
#endif  // !BARO_HIP
