// baro_log_softmax (GPU, CUDA and HIP): out[r, j] = (x[r, j] - max_r) - log(sum_r), whatever m
// is. Compiled with --fmad=false / -ffp-contract=off (gpu.cmake); no fast-math, so expf / logf
// are the accurate device functions. Two kernels, each with one order that depends on V alone,
// so a row's bytes do not depend on m or on the other rows:
// - sm_90 (a cluster per row): the row is cut into kLsmPieces contiguous pieces of
//   ceil(V / kLsmPieces) entries, one block of kLsmThreads threads each. Thread t of piece p
//   reduces j = p * piece + t, + kLsmThreads, ... in ascending order (the max, then an fp32 chain
//   of expf(x - max) from +0 with the row's max), the block combines its partials in a fixed
//   tree (t += t + w for w = 128, 64, ..., 1), and every block of the cluster reads the
//   kLsmPieces block results from distributed shared memory: the max in any order (fmaxf is
//   exact), the sum in piece order from +0. One row is spread over kLsmPieces SMs: a decode
//   step's logprobs at one row cost what they cost at 64.
// - before sm_90, and on HIP: one block per row, thread t reducing j = t, t + kLsmThreads, ...,
//   then the same tree.
#include <atomic>
#include <cmath>
#include <cstdint>

#include "contract_rows.h"
#include "ffi_gpu.h"
#include "launch_rows.h"
#include "portability.h"

#if !BARO_HIP
#include <cooperative_groups.h>
#endif

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

#if !BARO_HIP
constexpr int kLsmPieces = 8;  // blocks per row: one cluster (the portable cluster size)

// Block-wide fixed tree over red[0..kLsmThreads) (op: fmaxf or +); every thread gets red[0].
template <bool MAX>
__device__ float block_tree(float* red, float v) {
  const int t = threadIdx.x;
  red[t] = v;
  __syncthreads();
  for (int w = kLsmThreads / 2; w > 0; w >>= 1) {
    if (t < w) red[t] = MAX ? fmaxf(red[t], red[t + w]) : red[t] + red[t + w];
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();  // every thread has read red[0] before red is reused
  return r;
}

// Grid (kLsmPieces * m) with clusters of kLsmPieces along x: block x is piece x % kLsmPieces of
// row x / kLsmPieces.
__global__ void __launch_bounds__(kLsmThreads)
    log_softmax_cluster_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t V) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ float red[kLsmThreads];
  __shared__ float part;  // this piece's max, then its sum
  const int p = static_cast<int>(cluster.block_rank());
  const int64_t row = static_cast<int64_t>(blockIdx.x) / kLsmPieces;
  const float* xr = x + row * V;
  float* yr = y + row * V;
  const int64_t piece = (V + kLsmPieces - 1) / kLsmPieces;
  const int64_t j0 = piece * p, j1 = j0 + piece < V ? j0 + piece : V;
  const int t = threadIdx.x;
  float mx = -INFINITY;  // fmaxf drops NaN operands: a NaN logit reaches the row through the sum
  for (int64_t j = j0 + t; j < j1; j += kLsmThreads) mx = fmaxf(mx, xr[j]);
  mx = block_tree<true>(red, mx);
  if (t == 0) part = mx;
  cluster.sync();
  mx = -INFINITY;
  for (int q = 0; q < kLsmPieces; ++q) mx = fmaxf(mx, *cluster.map_shared_rank(&part, q));
  cluster.sync();  // every block has read every max before part is overwritten
  float s = 0.0f;
  for (int64_t j = j0 + t; j < j1; j += kLsmThreads) s = s + expf(xr[j] - mx);
  s = block_tree<false>(red, s);
  if (t == 0) part = s;
  cluster.sync();
  s = 0.0f;
  for (int q = 0; q < kLsmPieces; ++q) s = s + *cluster.map_shared_rank(&part, q);
  cluster.sync();  // no block leaves while another still reads its shared memory
  const float ls = logf(s);
  for (int64_t j = j0 + t; j < j1; j += kLsmThreads) yr[j] = (xr[j] - mx) - ls;
#else
  (void)x, (void)y, (void)V;
  __trap();  // launched only where clusters exist (launch_log_softmax checks)
#endif
}

static bool clusters_available() {
  static std::atomic<int> major[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (dev >= 0 && dev < 64 && major[dev].load(std::memory_order_relaxed) > 0)
    return major[dev].load(std::memory_order_relaxed) >= 9;
  int cc = 0;
  if (cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  if (dev >= 0 && dev < 64) major[dev].store(cc, std::memory_order_relaxed);
  return cc >= 9;
}
#endif

}  // namespace

gpuError_t launch_log_softmax(const float* x, float* y, int64_t m, int64_t V, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (m <= 0 || V <= 0) return gpuSuccess;
  if (m > 0x7fffffffLL) return gpuErrorInvalidValue;
#if !BARO_HIP
  if (clusters_available()) {
    if (m > 0x7fffffffLL / kLsmPieces) return gpuErrorInvalidValue;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(m * kLsmPieces));
    cfg.blockDim = dim3(kLsmThreads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kLsmPieces;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, log_softmax_cluster_kernel, x, y, V);
  }
#endif
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
