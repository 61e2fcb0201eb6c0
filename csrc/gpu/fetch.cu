// baro_fetch_experts on the GPU: pool[slot] = store[expert] for the pairs of this run's ring
// entry (csrc/common/fetch_ring.h) as copy-engine copies on XLA's stream, the pools updated in
// place (aliased). Why not XLA: a dynamic-slice of a pinned_host operand at a device-side index
// is XLA's async dynamic slicing, a fusion kernel whose SMs read over the host link; the copy
// engines do it without SMs: on the H200 the cache path's decode went 86.8 -> 79.5 ms per token
// with them at 856b132 (benchmarks/results/decode_profile_tier_cache_dma_h200.json). The copies
// need the addresses on the host, hence the ring. The handler declares no command-buffer trait: a captured
// run would replay one entry's copies forever.
#include "fetch_ring.h"
#include "ffi_gpu.h"
#include "host_store.h"

namespace {

ffi::Error FetchExpertsGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> pool_gu, ffi::Buffer<ffi::BF16> pool_dn,
                               int64_t ring, ffi::ResultBuffer<ffi::BF16> out_gu,
                               ffi::ResultBuffer<ffi::BF16> out_dn) {
  const char* op = "baro_fetch_experts";
  baro::FetchPlan p;
  if (auto err = baro::read_fetch_ring(ring, pool_gu, pool_dn, p); err.failure()) return err;
  const uint16_t *gu_src = nullptr, *dn_src = nullptr;
  if (auto err = host_store_pointer(op, "the store's gate_up", reinterpret_cast<int64_t>(p.gate_up), stream, &gu_src);
      err.failure())
    return err;
  if (auto err = host_store_pointer(op, "the store's down", reinterpret_cast<int64_t>(p.down), stream, &dn_src);
      err.failure())
    return err;
  auto* gu = reinterpret_cast<uint8_t*>(out_gu->typed_data());
  auto* dn = reinterpret_cast<uint8_t*>(out_dn->typed_data());
  if (gu != reinterpret_cast<const uint8_t*>(pool_gu.typed_data()))  // not aliased: start from the operand
    BARO_GPU_CHECK_LAUNCH(op, gpuMemcpyAsync(gu, pool_gu.typed_data(), p.S * p.gu_bytes, gpuMemcpyDeviceToDevice,
                                             stream));
  if (dn != reinterpret_cast<const uint8_t*>(pool_dn.typed_data()))
    BARO_GPU_CHECK_LAUNCH(op, gpuMemcpyAsync(dn, pool_dn.typed_data(), p.S * p.dn_bytes, gpuMemcpyDeviceToDevice,
                                             stream));
  // the host addresses (pinned): the copy engines read them; cudaMemcpyDefault lets the
  // driver take either kind the checked pointer is
  const auto* gu_host = reinterpret_cast<const uint8_t*>(p.gate_up);
  const auto* dn_host = reinterpret_cast<const uint8_t*>(p.down);
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t e = p.pairs[2 * i], s = p.pairs[2 * i + 1];
    BARO_GPU_CHECK_LAUNCH(op, gpuMemcpyAsync(gu + s * p.gu_bytes, gu_host + e * p.gu_bytes, p.gu_bytes,
                                             gpuMemcpyDefault, stream));
    BARO_GPU_CHECK_LAUNCH(op, gpuMemcpyAsync(dn + s * p.dn_bytes, dn_host + e * p.dn_bytes, p.dn_bytes,
                                             gpuMemcpyDefault, stream));
  }
  p.consumed->fetch_add(1, std::memory_order_release);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroFetchExpertsGpu, baro::KnobChecked<FetchExpertsGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // pool_gu [S, 2I, D]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // pool_dn [S, D, I]
                                  .Attr<int64_t>("ring")          // address of the FetchRing
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // pool_gu, updated (aliased)
                                  .Ret<ffi::Buffer<ffi::BF16>>());
