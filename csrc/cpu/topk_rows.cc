// baro_topk_rows (CPU): each row's k largest logits by the selection key of contract_rows.h (the IEEE
// total order lax.top_k uses), largest first, equal bit patterns by lower id. A selection, no
// arithmetic: the result is defined by the row alone, so it is the same on every platform and in
// every batch (the GPU kernel gives these bytes; tests/test_kernels_topk.py).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "contract_rows.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error TopkRowsImpl(ffi::Buffer<ffi::F32> x, int32_t k, ffi::ResultBuffer<ffi::F32> vals,
                        ffi::ResultBuffer<ffi::S32> ids) {
  baro::TopkRowsDims d;
  if (auto err = baro::check_topk_rows(x, k, *vals, *ids, d); err.failure()) return err;
  const int64_t V = d.V, K = d.k;
  const float* xp = x.typed_data();
  float* vp = vals->typed_data();
  int32_t* ip = ids->typed_data();
  baro::parallel_for(d.m, 8.0 * V, [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> key(static_cast<size_t>(V));
    std::vector<int32_t> idx(static_cast<size_t>(V));
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * V;
      for (int64_t j = 0; j < V; ++j) {
        uint32_t b;
        std::memcpy(&b, xr + j, 4);
        key[j] = baro::topk_key(b);
      }
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), [&](int32_t a, int32_t b) {
        return key[a] != key[b] ? key[a] > key[b] : a < b;
      });
      for (int64_t i = 0; i < K; ++i) {
        vp[r * K + i] = xr[idx[i]];
        ip[r * K + i] = idx[i];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroTopkRowsCpu, TopkRowsImpl, BARO_BIND_TOPK_ROWS_ARGS(ffi::Ffi::Bind()));
