// baro_attention prefill on Hopper (sm_90a only), the default there (BARO_ATTN_WGMMA=0: the
// mma.sync kernel; attention_fa.cuh's fa_launch): attn_fa_kernel's serial mode (the 64-row prefill
// tile) with its two dots moved from mma.sync to wgmma, written to give the same bits for every
// row, so decode (attn_fa_kernel's 16-row tiles) still equals prefill.
//
// Why the bits are the same. attn_fa_kernel's prefill tile is 4 warp pairs; warp `half` of pair w
// owns tile rows 16w..16w+15, S columns 32 half..32 half+31 of each KV block and head dims
// half*hd/2.. of P V. Here warpgroup `half` (4 warps) plays warp `half` of all four pairs at once:
// warp w of a warpgroup holds tile rows 16w..16w+15 (the wgmma accumulator layout), and within
// every 8-column chunk a thread holds exactly the accumulator registers mma_16816 gives it. So
//  - S: one m64n32k16 per 16 head dims, ascending, into one fp32 accumulator zeroed first (as
//    attn_fa_kernel zeroes sacc; scale-d is always 1): the same tensor-core order (docs/DESIGN.md §2,
//    measured: wgmma and mma.sync agree for bf16 K walks). Q and K are the same bf16 values;
//  - the scale, the masks (a select), the row max, p = fa_ex2(s - m'), the row sum (in-thread over
//    n-tiles 0..3, column 2t then 2t+1, butterfly xor 1 then 2, then A + B through shared
//    memory), P rounded by fa_pack_bf16x2 into the same padded P rows, alpha, ls and ms: the same
//    statements as fa_block_step, on the same registers;
//  - P V: o = o * alpha, then 4 m64n{hd/2}k16 over the 64 keys ascending, A = the P fragments
//    from fa_load_a (the wgmma register-A layout is mma.sync's per warp), B = the V tile;
//  - splits of kAttnSplitBlocks blocks, the per-split online softmax, the in-order merge
//    (fa_merge_scale) and the epilogue are attn_fa_kernel's.
// One difference of form, not of value: attn_fa_kernel keeps o unchanged on a block where a row
// is inactive (wholly past its position) by a select after the mma; a wgmma accumulator cannot be
// selected per row, so such a row's split is merged at the start of its first inactive block
// (with the values the split end would have used: an inactive row's o, ms, ls never change), and
// the split end skips it. Later blocks and splits are never merged for it (its limit is below
// them), as in attn_fa_kernel.
//
// Shared memory operands. Q is stored as 8 x 8 blocks of 128 contiguous bytes: element (r, c) of
// a [rows][hd] tile at block (r/8, c/8) = ((r/8)*(hd/8) + c/8) * 128 B, row r%8 at 16 B, which
// wgmma reads without swizzle (K-major: LBO 128 B to the next 8 head dims, SBO hd*16 B to the
// next 8 rows). K and V take one of two paths, the same values in either:
//  - TMA (the default at hd 128 and 256): one thread issues cp.async.bulk.tensor copies of
//    64-position x 64-dim boxes (the caches are [S][Hkv][hd], so a block of one kv head is 64
//    rows 512 B long, Hkv*hd*2 B apart: a 2-D box, not one contiguous run) in the 128-byte
//    swizzle, completing on one mbarrier per ring stage. wgmma reads K K-major and V N-major
//    (trans-b) through swizzled descriptors (wg_kdesc, wg_vdesc). Whole 128-byte lines, no
//    thread issues per-16-byte copies, and no per-step proxy fence. attention_wgmma_set_loads(2)
//    (experimental, for timing): clusters of two adjacent tiles multicast the blocks both read,
//    each CTA copying half the boxes (half the L2 reads; see wg_tma_tile_pair).
//  - the cp.async rings (hd 32 and 64; attention_wgmma_set_loads(0) for all): Q's blocked layout
//    for K and V too (V N-major: LBO hd*16 B to the next 8 keys, SBO 128 B to the next 8 dims),
//    8 consecutive threads filling one block.
// Rows past the last written cache row are zeros on both paths (attn_fa_kernel's rule: P V must
// not meet stale values): the rings copy 0 bytes for them, the TMA path writes the zeros over
// the landed block (only the blocks that hold such rows).
//
// Schedule: one tile per block, 256 threads, one block per SM (202 KB of shared memory at hd
// 256, 203 with TMA); K blocks are in flight two (hd 256) or three blocks ahead of their step
// and V blocks one or two (WgLayout). On the TMA path block b + 1's S is issued before block b's
// softmax and waited for with block b's P V (kPipe: 9.95 -> 9.65 ms for an 8192-row call at 32k
// context on the H100, op_times_attn_pipe{0,1}_ctx32768_bbbad77_h100.json); P V is waited for
// right after it is issued.
// What the rings cost (H200, the 32k prompt's last 8k chunk at hd 256; attn_wgmma_h200.json):
// 25.9 ms against attn_fa_kernel's 20.8, 11.5 against 16.6 without the in-loop copies. Those
// times were taken with the harness built -dc, where every wgmma was serialised (see
// benchmarks/wgmma_attention_check.cu); the library's build is not. The rings lose on copies:
// each warp reads 8 rows x 64 bytes, half a 128-byte line per row, so the same bytes take twice
// the L2 requests (ncu: L2 throughput 84% against 42%, hit rate 99% for both). The TMA path
// fetches whole lines in 8 KB boxes: 13.9 ms against the default's 20.8 on the same chunk, the
// pairs 16.5, every harness case byte-equal (wgmma_attention_check_{tma,pairs}_a1c85d2_h200.jsonl).
#include <atomic>
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "dot.cuh"
#include "launch.h"

#if !BARO_HIP && defined(BARO_WGMMA) && BARO_WGMMA
#define BARO_WGMMA_BUILT 1
#else
#define BARO_WGMMA_BUILT 0
#endif

#if BARO_WGMMA_BUILT

// mbarriers, TMA boxes, wgmma descriptors and fences, the tensor-map encoder (shared with gemm_wgmma.cu)
#include "wgmma_util.cuh"

// Shared with attn_fa_kernel: the KV block and split, the norm + rotary element, the n_valid clamp.
#include "attention_common.cuh"

// fa_ex2, fa_merge_scale, fa_pack_bf16x2, fa_load_a, cp.async: attn_fa_kernel's own helpers
// (the kernels of that header stay in attention.cu's translation unit).
#define BARO_FA_HELPERS_ONLY 1
#include "attention_fa.cuh"

namespace baro_gpu {

constexpr int kWgRows = kFaBigPairs * kFaPairRows;  // 64: attn_fa_kernel's prefill tile
constexpr int kWgThreads = 2 * 128;                 // two warpgroups
static_assert(kFaKB == kAttnKB && kWgRows == 64, "the tile and block of attn_fa_kernel");

// kTma: K and V tiles arrive by TMA (cp.async.bulk.tensor) in wgmma's 128-byte swizzle, their
// completion counted on one mbarrier per ring stage; only head dims whose warpgroup half is whole
// 64-dim boxes (128, 256) take it. Otherwise the cp.async rings (the first version).
template <int kHd>
constexpr bool wg_tma_ok() {
  return kHd == 128 || kHd == 256;
}

template <int kHd, bool kTma = false>
struct WgLayout {
  static constexpr int kChunks = kHd / 8;  // 8 x 8 blocks per 8 rows
  static constexpr int kNt = kHd / 16;     // 8-dim chunks of a warpgroup's half of the head dims
  // Rings of K and V blocks. S needs block b's K at the start of its step and P V its V only at
  // the end, so K runs one block further ahead than V: a K copy has two steps to land, a V copy
  // one and a half (hd 256: 202 KB, where a third V stage would not fit).
  static constexpr int kVStages = kHd > 128 ? 2 : 3;
  static constexpr int kKStages = kVStages + 1;
  static constexpr int kVLead = kVStages - 1;  // blocks a V copy is issued ahead of its use
  static constexpr int kKLead = kKStages - 1;
  // Each step commits two cp.async groups, V(b + kVLead) then K(b + kKLead). Block b's K is then
  // older than the newest 2 (kKLead - 1) groups at the top of step b, and its V older than the
  // newest 2 kVLead + 1 once step b has committed its own two.
  static constexpr int kKWait = 2 * (kKLead - 1);
  static constexpr int kVWait = 2 * kVLead + 1;
  static constexpr uint32_t kRowGroup = kChunks * 128;  // bytes from one 8-row group to the next
  static constexpr int kTile = kFaKB * kHd * 2;         // bytes of a K or V (or Q) tile
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kTile;
  static constexpr int kV = kK + kKStages * kTile;
  static constexpr int kP = kV + kVStages * kTile;
  static constexpr int kRed = kP + kWgRows * kFaPld * 2;
  static constexpr int kBar = kRed + 4 * kWgRows * 4;  // [max|sum][half][row], then the mbarriers
  // TMA: full-barriers of the K then the V stages, then (pairs) their empty-barriers; 1 KB of slack
  // to put the tiles on the 1024-byte boundary the 128-byte swizzle pattern repeats on (the same
  // address bits for TMA and wgmma).
  static constexpr int kTotal = kTma ? kBar + 16 * (kKStages + kVStages) + 1024 : kBar;
  static_assert(!kTma || (kTile % 1024 == 0 && wg_tma_ok<kHd>()), "swizzled tiles on 1 KB");
  static_assert(kTotal <= 227 * 1024, "shared memory of one block");
};

// Element (r, c) of a [rows][kHd] operand tile (see the header comment).
template <int kHd>
BARO_DEV int wg_off(int r, int c) {
  return ((r >> 3) * (kHd / 8) + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7);
}

// Rows j0..j0+63 of one kv head -> dst (blocked layout) with cp.async; rows past lim are
// zero-filled and never read (fa_issue_tile's rule). Thread tid fills row 8k + tid%8 of 16-byte
// column (tid/8) % (kHd/8): 8 consecutive threads write one 128-byte block.
template <int kHd>
BARO_DEV void wg_issue_tile(uint16_t* __restrict__ dst, const uint16_t* __restrict__ base,
                            int64_t row_stride, int j0, int lim) {
  constexpr int kChunks = kHd / 8;
  constexpr int kGroups = kWgThreads / (8 * kChunks);  // 8-row groups per pass
  static_assert(kWgThreads % (8 * kChunks) == 0 && (kFaKB / 8) % kGroups == 0, "whole passes");
  const int tid = threadIdx.x;
  const int rl = tid & 7, c = (tid >> 3) % kChunks, rg = (tid >> 3) / kChunks;
#pragma unroll
  for (int r8 = rg; r8 < kFaKB / 8; r8 += kGroups) {
    const int r = 8 * r8 + rl;
    const bool ok = j0 + r <= lim;
    const uint16_t* src = base + static_cast<int64_t>(j0 + r) * row_stride + 8 * c;
    fa_cp_async16(dst + (r8 * kChunks + c) * 64 + rl * 8, ok ? src : base, ok ? 16 : 0);
  }
}

// ---- The TMA path: tensor maps, mbarriers, swizzled tiles ----
// The caches as 2-D tensors of [S][Hkv * hd] bf16 (a position's heads side by side), one box =
// 64 positions x 64 head dims of one kv head (128 bytes a row: one swizzle span). A K or V tile
// is kHd / 64 boxes, each 8 KB: box q holds dims 64q.. of the 64 rows, row r at 128 r, its eight
// 16-byte chunks permuted by r % 8 (the 128-byte swizzle).
struct WgMaps {
  CUtensorMap k, v;
};

// Block (rows j0..j0+63) of kv head kh into tile dst: the arrival with its byte count, then the
// kHd / 64 boxes. One thread.
template <int kHd>
BARO_DEV void wg_tma_tile(uint16_t* dst, const CUtensorMap* map, int kh, int j0, uint32_t bar) {
  wg_mbar_expect(bar, kFaKB * kHd * 2);
  const uint32_t d = fa_smem_addr(dst);
#pragma unroll
  for (int q = 0; q < kHd / 64; ++q) tma_box(d + q * kFaKB * 128, map, kh * kHd + 64 * q, j0, bar);
}
// ---- Pairs (attention_wgmma_set_loads(2)): clusters of two CTAs on adjacent tiles of one kv
// head. Both need the same K/V blocks up to the shorter one's last; for those each CTA copies
// half the boxes and multicasts them into both, halving the L2 reads (every tile reads all of
// its KV: ~60 GB per 8k chunk at 32k). A stage is refilled with a shared block only after both
// CTAs released it: each one's issuing thread arrives on both CTAs' empty-barrier of the stage
// (count 2), then waits on its own. The layouts match, so a multicast lands at the same offsets
// and completes on the same full-barrier in each CTA; a CTA's own arrival carries the block's
// whole byte count, the peer's bytes may land before it (the phase waits for the arrival).
// A block both CTAs of the pair need: this CTA's arrival with the block's whole byte count, and its
// half of the boxes (those of its rank's parity) into both.
template <int kHd>
BARO_DEV void wg_tma_tile_pair(uint16_t* dst, const CUtensorMap* map, int kh, int j0, uint32_t bar, uint32_t rank) {
  static_assert(kHd / 64 % 2 == 0, "boxes split evenly over the pair");
  wg_mbar_expect(bar, kFaKB * kHd * 2);
  const uint32_t d = fa_smem_addr(dst);
#pragma unroll
  for (int q = static_cast<int>(rank); q < kHd / 64; q += 2)
    wg_tma_box_pair(d + q * kFaKB * 128, map, kh * kHd + 64 * q, j0, bar);
}

// Rows first.. of a swizzled tile to zero: fa_issue_tile's zero fill of rows past the last
// written cache row (TMA brings whatever the cache holds there; P V must see finite zeros, as
// attn_fa_kernel does). A row's chunks stay inside its own 128 bytes of each box, so the
// permutation does not matter. Every thread; the caller fences for the async proxy and syncs.
template <int kHd>
BARO_DEV void wg_zero_rows(uint16_t* tile, int first) {
  uint4* p = reinterpret_cast<uint4*>(tile);
  for (int i = threadIdx.x; i < kFaKB * kHd / 8; i += kWgThreads)
    if (((i >> 3) & (kFaKB - 1)) >= first) p[i] = make_uint4(0u, 0u, 0u, 0u);
}

// B of S (K-major) for keys n0.. (a multiple of 8) and head dims 0..15 of a K tile; head dims
// k0..k0+15 are wg_desc_at(that, wg_kstep_bytes(k0)). Blocked: 8 x 8 blocks, LBO the next 8 dims,
// SBO the next 8 keys. Swizzled: box k0 / 64, the 16 dims as a 32-byte step inside the 128-byte
// rows (the swizzle applies to the address wgmma forms, as TMA's did), SBO 1024 the next 8 keys;
// LBO unused (16 dims never cross a row).
template <int kHd, bool kTma>
BARO_DEV uint64_t wg_kdesc(const uint16_t* Kt, int n0) {
  if constexpr (kTma)
    return wg_desc_sw128(Kt + n0 * 64, 16, 1024);
  else
    return wg_desc(Kt + (n0 / 8) * (kHd / 8) * 64, 128, kHd / 8 * 128);
}
// Bytes from head dim 0 to head dim k0 (a multiple of 16) in a K tile: swizzled, box k0 / 64 then
// 2 bytes a dim inside its rows; blocked, 128 bytes per 8 dims.
template <int kHd, bool kTma>
BARO_DEV constexpr uint32_t wg_kstep_bytes(int k0) {
  return kTma ? static_cast<uint32_t>(2 * ((k0 / 64) * (kFaKB * 64) + k0 % 64)) : static_cast<uint32_t>(2 * k0 * 8);
}
// B of P V (N-major, trans-b) for keys 16 kk..16 kk+15 and head dims d0.. (this warpgroup's half)
// of a V tile. Blocked: LBO the next 8 keys, SBO the next 8 dims. Swizzled: box d0 / 64, keys at
// 128 bytes, LBO = 8 KB the next 64 dims (the next box), SBO 1024 the next 8 keys.
template <int kHd, bool kTma>
BARO_DEV uint64_t wg_vdesc(const uint16_t* Vt, int kk, int d0) {
  if constexpr (kTma)
    return wg_desc_sw128(Vt + (d0 / 64) * (kFaKB * 64) + kk * 16 * 64, kFaKB * 128, 1024);
  else
    return wg_desc(Vt + (2 * kk * (kHd / 8) + d0 / 8) * 64, kHd / 8 * 128, 128);
}

// d[4][4] += A[64 x 16] B[16 x 32], A and B from shared memory (K-major both: Q and K tiles).
BARO_DEV void wg_mma_s(float (&d)[4][4], uint64_t adesc, uint64_t bdesc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(adesc), "l"(bdesc), "r"(1));
}
// d[2][4] += A[64 x 16] B[16 x 16], A from registers (this warp's 16 rows, FragA), B from
// shared memory N-major (trans-b: the V tile).
BARO_DEV void wg_mma_pv(float (&d)[2][4], const FragA& a, uint64_t bdesc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(bdesc), "r"(1));
}
// d[4][4] += A[64 x 16] B[16 x 32], A from registers (this warp's 16 rows, FragA), B from
// shared memory N-major (trans-b: the V tile).
BARO_DEV void wg_mma_pv(float (&d)[4][4], const FragA& a, uint64_t bdesc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(bdesc), "r"(1));
}
// d[8][4] += A[64 x 16] B[16 x 64], A from registers (this warp's 16 rows, FragA), B from
// shared memory N-major (trans-b: the V tile).
BARO_DEV void wg_mma_pv(float (&d)[8][4], const FragA& a, uint64_t bdesc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(bdesc), "r"(1));
}
// d[16][4] += A[64 x 16] B[16 x 128], A from registers (this warp's 16 rows, FragA), B from
// shared memory N-major (trans-b: the V tile).
BARO_DEV void wg_mma_pv(float (&d)[16][4], const FragA& a, uint64_t bdesc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
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
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(bdesc), "r"(1));
}

// Step a, issued: S for this warpgroup's 32 columns of K tile Kt, head dims ascending into one
// accumulator zeroed first, committed as one wgmma group and not waited for.
template <int kHd, bool kTma>
BARO_DEV void wg_s_issue(const uint16_t* __restrict__ Qs, const uint16_t* __restrict__ Kt, int half,
                         float (&sacc)[4][4]) {
  using L = WgLayout<kHd, kTma>;
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) sacc[u][i] = 0.0f;
  wg_hold(sacc);
  wg_fence();
  // the k16 steps' operands as the first step's descriptors plus constant offsets (wg_desc_at):
  // the descriptors of each k0's addresses
  const uint64_t qd = wg_desc(Qs, 128, L::kRowGroup), kd = wg_kdesc<kHd, kTma>(Kt, half * 32);
#pragma unroll
  for (int k0 = 0; k0 < kHd; k0 += 16)
    wg_mma_s(sacc, wg_desc_at(qd, 2 * k0 * 8), wg_desc_at(kd, wg_kstep_bytes<kHd, kTma>(k0)));
  wg_commit();
}

// Keeps P's fragments in their registers up to here: a P V in flight reads them.
template <int N>
BARO_DEV void wg_hold_a(FragA (&a)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[j].r[i])::"memory");
}

// Steps a-d of one KV block of 64 keys (from j0) for the tile: fa_block_step's statements with
// pair -> w (this warp in its warpgroup), half -> the warpgroup, and the two dots on wgmma.
// kIssued: S is already in sacc (wg_s_issue'd and waited for by the caller: the pipelined loop
// issues block b + 1's S before block b's softmax); otherwise step a runs here.
// kMasked = false only when every row of the tile is real and its limit is >= j0 + 63.
// kTma: Vt arrives by TMA, complete when phase vpar of the mbarrier vbar is; its rows vrows..
// (past the last written cache row) are zeroed here. Otherwise by this thread's cp.async groups.
// kDeferPV (with kIssued and kTma): block b - 1's P V, its A operand in pa, may still run on entry
// and block b's is left running on return. It is waited for just before the second barrier (with
// block b + 1's S: ptxas serialises every wgmma where both of a block's waits leave a group in
// flight), and v_free() runs right after that barrier, when no warp reads block b - 1's V stage.
template <bool kMasked, int kHd, bool kTma, bool kIssued = false, bool kDeferPV = false, class VFree>
BARO_DEV void wg_block_step(const uint16_t* __restrict__ Qs, const uint16_t* __restrict__ Kt,
                            uint16_t* __restrict__ Vt, uint16_t* __restrict__ Ps,
                            float* __restrict__ red, int half, int w, int j0, const int (&lim)[2], float sl2,
                            float (&o)[WgLayout<kHd>::kNt][4], float (&ms)[2], float (&ls)[2],
                            uint32_t vbar, uint32_t vpar, int vrows, float (&sacc)[4][4],
                            FragA (&pa)[kFaKB / 16], VFree&& v_free) {
  static_assert(!kDeferPV || (kIssued && kTma), "a deferred P V follows the pipelined TMA loop");
  using L = WgLayout<kHd, kTma>;
  const int lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  const int nbase = half * 32;  // this warpgroup's S columns
  const int rb = 16 * w;        // this warp's first tile row

  // a. S for this warpgroup's 32 columns: K ascending into one accumulator.
  if constexpr (!kIssued) {
    wg_s_issue<kHd, kTma>(Qs, Kt, half, sacc);
    wg_wait_all();
    wg_hold(sacc);
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
    if (t == 0) red[half * kWgRows + rb + g + 8 * e] = mx[e];
  }
  __syncthreads();
  // c. p = 2^(s - m'), in-thread sum in a fixed order, quad butterfly, P -> smem.
  float alpha[2], mnew[2], psum[2];
  bool active[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = rb + g + 8 * e;
    const float bmax = fmaxf(red[r], red[kWgRows + r]);
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
    if (t == 0) red[2 * kWgRows + half * kWgRows + rb + g + 8 * e] = psum[e];
  }
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = nbase + 8 * u + 2 * t;
      *reinterpret_cast<uint32_t*>(Ps + (rb + g + 8 * e) * kFaPld + c) =
          fa_pack_bf16x2(sacc[u][2 * e], sacc[u][2 * e + 1]);
    }
  if constexpr (kTma) {
    wg_mbar_wait(vbar, vpar);  // this block's V, for P V below
    if (vrows < kFaKB) {  // uniform: the block holds rows past the last written one
      wg_zero_rows<kHd>(Vt, vrows);
      wg_fence_proxy();
    }
  } else {
    fa_cp_async_wait<L::kVWait>();  // this block's V, for P V below
    wg_fence_proxy();
  }
  if constexpr (kDeferPV) {  // block b - 1's P V: o, pa and its V stage are free after this
    wg_wait_all();
    wg_hold(o);
    wg_hold_a(pa);
  }
  __syncthreads();
  if constexpr (kDeferPV) v_free();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (active[e]) {
      const int r = rb + g + 8 * e;
      const float lb = red[2 * kWgRows + r] + red[3 * kWgRows + r];  // A then B
      ls[e] = ls[e] * alpha[e] + lb;
      ms[e] = mnew[e];
    }
  }
  // d. o = o * alpha + P V over this warpgroup's dims, the 4 key steps ascending. A row inactive
  //    on this block was merged before it (attn_wgmma_kernel); its o is dead from here on.
#pragma unroll
  for (int kk = 0; kk < kFaKB / 16; ++kk) fa_load_a(pa[kk], Ps + rb * kFaPld + kk * 16, kFaPld);
#pragma unroll
  for (int q = 0; q < L::kNt; ++q) {
    o[q][0] = o[q][0] * alpha[0];
    o[q][1] = o[q][1] * alpha[0];
    o[q][2] = o[q][2] * alpha[1];
    o[q][3] = o[q][3] * alpha[1];
  }
  wg_hold(o);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < kFaKB / 16; ++kk)
    wg_mma_pv(o, pa[kk], wg_vdesc<kHd, kTma>(Vt, kk, half * (kHd / 2)));
  wg_commit();
  if constexpr (!kDeferPV) {
    wg_wait_all();
    wg_hold(o);
  }
}

// Grid (tiles, Hkv): tile x of kv head y, the tiles last-first (attn_fa_kernel's serial mode).
// kTma: K/V by TMA through maps (wg_launch); else the cp.async rings, maps unused. kPair (with
// kTma): launched in clusters of 2 along x, blocks both tiles need multicast (see wg_tma_tile_pair).
// kPipe (with kTma, not kPair; 1, the default, BARO_ATTN_PIPE=0 turns it off): block b + 1's S is
// issued before block b's softmax, so the tensor cores compute it while the warps run the softmax
// and P V's setup; every dot and every statement is the same, only when S is issued moves. Block
// b + 1's K is waited for at the top of step b, so a K copy has one step to land, not two.
// kPipe 2 (BARO_ATTN_PIPE=2, opt-in): block b's P V also runs beside block b + 1's S issue and
// softmax, its A operand (P) held in registers until then; wg_block_step waits for it before the
// o rescale, and anything else that touches o waits first (a split's start follows a split end,
// which waits; a row's merge on its first inactive block; a split's end). The room for that comes
// from the split merge's O, which moves to global memory (Og: `scratch`, 64 rows x hd fp32 a tile,
// each thread its own O elements, read and written once a split: the same products and sums as in
// registers, the first merge of a row against 0.0f as the registers held). Block b + 1's V refills
// block b - 1's stage once that P V is done in both warpgroups, so it has one step to land.
// It stays opt-in: on an H100 the op gains 1.3% / 2.7% at 32k / 64k context and a prefill does
// not move, for 128 MB of scratch an 8,192-row chunk (docs/PERF.md, 2026-12-07).
template <int kHd, bool kTma, bool kPair, int kPipe = 0>
__global__ void __launch_bounds__(kWgThreads, 1)
    attn_wgmma_kernel(AttentionArgs a, const __grid_constant__ WgMaps maps, float* __restrict__ Og) {
  static_assert(kTma || !kPair, "pairs share TMA copies");
  static_assert(!kPipe || (kTma && !kPair), "the pipelined loop is written for the one-CTA TMA path");
  constexpr bool kDeferPV = kPipe == 2;
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgLayout<kHd, kTma>;
  constexpr int hd = kHd;
  extern __shared__ uint4 wg_smem4[];
  grid_dependency_wait();  // launch_dependent: the cache write first
  char* smem = reinterpret_cast<char*>(wg_smem4);
  if constexpr (kTma) smem += (1024u - (fa_smem_addr(wg_smem4) & 1023u)) & 1023u;  // kTotal has the slack
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + L::kQ);
  uint16_t* K0 = reinterpret_cast<uint16_t*>(smem + L::kK);
  uint16_t* V0 = reinterpret_cast<uint16_t*>(smem + L::kV);
  uint16_t* Ps = reinterpret_cast<uint16_t*>(smem + L::kP);
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  constexpr int tile_el = kFaKB * hd;  // elements per K or V tile

  const int lane = lane_id(), warp = warp_id();
  const int half = warp >> 2, w = warp & 3;  // warpgroup, warp in it (tile rows 16w..)
  const int g = lane >> 2, t = lane & 3;

  const int kh = blockIdx.y;
  const int G = a.H / a.Hkv;
  const int64_t m = a.m;
  const int64_t nrows = m * G;
  const int64_t tile = gridDim.x - 1 - blockIdx.x;
  const int64_t R0 = tile * kWgRows;
  if (R0 >= nrows) {  // the pad of an odd tile count (pairs): the peer's two cluster barriers
    if constexpr (kPair) {
      wg_cluster_sync();
      wg_cluster_sync();
    }
    return;
  }
  const int64_t pos = *a.pos;
  const int64_t nvld = clamp_nvalid(a.n_valid, m);
  const int64_t R_last = (R0 + kWgRows < nrows ? R0 + kWgRows : nrows) - 1;

  int64_t tile_lim = pos + R_last / G;  // last row's position
  if (tile_lim > a.S - 1) tile_lim = a.S - 1;
  int64_t load_lim = pos + nvld - 1;  // last cache row written so far
  if (load_lim > tile_lim) load_lim = tile_lim;
  const int n_blocks = tile_lim < 0 ? 0 : static_cast<int>(tile_lim / kFaKB + 1);
  const int b_begin = 0, b_end = n_blocks;
  const int lim_load = static_cast<int>(load_lim < -1 ? -1 : load_lim);

  const int64_t row_stride = static_cast<int64_t>(a.Hkv) * hd;
  const uint16_t* kbase = a.k_cache + static_cast<int64_t>(kh) * hd;
  const uint16_t* vbase = a.v_cache + static_cast<int64_t>(kh) * hd;
  // TMA: stage s of the K ring completes on kbar + 8 s, of the V ring on vbar + 8 s; block b's
  // use of its stage is the (b / stages)-th, so it waits for the phase of that parity. A stage
  // is refilled only after the barrier that ends every thread's wait on its previous use, so no
  // waiter can miss a phase.
  const uint32_t kbar = fa_smem_addr(smem + L::kBar), vbar = kbar + 8 * L::kKStages;
  const uint32_t kempty = kbar + 8 * (L::kKStages + L::kVStages), vempty = kempty + 8 * L::kKStages;
  // Pairs: blocks below `common` are the ones both tiles of the cluster read (the peer's count by
  // the same rule as b_end: both CTAs get the same number); the longer tile copies the rest alone.
  int common = 0;
  uint32_t rank = 0;
  if constexpr (kPair) {
    rank = wg_cluster_rank();
    const int64_t pR0 = (static_cast<int64_t>(gridDim.x) - 1 - (blockIdx.x ^ 1u)) * kWgRows;
    int p_blocks = 0;
    if (pR0 < nrows) {
      const int64_t pR_last = (pR0 + kWgRows < nrows ? pR0 + kWgRows : nrows) - 1;
      int64_t p_lim = pos + pR_last / G;
      if (p_lim > a.S - 1) p_lim = a.S - 1;
      p_blocks = p_lim < 0 ? 0 : static_cast<int>(p_lim / kFaKB + 1);
    }
    common = p_blocks < b_end ? p_blocks : b_end;
  }
  // Block bl into its stage of one ring (thread 0): multicast half of it for a shared block, all
  // of it alone otherwise. A shared block refilling a used stage first releases that stage in
  // both CTAs (the barrier just passed ended this CTA's reads of it) and waits for the peer's
  // release: the (bl / stages)-th use of the stage, so its empty-barrier's phase bl / stages - 1.
  auto issue = [&](uint16_t* ring, const CUtensorMap* map, uint32_t full, uint32_t empty, int stages, int bl,
                   bool refill) {
    if constexpr (kTma) {
      const int st = bl % stages;
      uint16_t* dst = ring + st * tile_el;
      if constexpr (kPair) {
        if (bl < common) {
          if (refill && bl >= stages) {
            wg_mbar_arrive_cta(empty + 8 * st, 0);
            wg_mbar_arrive_cta(empty + 8 * st, 1);
            wg_mbar_wait(empty + 8 * st, (bl / stages - 1) & 1);
          }
          wg_tma_tile_pair<kHd>(dst, map, kh, bl * kFaKB, full + 8 * st, rank);
          return;
        }
      }
      wg_tma_tile<kHd>(dst, map, kh, bl * kFaKB, full + 8 * st);
    }
  };
  if constexpr (kTma) {
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.k)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.v)) : "memory");
      for (int s = 0; s < L::kKStages + L::kVStages; ++s) wg_mbar_init(kbar + 8 * s, 1);
      if constexpr (kPair)  // one arrival from each CTA of the pair
        for (int s = 0; s < L::kKStages + L::kVStages; ++s) wg_mbar_init(kempty + 8 * s, 2);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // for the TMA unit, the peer
    }
    // the barriers initialised before anyone (pairs: the peer's copies and arrivals too) uses them
    if constexpr (kPair)
      wg_cluster_sync();
    else
      __syncthreads();
    if (threadIdx.x == 0) {  // the first blocks in flight while Q is normed (first uses of stages)
      for (int j = 0; j < L::kVLead && j < b_end; ++j) issue(V0, &maps.v, vbar, vempty, L::kVStages, j, false);
      for (int j = 0; j < L::kKLead && j < b_end; ++j) issue(K0, &maps.k, kbar, kempty, L::kKStages, j, false);
    }
  } else {
  // The first blocks in flight while Q is normed: the groups steps -kKLead..-1 would have
  // committed (V(j + kVLead), then K(j + kKLead)), empty where the block is < 0 or >= b_end, so
  // every step's waits count the same.
#pragma unroll
  for (int j = -L::kKLead; j < 0; ++j) {
    const int bv = j + L::kVLead, bk = j + L::kKLead;
    if (bv >= b_begin && bv < b_end)
      wg_issue_tile<kHd>(V0 + (bv % L::kVStages) * tile_el, vbase, row_stride, bv * kFaKB, lim_load);
    fa_cp_async_commit();
    if (bk < b_end) wg_issue_tile<kHd>(K0 + (bk % L::kKStages) * tile_el, kbase, row_stride, bk * kFaKB, lim_load);
    fa_cp_async_commit();
  }
  }

  // Q tile (bf16): attn_fa_kernel's per-(token, head) warp code, stored blocked.
  const int64_t W = static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
  for (int r = warp; r < kWgRows; r += kWgThreads / BARO_WARP) {
    const int64_t R = R0 + r;
    if (R < nrows) {
      const int64_t i = R / G;
      const int h = kh * G + static_cast<int>(R - i * G);
      const float* xq = a.qkv + i * W + static_cast<int64_t>(h) * 2 * hd;
      const float rr = inv_rms(warp_sumsq(xq, hd), static_cast<float>(hd), a.eps);
      const float* cr = a.cos + i * a.R2;
      const float* sr = a.sin + i * a.R2;
      for (int d = lane; d < hd; d += BARO_WARP)
        Qs[wg_off<kHd>(r, d)] = f32_to_bf16(norm_rope_elem(xq, a.q_norm, rr, cr, sr, a.R2, d));
    } else {
      for (int d = lane; d < hd; d += BARO_WARP) Qs[wg_off<kHd>(r, d)] = 0;
    }
  }
  wg_fence_proxy();  // Q for the first block's wgmma (after the loop's barrier)

  // This lane's rows g and g+8 of warp w's 16: position limit (-1: padding row).
  int lim[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int64_t R = R0 + w * kFaPairRows + g + 8 * e;
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
  if (R_last == R0 + kWgRows - 1) {
    int64_t l = pos + R0 / G;
    if (l > a.S - 1) l = a.S - 1;
    lim_min = static_cast<int>(l < -1 ? -1 : l);
  }
  const float sl2 = a.scale * 1.44269504088896340736f;  // scores in base 2
  constexpr int nnt = L::kNt;                          // 8-dim chunks of this warpgroup's head dims
  const int dbase = half * (hd / 2);                    // this warpgroup's head dims

  float o[nnt][4];  // this split's O (reset when a split starts: b % kAttnSplitBlocks == 0)
  FragA pa[kFaKB / 16];  // the block's P as P V's A operand (kDeferPV: live until the next block's wait)
#pragma unroll
  for (int q = 0; q < nnt; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[q][i] = 0.0f;
  float ms[2] = {-INFINITY, -INFINITY}, ls[2] = {0.0f, 0.0f};
  // running merge over splits: in registers, or (kDeferPV) in this block's nnt x 4 x 256 floats of
  // Og, O[q][2e..2e+1] of thread t at float2 (2q + e) * 256 + t (a warp's accesses side by side);
  // fresh[e]: row e not merged yet (its O is 0.0f)
  float O[kDeferPV ? 1 : nnt][4];
  float2* Og2 = nullptr;
  bool fresh[2] = {true, true};
  if constexpr (kDeferPV)
    Og2 = reinterpret_cast<float2*>(Og + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kWgThreads *
                                             (nnt * 4)) + threadIdx.x;
  float Mrun[2] = {-INFINITY, -INFINITY}, Lrun[2] = {0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < (kDeferPV ? 1 : nnt); ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) O[q][i] = 0.0f;
  // O[q][2e..2e+1] of row e as merged so far
  auto o_run = [&](int q, int e) {
    if constexpr (kDeferPV) return fresh[e] ? make_float2(0.0f, 0.0f) : Og2[(2 * q + e) * kWgThreads];
    else return make_float2(O[q][2 * e], O[q][2 * e + 1]);
  };
  // attn_fa_kernel's split merge of row e (g + 8e), when split sp is active for it.
  auto merge_row = [&](int e, int sp) {
    if (static_cast<int64_t>(sp) * kAttnSplit <= lim[e]) {  // split active for the row
      float Mn, ea, eb;
      fa_merge_scale(Mrun[e], ms[e], Mn, ea, eb);
      Lrun[e] = Lrun[e] * ea + ls[e] * eb;
#pragma unroll
      for (int q = 0; q < nnt; ++q) {
        const float2 r = o_run(q, e);
        const float2 n = make_float2(r.x * ea + o[q][2 * e + 0] * eb, r.y * ea + o[q][2 * e + 1] * eb);
        if constexpr (kDeferPV) {
          Og2[(2 * q + e) * kWgThreads] = n;
        } else {
          O[q][2 * e + 0] = n.x;
          O[q][2 * e + 1] = n.y;
        }
      }
      fresh[e] = false;
      Mrun[e] = Mn;
    }
  };

  // Block bk's K has landed (TMA) and its rows past the last written cache row are zeros (each
  // thread fences its own zero stores for wgmma; a barrier follows before any wgmma reads it).
  auto k_landed = [&](int bk) {
    uint16_t* Kt = K0 + (bk % L::kKStages) * tile_el;
    const int ok = lim_load - bk * kFaKB + 1;
    wg_mbar_wait(kbar + 8 * (bk % L::kKStages), (bk / L::kKStages) & 1);
    if (ok < kFaKB) {  // uniform over the block
      wg_zero_rows<kHd>(Kt, ok);
      wg_fence_proxy();
    }
  };
  // One KV block. cur: its S (kPipe: issued one block earlier and complete once waited for here);
  // nxt: where kPipe issues block b + 1's S.
  auto block = [&](int b, float (&cur)[4][4], float (&nxt)[4][4]) {
    uint16_t* Kt = K0 + (b % L::kKStages) * tile_el;
    uint16_t* Vt = V0 + (b % L::kVStages) * tile_el;
    // Rows of block b up to the last written cache row; the rest are zeros for both paths.
    const int rows_ok = lim_load - b * kFaKB + 1;
    if constexpr (kPipe) {
      if (b + 1 < b_end) k_landed(b + 1);  // for block b + 1's S, issued below
    } else if constexpr (kTma) {
      k_landed(b);
    } else {
      fa_cp_async_wait<L::kKWait>();  // block b's K (its V is waited for in the step, before P V)
      wg_fence_proxy();  // block b, as written by this thread's cp.async, for wgmma
    }
    __syncthreads();   // that K visible to all; every warp done with block b-1's buffers
    // into the buffers of block b-1 (the rings are kVLead + 1 and kKLead + 1 deep)
    const int bv = b + L::kVLead;
    if constexpr (kTma) {
      if (threadIdx.x == 0) {
        const int bk = b + L::kKLead;
        // kDeferPV: block b - 1's P V may still read that V stage; the step refills it (v_free)
        if (!kDeferPV && bv < b_end) issue(V0, &maps.v, vbar, vempty, L::kVStages, bv, true);
        if (bk < b_end) issue(K0, &maps.k, kbar, kempty, L::kKStages, bk, true);
      }
    } else {
      if (b + L::kVLead < b_end)
        wg_issue_tile<kHd>(V0 + ((b + L::kVLead) % L::kVStages) * tile_el, vbase, row_stride,
                           (b + L::kVLead) * kFaKB, lim_load);
      fa_cp_async_commit();
      if (b + L::kKLead < b_end)
        wg_issue_tile<kHd>(K0 + ((b + L::kKLead) % L::kKStages) * tile_el, kbase, row_stride,
                           (b + L::kKLead) * kFaKB, lim_load);
      fa_cp_async_commit();
    }

    // kDeferPV: block b - 1's P V is complete before o is written or read here. ptxas must see a
    // wait on every path to such an access (else it serialises every wgmma), so the waits sit in
    // the same branches: a split's start (after a split end nothing is in flight) and every block
    // past the tile's smallest row limit (a row's merge on its first block past its position).
    if (b % kAttnSplitBlocks == 0) {  // a split starts: fresh online softmax
      if constexpr (kDeferPV) wg_wait_all();
#pragma unroll
      for (int q = 0; q < nnt; ++q)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[q][i] = 0.0f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        ms[e] = -INFINITY;
        ls[e] = 0.0f;
      }
    }
    const int j0 = b * kFaKB;
    // A row whose position is in the previous block is inactive from this block on: its split
    // (if active for it) is merged now, with the o, ms, ls the split end would have seen.
    if (!kDeferPV || j0 > lim_min) {
      if constexpr (kDeferPV) {
        wg_wait_all();
        wg_hold(o);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j0 > lim[e] && j0 - kFaKB <= lim[e]) merge_row(e, b / kAttnSplitBlocks);
    }

    if constexpr (kPipe) {
      // block b's S (kDeferPV: done at block b - 1's second wait, or before the loop; only block
      // b - 1's P V may still run; else nothing else is in flight)
      if constexpr (!kDeferPV) wg_wait_all();
      wg_hold(cur);
      // Issued on every block (the last one's result unused, read from its own landed K) so no
      // wgmma sits on a branch: ptxas serialises wgmmas around one it cannot prove uniform.
      const int bn = b + 1 < b_end ? b + 1 : b;
      wg_s_issue<kHd, kTma>(Qs, K0 + (bn % L::kKStages) * tile_el, half, nxt);
    }
    // a-d for the tile (kPipe: b-d; the step's last wait also completes block b + 1's S). Only
    // blocks that cross a row's position (the diagonal, or any block of a tile with padding
    // rows) need the masks.
    const uint32_t vb = vbar + 8 * (b % L::kVStages), vp = (b / L::kVStages) & 1;
    auto v_free = [&] {  // kDeferPV: every warp's block b - 1 P V is done; its V stage takes block bv
      if (threadIdx.x == 0 && bv < b_end) issue(V0, &maps.v, vbar, vempty, L::kVStages, bv, true);
    };
    constexpr bool kIssued = kPipe != 0;
    if (j0 + kFaKB - 1 > lim_min)
      wg_block_step<true, kHd, kTma, kIssued, kDeferPV>(Qs, Kt, Vt, Ps, red, half, w, j0, lim, sl2, o, ms, ls, vb,
                                                        vp, rows_ok, cur, pa, v_free);
    else
      wg_block_step<false, kHd, kTma, kIssued, kDeferPV>(Qs, Kt, Vt, Ps, red, half, w, j0, lim, sl2, o, ms, ls, vb,
                                                         vp, rows_ok, cur, pa, v_free);

    // e. split done: in-order merge of the rows still active on this block.
    if ((b + 1) % kAttnSplitBlocks == 0 || b + 1 == b_end) {
      if constexpr (kDeferPV) {
        wg_wait_all();
        wg_hold(o);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j0 <= lim[e]) merge_row(e, b / kAttnSplitBlocks);
    }
  };

  float sA[4][4], sB[4][4];
  if constexpr (kPipe) {
    // Block b_begin's S before the loop (issued even for a tile without blocks, unused then).
    if (b_begin < b_end) k_landed(b_begin);
    __syncthreads();  // Q and that K visible to both warpgroups
    wg_s_issue<kHd, kTma>(Qs, K0 + (b_begin % L::kKStages) * tile_el, half, sA);
    if constexpr (kDeferPV) wg_wait_all();  // the loop's blocks find their S done
    int b = b_begin;
    for (; b + 1 < b_end; b += 2) {  // the two accumulators by name, alternating
      block(b, sA, sB);
      block(b + 1, sB, sA);
    }
    if (b < b_end) block(b, sA, sB);
    wg_wait_all();  // the last issued S (unused)
  } else {
    for (int b = b_begin; b < b_end; ++b) block(b, sA, sB);
  }

  // epilogue: o = bf16((O / L) * sigmoid(gate)); rows >= n_valid -> 0.
  const int64_t out_ld = static_cast<int64_t>(a.H) * hd;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int64_t R = R0 + w * kFaPairRows + g + 8 * e;
    if (R < nrows) {
      const int64_t i = R / G;
      const int h = kh * G + static_cast<int>(R - i * G);
      uint16_t* orow = a.out + i * out_ld + static_cast<int64_t>(h) * hd + dbase + 2 * t;
      const float* grow = a.qkv + i * W + static_cast<int64_t>(h) * 2 * hd + hd + dbase + 2 * t;
#pragma unroll
      for (int q = 0; q < nnt; ++q) {
        uint32_t v = 0;
        if (i < nvld) {
          const float2 r = o_run(q, e);
          const uint16_t lo = f32_to_bf16((r.x / Lrun[e]) * sigmoidf_(grow[q * 8]));
          const uint16_t hi = f32_to_bf16((r.y / Lrun[e]) * sigmoidf_(grow[q * 8 + 1]));
          v = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
        *reinterpret_cast<uint32_t*>(orow + q * 8) = v;
      }
    }
  }
  // Pairs: neither CTA leaves while the other may still arrive on its barriers.
  if constexpr (kPair) wg_cluster_sync();
#else
  (void)a;  // built for sm_90a only (gpu.cmake, .ci/compile_gpu.sh)
  (void)maps;
#endif
}

// The K/V path of the head dims that have TMA (attention_wgmma_set_loads; the harness times each),
// and the path the last launch took (attention_wgmma_last_loads).
static std::atomic<int> g_wg_tma{1};
static std::atomic<int> g_wg_last{-1};


// One cache as [S][Hkv * hd] with 64 x 64 boxes in the 128-byte swizzle (WgMaps); false where
// the encoder or the alignment TMA needs is missing (the caller then takes the rings).
static bool wg_encode(CUtensorMap* m, const uint16_t* cache, const AttentionArgs& a) {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = tma_encoder();
  if (enc == nullptr || cache == nullptr || reinterpret_cast<uintptr_t>(cache) % 16 != 0 || a.S < 1) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(a.Hkv) * a.hd, static_cast<cuuint64_t>(a.S)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(a.Hkv) * a.hd * 2};  // bytes per position
  const cuuint32_t box[2] = {64, kFaKB};
  const cuuint32_t step[2] = {1, 1};
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<uint16_t*>(cache), dims, strides, box, step,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kHd, bool kTma, int kPipe = 0>
gpuError_t wg_launch_one(const AttentionArgs& a, const WgMaps& maps, unsigned tiles, gpuStream_t stream,
                         float* og = nullptr) {
  constexpr int smem = WgLayout<kHd, kTma>::kTotal;  // 202 KB at hd 256 (TMA: 203)
  static std::atomic<uint64_t> smem_done{0};
  const gpuError_t e = allow_smem(attn_wgmma_kernel<kHd, kTma, false, kPipe>, smem, smem_done);
  if (e != gpuSuccess) return e;
  return launch_dependent(attn_wgmma_kernel<kHd, kTma, false, kPipe>, dim3(tiles, static_cast<unsigned>(a.Hkv), 1u),
                          dim3(kWgThreads), smem, stream, a, maps, og);  // after the cache write
}

// Pairs: clusters of 2 along the tiles (an even count: the pad CTA only meets the cluster
// barriers), with launch_dependent's programmatic serialisation where it is on.
template <int kHd>
gpuError_t wg_launch_pair(const AttentionArgs& a, const WgMaps& maps, unsigned tiles, gpuStream_t stream) {
  constexpr int smem = WgLayout<kHd, true>::kTotal;
  static std::atomic<uint64_t> smem_done{0};
  gpuError_t e = allow_smem(attn_wgmma_kernel<kHd, true, true>, smem, smem_done);
  if (e != gpuSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(tiles + (tiles & 1u), static_cast<unsigned>(a.Hkv), 1u);
  cfg.blockDim = dim3(kWgThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0] = wg_pair_cluster_attr();
  unsigned n = 1;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, attn_wgmma_kernel<kHd, true, true>, a, maps, static_cast<float*>(nullptr));
}

template <int kHd>
gpuError_t wg_launch(const AttentionArgs& a, unsigned tiles, void* scratch, gpuStream_t stream) {
  WgMaps maps{};
  if constexpr (wg_tma_ok<kHd>()) {
    const int mode = g_wg_tma.load(std::memory_order_relaxed);
    if (mode != 0 && tiles < 0xffffffffu && wg_encode(&maps.k, a.k_cache, a) && wg_encode(&maps.v, a.v_cache, a)) {
      g_wg_last.store(mode == 2 ? 2 : 1, std::memory_order_relaxed);
      if (mode == 2) return wg_launch_pair<kHd>(a, maps, tiles, stream);
      // block b + 1's S issued before block b's softmax (the same bits; BARO_ATTN_PIPE=0: not; 2:
      // block b's P V also beside block b + 1's softmax, the split merge's O in `scratch`)
      if (baro::knobs::is(baro::knobs::kAttnPipe, "0")) return wg_launch_one<kHd, true, 0>(a, maps, tiles, stream);
      if (baro::knobs::is(baro::knobs::kAttnPipe, "2") && scratch != nullptr)
        return wg_launch_one<kHd, true, 2>(a, maps, tiles, stream, static_cast<float*>(scratch));
      return wg_launch_one<kHd, true, 1>(a, maps, tiles, stream);
    }
  }
  g_wg_last.store(0, std::memory_order_relaxed);
  return wg_launch_one<kHd, false>(a, maps, tiles, stream);
}


}  // namespace baro_gpu

#endif  // BARO_WGMMA_BUILT

namespace baro_gpu {

// Which K/V path attn_wgmma_kernel takes where the head dim has them: 1 (the default) TMA, 2 TMA
// in multicasting pairs (experimental), 0 the cp.async rings. Not a knob (the library never sets
// it): wgmma_attention_check.cu declares it to time and check every path in one run.
void attention_wgmma_set_loads(int tma) {
#if BARO_WGMMA_BUILT
  g_wg_tma.store(tma, std::memory_order_relaxed);
#else
  (void)tma;
#endif
}
// 1: the last launch took TMA, 2: TMA pairs, 0: the rings, -1: none yet (so a check cannot pass on a fallback).
int attention_wgmma_last_loads() {
#if BARO_WGMMA_BUILT
  return g_wg_last.load(std::memory_order_relaxed);
#else
  return -1;
#endif
}

// BARO_ATTN_PIPE=2's merge accumulators: 64 rows x hd fp32 a tile (wg_launch's grid: the row tiles
// of each kv head), for calls of more than 16 rows at the head dims with TMA; 0 otherwise.
size_t attention_wgmma_scratch_bytes(const AttentionArgs& a) {
#if BARO_WGMMA_BUILT
  if (a.m <= 16 || (a.hd != 256 && a.hd != 128) || a.Hkv <= 0 || a.H % a.Hkv != 0 ||
      !baro::knobs::is(baro::knobs::kAttnPipe, "2"))
    return 0;
  const int64_t tiles = (a.m * (a.H / a.Hkv) + kWgRows - 1) / kWgRows;
  return static_cast<size_t>(tiles * a.Hkv * kWgRows * a.hd * 4);
#else
  (void)a;
  return 0;
#endif
}

gpuError_t launch_attention_wgmma(const AttentionArgs& a, void* scratch, gpuStream_t stream, bool* ran) {
  *ran = false;
#if BARO_WGMMA_BUILT
  if (a.m <= 0 || a.Hkv <= 0 || a.H % a.Hkv != 0) return gpuSuccess;
  if (a.hd != 256 && a.hd != 128 && a.hd != 64 && a.hd != 32) return gpuSuccess;
  const int64_t rows = a.m * (a.H / a.Hkv);
  const int64_t tiles = (rows + kWgRows - 1) / kWgRows;
  if (tiles > 0x7fffffffLL || (a.S + kAttnSplit - 1) / kAttnSplit > 65535) return gpuSuccess;
  if (!wg_device_is_sm90()) return gpuSuccess;
  *ran = true;
  const unsigned n = static_cast<unsigned>(tiles);
  switch (a.hd) {
    case 256: return wg_launch<256>(a, n, scratch, stream);
    case 128: return wg_launch<128>(a, n, scratch, stream);
    case 64: return wg_launch<64>(a, n, scratch, stream);
    default: return wg_launch<32>(a, n, scratch, stream);
  }
#else
  (void)a;
  (void)scratch;
  (void)stream;
  return gpuSuccess;
#endif
}

}  // namespace baro_gpu
