// baro_jax GPU: framework-free host launchers (pointers, sizes, a stream).
// The FFI handlers in csrc/gpu/*.cu validate shapes and call these. Every
// launcher only enqueues work on `stream` (never synchronises, never copies to
// the host) and returns the status of the last launch (gpuGetLastError).
// Device scalars (pos, n_valid) are read by the kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm.cuh"
#include "knobs.h"  // the speed/test knobs, read per call (csrc/common/knobs.h)
#include "portability.h"

namespace baro_gpu {

// Host helpers of the launchers.
inline bool is_aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }
// The current device's SM count, read once per device (132 when it cannot be read; 0 on HIP).
int sm_count();

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch on sm_90
// (portability.h grid_dependency_wait; the kernel must call it first): for the second and later
// kernels of one handler, whose launch latency then overlaps the previous kernel's drain.
// Opt-in, BARO_PDL=1 (read per call), until its speed is measured; otherwise, and on HIP and
// GPUs before sm_90, a plain launch.
bool pdl_enabled();
template <typename... K, typename... A>
gpuError_t launch_dependent(void (*kernel)(K...), dim3 grid, dim3 block, size_t smem, gpuStream_t stream,
                            A&&... args) {
#if !BARO_HIP
  if (pdl_enabled()) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<A&&>(args)...);
  }
#endif
  kernel<<<grid, block, smem, stream>>>(static_cast<A&&>(args)...);
  return gpuGetLastError();
}

#if !BARO_HIP
// >48 KB of dynamic shared memory must be opted into per kernel and device;
// done once per (instantiation, device). Harmless to repeat on a race. `done`
// belongs to the caller's instantiation: every pipelined kernel has the same
// function type, so a static here would be shared by all of them.
template <typename Kernel>
inline gpuError_t allow_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  gpuError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev >= 0 && dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && bit != 0) done.fetch_or(bit, std::memory_order_release);
  return e;
}
#endif

// ---- GEMM (matmul.cu) ----
// kSmall 16 x 32 and kLarge 64 x 64: the simple synchronous kernel (decode,
// no 16-byte loads, HIP). kPipe64 64 x 128 and kPipe128 128 x 128: the
// pipelined sm_80+ kernel (HIP runs them on the simple kernel). Every config
// gives the same bits; the choice is speed only. kRow1: one row per slot, the
// streaming decode kernel (gemm_row1.cuh; CUDA, 16-byte loads, K % 16 == 0, else
// kSmall runs).
enum class GemmConfig { kSmall, kLarge, kPipe64, kPipe128, kRow1 };
int gemm_bm(GemmConfig cfg);  // rows per slot / max rows per grouped tile
// Plain matmul: one row when m == 1, small when m <= 16, else by m and N (env
// BARO_GEMM_TILE forces one for m > 1; BARO_GEMM_ROW1=off keeps m == 1 on kSmall).
GemmConfig gemm_pick(int64_t m, int64_t N);
// Grouped (MoE) over `rows` tokens: one row when rows == 1, else by the average rows per group.
GemmConfig gemm_pick_grouped(int64_t pairs, int64_t groups, int64_t rows);
// 16-byte loads possible (the pipelined kernel; otherwise the simple one runs).
bool gemm_vec_ok(const GemmParams& p);
// kRow1 runs gemm_row1 on these operands (not its kSmall fallback): CUDA, the knob on,
// 16-byte loads, K % 16 == 0. The only kernel that reads p.W_host.
bool gemm_row1_runs(const GemmParams& p);
// launch_gemm(p, cfg, ...) runs a kernel that reads p.W_tail / p.W_last (gemm_row1, or for
// kSmall gemm_row1's 16-row stream and gemm_rows16; CUDA only) and, for kRow1, p.W_host.
bool gemm_split_w_runs(const GemmParams& p, GemmConfig cfg);
// p.moe (the one-token MoE's route on gate/up, combine on down) can run: kRow1 on gemm_row1,
// grouped, k <= 32, the pointers its kind needs, the route's tiles within its shared memory.
bool gemm_row1_moe_ok(const GemmParams& p, GemmConfig cfg);
// The most tiles the route in gemm_row1's shared memory holds (0 where gemm_row1 is not built).
int64_t row1_moe_route_max_tiles();
// The config can run the fused SwiGLU epilogue (p.Act != nullptr) when gemm_vec_ok.
bool gemm_fused_swiglu_ok(GemmConfig cfg);
// Enqueues the config's kernel over grid (row_slots, N tiles). Fills
// p.slot_rows, p.vec, p.out2. Grouped tiles must hold <= gemm_bm(cfg) rows.
// p.C16 (with p.C, no SwiGLU, stored16 given): the wgmma kernel, where it runs, stores the output
// columns below p.c16_cols rounded to bf16 there, and *stored16 says so; every other kernel stores
// fp32 into p.C, and the caller takes them from there.
gpuError_t launch_gemm(GemmParams p, GemmConfig cfg, int64_t row_slots, gpuStream_t stream,
                       bool* stored16 = nullptr);
// The Hopper prefill GEMM (gemm_wgmma.cu, on unless BARO_GEMM_WGMMA=0; launch_gemm calls it):
// a plain dense call of m >= 64 rows, or a grouped one (tiles of at most bm rows, row_slots of
// them, p.w_groups set, and p.a_total_rows where A is read in place; a_rows only with the fused
// SwiGLU and p.vec: the rows copied by the producer warp's cp.async), with no W_tail / W_last /
// W_host or one-token MoE, on wgmma + TMA in bm-row tiles (64 or 128), fp32 C or the fused
// SwiGLU, giving gemm_pipe_kernel's bits. Enqueues nothing and sets *ran = false where it is not built (no sm_90
// in the architectures, HIP), the device is not sm_90, or the call or its alignment does not fit;
// the caller then runs its own kernel. p.out2 must be filled (launch_gemm does).
gpuError_t launch_gemm_wgmma(const GemmParams& p, int bm, int64_t row_slots, gpuStream_t stream, bool* ran);
// Where `auto` puts the MoE's grouped prefill GEMMs on wgmma (BARO_GEMM_WGMMA_GROUPED: gate/up's A
// rows copied into sorted order, both GEMMs reading A in place) and the wgmma GEMM's 256-row W
// tiles (BARO_GEMM_WGMMA_BN): calls of at least 4,096 rows (plain) or 32,768 pairs (grouped: 4,096
// tokens of top 8), the sizes measured faster (docs/PERF.md 2026-12-06: an 8k prefill at chunk
// 4096 +4.8%, the MoE op at 8,192 rows -13%, H100); smaller calls, decode steps among them, keep
// the kernels measured there. Any choice gives the same bits.
constexpr int64_t kWgAutoRows = 4096, kWgAutoPairs = 32768;
// The tiled grids' walk (BARO_PIPE_ORDER, GemmParams::cols_fast): a slot's column tiles side by
// side where forced (cols) or, under auto, where the caller says it was measured faster (the
// MoE's grouped prefill GEMMs, on the pipelined kernel and on wgmma).
inline bool gemm_walk_cols(bool auto_cols) {
  namespace k = baro::knobs;
  return k::is(k::kPipeOrder, "cols") || (auto_cols && k::is(k::kPipeOrder, "auto"));
}
inline bool wgmma_grouped_sorted(int64_t pairs) {
  namespace k = baro::knobs;
  return k::is(k::kGemmWgmmaGrouped, "sorted") || (k::is(k::kGemmWgmmaGrouped, "auto") && pairs >= kWgAutoPairs);
}
inline bool wgmma_grouped_on(int64_t pairs) {
  return baro::knobs::is(baro::knobs::kGemmWgmmaGrouped, "down") || wgmma_grouped_sorted(pairs);
}
// y[m,N] = x[m,K] . w[N,K]^T; the first bf16_cols columns rounded to bf16 and packed at the start
// of each row (GemmParams::C16 on C's own rows, else launch_pack16 after the GEMM)
gpuError_t launch_matmul(const uint16_t* x, const uint16_t* w, float* y, int64_t m, int64_t N,
                         int64_t K, gpuStream_t stream, int64_t bf16_cols = 0);
// C's rows' first `cols` fp32 values rounded to bf16 and packed at the start of the row, in place
gpuError_t launch_pack16(float* C, int64_t m, int64_t ldc, int64_t cols, gpuStream_t stream);

// ---- norms (norm.cu) ----
gpuError_t launch_rmsnorm(const float* x, const float* w, uint16_t* y, int64_t m, int64_t D,
                          float eps, gpuStream_t stream);
// s = x + r (fp32), y = rmsnorm(s): baro_add_rmsnorm
gpuError_t launch_add_rmsnorm(const float* x, const float* r, const float* w, float* s, uint16_t* y,
                              int64_t m, int64_t D, float eps, gpuStream_t stream);
// o: [rows, dv] with rows = m*nv; z, y: [rows, dv]
// rows = m * nv (token, head) rows; z points at token 0's first gate, row i's gates at z + i * z_ld
gpuError_t launch_gated_norm(const float* o, const float* z, const float* w, uint16_t* y,
                             int64_t rows, int64_t nv, int64_t dv, int64_t z_ld, float eps,
                             gpuStream_t stream);

// ---- attention (attention.cu) ----
struct AttentionArgs {
  const float* qkv;  // [m, (2H+2Hkv)*hd]
  const float* q_norm;
  const float* k_norm;
  const float* cos;  // [m, R2]
  const float* sin;
  uint16_t* k_cache;  // [S, Hkv, hd] (already holding the old contents)
  uint16_t* v_cache;
  const int32_t* pos;      // device scalar
  const int32_t* n_valid;  // device scalar
  uint16_t* out;           // [m, H*hd]
  int64_t m, S;
  int H, Hkv, hd, R2;
  float eps, scale;
};
// A paged cache (baro_attention_rows' row views, the kernels' kPaged instantiations): cache
// position j lives in page table[j / page], row j % page, of AttentionArgs' k_cache / v_cache
// [num_pages][page][Hkv][hd]; page is a multiple of the 64-position KV block.
struct KvPages {
  const int32_t* table;
  int64_t num_pages;
  int page;
};
constexpr int kAttnMaxHeadDim = 256;
// Checks hd/alignment limits; "" when fine, else a message.
const char* attention_unsupported(const AttentionArgs& a);
// Device scratch launch_attention needs (0 when m > 16: no scratch).
size_t attention_scratch_bytes(const AttentionArgs& a);
gpuError_t launch_attention(const AttentionArgs& a, void* scratch, gpuStream_t stream);
// The opt-in Hopper prefill kernel (attention_wgmma.cu, BARO_ATTN_WGMMA=1): kernel 2 of a serial
// (m > 16) launch_attention call, after the cache write, giving attn_fa_kernel's bits. Enqueues
// nothing and sets *ran = false where it is not built (no sm_90 in the architectures, HIP), the
// device is not sm_90 or the head dim is not 32, 64, 128 or 256; the caller then runs the default.
gpuError_t launch_attention_wgmma(const AttentionArgs& a, void* scratch, gpuStream_t stream, bool* ran);
// Scratch the Hopper prefill attention takes for a call (BARO_ATTN_PIPE=2's merge accumulators; else 0).
size_t attention_wgmma_scratch_bytes(const AttentionArgs& a);

// ---- Gated DeltaNet (conv.cu, delta.cu) ----
// y[t,c] = silu(sum_j w[c,j] u[t-3+j,c]); win_out may equal win_in.
gpuError_t launch_conv(const uint16_t* x, const uint16_t* w, const uint16_t* win_in,
                       uint16_t* win_out, const int32_t* n_valid, float* y, int64_t m,
                       int64_t C, gpuStream_t stream);
// x: f32 rows of width ldx >= C, rounded to bf16 on load (baro_conv_proj). P > 1: rows mode (m = 1,
// x [P, ldx], window [3, P*C], y [P, C]: one token of P*C channels, channel p*C + c from x[p, c]).
// packed: x's first C columns are bf16 packed at the start of each row (baro_matmul's bf16_cols:
// uint16 element t * 2 ldx + c), read as they are.
gpuError_t launch_conv_proj(const float* x, int64_t ldx, const uint16_t* w, const uint16_t* win_in,
                            uint16_t* win_out, const int32_t* n_valid, float* y, int64_t m, int64_t C,
                            int64_t P, gpuStream_t stream, bool packed = false);
// Rows mode (rows = P > 1, m = 1): y, b and a hold P sequences' one token each, row p; the call's
// value head j (of rows * nv) is row j / nv's head j % nv, key head (j % nv) / (nv / nk).
struct DeltaArgs {
  const float* y;  // [m * rows, 2*nk*dk + nv*dv]
  const float* b;  // row t's nv gates at b + t * b_ld
  const float* a;  // row t's at a + t * a_ld
  const float* A_log;    // [nv]
  const float* dt_bias;  // [nv]
  const float* state_in;  // [rows * nv, dk, dv]
  float* state_out;       // may equal state_in
  const int32_t* n_valid;
  float* o;  // [m, rows * nv, dv]
  int64_t m;
  int nk, nv, dk, dv;  // nk, nv: the heads of one row of y
  float scale;
  int64_t b_ld, a_ld;
  int rows = 1;  // rows of y per token
};
// State columns per delta block (grid: rows * nv x ceil(dv / this)).
constexpr int kDeltaColsPerBlock = BARO_HIP ? 64 : 32;
bool delta_supported_dk(int dk);
gpuError_t launch_delta(const DeltaArgs& a, gpuStream_t stream);
// baro_delta_blocked (delta_blocked.cu): the chunk-aligned delta rule. *_in may equal *_out
// (the handler passes the results, after copying the operands when XLA did not alias them).
struct DeltaBlockedArgs {
  const float* y;  // [m, 2*nk*dk + nv*dv]
  const float* b;  // [m, nv]
  const float* a;  // [m, nv]
  const float* A_log;
  const float* dt_bias;
  const float* s0_in;  // [nv, dk, dv]
  const float* pk_in;  // [nv, B, dk]
  const float* pu_in;  // [nv, B, dv]
  const float* pc_in;  // [nv, B]
  float* s0_out;
  float* pk_out;
  float* pu_out;
  float* pc_out;
  const int32_t* pos;      // device scalar
  const int32_t* n_valid;  // device scalar
  float* o;                // [m, nv, dv]
  int64_t m;
  int nk, nv, dk, dv, B;
  float scale;
};
// "" when the shape is supported, else what is (dk 16/32/64/128, dv <= 128, B <= 64).
const char* delta_blocked_unsupported(int dk, int dv, int B);
gpuError_t launch_delta_blocked(const DeltaBlockedArgs& a, gpuStream_t stream);

// ---- MoE (moe.cu) ----
struct MoeArgs {
  const uint16_t* h;       // [m, D]
  const uint16_t* router;  // [E, D]
  const uint16_t* w_gate_up;  // [E, 2I, D]
  const uint16_t* w_down;     // [E, D, I]
  const uint16_t* s_gate_up;  // [2Is, D]
  const uint16_t* s_down;     // [D, Is]
  const uint16_t* s_gate;     // [1, D]
  float* out;                 // [m, D]
  int64_t m, D, E, I, Is;
  int top_k;
  // baro_moe_slots: w_gate_up / w_down are pools of S slots and expert e's weights are slot
  // slots[e] (-1 = not resident: its rows come out NaN); nullptr: slot e (baro_moe).
  const int32_t* slots = nullptr;  // [E]
  int64_t S = 0;
  // Grouping only: experts with no slot get no GEMM tiles (baro_moe_pairs: another shard's).
  bool skip_unslotted = false;
  // baro_moe_host (one token, the fold path only): an expert with no slot is read from the host
  // store ([E, 2I, D] / [E, D, I], device-accessible pinned host memory) instead of NaN rows.
  const uint16_t* host_gu = nullptr;
  const uint16_t* host_dn = nullptr;
};
// Whether launch_moe runs a's one-token fold path (the only one that reads a host store).
bool moe_runs_fold(const MoeArgs& a);
constexpr int kMoeMaxExperts = 8192;
// Bytes of device scratch launch_moe needs (256-byte aligned pieces).
size_t moe_scratch_bytes(const MoeArgs& a);
gpuError_t launch_moe(const MoeArgs& a, void* scratch, gpuStream_t stream);
// baro_moe_pairs: launch_moe's routing and grouped experts for the pairs whose expert is in
// [*expert_base, *expert_base + El) (w_gate_up / w_down hold those El experts; a.E = router
// rows); y[m, k, D] = each such pair's expert output (0 for the others), w[m, k], ids[m, k].
size_t moe_pairs_scratch_bytes(const MoeArgs& a);
gpuError_t launch_moe_pairs(const MoeArgs& a, int64_t El, const int32_t* expert_base, float* y, float* w,
                            int32_t* ids, void* scratch, gpuStream_t stream);
// baro_moe_combine: launch_moe's combine of given pairs y[m, k, D] / w[m, k] plus the shared
// expert of a.h (a.s_gate_up, a.s_down, a.s_gate, a.Is), into a.out.
size_t moe_combine_scratch_bytes(const MoeArgs& a);
gpuError_t launch_moe_combine(const MoeArgs& a, const float* y, const float* w, void* scratch,
                              gpuStream_t stream);
// baro_moe_route: ids[m, k] = the experts launch_moe routes each row to (the same kernels).
size_t moe_route_scratch_bytes(int64_t m, int64_t E, int k);
gpuError_t launch_moe_route(const uint16_t* h, const uint16_t* router, int32_t* ids, int64_t m,
                            int64_t D, int64_t E, int k, void* scratch, gpuStream_t stream);

}  // namespace baro_gpu
