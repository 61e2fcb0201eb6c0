// baro_conv, baro_delta (GPU): Gated DeltaNet causal conv (window 4, SiLU)
// and the gated delta-rule recurrence with fp32 state.
//
// conv: one thread per channel walks the m rows in order with the window in
//   registers; y[t,c] = silu(fma chain over the 4 taps, j ascending).
// delta: the state columns S[:, c] are independent (kv[c], delta[c], the
//   update and o[c] only touch column c), so one thread owns one column of
//   one value head, keeps it in registers (DK floats) and walks the valid rows
//   in order; every reduction over the key dimension is a sequential fmaf
//   chain r = 0..DK-1 in that thread. The per-row q/k L2 norms are computed
//   once per block by one warp each (fixed lane order + butterfly), identical
//   code for every block, row and m. One launch for all m rows.
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "contract.h"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {

constexpr int kConvThreads = 256;
constexpr int kConvK = 4;  // taps; the window holds kConvK - 1 rows

BARO_DEV int64_t clamp_rows(const int32_t* p, int64_t m) {
  int64_t v = *p;
  return v < 0 ? 0 : (v > m ? m : v);
}

__global__ void __launch_bounds__(kConvThreads)
    conv_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                const uint16_t* win_in, uint16_t* win_out, const int32_t* __restrict__ n_valid,
                float* __restrict__ y, int64_t m, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t nvld = clamp_rows(n_valid, m);
  const float w0 = bf16_to_f32(w[c * kConvK + 0]);
  const float w1 = bf16_to_f32(w[c * kConvK + 1]);
  const float w2 = bf16_to_f32(w[c * kConvK + 2]);
  const float w3 = bf16_to_f32(w[c * kConvK + 3]);
  // u = [window (3 rows); x]; the new window is u[nvld .. nvld+2]. Read it
  // (and the old window) before anything is written: win_in may be win_out.
  auto u_at = [&](int64_t q) -> uint16_t {
    return q < kConvK - 1 ? win_in[q * C + c] : x[(q - (kConvK - 1)) * C + c];
  };
  const uint16_t nw0 = u_at(nvld), nw1 = u_at(nvld + 1), nw2 = u_at(nvld + 2);
  uint16_t u0 = win_in[0 * C + c], u1 = win_in[1 * C + c], u2 = win_in[2 * C + c];
  for (int64_t t = 0; t < m; ++t) {
    const uint16_t u3 = x[t * C + c];
    float acc = 0.0f;
    acc = fmaf(w0, bf16_to_f32(u0), acc);
    acc = fmaf(w1, bf16_to_f32(u1), acc);
    acc = fmaf(w2, bf16_to_f32(u2), acc);
    acc = fmaf(w3, bf16_to_f32(u3), acc);
    y[t * C + c] = siluf_(acc);
    u0 = u1;
    u1 = u2;
    u2 = u3;
  }
  win_out[0 * C + c] = nw0;
  win_out[1 * C + c] = nw1;
  win_out[2 * C + c] = nw2;
}

gpuError_t launch_conv(const uint16_t* x, const uint16_t* w, const uint16_t* win_in,
                       uint16_t* win_out, const int32_t* n_valid, float* y, int64_t m,
                       int64_t C, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (C <= 0) return gpuSuccess;
  const int64_t blocks = (C + kConvThreads - 1) / kConvThreads;
  if (blocks > 0x7fffffffLL) return gpuErrorInvalidValue;
  conv_kernel<<<static_cast<unsigned>(blocks), kConvThreads, 0, stream>>>(x, w, win_in, win_out,
                                                                          n_valid, y, m, C);
  return gpuGetLastError();
}

// ---- delta rule ----
constexpr int kDeltaCols = 64;  // state columns (threads) per block; 2 warps

template <int DK>
__global__ void __launch_bounds__(kDeltaCols) delta_kernel(DeltaArgs a) {
  static_assert(kDeltaCols == 2 * BARO_WARP, "warp 0: q norm, warp 1: k norm");
  static_assert(kConvK == 4, "conv_kernel is written for 4 taps");
  __shared__ float qn[DK];
  __shared__ float kn[DK];
  __shared__ float gates[2];  // exp(g), beta

  const int j = blockIdx.x;  // value head
  const int c = static_cast<int>(blockIdx.y) * kDeltaCols + static_cast<int>(threadIdx.x);
  const bool has = c < a.dv;
  const int nk = a.nk, nv = a.nv, dv = a.dv;
  const int kh = j / (nv / nk);
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * dv;
  const int64_t m = a.m;
  const int64_t nvld = clamp_rows(a.n_valid, m);
  const int warp = warp_id(), lane = lane_id();

  float s[DK];
  const float* Sin = a.state_in + static_cast<int64_t>(j) * DK * dv;
#pragma unroll
  for (int r = 0; r < DK; ++r) s[r] = has ? Sin[static_cast<int64_t>(r) * dv + c] : 0.0f;

  const float A_log = a.A_log[j], dt_bias = a.dt_bias[j];
  for (int64_t t = 0; t < nvld; ++t) {
    const float* yr = a.y + t * C;
    __syncthreads();  // previous row's qn/kn/gates fully consumed
    if (warp == 0) {
      const float* q = yr + static_cast<int64_t>(kh) * DK;
      const float rq = 1.0f / sqrtf(warp_sumsq(q, DK) + 1e-6f);
      for (int r = lane; r < DK; r += BARO_WARP) qn[r] = (q[r] * rq) * a.scale;
    } else {
      const float* k = yr + static_cast<int64_t>(nk + kh) * DK;
      const float rk = 1.0f / sqrtf(warp_sumsq(k, DK) + 1e-6f);
      for (int r = lane; r < DK; r += BARO_WARP) kn[r] = k[r] * rk;
      if (lane == 0) {
        const float beta = sigmoidf_(a.b[t * nv + j]);
        const float g = -expf(A_log) * softplusf_(a.a[t * nv + j] + dt_bias);
        gates[0] = expf(g);
        gates[1] = beta;
      }
    }
    __syncthreads();
    if (has) {
      const float e = gates[0], beta = gates[1];
      float kv = 0.0f;
#pragma unroll
      for (int r = 0; r < DK; ++r) {
        s[r] = s[r] * e;
        kv = fmaf(s[r], kn[r], kv);
      }
      const float v = yr[static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(j) * dv + c];
      const float d = (v - kv) * beta;
      float ov = 0.0f;
#pragma unroll
      for (int r = 0; r < DK; ++r) {
        s[r] = fmaf(kn[r], d, s[r]);
        ov = fmaf(s[r], qn[r], ov);
      }
      a.o[(t * nv + j) * dv + c] = ov;
    }
  }
  if (has) {
    for (int64_t t = nvld; t < m; ++t) a.o[(t * nv + j) * dv + c] = 0.0f;  // padded rows
    float* Sout = a.state_out + static_cast<int64_t>(j) * DK * dv;
#pragma unroll
    for (int r = 0; r < DK; ++r) Sout[static_cast<int64_t>(r) * dv + c] = s[r];
  }
}

bool delta_supported_dk(int dk) { return dk == 16 || dk == 32 || dk == 64 || dk == 128; }

gpuError_t launch_delta(const DeltaArgs& a, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.nv <= 0 || a.dv <= 0) return gpuSuccess;
  if (!delta_supported_dk(a.dk) || a.nk <= 0 || a.nv % a.nk != 0) return gpuErrorInvalidValue;
  const int64_t col_blocks = (a.dv + kDeltaCols - 1) / kDeltaCols;
  if (col_blocks > 65535) return gpuErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(a.nv), static_cast<unsigned>(col_blocks));
  switch (a.dk) {
    case 16: delta_kernel<16><<<grid, kDeltaCols, 0, stream>>>(a); break;
    case 32: delta_kernel<32><<<grid, kDeltaCols, 0, stream>>>(a); break;
    case 64: delta_kernel<64><<<grid, kDeltaCols, 0, stream>>>(a); break;
    case 128: delta_kernel<128><<<grid, kDeltaCols, 0, stream>>>(a); break;
    default: return gpuErrorInvalidValue;
  }
  return gpuGetLastError();
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handlers (same operands/results as BaroConvCpu / BaroDeltaCpu, BUILD.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error ConvGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf,
                       ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::BF16> window_out) {
  const char* op = "baro_conv";
  constexpr int64_t K = baro_gpu::kConvK;
  BARO_RETURN_IF(baro::expect_rank(op, "x", x, 2));
  const int64_t m = x.dimensions()[0], C = x.dimensions()[1];
  BARO_RETURN_IF(baro::expect_shape(op, "w", w, {C, K}));
  BARO_RETURN_IF(baro::expect_shape(op, "window", window, {K - 1, C}));
  BARO_RETURN_IF(baro::expect_shape(op, "n_valid", n_valid_buf, {}));
  BARO_RETURN_IF(baro::expect_shape(op, "y (result)", *y, {m, C}));
  BARO_RETURN_IF(baro::expect_shape(op, "window (result)", *window_out, {K - 1, C}));
  // Each thread reads its own window column before writing it, so the kernel
  // is correct both aliased (in place) and not aliased (reads input, writes
  // result); no copy needed.
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_conv(x.typed_data(), w.typed_data(),
                                                  window.typed_data(), window_out->typed_data(),
                                                  n_valid_buf.typed_data(), y->typed_data(), m, C,
                                                  stream));
  return ffi::Error::Success();
}

ffi::Error DeltaGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> yb, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> A_log,
                        ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> state,
                        ffi::Buffer<ffi::S32> n_valid_buf, ffi::ResultBuffer<ffi::F32> o,
                        ffi::ResultBuffer<ffi::F32> state_out) {
  const char* op = "baro_delta";
  baro::DeltaDims dims;
  if (auto err = baro::check_delta(yb, b, a, A_log, dt_bias, state, n_valid_buf, *o, *state_out, dims);
      err.failure())
    return err;
  const int64_t m = dims.m, nv = dims.nv, dk = dims.dk, dv = dims.dv, nk = dims.nk;
  BARO_CHECK(baro_gpu::delta_supported_dk(static_cast<int>(dk)), op,
             "the GPU kernel supports key head dims 16, 32, 64, 128; got dk=" << dk);
  BARO_CHECK(nv <= 0x7fffffffLL && dv <= 65535LL * 64 && nk <= 0x7fffffffLL, op,
             "state shape " << baro::dims_str(state.dimensions()) << " too large for the GPU grid");

  baro_gpu::DeltaArgs args;
  args.y = yb.typed_data();
  args.b = b.typed_data();
  args.a = a.typed_data();
  args.A_log = A_log.typed_data();
  args.dt_bias = dt_bias.typed_data();
  // Each thread reads its own state column before writing it: correct aliased
  // or not, so no copy is needed.
  args.state_in = state.typed_data();
  args.state_out = state_out->typed_data();
  args.n_valid = n_valid_buf.typed_data();
  args.o = o->typed_data();
  args.m = m;
  args.nk = static_cast<int>(nk);
  args.nv = static_cast<int>(nv);
  args.dk = static_cast<int>(dk);
  args.dv = static_cast<int>(dv);
  args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_delta(args, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroConvGpu, ConvGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // window
                                  .Arg<ffi::Buffer<ffi::S32>>()    // n_valid
                                  .Ret<ffi::Buffer<ffi::F32>>()    // y
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // window
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaGpu, DeltaGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A_log
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()   // state
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_valid
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // state
                              {ffi::Traits::kCmdBufferCompatible});
