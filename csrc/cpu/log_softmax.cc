// baro_log_softmax (CPU): out[r, j] = (x[r, j] - max_r) - log(sum_r), per row, in an order
// fixed by V alone (docs/NUMERICS.md "log_softmax"): max_r over j ascending, then
// sum_r = sum of exp(x - max_r) as one fp32 chain from +0, j ascending. A row's bytes do not
// depend on m or on the other rows. Built with -ffp-contract=off -fno-fast-math (CMakeLists.txt).
#include <cmath>
#include <limits>

#include "contract_rows.h"
#include "dot.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

// The row's max, j ascending. fmax drops NaN operands, so a NaN logit reaches the output through
// the sum (exp(NaN) = NaN) instead of through the max: the row becomes NaN either way.
inline float row_max(const float* x, int64_t V) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < V; ++j) mx = std::fmax(mx, x[j]);
  return mx;
}

// sum_j exp(x_j - mx): one accumulator from +0, j ascending, no fma (there is no product).
inline float row_sum_exp(const float* x, int64_t V, float mx) {
  float s = 0.0f;
  for (int64_t j = 0; j < V; ++j) s = s + std::exp(x[j] - mx);
  return s;
}

ffi::Error LogSoftmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  baro::LogSoftmaxDims d;
  if (auto err = baro::check_log_softmax(x, *out, d); err.failure()) return err;
  const int64_t V = d.V;
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  baro::parallel_for(d.m, 4.0 * V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * V;
      float* orow = op + r * V;
      const float mx = row_max(xr, V);
      const float ls = std::log(row_sum_exp(xr, V, mx));
      for (int64_t j = 0; j < V; ++j) orow[j] = (xr[j] - mx) - ls;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroLogSoftmaxCpu, LogSoftmaxImpl, BARO_BIND_LOG_SOFTMAX_ARGS(ffi::Ffi::Bind()));
