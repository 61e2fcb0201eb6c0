// baro_conv, baro_delta (CPU): Gated DeltaNet causal conv (window 4, SiLU)
// and the gated delta-rule recurrence with fp32 state.
#include <vector>

#include "dot.h"
#include "contract.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kConvK = 4;  // kernel width; the window holds kConvK-1 rows

ffi::Error ConvImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf,
                    ffi::ResultBuffer<ffi::F32> y,
                    ffi::ResultBuffer<ffi::BF16> window_out) {
  const char* op = "baro_conv";
  BARO_RETURN_IF(baro::expect_rank(op, "x", x, 2));
  const int64_t m = x.dimensions()[0], C = x.dimensions()[1];
  BARO_RETURN_IF(baro::expect_shape(op, "w", w, {C, kConvK}));
  BARO_RETURN_IF(baro::expect_shape(op, "window", window, {kConvK - 1, C}));
  BARO_RETURN_IF(baro::expect_shape(op, "n_valid", n_valid_buf, {}));
  BARO_RETURN_IF(baro::expect_shape(op, "y (result)", *y, {m, C}));
  BARO_RETURN_IF(baro::expect_shape(op, "window (result)", *window_out, {kConvK - 1, C}));
  const int64_t n_valid = n_valid_buf.typed_data()[0];
  BARO_CHECK(n_valid >= 0 && n_valid <= m, op,
             "n_valid must be in [0, m=" << m << "], got " << n_valid);

  baro::copy_if_not_aliased(window, window_out);
  uint16_t* win = window_out->typed_data();
  const uint16_t* xp = x.typed_data();
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();

  // u[t] for t in [-3, m): window rows then x rows.
  auto u = [&](int64_t t, int64_t c) -> uint16_t {
    return t < 0 ? win[(t + kConvK - 1) * C + c] : xp[t * C + c];
  };
  baro::parallel_for(C, 8.0 * m, [&](int64_t c0, int64_t c1) {
    uint16_t tap[kConvK];
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < kConvK; ++j) tap[j] = u(t - (kConvK - 1) + j, c);
        yp[t * C + c] = baro::silu(baro::dot(wp + c * kConvK, tap, kConvK));
      }
    }
  });
  // New window: last 3 rows of [window; x[:n_valid]] (computed before writing).
  std::vector<uint16_t> nw((kConvK - 1) * C);
  for (int64_t r = 0; r < kConvK - 1; ++r) {
    const int64_t t = n_valid - (kConvK - 1) + r;
    for (int64_t c = 0; c < C; ++c) nw[r * C + c] = u(t, c);
  }
  std::copy(nw.begin(), nw.end(), win);
  return ffi::Error::Success();
}

ffi::Error DeltaImpl(ffi::Buffer<ffi::F32> yb, ffi::Buffer<ffi::F32> b,
                     ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> A_log,
                     ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> state,
                     ffi::Buffer<ffi::S32> n_valid_buf, ffi::ResultBuffer<ffi::F32> o,
                     ffi::ResultBuffer<ffi::F32> state_out) {
  const char* op = "baro_delta";
  baro::DeltaDims dims;
  if (auto err = baro::check_delta(yb, b, a, A_log, dt_bias, state, n_valid_buf, *o, *state_out, dims);
      err.failure())
    return err;
  const int64_t m = dims.m, C = dims.C, nv = dims.nv, dk = dims.dk, dv = dims.dv, nk = dims.nk;
  const int64_t n_valid = n_valid_buf.typed_data()[0];
  BARO_CHECK(n_valid >= 0 && n_valid <= m, op,
             "n_valid must be in [0, m=" << m << "], got " << n_valid);

  baro::copy_if_not_aliased(state, state_out);
  float* S_all = state_out->typed_data();
  float* op_ = o->typed_data();
  const float* yp = yb.typed_data();
  const float* bp = b.typed_data();
  const float* ap = a.typed_data();
  const float* alp = A_log.typed_data();
  const float* dtp = dt_bias.typed_data();
  const int64_t ratio = nv / nk;
  const float scale = baro::inv_sqrt_scale(dk);
  const float l2eps = 1e-6f;

  for (int64_t i = n_valid; i < m; ++i)
    std::fill(op_ + i * nv * dv, op_ + (i + 1) * nv * dv, 0.0f);

  // Value heads are independent; each walks the valid rows in order.
  baro::parallel_for(nv, 4.0 * n_valid * dk * dv, [&](int64_t j0, int64_t j1) {
    std::vector<float> q(dk), k(dk), kv(dv), del(dv);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t kh = j / ratio;
      float* S = S_all + j * dk * dv;
      for (int64_t i = 0; i < n_valid; ++i) {
        const float* yr = yp + i * C;
        const float* qs = yr + kh * dk;
        const float* ks = yr + nk * dk + kh * dk;
        const float* vs = yr + 2 * nk * dk + j * dv;
        const float rq = 1.0f / std::sqrt(baro::dot(qs, qs, dk) + l2eps);
        const float rk = 1.0f / std::sqrt(baro::dot(ks, ks, dk) + l2eps);
        for (int64_t d = 0; d < dk; ++d) {
          q[d] = (qs[d] * rq) * scale;
          k[d] = ks[d] * rk;
        }
        const float beta = baro::sigmoid(bp[i * nv + j]);
        const float g = -std::exp(alp[j]) * baro::softplus(ap[i * nv + j] + dtp[j]);
        const float e = std::exp(g);
        for (int64_t t = 0; t < dk * dv; ++t) S[t] = S[t] * e;
        for (int64_t d = 0; d < dv; ++d) {
          kv[d] = baro::dot(S + d, dv, k.data(), 1, dk);
          del[d] = (vs[d] - kv[d]) * beta;
        }
        for (int64_t r = 0; r < dk; ++r) {
          for (int64_t d = 0; d < dv; ++d) {
            S[r * dv + d] = std::fma(k[r], del[d], S[r * dv + d]);
          }
        }
        float* orow = op_ + i * nv * dv + j * dv;
        for (int64_t d = 0; d < dv; ++d) orow[d] = baro::dot(S + d, dv, q.data(), 1, dk);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroConvCpu, ConvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_valid
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // window
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaCpu, DeltaImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A_log
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // state
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n_valid
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // state
);
