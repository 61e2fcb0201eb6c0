// baro_matmul (GPU): y[m,N] f32 = x[m,K] bf16 . w[N,K]^T bf16, plus the GEMM
// launcher shared with moe.cu. Order: see gemm.cuh / dot.cuh.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "contract.h"
#include "ffi_gpu.h"
#include "gemm.cuh"
#include "gemm_row1.cuh"
#include "gemm_rows16.cuh"
#include "launch.h"

namespace baro_gpu {

// Block shapes. All walk K identically per output element (gemm.cuh), so the
// choice never changes bits; it only trades padding waste against reuse.
// Small: BK = 256 so a decode GEMM (latency-bound) needs few K stages.
using GemmSmall = GemmShape<1, 1, 1, 4, 256>;  // 16 x 32, 4 warps (decode, small groups)
using GemmLarge = GemmShape<2, 4, 2, 2, 64>;   // 64 x 64, 4 warps (no 16-byte loads; HIP)
constexpr int kPipeStages = 3;

int gemm_bm(GemmConfig cfg) {
  switch (cfg) {
    case GemmConfig::kSmall: return GemmSmall::BM;
    case GemmConfig::kLarge: return GemmLarge::BM;
    case GemmConfig::kPipe64: return 64;
    case GemmConfig::kPipe128: return 128;
    case GemmConfig::kRow1: return 1;
  }
  return GemmLarge::BM;
}

// Test/benchmark knob: BARO_GEMM_TILE=16|64|128|simple forces a config for
// every GEMM of m > 1 rows (speed only: every config gives the same bits, and
// the tests use it to reach each kernel at small shapes). Read per call so a
// test can switch it between calls.
static bool forced_config(GemmConfig& cfg) {
  namespace k = baro::knobs;
  const int t = k::get(k::kGemmTile);
  if (t == k::word(k::kGemmTile, "16")) cfg = GemmConfig::kSmall;
  else if (t == k::word(k::kGemmTile, "simple")) cfg = GemmConfig::kLarge;
  else if (t == k::word(k::kGemmTile, "64")) cfg = GemmConfig::kPipe64;
  else if (t == k::word(k::kGemmTile, "128")) cfg = GemmConfig::kPipe128;
  else return false;  // auto
  return true;
}

// Test knob: BARO_GEMM_SMALL picks the kernel of 16-row slots: stream (gemm_row1.cuh's stream
// over 16-row slots, where K % 16 == 0), rows16 (gemm_rows16.cuh) or simple (the simple
// synchronous kernel; one-row calls then run there too); auto: the stream for a plain call of
// one slot (2 to 16 rows), gemm_rows16 otherwise. All give the same bits; the tests compare them.
// Measured on the H200 (decode steps of 8 and 64 sequences, 6eb5b4e, both kernels in one run):
// one slot streams a little faster (8 rows: in_proj 23.1 -> 22.0 us, out_proj 15.7 -> 15.2,
// router 8.3 -> 7.0, the shared expert's gate 8.1 -> 6.7); several slots do not (64 rows,
// out_proj 22.5 -> 46: the slots of a column unit read W again through L2), nor grouped MoE
// calls (8 sequences: gate/up 76.5 -> 97.1). docs/PERF.md has the table.
[[maybe_unused]] static bool small_simple() { return baro::knobs::is(baro::knobs::kGemmSmall, "simple"); }
[[maybe_unused]] static bool small_stream(const GemmParams& p) {
  namespace k = baro::knobs;
  if (k::is(k::kGemmSmall, "stream")) return true;
  return k::is(k::kGemmSmall, "auto") && p.tiles == nullptr && p.M <= 16;
}

// Test knob: BARO_GEMM_ROW1=off runs one-row calls on gemm_rows16 instead of
// gemm_row1 (same bits; the tests compare the two). Read per call.
static bool row1_enabled() {
#if BARO_HIP
  return false;
#else
  return !small_simple() && baro::knobs::on(baro::knobs::kGemmRow1);
#endif
}

#if !BARO_HIP
// The current device's attribute, read once per device (64 of them) into `cache`; `fallback`
// when it cannot be read or is not positive.
static int device_attr(cudaDeviceAttr attr, std::atomic<int> (&cache)[64], int fallback) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return fallback;
  if (dev >= 0 && dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, attr, dev) != cudaSuccess || n <= 0) return fallback;
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}
#endif

bool pdl_enabled() {
#if BARO_HIP
  return false;
#else
  if (!baro::knobs::on(baro::knobs::kPdl)) return false;  // opt-in until measured on the H200
  static std::atomic<int> major[64];
  return device_attr(cudaDevAttrComputeCapabilityMajor, major, 0) >= 9;
#endif
}

int sm_count() {
#if BARO_HIP
  return 0;  // unused on HIP
#else
  static std::atomic<int> count[64];
  return device_attr(cudaDevAttrMultiProcessorCount, count, 132);
#endif
}

GemmConfig gemm_pick(int64_t m, int64_t N) {
  GemmConfig cfg;
  if (m > 1 && forced_config(cfg)) return cfg;
  if (m == 1 && row1_enabled()) return GemmConfig::kRow1;
  if (m <= 16) return GemmConfig::kSmall;
  if (m <= 64) {
    // A decode step of many sequences: one 64-row tile per 128 columns is only 16 blocks for
    // N = 2048, each walking all of K alone (no split-K, for the order), far from the memory
    // rate. 16-row slots give 4x the row slots and 4x the column tiles, and the slots of a
    // column tile run side by side (grid x), so their W reads meet in L2. From about half a
    // block per SM the 64-row tiles win, reading W and A once (H200, 64 rows: N = 12352,
    // K = 2048 in 26 us on 64-row tiles, 60 on 16-row slots; N = 2048, K = 4096 in 42 and 23).
    const int64_t blocks64 = (N + 127) / 128;
    return 2 * blocks64 >= sm_count() ? GemmConfig::kPipe64 : GemmConfig::kSmall;
  }
  // 128-row tiles halve the weight traffic per row but need enough blocks to
  // fill the machine; below about one block per SM the 64-row tiles win.
  const int64_t blocks128 = ((m + 127) / 128) * ((N + 127) / 128);
  return blocks128 >= sm_count() ? GemmConfig::kPipe128 : GemmConfig::kPipe64;
}

GemmConfig gemm_pick_grouped(int64_t pairs, int64_t groups, int64_t rows) {
  GemmConfig cfg;
  if (pairs > 1 && forced_config(cfg)) return cfg;
  if (rows == 1 && row1_enabled()) return GemmConfig::kRow1;  // one pair per expert
  // Rows per group decide: a tile of BM rows reads the group's weights once,
  // so BM near the typical group size minimises both re-reads and padding.
  const int64_t avg = groups > 0 ? pairs / groups : pairs;
  if (avg < 8) return GemmConfig::kSmall;
  if (avg < 64) return GemmConfig::kPipe64;
  return GemmConfig::kPipe128;
}


#if !BARO_HIP
// Grid (row slots, output-column tiles) of one dynamic-smem kernel. Kernel is a template
// argument, so each kernel has its own opt-in flag (see allow_smem).
// The order (BARO_PIPE_ORDER, GemmParams::cols_fast): cols puts a slot's column tiles side by
// side. auto takes it where measured: the MoE's grouped prefill GEMMs on the pipelined kernel
// (cols_auto), whose A rows and expert weight panels were read from DRAM once per column tile
// (ncu on an H100: 77-82% of DRAM with 1.3-1.6x the floor's bytes); the MoE op at 4096 / 8192
// rows 1.337 / 2.236 -> 1.164 / 2.032 ms, an 8k prefill at chunk 2048 27.2k -> 28.8k tok/s
// (op_times_moe_order*_714fee0_h100.json, speed_pipe_order*_714fee0_h100.json).
template <typename Cfg, auto Kernel, int kThreads, bool SWIGLU>
static gpuError_t launch_tiled(const GemmParams& p, int64_t row_slots, gpuStream_t stream, bool cols_auto = false) {
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t n_tiles = (out_n + Cfg::kOutCols - 1) / Cfg::kOutCols;
  if (n_tiles > 65535 || row_slots > 0x7fffffffLL) return gpuErrorInvalidValue;
  static std::atomic<uint64_t> smem_done{0};
  gpuError_t e = allow_smem(Kernel, Cfg::kSmemBytes, smem_done);
  if (e != gpuSuccess) return e;
  GemmParams q = p;
  q.cols_fast = gemm_walk_cols(cols_auto) && row_slots <= 65535 ? 1 : 0;
  const dim3 grid = q.cols_fast ? dim3(static_cast<unsigned>(n_tiles), static_cast<unsigned>(row_slots))
                                : dim3(static_cast<unsigned>(row_slots), static_cast<unsigned>(n_tiles));
  Kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(q);
  return gpuGetLastError();
}

// The ring (BARO_PIPE_RING): shallow where blocks share SMs (prefill: 3 stages, 2-3 blocks per
// SM), deep where the grid has at most one block per SM: a decode step of many sequences
// (in_proj at 64 rows is 97 blocks of 64 x 128; 11.8 us at the copy rate). 8 stages of 24 KB at
// BM 64, 6 of 32 KB at 128 (192 KB). H200, 64 sequences, one run (247591d): in_proj 25.7 ->
// 24.7 us, the pipelined GEMMs 1.31 -> 1.27 ms a step: the ring was not what held them. The
// depth never touches the arithmetic.
constexpr int kPipeDeepStages64 = 8, kPipeDeepStages128 = 6;
static bool pipe_deep(const GemmParams& p, int64_t row_slots) {
  namespace k = baro::knobs;
  const int r = k::get(k::kPipeRing);
  if (r == k::word(k::kPipeRing, "deep")) return true;
  if (r == k::word(k::kPipeRing, "shallow")) return false;
  const bool swiglu = p.Act != nullptr;
  const int64_t out_n = swiglu ? p.swiglu_I : p.N, cols = swiglu ? 64 : 128;  // BN 128 in both configs
  return row_slots * ((out_n + cols - 1) / cols) <= sm_count();
}
template <int BM, int BN, int WM, int WN, bool SWIGLU>
static gpuError_t launch_pipe(const GemmParams& p, int64_t row_slots, gpuStream_t stream) {
  constexpr int kDeep = BM >= 128 ? kPipeDeepStages128 : kPipeDeepStages64;
  const bool grouped = p.tiles != nullptr;  // BARO_PIPE_ORDER=auto: cols (launch_tiled)
  if (pipe_deep(p, row_slots))
    return launch_tiled<PipeCfg<BM, BN, WM, WN, kDeep, SWIGLU>, gemm_pipe_kernel<BM, BN, WM, WN, kDeep, SWIGLU>,
                        kPipeThreads, SWIGLU>(p, row_slots, stream, grouped);
  return launch_tiled<PipeCfg<BM, BN, WM, WN, kPipeStages, SWIGLU>,
                      gemm_pipe_kernel<BM, BN, WM, WN, kPipeStages, SWIGLU>, kPipeThreads, SWIGLU>(
      p, row_slots, stream, grouped);
}

// The one-row streaming kernel (gemm_row1.cuh): a persistent grid of one-warp blocks,
// `bps` per SM (fewer when there are fewer units). A warp's mma chains run one k-step per
// mma latency, so throughput wants many chains per SM: units of 4 or 2 n-tiles when there
// are enough of them to give every warp one, else one n-tile (small N: more warps, one
// chain each). The ring: the largest k piece (<= kchunk_max) of which min_stages fit.
// Speed knobs (same bits; read per call, for benchmarks/row1_sweep.py): BARO_ROW1_BPS,
// BARO_ROW1_KCHUNK, BARO_ROW1_STAGES, BARO_ROW1_NT, BARO_ROW1_COPY=lsu (16-byte cp.async
// per lane instead of the copy engine's bulk copies; W only under BARO_ROW1_ASHARED, whose A is
// always bulk copies). With BARO_ROW1_ASHARED=1, BARO_ROW1_BPS is the most warps of a block
// (one block per SM).
struct Row1Plan {
  int bps = kRow1BlocksPerSM, kchunk_max = 2048, min_stages = 2, nt = 0;  // nt 0: by units (knobs.h defaults)
  int lsu = 0;
};
// knobs.h's defaults and ranges are this plan's (it cannot include gemm_row1.cuh)
static_assert(baro::knobs::kKnobs[baro::knobs::kRow1Bps].dflt == kRow1BlocksPerSM, "BARO_ROW1_BPS default");
static_assert(baro::knobs::kKnobs[baro::knobs::kRow1Stages].hi == kRow1MaxStages, "BARO_ROW1_STAGES range");
static Row1Plan row1_plan() {
  namespace k = baro::knobs;
  Row1Plan r;
  r.bps = k::get(k::kRow1Bps);
  r.kchunk_max = k::get(k::kRow1Kchunk) / 128 * 128;
  r.min_stages = k::get(k::kRow1Stages);
  r.nt = k::get(k::kRow1Nt);
  r.lsu = baro::knobs::is(baro::knobs::kRow1Copy, "lsu") ? 1 : 0;
  return r;
}

// BARO_ROW1_ASHARED=1 (opt-in until measured on a GPU; the same bits): a plain call of 2 to 16
// rows (one 16-row slot, no tile list, no gathered rows, no host store) runs the stream's ASHARED
// instance, whose blocks share one copy of the slot's A (gemm_row1.cuh). =require (tests): a call
// on the 16-row stream that it cannot take fails instead of running the default instance, so a
// byte test cannot pass on the default. Read per call.
static bool row1_ashared_takes(const GemmParams& p, int64_t row_slots) {
  return row_slots == 1 && p.tiles == nullptr && p.a_rows == nullptr && p.W_host == nullptr && p.W_last == nullptr &&
         p.moe.kind == Row1Moe::kNone;
}
static bool row1_ashared_required() { return baro::knobs::is(baro::knobs::kRow1Ashared, "require"); }

// The ring of `ring_bytes` per warp: the largest k piece (<= kchunk_max, no wider than K) of
// which min_stages fit; ring.stages < 2 when not even 128-wide pieces do.
static void row1_ring(Row1Ring& ring, const GemmParams& p, const Row1Plan& plan, int w_rows, int a_rows,
                      int ring_bytes) {
  const int64_t k128 = (p.K + 127) / 128 * 128;
  while (ring.kchunk > 128 && ring.kchunk / 2 >= k128) ring.kchunk /= 2;  // no wider than K
  for (;;) {
    ring.stage_bytes = row1_stage_bytes(w_rows, ring.kchunk, a_rows);
    ring.stages = ring_bytes > 0 ? ring_bytes / ring.stage_bytes : 0;
    if (ring.stages >= plan.min_stages || ring.kchunk <= 128) break;
    ring.kchunk = ring.kchunk / 2 / 128 * 128 > 128 ? ring.kchunk / 2 / 128 * 128 : 128;
  }
  if (ring.stages > kRow1MaxStages) ring.stages = kRow1MaxStages;
  ring.n_k = static_cast<int>((p.K + ring.kchunk - 1) / ring.kchunk);
}

// One gemm_row1_kernel instance on `blocks` blocks of `warps` warps: its shared-memory opt-in
// once (for any bps), then a plain launch or, with p.pdl, a programmatic dependent one.
template <auto Kernel, typename Maps>
static gpuError_t launch_row1_kernel(const GemmParams& p, int64_t row_slots, const Row1Ring& ring, const Maps& maps,
                                     int64_t blocks, int warps, int smem, gpuStream_t stream) {
  static std::atomic<uint64_t> smem_done{0};
  const gpuError_t e = allow_smem(Kernel, 233472 - 1024, smem_done);
  if (e != gpuSuccess) return e;
  const dim3 grid(static_cast<unsigned>(blocks)), block(static_cast<unsigned>(warps * BARO_WARP));
  if (p.pdl) return launch_dependent(Kernel, grid, block, static_cast<size_t>(smem), stream, p, row_slots, ring, maps);
  Kernel<<<grid, block, smem, stream>>>(p, row_slots, ring, maps);
  return gpuGetLastError();
}

// a_rows: the A rows a stage must hold (1, or SLOT16's most rows in any slot). grid: one-warp
// blocks. ASHARED: blocks of up to plan.bps warps, one block per SM (fewer warps per block when
// there are fewer units than bps per SM, so the units still spread over the SMs), A beside the
// warps' rings; where A leaves no room for two 128-wide stages per warp (16 rows of K above about
// 5,500 at three warps of 4 n-tiles), the plain SLOT16 instance runs instead (the same bits).
template <bool SWIGLU, int NT, int MOE, bool SLOT16, bool ASHARED = false, bool SWAP = false>
static gpuError_t launch_row1_nt(const GemmParams& p, int64_t row_slots, int64_t grid, const Row1Plan& plan,
                                 int a_rows, gpuStream_t stream) {
  using Cfg = Row1Cfg<SWIGLU, NT>;
  constexpr int extra = MOE == Row1Moe::kRoute ? kRow1RouteBytes : 0;  // the route after the ring
  // the kernel walks its units in 32-bit (slot, column unit) cursors
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t units = row_slots * ((out_n + Cfg::kOutCols - 1) / Cfg::kOutCols);
  if (units > 0x7fffffffLL) return gpuErrorInvalidValue;
  // host-store experts (W_host in pinned host memory) come over the host link through 16-byte
  // cp.async: the bulk copies are not relied on for it
  Row1Ring ring{plan.kchunk_max, 0, 0, plan.lsu || (p.W_host != nullptr && p.w_host_mapped) ? 1 : 0, 0};
  int warps = 1, smem = 0;
  int64_t blocks = grid;
  if constexpr (ASHARED) {
    static_assert(kRow1AsMaxWarps == baro::knobs::kKnobs[baro::knobs::kRow1Bps].hi, "BARO_ROW1_BPS: warps per block");
    const int64_t sms = sm_count();
    const int64_t per_sm = (units + sms - 1) / sms;
    warps = static_cast<int>(per_sm < plan.bps ? per_sm : plan.bps);
    blocks = (units + warps - 1) / warps;
    if (blocks > sms) blocks = sms;
    const int64_t a_bytes = row1_a_bytes(a_rows, p.K);
    const int64_t left = 233472 - 1024 - kRow1AsBarBytes - a_bytes;  // one block per SM
    row1_ring(ring, p, plan, Cfg::kWRows, 0, left > 0 ? static_cast<int>(left / warps) : 0);
    if (ring.stages < 2) {
      if (row1_ashared_required()) return gpuErrorInvalidValue;
      return launch_row1_nt<SWIGLU, NT, MOE, SLOT16, false>(p, row_slots, grid, plan, a_rows, stream);
    }
    ring.a_rowb = static_cast<int>(row1_a_row_bytes(p.K));  // A fits: < 2^31
    ring.a_bytes = static_cast<int>(a_bytes);
    ring.a_per = (ring.n_k + kRow1AsPieces - 1) / kRow1AsPieces;
    ring.n_ka = (ring.n_k + ring.a_per - 1) / ring.a_per;
    smem = kRow1AsBarBytes + ring.a_bytes + warps * ring.stages * ring.stage_bytes;
  } else {
    row1_ring(ring, p, plan, Cfg::kWRows, a_rows, 233472 / plan.bps - 1024 - kRow1BarBytes - extra);  // an SM's smem over its blocks
    if (ring.stages < 2) return gpuErrorInvalidValue;
    smem = kRow1BarBytes + ring.stages * ring.stage_bytes + extra;
  }
  return launch_row1_kernel<gemm_row1_kernel<SWIGLU, NT, MOE, SLOT16, ASHARED, false, SWAP>>(
      p, row_slots, ring, Row1NoMaps{}, blocks, warps, smem, stream);
}

// BARO_ROW1_TMA=1 (opt-in until measured on a GPU; the same bits): a plain call without SwiGLU
// on the stream runs gemm_row1_tma_kernel, whose stages are filled by two tensor copies (W's unit
// rows, the slot's A rows) issued by one lane (gemm_row1.cuh, Row1Maps, says why). =require
// (tests): a call on the stream that it cannot take fails instead of running the bulk-copy
// instance, so a byte test cannot pass on the default. Read per call.
static bool row1_tma_takes(const GemmParams& p) {
  constexpr int64_t kI32 = 0x7fffffffLL;  // TMA coordinates are 32-bit
  return p.Act == nullptr && p.tiles == nullptr && p.a_rows == nullptr && p.W_tail == nullptr &&
         p.W_last == nullptr && p.W_host == nullptr && p.moe.kind == Row1Moe::kNone && is_aligned(p.A, 16) &&
         is_aligned(p.W, 16) && p.lda % 8 == 0 && p.ldw % 8 == 0 && p.lda >= p.K && p.ldw >= p.K && p.K <= kI32 &&
         p.N <= kI32 && p.M <= kI32 && tma_encoder() != nullptr;
}

// rows x K bf16 at row stride ld as a 2-D tensor map of kRow1TmaBoxK x box_rows boxes, no
// swizzle (the ring's padded rows keep ldmatrix off bank conflicts), zeros outside.
static bool row1_tma_encode(CUtensorMap* m, const uint16_t* base, int64_t rows, int64_t K, int64_t ld, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};  // bytes per row
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kRow1TmaBoxK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  return tma_encoder()(m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<uint16_t*>(base), dims, strides, box, step,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// a_rows: the A rows of a slot's box (1, or min(M, 16)). A sub-stage is the unit's W rows then
// A's rows rounded up to 8, 272 bytes each, so every sub-stage and box starts 128-byte aligned
// (8 rows of 272 bytes are 17 x 128). A stage is the most sub-stages of 4, 2, 1 (no wider than
// K) of which an SM's share of shared memory (BARO_ROW1_BPS blocks per SM) holds three stages,
// else two of one: the stage's wait and refill are paid once per sub-stage or fewer. The bulk
// instance's k-piece and stage knobs do not apply.
template <int NT, bool SLOT16>
static gpuError_t launch_row1_tma(const GemmParams& p, int64_t row_slots, int64_t grid, const Row1Plan& plan,
                                  int a_rows, gpuStream_t stream) {
  using Cfg = Row1Cfg<false, NT>;
  const int64_t units = row_slots * ((p.N + Cfg::kOutCols - 1) / Cfg::kOutCols);
  if (units > 0x7fffffffLL) return gpuErrorInvalidValue;
  Row1Maps maps;
  if (!row1_tma_encode(&maps.w, p.W, p.N, p.K, p.ldw, Cfg::kWRows) ||
      !row1_tma_encode(&maps.a, p.A, p.M, p.K, p.lda, a_rows))
    return gpuErrorInvalidValue;
  const int ring_bytes = 233472 / plan.bps - 1024 - kRow1BarBytes;
  const int sub_bytes = (Cfg::kWRows + (a_rows + 7) / 8 * 8) * row1_row_bytes(kRow1TmaK);
  const int64_t k_subs = (p.K + kRow1TmaK - 1) / kRow1TmaK;
  int subs = 4;
  while (subs > 1 && (subs / 2 >= k_subs || ring_bytes / (subs * sub_bytes) < 3)) subs /= 2;
  Row1Ring ring{kRow1TmaK * subs, 0, subs * sub_bytes, 0, static_cast<int>((k_subs + subs - 1) / subs)};
  ring.stages = ring_bytes / ring.stage_bytes;
  if (ring.stages > kRow1MaxStages) ring.stages = kRow1MaxStages;
  if (ring.stages < 2) return gpuErrorInvalidValue;
  ring.tma_sub = sub_bytes;
  ring.tma_tx = (Cfg::kWRows + a_rows) * kRow1TmaBoxK * 2;
  const int smem = kRow1BarBytes + ring.stages * ring.stage_bytes;
  return launch_row1_kernel<gemm_row1_kernel<false, NT, Row1Moe::kNone, SLOT16, false, true>>(p, row_slots, ring, maps,
                                                                                             grid, 1, smem, stream);
}

template <bool SWIGLU, int MOE, bool SLOT16 = false>
static gpuError_t launch_row1_moe(const GemmParams& p, int64_t row_slots, gpuStream_t stream) {
  const Row1Plan plan = row1_plan();
  // a plain call's slots hold min(M, 16) rows at most; a grouped call's tiles up to 16
  const int a_rows = !SLOT16 ? 1 : p.tiles == nullptr && p.M < 16 ? static_cast<int>(p.M) : 16;
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int64_t warps = static_cast<int64_t>(plan.bps) * sm_count();
  auto units = [&](int nt) { return row_slots * ((out_n + 8 * nt - 1) / (8 * nt)); };
  auto grid = [&](int nt) { return units(nt) < warps ? units(nt) : warps; };
  const int64_t enough = warps * 9 / 10;
  int nt = plan.nt;
  if (nt == 0) nt = !SWIGLU && units(4) >= enough ? 4 : units(2) >= enough ? 2 : 1;
  // The opt-in instances, tried in this order where several are on; one set to require (tests) is
  // the only one tried, so its byte test cannot pass on another, and two set to require fail.
  namespace k = baro::knobs;
  const bool tma_req = k::is(k::kRow1Tma, "require"), swap_req = k::is(k::kRow1Swap, "require");
  const bool ash_req = row1_ashared_required();
  if (static_cast<int>(tma_req) + static_cast<int>(swap_req) + static_cast<int>(ash_req) > 1) return gpuErrorInvalidValue;
  if constexpr (!SWIGLU && MOE == Row1Moe::kNone) {
    if (!k::is(k::kRow1Tma, "0") && !swap_req && !ash_req) {
      if (row1_tma_takes(p)) {
        if (nt >= 4) return launch_row1_tma<4, SLOT16>(p, row_slots, grid(4), plan, a_rows, stream);
        if (nt >= 2) return launch_row1_tma<2, SLOT16>(p, row_slots, grid(2), plan, a_rows, stream);
        return launch_row1_tma<1, SLOT16>(p, row_slots, grid(1), plan, a_rows, stream);
      }
      if (tma_req) return gpuErrorInvalidValue;
    }
  }
  // BARO_ROW1_SWAP=1 (opt-in until measured on a GPU; the same bits): every call on the stream but
  // the one-token MoE's with the route or the combine inside runs the SWAP instance (gemm_row1.cuh),
  // W as the mma's 16-row operand, in whole 16-column tiles: units of 4 n-tiles where they fill the
  // warps, else 2 (SwiGLU: 2). =require (tests): a fused call fails instead of running the default.
  if (!k::is(k::kRow1Swap, "0") && !tma_req && !ash_req) {
    if constexpr (MOE == Row1Moe::kNone) {
      if constexpr (!SWIGLU)
        if (nt >= 4)
          return launch_row1_nt<SWIGLU, 4, MOE, SLOT16, false, true>(p, row_slots, grid(4), plan, a_rows, stream);
      return launch_row1_nt<SWIGLU, 2, MOE, SLOT16, false, true>(p, row_slots, grid(2), plan, a_rows, stream);
    } else if (swap_req) {
      return gpuErrorInvalidValue;
    }
  }
  if constexpr (SLOT16 && MOE == Row1Moe::kNone) {
    const bool on = !k::is(k::kRow1Ashared, "0") && !tma_req && !swap_req;
    if (on && !row1_ashared_takes(p, row_slots) && ash_req) return gpuErrorInvalidValue;
    if (on && row1_ashared_takes(p, row_slots)) {  // the same unit widths, blocks sharing A
      if constexpr (!SWIGLU)
        if (nt >= 4) return launch_row1_nt<SWIGLU, 4, MOE, SLOT16, true>(p, row_slots, grid(4), plan, a_rows, stream);
      if (nt >= 2) return launch_row1_nt<SWIGLU, 2, MOE, SLOT16, true>(p, row_slots, grid(2), plan, a_rows, stream);
      return launch_row1_nt<SWIGLU, 1, MOE, SLOT16, true>(p, row_slots, grid(1), plan, a_rows, stream);
    }
  }
  if constexpr (!SWIGLU)
    if (nt >= 4) return launch_row1_nt<SWIGLU, 4, MOE, SLOT16>(p, row_slots, grid(4), plan, a_rows, stream);
  if (nt >= 2) return launch_row1_nt<SWIGLU, 2, MOE, SLOT16>(p, row_slots, grid(2), plan, a_rows, stream);
  return launch_row1_nt<SWIGLU, 1, MOE, SLOT16>(p, row_slots, grid(1), plan, a_rows, stream);
}

// The one-token MoE's route rides on the SwiGLU (gate/up) GEMM, its combine on the plain
// (down) one; the launcher checked which.
template <bool SWIGLU>
static gpuError_t launch_row1(const GemmParams& p, int64_t row_slots, gpuStream_t stream) {
  if (p.moe.kind == Row1Moe::kNone) return launch_row1_moe<SWIGLU, Row1Moe::kNone>(p, row_slots, stream);
  if constexpr (SWIGLU)
    return launch_row1_moe<SWIGLU, Row1Moe::kRoute>(p, row_slots, stream);
  else
    return launch_row1_moe<SWIGLU, Row1Moe::kCombine>(p, row_slots, stream);
}

// The decode-shaped kernel (gemm_rows16.cuh) for 16-row slots with 16-byte loads.
// The ring (BARO_ROWS16_RING): light where the grid has blocks to spare (a grouped MoE call,
// four or more blocks per SM), deep where a few blocks
// must each keep many copies in flight; Rows16Cfg says why. (H200, 64 sequences: the MoE's two
// grouped GEMMs 0.35 ms per layer light, 0.53 deep.)
static bool rows16_light(const GemmParams& p, int64_t row_slots, int64_t n_tiles) {
  namespace k = baro::knobs;
  const int r = k::get(k::kRows16Ring);
  if (r == k::word(k::kRows16Ring, "deep")) return false;
  if (r == k::word(k::kRows16Ring, "light")) return true;
  return p.tiles != nullptr || row_slots * n_tiles >= 4 * static_cast<int64_t>(sm_count());
}

template <bool SWIGLU, bool LIGHT, int WARPS, int MT = 1>
static gpuError_t launch_rows16_ring(const GemmParams& p, int64_t row_slots, gpuStream_t stream) {
  using Cfg = Rows16Cfg<SWIGLU, LIGHT, WARPS, MT>;
  return launch_tiled<Cfg, gemm_rows16_kernel<SWIGLU, LIGHT, WARPS, MT>, Cfg::kThreads, SWIGLU>(p, row_slots, stream);
}

// m16 tiles per slot of a plain GEMM of more than 16 rows (BARO_ROWS16_TALL=on: 2 or 4; else 1).
// Opt-in: a 64-row slot reads each W column block once where four 16-row slots read it four
// times through L2, but it was slower. H200, 64 sequences, one run (247591d): out_proj (N 2048,
// K 4096) 22.7 -> 30.4 us, the step 21.61 -> 21.86 ms: 64 four-warp blocks each pull 768 KB
// through one SM, where 256 blocks of 384 KB spread over all of them
// (decode_profile_batch64_tall_{off,on}_247591d_h200.json).
static int rows16_tall(const GemmParams& p) {
  namespace k = baro::knobs;
  if (p.tiles != nullptr || p.Act != nullptr || p.M <= 16) return 1;
  if (!k::is(k::kRows16Tall, "on")) return 1;
  return p.M <= 32 ? 2 : 4;
}

// Warps per block (BARO_ROWS16_WARPS): 4, except a plain SwiGLU call whose four-warp blocks would
// leave half the SMs idle, which runs one-warp blocks (4x as many, and 4 per SM instead of the
// deep SwiGLU ring's one). Measured on the H200 (decode steps of 8 and 64 sequences, every
// narrow call on one warp): the shared expert's gate/up GEMM 14.1 -> 5.1 us at 8 rows and
// 14.7 -> 12.6 at 64; plain GEMMs of few blocks (the router, the shared expert's down and gate,
// out_proj at 8 rows) were as fast or slower, so they keep four warps. A grouped call's grid is
// an upper bound (tiles past the routed ones exit at once): four warps.
static int rows16_warps(const GemmParams& p, int64_t row_slots, int64_t out_n) {
  namespace k = baro::knobs;
  const int w = k::get(k::kRows16Warps);
  if (w == k::word(k::kRows16Warps, "4")) return 4;
  if (w == k::word(k::kRows16Warps, "2")) return 2;
  if (w == k::word(k::kRows16Warps, "1")) return 1;
  if (p.tiles != nullptr || p.Act == nullptr) return 4;
  const int64_t blocks4 = row_slots * ((out_n + 31) / 32);
  return blocks4 * 2 <= sm_count() ? 1 : 4;
}

template <bool SWIGLU, bool LIGHT>
static gpuError_t launch_rows16_warps(const GemmParams& p, int64_t row_slots, int warps, gpuStream_t stream) {
  if (warps == 1) return launch_rows16_ring<SWIGLU, LIGHT, 1>(p, row_slots, stream);
  if (warps == 2) return launch_rows16_ring<SWIGLU, LIGHT, 2>(p, row_slots, stream);
  return launch_rows16_ring<SWIGLU, LIGHT, 4>(p, row_slots, stream);
}

// BARO_ROWS16_PERSIST=1 (opt-in until measured on a GPU; the same bits): a grouped call that would
// run four-warp blocks on the light ring runs gemm_rows16_persist_kernel instead (gemm_rows16.cuh
// says what it does and why) on SMs x (the blocks of it an SM holds) blocks, no more than the
// call's most items. =require (tests): a grouped call here that it cannot take (BARO_ROWS16_WARPS
// or BARO_ROWS16_RING asking for another instance) fails instead of running the default, so a byte
// test cannot pass on the default. Plain calls are not its business: they run as before.
static bool rows16_persist_takes(const GemmParams& p, int64_t row_slots, int warps) {
  return p.tiles != nullptr && warps == 4 && rows16_light(p, row_slots, 0);
}
template <bool SWIGLU>
static gpuError_t launch_rows16_persist(const GemmParams& p, int64_t row_slots, gpuStream_t stream) {
  using Cfg = Rows16Cfg<SWIGLU, true, 4, 1>;
  constexpr auto kernel = gemm_rows16_persist_kernel<SWIGLU, 4>;
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  // the most blocks with work: every tile used and every item split into WARPS column pieces
  // (a call of fewer items than resident blocks spreads its W reads over more SMs that way)
  const int64_t items = row_slots * ((out_n + Cfg::kOutCols - 1) / Cfg::kOutCols) * 4;
  static std::atomic<uint64_t> smem_done{0};
  gpuError_t e = allow_smem(kernel, Cfg::kSmemBytes, smem_done);
  if (e != gpuSuccess) return e;
  // blocks of it an SM holds (smem, threads, registers), read once per device: the grid must be
  // resident at once, or the blocks that start late are the thin last wave again
  static std::atomic<int> per_sm_cache[64];
  int dev = 0, per_sm = 0;
  e = cudaGetDevice(&dev);
  if (e != gpuSuccess) return e;
  if (dev >= 0 && dev < 64) per_sm = per_sm_cache[dev].load(std::memory_order_relaxed);
  if (per_sm <= 0) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Cfg::kThreads, Cfg::kSmemBytes);
    if (e != gpuSuccess) return e;
    if (per_sm <= 0) return gpuErrorInvalidValue;
    if (dev >= 0 && dev < 64) per_sm_cache[dev].store(per_sm, std::memory_order_relaxed);
  }
  int64_t grid = static_cast<int64_t>(sm_count()) * per_sm;
  if (grid > items) grid = items;
  if (grid <= 0 || grid > 0x7fffffffLL) return gpuErrorInvalidValue;
  kernel<<<static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return gpuGetLastError();
}

template <bool SWIGLU>
static gpuError_t launch_rows16(const GemmParams& p, int64_t row_slots, gpuStream_t stream) {
  if constexpr (!SWIGLU) {
    const int mt = rows16_tall(p);
    if (mt > 1) {  // slots of 16 mt rows, four-warp blocks
      GemmParams q = p;
      q.slot_rows = 16 * mt;
      const int64_t slots = (p.M + q.slot_rows - 1) / q.slot_rows;
      const bool light = rows16_light(q, slots, (p.N + 31) / 32);
      if (mt == 2)
        return light ? launch_rows16_ring<false, true, 4, 2>(q, slots, stream)
                     : launch_rows16_ring<false, false, 4, 2>(q, slots, stream);
      return light ? launch_rows16_ring<false, true, 4, 4>(q, slots, stream)
                   : launch_rows16_ring<false, false, 4, 4>(q, slots, stream);
    }
  }
  const int64_t out_n = SWIGLU ? p.swiglu_I : p.N;
  const int warps = rows16_warps(p, row_slots, out_n);
  if (p.tiles != nullptr) {
    namespace k = baro::knobs;
    const int persist = k::get(k::kRows16Persist);
    if (persist != k::word(k::kRows16Persist, "0")) {
      if (rows16_persist_takes(p, row_slots, warps)) return launch_rows16_persist<SWIGLU>(p, row_slots, stream);
      if (persist == k::word(k::kRows16Persist, "require")) return gpuErrorInvalidValue;
    }
  }
  const int64_t n_tiles = (out_n + warps * 8 - 1) / (warps * 8);
  return rows16_light(p, row_slots, n_tiles) ? launch_rows16_warps<SWIGLU, true>(p, row_slots, warps, stream)
                                             : launch_rows16_warps<SWIGLU, false>(p, row_slots, warps, stream);
}
#endif

bool gemm_fused_swiglu_ok(GemmConfig cfg) {
#if BARO_HIP
  (void)cfg;
  return false;
#else
  return cfg == GemmConfig::kPipe64 || cfg == GemmConfig::kPipe128 || cfg == GemmConfig::kRow1 ||
         (cfg == GemmConfig::kSmall && !small_simple());
#endif
}

bool gemm_row1_runs(const GemmParams& p) {
#if BARO_HIP
  (void)p;
  return false;
#else
  return row1_enabled() && gemm_vec_ok(p) && p.K % 16 == 0;
#endif
}

bool gemm_split_w_runs(const GemmParams& p, GemmConfig cfg) {
#if BARO_HIP
  (void)p;
  (void)cfg;
  return false;
#else
  if (cfg == GemmConfig::kRow1) return gemm_row1_runs(p);
  // kSmall runs gemm_row1's 16-row stream or gemm_rows16 (launch_gemm below), never the simple
  // kernel, when 16-byte loads are possible and the knob does not ask for the simple one
  return cfg == GemmConfig::kSmall && p.W_host == nullptr && gemm_vec_ok(p) && !small_simple();
#endif
}

int64_t row1_moe_route_max_tiles() {
#if BARO_HIP
  return 0;
#else
  return row1_route_max_tiles();
#endif
}

bool gemm_row1_moe_ok(const GemmParams& p, GemmConfig cfg) {
#if BARO_HIP
  (void)p;
  (void)cfg;
  return false;
#else
  const Row1Moe& mo = p.moe;
  const bool swiglu = p.Act != nullptr;
  if (cfg != GemmConfig::kRow1 || !gemm_row1_runs(p) || p.tiles == nullptr || mo.k < 1 || mo.k > BARO_WARP)
    return false;
  if (mo.kind == Row1Moe::kRoute)
    return swiglu && mo.logits != nullptr && mo.E >= mo.k && mo.E <= BARO_WARP * kTopkRegPer &&
           mo.max_tiles <= row1_route_max_tiles() && mo.ids && mo.wts && mo.srow && mo.inv && mo.tiles &&
           mo.n_tiles && (mo.n_counters == 0 || mo.counters != nullptr);
  if (mo.kind == Row1Moe::kCombine)  // one counter per 8-column unit covers any NT
    return !swiglu && mo.counters != nullptr && mo.n_counters >= (p.N + 7) / 8 && mo.wts && mo.inv &&
           mo.sout && mo.sgl && mo.out && (mo.slots == nullptr || mo.ids != nullptr);
  return false;
#endif
}

gpuError_t launch_gemm(GemmParams p, GemmConfig cfg, int64_t row_slots, gpuStream_t stream, bool* stored16) {
  const bool swiglu = p.Act != nullptr;
  if (stored16 != nullptr) *stored16 = false;
  if (p.C16 != nullptr && (swiglu || p.C == nullptr || stored16 == nullptr || p.c16_cols < 1 ||
                           p.c16_cols > p.N || p.c16_cols % 2 != 0 || p.ldc16 < p.c16_cols))
    return gpuErrorInvalidValue;
  if (row_slots <= 0 || p.N <= 0) return gpuSuccess;  // nothing to compute
  const bool split_w = p.W_tail != nullptr || p.W_last != nullptr || p.W_host != nullptr;
  if (split_w && (!gemm_split_w_runs(p, cfg) || (p.W_last != nullptr && p.last_group >= 0)))
    return gpuErrorInvalidValue;
  if (p.moe.kind != Row1Moe::kNone && !gemm_row1_moe_ok(p, cfg)) return gpuErrorInvalidValue;
  if (swiglu && (!gemm_fused_swiglu_ok(cfg) || p.N != 2 * p.swiglu_I)) return gpuErrorInvalidValue;
  p.slot_rows = gemm_bm(cfg);
  p.vec = gemm_vec_ok(p) ? 1 : 0;
  p.out2 = swiglu ? (p.ldc % 2 == 0 && is_aligned(p.Act, 4)) : (p.ldc % 2 == 0 && is_aligned(p.C, 8));
#if !BARO_HIP
  // BARO_GEMM_WGMMA=1 (the default): plain dense calls of m >= 64 rows on the sm_90a wgmma + TMA
  // kernel (gemm_wgmma.cu, the same bits as every config here) where the build, device and
  // operands have it, else the config's kernel below; =require (tests): an error instead of that
  // fallback. Whatever cfg the call picked: 128-row tiles where it picked them. Grouped calls
  // where their tiles are the pipelined kernel's 64 or 128 rows (BARO_GEMM_WGMMA_GROUPED): =down
  // the MoE's down GEMM of prefill (A read in place), =sorted its gate/up GEMM with the fused
  // SwiGLU too, gate/up's A rows copied into sorted order before the call (moe.cu) and read in
  // place; auto (the default): sorted for calls of at least kWgAutoPairs pairs (launch.h).
  namespace k = baro::knobs;
  const bool wg_plain = p.tiles == nullptr && p.M >= 64 && p.a_rows == nullptr;
  const bool wg_grouped = p.tiles != nullptr && (cfg == GemmConfig::kPipe64 || cfg == GemmConfig::kPipe128) &&
                          p.a_rows == nullptr && wgmma_grouped_on(p.a_total_rows);
  if ((wg_plain || wg_grouped) && !split_w && p.moe.kind == Row1Moe::kNone) {
    const bool wg_need = k::is(k::kGemmWgmma, "require");
    if (wg_need || k::is(k::kGemmWgmma, "1")) {
      bool ran = false;
      GemmParams q = p;
      // pair stores where both stores allow them (only bf16 ones where every column is bf16)
      if (q.C16 != nullptr) q.out2 = (q.c16_cols >= q.N || q.out2) && q.ldc16 % 2 == 0 && is_aligned(q.C16, 4);
      const gpuError_t e = launch_gemm_wgmma(q, cfg == GemmConfig::kPipe128 ? 128 : 64, row_slots, stream, &ran);
      if (ran && stored16 != nullptr) *stored16 = q.C16 != nullptr;
      if (ran || e != gpuSuccess) return e;
      if (wg_need) return gpuErrorInvalidValue;
    }
  }
#endif
  p.C16 = nullptr;  // the kernels below store fp32 into C
  if (cfg == GemmConfig::kRow1) {
#if !BARO_HIP
    if (p.vec && p.K % 16 == 0)
      return swiglu ? launch_row1<true>(p, row_slots, stream) : launch_row1<false>(p, row_slots, stream);
#endif
    // the 16-row kernel instead: grouped tiles of one row fit its slots; plain rows regroup
    cfg = GemmConfig::kSmall;
    p.slot_rows = gemm_bm(cfg);
    if (p.tiles == nullptr) row_slots = (p.M + p.slot_rows - 1) / p.slot_rows;
  }
#if BARO_HIP
  if (cfg != GemmConfig::kSmall) cfg = GemmConfig::kLarge;  // slot_rows stays: sub-tiles
#else
  if (cfg == GemmConfig::kPipe64 || cfg == GemmConfig::kPipe128) {
    // the pipelined kernel keeps A row indices in 32 bits
    if (p.vec && (p.tiles != nullptr || p.M <= 0x7fffffffLL)) {
      if (swiglu)
        return cfg == GemmConfig::kPipe128 ? launch_pipe<128, 128, 2, 4, true>(p, row_slots, stream)
                                           : launch_pipe<64, 128, 2, 4, true>(p, row_slots, stream);
      return cfg == GemmConfig::kPipe128 ? launch_pipe<128, 128, 2, 4, false>(p, row_slots, stream)
                                         : launch_pipe<64, 128, 2, 4, false>(p, row_slots, stream);
    }
    if (swiglu) return gpuErrorInvalidValue;  // callers check gemm_vec_ok first
    cfg = GemmConfig::kLarge;  // no 16-byte loads: the simple kernel walks the slot in sub-tiles
  }
  if (cfg == GemmConfig::kSmall && p.vec && small_stream(p) && p.K % 16 == 0) {
    if (row_slots > 0x7fffffffLL) return gpuErrorInvalidValue;
    return swiglu ? launch_row1_moe<true, Row1Moe::kNone, true>(p, row_slots, stream)
                  : launch_row1_moe<false, Row1Moe::kNone, true>(p, row_slots, stream);
  }
  if (cfg == GemmConfig::kSmall && p.vec && !small_simple()) {
    return swiglu ? launch_rows16<true>(p, row_slots, stream) : launch_rows16<false>(p, row_slots, stream);
  }
#endif
  if (swiglu) return gpuErrorInvalidValue;
  const int bn = cfg == GemmConfig::kSmall ? GemmSmall::BN : GemmLarge::BN;
  const int64_t n_tiles = (p.N + bn - 1) / bn;
  if (n_tiles > 65535 || row_slots > 0x7fffffffLL) return gpuErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(row_slots), static_cast<unsigned>(n_tiles));
  if (cfg == GemmConfig::kSmall) {
    gemm_kernel<1, 1, 1, 4, GemmSmall::BK><<<grid, GemmSmall::kThreads, 0, stream>>>(p);
  } else {
    gemm_kernel<2, 4, 2, 2, GemmLarge::BK><<<grid, GemmLarge::kThreads, 0, stream>>>(p);
  }
  return gpuGetLastError();
}

bool gemm_vec_ok(const GemmParams& p) {
  return p.K % 8 == 0 && p.lda % 8 == 0 && p.ldw % 8 == 0 && p.w_group_stride % 8 == 0 &&
         is_aligned(p.A, 16) && is_aligned(p.W, 16);
}

// Row r of C: its first `cols` fp32 values rounded to bf16 and packed at the start of the row,
// in place (baro_matmul's bf16_cols after a kernel that stored fp32). Chunks in ascending order, each
// read whole before any thread writes it; a chunk's bf16 values land on fp32 columns below its
// end, all read by then, so no value is overwritten before it is read.
constexpr int kPackThreads = 256;
__global__ void __launch_bounds__(kPackThreads) pack16_kernel(float* C, int64_t ldc, int64_t cols) {
  float* row = C + static_cast<int64_t>(blockIdx.x) * ldc;
  uint16_t* row16 = reinterpret_cast<uint16_t*>(row);
  for (int64_t c0 = 0; c0 < cols; c0 += kPackThreads) {
    const int64_t c = c0 + threadIdx.x;
    const float v = c < cols ? row[c] : 0.0f;
    __syncthreads();
    if (c < cols) row16[c] = f32_to_bf16(v);
  }
}

gpuError_t launch_pack16(float* C, int64_t m, int64_t ldc, int64_t cols, gpuStream_t stream) {
  if (m <= 0 || cols <= 0) return gpuSuccess;
  if (m > 0x7fffffffLL) return gpuErrorInvalidValue;
  pack16_kernel<<<static_cast<unsigned>(m), kPackThreads, 0, stream>>>(C, ldc, cols);
  return gpuGetLastError();
}

gpuError_t launch_matmul(const uint16_t* x, const uint16_t* w, float* y, int64_t m, int64_t N,
                         int64_t K, gpuStream_t stream, int64_t bf16_cols) {
  (void)gpuGetLastError();  // clear a stale error so the status below is ours
  if (m <= 0 || N <= 0) return gpuSuccess;
  GemmParams p;
  p.A = x;
  p.lda = K;
  p.W = w;
  p.ldw = K;
  p.w_group_stride = 0;
  p.M = m;
  p.N = N;
  p.K = K;
  p.C = y;
  p.ldc = N;
  if (bf16_cols > 0) {  // C's own rows, the bf16 columns packed at their start
    p.C16 = reinterpret_cast<uint16_t*>(y);
    p.ldc16 = 2 * N;
    p.c16_cols = bf16_cols;
  }
  const GemmConfig cfg = gemm_pick(m, N);
  const int bm = gemm_bm(cfg);
  bool stored16 = false;
  const gpuError_t e = launch_gemm(p, cfg, (m + bm - 1) / bm, stream, bf16_cols > 0 ? &stored16 : nullptr);
  if (e != gpuSuccess || bf16_cols <= 0 || stored16) return e;
  return launch_pack16(y, m, N, bf16_cols, stream);  // a kernel that stored fp32: pack in place
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/results as BaroMatmulCpu, see docs/FFI.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error MatmulGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                         int64_t bf16_cols, ffi::ResultBuffer<ffi::F32> y) {
  const char* op = "baro_matmul";
  baro::MatmulDims dims;
  if (auto err = baro::check_matmul(x, w, *y, bf16_cols, dims); err.failure()) return err;
  const int64_t m = dims.m, K = dims.K, N = dims.N;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_matmul(x.typed_data(), w.typed_data(),
                                                    y->typed_data(), m, N, K, stream, bf16_cols));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMatmulGpu, baro::KnobChecked<MatmulGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Attr<int64_t>("bf16_cols")     // leading columns packed as bf16
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});
