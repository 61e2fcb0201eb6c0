// baro_matmul (CPU): y[m,N] f32 = x[m,K] bf16 . w[N,K]^T bf16, fixed order; the first
// bf16_cols columns rounded to bf16, packed at the start of each row (contract.h).
#include <vector>

#include "dot.h"
#include "contract.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error MatmulImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, int64_t bf16_cols,
                      ffi::ResultBuffer<ffi::F32> y) {
  baro::MatmulDims dims;
  if (auto err = baro::check_matmul(x, w, *y, bf16_cols, dims); err.failure()) return err;
  const int64_t m = dims.m, K = dims.K, N = dims.N;

  const uint16_t* xp = x.typed_data();
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();
  uint16_t* y16 = reinterpret_cast<uint16_t*>(yp);
  // Parallel over output columns n (each y[i,n] is one sequential dot). A packed column's
  // float32 goes to a buffer of the range's own, since the words at the start of the row hold
  // other ranges' packed columns.
  baro::parallel_for(N, static_cast<double>(m) * K, [&](int64_t n0, int64_t n1) {
    const int64_t p1 = n1 < bf16_cols ? n1 : bf16_cols;  // [n0, p1): packed columns of the range
    std::vector<float> packed(p1 > n0 ? p1 - n0 : 0);
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t* xr = xp + i * K;
      if (p1 > n0) {
        baro::dot_rows(xr, wp + n0 * K, K, p1 - n0, K, packed.data());
        for (int64_t n = n0; n < p1; ++n) y16[i * 2 * N + n] = baro::f32_to_bf16(packed[n - n0]);
      }
      const int64_t f0 = p1 > n0 ? p1 : n0;
      if (n1 > f0) baro::dot_rows(xr, wp + f0 * K, K, n1 - f0, K, yp + i * N + f0);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMatmulCpu, baro::KnobChecked<MatmulImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Attr<int64_t>("bf16_cols")     // leading columns packed as bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
);
