// baro_rmsnorm, baro_gated_norm (GPU). One warp per row (per (row, head) for
// gated_norm); the sum of squares uses common.cuh's fixed lane order and
// butterfly, so a row's bits never depend on m or on its neighbours.
#include <cstdint>

#include "contract.h"
#include "common.cuh"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {

constexpr int kNormWarps = 4;  // rows per block

// y = bf16((x * r) * (1 + w)), r = 1/sqrt(ss/D + eps)
__global__ void __launch_bounds__(kNormWarps * BARO_WARP)
    rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                   uint16_t* __restrict__ y, int64_t m, int D, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp_id();
  if (row >= m) return;
  const float* xr = x + row * D;
  const float r = inv_rms(warp_sumsq(xr, D), static_cast<float>(D), eps);
  uint16_t* yr = y + row * D;
  for (int d = lane_id(); d < D; d += BARO_WARP) yr[d] = f32_to_bf16((xr[d] * r) * (1.0f + w[d]));
}

// per (row, head): y = bf16(((o * r) * w) * silu(z)), r = 1/sqrt(ss/dv + eps)
__global__ void __launch_bounds__(kNormWarps * BARO_WARP)
    gated_norm_kernel(const float* __restrict__ o, const float* __restrict__ z,
                      const float* __restrict__ w, uint16_t* __restrict__ y, int64_t rows, int dv,
                      float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp_id();
  if (row >= rows) return;
  const float* orow = o + row * dv;
  const float* zrow = z + row * dv;
  const float r = inv_rms(warp_sumsq(orow, dv), static_cast<float>(dv), eps);
  uint16_t* yr = y + row * dv;
  for (int d = lane_id(); d < dv; d += BARO_WARP)
    yr[d] = f32_to_bf16(((orow[d] * r) * w[d]) * siluf_(zrow[d]));
}

static unsigned norm_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kNormWarps - 1) / kNormWarps);
}

gpuError_t launch_rmsnorm(const float* x, const float* w, uint16_t* y, int64_t m, int64_t D,
                          float eps, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (m <= 0 || D <= 0) return gpuSuccess;
  if (D > 0x7fffffffLL || (m + kNormWarps - 1) / kNormWarps > 0x7fffffffLL)
    return gpuErrorInvalidValue;
  rmsnorm_kernel<<<norm_blocks(m), kNormWarps * BARO_WARP, 0, stream>>>(x, w, y, m,
                                                                          static_cast<int>(D), eps);
  return gpuGetLastError();
}

gpuError_t launch_gated_norm(const float* o, const float* z, const float* w, uint16_t* y,
                             int64_t rows, int64_t dv, float eps, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (rows <= 0 || dv <= 0) return gpuSuccess;
  if (dv > 0x7fffffffLL || (rows + kNormWarps - 1) / kNormWarps > 0x7fffffffLL)
    return gpuErrorInvalidValue;
  gated_norm_kernel<<<norm_blocks(rows), kNormWarps * BARO_WARP, 0, stream>>>(
      o, z, w, y, rows, static_cast<int>(dv), eps);
  return gpuGetLastError();
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handlers (same operands/attrs/results as the CPU ones, see BUILD.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error RmsnormGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          float eps, ffi::ResultBuffer<ffi::BF16> y) {
  const char* op = "baro_rmsnorm";
  baro::RmsnormDims dims;
  if (auto err = baro::check_rmsnorm(x, w, *y, dims); err.failure()) return err;
  const int64_t m = dims.m, D = dims.D;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_rmsnorm(x.typed_data(), w.typed_data(),
                                                     y->typed_data(), m, D, eps, stream));
  return ffi::Error::Success();
}

ffi::Error GatedNormGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> z,
                            ffi::Buffer<ffi::F32> w, float eps, ffi::ResultBuffer<ffi::BF16> y) {
  const char* op = "baro_gated_norm";
  baro::GatedNormDims dims;
  if (auto err = baro::check_gated_norm(o, z, w, *y, dims); err.failure()) return err;
  const int64_t m = dims.m, nv = dims.nv, dv = dims.dv;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_gated_norm(o.typed_data(), z.typed_data(),
                                                        w.typed_data(), y->typed_data(), m * nv,
                                                        dv, eps, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroRmsnormGpu, RmsnormGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroGatedNormGpu, GatedNormGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // z
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});
