// baro_rmsnorm, baro_add_rmsnorm, baro_gated_norm (GPU). One warp per row (per (row, head) for
// gated_norm); the sum of squares uses common.cuh's fixed lane order and
// butterfly, so a row's bits never depend on m or on its neighbours.
#include <cstdint>

#include "contract.h"
#include "common.cuh"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {

constexpr int kNormWarps = 4;  // rows per block

// y = bf16((x * r) * (1 + w)), r = 1/sqrt(ss/D + eps).
// kPer > 0: D == 32 * kPer exactly (the models' 2048 and 1024): the row is read once into
// registers with every load in flight together, and w is read in batches of 16, so a row
// costs a few memory latencies. A decode row is one warp on one SM, so that latency was the
// whole cost (the runtime-D loop waited on each 4-element step: ~9 us for 2048). kPer = 0:
// any D. Both sum x^2 in warp_sumsq's order (per lane ascending, then the butterfly).
// kAdd (baro_add_rmsnorm): the row normed is s = x + r (fp32 add), written to s_out first; the
// norm is then the same code on s.
template <int kPer, bool kAdd = false>
__global__ void __launch_bounds__(kNormWarps * BARO_WARP)
    rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                   uint16_t* __restrict__ y, int64_t m, int D, float eps,
                   const float* __restrict__ r_in = nullptr, float* __restrict__ s_out = nullptr) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp_id();
  if (row >= m) return;
  const float* xr = x + row * D;
  uint16_t* yr = y + row * D;
  const int lane = lane_id();
  if constexpr (kPer > 0) {
    static_assert(kPer % 16 == 0, "w is read in batches of 16");
    float v[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) v[q] = xr[lane + BARO_WARP * q];
    if constexpr (kAdd) {
      const float* rr = r_in + row * D;
      float* sr = s_out + row * D;
#pragma unroll
      for (int q = 0; q < kPer; ++q) v[q] = v[q] + rr[lane + BARO_WARP * q];
#pragma unroll
      for (int q = 0; q < kPer; ++q) sr[lane + BARO_WARP * q] = v[q];
    }
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < kPer; ++q) acc = fmaf(v[q], v[q], acc);
    const float r = inv_rms(warp_sum(acc), static_cast<float>(D), eps);
#pragma unroll
    for (int q0 = 0; q0 < kPer; q0 += 16) {
      float wv[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) wv[j] = w[lane + BARO_WARP * (q0 + j)];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        yr[lane + BARO_WARP * (q0 + j)] = f32_to_bf16((v[q0 + j] * r) * (1.0f + wv[j]));
    }
  } else {
    if constexpr (kAdd) {  // s first; each lane reads back only the elements it wrote
      const float* rr = r_in + row * D;
      float* sr = s_out + row * D;
      for (int d = lane; d < D; d += BARO_WARP) sr[d] = xr[d] + rr[d];
      xr = sr;
    }
    const float r = inv_rms(warp_sumsq(xr, D), static_cast<float>(D), eps);
    for (int d = lane; d < D; d += BARO_WARP) yr[d] = f32_to_bf16((xr[d] * r) * (1.0f + w[d]));
  }
}

// per (row, head): y = bf16(((o * r) * w) * silu(z)), r = 1/sqrt(ss/dv + eps)
// kPer > 0: dv == 32 * kPer exactly (the models' 128): o, z and w are read once into registers,
// all loads in flight together (the runtime-dv loop waited on its loads element by element:
// ~3 us per decode call). The sum of squares is warp_sumsq's order (per lane ascending, one
// fmaf chain, then the butterfly), so both give the same bits.
template <int kPer>
__global__ void __launch_bounds__(kNormWarps * BARO_WARP)
    gated_norm_kernel(const float* __restrict__ o, const float* __restrict__ z,
                      const float* __restrict__ w, uint16_t* __restrict__ y, int64_t rows, int dv,
                      float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp_id();
  if (row >= rows) return;
  const float* orow = o + row * dv;
  const float* zrow = z + row * dv;
  uint16_t* yr = y + row * dv;
  if constexpr (kPer > 0) {
    const int lane = lane_id();
    float ov[kPer], zv[kPer], wv[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      ov[q] = orow[lane + BARO_WARP * q];
      zv[q] = zrow[lane + BARO_WARP * q];
      wv[q] = w[lane + BARO_WARP * q];
    }
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < kPer; ++q) acc = fmaf(ov[q], ov[q], acc);
    const float r = inv_rms(warp_sum(acc), static_cast<float>(dv), eps);
#pragma unroll
    for (int q = 0; q < kPer; ++q)
      yr[lane + BARO_WARP * q] = f32_to_bf16(((ov[q] * r) * wv[q]) * siluf_(zv[q]));
  } else {
    const float r = inv_rms(warp_sumsq(orow, dv), static_cast<float>(dv), eps);
    for (int d = lane_id(); d < dv; d += BARO_WARP)
      yr[d] = f32_to_bf16(((orow[d] * r) * w[d]) * siluf_(zrow[d]));
  }
}

static unsigned norm_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kNormWarps - 1) / kNormWarps);
}

template <bool kAdd>
static gpuError_t launch_rmsnorm_rows(const float* x, const float* w, uint16_t* y, int64_t m, int64_t D,
                                      float eps, const float* r_in, float* s_out, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (m <= 0 || D <= 0) return gpuSuccess;
  if (D > 0x7fffffffLL || (m + kNormWarps - 1) / kNormWarps > 0x7fffffffLL)
    return gpuErrorInvalidValue;
  const unsigned blocks = norm_blocks(m);
  const int d = static_cast<int>(D);
  constexpr int T = kNormWarps * BARO_WARP;
  // Test knob: BARO_NORM_GENERIC=1 runs every D on the runtime-D kernel (same bits; the
  // kernel tests compare the two at the model widths).
  if (env_is("BARO_NORM_GENERIC", "1"))
    rmsnorm_kernel<0, kAdd><<<blocks, T, 0, stream>>>(x, w, y, m, d, eps, r_in, s_out);
  else if (D == BARO_WARP * 64)
    rmsnorm_kernel<64, kAdd><<<blocks, T, 0, stream>>>(x, w, y, m, d, eps, r_in, s_out);
  else if (D == BARO_WARP * 32)
    rmsnorm_kernel<32, kAdd><<<blocks, T, 0, stream>>>(x, w, y, m, d, eps, r_in, s_out);
  else
    rmsnorm_kernel<0, kAdd><<<blocks, T, 0, stream>>>(x, w, y, m, d, eps, r_in, s_out);
  return gpuGetLastError();
}

gpuError_t launch_rmsnorm(const float* x, const float* w, uint16_t* y, int64_t m, int64_t D,
                          float eps, gpuStream_t stream) {
  return launch_rmsnorm_rows<false>(x, w, y, m, D, eps, nullptr, nullptr, stream);
}

// s = x + r, y = rmsnorm(s)
gpuError_t launch_add_rmsnorm(const float* x, const float* r, const float* w, float* s, uint16_t* y,
                              int64_t m, int64_t D, float eps, gpuStream_t stream) {
  return launch_rmsnorm_rows<true>(x, w, y, m, D, eps, r, s, stream);
}

gpuError_t launch_gated_norm(const float* o, const float* z, const float* w, uint16_t* y,
                             int64_t rows, int64_t dv, float eps, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (rows <= 0 || dv <= 0) return gpuSuccess;
  if (dv > 0x7fffffffLL || (rows + kNormWarps - 1) / kNormWarps > 0x7fffffffLL)
    return gpuErrorInvalidValue;
  const int d = static_cast<int>(dv);
  // BARO_NORM_GENERIC=1: the runtime-dv kernel for every width (same bits; tested)
  if (dv == BARO_WARP * 4 && !env_is("BARO_NORM_GENERIC", "1"))
    gated_norm_kernel<4><<<norm_blocks(rows), kNormWarps * BARO_WARP, 0, stream>>>(o, z, w, y, rows, d, eps);
  else
    gated_norm_kernel<0><<<norm_blocks(rows), kNormWarps * BARO_WARP, 0, stream>>>(o, z, w, y, rows, d, eps);
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

ffi::Error AddRmsnormGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                             ffi::Buffer<ffi::F32> w, float eps, ffi::ResultBuffer<ffi::F32> s,
                             ffi::ResultBuffer<ffi::BF16> h) {
  const char* op = "baro_add_rmsnorm";
  baro::RmsnormDims dims;
  if (auto err = baro::check_add_rmsnorm(x, y, w, *s, *h, dims); err.failure()) return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_add_rmsnorm(x.typed_data(), y.typed_data(), w.typed_data(),
                                                         s->typed_data(), h->typed_data(), dims.m, dims.D,
                                                         eps, stream));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAddRmsnormGpu, AddRmsnormGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()    // s = x + y
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // h = rmsnorm(s)
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
