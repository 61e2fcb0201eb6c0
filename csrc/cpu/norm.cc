// baro_rmsnorm, baro_add_rmsnorm, baro_gated_norm (CPU).
#include "contract.h"
#include "dot.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

// One row: y = bf16((x * r) * (1 + w)), r = 1/sqrt(dot(x,x)/D + eps).
inline void rmsnorm_row(const float* xr, const float* wp, uint16_t* yr, int64_t D, float eps) {
  const float r = baro::inv_rms(baro::dot(xr, xr, D), static_cast<float>(D), eps);
  for (int64_t d = 0; d < D; ++d) yr[d] = baro::f32_to_bf16((xr[d] * r) * (1.0f + wp[d]));
}

ffi::Error RmsnormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       float eps, ffi::ResultBuffer<ffi::BF16> y) {
  baro::RmsnormDims dims;
  if (auto err = baro::check_rmsnorm(x, w, *y, dims); err.failure()) return err;
  BARO_RETURN_IF(baro::expect_eps("baro_rmsnorm", eps));
  const int64_t m = dims.m, D = dims.D;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  uint16_t* yp = y->typed_data();
  baro::parallel_for(m, 2.0 * D, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) rmsnorm_row(xp + i * D, wp, yp + i * D, D, eps);
  });
  return ffi::Error::Success();
}

// s = x + y (fp32), h = rmsnorm(s): the residual add and the norm after it, one call; h is
// RmsnormImpl's arithmetic on s.
ffi::Error AddRmsnormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> w,
                          float eps, ffi::ResultBuffer<ffi::F32> s, ffi::ResultBuffer<ffi::BF16> h) {
  baro::RmsnormDims dims;
  if (auto err = baro::check_add_rmsnorm(x, y, w, *s, *h, dims); err.failure()) return err;
  BARO_RETURN_IF(baro::expect_eps("baro_add_rmsnorm", eps));
  const int64_t m = dims.m, D = dims.D;
  const float* xp = x.typed_data();
  const float* yp = y.typed_data();
  const float* wp = w.typed_data();
  float* sp = s->typed_data();
  uint16_t* hp = h->typed_data();
  baro::parallel_for(m, 3.0 * D, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* sr = sp + i * D;
      for (int64_t d = 0; d < D; ++d) sr[d] = xp[i * D + d] + yp[i * D + d];
      rmsnorm_row(sr, wp, hp + i * D, D, eps);
    }
  });
  return ffi::Error::Success();
}

// per head: y = bf16(((o * r) * w) * silu(z)), r = 1/sqrt(dot(o,o)/dv + eps)
ffi::Error GatedNormImpl(ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> z,
                         ffi::Buffer<ffi::F32> w, float eps, int64_t z_col,
                         ffi::ResultBuffer<ffi::BF16> y) {
  baro::GatedNormDims dims;
  if (auto err = baro::check_gated_norm(o, z, w, z_col, *y, dims); err.failure()) return err;
  BARO_RETURN_IF(baro::expect_eps("baro_gated_norm", eps));
  const int64_t m = dims.m, nv = dims.nv, dv = dims.dv;
  const float* op_ = o.typed_data();
  const float* zp = z.typed_data() + z_col;
  const int64_t z_ld = dims.z_ld;
  const float* wp = w.typed_data();
  uint16_t* yp = y->typed_data();
  const float fdv = static_cast<float>(dv);
  baro::parallel_for(m * nv, 3.0 * dv, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // r = i * nv + head
      const float* orow = op_ + r * dv;
      const float* zrow = zp + (r / nv) * z_ld + (r % nv) * dv;
      const float rr = baro::inv_rms(baro::dot(orow, orow, dv), fdv, eps);
      for (int64_t d = 0; d < dv; ++d) {
        yp[r * dv + d] =
            baro::f32_to_bf16(((orow[d] * rr) * wp[d]) * baro::silu(zrow[d]));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroRmsnormCpu, baro::KnobChecked<RmsnormImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAddRmsnormCpu, baro::KnobChecked<AddRmsnormImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // s = x + y
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // h = rmsnorm(s)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroGatedNormCpu, baro::KnobChecked<GatedNormImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // z
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("z_col")  // z's first gate column
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y
);
