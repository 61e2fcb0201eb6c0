// baro_matmul (CPU): y[m,N] f32 = x[m,K] bf16 . w[N,K]^T bf16, fixed order.
#include "dot.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error MatmulImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const char* op = "baro_matmul";
  BARO_RETURN_IF(baro::expect_rank(op, "x", x, 2));
  BARO_RETURN_IF(baro::expect_rank(op, "w", w, 2));
  const int64_t m = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t N = w.dimensions()[0];
  BARO_CHECK(w.dimensions()[1] == K, op,
             "w must have shape [N, K] with K = x.shape[1] = " << K << ", got "
                 << baro::dims_str(w.dimensions()));
  BARO_RETURN_IF(baro::expect_shape(op, "y (result)", *y, {m, N}));

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
);
