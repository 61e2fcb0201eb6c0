// baro_topk_rows (GPU, CUDA and HIP): each row's k largest logits, largest first, equal bit patterns
// by lower id, the order of contract_rows.h's topk_key (the IEEE total order lax.top_k uses). A
// selection: the result is defined by the row alone, whatever the block does, so it equals the CPU
// handler's and lax.top_k's bytes and never depends on the other rows.
//
// One block per row, a radix select on the 32-bit keys, 8 bits a pass from the top: pass p counts
// the keys that match the prefix chosen so far in 256 bins (one histogram per warp, then summed;
// on CUDA a warp's lanes with the same bin add once, __match_any_sync: logits share their sign and
// exponent bits, so the first passes land in a few bins), then walks the bins from the top to the
// one holding the k-th largest. After four passes T is the k-th largest key, `need` how many keys
// equal to T are taken (the rest of the k are above T). A last pass collects the keys above T and
// the equal ones: all of them when exactly `need` equal T, else the `need` lowest ids (each thread
// counts the equal keys of its contiguous share of the row, the shares are ranked in thread order).
// The k candidates are then ranked by (key down, id up) and written in that order, the values
// read back from the row (their bits unchanged). About five reads of the row from L2 (a 248k-id
// row is ~1 MB): tens of microseconds a step, the rows in parallel.
#include <cstdint>

#include "contract_rows.h"
#include "ffi_gpu.h"
#include "launch_rows.h"
#include "portability.h"

namespace baro_gpu {

namespace {

constexpr int kTkThreads = 1024;
constexpr int kTkWarps = kTkThreads / BARO_WARP;
constexpr int kTkMaxK = 256;  // custom_calls/topk.py MAX_K_GPU

BARO_DEV uint32_t tk_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
}

// hist[b] += 1 from this lane; lanes of a warp with the same bin add together (CUDA).
BARO_DEV void tk_count(uint32_t* hist, uint32_t bin, bool on) {
#if !BARO_HIP
  const unsigned act = __ballot_sync(0xffffffffu, on);
  if (!on) return;
  const unsigned same = __match_any_sync(act, bin);
  if ((__ffs(same) - 1) == lane_id()) atomicAdd(hist + bin, static_cast<uint32_t>(__popc(same)));
#else
  if (on) atomicAdd(hist + bin, 1u);
#endif
}

__global__ void __launch_bounds__(kTkThreads)
    topk_rows_kernel(const float* __restrict__ x, float* __restrict__ vals, int32_t* __restrict__ ids, int64_t V,
                     int k) {
  __shared__ uint32_t whist[kTkWarps][256];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t s_prefix, s_need, s_eq, s_gt, s_take;
  __shared__ uint32_t cand_key[kTkMaxK];
  __shared__ int32_t cand_id[kTkMaxK];
  __shared__ uint32_t share_eq[kTkThreads];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * V;
  const int t = static_cast<int>(threadIdx.x), w = warp_id();

  uint32_t prefix = 0, mask = 0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = t; i < kTkWarps * 256; i += kTkThreads) (&whist[0][0])[i] = 0u;
    __syncthreads();
    // every lane of a warp runs the same trip count (the match above needs the whole warp)
    for (int64_t j0 = 0; j0 < V; j0 += kTkThreads) {
      const int64_t j = j0 + t;
      const uint32_t key = j < V ? tk_key(xr[j]) : 0u;
      tk_count(whist[w], (key >> shift) & 255u, j < V && (key & mask) == prefix);
    }
    __syncthreads();
    for (int b = t; b < 256; b += kTkThreads) {
      uint32_t c = 0;
      for (int i = 0; i < kTkWarps; ++i) c += whist[i][b];
      hist[b] = c;
    }
    __syncthreads();
    if (t == 0) {
      const uint32_t need = pass == 0 ? static_cast<uint32_t>(k) : s_need;
      uint32_t above = 0;
      int b = 255;
      for (; b > 0 && above + hist[b] < need; --b) above += hist[b];
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      s_need = need - above;  // of the keys in bin b, the largest s_need are taken
      s_eq = hist[b];
    }
    __syncthreads();
    prefix = s_prefix;
    mask |= 255u << shift;
  }
  const uint32_t T = prefix, need = s_need, n_eq = s_eq;
  const uint32_t n_gt = static_cast<uint32_t>(k) - need;
  if (t == 0) {
    s_gt = 0;
    s_take = 0;
  }
  __syncthreads();
  // the keys above T (n_gt of them), and the equal ones when all of them are taken
  for (int64_t j = t; j < V; j += kTkThreads) {
    const uint32_t key = tk_key(xr[j]);
    if (key > T) {
      const uint32_t s = atomicAdd(&s_gt, 1u);
      cand_key[s] = key;
      cand_id[s] = static_cast<int32_t>(j);
    } else if (key == T && n_eq == need) {
      const uint32_t s = n_gt + atomicAdd(&s_take, 1u);
      cand_key[s] = key;
      cand_id[s] = static_cast<int32_t>(j);
    }
  }
  if (n_eq != need) {  // more keys equal T than are taken: the lowest ids, in order
    const int64_t per = (V + kTkThreads - 1) / kTkThreads;
    const int64_t lo = t * per, hi = lo + per < V ? lo + per : V;
    uint32_t c = 0;
    for (int64_t j = lo; j < hi; ++j) c += tk_key(xr[j]) == T ? 1u : 0u;
    share_eq[t] = c;
    __syncthreads();
    uint32_t before = 0;
    for (int i = 0; i < t; ++i) before += share_eq[i];
    for (int64_t j = lo; j < hi && before < need; ++j) {
      if (tk_key(xr[j]) == T) {
        cand_key[n_gt + before] = T;
        cand_id[n_gt + before] = static_cast<int32_t>(j);
        ++before;
      }
    }
  }
  __syncthreads();
  // rank the k candidates by (key down, id up): distinct ids, so the ranks are a permutation
  if (t < k) {
    const uint32_t ki = cand_key[t];
    const int32_t ii = cand_id[t];
    int r = 0;
    for (int j = 0; j < k; ++j) {
      const uint32_t kj = cand_key[j];
      r += (kj > ki || (kj == ki && cand_id[j] < ii)) ? 1 : 0;
    }
    const int64_t o = static_cast<int64_t>(blockIdx.x) * k + r;
    vals[o] = xr[ii];
    ids[o] = ii;
  }
}

}  // namespace

gpuError_t launch_topk_rows(const float* x, float* vals, int32_t* ids, int64_t m, int64_t V, int k,
                            gpuStream_t stream) {
  if (m <= 0) return gpuSuccess;
  if (m > 0x7fffffffLL || k < 1 || k > kTkMaxK || V < k) return gpuErrorInvalidValue;
  topk_rows_kernel<<<static_cast<unsigned>(m), kTkThreads, 0, stream>>>(x, vals, ids, V, k);
  return gpuGetLastError();
}

}  // namespace baro_gpu

namespace {

namespace ffi = xla::ffi;

ffi::Error TopkRowsGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> x, int32_t k, ffi::ResultBuffer<ffi::F32> vals,
                           ffi::ResultBuffer<ffi::S32> ids) {
  const char* op = "baro_topk_rows";
  baro::TopkRowsDims d;
  if (auto err = baro::check_topk_rows(x, k, *vals, *ids, d); err.failure()) return err;
  BARO_CHECK(d.m <= 0x7fffffffLL, op, "m=" << d.m << " rows exceed the GPU grid");
  BARO_CHECK(k <= 256, op, "k=" << k << ": the GPU kernel takes k <= 256");
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_topk_rows(x.typed_data(), vals->typed_data(), ids->typed_data(), d.m,
                                                       d.V, k, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroTopkRowsGpu, TopkRowsGpuImpl,
                              BARO_BIND_TOPK_ROWS_ARGS(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
