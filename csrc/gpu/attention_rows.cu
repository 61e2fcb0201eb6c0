// baro_attention_rows (GPU): m rows, row r the token of sequence slot[r] at absolute position
// pos[r], over paged KV pools: pages [NP, page, Hkv, hd] and a table [P, T] mapping a slot's
// position j to page table[slot][j / page] (docs/FFI.md). Three launches on one stream, each a
// grid over all rows:
//   1. attn_rows_kv_write_kernel: every valid row's k/v into its position's page, before any
//      row attends (so a prefill chunk of one slot reads its own rows);
//   2. attn_rows_kernel, grid (rows x tiles of a row, kv heads, splits): each block runs
//      attn_fa_tile (attention_fa.cuh, its kPaged instantiation) on row r's view of its slot;
//   3. (m <= kRowsParallelMax) attn_rows_combine_kernel: attn_fa_combine_item per row.
// Why row r's bytes are baro_attention's one-row call on the contiguous cache its slot's pages
// stand for (the decode path): the view is exactly that call's AttentionArgs (m = 1,
// qkv/cos/sin/out at row r, pos at &pos[r], n_valid = 1) with the cache read through the slot's
// table row; a page holds whole 64-position KV blocks, so every block the tile loads comes from
// one page with the same rows in the same shared-memory places (an unmapped page's block
// zero-filled, as a contiguous cache of zeros would give); the tile geometry is that call's
// fa_plan (a tile of the row's G q heads, its decode copies and compile-time head dim as
// fa_launch_one picks them), the KV write, tile and merge are the same device functions, and the
// splits are the same absolute 512-position ones. With more than kRowsParallelMax rows a row's splits run in order inside its
// block (attn_fa_tile's serial mode) instead of in parallel blocks plus the merge: the same
// merge arithmetic (fa_merge_scale, then L*ea + l*eb, O*ea + o*eb in split order), as
// baro_attention's prefill and decode modes agree.
// Bad rows: slot outside [-1, P), pos outside [0, S) or a position whose page is unmapped or
// past NP cannot be refused without a sync, so they are poisoned: nothing written, o[r] = NaN;
// slot == -1 (padding) gives o[r] = 0.
// HIP: the handler refuses the call (the portable kernels have not been split per row yet);
// custom_calls refuses it first.
#include <cmath>
#include <cstdint>
#include <string>

#include "attention_common.cuh"
#include "attention_kv_write.cuh"
#include "common.cuh"
#include "contract_rows.h"
#include "ffi_gpu.h"
#include "launch.h"
#include "launch_rows.h"
#include "scratch_layout.h"

#if !BARO_HIP
#include "attention_fa.cuh"
#endif

namespace baro_gpu {

const char* attention_rows_unsupported(const AttentionRowsArgs& r) {
  const char* why = attention_unsupported(r.a);
  if (why[0] != '\0') return why;
  if (r.P < 1 || r.T < 1 || r.NP < 1) return "the table needs a slot and a page, the pool a page";
  if (r.page < kAttnKB || r.page % kAttnKB != 0) return "the page size must be a multiple of the 64-position KV block";
  if (r.T * r.page != r.a.S) return "the table width times the page size must be the positions S";
  if ((r.a.S + kAttnSplit - 1) / kAttnSplit > 65535) return "too many KV splits for the GPU grid";
  const int64_t G = r.a.H / r.a.Hkv;
  if (r.a.m * ((G + 63) / 64 + 1) > 0x7fffffffLL) return "too many rows for the GPU grid";
  return "";
}

#if !BARO_HIP
namespace {

__device__ const int32_t kRowsOneValid = 1;  // n_valid of a row's one-row view
constexpr uint16_t kBf16Nan = 0x7fc0;

enum RowKind { kRowValid = 0, kRowPad = 1, kRowBad = 2 };

// Row r's view: the AttentionArgs of baro_attention's one-row call, its cache the pages of kv
// (the slot's table row). Bad and padding rows get only their qkv / out rows (their kv is never
// read).
BARO_DEV int row_view(const AttentionRowsArgs& ra, int64_t r, AttentionArgs& a, KvPages& kv) {
  a = ra.a;
  const int hd = a.hd;
  a.m = 1;
  a.qkv += r * static_cast<int64_t>(2 * a.H + 2 * a.Hkv) * hd;
  a.cos += r * a.R2;
  a.sin += r * a.R2;
  a.out += r * static_cast<int64_t>(a.H) * hd;
  a.pos = ra.a.pos + r;
  a.n_valid = &kRowsOneValid;
  const int32_t s = ra.slot[r];
  const int32_t p = ra.a.pos[r];
  if (s == -1) return kRowPad;
  if (s < -1 || s >= ra.P || p < 0 || p >= ra.a.S) return kRowBad;
  kv.table = ra.table + static_cast<int64_t>(s) * ra.T;
  kv.page = ra.page;
  kv.num_pages = ra.NP;
  if (attn_kv_row(kv, p, static_cast<int64_t>(a.Hkv) * hd) < 0) return kRowBad;  // nowhere to write
  return kRowValid;
}

// The per-row plan: baro_attention's for m = 1.
struct RowsPlan {
  FaPlan one;          // fa_plan of the one-row call (parallel, its tile and split counts)
  bool parallel;       // m <= kRowsParallelMax: splits in parallel + the merge
  int64_t row_bytes;   // one row's partials, rounded to 256 bytes
  int64_t o_bytes;     // where a row's (max, sum) start after its O partials (fa_launch's layout)
};
inline RowsPlan rows_plan(const AttentionRowsArgs& ra) {
  AttentionArgs a1 = ra.a;
  a1.m = 1;
  RowsPlan p;
  p.one = fa_plan(a1);
  p.parallel = ra.a.m <= kRowsParallelMax;
  const int64_t slots = static_cast<int64_t>(a1.Hkv) * p.one.max_splits * p.one.rows_pad;
  p.o_bytes = baro::scratch::up256(4 * slots * a1.hd);
  p.row_bytes = baro::scratch::up256(static_cast<int64_t>(fa_scratch_bytes(a1)));
  return p;
}

__global__ void __launch_bounds__(kKvWarps * BARO_WARP) attn_rows_kv_write_kernel(AttentionRowsArgs ra) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kKvWarps + warp_id();
  if (item >= ra.a.m * ra.a.Hkv) return;
  const int64_t r = item / ra.a.Hkv;
  AttentionArgs a;
  KvPages kv;
  if (row_view(ra, r, a, kv) != kRowValid) return;
  attn_kv_write_item<true>(a, item - r * ra.a.Hkv, kv);  // item kh of the one-row call
}

// Grid (m * tiles, Hkv, splits or 1).
template <int kPairs, bool kParallel, int kHd, int kDup>
__global__ void __launch_bounds__(kPairs * 2 * kDup * BARO_WARP, 1)
    attn_rows_kernel(AttentionRowsArgs ra, char* __restrict__ scratch, int64_t row_bytes, int64_t o_bytes,
                     int tiles, int max_splits, int64_t rows_pad) {
  grid_dependency_wait();  // launch_dependent: the KV writes first
  const int64_t r = blockIdx.x / tiles;
  const int tile = static_cast<int>(blockIdx.x % tiles);
  const int kh = static_cast<int>(blockIdx.y);
  AttentionArgs a;
  KvPages kv;
  const int kind = row_view(ra, r, a, kv);
  if (kind != kRowValid) {  // uniform for the block, before any barrier
    if (!kParallel && tile == 0 && blockIdx.z == 0) {  // parallel mode: the combine writes the row
      const int G = a.H / a.Hkv;
      uint16_t* orow = a.out + static_cast<int64_t>(kh) * G * a.hd;
      const uint16_t fill = kind == kRowPad ? uint16_t{0} : kBf16Nan;
      for (int e = threadIdx.x; e < G * a.hd; e += blockDim.x) orow[e] = fill;
    }
    return;
  }
  float* po = nullptr;
  float* pml = nullptr;
  if constexpr (kParallel) {
    char* base = scratch + r * row_bytes;
    po = reinterpret_cast<float*>(base);
    pml = reinterpret_cast<float*>(base + o_bytes);
  }
  attn_fa_tile<kPairs, kParallel, kHd, kDup, true>(a, po, pml, max_splits, rows_pad, tile, kh,
                                                   static_cast<int>(blockIdx.z), kv);
}

__global__ void __launch_bounds__(kFaCombineWarps * BARO_WARP)
    attn_rows_combine_kernel(AttentionRowsArgs ra, const char* __restrict__ scratch, int64_t row_bytes,
                             int64_t o_bytes, int max_splits, int64_t rows_pad) {
  grid_dependency_wait();  // launch_dependent: the splits' partials first
  const int64_t per_row = static_cast<int64_t>(ra.a.H) * kFaCombineSlices;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kFaCombineWarps + warp_id();
  if (item >= ra.a.m * per_row) return;
  const int64_t r = item / per_row, local = item - r * per_row;
  AttentionArgs a;
  KvPages kv;
  const int kind = row_view(ra, r, a, kv);
  if (kind != kRowValid) {
    const int slice = static_cast<int>(local % kFaCombineSlices);
    const int h = static_cast<int>(local / kFaCombineSlices);
    uint16_t* orow = a.out + static_cast<int64_t>(h) * a.hd;
    const uint16_t fill = kind == kRowPad ? uint16_t{0} : kBf16Nan;
    for (int d = lane_id() + BARO_WARP * slice; d < a.hd; d += BARO_WARP * kFaCombineSlices) orow[d] = fill;
    return;
  }
  const char* base = scratch + r * row_bytes;
  attn_fa_combine_item(a, reinterpret_cast<const float*>(base), reinterpret_cast<const float*>(base + o_bytes),
                       max_splits, rows_pad, local);
}

template <int kPairs, bool kParallel, int kHd, int kDup>
gpuError_t rows_launch_hd(const AttentionRowsArgs& ra, const RowsPlan& p, dim3 grid, char* scratch,
                          gpuStream_t stream) {
  const size_t smem = fa_smem(ra.a.hd, kPairs).total;
  gpuError_t e = cudaFuncSetAttribute(attn_rows_kernel<kPairs, kParallel, kHd, kDup>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != gpuSuccess) return e;
  return launch_dependent(attn_rows_kernel<kPairs, kParallel, kHd, kDup>, grid, dim3(kPairs * 2 * kDup * BARO_WARP),
                          smem, stream, ra, scratch, p.row_bytes, p.o_bytes, static_cast<int>(p.one.tiles),
                          static_cast<int>(p.one.max_splits), p.one.rows_pad);
}

// The instantiation fa_launch_one gives the one-row call (its decode copies where fa_decode_dup
// says, the compile-time head dim at 256), in the mode of this call.
template <int kPairs, bool kParallel>
gpuError_t rows_launch(const AttentionRowsArgs& ra, const RowsPlan& p, dim3 grid, char* scratch, gpuStream_t s) {
  if constexpr (kParallel && kPairs == kFaSmallPairs) {
    if (fa_decode_dup(ra.a)) {
      if (ra.a.hd == kAttnMaxHeadDim)
        return rows_launch_hd<kPairs, true, kAttnMaxHeadDim, kFaDecodeDup>(ra, p, grid, scratch, s);
      return rows_launch_hd<kPairs, true, 0, kFaDecodeDup>(ra, p, grid, scratch, s);
    }
  }
  if (ra.a.hd == kAttnMaxHeadDim) return rows_launch_hd<kPairs, kParallel, kAttnMaxHeadDim, 1>(ra, p, grid, scratch, s);
  return rows_launch_hd<kPairs, kParallel, 0, 1>(ra, p, grid, scratch, s);
}

}  // namespace
#endif  // !BARO_HIP

size_t attention_rows_scratch_bytes(const AttentionRowsArgs& r) {
#if !BARO_HIP
  if (r.a.m <= 0 || r.a.m > kRowsParallelMax) return 0;
  return static_cast<size_t>(r.a.m * rows_plan(r).row_bytes);
#else
  (void)r;
  return 0;
#endif
}

gpuError_t launch_attention_rows(const AttentionRowsArgs& ra, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
#if BARO_HIP
  (void)ra;
  (void)scratch;
  (void)stream;
  return gpuErrorInvalidValue;
#else
  const AttentionArgs& a = ra.a;
  if (a.m <= 0) return gpuSuccess;
  if (attention_rows_unsupported(ra)[0] != '\0') return gpuErrorInvalidValue;
  const RowsPlan p = rows_plan(ra);
  if (p.parallel && scratch == nullptr) return gpuErrorInvalidValue;
  // 1. every row's K/V
  const int64_t blocks1 = (a.m * a.Hkv + kKvWarps - 1) / kKvWarps;
  attn_rows_kv_write_kernel<<<static_cast<unsigned>(blocks1), kKvWarps * BARO_WARP, 0, stream>>>(ra);
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) return e;
  // 2. the tiles of every row (and split)
  const dim3 grid(static_cast<unsigned>(a.m * p.one.tiles), static_cast<unsigned>(a.Hkv),
                  p.parallel ? static_cast<unsigned>(p.one.max_splits) : 1u);
  char* sc = static_cast<char*>(scratch);
  if (p.one.pairs == kFaSmallPairs)
    e = p.parallel ? rows_launch<kFaSmallPairs, true>(ra, p, grid, sc, stream)
                   : rows_launch<kFaSmallPairs, false>(ra, p, grid, sc, stream);
  else
    e = p.parallel ? rows_launch<kFaBigPairs, true>(ra, p, grid, sc, stream)
                   : rows_launch<kFaBigPairs, false>(ra, p, grid, sc, stream);
  if (e != gpuSuccess || !p.parallel) return e;
  // 3. each row's splits merged in order
  const int64_t blocks3 = (a.m * a.H * kFaCombineSlices + kFaCombineWarps - 1) / kFaCombineWarps;
  return launch_dependent(attn_rows_combine_kernel, dim3(static_cast<unsigned>(blocks3)),
                          dim3(kFaCombineWarps * BARO_WARP), 0, stream, ra, static_cast<const char*>(sc),
                          p.row_bytes, p.o_bytes, static_cast<int>(p.one.max_splits), p.one.rows_pad);
#endif
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/attrs/results as BaroAttentionRowsCpu, docs/FFI.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error AttentionRowsGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> q_norm,
                                ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                                ffi::Buffer<ffi::BF16> k_pages, ffi::Buffer<ffi::BF16> v_pages,
                                ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> pos,
                                float eps,
                                ffi::ResultBuffer<ffi::BF16> o, ffi::ResultBuffer<ffi::BF16> k_out,
                                ffi::ResultBuffer<ffi::BF16> v_out, ffi::ResultBuffer<ffi::U8> scratch) {
  const char* op = "baro_attention_rows";
  baro::AttentionRowsDims d;
  if (auto err = baro::check_attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slot, pos, *o,
                                            *k_out, *v_out, d);
      err.failure())
    return err;
  BARO_RETURN_IF(baro::expect_eps(op, eps));
#if BARO_HIP
  (void)stream;
  (void)eps;
  (void)scratch;
  return ffi::Error::InvalidArgument(std::string(op) + ": the HIP kernel is not written yet (CUDA and CPU have it)");
#else
  BARO_CHECK(d.S < (int64_t{1} << 31) && d.H <= 65535, op,
             "pool length " << d.S << " or q heads " << d.H << " too large for the GPU kernel");
  baro_gpu::AttentionRowsArgs ra;
  baro_gpu::AttentionArgs& a = ra.a;
  a.qkv = qkv.typed_data();
  a.q_norm = q_norm.typed_data();
  a.k_norm = k_norm.typed_data();
  a.cos = cos.typed_data();
  a.sin = sin.typed_data();
  a.k_cache = k_out->typed_data();
  a.v_cache = v_out->typed_data();
  a.pos = pos.typed_data();
  a.n_valid = nullptr;
  a.out = o->typed_data();
  a.m = d.m;
  a.S = d.S;
  a.H = static_cast<int>(d.H);
  a.Hkv = static_cast<int>(d.Hkv);
  a.hd = static_cast<int>(d.hd);
  a.R2 = static_cast<int>(d.R2);
  a.eps = eps;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.hd)));
  ra.slot = slot.typed_data();
  ra.table = table.typed_data();
  ra.P = d.P;
  ra.T = d.T;
  ra.NP = d.NP;
  ra.page = static_cast<int>(d.page);
  const char* why = baro_gpu::attention_rows_unsupported(ra);
  BARO_CHECK(why[0] == '\0', op, why << " (head_dim=" << d.hd << ", H=" << d.H << ", Hkv=" << d.Hkv << ")");
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::copy_if_not_aliased_async(k_pages, k_out, stream));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::copy_if_not_aliased_async(v_pages, v_out, stream));
  void* mem = nullptr;
  if (auto err = baro_gpu::take_scratch(op, baro_gpu::ScratchSource{nullptr, &scratch},
                                        baro_gpu::attention_rows_scratch_bytes(ra), &mem);
      err.failure())
    return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_attention_rows(ra, mem, stream));
  return ffi::Error::Success();
#endif
}

}  // namespace

// Allocates nothing (the split partials are the last result, sized by custom_calls), so it may
// run inside XLA's command buffers like the _small ops.
XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionRowsGpu, baro::KnobChecked<AttentionRowsGpuImpl>::Call,
                              BARO_BIND_ATTENTION_ROWS_ARGS(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
