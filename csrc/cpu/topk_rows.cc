// baro_topk_rows (CPU): each row's k largest logits by the selection key of contract_rows.h (the IEEE
// total order lax.top_k uses), largest first, equal bit patterns by lower id. A selection, no
// arithmetic: the result is defined by the row alone, so it is the same on every platform and in
// every batch (the GPU kernel gives these bytes; tests/test_kernels_topk.py).
#include <algorithm>
#include <cstring>
#include <utility>
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
  // One pass a row keeping the k best so far in a heap whose front is the worst of them: a later
  // id only enters with a strictly larger key (an equal key with a larger id ranks below), so
  // most of the row costs one comparison. Then the k sorted best first.
  using Entry = std::pair<uint32_t, int32_t>;  // (key, id)
  const auto better = [](const Entry& a, const Entry& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  baro::parallel_for(d.m, 4.0 * V, [&](int64_t r0, int64_t r1) {
    std::vector<Entry> heap;
    heap.reserve(static_cast<size_t>(K));
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * V;
      heap.clear();
      for (int64_t j = 0; j < V; ++j) {
        uint32_t b;
        std::memcpy(&b, xr + j, 4);
        const uint32_t key = baro::topk_key(b);
        if (static_cast<int64_t>(heap.size()) < K) {
          heap.emplace_back(key, static_cast<int32_t>(j));
          std::push_heap(heap.begin(), heap.end(), better);
        } else if (key > heap.front().first) {
          std::pop_heap(heap.begin(), heap.end(), better);
          heap.back() = Entry(key, static_cast<int32_t>(j));
          std::push_heap(heap.begin(), heap.end(), better);
        }
      }
      std::sort(heap.begin(), heap.end(), better);
      for (int64_t i = 0; i < K; ++i) {
        vp[r * K + i] = xr[heap[i].second];
        ip[r * K + i] = heap[i].second;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroTopkRowsCpu, TopkRowsImpl, BARO_BIND_TOPK_ROWS_ARGS(ffi::Ffi::Bind()));
