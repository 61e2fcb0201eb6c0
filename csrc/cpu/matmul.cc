// baro_matmul (CPU): y[m,N] f32 = x[m,K] bf16 . w[N,K]^T bf16, fixed order.
#include "dot.h"
#include "contract.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error MatmulImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  baro::MatmulDims dims;
  if (auto err = baro::check_matmul(x, w, *y, dims); err.failure()) return err;
  const int64_t m = dims.m, K = dims.K, N = dims.N;

  const uint16_t* xp = x.typed_data();
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();
  // Parallel over output columns n (each y[i,n] is one sequential dot).
  baro::parallel_for(N, static_cast<double>(m) * K, [&](int64_t n0, int64_t n1) {
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t* xr = xp + i * K;
      baro::dot_rows(xr, wp + n0 * K, K, n1 - n0, K, yp + i * N + n0);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMatmulCpu, baro::KnobChecked<MatmulImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
);
