// baro_conv (GPU): Gated DeltaNet causal conv (window 4, SiLU).
//
// y[t,c] = silu(fma chain over the 4 taps, j ascending from 0, starting at 0)
// with u = [window (3 rows); x]. Every output depends only on its own four
// inputs and the weights, so any split over channels and tokens gives the
// same bits as one row per call.
//
// Work split: a thread owns V = 8 consecutive channels (one 16-byte bf16 load
// per row; V = 1 when C or a pointer is not aligned) and kConvRows consecutive
// tokens; it reads the three inputs before its first token from x, or from the
// window for the first token block.
//
// Rows mode (baro_conv_proj, rows = 1): x [P, W] is P sequences' one token each, run as one
// token of P*C channels; channel p*C + c reads x[p, c] and w[c] (a row index and a channel of
// the row: addresses only, the arithmetic is the one-token call's).
//
// Window aliasing (win_out may be win_in): only token block 0 reads the old
// window (t0 - 3 < 0 only there, since kConvRows >= 3), and each thread of it
// reads only its own V columns. The same thread writes the new window of
// those columns (u[n_valid .. n_valid + 2]), after all of its reads, so no
// thread of any block can read a window value that was already replaced.
#include <cstdint>

#include "common.cuh"
#include "contract.h"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {
namespace {

constexpr int kConvThreads = 256;
constexpr int kConvK = 4;      // taps; the window holds kConvK - 1 rows
constexpr int kConvRows = 8;  // tokens per thread
static_assert(kConvRows >= kConvK - 1, "only token block 0 may read the old window");

// V raw bf16 values; for V = 8 packed two per 32-bit word, as loaded.
template <int V>
struct Raw {
  uint16_t h[V];
  BARO_DEV float f(int i) const { return bf16_to_f32(h[i]); }
};
template <>
struct Raw<8> {
  uint4 u;
  BARO_DEV float f(int i) const {
    const uint32_t w = (i >> 1) == 0 ? u.x : (i >> 1) == 1 ? u.y : (i >> 1) == 2 ? u.z : u.w;
    return __uint_as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));  // == bf16_to_f32
  }
};

template <int V>
BARO_DEV Raw<V> load_raw(const uint16_t* p) {
  Raw<V> r;
  if constexpr (V == 8) {
    r.u = *reinterpret_cast<const uint4*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) r.h[i] = p[i];
  }
  return r;
}

// V f32 values rounded to bf16 (baro_conv_proj's input: the projection, rounded as XLA's
// convert does before baro_conv), in the layout load_raw gives.
template <int V>
BARO_DEV Raw<V> load_raw(const float* p) {
  Raw<V> r;
  if constexpr (V == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    auto pack = [](float lo, float hi) {
      return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
    };
    r.u = make_uint4(pack(a.x, a.y), pack(a.z, a.w), pack(b.x, b.y), pack(b.z, b.w));
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) r.h[i] = f32_to_bf16(p[i]);
  }
  return r;
}

template <int V>
BARO_DEV void store_raw(uint16_t* p, const Raw<V>& r) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p) = r.u;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = r.h[i];
  }
}

template <int V>
BARO_DEV void store_f32(float* p, const float (&v)[V]) {
  if constexpr (V == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = v[i];
  }
}

// grid: (token blocks, channel blocks); block: kConvThreads channel groups.
// Two blocks per SM: 16 warps keep enough 16-byte loads in flight.
// TX: uint16_t (bf16 x [m, C]) or float (baro_conv_proj: x [m, ldx], rounded on load).
// C: the call's channels (y and window row stride); Cx: the channels of one x row, C / P in rows
// mode (m = 1), else C. V divides Cx, so a thread's channels are in one row.
template <int V, class TX>
__global__ void __launch_bounds__(kConvThreads, 2)
    conv_kernel(const TX* __restrict__ x, const uint16_t* __restrict__ w,
                const uint16_t* win_in, uint16_t* win_out, const int32_t* __restrict__ n_valid,
                float* __restrict__ y, int64_t m, int64_t C, int64_t ldx, int64_t Cx) {
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * V;
  if (c >= C) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kConvRows;
  const int64_t nv = blockIdx.x == 0 ? static_cast<int64_t>(*n_valid) : 0;  // early: its latency overlaps the rows'
  const int64_t p = c / Cx, cx = c - p * Cx;  // x row (0 unless rows mode) and channel of channel c
  const TX* const xc = x + p * ldx + cx;

  float wf[V][kConvK];  // w[cx + i][j]: the V channels' taps are V*4 contiguous bf16
#pragma unroll
  for (int q = 0; q < kConvK; ++q) {
    const Raw<V> r = load_raw<V>(w + cx * kConvK + q * V);
#pragma unroll
    for (int i = 0; i < V; ++i) wf[(q * V + i) / kConvK][(q * V + i) % kConvK] = r.f(i);
  }
  // u row q = t + 3: the window for q < 3, else x row q - 3.
  auto load_u = [&](int64_t q) -> Raw<V> {
    return q < kConvK - 1 ? load_raw<V>(win_in + q * C + c) : load_raw<V>(xc + (q - (kConvK - 1)) * ldx);
  };
  Raw<V> hist[kConvK - 1];
#pragma unroll
  for (int i = 0; i < kConvK - 1; ++i) hist[i] = load_u(t0 + i);
  // All rows' loads first: independent, so they are in flight together.
  Raw<V> xr[kConvRows];
#pragma unroll
  for (int r = 0; r < kConvRows; ++r)
    if (t0 + r < m) xr[r] = load_raw<V>(xc + (t0 + r) * ldx);
#pragma unroll
  for (int r = 0; r < kConvRows; ++r) {
    if (t0 + r >= m) break;
    float out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float acc = 0.0f;
      acc = fmaf(wf[i][0], hist[0].f(i), acc);
      acc = fmaf(wf[i][1], hist[1].f(i), acc);
      acc = fmaf(wf[i][2], hist[2].f(i), acc);
      acc = fmaf(wf[i][3], xr[r].f(i), acc);
      out[i] = siluf_(acc);
    }
    store_f32<V>(y + (t0 + r) * C + c, out);
    hist[0] = hist[1];
    hist[1] = hist[2];
    hist[2] = xr[r];
  }
  if (blockIdx.x == 0) {
    // New window = u[nvld .. nvld + 2]: read all three, then write.
    const int64_t nvld = nv < 0 ? 0 : (nv > m ? m : nv);
    Raw<V> nw[kConvK - 1];
#pragma unroll
    for (int i = 0; i < kConvK - 1; ++i) nw[i] = load_u(nvld + i);
#pragma unroll
    for (int i = 0; i < kConvK - 1; ++i) store_raw<V>(win_out + i * C + c, nw[i]);
  }
}

template <int V, class TX>
gpuError_t launch_conv_v(const TX* x, const uint16_t* w, const uint16_t* win_in,
                         uint16_t* win_out, const int32_t* n_valid, float* y, int64_t m,
                         int64_t C, int64_t ldx, int64_t Cx, gpuStream_t stream) {
  const int64_t groups = (C + V - 1) / V;
  const int64_t cblocks = (groups + kConvThreads - 1) / kConvThreads;
  // Block row 0 exists even for m = 0: it writes the window.
  const int64_t tblocks = m > 0 ? (m + kConvRows - 1) / kConvRows : 1;
  if (cblocks > 65535 || tblocks > 0x7fffffffLL) return gpuErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tblocks), static_cast<unsigned>(cblocks));
  conv_kernel<V, TX><<<grid, kConvThreads, 0, stream>>>(x, w, win_in, win_out, n_valid, y, m, C, ldx, Cx);
  return gpuGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

gpuError_t launch_conv(const uint16_t* x, const uint16_t* w, const uint16_t* win_in,
                       uint16_t* win_out, const int32_t* n_valid, float* y, int64_t m,
                       int64_t C, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (C <= 0) return gpuSuccess;
  const bool vec = C % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(win_in) &&
                   aligned16(win_out) && aligned16(y);
  return vec ? launch_conv_v<8>(x, w, win_in, win_out, n_valid, y, m, C, C, C, stream)
             : launch_conv_v<1>(x, w, win_in, win_out, n_valid, y, m, C, C, C, stream);
}

gpuError_t launch_conv_proj(const float* x, int64_t ldx, const uint16_t* w, const uint16_t* win_in,
                            uint16_t* win_out, const int32_t* n_valid, float* y, int64_t m, int64_t C,
                            int64_t P, gpuStream_t stream, bool packed) {
  (void)gpuGetLastError();
  if (C <= 0 || P <= 0) return gpuSuccess;
  const bool vec = C % 8 == 0 && ldx % 4 == 0 && aligned16(x) && aligned16(w) && aligned16(win_in) &&
                   aligned16(win_out) && aligned16(y);
  if (packed) {  // the bf16 columns at the start of each row: a row is 2 ldx of them apart
    const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
    return vec ? launch_conv_v<8>(x16, w, win_in, win_out, n_valid, y, m, P * C, 2 * ldx, C, stream)
               : launch_conv_v<1>(x16, w, win_in, win_out, n_valid, y, m, P * C, 2 * ldx, C, stream);
  }
  return vec ? launch_conv_v<8>(x, w, win_in, win_out, n_valid, y, m, P * C, ldx, C, stream)
             : launch_conv_v<1>(x, w, win_in, win_out, n_valid, y, m, P * C, ldx, C, stream);
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/results as BaroConvCpu, docs/FFI.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

// The operands after x and the results, for m tokens of P rows of C channels (both ops; P > 1 in
// rows mode only), and the grid's limit on the call's P*C channels.
ffi::Error check_conv_rest(const char* op, int64_t m, int64_t C, int64_t P, const ffi::Buffer<ffi::BF16>& w,
                           const ffi::Buffer<ffi::BF16>& window, const ffi::Buffer<ffi::S32>& n_valid_buf,
                           const ffi::Buffer<ffi::F32>& y, const ffi::Buffer<ffi::BF16>& window_out) {
  if (auto err = baro::check_conv_rest(op, m, C, P, w, window, n_valid_buf, y, window_out); err.failure()) return err;
  BARO_CHECK(P * C <= 65535LL * 256, op, P * C << " channels, too many for the GPU grid");
  return ffi::Error::Success();
}

ffi::Error ConvGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf, int64_t rows,
                       ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::BF16> window_out) {
  const char* op = "baro_conv";
  BARO_RETURN_IF(baro::expect_no_rows_mode(op, rows));
  BARO_RETURN_IF(baro::expect_rank(op, "x", x, 2));
  const int64_t m = x.dimensions()[0], C = x.dimensions()[1];
  if (auto err = check_conv_rest(op, m, C, 1, w, window, n_valid_buf, *y, *window_out); err.failure()) return err;
  // The kernel reads every old window value before the same thread replaces
  // it (see the top of this file): correct aliased or not, no copy needed.
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_conv(x.typed_data(), w.typed_data(),
                                                  window.typed_data(), window_out->typed_data(),
                                                  n_valid_buf.typed_data(), y->typed_data(), m, C,
                                                  stream));
  return ffi::Error::Success();
}

// baro_conv_proj: x is the GDN projection f32 [m, W]; its first C columns (C from w), rounded
// to bf16 on load, are the conv input (the rounding XLA's convert does before baro_conv). Rows
// mode: x [P, W], one token of each of P sequences, window [3, P*C].
ffi::Error ConvProjGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                           ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf, int64_t rows,
                           int64_t packed, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::BF16> window_out) {
  const char* op = "baro_conv_proj";
  int64_t m = 0, W = 0, C = 0, P = 1;
  if (auto err = baro::check_conv_proj_x(op, x, w, rows, packed, m, W, C, P); err.failure()) return err;
  if (auto err = check_conv_rest(op, m, C, P, w, window, n_valid_buf, *y, *window_out); err.failure()) return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_conv_proj(x.typed_data(), W, w.typed_data(), window.typed_data(),
                                                       window_out->typed_data(), n_valid_buf.typed_data(),
                                                       y->typed_data(), m, C, P, stream, packed != 0));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroConvProjGpu, baro::KnobChecked<ConvProjGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: the projection [m, W]
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // window
                                  .Arg<ffi::Buffer<ffi::S32>>()    // n_valid
                                  .Attr<int64_t>("rows")           // 1: rows mode (x [P, W], window [3, P*C])
                                  .Attr<int64_t>("packed")         // 1: x's C columns packed bf16 (baro_matmul)
                                  .Ret<ffi::Buffer<ffi::F32>>()    // y
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // window
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroConvGpu, baro::KnobChecked<ConvGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // window
                                  .Arg<ffi::Buffer<ffi::S32>>()    // n_valid
                                  .Attr<int64_t>("rows")           // 0 (rows mode is baro_conv_proj's)
                                  .Ret<ffi::Buffer<ffi::F32>>()    // y
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // window
                              {ffi::Traits::kCmdBufferCompatible});
