// baro_attention (GPU): q/k head RMSNorm, partial rotary, KV-cache write,
// causal online-softmax attention over KV blocks of 64 aligned to absolute
// positions, output gate. Launches on one stream:
//   1. attn_kv_write_kernel (attention_kv_write.cuh): k (normed, rotated) and v rounded to bf16 and
//      stored at cache rows pos+i for i < n_valid;
//   2. the attention kernel. KV positions are cut into splits of 512 (8
//      blocks of 64, aligned to absolute positions); each split is an online
//      softmax over its blocks in order, and a row's result is the in-order
//      merge of its splits (see below). CUDA: attn_fa_kernel
//      (attention_fa.cuh), GQA-aware: a tile's rows are (token, q head of one
//      kv group) pairs, so the G q heads of a kv head share every K/V tile;
//      64-row tiles (prefill) or 16-row tiles (decode). HIP: attn_kernel
//      (attention_portable.cuh), one block = 16 query rows of one q head;
//   3. (m <= 16 only) the combine kernel: the in-order merge of the splits,
//      which kernel 2 then computed in parallel (decode of a long context).
//
// Why a row gets the same bits whatever m is (decode m = 1 vs prefill m = C):
// - its q is computed by the same per-(row, head) warp code;
// - S = QK^T and O += PV use dot.cuh's MMA (row- and tile-invariant), K and
//   V read from the cache (so decode and prefill read the same bf16 values);
// - the block max and sum of a row use a fixed order that depends on the
//   column only (HIP: lane order + butterfly; CUDA: attention_fa.cuh);
// - columns past the row's own position are masked to -inf (p = 0);
// - a KV block (or a whole split) that lies wholly past a row's position
//   (possible when other rows of the tile are later) is skipped for that row
//   by a select, so the row sees exactly the blocks 0 .. pos_i/64 and the
//   splits 0 .. pos_i/512, as in decode;
// - the split boundaries are absolute, and both modes run the same split code
//   and the same merge arithmetic (attn_merge_scale, then L*ea + l*eb,
//   O*ea + o*eb, in split order).
// KV rows past min(last row of the tile, pos + n_valid - 1) are never read
// (zero-filled in shared memory), so unwritten cache rows (maybe NaN) cannot
// leak in through 0 * NaN.
#include <cmath>
#include <cstdint>
#include <string>

#include "attention_common.cuh"
#include "attention_kv_write.cuh"
#include "contract.h"
#include "common.cuh"
#include "dot.cuh"
#include "ffi_gpu.h"
#include "launch.h"
#include "scratch_layout.h"

#if BARO_HIP
#include "attention_portable.cuh"  // kernels 2 and 3 on HIP
#else
#include "attention_fa.cuh"  // kernels 2 and 3 on NVIDIA
#endif

namespace baro_gpu {

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

const char* attention_unsupported(const AttentionArgs& a) {
  if (a.hd <= 0 || a.hd % 16 != 0 || a.hd > kAttnMaxHeadDim)
    return "the GPU kernel needs head_dim to be a multiple of 16 and <= 256";
  if (a.Hkv <= 0 || a.H <= 0 || a.H % a.Hkv != 0) return "H must be a positive multiple of Hkv";
  if (a.R2 < 0 || 2 * a.R2 > a.hd) return "rotary dims exceed head_dim";
  if (!aligned16(a.k_cache) || !aligned16(a.v_cache))
    return "k_cache / v_cache must be 16-byte aligned";
  if (a.H > 65535) return "too many q heads for the GPU grid";
  return "";
}

#if BARO_HIP
static int64_t attn_max_splits(const AttentionArgs& a) { return (a.S + kAttnSplit - 1) / kAttnSplit; }
#endif

size_t attention_scratch_bytes(const AttentionArgs& a) {
#if !BARO_HIP
  return fa_scratch_bytes(a) + attention_wgmma_scratch_bytes(a);  // calls of <= 16 rows / more
#else
  static_assert(baro::scratch::kAttnRows == kAttnRows && baro::scratch::kAttnSplit == kAttnSplit,
                "scratch_layout.h has the HIP kernel's geometry");
  return static_cast<size_t>(baro::scratch::attention_bytes(a.m, a.S, a.H, a.Hkv, a.hd, true));  // serial: 0
#endif
}

gpuError_t launch_attention(const AttentionArgs& a, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.m <= 0) return gpuSuccess;
  const char* why = attention_unsupported(a);
  if (why[0] != '\0') return gpuErrorInvalidValue;
  // 1. cache writes (before any block of kernel 2 reads the cache: same stream)
  const int64_t items = a.m * a.Hkv;
  const int64_t blocks1 = (items + kKvWarps - 1) / kKvWarps;
  if (blocks1 > 0x7fffffffLL) return gpuErrorInvalidValue;
  attn_kv_write_kernel<<<static_cast<unsigned>(blocks1), kKvWarps * BARO_WARP, 0, stream>>>(a);
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) return e;
#if !BARO_HIP
  // 2. (and 3.) GQA flash attention, attention_fa.cuh
  return fa_launch(a, scratch, stream);
#else
  const bool parallel = a.m <= kAttnRows;
  if (parallel && scratch == nullptr) return gpuErrorInvalidValue;
  const int64_t max_splits = attn_max_splits(a);
  const int64_t blocks2 = (a.m + kAttnRows - 1) / kAttnRows;
  const int64_t blocks3 = (a.m * a.H + kCombineWarps - 1) / kCombineWarps;
  if (blocks2 > 0x7fffffffLL || max_splits > 65535) return gpuErrorInvalidValue;
  // 2. attention
  const size_t smem = attn_smem(a.hd).total;  // <= 49088 B for hd <= 256
  if (!parallel) {
    dim3 grid(static_cast<unsigned>(blocks2), static_cast<unsigned>(a.H), 1u);
    attn_kernel<<<grid, kAttnThreads, smem, stream>>>(a, nullptr, nullptr, 0);
    return gpuGetLastError();
  }
  const int64_t slots = static_cast<int64_t>(a.H) * max_splits * kAttnRows;
  float* part_o = static_cast<float*>(scratch);
  float* part_ml = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                            ((sizeof(float) * slots * a.hd + 255) / 256) * 256);
  dim3 grid(1u, static_cast<unsigned>(a.H), static_cast<unsigned>(max_splits));
  attn_kernel<<<grid, kAttnThreads, smem, stream>>>(a, part_o, part_ml, static_cast<int>(max_splits));
  e = gpuGetLastError();
  if (e != gpuSuccess) return e;
  // 3. merge the splits of each row in order
  attn_combine_kernel<<<static_cast<unsigned>(blocks3), kCombineWarps * BARO_WARP, 0, stream>>>(
      a, part_o, part_ml, static_cast<int>(max_splits));
  return gpuGetLastError();
#endif
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/attrs/results as BaroAttentionCpu, see docs/FFI.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

// given == nullptr: the split partials come from XLA's scratch allocator (baro_attention);
// else from the caller's result buffer, checked to be large enough (baro_attention_small,
// which allocates nothing and so may run inside a command buffer).
ffi::Error attention_common(const char* op, gpuStream_t stream, ffi::ScratchAllocator* scratch,
                            ffi::Result<ffi::Buffer<ffi::U8>>* given, ffi::Buffer<ffi::F32> qkv,
                            ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm,
                            ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                            ffi::Buffer<ffi::BF16> k_cache, ffi::Buffer<ffi::BF16> v_cache,
                            ffi::Buffer<ffi::S32> pos_buf, ffi::Buffer<ffi::S32> n_valid_buf,
                            float eps, ffi::ResultBuffer<ffi::BF16> o,
                            ffi::ResultBuffer<ffi::BF16> k_out,
                            ffi::ResultBuffer<ffi::BF16> v_out) {
  baro::AttentionDims dims;
  if (auto err = baro::check_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos_buf, n_valid_buf,
                                       *o, *k_out, *v_out, dims);
      err.failure())
    return err;
  BARO_RETURN_IF(baro::expect_eps(op, eps));
  const int64_t m = dims.m, hd = dims.hd, S = dims.S, Hkv = dims.Hkv, H = dims.H, R2 = dims.R2;
  BARO_CHECK(S < (int64_t{1} << 31) && H <= 65535, op,
             "cache length " << S << " or q heads " << H << " too large for the GPU kernel");

  baro_gpu::AttentionArgs a;
  a.qkv = qkv.typed_data();
  a.q_norm = q_norm.typed_data();
  a.k_norm = k_norm.typed_data();
  a.cos = cos.typed_data();
  a.sin = sin.typed_data();
  a.k_cache = k_out->typed_data();
  a.v_cache = v_out->typed_data();
  a.pos = pos_buf.typed_data();
  a.n_valid = n_valid_buf.typed_data();
  a.out = o->typed_data();
  a.m = m;
  a.S = S;
  a.H = static_cast<int>(H);
  a.Hkv = static_cast<int>(Hkv);
  a.hd = static_cast<int>(hd);
  a.R2 = static_cast<int>(R2);
  a.eps = eps;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const char* why = baro_gpu::attention_unsupported(a);
  BARO_CHECK(why[0] == '\0', op, why << " (head_dim=" << hd << ", H=" << H << ", Hkv=" << Hkv << ")");

  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::copy_if_not_aliased_async(k_cache, k_out, stream));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::copy_if_not_aliased_async(v_cache, v_out, stream));
  void* scratch_mem = nullptr;
  if (auto err = baro_gpu::take_scratch(op, baro_gpu::ScratchSource{scratch, given},
                                        baro_gpu::attention_scratch_bytes(a), &scratch_mem);
      err.failure())
    return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_attention(a, scratch_mem, stream));
  return ffi::Error::Success();
}

ffi::Error AttentionGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::F32> qkv,
                            ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos,
                            ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::BF16> k_cache,
                            ffi::Buffer<ffi::BF16> v_cache, ffi::Buffer<ffi::S32> pos_buf,
                            ffi::Buffer<ffi::S32> n_valid_buf, float eps, ffi::ResultBuffer<ffi::BF16> o,
                            ffi::ResultBuffer<ffi::BF16> k_out, ffi::ResultBuffer<ffi::BF16> v_out) {
  return attention_common("baro_attention", stream, &scratch, nullptr, qkv, q_norm, k_norm, cos, sin, k_cache,
                          v_cache, pos_buf, n_valid_buf, eps, o, k_out, v_out);
}

ffi::Error AttentionSmallGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> q_norm,
                                 ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                                 ffi::Buffer<ffi::BF16> k_cache, ffi::Buffer<ffi::BF16> v_cache,
                                 ffi::Buffer<ffi::S32> pos_buf, ffi::Buffer<ffi::S32> n_valid_buf, float eps,
                                 ffi::ResultBuffer<ffi::BF16> o, ffi::ResultBuffer<ffi::BF16> k_out,
                                 ffi::ResultBuffer<ffi::BF16> v_out, ffi::ResultBuffer<ffi::U8> scratch) {
  return attention_common("baro_attention_small", stream, nullptr, &scratch, qkv, q_norm, k_norm, cos, sin,
                          k_cache, v_cache, pos_buf, n_valid_buf, eps, o, k_out, v_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionGpu, baro::KnobChecked<AttentionGpuImpl>::Call,
                              BARO_BIND_ATTENTION_ARGS(ffi::Ffi::Bind()
                                                           .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                                           .Ctx<ffi::ScratchAllocator>()));  // split partials (m <= 16)

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionSmallGpu, baro::KnobChecked<AttentionSmallGpuImpl>::Call,
                              BARO_BIND_SCRATCH(BARO_BIND_ATTENTION_ARGS(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>())),  // split partials
                              {ffi::Traits::kCmdBufferCompatible});
