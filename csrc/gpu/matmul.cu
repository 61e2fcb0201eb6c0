// baro_matmul (GPU): y[m,N] f32 = x[m,K] bf16 . w[N,K]^T bf16, plus the GEMM
// launcher shared with moe.cu. Order: see gemm.cuh / dot.cuh.
#include <cstdint>

#include "contract.h"
#include "ffi_gpu.h"
#include "gemm.cuh"
#include "launch.h"

namespace baro_gpu {

// Block shapes. Both walk K identically per output element (dot.cuh), so the
// choice never changes bits; it only trades padding waste against reuse.
// Small: BK = 256 so a decode GEMM (latency-bound) needs few K stages.
using GemmSmall = GemmShape<1, 1, 1, 4, 256>;  // 16 x 32, 4 warps (decode, small groups)
using GemmLarge = GemmShape<2, 4, 2, 2, 64>;   // 64 x 64, 4 warps (prefill)

int gemm_bm(GemmConfig cfg) { return cfg == GemmConfig::kSmall ? GemmSmall::BM : GemmLarge::BM; }

GemmConfig gemm_pick(int64_t m) { return m <= 16 ? GemmConfig::kSmall : GemmConfig::kLarge; }

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

gpuError_t launch_gemm(GemmParams p, GemmConfig cfg, int64_t row_slots, gpuStream_t stream) {
  if (row_slots <= 0 || p.N <= 0) return gpuSuccess;  // nothing to compute
  p.vec = (p.K % 8 == 0 && p.lda % 8 == 0 && p.ldw % 8 == 0 && p.w_group_stride % 8 == 0 &&
           aligned16(p.A) && aligned16(p.W))
              ? 1
              : 0;
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

gpuError_t launch_matmul(const uint16_t* x, const uint16_t* w, float* y, int64_t m, int64_t N,
                         int64_t K, gpuStream_t stream) {
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
  const GemmConfig cfg = gemm_pick(m);
  const int bm = gemm_bm(cfg);
  return launch_gemm(p, cfg, (m + bm - 1) / bm, stream);
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/results as BaroMatmulCpu, see BUILD.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error MatmulGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  const char* op = "baro_matmul";
  baro::MatmulDims dims;
  if (auto err = baro::check_matmul(x, w, *y, dims); err.failure()) return err;
  const int64_t m = dims.m, K = dims.K, N = dims.N;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_matmul(x.typed_data(), w.typed_data(),
                                                    y->typed_data(), m, N, K, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMatmulGpu, MatmulGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});
