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

// Few rows (decode: m = 1): one block per row, the same arithmetic as rmsnorm_kernel<kPer>.
// A decode row on one warp is bound by what one warp keeps in flight (a row of 2048 with its
// residual: 36 KB through one warp, ~6 us on the H200); here kRowBlockThreads threads load it
// with 16-byte loads, stage s in shared memory, and warp 0 sums s^2 in rmsnorm_kernel's order
// (lane's elements lane + BARO_WARP * q for q ascending, one fmaf chain, then warp_sum), so a
// row's bits are those of the warp kernel, whatever the m. Needs 16-byte aligned f32 pointers
// (the launcher checks, else the warp kernel); D % (4 * threads) == 0 holds at both widths.
constexpr int kRowBlockThreads = 256;
constexpr int64_t kRowBlockMaxRows = 64;  // past this the warp kernel fills the card anyway

template <int kPer, bool kAdd>
__global__ void __launch_bounds__(kRowBlockThreads)
    rmsnorm_row_block_kernel(const float* __restrict__ x, const float* __restrict__ w,
                             uint16_t* __restrict__ y, float eps, const float* __restrict__ r_in,
                             float* __restrict__ s_out) {
  constexpr int D = BARO_WARP * kPer;
  static_assert(D % (4 * kRowBlockThreads) == 0, "a thread holds whole float4s");
  constexpr int kVec = D / (4 * kRowBlockThreads);
  __shared__ float4 s_row[D / 4];
  __shared__ float s_inv;
  const int64_t row = blockIdx.x;
  const int t = threadIdx.x;
  const float4* x4 = reinterpret_cast<const float4*>(x + row * D);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4 v[kVec], wv[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = x4[t + kRowBlockThreads * j];
  if constexpr (kAdd) {
    const float4* r4 = reinterpret_cast<const float4*>(r_in + row * D);
    float4* s4 = reinterpret_cast<float4*>(s_out + row * D);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float4 r = r4[t + kRowBlockThreads * j];
      v[j].x = v[j].x + r.x;
      v[j].y = v[j].y + r.y;
      v[j].z = v[j].z + r.z;
      v[j].w = v[j].w + r.w;
      s4[t + kRowBlockThreads * j] = v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    wv[j] = w4[t + kRowBlockThreads * j];
    s_row[t + kRowBlockThreads * j] = v[j];
  }
  __syncthreads();
  if (t < BARO_WARP) {
    const float* sr = reinterpret_cast<const float*>(s_row);
    float acc = 0.0f;
#pragma unroll 16
    for (int q = 0; q < kPer; ++q) {
      const float a = sr[t + BARO_WARP * q];
      acc = fmaf(a, a, acc);
    }
    const float r = inv_rms(warp_sum(acc), static_cast<float>(D), eps);
    if (t == 0) s_inv = r;
  }
  __syncthreads();
  const float r = s_inv;
  uint2* y4 = reinterpret_cast<uint2*>(y + row * D);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const uint32_t lo = static_cast<uint32_t>(f32_to_bf16((v[j].x * r) * (1.0f + wv[j].x))) |
                        (static_cast<uint32_t>(f32_to_bf16((v[j].y * r) * (1.0f + wv[j].y))) << 16);
    const uint32_t hi = static_cast<uint32_t>(f32_to_bf16((v[j].z * r) * (1.0f + wv[j].z))) |
                        (static_cast<uint32_t>(f32_to_bf16((v[j].w * r) * (1.0f + wv[j].w))) << 16);
    y4[t + kRowBlockThreads * j] = make_uint2(lo, hi);
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
                      const float* __restrict__ w, uint16_t* __restrict__ y, int64_t rows, int nv, int dv,
                      int64_t z_ld, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp_id();
  if (row >= rows) return;
  const float* orow = o + row * dv;
  const float* zrow = z + (row / nv) * z_ld + (row % nv) * dv;  // z: row i's gates at z[i * z_ld]
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
  const bool generic = baro::knobs::on(baro::knobs::kNormGeneric);
  // Test knob: BARO_NORM_ROW_BLOCK=0 keeps few rows on the warp kernel (same bits; tested).
  const bool row_block = !generic && m <= kRowBlockMaxRows && baro::knobs::on(baro::knobs::kNormRowBlock) &&
                         is_aligned(x, 16) && is_aligned(w, 16) && is_aligned(y, 8) &&
                         (!kAdd || (is_aligned(r_in, 16) && is_aligned(s_out, 16)));
  if (row_block && D == BARO_WARP * 64)
    rmsnorm_row_block_kernel<64, kAdd><<<static_cast<unsigned>(m), kRowBlockThreads, 0, stream>>>(
        x, w, y, eps, r_in, s_out);
  else if (row_block && D == BARO_WARP * 32)
    rmsnorm_row_block_kernel<32, kAdd><<<static_cast<unsigned>(m), kRowBlockThreads, 0, stream>>>(
        x, w, y, eps, r_in, s_out);
  else if (generic)
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
                             int64_t rows, int64_t nv, int64_t dv, int64_t z_ld, float eps,
                             gpuStream_t stream) {
  (void)gpuGetLastError();
  if (rows <= 0 || dv <= 0) return gpuSuccess;
  if (dv > 0x7fffffffLL || nv <= 0 || nv > 0x7fffffffLL || (rows + kNormWarps - 1) / kNormWarps > 0x7fffffffLL)
    return gpuErrorInvalidValue;
  const int d = static_cast<int>(dv), n = static_cast<int>(nv);
  // BARO_NORM_GENERIC=1: the runtime-dv kernel for every width (same bits; tested)
  if (dv == BARO_WARP * 4 && !baro::knobs::on(baro::knobs::kNormGeneric))
    gated_norm_kernel<4><<<norm_blocks(rows), kNormWarps * BARO_WARP, 0, stream>>>(o, z, w, y, rows, n, d, z_ld, eps);
  else
    gated_norm_kernel<0><<<norm_blocks(rows), kNormWarps * BARO_WARP, 0, stream>>>(o, z, w, y, rows, n, d, z_ld, eps);
  return gpuGetLastError();
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handlers (same operands/attrs/results as the CPU ones, see docs/FFI.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error RmsnormGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          float eps, ffi::ResultBuffer<ffi::BF16> y) {
  const char* op = "baro_rmsnorm";
  baro::RmsnormDims dims;
  if (auto err = baro::check_rmsnorm(x, w, *y, dims); err.failure()) return err;
  BARO_RETURN_IF(baro::expect_eps(op, eps));
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
  BARO_RETURN_IF(baro::expect_eps(op, eps));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_add_rmsnorm(x.typed_data(), y.typed_data(), w.typed_data(),
                                                         s->typed_data(), h->typed_data(), dims.m, dims.D,
                                                         eps, stream));
  return ffi::Error::Success();
}

ffi::Error GatedNormGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> z,
                            ffi::Buffer<ffi::F32> w, float eps, int64_t z_col, ffi::ResultBuffer<ffi::BF16> y) {
  const char* op = "baro_gated_norm";
  baro::GatedNormDims dims;
  if (auto err = baro::check_gated_norm(o, z, w, z_col, *y, dims); err.failure()) return err;
  BARO_RETURN_IF(baro::expect_eps(op, eps));
  const int64_t m = dims.m, nv = dims.nv, dv = dims.dv;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_gated_norm(o.typed_data(), z.typed_data() + z_col,
                                                        w.typed_data(), y->typed_data(), m * nv,
                                                        nv, dv, dims.z_ld, eps, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroRmsnormGpu, baro::KnobChecked<RmsnormGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAddRmsnormGpu, baro::KnobChecked<AddRmsnormGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()    // s = x + y
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // h = rmsnorm(s)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroGatedNormGpu, baro::KnobChecked<GatedNormGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // z
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("z_col")  // z's first gate column
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});
