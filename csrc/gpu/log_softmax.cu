// baro_log_softmax (GPU, CUDA and HIP): out[r, j] = (x[r, j] - max_r) - log(sum_r), one block of
// kLsmThreads threads per row, whatever m is. Thread t reduces j = t, t + kLsmThreads, ... in
// ascending order (max, then an fp32 chain of expf(x - max) from +0), then the block combines
// the kLsmThreads partials in a fixed tree (t += t + w for w = 128, 64, ..., 1). Both orders
// depend on V only, so a row's bytes do not depend on m or on the other rows. Compiled with
// --fmad=false / -ffp-contract=off (gpu.cmake); no fast-math, so expf / logf are the accurate
// device functions.
#include <cmath>
#include <cstdint>

#include "contract_rows.h"
#include "ffi_gpu.h"
#include "launch_rows.h"
#include "portability.h"

namespace baro_gpu {

namespace {

constexpr int kLsmThreads = 256;

__global__ void __launch_bounds__(kLsmThreads)
    log_softmax_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t V) {
  __shared__ float red[kLsmThreads];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * V;
  float* yr = y + static_cast<int64_t>(blockIdx.x) * V;
  const int t = threadIdx.x;
  // fmaxf drops NaN operands (as the CPU's std::fmax): a NaN logit reaches the row through the sum.
  float mx = -INFINITY;
  for (int64_t j = t; j < V; j += kLsmThreads) mx = fmaxf(mx, xr[j]);
  red[t] = mx;
  __syncthreads();
  for (int w = kLsmThreads / 2; w > 0; w >>= 1) {
    if (t < w) red[t] = fmaxf(red[t], red[t + w]);
    __syncthreads();
  }
  mx = red[0];
  __syncthreads();  // every thread has read the max before red is reused
  float s = 0.0f;
  for (int64_t j = t; j < V; j += kLsmThreads) s = s + expf(xr[j] - mx);
  red[t] = s;
  __syncthreads();
  for (int w = kLsmThreads / 2; w > 0; w >>= 1) {
    if (t < w) red[t] = red[t] + red[t + w];
    __syncthreads();
  }
  const float ls = logf(red[0]);
  for (int64_t j = t; j < V; j += kLsmThreads) yr[j] = (xr[j] - mx) - ls;
}

}  // namespace

gpuError_t launch_log_softmax(const float* x, float* y, int64_t m, int64_t V, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (m <= 0 || V <= 0) return gpuSuccess;
  if (m > 0x7fffffffLL) return gpuErrorInvalidValue;
  log_softmax_kernel<<<static_cast<unsigned>(m), kLsmThreads, 0, stream>>>(x, y, V);
  return gpuGetLastError();
}

}  // namespace baro_gpu

namespace {

namespace ffi = xla::ffi;

ffi::Error LogSoftmaxGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const char* op = "baro_log_softmax";
  baro::LogSoftmaxDims d;
  if (auto err = baro::check_log_softmax(x, *out, d); err.failure()) return err;
  BARO_CHECK(d.m <= 0x7fffffffLL, op, "m=" << d.m << " rows exceed the GPU grid");
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_log_softmax(x.typed_data(), out->typed_data(), d.m, d.V, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroLogSoftmaxGpu, LogSoftmaxGpuImpl,
                              BARO_BIND_LOG_SOFTMAX_ARGS(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
