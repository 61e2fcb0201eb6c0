// baro_fetch_experts on the CPU: pool[slot] = store[expert] for the pairs of this run's ring
// entry (csrc/common/fetch_ring.h), the pools updated in place (aliased). The CPU's "device"
// memory is host memory, so the copies are memcpy; the GPU handler issues copy-engine copies.
#include <cstring>

#include "fetch_ring.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error FetchExpertsImpl(ffi::Buffer<ffi::BF16> pool_gu, ffi::Buffer<ffi::BF16> pool_dn, int64_t ring,
                            ffi::ResultBuffer<ffi::BF16> out_gu, ffi::ResultBuffer<ffi::BF16> out_dn) {
  baro::FetchPlan p;
  if (auto err = baro::read_fetch_ring(ring, pool_gu, pool_dn, p); err.failure()) return err;
  auto* gu = reinterpret_cast<uint8_t*>(out_gu->typed_data());
  auto* dn = reinterpret_cast<uint8_t*>(out_dn->typed_data());
  // not aliased by XLA: the result starts as the operand
  if (gu != reinterpret_cast<const uint8_t*>(pool_gu.typed_data())) std::memcpy(gu, pool_gu.typed_data(), p.S * p.gu_bytes);
  if (dn != reinterpret_cast<const uint8_t*>(pool_dn.typed_data())) std::memcpy(dn, pool_dn.typed_data(), p.S * p.dn_bytes);
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t e = p.pairs[2 * i], s = p.pairs[2 * i + 1];
    std::memcpy(gu + s * p.gu_bytes, p.gate_up + e * p.gu_bytes, p.gu_bytes);
    std::memcpy(dn + s * p.dn_bytes, p.down + e * p.dn_bytes, p.dn_bytes);
  }
  p.consumed->fetch_add(1, std::memory_order_release);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroFetchExpertsCpu, baro::KnobChecked<FetchExpertsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // pool_gu [S, 2I, D]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // pool_dn [S, D, I]
                                  .Attr<int64_t>("ring")          // address of the FetchRing
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // pool_gu, updated (aliased)
                                  .Ret<ffi::Buffer<ffi::BF16>>());
