// baro_jax: the shape contract of the FFI targets (BUILD.md, "FFI contract"),
// checked by one function per target that the CPU and the GPU handlers both
// call, so the two platforms accept and reject exactly the same calls with the
// same messages. Each check also returns the sizes the kernels need.
#pragma once

#include <cstdint>

#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace baro {

struct MatmulDims {
  int64_t m, K, N;
};

inline ::xla::ffi::Error check_matmul(const ::xla::ffi::Buffer<::xla::ffi::BF16>& x,
                                      const ::xla::ffi::Buffer<::xla::ffi::BF16>& w,
                                      const ::xla::ffi::Buffer<::xla::ffi::F32>& y, MatmulDims& d) {
  const char* op = "baro_matmul";
  BARO_RETURN_IF(expect_rank(op, "x", x, 2));
  BARO_RETURN_IF(expect_rank(op, "w", w, 2));
  d.m = x.dimensions()[0];
  d.K = x.dimensions()[1];
  d.N = w.dimensions()[0];
  BARO_CHECK(w.dimensions()[1] == d.K, op,
             "w must have shape [N, K] with K = x.shape[1] = " << d.K << ", got "
                 << dims_str(w.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "y (result)", y, {d.m, d.N}));
  return ::xla::ffi::Error::Success();
}

struct DeltaDims {
  int64_t m, C, nv, dk, dv, nk;
};

inline ::xla::ffi::Error check_delta(const ::xla::ffi::Buffer<::xla::ffi::F32>& y,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& b,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& a,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& A_log,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& dt_bias,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& state,
                                     const ::xla::ffi::Buffer<::xla::ffi::S32>& n_valid,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& o,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& state_out,
                                     DeltaDims& d) {
  const char* op = "baro_delta";
  BARO_RETURN_IF(expect_rank(op, "y", y, 2));
  BARO_RETURN_IF(expect_rank(op, "state", state, 3));
  d.m = y.dimensions()[0];
  d.C = y.dimensions()[1];
  d.nv = state.dimensions()[0];
  d.dk = state.dimensions()[1];
  d.dv = state.dimensions()[2];
  BARO_CHECK(d.nv > 0 && d.dk > 0 && d.dv > 0, op,
             "state must have non-empty shape [nv, dk, dv], got " << dims_str(state.dimensions()));
  BARO_CHECK(d.C > d.nv * d.dv && (d.C - d.nv * d.dv) % (2 * d.dk) == 0, op,
             "y width " << d.C << " must be 2*nk*dk + nv*dv with nv=" << d.nv << ", dk=" << d.dk
                        << ", dv=" << d.dv << " (from state)");
  d.nk = (d.C - d.nv * d.dv) / (2 * d.dk);
  BARO_CHECK(d.nv % d.nk == 0, op,
             "nv=" << d.nv << " value heads must be a multiple of nk=" << d.nk << " key heads");
  BARO_RETURN_IF(expect_shape(op, "b", b, {d.m, d.nv}));
  BARO_RETURN_IF(expect_shape(op, "a", a, {d.m, d.nv}));
  BARO_RETURN_IF(expect_shape(op, "A_log", A_log, {d.nv}));
  BARO_RETURN_IF(expect_shape(op, "dt_bias", dt_bias, {d.nv}));
  BARO_RETURN_IF(expect_shape(op, "n_valid", n_valid, {}));
  BARO_RETURN_IF(expect_shape(op, "o (result)", o, {d.m, d.nv, d.dv}));
  BARO_RETURN_IF(expect_shape(op, "state (result)", state_out, {d.nv, d.dk, d.dv}));
  return ::xla::ffi::Error::Success();
}

}  // namespace baro
